//! The norm weights whose update, drift, mean and intended update every step reports,
//! measured a group at a time.
//!
//! A decoder stack repeats its norm weights' shape in every layer (Qwen2.5-0.5B has 49
//! of 896 elements), and each statistic is a few small reductions. Measured one weight
//! at a time that is about 40 operations a weight, each its own kernel launch and
//! allocation on CUDA, where they cost 17 ms of a 135 ms step for data under 0.1 % of
//! the parameters. Stacked by shape and dtype, each statistic is one row-wise
//! reduction a group: the launches no longer grow with the layer count.

use candle_core::{D, DType, Result, Tensor, Var};

use crate::grad_sums::same_shape_groups;
use crate::optim::{StepMoments, intended_summary};

/// Weights of one shape and dtype, stacked in this order.
struct Group {
    /// Indices into the watch order.
    members: Vec<usize>,
    dtype: DType,
    /// The members' values when watching began, in f32, as rows: `[members, elements]`.
    initial: Tensor,
}

/// The watched norm weights, in the order they were given.
pub struct NormWatch {
    /// Each weight's index among the trainer's variables.
    params: Vec<usize>,
    groups: Vec<Group>,
}

/// The watched weights' values before the optimizer step: one stacked f32 copy a group.
pub struct Before(Vec<Tensor>);

/// What one step measured of one watched weight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WeightStats {
    /// ‖after − before‖².
    pub update_squared: f32,
    /// max |after − initial|, NaN when any element is not finite.
    pub drift: f32,
    pub mean: f32,
    /// Where the optimizer updated it: `intended_summary`'s four values.
    pub intended: Option<[f32; 4]>,
}

/// The weights of `members` (trainer variable indices), stacked as f32 rows.
fn stack_rows(vars: &[Var], params: impl Iterator<Item = usize>) -> Result<Tensor> {
    let rows: Vec<Tensor> = params
        .map(|i| vars[i].as_tensor().flatten_all())
        .collect::<Result<_>>()?;
    // A copy even of one row: stacking one tensor would share its storage, and the
    // optimizer writes the weights in place.
    let stacked = match rows.as_slice() {
        [one] => one.unsqueeze(0)?.copy()?,
        _ => Tensor::stack(&rows, 0)?,
    };
    stacked.to_dtype(DType::F32)
}

impl NormWatch {
    /// Watches `params` (indices into `vars`), from their current values.
    pub fn new(vars: &[Var], params: Vec<usize>) -> Result<NormWatch> {
        let tensors: Vec<&Tensor> = params.iter().map(|&i| vars[i].as_tensor()).collect();
        let groups = same_shape_groups(&tensors)
            .into_iter()
            .map(|members| {
                Ok(Group {
                    dtype: tensors[members[0]].dtype(),
                    initial: stack_rows(vars, members.iter().map(|&k| params[k]))?,
                    members,
                })
            })
            .collect::<Result<_>>()?;
        Ok(NormWatch { params, groups })
    }

    /// Each watched weight's index among the trainer's variables, in watch order.
    pub fn params(&self) -> &[usize] {
        &self.params
    }

    /// A copy of the watched weights as they are now (before the optimizer step).
    pub fn before(&self, vars: &[Var]) -> Result<Before> {
        self.groups
            .iter()
            .map(|g| stack_rows(vars, g.members.iter().map(|&k| self.params[k])))
            .collect::<Result<_>>()
            .map(Before)
    }

