//! One micro-batch of the training step, straight-line (nanoGPT's shape), in two parts:
//! - [`prepare_batch`] makes every random draw (flip, caption dropout and shuffle, the VAE
//!   posterior sample, noise and timesteps): images → VAE latents (frozen, detached) → noised
//!   latents and captions;
//! - [`forward_backward`] has no randomness of its own: text conditioning → UNet → (min-SNR
//!   weighted) MSE, weighted by the micro-batch's share of the effective batch and by the loss
//!   scale, then backward.
//!
//! The split lets a prepared batch be cut into smaller micro-batches that see exactly the same
//! samples, noise and timesteps (gradient accumulation's test, and the OOM retry's halving).
//!
//! The VAE posterior is sampled with host-drawn, seeded noise so a run repeats exactly; candle's
//! CPU `randn` cannot be seeded.

use anyhow::Context;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use rand::Rng;
use rand_distr::StandardNormal;

use crate::data::augment;
use crate::data::TrainImage;
use crate::diffusion::objective::{NoisedBatch, Objective};
use crate::model::pipeline::StableDiffusion;
use crate::model::unet::AddedConditions;
use crate::nn::Checkpointing;

/// What the step needs besides the model and the batch.
pub struct StepSettings<'a> {
    pub objective: &'a Objective,
    pub flip_p: f64,
    pub cond_dropout: f64,
    pub shuffle_tags: bool,
    /// Text-encoder layers skipped beyond the family default.
    pub clip_skip_layers: usize,
    /// Whether any text-encoder parameter trains (otherwise the conditioning is detached).
    pub train_text_encoder: bool,
    /// The dtype the models compute in (the UNet input's dtype).
    pub compute_dtype: DType,
    /// The checkpointing context the models use, whose parameter gradients the step collects.
    pub checkpointing: Option<&'a Checkpointing>,
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
            noised: NoisedBatch {
                timesteps: self.noised.timesteps[start..start + len].to_vec(),
                noisy: self.noised.noisy.narrow(0, start, len)?,
                target: self.noised.target.narrow(0, start, len)?,
            },
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

/// Makes every random draw for `images`, in a fixed order, and encodes them with the VAE.
pub fn prepare_batch<R: Rng>(
    sd: &StableDiffusion,
    images: &[&TrainImage],
    settings: &StepSettings<'_>,
    rng: &mut R,
) -> anyhow::Result<PreparedBatch> {
    let device = sd.unet.conv_in.weight.device().clone();
    let flipped: Vec<std::borrow::Cow<'_, TrainImage>> = images
        .iter()
        .map(|im| augment::flip_p(im, settings.flip_p, rng))
        .collect();
    let batch: Vec<&TrainImage> = flipped.iter().map(|c| c.as_ref()).collect();
    let captions: Vec<String> = batch
        .iter()
        .map(|im| {
            let caption = augment::cond_dropout(&im.caption, settings.cond_dropout, rng);
            if settings.shuffle_tags {
                augment::shuffle_tags(caption, rng)
            } else {
                caption.to_string()
            }
        })
        .collect();

    let vae_dtype = sd.vae.dtype();
    let pixels = augment::to_tensor(&batch, &device)?.to_dtype(vae_dtype)?;
    let posterior = sd.vae.encode(&pixels)?;
    let eps = host_randn(rng, posterior.mean.dims(), &device)?.to_dtype(posterior.mean.dtype())?;
    let latents = sd
        .vae
        .scale_latents(&posterior.sample_with_noise(&eps)?)?
        .detach()
        .to_dtype(settings.compute_dtype)?;
    let noised = settings.objective.noise_batch(rng, &latents)?;
    Ok(PreparedBatch {
        noised,
        captions,
        time_ids: batch.iter().map(|im| time_ids_row(im)).collect(),
    })
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
    if let Some(ck) = settings.checkpointing {
        // Left over from a micro-batch that failed part-way: not this one's.
        drop(ck.take_grads()?);
    }
    let device = batch.noised.noisy.device().clone();
    let prompts: Vec<&str> = batch.captions.iter().map(String::as_str).collect();
    let cond = sd.encode_prompts(&prompts, settings.clip_skip_layers)?;
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
    let context = context.to_dtype(settings.compute_dtype)?;
    let pred = sd
        .unet
        .forward(&batch.noised.noisy, &t, &context, added.as_ref())?;
    let loss = settings.objective.loss(&pred, &batch.noised)?;
    let value = (loss.detach().to_dtype(DType::F32)? * weight)?;
    let mut grads = (loss * (weight * loss_scale))?
        .backward()
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

/// Standard normal noise drawn on the host from `rng`, as f32.
pub fn host_randn<R: Rng>(
    rng: &mut R,
    dims: &[usize],
    device: &candle_core::Device,
) -> candle_core::Result<Tensor> {
    let n: usize = dims.iter().product();
    let data: Vec<f32> = (0..n).map(|_| rng.sample(StandardNormal)).collect();
    Tensor::from_vec(data, dims, device)
}
