//! Textual-inversion training glue (`mode: "textual_inversion"`): the token's vectors, one
//! trainable `[n, dim]` f32 tensor per text encoder, start from `embedding.init_word` (or
//! `embedding.init_from`), join the frozen model ([`crate::model::textual_inversion`]), train as
//! the optimizer group `embedding`, and are saved as kohya saves them (`emb_params`, or SDXL's
//! `clip_l`/`clip_g`).
//!
//! kohya trains the whole token-embedding table and copies the old rows back after each step;
//! only the new rows train here, which updates them the same way. Gradient clipping
//! (`clip_grad_norm`) sees the new rows' gradients alone, where kohya's norm also counts the
//! gradients of the caption's other tokens, which it then discards.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor, Var};

use crate::adapter::embedding_file::{self, load_embedding, CLIP_G, CLIP_L, EMB_PARAMS};
use crate::config::{EmbeddingPlan, SaveDtype, TrainPlan};
use crate::data::caption_templates;
use crate::model::pipeline::StableDiffusion;
use crate::model::textual_inversion::{add_embedding, init_word_vectors, token_strings};

/// The optimizer group (and save-point prefix) of the vectors.
pub const GROUP: &str = "embedding";

/// The run's embedding.
pub struct TrainedEmbedding {
    pub plan: EmbeddingPlan,
    /// One `[n, dim]` f32 Var per text encoder, under its key in the saved file.
    pub vars: Vec<(String, Var)>,
    /// Each encoder's ids for the token's vectors.
    pub ids: Vec<Vec<u32>>,
    /// The captions `embedding.template` draws from (empty without one).
    pub templates: Vec<String>,
}

/// The saved file's key of each text encoder's vectors.
fn keys(encoders: usize) -> &'static [&'static str] {
    match encoders {
        1 => &[EMB_PARAMS],
        _ => &[CLIP_L, CLIP_G],
    }
}

/// Adds the plan's token to `sd`'s text encoders with trainable vectors on `device`.
pub fn attach(
    sd: &mut StableDiffusion,
    plan: &TrainPlan,
    device: &Device,
) -> anyhow::Result<TrainedEmbedding> {
    let e = plan
        .embedding
        .clone()
        .context("textual_inversion mode without an embedding plan")?;
    let start = start_vectors(sd, &e, device)?;
    let vars = start
        .iter()
        .map(|t| Var::from_tensor(&t.to_dtype(DType::F32)?.to_device(device)?))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let ids = add_embedding(sd, &e.token_string, &tensors)
        .with_context(|| format!("embedding.token_string {:?}", e.token_string))?;
    let named = keys(vars.len())
        .iter()
        .map(|k| k.to_string())
        .zip(vars)
        .collect();
    let templates = match e.template {
        None => Vec::new(),
        Some(crate::config::CaptionTemplate::Object) => {
            caption_templates::captions(caption_templates::OBJECT, &e.token_string)
        }
        Some(crate::config::CaptionTemplate::Style) => {
            caption_templates::captions(caption_templates::STYLE, &e.token_string)
        }
    };
    let strings = token_strings(&e.token_string, e.num_vectors);
    crate::console::say(format_args!(
        "textual inversion: `{}` stands for {} new token(s) ({}), ids {:?}",
        e.token_string,
        e.num_vectors,
        strings.join(" "),
        ids.iter()
            .map(|i| (i[0], i[i.len() - 1]))
            .collect::<Vec<_>>()
    ));
    Ok(TrainedEmbedding {
        plan: e,
        vars: named,
        ids,
        templates,
    })
}

/// The vectors the run starts from: `init_from`'s, or `init_word`'s rows.
fn start_vectors(
    sd: &StableDiffusion,
    e: &EmbeddingPlan,
    device: &Device,
) -> anyhow::Result<Vec<Tensor>> {
    if let Some(path) = &e.init_from {
        let widths: Vec<usize> = sd
            .text_encoders
            .iter()
            .map(|te| te.model.token_embedding.dim())
            .collect();
        let file = load_embedding(path, device).context("embedding.init_from")?;
        let vectors = file.for_encoders(&widths).context("embedding.init_from")?;
        if file.vectors_per_token() != e.num_vectors {
            bail!(
                "embedding.init_from: {} holds {} vector(s) per token, but \
                 embedding.num_vectors_per_token is {}",
                path.display(),
                file.vectors_per_token(),
                e.num_vectors
            );
        }
        return Ok(vectors);
    }
    let word = e.init_word.as_deref().unwrap_or("*");
    sd.text_encoders
        .iter()
        .enumerate()
        .map(|(i, te)| {
            init_word_vectors(te, i, word, e.num_vectors, device).context("embedding.init_word")
        })
        .collect()
}

