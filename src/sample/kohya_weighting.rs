//! A sample prompt's conditioning as kohya sd-scripts builds it for its samples, with A1111's
//! emphasis ([`super::a1111_syntax`]):
//! - SD1/SD2 (`library/lpw_stable_diffusion.py`, `get_weighted_text_embeddings` with its
//!   defaults: up to 3 × 75 tokens, each 75-token chunk encoded on its own between BOS and EOS):
//!   the prompt's and the negative prompt's tokens are padded with EOS to the same number of
//!   chunks, each token's encoding is multiplied by its weight, and the whole is rescaled so its
//!   mean is the unweighted one's;
//! - SDXL (`library/strategy_sdxl.py`, `encode_tokens_with_weights`; kohya's default
//!   `max_token_length` of 75 tokens): each encoder's tokens (padded as its tokenizer pads)
//!   multiplied by their weights, no rescaling; the pooled embedding is the second encoder's for
//!   the same tokens, unweighted.
//!
//! Differences, each deliberate: SDXL's empty negative prompt is zeros where the model's
//! `model_index.json` asks for it (diffusers' `force_zeros_for_empty_prompt`), as every sdtrain
//! sample does (kohya encodes `""`).

use candle_core::{DType, Device, Tensor};

use super::a1111_syntax;
use crate::model::clip::ClipTokenizer;
use crate::model::family::ModelFamily;
use crate::model::pipeline::{StableDiffusion, TextConditioning, TextEncoder};

/// kohya's `max_embeddings_multiples`: prompts up to 3 chunks of 75 tokens.
const MAX_CHUNKS: usize = 3;

/// The prompt's conditioning and, when `guided`, the negative prompt's.
pub fn encode(
    sd: &StableDiffusion,
    prompt: &str,
    negative: &str,
    guided: bool,
    clip_skip: usize,
) -> candle_core::Result<(TextConditioning, Option<TextConditioning>)> {
    match sd.family() {
        ModelFamily::Sd1 | ModelFamily::Sd2 => {
            let negative = guided.then_some(negative);
            let (cond, uncond) = lpw(sd, prompt, negative, clip_skip)?;
            let wrap = |context| TextConditioning {
                context,
                pooled: None,
            };
            Ok((wrap(cond), uncond.map(wrap)))
        }
        ModelFamily::Sdxl => {
            let cond = sdxl(sd, prompt, clip_skip)?;
            let uncond = match guided {
                true => Some(sdxl(sd, negative, clip_skip)?),
                false => None,
            };
            Ok((cond, uncond))
        }
    }
}

fn first_encoder(sd: &StableDiffusion) -> candle_core::Result<&TextEncoder> {
    sd.text_encoders.first().ok_or_else(|| {
        msg("the text encoders were released (their outputs are cached); this prompt was not")
    })
}

