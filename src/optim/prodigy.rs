//! Prodigy (Mishchenko & Defazio 2023, "Prodigy: An Expeditiously Adaptive Parameter-Free
//! Learner", arXiv 2306.06101): Adam whose step size `d` is estimated from the distance the
//! weights travelled, as the `prodigyopt` package (1.1.2, EveryDream2's `prodigy`) does it, with
//! `slice_p` 1 and one parameter group.
//!
//! Per step `k` (from 0), with `lr` the schedule's multiplier (1 by default):
//!
//! ```text
//! dlr = d · lr · (√(1 − β2^(k+1)) / (1 − β1^(k+1)) with use_bias_correction, else 1)
//! first pass, every parameter (g + λ·p for coupled decay; p0 = p at its first step):
//!   Δnum += (d/d0) · dlr · ⟨g, p0 − p⟩
//!   m ← β1·m + d(1 − β1)·g;   v ← β2·v + d²(1 − β2)·g²
//!   s ← β3·s + (d/d0)·(safeguard_warmup ? d : dlr)·g;   den += Σ|s|
//! num ← β3·num + Δnum;  d̂ = d_coef · num / den
//! d ← max(d, d̂) on the first growth (d = d0);  d_max ← max(d_max, d̂);  d ← min(d_max, d · growth)
//! second pass: p ← p − λ·dlr·p (decoupled);  p ← p − dlr · m / (√v + d·ε)
//! ```
//!
//! β3 defaults to √β2. A step whose `Σ|s|` is 0 (every gradient zero, or lr 0 as in the first
//! step of a warmup) updates nothing and leaves the estimate as it was, as the package returns
//! early. EveryDream2 passes `use_bias_correction` and `safeguard_warmup` true; the package's own
//! defaults are false.

use candle_core::{Tensor, Var};
use serde::Serialize;

use super::dense;
use super::hyper::{bias_correction, check_common, invalid};
use super::rule::{ParamState, Shares, StepEstimate, StepScalars, UpdateRule};
use super::Result;

/// Prodigy's hyper-parameters (the lr is the group's, a multiplier of `d`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ProdigyParams {
    pub beta1: f64,
    pub beta2: f64,
    /// `None`: √β2.
    pub beta3: Option<f64>,
    pub eps: f64,
    pub weight_decay: f64,
    /// AdamW-style decay (true) or decay added to the gradient (false).
    pub decouple: bool,
    pub use_bias_correction: bool,
    pub safeguard_warmup: bool,
    pub d0: f64,
    pub d_coef: f64,
    /// The most `d` may grow per step, as a factor (∞: unbounded).
    pub growth_rate: f64,
}

impl Default for ProdigyParams {
    /// `prodigyopt.Prodigy`'s defaults.
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            beta3: None,
            eps: 1e-8,
            weight_decay: 0.0,
            decouple: true,
            use_bias_correction: false,
            safeguard_warmup: false,
            d0: 1e-6,
            d_coef: 1.0,
            growth_rate: f64::INFINITY,
        }
    }
}

impl ProdigyParams {
    /// β3, √β2 unless given.
    pub fn beta3(&self) -> f64 {
        self.beta3.unwrap_or_else(|| self.beta2.sqrt())
    }
}

/// The Prodigy rule.
#[derive(Debug, Clone, Copy)]
pub struct Prodigy {
    hyper: ProdigyParams,
}

impl Prodigy {
    pub fn rule(hyper: ProdigyParams) -> Result<Self> {
        let betas = [("beta1", hyper.beta1), ("beta2", hyper.beta2)];
        let beta3 = hyper.beta3.map(|b| ("beta3", b));
        let betas: Vec<_> = betas.into_iter().chain(beta3).collect();
        check_common(&betas, hyper.d0, hyper.growth_rate, hyper.weight_decay)?;
        for (field, v) in [("eps", hyper.eps), ("d_coef", hyper.d_coef)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid(field, v, "must be greater than 0"));
            }
        }
        Ok(Self { hyper })
    }
}

