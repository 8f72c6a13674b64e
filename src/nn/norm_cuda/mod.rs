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
//! backward that holds them. `γ`, `β` enter the kernels as f32 (a no-op for f32 parameters, one
//! small cast otherwise) and `dγ`, `dβ` come back as f32, cast to the parameters' dtype.
//!
//! One file per op beside this one; this one holds the loading and launching they share.

use std::sync::Mutex;

use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchArgs, LaunchConfig,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Tensor};

use super::norm_launch::Tuning;

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

mod geglu;
mod group_norm;
mod layer_norm;

pub(crate) use geglu::{geglu, geglu_grad};
pub(crate) use group_norm::group_norm_parts;
pub(crate) use layer_norm::{layer_norm, layer_norm_recomputed};

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
