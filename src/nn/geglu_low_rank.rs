//! A transformer block's feed-forward output layer under LoRA, `ff.net.2(geglu(p))`, as ONE op
//! over the GEGLU projection `p`: `y = W·g + b + s·up(m ⊙ down·g)` with `g = geglu(p)`, plus the
//! block's residual when there is one.
//!
//! Composed, the graph keeps `g` (the low-rank linear's input, read by `∂L/∂down`) beside `p`
//! (GEGLU's input): `4·dim` values per token besides `p`'s `8·dim`, in every transformer block.
//! This op keeps `p` only and computes `g` again in its backward, one elementwise pass, as
//! activation-checkpointing does for a whole block. The values are the composed ones: `g` is
//! rounded to `p`'s dtype as GEGLU's output is, and `∂L/∂g` to `p`'s dtype before GEGLU's
//! backward, as the composed gradient is.

use candle_core::{Result, Tensor};

use super::fused_op::{Backward3, Grads3};
use super::geglu::{geglu_detached, geglu_grad};
use super::low_rank::{linear_forward, with_residual, LinearBackward, LowRank};
use super::BaseWeight;

/// `residual + W·geglu(p) + b + s·up(m ⊙ down·geglu(p))` over the last dimension, with `W`
/// `[out, I]` and `b` `[out]` frozen and `p` `[..., 2·I]` (see [`super::geglu`]). `p`, `down`,
/// `up` and the residual get gradients where they are tracked.
pub fn frozen_geglu_linear_low_rank(
    p: &Tensor,
    w: &BaseWeight,
    b: Option<&Tensor>,
    lr: LowRank<'_>,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let g = geglu_detached(p)?;
    let (y, lin) = linear_forward(&g, w, b, &lr)?;
    drop(g);
    let backward = GegluInput(lin);
    with_residual(
        (p, lr.down, lr.up),
        "frozen-geglu-linear-low-rank",
        y,
        backward,
        residual,
    )
}

/// The low-rank linear's backward on `g = geglu(p)`, computed again from `p`.
struct GegluInput(LinearBackward);

