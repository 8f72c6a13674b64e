//! Schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled", arXiv 2405.15682), as the
//! `schedulefree` package (1.4.1) `AdamWScheduleFree` does it, with one parameter group.
//!
//! The parameter holds `y`, where the gradient is taken; the state keeps `z` (the base sequence)
//! and Adam's second moment `v`. The weights to evaluate and save are the average
//! `x = y + (1 − 1/β1)·(z − y)`. Per group step `k` (from 0), with `lr` the group's learning rate:
//!
//! ```text
//! lr_k    = lr · min(1, (k + 1)/warmup_steps)            (the warmup is the optimizer's)
//! lr_max  = max(lr_max, lr_k);  w = (k + 1)^r · lr_max^weight_lr_power
//! Σw     += w;  c = w / Σw                               (0 when Σw = 0)
//! every parameter (z ← p at its first step):
//!   v ← β2·v + (1 − β2)·g²
//!   ĝ = g / (√(v / (1 − β2^(k+1))) + ε) + λ·y            (decay taken at y)
//!   y ← lerp(y, z, c) + lr_k·(β1·(1 − c) − 1)·ĝ
//!   z ← z − lr_k·ĝ
//! ```
//!
//! `k`, `Σw`, `lr_max` and the step's `lr_k` are group scalars, kept and saved by a
//! [`StepEstimate`]: each step takes the two passes of the estimators, the first taking `z`'s
//! starting point, the second the update. The package's `eval()` and `train()` move the parameter
//! between `y` and `x`; here [`ParamState::eval_weights`] writes `x`, and the optimizer group
//! restores the `y` it kept instead of computing it back from `x` (the package's
//! `lerp(x, z, 1 − β1)`), so training goes on bit for bit as if nothing had been evaluated.
//!
//! The CPU path is written with tensor ops ([`super::dense`]); a CUDA parameter takes the fused
//! kernels `sf_adamw_*` of src/optim/adaptive.cu instead.

use candle_core::{Tensor, Var};
use serde::Serialize;

use super::dense;
use super::hyper::invalid;
use super::rule::{ParamState, Shares, StepEstimate, StepScalars, UpdateRule};
use super::Result;

pub(crate) const NAME: &str = "adamw_schedulefree";

/// Schedule-free AdamW's hyper-parameters (the lr is the group's). `Default` is the package's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ScheduleFreeParams {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Steps of the linear warmup of the lr (0: none).
    pub warmup_steps: u64,
    /// The power of the step in the average's weights (0: uniform).
    pub r: f64,
    /// The power of the largest lr so far in the average's weights.
    pub weight_lr_power: f64,
}

impl Default for ScheduleFreeParams {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            warmup_steps: 0,
            r: 0.0,
            weight_lr_power: 2.0,
        }
    }
}

/// The schedule-free AdamW rule.
#[derive(Debug, Clone, Copy)]
pub struct AdamWScheduleFree {
    hyper: ScheduleFreeParams,
}

impl AdamWScheduleFree {
    pub fn rule(hyper: ScheduleFreeParams) -> Result<Self> {
        // β1 = 0 would make x = y + (1 − 1/0)·(z − y): the package divides by it too.
        if !(hyper.beta1 > 0.0 && hyper.beta1 < 1.0) {
            return Err(invalid("beta1", hyper.beta1, "must be in (0, 1)"));
        }
        if !(0.0..1.0).contains(&hyper.beta2) {
            return Err(invalid("beta2", hyper.beta2, "must be in [0, 1)"));
        }
        if !(hyper.eps.is_finite() && hyper.eps >= 0.0) {
            return Err(invalid("eps", hyper.eps, "must be >= 0"));
        }
        if !(hyper.weight_decay.is_finite() && hyper.weight_decay >= 0.0) {
            return Err(invalid("weight_decay", hyper.weight_decay, "must be >= 0"));
        }
        for (field, v) in [("r", hyper.r), ("weight_lr_power", hyper.weight_lr_power)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(invalid(field, v, "must be >= 0"));
            }
        }
        Ok(Self { hyper })
    }

    /// The weight of `z` in `x = lerp(y, z, ·)`: `1 − 1/β1`.
    pub(crate) fn eval_weight(h: &ScheduleFreeParams) -> f64 {
        1.0 - 1.0 / h.beta1
    }
}

impl UpdateRule for AdamWScheduleFree {
    fn name(&self) -> &'static str {
        NAME
    }

    fn init(&self, var: &Var) -> candle_core::Result<Box<dyn ParamState>> {
        #[cfg(feature = "cuda")]
        if let Some(state) = super::adaptive_cuda::on_cuda(
            var,
            super::adaptive_args::ScheduleFreeKernel(self.hyper),
        )? {
            return Ok(state);
        }
        Ok(Box::new(State {
            hyper: self.hyper,
            z: dense::zeros(var)?,
            v: dense::zeros(var)?,
        }))
    }

    fn estimate(&self) -> Option<Box<dyn StepEstimate>> {
        Some(Box::new(Estimate {
            hyper: self.hyper,
            k: 0,
            weight_sum: 0.0,
            lr_max: -1.0,
            scheduled_lr: 0.0,
            begun: StepScalars::default(),
        }))
    }

    fn eval_weights_differ(&self) -> bool {
        true
    }

    fn hyper_json(&self) -> serde_json::Value {
        serde_json::to_value(self.hyper).unwrap_or_default()
    }

    fn state_bytes(&self, shape: &[usize]) -> usize {
        dense::f32_bytes(shape, 2)
    }
}

/// The group's scalars: the step count, the sum of the average's weights, the largest lr so far
/// and the lr of the last step (warmup applied).
struct Estimate {
    hyper: ScheduleFreeParams,
    k: u64,
    weight_sum: f64,
    lr_max: f64,
    scheduled_lr: f64,
    /// The scalars of the step under way: `d` the average's weight `c`, `dlr` the step's lr.
    begun: StepScalars,
}

