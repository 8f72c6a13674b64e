//! One micro-batch of the training step, straight-line (nanoGPT's shape), in two parts:
//! - [`prepare_batch`] makes every random draw (flip, caption dropout and shuffle, the VAE
//!   posterior sample, noise and timesteps): images → VAE latents (frozen, detached) → noised
//!   latents and captions. Each sample draws from its own generator ([`sample_rngs`]), so a
//!   batch prepared whole or in any split sees the same draws;
//! - [`forward_backward`] has no randomness of its own: text conditioning (plus the embedding
//!   noise drawn in the first part, when on) → UNet → the objective's loss (MSE by default,
//!   weighted and masked as configured), weighted by the micro-batch's share of the effective
//!   batch and by the loss scale, then backward.
//!
//! The split lets a prepared batch be cut into smaller micro-batches that see exactly the same
//! samples, noise and timesteps (gradient accumulation's test, and the OOM retry's halving).
//!
//! The VAE posterior is sampled with host-drawn, seeded noise so a run repeats exactly; candle's
//! CPU `randn` cannot be seeded.

use anyhow::Context;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use std::sync::Arc;

use crate::data::augment;
use crate::data::ItemOptions;
use crate::data::TrainImage;
use crate::diffusion::host_randn;
use crate::diffusion::objective::{NoisedBatch, Objective};
use crate::model::pipeline::StableDiffusion;
use crate::model::unet::AddedConditions;
use crate::model::vae::DiagonalGaussian;
use crate::nn::Checkpointing;
use crate::train::latent_cache::CachedLatent;
use crate::train::text_cache::TextCache;

/// The run's position as the step's captions see it. The default is outside training
/// (validation, tests): no epoch drops its captions and the token warmup is over.
#[derive(Debug, Clone, Copy)]
pub struct CaptionClock {
    /// The epoch, from 0; `None` outside training.
    pub epoch: Option<usize>,
    /// Optimizer steps done before this one.
    pub step: usize,
    /// The run's steps.
    pub total_steps: usize,
}

impl Default for CaptionClock {
    fn default() -> Self {
        Self {
            epoch: None,
            step: usize::MAX,
            total_steps: usize::MAX,
        }
    }
}

/// What the step needs besides the model and the batch.
pub struct StepSettings<'a> {
    pub objective: &'a Objective,
    pub flip_p: f64,
    pub cond_dropout: f64,
    pub shuffle_tags: bool,
    /// Tags kept in place by the shuffle, after the main prompt (`keep_tags`).
    pub keep_tags: usize,
    /// kohya's `caption_tag_dropout_rate` (0: off).
    pub tag_dropout: f64,
    /// Text-encoder layers skipped beyond the family default.
    pub clip_skip_layers: usize,
    /// The 75-token chunks a caption is encoded in (`max_token_length`).
    pub caption_chunks: usize,
    /// kohya's `weighted_captions` ([`super::weighted_captions`]).
    pub weighted_captions: bool,
    /// Textual inversion's caption templates (`embedding.template`): when not empty, each
    /// sample's caption is one of them, drawn from its generator first. Empty: the captions.
    pub caption_templates: &'a [String],
    /// kohya's `keep_tokens_separator`, `secondary_separator` and `enable_wildcard`, applied each
    /// step (`None` when captions do not change from step to step: the setup applied what they
    /// change once).
    pub kohya_captions: Option<&'a crate::data::kohya_caption::KohyaCaptions>,
    /// Where the run is, for kohya's caption keys that depend on it
    /// (`caption_dropout_every_n_epochs`, the token warmup).
    pub clock: CaptionClock,
    /// Whether any text-encoder parameter trains (otherwise the conditioning is detached).
    pub train_text_encoder: bool,
    /// The dtype the models compute in (the UNet input's dtype).
    pub compute_dtype: DType,
    /// The checkpointing context the models use, whose parameter gradients the step collects.
    pub checkpointing: Option<&'a Checkpointing>,
    /// Cached caption encodings, when the text encoders were released.
    pub text_cache: Option<&'a TextCache>,
    /// `Some` when masked loss is on: the chance a sample ignores its mask (OneTrainer's
    /// `unmasked_probability`), one draw per sample.
    pub unmasked_probability: Option<f64>,
    /// The adapters a prior prediction takes out (masked prior preservation), when the
    /// objective wants one.
    pub prior_adapters: Option<&'a [std::sync::Arc<crate::adapter::LoraModule>]>,
}

