//! A sample prompt's conditioning with compel's weights ([`super::compel_syntax`]), as compel
//! 1.1's `EmbeddingsProvider` builds it for EveryDream2's samples (and compel 2 for SDXL, with
//! each text encoder weighted on its own and the pooled embedding of the prompt's raw text).
//!
//! Per text encoder, with the fragments' tokens joined and cut to `max_length − 2`:
//! ```text
//! ids = BOS tokens EOS pad…        w = 1 (each fragment's weight on its tokens) 1 1…
//! z = encode(ids)                  ∅ = encode(BOS EOS pad…)
//! base = ∅ + (z − ∅)·w
//! ```
//! and each fragment of weight `v < 1` adds `eᵢ = ∅ + (encode(ids, its tokens masked out of the
//! attention) − ∅)·w` to a weighted mean with `base`: weight 1 for `base`, `tan((1 − v)·π/2)` for
//! `eᵢ`, divided by their sum (compel's `DownweightMode.MASK`). A `.blend()` is the weighted
//! mean of its prompts' conditionings.
//!
//! A prompt with no weights is the plain encoding of its text, as diffusers' pipelines encode it
//! (compel's `∅ + (z − ∅)·1` differs from it by rounding only). A random training caption that
//! compel's syntax cannot read is encoded as it stands (EveryDream2 would stop on it).

use std::f64::consts::FRAC_PI_2;

use candle_core::{DType, Device, Tensor};

use super::compel_syntax::{self, Fragment, WeightedPrompt};
use crate::model::family::ModelFamily;
use crate::model::pipeline::{StableDiffusion, TextConditioning};

/// `prompt`'s conditioning under compel's weighting. `clip_skip` as
/// [`StableDiffusion::encode_prompts`].
pub fn encode(
    sd: &StableDiffusion,
    prompt: &str,
    clip_skip: usize,
) -> candle_core::Result<TextConditioning> {
    // The prompts file and `--prompt` are checked when read; a random training caption compel
    // cannot read is encoded as it stands.
    let parsed = match compel_syntax::parse(prompt) {
        Ok(p) if p.plain_text() != Some(prompt) => p,
        _ => return sd.encode_prompts(&[prompt], clip_skip),
    };
    let context = match &parsed {
        WeightedPrompt::Fragments(f) => fragments_context(sd, f, clip_skip)?,
        WeightedPrompt::Blend {
            prompts,
            weights,
            normalize,
        } => blend(sd, prompts, weights, *normalize, clip_skip)?,
    };
    let pooled = match sd.family() {
        ModelFamily::Sdxl => sd.encode_prompts(&[prompt], clip_skip)?.pooled,
        ModelFamily::Sd1 | ModelFamily::Sd2 => None,
    };
    Ok(TextConditioning { context, pooled })
}

/// `Σ wᵢ·cᵢ` over the prompts' conditionings, the weights divided by their sum when `normalize`.
fn blend(
    sd: &StableDiffusion,
    prompts: &[Vec<Fragment>],
    weights: &[f64],
    normalize: bool,
    clip_skip: usize,
) -> candle_core::Result<Tensor> {
    let total: f64 = match normalize {
        true => weights.iter().sum(),
        false => 1.0,
    };
    let mut acc: Option<Tensor> = None;
    let mut dtype = DType::F32;
    for (p, w) in prompts.iter().zip(weights) {
        let c = fragments_context(sd, p, clip_skip)?;
        dtype = c.dtype();
        let c = (c.to_dtype(DType::F32)? * (w / total))?;
        acc = Some(match acc {
            None => c,
            Some(a) => (a + c)?,
        });
    }
    match acc {
        Some(a) => a.to_dtype(dtype),
        None => candle_core::bail!("`.blend()` has no prompts"),
    }
}

/// One prompt's context `[1, L, D]`: every text encoder's weighted output, side by side.
fn fragments_context(
    sd: &StableDiffusion,
    fragments: &[Fragment],
    clip_skip: usize,
) -> candle_core::Result<Tensor> {
    if let [f] = fragments {
        if f.weight == 1.0 {
            return Ok(sd.encode_prompts(&[&f.text], clip_skip)?.context);
        }
    }
    let encoders = match sd.family() {
        ModelFamily::Sd1 | ModelFamily::Sd2 => 1,
        ModelFamily::Sdxl => 2,
    };
    sd.require_text_encoders()?;
    let mut parts = Vec::with_capacity(encoders);
    for index in 0..encoders {
        parts.push(encoder_context(sd, index, fragments, clip_skip)?);
    }
    let dtype = parts[0].dtype();
    let parts = parts
        .iter()
        .map(|p| p.to_dtype(dtype))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Tensor::cat(&parts, 2)
}

/// The ids, weights and per-fragment tokens of one text encoder's row.
struct Row {
    ids: Vec<u32>,
    weights: Vec<f32>,
    per_fragment: Vec<Vec<u32>>,
}

