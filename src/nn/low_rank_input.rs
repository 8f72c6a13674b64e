//! A frozen linear under LoRA whose input is computed from the op's argument, as ONE op that
//! keeps the argument only and computes the input again in its backward:
//! `y = W·u + b + s·up(m ⊙ down·u)` with `u = f(a)`, plus the block's residual when there is
//! one. Two such inputs in a transformer block:
//!
//! - **GEGLU** (`ff.net.2`, `u = geglu(p)`): composed, the graph keeps `u` (the low-rank
//!   linear's input, read by `∂L/∂down`) beside `p` (GEGLU's input): `4·dim` values per token
//!   besides `p`'s `8·dim`.
//! - **a frozen LayerNorm** (`to_q`, `to_k`, `to_v` after `norm1`, `to_q` after `norm2`,
//!   `ff.net.0.proj` after `norm3`, `u = LN(x)`): composed, the graph keeps the norm's output
//!   beside its input, the block's residual stream, which stays anyway. The norm's output is
//!   computed once for the layers that share it and handed in; each layer's backward takes its
//!   own share of `∂L/∂x` through the norm (the norm is linear in its upstream gradient, so the
//!   shares sum to the composed gradient, up to rounding).
//!
//! Each recomputation is one elementwise pass (a row reduction for the norm), as
//! activation-checkpointing does for a whole block, for 3 + 3 `dim`-sized tensors per token
//! fewer per block. The forward values are the composed ones bit for bit: `u` is rounded to the
//! argument's dtype as the composed op's output is, and so is `∂L/∂u` before the input's
//! backward.

use candle_core::{Result, Tensor};

use super::fused_op::{Backward3, Grads3};
use super::geglu::{geglu_detached, geglu_grad};
use super::layer_norm::{layer_norm_recomputed, InputGrad};
use super::low_rank::{linear_forward, with_residual, LinearBackward, LowRank};
use super::BaseWeight;

/// How a low-rank linear's input `u` is made from the op's argument.
#[derive(Clone, Debug)]
pub enum DerivedInput {
    /// `u = geglu(p)` for the GEGLU projection `p` `[..., 2·I]` (see [`super::geglu`]).
    Geglu,
    /// `u = LN(x)` over the last dimension with frozen `γ`, `β` (plain tensors).
    LayerNorm {
        weight: Tensor,
        bias: Tensor,
        eps: f64,
    },
}

impl DerivedInput {
    /// `u = f(a)`, untracked, in `a`'s dtype.
    pub fn value(&self, a: &Tensor) -> Result<Tensor> {
        match self {
            Self::Geglu => geglu_detached(a),
            Self::LayerNorm { weight, bias, eps } => {
                super::layer_norm(&a.detach(), &weight.detach(), &bias.detach(), *eps)
            }
        }
    }

    /// `u = f(a)` again, and how to take `∂L/∂a` from `∂L/∂u` (in `a`'s dtype); the norm's
    /// from the row statistics of the same pass.
    fn recomputed(&self, a: &Tensor) -> Result<(Tensor, InputGrad)> {
        match self {
            Self::Geglu => {
                let p = a.clone();
                Ok((geglu_detached(a)?, Box::new(move |du| geglu_grad(&p, du))))
            }
            Self::LayerNorm { weight, bias, eps } => layer_norm_recomputed(a, weight, bias, *eps),
        }
    }
}

/// `residual + W·u + b + s·up(m ⊙ down·u)` over the last dimension, `u = input(a)` (`value`:
/// `u` when the caller has computed it already, for layers that share it), with `W` `[out, I]`
/// and `b` `[out]` frozen. `a`, `down`, `up` and the residual get gradients where they are
/// tracked.
pub fn frozen_linear_low_rank_on(
    a: &Tensor,
    input: &DerivedInput,
    value: Option<&Tensor>,
    w: &BaseWeight,
    b: Option<&Tensor>,
    lr: LowRank<'_>,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let u = match value {
        Some(u) => u.detach(),
        None => input.value(a)?,
    };
    let (y, lin) = linear_forward(&u, w, b, &lr)?;
    drop(u);
    let backward = Derived {
        lin,
        input: input.clone(),
    };
    let name = match input {
        DerivedInput::Geglu => "frozen-geglu-linear-low-rank",
        DerivedInput::LayerNorm { .. } => "frozen-norm-linear-low-rank",
    };
    with_residual((a, lr.down, lr.up), name, y, backward, residual)
}

