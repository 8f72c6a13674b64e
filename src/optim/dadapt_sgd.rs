//! D-Adaptation SGD, as the `dadaptation` package (3.2, EveryDream2's `dadapt_sgd`) does it with
//! one parameter group: a dual-averaging step from the starting point `x0`.
//!
//! Per step `k` (from 0), with `lr` the schedule's multiplier (1 by default):
//!
//! ```text
//! at k = 0: g0 = ‖every gradient‖₂ (without weight decay, as the package computes it)
//! dlr = d · lr / g0
//! first pass, every parameter (g + λ·p): num += dlr · ⟨g, s⟩;  s ← s + dlr·g;  sksq += Σ s²
//! d̂ = 2·num / √sksq;   d ← max(d, min(d̂, d · growth))
//! second pass: z = x0 − s;   p ← momentum·p + (1 − momentum)·z
//! ```
//!
//! `num` accumulates over the whole run (it is not decayed). A step whose `sksq` is 0 updates
//! nothing and leaves the estimate as it was. The package also keeps `z` per parameter; it is
//! `x0 − s` at every use, so sdtrain recomputes it (8 bytes of state per parameter, not 12).
//! Because its first step needs every gradient's norm before any update, it cannot run inside a
//! fused backward pass.

use candle_core::{Tensor, Var};
use serde::Serialize;

use super::dense;
use super::hyper::{check_common, invalid};
use super::rule::{ParamState, Shares, StepEstimate, StepScalars, UpdateRule};
use super::Result;

/// D-Adaptation SGD's hyper-parameters (the lr is the group's, a multiplier of `d`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DAdaptSgdParams {
    pub momentum: f64,
    pub weight_decay: f64,
    pub d0: f64,
    pub growth_rate: f64,
}

impl Default for DAdaptSgdParams {
    /// `dadaptation.DAdaptSGD`'s defaults.
    fn default() -> Self {
        Self {
            momentum: 0.0,
            weight_decay: 0.0,
            d0: 1e-6,
            growth_rate: f64::INFINITY,
        }
    }
}

/// The D-Adaptation SGD rule.
#[derive(Debug, Clone, Copy)]
pub struct DAdaptSgd {
    hyper: DAdaptSgdParams,
}

impl DAdaptSgd {
    pub fn rule(hyper: DAdaptSgdParams) -> Result<Self> {
        check_common(&[], hyper.d0, hyper.growth_rate, hyper.weight_decay)?;
        if !(0.0..1.0).contains(&hyper.momentum) {
            return Err(invalid("momentum", hyper.momentum, "must be in [0, 1)"));
        }
        Ok(Self { hyper })
    }
}

impl UpdateRule for DAdaptSgd {
    fn name(&self) -> &'static str {
        "dadapt_sgd"
    }

    fn init(&self, var: &Var) -> candle_core::Result<Box<dyn ParamState>> {
        #[cfg(feature = "cuda")]
        if let Some(state) =
            super::adaptive_cuda::on_cuda(var, super::adaptive_args::DAdaptSgdKernel(self.hyper))?
        {
            return Ok(state);
        }
        Ok(Box::new(State {
            hyper: self.hyper,
            s: dense::zeros(var)?,
            x0: dense::zeros(var)?,
        }))
    }

    fn estimate(&self) -> Option<Box<dyn StepEstimate>> {
        Some(Box::new(Estimate {
            hyper: self.hyper,
            d: self.hyper.d0,
            numerator: 0.0,
            g0_norm: 0.0,
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
    hyper: DAdaptSgdParams,
    d: f64,
    numerator: f64,
    g0_norm: f64,
    k: u64,
    lr: f64,
}

impl StepEstimate for Estimate {
    /// Its update needs the sums over every gradient of the step.
    fn runs_fused(&self) -> bool {
        false
    }

    fn needs_grad_sq(&self) -> bool {
        self.k == 0
    }

    fn begin(&mut self, lr: f64, grad_sq: Option<f64>) -> StepScalars {
        if let (0, Some(sq)) = (self.k, grad_sq) {
            self.g0_norm = sq.sqrt();
        }
        self.lr = lr;
        StepScalars {
            d: self.d,
            dlr: self.d * lr / self.g0_norm,
            k: self.k,
        }
    }

    /// Shares: `[Δnum, sksq, 0]`.
    fn finish(&mut self, shares: &Shares) -> Option<StepScalars> {
        let [delta, sksq, _] = *shares;
        if self.lr.is_nan() || self.lr <= 0.0 || sksq == 0.0 {
            return None;
        }
        let numerator = self.numerator + delta;
        let d_hat = 2.0 * numerator / sksq.sqrt();
        self.d = self.d.max(d_hat.min(self.d * self.hyper.growth_rate));
        self.numerator = numerator;
        self.k += 1;
        Some(StepScalars {
            d: self.d,
            dlr: 0.0,
            k: self.k,
        })
    }

    fn save(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("d", self.d),
            ("numerator_weighted", self.numerator),
            ("g0_norm", self.g0_norm),
            ("k", self.k as f64),
        ]
    }

    fn load(&mut self, values: &[f64]) {
        if let [d, numerator, g0_norm, k] = *values {
            self.d = d;
            self.numerator = numerator;
            self.g0_norm = g0_norm;
            self.k = k as u64;
        }
    }
}

struct State {
    hyper: DAdaptSgdParams,
    s: Tensor,
    x0: Tensor,
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
        let x0 = if done == 0 {
            dense::snapshot(var)?
        } else {
            self.x0.clone()
        };
        if step.dlr.is_nan() || step.dlr <= 0.0 {
            self.x0 = x0;
            return Ok(());
        }
        let h = &self.hyper;
        let mut g = dense::grad(grad)?;
        if h.weight_decay != 0.0 {
            g = dense::mix(&g, 1.0, &p, h.weight_decay)?;
        }
        let num = step.dlr * dense::dot(&g, &self.s)?;
        let s = dense::mix(&self.s, 1.0, &g, step.dlr)?;
        let sksq = dense::sq_sum(&s)?;
        (self.s, self.x0) = (s, x0);
        shares[0] += num;
        shares[1] += sksq;
        Ok(())
    }

    fn apply(&mut self, var: &Var, _grad: &Tensor, _step: &StepScalars) -> candle_core::Result<()> {
        let ck = 1.0 - self.hyper.momentum;
        let z = (&self.x0 - &self.s)?;
        let p = dense::mix(&dense::value(var)?, 1.0 - ck, &z, ck)?;
        dense::write(var, &p)
    }

    fn save(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        Ok(vec![("s", self.s.clone()), ("x0", self.x0.clone())])
    }

    fn load(&mut self, tensors: Vec<Tensor>) -> candle_core::Result<()> {
        let [s, x0] = dense::place::<2>(tensors, &self.s, "dadapt_sgd")?;
        (self.s, self.x0) = (s, x0);
        Ok(())
    }

    fn bytes(&self) -> usize {
        2 * 4 * self.s.elem_count()
    }
}