/// What one training sample brings to a step: decoded pixels, or its cached VAE posterior.
#[derive(Debug, Clone)]
pub enum SampleData {
    Pixels(TrainImage),
    Latent(Arc<CachedLatent>),
}

impl SampleData {
    fn caption(&self) -> &str {
        match self {
            Self::Pixels(im) => &im.caption,
            Self::Latent(l) => &l.geometry.caption,
        }
    }

    /// The image's own settings, which override the step's.
    fn options(&self) -> &ItemOptions {
        match self {
            Self::Pixels(im) => &im.options,
            Self::Latent(l) => &l.geometry.options,
        }
    }
}

/// A micro-batch with every random choice made: what [`forward_backward`] consumes.
#[derive(Debug, Clone)]
pub struct PreparedBatch {
    /// Noised latents, target and timesteps, batch-first.
    pub noised: NoisedBatch,
    /// The captions after dropout and tag shuffling, one per sample.
    pub captions: Vec<String>,
    /// SDXL's `time_ids` rows, one per sample.
    pub time_ids: Vec<[f32; 6]>,
}

impl PreparedBatch {
    pub fn len(&self) -> usize {
        self.captions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.captions.is_empty()
    }

    /// The samples `start..start + len`, in order.
    pub fn narrow(&self, start: usize, len: usize) -> candle_core::Result<Self> {
        if start + len > self.len() || len == 0 {
            candle_core::bail!(
                "cannot take samples {start}..{} of a batch of {}",
                start + len,
                self.len()
            );
        }
        Ok(Self {
            noised: self.noised.narrow(start, len)?,
            captions: self.captions[start..start + len].to_vec(),
            time_ids: self.time_ids[start..start + len].to_vec(),
        })
    }

    /// Cuts the batch into consecutive micro-batches of at most `size` samples.
    pub fn split(&self, size: usize) -> candle_core::Result<Vec<Self>> {
        if size == 0 {
            candle_core::bail!("micro-batch size must be at least 1");
        }
        (0..self.len())
            .step_by(size)
            .map(|start| self.narrow(start, size.min(self.len() - start)))
            .collect()
    }
}

/// The seeds of (0-based) step `step`'s `n` samples: a pure function of the run's seed and the
/// step, so an OOM retry, and a resumed run, draw exactly what an uninterrupted run draws.
pub fn step_seeds(seed: u64, step: usize, n: usize) -> Vec<u64> {
    let mix = (step as u64)
        .wrapping_add(1)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut rng = StdRng::seed_from_u64(seed ^ mix);
    (0..n).map(|_| rng.random()).collect()
}

/// One generator per sample, from the sample's seed: every draw a sample needs comes from its own
/// generator, so a batch cut into micro-batches of any size (the OOM retry) draws the same.
pub fn sample_rngs(seeds: &[u64]) -> Vec<StdRng> {
    seeds.iter().map(|&s| StdRng::seed_from_u64(s)).collect()
}