    /// The step's statistics on the device, as one f32 vector to bring to the host
    /// with the rest of the step and to read back with [`NormWatch::decode`].
    /// `moments` is what the optimizer step used on each watched weight (in watch
    /// order), from which the update it meant to apply is computed here, a group at
    /// a time; a weight it did not update has no intended-update summary.
    pub fn statistics(
        &self,
        vars: &[Var],
        before: &Before,
        moments: &StepMoments,
    ) -> Result<Option<Tensor>> {
        let mut parts = Vec::with_capacity(self.groups.len() * 2);
        for (group, before) in self.groups.iter().zip(&before.0) {
            let after = stack_rows(vars, group.members.iter().map(|&k| self.params[k]))?;
            let update = (&after - before)?.sqr()?.sum_keepdim(D::Minus1)?;
            let moved = (&after - &group.initial)?;
            // max skips NaN on CUDA (a NaN weight gave a drift of −Infinity): adding
            // 0 × the sum brings any NaN or infinity back.
            let poison = (moved.sum_keepdim(D::Minus1)? * 0.0)?;
            let drift = (moved.abs()?.max_keepdim(D::Minus1)? + poison)?;
            let mean = after.mean_keepdim(D::Minus1)?;
            parts.push(Tensor::cat(&[update, drift, mean], 1)?.flatten_all()?);

            let (rows, used): (Vec<u32>, Vec<&(Tensor, Tensor)>) = (0..group.members.len() as u32)
                .filter_map(|r| {
                    let used = moments.moments[group.members[r as usize]].as_ref()?;
                    Some((r, used))
                })
                .unzip();
            if rows.is_empty() {
                continue;
            }
            let stack = |pick: fn(&(Tensor, Tensor)) -> &Tensor| -> Result<Tensor> {
                let rows: Vec<Tensor> = used
                    .iter()
                    .map(|&pair| pick(pair).flatten_all())
                    .collect::<Result<_>>()?;
                Tensor::stack(&rows, 0)
            };
            let (m_hat, v_hat) = (stack(|p| &p.0)?, stack(|p| &p.1)?);
            let (before, after) = if rows.len() == group.members.len() {
                (before.clone(), after)
            } else {
                let index = Tensor::new(rows.as_slice(), after.device())?;
                (
                    before.index_select(&index, 0)?,
                    after.index_select(&index, 0)?,
                )
            };
            let updates = moments.intended(&before, &m_hat, &v_hat)?;
            let summary = intended_summary(&updates, &before, &after, group.dtype)?;
            parts.push(Tensor::cat(&summary, 1)?.flatten_all()?);
        }
        if parts.is_empty() {
            return Ok(None);
        }
        Tensor::cat(&parts, 0).map(Some)
    }