impl TrainedEmbedding {
    /// The vectors, named for the optimizer group.
    pub fn params(&self) -> Vec<(String, Var)> {
        self.vars.clone()
    }

    /// The vectors as a LoRA file bundles them (OneTrainer's `bundle_emb.<token>.clip_l`/`clip_g`,
    /// which A1111 loads with the LoRA).
    pub fn bundle(&self) -> Vec<(String, Tensor)> {
        let tensors: Vec<Tensor> = self
            .vars
            .iter()
            .map(|(_, v)| v.as_tensor().clone())
            .collect();
        embedding_file::bundle_keys(&self.plan.token_string, &tensors)
    }

    /// Writes the vectors to `path` in the plan's dtype.
    pub fn save(&self, path: &Path, metadata: &HashMap<String, String>) -> anyhow::Result<()> {
        let dtype = match self.plan.save_dtype {
            SaveDtype::Fp16 => DType::F16,
            SaveDtype::Bf16 => DType::BF16,
            SaveDtype::Fp32 => DType::F32,
        };
        let tensors: Vec<Tensor> = self
            .vars
            .iter()
            .map(|(_, v)| v.as_tensor().clone())
            .collect();
        embedding_file::save_embedding(path, &tensors, dtype, metadata)?;
        Ok(())
    }

    /// Refuses a run whose captions never name the token (nothing would train) and warns about
    /// the captions that do not; with templates the captions are not used.
    pub fn check_captions(&self, sd: &StableDiffusion, captions: &[&str]) -> anyhow::Result<()> {
        if !self.templates.is_empty() {
            return Ok(());
        }
        let naming = self.captions_naming_token(sd, captions)?;
        let token = &self.plan.token_string;
        if naming == 0 {
            bail!(
                "embedding.token_string: no training caption names `{token}`, so its vectors \
                 would never train; write `{token}` into the captions where the concept is, or \
                 set embedding.template to \"object\" or \"style\" to caption every image \
                 from kohya's templates"
            );
        }
        if naming < captions.len() {
            crate::console::say(format_args!(
                "warning: embedding: {} of {} captions do not name `{token}`; those samples \
                 do not train the embedding",
                captions.len() - naming,
                captions.len()
            ));
        }
        Ok(())
    }

    /// How many of `captions` name the token (its first id is among their tokens), by the
    /// first text encoder's tokenizer.
    pub fn captions_naming_token(
        &self,
        sd: &StableDiffusion,
        captions: &[&str],
    ) -> anyhow::Result<usize> {
        let (Some(te), Some(ids)) = (sd.text_encoders.first(), self.ids.first()) else {
            return Ok(0);
        };
        let mut n = 0;
        for c in captions {
            if te.tokenizer.tokenize(c)?.contains(&ids[0]) {
                n += 1;
            }
        }
        Ok(n)
    }
}

/// An embedding file's vectors by the EMA's names (`embedding/<key>`), for `ema_resume_model`.
pub(super) fn ema_values(path: &Path) -> anyhow::Result<HashMap<String, Tensor>> {
    let file = load_embedding(path, &Device::Cpu)?;
    let sets = match &file.vectors {
        embedding_file::EmbeddingVectors::Single(t) => vec![(EMB_PARAMS, t.clone())],
        embedding_file::EmbeddingVectors::Sdxl { clip_l, clip_g } => {
            [(CLIP_L, clip_l), (CLIP_G, clip_g)]
                .into_iter()
                .filter_map(|(k, t)| t.clone().map(|t| (k, t)))
                .collect()
        }
    };
    Ok(sets
        .into_iter()
        .map(|(k, t)| (format!("{GROUP}/{k}"), t))
        .collect())
}
