//! Frozen linear and conv layers whose backward returns only the input gradient.
//!
//! Candle's `Matmul`/`Conv2D` backward always computes and stores both operand gradients, so a
//! frozen weight `W` (a plain tensor) still costs a weight-gradient GEMM and a `W`-sized buffer in
//! the `GradStore`; a plain-tensor bias added with `broadcast_add` leaves an output-sized gradient
//! for its broadcast view (see ../shared/NOTES.md). For LoRA that undoes the memory savings. Here
//! the frozen layer is one custom op on `x`:
//!
//! - linear: `y = x·Wᵀ (+ b)` with `∂L/∂x = ∂L/∂y · W`, as a `CustomOp2`/`CustomOp3` whose forward
//!   calls the backend's own matmul (and broadcast add) through `BackendStorage`, on CPU and CUDA;
//! - conv: `y = conv2d(x, W) (+ b)` with `∂L/∂x` a stride-1 conv of the dilated gradient with the
//!   flipped kernel (`conv_grad`), the GEMM form of `conv_transpose2d(∂L/∂y, W)`. `BackendStorage::
//!   conv2d` cannot be called from outside candle (its `ParamsConv2D` has crate-private fields),
//!   so the forward runs candle's own conv on detached tensors and a `CustomOp1` on `x` hands that
//!   output over (one output-sized copy) and carries the input-only backward. This works on every
//!   backend.
//!
//! The weight and bias never get a `GradStore` entry. `*_reference` are the ordinary candle ops,
//! kept for the comparison test in `tests/frozen_op.rs`.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};

use super::output_slot::OutputSlot;

/// `x2d·wᵀ` for `x2d` `[m, k]` and `w` `[n, k]`; the backward yields only `∂L/∂x`.
pub fn frozen_matmul(x2d: &Tensor, w: &Tensor) -> Result<Tensor> {
    frozen_linear(x2d, w, None)
}

/// `x2d·wᵀ + b` for `x2d` `[m, k]`, `w` `[n, k]`, `b` `[n]`; the backward yields only `∂L/∂x`.
pub fn frozen_linear(x2d: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (_, k) = x2d.dims2()?;
    let (n, kw) = w.dims2()?;
    if k != kw {
        candle_core::bail!(
            "frozen linear: input has {k} features, weight {:?} wants {kw}",
            w.dims()
        );
    }
    check_dtype("frozen linear weight", x2d, w)?;
    // The backend matmul accepts only a few stride patterns; a contiguous lhs is always one.
    let x2d = x2d.contiguous()?;
    match bias {
        None => x2d.apply_op2(w, FrozenLinear),
        Some(b) => {
            check_dtype("frozen linear bias", &x2d, b)?;
            if b.dims() != [n] {
                candle_core::bail!("frozen linear: bias {:?}, want [{n}]", b.dims());
            }
            x2d.apply_op3(w, b, FrozenLinear)
        }
    }
}

