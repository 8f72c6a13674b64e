//! The σ tables the k-diffusion-style samplers share (Euler, Euler ancestral, LMS, KDPM2
//! ancestral, DPM++ SDE, DPM-Solver++), as diffusers computes them:
//! - `σ_t = √((1−ᾱ_t)/ᾱ_t)` of each training timestep, rounded to f32 (`ᾱ` is f32 in torch);
//! - σ at a fractional timestep by linear interpolation (numpy's `interp`);
//! - Karras et al.'s schedule (arXiv 2206.00364, eq. 5, ρ = 7):
//!   `σ_k = (σ_max^{1/ρ} + k/(n−1)·(σ_min^{1/ρ} − σ_max^{1/ρ}))^ρ`;
//! - a σ read back as a fractional timestep by interpolating `ln σ` between its neighbours
//!   (diffusers' `_sigma_to_t`).

use super::scheduler_config::{round_half_even, SchedulerConfig, Spacing};

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

/// `ln σ` of each training σ, as numpy's f32 `log` of the f32 σ.
pub(super) fn log_sigmas(train_sigmas: &[f64]) -> Vec<f64> {
    train_sigmas
        .iter()
        .map(|&s| f64::from((s as f32).ln()))
        .collect()
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

/// Karras et al.'s schedule of `n` sigmas from `max` down to `min` (ρ = 7).
pub(super) fn karras(min: f64, max: f64, n: usize) -> Vec<f64> {
    let rho = 7.0;
    let (lo, hi) = (min.powf(1.0 / rho), max.powf(1.0 / rho));
    (0..n)
        .map(|k| {
            let r = if n == 1 {
                0.0
            } else {
                k as f64 / (n - 1) as f64
            };
            (hi + r * (lo - hi)).powf(rho)
        })
        .collect()
}

/// The (fractional) training timestep whose `ln σ` is `ln σ`, interpolated between neighbours
/// (diffusers' `_sigma_to_t`; `log_sigmas` are f32 there, so their difference is taken in f32).
pub(super) fn sigma_to_t(sigma: f64, log_sigmas: &[f64]) -> f64 {
    let log_sigma = sigma.max(1e-10).ln();
    let top = log_sigmas.len().saturating_sub(2);
    let low = log_sigmas
        .iter()
        .rposition(|&l| log_sigma - l >= 0.0)
        .unwrap_or(0)
        .min(top);
    let (lo, hi) = (log_sigmas[low], log_sigmas[low + 1]);
    let w = ((lo - log_sigma) / f64::from(lo as f32 - hi as f32)).clamp(0.0, 1.0);
    (1.0 - w) * low as f64 + w * (low + 1) as f64
}

/// How a k-diffusion sampler reads timesteps back from Karras sigmas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KarrasTimesteps {
    /// Fractional (Euler, LMS, DPM++ SDE).
    Fractional,
    /// Rounded to whole timesteps (KDPM2 ancestral).
    Rounded,
}

/// The timesteps and σ (one per step, no final σ; σ unrounded) of the samplers whose
/// `set_timesteps` is Euler's: timesteps spaced as the config says (`linspace` when it says
/// nothing; fractional, in f32), σ interpolated at them; with `karras`, Karras sigmas between the
/// first and last of those σ and the timesteps read back from them.
pub(super) fn k_schedule(
    config: &SchedulerConfig,
    steps: usize,
    karras_timesteps: Option<KarrasTimesteps>,
) -> (Vec<f64>, Vec<f64>) {
    let (_, train) = train_sigmas(config);
    let spacing = config.spacing.unwrap_or(Spacing::Linspace);
    let timesteps: Vec<f64> = spacing
        .timesteps(train.len(), steps, config.steps_offset, false)
        .into_iter()
        .map(|t| f64::from(t as f32))
        .collect();
    let sigmas: Vec<f64> = timesteps.iter().map(|&t| interp(&train, t)).collect();
    let Some(read_back) = karras_timesteps else {
        return (timesteps, sigmas);
    };
    let (min, max) = (sigmas[sigmas.len() - 1], sigmas[0]);
    let sigmas = karras(min, max, steps);
    let logs = log_sigmas(&train);
    let timesteps = sigmas
        .iter()
        .map(|&s| {
            let t = sigma_to_t(s, &logs);
            let t = match read_back {
                KarrasTimesteps::Fractional => t,
                KarrasTimesteps::Rounded => round_half_even(t),
            };
            f64::from(t as f32)
        })
        .collect();
    (timesteps, sigmas)
}

/// `f64` values as diffusers stores them: rounded to f32.
pub(super) fn as_f32(v: impl IntoIterator<Item = f64>) -> Vec<f64> {
    v.into_iter().map(|x| f64::from(x as f32)).collect()
}

/// The initial noise's σ of the k-diffusion samplers: the largest σ (`linspace`, `trailing`), or
/// `√(σ_max² + 1)` (`leading`), in f32.
pub(super) fn init_noise_sigma(config: &SchedulerConfig, sigmas: &[f64]) -> f64 {
    let max = sigmas.iter().copied().fold(0.0, f64::max);
    match config.spacing.unwrap_or(Spacing::Linspace) {
        Spacing::Linspace | Spacing::Trailing => max,
        Spacing::Leading => f64::from((max * max + 1.0).sqrt() as f32),
    }
}

/// The model's input at σ for the σ-parameterised samplers: `x/√(σ²+1)`.
pub(super) fn k_scale(
    sample: &candle_core::Tensor,
    sigma: f64,
) -> candle_core::Result<candle_core::Tensor> {
    sample * (1.0 / (sigma * sigma + 1.0).sqrt())
}

/// `x̂₀` of the σ-parameterised samplers: `x − σ·ε̂`, or `v̂·(−σ/√(σ²+1)) + x/(σ²+1)` under
/// v-prediction.
pub(super) fn k_denoised(
    prediction: crate::model::family::PredictionType,
    sample: &candle_core::Tensor,
    model_output: &candle_core::Tensor,
    sigma: f64,
) -> candle_core::Result<candle_core::Tensor> {
    use crate::model::family::PredictionType;
    match prediction {
        PredictionType::Epsilon => sample - (model_output * sigma)?,
        PredictionType::VPrediction => {
            let s2 = sigma * sigma + 1.0;
            (model_output * (-sigma / s2.sqrt()))? + (sample * (1.0 / s2))?
        }
    }
}
