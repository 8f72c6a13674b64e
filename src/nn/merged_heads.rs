//! Attention over merged heads as one op: `q` `[B, Lq, H·D]`, `k`/`v` `[B, Lk, H·D]` in, the
//! `[B, Lq, H·D]` output out, with the kernels' `[B, H, L, D]` copies made inside.
//!
//! Split into heads with candle ops, every attention layer keeps, until the backward, the
//! contiguous split copies of `q`, `k` and `v` and the kernel's split output, besides `q`, `k`,
//! `v` and the merged output that the layers around it keep anyway: four layer-sized tensors
//! that torch (whose SDPA reads the strided views) does not keep. Here the split copies live
//! only inside the forward, and the backward splits again (`q`, `k`, `v`, the output and its
//! gradient: memory-bound copies) before the kernel's own backward ([`HeadsKernel`]: chunked
//! attention, or flash attention on CUDA), then merges the gradients.

use candle_core::{Result, Tensor};

use super::fused_op::{attach3, Backward3, Grads3};

/// An attention kernel's backward on split heads `[B, H, L, D]` (detached, contiguous), from
/// what its forward kept (the row log-sum-exp): the gradients of the `want`ed operands.
pub(crate) trait HeadsKernel: Send + Sync + 'static {
    fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        g: &Tensor,
        want: [bool; 3],
    ) -> Result<Grads3>;
}

/// `[B, L, H·D]` → `[B, H, L, D]`, contiguous and detached.
fn split(t: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, l, inner) = t.dims3()?;
    t.detach()
        .reshape((b, l, heads, inner / heads))?
        .transpose(1, 2)?
        .contiguous()
}

/// `[B, H, L, D]` → `[B, L, H·D]`, contiguous.
fn merge(t: &Tensor) -> Result<Tensor> {
    let (b, h, l, d) = t.dims4()?;
    t.transpose(1, 2)?.reshape((b, l, h * d))
}

/// Runs `forward` (a kernel on detached split heads, returning its split output and backward)
/// on `q`, `k`, `v` and returns the merged output, differentiable in each tracked operand.
pub(crate) fn merged_heads<K: HeadsKernel>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    forward: impl FnOnce(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, K)>,
) -> Result<Tensor> {
    let (_, _, inner) = q.dims3()?;
    if heads == 0 || inner % heads != 0 || k.dim(2)? != inner || v.dims() != k.dims() {
        candle_core::bail!(
            "attention: q {:?}, k {:?}, v {:?} do not split into {heads} heads",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    let (out, kernel) = forward(&split(q, heads)?, &split(k, heads)?, &split(v, heads)?)?;
    let out = merge(&out)?;
    attach3(
        (q, k, v),
        "merged-heads-attention",
        out,
        MergedBackward { heads, kernel },
    )
}

struct MergedBackward<K> {
    heads: usize,
    kernel: K,
}

impl<K: HeadsKernel> Backward3 for MergedBackward<K> {
    fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<Grads3> {
        let h = self.heads;
        let want = [q.track_op(), k.track_op(), v.track_op()];
        let g = split(&grad.to_dtype(res.dtype())?, h)?;
        let (dq, dk, dv) = self.kernel.backward(
            &split(q, h)?,
            &split(k, h)?,
            &split(v, h)?,
            &split(res, h)?,
            &g,
            want,
        )?;
        let merged = |t: Option<Tensor>, like: &Tensor| -> Result<Option<Tensor>> {
            t.map(|t| merge(&t)?.to_dtype(like.dtype())).transpose()
        };
        Ok((merged(dq, q)?, merged(dk, k)?, merged(dv, v)?))
    }
}

#[cfg(test)]
mod tests {
    use crate::nn::test_util::{assert_parity, fill};
    use crate::nn::{attention, attention_reference};
    use candle_core::Tensor;

    fn qkv(lq: usize, lk: usize) -> Vec<Tensor> {
        vec![
            fill(&[2, lq, 12], 31, 1.5),
            fill(&[2, lk, 12], 32, 1.5),
            fill(&[2, lk, 12], 33, 1.5),
        ]
    }

    /// The merged-heads op (what every unmasked attention layer runs) against the composed
    /// reference, self- and cross-attention, with constant keys and values too. A wrong split
    /// or merge (heads and tokens swapped) or a gradient merged for the wrong operand fails.
    #[test]
    fn matches_the_composed_attention() {
        for (lq, lk) in [(9, 9), (9, 5)] {
            for track in [
                [true; 3],
                [true, false, false],
                [false, true, true],
                [true, true, false],
            ] {
                assert_parity(
                    &format!("merged heads, lq {lq} lk {lk}, tracked {track:?}"),
                    &qkv(lq, lk),
                    &track,
                    1e-5,
                    &|a| attention(&a[0], &a[1], &a[2], 3, None),
                    &|a| attention_reference(&a[0], &a[1], &a[2], 3, None),
                );
            }
        }
    }

    /// The graph holds the output and `q`, `k`, `v`: no split copy of them.
    #[test]
    fn keeps_no_split_copies() {
        let a: Vec<Tensor> = qkv(9, 9)
            .iter()
            .map(|t| {
                candle_core::Var::from_tensor(t)
                    .unwrap()
                    .as_tensor()
                    .clone()
            })
            .collect();
        let y = attention(&a[0], &a[1], &a[2], 3, None).unwrap();
        assert_eq!(y.sorted_nodes().len(), 4);
    }

    #[test]
    fn heads_that_do_not_divide_the_width_are_an_error() {
        let a = qkv(4, 4);
        let e = attention(&a[0], &a[1], &a[2], 5, None).unwrap_err();
        assert!(e.to_string().contains("do not split into 5 heads"), "{e}");
    }
}
