//! Pseudo numerical methods (PNDM, Liu et al., arXiv 2202.09778), as diffusers' `PNDMScheduler`
//! (EveryDream2's `pndm`; Stable Diffusion 1.x ships its config):
//! - the transfer `φ(x, ε, t → t')` of eq. 9:
//!   `x' = √(ᾱ_{t'}/ᾱ_t)·x − (ᾱ_{t'} − ᾱ_t)·ε / (ᾱ_t·√(1−ᾱ_{t'}) + √(ᾱ_t(1−ᾱ_t)ᾱ_{t'}))`, with
//!   `ᾱ` below 0 `ᾱ_0` (or 1, `set_alpha_to_one`) and `ε = √ᾱ_t·v̂ + √(1−ᾱ_t)·x` under
//!   v-prediction;
//! - `skip_prk_steps` (PLMS, as Stable Diffusion's config): `n + 1` model evaluations, the second
//!   at the first step's end to average with the first (a Heun step), then linear multistep
//!   with the last 2, 3 and 4 outputs: `(3e₀ − e₁)/2`, `(23e₀ − 16e₁ + 5e₂)/12`,
//!   `(55e₀ − 59e₁ + 37e₂ − 9e₃)/24`;
//! - otherwise (F-PNDM) three Runge–Kutta steps (4 evaluations each, at half steps of
//!   `T // n // 2`) over the last 3 of the `n` intervals, then 4-output multistep over the rest.
//!
//! Every step moves by `T // n` timesteps whatever the spacing, as diffusers does. The outputs
//! and latents are kept by step index, so one sampler draws one image at a time from step 0.

use std::cell::RefCell;

use candle_core::{Result, Tensor};

use super::ddpm::check_timesteps;
use super::sampler::{NoiseFn, Sampler};
use super::scheduler_config::{SchedulerConfig, Spacing};
use crate::model::family::PredictionType;

/// Runge–Kutta steps (F-PNDM's warm-up): 3 intervals × 4 evaluations.
const PRK_STEPS: usize = 12;

pub struct Pndm {
    timesteps: Vec<f64>,
    alphas_cumprod: Vec<f64>,
    final_alpha_cumprod: f64,
    /// `T // n`.
    ratio: usize,
    prk: bool,
    prediction: PredictionType,
    /// The model output and the latents of each step taken, by step index.
    taken: RefCell<Vec<Option<(Tensor, Tensor)>>>,
}

impl Pndm {
    /// `steps` must be in `1..=num_train_timesteps` ([`super::SamplerKind::build`] checks).
    pub fn new(config: &SchedulerConfig, steps: usize) -> std::result::Result<Self, String> {
        config.refuse_zero_snr("PNDMScheduler")?;
        let alphas_cumprod = config.schedule.alphas_cumprod().to_vec();
        let train = alphas_cumprod.len();
        let spacing = config.spacing.unwrap_or(Spacing::Leading);
        let mut ascending = spacing.timesteps(train, steps, config.steps_offset, true);
        ascending.reverse();
        check_timesteps(config, &ascending, train)?;
        let prk = !config.skip_prk_steps.unwrap_or(false);
        let timesteps: Vec<f64> = if prk {
            if steps < 4 {
                return Err(config.refuse(
                    "skip_prk_steps",
                    &format!(
                        "is false (Runge–Kutta warm-up steps), which needs at least 4 sampling \
                         steps; {steps} asked"
                    ),
                ));
            }
            let half = (train / steps / 2) as f64;
            // diffusers: the last 4 timesteps each with its half step, less the last, each
            // twice, less the ends, reversed; then the rest less the last 3, reversed.
            let mut pairs: Vec<f64> = ascending[steps - 4..]
                .iter()
                .flat_map(|&t| [t, t + half])
                .collect();
            pairs.pop();
            let doubled: Vec<f64> = pairs.iter().flat_map(|&t| [t, t]).collect();
            let mut prk: Vec<f64> = doubled[1..doubled.len() - 1].to_vec();
            prk.reverse();
            prk.extend(ascending[..steps - 3].iter().rev());
            prk
        } else {
            // The first step's timestep twice: its end is evaluated before the second step.
            let mut plms: Vec<f64> = ascending[..steps - 1].to_vec();
            plms.extend_from_slice(&ascending[steps.saturating_sub(2)..steps - 1]);
            plms.push(ascending[steps - 1]);
            plms.reverse();
            plms
        };
        let final_alpha_cumprod = match config.set_alpha_to_one.unwrap_or(false) {
            true => 1.0,
            false => alphas_cumprod[0],
        };
        Ok(Self {
            taken: RefCell::new(vec![None; timesteps.len()]),
            timesteps,
            alphas_cumprod,
            final_alpha_cumprod,
            ratio: train / steps,
            prk,
            prediction: config.schedule.prediction_type(),
        })
    }

