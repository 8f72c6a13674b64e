//! Group norm (and group norm + SiLU) on CUDA: `gn_stats`, `gn_fwd` forward; `gn_bwd_sums`,
//! `gn_bwd_dx` for `dx` and `gn_bwd_params` for `dγ`, `dβ` backward (formulas: the header of
//! src/nn/group_norm.rs).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchArgs};
use candle_core::{bail, CpuStorage, CudaStorage, Layout, Result, Shape, Tensor};
use candle_core::{CustomOp3, DType};

use super::{
    alloc, f32_contiguous, function, launch, no_cpu, take_stats, threads, view, Act, Stats, TUNING,
};
use crate::nn::fused_op::{if_tracked, Backward3, Grads3};
use crate::nn::norm_launch::{entry, GnGeometry};

/// The forward of [`super::group_norm`] (`silu` false) or [`super::group_norm_silu`] on a CUDA
/// device, on detached operands, and its backward; the arguments are already checked.
pub(crate) fn group_norm_parts(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
    silu: bool,
) -> Result<(Tensor, Box<dyn Backward3>)> {
    let geo = GnGeometry::new(x.dims(), groups, TUNING)?;
    let op = GnFwd {
        geo,
        eps: eps as f32,
        silu,
        stats: Mutex::new(None),
    };
    let xd = x.detach().contiguous()?;
    let out = xd.apply_op3_no_bwd(&f32_contiguous(weight)?, &f32_contiguous(bias)?, &op)?;
    let stats = take_stats(&op.stats, "group norm")?;
    Ok((out, Box::new(GnBackward { geo, silu, stats })))
}

/// The forward: `(x, γ, β)` → the output, in `x`'s dtype; the statistics land in `stats`.
struct GnFwd {
    geo: GnGeometry,
    eps: f32,
    silu: bool,
    stats: Mutex<Option<Stats>>,
}

impl CustomOp3 for GnFwd {
    fn name(&self) -> &'static str {
        "group-norm-cuda"
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
        let out = by_dtype!(x.dtype(), gn_forward(self, x, xl, w, wl, b, bl))?;
        Ok((out, xl.shape().clone()))
    }
}

fn gn_forward<T: Act>(
    op: &GnFwd,
    x: &CudaStorage,
    xl: &Layout,
    w: &CudaStorage,
    wl: &Layout,
    b: &CudaStorage,
    bl: &Layout,
) -> Result<CudaStorage> {
    let (geo, dev) = (&op.geo, x.device());
    let xs = view::<T>(x, xl, "group norm input")?;
    let (ws, bs) = (view::<f32>(w, wl, "γ")?, view::<f32>(b, bl, "β")?);
    let stream = dev.cuda_stream();
    let shape = [geo.groups, geo.cpg, geo.hw, geo.chunk];

    let mut part = alloc::<f32>(dev, geo.fwd_partials())?;
    let f = function(dev, &entry("gn_stats", x.dtype())?)?;
    let mut lb = stream.launch_builder(&f);
    lb.arg(&mut part).arg(&xs);
    for v in &shape {
        lb.arg(v);
    }
    // SAFETY: gn_stats(part, x, groups, cpg, hw, chunk); `part` holds 3 floats per chunk.
    unsafe { launch(lb, geo.grid(), threads()) }?;

    let mut y = alloc::<T>(dev, xl.shape().elem_count())?;
    let mut mean = alloc::<f32>(dev, geo.stats_len())?;
    let mut rstd = alloc::<f32>(dev, geo.stats_len())?;
    let silu = op.silu as u32;
    let f = function(dev, &entry("gn_fwd", x.dtype())?)?;
    let mut lb = stream.launch_builder(&f);
    lb.arg(&mut y).arg(&mut mean).arg(&mut rstd);
    lb.arg(&xs).arg(&ws).arg(&bs).arg(&part);
    for v in &shape {
        lb.arg(v);
    }
    lb.arg(&op.eps).arg(&silu);
    // SAFETY: gn_fwd(y, mean, rstd, x, γ, β, part, groups, cpg, hw, chunk, eps, silu); `y` is
    // x-sized, the statistics one per (sample, group), γ and β one per channel.
    unsafe { launch(lb, geo.grid(), threads()) }?;

    let mut slot = op
        .stats
        .lock()
        .map_err(|_| candle_core::Error::Msg("group norm: poisoned lock".into()))?;
    *slot = Some(Stats { mean, rstd });
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

struct GnBackward {
    geo: GnGeometry,
    silu: bool,
    stats: Stats,
}

impl Backward3 for GnBackward {
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
        // γ and β side by side, `[2, C]` f32: the third operand of both backward ops.
        let affine = Tensor::cat(&[f32_contiguous(weight)?, f32_contiguous(bias)?], 0)?;
        let op = |params| GnBwd { back: self, params };
        let dx = if_tracked(x, || xd.apply_op3_no_bwd(&g, &affine, &op(false)))?;
        let dparams = if weight.track_op() || bias.track_op() {
            Some(xd.apply_op3_no_bwd(&g, &affine, &op(true))?)
        } else {
            None
        };
        let row = |i: usize| match &dparams {
            Some(p) => p.get(i),
            None => bail!("group norm: parameter gradients were not computed"),
        };
        let dw = if_tracked(weight, || row(0))?;
        let db = if_tracked(bias, || row(1))?;
        Ok((dx, dw, db))
    }
}

