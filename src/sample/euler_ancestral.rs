//! Euler ancestral (k-diffusion's `sample_euler_ancestral`), as diffusers'
//! `EulerAncestralDiscreteScheduler`:
//! - `σ_t = √((1−ᾱ_t)/ᾱ_t)`, interpolated linearly at fractional timesteps, then a final 0;
//! - the model sees `x/√(σ²+1)`;
//! - `x̂₀ = x − σ·ε̂`, or `v̂·(−σ/√(σ²+1)) + x/(σ²+1)` under v-prediction;
//! - from `σ` to `σ'`: `σ↑ = √(σ'²(σ²−σ'²)/σ²)`, `σ↓ = √(σ'²−σ↑²)`,
//!   `x' = x + (x − x̂₀)/σ·(σ↓ − σ) + σ↑·z` with `z` standard normal.
//!
//! With `rescale_betas_zero_snr` the last `ᾱ` is set to 2⁻²⁴ so `σ` stays finite, as diffusers
//! does. Sigmas and timesteps are rounded to f32 as diffusers stores them.

use candle_core::{Result, Tensor};

use super::sampler::{NoiseFn, Sampler};
use super::scheduler_config::SchedulerConfig;
use super::sigmas::{as_f32, init_noise_sigma, k_denoised, k_scale, k_schedule};
use crate::model::family::PredictionType;

#[derive(Debug, Clone)]
pub struct EulerAncestral {
    timesteps: Vec<f64>,
    /// One per step, then 0.
    sigmas: Vec<f64>,
    init_noise_sigma: f64,
    prediction: PredictionType,
}

impl EulerAncestral {
    /// `steps` must be in `1..=num_train_timesteps` ([`super::SamplerKind::build`] checks).
    pub fn new(config: &SchedulerConfig, steps: usize) -> Self {
        let (timesteps, sigmas) = k_schedule(config, steps, None);
        let mut sigmas = as_f32(sigmas);
        sigmas.push(0.0);
        Self {
            init_noise_sigma: init_noise_sigma(config, &sigmas),
            timesteps,
            sigmas,
            prediction: config.schedule.prediction_type(),
        }
    }
}

impl Sampler for EulerAncestral {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn init_noise_sigma(&self) -> f64 {
        self.init_noise_sigma
    }

    fn sigmas(&self) -> Option<&[f64]> {
        Some(&self.sigmas)
    }

    fn scale_model_input(&self, sample: &Tensor, i: usize) -> Result<Tensor> {
        k_scale(sample, self.sigmas[i])
    }

    fn step(
        &self,
        i: usize,
        model_output: &Tensor,
        sample: &Tensor,
        noise: &mut NoiseFn<'_>,
    ) -> Result<Tensor> {
        let sigma = self.sigmas[i];
        let x0 = k_denoised(self.prediction, sample, model_output, sigma)?;
        let to = self.sigmas[i + 1];
        let up = (to * to * (sigma * sigma - to * to) / (sigma * sigma)).sqrt();
        let down = (to * to - up * up).max(0.0).sqrt();
        let derivative = ((sample - x0)? * (1.0 / sigma))?;
        let prev = (sample + (derivative * (down - sigma))?)?;
        let z = noise(model_output.dims())?.to_dtype(prev.dtype())?;
        prev + (z * up)?
    }
}
