//! D-Adaptation Adan, as the `dadaptation` package (3.2) does it with one parameter group.
//! EveryDream2 names `dadapt_adan` but builds AdamW8bit for it (its branch lists only
//! `dadapt_adam`, `dadapt_lion` and `dadapt_sgd`, and it passes two betas where Adan takes
//! three); sdtrain trains with the package's optimizer.
//!
//! Per step, with `lr` the schedule's multiplier (1 by default) and `dlr = d · lr`:
//!
//! ```text
//! first pass, every parameter (g₋ = the previous gradient, g at the parameter's first step):
//!   Δ = g − g₋;  u = g + β2·Δ
//!   m ← β1·m + dlr(1 − β1)·g;   n ← β2·n + dlr(1 − β2)·Δ;   v ← β3·v + (1 − β3)·u²
//!   D = √v + ε;   gsq_k += Σ g²/D
//!   s ← β3·s + dlr(1 − β3)·g;   sksq += Σ s²/D;   ‖s‖₁ += Σ|s|
//! gsq ← β3·gsq + (1 − β3)·dlr²·gsq_k;   d̂ = (sksq/(1 − β3) − gsq) / ‖s‖₁
//! d ← max(d, min(d̂, d · growth))
//! second pass: x = (m + β2·n) / D
//!   no_prox: p ← p·(1 − dlr·λ) − x;   else p ← (p − x) / (1 + dlr·λ)
//!   g₋ ← g
//! ```
//!
//! A step whose `‖s‖₁` is 0 updates nothing and leaves the estimate as it was (the package
//! returns early; the moments were already updated).

use candle_core::{Tensor, Var};
use serde::Serialize;

use super::dense;
use super::hyper::{check_common, invalid};
use super::rule::{ParamState, Shares, StepEstimate, StepScalars, UpdateRule};
use super::Result;

/// D-Adaptation Adan's hyper-parameters (the lr is the group's, a multiplier of `d`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DAdaptAdanParams {
    pub beta1: f64,
    pub beta2: f64,
    pub beta3: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub no_prox: bool,
    pub d0: f64,
    pub growth_rate: f64,
}

impl Default for DAdaptAdanParams {
    /// `dadaptation.DAdaptAdan`'s defaults.
    fn default() -> Self {
        Self {
            beta1: 0.98,
            beta2: 0.92,
            beta3: 0.99,
            eps: 1e-8,
            weight_decay: 0.02,
            no_prox: false,
            d0: 1e-6,
            growth_rate: f64::INFINITY,
        }
    }
}

/// The D-Adaptation Adan rule.
#[derive(Debug, Clone, Copy)]
pub struct DAdaptAdan {
    hyper: DAdaptAdanParams,
}

