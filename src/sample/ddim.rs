//! DDIM (Song et al., arXiv 2010.02502) with η = 0, as diffusers' `DDIMScheduler.step`:
//! - `x̂₀ = (x − √(1−ᾱ_t)·ε̂)/√ᾱ_t` (ε-prediction) or `√ᾱ_t·x − √(1−ᾱ_t)·v̂` (v-prediction),
//!   clamped to ±`clip_sample_range` when `clip_sample`;
//! - `ε̂ = √ᾱ_t·v̂ + √(1−ᾱ_t)·x` under v-prediction (from the unclamped output);
//! - `x_prev = √ᾱ_prev·x̂₀ + √(1−ᾱ_prev)·ε̂`, where `prev = t − N // n` and `ᾱ_prev` is 1
//!   (`set_alpha_to_one`) or `ᾱ_0` below 0.

use candle_core::{Result, Tensor};

use super::sampler::{NoiseFn, Sampler};
use super::scheduler_config::{SchedulerConfig, Spacing};
use crate::model::family::PredictionType;

#[derive(Debug, Clone)]
pub struct Ddim {
    timesteps: Vec<f64>,
    alphas_cumprod: Vec<f64>,
    final_alpha_cumprod: f64,
    step_size: usize,
    prediction: PredictionType,
    clip: Option<f64>,
}

impl Ddim {
    /// `steps` must be in `1..=num_train_timesteps` ([`super::SamplerKind::build`] checks).
    pub fn new(config: &SchedulerConfig, steps: usize) -> Self {
        let alphas_cumprod = config.schedule.alphas_cumprod().to_vec();
        let train = alphas_cumprod.len();
        let spacing = config.spacing.unwrap_or(Spacing::Leading);
        let final_alpha_cumprod = if config.set_alpha_to_one.unwrap_or(true) {
            1.0
        } else {
            alphas_cumprod[0]
        };
        Self {
            timesteps: spacing.timesteps(train, steps, config.steps_offset, true),
            final_alpha_cumprod,
            step_size: train / steps,
            prediction: config.schedule.prediction_type(),
            clip: config
                .clip_sample
                .unwrap_or(true)
                .then_some(config.clip_sample_range),
            alphas_cumprod,
        }
    }

    fn alpha_bar(&self, t: i64) -> f64 {
        if t >= 0 {
            self.alphas_cumprod
                .get(t as usize)
                .copied()
                .unwrap_or(self.final_alpha_cumprod)
        } else {
            self.final_alpha_cumprod
        }
    }
}

impl Sampler for Ddim {
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
        _noise: &mut NoiseFn<'_>,
    ) -> Result<Tensor> {
        let t = self.timesteps[i] as i64;
        let a = self.alpha_bar(t);
        let a_prev = self.alpha_bar(t - self.step_size as i64);
        let (sa, sb) = (a.sqrt(), (1.0 - a).sqrt());
        let (x0, eps) = match self.prediction {
            PredictionType::Epsilon => (
                ((sample - (model_output * sb)?)? * (1.0 / sa))?,
                model_output.clone(),
            ),
            PredictionType::VPrediction => (
                ((sample * sa)? - (model_output * sb)?)?,
                ((model_output * sa)? + (sample * sb)?)?,
            ),
        };
        let x0 = match self.clip {
            Some(r) => x0.clamp(-r, r)?,
            None => x0,
        };
        (x0 * a_prev.sqrt())? + (eps * (1.0 - a_prev).sqrt())?
    }
}
