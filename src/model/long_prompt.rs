//! Captions longer than the text encoder's 75 tokens, as kohya sd-scripts trains on them
//! (`--max_token_length 150|225`; `library/strategy_base.py` `_get_input_ids`,
//! `strategy_sd.py` `encode_tokens`, `strategy_sdxl.py` `_get_hidden_states_sdxl`):
//! ```text
//! ids   = BOS t₁ … t₇₅ₙ EOS pad…                       (75·n + 2 ids, cut and padded)
//! chunk c = BOS, ids[1 + 75c .. 76 + 75c], last id      (n rows of 77, each encoded alone)
//! context = h₀[BOS], h_c[1..76] for each chunk c, h_{n−1}[last]     (75·n + 2 positions)
//! ```
//! Where the tokenizer pads with something other than EOS (SD2's and SDXL's second), a chunk
//! whose last token is a word gets EOS in its last place, and a chunk that starts with padding
//! gets EOS after BOS, as kohya's `_get_input_ids` does. SDXL's pooled embedding is the first
//! chunk's.

use candle_core::{Device, Tensor};

use super::clip::ClipTokenizer;
use super::family::ModelFamily;
use super::pipeline::{StableDiffusion, TextConditioning, TextEncoder};

/// kohya's `max_token_length` choices: 75 (one chunk, the default), 150 and 225.
pub const MAX_CHUNKS: usize = 3;

/// The `n` rows of 77 ids each prompt is encoded as.
fn chunk_ids(tok: &ClipTokenizer, prompt: &str, chunks: usize) -> candle_core::Result<Vec<u32>> {
    let tokens = tok
        .tokenize(prompt)
        .map_err(|e| candle_core::Error::Msg(format!("tokenizing a caption: {e}")))?;
    Ok(chunk_rows(tok, tokens, chunks))
}

/// [`chunk_ids`] of a prompt's BPE tokens (no BOS or EOS).
fn chunk_rows(tok: &ClipTokenizer, mut tokens: Vec<u32>, chunks: usize) -> Vec<u32> {
    let width = tok.max_length();
    let room = width - 2;
    tokens.truncate(room * chunks);
    let (bos, eos, pad) = (tok.bos_id(), tok.eos_id(), tok.pad_id());
    let mut ids = vec![bos];
    ids.extend(tokens);
    ids.push(eos);
    ids.resize(room * chunks + 2, pad);
    let last = ids[ids.len() - 1];
    let mut rows = Vec::with_capacity(chunks * width);
    for c in 0..chunks {
        let mut row = vec![bos];
        row.extend_from_slice(&ids[1 + room * c..1 + room * (c + 1)]);
        row.push(last);
        if pad != eos {
            if row[width - 2] != eos && row[width - 2] != pad {
                row[width - 1] = eos;
            }
            if row[1] == pad {
                row[1] = eos;
            }
        }
        rows.extend(row);
    }
    rows
}

/// `[B·n, 77, D]` hidden states back to `[B, 75·n + 2, D]`: each chunk without its first and
/// last place, between the first chunk's BOS and the last chunk's last place.
fn merge(h: &Tensor, batch: usize, chunks: usize) -> candle_core::Result<Tensor> {
    let (_, width, d) = h.dims3()?;
    let h = h.reshape((batch, chunks * width, d))?;
    let mut parts = vec![h.narrow(1, 0, 1)?];
    for c in 0..chunks {
        parts.push(h.narrow(1, c * width + 1, width - 2)?);
    }
    parts.push(h.narrow(1, chunks * width - 1, 1)?);
    Tensor::cat(&parts, 1)
}

fn ids_tensor(te: &TextEncoder, prompts: &[&str], chunks: usize) -> candle_core::Result<Tensor> {
    let width = te.tokenizer.max_length();
    let mut flat = Vec::with_capacity(prompts.len() * chunks * width);
    for p in prompts {
        flat.extend(chunk_ids(&te.tokenizer, p, chunks)?);
    }
    Tensor::from_vec(flat, (prompts.len() * chunks, width), &Device::Cpu)
}

/// One prompt's BPE tokens for one encoder (no BOS or EOS) and a weight per token.
pub type WeightedTokens = (Vec<u32>, Vec<f32>);

/// Each merged place's weight for `prompts` (`[B, 75·chunks + 2, 1]`): BOS, EOS and padding 1,
/// token `k` at place `1 + k`.
fn place_weights(
    prompts: &[WeightedTokens],
    room: usize,
    chunks: usize,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let len = room * chunks + 2;
    let mut w = vec![1.0f32; prompts.len() * len];
    for (p, (_, weights)) in prompts.iter().enumerate() {
        for (k, &x) in weights.iter().take(room * chunks).enumerate() {
            w[p * len + 1 + k] = x;
        }
    }
    Tensor::from_vec(w, (prompts.len(), len, 1), device)
}