/// Makes every random draw for `samples`, sample `i` from `rngs[i]` in a fixed order (the caption
/// template when there are templates, flip, caption dropout, tag shuffle, the VAE posterior sample, noise, timestep, and with masked loss
/// whether the sample ignores its mask), and encodes the
/// pixels with the VAE or takes the cached posterior: the same draws either way.
pub fn prepare_batch<R: Rng>(
    sd: &StableDiffusion,
    samples: &[&SampleData],
    settings: &StepSettings<'_>,
    rngs: &mut [R],
) -> anyhow::Result<PreparedBatch> {
    if rngs.len() != samples.len() || samples.is_empty() {
        anyhow::bail!("{} generators for {} samples", rngs.len(), samples.len());
    }
    let device = sd.unet.conv_in.weight.device().clone();
    let mut flips = Vec::with_capacity(samples.len());
    let mut captions = Vec::with_capacity(samples.len());
    for (sample, rng) in samples.iter().zip(rngs.iter_mut()) {
        // An image's own flip_p, cond_dropout and shuffle_tags (from its files) win.
        let own = sample.options();
        let caption = match settings.caption_templates {
            [] => sample.caption(),
            templates => crate::data::caption_templates::draw(templates, rng),
        };
        // One draw whatever `flip_p`, as augment::flip_p makes.
        flips.push(rng.random::<f64>() < own.flip_p.unwrap_or(settings.flip_p));
        captions.push(super::step_caption::step_caption(
            caption, own, settings, rng,
        ));
    }
    let (moments, time_ids, masks) = posterior_moments(sd, samples, &flips, &device)?;
    let posterior = DiagonalGaussian::from_moments(&moments)?;
    let (_, c, h, w) = posterior.mean.dims4()?;
    let eps = rngs
        .iter_mut()
        .map(|rng| host_randn(rng, &[1, c, h, w], &device))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let eps = Tensor::cat(&eps, 0)?.to_dtype(posterior.mean.dtype())?;
    let latents = scale_latents(sd, &posterior.sample_with_noise(&eps)?)?
        .detach()
        .to_dtype(settings.compute_dtype)?;
    let mut noised = settings.objective.noise_per_sample(rngs, &latents)?;
    noised.sample_weights = sample_weights(samples);
    if let Some(p) = settings.unmasked_probability {
        // One draw per sample, the last, so masks change no other draw.
        let keep: Vec<bool> = rngs.iter_mut().map(|r| r.random::<f64>() >= p).collect();
        noised.mask = Some(latent_masks(&masks, &keep, (h, w), &device)?);
    }
    Ok(PreparedBatch {
        noised,
        captions,
        time_ids,
    })
}

/// Each sample's own loss weight (a regularization image's `prior_loss_weight`, times a
/// OneTrainer concept's `loss_weight`), or empty when every sample weighs 1.
fn sample_weights(samples: &[&SampleData]) -> Vec<f64> {
    let own: Vec<f64> = samples
        .iter()
        .map(|s| {
            let o = s.options();
            o.prior_loss_weight.unwrap_or(1.0) * o.loss_weight
        })
        .collect();
    let weighed = samples.iter().any(|s| {
        let o = s.options();
        o.prior_loss_weight.is_some() || o.loss_weight != 1.0
    });
    match weighed {
        true => own,
        false => Vec::new(),
    }
}

/// `(z − shift) · scale` with the VAE's constants, kept when the VAE itself was released.
fn scale_latents(sd: &StableDiffusion, z: &Tensor) -> candle_core::Result<Tensor> {
    crate::model::vae::scale_latents_with(&sd.vae_config, z)
}

/// One sample's loss mask as drawn (flipped with its image): `height × width` bytes and the
/// image's `(height, width)`, or `None` for an image without one.
type PixelMask = (Option<Vec<u8>>, (usize, usize));

/// The loss masks `[B, 1, h, w]` f32 at latent size `(h, w)`: each sample's mask as a fraction
/// of 255, area-downsampled by the VAE factor; all ones for a sample without a mask or whose
/// draw (`keep[i]` false) trains it unmasked.
pub fn latent_masks(
    masks: &[PixelMask],
    keep: &[bool],
    (h, w): (usize, usize),
    device: &candle_core::Device,
) -> anyhow::Result<Tensor> {
    let mut out = Vec::with_capacity(masks.len() * h * w);
    for ((mask, (ih, iw)), &keep) in masks.iter().zip(keep) {
        match mask {
            Some(m) if keep => {
                let f = ih / h.max(1);
                let down = (f * h == *ih && f * w == *iw)
                    .then(|| {
                        crate::data::mask::area_downsample(
                            &crate::data::mask::to_unit(m),
                            (*ih, *iw),
                            f,
                        )
                    })
                    .flatten()
                    .with_context(|| {
                        format!("a {iw}×{ih} loss mask does not reduce to the {w}×{h} latent")
                    })?;
                out.extend(down);
            }
            _ => out.extend(std::iter::repeat_n(1f32, h * w)),
        }
    }
    Ok(Tensor::from_vec(out, (masks.len(), 1, h, w), device)?)
}