    /// Eq. 9's transfer of `sample` from `t` to `prev` along `eps` (the module header).
    fn transfer(&self, sample: &Tensor, t: i64, prev: i64, eps: &Tensor) -> Result<Tensor> {
        let alpha_at = |t: i64| -> Result<f64> {
            match t {
                t if t < 0 => Ok(self.final_alpha_cumprod),
                t => self.alphas_cumprod.get(t as usize).copied().ok_or_else(|| {
                    candle_core::Error::Msg(format!("PNDM: timestep {t} is past the schedule"))
                }),
            }
        };
        let (a, a_prev) = (alpha_at(t)?, alpha_at(prev)?);
        let eps = match self.prediction {
            PredictionType::Epsilon => eps.clone(),
            PredictionType::VPrediction => ((eps * a.sqrt())? + (sample * (1.0 - a).sqrt())?)?,
        };
        let sample_coef = (a_prev / a).sqrt();
        let denom = a * (1.0 - a_prev).sqrt() + (a * (1.0 - a) * a_prev).sqrt();
        (sample * sample_coef)? - (eps * ((a_prev - a) / denom))?
    }

    /// The outputs PLMS combines at step `i`: the last 4 of those it keeps (F-PNDM keeps the
    /// first of each Runge–Kutta step's 4, PLMS all but the Heun step's second).
    fn kept(&self, i: usize) -> Vec<usize> {
        let keeps = |k: usize| match self.prk {
            true => k >= PRK_STEPS || k.is_multiple_of(4),
            false => k != 1,
        };
        let all: Vec<usize> = (0..=i).filter(|&k| keeps(k)).collect();
        all[all.len().saturating_sub(4)..].to_vec()
    }
}

/// `Σ cᵢ·tᵢ`.
fn combine(terms: &[(f64, &Tensor)]) -> Result<Tensor> {
    let mut acc = (terms[0].1 * terms[0].0)?;
    for (c, t) in &terms[1..] {
        acc = (acc + (*t * *c)?)?;
    }
    Ok(acc)
}

impl Sampler for Pndm {
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
        self.taken.borrow_mut()[i] = Some((model_output.clone(), sample.clone()));
        let taken = self.taken.borrow();
        let at = |k: usize| -> Result<&(Tensor, Tensor)> {
            taken[k]
                .as_ref()
                .ok_or_else(|| candle_core::Error::Msg(format!("PNDM: step {k} was not taken")))
        };
        let out = |k: usize| -> Result<&Tensor> { Ok(&at(k)?.0) };
        let t = self.timesteps[i] as i64;
        let ratio = self.ratio as i64;
        if self.prk && i < PRK_STEPS {
            // Runge–Kutta: every evaluation starts from the step's first latents.
            let first = i / 4 * 4;
            let half = ratio / 2;
            let prev = if i % 2 == 1 { t } else { t - half };
            let eps = match i % 4 {
                3 => combine(&[
                    (1.0 / 6.0, out(first)?),
                    (1.0 / 3.0, out(first + 1)?),
                    (1.0 / 3.0, out(first + 2)?),
                    (1.0 / 6.0, model_output),
                ])?,
                _ => model_output.clone(),
            };
            let start = self.timesteps[first] as i64;
            return self.transfer(&at(first)?.1, start, prev, &eps);
        }
        if !self.prk && i == 1 {
            // The first step again, with the mean of its two ends' outputs.
            let eps = combine(&[(0.5, model_output), (0.5, out(0)?)])?;
            return self.transfer(&at(0)?.1, t + ratio, t, &eps);
        }
        let kept = self.kept(i);
        let e = |k: usize| out(kept[kept.len() - 1 - k]);
        let eps = match kept.len() {
            1 => model_output.clone(),
            2 => combine(&[(1.5, e(0)?), (-0.5, e(1)?)])?,
            3 => combine(&[
                (23.0 / 12.0, e(0)?),
                (-16.0 / 12.0, e(1)?),
                (5.0 / 12.0, e(2)?),
            ])?,
            _ => combine(&[
                (55.0 / 24.0, e(0)?),
                (-59.0 / 24.0, e(1)?),
                (37.0 / 24.0, e(2)?),
                (-9.0 / 24.0, e(3)?),
            ])?,
        };
        self.transfer(sample, t, t - ratio, &eps)
    }
}
