//! The CUDA path of [`super::group_norm`], [`super::group_norm_silu`], [`super::layer_norm`] and
//! [`super::geglu`]: forward and backward are launches of the kernels of src/nn/kernels/norm.cu
//! (PTX compiled by build.rs, loaded as candle custom kernels), with the geometry of
//! [`super::norm_launch`]. The formulas are in the headers of group_norm.rs, layer_norm.rs and
//! geglu.rs; the kernels read the activation dtype and write it, so no cast runs beside them.
//!
//! - group norm forward: `gn_stats`, `gn_fwd` (2 launches); backward: `gn_bwd_sums`, `gn_bwd_dx`
//!   for `dx`, `gn_bwd_params` for `dγ`, `dβ` (only when one of them is tracked).
//! - layer norm forward: `ln_fwd`; backward: `ln_bwd_dx`, and `ln_bwd_params_part`,
//!   `ln_bwd_params_finish` for `dγ`, `dβ` (only when tracked).
//! - GEGLU: `geglu_fwd`, `geglu_bwd`.
//!
//! The forward runs as a custom op on detached operands that saves the per-group (or per-row)
//! mean and 1/σ as raw f32 device buffers; [`super::fused_op`] attaches the output with a
//! backward that holds them. `γ`, `β` enter the kernels as f32 (a no-op for f32 parameters,
//! one small cast otherwise) and `dγ`, `dβ` come back as f32, cast to the parameters' dtype.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{
    bail, CpuStorage, CudaDevice, CudaStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout,
    Result, Shape, Tensor, D,
};

use super::fused_op::{attach1, attach3, if_tracked, Backward1, Backward3, Grads3};
use super::norm_launch::{entry, geglu_grid, GnGeometry, LnGeometry, Tuning};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels_norm.ptx"));
const MODULE: &str = "sdtrain_norm";
const TUNING: Tuning = Tuning::CUDA;

/// An activation element type the kernels have an entry point for.
trait Act: CudaDType + DeviceRepr {}
impl Act for f32 {}
impl Act for half::bf16 {}
impl Act for half::f16 {}

/// Calls `$f::<T>($args)` with `T` the Rust type of `$dtype`.
macro_rules! by_dtype {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            other => bail!("norm kernels: no kernel for {other:?} activations"),
        }
    };
}

fn function(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    Ok(dev
        .get_or_load_custom_func(name, MODULE, PTX)?
        .into_cuda_function())
}

fn config(grid: [u32; 3], block: [u32; 3]) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid[0], grid[1], grid[2]),
        block_dim: (block[0], block[1], block[2]),
        shared_mem_bytes: 0,
    }
}

fn threads() -> [u32; 3] {
    [TUNING.threads, 1, 1]
}

/// Launches `b` over `grid` × `block`.
///
/// # Safety
/// The arguments pushed onto `b` match the entry point's signature in norm.cu, and every
/// buffer holds what the geometry that gave `grid` says the kernel reads or writes.
unsafe fn launch(mut b: LaunchArgs<'_>, grid: [u32; 3], block: [u32; 3]) -> Result<()> {
    unsafe { b.launch(config(grid, block)) }.w()?;
    Ok(())
}

/// The elements of a contiguous operand, as a view.
fn view<'a, T: Act>(s: &'a CudaStorage, l: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(s.as_cuda_slice::<T>()?.slice(a..b)),
        None => bail!("norm kernels: {what} is not contiguous"),
    }
}

/// A fresh device buffer of `n` elements, every one written by the kernel that fills it.
fn alloc<T: DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<CudaSlice<T>> {
    // SAFETY: the kernels write every element before anything reads it.
    unsafe { dev.alloc::<T>(n) }
}

fn f32_contiguous(t: &Tensor) -> Result<Tensor> {
    t.detach().to_dtype(DType::F32)?.contiguous()
}

/// The per-group (or per-row) mean and 1/σ a forward saved for its backward.
struct Stats {
    mean: CudaSlice<f32>,
    rstd: CudaSlice<f32>,
}

/// Takes the statistics a forward op left in `slot`.
fn take_stats(slot: &Mutex<Option<Stats>>, name: &str) -> Result<Stats> {
    let mut slot = slot
        .lock()
        .map_err(|_| candle_core::Error::Msg(format!("{name}: poisoned lock")))?;
    match slot.take() {
        Some(s) => Ok(s),
        None => bail!("{name}: the forward saved no statistics"),
    }
}

fn no_cpu<R>(name: &str) -> Result<R> {
    bail!("{name}: the CUDA kernel got a CPU tensor")
}

// ---------------------------------------------------------------- group norm

/// [`super::group_norm`] (`silu` false) or [`super::group_norm_silu`] on a CUDA device; the
/// arguments are already checked.
pub(crate) fn group_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
    silu: bool,
) -> Result<Tensor> {
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
    let name = if silu {
        "group-norm-silu"
    } else {
        "group-norm"
    };
    let backward = GnBackward { geo, silu, stats };
    attach3((x, weight, bias), name, out, backward)
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

fn gn_views<'a, T: Act>(
    ops: &GnBwdOperands<'a>,
    c: usize,
) -> Result<([CudaView<'a, T>; 2], [CudaView<'a, f32>; 2])> {
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

// ---------------------------------------------------------------- layer norm

/// [`super::layer_norm`] on a CUDA device; the arguments are already checked.
pub(crate) fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
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
    attach3(
        (x, weight, bias),
        "layer-norm",
        out,
        LnBackward { geo, stats },
    )
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

// ---------------------------------------------------------------- GEGLU

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
        let g = grad.detach().to_dtype(p.dtype())?.contiguous()?;
        p.detach().contiguous()?.apply_op2_no_bwd(&g, &GegluBwd)
    }
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