impl DAdaptAdan {
    pub fn rule(hyper: DAdaptAdanParams) -> Result<Self> {
        check_common(
            &[
                ("beta1", hyper.beta1),
                ("beta2", hyper.beta2),
                ("beta3", hyper.beta3),
            ],
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

impl UpdateRule for DAdaptAdan {
    fn name(&self) -> &'static str {
        "dadapt_adan"
    }

    fn init(&self, var: &Var) -> candle_core::Result<Box<dyn ParamState>> {
        #[cfg(feature = "cuda")]
        if let Some(state) =
            super::adaptive_cuda::on_cuda(var, super::adaptive_args::DAdaptAdanKernel(self.hyper))?
        {
            return Ok(state);
        }
        Ok(Box::new(State {
            hyper: self.hyper,
            s: dense::zeros(var)?,
            m: dense::zeros(var)?,
            n: dense::zeros(var)?,
            v: dense::zeros(var)?,
            previous: dense::zeros(var)?,
        }))
    }

    fn estimate(&self) -> Option<Box<dyn StepEstimate>> {
        Some(Box::new(Estimate {
            hyper: self.hyper,
            d: self.hyper.d0,
            gsq: 0.0,
            k: 0,
            lr: 0.0,
            dlr: 0.0,
        }))
    }

    fn hyper_json(&self) -> serde_json::Value {
        serde_json::to_value(self.hyper).unwrap_or_default()
    }

    fn state_bytes(&self, shape: &[usize]) -> usize {
        dense::f32_bytes(shape, 5)
    }
}

struct Estimate {
    hyper: DAdaptAdanParams,
    d: f64,
    gsq: f64,
    k: u64,
    lr: f64,
    dlr: f64,
}

impl StepEstimate for Estimate {
    fn begin(&mut self, lr: f64, _grad_sq: Option<f64>) -> StepScalars {
        self.lr = lr;
        self.dlr = self.d * lr;
        StepScalars {
            d: self.d,
            dlr: self.dlr,
            k: self.k,
        }
    }

    /// Shares: `[gsq_k, sksq, ‖s‖₁]`.
    fn finish(&mut self, shares: &Shares) -> Option<StepScalars> {
        let [gsq_k, sksq, sk_l1] = *shares;
        let b3 = self.hyper.beta3;
        let gsq = b3 * self.gsq + gsq_k * self.dlr * self.dlr * (1.0 - b3);
        if sk_l1 == 0.0 {
            return None;
        }
        if self.lr > 0.0 {
            let d_hat = (sksq / (1.0 - b3) - gsq) / sk_l1;
            self.d = self.d.max(d_hat.min(self.d * self.hyper.growth_rate));
        }
        self.gsq = gsq;
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
            ("gsq_weighted", self.gsq),
            ("k", self.k as f64),
        ]
    }

    fn load(&mut self, values: &[f64]) {
        if let [d, gsq, k] = *values {
            self.d = d;
            self.gsq = gsq;
            self.k = k as u64;
        }
    }
}

struct State {
    hyper: DAdaptAdanParams,
    s: Tensor,
    m: Tensor,
    /// The moment of the gradient differences.
    n: Tensor,
    v: Tensor,
    /// The previous step's gradient.
    previous: Tensor,
}

impl ParamState for State {
    fn accumulate(
        &mut self,
        _var: &Var,
        grad: &Tensor,
        step: &StepScalars,
        done: u64,
        shares: &mut Shares,
    ) -> candle_core::Result<()> {
        let h = &self.hyper;
        let dlr = step.dlr;
        let g = dense::grad(grad)?;
        let previous = if done == 0 {
            g.clone()
        } else {
            self.previous.clone()
        };
        let diff = (&g - &previous)?;
        let u = dense::mix(&g, 1.0, &diff, h.beta2)?;
        let m = dense::mix(&self.m, h.beta1, &g, dlr * (1.0 - h.beta1))?;
        let n = dense::mix(&self.n, h.beta2, &diff, dlr * (1.0 - h.beta2))?;
        let v = dense::mix(&self.v, h.beta3, &u.sqr()?, 1.0 - h.beta3)?;
        let denom = v.sqrt()?.affine(1.0, h.eps)?;
        let gsq = f64::from((g.sqr()? / &denom)?.sum_all()?.to_scalar::<f32>()?);
        let s = dense::mix(&self.s, h.beta3, &g, dlr * (1.0 - h.beta3))?;
        let sksq = f64::from((s.sqr()? / &denom)?.sum_all()?.to_scalar::<f32>()?);
        let l1 = dense::abs_sum(&s)?;
        (self.m, self.n, self.v, self.s, self.previous) = (m, n, v, s, previous);
        shares[0] += gsq;
        shares[1] += sksq;
        shares[2] += l1;
        Ok(())
    }

    fn apply(&mut self, var: &Var, grad: &Tensor, step: &StepScalars) -> candle_core::Result<()> {
        let h = &self.hyper;
        let denom = self.v.sqrt()?.affine(1.0, h.eps)?;
        let x = (dense::mix(&self.m, 1.0, &self.n, h.beta2)? / &denom)?;
        let p = dense::value(var)?;
        let decay = step.dlr * h.weight_decay;
        let p = if h.no_prox {
            ((p * (1.0 - decay))? - x)?
        } else {
            ((p - x)? / (1.0 + decay))?
        };
        dense::write(var, &p)?;
        self.previous = dense::grad(grad)?;
        Ok(())
    }

    fn save(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        Ok(vec![
            ("s", self.s.clone()),
            ("exp_avg", self.m.clone()),
            ("exp_avg_diff", self.n.clone()),
            ("exp_avg_sq", self.v.clone()),
            ("pre_grad", self.previous.clone()),
        ])
    }

    fn load(&mut self, tensors: Vec<Tensor>) -> candle_core::Result<()> {
        let [s, m, n, v, previous] = dense::place::<5>(tensors, &self.s, "dadapt_adan")?;
        (self.s, self.m, self.n, self.v, self.previous) = (s, m, n, v, previous);
        Ok(())
    }

    fn bytes(&self) -> usize {
        5 * 4 * self.s.elem_count()
    }
}
