//! Graph surgery for frozen bases: an op whose forward result is computed elsewhere (on detached
//! operands, so candle records nothing) and handed over, attached to ONE tracked argument with a
//! hand-written backward for that argument only.
//!
//! Candle's backward stores a gradient for every operand of an op, tracked or not. Where a
//! trainable path meets a constant (a LoRA's `down` applied to a frozen layer's input, a skip
//! connection from before the first adapter, the loss target) that is an activation-sized
//! gradient nobody reads. These helpers attach the result to the trainable side only:
//! - `matmul_const_lhs(x, w)` = `x·wᵀ`, gradient for `w` only: `∂L/∂w = gᵀ·x`;
//! - `conv2d_const_input(x, w)`, gradient for `w` only (candle's own weight-gradient formula);
//!   on a tracked `x` the trainable conv (`conv_grad::conv2d`), never candle's `Conv2D`, whose
//!   backward fails on inputs whose H and W differ in parity at stride 2;
//! - `cat_with_const(a, c, dim)` = `cat(a, c)`, gradient for `a` only: `g.narrow(dim, 0, a_len)`;
//! - `sub_const(a, c)` = `a − c`.
//!
//! Forward costs one extra output-sized copy (the handed-over result), which is freed at once.

use candle_core::{DType, Result, Tensor};

use super::BaseWeight;

use super::fused_op::{attach1, Backward1};

type Backward = Box<dyn Fn(&Tensor, &Tensor) -> Result<Tensor> + Send + Sync>;

/// A hand-written backward for the one tracked argument: `backward(arg, grad) -> ∂L/∂arg`.
struct HandOver(Backward);

