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
use super::scheduler_config::{SchedulerConfig, Spacing};
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
        let (_, train_sigmas) = train_sigmas(config);
        let spacing = config.spacing.unwrap_or(Spacing::Linspace);
        let timesteps: Vec<f64> = spacing
            .timesteps(train_sigmas.len(), steps, config.steps_offset, false)
            .into_iter()
            .map(|t| f64::from(t as f32))
            .collect();
        let mut sigmas: Vec<f64> = timesteps
            .iter()
            .map(|&t| f64::from(interp(&train_sigmas, t) as f32))
            .collect();
        sigmas.push(0.0);
        let max = sigmas.iter().copied().fold(0.0, f64::max);
        let init_noise_sigma = match spacing {
            Spacing::Linspace | Spacing::Trailing => max,
            Spacing::Leading => f64::from((max * max + 1.0).sqrt() as f32),
        };
        Self {
            timesteps,
            sigmas,
            init_noise_sigma,
            prediction: config.schedule.prediction_type(),
        }
    }

    /// `σ` at each step and the final 0.
    pub fn sigmas(&self) -> &[f64] {
        &self.sigmas
    }
}

/// The schedule's `ᾱ` as the σ-based samplers take it (the last set to 2⁻²⁴ under zero terminal
/// SNR, so `σ` stays finite, as diffusers does) and `σ_t = √((1−ᾱ_t)/ᾱ_t)` rounded to f32.
pub(super) fn train_sigmas(config: &SchedulerConfig) -> (Vec<f64>, Vec<f64>) {
    let mut alphas_cumprod = config.schedule.alphas_cumprod().to_vec();
    if config.zero_terminal_snr {
        if let Some(last) = alphas_cumprod.last_mut() {
            *last = 2f64.powi(-24);
        }
    }
    let sigmas = alphas_cumprod
        .iter()
        .map(|&a| f64::from((((1.0 - a) / a).sqrt()) as f32))
        .collect();
    (alphas_cumprod, sigmas)
}

/// numpy's `interp(t, arange(len(ys)), ys)`: linear, clamped at the ends.
pub(super) fn interp(ys: &[f64], t: f64) -> f64 {
    let last = ys.len() - 1;
    if t <= 0.0 {
        return ys[0];
    }
    if t >= last as f64 {
        return ys[last];
    }
    let k = t.floor() as usize;
    let f = t - k as f64;
    ys[k] + (ys[k + 1] - ys[k]) * f
}

impl Sampler for EulerAncestral {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn init_noise_sigma(&self) -> f64 {
        self.init_noise_sigma
    }

    fn scale_model_input(&self, sample: &Tensor, i: usize) -> Result<Tensor> {
        let s = self.sigmas[i];
        sample * (1.0 / (s * s + 1.0).sqrt())
    }

    fn step(
        &self,
        i: usize,
        model_output: &Tensor,
        sample: &Tensor,
        noise: &mut NoiseFn<'_>,
    ) -> Result<Tensor> {
        let sigma = self.sigmas[i];
        let x0 = match self.prediction {
            PredictionType::Epsilon => (sample - (model_output * sigma)?)?,
            PredictionType::VPrediction => {
                let s2 = sigma * sigma + 1.0;
                ((model_output * (-sigma / s2.sqrt()))? + (sample * (1.0 / s2))?)?
            }
        };
        let to = self.sigmas[i + 1];
        let up = (to * to * (sigma * sigma - to * to) / (sigma * sigma)).sqrt();
        let down = (to * to - up * up).max(0.0).sqrt();
        let derivative = ((sample - x0)? * (1.0 / sigma))?;
        let prev = (sample + (derivative * (down - sigma))?)?;
        let z = noise(model_output.dims())?.to_dtype(prev.dtype())?;
        prev + (z * up)?
    }
}
