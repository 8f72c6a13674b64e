//! Layer norm on CUDA: `ln_fwd` forward; `ln_bwd_dx` for `dx`, `ln_bwd_params_part` and
//! `ln_bwd_params_finish` for `dγ`, `dβ` backward (formulas: the header of
//! src/nn/layer_norm.rs).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{bail, CpuStorage, CudaStorage, Layout, Result, Shape, Tensor};
use candle_core::{CustomOp2, CustomOp3, DType, D};

use super::{
    alloc, f32_contiguous, function, launch, no_cpu, take_stats, threads, view, Act, Stats, TUNING,
};
use crate::nn::fused_op::{attach3, if_tracked, Backward3, Grads3};
use crate::nn::layer_norm::InputGrad;
use crate::nn::norm_launch::{entry, LnGeometry};

/// [`super::layer_norm`] on a CUDA device; the arguments are already checked.
pub(crate) fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let (out, back) = forward(x, weight, bias, eps)?;
    attach3((x, weight, bias), "layer-norm", out, back)
}

/// The forward kernel on `x` (detached): the output and what the backward needs (the geometry
/// and the row statistics).
fn forward(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<(Tensor, LnBackward)> {
    let d = x.dim(D::Minus1)?;
    let geo = LnGeometry::new(x.elem_count() / d.max(1), d, TUNING)?;
    let op = LnFwd {
        geo,
        eps: eps as f32,
        stats: Mutex::new(None),
    };
    let xd = x.detach().contiguous()?;
    let out = xd.apply_op3_no_bwd(&f32_contiguous(weight)?, &f32_contiguous(bias)?, &op)?;
    let stats = take_stats(&op.stats, "layer norm")?;
    Ok((out, LnBackward { geo, stats }))
}

/// [`super::super::layer_norm::layer_norm_recomputed`] on a CUDA device: the forward kernel
/// (output and row statistics), and the backward's dx kernel on those statistics.
pub(crate) fn layer_norm_recomputed(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<(Tensor, InputGrad)> {
    let (out, back) = forward(x, weight, bias, eps)?;
    let xd = x.detach().contiguous()?;
    let w = f32_contiguous(weight)?;
    let dtype = x.dtype();
    let dx = move |grad: &Tensor| {
        let g = grad.detach().to_dtype(dtype)?.contiguous()?;
        xd.apply_op3_no_bwd(&g, &w, &LnBwdDx(&back))
    };
    Ok((out, Box::new(dx)))
}

struct LnFwd {
    geo: LnGeometry,
    eps: f32,
    stats: Mutex<Option<Stats>>,
}

impl CustomOp3 for LnFwd {
    fn name(&self) -> &'static str {
        "layer-norm-cuda"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let out = by_dtype!(x.dtype(), ln_forward(self, x, xl, w, wl, b, bl))?;
        Ok((out, xl.shape().clone()))
    }
}

fn ln_forward<T: Act>(
    op: &LnFwd,
    x: &CudaStorage,
    xl: &Layout,
    w: &CudaStorage,
    wl: &Layout,
    b: &CudaStorage,
    bl: &Layout,
) -> Result<CudaStorage> {
    let (geo, dev) = (&op.geo, x.device());
    let xs = view::<T>(x, xl, "layer norm input")?;
    let (ws, bs) = (view::<f32>(w, wl, "γ")?, view::<f32>(b, bl, "β")?);
    let mut y = alloc::<T>(dev, xl.shape().elem_count())?;
    let mut mean = alloc::<f32>(dev, geo.rows as usize)?;
    let mut rstd = alloc::<f32>(dev, geo.rows as usize)?;
    let stream = dev.cuda_stream();
    let f = function(dev, &entry("ln_fwd", x.dtype())?)?;
    let mut lb = stream.launch_builder(&f);
    lb.arg(&mut y).arg(&mut mean).arg(&mut rstd);
    lb.arg(&xs).arg(&ws).arg(&bs);
    lb.arg(&geo.rows).arg(&geo.d).arg(&op.eps);
    // SAFETY: ln_fwd(y, mean, rstd, x, γ, β, rows, d, eps); one warp per row.
    unsafe { launch(lb, geo.rows_grid(), threads()) }?;
    let mut slot = op
        .stats
        .lock()
        .map_err(|_| candle_core::Error::Msg("layer norm: poisoned lock".into()))?;
    *slot = Some(Stats { mean, rstd });
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

struct LnBackward {
    geo: LnGeometry,
    stats: Stats,
}

impl Backward3 for LnBackward {
    fn backward(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<Grads3> {
        let xd = x.detach().contiguous()?;
        let g = grad.detach().to_dtype(x.dtype())?.contiguous()?;
        let dx = if_tracked(x, || {
            xd.apply_op3_no_bwd(&g, &f32_contiguous(weight)?, &LnBwdDx(self))
        })?;
        let dparams = if weight.track_op() || bias.track_op() {
            Some(xd.apply_op2_no_bwd(&g, &LnBwdParams(self))?)
        } else {
            None
        };
        let row = |i: usize| match &dparams {
            Some(p) => p.get(i),
            None => bail!("layer norm: parameter gradients were not computed"),
        };
        let dw = if_tracked(weight, || row(0))?;
        let db = if_tracked(bias, || row(1))?;
        Ok((dx, dw, db))
    }
}

/// `(x, g, γ)` → `dx`.
struct LnBwdDx<'a>(&'a LnBackward);

impl CustomOp3 for LnBwdDx<'_> {
    fn name(&self) -> &'static str {
        "layer-norm-cuda-dx"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        if gl.shape() != xl.shape() {
            bail!(
                "layer norm backward: gradient {:?}, input {:?}",
                gl.shape(),
                xl.shape()
            );
        }
        let out = by_dtype!(x.dtype(), ln_dx(self.0, x, xl, g, gl, w, wl))?;
        Ok((out, xl.shape().clone()))
    }
}

