//! Euler (Karras et al., arXiv 2206.00364, Algorithm 2 without churn), as diffusers'
//! `EulerDiscreteScheduler` (EveryDream2's `euler`):
//! - timesteps as the config spaces them (`linspace` when it says nothing), fractional; `σ`
//!   interpolated at them, or Karras sigmas (`use_karras_sigmas`) between the first and last of
//!   those with each timestep read back from `ln σ`; then a final 0 (`final_sigmas_type` `zero`)
//!   or the smallest training σ (`sigma_min`);
//! - the model sees `x/√(σ²+1)`; `x̂₀ = x − σ·ε̂`, or `v̂·(−σ/√(σ²+1)) + x/(σ²+1)`;
//! - `x' = x + (x − x̂₀)/σ·(σ' − σ)`.
//!
//! Zero terminal SNR sets the last `ᾱ` to 2⁻²⁴, as diffusers does.

use candle_core::{Result, Tensor};

use super::sampler::{NoiseFn, Sampler};
use super::scheduler_config::SchedulerConfig;
use super::sigmas::{
    as_f32, init_noise_sigma, k_denoised, k_scale, k_schedule, train_sigmas, KarrasTimesteps,
};
use crate::model::family::PredictionType;

#[derive(Debug, Clone)]
pub struct Euler {
    timesteps: Vec<f64>,
    /// One per step, then the final one.
    sigmas: Vec<f64>,
    init_noise_sigma: f64,
    prediction: PredictionType,
}

impl Euler {
    /// `steps` must be in `1..=num_train_timesteps` ([`super::SamplerKind::build`] checks).
    pub fn new(config: &SchedulerConfig, steps: usize) -> std::result::Result<Self, String> {
        if config.log_linear_interpolation {
            return Err(config.refuse(
                "interpolation_type",
                "is \"log_linear\"; only \"linear\" is supported (Stable Diffusion's configs use it)",
            ));
        }
        let prediction = config.schedule.prediction_type();
        if config.continuous_timesteps && prediction == PredictionType::VPrediction {
            return Err(config.refuse(
                "timestep_type",
                "is \"continuous\" with v-prediction (EDM timesteps); only \"discrete\" is supported",
            ));
        }
        let karras = config.use_karras_sigmas.unwrap_or(false);
        let (timesteps, sigmas) =
            k_schedule(config, steps, karras.then_some(KarrasTimesteps::Fractional));
        let mut sigmas = sigmas;
        sigmas.push(match config.dpm.final_sigma_min.unwrap_or(false) {
            false => 0.0,
            true => train_sigmas(config).1[0],
        });
        let sigmas = as_f32(sigmas);
        Ok(Self {
            init_noise_sigma: init_noise_sigma(config, &sigmas),
            timesteps,
            sigmas,
            prediction,
        })
    }
}

impl Sampler for Euler {
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
        _noise: &mut NoiseFn<'_>,
    ) -> Result<Tensor> {
        let sigma = self.sigmas[i];
        let x0 = k_denoised(self.prediction, sample, model_output, sigma)?;
        let derivative = ((sample - x0)? * (1.0 / sigma))?;
        sample + (derivative * (self.sigmas[i + 1] - sigma))?
    }
}