impl UpdateRule for Prodigy {
    fn name(&self) -> &'static str {
        "prodigy"
    }

    fn init(&self, var: &Var) -> candle_core::Result<Box<dyn ParamState>> {
        #[cfg(feature = "cuda")]
        if let Some(state) =
            super::adaptive_cuda::on_cuda(var, super::adaptive_args::ProdigyKernel(self.hyper))?
        {
            return Ok(state);
        }
        Ok(Box::new(State {
            hyper: self.hyper,
            m: if self.hyper.beta1 > 0.0 {
                Some(dense::zeros(var)?)
            } else {
                None
            },
            v: dense::zeros(var)?,
            s: dense::zeros(var)?,
            p0: dense::zeros(var)?,
        }))
    }

    fn estimate(&self) -> Option<Box<dyn StepEstimate>> {
        Some(Box::new(Estimate {
            hyper: self.hyper,
            d: self.hyper.d0,
            d_max: self.hyper.d0,
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
        dense::f32_bytes(shape, if self.hyper.beta1 > 0.0 { 4 } else { 3 })
    }
}

/// The group's estimate: `d`, its running maximum, the weighted numerator and the step count.
struct Estimate {
    hyper: ProdigyParams,
    d: f64,
    d_max: f64,
    numerator: f64,
    k: u64,
    /// The step's lr and dlr, from `begin`.
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

    /// Shares: `[Δnum, Σ|s|, 0]`.
    fn finish(&mut self, shares: &Shares) -> Option<StepScalars> {
        let [delta, denom, _] = *shares;
        if denom == 0.0 {
            return None;
        }
        if self.lr > 0.0 {
            self.numerator = self.hyper.beta3() * self.numerator + delta;
            let d_hat = self.hyper.d_coef * self.numerator / denom;
            if self.d == self.hyper.d0 {
                self.d = self.d.max(d_hat);
            }
            self.d_max = self.d_max.max(d_hat);
            self.d = self.d_max.min(self.d * self.hyper.growth_rate);
        }
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
            ("d_max", self.d_max),
            ("d_numerator", self.numerator),
            ("k", self.k as f64),
        ]
    }

    fn load(&mut self, values: &[f64]) {
        if let [d, d_max, numerator, k] = *values {
            self.d = d;
            self.d_max = d_max;
            self.numerator = numerator;
            self.k = k as u64;
        }
    }
}

struct State {
    hyper: ProdigyParams,
    /// First moment (absent with β1 = 0), second moment, the weighted gradient sum `s`, and the
    /// parameter at its first step.
    m: Option<Tensor>,
    v: Tensor,
    s: Tensor,
    p0: Tensor,
}

impl State {
    /// The gradient with coupled weight decay added, as the package adds it in place.
    fn grad(&self, p: &Tensor, g: &Tensor) -> candle_core::Result<Tensor> {
        let g = dense::grad(g)?;
        let h = &self.hyper;
        if h.weight_decay != 0.0 && !h.decouple {
            dense::mix(&g, 1.0, p, h.weight_decay)
        } else {
            Ok(g)
        }
    }
}

impl ParamState for State {
    fn accumulate(
        &mut self,
        var: &Var,
        grad: &Tensor,
        step: &StepScalars,
        done: u64,
        shares: &mut Shares,
    ) -> candle_core::Result<()> {
        let p = dense::value(var)?;
        let p0 = if done == 0 {
            dense::snapshot(var)?
        } else {
            self.p0.clone()
        };
        if step.dlr <= 0.0 {
            self.p0 = p0;
            return Ok(());
        }
        let h = &self.hyper;
        let g = self.grad(&p, grad)?;
        let d = step.d;
        let ratio = d / h.d0;
        let delta = ratio * step.dlr * dense::dot(&g, &(&p0 - &p)?)?;
        let m = match &self.m {
            Some(m) => Some(dense::mix(m, h.beta1, &g, d * (1.0 - h.beta1))?),
            None => None,
        };
        let v = dense::mix(&self.v, h.beta2, &g.sqr()?, d * d * (1.0 - h.beta2))?;
        let s_scale = ratio * if h.safeguard_warmup { d } else { step.dlr };
        let s = dense::mix(&self.s, h.beta3(), &g, s_scale)?;
        let denom = dense::abs_sum(&s)?;
        (self.m, self.v, self.s, self.p0) = (m, v, s, p0);
        shares[0] += delta;
        shares[1] += denom;
        Ok(())
    }

    fn apply(&mut self, var: &Var, grad: &Tensor, step: &StepScalars) -> candle_core::Result<()> {
        let h = &self.hyper;
        let mut p = dense::value(var)?;
        let denom = self.v.sqrt()?.affine(1.0, step.d * h.eps)?;
        let direction = match &self.m {
            Some(m) => (m / &denom)? * step.dlr,
            // β1 = 0: the gradient (with any coupled decay) times d.
            None => (self.grad(&p, grad)? / &denom)? * (step.dlr * step.d),
        }?;
        if h.weight_decay != 0.0 && h.decouple {
            p = dense::mix(&p, 1.0, &p, -h.weight_decay * step.dlr)?;
        }
        dense::write(var, &(p - direction)?)
    }

    fn save(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        let mut out = Vec::with_capacity(4);
        if let Some(m) = &self.m {
            out.push(("exp_avg", m.clone()));
        }
        out.push(("exp_avg_sq", self.v.clone()));
        out.push(("s", self.s.clone()));
        out.push(("p0", self.p0.clone()));
        Ok(out)
    }

    fn load(&mut self, tensors: Vec<Tensor>) -> candle_core::Result<()> {
        if self.m.is_some() {
            let [m, v, s, p0] = dense::place::<4>(tensors, &self.v, "prodigy")?;
            (self.m, self.v, self.s, self.p0) = (Some(m), v, s, p0);
        } else {
            let [v, s, p0] = dense::place::<3>(tensors, &self.v, "prodigy")?;
            (self.v, self.s, self.p0) = (v, s, p0);
        }
        Ok(())
    }

    fn bytes(&self) -> usize {
        let n = if self.m.is_some() { 4 } else { 3 };
        n * self.v.elem_count() * 4
    }
}
