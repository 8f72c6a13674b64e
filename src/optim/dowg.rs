//! DoWG, "Distance over Weighted Gradients" (Khaled, Mishchenko & Jin 2023, arXiv 2305.16284),
//! as the `dowg` package (0.3.1, EveryDream2's `coordinate_dowg` and `scalar_dowg`) does it:
//! learning-rate free, so the group's lr and its schedule do not enter the update (the package
//! fixes lr at 1). Gradients are clamped to ±`clip` (0.5) element by element. EveryDream2 passes
//! its `epsilon` as `eps`.
//!
//! Coordinate DoWG, per element, with `x0` the parameter at its first step:
//!
//! ```text
//! r² ← max(r², (p − x0)²)  (r² starts at ε);   v ← v + r²·g²;   p ← p − r²·clamp(g) / (√v + ε)
//! ```
//!
//! Scalar DoWG, with one `r²` and `v` for the group (in f32, as the package keeps them):
//!
//! ```text
//! first pass: Σ g² and Σ (p − x0)² over every parameter
//! r² ← max(r², Σ (p − x0)²)  (r² starts at 1 − ε);   v ← v + r²·Σ g²
//! second pass: p ← p − r²·clamp(g) / (√v + 1 − ε)
//! ```
//!
//! The package's `ScalarDoWG.step` does all of this only when it is given a closure, which
//! EveryDream2 never passes, so EveryDream2's `scalar_dowg` leaves the weights unchanged.
//! sdtrain runs the algorithm (the package's closure path); the `1 − ε` is the package's.

use candle_core::{Tensor, Var};
use serde::Serialize;

use super::dense;
use super::hyper::invalid;
use super::rule::{ParamState, Shares, StepEstimate, StepScalars, UpdateRule};
use super::Result;

/// DoWG's hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DowgParams {
    pub eps: f64,
    /// Gradients are clamped to ±clip.
    pub clip: f64,
}

impl Default for DowgParams {
    /// The package's defaults.
    fn default() -> Self {
        Self {
            eps: 1e-4,
            clip: 0.5,
        }
    }
}

fn check(hyper: &DowgParams) -> Result<()> {
    if !(hyper.eps.is_finite() && hyper.eps > 0.0 && hyper.eps < 1.0) {
        return Err(invalid("eps", hyper.eps, "must be in (0, 1)"));
    }
    if !(hyper.clip.is_finite() && hyper.clip > 0.0) {
        return Err(invalid("clip", hyper.clip, "must be greater than 0"));
    }
    Ok(())
}

/// Coordinate DoWG: `r²` and `v` per element.
#[derive(Debug, Clone, Copy)]
pub struct CoordinateDowg {
    hyper: DowgParams,
}

impl CoordinateDowg {
    pub fn rule(hyper: DowgParams) -> Result<Self> {
        check(&hyper)?;
        Ok(Self { hyper })
    }
}

impl UpdateRule for CoordinateDowg {
    fn name(&self) -> &'static str {
        "coordinate_dowg"
    }

    fn init(&self, var: &Var) -> candle_core::Result<Box<dyn ParamState>> {
        #[cfg(feature = "cuda")]
        if let Some(state) = super::adaptive_cuda::on_cuda(
            var,
            super::adaptive_args::CoordinateDowgKernel(self.hyper),
        )? {
            return Ok(state);
        }
        Ok(Box::new(CoordinateState {
            hyper: self.hyper,
            x0: dense::zeros(var)?,
            r2: dense::zeros(var)?.affine(1.0, self.hyper.eps)?,
            v: dense::zeros(var)?,
        }))
    }

    fn hyper_json(&self) -> serde_json::Value {
        serde_json::to_value(self.hyper).unwrap_or_default()
    }

    fn state_bytes(&self, shape: &[usize]) -> usize {
        dense::f32_bytes(shape, 3)
    }
}

struct CoordinateState {
    hyper: DowgParams,
    x0: Tensor,
    r2: Tensor,
    v: Tensor,
}

impl ParamState for CoordinateState {
    fn update(&mut self, var: &Var, grad: &Tensor, _lr: f64, t: u64) -> candle_core::Result<()> {
        let h = &self.hyper;
        let p = dense::value(var)?;
        let g = dense::grad(grad)?;
        let x0 = if t == 1 {
            dense::snapshot(var)?
        } else {
            self.x0.clone()
        };
        let r2 = self.r2.maximum(&(&p - &x0)?.sqr()?)?;
        let v = (&self.v + (&r2 * g.sqr()?)?)?;
        let step = ((&r2 * g.clamp(-h.clip, h.clip)?)? / v.sqrt()?.affine(1.0, h.eps)?)?;
        dense::write(var, &(p - step)?)?;
        (self.x0, self.r2, self.v) = (x0, r2, v);
        Ok(())
    }

    fn save(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        Ok(vec![
            ("x0", self.x0.clone()),
            ("rt2", self.r2.clone()),
            ("vt", self.v.clone()),
        ])
    }

