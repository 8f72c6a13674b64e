//! The step check's sums of squares on one CUDA device (src/optim/sumsq.cu): each gradient's
//! Σ g² added into its slot of one f32 buffer by one launch, and the buffer copied to the host
//! once, with the step's other scalars (the loss) in its first slots.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CpuStorage, CudaStorage, DType, InplaceOp2, Layout, Result, Tensor};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/optim_sumsq.ptx"));
const MODULE: &str = "sdtrain_sumsq";
/// Threads per block (`SUMSQ_THREADS`) and the most blocks per launch.
const THREADS: u32 = 256;
const MAX_BLOCKS: usize = 1024;

/// `extra` (0-d tensors, their values first) and Σ g² of each of `grads`, read back in one
/// copy; `None` when they are not all on one CUDA device, contiguous, in f32/bf16/f16 (the caller
/// then takes the composed path).
pub fn fetch(extra: &[&Tensor], grads: &[&Tensor]) -> Result<Option<Vec<f32>>> {
    let Some(first) = grads.first() else {
        return Ok(None);
    };
    let dev = first.device();
    let fits = |t: &&Tensor| {
        t.device().same_device(dev)
            && t.is_contiguous()
            && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
    };
    if !dev.is_cuda()
        || !grads.iter().all(fits)
        || !extra.iter().all(|t| t.device().same_device(dev))
    {
        return Ok(None);
    }
    let mut parts = extra
        .iter()
        .map(|t| t.to_dtype(DType::F32)?.reshape(1))
        .collect::<Result<Vec<_>>>()?;
    parts.push(Tensor::zeros(grads.len(), DType::F32, dev)?);
    let out = Tensor::cat(&parts, 0)?;
    for (i, g) in grads.iter().enumerate() {
        out.inplace_op2(
            g,
            &SumSqInto {
                slot: extra.len() + i,
            },
        )?;
    }
    Ok(Some(out.to_vec1::<f32>()?))
}

/// Adds Σ g² of the second operand into slot `slot` of the first (f32).
struct SumSqInto {
    slot: usize,
}

impl InplaceOp2 for SumSqInto {
    fn name(&self) -> &'static str {
        "sum-of-squares-into"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        bail!("sum of squares: the CUDA kernel got a CPU tensor")
    }

    fn cuda_fwd(
        &self,
        out: &mut CudaStorage,
        ol: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        let (Some((o0, o1)), Some((g0, g1))) = (ol.contiguous_offsets(), gl.contiguous_offsets())
        else {
            bail!("sum of squares: a strided operand")
        };
        if self.slot >= o1 - o0 {
            bail!("sum of squares: slot {} of {}", self.slot, o1 - o0)
        }
        let n = g1 - g0;
        if n == 0 {
            return Ok(());
        }
        let suffix = match g.dtype() {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            other => bail!("sum of squares: a {other:?} gradient"),
        };
        let dev = out.device.clone();
        let func = dev
            .get_or_load_custom_func(&format!("sumsq_into_{suffix}"), MODULE, PTX)?
            .into_cuda_function();
        let stream = dev.cuda_stream();
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(THREADS as usize).min(MAX_BLOCKS) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut o = out.as_cuda_slice_mut::<f32>()?.slice_mut(o0..o1);
        let (n64, slot) = (n as u64, self.slot as i32);
        macro_rules! go {
            ($t:ty) => {{
                let x = g.as_cuda_slice::<$t>()?.slice(g0..g1);
                let mut b = stream.launch_builder(&func);
                b.arg(&x).arg(&n64).arg(&mut o).arg(&slot);
                // SAFETY: the arguments match `sumsq_into_<dtype>(const T*, u64, float*, int)`;
                // x holds n values of that dtype and `slot` is inside `o` (checked above), and
                // the grid-stride loop stops at n.
                unsafe { b.launch(cfg) }.w()?;
            }};
        }
        match g.dtype() {
            DType::F32 => go!(f32),
            DType::BF16 => go!(half::bf16),
            _ => go!(half::f16),
        }
        Ok(())
    }
}