impl Backward3 for GegluInput {
    fn backward(
        &self,
        p: &Tensor,
        down: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<Grads3> {
        let g = geglu_detached(p)?;
        let (dg, d_down, d_up) = self.0.grads(&g, p.track_op(), down, up, grad)?;
        drop(g);
        let dp = dg.map(|dg| geglu_grad(p, &dg)).transpose()?;
        Ok((dp, d_down, d_up))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use super::*;
    use crate::nn::test_util::{assert_parity, fill};

    /// A fixed inverted-dropout mask (p = 0.5): every third element dropped.
    fn half_mask(h: &Tensor) -> Result<Option<Tensor>> {
        let v: Vec<f32> = (0..h.elem_count())
            .map(|i| if i % 3 == 0 { 0.0 } else { 2.0 })
            .collect();
        Ok(Some(
            Tensor::from_vec(v, h.shape(), h.device())?.to_dtype(h.dtype())?,
        ))
    }

    /// `[p, W, b, down, up, residual]`: `p` `[2, 3, 12]` (so `g` `[2, 3, 6]`, `z` spanning
    /// [−3, 3)), a 6 → 5 linear of rank 3, a residual of the output's shape; `p`, `W`, `b`
    /// and the residual in `dtype`.
    fn inputs(dtype: DType) -> Result<Vec<Tensor>> {
        let t = |dims: &[usize], seed, range, dt: DType| fill(dims, seed, range).to_dtype(dt);
        Ok(vec![
            t(&[2, 3, 12], 21, 3.0, dtype)?,
            t(&[5, 6], 22, 1.0, dtype)?,
            t(&[5], 23, 1.0, dtype)?,
            t(&[3, 6], 24, 1.0, DType::F32)?,
            t(&[5, 3], 25, 1.0, DType::F32)?,
            t(&[2, 3, 5], 26, 1.0, dtype)?,
        ])
    }

    fn lr<'a>(a: &'a [Tensor], mask: super::super::DropoutMask<'a>) -> LowRank<'a> {
        LowRank {
            down: &a[3],
            up: &a[4],
            scale: 0.75,
            dropout: mask,
        }
    }

    fn fused(a: &[Tensor], residual: bool) -> Result<Tensor> {
        let r = if residual { Some(&a[5]) } else { None };
        frozen_geglu_linear_low_rank(
            &a[0],
            &BaseWeight::plain(&a[1]),
            Some(&a[2]),
            lr(a, &half_mask),
            r,
        )
    }

    /// The model's composed path: GEGLU as its own op, then the low-rank linear (and the add).
    fn composed(a: &[Tensor], residual: bool) -> Result<Tensor> {
        let g = super::super::geglu(&a[0])?;
        let w = BaseWeight::plain(&a[1]);
        let y = super::super::frozen_linear_low_rank(&g, &w, Some(&a[2]), lr(a, &half_mask), None)?;
        if residual {
            crate::nn::add_maybe_const(&y, &a[5])
        } else {
            Ok(y)
        }
    }

    /// Forward and the gradients of `p`, `down`, `up` (and the residual) equal GEGLU followed by
    /// the low-rank linear, with and without the residual, `p` tracked or a constant. Catches
    /// `∂L/∂p` taken through the wrong GEGLU half, `g` not recomputed (a stale or zero input to
    /// `∂L/∂down`), and the GEGLU backward skipped.
    #[test]
    fn matches_geglu_then_the_low_rank_linear() -> Result<()> {
        for residual in [false, true] {
            for track_p in [true, false] {
                let n = if residual { 6 } else { 5 };
                let track = [track_p, false, false, true, true, residual];
                assert_parity(
                    &format!("geglu + low-rank linear, residual {residual}, p tracked {track_p}"),
                    &inputs(DType::F32)?[..n],
                    &track[..n],
                    1e-6,
                    &|a| fused(a, residual),
                    &|a| composed(a, residual),
                );
            }
        }
        Ok(())
    }

    /// bf16 (computed in f32 on the CPU): the forward and every gradient are the composed
    /// path's bit for bit, `g` and `∂L/∂g` rounded where the composed path rounds them.
    #[test]
    fn bf16_is_the_composed_path_bit_for_bit() -> Result<()> {
        let a = inputs(DType::BF16)?;
        let vars = |a: &[Tensor]| -> Result<Vec<Tensor>> {
            a.iter()
                .enumerate()
                .map(|(i, t)| match i {
                    1 | 2 => Ok(t.clone()),
                    _ => Ok(candle_core::Var::from_tensor(t)?.as_tensor().clone()),
                })
                .collect()
        };
        let run = |f: &dyn Fn(&[Tensor]) -> Result<Tensor>| -> Result<Vec<Vec<f32>>> {
            let args = vars(&a)?;
            let y = f(&args)?;
            let weights = fill(y.dims(), 99, 1.0);
            let grads = (y.to_dtype(DType::F32)? * weights)?.sum_all()?.backward()?;
            let mut out = vec![y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?];
            for i in [0, 3, 4, 5] {
                let g = grads.get(&args[i]).ok_or_else(|| {
                    candle_core::Error::Msg(format!("no gradient for argument {i}"))
                })?;
                out.push(g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
            }
            Ok(out)
        };
        assert_eq!(run(&|a| fused(a, true))?, run(&|a| composed(a, true))?);
        Ok(())
    }

    /// What the op saves: its node is the block's output over `p`, the factors and the
    /// residual; the composed path keeps GEGLU's output as a node of its own.
    #[test]
    fn the_graph_keeps_no_geglu_output() -> Result<()> {
        let a = inputs(DType::F32)?;
        let mut args = a.clone();
        for i in [0, 3, 4, 5] {
            args[i] = candle_core::Var::from_tensor(&a[i])?.as_tensor().clone();
        }
        assert_eq!(fused(&args, true)?.sorted_nodes().len(), 5);
        assert_eq!(composed(&args, true)?.sorted_nodes().len(), 7);
        Ok(())
    }
}