/// The ordinary candle version of [`frozen_linear`] (stores weight and bias gradients).
pub fn frozen_linear_reference(x2d: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let y = x2d.matmul(&w.t()?)?;
    match bias {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// The ordinary candle version of [`frozen_matmul`].
pub fn frozen_matmul_reference(x2d: &Tensor, w: &Tensor) -> Result<Tensor> {
    frozen_linear_reference(x2d, w, None)
}

/// `conv2d(x, w)` (groups 1, dilation 1) for `x` `[B, C, H, W]`, `w` `[O, C, kh, kw]`; the
/// backward yields only `∂L/∂x`.
pub fn frozen_conv2d(x: &Tensor, w: &Tensor, padding: usize, stride: usize) -> Result<Tensor> {
    frozen_conv2d_bias(x, w, None, padding, stride)
}

/// [`frozen_conv2d`] plus a per-channel bias `b` `[O]`, folded into the same op so the bias gets
/// no gradient either.
pub fn frozen_conv2d_bias(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    padding: usize,
    stride: usize,
) -> Result<Tensor> {
    check_dtype("frozen conv2d weight", x, w)?;
    // Forward on detached operands: no graph node, so nothing here is differentiated.
    let mut y = super::conv2d_detached(x, w, padding, stride)?;
    if let Some(b) = bias {
        check_dtype("frozen conv2d bias", x, b)?;
        let b = b.detach().reshape((1, b.elem_count(), 1, 1))?;
        y = y.broadcast_add(&b)?;
    }
    if !x.track_op() {
        return Ok(y);
    }
    x.apply_op1(FrozenConv {
        w: w.detach(),
        padding,
        stride,
        out: OutputSlot::new("frozen conv2d", y)?,
    })
}

/// The ordinary candle version of [`frozen_conv2d_bias`] (stores weight and bias gradients).
pub fn frozen_conv2d_reference(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    padding: usize,
    stride: usize,
) -> Result<Tensor> {
    let y = x.conv2d(w, padding, stride, 1, 1)?;
    match bias {
        Some(b) => y.broadcast_add(&b.reshape((1, b.elem_count(), 1, 1))?),
        None => Ok(y),
    }
}

fn check_dtype(what: &str, x: &Tensor, p: &Tensor) -> Result<()> {
    if x.dtype() != p.dtype() {
        candle_core::bail!(
            "{what}: dtype {:?} differs from the input's {:?}",
            p.dtype(),
            x.dtype()
        );
    }
    Ok(())
}

/// `y = x·wᵀ (+ b)` on raw storage: the backend's matmul with `w` viewed transposed, then the
/// backend's broadcast add.
fn linear_fwd<S: BackendStorage>(
    x: &S,
    lx: &Layout,
    w: &S,
    lw: &Layout,
    bias: Option<(&S, &Layout)>,
) -> Result<(S, Shape)> {
    let (m, k) = lx.shape().dims2()?;
    let (n, _) = lw.shape().dims2()?;
    let wt = lw.transpose(0, 1)?;
    let y = x.matmul(w, (1, m, n, k), lx, &wt)?;
    let ly = Layout::contiguous((m, n));
    let y = match bias {
        Some((b, lb)) => {
            y.binary_impl::<candle_core::op::Add>(b, &ly, &lb.broadcast_as((m, n))?)?
        }
        None => y,
    };
    Ok((y, Shape::from((m, n))))
}

/// `∂L/∂x = ∂L/∂y · w`, the only gradient a frozen linear passes back.
fn linear_bwd(w: &Tensor, grad: &Tensor) -> Result<Tensor> {
    grad.matmul(w)
}

struct FrozenLinear;

impl CustomOp2 for FrozenLinear {
    fn name(&self) -> &'static str {
        "frozen-linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        linear_fwd(x, lx, w, lw, None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        linear_fwd(x, lx, w, lw, None)
    }

    fn bwd(
        &self,
        _x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(linear_bwd(w, grad)?), None))
    }
}

impl CustomOp3 for FrozenLinear {
    fn name(&self) -> &'static str {
        "frozen-linear-bias"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        linear_fwd(x, lx, w, lw, Some((b, lb)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        linear_fwd(x, lx, w, lw, Some((b, lb)))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        Ok((Some(linear_bwd(w, grad)?), None, None))
    }
}

/// Carries a conv output computed outside the graph (see the module docs) and the input-only
/// backward. `out` is taken by the forward, so the graph keeps just `w`, not a second output.
struct FrozenConv {
    w: Tensor,
    padding: usize,
    stride: usize,
    out: OutputSlot,
}

impl CustomOp1 for FrozenConv {
    fn name(&self) -> &'static str {
        "frozen-conv2d"
    }

    fn cpu_fwd(&self, _x: &CpuStorage, _lx: &Layout) -> Result<(CpuStorage, Shape)> {
        self.out.cpu()
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _x: &candle_core::CudaStorage,
        _lx: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.out.cuda()
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // ∂L/∂x as a stride-1 convolution (im2col + GEMM), not candle's naive conv_transpose2d.
        let (_, _, x_h, x_w) = x.dims4()?;
        let gx = super::conv_grad::conv2d_input_grad(
            grad,
            &self.w,
            self.padding,
            self.stride,
            (x_h, x_w),
        )?;
        Ok(Some(gx))
    }
}

