//! One image from a prompt, as diffusers' `StableDiffusionPipeline` / `StableDiffusionXLPipeline`
//! make it:
//! - classifier-free guidance when `cfg > 1`: the UNet sees `[uncond, cond]` and the guided
//!   output is `g = u + cfg·(c − u)`;
//! - guidance rescale φ (`guidance_rescale`, arXiv 2305.08891 §3.4, diffusers'
//!   `rescale_noise_cfg`) under guidance when φ > 0: `φ·g·std(c)/std(g) + (1 − φ)·g`, each
//!   standard deviation over all of a sample's elements (Bessel-corrected, as `torch.std`);
//! - the negative conditioning is the negative prompt's encoding (`""` when none), except that
//!   SDXL pipelines with `force_zeros_for_empty_prompt` use zeros for an empty negative prompt;
//! - SDXL's `time_ids` are `(h, w, 0, 0, h, w)` for both halves;
//! - initial latents are standard normal noise times the sampler's `init_noise_sigma`;
//! - the image is `clamp(decode(latents)/2 + 0.5, 0, 1)`.
//!
//! Noise comes from a host RNG seeded by the request's seed (the initial latents first, then
//! the ancestral sampler's per-step draws), so a seed gives the same image on any device up to
//! arithmetic differences.

use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::prompts::PromptSyntax;
use super::sampler::{NoiseFn, Sampler, SamplerKind};
use crate::diffusion::host_randn;
use crate::model::family::ModelFamily;
use crate::model::pipeline::{StableDiffusion, TextConditioning};
use crate::model::unet::AddedConditions;
use crate::model::vae::AutoencoderKL;

/// The denoised latents of a sample hold NaN or Inf (broken or diverged weights, a LoRA merged
/// at an overflowing scale, or f16 overflow): the image would be black or noise.
#[derive(Debug, thiserror::Error)]
#[error("sampling produced {value} in the latents (seed {seed}): the image would be meaningless")]
pub struct NonFiniteSample {
    pub value: f32,
    pub seed: u64,
}

/// The first non-finite value of `t`, if any (read on the host: latents are small).
fn first_nonfinite_value(t: &Tensor) -> candle_core::Result<Option<f32>> {
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(v.into_iter().find(|x| !x.is_finite()))
}

/// What to draw.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleRequest {
    pub prompt: String,
    /// `""`: none.
    pub negative_prompt: String,
    pub seed: u64,
    pub width: usize,
    pub height: usize,
    pub steps: usize,
    /// Guidance scale; ≤ 1 runs the conditional half alone.
    pub cfg: f64,
    /// Guidance rescale φ in [0, 1] (diffusers' `guidance_rescale`); 0 leaves guidance as it is.
    pub guidance_rescale: f64,
    pub sampler: SamplerKind,
}

impl SampleRequest {
    pub fn guided(&self) -> bool {
        self.cfg > 1.0
    }
}

/// A request's text conditioning: the prompt's, and the negative one under guidance.
#[derive(Debug, Clone)]
pub struct PromptConds {
    pub cond: TextConditioning,
    pub uncond: Option<TextConditioning>,
}

impl PromptConds {
    /// Encodes `prompt` (and `negative` when `guided`) with the model's text encoders, reading
    /// their weights in `syntax`: compel's as EveryDream2's samples do
    /// ([`super::weighted_prompt`]), or A1111's as kohya's do ([`super::kohya_weighting`]).
    /// `zero_empty_negative` is the SDXL pipeline's `force_zeros_for_empty_prompt`.
    pub fn encode(
        sd: &StableDiffusion,
        prompt: &str,
        negative: &str,
        guided: bool,
        clip_skip: usize,
        zero_empty_negative: bool,
        syntax: PromptSyntax,
    ) -> candle_core::Result<Self> {
        let zeros = guided && negative.is_empty() && zero_empty_negative;
        let (cond, uncond) = match syntax {
            PromptSyntax::Kohya => {
                super::kohya_weighting::encode(sd, prompt, negative, guided, clip_skip)?
            }
            PromptSyntax::Compel => {
                let cond = super::weighted_prompt::encode(sd, prompt, clip_skip)?;
                let uncond = (guided && !zeros)
                    .then(|| super::weighted_prompt::encode(sd, negative, clip_skip))
                    .transpose()?;
                (cond, uncond)
            }
        };
        let uncond = match zeros {
            true => Some(TextConditioning {
                context: cond.context.zeros_like()?,
                pooled: cond.pooled.as_ref().map(Tensor::zeros_like).transpose()?,
            }),
            false => uncond.map(detach).transpose()?,
        };
        let cond = detach(cond)?;
        Ok(Self { cond, uncond })
    }

    /// The same conditioning on `device` (cached encodings live on the host).
    pub fn to_device(&self, device: &Device) -> candle_core::Result<Self> {
        Ok(Self {
            cond: move_cond(&self.cond, device)?,
            uncond: self
                .uncond
                .as_ref()
                .map(|u| move_cond(u, device))
                .transpose()?,
        })
    }
}

