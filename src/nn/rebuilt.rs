//! A frozen layer plus a trainable weight update that is rebuilt from small factors (LyCORIS's
//! LoHa, LoKr and DoRA) as ONE op: `y = op(x, W) + op(x, U) + b`, `U = rebuild(θ)`.
//!
//! Composed from candle ops, the graph keeps every weight-sized intermediate of `rebuild` until
//! the backward (LoHa: both rank products, their Hadamard product, its scaled copy and the cast
//! copy; DoRA: the merged weight, its normalised copy and more), per adapted layer: on the real
//! SD1.5 UNet that is several copies of the whole UNet in f32 (docs/BENCHMARKS.md, 2026-11-25).
//! This op holds only `x`, the packed factors `θ` (a flat f32 vector) and the frozen weight as
//! stored. The backward rebuilds `U` from `θ` and takes the factors' gradient through it,
//! `∂L/∂θ = J_rebuild(θ)ᵀ · ∂L/∂U` with `∂L/∂U = gᵀ·x` (a linear's weight gradient, a conv's on a
//! conv), by a small backward pass over `rebuild` alone: LyCORIS's `HadaWeight` and `KronWeight`
//! autograd functions recompute the same way. The weight-sized tensors live for one layer's
//! backward, not for the whole step.
//!
//! The layer and the update stay two products, `op(x, W) + op(x, U)`, not one on `W + U`: in
//! bf16, `W + U` would round a small update away.
//!
//! On the CPU in bf16, where candle has no bf16 GEMM, the forward and backward compute in f32 and
//! round once, as the frozen layers do. `θ` and its gradient are f32.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor, Var};

use super::fused_op::{attach2, if_tracked, Backward2};
use super::BaseWeight;

/// Builds the f32 weight update `U` (the wrapped weight's shape) from the packed factors.
pub type Rebuild = Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

/// The trainable side of the op: the factors packed into one flat f32 vector (tracked; a `cat`
/// of the Vars' flattened tensors routes its gradient back to each Var), and how to rebuild `U`.
pub struct WeightUpdate<'a> {
    pub packed: &'a Tensor,
    pub rebuild: Rebuild,
}

/// The dtype the op computes in: the input's, but f32 for bf16 on the CPU.
fn compute_dtype(x: &Tensor) -> DType {
    if super::cpu_bf16(x) {
        DType::F32
    } else {
        x.dtype()
    }
}

/// `U` rebuilt from detached factors, checked against the weight's shape.
fn rebuilt(up: &Rebuild, packed: &Tensor, w: &BaseWeight) -> Result<Tensor> {
    let u = up(&packed.detach())?;
    if u.dims() != w.dims() {
        candle_core::bail!(
            "an adapter's update {:?} does not fit its layer's weight {:?}",
            u.dims(),
            w.dims()
        );
    }
    Ok(u)
}

/// `U` for the backward, rebuilt once for both gradients: tracked through a fresh Var of the
/// factors when they want a gradient ([`factor_grad`]), detached otherwise.
fn rebuilt_for_backward(
    up: &Rebuild,
    packed: &Tensor,
    w: &BaseWeight,
) -> Result<(Tensor, Option<Var>)> {
    if !packed.track_op() {
        return Ok((rebuilt(up, packed, w)?, None));
    }
    let theta = Var::from_tensor(&packed.detach().to_dtype(DType::F32)?)?;
    let u = up(theta.as_tensor())?;
    if u.dims() != w.dims() {
        candle_core::bail!(
            "an adapter's update {:?} does not fit its layer's weight {:?}",
            u.dims(),
            w.dims()
        );
    }
    Ok((u, Some(theta)))
}

/// `J_rebuild(θ)ᵀ · du`: the factors' gradient for the update's gradient `du`, by a backward pass
/// over `rebuild` alone (the surrogate `Σ U ⊙ du`, `u` built from `theta` by
/// [`rebuilt_for_backward`]).
fn factor_grad(u: Tensor, theta: &Var, du: &Tensor) -> Result<Tensor> {
    let grads = (u * du.to_dtype(DType::F32)?)?.sum_all()?.backward()?;
    match grads.get(theta.as_tensor()) {
        Some(g) => Ok(g.clone()),
        None => theta.zeros_like(),
    }
}

/// `x·Wᵀ + b + x·Uᵀ` over the last dimension of `x`, with `W` `[out, in]` and `b` `[out]`
/// frozen. `x` and the packed factors get gradients where they are tracked.
pub fn frozen_linear_rebuilt(
    x: &Tensor,
    w: &BaseWeight,
    b: Option<&Tensor>,
    up: WeightUpdate<'_>,
) -> Result<Tensor> {
    let (out_dim, in_dim) = match *w.dims() {
        [o, i] => (o, i),
        ref d => candle_core::bail!("rebuilt linear: a weight of shape {d:?}"),
    };
    let x_dims = x.dims().to_vec();
    if x_dims.last() != Some(&in_dim) {
        candle_core::bail!("rebuilt linear: input {x_dims:?}, weight [{out_dim}, {in_dim}]");
    }
    let cd = compute_dtype(x);
    let u = rebuilt(&up.rebuild, up.packed, w)?.to_dtype(cd)?;
    let rows = x.elem_count() / in_dim.max(1);
    let x2 = x.detach().reshape((rows, in_dim))?.to_dtype(cd)?;
    let mut y = (x2.matmul(&w.get(cd)?.t()?)? + x2.matmul(&u.t()?)?)?;
    drop((x2, u));
    if let Some(b) = b {
        y = y.broadcast_add(&b.detach().to_dtype(cd)?)?;
    }
    let mut out_dims = x_dims.clone();
    if let Some(last) = out_dims.last_mut() {
        *last = out_dim;
    }
    let y = y.to_dtype(x.dtype())?.reshape(out_dims)?;
    let backward = LinearBackward {
        w: w.clone(),
        rebuild: up.rebuild,
        cd,
        rows,
        x_dims,
    };
    attach2((x, up.packed), "frozen-linear-rebuilt", y, backward)
}

