//! diffusers' `AutoencoderKL` (`models/autoencoders/autoencoder_kl.py`, 0.42) without tiling or
//! slicing:
//! - `encode(x) = DiagonalGaussian(quant_conv(encoder(x)))`, the channels split into mean and
//!   log-variance, `logvar` clamped to [−30, 20], `std = exp(logvar / 2)`;
//! - `decode(z) = decoder(post_quant_conv(z))`;
//! - the latents the UNet sees are `(z − shift_factor)·scaling_factor`
//!   (diffusers' training scripts: `latents = vae.encode(x).latent_dist.sample() * scaling_factor`).
//!
//! Every layer computes in the dtype of its input (parameters are cast to it, and the cast's
//! backward brings gradients back to the parameter dtype), so an f32 image through a bf16-loaded
//! VAE runs in f32, as diffusers' `force_upcast` would.

use candle_core::{DType, Result, Tensor, D};

use super::config::VaeConfig;
use super::decoder::Decoder;
use super::encoder::Encoder;
use crate::model::weights::{Weights, WeightsError};
use crate::nn::{Conv2d, Conv2dConfig, LayerMut, VisitLayers};

/// diffusers' `DiagonalGaussianDistribution` (non-deterministic), each tensor `[B, latent, h, w]`.
#[derive(Debug, Clone)]
pub struct DiagonalGaussian {
    pub mean: Tensor,
    /// Clamped to [−30, 20].
    pub logvar: Tensor,
    pub std: Tensor,
}

impl DiagonalGaussian {
    /// Splits `moments` `[B, 2·latent, h, w]` into mean and log-variance along the channels.
    pub fn from_moments(moments: &Tensor) -> Result<Self> {
        let c = moments.dim(1)?;
        if c % 2 != 0 {
            candle_core::bail!("VAE moments have {c} channels; expected an even count");
        }
        let mean = moments.narrow(1, 0, c / 2)?;
        let logvar = moments.narrow(1, c / 2, c / 2)?.clamp(-30f32, 20f32)?;
        let std = (&logvar * 0.5)?.exp()?;
        Ok(Self { mean, logvar, std })
    }

    /// `mean + std·ε` with ε ~ N(0, 1) from the device's generator. candle's CPU generator
    /// cannot be seeded, so for reproducible draws (a latent cache) pass seeded noise to
    /// [`Self::sample_with_noise`] instead.
    pub fn sample(&self) -> Result<Tensor> {
        // Drawn in f32 and cast: candle's CUDA backend has no bf16/f16 normal sampler.
        let noise = Tensor::randn(0f32, 1f32, self.mean.shape(), self.mean.device())?
            .to_dtype(self.mean.dtype())?;
        self.sample_with_noise(&noise)
    }

    /// `mean + std·noise`, `noise` shaped like `mean`.
    pub fn sample_with_noise(&self, noise: &Tensor) -> Result<Tensor> {
        let noise = noise.to_dtype(self.mean.dtype())?;
        &self.mean + (&self.std * noise)?
    }

    /// `KL(N(mean, var) ‖ N(0, 1))` summed over all but the batch dimension → `[B]`, in f32.
    pub fn kl(&self) -> Result<Tensor> {
        let mean = self.mean.to_dtype(DType::F32)?;
        let logvar = self.logvar.to_dtype(DType::F32)?;
        let terms = ((mean.sqr()? + logvar.exp()?)? - 1.0)?.sub(&logvar)?;
        terms.flatten_from(1)?.sum(D::Minus1)? * 0.5
    }
}

/// diffusers' `AutoencoderKL`.
/// [`AutoencoderKL::scale_latents`] from the config alone (the VAE may be released).
pub fn scale_latents_with(config: &VaeConfig, z: &Tensor) -> Result<Tensor> {
    let z = match config.shift_factor {
        Some(shift) => (z - shift)?,
        None => z.clone(),
    };
    z * config.scaling_factor
}

#[derive(Debug, Clone)]
pub struct AutoencoderKL {
    pub encoder: Encoder,
    pub decoder: Decoder,
    pub quant_conv: Option<Conv2d>,
    pub post_quant_conv: Option<Conv2d>,
    pub config: VaeConfig,
}