fn detach(c: TextConditioning) -> candle_core::Result<TextConditioning> {
    Ok(TextConditioning {
        context: c.context.detach(),
        pooled: c.pooled.map(|p| p.detach()),
    })
}

fn move_cond(c: &TextConditioning, device: &Device) -> candle_core::Result<TextConditioning> {
    Ok(TextConditioning {
        context: c.context.to_device(device)?,
        pooled: c.pooled.as_ref().map(|p| p.to_device(device)).transpose()?,
    })
}

/// Whether SDXL's empty negative prompt is zeros: the pipeline's `force_zeros_for_empty_prompt`
/// in `model_index.json` (true when absent, diffusers' default). Always false for SD1/SD2.
pub fn zero_empty_negative(sd: &StableDiffusion) -> bool {
    if sd.family() != ModelFamily::Sdxl {
        return false;
    }
    sd.layout
        .model_index_json()
        .ok()
        .and_then(|v| {
            v.get("force_zeros_for_empty_prompt")
                .and_then(|b| b.as_bool())
        })
        .unwrap_or(true)
}

/// How the UNet runs while sampling.
#[derive(Debug, Clone, Copy)]
pub struct UnetRun {
    /// The UNet's input dtype (the training compute dtype).
    pub dtype: DType,
    /// Run the two guidance halves as one batch of 2 (else one after the other, which needs
    /// no more memory than a training micro-batch of 1).
    pub batch_halves: bool,
}

/// SDXL's added time ids for a `width`×`height` sample, as diffusers' pipeline builds them
/// (`_get_add_time_ids`: `original_size + crops_coords_top_left + target_size`, sizes as
/// `(height, width)`, crop `(0, 0)`).
fn sample_time_ids(width: usize, height: usize) -> [f32; 6] {
    let (h, w) = (height as f32, width as f32);
    [h, w, 0.0, 0.0, h, w]
}

/// The model's guided prediction for latents `x` at timestep `t`.
fn predict(
    sd: &StableDiffusion,
    run: UnetRun,
    x: &Tensor,
    t: f64,
    conds: &PromptConds,
    req: &SampleRequest,
) -> candle_core::Result<Tensor> {
    let one = |x: &Tensor, c: &TextConditioning| -> candle_core::Result<Tensor> {
        let b = x.dim(0)?;
        let device = x.device();
        let ts = Tensor::from_vec(vec![t as f32; b], b, device)?;
        let added = match &c.pooled {
            Some(p) => {
                let row = sample_time_ids(req.width, req.height);
                let ids: Vec<f32> = (0..b).flat_map(|_| row).collect();
                Some(AddedConditions {
                    text_embeds: p.clone(),
                    time_ids: Tensor::from_vec(ids, (b, 6), device)?,
                })
            }
            None => None,
        };
        let out = sd.unet.forward(
            &x.to_dtype(run.dtype)?,
            &ts,
            &c.context.to_dtype(run.dtype)?,
            added.as_ref(),
        )?;
        // Detached: the UNet's weights may be training variables, and a graph kept alive here
        // would hold every activation of the forward.
        Ok(out.to_dtype(DType::F32)?.detach())
    };
    let Some(u) = &conds.uncond else {
        return one(x, &conds.cond);
    };
    let (out_u, out_c) = if run.batch_halves {
        let both = TextConditioning {
            context: Tensor::cat(&[&u.context, &conds.cond.context], 0)?,
            pooled: match (&u.pooled, &conds.cond.pooled) {
                (Some(a), Some(b)) => Some(Tensor::cat(&[a, b], 0)?),
                _ => None,
            },
        };
        let out = one(&Tensor::cat(&[x, x], 0)?, &both)?;
        (out.narrow(0, 0, 1)?, out.narrow(0, 1, 1)?)
    } else {
        (one(x, u)?, one(x, &conds.cond)?)
    };
    let guided = (&out_u + ((&out_c - &out_u)? * req.cfg)?)?;
    match req.guidance_rescale > 0.0 {
        true => rescale_guidance(&guided, &out_c, req.guidance_rescale),
        false => Ok(guided),
    }
}

/// diffusers' `rescale_noise_cfg`: the guided output `guided` brought `phi` of the way to the
/// standard deviation of the conditional output `cond`, per sample (dim 0).
pub fn rescale_guidance(guided: &Tensor, cond: &Tensor, phi: f64) -> candle_core::Result<Tensor> {
    let std = |t: &Tensor| -> candle_core::Result<Tensor> {
        let flat = t.flatten_from(1)?;
        let n = flat.dim(1)?;
        let centred = flat.broadcast_sub(&flat.mean_keepdim(1)?)?;
        (centred.sqr()?.sum_keepdim(1)? / (n.max(2) - 1) as f64)?.sqrt()
    };
    let ratio = (std(cond)? / std(guided)?)?;
    let shape: Vec<usize> = (0..guided.rank())
        .map(|d| if d == 0 { guided.dim(0) } else { Ok(1) })
        .collect::<candle_core::Result<_>>()?;
    let rescaled = guided.broadcast_mul(&ratio.reshape(shape)?)?;
    (rescaled * phi)? + (guided * (1.0 - phi))?
}