fn row(sd: &StableDiffusion, index: usize, fragments: &[Fragment]) -> candle_core::Result<Row> {
    let tok = &sd.text_encoders[index].tokenizer;
    let len = tok.max_length();
    let room = len - 2;
    let mut per_fragment = Vec::with_capacity(fragments.len());
    let (mut ids, mut weights) = (vec![tok.bos_id()], vec![1.0f32]);
    for f in fragments {
        let mut t = tok
            .tokenize(&f.text)
            .map_err(|e| candle_core::Error::Msg(format!("tokenizing `{}`: {e}", f.text)))?;
        t.truncate(room);
        for &id in &t {
            if ids.len() <= room {
                ids.push(id);
                weights.push(f.weight as f32);
            }
        }
        per_fragment.push(t);
    }
    ids.push(tok.eos_id());
    weights.push(1.0);
    ids.resize(len, tok.pad_id());
    weights.resize(len, 1.0);
    Ok(Row {
        ids,
        weights,
        per_fragment,
    })
}

/// compel's `_get_token_ranges_for_fragments` on one row: where each fragment's tokens are,
/// first to last inclusive; `None` for a fragment without tokens. A fragment cut by the
/// truncation ends at the row's last position (the EOS), as compel's scan does; fragments
/// after the cut are left out.
fn token_ranges(ids: &[u32], per_fragment: &[Vec<u32>]) -> Vec<Option<(usize, usize)>> {
    let last = ids.len() - 1;
    let mut out = Vec::new();
    let mut start = 0;
    for tokens in per_fragment {
        let Some(&first) = tokens.first() else {
            out.push(None);
            continue;
        };
        if start >= last {
            break;
        }
        while start < last && ids[start] != first {
            start += 1;
        }
        let mut end = start;
        let mut matched = 0;
        while end < last {
            if ids[end] == tokens[matched] {
                matched += 1;
                if matched == tokens.len() {
                    break;
                }
            }
            end += 1;
        }
        out.push(Some((start, end.min(last))));
        start = end + 1;
    }
    out
}

/// One text encoder's weighted output `[1, L, D]`.
fn encoder_context(
    sd: &StableDiffusion,
    index: usize,
    fragments: &[Fragment],
    clip_skip: usize,
) -> candle_core::Result<Tensor> {
    let r = row(sd, index, fragments)?;
    let len = r.ids.len();
    let tok = &sd.text_encoders[index].tokenizer;
    let mut empty_ids = vec![tok.bos_id(), tok.eos_id()];
    empty_ids.resize(len, tok.pad_id());
    let host = |v: &[u32]| Tensor::from_slice(v, (1, len), &Device::Cpu);
    let ids = host(&r.ids)?;
    let empty = sd.encoder_context(index, &host(&empty_ids)?, None, clip_skip)?;
    let dtype = empty.dtype();
    let empty = empty.to_dtype(DType::F32)?;
    let w = Tensor::from_slice(&r.weights, (1, len, 1), empty.device())?;
    let weighted = |keep: Option<&[Vec<bool>]>| -> candle_core::Result<Tensor> {
        let z = sd
            .encoder_context(index, &ids, keep, clip_skip)?
            .to_dtype(DType::F32)?;
        empty.broadcast_add(&(z - &empty)?.broadcast_mul(&w)?)
    };
    let mut embeddings = vec![weighted(None)?];
    let mut shares = vec![1.0f64];
    for (f, range) in fragments.iter().zip(token_ranges(&r.ids, &r.per_fragment)) {
        // compel fails on a down-weighted fragment without tokens; it has nothing to mask.
        let (true, Some((a, b))) = (f.weight < 1.0, range) else {
            continue;
        };
        let mut keep = vec![true; len];
        keep[a..=b].iter_mut().for_each(|k| *k = false);
        embeddings.push(weighted(Some(&[keep]))?);
        shares.push(((1.0 - f.weight.max(1e-5)) * FRAC_PI_2).tan());
    }
    let total: f64 = shares.iter().sum();
    let mut out = (&embeddings[0] * (shares[0] / total))?;
    for (e, s) in embeddings.iter().zip(&shares).skip(1) {
        out = (out + (e * (s / total))?)?;
    }
    out.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// compel's scan: consecutive fragments, an empty one skipped, and a fragment cut by the
    /// truncation running to the last position.
    #[test]
    fn token_ranges_follow_compel() {
        // BOS=9, EOS=8, pad=0; fragments [1 2] [] [3] [4 5 6] in a row of 7 (room for 5 tokens).
        let ids = [9, 1, 2, 3, 4, 5, 8];
        let frags = vec![vec![1, 2], vec![], vec![3], vec![4, 5, 6]];
        assert_eq!(
            token_ranges(&ids, &frags),
            vec![Some((1, 2)), None, Some((3, 3)), Some((4, 6))]
        );
        // A fragment wholly past the cut is left out.
        let frags = vec![vec![1, 2, 3, 4, 5], vec![7]];
        assert_eq!(token_ranges(&ids, &frags), vec![Some((1, 5))]);
    }
}