struct LinearBackward {
    /// The frozen weight as stored (dequantised again here for fp8).
    w: BaseWeight,
    rebuild: Rebuild,
    cd: DType,
    rows: usize,
    x_dims: Vec<usize>,
}

impl Backward2 for LinearBackward {
    fn backward(
        &self,
        x: &Tensor,
        packed: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let cd = self.cd;
        let (out_dim, in_dim) = (self.w.dims()[0], self.w.dims()[1]);
        let g = grad.reshape((self.rows, out_dim))?.to_dtype(cd)?;
        let (u, theta) = rebuilt_for_backward(&self.rebuild, packed, &self.w)?;
        let dx = if_tracked(x, || {
            let u = u.detach().to_dtype(cd)?;
            (g.matmul(&self.w.get(cd)?)? + g.matmul(&u)?)?.reshape(self.x_dims.as_slice())
        })?;
        let d_packed = match theta {
            Some(theta) => {
                let x2 = x.detach().reshape((self.rows, in_dim))?.to_dtype(cd)?;
                let du = g.t()?.matmul(&x2)?;
                drop(x2);
                Some(factor_grad(u, &theta, &du)?)
            }
            None => None,
        };
        Ok((dx, d_packed))
    }
}

/// `conv2d(x, W) + b + conv2d(x, U)` for `x` `[B, C, H, W]`, `W` and `U` `[O, C, kh, kw]` and
/// `b` `[O]`, with the base's `padding` and `stride`.
pub fn frozen_conv2d_rebuilt(
    x: &Tensor,
    w: &BaseWeight,
    b: Option<&Tensor>,
    padding: usize,
    stride: usize,
    up: WeightUpdate<'_>,
) -> Result<Tensor> {
    let out_ch = match *w.dims() {
        [o, _, _, _] => o,
        ref d => candle_core::bail!("rebuilt conv: a weight of shape {d:?}"),
    };
    let cd = compute_dtype(x);
    let u = rebuilt(&up.rebuild, up.packed, w)?.to_dtype(cd)?;
    let xc = x.detach().to_dtype(cd)?;
    let base = super::conv2d_detached(&xc, &w.get(cd)?, padding, stride)?;
    let mut y = (base + super::conv2d_detached(&xc, &u, padding, stride)?)?;
    drop((xc, u));
    if let Some(b) = b {
        y = y.broadcast_add(&b.detach().to_dtype(cd)?.reshape((1, out_ch, 1, 1))?)?;
    }
    let y = y.to_dtype(x.dtype())?;
    let (_, _, x_h, x_w) = x.dims4()?;
    let backward = ConvBackward {
        w: w.clone(),
        rebuild: up.rebuild,
        cd,
        padding,
        stride,
        x_hw: (x_h, x_w),
    };
    attach2((x, up.packed), "frozen-conv2d-rebuilt", y, backward)
}

struct ConvBackward {
    /// The frozen weight as stored (dequantised again here for fp8).
    w: BaseWeight,
    rebuild: Rebuild,
    cd: DType,
    padding: usize,
    stride: usize,
    x_hw: (usize, usize),
}

impl Backward2 for ConvBackward {
    fn backward(
        &self,
        x: &Tensor,
        packed: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        use super::conv_grad::{conv2d_input_grad, conv2d_weight_grad};
        let cd = self.cd;
        let g = grad.to_dtype(cd)?;
        let (p, s) = (self.padding, self.stride);
        let (u, theta) = rebuilt_for_backward(&self.rebuild, packed, &self.w)?;
        let dx = if_tracked(x, || {
            let u = u.detach().to_dtype(cd)?;
            let base = conv2d_input_grad(&g, &self.w.get(cd)?, p, s, self.x_hw)?;
            base + conv2d_input_grad(&g, &u, p, s, self.x_hw)?
        })?;
        let d_packed = match theta {
            Some(theta) => {
                let (kh, kw) = (self.w.dims()[2], self.w.dims()[3]);
                let du = conv2d_weight_grad(&x.detach().to_dtype(cd)?, &g, p, s, (kh, kw))?;
                Some(factor_grad(u, &theta, &du)?)
            }
            None => None,
        };
        Ok((dx, d_packed))
    }
}

#[cfg(test)]
#[path = "rebuilt_tests.rs"]
mod tests;