fn ln_dx<T: Act>(
    back: &LnBackward,
    x: &CudaStorage,
    xl: &Layout,
    g: &CudaStorage,
    gl: &Layout,
    w: &CudaStorage,
    wl: &Layout,
) -> Result<CudaStorage> {
    let (geo, dev) = (&back.geo, x.device());
    let xs = view::<T>(x, xl, "layer norm input")?;
    let gs = view::<T>(g, gl, "layer norm gradient")?;
    let ws = view::<f32>(w, wl, "γ")?;
    let mut dx = alloc::<T>(dev, xl.shape().elem_count())?;
    let stream = dev.cuda_stream();
    let f = function(dev, &entry("ln_bwd_dx", x.dtype())?)?;
    let mut lb = stream.launch_builder(&f);
    lb.arg(&mut dx).arg(&xs).arg(&gs).arg(&ws);
    lb.arg(&back.stats.mean).arg(&back.stats.rstd);
    lb.arg(&geo.rows).arg(&geo.d);
    // SAFETY: ln_bwd_dx(dx, x, g, γ, mean, rstd, rows, d); one warp per row.
    unsafe { launch(lb, geo.rows_grid(), threads()) }?;
    Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()))
}

/// `(x, g)` → `[dγ; dβ]`, `[2, d]` f32.
struct LnBwdParams<'a>(&'a LnBackward);

impl CustomOp2 for LnBwdParams<'_> {
    fn name(&self) -> &'static str {
        "layer-norm-cuda-params"
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
        x: &CudaStorage,
        xl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        if gl.shape() != xl.shape() {
            bail!(
                "layer norm backward: gradient {:?}, input {:?}",
                gl.shape(),
                xl.shape()
            );
        }
        let out = by_dtype!(x.dtype(), ln_params(self.0, x, xl, g, gl))?;
        Ok((out, Shape::from((2, self.0.geo.d as usize))))
    }
}

fn ln_params<T: Act>(
    back: &LnBackward,
    x: &CudaStorage,
    xl: &Layout,
    g: &CudaStorage,
    gl: &Layout,
) -> Result<CudaStorage> {
    let (geo, dev) = (&back.geo, x.device());
    let xs = view::<T>(x, xl, "layer norm input")?;
    let gs = view::<T>(g, gl, "layer norm gradient")?;
    let stream = dev.cuda_stream();
    let mut part = alloc::<f32>(dev, geo.partials())?;
    let f = function(dev, &entry("ln_bwd_params_part", x.dtype())?)?;
    let mut lb = stream.launch_builder(&f);
    lb.arg(&mut part).arg(&xs).arg(&gs);
    lb.arg(&back.stats.mean).arg(&back.stats.rstd);
    lb.arg(&geo.rows).arg(&geo.d).arg(&geo.rows_per_chunk);
    let (grid, tile) = geo.part_grid();
    // SAFETY: ln_bwd_params_part(part, x, g, mean, rstd, rows, d, rows_per_chunk); `part` is
    // `[chunks, 2, d]`.
    unsafe { launch(lb, grid, tile) }?;

    let mut dparams = alloc::<f32>(dev, 2 * geo.d as usize)?;
    let f = function(dev, "ln_bwd_params_finish")?;
    let mut lb = stream.launch_builder(&f);
    lb.arg(&mut dparams).arg(&part).arg(&geo.chunks).arg(&geo.d);
    // SAFETY: ln_bwd_params_finish(dparams, part, chunks, d); one thread per column.
    unsafe { launch(lb, geo.finish_grid(), threads()) }?;
    Ok(CudaStorage::wrap_cuda_slice(dparams, dev.clone()))
}
