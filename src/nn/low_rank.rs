//! A frozen layer plus a trainable low-rank addition (LoRA on a Linear, LoCon on a Conv2d) as ONE
//! op: `y = base(x) + s · up(m ⊙ down(x))`.
//!
//! Composed from candle ops, the addition keeps five layer-output-sized tensors alive until the
//! backward: the base output, `up`'s output, its scaled copy, and the sum's two operands. Only the
//! sum is needed downstream, and the backward needs none of them: `∂L/∂up = s·gᵀ·h`,
//! `∂L/∂h = s·g·up` (times the dropout mask), `∂L/∂down = (∂L/∂h)ᵀ·x`,
//! `∂L/∂x = g·W + (∂L/∂h)·down`. So this op computes the forward on detached operands (the fused
//! ops' carrier, [`super::fused_op`]), keeps the rank-r `h = m ⊙ down(x)` (and the mask), and
//! holds `x`, `down` and `up` as its arguments: per adapted layer, three output-sized tensors
//! fewer than the composed form (SD1.5 LoRA at 512 px: about 1 GiB in bf16).
//!
//! On the CPU in bf16, where candle has no bf16 GEMM, the forward and backward compute in f32 and
//! round once, as the frozen layers do. The Vars stay f32; the gradients returned for them are f32.

use candle_core::{DType, Result, Tensor};

use super::fused_op::{attach3, attach_n, if_tracked, Backward3, BackwardN, Grads3};
use super::BaseWeight;

/// The inverted-dropout mask for `h = down(x)`: `0` or `1/(1-p)` per element, `h`'s shape, dtype
/// and device; `None` when dropout is off.
pub type DropoutMask<'a> = &'a dyn Fn(&Tensor) -> Result<Option<Tensor>>;

/// The trainable pair of a low-rank addition and how it is applied.
pub struct LowRank<'a> {
    /// `[r, in]` on a linear; on a conv `[r, in, kh, kw]`, with the base's stride and padding.
    pub down: &'a Tensor,
    /// `[out, r]` on a linear, `[out, r, 1, 1]` on a conv.
    pub up: &'a Tensor,
    /// `alpha / rank`.
    pub scale: f64,
    pub dropout: DropoutMask<'a>,
}

/// The dtype the op computes in: the input's, but f32 for bf16 on the CPU.
fn compute_dtype(x: &Tensor) -> DType {
    if super::cpu_bf16(x) {
        DType::F32
    } else {
        x.dtype()
    }
}

/// `s · up` in `dtype` (scaled in f32, rounded once), detached. The forward makes it once and
/// its backward reuses it: the cast and the scaling are a kernel each on a GPU.
fn scaled(up: &Tensor, scale: f64, dtype: DType) -> Result<Tensor> {
    times(&up.detach().to_dtype(DType::F32)?, scale)?.to_dtype(dtype)
}

/// `s · t`; `t` itself when `s` is 1 (kohya's `alpha = rank`), where the product is exact and
/// the multiply would be one more kernel launch for nothing (up to the sign of a zero).
fn times(t: &Tensor, scale: f64) -> Result<Tensor> {
    if scale == 1.0 {
        Ok(t.clone())
    } else {
        t.affine(scale, 0.0)
    }
}

/// `h ⊙ mask` when there is a mask.
fn masked(h: Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
    match mask {
        Some(m) => h * m,
        None => Ok(h),
    }
}

/// `x·Wᵀ + b + s·(m ⊙ x·downᵀ)·upᵀ` over the last dimension of `x`, with `W` `[out, in]` and
/// `b` `[out]` frozen (plain tensors: they get no gradient), plus `residual` when there is one
/// (see [`with_residual`]). `x`, `down`, `up` and the residual get gradients where they are
/// tracked.
pub fn frozen_linear_low_rank(
    x: &Tensor,
    w: &BaseWeight,
    b: Option<&Tensor>,
    lr: LowRank<'_>,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let (y, backward) = linear_forward(x, w, b, &lr)?;
    with_residual(
        (x, lr.down, lr.up),
        "frozen-linear-low-rank",
        y,
        backward,
        residual,
    )
}