fn msg(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// The text's tokens and their weights, without BOS/EOS, cut at `room` tokens (kohya's
/// `get_prompts_with_weights`: each piece tokenized on its own).
pub fn weighted_tokens(
    tok: &ClipTokenizer,
    text: &str,
    room: usize,
) -> candle_core::Result<(Vec<u32>, Vec<f32>)> {
    let pieces = a1111_syntax::parse(text).map_err(|e| msg(format!("prompt `{text}`: {e}")))?;
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    for (piece, w) in pieces {
        let t = tok
            .tokenize(&piece)
            .map_err(|e| msg(format!("tokenizing `{piece}`: {e}")))?;
        weights.extend(std::iter::repeat_n(w as f32, t.len()));
        ids.extend(t);
        if ids.len() > room {
            break;
        }
    }
    ids.truncate(room);
    weights.truncate(room);
    Ok((ids, weights))
}

/// `lpw_stable_diffusion.get_weighted_text_embeddings`: `[1, chunks·77, D]` for the prompt and
/// the negative prompt (when given), with the same number of chunks.
fn lpw(
    sd: &StableDiffusion,
    prompt: &str,
    negative: Option<&str>,
    clip_skip: usize,
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    let tok = &first_encoder(sd)?.tokenizer;
    let chunk = tok.max_length() - 2;
    let room = chunk * MAX_CHUNKS;
    let p = weighted_tokens(tok, prompt, room)?;
    let n = negative
        .map(|t| weighted_tokens(tok, t, room))
        .transpose()?;
    let longest = p.0.len().max(n.as_ref().map_or(0, |n| n.0.len()));
    let chunks = (longest.saturating_sub(1) / chunk + 1).clamp(1, MAX_CHUNKS);
    let cond = lpw_one(sd, &p, chunks, clip_skip)?;
    let uncond = n.map(|n| lpw_one(sd, &n, chunks, clip_skip)).transpose()?;
    Ok((cond, uncond))
}

/// One row of `lpw`: EOS padding to `chunks · 75 + 2` ids, each chunk encoded between BOS and
/// EOS (kohya's `get_unweighted_text_embeddings`), then weighted with the mean kept.
fn lpw_one(
    sd: &StableDiffusion,
    (tokens, weights): &(Vec<u32>, Vec<f32>),
    chunks: usize,
    clip_skip: usize,
) -> candle_core::Result<Tensor> {
    let te = first_encoder(sd)?;
    let tok = &te.tokenizer;
    let width = tok.max_length();
    let chunk = width - 2;
    let (bos, eos, pad) = (tok.bos_id(), tok.eos_id(), tok.pad_id());
    let mut ids = vec![bos];
    ids.extend(tokens);
    ids.resize(chunk * chunks + 2, eos);
    let last = ids[ids.len() - 1];
    let mut parts = Vec::with_capacity(chunks);
    for i in 0..chunks {
        let mut c: Vec<u32> = match chunks {
            1 => ids.clone(),
            _ => ids[i * chunk..i * chunk + width].to_vec(),
        };
        if chunks > 1 {
            c[0] = bos;
            if pad == eos {
                c[width - 1] = last;
            } else {
                if c[width - 1] != eos && c[width - 1] != pad {
                    c[width - 1] = eos;
                }
                if c[1] == pad {
                    c[1] = eos;
                }
            }
        }
        let c = Tensor::from_vec(c, (1, width), &Device::Cpu)?;
        parts.push(
            sd.encoder_context(0, &c, None, clip_skip)?
                .to_dtype(DType::F32)?,
        );
    }
    let dtype = te.model.compute_dtype;
    let emb = Tensor::cat(&parts, 1)?;
    // Each chunk's BOS and EOS keep weight 1; token k of chunk j has the weight of token
    // j·75 + k of the prompt.
    let mut w = vec![1.0f32; chunks * width];
    for (idx, &v) in weights.iter().enumerate() {
        w[(idx / chunk) * width + 1 + idx % chunk] = v;
    }
    let w = Tensor::from_vec(w, (1, chunks * width, 1), emb.device())?;
    // kohya rescales the weighted embeddings to the unweighted ones' mean. With every weight 1
    // that ratio is 1, except where the mean is exactly 0 (a final layer norm without bias, as
    // in random-weight models), where kohya's 0/0 would make every sample NaN: it is left out.
    if weights.iter().all(|&v| v == 1.0) {
        return emb.to_dtype(dtype);
    }
    let before = emb.mean_all()?;
    let weighted = emb.broadcast_mul(&w)?;
    let after = weighted.mean_all()?;
    weighted
        .broadcast_mul(&before.div(&after)?)?
        .to_dtype(dtype)
}

/// SDXL: each encoder's hidden states times its tokens' weights; the pooled embedding of the
/// second encoder, unweighted.
fn sdxl(
    sd: &StableDiffusion,
    text: &str,
    clip_skip: usize,
) -> candle_core::Result<TextConditioning> {
    let mut contexts = Vec::with_capacity(2);
    let mut pooled = None;
    for (index, te) in sd.text_encoders.iter().take(2).enumerate() {
        let tok = &te.tokenizer;
        let width = tok.max_length();
        let (tokens, weights) = weighted_tokens(tok, text, width - 2)?;
        let mut ids = vec![tok.bos_id()];
        ids.extend(&tokens);
        ids.push(tok.eos_id());
        ids.resize(width, tok.pad_id());
        let mut w = vec![1.0f32];
        w.extend(&weights);
        w.resize(width, 1.0);
        let ids = Tensor::from_vec(ids, (1, width), &Device::Cpu)?;
        let out = te.model.forward(&ids, 1 + clip_skip)?;
        let w = Tensor::from_vec(w, (1, width, 1), out.hidden.device())?;
        let dtype = out.hidden.dtype();
        contexts.push(
            out.hidden
                .to_dtype(DType::F32)?
                .broadcast_mul(&w)?
                .to_dtype(dtype)?,
        );
        if index == 1 {
            pooled = out.text_embeds;
        }
    }
    if contexts.len() < 2 {
        candle_core::bail!("the text encoders were released (their outputs are cached)");
    }
    let dtype = contexts[0].dtype();
    let second = contexts[1].to_dtype(dtype)?;
    Ok(TextConditioning {
        context: Tensor::cat(&[&contexts[0], &second], 2)?,
        pooled,
    })
}
