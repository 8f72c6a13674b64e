//! A frozen layer's weight as it is stored, and the weight in the dtype a layer computes in.
//!
//! Stored either as the tensor itself, or, with `base_weight_dtype: "fp8"`, as e4m3 codes with a
//! scale per output channel ([`super::fp8`]). The frozen ops hold a [`BaseWeight`] for their
//! backward, not the weight they computed with: an fp8 weight is dequantised in the forward and
//! again in the backward, so between the two only its codes (one byte per weight) stay in memory.

use candle_core::{DType, Result, Tensor};

/// A frozen weight as stored: cheap to clone (the tensors share their storage).
#[derive(Clone, Debug)]
pub struct BaseWeight {
    stored: Tensor,
    /// The row scales when `stored` holds e4m3 codes.
    scale: Option<Tensor>,
}

impl BaseWeight {
    /// A weight stored as itself.
    pub fn plain(w: &Tensor) -> Self {
        Self {
            stored: w.clone(),
            scale: None,
        }
    }

    /// A layer's `weight` and `weight_scale` fields: e4m3 codes when there is a scale.
    pub fn of(weight: &Tensor, scale: Option<&Tensor>) -> Self {
        Self {
            stored: weight.clone(),
            scale: scale.cloned(),
        }
    }

    /// `w` quantised to e4m3 with a scale per output channel; `name` names it in errors.
    pub fn quantized(w: &Tensor, name: &str) -> Result<Self> {
        let (codes, scale) = super::fp8::quantize(w, name)?;
        Ok(Self {
            stored: codes,
            scale: Some(scale),
        })
    }

    pub fn dims(&self) -> &[usize] {
        self.stored.dims()
    }

    /// The weight in `dtype`, detached: dequantised for fp8, else the stored tensor (cast when
    /// its dtype differs).
    pub fn get(&self, dtype: DType) -> Result<Tensor> {
        match &self.scale {
            Some(scale) => super::fp8::dequantize(&self.stored, scale, dtype),
            None => self.stored.detach().to_dtype(dtype),
        }
    }
}