    /// Reads [`NormWatch::statistics`]' vector back, one entry a watched weight in
    /// watch order. `has_intended` is which weights `statistics` was given an update
    /// for.
    pub fn decode(&self, host: &[f32], has_intended: &[bool]) -> Vec<WeightStats> {
        let mut stats = vec![
            WeightStats {
                update_squared: f32::NAN,
                drift: f32::NAN,
                mean: f32::NAN,
                intended: None,
            };
            self.params.len()
        ];
        let mut values = host.iter().copied();
        let mut next = || values.next().unwrap_or(f32::NAN);
        for group in &self.groups {
            let rows: Vec<[f32; 3]> = group
                .members
                .iter()
                .map(|_| [next(), next(), next()])
                .collect();
            for (&k, [update, drift, mean]) in group.members.iter().zip(rows) {
                stats[k].update_squared = update;
                stats[k].drift = drift;
                stats[k].mean = mean;
            }
            for &k in group.members.iter().filter(|&&k| has_intended[k]) {
                stats[k].intended = Some([next(), next(), next(), next()]);
            }
        }
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn var(values: &[f32], dtype: DType) -> Var {
        let t = Tensor::new(values, &Device::Cpu).unwrap();
        Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()
    }

    /// The statistics one weight at a time, as the trainer measured them before they
    /// were grouped: the reference the grouped ones must equal.
    fn one_at_a_time(
        initial: &Tensor,
        before: &Tensor,
        var: &Var,
        intended: Option<&Tensor>,
    ) -> WeightStats {
        let after = var.as_tensor().to_dtype(DType::F32).unwrap();
        let moved = (&after - initial).unwrap();
        let scalar = |t: Tensor| t.to_dtype(DType::F32).unwrap().to_scalar::<f32>().unwrap();
        let poison = scalar((moved.sum_all().unwrap() * 0.0).unwrap());
        WeightStats {
            update_squared: scalar((&after - before).unwrap().sqr().unwrap().sum_all().unwrap()),
            drift: scalar(moved.abs().unwrap().max_all().unwrap()) + poison,
            mean: scalar(after.mean_all().unwrap()),
            intended: intended.map(|u| {
                let parts = intended_summary(u, before, &after, var.dtype()).unwrap();
                let v: Vec<f32> = Tensor::cat(&parts, 0).unwrap().to_vec1().unwrap();
                [v[0], v[1], v[2], v[3]]
            }),
        }
    }

    #[test]
    fn grouped_statistics_equal_those_of_one_weight_at_a_time() {
        // Two shapes, two dtypes, a weight without an intended update, and one that
        // turns NaN: four groups, one of them only partly updated.
        let vars = vec![
            var(&[1.0, 1.0, 1.0], DType::BF16),
            var(&[0.5, 2.0], DType::F32),
            var(&[1.0, 0.25, -1.0], DType::BF16),
            var(&[1.0, 1.0, 1.0], DType::F32),
            var(&[3.0, -2.0], DType::F32),
            var(&[0.1, 0.2, 0.3], DType::BF16),
        ];
        let params: Vec<usize> = (0..vars.len()).collect();
        let watch = NormWatch::new(&vars, params.clone()).unwrap();
        let initial: Vec<Tensor> = vars
            .iter()
            .map(|v| v.as_tensor().copy().unwrap().to_dtype(DType::F32).unwrap())
            .collect();
        // A first step moves the weights away from their initial values.
        let step = |k: usize| {
            let t = vars[k].as_tensor();
            let shift = Tensor::ones(t.shape(), DType::F32, &Device::Cpu).unwrap();
            let shift = (shift * (1e-3 * (k as f64 + 1.0))).unwrap();
            vars[k]
                .set(
                    &(t.to_dtype(DType::F32).unwrap() + shift)
                        .unwrap()
                        .to_dtype(t.dtype())
                        .unwrap(),
                )
                .unwrap();
        };
        (0..vars.len()).for_each(step);
        let before_each: Vec<Tensor> = vars
            .iter()
            .map(|v| v.as_tensor().copy().unwrap().to_dtype(DType::F32).unwrap())
            .collect();
        let before = watch.before(&vars).unwrap();
        // Moments in each weight's dtype, as the optimizer step keeps them; weight 2
        // was not updated.
        let moments = StepMoments {
            lr: 1e-3,
            lr_lambda: 1e-4,
            eps: 1e-8,
            moments: (0..vars.len())
                .map(|k| {
                    (k != 2).then(|| {
                        let n = vars[k].elem_count();
                        let tensor = |f: &dyn Fn(usize) -> f32| {
                            let values: Vec<f32> = (0..n).map(f).collect();
                            Tensor::new(values.as_slice(), &Device::Cpu)
                                .unwrap()
                                .to_dtype(vars[k].dtype())
                                .unwrap()
                        };
                        let m_hat = tensor(&|e| 1e-2 * (e as f32 - 1.0));
                        let v_hat = tensor(&|e| 1e-4 * (e as f32 + 1.0));
                        (m_hat, v_hat)
                    })
                })
                .collect(),
        };
        // Each weight's intended update computed on its own, as the step once did.
        let intended: Vec<Option<Tensor>> = (0..vars.len())
            .map(|k| {
                let (m_hat, v_hat) = moments.moments[k].as_ref()?;
                Some(moments.intended(&before_each[k], m_hat, v_hat).unwrap())
            })
            .collect();
        for (k, update) in intended.iter().enumerate() {
            if let Some(update) = update {
                let t = vars[k].as_tensor();
                let next = (t.to_dtype(DType::F32).unwrap() + update).unwrap();
                vars[k].set(&next.to_dtype(t.dtype()).unwrap()).unwrap();
            }
        }
        let nan = Tensor::new(&[f32::NAN, 1.0], &Device::Cpu).unwrap();
        vars[4].set(&nan).unwrap();

        let device = watch.statistics(&vars, &before, &moments).unwrap().unwrap();
        let has = moments.updated();
        let grouped = watch.decode(&device.to_vec1::<f32>().unwrap(), &has);
        for k in 0..vars.len() {
            let expected =
                one_at_a_time(&initial[k], &before_each[k], &vars[k], intended[k].as_ref());
            let same = |a: f32, b: f32| a == b || (a.is_nan() && b.is_nan());
            let g = grouped[k];
            assert!(
                same(g.update_squared, expected.update_squared),
                "{k}: {g:?} {expected:?}"
            );
            assert!(same(g.drift, expected.drift), "{k}: {g:?} {expected:?}");
            assert!(same(g.mean, expected.mean), "{k}: {g:?} {expected:?}");
            match (g.intended, expected.intended) {
                (Some(a), Some(b)) => {
                    assert!(
                        a.iter().zip(b).all(|(&x, y)| same(x, y)),
                        "{k}: {a:?} {b:?}"
                    )
                }
                (a, b) => assert_eq!(a, b, "{k}"),
            }
        }
        assert!(grouped[4].drift.is_nan(), "a NaN weight's drift is NaN");
        assert_eq!(grouped[2].intended, None);
        assert!(grouped[0].intended.is_some());
    }
}