impl StableDiffusion {
    /// [`Self::encode_prompts_long`] of prompts given as each encoder's tokens
    /// (`per_encoder[e][p]`), each token's encoding times its weight: kohya's
    /// `encode_tokens_with_weights` for `weighted_captions` (`library/strategy_sd.py`,
    /// `strategy_sdxl.py`), with no rescaling. SDXL's pooled embedding stays unweighted.
    pub fn encode_weighted_long(
        &self,
        per_encoder: &[Vec<WeightedTokens>],
        clip_skip: usize,
        chunks: usize,
    ) -> candle_core::Result<TextConditioning> {
        self.require_text_encoders()?;
        let chunks = chunks.max(1);
        let sdxl = self.family() == ModelFamily::Sdxl;
        let encoders = if sdxl { 2 } else { 1 };
        if per_encoder.len() < encoders {
            candle_core::bail!(
                "weighted captions: {} encoders' tokens for {encoders}",
                per_encoder.len()
            );
        }
        let b = per_encoder[0].len();
        let mut contexts = Vec::with_capacity(encoders);
        let mut pooled = None;
        for (e, prompts) in per_encoder.iter().take(encoders).enumerate() {
            let te = &self.text_encoders[e];
            let width = te.tokenizer.max_length();
            let mut flat = Vec::with_capacity(b * chunks * width);
            for (tokens, _) in prompts {
                flat.extend(chunk_rows(&te.tokenizer, tokens.clone(), chunks));
            }
            let ids = Tensor::from_vec(flat, (b * chunks, width), &Device::Cpu)?;
            let (hidden, embeds) = match sdxl {
                false => (self.encoder_context(0, &ids, None, clip_skip)?, None),
                true => {
                    let o = te.model.forward(&ids, 1 + clip_skip)?;
                    (o.hidden, o.text_embeds)
                }
            };
            let h = merge(&hidden, b, chunks)?;
            let w = place_weights(prompts, width - 2, chunks, h.device())?;
            let dtype = h.dtype();
            contexts.push(
                h.to_dtype(candle_core::DType::F32)?
                    .broadcast_mul(&w)?
                    .to_dtype(dtype)?,
            );
            if e == 1 {
                let first: Vec<u32> = (0..b).map(|i| (i * chunks) as u32).collect();
                let first = Tensor::from_vec(first, b, h.device())?;
                pooled = embeds.map(|p| p.index_select(&first, 0)).transpose()?;
            }
        }
        let context = match contexts.as_slice() {
            [one] => one.clone(),
            [a, b2, ..] => Tensor::cat(&[a, &b2.to_dtype(a.dtype())?], 2)?,
            [] => candle_core::bail!("weighted captions: no text encoder"),
        };
        Ok(TextConditioning { context, pooled })
    }

    /// [`Self::encode_prompts`] for captions up to `chunks` × 75 tokens (kohya's
    /// `max_token_length`): `[B, 75·chunks + 2, D]`. One chunk is `encode_prompts` itself.
    pub fn encode_prompts_long(
        &self,
        prompts: &[&str],
        clip_skip: usize,
        chunks: usize,
    ) -> candle_core::Result<TextConditioning> {
        if chunks <= 1 {
            return self.encode_prompts(prompts, clip_skip);
        }
        self.require_text_encoders()?;
        let b = prompts.len();
        match self.family() {
            ModelFamily::Sd1 | ModelFamily::Sd2 => {
                let ids = ids_tensor(&self.text_encoders[0], prompts, chunks)?;
                let h = self.encoder_context(0, &ids, None, clip_skip)?;
                Ok(TextConditioning {
                    context: merge(&h, b, chunks)?,
                    pooled: None,
                })
            }
            ModelFamily::Sdxl => {
                let (te1, te2) = (&self.text_encoders[0], &self.text_encoders[1]);
                let o1 = te1
                    .model
                    .forward(&ids_tensor(te1, prompts, chunks)?, 1 + clip_skip)?;
                let o2 = te2
                    .model
                    .forward(&ids_tensor(te2, prompts, chunks)?, 1 + clip_skip)?;
                let h1 = merge(&o1.hidden, b, chunks)?;
                let h2 = merge(&o2.hidden, b, chunks)?.to_dtype(h1.dtype())?;
                // The pooled embedding of each prompt's first chunk.
                let first: Vec<u32> = (0..b).map(|i| (i * chunks) as u32).collect();
                let first = Tensor::from_vec(first, b, h1.device())?;
                let pooled = o2
                    .text_embeds
                    .map(|p| p.index_select(&first, 0))
                    .transpose()?;
                Ok(TextConditioning {
                    context: Tensor::cat(&[&h1, &h2], 2)?,
                    pooled,
                })
            }
        }
    }
}
