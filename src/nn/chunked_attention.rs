//! Memory-efficient attention: queries in chunks, the score matrix never kept for backward.
//!
//! Rabe & Staats, "Self-attention does not need O(n²) memory", arXiv 2112.05682; the backward is
//! flash-attention's (Dao et al., arXiv 2205.14135). For `q` `[.., Lq, D]`, `k`, `v` `[.., Lk, D]`
//! and scale `s`, per query chunk `c`:
//!
//! ```text
//! forward:  S = s·q_c·kᵀ (f32);  m = rowmax S;  P̃ = exp(S − m);  l = rowsum P̃
//!           o_c = (P̃ / l)·v;     L_c = m + ln l                        (saved: L, the output)
//! backward: D = rowsum(dO ∘ O);  P = exp(s·q_c·kᵀ − L_c)                (recomputed per chunk)
//!           dV += Pᵀ·dO_c;  dP = dO_c·vᵀ;  dS = P ∘ (dP − D_c)·s;  dQ_c = dS·k;  dK += dSᵀ·q_c
//! ```
//!
//! Only one chunk's `[.., C, Lk]` scores exist at a time, in forward and in backward; the graph
//! keeps `q`, `k`, `v`, the output and `L` (one f32 per query row). Scores and softmax are f32
//! whatever the input dtype, as in the composed reference (`super::attention::attention_reference`).
//!
//! - On CUDA the chunks are candle tensor ops, sized so a chunk's f32 scores stay under
//!   [`SCORE_BUDGET`] elements.
//! - On the CPU the same math runs as [`super::cpu_flash_attention`]: blocks of query rows whose
//!   scores fit the cache, in reused per-thread buffers (no fresh memory per chunk).
//!
//! The forward runs on detached operands and hands its output over through an [`OutputSlot`].

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, D};

use super::fused_op::Grads3;
use super::merged_heads::HeadsKernel;
use super::output_slot::OutputSlot;

/// The most f32 score elements one chunk may hold on CUDA (64 Mi = 256 MiB), where fewer, larger
/// chunks mean fewer kernel launches (measured on the H100, docs/BENCHMARKS.md).
pub const SCORE_BUDGET: usize = 1 << 26;

/// Query rows per chunk for `batch_heads` heads of `lk` keys: as many as fit in `budget`.
fn chunk_rows(budget: usize, batch_heads: usize, lq: usize, lk: usize) -> usize {
    (budget / (batch_heads * lk).max(1)).clamp(1, lq.max(1))
}

/// `softmax(s·q·kᵀ)·v` for `q` `[B, H, Lq, D]`, `k`/`v` `[B, H, Lk, D]` (same dtype), computed in
/// query chunks of `chunk` rows (`None`: sized by [`SCORE_BUDGET`] on CUDA, for the cache on the
/// CPU).
pub fn chunked_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    chunk: Option<usize>,
) -> Result<Tensor> {
    run(q, k, v, scale, chunk, q.device().is_cpu())
}

/// `cpu_kernel`: the CPU's block kernels, else chunks of candle ops (the CUDA path, which the CPU
/// tests run too).
fn run(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    chunk: Option<usize>,
    cpu_kernel: bool,
) -> Result<Tensor> {
    let (out, state) = forward_detached(q, k, v, scale, chunk, cpu_kernel)?;
    if !(q.track_op() || k.track_op() || v.track_op()) {
        return Ok(out);
    }
    q.apply_op3(
        k,
        v,
        ChunkedAttention {
            state,
            out: OutputSlot::new("chunked attention", out)?,
        },
    )
}

/// The forward on detached operands: the output and what its backward needs.
fn forward_detached(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    chunk: Option<usize>,
    cpu_kernel: bool,
) -> Result<(Tensor, ChunkedState)> {
    let (b, h, lq, _) = q.dims4()?;
    let lk = k.dim(2)?;
    let (q0, k0, v0) = (q.detach(), k.detach(), v.detach());
    let (out, lse, chunk) = if cpu_kernel {
        let chunk = chunk.unwrap_or_else(|| super::cpu_flash_attention::block_rows(lk));
        let (out, lse) = cpu::forward(&q0, &k0, &v0, scale, chunk)?;
        (out, lse, chunk)
    } else {
        let chunk = chunk
            .unwrap_or_else(|| chunk_rows(SCORE_BUDGET, b * h, lq, lk))
            .max(1);
        let (out, lse) = forward(&q0, &k0, &v0, scale, chunk)?;
        (out, lse, chunk)
    };
    let state = ChunkedState {
        scale,
        chunk,
        cpu_kernel,
        lse,
    };
    Ok((out, state))
}