/// The low-rank linear's backward on `u = input(a)`, `u` computed again from `a`.
struct Derived {
    lin: LinearBackward,
    input: DerivedInput,
}

impl Backward3 for Derived {
    fn backward(
        &self,
        a: &Tensor,
        down: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<Grads3> {
        let (u, input_grad) = self.input.recomputed(a)?;
        let (du, d_down, d_up) = self.lin.grads(&u, a.track_op(), down, up, grad)?;
        drop(u);
        let da = du.map(|du| input_grad(&du)).transpose()?;
        Ok((da, d_down, d_up))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use super::*;
    use crate::nn::test_util::{assert_parity, fill, half_mask, tracked_except};

    /// `[a, W, b, down, up, residual]` for a 6 → 5 linear of rank 3 after `input`: for GEGLU
    /// `a` is `p` `[2, 3, 12]` (`z` spanning [−3, 3)), for the norm `x` `[2, 3, 6]` with a
    /// per-row offset; the residual is the output's shape. `a`, `W`, `b` and the residual in
    /// `dtype`.
    fn inputs(input: &DerivedInput, dtype: DType) -> Result<Vec<Tensor>> {
        let t = |dims: &[usize], seed, range, dt: DType| fill(dims, seed, range).to_dtype(dt);
        let a = match input {
            DerivedInput::Geglu => t(&[2, 3, 12], 21, 3.0, dtype)?,
            DerivedInput::LayerNorm { .. } => {
                let offset =
                    Tensor::arange(0f32, 6., &candle_core::Device::Cpu)?.reshape((2, 3, 1))?;
                fill(&[2, 3, 6], 27, 2.0)
                    .broadcast_add(&offset)?
                    .to_dtype(dtype)?
            }
        };
        Ok(vec![
            a,
            t(&[5, 6], 22, 1.0, dtype)?,
            t(&[5], 23, 1.0, dtype)?,
            t(&[3, 6], 24, 1.0, DType::F32)?,
            t(&[5, 3], 25, 1.0, DType::F32)?,
            t(&[2, 3, 5], 26, 1.0, dtype)?,
        ])
    }

    /// A frozen norm with `γ`, `β` far from 1 and 0.
    fn norm() -> Result<DerivedInput> {
        Ok(DerivedInput::LayerNorm {
            weight: (fill(&[6], 28, 1.0) + 1.5)?,
            bias: fill(&[6], 29, 0.8),
            eps: 1e-5,
        })
    }

    fn lr<'a>(a: &'a [Tensor], mask: super::super::DropoutMask<'a>) -> LowRank<'a> {
        LowRank {
            down: &a[3],
            up: &a[4],
            scale: 0.75,
            dropout: mask,
        }
    }

    fn fused(input: &DerivedInput, a: &[Tensor], residual: bool) -> Result<Tensor> {
        let r = if residual { Some(&a[5]) } else { None };
        let w = BaseWeight::plain(&a[1]);
        frozen_linear_low_rank_on(&a[0], input, None, &w, Some(&a[2]), lr(a, &half_mask), r)
    }

    /// The model's composed path: the input's own op (GEGLU, the norm), then the low-rank
    /// linear (and the add).
    fn composed(input: &DerivedInput, a: &[Tensor], residual: bool) -> Result<Tensor> {
        let u = match input {
            DerivedInput::Geglu => super::super::geglu(&a[0])?,
            DerivedInput::LayerNorm { weight, bias, eps } => {
                super::super::layer_norm(&a[0], weight, bias, *eps)?
            }
        };
        let w = BaseWeight::plain(&a[1]);
        let y = super::super::frozen_linear_low_rank(&u, &w, Some(&a[2]), lr(a, &half_mask), None)?;
        if residual {
            crate::nn::add_maybe_const(&y, &a[5])
        } else {
            Ok(y)
        }
    }

    /// Forward and the gradients of the argument, `down`, `up` (and the residual) equal the
    /// input's op followed by the low-rank linear, with and without the residual, the argument
    /// tracked or a constant. Catches `∂L/∂a` taken through the wrong GEGLU half or a norm
    /// backward without its mean terms, `u` not recomputed (a stale or zero input to
    /// `∂L/∂down`), and the input's backward skipped.
    #[test]
    fn matches_the_input_op_then_the_low_rank_linear() -> Result<()> {
        for input in [DerivedInput::Geglu, norm()?] {
            for residual in [false, true] {
                for track_a in [true, false] {
                    let n = if residual { 6 } else { 5 };
                    let track = [track_a, false, false, true, true, residual];
                    assert_parity(
                        &format!("{input:?} + low-rank linear, residual {residual}, a {track_a}"),
                        &inputs(&input, DType::F32)?[..n],
                        &track[..n],
                        1e-5,
                        &|a| fused(&input, a, residual),
                        &|a| composed(&input, a, residual),
                    );
                }
            }
        }
        Ok(())
    }

    /// The forward output and every gradient in bf16, flattened to f32.
    fn run_bf16(a: &[Tensor], f: &dyn Fn(&[Tensor]) -> Result<Tensor>) -> Result<Vec<Vec<f32>>> {
        let args = tracked_except(a, &[1, 2])?;
        let y = f(&args)?;
        let weights = fill(y.dims(), 99, 1.0);
        let grads = (y.to_dtype(DType::F32)? * weights)?.sum_all()?.backward()?;
        let flat = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
        let mut out = vec![flat(&y)?];
        for i in [0, 3, 4, 5] {
            let g = grads
                .get(&args[i])
                .ok_or_else(|| candle_core::Error::Msg(format!("no gradient for argument {i}")))?;
            out.push(flat(g)?);
        }
        Ok(out)
    }

    /// bf16 (computed in f32 on the CPU): the forward and every gradient are the composed
    /// path's bit for bit, `u` and `∂L/∂u` rounded where the composed path rounds them.
    #[test]
    fn bf16_is_the_composed_path_bit_for_bit() -> Result<()> {
        for input in [DerivedInput::Geglu, norm()?] {
            let a = inputs(&input, DType::BF16)?;
            assert_eq!(
                run_bf16(&a, &|a| fused(&input, a, true))?,
                run_bf16(&a, &|a| composed(&input, a, true))?,
                "{input:?}"
            );
        }
        Ok(())
    }

    /// Two layers after one norm (a block's `to_q` and `to_k`), its output computed once and
    /// handed to both: the input's gradient is the composed one, where candle sums the two
    /// layers' `∂L/∂u` before the norm's backward and here each layer takes its share through
    /// the norm. Catches a share dropped and the shared value ignored for a fresh one.
    #[test]
    fn layers_sharing_one_norm_sum_their_shares() -> Result<()> {
        let input = norm()?;
        let mut a = inputs(&input, DType::F32)?;
        a.truncate(5);
        a.push(fill(&[3, 6], 30, 1.0));
        a.push(fill(&[5, 3], 31, 1.0));
        let pair = |a: &[Tensor], fused_op: bool| -> Result<Tensor> {
            let w = BaseWeight::plain(&a[1]);
            let second = LowRank {
                down: &a[5],
                up: &a[6],
                scale: 0.5,
                dropout: &|_| Ok(None),
            };
            let (y1, y2) = if fused_op {
                let u = input.value(&a[0])?;
                let on =
                    |lr| frozen_linear_low_rank_on(&a[0], &input, Some(&u), &w, None, lr, None);
                (on(lr(a, &half_mask))?, on(second)?)
            } else {
                let u = composed_norm(&input, &a[0])?;
                let on = |lr| super::super::frozen_linear_low_rank(&u, &w, None, lr, None);
                (on(lr(a, &half_mask))?, on(second)?)
            };
            y1 + (y2 * 0.5)?
        };
        assert_parity(
            "two layers after one norm",
            &a,
            &[true, false, false, true, true, true, true],
            1e-5,
            &|a| pair(a, true),
            &|a| pair(a, false),
        );
        Ok(())
    }

    fn composed_norm(input: &DerivedInput, x: &Tensor) -> Result<Tensor> {
        match input {
            DerivedInput::LayerNorm { weight, bias, eps } => {
                super::super::layer_norm(x, weight, bias, *eps)
            }
            DerivedInput::Geglu => super::super::geglu(x),
        }
    }

    /// What the op saves: its node is the block's output over the argument, the factors and
    /// the residual; the composed path keeps the input op's output as a node of its own.
    #[test]
    fn the_graph_keeps_no_input_value() -> Result<()> {
        for input in [DerivedInput::Geglu, norm()?] {
            let args = tracked_except(&inputs(&input, DType::F32)?, &[1, 2])?;
            assert_eq!(fused(&input, &args, true)?.sorted_nodes().len(), 5);
            assert_eq!(composed(&input, &args, true)?.sorted_nodes().len(), 7);
        }
        Ok(())
    }
}
