//! Every gradient's sum of squares, the per-module gradient norms' raw material, in
//! one of three ways, because CPUs and GPUs disagree on which is cheaper.
//!
//! - **Per tensor**: one dot product a gradient. No copy of the data; one kernel
//!   launch, allocation and dtype cast a gradient (306 for Qwen2.5-0.5B), which a
//!   CPU does not mind.
//! - **Stacked**: gradients of one shape and dtype (a decoder stack repeats its
//!   shapes in every layer) stacked, cast once, and reduced row by row as one batched
//!   product, then put back in order: a few dozen launches instead of hundreds, for
//!   one more copy of the gradients. On a CPU the copy costs more than the launches
//!   it saves (`small`: 1.25 → 2.60 ms a step).
//! - **Fused** (CUDA): one launch of gradflow's own multi-tensor kernel
//!   ([`fused`]), which reads each gradient once in its own dtype. candle has no
//!   multi-tensor reduction, and its general kernels took 11–12 ms a step for
//!   Qwen2.5-0.5B's gradients either of the other ways (about 30 times one read of
//!   them); BENCHMARKS.md, "On a GPU", has the figures.
//!
//! Whichever way, the sums are f32 and a NaN or infinity in any element makes its sum
//! non-finite, which is also how the loss scaler's `found_inf` is decided.

use candle_core::{DType, Device, Result, Tensor};

#[cfg(feature = "cuda")]
mod fused;

/// How the instrumented step sums each gradient's squares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GradSums {
    /// Fused on CUDA, per tensor elsewhere.
    Auto,
    PerTensor,
    Stacked,
    /// One launch of gradflow's own kernel for every gradient (CUDA builds, on a
    /// CUDA device, f32/bf16/f16 gradients; per tensor otherwise).
    Fused,
}

impl GradSums {
    /// What `Auto` means on `device`.
    pub fn resolve(self, device: &Device) -> GradSums {
        match self {
            GradSums::Auto if device.is_cuda() => GradSums::Fused,
            GradSums::Auto => GradSums::PerTensor,
            chosen => chosen,
        }
    }
}

/// The sum of squares of each of `grads`, as parts whose concatenation (f32, one
/// element a gradient) is in the order of `grads`.
pub fn sums_of_squares(grads: &[&Tensor], how: GradSums) -> Result<Vec<Tensor>> {
    match how {
        GradSums::Stacked if !grads.is_empty() => stacked(grads).map(|sums| vec![sums]),
        #[cfg(feature = "cuda")]
        GradSums::Fused if !grads.is_empty() && fused::supports(grads) => {
            fused::sums_of_squares(grads).map(|sums| vec![sums])
        }
        _ => grads.iter().map(|g| sum_of_squares(g)).collect(),
    }
}

/// The sum of squares of a tensor's elements as a one-element f32 tensor, computed
/// as a dot product: one read of the data and no temporary the size of the tensor
/// (`sqr().sum_all()` writes a full squared copy first). NaN and infinity propagate.
fn sum_of_squares(t: &Tensor) -> Result<Tensor> {
    let t = t.to_dtype(DType::F32)?;
    let n = t.elem_count();
    let flat = t.flatten_all()?.contiguous()?;
    flat.reshape((1, n))?
        .matmul(&flat.reshape((n, 1))?)?
        .reshape(1)
}

/// Indices of `tensors` grouped by dtype and shape: each group can be stacked into
/// one tensor. Members keep their order, and groups the order of their first member.
/// The norm weights' statistics (`norm_watch`) stack by the same rule.
pub(crate) fn same_shape_groups(tensors: &[&Tensor]) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let same = |m: &&mut Vec<usize>| {
            let first = tensors[m[0]];
            first.dtype() == t.dtype() && first.shape() == t.shape()
        };
        match groups.iter_mut().find(same) {
            Some(members) => members.push(i),
            None => groups.push(vec![i]),
        }
    }
    groups
}

