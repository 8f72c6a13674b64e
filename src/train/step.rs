//! One micro-batch of the training step, straight-line (nanoGPT's shape):
//! images → VAE latents (frozen, detached) → noise and timesteps → text conditioning → UNet →
//! (min-SNR weighted) MSE, divided by the accumulation count, then backward.
//!
//! The VAE posterior is sampled with host-drawn, seeded noise so a run repeats exactly; candle's
//! CPU `randn` cannot be seeded.

use anyhow::Context;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use rand::Rng;
use rand_distr::StandardNormal;

use crate::data::augment;
use crate::data::TrainImage;
use crate::diffusion::objective::Objective;
use crate::model::pipeline::StableDiffusion;
use crate::model::unet::AddedConditions;

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
}

/// Runs forward and backward for one micro-batch; returns the (undivided) loss as a detached 0-d
/// f32 tensor on the device, and the gradients of `loss / accum`. The loss stays on the device
/// so the trainer fetches it with the gradient norm in one copy per optimizer step.
pub fn micro_batch<R: Rng>(
    sd: &StableDiffusion,
    images: &[&TrainImage],
    settings: &StepSettings<'_>,
    accum: usize,
    rng: &mut R,
) -> anyhow::Result<(Tensor, GradStore)> {
    let device = sd.unet.conv_in.weight.device().clone();
    let dtype = sd.unet.conv_in.weight.dtype();
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

    let pixels = augment::to_tensor(&batch, &device)?.to_dtype(dtype)?;
    let posterior = sd.vae.encode(&pixels)?;
    let eps = host_randn(rng, posterior.mean.dims(), &device)?.to_dtype(posterior.mean.dtype())?;
    let latents = sd
        .vae
        .scale_latents(&posterior.sample_with_noise(&eps)?)?
        .detach();

    let noised = settings.objective.noise_batch(rng, &latents)?;
    let prompts: Vec<&str> = captions.iter().map(String::as_str).collect();
    let cond = sd.encode_prompts(&prompts, settings.clip_skip_layers)?;
    let (context, pooled) = if settings.train_text_encoder {
        (cond.context, cond.pooled)
    } else {
        (cond.context.detach(), cond.pooled.map(|p| p.detach()))
    };
    let added = match pooled {
        Some(text_embeds) => Some(AddedConditions {
            text_embeds,
            time_ids: time_ids(&batch, &device)?,
        }),
        None => None,
    };
    let t = noised.timesteps_tensor(&device)?;
    let pred = sd
        .unet
        .forward(&noised.noisy, &t, &context, added.as_ref())?;
    let loss = settings.objective.loss(&pred, &noised)?;
    let value = loss.detach().to_dtype(DType::F32)?;
    let grads = (loss / accum as f64)?.backward().context("backward pass")?;
    Ok((value, grads))
}

/// SDXL's `time_ids` per sample: original size (h, w), crop top-left (y, x), target size (h, w).
fn time_ids(batch: &[&TrainImage], device: &candle_core::Device) -> candle_core::Result<Tensor> {
    let rows: Vec<f32> = batch
        .iter()
        .flat_map(|im| {
            let (oh, ow) = im.original_size;
            let (cy, cx) = im.crop_top_left;
            let (th, tw) = im.target_size();
            [oh, ow, cy, cx, th, tw].map(|v| v as f32)
        })
        .collect();
    Tensor::from_vec(rows, (batch.len(), 6), device)
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

/// Adds `next` into `acc` for every parameter in `params` (gradient accumulation).
pub fn accumulate(
    acc: &mut GradStore,
    next: &GradStore,
    params: &[&Var],
) -> candle_core::Result<()> {
    for var in params {
        if let Some(g) = next.get(var) {
            // Detached: a Var's gradient still references the forward graph that made it.
            let sum = match acc.get(var) {
                Some(a) => (a + g)?.detach(),
                None => g.detach(),
            };
            acc.insert(var, sum);
        }
    }
    Ok(())
}
