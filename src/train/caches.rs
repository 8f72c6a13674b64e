//! The run's caches, built once before the first step, each releasing the model it replaces:
//! - the text-encoder output cache ([`super::text_cache`]), when no text encoder trains and the
//!   captions do not change from step to step; the text encoders are released;
//! - the latent cache ([`super::latent_cache`]), in memory or on disk, for the training images
//!   and the validation set; the VAE is released.

use std::time::Instant;

use anyhow::Context;
use candle_core::Device;

use super::data_feed::DataFeed;
use super::latent_cache::{self, CacheSpec};
use super::text_cache::TextCache;
use super::validation::Validation;
use crate::config::{CacheLatents, TextCacheDecision, TrainPlan};
use crate::dist::Collective;
use crate::memory::trim_pool;
use crate::model::pipeline::StableDiffusion;

/// What the caches built: the text cache, if any, and one line per cache for the summary.
pub(super) struct Caches {
    pub text: Option<TextCache>,
    pub lines: Vec<String>,
}

/// Builds the caches that apply to `plan`. `share`: the ranks of a data-parallel run, which split
/// the encoding of a disk latent cache.
pub(super) fn build(
    plan: &TrainPlan,
    sd: &mut StableDiffusion,
    feed: &mut DataFeed,
    validation: Option<&mut Validation>,
    device: &Device,
    share: Option<&mut dyn Collective>,
) -> anyhow::Result<Caches> {
    let (text, line) = text_encoder_cache(plan, sd, feed, validation.as_deref())?;
    crate::console::say(format_args!("{line}"));
    let mut lines = vec![line];
    match latents(plan, sd, feed, validation, device, share)? {
        Some(line) => {
            crate::console::say(format_args!("{line}"));
            lines.push(line);
        }
        None => lines.push("latent cache: off (the VAE encodes every step)".into()),
    }
    Ok(Caches { text, lines })
}

/// The text-encoder output cache, when it applies, and its line.
fn text_encoder_cache(
    plan: &TrainPlan,
    sd: &mut StableDiffusion,
    feed: &DataFeed,
    validation: Option<&Validation>,
) -> anyhow::Result<(Option<TextCache>, String)> {
    if let TextCacheDecision::Off(why) = plan.data.text_cache {
        return Ok((None, format!("text-encoder cache: off ({why})")));
    }
    if feed.dataset.items.iter().any(|i| i.options.shuffle_tags) {
        let why = "a shuffle_tags.txt or YAML `shuffle_tags` shuffles some captions";
        return Ok((None, format!("text-encoder cache: off ({why})")));
    }
    let started = Instant::now();
    let mut captions: Vec<&str> = feed
        .dataset
        .items
        .iter()
        .map(|i| i.caption.as_str())
        .collect();
    if let Some(v) = validation {
        captions.extend(v.items().map(|i| i.caption.as_str()));
    }
    let items = &feed.dataset.items;
    // A dataset config's images carry their subsets' dropout instead of train.json's.
    let global = plan.data.dataset_config.is_none()
        && (plan.data.cond_dropout > 0.0 || plan.data.kohya_captions.dropout_every_n_epochs > 0);
    let dropped = global
        || items.iter().any(|i| {
            let epochs = i.options.subset_captions.as_ref();
            i.options.cond_dropout > Some(0.0)
                || epochs.is_some_and(|c| c.keys.dropout_every_n_epochs > 0)
        });
    if dropped {
        // What cond_dropout (and caption_dropout_every_n_epochs) replaces a caption with.
        captions.push("");
    }
    let batch = plan.batch_size.max(1);
    let text = (
        plan.objective.clip_skip_layers,
        plan.data.caption_chunks,
        plan.data.weighted_captions,
    );
    let cache = TextCache::build(sd, captions, text, batch)
        .context("caching the text encoders' outputs")?;
    sd.release_text_encoders();
    let line = format!(
        "text-encoder cache: {} captions encoded in {:.1} s; text encoders released",
        cache.len(),
        started.elapsed().as_secs_f64()
    );
    Ok((Some(cache), line))
}

/// The latent cache, when `cache_latents` is on: the training images' latents go to `feed`,
/// the validation set's to it; returns the cache's line (none when off).
fn latents(
    plan: &TrainPlan,
    sd: &mut StableDiffusion,
    feed: &mut DataFeed,
    validation: Option<&mut Validation>,
    device: &Device,
    share: Option<&mut dyn Collective>,
) -> anyhow::Result<Option<String>> {
    let data = &plan.data;
    if data.cache_latents == CacheLatents::Off {
        return Ok(None);
    }
    let started = Instant::now();
    let batch = plan.batch_size.max(1);
    let dir = (data.cache_latents == CacheLatents::Disk)
        .then(|| plan.output_dir.join(latent_cache::CACHE_DIR));
    let spec = CacheSpec {
        items: &feed.dataset.items,
        buckets: &feed.buckets,
        with_flip: data.flip_p > 0.0
            || feed
                .dataset
                .items
                .iter()
                .any(|i| i.options.flip_p > Some(0.0)),
        dir: dir.clone(),
        max_pixels: data.max_image_pixels,
        batch,
        masks: plan.objective.loss.mask.map(|m| m.source),
    };
    let (store, stats) =
        latent_cache::build(sd, &spec, device, share).context("caching latents")?;
    feed.use_latents(store);
    if let Some(v) = validation {
        v.cache_latents(sd, dir.clone(), batch, device)
            .context("caching the validation images' latents")?;
    }
    sd.release_vae();
    trim_pool(device).context("freeing the VAE")?;
    let place = match &dir {
        Some(d) => format!("in {}", d.display()),
        None => "in memory".into(),
    };
    let others = if stats.by_others > 0 {
        format!(", {} by the other ranks", stats.by_others)
    } else {
        String::new()
    };
    Ok(Some(format!(
        "latent cache {place}: {} encoded{others}, {} reused, in {:.1} s; VAE released",
        stats.encoded,
        stats.reused,
        started.elapsed().as_secs_f64()
    )))
}
