//! Floating-point spacing: the arithmetic behind `low_precision_underflow`.
//!
//! A format with `p` explicit mantissa bits spaces its values `2^(e−p)` apart in
//! `[2^e, 2^(e+1))`. Just below a power of two the spacing halves. Under
//! round-to-nearest-even an update smaller than half the spacing on its side is lost:
//! bf16 (`p` = 7) at 1.0 has neighbours 1.0078125 and 0.99609375, so an increase of up
//! to 2^-8 ≈ 0.0039 and a decrease of up to 2^-9 ≈ 0.00195 round back to 1.0.

use gradflow_protocol::Dtype;

/// The smallest change a value of magnitude `|value|` can make in `dtype`: half the
/// smaller of its two spacings. An update of at most this rounds away in either
/// direction. `None` for 0 and non-finite values.
pub fn smallest_change(value: f64, dtype: Dtype) -> Option<f64> {
    let magnitude = value.abs();
    if magnitude == 0.0 || !magnitude.is_finite() {
        return None;
    }
    let exponent = magnitude.log2().floor();
    let spacing_above = (exponent - dtype.mantissa_bits() as f64).exp2();
    let at_power_of_two = magnitude == exponent.exp2();
    let spacing_below = if at_power_of_two {
        spacing_above / 2.0
    } else {
        spacing_above
    };
    Some(spacing_below / 2.0)
}

/// "just below 1.0" / "near 0.1": where the weight sits, for texts.
pub fn describe_magnitude(value: f64) -> String {
    let magnitude = value.abs();
    if magnitude > 0.0 && magnitude == magnitude.log2().floor().exp2() {
        format!("just below {}", trim(magnitude))
    } else {
        format!("near {}", trim(magnitude))
    }
}

fn trim(value: f64) -> String {
    let text = format!("{value:.4}");
    let text = text.trim_end_matches('0');
    match text.strip_suffix('.') {
        Some(whole) => format!("{whole}.0"),
        None => text.to_owned(),
    }
}

/// float16's largest finite value: inputs beyond it are inf under fp16 autocast.
pub const F16_MAX: f64 = 65504.0;

/// What a step's `input_absmax` says about a non-finite loss or gradient: a cause and
/// a sentence when the inputs themselves explain it (NaN in them, or values past
/// float16's range), else None.
pub fn input_explanation(input_absmax: Option<f64>) -> Option<(&'static str, String)> {
    let max = input_absmax?;
    if max.is_nan() || max.is_infinite() {
        return Some((
            "input_nonfinite",
            " The model's inputs themselves held NaN or infinite values on these steps: the \
             batch is the cause, not the model."
                .to_owned(),
        ));
    }
    (max >= F16_MAX).then(|| {
        (
            "input_overflow",
            format!(
                " The model's inputs reached {} in absolute value, beyond float16's largest value \
                 65504: under fp16 autocast they become inf in the first layer, so the batch is \
                 the likely cause, not the model. Normalise or clip the inputs, or keep the \
                 first layer in fp32.",
                super::wording::sci(max)
            ),
        )
    })
}

/// A reading for an alert's evidence: the number, or its protocol spelling when it is
/// not finite (JSON has no NaN).
pub fn evidence_number(value: Option<f64>) -> serde_json::Value {
    match value {
        Some(x) if x.is_finite() => serde_json::json!(x),
        Some(x) => serde_json::json!(gradflow_protocol::format_float(x)),
        None => serde_json::Value::Null,
    }
}

/// The one remedy for updates that round away, said by every detector that finds
/// them (norm weights and other weights alike), whatever the device: the update must
/// be applied to a wider copy of the weights, not made larger.
pub const MASTER_WEIGHTS_FIX: &str = "Keep fp32 master weights: store the parameters in \
    float32 and run the forward under autocast (torch.autocast(device_type=x.device.type, \
    dtype=torch.bfloat16), with x an input), so the optimizer applies every update to a \
    float32 copy; or at least keep these weights in float32. For pure low-precision \
    training, use an optimizer with f32 master copies, Kahan summation or stochastic \
    rounding. Raising the learning rate until updates exceed half the dtype's spacing is \
    not a fix: it changes the step of every other parameter too.";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spacings_of_the_issue() {
        // bf16 at 1.0: a decrease of up to 2^-9 is lost.
        assert_eq!(smallest_change(1.0, Dtype::Bf16), Some(2f64.powi(-9)));
        // f16 at 1.0: 2^-11 below, so half of it.
        assert_eq!(smallest_change(1.0, Dtype::F16), Some(2f64.powi(-12)));
        // bf16 near 0.1 moves in steps of 2^-11.
        assert_eq!(smallest_change(0.1, Dtype::Bf16), Some(2f64.powi(-12)));
        assert_eq!(smallest_change(1.5, Dtype::Bf16), Some(2f64.powi(-8)));
        assert_eq!(smallest_change(-1.0, Dtype::F32), Some(2f64.powi(-25)));
        assert_eq!(smallest_change(0.0, Dtype::Bf16), None);
    }

    #[test]
    fn adamw_steps_against_bf16_spacing() {
        // lr 3e-4 at 1.0 rounds away; lr 0.05 does not; lr 3e-4 near 0.1 does not.
        assert!(3e-4 < smallest_change(1.0, Dtype::Bf16).unwrap());
        assert!(0.05 > smallest_change(1.0, Dtype::Bf16).unwrap());
        assert!(3e-4 > smallest_change(0.1, Dtype::Bf16).unwrap());
        assert!(3e-4 > smallest_change(1.0, Dtype::F32).unwrap());
    }

    #[test]
    fn magnitudes_read_naturally() {
        assert_eq!(describe_magnitude(1.0), "just below 1.0");
        assert_eq!(describe_magnitude(0.1), "near 0.1");
    }
}