    fn load(&mut self, tensors: Vec<Tensor>) -> candle_core::Result<()> {
        let [x0, r2, v] = dense::place::<3>(tensors, &self.x0, "coordinate_dowg")?;
        (self.x0, self.r2, self.v) = (x0, r2, v);
        Ok(())
    }

    fn bytes(&self) -> usize {
        3 * 4 * self.x0.elem_count()
    }
}

/// Scalar DoWG: one `r²` and `v` for the group.
#[derive(Debug, Clone, Copy)]
pub struct ScalarDowg {
    hyper: DowgParams,
}

impl ScalarDowg {
    pub fn rule(hyper: DowgParams) -> Result<Self> {
        check(&hyper)?;
        Ok(Self { hyper })
    }
}

impl UpdateRule for ScalarDowg {
    fn name(&self) -> &'static str {
        "scalar_dowg"
    }

    fn init(&self, var: &Var) -> candle_core::Result<Box<dyn ParamState>> {
        #[cfg(feature = "cuda")]
        if let Some(state) =
            super::adaptive_cuda::on_cuda(var, super::adaptive_args::ScalarDowgKernel(self.hyper))?
        {
            return Ok(state);
        }
        Ok(Box::new(ScalarState {
            clip: self.hyper.clip,
            x0: dense::zeros(var)?,
        }))
    }

    fn estimate(&self) -> Option<Box<dyn StepEstimate>> {
        Some(Box::new(ScalarEstimate {
            epsilon: (1.0 - self.hyper.eps) as f32,
            r2: (1.0 - self.hyper.eps) as f32,
            v: 0.0,
        }))
    }

    fn hyper_json(&self) -> serde_json::Value {
        serde_json::to_value(self.hyper).unwrap_or_default()
    }

    fn state_bytes(&self, shape: &[usize]) -> usize {
        dense::f32_bytes(shape, 1)
    }
}

/// The group's `r²` and `v`, in f32 as the package's one-element tensors.
struct ScalarEstimate {
    /// The package's `1 − eps`.
    epsilon: f32,
    r2: f32,
    v: f32,
}

impl StepEstimate for ScalarEstimate {
    /// Its update needs the sums over every gradient of the step.
    fn runs_fused(&self) -> bool {
        false
    }

    fn begin(&mut self, _lr: f64, _grad_sq: Option<f64>) -> StepScalars {
        StepScalars::default()
    }

    /// Shares: `[Σ g², Σ (p − x0)², 0]`.
    fn finish(&mut self, shares: &Shares) -> Option<StepScalars> {
        let [grad_sq, dist_sq, _] = *shares;
        self.r2 = self.r2.max(dist_sq as f32);
        self.v += self.r2 * grad_sq as f32;
        Some(StepScalars {
            d: f64::from(self.r2),
            dlr: f64::from(self.v.sqrt() + self.epsilon),
            k: 0,
        })
    }

    fn save(&self) -> Vec<(&'static str, f64)> {
        vec![("rt2", f64::from(self.r2)), ("vt", f64::from(self.v))]
    }

    fn load(&mut self, values: &[f64]) {
        if let [r2, v] = *values {
            self.r2 = r2 as f32;
            self.v = v as f32;
        }
    }
}

struct ScalarState {
    clip: f64,
    x0: Tensor,
}

impl ParamState for ScalarState {
    fn accumulate(
        &mut self,
        var: &Var,
        grad: &Tensor,
        _step: &StepScalars,
        done: u64,
        shares: &mut Shares,
    ) -> candle_core::Result<()> {
        let p = dense::value(var)?;
        let x0 = if done == 0 {
            dense::snapshot(var)?
        } else {
            self.x0.clone()
        };
        let grad_sq = dense::sq_sum(&dense::grad(grad)?)?;
        let dist_sq = dense::sq_sum(&(&p - &x0)?)?;
        self.x0 = x0;
        shares[0] += grad_sq;
        shares[1] += dist_sq;
        Ok(())
    }

    /// `step.d` is `r²`, `step.dlr` the denominator `√v + 1 − ε`.
    fn apply(&mut self, var: &Var, grad: &Tensor, step: &StepScalars) -> candle_core::Result<()> {
        let g = dense::grad(grad)?.clamp(-self.clip, self.clip)?;
        let r2 = Tensor::new(step.d as f32, g.device())?;
        let denom = Tensor::new(step.dlr as f32, g.device())?;
        let delta = g.broadcast_mul(&r2)?.broadcast_div(&denom)?;
        dense::write(var, &(dense::value(var)? - delta)?)
    }

    fn save(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        Ok(vec![("x0", self.x0.clone())])
    }

    fn load(&mut self, tensors: Vec<Tensor>) -> candle_core::Result<()> {
        let [x0] = dense::place::<1>(tensors, &self.x0, "scalar_dowg")?;
        self.x0 = x0;
        Ok(())
    }

    fn bytes(&self) -> usize {
        4 * self.x0.elem_count()
    }
}
