//! DPM-Solver++ multistep (Lu et al., arXiv 2211.01095), as diffusers'
//! `DPMSolverMultistepScheduler` with `algorithm_type` `dpmsolver++` (EveryDream2's `dpm++` and
//! `dpm++_2m`, A1111's "DPM++ 2M") or `sde-dpmsolver++` (`dpm++_2m_sde`), each with Karras
//! sigmas (`_k`: `use_karras_sigmas`):
//! - timesteps: `linspace` (the class's default) takes `round(linspace(0, T−1, n+1))` descending
//!   without its last, `leading` `k·(T // (n+1)) + steps_offset`, `trailing` as the others; `T`
//!   stops short of where `λ` falls below `lambda_min_clipped`;
//! - `σ` interpolated at those timesteps, or Karras' `(σ_max^{1/ρ} + r·(σ_min^{1/ρ} − σ_max^{1/ρ}))^ρ`
//!   (ρ = 7, r = linspace(0, 1, n)) with each timestep read back from `log σ`, rounded; then a final
//!   0 (`final_sigmas_type` `zero`) or the smallest training `σ` (`sigma_min`);
//! - `α = 1/√(σ²+1)`, `s = σ·α`, `λ = ln α − ln s`; the model's output becomes `x̂₀`
//!   (`(x − s·ε̂)/α`, or `α·x − s·v̂`);
//! - with `h = λ_t − λ_{s0}`: first order `x' = (s_t/s_0)·x − α_t(e^{−h} − 1)·D0`; second order adds
//!   `D1 = (m0 − m1)/r0` (`r0 = h_0/h`) by the midpoint or Heun rule; third order `D2` too. The SDE
//!   form multiplies `x` by `e^{−h}` more, uses `α_t(1 − e^{−2h})` and adds `s_t√(1 − e^{−2h})·z`;
//! - the first steps run at lower order until enough outputs exist; the last step is first order
//!   with a final σ of zero (or `euler_at_final`, or `lower_order_final` under 15 steps), and the
//!   second-to-last at most second order under 15 steps.
//!
//! The model input is the latents unscaled and the initial noise has σ 1. The previous steps'
//! `x̂₀` are kept by step index, so one sampler draws one image at a time from step 0.

use std::cell::RefCell;

use candle_core::{Result, Tensor};

use super::sampler::{NoiseFn, Sampler};
use super::scheduler_config::{round_half_even, SchedulerConfig, Spacing};
use super::sigmas::{as_f32, interp, karras, log_sigmas, sigma_to_t, train_sigmas};
use crate::model::family::PredictionType;

/// Which DPM-Solver++ (EveryDream2's name without `_k`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DpmVariant {
    /// `sde-dpmsolver++`: noise added at every step.
    pub sde: bool,
    /// Karras sigmas.
    pub karras: bool,
}

pub struct DpmSolver {
    variant: DpmVariant,
    timesteps: Vec<f64>,
    /// One per step, then the final one.
    sigmas: Vec<f64>,
    order: usize,
    heun: bool,
    lower_order_final: bool,
    euler_at_final: bool,
    final_zero: bool,
    prediction: PredictionType,
    /// `x̂₀` of each step taken, by step index.
    outputs: RefCell<Vec<Option<Tensor>>>,
}

impl DpmSolver {
    /// `steps` must be in `1..=num_train_timesteps` ([`super::SamplerKind::build`] checks).
    pub fn new(config: &SchedulerConfig, steps: usize, variant: DpmVariant) -> Self {
        let dpm = &config.dpm;
        let spacing = config.spacing.unwrap_or(Spacing::Linspace);
        let final_zero = !dpm.final_sigma_min.unwrap_or(false);
        let (timesteps, sigmas) = dpm_schedule(config, steps, spacing, variant.karras, final_zero);
        Self {
            variant,
            outputs: RefCell::new(vec![None; timesteps.len()]),
            timesteps,
            sigmas,
            order: dpm.solver_order.unwrap_or(2),
            heun: dpm.heun.unwrap_or(false),
            lower_order_final: dpm.lower_order_final.unwrap_or(true),
            euler_at_final: dpm.euler_at_final.unwrap_or(false),
            final_zero,
            prediction: config.schedule.prediction_type(),
        }
    }

