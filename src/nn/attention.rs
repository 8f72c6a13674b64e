//! Multi-head scaled dot-product attention from differentiable primitives:
//! `softmax(q·kᵀ / sqrt(d) + mask) · v`, per head.
//!
//! Scores and softmax are computed in f32 whatever the input dtype (diffusers' `upcast_attention`
//! and `upcast_softmax`). Unmasked attention (every UNet layer) goes through
//! [`super::chunked_attention`], which never keeps the `[B, H, Lq, Lk]` scores for backward; the
//! composed [`attention_reference`] keeps them (about 2.5 GB per 4096-token layer per sample,
//! measured on an H100: docs/GPU.md). Masked attention (CLIP's 77 tokens) is the composed form
//! with the fused softmax of `softmax.rs`, which keeps only the probabilities for backward.
//!
//! On CUDA, unmasked attention over at least `FLASH_MIN_KEYS` keys and causal
//! ([`causal_attention`]) attention go through the flash kernels (`super::flash_attention`,
//! FlashAttention-2, arXiv 2307.08691) instead, which keep neither scores nor probabilities;
//! cross-attention over fewer keys (77 text tokens) takes the chunked path, which is faster there.

use candle_core::{DType, Device, Result, Tensor, D};

/// `q` `[B, Lq, H·D]`, `k`/`v` `[B, Lk, H·D]` → `[B, Lq, H·D]`. `mask` is added to the scores and
/// must broadcast to `[B, H, Lq, Lk]`.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    if mask.is_some() {
        if super::fused_op::use_fused(q) {
            return composed(q, k, v, heads, mask, super::softmax::softmax_last_dim);
        }
        return attention_reference(q, k, v, heads, mask);
    }
    if !super::frozen::custom_op_device(q) {
        return attention_reference(q, k, v, heads, mask);
    }
    if let Some(out) = flash(q, k, v, heads, false)? {
        return Ok(out);
    }
    let scale = head_scale(q, heads)?;
    super::merged_heads::merged_heads(q, k, v, heads, |q, k, v| {
        super::chunked_attention::chunked_detached(q, k, v, scale)
    })
}

/// `1/sqrt(D)` for `q` `[B, L, H·D]`.
fn head_scale(q: &Tensor, heads: usize) -> Result<f64> {
    let inner = q.dim(2)?;
    Ok(1.0 / ((inner / heads.max(1)) as f64).sqrt())
}

/// [`attention`] under CLIP's causal mask: the flash kernel with its causal flag where it runs
/// (see [`flash`]), else the masked path of [`attention`] with the mask's values.
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    mask: &CausalMask,
) -> Result<Tensor> {
    if let Some(out) = flash(q, k, v, heads, true)? {
        return Ok(out);
    }
    attention(q, k, v, heads, Some(mask.tensor()))
}

/// Key lengths below this take chunked attention instead of flash (unmasked attention only).
/// Cross-attention over 77 text tokens, SD1.5 at 4096 queries, forward + backward on an H100 in
/// bf16: flash 1.74 ms, chunked 0.76 ms; self-attention over 256 tokens: flash 0.36 ms, chunked
/// 0.49 ms (bench_step --op-profile, 2026-11-24). The flash kernels' key tiles and per-tile dQ
/// atomics do not pay off over so few keys.
#[cfg(feature = "cuda")]
const FLASH_MIN_KEYS: usize = 128;

/// Flash attention (`super::flash_attention`) when it runs here: a CUDA tensor of a float dtype,
/// fused ops enabled (off gives the composed and chunked paths, for benchmarks), a head dim the
/// kernels take, and (unmasked) at least [`FLASH_MIN_KEYS`] keys. `None`: use another path.
#[cfg(feature = "cuda")]
fn flash(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, causal: bool) -> Result<Option<Tensor>> {
    use super::flash_attention::{flash_detached, MAX_HEAD_DIM};
    let float = matches!(q.dtype(), DType::F32 | DType::BF16 | DType::F16);
    if !(q.device().is_cuda() && float && super::fused_op::use_fused(q)) {
        return Ok(None);
    }
    let (_, lq, inner) = q.dims3()?;
    let lk = k.dim(1)?;
    let head_dim = inner / heads.max(1);
    if head_dim > MAX_HEAD_DIM || (causal && lq != lk) || (!causal && lk < FLASH_MIN_KEYS) {
        return Ok(None);
    }
    let scale = head_scale(q, heads)?;
    // The tensor-core kernels read the merged heads in place; the others take split copies.
    if let Some(out) = super::flash_attention::flash_merged(q, k, v, heads, scale, causal)? {
        return Ok(Some(out));
    }
    let out = super::merged_heads::merged_heads(q, k, v, heads, |q, k, v| {
        flash_detached(q, k, v, scale, causal)
    })?;
    Ok(Some(out))
}