impl Backward1 for HandOver {
    fn backward(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Tensor> {
        (self.0)(arg, grad)
    }
}

/// Attaches the precomputed `out` to `arg` with `backward(arg, grad) -> ∂L/∂arg`, through the
/// fused ops' carrier (`super::fused_op`).
fn hand_over(arg: &Tensor, name: &'static str, out: Tensor, backward: Backward) -> Result<Tensor> {
    attach1(arg, name, out, HandOver(backward))
}

/// Whether `t` is a constant here: untracked, on a backend the hand-over supports.
fn constant(t: &Tensor) -> bool {
    !t.track_op() && super::frozen::supported(t)
}

/// `x·wᵀ` (`x` `[N, in]`, `w` `[out, in]`); when `x` is a constant, only `w` gets a gradient.
pub fn matmul_const_lhs(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if !constant(x) || !w.track_op() {
        return x.matmul(&w.t()?);
    }
    let out = x.matmul(&w.detach().t()?)?;
    let x = x.clone();
    hand_over(
        w,
        "matmul-const-lhs",
        out,
        Box::new(move |_w, g| g.t()?.matmul(&x)),
    )
}

/// `conv2d(x, w)`; when `x` is a constant, only `w` gets a gradient. Otherwise the trainable
/// conv [`super::conv2d_trainable`], whose backward is right for every input shape.
pub fn conv2d_const_input(x: &Tensor, w: &Tensor, padding: usize, stride: usize) -> Result<Tensor> {
    if !constant(x) || !w.track_op() {
        return super::conv_grad::conv2d(x, w, padding, stride);
    }
    let out = super::conv2d_detached(x, w, padding, stride)?;
    let x = x.clone();
    hand_over(
        w,
        "conv2d-const-input",
        out,
        Box::new(move |w, g| {
            // candle's Conv2D weight gradient (backprop.rs), with stride and dilation swapped.
            let (_, _, k_h, k_w) = w.dims4()?;
            super::conv_grad::conv2d_weight_grad(&x, g, padding, stride, (k_h, k_w))
        }),
    )
}

/// `cat(a, c)` along `dim`; when `c` is a constant and `a` tracked, only `a` gets a gradient.
pub fn cat_with_const(a: &Tensor, c: &Tensor, dim: usize) -> Result<Tensor> {
    if !constant(c) || !a.track_op() {
        return Tensor::cat(&[a, c], dim);
    }
    let out = Tensor::cat(&[&a.detach(), c], dim)?;
    let len = a.dim(dim)?;
    hand_over(
        a,
        "cat-with-const",
        out,
        // A copy, not a view: a view would keep the whole gradient alive as `a`'s.
        Box::new(move |_a, g| g.narrow(dim, 0, len)?.force_contiguous()),
    )
}

/// `a − c`; when `c` is a constant, only `a` gets a gradient (the loss against its target).
pub fn sub_const(a: &Tensor, c: &Tensor) -> Result<Tensor> {
    if !constant(c) || !a.track_op() {
        return a - c;
    }
    let out = (a.detach() - c)?;
    hand_over(a, "sub-const", out, Box::new(|_a, g| Ok(g.clone())))
}

/// `a + b` where either side may be a constant: the constant gets no gradient.
pub fn add_maybe_const(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    match (constant(a) && b.track_op(), constant(b) && a.track_op()) {
        (true, _) => super::frozen_broadcast_add(b, a),
        (_, true) => super::frozen_broadcast_add(a, b),
        _ => a + b,
    }
}

/// The dtype a frozen layer computes in for `x`: `x`'s, but f32 for bf16 on the CPU, where candle
/// has no bf16 GEMM (f32 accumulation, rounded once, as cuBLAS/cuDNN do for bf16).
fn compute_dtype(x: &Tensor) -> DType {
    if super::cpu_bf16(x) {
        DType::F32
    } else {
        x.dtype()
    }
}

/// A frozen `x·Wᵀ + b` with only `x` getting a gradient, which keeps the weight as stored
/// ([`BaseWeight`]) and makes the weight it computes with twice, in the forward and in the
/// backward. Used where the stored weight is not the one computed with:
/// - an fp8 base weight: only its codes (one byte per weight) stay in memory between the two;
/// - a bf16 `x` on the CPU (computed in f32): the plain upcast path kept an f32 copy of every
///   frozen weight for the whole step.
pub fn frozen_linear_stored(x: &Tensor, w: &BaseWeight, b: Option<&Tensor>) -> Result<Tensor> {
    let x_dims = x.dims().to_vec();
    let (n, k) = match *w.dims() {
        [n, k] => (n, k),
        ref d => candle_core::bail!("frozen linear: a weight of shape {d:?}"),
    };
    if x_dims.last() != Some(&k) {
        candle_core::bail!("frozen linear: input {x_dims:?}, weight [{n}, {k}]");
    }
    let rows = x.elem_count() / k.max(1);
    let cd = compute_dtype(x);
    let mut y = x
        .detach()
        .to_dtype(cd)?
        .reshape((rows, k))?
        .matmul(&w.get(cd)?.t()?)?;
    if let Some(b) = b {
        y = y.broadcast_add(&b.detach().to_dtype(cd)?)?;
    }
    let mut out_dims = x_dims.clone();
    if let Some(last) = out_dims.last_mut() {
        *last = n;
    }
    let out = y.to_dtype(x.dtype())?.reshape(out_dims)?;
    let w = w.clone();
    hand_over(
        x,
        "frozen-linear-stored",
        out,
        Box::new(move |x, g| {
            g.to_dtype(cd)?
                .reshape((rows, n))?
                .matmul(&w.get(cd)?)?
                .to_dtype(x.dtype())?
                .reshape(x_dims.as_slice())
        }),
    )
}

/// A frozen `conv2d(x, W) + b` with only `x` getting a gradient, keeping the weight as stored, as
/// [`frozen_linear_stored`].
pub fn frozen_conv2d_stored(
    x: &Tensor,
    w: &BaseWeight,
    b: Option<&Tensor>,
    padding: usize,
    stride: usize,
) -> Result<Tensor> {
    let cd = compute_dtype(x);
    let mut y = super::conv2d_detached(&x.detach().to_dtype(cd)?, &w.get(cd)?, padding, stride)?;
    if let Some(b) = b {
        let b = b
            .detach()
            .to_dtype(cd)?
            .reshape((1, b.elem_count(), 1, 1))?;
        y = y.broadcast_add(&b)?;
    }
    let out = y.to_dtype(x.dtype())?;
    let (_, _, h, wd) = x.dims4()?;
    let w = w.clone();
    hand_over(
        x,
        "frozen-conv2d-stored",
        out,
        Box::new(move |x, g| {
            super::conv_grad::conv2d_input_grad(
                &g.to_dtype(cd)?,
                &w.get(cd)?,
                padding,
                stride,
                (h, wd),
            )?
            .to_dtype(x.dtype())
        }),
    )
}
