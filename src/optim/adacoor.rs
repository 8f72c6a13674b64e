//! AdaCoor, EveryDream2's own learning-rate-free optimizer (optimizer/adacoor.py): a
//! coordinate-wise AdaGrad whose accumulator is scaled by ε and kept in bf16.
//!
//! ```text
//! v ← v + bf16(ε·g²)        (v in bf16, ε rounded to bf16 as the reference's tensor holds it)
//! p ← p − ε·g / bf16(√v + ε)
//! ```
//!
//! The group's lr and its schedule do not enter the update (the reference fixes lr at 1).
//! EveryDream2 passes its `epsilon` (1e-8 by default). The state is 2 bytes per parameter.

use candle_core::{DType, Tensor, Var};
use half::bf16;
use serde::Serialize;

use super::dense;
use super::hyper::invalid;
use super::rule::{ParamState, UpdateRule};
use super::Result;

/// AdaCoor's hyper-parameter.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AdaCoorParams {
    pub eps: f64,
}

/// The AdaCoor rule.
#[derive(Debug, Clone, Copy)]
pub struct AdaCoor {
    hyper: AdaCoorParams,
}

impl AdaCoor {
    pub fn rule(hyper: AdaCoorParams) -> Result<Self> {
        if !(hyper.eps.is_finite() && hyper.eps > 0.0) {
            return Err(invalid("eps", hyper.eps, "must be greater than 0"));
        }
        Ok(Self { hyper })
    }
}

impl UpdateRule for AdaCoor {
    fn name(&self) -> &'static str {
        "adacoor"
    }

    fn init(&self, var: &Var) -> candle_core::Result<Box<dyn ParamState>> {
        #[cfg(feature = "cuda")]
        if let Some(state) =
            super::adaptive_cuda::on_cuda(var, super::adaptive_args::AdaCoorKernel(self.hyper))?
        {
            return Ok(state);
        }
        Ok(Box::new(State {
            eps: self.hyper.eps,
            v: Tensor::zeros(var.shape(), DType::BF16, var.device())?,
        }))
    }

    fn hyper_json(&self) -> serde_json::Value {
        serde_json::to_value(self.hyper).unwrap_or_default()
    }

    fn state_bytes(&self, shape: &[usize]) -> usize {
        2 * shape.iter().product::<usize>()
    }
}

struct State {
    eps: f64,
    /// The bf16 accumulator.
    v: Tensor,
}

impl ParamState for State {
    fn update(&mut self, var: &Var, grad: &Tensor, _lr: f64, _t: u64) -> candle_core::Result<()> {
        // The reference's ε is a bf16 tensor; products with the f32 gradient are f32.
        let eps_bf16 = f64::from(bf16::from_f64(self.eps).to_f32());
        let g = dense::grad(grad)?;
        let added = (g.sqr()? * eps_bf16)?.to_dtype(DType::BF16)?;
        let v =
            (self.v.to_dtype(DType::F32)? + added.to_dtype(DType::F32)?)?.to_dtype(DType::BF16)?;
        let denom = v
            .sqrt()?
            .to_dtype(DType::F32)?
            .affine(1.0, self.eps)?
            .to_dtype(DType::BF16)?
            .to_dtype(DType::F32)?;
        let step = ((g * eps_bf16)? / denom)?;
        dense::write(var, &(dense::value(var)? - step)?)?;
        self.v = v;
        Ok(())
    }

    fn save(&self) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        Ok(vec![("vt", self.v.clone())])
    }

    fn load(&mut self, tensors: Vec<Tensor>) -> candle_core::Result<()> {
        let [v] = dense::place::<1>(tensors, &self.v, "adacoor")?;
        self.v = v;
        Ok(())
    }

    fn bytes(&self) -> usize {
        2 * self.v.elem_count()
    }
}
