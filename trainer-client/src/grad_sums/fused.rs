//! The `fused` way: every gradient's sum of squares in one CUDA launch of our own
//! kernel (`sums_of_squares.cu`), which reads each gradient once in its own dtype.
//!
//! candle has no multi-tensor reduction, so this goes one level down, to cudarc
//! (candle's CUDA backend): the kernel is compiled once per process by NVRTC, a table
//! of the gradients' addresses, lengths and dtypes is copied to the device (24 bytes a
//! gradient), and the sums land in one f32 buffer that becomes an ordinary candle
//! tensor. Everything runs on candle's stream, so the launch is ordered after the
//! backward pass that wrote the gradients and before anything that reads the sums.

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::cudarc::nvrtc;
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Result, Storage, Tensor};

const SOURCE: &str = include_str!("sums_of_squares.cu");
const KERNEL: &str = "gradflow_sums_of_squares";
const MODULE: &str = "gradflow_grad_sums";
/// Elements a block sums: 32 Ki, so Qwen2.5-0.5B's 494 M gradient elements make
/// about 15,000 blocks, enough to fill any GPU, each long enough to hide its start.
/// A multiple of 8, so every chunk of an aligned tensor starts on 16 bytes.
const CHUNK: u32 = 32 * 1024;
/// Must equal the kernel's THREADS.
const THREADS: u32 = 256;

/// The kernel's PTX, compiled on first use (a few hundred milliseconds, once).
fn ptx() -> Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        nvrtc::compile_ptx(SOURCE)
            .map(|ptx| ptx.to_src())
            .map_err(|e| format!("compiling the gradient-sums kernel with NVRTC: {e:?}"))
    })
    .as_ref()
    .map(String::as_str)
    .map_err(|e| candle_core::Error::Msg(e.clone()))
}

/// The kernel's code for a gradient's dtype, or None where it has none.
fn dtype_code(dtype: DType) -> Option<u64> {
    match dtype {
        DType::F32 => Some(0),
        DType::BF16 => Some(1),
        DType::F16 => Some(2),
        _ => None,
    }
}

/// Whether every one of `grads` is a CUDA tensor of a dtype the kernel reads.
pub fn supports(grads: &[&Tensor]) -> bool {
    grads
        .iter()
        .all(|g| g.device().is_cuda() && dtype_code(g.dtype()).is_some())
}

/// The sum of squares of each of `grads` as one `[grads.len()]` f32 tensor on their
/// device, in their order. Every gradient must be on the same CUDA device, in f32,
/// bf16 or f16 ([`supports`]); a non-contiguous one is copied first.
pub fn sums_of_squares(grads: &[&Tensor]) -> Result<Tensor> {
    let Some(first) = grads.first() else {
        candle_core::bail!("fused gradient sums of no gradient");
    };
    let Device::Cuda(device) = first.device() else {
        candle_core::bail!(
            "fused gradient sums need CUDA tensors, got {:?}",
            first.device()
        );
    };
    // Gradients are contiguous in practice; the odd one that is not is copied, and the
    // copy kept alive until the launch is queued.
    let contiguous: Vec<Tensor> = grads
        .iter()
        .map(|g| g.contiguous())
        .collect::<Result<_>>()?;
    let stream = device.cuda_stream();
    let storages: Vec<_> = contiguous.iter().map(|g| g.storage_and_layout()).collect();

    let mut table = Vec::with_capacity(3 * grads.len());
    // Held until the launch is queued: each records the gradient's use on the stream
    // when dropped.
    let mut uses = Vec::with_capacity(grads.len());
    let mut chunks: u64 = 0;
    for (grad, (storage, layout)) in contiguous.iter().zip(&storages) {
        let code = dtype_code(grad.dtype()).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "fused gradient sums read f32, bf16 and f16 gradients, got {:?}",
                grad.dtype()
            ))
        })?;
        let Storage::Cuda(cuda) = &**storage else {
            candle_core::bail!("fused gradient sums need CUDA tensors");
        };
        let (address, used) = match grad.dtype() {
            DType::F32 => cuda.as_cuda_slice::<f32>()?.device_ptr(&stream),
            DType::BF16 => cuda.as_cuda_slice::<half::bf16>()?.device_ptr(&stream),
            _ => cuda.as_cuda_slice::<half::f16>()?.device_ptr(&stream),
        };
        uses.push(used);
        let len = grad.elem_count() as u64;
        let start = address + (layout.start_offset() * grad.dtype().size_in_bytes()) as u64;
        table.extend([start, len, (code << 32) | chunks]);
        chunks += len.div_ceil(u64::from(CHUNK));
    }
    if chunks > u64::from(u32::MAX) {
        candle_core::bail!("fused gradient sums: {chunks} chunks are more than one launch takes");
    }

    let table = stream.clone_htod(&table).w()?;
    let mut sums = stream.alloc_zeros::<f32>(grads.len()).w()?;
    if chunks > 0 {
        let kernel = device.get_or_load_custom_func(KERNEL, MODULE, ptx()?)?;
        let tensors = grads.len() as u32;
        let mut launch = kernel.builder();
        launch.arg(&table).arg(&tensors).arg(&CHUNK).arg(&mut sums);
        let config = LaunchConfig {
            grid_dim: (chunks as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; `table` holds the
        // address and length of live storage (borrowed in `storages` until after the
        // launch) for each of the `tensors` slots of `sums`.
        unsafe { launch.launch(config) }.w()?;
    }
    drop(uses);
    drop(storages);
    let storage = CudaStorage::wrap_cuda_slice(sums, device.clone());
    Ok(Tensor::from_storage(
        Storage::Cuda(storage),
        grads.len(),
        BackpropOp::none(),
        false,
    ))
}