    /// The order step `i` runs at (diffusers' `lower_order_nums` and final-step rules).
    fn order_at(&self, i: usize) -> usize {
        let n = self.timesteps.len();
        let taken = i.min(self.order);
        let lower_final = i + 1 == n
            && (self.euler_at_final || (self.lower_order_final && n < 15) || self.final_zero);
        let lower_second = i + 2 == n && self.lower_order_final && n < 15;
        if self.order == 1 || taken < 1 || lower_final {
            1
        } else if self.order == 2 || taken < 2 || lower_second {
            2
        } else {
            3
        }
    }
}

/// `(α, s, λ)` at `σ`, in f32 as diffusers computes them: `α = 1/√(σ²+1)`, `s = σ·α`,
/// `λ = ln α − ln s`.
pub(super) fn alpha_sigma_lambda(sigma: f64) -> (f32, f32, f32) {
    let sigma = sigma as f32;
    let alpha = 1.0 / (sigma * sigma + 1.0).sqrt();
    let s = sigma * alpha;
    (alpha, s, alpha.ln() - s.ln())
}

/// DPM-Solver++'s data prediction at `σ`: `(x − s·ε̂)/α`, or `α·x − s·v̂`.
pub(super) fn dpm_x0(
    prediction: PredictionType,
    sample: &Tensor,
    model_output: &Tensor,
    sigma: f64,
) -> Result<Tensor> {
    let (alpha, s, _) = alpha_sigma_lambda(sigma);
    match prediction {
        PredictionType::Epsilon => {
            (sample - (model_output * f64::from(s))?)? * f64::from(1.0 / alpha)
        }
        PredictionType::VPrediction => {
            (sample * f64::from(alpha))? - (model_output * f64::from(s))?
        }
    }
}

/// DPM-Solver's timesteps and σ (one per step, then the final one), both rounded as diffusers
/// stores them (module header); the single-step solver shares them.
pub(super) fn dpm_schedule(
    config: &SchedulerConfig,
    steps: usize,
    spacing: Spacing,
    karras_sigmas: bool,
    final_zero: bool,
) -> (Vec<f64>, Vec<f64>) {
    let (alphas_cumprod, train_sigmas) = train_sigmas(config);
    let last = last_timestep(&alphas_cumprod, config.dpm.lambda_min_clipped);
    let mut timesteps = dpm_timesteps(spacing, train_sigmas.len(), last, steps, config);
    let mut sigmas: Vec<f64> = if karras_sigmas {
        let log_sigmas = log_sigmas(&train_sigmas);
        let sigma_min = train_sigmas[0];
        let sigma_max = *train_sigmas.last().unwrap_or(&1.0);
        let sigmas = karras(sigma_min, sigma_max, steps);
        timesteps = sigmas
            .iter()
            .map(|&s| round_half_even(sigma_to_t(s, &log_sigmas)))
            .collect();
        sigmas
    } else {
        timesteps
            .iter()
            .map(|&t| interp(&train_sigmas, t))
            .collect()
    };
    sigmas.push(if final_zero { 0.0 } else { train_sigmas[0] });
    (timesteps, as_f32(sigmas))
}

/// The timestep where `λ` first falls below `clip` (counted from the end), else `T`.
fn last_timestep(alphas_cumprod: &[f64], clip: Option<f64>) -> usize {
    let n = alphas_cumprod.len();
    let Some(clip) = clip.filter(|c| c.is_finite()) else {
        return n;
    };
    // torch.searchsorted over λ ascending (λ falls with t): the count of λ below `clip`.
    let below = alphas_cumprod
        .iter()
        .map(|&a| {
            let a = a as f32;
            f64::from(a.sqrt().ln() - (1.0 - a).sqrt().ln())
        })
        .filter(|&l| l < clip)
        .count();
    n - below
}

