//! DPM-Solver-2 ancestral (k-diffusion's `sample_dpm_2_ancestral`), as diffusers'
//! `KDPM2AncestralDiscreteScheduler`, which EveryDream2's `kdpm2` builds:
//! - timesteps and `σ_k` as Euler's (Karras sigmas when `use_karras_sigmas`, their timesteps
//!   rounded), then a final 0; from `σ_k` to `σ_{k+1}`: `σ↑ = √(σ_{k+1}²(σ_k²−σ_{k+1}²)/σ_k²)`,
//!   `σ↓ = √(σ_{k+1}² − σ↑²)`, and the midpoint `σ_m = √(σ_k·σ↓)` (0 for the last step);
//! - each step but the last takes two model evaluations, at `σ_k` and at `σ_m` (its timestep read
//!   back from `ln σ_m`), so there are `2n − 1`: `t_0, t_{m0}, t_1, t_{m1}, …, t_{n−1}`;
//! - first evaluation: `x_m = x + (x − x̂₀(σ_k))/σ_k·(σ_m − σ_k)`; second, from the same `x`:
//!   `x' = x + (x_m − x̂₀(σ_m))/σ_m·(σ↓ − σ_k) + σ↑·z`; the last step is Euler's to 0;
//! - the model sees its input divided by `√(σ²+1)` of the σ it is evaluated at.
//!
//! The latents of each first evaluation are kept by step index, so one sampler draws one image
//! at a time from step 0.

use std::cell::RefCell;

use candle_core::{Result, Tensor};

use super::sampler::{NoiseFn, Sampler};
use super::scheduler_config::SchedulerConfig;
use super::sigmas::{
    init_noise_sigma, k_denoised, k_scale, k_schedule, log_sigmas, sigma_to_t, train_sigmas,
    KarrasTimesteps,
};
use crate::model::family::PredictionType;

pub struct Kdpm2Ancestral {
    timesteps: Vec<f64>,
    /// diffusers' table: `σ_0`, then each later σ twice, then the final 0 twice.
    table: Vec<f64>,
    /// Per step `k`: `σ_k`, `σ_m`, `σ↑`, `σ↓` (f32, as diffusers).
    sigma: Vec<f64>,
    mid: Vec<f64>,
    up: Vec<f64>,
    down: Vec<f64>,
    init_noise_sigma: f64,
    prediction: PredictionType,
    started: RefCell<Vec<Option<Tensor>>>,
}

impl Kdpm2Ancestral {
    /// `steps` must be in `1..=num_train_timesteps` ([`super::SamplerKind::build`] checks).
    pub fn new(config: &SchedulerConfig, steps: usize) -> std::result::Result<Self, String> {
        config.refuse_zero_snr("KDPM2AncestralDiscreteScheduler")?;
        let karras = config.use_karras_sigmas.unwrap_or(false);
        let (t, sigmas) = k_schedule(config, steps, karras.then_some(KarrasTimesteps::Rounded));
        // Computed in f32, as diffusers does from its f32 σ table.
        let mut s: Vec<f32> = sigmas.iter().map(|&x| x as f32).collect();
        s.push(0.0);
        let n = s.len();
        let mut up = vec![0f32; n];
        let mut down = vec![0f32; n];
        let mut mid = vec![0f32; n];
        for k in 0..n {
            let next = s.get(k + 1).copied().unwrap_or(0.0);
            up[k] = (next * next * (s[k] * s[k] - next * next) / (s[k] * s[k])).sqrt();
            down[k] = match k + 1 == n {
                true => 0.0,
                false => (next * next - up[k] * up[k]).sqrt(),
            };
            let (ls, ld) = (s[k].ln(), down[k].ln());
            mid[k] = match k + 2 >= n {
                true => 0.0,
                false => (ls + 0.5 * (ld - ls)).exp(),
            };
        }
        let logs = log_sigmas(&train_sigmas(config).1);
        let mut timesteps = vec![t[0]];
        for k in 0..steps - 1 {
            let tm = sigma_to_t(f64::from(mid[k]), &logs);
            timesteps.push(f64::from(tm as f32));
            timesteps.push(t[k + 1]);
        }
        let wide = |v: &[f32]| -> Vec<f64> { v.iter().map(|&x| f64::from(x)).collect() };
        let mut table = vec![f64::from(s[0])];
        for &x in &s[1..] {
            table.extend([f64::from(x); 2]);
        }
        table.push(0.0);
        Ok(Self {
            init_noise_sigma: init_noise_sigma(config, &wide(&s)),
            started: RefCell::new(vec![None; timesteps.len()]),
            timesteps,
            table,
            sigma: wide(&s),
            mid: wide(&mid),
            up: wide(&up),
            down: wide(&down),
            prediction: config.schedule.prediction_type(),
        })
    }
}

impl Sampler for Kdpm2Ancestral {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn init_noise_sigma(&self) -> f64 {
        self.init_noise_sigma
    }

    fn sigmas(&self) -> Option<&[f64]> {
        Some(&self.table)
    }

    fn scale_model_input(&self, sample: &Tensor, i: usize) -> Result<Tensor> {
        match i % 2 {
            0 => k_scale(sample, self.sigma[i / 2]),
            _ => k_scale(sample, self.mid[i / 2]),
        }
    }

    fn step(
        &self,
        i: usize,
        model_output: &Tensor,
        sample: &Tensor,
        noise: &mut NoiseFn<'_>,
    ) -> Result<Tensor> {
        let k = i / 2;
        let (sigma, mid) = (self.sigma[k], self.mid[k]);
        if i.is_multiple_of(2) {
            let x0 = k_denoised(self.prediction, sample, model_output, sigma)?;
            self.started.borrow_mut()[i] = Some(sample.clone());
            let derivative = ((sample - x0)? * (1.0 / sigma))?;
            return sample + (derivative * (mid - sigma))?;
        }
        let x0 = k_denoised(self.prediction, sample, model_output, mid)?;
        let derivative = ((sample - x0)? * (1.0 / mid))?;
        let started = self.started.borrow();
        let start = started[i - 1].as_ref().ok_or_else(|| {
            candle_core::Error::Msg(format!("KDPM2 ancestral: step {} was not taken", i - 1))
        })?;
        let x = (start + (derivative * (self.down[k] - sigma))?)?;
        let z = noise(model_output.dims())?.to_dtype(x.dtype())?;
        x + (z * self.up[k])?
    }
}
