//! Half a frozen resnet block as one op: `conv2d(silu(group_norm(x)), W) + b + extra`, with the
//! norm's `γ`, `β` and the conv frozen (LoRA training on layers that carry no adapter).
//!
//! As separate ops the graph keeps the norm's output (the conv holds it as its argument, though a
//! frozen conv's backward reads only `W`) and the conv's output (the add after it holds it): two
//! block-sized tensors per half that torch does not keep. Here the forward runs on detached
//! operands and the op holds `x` and the extra operand:
//!
//! ```text
//! ∂L/∂u = conv2d_input_grad(g, W)          (u = silu(group_norm(x)), never kept)
//! ∂L/∂x = the fused GroupNorm+SiLU backward of ∂L/∂u at x   (its statistics, one f32 pair per
//!                                                            sample and group, are kept)
//! extra: Channels(t)  `[B, O]` broadcast over H, W (the resnet's time embedding): ∂L/∂t = Σ_hw g
//!        Residual(r)  `r` of the output's shape: ∂L/∂r = g
//!        Shortcut(r, Ws, bs)  a frozen 1×1 conv of `r`: ∂L/∂r = conv2d_input_grad(g, Ws)
//! ```

use candle_core::{Result, Tensor};

use super::fused_op::{attach2, Backward2, Backward3};
use super::{BaseWeight, Conv2d, GroupNorm};

