//! The chunked attention's forward and backward on the CPU, block by block with no allocation per
//! block: for each head and block of query rows, the block's scores live in a per-thread scratch
//! buffer sized for the cache (about 256 KiB), are turned into probabilities in place, and meet
//! `v` (forward) or the upstream gradient (backward) in single-threaded GEMMs ([`super::cpu_gemm`]).
//! Heads and blocks run in parallel on rayon.
//!
//! This replaced candle ops over query chunks of up to 16 Mi scores, whose fresh 64 MiB buffers
//! (every chunk, every layer) cost more in page faults and kernel zero-filling than the math
//! (docs/BENCHMARKS.md). The math is `chunked_attention`'s, for `q` `[BH, Lq, D]`, `k`, `v`
//! `[BH, Lk, D]` (contiguous f32) and scale `s`:
//!
//! ```text
//! forward:  S = s·q_b·kᵀ;  P = softmax S;  o_b = P·v;  L_b = rowlogsumexp S
//! backward: D = rowsum(dO ∘ O);  P = exp(s·q_b·kᵀ − L_b)
//!           dV += Pᵀ·dO_b;  dP = dO_b·vᵀ;  dS = P ∘ (dP − D_b)·s;  dQ_b = dS·k;  dK += dSᵀ·q_b
//! ```
//!
//! The backward runs one head per task (dK and dV sum over every query block of the head).

use std::cell::RefCell;

use rayon::prelude::*;

use super::cpu_gemm::{gemm, Mat};
use super::softmax_row;

/// Score elements per block: 64 Ki f32 = 256 KiB, about an L2 cache.
const BLOCK_SCORES: usize = 1 << 16;

/// The attention's shape: `bh` heads (batch × heads), `lq` queries, `lk` keys, head dim `d`.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub bh: usize,
    pub lq: usize,
    pub lk: usize,
    pub d: usize,
}

/// Query rows per block for `lk` keys: the block's scores fit [`BLOCK_SCORES`].
pub fn block_rows(lk: usize) -> usize {
    (BLOCK_SCORES / lk.max(1)).clamp(4, 256)
}

thread_local! {
    /// Two reusable score-sized buffers per thread (scores/probabilities and their gradient).
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Runs `f` with two scratch buffers of at least `n` elements (contents unspecified).
fn with_scratch<R>(n: usize, f: impl FnOnce(&mut [f32], &mut [f32]) -> R) -> R {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        let (a, b) = &mut *s;
        if a.len() < n {
            a.resize(n, 0.0);
            b.resize(n, 0.0);
        }
        f(&mut a[..n], &mut b[..n])
    })
}

/// The output `[BH, Lq, D]` and row log-sum-exp `[BH, Lq]` of `softmax(s·q·kᵀ)·v`.
/// Query blocks have `rows` rows ([`block_rows`] unless a test asks otherwise).
pub fn forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: Dims,
    scale: f32,
    rows: usize,
) -> (Vec<f32>, Vec<f32>) {
    let Dims { bh, lq, lk, d } = dims;
    let rows = rows.max(1);
    assert!(q.len() == bh * lq * d && k.len() == bh * lk * d && v.len() == k.len());
    let mut out = vec![0f32; bh * lq * d];
    let mut lse = vec![0f32; bh * lq];
    if lq == 0 || d == 0 {
        return (out, lse);
    }
    out.par_chunks_mut(lq * d)
        .zip(lse.par_chunks_mut(lq))
        .enumerate()
        .for_each(|(h, (o_h, lse_h))| {
            let (q_h, k_h, v_h) = (
                head_of(q, h, lq * d),
                head_of(k, h, lk * d),
                head_of(v, h, lk * d),
            );
            o_h.par_chunks_mut(rows * d)
                .zip(lse_h.par_chunks_mut(rows))
                .enumerate()
                .for_each(|(b, (o_b, lse_b))| {
                    let n = lse_b.len();
                    let q_b = &q_h[b * rows * d..(b * rows + n) * d];
                    with_scratch(n * lk, |s, _| {
                        forward_block(q_b, k_h, v_h, (n, lk, d), scale, s, o_b, lse_b)
                    })
                });
        });
    (out, lse)
}

