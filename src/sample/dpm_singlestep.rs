//! DPM-Solver++ single-step (Lu et al., arXiv 2211.01095), as diffusers'
//! `DPMSolverSinglestepScheduler` with `algorithm_type` `dpmsolver++` (EveryDream2's `dpm++_2s`,
//! and `dpm++_2s_k` with Karras sigmas):
//! - timesteps `round(linspace(0, T−1, n+1))` descending without the last, whatever the config's
//!   spacing (or Karras sigmas with their timesteps read back and rounded), and `σ` as
//!   DPM-Solver++ multistep's (`dpm_solver.rs`), then a final 0 or `σ_min`;
//! - the steps run in groups of orders `1, 2(, 3)` (`solver_order`, 2 when the config says
//!   nothing): each group starts from the latents `x_s` at its first step, and its k-th step
//!   jumps from there to the σ after it, using the `x̂₀` of the group's steps so far:
//!   first order `x' = (s_t/s_s)·x_s − α_t(e^{−h} − 1)·D0`, second order adds `D1` by the
//!   midpoint or Heun rule (`solver_type`), third order `D1`, `D2`, as in diffusers;
//! - `lower_order_final` (forced on when `n` is not a multiple of the order or the final σ is
//!   zero) ends with lower-order groups; a final σ of zero makes the last step first order.
//!
//! `α`, `s`, `λ` as multistep's, in f32. The model input is the latents unscaled and the initial
//! noise has σ 1. The steps' `x̂₀` and latents are kept by step index, so one sampler draws one
//! image at a time from step 0.

use std::cell::RefCell;

use candle_core::{Result, Tensor};

use super::dpm_solver::{alpha_sigma_lambda, dpm_schedule, dpm_x0};
use super::sampler::{NoiseFn, Sampler};
use super::scheduler_config::{SchedulerConfig, Spacing};
use crate::model::family::PredictionType;

pub struct DpmSinglestep {
    timesteps: Vec<f64>,
    /// One per step, then the final one.
    sigmas: Vec<f64>,
    orders: Vec<usize>,
    heun: bool,
    prediction: PredictionType,
    /// `x̂₀` and the latents of each step taken, by step index.
    taken: RefCell<Vec<Option<(Tensor, Tensor)>>>,
}

impl DpmSinglestep {
    /// `steps` must be in `1..=num_train_timesteps` ([`super::SamplerKind::build`] checks).
    pub fn new(
        config: &SchedulerConfig,
        steps: usize,
        karras: bool,
    ) -> std::result::Result<Self, String> {
        config.refuse_zero_snr("DPMSolverSinglestepScheduler")?;
        match config.algorithm_type.as_deref() {
            // diffusers maps `deis` to `dpmsolver++` in this class.
            None | Some("dpmsolver++") | Some("deis") => {}
            Some(other) => {
                return Err(config.refuse(
                    "algorithm_type",
                    &format!(
                        "is \"{other}\"; EveryDream2's dpm++_2s draws with \"dpmsolver++\" (the \
                         config's own algorithm is not supported for it)"
                    ),
                ))
            }
        }
        let dpm = &config.dpm;
        let final_zero = !dpm.final_sigma_min.unwrap_or(false);
        let (timesteps, sigmas) =
            dpm_schedule(config, steps, Spacing::Linspace, karras, final_zero);
        let order = dpm.solver_order.unwrap_or(2);
        // diffusers turns `lower_order_final` on for these at `set_timesteps`.
        let lower_order_final =
            dpm.lower_order_final.unwrap_or(false) || !steps.is_multiple_of(order) || final_zero;
        Ok(Self {
            taken: RefCell::new(vec![None; timesteps.len()]),
            orders: order_list(steps, order, lower_order_final, final_zero),
            timesteps,
            sigmas,
            heun: dpm.heun.unwrap_or(false),
            prediction: config.schedule.prediction_type(),
        })
    }
}

/// diffusers' `get_order_list`: the order of each of `steps` steps.
fn order_list(steps: usize, order: usize, lower_order_final: bool, final_zero: bool) -> Vec<usize> {
    let cycle = |k: usize, groups: usize| -> Vec<usize> {
        (0..groups).flat_map(|_| 1..=k).collect::<Vec<_>>()
    };
    let mut orders = match (order, lower_order_final) {
        (3, true) => match steps % 3 {
            0 => [cycle(3, steps / 3 - 1), vec![1, 2, 1]].concat(),
            1 => [cycle(3, steps / 3), vec![1]].concat(),
            _ => [cycle(3, steps / 3), vec![1, 2]].concat(),
        },
        (2, true) => match steps % 2 {
            0 => [cycle(2, steps / 2 - 1), vec![1, 1]].concat(),
            _ => [cycle(2, steps / 2), vec![1]].concat(),
        },
        (3, false) => cycle(3, steps / 3),
        (2, false) => cycle(2, steps / 2),
        _ => vec![1; steps],
    };
    if final_zero {
        if let Some(last) = orders.last_mut() {
            *last = 1;
        }
    }
    orders
}