/// The longest side a sample may have, in pixels: training's `aspects` bound. Far past it the
/// latents alone would not fit in memory, and the allocation failure would abort the process.
pub const MAX_SAMPLE_SIDE: usize = 8192;

/// `Err` naming the limit when a side of `width`×`height` is over [`MAX_SAMPLE_SIDE`].
pub fn check_side_limit(width: usize, height: usize) -> Result<(), String> {
    if width > MAX_SAMPLE_SIDE || height > MAX_SAMPLE_SIDE {
        return Err(format!(
            "sample size {width}x{height}: each side must be at most {MAX_SAMPLE_SIDE} pixels"
        ));
    }
    Ok(())
}

/// Checks that `req`'s size fits the model: multiples of the VAE's and UNet's combined factor,
/// each side at most [`MAX_SAMPLE_SIDE`].
pub fn check_size(sd: &StableDiffusion, req: &SampleRequest) -> Result<(), String> {
    check_side_limit(req.width, req.height)?;
    let align = sd.vae_scale << sd.unet.config.num_downsamples();
    if req.width == 0
        || req.height == 0
        || !req.width.is_multiple_of(align)
        || !req.height.is_multiple_of(align)
    {
        return Err(format!(
            "sample size {}x{} must be a positive multiple of {align} for this model",
            req.width, req.height
        ));
    }
    Ok(())
}

/// The denoising loop from `latents` (already times `init_noise_sigma`), calling `on_step` with
/// the latents after each step. Returns the final latents (f32).
#[allow(clippy::too_many_arguments)]
pub fn denoise(
    sd: &StableDiffusion,
    run: UnetRun,
    sampler: &dyn Sampler,
    conds: &PromptConds,
    req: &SampleRequest,
    latents: Tensor,
    noise: &mut NoiseFn<'_>,
    on_step: &mut dyn FnMut(usize, &Tensor),
) -> candle_core::Result<Tensor> {
    let mut x = latents;
    for (i, &t) in sampler.timesteps().iter().enumerate() {
        let input = sampler.scale_model_input(&x, i)?;
        let out = predict(sd, run, &input, t, conds, req)?;
        x = sampler.step(i, &out, &x, noise)?;
        on_step(i, &x);
    }
    Ok(x)
}

/// Latents → image `[3, H, W]` f32 in `[0, 1]` on the host.
pub fn decode(vae: &AutoencoderKL, latents: &Tensor) -> candle_core::Result<Tensor> {
    let image = vae.image_from_latents(&latents.to_dtype(vae.dtype())?)?;
    let image = ((image.to_dtype(DType::F32)? * 0.5)? + 0.5)?.clamp(0f32, 1f32)?;
    image.squeeze(0)?.to_device(&Device::Cpu)
}

/// One image for `req`: seeded noise, the denoising loop and the VAE decode.
pub fn generate(
    sd: &StableDiffusion,
    vae: &AutoencoderKL,
    run: UnetRun,
    sampler: &dyn Sampler,
    conds: &PromptConds,
    req: &SampleRequest,
) -> anyhow::Result<Tensor> {
    check_size(sd, req).map_err(anyhow::Error::msg)?;
    let device = sd.unet.conv_in.weight.device().clone();
    let f = sd.vae_scale;
    let c = sd.unet.config.in_channels;
    let mut rng = StdRng::seed_from_u64(req.seed);
    let latents = host_randn(&mut rng, &[1, c, req.height / f, req.width / f], &device)?;
    let latents = (latents * sampler.init_noise_sigma())?;
    let mut noise = |dims: &[usize]| host_randn(&mut rng, dims, &device);
    let conds = conds.to_device(&device)?;
    let x = denoise(
        sd,
        run,
        sampler,
        &conds,
        req,
        latents,
        &mut noise,
        &mut |_, _| {},
    )?;
    if let Some(value) = first_nonfinite_value(&x)? {
        return Err(NonFiniteSample {
            value,
            seed: req.seed,
        }
        .into());
    }
    Ok(decode(vae, &x)?)
}

#[cfg(test)]
mod tests {
    /// Height before width, as diffusers orders them: every SDXL parity case is square, so a
    /// swap fails only here.
    #[test]
    fn time_ids_put_the_height_first() {
        assert_eq!(
            super::sample_time_ids(48, 32),
            [32.0, 48.0, 0.0, 0.0, 32.0, 48.0]
        );
    }
}