/// The posterior moments `[B, 2·latent, h, w]` of the (flipped where `flips` says) samples on
/// `device`, their SDXL `time_ids` and their loss masks: from the VAE for pixels, from the cache
/// for latents.
fn posterior_moments(
    sd: &StableDiffusion,
    samples: &[&SampleData],
    flips: &[bool],
    device: &candle_core::Device,
) -> anyhow::Result<(Tensor, Vec<[f32; 6]>, Vec<PixelMask>)> {
    let mut pixels: Vec<std::borrow::Cow<'_, TrainImage>> = Vec::new();
    let mut cached = Vec::new();
    let mut time_ids = Vec::with_capacity(samples.len());
    let mut masks = Vec::with_capacity(samples.len());
    for (sample, &flip) in samples.iter().zip(flips) {
        match sample {
            SampleData::Pixels(im) => {
                let im = if flip {
                    std::borrow::Cow::Owned(augment::hflip(im))
                } else {
                    std::borrow::Cow::Borrowed(im)
                };
                time_ids.push(time_ids_row(&im));
                masks.push((im.mask.clone(), (im.height, im.width)));
                pixels.push(im);
            }
            SampleData::Latent(l) => {
                let (moments, geometry) = l.variant(flip)?;
                time_ids.push(time_ids_row(&geometry));
                masks.push((geometry.mask, (geometry.height, geometry.width)));
                cached.push(moments.unsqueeze(0)?);
            }
        }
    }
    let moments = match (pixels.is_empty(), cached.is_empty()) {
        (false, true) => {
            let vae = sd.vae()?;
            let batch: Vec<&TrainImage> = pixels.iter().map(|c| c.as_ref()).collect();
            let x = augment::to_tensor(&batch, device)?.to_dtype(vae.dtype())?;
            vae.encode_moments(&x)?
        }
        (true, false) => Tensor::cat(&cached, 0)?.to_device(device)?,
        _ => anyhow::bail!("a micro-batch mixes cached latents and pixels"),
    };
    Ok((moments, time_ids, masks))
}

/// The forward pass for one prepared micro-batch: text conditioning → UNet → the (min-SNR
/// weighted) MSE, still attached to the graph. Validation uses it alone.
pub fn forward_loss(
    sd: &StableDiffusion,
    batch: &PreparedBatch,
    settings: &StepSettings<'_>,
) -> anyhow::Result<Tensor> {
    if let Some(ck) = settings.checkpointing {
        // Left over from a micro-batch that failed part-way: not this one's.
        drop(ck.take_grads()?);
    }
    // OneTrainer's prior model: the same batch through the model without its adapters, before
    // the prediction that trains (and so before its graph exists).
    let prior = match (settings.prior_adapters, &batch.noised.mask) {
        (Some(adapters), Some(_)) if settings.objective.wants_prior() => {
            let _off = crate::adapter::Bypassed::new(adapters);
            Some(predict(sd, batch, settings)?.detach())
        }
        _ => None,
    };
    let pred = predict(sd, batch, settings)?;
    Ok(settings
        .objective
        .loss_with_prior(&pred, &batch.noised, prior.as_ref())?)
}