/// Same-shaped gradients stacked and reduced together, the sums put back in order.
fn stacked(grads: &[&Tensor]) -> Result<Tensor> {
    let groups = same_shape_groups(grads);
    let mut sums = Vec::with_capacity(groups.len());
    let mut order = Vec::with_capacity(grads.len());
    for members in groups {
        let rows: Vec<&Tensor> = members.iter().map(|&i| grads[i]).collect();
        let stack = match rows.as_slice() {
            [one] => one.unsqueeze(0)?,
            _ => Tensor::stack(&rows, 0)?,
        };
        sums.push(row_sums_of_squares(&stack)?);
        order.extend(members);
    }
    let sums = Tensor::cat(&sums, 0)?;
    // Where each gradient's sum landed in group order.
    let mut position = vec![0u32; grads.len()];
    for (at, &i) in order.iter().enumerate() {
        position[i] = at as u32;
    }
    let position = Tensor::new(position.as_slice(), sums.device())?;
    sums.index_select(&position, 0)
}

/// Per leading index of `stack` (`[k, …]`), the sum of squares of the rest, as `[k]`
/// f32: a batched dot product over the innermost dimension, so the work spreads over
/// every row of every tensor rather than one long reduction a tensor. (Squaring and
/// then summing rows, candle's reduction, was slower on CUDA: 16.3 against 12.1 ms a
/// step for Qwen2.5-0.5B's gradients, for the squared copy it writes.)
fn row_sums_of_squares(stack: &Tensor) -> Result<Tensor> {
    let k = stack.dim(0)?;
    let inner = match stack.rank() {
        1 => 1,
        _ => stack.dims()[stack.rank() - 1],
    };
    let rows = stack.elem_count() / inner;
    let flat = stack.to_dtype(DType::F32)?.contiguous()?;
    let dots = flat
        .reshape((rows, 1, inner))?
        .matmul(&flat.reshape((rows, inner, 1))?)?;
    dots.reshape((k, rows / k))?.sum(1)
}

/// A gradient whose fused sum differs from its per-tensor sum ([`check_fused`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Mismatch {
    pub case: String,
    pub per_tensor: f32,
    pub fused: f32,
}