/// [`chunked_attention`]'s forward on detached operands, for an op that carries the backward
/// itself (`super::merged_heads`): the output and the [`HeadsKernel`] that differentiates it.
pub(crate) fn chunked_detached(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
) -> Result<(Tensor, ChunkedState)> {
    forward_detached(q, k, v, scale, None, q.device().is_cpu())
}

/// The output and the row log-sum-exp `[B, H, Lq, 1]` (f32).
fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    chunk: usize,
) -> Result<(Tensor, Tensor)> {
    let lq = q.dim(2)?;
    let dtype = v.dtype();
    let kt = k.to_dtype(DType::F32)?.t()?.contiguous()?;
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for start in (0..lq).step_by(chunk) {
        let len = chunk.min(lq - start);
        let qc = (q.narrow(2, start, len)?.to_dtype(DType::F32)? * scale)?;
        let s = qc.matmul(&kt)?;
        let m = s.max_keepdim(D::Minus1)?;
        let p = s.broadcast_sub(&m)?.exp()?;
        let l = p.sum_keepdim(D::Minus1)?;
        let (probs, lse) = (p.broadcast_div(&l)?, (m + l.log()?)?);
        outs.push(super::matmul(&probs.to_dtype(dtype)?, v)?);
        lses.push(lse);
    }
    Ok((Tensor::cat(&outs, 2)?, Tensor::cat(&lses, 2)?))
}

/// What chunked attention's backward needs besides the operands and the output.
pub(crate) struct ChunkedState {
    scale: f64,
    chunk: usize,
    /// Whether the CPU block kernels ran the forward (and so run the backward).
    cpu_kernel: bool,
    /// Row log-sum-exp of the scaled scores, `[B, H, Lq, 1]`, f32.
    lse: Tensor,
}

struct ChunkedAttention {
    state: ChunkedState,
    out: OutputSlot,
}

impl HeadsKernel for ChunkedState {
    /// The gradients of `q`, `k`, `v` for the upstream gradient `g` of output `o`; only for the
    /// wanted operands (candle stores whatever a backward returns, tracked or not).
    fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        g: &Tensor,
        want: [bool; 3],
    ) -> Result<Grads3> {
        if self.cpu_kernel {
            return cpu::backward(q, k, v, o, g, &self.lse, self.scale, self.chunk, want);
        }
        let f32 = |t: &Tensor| t.detach().to_dtype(DType::F32);
        let (q32, k32, v32, g32) = (f32(q)?, f32(k)?, f32(v)?, f32(g)?);
        let d_rows = (&g32 * f32(o)?)?.sum_keepdim(D::Minus1)?;
        let kt = k32.t()?.contiguous()?;
        let vt = v32.t()?.contiguous()?;
        let lq = q.dim(2)?;
        let mut dq = Vec::new();
        let mut dk = k32.zeros_like()?;
        let mut dv = v32.zeros_like()?;
        for start in (0..lq).step_by(self.chunk) {
            let len = self.chunk.min(lq - start);
            let qc = q32.narrow(2, start, len)?;
            let gc = g32.narrow(2, start, len)?;
            let lse = self.lse.narrow(2, start, len)?;
            let d = d_rows.narrow(2, start, len)?;
            let p = (qc.matmul(&kt)? * self.scale)?.broadcast_sub(&lse)?.exp()?;
            if want[2] {
                dv = (dv + p.t()?.matmul(&gc)?)?;
            }
            let dp = gc.matmul(&vt)?;
            let ds = ((p * dp.broadcast_sub(&d)?)? * self.scale)?;
            if want[0] {
                dq.push(ds.matmul(&k32)?);
            }
            if want[1] {
                dk = (dk + ds.t()?.matmul(&qc)?)?;
            }
        }
        let dq = if want[0] {
            Some(Tensor::cat(&dq, 2)?.to_dtype(q.dtype())?)
        } else {
            None
        };
        let dk = if want[1] {
            Some(dk.to_dtype(k.dtype())?)
        } else {
            None
        };
        let dv = if want[2] {
            Some(dv.to_dtype(v.dtype())?)
        } else {
            None
        };
        Ok((dq, dk, dv))
    }
}

