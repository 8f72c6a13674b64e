//! The CUDA launch of src/optim/rounding.cu: stochastic rounding of an f32 tensor into a bf16 or
//! f16 parameter's storage ([`super::stochastic_round::round_into`]).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, DType, Result};

use super::launch;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/optim_rounding.ptx"));
const MODULE: &str = "sdtrain_rounding";

/// Rounds `x[x0..]` into `p[p0..p1]` with `seed`.
pub fn launch(
    p: &mut CudaStorage,
    (p0, p1): (usize, usize),
    x: &CudaStorage,
    (x0, _): (usize, usize),
    seed: u64,
) -> Result<()> {
    let n = p1 - p0;
    if n == 0 {
        return Ok(());
    }
    let suffix = match p.dtype() {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => bail!("stochastic rounding: a {other:?} parameter (bf16 or f16 only)"),
    };
    let dev = p.device.clone();
    let func = dev
        .get_or_load_custom_func(&format!("stochastic_round_{suffix}"), MODULE, PTX)?
        .into_cuda_function();
    let stream = dev.cuda_stream();
    let x = x.as_cuda_slice::<f32>()?.slice(x0..x0 + n);
    let cfg = LaunchConfig {
        grid_dim: (launch::grid(n, false), 1, 1),
        block_dim: (launch::THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let n = n as u64;
    macro_rules! go {
        ($t:ty) => {{
            let mut out = p.as_cuda_slice_mut::<$t>()?.slice_mut(p0..p1);
            let mut b = stream.launch_builder(&func);
            b.arg(&mut out);
            b.arg(&x);
            b.arg(&seed);
            b.arg(&n);
            // SAFETY: the arguments match `stochastic_round_<dtype>(u16*, const float*, u64, u64)`
            // (bf16 and f16 are 16-bit values), both buffers hold `n` values on this device, and
            // the grid-stride loop stops at `n`.
            unsafe { b.launch(cfg) }.w()?;
        }};
    }
    match p.dtype() {
        DType::BF16 => go!(half::bf16),
        _ => go!(half::f16),
    }
    Ok(())
}
