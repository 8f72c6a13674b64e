//! Multi-head scaled dot-product attention from differentiable primitives:
//! `softmax(q·kᵀ / sqrt(d) + mask) · v`, per head.
//!
//! Scores and softmax are computed in f32 whatever the input dtype (diffusers' `upcast_attention`
//! and `upcast_softmax`). Unmasked attention (every UNet layer) goes through
//! [`super::chunked_attention`], which never keeps the `[B, H, Lq, Lk]` scores for backward; the
//! composed [`attention_reference`] keeps them (about 2.5 GB per 4096-token layer per sample,
//! measured on an H100: docs/GPU.md) and serves masked attention (CLIP's 77 tokens).

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
    if mask.is_some() || !super::frozen::custom_op_device(q) {
        return attention_reference(q, k, v, heads, mask);
    }
    let (b, lq, inner) = q.dims3()?;
    let lk = k.dim(1)?;
    let head_dim = inner / heads;
    let split = |t: &Tensor, l: usize| split_heads(t, (b, l, heads, head_dim));
    let scale = 1.0 / (head_dim as f64).sqrt();
    super::chunked_attention::chunked_attention(
        &split(q, lq)?,
        &split(k, lk)?,
        &split(v, lk)?,
        scale,
        None,
    )?
    .transpose(1, 2)?
    .reshape((b, lq, inner))
}

/// [`attention`] from composed candle ops, keeping every intermediate for backward.
pub fn attention_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    mask: Option<&Tensor>,
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
    let probs = candle_nn::ops::softmax(&scores, D::Minus1)?.to_dtype(dtype)?;
    super::matmul(&probs, &v)?
        .transpose(1, 2)?
        .reshape((b, lq, inner))
}

/// `[B, L, H·D]` → `[B, H, L, D]`, contiguous.
fn split_heads(t: &Tensor, shape: (usize, usize, usize, usize)) -> Result<Tensor> {
    t.reshape(shape)?.transpose(1, 2)?.contiguous()
}

/// The causal mask CLIP's text transformer uses: `[1, 1, L, L]` with the most negative f32 above the diagonal.
pub fn causal_mask(len: usize, device: &Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..len)
        .flat_map(|i| (0..len).map(move |j| if j > i { f32::MIN } else { 0.0 }))
        .collect();
    Tensor::from_slice(&mask, (1, 1, len, len), device)
}