impl CustomOp3 for ChunkedAttention {
    fn name(&self) -> &'static str {
        "chunked-attention"
    }

    fn cpu_fwd(
        &self,
        _q: &CpuStorage,
        _lq: &Layout,
        _k: &CpuStorage,
        _lk: &Layout,
        _v: &CpuStorage,
        _lv: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.out.cpu()
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _q: &candle_core::CudaStorage,
        _lq: &Layout,
        _k: &candle_core::CudaStorage,
        _lk: &Layout,
        _v: &candle_core::CudaStorage,
        _lv: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.out.cuda()
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let want = [q.track_op(), k.track_op(), v.track_op()];
        self.state.backward(q, k, v, res, grad, want)
    }
}

/// The CPU path: [`super::cpu_flash_attention`] on f32 copies of the operands.
mod cpu {
    use candle_core::{CpuStorage, DType, Layout, Result, Storage, Tensor};

    use super::super::cpu_flash_attention::{self as kernel, Dims, Wanted};

    /// `t` as a contiguous f32 tensor: the same storage when it already is one (the usual case:
    /// f32 runs with heads made contiguous), so the kernels borrow it without a copy.
    fn f32_contiguous(t: &Tensor) -> Result<Tensor> {
        t.detach().to_dtype(DType::F32)?.contiguous()
    }

    /// Runs `f` on the elements of each of `ts` (contiguous f32 CPU tensors), borrowed from their
    /// storage for the call.
    fn with_values<R>(ts: &[Tensor], f: impl FnOnce(&[&[f32]]) -> R) -> Result<R> {
        let guards: Vec<_> = ts.iter().map(|t| t.storage_and_layout()).collect();
        let slices = guards
            .iter()
            .map(|(s, l)| slice(s, l))
            .collect::<Result<Vec<_>>>()?;
        Ok(f(&slices))
    }