impl StepEstimate for Estimate {
    fn begin(&mut self, lr: f64, _grad_sq: Option<f64>) -> StepScalars {
        let h = &self.hyper;
        let k = self.k;
        let sched = if k < h.warmup_steps {
            (k + 1) as f64 / h.warmup_steps as f64
        } else {
            1.0
        };
        let lr = lr * sched;
        self.scheduled_lr = lr;
        self.lr_max = lr.max(self.lr_max);
        let weight = ((k + 1) as f64).powf(h.r) * self.lr_max.powf(h.weight_lr_power);
        self.weight_sum += weight;
        // The package catches the ZeroDivisionError of a zero sum (every lr so far 0).
        let ckp1 = if self.weight_sum == 0.0 {
            0.0
        } else {
            weight / self.weight_sum
        };
        self.begun = StepScalars {
            d: ckp1,
            dlr: lr,
            k,
        };
        self.begun
    }

    /// The step ends: the second pass takes the scalars the step began with.
    fn finish(&mut self, _shares: &Shares) -> Option<StepScalars> {
        self.k += 1;
        Some(self.begun)
    }

    fn save(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("scheduled_lr", self.scheduled_lr),
            ("weight_sum", self.weight_sum),
            ("lr_max", self.lr_max),
            ("k", self.k as f64),
        ]
    }

    fn load(&mut self, values: &[f64]) {
        if let [lr, weight_sum, lr_max, k] = *values {
            self.scheduled_lr = lr;
            self.weight_sum = weight_sum;
            self.lr_max = lr_max;
            self.k = k as u64;
        }
    }
}

/// The update's f64 coefficients for a step's scalars, shared by the CPU path and the kernel's
/// arguments (src/optim/adaptive_args.rs).
pub(crate) struct Coefficients {
    /// `1/(1 − β2^(k+1))`: candle's division by a scalar multiplies by its reciprocal.
    pub inv_bc2: f64,
    /// The lerp's weight `c`, and whether torch's lerp takes its first form (`c < 0.5`).
    pub ckp1: f64,
    /// The coefficient of `ĝ` in y's update: `lr_k·(β1·(1 − c) − 1)`.
    pub y_coef: f64,
    /// The coefficient of `ĝ` in z's update: `−lr_k`.
    pub z_coef: f64,
}

impl Coefficients {
    pub fn new(h: &ScheduleFreeParams, step: &StepScalars) -> Self {
        let ckp1 = step.d;
        Self {
            // Python's `beta2 ** (k+1)`: C pow.
            inv_bc2: 1.0 / (1.0 - h.beta2.powf((step.k + 1) as f64)),
            ckp1,
            y_coef: step.dlr * (h.beta1 * (1.0 - ckp1) - 1.0),
            z_coef: -step.dlr,
        }
    }
}

/// torch's `lerp(a, b, w)` as candle ops: `a + w·(b − a)` for `w < 0.5`, else
/// `b − (1 − w)·(b − a)` (torch's two forms, which keep the ends exact).
pub(crate) fn lerp(a: &Tensor, b: &Tensor, w: f64) -> candle_core::Result<Tensor> {
    let d = (b - a)?;
    if w < 0.5 {
        dense::mix(a, 1.0, &d, w)
    } else {
        dense::mix(b, 1.0, &d, -(1.0 - w))
    }
}

struct State {
    hyper: ScheduleFreeParams,
    z: Tensor,
    v: Tensor,
}

impl ParamState for State {
    /// The first pass takes `z`'s starting point (the parameter, at its first step).
    fn accumulate(
        &mut self,
        var: &Var,
        _grad: &Tensor,
        _step: &StepScalars,
        done: u64,
        _shares: &mut Shares,
    ) -> candle_core::Result<()> {
        if done == 0 {
            self.z = dense::snapshot(var)?;
        }
        Ok(())
    }

    fn apply(&mut self, var: &Var, grad: &Tensor, step: &StepScalars) -> candle_core::Result<()> {
        let h = &self.hyper;
        let c = Coefficients::new(h, step);
        let g = dense::grad(grad)?;
        let y = dense::value(var)?;
        let v = dense::mix(&self.v, h.beta2, &g.sqr()?, 1.0 - h.beta2)?;
        let denom = (&v * c.inv_bc2)?.sqrt()?.affine(1.0, h.eps)?;
        let mut gn = (g / denom)?;
        if h.weight_decay != 0.0 {
            gn = dense::mix(&gn, 1.0, &y, h.weight_decay)?;
        }
        let y = lerp(&y, &self.z, c.ckp1)?;
        let y = dense::mix(&y, 1.0, &gn, c.y_coef)?;
        let z = dense::mix(&self.z, 1.0, &gn, c.z_coef)?;
        dense::write(var, &y)?;
        (self.z, self.v) = (z, v);
        Ok(())
    }

    fn eval_weights(&mut self, var: &Var) -> candle_core::Result<()> {
        let y = dense::value(var)?;
        let w = AdamWScheduleFree::eval_weight(&self.hyper);
        dense::write(var, &lerp(&y, &self.z, w)?)
    }

    fn save(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        Ok(vec![("z", self.z.clone()), ("exp_avg_sq", self.v.clone())])
    }

    fn load(&mut self, tensors: Vec<Tensor>) -> candle_core::Result<()> {
        let [z, v] = dense::place::<2>(tensors, &self.v, NAME)?;
        (self.z, self.v) = (z, v);
        Ok(())
    }

    fn bytes(&self) -> usize {
        2 * 4 * self.v.elem_count()
    }
}
