//! GEGLU on CUDA: `geglu_fwd`, `geglu_bwd` (formulas: the header of src/nn/geglu.rs).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{bail, CpuStorage, CudaStorage, Layout, Result, Shape, Tensor};
use candle_core::{CustomOp1, CustomOp2, DType, D};

use super::{alloc, function, launch, no_cpu, threads, view, Act, TUNING};
use crate::nn::fused_op::{attach1, Backward1};
use crate::nn::norm_launch::{entry, geglu_grid};

/// [`super::geglu`] on a CUDA device.
pub(crate) fn geglu(p: &Tensor) -> Result<Tensor> {
    let two_i = p.dim(D::Minus1)?;
    if two_i % 2 != 0 {
        bail!("geglu: last dimension of {:?} is odd", p.dims());
    }
    let out = p.detach().contiguous()?.apply_op1_no_bwd(&GegluFwd)?;
    attach1(p, "geglu", out, GegluBackward)
}

/// The output's shape and element count, and the half width `I`, for `p` `[..., 2I]`.
fn geglu_sizes(l: &Layout) -> Result<(Shape, usize, u32)> {
    let mut dims = l.shape().dims().to_vec();
    let Some(last) = dims.last_mut() else {
        bail!("geglu: a scalar input");
    };
    *last /= 2;
    let inner = u32::try_from(*last)
        .map_err(|_| candle_core::Error::Msg(format!("geglu: width {last} exceeds u32")))?;
    let shape = Shape::from(dims);
    let n = shape.elem_count();
    Ok((shape, n, inner))
}

struct GegluFwd;

impl CustomOp1 for GegluFwd {
    fn name(&self) -> &'static str {
        "geglu-cuda"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }

    fn cuda_fwd(&self, p: &CudaStorage, pl: &Layout) -> Result<(CudaStorage, Shape)> {
        let (shape, _, _) = geglu_sizes(pl)?;
        Ok((by_dtype!(p.dtype(), geglu_forward(p, pl))?, shape))
    }
}

fn geglu_forward<T: Act>(p: &CudaStorage, pl: &Layout) -> Result<CudaStorage> {
    let (_, n, inner) = geglu_sizes(pl)?;
    let dev = p.device();
    let ps = view::<T>(p, pl, "geglu input")?;
    let mut out = alloc::<T>(dev, n)?;
    let stream = dev.cuda_stream();
    let f = function(dev, &entry("geglu_fwd", p.dtype())?)?;
    let mut lb = stream.launch_builder(&f);
    let n64 = n as u64;
    lb.arg(&mut out).arg(&ps).arg(&n64).arg(&inner);
    // SAFETY: geglu_fwd(out, p, n, inner); `p` holds 2n values, `out` n, grid-stride.
    unsafe { launch(lb, geglu_grid(n, TUNING), threads()) }?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

struct GegluBackward;

impl Backward1 for GegluBackward {
    fn backward(&self, p: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Tensor> {
        geglu_grad(p, grad)
    }
}

/// `∂L/∂p` for the upstream gradient `grad` of `geglu(p)`, one launch.
pub(crate) fn geglu_grad(p: &Tensor, grad: &Tensor) -> Result<Tensor> {
    let g = grad.detach().to_dtype(p.dtype())?.contiguous()?;
    p.detach().contiguous()?.apply_op2_no_bwd(&g, &GegluBwd)
}

/// `(p, g)` → `dp`.
struct GegluBwd;

impl CustomOp2 for GegluBwd {
    fn name(&self) -> &'static str {
        "geglu-cuda-backward"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }

    fn cuda_fwd(
        &self,
        p: &CudaStorage,
        pl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (shape, _, _) = geglu_sizes(pl)?;
        if gl.shape() != &shape {
            bail!(
                "geglu backward: gradient {:?} for output {shape:?}",
                gl.shape()
            );
        }
        Ok((
            by_dtype!(p.dtype(), geglu_backward(p, pl, g, gl))?,
            pl.shape().clone(),
        ))
    }
}

fn geglu_backward<T: Act>(
    p: &CudaStorage,
    pl: &Layout,
    g: &CudaStorage,
    gl: &Layout,
) -> Result<CudaStorage> {
    let (_, n, inner) = geglu_sizes(pl)?;
    let dev = p.device();
    let ps = view::<T>(p, pl, "geglu input")?;
    let gs = view::<T>(g, gl, "geglu gradient")?;
    let mut dp = alloc::<T>(dev, 2 * n)?;
    let stream = dev.cuda_stream();
    let f = function(dev, &entry("geglu_bwd", p.dtype())?)?;
    let mut lb = stream.launch_builder(&f);
    let n64 = n as u64;
    lb.arg(&mut dp).arg(&ps).arg(&gs).arg(&n64).arg(&inner);
    // SAFETY: geglu_bwd(dp, p, g, n, inner); `p` and `dp` hold 2n values, `g` n.
    unsafe { launch(lb, geglu_grid(n, TUNING), threads()) }?;
    Ok(CudaStorage::wrap_cuda_slice(dp, dev.clone()))
}