    fn slice<'a>(s: &'a Storage, l: &Layout) -> Result<&'a [f32]> {
        match (s, l.contiguous_offsets()) {
            (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Ok(&v[a..b]),
            _ => candle_core::bail!("chunked attention: expected contiguous f32 CPU operands"),
        }
    }

    fn dims(q: &Tensor, k: &Tensor) -> Result<Dims> {
        let (b, h, lq, d) = q.dims4()?;
        Ok(Dims {
            bh: b * h,
            lq,
            lk: k.dim(2)?,
            d,
        })
    }

    /// The output (in `v`'s dtype) and the row log-sum-exp `[B, H, Lq, 1]` (f32).
    /// `rows`: query rows per block.
    pub(super) fn forward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f64,
        rows: usize,
    ) -> Result<(Tensor, Tensor)> {
        let dims = dims(q, k)?;
        let ops = [f32_contiguous(q)?, f32_contiguous(k)?, f32_contiguous(v)?];
        let (out, lse) = with_values(&ops, |x| {
            kernel::forward(x[0], x[1], x[2], dims, scale as f32, rows)
        })?;
        let (b, h, lq, _) = q.dims4()?;
        let out = Tensor::from_vec(out, q.shape(), q.device())?.to_dtype(v.dtype())?;
        let lse = Tensor::from_vec(lse, (b, h, lq, 1), q.device())?;
        Ok((out, lse))
    }

    /// The gradients of the tracked operands, each in its operand's dtype.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    pub(super) fn backward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        g: &Tensor,
        lse: &Tensor,
        scale: f64,
        rows: usize,
        want: [bool; 3],
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dims = dims(q, k)?;
        let want = Wanted {
            q: want[0],
            k: want[1],
            v: want[2],
        };
        let ops = [q, k, v, o, g, lse]
            .iter()
            .map(|t| f32_contiguous(t))
            .collect::<Result<Vec<_>>>()?;
        let (dq, dk, dv) = with_values(&ops, |x| {
            kernel::backward(
                x[0],
                x[1],
                x[2],
                x[3],
                x[4],
                x[5],
                dims,
                scale as f32,
                want,
                rows,
            )
        })?;
        let back = |on: bool, x: Vec<f32>, like: &Tensor| -> Result<Option<Tensor>> {
            if !on {
                return Ok(None);
            }
            let t = Tensor::from_vec(x, like.shape(), like.device())?;
            Ok(Some(t.to_dtype(like.dtype())?))
        };
        Ok((
            back(want.q, dq, q)?,
            back(want.k, dk, k)?,
            back(want.v, dv, v)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::test_util::max_abs;
    use candle_core::Var;

    fn fill(shape: &[usize], seed: u64) -> Tensor {
        crate::nn::test_util::fill(shape, seed, 2.0)
    }

    /// The composed attention: `softmax(s·q·kᵀ)·v` with every intermediate kept.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Tensor {
        let s = (q.to_dtype(DType::F32).unwrap() * scale)
            .unwrap()
            .matmul(&k.to_dtype(DType::F32).unwrap().t().unwrap())
            .unwrap();
        let p = candle_nn::ops::softmax(&s, D::Minus1).unwrap();
        p.matmul(&v.to_dtype(DType::F32).unwrap()).unwrap()
    }

    fn check(lq: usize, lk: usize, chunk: usize, track: [bool; 3]) {
        check_path(lq, lk, chunk, track, true);
        check_path(lq, lk, chunk, track, false);
    }

    /// `cpu_kernel`: the CPU block kernels, else the candle-op chunks CUDA runs.
    fn check_path(lq: usize, lk: usize, chunk: usize, track: [bool; 3], cpu_kernel: bool) {
        let (b, h, d) = (2, 3, 8);
        let scale = 1.0 / (d as f64).sqrt();
        let vals = [
            fill(&[b, h, lq, d], 1),
            fill(&[b, h, lk, d], 2),
            fill(&[b, h, lk, d], 3),
        ];
        let r = fill(&[b, h, lq, d], 4);
        let run = |chunked: bool| {
            let vars: Vec<Var> = vals.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
            let args: Vec<Tensor> = vars
                .iter()
                .zip(track)
                .map(|(v, t)| {
                    if t {
                        v.as_tensor().clone()
                    } else {
                        v.as_tensor().detach()
                    }
                })
                .collect();
            let y = if chunked {
                run(&args[0], &args[1], &args[2], scale, Some(chunk), cpu_kernel).unwrap()
            } else {
                reference(&args[0], &args[1], &args[2], scale)
            };
            let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let gs: Vec<Option<Tensor>> = vars.iter().map(|v| grads.get(v).cloned()).collect();
            (y, gs, grads.get_ids().count())
        };
        let (y, g, n) = run(true);
        let (y_ref, g_ref, _) = run(false);
        assert!(
            max_abs(&y, &y_ref) < 1e-5,
            "lq {lq} lk {lk} chunk {chunk}: forward"
        );
        for (i, (a, b)) in g.iter().zip(&g_ref).enumerate() {
            match (a, b) {
                (Some(a), Some(b)) => {
                    let e = max_abs(a, b);
                    assert!(
                        e < 1e-4,
                        "lq {lq} lk {lk} chunk {chunk}: grad {i} differs by {e}"
                    );
                }
                (None, None) => {}
                _ => panic!("grad {i}: presence differs (tracked {track:?})"),
            }
        }
        // The gradient store holds the tracked operands and one graph node (the product with
        // `r`), never an entry for an untracked operand.
        assert_eq!(
            n,
            track.iter().filter(|t| **t).count() + 1,
            "track {track:?}"
        );
    }

    #[test]
    fn matches_composed_attention_forward_and_backward() {
        check(16, 16, 5, [true; 3]); // self-attention, a remainder chunk
        check(12, 7, 4, [true; 3]); // cross-attention
        check(9, 9, 64, [true; 3]); // one chunk
        check(10, 6, 3, [true, false, false]); // constant keys and values
        check(10, 6, 3, [false, true, true]);
        // The CPU kernel's own block size: two blocks of 31 rows and a ragged one, long rows
        // (lanes and a tail in the vectorised softmax).
        let rows = crate::nn::cpu_flash_attention::block_rows(2100);
        assert_eq!(rows, 31);
        check(70, 2100, rows, [true; 3]);
    }

    #[test]
    fn bf16_stays_close_to_f32() {
        let (q, k, v) = (
            fill(&[1, 2, 20, 8], 5),
            fill(&[1, 2, 20, 8], 6),
            fill(&[1, 2, 20, 8], 7),
        );
        let want = reference(&q, &k, &v, 0.35);
        let bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
        let got = chunked_attention(&bf(&q), &bf(&k), &bf(&v), 0.35, Some(6)).unwrap();
        assert_eq!(got.dtype(), DType::BF16);
        assert!(max_abs(&got, &want) < 3e-2);
    }

    #[test]
    fn chunks_fit_the_score_budget() {
        assert_eq!(
            chunk_rows(SCORE_BUDGET, 8, 4096, 4096),
            SCORE_BUDGET / (8 * 4096)
        );
        assert_eq!(chunk_rows(SCORE_BUDGET, 1, 77, 77), 77);
        assert_eq!(chunk_rows(SCORE_BUDGET, 1 << 20, 4096, 1 << 10), 1);
    }
}