/// The low-rank linear's output for the input `x` (its value only: nothing is tracked), in
/// `x`'s dtype, and what its backward keeps.
pub(super) fn linear_forward(
    x: &Tensor,
    w: &BaseWeight,
    b: Option<&Tensor>,
    lr: &LowRank<'_>,
) -> Result<(Tensor, LinearBackward)> {
    let (out_dim, in_dim) = match *w.dims() {
        [o, i] => (o, i),
        ref d => candle_core::bail!("low-rank linear: a weight of shape {d:?}"),
    };
    let x_dims = x.dims().to_vec();
    if x_dims.last() != Some(&in_dim) {
        candle_core::bail!("low-rank linear: input {x_dims:?}, weight [{out_dim}, {in_dim}]");
    }
    let (rank, down_in) = lr.down.dims2()?;
    if down_in != in_dim || lr.up.dims2()? != (out_dim, rank) {
        candle_core::bail!(
            "low-rank linear: down {:?} and up {:?} do not fit the weight [{out_dim}, {in_dim}]",
            lr.down.dims(),
            lr.up.dims()
        );
    }
    let cd = compute_dtype(x);
    let rows = x.elem_count() / in_dim.max(1);
    let x2 = x.detach().reshape((rows, in_dim))?.to_dtype(cd)?;
    let down = lr.down.detach().to_dtype(cd)?;
    let h = x2.matmul(&down.t()?)?;
    let mask = (lr.dropout)(&h)?;
    let h = masked(h, mask.as_ref())?;
    let mut y = x2.matmul(&w.get(cd)?.t()?)?;
    drop(x2);
    if let Some(b) = b {
        y = y.broadcast_add(&b.detach().to_dtype(cd)?)?;
    }
    let up = scaled(lr.up, lr.scale, cd)?;
    let y = (y + h.matmul(&up.t()?)?)?;
    let mut out_dims = x_dims.clone();
    if let Some(last) = out_dims.last_mut() {
        *last = out_dim;
    }
    let y = y.to_dtype(x.dtype())?.reshape(out_dims)?;
    let backward = LinearBackward {
        w: w.clone(),
        h,
        down,
        up,
        mask,
        scale: lr.scale,
        rows,
        x_dims,
    };
    Ok((y, backward))
}

/// Attaches the op's output `y` to `(x, down, up)`, or `y + residual` to `(x, down, up,
/// residual)`. The residual add of a transformer block (`x + to_out(…)`, `x + ff(…)`) composed
/// after the op keeps the op's output alive until the backward as the add's operand; added here,
/// the layer's own output is never a tensor of the graph: one layer-output-sized tensor fewer
/// per residual (3 per transformer block). The sum is taken in the output's dtype, after the
/// op's rounding, as the composed add does, so the values are the same bit for bit.
pub(super) fn with_residual(
    (x, down, up): (&Tensor, &Tensor, &Tensor),
    name: &'static str,
    y: Tensor,
    backward: impl Backward3,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let Some(r) = residual else {
        return attach3((x, down, up), name, y, backward);
    };
    if r.dims() != y.dims() {
        candle_core::bail!(
            "{name}: a residual of shape {:?} for an output of shape {:?}",
            r.dims(),
            y.dims()
        );
    }
    let y = (y + r.detach())?;
    attach_n(&[x, down, up, r], name, y, Residual(backward))
}

/// A three-argument op's backward with a residual as the fourth argument, whose gradient is the
/// output's.
struct Residual<B>(B);

impl<B: Backward3> BackwardN for Residual<B> {
    fn backward(
        &self,
        args: &[Tensor],
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let [x, down, up, r] = args else {
            candle_core::bail!("low-rank op with a residual: {} arguments", args.len());
        };
        let (dx, d_down, d_up) = self.0.backward(x, down, up, res, grad)?;
        let dr = if_tracked(r, || Ok(grad.clone()))?;
        Ok(vec![dx, d_down, d_up, dr])
    }
}