/// The UNet's prediction for one prepared micro-batch: text conditioning → UNet.
fn predict(
    sd: &StableDiffusion,
    batch: &PreparedBatch,
    settings: &StepSettings<'_>,
) -> anyhow::Result<Tensor> {
    let device = batch.noised.noisy.device().clone();
    let prompts: Vec<&str> = batch.captions.iter().map(String::as_str).collect();
    let cond = match settings.text_cache {
        Some(cache) => cache.lookup(&prompts, &device)?,
        None => super::weighted_captions::encode(
            sd,
            &prompts,
            settings.clip_skip_layers,
            settings.caption_chunks,
            settings.weighted_captions,
        )?,
    };
    let (context, pooled) = if settings.train_text_encoder {
        (cond.context, cond.pooled)
    } else {
        (cond.context.detach(), cond.pooled.map(|p| p.detach()))
    };
    let added = match pooled {
        Some(text_embeds) => Some(AddedConditions {
            text_embeds,
            time_ids: Tensor::from_vec(
                batch
                    .time_ids
                    .iter()
                    .flatten()
                    .copied()
                    .collect::<Vec<f32>>(),
                (batch.len(), 6),
                &device,
            )?,
        }),
        None => None,
    };
    let t = batch.noised.timesteps_tensor(&device)?;
    let context = settings
        .objective
        .perturb_context(&context, &batch.noised)?
        .to_dtype(settings.compute_dtype)?;
    Ok(sd
        .unet
        .forward(&batch.noised.noisy, &t, &context, added.as_ref())?)
}

/// Forward and backward for one prepared micro-batch. The loss is multiplied by `weight` (the
/// micro-batch's share of the effective batch, `len / effective`) and by `loss_scale` before
/// backward. Returns the weighted (unscaled) loss as a detached 0-d f32 tensor on the device,
/// and the gradients of `loss · weight · loss_scale`. The loss stays on the device so the
/// trainer fetches it with the gradient norm in one copy per optimizer step.
pub fn forward_backward(
    sd: &StableDiffusion,
    batch: &PreparedBatch,
    settings: &StepSettings<'_>,
    weight: f64,
    loss_scale: f64,
) -> anyhow::Result<(Tensor, GradStore)> {
    let loss = forward_loss(sd, batch, settings)?;
    let value = (loss.detach().to_dtype(DType::F32)? * weight)?;
    // Given up to the backward: the forward's tensors are freed as the walk passes them.
    let mut grads = (loss * (weight * loss_scale))?
        .into_backward()
        .context("backward pass")?;
    if let Some(ck) = settings.checkpointing {
        grads.extend(ck.take_grads()?)?;
    }
    Ok((value, grads))
}

/// SDXL's `time_ids` for one sample: original size (h, w), crop top-left (y, x), target size
/// (h, w).
fn time_ids_row(im: &TrainImage) -> [f32; 6] {
    let (oh, ow) = im.original_size;
    let (cy, cx) = im.crop_top_left;
    let (th, tw) = im.target_size();
    [oh, ow, cy, cx, th, tw].map(|v| v as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each sample's mask at latent size is the mean of its 8 × 8 blocks over 255 (kohya's
    /// `interpolate(mode="area")`); a sample without a mask, or drawn to ignore it, weighs 1.
    #[test]
    fn latent_masks_average_blocks_and_fill_ones() {
        // 16 × 8 pixels → 2 × 1 latent: left block has one full pixel in 64, right block half 255
        let mut m = vec![0u8; 16 * 8];
        m[0] = 255;
        for y in 0..8 {
            for x in 8..16 {
                m[y * 16 + x] = if x % 2 == 0 { 255 } else { 0 };
            }
        }
        let masks = [
            (Some(m.clone()), (8, 16)),
            (None, (8, 16)),
            (Some(m), (8, 16)),
        ];
        let t = latent_masks(
            &masks,
            &[true, true, false],
            (1, 2),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        assert_eq!(t.dims(), &[3, 1, 1, 2]);
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(v, [1.0 / 64.0, 0.5, 1.0, 1.0, 1.0, 1.0]);
        // a mask that does not reduce to the latent is an error, not a panic
        let odd = [(Some(vec![0u8; 12 * 8]), (8, 12))];
        assert!(latent_masks(&odd, &[true], (1, 2), &candle_core::Device::Cpu).is_err());
    }
}