impl Sampler for DpmSinglestep {
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
        _noise: &mut NoiseFn<'_>,
    ) -> Result<Tensor> {
        let x0 = dpm_x0(self.prediction, sample, model_output, self.sigmas[i])?;
        self.taken.borrow_mut()[i] = Some((x0, sample.clone()));
        let taken = self.taken.borrow();
        let at = |k: usize| -> Result<&(Tensor, Tensor)> {
            taken[k].as_ref().ok_or_else(|| {
                candle_core::Error::Msg(format!("DPM-Solver single-step: step {k} was not taken"))
            })
        };
        let order = self.orders[i].min(i + 1);
        let first = i + 1 - order;
        let base = &at(first)?.1;
        let (alpha_t, s_t, lambda_t) = alpha_sigma_lambda(self.sigmas[i + 1]);
        let (_, s_first, lambda_first) = alpha_sigma_lambda(self.sigmas[first]);
        let h = lambda_t - lambda_first;
        let e = (-h).exp() - 1.0;
        // (coefficient, tensor) pairs of diffusers' updates, coefficients in f32.
        let mut terms: Vec<(f32, Tensor)> = vec![(s_t / s_first, base.clone())];
        let m = |k: usize| -> Result<&Tensor> { Ok(&at(i - k)?.0) };
        match order {
            1 => terms.push((-(alpha_t * e), m(0)?.clone())),
            2 => {
                let lambda_0 = alpha_sigma_lambda(self.sigmas[i]).2;
                let r0 = (lambda_0 - lambda_first) / h;
                let d1 = ((m(0)? - m(1)?)? * f64::from(1.0 / r0))?;
                terms.push((-(alpha_t * e), m(1)?.clone()));
                terms.push(match self.heun {
                    false => (-(0.5 * (alpha_t * e)), d1),
                    true => (alpha_t * (e / h + 1.0), d1),
                });
            }
            _ => {
                let lambda_0 = alpha_sigma_lambda(self.sigmas[i]).2;
                let lambda_1 = alpha_sigma_lambda(self.sigmas[i - 1]).2;
                let (r0, r1) = ((lambda_0 - lambda_first) / h, (lambda_1 - lambda_first) / h);
                let d1_0 = ((m(1)? - m(2)?)? * f64::from(1.0 / r1))?;
                let d1_1 = ((m(0)? - m(2)?)? * f64::from(1.0 / r0))?;
                terms.push((-(alpha_t * e), m(2)?.clone()));
                if self.heun {
                    let d1 = (((&d1_0 * f64::from(r0))? - (&d1_1 * f64::from(r1))?)?
                        * f64::from(1.0 / (r0 - r1)))?;
                    let d2 = ((d1_1 - d1_0)? * f64::from(2.0 / (r0 - r1)))?;
                    terms.push((alpha_t * (e / h + 1.0), d1));
                    terms.push((-(alpha_t * ((e + h) / (h * h) - 0.5)), d2));
                } else {
                    terms.push((alpha_t * (e / h + 1.0), d1_1));
                }
            }
        }
        let mut x = (&terms[0].1 * f64::from(terms[0].0))?;
        for (c, t) in &terms[1..] {
            x = (x + (t * f64::from(*c))?)?;
        }
        Ok(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// diffusers' `get_order_list` for a few step counts. Catches a group cut short or a final
    /// step left at second order before a final σ of zero.
    #[test]
    fn orders_follow_diffusers() {
        assert_eq!(order_list(5, 2, true, true), [1, 2, 1, 2, 1]);
        assert_eq!(order_list(6, 2, true, true), [1, 2, 1, 2, 1, 1]);
        assert_eq!(order_list(6, 2, false, false), [1, 2, 1, 2, 1, 2]);
        assert_eq!(order_list(6, 3, true, false), [1, 2, 3, 1, 2, 1]);
        assert_eq!(order_list(7, 3, true, true), [1, 2, 3, 1, 2, 3, 1]);
        assert_eq!(order_list(8, 3, true, true), [1, 2, 3, 1, 2, 3, 1, 1]);
        assert_eq!(order_list(3, 1, true, true), [1, 1, 1]);
    }
}