impl AutoencoderKL {
    /// Builds the VAE from `w` (its root: `encoder.*`, `decoder.*`, `quant_conv.*`,
    /// `post_quant_conv.*`). Validates `cfg` first.
    pub fn new(w: &Weights, cfg: &VaeConfig) -> std::result::Result<Self, WeightsError> {
        cfg.validate(w.component())
            .map_err(|e| WeightsError::Config(crate::error_chain::chain_text(&e)))?;
        let latent = cfg.latent_channels;
        let encoder = Encoder::new(&w.pp("encoder"), cfg)?;
        let decoder = Decoder::new(&w.pp("decoder"), cfg)?;
        let quant_conv = if cfg.use_quant_conv {
            Some(Conv2d::new(
                &w.pp("quant_conv"),
                2 * latent,
                2 * latent,
                Conv2dConfig::same(1),
            )?)
        } else {
            None
        };
        let post_quant_conv = if cfg.use_post_quant_conv {
            Some(Conv2d::new(
                &w.pp("post_quant_conv"),
                latent,
                latent,
                Conv2dConfig::same(1),
            )?)
        } else {
            None
        };
        Ok(Self {
            encoder,
            decoder,
            quant_conv,
            post_quant_conv,
            config: cfg.clone(),
        })
    }

    /// The dtype the VAE's weights are stored in (its input's dtype).
    pub fn dtype(&self) -> candle_core::DType {
        self.encoder.conv_in.weight.dtype()
    }

    /// `x` `[B, in, H, W]` in [−1, 1] → the posterior over raw (unscaled) latents.
    pub fn encode(&self, x: &Tensor) -> Result<DiagonalGaussian> {
        DiagonalGaussian::from_moments(&self.encode_moments(x)?)
    }

    /// The posterior's moments `[B, 2·latent, h, w]` (mean, then log-variance), what
    /// [`DiagonalGaussian::from_moments`] takes: what a latent cache keeps.
    pub fn encode_moments(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.encoder.forward(x)?;
        match &self.quant_conv {
            Some(q) => q.forward(&h),
            None => Ok(h),
        }
    }

    /// Raw (unscaled) latents `[B, latent, h, w]` → image `[B, out, h·f, w·f]`, roughly in [−1, 1].
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        let z = match &self.post_quant_conv {
            Some(p) => p.forward(z)?,
            None => z.clone(),
        };
        self.decoder.forward(&z)
    }

    /// The UNet's latents for image `x`: `(z − shift)·scaling_factor`, where `z` is a posterior
    /// sample when `sample`, else its mean.
    pub fn latents_from_image(&self, x: &Tensor, sample: bool) -> Result<Tensor> {
        let dist = self.encode(x)?;
        let z = if sample { dist.sample()? } else { dist.mean };
        self.scale_latents(&z)
    }

    /// `decode(latents / scaling_factor + shift)`.
    pub fn image_from_latents(&self, latents: &Tensor) -> Result<Tensor> {
        self.decode(&self.unscale_latents(latents)?)
    }

    /// Raw latents → the UNet's: `(z − shift)·scaling_factor`.
    pub fn scale_latents(&self, z: &Tensor) -> Result<Tensor> {
        scale_latents_with(&self.config, z)
    }

    /// The UNet's latents → raw: `latents / scaling_factor + shift`.
    pub fn unscale_latents(&self, latents: &Tensor) -> Result<Tensor> {
        let z = (latents / self.config.scaling_factor)?;
        match self.config.shift_factor {
            Some(shift) => z + shift,
            None => Ok(z),
        }
    }

    /// Image pixels per latent pixel per side (8 for SD).
    pub fn downscale_factor(&self) -> usize {
        self.config.downscale_factor()
    }
}

impl VisitLayers for AutoencoderKL {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        self.encoder.visit_layers(f);
        self.quant_conv.visit_layers(f);
        self.post_quant_conv.visit_layers(f);
        self.decoder.visit_layers(f);
    }
}
