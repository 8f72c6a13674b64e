//! D-Adaptation Adam (Defazio & Mishchenko 2023, "Learning-Rate-Free Learning by
//! D-Adaptation", arXiv 2301.07733), as the `dadaptation` package (3.2, EveryDream2's
//! `dadapt_adam`) does it with one parameter group and `layer_scale` 1.
//!
//! Per step `k` (from 0), with `lr` the schedule's multiplier (1 by default):
//!
//! ```text
//! dlr = d · lr · (√(1 − β2^(k+1)) / (1 − β1^(k+1)) with use_bias_correction, else 1)
//! first pass, every parameter (g + λ·p for coupled decay):
//!   num_k += dlr · ⟨g, s / (√v + ε)⟩               (s and v before this step)
//!   m ← β1·m + dlr(1 − β1)·g;   v ← β2·v + (1 − β2)·g²
//!   s ← √β2·s + dlr(1 − √β2)·g;   ‖s‖₁ += Σ|s|
//! num ← √β2·num + (1 − √β2)·num_k;   d̂ = num / ((1 − √β2)·‖s‖₁)
//! d ← max(d, min(d̂, d · growth))
//! second pass: p ← p − λ·dlr·p (decoupled);  p ← p − m / (√v + ε)
//! ```
//!
//! A step whose `‖s‖₁` is 0 (every gradient zero, or lr 0) updates nothing and leaves the
//! estimate as it was, as the package returns early.

use candle_core::{Tensor, Var};
use serde::Serialize;

use super::dense;
use super::hyper::{bias_correction, check_common, invalid};
use super::rule::{ParamState, Shares, StepEstimate, StepScalars, UpdateRule};
use super::Result;

/// D-Adaptation Adam's hyper-parameters (the lr is the group's, a multiplier of `d`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DAdaptAdamParams {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub decouple: bool,
    pub use_bias_correction: bool,
    pub d0: f64,
    pub growth_rate: f64,
}

impl Default for DAdaptAdamParams {
    /// `dadaptation.DAdaptAdam`'s defaults.
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decouple: false,
            use_bias_correction: false,
            d0: 1e-6,
            growth_rate: f64::INFINITY,
        }
    }
}

/// The D-Adaptation Adam rule.
#[derive(Debug, Clone, Copy)]
pub struct DAdaptAdam {
    hyper: DAdaptAdamParams,
}

impl DAdaptAdam {
    pub fn rule(hyper: DAdaptAdamParams) -> Result<Self> {
        check_common(
            &[("beta1", hyper.beta1), ("beta2", hyper.beta2)],
            hyper.d0,
            hyper.growth_rate,
            hyper.weight_decay,
        )?;
        if !(hyper.eps.is_finite() && hyper.eps > 0.0) {
            return Err(invalid("eps", hyper.eps, "must be greater than 0"));
        }
        Ok(Self { hyper })
    }
}

impl UpdateRule for DAdaptAdam {
    fn name(&self) -> &'static str {
        "dadapt_adam"
    }

    fn init(&self, var: &Var) -> candle_core::Result<Box<dyn ParamState>> {
        #[cfg(feature = "cuda")]
        if let Some(state) =
            super::adaptive_cuda::on_cuda(var, super::adaptive_args::DAdaptAdamKernel(self.hyper))?
        {
            return Ok(state);
        }
        Ok(Box::new(State {
            hyper: self.hyper,
            s: dense::zeros(var)?,
            m: dense::zeros(var)?,
            v: dense::zeros(var)?,
        }))
    }

    fn estimate(&self) -> Option<Box<dyn StepEstimate>> {
        Some(Box::new(Estimate {
            hyper: self.hyper,
            d: self.hyper.d0,
            numerator: 0.0,
            k: 0,
            lr: 0.0,
            dlr: 0.0,
        }))
    }

    fn hyper_json(&self) -> serde_json::Value {
        serde_json::to_value(self.hyper).unwrap_or_default()
    }

    fn state_bytes(&self, shape: &[usize]) -> usize {
        dense::f32_bytes(shape, 3)
    }
}

struct Estimate {
    hyper: DAdaptAdamParams,
    d: f64,
    numerator: f64,
    k: u64,
    lr: f64,
    dlr: f64,
}

impl StepEstimate for Estimate {
    fn begin(&mut self, lr: f64, _grad_sq: Option<f64>) -> StepScalars {
        let h = &self.hyper;
        let bias = bias_correction(h.use_bias_correction, h.beta1, h.beta2, self.k);
        self.lr = lr;
        self.dlr = self.d * lr * bias;
        StepScalars {
            d: self.d,
            dlr: self.dlr,
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
            let d_hat = numerator / ((1.0 - sqrt_b2) * sk_l1);
            self.d = self.d.max(d_hat.min(self.d * self.hyper.growth_rate));
        }
        self.numerator = numerator;
        self.k += 1;
        Some(StepScalars {
            d: self.d,
            dlr: self.dlr,
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
    hyper: DAdaptAdamParams,
    s: Tensor,
    m: Tensor,
    v: Tensor,
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
        if step.dlr <= 0.0 {
            return Ok(());
        }
        let h = &self.hyper;
        let mut g = dense::grad(grad)?;
        if h.weight_decay != 0.0 && !h.decouple {
            g = dense::mix(&g, 1.0, &dense::value(var)?, h.weight_decay)?;
        }
        let denom = self.v.sqrt()?.affine(1.0, h.eps)?;
        let num = step.dlr * dense::dot(&g, &(&self.s / &denom)?)?;
        let m = dense::mix(&self.m, h.beta1, &g, step.dlr * (1.0 - h.beta1))?;
        let v = dense::mix(&self.v, h.beta2, &g.sqr()?, 1.0 - h.beta2)?;
        let sqrt_b2 = h.beta2.sqrt();
        let s = dense::mix(&self.s, sqrt_b2, &g, step.dlr * (1.0 - sqrt_b2))?;
        let l1 = dense::abs_sum(&s)?;
        (self.m, self.v, self.s) = (m, v, s);
        shares[0] += num;
        shares[1] += l1;
        Ok(())
    }

    fn apply(&mut self, var: &Var, _grad: &Tensor, step: &StepScalars) -> candle_core::Result<()> {
        let h = &self.hyper;
        let mut p = dense::value(var)?;
        let denom = self.v.sqrt()?.affine(1.0, h.eps)?;
        if h.weight_decay != 0.0 && h.decouple {
            p = dense::mix(&p, 1.0, &p, -h.weight_decay * step.dlr)?;
        }
        dense::write(var, &(p - (&self.m / &denom)?)?)
    }

    fn save(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        Ok(vec![
            ("s", self.s.clone()),
            ("exp_avg", self.m.clone()),
            ("exp_avg_sq", self.v.clone()),
        ])
    }

    fn load(&mut self, tensors: Vec<Tensor>) -> candle_core::Result<()> {
        let [s, m, v] = dense::place::<3>(tensors, &self.s, "dadapt_adam")?;
        (self.s, self.m, self.v) = (s, m, v);
        Ok(())
    }

    fn bytes(&self) -> usize {
        3 * 4 * self.s.elem_count()
    }
}
