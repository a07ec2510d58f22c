//! AdamW, as candle's `candle_nn::optim::AdamW` computes it (the same operations in
//! the same order, in each parameter's own dtype, so training is unchanged), plus
//! what candle's keeps private: the update it *meant* to apply.
//!
//! The intended update of a parameter is `−lr·λ·θ − lr·m̂/(√v̂ + ε)` evaluated in f32
//! from the step's moments, before the result is written in the parameter's dtype.
//! Comparing it with the parameter's spacing (its ulp) is what decides whether a
//! weight that did not move was frozen by rounding (protocol v1.1's intended
//! updates): Adam's step is often far below `lr`, so `lr` alone cannot decide.

use candle_core::backprop::GradStore;
use candle_core::{D, DType, Result, Tensor, Var};
pub use candle_nn::optim::ParamsAdamW;

struct VarAdamW {
    var: Var,
    first_moment: Var,
    second_moment: Var,
}

pub struct AdamW {
    vars: Vec<VarAdamW>,
    step_t: usize,
    params: ParamsAdamW,
}

impl AdamW {
    pub fn new(vars: Vec<Var>, params: ParamsAdamW) -> Result<AdamW> {
        let vars = vars
            .into_iter()
            .filter(|var| var.dtype().is_float())
            .map(|var| {
                let first_moment = Var::zeros(var.shape(), var.dtype(), var.device())?;
                let second_moment = Var::zeros(var.shape(), var.dtype(), var.device())?;
                Ok(VarAdamW {
                    var,
                    first_moment,
                    second_moment,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(AdamW {
            vars,
            step_t: 0,
            params,
        })
    }

    pub fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    pub fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr;
    }

    /// One optimizer step. For each var of `watch`, the bias-corrected moments the
    /// step used (`None`: the optimizer does not hold it, or it had no gradient), from
    /// which [`StepMoments::intended`] gives the update it meant to apply: computed
    /// a group of same-shaped weights at a time by the caller, not here a weight at
    /// a time (eight small operations a weight, each a kernel launch on CUDA).
    pub fn step(&mut self, grads: &GradStore, watch: &[&Var]) -> Result<StepMoments> {
        self.step_t += 1;
        let ParamsAdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.params;
        let lr_lambda = lr * weight_decay;
        let scale_m = 1f64 / (1f64 - beta1.powi(self.step_t as i32));
        let scale_v = 1f64 / (1f64 - beta2.powi(self.step_t as i32));
        let mut moments = StepMoments {
            lr,
            lr_lambda,
            eps,
            moments: vec![None; watch.len()],
        };
        for state in &self.vars {
            let theta = &state.var;
            let Some(g) = grads.get(theta) else { continue };
            let next_m = ((state.first_moment.as_tensor() * beta1)? + (g * (1.0 - beta1))?)?;
            let next_v =
                ((state.second_moment.as_tensor() * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let m_hat = (&next_m * scale_m)?;
            let v_hat = (&next_v * scale_v)?;
            if let Some(k) = watch.iter().position(|w| w.id() == theta.id()) {
                moments.moments[k] = Some((m_hat.clone(), v_hat.clone()));
            }
            let next_theta = (theta.as_tensor() * (1f64 - lr_lambda))?;
            let adjusted_grad = (m_hat / (v_hat.sqrt()? + eps)?)?;
            let next_theta = (next_theta - (adjusted_grad * lr)?)?;
            state.first_moment.set(&next_m)?;
            state.second_moment.set(&next_v)?;
            theta.set(&next_theta)?;
        }
        Ok(moments)
    }
}

/// What one optimizer step used on the watched vars: enough to compute the update it
/// meant to apply to each, later and for many weights at once.
#[derive(Clone)]
pub struct StepMoments {
    pub lr: f64,
    /// lr · weight decay.
    pub lr_lambda: f64,
    pub eps: f64,
    /// Per watched var, its bias-corrected first and second moments (m̂, v̂) in the
    /// var's dtype; `None` where the step did not update it.
    pub moments: Vec<Option<(Tensor, Tensor)>>,
}

impl StepMoments {
    /// A step that updated none of `watched` vars (skipped by the loss scaler).
    pub fn none(watched: usize) -> StepMoments {
        StepMoments {
            lr: 0.0,
            lr_lambda: 0.0,
            eps: 0.0,
            moments: vec![None; watched],
        }
    }

    /// Which watched vars the step updated.
    pub fn updated(&self) -> Vec<bool> {
        self.moments.iter().map(Option::is_some).collect()
    }

    /// The intended update `−lr·λ·θ − lr·m̂/(√v̂ + ε)` in f32, of weights `theta` (in
    /// f32, their values before the step) whose moments are `m_hat` and `v_hat` (in
    /// the weights' dtype): the same operations in the same order as the step's, so
    /// rows stacked from several weights give each weight's own update exactly.
    pub fn intended(&self, theta: &Tensor, m_hat: &Tensor, v_hat: &Tensor) -> Result<Tensor> {
        let m_hat = m_hat.to_dtype(DType::F32)?;
        let v_hat = v_hat.to_dtype(DType::F32)?;
        let decay = (theta * (-self.lr_lambda))?;
        let adam = ((m_hat / (v_hat.sqrt()? + self.eps)?)? * (-self.lr))?;
        decay + adam
    }
}

/// Explicit significand bits of a floating-point dtype.
fn mantissa_bits(dtype: DType) -> i32 {
    match dtype {
        DType::BF16 => 7,
        DType::F16 => 10,
        DType::F64 => 52,
        _ => 23,
    }
}

/// The smallest normal magnitude of a dtype: below it the spacing stays constant.
fn min_normal(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 6.103_515_625e-5,
        DType::F64 => f64::MIN_POSITIVE,
        _ => f32::MIN_POSITIVE as f64,
    }
}

/// Each element's ulp in `dtype` (the spacing above its magnitude; below the
/// smallest normal value, the subnormals' constant spacing), in f32, exactly.
///
/// Found by rounding rather than by logarithms, whose f32 results straddle the
/// integers at powers of two: for `m = |x|` with `p` explicit significand bits,
/// `m + 0.75·2^−p·m` lies between `m + 0.75 ulp` and `m + 1.5 ulp`, so rounding it
/// to `dtype` gives the next value, `m + ulp`. The sum is computed exactly in a
/// wider float (f32 for bf16 and f16, f64 for f32), so only that one rounding
/// happens.
fn ulp(x: &Tensor, dtype: DType) -> Result<Tensor> {
    let wide = match dtype {
        DType::BF16 | DType::F16 => DType::F32,
        _ => DType::F64,
    };
    let m = x.to_dtype(wide)?.abs()?.maximum(min_normal(dtype))?;
    let offset = (&m * (0.75 * 2f64.powi(-mantissa_bits(dtype))))?;
    let next = (&m + offset)?.to_dtype(dtype)?.to_dtype(wide)?;
    (next - m)?.to_dtype(DType::F32)
}

/// The summary of intended updates against the weights they were meant for, as four
/// reductions over the last dimension (kept, so a weight's `[n]` gives `[1]` and
/// stacked rows `[k, n]` give `[k, 1]`), on the device: the update's squared norm,
/// the largest |update| / ulp(weight) with the ulp in `dtype` at each weight's value
/// before the step, how many elements had a non-zero intended update, and how many
/// of those kept their stored value. `before` and `after` are the weights in f32
/// (exact for every narrower dtype). A non-finite update makes the ratio NaN, never
/// a number that hides it.
pub fn intended_summary(
    intended: &Tensor,
    before: &Tensor,
    after: &Tensor,
    dtype: DType,
) -> Result<[Tensor; 4]> {
    let squared = intended.sqr()?.sum_keepdim(D::Minus1)?;
    let ulp = ulp(before, dtype)?;
    let ratio = (intended.abs()? / ulp)?;
    // max skips NaN on some devices; adding 0 × the sum brings any NaN or infinity
    // of the update back.
    let poison = (intended.sum_keepdim(D::Minus1)? * 0.0)?;
    let max_ratio = (ratio.max_keepdim(D::Minus1)? + poison)?;
    let nonzero = intended.ne(0.0)?.to_dtype(DType::F32)?;
    let unchanged = after.eq(before)?.to_dtype(DType::F32)?;
    let count_nonzero = nonzero.sum_keepdim(D::Minus1)?;
    let rounded_away = (nonzero * unchanged)?.sum_keepdim(D::Minus1)?;
    Ok([squared, max_ratio, count_nonzero, rounded_away])
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Applies `update` to `weights` stored in `dtype` and summarises it.
    fn summary(weights: &[f32], update: &[f32], dtype: DType) -> [f32; 4] {
        let device = Device::Cpu;
        let stored = Tensor::new(weights, &device)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let before = stored.to_dtype(DType::F32).unwrap();
        let update = Tensor::new(update, &device).unwrap();
        let after = (&before + &update)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let parts = intended_summary(&update, &before, &after, dtype).unwrap();
        let values: Vec<f32> = Tensor::cat(&parts, 0).unwrap().to_vec1().unwrap();
        [values[0], values[1], values[2], values[3]]
    }

    #[test]
    fn bf16_at_one_rounds_away_updates_below_half_an_ulp() {
        // bf16 spacing just above 1.0 is 2^-7 = 7.8e-3; just below, 3.9e-3.
        let [_, ratio, nonzero, rounded] = summary(&[1.0, 1.0], &[1e-3, -1e-3], DType::BF16);
        assert!((ratio - 1e-3 / 7.8125e-3).abs() < 1e-4, "{ratio}");
        assert_eq!((nonzero, rounded), (2.0, 2.0));
        let [_, ratio, _, rounded] = summary(&[1.0], &[5e-3], DType::BF16);
        assert!(ratio > 0.5, "{ratio}");
        assert_eq!(rounded, 0.0, "5e-3 moves a bf16 1.0");
    }

    #[test]
    fn smaller_weights_have_finer_spacing() {
        // At 0.1 bf16's spacing is 2^-11 = 4.9e-4: 1e-3 moves it.
        let [_, ratio, _, rounded] = summary(&[0.1], &[1e-3], DType::BF16);
        assert!(ratio > 2.0, "{ratio}");
        assert_eq!(rounded, 0.0);
        // f16 at 1.0: spacing 2^-10 = 9.8e-4; 1e-4 rounds away, 1e-3 does not.
        assert_eq!(summary(&[1.0], &[1e-4], DType::F16)[3], 1.0);
        assert_eq!(summary(&[1.0], &[1e-3], DType::F16)[3], 0.0);
        // f32 at 1.0: 1e-4 is far above its spacing of 1.2e-7.
        let [_, ratio, _, rounded] = summary(&[1.0], &[1e-4], DType::F32);
        assert!(ratio > 500.0, "{ratio}");
        assert_eq!(rounded, 0.0);
    }

    #[test]
    fn the_ulp_is_exact_at_powers_of_two_and_just_below_them() {
        // At 2^k the spacing above is 2^(k−p) with p explicit significand bits; just
        // below 2^k it is half that.
        for (dtype, p) in [(DType::BF16, 7), (DType::F16, 10), (DType::F32, 23)] {
            for k in -12i32..=12 {
                let w = 2f32.powi(k);
                let update = 2f32.powi(k - p - 2); // a quarter of the spacing above w
                let ratio = summary(&[w], &[update], dtype)[1];
                assert_eq!(ratio, 0.25, "{dtype:?} at 2^{k}");
                let below = w * (1.0 - 2f32.powi(-p - 1)); // the largest value below 2^k
                let ratio = summary(&[below], &[update], dtype)[1];
                assert_eq!(ratio, 0.5, "{dtype:?} just below 2^{k}");
            }
        }
    }

    #[test]
    fn the_norm_counts_every_element_and_zero_updates_are_not_counted() {
        let [squared, _, nonzero, rounded] =
            summary(&[1.0, 1.0, 1.0], &[3e-4, 4e-4, 0.0], DType::BF16);
        assert!((squared - 25e-8).abs() < 1e-10, "{squared}");
        assert_eq!((nonzero, rounded), (2.0, 2.0));
    }

    #[test]
    fn a_nan_update_makes_the_ratio_nan() {
        let [_, ratio, _, _] = summary(&[1.0, 1.0], &[1e-3, f32::NAN], DType::BF16);
        assert!(ratio.is_nan(), "{ratio}");
    }

    #[test]
    fn the_step_matches_candles_adamw() {
        let device = Device::Cpu;
        let init = Tensor::new(&[1.0f32, -0.5, 0.25], &device).unwrap();
        let ours = Var::from_tensor(&init).unwrap();
        let theirs = Var::from_tensor(&init).unwrap();
        let params = ParamsAdamW {
            lr: 1e-2,
            weight_decay: 0.1,
            ..Default::default()
        };
        let mut a = AdamW::new(vec![ours.clone()], params.clone()).unwrap();
        let mut b = <candle_nn::optim::AdamW as candle_nn::optim::Optimizer>::new(
            vec![theirs.clone()],
            params,
        )
        .unwrap();
        for _ in 0..3 {
            let ga = ours
                .as_tensor()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let before = ours.as_tensor().copy().unwrap();
            let moments = a.step(&ga, &[&ours]).unwrap();
            let (m_hat, v_hat) = moments.moments[0].clone().expect("updated");
            // In f32 the intended update is what the step applied, up to rounding.
            let intended = moments.intended(&before, &m_hat, &v_hat).unwrap();
            let applied = (ours.as_tensor() - &before).unwrap();
            let gap: f32 = (intended - applied)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar()
                .unwrap();
            assert!(gap < 1e-6, "intended and applied differ by {gap}");
            let gb = theirs
                .as_tensor()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            candle_nn::optim::Optimizer::step(&mut b, &gb).unwrap();
        }
        let x: Vec<f32> = ours.as_tensor().to_vec1().unwrap();
        let y: Vec<f32> = theirs.as_tensor().to_vec1().unwrap();
        assert_eq!(x, y, "training is unchanged");
    }
}
