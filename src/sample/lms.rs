//! Linear multistep (k-diffusion's `sample_lms`), as diffusers' `LMSDiscreteScheduler`
//! (EveryDream2's `lms`):
//! - timesteps and `σ` as Euler's (the config's spacing, `linspace` when it says nothing;
//!   Karras sigmas when `use_karras_sigmas`), then a final 0;
//! - the model sees `x/√(σ²+1)`; `x̂₀` as Euler's, and the derivative `d_i = (x − x̂₀)/σ_i`;
//! - `x' = x + Σ_j c_j·d_{i−j}` over the last `min(i+1, 4)` derivatives, where `c_j` integrates
//!   the Lagrange basis polynomial of node `σ_{i−j}` (over the nodes `σ_{i−k}`) from `σ_i` to
//!   `σ_{i+1}`.
//!
//! diffusers integrates with `scipy.integrate.quad`; the integrand is a polynomial of degree at
//! most 3, which 4-point Gauss–Legendre integrates exactly, so the coefficients agree to
//! rounding. The derivatives are kept by step index, so one sampler draws one image at a time
//! from step 0.

use std::cell::RefCell;

use candle_core::{Result, Tensor};

use super::sampler::{NoiseFn, Sampler};
use super::scheduler_config::SchedulerConfig;
use super::sigmas::{as_f32, init_noise_sigma, k_denoised, k_scale, k_schedule, KarrasTimesteps};
use crate::model::family::PredictionType;

/// diffusers' `step(order=4)`.
const ORDER: usize = 4;

pub struct Lms {
    timesteps: Vec<f64>,
    /// One per step, then 0.
    sigmas: Vec<f64>,
    init_noise_sigma: f64,
    prediction: PredictionType,
    derivatives: RefCell<Vec<Option<Tensor>>>,
}

impl Lms {
    /// `steps` must be in `1..=num_train_timesteps` ([`super::SamplerKind::build`] checks).
    pub fn new(config: &SchedulerConfig, steps: usize) -> std::result::Result<Self, String> {
        config.refuse_zero_snr("LMSDiscreteScheduler")?;
        let karras = config.use_karras_sigmas.unwrap_or(false);
        let (timesteps, sigmas) =
            k_schedule(config, steps, karras.then_some(KarrasTimesteps::Fractional));
        let mut sigmas = as_f32(sigmas);
        sigmas.push(0.0);
        Ok(Self {
            init_noise_sigma: init_noise_sigma(config, &sigmas),
            derivatives: RefCell::new(vec![None; timesteps.len()]),
            timesteps,
            sigmas,
            prediction: config.schedule.prediction_type(),
        })
    }

    /// `c_j` of step `i` at `order` (module header).
    fn coefficient(&self, order: usize, i: usize, j: usize) -> f64 {
        let node = |k: usize| self.sigmas[i - k];
        let basis = |tau: f64| -> f64 {
            (0..order)
                .filter(|&k| k != j)
                .map(|k| (tau - node(k)) / (node(j) - node(k)))
                .product()
        };
        gauss_legendre_4(basis, self.sigmas[i], self.sigmas[i + 1])
    }
}

/// `∫_a^b f` by 4-point Gauss–Legendre: exact for polynomials of degree ≤ 7.
fn gauss_legendre_4(f: impl Fn(f64) -> f64, a: f64, b: f64) -> f64 {
    // Nodes ±√(3/7 ∓ 2/7·√(6/5)) and weights (18 ± √30)/36.
    let r = (6.0f64 / 5.0).sqrt();
    let inner = (3.0 / 7.0 - 2.0 / 7.0 * r).sqrt();
    let outer = (3.0 / 7.0 + 2.0 / 7.0 * r).sqrt();
    let w_inner = (18.0 + 30f64.sqrt()) / 36.0;
    let w_outer = (18.0 - 30f64.sqrt()) / 36.0;
    let (mid, half) = ((a + b) / 2.0, (b - a) / 2.0);
    let at = |x: f64| f(mid + half * x);
    half * (w_inner * (at(inner) + at(-inner)) + w_outer * (at(outer) + at(-outer)))
}

impl Sampler for Lms {
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
        self.derivatives.borrow_mut()[i] = Some(((sample - x0)? * (1.0 / sigma))?);
        let derivatives = self.derivatives.borrow();
        let order = (i + 1).min(ORDER);
        let mut x = sample.clone();
        for j in 0..order {
            let d = derivatives[i - j].as_ref().ok_or_else(|| {
                candle_core::Error::Msg(format!("LMS: step {} was not taken", i - j))
            })?;
            x = (x + (d * self.coefficient(order, i, j))?)?;
        }
        Ok(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gauss–Legendre against closed forms: a cubic exactly, and `eˣ` (not a polynomial) to
    /// 1e-7 over a short interval. Catches a wrong node or weight.
    #[test]
    fn gauss_legendre_integrates_cubics_exactly() {
        let cubic = |x: f64| 4.0 * x.powi(3) - 3.0 * x * x + 2.0 * x - 1.0;
        let exact = |x: f64| x.powi(4) - x.powi(3) + x * x - x;
        let got = gauss_legendre_4(cubic, 14.6, 0.03);
        let want = exact(0.03) - exact(14.6);
        assert!((got - want).abs() <= 1e-12 * want.abs(), "{got} vs {want}");
        let got = gauss_legendre_4(f64::exp, 0.0, 0.5);
        assert!((got - (0.5f64.exp() - 1.0)).abs() < 1e-7, "{got}");
    }
}