/// `x + c` with `c` broadcast to `x`'s shape and treated as a constant: the backward passes the
/// gradient to `x` only. Candle's `Add` backward stores an `x`-sized gradient for the broadcast
/// view of an untracked `c` (a frozen norm bias, a frozen layer's output, an attention mask) that
/// nothing ever reads; this op stores none.
pub fn frozen_broadcast_add(x: &Tensor, c: &Tensor) -> Result<Tensor> {
    check_dtype("frozen broadcast add", x, c)?;
    x.apply_op2(c, FrozenBinary::Add)
}

/// `x · c` with `c` broadcast to `x`'s shape and treated as a constant (a frozen norm scale):
/// `∂L/∂x = ∂L/∂y · c`, and no gradient for `c`.
pub fn frozen_broadcast_mul(x: &Tensor, c: &Tensor) -> Result<Tensor> {
    check_dtype("frozen broadcast mul", x, c)?;
    x.apply_op2(c, FrozenBinary::Mul)
}

#[derive(Debug, Clone, Copy)]
enum FrozenBinary {
    Add,
    Mul,
}

impl FrozenBinary {
    fn fwd<S: BackendStorage>(self, x: &S, lx: &Layout, c: &S, lc: &Layout) -> Result<(S, Shape)> {
        let lcb = lc.broadcast_as(lx.shape().clone())?;
        let y = match self {
            Self::Add => x.binary_impl::<candle_core::op::Add>(c, lx, &lcb)?,
            Self::Mul => x.binary_impl::<candle_core::op::Mul>(c, lx, &lcb)?,
        };
        Ok((y, lx.shape().clone()))
    }
}

impl CustomOp2 for FrozenBinary {
    fn name(&self) -> &'static str {
        match self {
            Self::Add => "frozen-broadcast-add",
            Self::Mul => "frozen-broadcast-mul",
        }
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        c: &CpuStorage,
        lc: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.fwd(x, lx, c, lc)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        c: &candle_core::CudaStorage,
        lc: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.fwd(x, lx, c, lc)
    }

    fn bwd(
        &self,
        _x: &Tensor,
        c: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let gx = match self {
            Self::Add => grad.clone(),
            Self::Mul => grad.broadcast_mul(c)?,
        };
        Ok((Some(gx), None))
    }
}

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turns the routing of frozen Linear/Conv2d layers through these ops on (the default) or off,
/// process-wide. Off reproduces candle's plain ops, for before/after benchmarks.
pub fn set_frozen_ops_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed)
}

/// Whether layers use the frozen ops for `t`: enabled, and on a device they run on (CPU always;
/// CUDA with the `cuda` feature). Elsewhere (Metal) layers keep the plain ops.
pub(crate) fn supported(t: &Tensor) -> bool {
    ENABLED.load(Ordering::Relaxed) && custom_op_device(t)
}

/// Whether `t` is on a device our custom ops have forwards for (CPU always; CUDA with the `cuda`
/// feature). The trainable conv and chunked attention use it directly: they are not frozen ops,
/// so [`set_frozen_ops_enabled`] does not switch them.
pub(crate) fn custom_op_device(t: &Tensor) -> bool {
    t.device().is_cpu() || (cfg!(feature = "cuda") && t.device().is_cuda())
}

/// Whether `p` is a frozen parameter: a plain tensor that no gradient flows into.
pub(crate) fn is_frozen(p: &Tensor) -> bool {
    !p.track_op()
}

/// `x + c` broadcast, through [`frozen_broadcast_add`] when `c` is a constant (untracked) and the
/// input is tracked, so no `c`-gradient is stored; the plain op otherwise.
pub fn broadcast_add_const(x: &Tensor, c: &Tensor) -> Result<Tensor> {
    if is_frozen(c) && !is_frozen(x) && supported(x) && x.dtype() == c.dtype() {
        frozen_broadcast_add(x, c)
    } else {
        x.broadcast_add(c)
    }
}

/// `x · c` broadcast, through [`frozen_broadcast_mul`] when `c` is a constant; see
/// [`broadcast_add_const`].
pub fn broadcast_mul_const(x: &Tensor, c: &Tensor) -> Result<Tensor> {
    if is_frozen(c) && !is_frozen(x) && supported(x) && x.dtype() == c.dtype() {
        frozen_broadcast_mul(x, c)
    } else {
        x.broadcast_mul(c)
    }
}