/// `(x, g, [γ; β])` → `dx` (`params` false) or `[dγ; dβ]` `[2, C]` f32 (`params` true).
struct GnBwd<'a> {
    back: &'a GnBackward,
    params: bool,
}

impl CustomOp3 for GnBwd<'_> {
    fn name(&self) -> &'static str {
        "group-norm-cuda-backward"
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
        a: &CudaStorage,
        al: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        if gl.shape() != xl.shape() {
            bail!(
                "group norm backward: gradient {:?}, input {:?}",
                gl.shape(),
                xl.shape()
            );
        }
        let ops = GnBwdOperands {
            x,
            xl,
            g,
            gl,
            a,
            al,
        };
        if self.params {
            let c = self.back.geo.channels as usize;
            let out = by_dtype!(x.dtype(), gn_params(self.back, &ops))?;
            Ok((out, Shape::from((2, c))))
        } else {
            let out = by_dtype!(x.dtype(), gn_dx(self.back, &ops))?;
            Ok((out, xl.shape().clone()))
        }
    }
}

struct GnBwdOperands<'a> {
    x: &'a CudaStorage,
    xl: &'a Layout,
    g: &'a CudaStorage,
    gl: &'a Layout,
    a: &'a CudaStorage,
    al: &'a Layout,
}

/// Pushes `x, g, γ, β, mean, rstd`, the leading operands of every group-norm backward kernel.
fn push_gn_operands<'a, T: Act>(
    lb: &mut LaunchArgs<'a>,
    views: &'a [CudaView<'a, T>; 2],
    affine: &'a [CudaView<'a, f32>; 2],
    stats: &'a Stats,
) {
    lb.arg(&views[0]).arg(&views[1]);
    lb.arg(&affine[0]).arg(&affine[1]);
    lb.arg(&stats.mean).arg(&stats.rstd);
}

/// `[x, g]` and `[γ, β]`.
type GnViews<'a, T> = ([CudaView<'a, T>; 2], [CudaView<'a, f32>; 2]);

fn gn_views<'a, T: Act>(ops: &GnBwdOperands<'a>, c: usize) -> Result<GnViews<'a, T>> {
    let x = view::<T>(ops.x, ops.xl, "group norm input")?;
    let g = view::<T>(ops.g, ops.gl, "group norm gradient")?;
    let a = view::<f32>(ops.a, ops.al, "γ, β")?;
    if a.len() != 2 * c {
        bail!(
            "group norm backward: {} affine values for {c} channels",
            a.len()
        );
    }
    Ok(([x, g], [a.slice(0..c), a.slice(c..2 * c)]))
}

fn gn_dx<T: Act>(back: &GnBackward, ops: &GnBwdOperands<'_>) -> Result<CudaStorage> {
    let (geo, dev) = (&back.geo, ops.x.device());
    let (views, affine) = gn_views::<T>(ops, geo.channels as usize)?;
    let stream = dev.cuda_stream();
    let tail = [geo.groups, geo.cpg, geo.hw, geo.chunk, back.silu as u32];

    let mut part = alloc::<f32>(dev, geo.bwd_partials())?;
    let f = function(dev, &entry("gn_bwd_sums", ops.x.dtype())?)?;
    let mut lb = stream.launch_builder(&f);
    lb.arg(&mut part);
    push_gn_operands(&mut lb, &views, &affine, &back.stats);
    for v in &tail {
        lb.arg(v);
    }
    // SAFETY: gn_bwd_sums(part, x, g, γ, β, mean, rstd, groups, cpg, hw, chunk, silu); `part`
    // holds 2 floats per chunk.
    unsafe { launch(lb, geo.grid(), threads()) }?;

    let mut dx = alloc::<T>(dev, ops.xl.shape().elem_count())?;
    let f = function(dev, &entry("gn_bwd_dx", ops.x.dtype())?)?;
    let mut lb = stream.launch_builder(&f);
    lb.arg(&mut dx);
    push_gn_operands(&mut lb, &views, &affine, &back.stats);
    lb.arg(&part);
    for v in &tail {
        lb.arg(v);
    }
    // SAFETY: gn_bwd_dx(dx, x, g, γ, β, mean, rstd, part, groups, cpg, hw, chunk, silu).
    unsafe { launch(lb, geo.grid(), threads()) }?;
    Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()))
}

fn gn_params<T: Act>(back: &GnBackward, ops: &GnBwdOperands<'_>) -> Result<CudaStorage> {
    let (geo, dev) = (&back.geo, ops.x.device());
    let (views, affine) = gn_views::<T>(ops, geo.channels as usize)?;
    let stream = dev.cuda_stream();
    let mut dparams = alloc::<f32>(dev, 2 * geo.channels as usize)?;
    let f = function(dev, &entry("gn_bwd_params", ops.x.dtype())?)?;
    let mut lb = stream.launch_builder(&f);
    lb.arg(&mut dparams);
    push_gn_operands(&mut lb, &views, &affine, &back.stats);
    let tail = [
        geo.batch,
        geo.channels,
        geo.groups,
        geo.hw,
        back.silu as u32,
    ];
    for v in &tail {
        lb.arg(v);
    }
    // SAFETY: gn_bwd_params(dparams, x, g, γ, β, mean, rstd, batch, channels, groups, hw,
    // silu); one block per channel writes its dγ and dβ.
    unsafe { launch(lb, geo.params_grid(), threads()) }?;
    Ok(CudaStorage::wrap_cuda_slice(dparams, dev.clone()))
}