/// What is added to the conv's output.
pub enum Extra<'a> {
    /// `t` `[B, O]`, broadcast over height and width.
    Channels(&'a Tensor),
    /// `r`, the output's shape.
    Residual(&'a Tensor),
    /// `shortcut(r)`, a frozen 1×1 conv without an adapter.
    Shortcut(&'a Tensor, &'a Conv2d),
}

/// Whether `conv` is frozen, has no adapter and runs through our conv kernels for `x`: its weight
/// is stored in `x`'s dtype, or in fp8 (dequantised to it).
fn plain_frozen(conv: &Conv2d, x: &Tensor) -> bool {
    conv.adapter.is_none()
        && super::frozen::is_frozen(&conv.weight)
        && conv.bias.as_ref().is_none_or(super::frozen::is_frozen)
        && (conv.weight_scale.is_some() || conv.weight.dtype() == x.dtype())
        && conv.bias.as_ref().is_none_or(|b| b.dtype() == x.dtype())
}

/// Whether [`group_norm_silu_conv`] runs as one op for these operands and layers (see there);
/// a caller chaining two such ops asks for both before running the first.
pub fn group_norm_silu_conv_applies(
    x: &Tensor,
    norm: &GroupNorm,
    conv: &Conv2d,
    extra: &Extra<'_>,
) -> bool {
    let frozen_norm =
        super::frozen::is_frozen(&norm.weight) && super::frozen::is_frozen(&norm.bias);
    let shortcut_ok = match extra {
        Extra::Shortcut(r, sc) => plain_frozen(sc, r) && sc.cfg.kernel == 1 && sc.cfg.stride == 1,
        _ => true,
    };
    frozen_norm
        && plain_frozen(conv, x)
        && shortcut_ok
        && !super::cpu_bf16(x)
        && super::fused_op::use_fused(x)
        && super::frozen::supported(x)
}

/// `conv(silu(norm(x))) + extra` as one op, or `None` where it does not apply (a trainable norm or
/// conv, an adapter on either conv, bf16 on the CPU, the fused or frozen ops switched off): the
/// caller then composes the layers.
pub fn group_norm_silu_conv(
    x: &Tensor,
    norm: &GroupNorm,
    conv: &Conv2d,
    extra: Extra<'_>,
) -> Result<Option<Tensor>> {
    if !group_norm_silu_conv_applies(x, norm, conv, &extra) {
        return Ok(None);
    }
    let (w, b) = (&norm.weight, &norm.bias);
    let (u, norm_backward) = super::group_norm::parts(x, w, b, norm.groups, norm.eps, true)?;
    let (p, s) = (conv.cfg.padding, conv.cfg.stride);
    let dt = x.dtype();
    let mut y = with_bias(
        super::conv2d_detached(&u, &conv.base_weight().get(dt)?, p, s)?,
        conv,
    )?;
    drop(u);
    let (other, kind) = match extra {
        Extra::Channels(t) => {
            let (bt, ct) = t.dims2()?;
            y = y.broadcast_add(&t.detach().reshape((bt, ct, 1, 1))?)?;
            (t, ExtraKind::Channels)
        }
        Extra::Residual(r) => {
            y = (y + r.detach())?;
            (r, ExtraKind::Residual)
        }
        Extra::Shortcut(r, sc) => {
            let ws = sc.base_weight();
            y = (y + with_bias(super::conv2d_detached(r, &ws.get(r.dtype())?, 0, 1)?, sc)?)?;
            (r, ExtraKind::Shortcut(ws))
        }
    };
    let (_, _, h, wd) = x.dims4()?;
    let backward = NormConvBackward {
        norm: norm_backward,
        gamma: w.detach(),
        beta: b.detach(),
        w: conv.base_weight(),
        padding: p,
        stride: s,
        x_hw: (h, wd),
        extra: kind,
    };
    Ok(Some(attach2(
        (x, other),
        "group-norm-silu-conv",
        y,
        backward,
    )?))
}

fn with_bias(y: Tensor, conv: &Conv2d) -> Result<Tensor> {
    match &conv.bias {
        Some(b) => y.broadcast_add(&b.detach().reshape((1, b.elem_count(), 1, 1))?),
        None => Ok(y),
    }
}

enum ExtraKind {
    Channels,
    Residual,
    /// The shortcut's frozen 1×1 weight, as stored.
    Shortcut(BaseWeight),
}

struct NormConvBackward {
    /// The fused GroupNorm+SiLU's backward (its statistics), `γ` and `β`.
    norm: Box<dyn Backward3>,
    gamma: Tensor,
    beta: Tensor,
    /// The conv's weight as stored (dequantised again here for fp8).
    w: BaseWeight,
    padding: usize,
    stride: usize,
    x_hw: (usize, usize),
    extra: ExtraKind,
}

impl Backward2 for NormConvBackward {
    fn backward(
        &self,
        x: &Tensor,
        other: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        use super::conv_grad::conv2d_input_grad;
        let g = grad.to_dtype(res.dtype())?;
        let dx = if x.track_op() {
            let w = self.w.get(g.dtype())?;
            let gu = conv2d_input_grad(&g, &w, self.padding, self.stride, self.x_hw)?;
            // The norm's backward takes `res` for its output; it reads only `x` and the gradient.
            let (dx, _, _) = self.norm.backward(x, &self.gamma, &self.beta, &gu, &gu)?;
            dx
        } else {
            None
        };
        let d_other = if other.track_op() {
            Some(
                match &self.extra {
                    ExtraKind::Channels => g.sum((2, 3))?,
                    ExtraKind::Residual => g.clone(),
                    ExtraKind::Shortcut(ws) => {
                        let (_, _, h, w) = other.dims4()?;
                        conv2d_input_grad(&g, &ws.get(g.dtype())?, 0, 1, (h, w))?
                    }
                }
                .to_dtype(other.dtype())?,
            )
        } else {
            None
        };
        Ok((dx, d_other))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::test_util::{assert_parity, fill};
    use crate::nn::{add_maybe_const, frozen_conv2d_bias, group_norm_silu_reference, Conv2dConfig};

    fn norm(c: usize) -> GroupNorm {
        GroupNorm {
            path: "norm".into(),
            weight: (fill(&[c], 41, 1.0) + 1.5).unwrap(),
            bias: fill(&[c], 42, 0.5),
            groups: 2,
            eps: 1e-5,
        }
    }

    fn conv(i: usize, o: usize, kernel: usize, seed: u64) -> Conv2d {
        Conv2d {
            path: "conv".into(),
            weight: fill(&[o, i, kernel, kernel], seed, 0.5),
            weight_scale: None,
            bias: Some(fill(&[o], seed + 1, 0.5)),
            cfg: Conv2dConfig::same(kernel),
            adapter: None,
        }
    }

    /// The composed layers: norm + SiLU, the frozen conv, then the extra term.
    fn composed(x: &Tensor, n: &GroupNorm, c: &Conv2d, extra: &Extra<'_>) -> Result<Tensor> {
        let u = group_norm_silu_reference(x, &n.weight, &n.bias, n.groups, n.eps)?;
        let y = frozen_conv2d_bias(&u, &c.weight, c.bias.as_ref(), 1, 1)?;
        // (Plain adds would store a gradient for a constant operand.)
        match extra {
            Extra::Channels(t) => {
                let (b, ch) = t.dims2()?;
                let t = t.reshape((b, ch, 1, 1))?.broadcast_as(y.shape())?;
                add_maybe_const(&y, &t)
            }
            Extra::Residual(r) => add_maybe_const(&y, r),
            Extra::Shortcut(r, sc) => add_maybe_const(
                &y,
                &frozen_conv2d_bias(r, &sc.weight, sc.bias.as_ref(), 0, 1)?,
            ),
        }
    }

    /// Each extra term, with the extra operand tracked and constant: the input's gradient goes
    /// back through the conv and the fused norm (a wrong kernel or a missed SiLU term fails), the
    /// extra's through its own rule (a missing sum over H, W or a shortcut gradient taken as the
    /// identity fails).
    #[test]
    fn matches_the_composed_layers() {
        let (n, c) = (norm(4), conv(4, 6, 3, 43));
        let sc = conv(4, 6, 1, 45);
        let x = fill(&[2, 4, 5, 6], 47, 2.0);
        let t = fill(&[2, 6], 48, 1.0);
        let r6 = fill(&[2, 6, 5, 6], 49, 1.0);
        for track_other in [true, false] {
            let track = [true, track_other];
            assert_parity(
                "channels",
                &[x.clone(), t.clone()],
                &track,
                1e-5,
                &|a| Ok(group_norm_silu_conv(&a[0], &n, &c, Extra::Channels(&a[1]))?.unwrap()),
                &|a| composed(&a[0], &n, &c, &Extra::Channels(&a[1])),
            );
            assert_parity(
                "residual",
                &[x.clone(), r6.clone()],
                &track,
                1e-5,
                &|a| Ok(group_norm_silu_conv(&a[0], &n, &c, Extra::Residual(&a[1]))?.unwrap()),
                &|a| composed(&a[0], &n, &c, &Extra::Residual(&a[1])),
            );
            assert_parity(
                "shortcut",
                &[x.clone(), fill(&[2, 4, 5, 6], 50, 1.0)],
                &track,
                1e-5,
                &|a| Ok(group_norm_silu_conv(&a[0], &n, &c, Extra::Shortcut(&a[1], &sc))?.unwrap()),
                &|a| composed(&a[0], &n, &c, &Extra::Shortcut(&a[1], &sc)),
            );
        }
    }

    /// The graph keeps the two operands and the output, not the norm's or the conv's output.
    #[test]
    fn keeps_neither_the_norm_nor_the_conv_output() {
        let (n, c) = (norm(4), conv(4, 4, 3, 43));
        let var = |t: Tensor| {
            candle_core::Var::from_tensor(&t)
                .unwrap()
                .as_tensor()
                .clone()
        };
        let x = var(fill(&[1, 4, 4, 4], 47, 2.0));
        let r = var(fill(&[1, 4, 4, 4], 51, 1.0));
        let y = group_norm_silu_conv(&x, &n, &c, Extra::Residual(&r))
            .unwrap()
            .unwrap();
        assert_eq!(y.sorted_nodes().len(), 3);
    }

    /// A trainable conv, or one with an adapter, is left to the composed layers.
    #[test]
    fn declines_trainable_layers() {
        let n = norm(4);
        let mut c = conv(4, 4, 3, 43);
        let x = fill(&[1, 4, 4, 4], 47, 2.0);
        c.weight = candle_core::Var::from_tensor(&c.weight)
            .unwrap()
            .as_tensor()
            .clone();
        assert!(group_norm_silu_conv(&x, &n, &c, Extra::Residual(&x))
            .unwrap()
            .is_none());
    }
}
