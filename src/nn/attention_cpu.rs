//! The chunked attention's row kernels on the CPU: one pass per row where the composed candle
//! ops make four or five, each with a fresh chunk-sized buffer (measured: attention held most of
//! an SD1.5 step at 64×64 latents on the CPU, docs/BENCHMARKS.md). Rows are the last dim of
//! contiguous f32 tensors; `rowvals` hold one value per row.
//!
//! ```text
//! softmax_lse:  p = exp(s − m) / l,  lse = m + ln l       (m = rowmax s, l = rowsum exp(s − m))
//! probs_from_scores (in place):  s ← exp(scale·s − lse)
//! score_grad (in place):         dp ← p ∘ (dp − D) · scale
//! ```

use candle_core::{CpuStorage, InplaceOp2, InplaceOp3, Layout, Result, Tensor};
use rayon::prelude::*;

/// Rows handled per rayon task.
const ROWS_PER_TASK: usize = 16;

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("attention kernel: {what} must be contiguous f32"),
    }
}

fn f32_slice_mut<'a>(s: &'a mut CpuStorage, l: &Layout, what: &str) -> Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&mut v[a..b]),
        _ => candle_core::bail!("attention kernel: {what} must be contiguous f32"),
    }
}

/// Softmax over the last dim of `s` (f32) and its row log-sum-exp `[.., 1]`.
pub fn softmax_lse(s: &Tensor) -> Result<(Tensor, Tensor)> {
    let s = s.contiguous()?;
    let row = s.dim(candle_core::D::Minus1)?;
    let (probs, lse) = super::with_cpu_f32(&s, |x| {
        let mut probs = vec![0f32; x.len()];
        let mut lse = vec![0f32; x.len() / row.max(1)];
        probs
            .par_chunks_mut(row * ROWS_PER_TASK)
            .zip(x.par_chunks(row * ROWS_PER_TASK))
            .zip(lse.par_chunks_mut(ROWS_PER_TASK))
            .for_each(|((p, x), lse)| {
                for ((p, x), lse) in p.chunks_mut(row).zip(x.chunks(row)).zip(lse) {
                    let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                    let mut l = 0f32;
                    for (p, &x) in p.iter_mut().zip(x) {
                        *p = (x - m).exp();
                        l += *p;
                    }
                    let inv = 1.0 / l;
                    p.iter_mut().for_each(|p| *p *= inv);
                    *lse = m + l.ln();
                }
            });
        (probs, lse)
    })?;
    let mut lse_dims = s.dims().to_vec();
    if let Some(last) = lse_dims.last_mut() {
        *last = 1;
    }
    Ok((
        Tensor::from_vec(probs, s.shape(), s.device())?,
        Tensor::from_vec(lse, lse_dims, s.device())?,
    ))
}

/// `s ← exp(scale·s − lse)` in place (`lse` one value per row).
pub fn probs_from_scores(s: &Tensor, lse: &Tensor, scale: f32) -> Result<()> {
    s.inplace_op2(&lse.contiguous()?, &ProbsFromScores { scale })
}

/// `dp ← p ∘ (dp − d)·scale` in place (`d` one value per row).
pub fn score_grad(dp: &Tensor, p: &Tensor, d: &Tensor, scale: f32) -> Result<()> {
    dp.inplace_op3(&p.contiguous()?, &d.contiguous()?, &ScoreGrad { scale })
}

struct ProbsFromScores {
    scale: f32,
}

impl InplaceOp2 for ProbsFromScores {
    fn name(&self) -> &'static str {
        "attention-probs-from-scores"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let lse = f32_slice(s2, l2, "lse")?;
        let s = f32_slice_mut(s1, l1, "scores")?;
        let row = s.len() / lse.len().max(1);
        if row * lse.len() != s.len() {
            candle_core::bail!(
                "attention kernel: {} scores for {} rows",
                s.len(),
                lse.len()
            );
        }
        let scale = self.scale;
        s.par_chunks_mut(row * ROWS_PER_TASK)
            .zip(lse.par_chunks(ROWS_PER_TASK))
            .for_each(|(s, lse)| {
                for (s, &l) in s.chunks_mut(row).zip(lse) {
                    s.iter_mut().for_each(|x| *x = (scale * *x - l).exp());
                }
            });
        Ok(())
    }
}

struct ScoreGrad {
    scale: f32,
}

impl InplaceOp3 for ScoreGrad {
    fn name(&self) -> &'static str {
        "attention-score-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<()> {
        let p = f32_slice(s2, l2, "probs")?;
        let d = f32_slice(s3, l3, "row sums")?;
        let dp = f32_slice_mut(s1, l1, "score gradient")?;
        let row = dp.len() / d.len().max(1);
        if row * d.len() != dp.len() || p.len() != dp.len() {
            candle_core::bail!("attention kernel: mismatched score gradient shapes");
        }
        let scale = self.scale;
        dp.par_chunks_mut(row * ROWS_PER_TASK)
            .zip(p.par_chunks(row * ROWS_PER_TASK))
            .zip(d.par_chunks(ROWS_PER_TASK))
            .for_each(|((dp, p), d)| {
                for ((dp, p), &d) in dp.chunks_mut(row).zip(p.chunks(row)).zip(d) {
                    for (g, &p) in dp.iter_mut().zip(p) {
                        *g = p * (*g - d) * scale;
                    }
                }
            });
        Ok(())
    }
}