/// One block of `n` query rows: scores into `s`, softmax in place, `o_b = P·v`.
#[allow(clippy::too_many_arguments)]
fn forward_block(
    q_b: &[f32],
    k_h: &[f32],
    v_h: &[f32],
    (n, lk, d): (usize, usize, usize),
    scale: f32,
    s: &mut [f32],
    o_b: &mut [f32],
    lse_b: &mut [f32],
) {
    if lk == 0 {
        lse_b.fill(f32::NEG_INFINITY);
        return;
    }
    gemm(
        n,
        lk,
        d,
        s,
        lk,
        false,
        Mat::rows(q_b, d),
        Mat::rows_t(k_h, d),
        1.0,
    );
    for (row, l) in s.chunks_mut(lk).zip(lse_b.iter_mut()) {
        *l = softmax_row::softmax(row, scale);
    }
    gemm(
        n,
        d,
        lk,
        o_b,
        d,
        false,
        Mat::rows(s, lk),
        Mat::rows(v_h, d),
        1.0,
    );
}

/// Which input gradients to compute.
#[derive(Clone, Copy, Debug)]
pub struct Wanted {
    pub q: bool,
    pub k: bool,
    pub v: bool,
}

/// The gradients `(dq, dk, dv)` (empty where not wanted) for upstream gradient `g` of output `o`,
/// with the forward's row log-sum-exp `lse`, in query blocks of `rows` rows.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    g: &[f32],
    lse: &[f32],
    dims: Dims,
    scale: f32,
    want: Wanted,
    rows: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let Dims { bh, lq, lk, d } = dims;
    assert!(q.len() == bh * lq * d && o.len() == q.len() && g.len() == q.len());
    assert!(k.len() == bh * lk * d && v.len() == k.len() && lse.len() == bh * lq);
    let sized = |on: bool, n: usize| if on { vec![0f32; n] } else { Vec::new() };
    let mut dq = sized(want.q, bh * lq * d);
    let mut dk = sized(want.k, bh * lk * d);
    let mut dv = sized(want.v, bh * lk * d);
    if lq == 0 || lk == 0 || d == 0 {
        return (dq, dk, dv);
    }
    // Row sums D = rowsum(dO ∘ O), one per query row.
    let d_rows: Vec<f32> = g
        .par_chunks(d)
        .zip(o.par_chunks(d))
        .map(|(g, o)| g.iter().zip(o).map(|(a, b)| a * b).sum())
        .collect();
    let heads: Vec<(usize, Grads)> = split_heads(&mut dq, &mut dk, &mut dv, dims);
    heads.into_par_iter().for_each(|(h, grads)| {
        let head = Head {
            q: head_of(q, h, lq * d),
            k: head_of(k, h, lk * d),
            v: head_of(v, h, lk * d),
            g: head_of(g, h, lq * d),
            lse: head_of(lse, h, lq),
            d_rows: head_of(&d_rows, h, lq),
        };
        backward_head(&head, grads, dims, scale, rows.max(1));
    });
    (dq, dk, dv)
}

/// Head `h` of `x`, `len` elements a head.
fn head_of(x: &[f32], h: usize, len: usize) -> &[f32] {
    &x[h * len..(h + 1) * len]
}

/// One head's inputs.
struct Head<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    lse: &'a [f32],
    d_rows: &'a [f32],
}

/// One head's gradient outputs (`None` where not wanted).
struct Grads<'a> {
    dq: Option<&'a mut [f32]>,
    dk: Option<&'a mut [f32]>,
    dv: Option<&'a mut [f32]>,
}