/// The inference timesteps of DPM-Solver's `set_timesteps` (module header).
fn dpm_timesteps(
    spacing: Spacing,
    train: usize,
    last: usize,
    n: usize,
    config: &SchedulerConfig,
) -> Vec<f64> {
    match spacing {
        Spacing::Linspace => {
            // numpy's linspace: `k · (stop − start)/(n)`.
            let step = (last as f64 - 1.0) / n as f64;
            let mut t: Vec<f64> = (0..=n).map(|k| round_half_even(k as f64 * step)).collect();
            t.reverse();
            t.pop();
            t
        }
        Spacing::Leading => {
            let ratio = last / (n + 1);
            let mut t: Vec<f64> = (0..=n)
                .map(|k| (k * ratio + config.steps_offset) as f64)
                .collect();
            t.reverse();
            t.pop();
            t
        }
        Spacing::Trailing => {
            let ratio = train as f64 / n as f64;
            (0..)
                .map(|i| last as f64 - i as f64 * ratio)
                .take_while(|&x| x > 0.0)
                .map(|x| round_half_even(x) - 1.0)
                .collect()
        }
    }
}

impl Sampler for DpmSolver {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn init_noise_sigma(&self) -> f64 {
        1.0
    }

    fn sigmas(&self) -> Option<&[f64]> {
        Some(&self.sigmas)
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
        let (_, s_0, lambda_0) = alpha_sigma_lambda(self.sigmas[i]);
        let x0 = dpm_x0(self.prediction, sample, model_output, self.sigmas[i])?;
        self.outputs.borrow_mut()[i] = Some(x0.clone());
        let z = match self.variant.sde {
            true => Some(noise(model_output.dims())?.to_dtype(sample.dtype())?),
            false => None,
        };
        let (alpha_t, s_t, lambda_t) = alpha_sigma_lambda(self.sigmas[i + 1]);
        let h = lambda_t - lambda_0;
        if h == 0.0 {
            // σ does not move (Karras sigmas ending at σ_min with a final σ_min): diffusers
            // divides by h = 0 here and returns NaN; the latents stay as they are.
            return Ok(sample.clone());
        }
        let outputs = self.outputs.borrow();
        let previous = |k: usize| -> Result<Tensor> {
            outputs[i - k].clone().ok_or_else(|| {
                candle_core::Error::Msg(format!("DPM-Solver: step {} was not taken", i - k))
            })
        };
        let lambda_at = |k: usize| alpha_sigma_lambda(self.sigmas[i - k]).2;
        let e = (-h).exp();
        let one_minus = 1.0 - (-2.0 * h).exp();
        // (coefficient, D) pairs of diffusers' multistep updates, coefficients in f32.
        let mut terms: Vec<(f32, Tensor)> = Vec::with_capacity(3);
        terms.push((
            match self.variant.sde {
                false => -(alpha_t * (e - 1.0)),
                true => alpha_t * one_minus,
            },
            x0.clone(),
        ));
        match self.order_at(i) {
            1 => {}
            2 => {
                let r0 = (lambda_0 - lambda_at(1)) / h;
                let d1 = ((&x0 - previous(1)?)? * f64::from(1.0 / r0))?;
                let coef = match (self.variant.sde, self.heun) {
                    (false, false) => -(0.5 * (alpha_t * (e - 1.0))),
                    (false, true) => alpha_t * ((e - 1.0) / h + 1.0),
                    (true, false) => 0.5 * (alpha_t * one_minus),
                    (true, true) => alpha_t * (one_minus / (-2.0 * h) + 1.0),
                };
                terms.push((coef, d1));
            }
            _ => {
                let (m1, m2) = (previous(1)?, previous(2)?);
                let (l1, l2) = (lambda_at(1), lambda_at(2));
                let (r0, r1) = ((lambda_0 - l1) / h, (l1 - l2) / h);
                let d1_0 = ((&x0 - &m1)? * f64::from(1.0 / r0))?;
                let d1_1 = ((m1 - m2)? * f64::from(1.0 / r1))?;
                let diff = (&d1_0 - d1_1)?;
                let d1 = (d1_0 + (&diff * f64::from(r0 / (r0 + r1)))?)?;
                let d2 = (diff * f64::from(1.0 / (r0 + r1)))?;
                let (c1, c2) = match self.variant.sde {
                    false => (
                        alpha_t * ((e - 1.0) / h + 1.0),
                        -(alpha_t * ((e - 1.0 + h) / (h * h) - 0.5)),
                    ),
                    true => (
                        alpha_t * (one_minus / (-2.0 * h) + 1.0),
                        alpha_t * ((one_minus - 2.0 * h) / (2.0 * h).powi(2) - 0.5),
                    ),
                };
                terms.push((c1, d1));
                terms.push((c2, d2));
            }
        }
        let sample_coef = match self.variant.sde {
            false => s_t / s_0,
            true => s_t / s_0 * e,
        };
        let mut x = (sample * f64::from(sample_coef))?;
        for (c, t) in terms {
            x = (x + (t * f64::from(c))?)?;
        }
        if let Some(z) = z {
            x = (x + (z * f64::from(s_t * one_minus.sqrt()))?)?;
        }
        Ok(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::scheduler_config::test_config;
    use crate::sample::SamplerKind;
    use candle_core::Device;

    /// Karras sigmas end at σ_min; with a final σ of σ_min the last step does not move σ, and
    /// diffusers divides by h = 0 there (its latents come out NaN). Here they stay finite and
    /// unchanged. Catches the guard removed.
    #[test]
    fn a_step_that_does_not_move_sigma_keeps_the_latents() {
        let cfg =
            test_config(serde_json::json!({"solver_order": 3, "final_sigmas_type": "sigma_min"}));
        let variant = DpmVariant {
            sde: false,
            karras: true,
        };
        let s = DpmSolver::new(&cfg, 16, variant);
        let n = s.timesteps().len();
        let sigmas = s.sigmas().unwrap();
        assert_eq!(sigmas[n - 1], sigmas[n]);
        let mut x = Tensor::randn(0f32, 1f32, (1, 4, 2, 2), &Device::Cpu).unwrap();
        let mut no_noise = |_: &[usize]| -> Result<Tensor> { unreachable!() };
        for i in 0..n {
            let out = Tensor::randn(0f32, 1f32, (1, 4, 2, 2), &Device::Cpu).unwrap();
            let before = x.clone();
            x = s.step(i, &out, &x, &mut no_noise).unwrap();
            if i + 1 == n {
                let d = (&x - &before).unwrap().abs().unwrap().max_all().unwrap();
                assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
            }
        }
        let v: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        assert!(v.iter().all(|x| x.is_finite()));
    }

    /// EveryDream2's names: `dpm++` is `dpm++_2m`; the `_k` forms take Karras sigmas; `_2s` is
    /// single-step and `_sde` the SDE solver. Catches `dpm++` mapped to the SDE form.
    #[test]
    fn everydream2_names_choose_the_variant() {
        let v = |sde, karras| Some(SamplerKind::DpmSolver(DpmVariant { sde, karras }));
        assert_eq!(SamplerKind::parse("dpm++"), v(false, false));
        assert_eq!(SamplerKind::parse("dpm++_2m"), v(false, false));
        assert_eq!(SamplerKind::parse("DPM++_2M_K"), v(false, true));
        assert_eq!(SamplerKind::parse("dpm++_2m_sde"), v(true, false));
        assert_eq!(SamplerKind::parse("dpm++_2m_sde_k"), v(true, true));
        for name in ["dpm++_2m", "dpm++_2m_k", "dpm++_2m_sde", "dpm++_2m_sde_k"] {
            assert_eq!(SamplerKind::parse(name).unwrap().name(), name);
        }
        for (name, kind) in [
            ("dpm++_2s", SamplerKind::DpmSinglestep { karras: false }),
            ("dpm++_2s_k", SamplerKind::DpmSinglestep { karras: true }),
            ("dpm++_sde", SamplerKind::DpmSde { karras: false }),
            ("dpm++_sde_k", SamplerKind::DpmSde { karras: true }),
        ] {
            assert_eq!(SamplerKind::parse(name), Some(kind));
            assert_eq!(kind.name(), name);
        }
        assert!(SamplerKind::unknown("warp").contains("the samplers are"));
    }
}
