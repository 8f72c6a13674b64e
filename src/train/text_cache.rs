//! The text-encoder output cache: each distinct caption encoded once before training, after
//! which the text encoders leave the device.
//!
//! It applies only when nothing can change a caption's encoding during the run: no
//! text-encoder parameter trains and captions are not shuffled (`shuffle_tags`). A caption that
//! `cond_dropout` drops becomes the empty one, which is cached too. The plan decides whether it
//! does, once
//! ([`crate::config::TextCacheDecision`]). The encodings (`[77, d]` per caption, and SDXL's pooled
//! `[d]`) stay in host memory in the compute dtype.

use std::collections::HashMap;

use candle_core::{Device, Tensor};

use crate::model::pipeline::{StableDiffusion, TextConditioning};

/// The cached encodings by caption.
pub struct TextCache {
    entries: HashMap<String, (Tensor, Option<Tensor>)>,
}

impl TextCache {
    /// Encodes every distinct caption of `captions`, `batch` at a time, in `chunks` 75-token
    /// chunks ([`StableDiffusion::encode_prompts_long`]), weighted by their emphasis when
    /// `weighted` (kohya's `weighted_captions`).
    pub fn build<'a>(
        sd: &StableDiffusion,
        captions: impl IntoIterator<Item = &'a str>,
        (clip_skip, chunks, weighted): (usize, usize, bool),
        batch: usize,
    ) -> candle_core::Result<Self> {
        let mut distinct: Vec<&str> = captions.into_iter().collect();
        distinct.sort_unstable();
        distinct.dedup();
        let mut entries = HashMap::with_capacity(distinct.len());
        for chunk in distinct.chunks(batch.max(1)) {
            let cond = super::weighted_captions::encode(sd, chunk, clip_skip, chunks, weighted)?;
            let context = cond.context.detach().to_device(&Device::Cpu)?;
            let pooled = match cond.pooled {
                Some(p) => Some(p.detach().to_device(&Device::Cpu)?),
                None => None,
            };
            for (k, caption) in chunk.iter().enumerate() {
                let p = pooled.as_ref().map(|p| p.get(k)).transpose()?;
                entries.insert(caption.to_string(), (context.get(k)?, p));
            }
        }
        Ok(Self { entries })
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The conditioning of `prompts`, as [`StableDiffusion::encode_prompts`] would return it.
    pub fn lookup(
        &self,
        prompts: &[&str],
        device: &Device,
    ) -> candle_core::Result<TextConditioning> {
        let mut contexts = Vec::with_capacity(prompts.len());
        let mut pooled = Vec::with_capacity(prompts.len());
        for p in prompts {
            let Some((c, pl)) = self.entries.get(*p) else {
                candle_core::bail!("caption {p:?} is not in the text-encoder cache");
            };
            contexts.push(c.unsqueeze(0)?);
            if let Some(pl) = pl {
                pooled.push(pl.unsqueeze(0)?);
            }
        }
        let context = Tensor::cat(&contexts, 0)?.to_device(device)?;
        let pooled = if pooled.is_empty() {
            None
        } else {
            Some(Tensor::cat(&pooled, 0)?.to_device(device)?)
        };
        Ok(TextConditioning { context, pooled })
    }
}