/// The per-head slices of the wanted gradients, for the parallel loop.
fn split_heads<'a>(
    dq: &'a mut [f32],
    dk: &'a mut [f32],
    dv: &'a mut [f32],
    dims: Dims,
) -> Vec<(usize, Grads<'a>)> {
    let Dims { bh, lq, lk, d } = dims;
    let mut dq = (!dq.is_empty()).then(|| dq.chunks_mut(lq * d));
    let mut dk = (!dk.is_empty()).then(|| dk.chunks_mut(lk * d));
    let mut dv = (!dv.is_empty()).then(|| dv.chunks_mut(lk * d));
    (0..bh)
        .map(|h| {
            let grads = Grads {
                dq: dq.as_mut().and_then(|c| c.next()),
                dk: dk.as_mut().and_then(|c| c.next()),
                dv: dv.as_mut().and_then(|c| c.next()),
            };
            (h, grads)
        })
        .collect()
}

/// One head's backward, query block by query block.
fn backward_head(x: &Head, mut out: Grads, dims: Dims, scale: f32, rows: usize) {
    let Dims { lq, lk, .. } = dims;
    for start in (0..lq).step_by(rows) {
        let n = rows.min(lq - start);
        with_scratch(n * lk, |p, dp| {
            backward_block(x, &mut out, dims, scale, start..start + n, (p, dp));
        });
    }
}

/// The query rows `block`'s share of one head's gradients; `p`, `dp` are its `n × lk` scratch.
fn backward_block(
    x: &Head,
    out: &mut Grads,
    dims: Dims,
    scale: f32,
    block: std::ops::Range<usize>,
    (p, dp): (&mut [f32], &mut [f32]),
) {
    let Dims { lk, d, .. } = dims;
    let (start, n) = (block.start, block.len());
    let (q_b, g_b) = (
        &x.q[start * d..(start + n) * d],
        &x.g[start * d..(start + n) * d],
    );
    // P = exp(s·q_b·kᵀ − L), recomputed.
    gemm(
        n,
        lk,
        d,
        p,
        lk,
        false,
        Mat::rows(q_b, d),
        Mat::rows_t(x.k, d),
        1.0,
    );
    for (row, &l) in p.chunks_mut(lk).zip(&x.lse[block.clone()]) {
        softmax_row::probs(row, scale, l);
    }
    if let Some(dv) = out.dv.as_deref_mut() {
        gemm(
            lk,
            d,
            n,
            dv,
            d,
            true,
            Mat::rows_t(p, lk),
            Mat::rows(g_b, d),
            1.0,
        );
    }
    if out.dq.is_none() && out.dk.is_none() {
        return;
    }
    score_grads(x, g_b, &x.d_rows[block], (p, dp), dims, scale);
    if let Some(dq) = out.dq.as_deref_mut() {
        let dq_b = &mut dq[start * d..(start + n) * d];
        gemm(
            n,
            d,
            lk,
            dq_b,
            d,
            false,
            Mat::rows(dp, lk),
            Mat::rows(x.k, d),
            1.0,
        );
    }
    if let Some(dk) = out.dk.as_deref_mut() {
        gemm(
            lk,
            d,
            n,
            dk,
            d,
            true,
            Mat::rows_t(dp, lk),
            Mat::rows(q_b, d),
            1.0,
        );
    }
}

/// `dS = P ∘ (g_b·vᵀ − D_b)·s` into `dp`, for the block's probabilities `p` and rows `d_b` of D.
fn score_grads(
    x: &Head,
    g_b: &[f32],
    d_b: &[f32],
    (p, dp): (&[f32], &mut [f32]),
    dims: Dims,
    scale: f32,
) {
    let Dims { lk, d, .. } = dims;
    gemm(
        d_b.len(),
        lk,
        d,
        dp,
        lk,
        false,
        Mat::rows(g_b, d),
        Mat::rows_t(x.v, d),
        1.0,
    );
    for ((ds, p), &dr) in dp.chunks_mut(lk).zip(p.chunks(lk)).zip(d_b) {
        softmax_row::score_grad(ds, p, dr, scale);
    }
}
