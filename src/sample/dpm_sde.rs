//! DPM-Solver++ SDE (k-diffusion's `sample_dpmpp_sde`, r = ½), as diffusers'
//! `DPMSolverSDEScheduler` (EveryDream2's `dpm++_sde`, and `dpm++_sde_k` with Karras sigmas):
//! - timesteps and `σ_k` as Euler's (Karras sigmas with fractional timesteps), then a final 0;
//!   each step but the last takes a second model evaluation at the log-midpoint
//!   `σ_m = e^{−(t + t')/2}` (`t = −ln σ_k`, `t' = −ln σ_{k+1}`), so there are `2n − 1`
//!   evaluations: `t_0, t_{m0}, t_1, …, t_{n−1}`;
//! - a move from `σ_from` to `σ_to` from latents `x_s`: `σ↑ = min(σ_to, √(σ_to²(σ_from² −
//!   σ_to²)/σ_from²))`, `σ↓ = √(σ_to² − σ↑²)`, `x' = (σ↓/σ_from)·x_s − expm1(ln σ↓ − ln σ_from)·x̂₀
//!   + σ↑·z`; the first evaluation moves from `σ_k` to `σ_m`, the second from `σ_k` to `σ_{k+1}`
//!   again from the step's first latents, with `x̂₀` at `σ_m`; the last step is Euler's to 0;
//! - the model sees its input divided by `√(σ²+1)` of the σ it is evaluated at.
//!
//! diffusers draws `z` from a torchsde Brownian tree (seeded with EveryDream2's
//! `noise_sampler_seed` 0), so the increments over nested intervals are correlated; sdtrain draws
//! each `z` as independent standard normal noise from the request's seed. Given the same `z`,
//! the steps match diffusers' (tests/sample_parity.rs), but a seed does not reproduce
//! diffusers' image.

use std::cell::RefCell;

use candle_core::{Result, Tensor};

use super::sampler::{NoiseFn, Sampler};
use super::scheduler_config::SchedulerConfig;
use super::sigmas::{
    as_f32, init_noise_sigma, k_denoised, k_scale, k_schedule, log_sigmas, sigma_to_t,
    train_sigmas, KarrasTimesteps,
};
use crate::model::family::PredictionType;

pub struct DpmSde {
    timesteps: Vec<f64>,
    /// diffusers' table: `σ_0`, each later σ twice, then 0.
    table: Vec<f64>,
    init_noise_sigma: f64,
    prediction: PredictionType,
    /// The latents at each first evaluation, by step index.
    started: RefCell<Vec<Option<Tensor>>>,
}

/// `t = −ln σ` and the log-midpoint `t + (t' − t)/2` of a move, in f32 as diffusers.
fn times(sigma: f64, next: f64) -> (f32, f32, f32) {
    let (t, t_next) = (-(sigma as f32).ln(), -(next as f32).ln());
    (t, t_next, t + (t_next - t) * 0.5)
}

impl DpmSde {
    /// `steps` must be in `1..=num_train_timesteps` ([`super::SamplerKind::build`] checks).
    pub fn new(
        config: &SchedulerConfig,
        steps: usize,
        karras: bool,
    ) -> std::result::Result<Self, String> {
        config.refuse_zero_snr("DPMSolverSDEScheduler")?;
        let (t, sigmas) = k_schedule(config, steps, karras.then_some(KarrasTimesteps::Fractional));
        let logs = log_sigmas(&train_sigmas(config).1);
        let mut timesteps = vec![t[0]];
        for k in 0..steps - 1 {
            // diffusers reads the midpoints back from the unrounded σ, in f64.
            let (a, b) = (-sigmas[k].ln(), -sigmas[k + 1].ln());
            let mid = (-(a + (b - a) * 0.5)).exp();
            timesteps.push(f64::from(sigma_to_t(mid, &logs) as f32));
            timesteps.push(t[k + 1]);
        }
        let s = as_f32(sigmas);
        let mut table = vec![s[0]];
        for &x in &s[1..] {
            table.extend([x, x]);
        }
        table.push(0.0);
        Ok(Self {
            init_noise_sigma: init_noise_sigma(config, &s),
            started: RefCell::new(vec![None; timesteps.len()]),
            timesteps,
            table,
            prediction: config.schedule.prediction_type(),
        })
    }

    /// The move of step `i`: from `σ`, towards `σ'`.
    fn bounds(&self, i: usize) -> (f64, f64) {
        match i % 2 {
            0 => (self.table[i], self.table[i + 1]),
            _ => (self.table[i - 1], self.table[i]),
        }
    }
}

impl Sampler for DpmSde {
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
        let (sigma, next) = self.bounds(i);
        match i % 2 {
            0 => k_scale(sample, sigma),
            _ => k_scale(sample, f64::from((-times(sigma, next).2).exp())),
        }
    }

    fn step(
        &self,
        i: usize,
        model_output: &Tensor,
        sample: &Tensor,
        noise: &mut NoiseFn<'_>,
    ) -> Result<Tensor> {
        let first = i.is_multiple_of(2);
        let (sigma, next) = self.bounds(i);
        let (t, t_next, t_mid) = times(sigma, next);
        let sigma_in = match first {
            true => sigma,
            false => f64::from((-t_mid).exp()),
        };
        let x0 = k_denoised(self.prediction, sample, model_output, sigma_in)?;
        if next == 0.0 {
            let derivative = ((sample - &x0)? * (1.0 / sigma))?;
            return sample + (derivative * (next - sigma))?;
        }
        let started = self.started.borrow();
        let (base, t_to) = match first {
            true => (sample, t_mid),
            false => (
                started[i - 1].as_ref().ok_or_else(|| {
                    candle_core::Error::Msg(format!("DPM++ SDE: step {} was not taken", i - 1))
                })?,
                t_next,
            ),
        };
        let (from, to) = ((-t).exp(), (-t_to).exp());
        let up = to.min((to * to * (from * from - to * to) / (from * from)).sqrt());
        let down = (to * to - up * up).sqrt();
        let t_down = -down.ln();
        let x = ((base * f64::from((-t_down).exp() / (-t).exp()))?
            - (&x0 * f64::from((t - t_down).exp_m1()))?)?;
        let z = noise(model_output.dims())?.to_dtype(x.dtype())?;
        let x = (x + (z * f64::from(up))?)?;
        drop(started);
        if first {
            self.started.borrow_mut()[i] = Some(sample.clone());
        }
        Ok(x)
    }
}