#[cfg(not(feature = "cuda"))]
fn flash(_: &Tensor, _: &Tensor, _: &Tensor, _: usize, _: bool) -> Result<Option<Tensor>> {
    Ok(None)
}

/// [`attention`] from composed candle ops, keeping every intermediate for backward.
pub fn attention_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    composed(q, k, v, heads, mask, |s| {
        candle_nn::ops::softmax(s, D::Minus1)
    })
}

/// The whole `[B, H, Lq, Lk]` score matrix at once, normalised with `softmax` (over the last
/// dimension, on f32 scores).
fn composed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    mask: Option<&Tensor>,
    softmax: fn(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let dtype = q.dtype();
    let (b, lq, inner) = q.dims3()?;
    let lk = k.dim(1)?;
    let head_dim = inner / heads;
    let split = |t: &Tensor, l: usize| split_heads(t, (b, l, heads, head_dim));
    let scale = 1.0 / (head_dim as f64).sqrt();
    let q = (split(q, lq)?.to_dtype(DType::F32)? * scale)?;
    let k = split(k, lk)?.to_dtype(DType::F32)?;
    let v = split(v, lk)?;
    let mut scores = q.matmul(&k.t()?)?; // f32 on every backend
    if let Some(m) = mask {
        scores = super::frozen::broadcast_add_const(&scores, &m.to_dtype(DType::F32)?)?;
    }
    let probs = softmax(&scores)?.to_dtype(dtype)?;
    super::matmul(&probs, &v)?
        .transpose(1, 2)?
        .reshape((b, lq, inner))
}

/// `[B, L, H·D]` → `[B, H, L, D]`, contiguous.
fn split_heads(t: &Tensor, shape: (usize, usize, usize, usize)) -> Result<Tensor> {
    t.reshape(shape)?.transpose(1, 2)?.contiguous()
}

/// The causal mask CLIP's text transformer uses: `[1, 1, L, L]` with the most negative f32 above
/// the diagonal. Only [`causal_mask`] makes one, so [`causal_attention`] may apply it as the flash
/// kernel's causal flag instead of reading its values.
#[derive(Clone, Debug)]
pub struct CausalMask(Tensor);

impl CausalMask {
    /// The additive mask.
    pub fn tensor(&self) -> &Tensor {
        &self.0
    }
}

/// [`CausalMask`] for `len` tokens.
pub fn causal_mask(len: usize, device: &Device) -> Result<CausalMask> {
    let mask: Vec<f32> = (0..len)
        .flat_map(|i| (0..len).map(move |j| if j > i { f32::MIN } else { 0.0 }))
        .collect();
    Ok(CausalMask(Tensor::from_slice(
        &mask,
        (1, 1, len, len),
        device,
    )?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::test_util::{assert_parity, fill};

    /// CLIP's path: causal-masked attention with the fused softmax against the composed
    /// reference; all of `q`, `k`, `v` tracked. `[2, 7, 12]` with 3 heads of 4.
    #[test]
    fn masked_attention_matches_reference() {
        let qkv: Vec<Tensor> = (0..3).map(|i| fill(&[2, 7, 12], 20 + i, 1.5)).collect();
        let mask = causal_mask(7, &Device::Cpu).unwrap();
        assert_parity(
            "masked attention",
            &qkv,
            &[true; 3],
            1e-5,
            &|a| causal_attention(&a[0], &a[1], &a[2], 3, &mask),
            &|a| attention_reference(&a[0], &a[1], &a[2], 3, Some(mask.tensor())),
        );
    }
}
