//! The text-encoder output cache: each distinct caption encoded once before training, after
//! which the text encoders leave the device.
//!
//! It applies only when nothing can change a caption's encoding during the run: no
//! text-encoder parameter trains, captions are not shuffled (`shuffle_tags`) and none is dropped
//! (`cond_dropout`). [`why_off`] names the reason when it cannot apply. The encodings (`[77, d]`
//! per caption, and SDXL's pooled `[d]`) stay in host memory in the compute dtype.

use std::collections::HashMap;

use candle_core::{Device, Tensor};

use crate::model::pipeline::{StableDiffusion, TextConditioning};

/// The cached encodings by caption.
pub struct TextCache {
    entries: HashMap<String, (Tensor, Option<Tensor>)>,
}

/// Why the cache cannot be used for this run, or `None` when it can.
pub fn why_off(
    enabled: bool,
    train_text_encoder: bool,
    shuffle_tags: bool,
    cond_dropout: f64,
) -> Option<&'static str> {
    if !enabled {
        Some("cache_text_encoder_outputs is false")
    } else if train_text_encoder {
        Some("a text encoder trains")
    } else if shuffle_tags {
        Some("shuffle_tags changes captions every step")
    } else if cond_dropout > 0.0 {
        Some("cond_dropout replaces captions with empty ones at random")
    } else {
        None
    }
}

impl TextCache {
    /// Encodes every distinct caption of `captions`, `batch` at a time.
    pub fn build<'a>(
        sd: &StableDiffusion,
        captions: impl IntoIterator<Item = &'a str>,
        clip_skip: usize,
        batch: usize,
    ) -> candle_core::Result<Self> {
        let mut distinct: Vec<&str> = captions.into_iter().collect();
        distinct.sort_unstable();
        distinct.dedup();
        let mut entries = HashMap::with_capacity(distinct.len());
        for chunk in distinct.chunks(batch.max(1)) {
            let cond = sd.encode_prompts(chunk, clip_skip)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_reasons_in_order() {
        assert_eq!(why_off(true, false, false, 0.0), None);
        assert!(why_off(false, false, false, 0.0).unwrap().contains("false"));
        assert!(why_off(true, true, false, 0.0)
            .unwrap()
            .contains("text encoder"));
        assert!(why_off(true, false, true, 0.0)
            .unwrap()
            .contains("shuffle_tags"));
        assert!(why_off(true, false, false, 0.1)
            .unwrap()
            .contains("cond_dropout"));
    }
}