pub(super) struct LinearBackward {
    /// The frozen weight as stored (dequantised again here for fp8).
    w: BaseWeight,
    /// `m ⊙ x·downᵀ`, `[rows, r]` in the compute dtype.
    h: Tensor,
    /// `down` and `s · up` in the compute dtype, as the forward used them (rank-sized: kept so
    /// that the backward does not cast and scale them again).
    down: Tensor,
    up: Tensor,
    mask: Option<Tensor>,
    scale: f64,
    rows: usize,
    x_dims: Vec<usize>,
}

impl LinearBackward {
    /// The gradients of the input `x` (when `want_dx`, in `x`'s dtype), `down` and `up` (where
    /// tracked) for the upstream gradient `grad`.
    pub(super) fn grads(
        &self,
        x: &Tensor,
        want_dx: bool,
        down: &Tensor,
        up: &Tensor,
        grad: &Tensor,
    ) -> Result<Grads3> {
        let cd = self.h.dtype();
        let out_dim = up.dim(0)?;
        let g = grad.reshape((self.rows, out_dim))?.to_dtype(cd)?;
        let gh = masked(g.matmul(&self.up)?, self.mask.as_ref())?;
        let d_up = if_tracked(up, || {
            times(&g.t()?.matmul(&self.h)?.to_dtype(DType::F32)?, self.scale)
        })?;
        let x2 = || {
            x.detach()
                .reshape((self.rows, self.x_dims[self.x_dims.len() - 1]))?
                .to_dtype(cd)
        };
        let d_down = if_tracked(down, || gh.t()?.matmul(&x2()?))?;
        let dx = if want_dx {
            let base = g.matmul(&self.w.get(cd)?)?;
            let dx = (base + gh.matmul(&self.down)?)?.reshape(self.x_dims.as_slice())?;
            Some(dx.to_dtype(x.dtype())?)
        } else {
            None
        };
        Ok((dx, d_down, d_up))
    }
}

impl Backward3 for LinearBackward {
    fn backward(
        &self,
        x: &Tensor,
        down: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<Grads3> {
        self.grads(x, x.track_op(), down, up, grad)
    }
}

/// `conv2d(x, W) + b + s·conv1×1(m ⊙ conv2d(x, down), up)` for `x` `[B, C, H, W]`, `W`
/// `[O, C, kh, kw]` and `b` `[O]` frozen, `down` `[r, C, kh, kw]` with the base's `padding` and
/// `stride`, `up` `[O, r, 1, 1]`; plus `residual` when there is one (see [`with_residual`]).
pub fn frozen_conv2d_low_rank(
    x: &Tensor,
    w: &BaseWeight,
    b: Option<&Tensor>,
    padding: usize,
    stride: usize,
    lr: LowRank<'_>,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let (out_ch, in_ch, kh, kw) = match *w.dims() {
        [o, i, kh, kw] => (o, i, kh, kw),
        ref d => candle_core::bail!("low-rank conv: a weight of shape {d:?}"),
    };
    let (rank, down_in, dkh, dkw) = lr.down.dims4()?;
    if down_in != in_ch || (dkh, dkw) != (kh, kw) || lr.up.dims4()? != (out_ch, rank, 1, 1) {
        candle_core::bail!(
            "low-rank conv: down {:?} and up {:?} do not fit the weight {:?}",
            lr.down.dims(),
            lr.up.dims(),
            w.dims()
        );
    }
    let cd = compute_dtype(x);
    let xc = x.detach().to_dtype(cd)?;
    let down = lr.down.detach().to_dtype(cd)?;
    let h = super::conv2d_detached(&xc, &down, padding, stride)?;
    let mask = (lr.dropout)(&h)?;
    let h = masked(h, mask.as_ref())?;
    let mut y = super::conv2d_detached(&xc, &w.get(cd)?, padding, stride)?;
    drop(xc);
    if let Some(b) = b {
        y = y.broadcast_add(&b.detach().to_dtype(cd)?.reshape((1, out_ch, 1, 1))?)?;
    }
    let up = scaled(lr.up, lr.scale, cd)?;
    let y = (y + super::conv2d_detached(&h, &up, 0, 1)?)?;
    let y = y.to_dtype(x.dtype())?;
    let (_, _, x_h, x_w) = x.dims4()?;
    let backward = ConvBackward {
        w: w.clone(),
        h,
        down,
        up,
        mask,
        scale: lr.scale,
        padding,
        stride,
        x_hw: (x_h, x_w),
    };
    with_residual(
        (x, lr.down, lr.up),
        "frozen-conv2d-low-rank",
        y,
        backward,
        residual,
    )
}

