//! D-Adaptation Lion, as the `dadaptation` package (3.2, EveryDream2's `dadapt_lion`) does it
//! with one parameter group. It updates each parameter in the first pass, with the `d` the step
//! began with; the new `d` serves the next step.
//!
//! Per step, with `lr` the schedule's multiplier (1 by default) and `dlr = d · lr`:
//!
//! ```text
//! every parameter:
//!   p ← p · (1 − dlr·λ)
//!   u = sign(β1·m + (1 − β1)·g);  p ← p − dlr·u
//!   m ← β2·m + (1 − β2)·dlr·g
//!   num_k += dlr · ⟨u, s⟩;  s ← √β2·s + (1 − √β2)·dlr·u;  ‖s‖₁ += Σ|s|
//! num ← √β2·num + (1 − √β2)·num_k;  d ← max(d, num / ((1 − √β2)·‖s‖₁))
//! ```
//!
//! A step whose `‖s‖₁` is 0 leaves the estimate and the step count as they were (the package
//! returns early, after the updates). Unlike D-Adaptation Adam it has no growth-rate bound.

use candle_core::{Tensor, Var};
use serde::Serialize;

use super::dense;
use super::hyper::check_common;
use super::rule::{ParamState, Shares, StepEstimate, StepScalars, UpdateRule};
use super::Result;

/// D-Adaptation Lion's hyper-parameters (the lr is the group's, a multiplier of `d`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DAdaptLionParams {
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub d0: f64,
}

impl Default for DAdaptLionParams {
    /// `dadaptation.DAdaptLion`'s defaults.
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.99,
            weight_decay: 0.0,
            d0: 1e-6,
        }
    }
}

/// The D-Adaptation Lion rule.
#[derive(Debug, Clone, Copy)]
pub struct DAdaptLion {
    hyper: DAdaptLionParams,
}

impl DAdaptLion {
    pub fn rule(hyper: DAdaptLionParams) -> Result<Self> {
        check_common(
            &[("beta1", hyper.beta1), ("beta2", hyper.beta2)],
            hyper.d0,
            1.0,
            hyper.weight_decay,
        )?;
        Ok(Self { hyper })
    }
}

impl UpdateRule for DAdaptLion {
    fn name(&self) -> &'static str {
        "dadapt_lion"
    }

    fn init(&self, var: &Var) -> candle_core::Result<Box<dyn ParamState>> {
        #[cfg(feature = "cuda")]
        if let Some(state) =
            super::adaptive_cuda::on_cuda(var, super::adaptive_args::DAdaptLionKernel(self.hyper))?
        {
            return Ok(state);
        }
        Ok(Box::new(State {
            hyper: self.hyper,
            m: dense::zeros(var)?,
            s: dense::zeros(var)?,
        }))
    }

    fn estimate(&self) -> Option<Box<dyn StepEstimate>> {
        Some(Box::new(Estimate {
            hyper: self.hyper,
            d: self.hyper.d0,
            numerator: 0.0,
            k: 0,
            lr: 0.0,
        }))
    }

    fn hyper_json(&self) -> serde_json::Value {
        serde_json::to_value(self.hyper).unwrap_or_default()
    }

    fn state_bytes(&self, shape: &[usize]) -> usize {
        dense::f32_bytes(shape, 2)
    }
}

struct Estimate {
    hyper: DAdaptLionParams,
    d: f64,
    numerator: f64,
    k: u64,
    lr: f64,
}

impl StepEstimate for Estimate {
    fn begin(&mut self, lr: f64, _grad_sq: Option<f64>) -> StepScalars {
        self.lr = lr;
        StepScalars {
            d: self.d,
            dlr: self.d * lr,
            k: self.k,
        }
    }

    /// Shares: `[num_k, ‖s‖₁, 0]`.
    fn finish(&mut self, shares: &Shares) -> Option<StepScalars> {
        let [num_k, sk_l1, _] = *shares;
        let sqrt_b2 = self.hyper.beta2.sqrt();
        let numerator = sqrt_b2 * self.numerator + (1.0 - sqrt_b2) * num_k;
        if sk_l1 == 0.0 {
            return None;
        }
        if self.lr > 0.0 {
            self.d = self.d.max(numerator / ((1.0 - sqrt_b2) * sk_l1));
        }
        self.numerator = numerator;
        self.k += 1;
        Some(StepScalars {
            d: self.d,
            dlr: self.d * self.lr,
            k: self.k,
        })
    }

    fn save(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("d", self.d),
            ("numerator_weighted", self.numerator),
            ("k", self.k as f64),
        ]
    }

    fn load(&mut self, values: &[f64]) {
        if let [d, numerator, k] = *values {
            self.d = d;
            self.numerator = numerator;
            self.k = k as u64;
        }
    }
}

struct State {
    hyper: DAdaptLionParams,
    m: Tensor,
    s: Tensor,
}

impl ParamState for State {
    fn accumulate(
        &mut self,
        var: &Var,
        grad: &Tensor,
        step: &StepScalars,
        _done: u64,
        shares: &mut Shares,
    ) -> candle_core::Result<()> {
        let h = &self.hyper;
        let dlr = step.dlr;
        let g = dense::grad(grad)?;
        let p = (dense::value(var)? * (1.0 - dlr * h.weight_decay))?;
        let u = dense::mix(&self.m, h.beta1, &g, 1.0 - h.beta1)?.sign()?;
        let p = dense::mix(&p, 1.0, &u, -dlr)?;
        let m = dense::mix(&self.m, h.beta2, &g, (1.0 - h.beta2) * dlr)?;
        let num = dlr * dense::dot(&u, &self.s)?;
        let sqrt_b2 = h.beta2.sqrt();
        let s = dense::mix(&self.s, sqrt_b2, &u, (1.0 - sqrt_b2) * dlr)?;
        let l1 = dense::abs_sum(&s)?;
        dense::write(var, &p)?;
        (self.m, self.s) = (m, s);
        shares[0] += num;
        shares[1] += l1;
        Ok(())
    }

    /// Every parameter was updated in the first pass.
    fn apply(&mut self, _: &Var, _: &Tensor, _: &StepScalars) -> candle_core::Result<()> {
        Ok(())
    }

    fn save(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        Ok(vec![("exp_avg", self.m.clone()), ("s", self.s.clone())])
    }

    fn load(&mut self, tensors: Vec<Tensor>) -> candle_core::Result<()> {
        let [m, s] = dense::place::<2>(tensors, &self.m, "dadapt_lion")?;
        (self.m, self.s) = (m, s);
        Ok(())
    }

    fn bytes(&self) -> usize {
        2 * 4 * self.m.elem_count()
    }
}