/// The fused sums against the per-tensor ones on `device`, for random gradients of
/// every dtype the kernel reads: sizes around its chunk and vector widths, Qwen2.5-0.5B's
/// largest shapes, a view that starts inside its storage (unaligned), a transposed
/// (non-contiguous) one, an empty one, and NaN and infinity, which must come out
/// non-finite. Empty when they agree (within 1e-4 relative: f32 sums in another
/// order). Off CUDA both ways are the per-tensor one, so this checks nothing there.
pub fn check_fused(device: &Device) -> Result<Vec<Mismatch>> {
    let random = |shape: &[usize], dtype: DType| -> Result<Tensor> {
        Tensor::randn(0f32, 1.0, shape, device)?.to_dtype(dtype)
    };
    let mut cases: Vec<(String, Tensor)> = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for n in [1, 7, 8, 9, 255, 32 * 1024, 32 * 1024 + 3, 1_000_003] {
            cases.push((format!("{dtype:?} [{n}]"), random(&[n], dtype)?));
        }
    }
    for shape in [[151_936, 896], [4864, 896], [896, 896], [128, 896]] {
        cases.push((format!("BF16 {shape:?}"), random(&shape, DType::BF16)?));
    }
    let wide = random(&[3 * 1024 + 5], DType::BF16)?;
    cases.push(("BF16 view at offset 3".into(), wide.narrow(0, 3, 3 * 1024)?));
    let square = random(&[96, 40], DType::F32)?;
    cases.push(("F32 transposed [40, 96]".into(), square.t()?));
    cases.push(("F32 empty".into(), random(&[0], DType::F32)?));
    let mut poisoned = vec![1f32; 70_000];
    poisoned[69_999] = f32::NAN;
    cases.push((
        "F32 with a NaN".into(),
        Tensor::new(poisoned.as_slice(), device)?,
    ));
    poisoned[69_999] = f32::INFINITY;
    let infinite = Tensor::new(poisoned.as_slice(), device)?.to_dtype(DType::BF16)?;
    cases.push(("BF16 with an infinity".into(), infinite));

    let grads: Vec<&Tensor> = cases.iter().map(|(_, t)| t).collect();
    let read =
        |how| -> Result<Vec<f32>> { Tensor::cat(&sums_of_squares(&grads, how)?, 0)?.to_vec1() };
    let per_tensor = read(GradSums::PerTensor)?;
    let fused = read(GradSums::Fused)?;
    let agree = |a: f32, b: f32| {
        (a.is_nan() && b.is_nan())
            || (a.is_infinite() && a == b)
            || (a.is_finite() && (a - b).abs() <= 1e-4 * a.abs().max(1e-30))
    };
    Ok(cases
        .iter()
        .zip(per_tensor.iter().zip(&fused))
        .filter(|(_, (a, b))| !agree(**a, **b))
        .map(|((case, _), (a, b))| Mismatch {
            case: case.clone(),
            per_tensor: *a,
            fused: *b,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn tensor(values: &[f32], shape: &[usize], dtype: DType) -> Tensor {
        Tensor::new(values, &Device::Cpu)
            .unwrap()
            .reshape(shape)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    #[test]
    fn stacked_sums_equal_per_tensor_sums_in_the_same_order() {
        let grads = [
            tensor(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], DType::F32),
            tensor(&[0.5, -0.5], &[2], DType::F32),
            tensor(&[1.0, 1.0, 1.0, 1.0, 1.0, 1.0], &[2, 3], DType::F32),
            tensor(&[2.0, 0.0, 0.0, 2.0, 0.0, 0.0], &[2, 3], DType::BF16),
            tensor(&[3.0, 4.0], &[2], DType::F32),
            tensor(&[f32::NAN, 1.0, 0.0, 0.0, 0.0, 0.0], &[3, 2], DType::F32),
            tensor(
                &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
                &[2, 2, 2],
                DType::F32,
            ),
        ];
        let grads: Vec<&Tensor> = grads.iter().collect();
        let read = |how| -> Vec<f32> {
            let parts = sums_of_squares(&grads, how).unwrap();
            Tensor::cat(&parts, 0).unwrap().to_vec1().unwrap()
        };
        let per_tensor = read(GradSums::PerTensor);
        let stacked = read(GradSums::Stacked);
        assert_eq!(per_tensor.len(), grads.len());
        assert_eq!(&per_tensor[..5], &[91.0, 0.5, 6.0, 8.0, 25.0]);
        assert!(per_tensor[5].is_nan() && stacked[5].is_nan());
        assert_eq!(per_tensor[6], 204.0);
        for (i, (a, b)) in per_tensor.iter().zip(&stacked).enumerate() {
            assert!(
                a == b || (a.is_nan() && b.is_nan()),
                "gradient {i}: {a} vs {b}"
            );
        }
        assert!(sums_of_squares(&[], GradSums::Stacked).unwrap().is_empty());
    }

    #[test]
    fn auto_is_per_tensor_off_cuda() {
        assert_eq!(GradSums::Auto.resolve(&Device::Cpu), GradSums::PerTensor);
        assert_eq!(GradSums::Stacked.resolve(&Device::Cpu), GradSums::Stacked);
    }

    #[test]
    fn fused_off_cuda_sums_per_tensor() {
        let grads = [
            tensor(&[1.0, 2.0, 3.0], &[3], DType::F32),
            tensor(&[0.5, -0.5], &[2], DType::BF16),
        ];
        let grads: Vec<&Tensor> = grads.iter().collect();
        let parts = sums_of_squares(&grads, GradSums::Fused).unwrap();
        let sums: Vec<f32> = Tensor::cat(&parts, 0).unwrap().to_vec1().unwrap();
        assert_eq!(sums, [14.0, 0.5]);
    }

    /// The fused kernel against the per-tensor sums on a real GPU ([`check_fused`]).
    /// `gradflow-trainer --device cuda --check-grad-sums` runs the same check from
    /// the release binary.
    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a CUDA device"]
    fn fused_sums_equal_per_tensor_sums_on_cuda() {
        let device = Device::new_cuda(0).expect("a CUDA device");
        let mismatches = check_fused(&device).unwrap();
        assert!(mismatches.is_empty(), "{mismatches:#?}");
    }
}
