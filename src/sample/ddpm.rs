//! DDPM ancestral sampling (Ho et al., arXiv 2006.11239, eqs. 6–7), as diffusers'
//! `DDPMScheduler` (EveryDream2's `ddpm`) over `n` of the training timesteps:
//! - timesteps as the config spaces them (`leading` when it says nothing), whole; the previous
//!   timestep `t'` is the next one in the list, and `ᾱ_{t'}` is 1 past the end;
//! - `x̂₀ = (x − √(1−ᾱ_t)·ε̂)/√ᾱ_t`, or `√ᾱ_t·x − √(1−ᾱ_t)·v̂`, clamped to ±`clip_sample_range`
//!   when `clip_sample` (true when the config says nothing);
//! - with `α = ᾱ_t/ᾱ_{t'}` and `β = 1 − α`:
//!   `x' = √ᾱ_{t'}·β/(1−ᾱ_t)·x̂₀ + √α·(1−ᾱ_{t'})/(1−ᾱ_t)·x + √var·z` with `z` standard normal,
//!   drawn while `t > 0`; `var` is `(1−ᾱ_{t'})/(1−ᾱ_t)·β` (at least 10⁻²⁰; `fixed_small`, the
//!   default) or `β` (`fixed_large`).
//!
//! Zero terminal SNR is taken as is (diffusers has no 2⁻²⁴ floor here), so ε-prediction at
//! `t = T−1` divides by zero, as in diffusers.

use candle_core::{Result, Tensor};

use super::sampler::{NoiseFn, Sampler};
use super::scheduler_config::{SchedulerConfig, Spacing};
use crate::model::family::PredictionType;

#[derive(Debug, Clone)]
pub struct Ddpm {
    timesteps: Vec<f64>,
    alphas_cumprod: Vec<f64>,
    prediction: PredictionType,
    clip: Option<f64>,
    fixed_large: bool,
}

impl Ddpm {
    /// `steps` must be in `1..=num_train_timesteps` ([`super::SamplerKind::build`] checks).
    pub fn new(config: &SchedulerConfig, steps: usize) -> std::result::Result<Self, String> {
        let fixed_large = match config.variance_type.as_deref() {
            None | Some("fixed_small") => false,
            Some("fixed_large") => true,
            Some(other) => {
                return Err(config.refuse(
                    "variance_type",
                    &format!(
                        "is \"{other}\"; DDPM draws with \"fixed_small\" or \"fixed_large\" (a \
                         learned variance needs a UNet that predicts one, which Stable Diffusion's \
                         do not)"
                    ),
                ))
            }
        };
        let alphas_cumprod = config.schedule.alphas_cumprod().to_vec();
        let spacing = config.spacing.unwrap_or(Spacing::Leading);
        let train = alphas_cumprod.len();
        let timesteps = spacing.timesteps(train, steps, config.steps_offset, true);
        check_timesteps(config, &timesteps, train)?;
        Ok(Self {
            timesteps,
            alphas_cumprod,
            prediction: config.schedule.prediction_type(),
            clip: config
                .clip_sample
                .unwrap_or(true)
                .then_some(config.clip_sample_range),
            fixed_large,
        })
    }
}

/// Refuses timesteps past the schedule's end (a large `steps_offset` with `leading` spacing).
pub(super) fn check_timesteps(
    config: &SchedulerConfig,
    timesteps: &[f64],
    train: usize,
) -> std::result::Result<(), String> {
    match timesteps.iter().find(|&&t| t >= train as f64) {
        None => Ok(()),
        Some(t) => Err(config.refuse(
            "steps_offset",
            &format!(
                "is {}: with {} steps the first timestep would be {t}, past the schedule's last \
                 ({})",
                config.steps_offset,
                timesteps.len(),
                train - 1
            ),
        )),
    }
}

impl Sampler for Ddpm {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn init_noise_sigma(&self) -> f64 {
        1.0
    }

    fn sigmas(&self) -> Option<&[f64]> {
        None
    }

    fn scale_model_input(&self, sample: &Tensor, _i: usize) -> Result<Tensor> {
        Ok(sample.clone())
    }

    fn step(
        &self,
        i: usize,
        model_output: &Tensor,
        sample: &Tensor,
        noise: &mut NoiseFn<'_>,
    ) -> Result<Tensor> {
        let t = self.timesteps[i] as usize;
        let a = self.alphas_cumprod[t];
        let a_prev = match self.timesteps.get(i + 1) {
            Some(&p) => self.alphas_cumprod[p as usize],
            None => 1.0,
        };
        let (beta, beta_prev) = (1.0 - a, 1.0 - a_prev);
        let current_alpha = a / a_prev;
        let current_beta = 1.0 - current_alpha;
        let x0 = match self.prediction {
            PredictionType::Epsilon => {
                ((sample - (model_output * beta.sqrt())?)? * (1.0 / a.sqrt()))?
            }
            PredictionType::VPrediction => ((sample * a.sqrt())? - (model_output * beta.sqrt())?)?,
        };
        let x0 = match self.clip {
            Some(r) => x0.clamp(-r, r)?,
            None => x0,
        };
        let x0_coef = a_prev.sqrt() * current_beta / beta;
        let x_coef = current_alpha.sqrt() * beta_prev / beta;
        let mean = ((x0 * x0_coef)? + (sample * x_coef)?)?;
        if t == 0 {
            return Ok(mean);
        }
        let variance = match self.fixed_large {
            false => (beta_prev / beta * current_beta).max(1e-20),
            true => current_beta,
        };
        let z = noise(model_output.dims())?.to_dtype(mean.dtype())?;
        mean + (z * variance.sqrt())?
    }
}