struct ConvBackward {
    /// The frozen weight as stored (dequantised again here for fp8).
    w: BaseWeight,
    /// `m ⊙ conv2d(x, down)`, `[B, r, H', W']` in the compute dtype.
    h: Tensor,
    /// `down` and `s · up` in the compute dtype, as the forward used them.
    down: Tensor,
    up: Tensor,
    mask: Option<Tensor>,
    scale: f64,
    padding: usize,
    stride: usize,
    x_hw: (usize, usize),
}

impl Backward3 for ConvBackward {
    fn backward(
        &self,
        x: &Tensor,
        down: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<Grads3> {
        use super::conv_grad::{conv2d_input_grad, conv2d_weight_grad};
        let cd = self.h.dtype();
        let g = grad.to_dtype(cd)?;
        let (_, _, h_h, h_w) = self.h.dims4()?;
        let gh = masked(
            conv2d_input_grad(&g, &self.up, 0, 1, (h_h, h_w))?,
            self.mask.as_ref(),
        )?;
        let d_up = if_tracked(up, || {
            times(
                &conv2d_weight_grad(&self.h, &g, 0, 1, (1, 1))?.to_dtype(DType::F32)?,
                self.scale,
            )
        })?;
        let (_, _, kh, kw) = down.dims4()?;
        let (p, s) = (self.padding, self.stride);
        let d_down = if_tracked(down, || {
            conv2d_weight_grad(&x.detach().to_dtype(cd)?, &gh, p, s, (kh, kw))
        })?;
        let dx = if_tracked(x, || {
            let base = conv2d_input_grad(&g, &self.w.get(cd)?, p, s, self.x_hw)?;
            let low = conv2d_input_grad(&gh, &self.down, p, s, self.x_hw)?;
            base + low
        })?;
        Ok((dx, d_down, d_up))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::test_util::{assert_parity, fill, half_mask, tracked_except};

    const SCALE: f64 = 0.75;

    fn no_mask(_: &Tensor) -> Result<Option<Tensor>> {
        Ok(None)
    }

    /// The composed form: `base(x) + s·up(m ⊙ down(x))` in plain candle ops, in f32 for a bf16
    /// input (rounded once at the end, as the fused op does on the CPU).
    fn composed_linear(a: &[Tensor], mask: DropoutMask<'_>, scale: f64) -> Result<Tensor> {
        let x = a[0].to_dtype(DType::F32)?;
        let f = |t: &Tensor| t.to_dtype(DType::F32);
        let y = x.matmul(&f(&a[1])?.t()?)?.broadcast_add(&f(&a[2])?)?;
        // A plain matmul would store a gradient for a constant `x`.
        let h = crate::nn::matmul_const_lhs(&x, &f(&a[3])?)?;
        let h = match mask(&h)? {
            Some(m) => (h * m)?,
            None => h,
        };
        let d = (h.matmul(&f(&a[4])?.t()?)? * scale)?;
        (y + d)?.to_dtype(a[0].dtype())
    }

    fn fused_linear(a: &[Tensor], mask: DropoutMask<'_>, scale: f64) -> Result<Tensor> {
        let lr = LowRank {
            down: &a[3],
            up: &a[4],
            scale,
            dropout: mask,
        };
        frozen_linear_low_rank(&a[0], &BaseWeight::plain(&a[1]), Some(&a[2]), lr, None)
    }

    /// `[x, W, b, down, up]` for a 6 → 5 linear of rank 3 on 7 rows; `x` in `dtype`.
    fn linear_inputs(dtype: DType) -> Vec<Tensor> {
        let t = |dims: &[usize], seed, dt: DType| fill(dims, seed, 1.0).to_dtype(dt).unwrap();
        vec![
            t(&[7, 6], 1, dtype),
            t(&[5, 6], 2, dtype),
            t(&[5], 3, dtype),
            t(&[3, 6], 4, DType::F32),
            t(&[5, 3], 5, DType::F32),
        ]
    }

    /// Forward and the gradients of `x`, `down` and `up` equal the composed form's, with and
    /// without dropout and with `x` a constant, at a scale of 0.75 and at 1 (where the op skips
    /// the multiplies). Catches a wrong scale on either factor's gradient (the forward's `s·up`
    /// reused unscaled, or the skip taken at another scale), a dropout mask left out of `∂L/∂h`,
    /// and a missing term of `∂L/∂x`.
    #[test]
    fn linear_matches_the_composed_form() {
        for (mask, label) in [
            (&half_mask as DropoutMask<'_>, "dropout"),
            (&no_mask as DropoutMask<'_>, "no dropout"),
        ] {
            for (track_x, scale) in [(true, SCALE), (false, SCALE), (true, 1.0)] {
                assert_parity(
                    &format!("low-rank linear, {label}, x tracked {track_x}, scale {scale}"),
                    &linear_inputs(DType::F32),
                    &[track_x, false, false, true, true],
                    1e-6,
                    &|a| fused_linear(a, mask, scale),
                    &|a| composed_linear(a, mask, scale),
                );
            }
        }
    }

    /// bf16 on the CPU computes in f32 and rounds the output once; the input's gradient comes
    /// back in bf16, the f32 factors' in f32.
    #[test]
    fn linear_bf16_on_the_cpu_computes_in_f32() {
        assert_parity(
            "low-rank linear, bf16",
            &linear_inputs(DType::BF16),
            &[true, false, false, true, true],
            1e-2,
            &|a| fused_linear(a, &half_mask, SCALE),
            &|a| composed_linear(a, &half_mask, SCALE),
        );
    }

    /// The point of the op: its graph holds the output and its three arguments, no intermediate
    /// (the composed form also keeps the base output, `up`'s output and its scaled copy).
    #[test]
    fn the_graph_keeps_no_intermediate() {
        let a = linear_inputs(DType::F32);
        let vars: Vec<Tensor> = [0, 3, 4]
            .iter()
            .map(|&i| {
                candle_core::Var::from_tensor(&a[i])
                    .unwrap()
                    .as_tensor()
                    .clone()
            })
            .collect();
        let args = [
            vars[0].clone(),
            a[1].clone(),
            a[2].clone(),
            vars[1].clone(),
            vars[2].clone(),
        ];
        let fused = fused_linear(&args, &no_mask, SCALE).unwrap();
        assert_eq!(fused.sorted_nodes().len(), 4);
        let composed = composed_linear(&args, &no_mask, SCALE).unwrap();
        assert!(composed.sorted_nodes().len() > 4);
    }

    /// `[x, W, b, down, up]` for a conv of kernel `k` from 3 to 4 channels, rank 2, on a
    /// `[2, 3, 7, 6]` input (odd and even sides, for the strided case).
    fn conv_inputs(k: usize, dtype: DType) -> Vec<Tensor> {
        let t = |dims: &[usize], seed, dt: DType| fill(dims, seed, 1.0).to_dtype(dt).unwrap();
        vec![
            t(&[2, 3, 7, 6], 11, dtype),
            t(&[4, 3, k, k], 12, dtype),
            t(&[4], 13, dtype),
            t(&[2, 3, k, k], 14, DType::F32),
            t(&[4, 2, 1, 1], 15, DType::F32),
        ]
    }

    fn composed_conv(
        a: &[Tensor],
        (p, s): (usize, usize),
        mask: DropoutMask<'_>,
        scale: f64,
    ) -> Result<Tensor> {
        let f = |t: &Tensor| t.to_dtype(DType::F32);
        let x = f(&a[0])?;
        let y = crate::nn::conv2d_trainable(&x, &f(&a[1])?, p, s)?
            .broadcast_add(&f(&a[2])?.reshape((1, 4, 1, 1))?)?;
        let h = crate::nn::conv2d_trainable(&x, &f(&a[3])?, p, s)?;
        let h = match mask(&h)? {
            Some(m) => (h * m)?,
            None => h,
        };
        let d = (crate::nn::conv2d_trainable(&h, &f(&a[4])?, 0, 1)? * scale)?;
        (y + d)?.to_dtype(a[0].dtype())
    }

    fn fused_conv(
        a: &[Tensor],
        (p, s): (usize, usize),
        mask: DropoutMask<'_>,
        scale: f64,
    ) -> Result<Tensor> {
        let lr = LowRank {
            down: &a[3],
            up: &a[4],
            scale,
            dropout: mask,
        };
        frozen_conv2d_low_rank(
            &a[0],
            &BaseWeight::plain(&a[1]),
            Some(&a[2]),
            p,
            s,
            lr,
            None,
        )
    }

    /// LoCon's shapes: 3×3 at stride 1 and 2 (padding 1), 1×1; with and without dropout, at
    /// scales 0.75 and 1.
    #[test]
    fn conv_matches_the_composed_form() {
        for (k, p, s) in [(3, 1, 1), (3, 1, 2), (1, 0, 1)] {
            for (mask, label, scale) in [
                (&half_mask as DropoutMask<'_>, "dropout", SCALE),
                (&no_mask as DropoutMask<'_>, "no dropout", SCALE),
                (&no_mask as DropoutMask<'_>, "no dropout", 1.0),
            ] {
                assert_parity(
                    &format!("low-rank conv {k}x{k} stride {s}, {label}, scale {scale}"),
                    &conv_inputs(k, DType::F32),
                    &[true, false, false, true, true],
                    1e-5,
                    &|a| fused_conv(a, (p, s), mask, scale),
                    &|a| composed_conv(a, (p, s), mask, scale),
                );
            }
        }
        assert_parity(
            "low-rank conv, bf16",
            &conv_inputs(3, DType::BF16),
            &[true, false, false, true, true],
            1e-2,
            &|a| fused_conv(a, (1, 1), &half_mask, SCALE),
            &|a| composed_conv(a, (1, 1), &half_mask, SCALE),
        );
    }

    /// `[x, W, b, down, up, residual]`: the linear's inputs and a residual of its output's
    /// shape, in `x`'s dtype.
    fn linear_residual_inputs(dtype: DType) -> Result<Vec<Tensor>> {
        let mut a = linear_inputs(dtype);
        a.push(fill(&[7, 5], 7, 1.0).to_dtype(dtype)?);
        Ok(a)
    }

    fn fused_linear_residual(a: &[Tensor], mask: DropoutMask<'_>) -> Result<Tensor> {
        let lr = LowRank {
            down: &a[3],
            up: &a[4],
            scale: SCALE,
            dropout: mask,
        };
        frozen_linear_low_rank(
            &a[0],
            &BaseWeight::plain(&a[1]),
            Some(&a[2]),
            lr,
            Some(&a[5]),
        )
    }

    /// The residual added inside the op: forward and every gradient (the residual's is the
    /// output's) equal the composed `residual + layer(x)`, with the residual tracked and as a
    /// constant (which then gets no gradient entry). Catches the residual's gradient dropped or
    /// scaled, and the residual added twice or not at all.
    #[test]
    fn linear_with_a_residual_matches_the_add() -> Result<()> {
        for track_r in [true, false] {
            for (mask, label) in [
                (&half_mask as DropoutMask<'_>, "dropout"),
                (&no_mask as DropoutMask<'_>, "no dropout"),
            ] {
                assert_parity(
                    &format!("low-rank linear + residual, {label}, residual tracked {track_r}"),
                    &linear_residual_inputs(DType::F32)?,
                    &[true, false, false, true, true, track_r],
                    1e-6,
                    &|a| fused_linear_residual(a, mask),
                    &|a| crate::nn::add_maybe_const(&composed_linear(a, mask, SCALE)?, &a[5]),
                );
            }
        }
        Ok(())
    }

    /// In bf16 the sum is the composed add's, bit for bit: the op's output rounded first, then
    /// added in bf16 (not the f32 sum rounded once, which would change the model's numbers).
    #[test]
    fn a_bf16_residual_is_added_after_the_rounding() -> Result<()> {
        let a = linear_residual_inputs(DType::BF16)?;
        let fused = fused_linear_residual(&a, &half_mask)?;
        let lr = LowRank {
            down: &a[3],
            up: &a[4],
            scale: SCALE,
            dropout: &half_mask,
        };
        let layer =
            frozen_linear_low_rank(&a[0], &BaseWeight::plain(&a[1]), Some(&a[2]), lr, None)?;
        let composed = (layer + &a[5])?;
        assert_eq!(
            fused.to_dtype(DType::F32)?.to_vec2::<f32>()?,
            composed.to_dtype(DType::F32)?.to_vec2::<f32>()?
        );
        Ok(())
    }

    /// What the residual saves: the op's node is the block's output, over its four arguments;
    /// the composed add keeps the layer's output as a node of its own.
    #[test]
    fn the_residual_leaves_no_layer_output_in_the_graph() -> Result<()> {
        let a = linear_residual_inputs(DType::F32)?;
        let args = tracked_except(&a, &[1, 2])?;
        let fused = fused_linear_residual(&args, &no_mask)?;
        // x, down, up, the residual and the output.
        assert_eq!(fused.sorted_nodes().len(), 5);
        let lr = LowRank {
            down: &args[3],
            up: &args[4],
            scale: SCALE,
            dropout: &no_mask,
        };
        let layer = frozen_linear_low_rank(
            &args[0],
            &BaseWeight::plain(&args[1]),
            Some(&args[2]),
            lr,
            None,
        )?;
        assert_eq!((layer + &args[5])?.sorted_nodes().len(), 6);
        Ok(())
    }

    /// The conv form with a residual (SD1's conv `proj_out` under LoCon), dropout on.
    #[test]
    fn conv_with_a_residual_matches_the_add() {
        let mut inputs = conv_inputs(3, DType::F32);
        inputs.push(fill(&[2, 4, 7, 6], 16, 1.0));
        assert_parity(
            "low-rank conv + residual",
            &inputs,
            &[true, false, false, true, true, true],
            1e-5,
            &|a| {
                let lr = LowRank {
                    down: &a[3],
                    up: &a[4],
                    scale: SCALE,
                    dropout: &half_mask,
                };
                let w = BaseWeight::plain(&a[1]);
                frozen_conv2d_low_rank(&a[0], &w, Some(&a[2]), 1, 1, lr, Some(&a[5]))
            },
            &|a| composed_conv(a, (1, 1), &half_mask, SCALE)? + &a[5],
        );
    }

    /// A residual that is not the output's shape is an error naming both shapes, not a
    /// broadcast.
    #[test]
    fn a_misshapen_residual_is_an_error() -> Result<()> {
        let mut a = linear_residual_inputs(DType::F32)?;
        a[5] = fill(&[1, 5], 8, 1.0);
        match fused_linear_residual(&a, &no_mask) {
            Ok(y) => candle_core::bail!("a [1, 5] residual was added to {:?}", y.dims()),
            Err(e) => {
                let e = e.to_string();
                assert!(e.contains("[1, 5]") && e.contains("[7, 5]"), "{e}");
                Ok(())
            }
        }
    }

    #[test]
    fn mismatched_factors_are_an_error() {
        let a = linear_inputs(DType::F32);
        let bad = fill(&[5, 4], 6, 1.0);
        let lr = LowRank {
            down: &a[3],
            up: &bad,
            scale: SCALE,
            dropout: &no_mask,
        };
        let e =
            frozen_linear_low_rank(&a[0], &BaseWeight::plain(&a[1]), None, lr, None).unwrap_err();
        assert!(e.to_string().contains("do not fit"), "{e}");
    }
}
