//! One stored value: a number, or one of the two states besides a number that must
//! survive storage.
//!
//! Every value is stored as one `f32`, and the two non-number states are NaN payloads
//! that no arithmetic produces:
//!
//! - [`Cell::Absent`]: not reported this step ("not measured");
//! - [`Cell::Null`]: reported as `null` (a module with no gradient tensor);
//! - a real NaN is always stored as the canonical quiet NaN.
//!
//! Values are stored as `f32`: seven significant digits are plenty for norms and
//! losses, and half the bytes of `f64`. Magnitudes outside `f32`'s range saturate to
//! its smallest subnormal or largest finite value rather than to 0 or infinity, so a
//! tiny non-zero gradient never reads back as exactly zero, and a finite value never
//! reads back as infinite.

/// Not reported this step.
pub const ABSENT_BITS: u32 = 0x7FC0_A65E;
/// Reported as `null`.
pub const NULL_BITS: u32 = 0x7FC0_0E11;

/// One stored value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Cell {
    Absent,
    Null,
    Value(f32),
}

impl Cell {
    pub fn from_bits(bits: u32) -> Cell {
        match bits {
            ABSENT_BITS => Cell::Absent,
            NULL_BITS => Cell::Null,
            _ => Cell::Value(f32::from_bits(bits)),
        }
    }

    pub fn to_bits(self) -> u32 {
        match self {
            Cell::Absent => ABSENT_BITS,
            Cell::Null => NULL_BITS,
            Cell::Value(v) => v.to_bits(),
        }
    }

    /// The cell for a wire value: `None` is null, anything else a number.
    pub fn from_wire(value: Option<f64>) -> Cell {
        match value {
            None => Cell::Null,
            Some(v) => Cell::Value(to_stored_f32(v)),
        }
    }
}

/// `f64` → `f32`, saturating instead of flushing to 0 or overflowing to infinity, and
/// canonicalising NaN (so a NaN never collides with the marker payloads).
pub fn to_stored_f32(value: f64) -> f32 {
    if value.is_nan() {
        return f32::NAN;
    }
    if value.is_infinite() || value == 0.0 {
        return value as f32;
    }
    let narrowed = value as f32;
    if narrowed.is_infinite() {
        f32::MAX.copysign(narrowed)
    } else if narrowed == 0.0 {
        f32::from_bits(1).copysign(value as f32)
    } else {
        narrowed
    }
}

/// The `f64` a stored `f32` stands for: the shortest decimal that reads back as the
/// same `f32`, so `3e-4` is served as `0.0003`, not `0.000300000014249235`. Whole
/// numbers widen exactly (`21474836480` bytes stays `21474836480`, where the shortest
/// decimal would be `21474836000`).
pub fn widen_for_display(value: f32) -> f64 {
    if !value.is_finite() || value.fract() == 0.0 {
        return value as f64;
    }
    value
        .to_string()
        .parse::<f64>()
        .expect("Rust prints f32 as a parsable decimal")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrowing_keeps_zero_and_finiteness() {
        assert_eq!(to_stored_f32(1e-300), f32::from_bits(1));
        assert_eq!(to_stored_f32(-1e-300), -f32::from_bits(1));
        assert_eq!(to_stored_f32(1e300), f32::MAX);
        assert_eq!(to_stored_f32(-1e300), -f32::MAX);
        assert_eq!(to_stored_f32(0.0), 0.0);
        assert_eq!(to_stored_f32(f64::INFINITY), f32::INFINITY);
        assert!(to_stored_f32(-f64::NAN).is_nan());
        assert_eq!(to_stored_f32(-f64::NAN).to_bits(), f32::NAN.to_bits());
    }

    #[test]
    fn widening_serves_the_decimal_that_was_sent() {
        for sent in [3e-4, 4.7711, 0.95, 65536.0, 1.2e-5, 21474836480.0, 1e10] {
            assert_eq!(widen_for_display(to_stored_f32(sent)), sent);
        }
    }

    #[test]
    fn the_states_keep_their_bits() {
        for cell in [
            Cell::Absent,
            Cell::Null,
            Cell::Value(1.5),
            Cell::Value(-0.0),
        ] {
            assert_eq!(Cell::from_bits(cell.to_bits()).to_bits(), cell.to_bits());
        }
        let nan = Cell::from_wire(Some(f64::NAN));
        assert!(matches!(nan, Cell::Value(v) if v.is_nan()));
        assert_ne!(nan.to_bits(), ABSENT_BITS);
        assert_eq!(Cell::from_wire(None), Cell::Null);
    }
}
