//! GroupNorm and LayerNorm written from differentiable primitives. Statistics are taken in f32
//! whatever the activation dtype (as torch does for half inputs on CUDA), then cast back.
//!
//! `y = (x − mean) / sqrt(var + eps) · γ + β`, with the biased variance.

use candle_core::{DType, Result, Tensor, D};

use super::frozen::{broadcast_add_const, broadcast_mul_const};
use crate::weights::{Init, Weights, WeightsError};

#[derive(Debug, Clone)]
pub struct GroupNorm {
    pub path: String,
    pub weight: Tensor,
    pub bias: Tensor,
    pub groups: usize,
    pub eps: f64,
}

impl GroupNorm {
    pub fn new(
        w: &Weights,
        groups: usize,
        channels: usize,
        eps: f64,
    ) -> std::result::Result<Self, WeightsError> {
        if groups == 0 || !channels.is_multiple_of(groups) {
            return Err(WeightsError::Config(format!(
                "{}: {channels} channels cannot be split into {groups} groups",
                w.prefix()
            )));
        }
        Ok(Self {
            path: w.prefix(),
            weight: w.get_init(channels, "weight", Init::Ones)?,
            bias: w.get_init(channels, "bias", Init::Zeros)?,
            groups,
            eps,
        })
    }

    /// `x`: `[B, C, ...]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let dims = x.dims().to_vec();
        let (b, c) = (dims[0], dims[1]);
        let xg = x.to_dtype(DType::F32)?.reshape((b, self.groups, ()))?;
        let mean = xg.mean_keepdim(2)?;
        let xc = xg.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(2)?;
        let xn = xc.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        let mut affine_shape = vec![1usize; dims.len()];
        affine_shape[1] = c;
        let w = self
            .weight
            .to_dtype(DType::F32)?
            .reshape(affine_shape.as_slice())?;
        let bias = self
            .bias
            .to_dtype(DType::F32)?
            .reshape(affine_shape.as_slice())?;
        xn.reshape(dims.as_slice())?
            .apply(&|t: &Tensor| broadcast_mul_const(t, &w))?
            .apply(&|t: &Tensor| broadcast_add_const(t, &bias))?
            .to_dtype(dtype)
    }
}

#[derive(Debug, Clone)]
pub struct LayerNorm {
    pub path: String,
    pub weight: Tensor,
    pub bias: Tensor,
    pub eps: f64,
}

impl LayerNorm {
    pub fn new(w: &Weights, dim: usize, eps: f64) -> std::result::Result<Self, WeightsError> {
        Ok(Self {
            path: w.prefix(),
            weight: w.get_init(dim, "weight", Init::Ones)?,
            bias: w.get_init(dim, "bias", Init::Zeros)?,
            eps,
        })
    }

    /// Normalises over the last dimension.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let x32 = x.to_dtype(DType::F32)?;
        let mean = x32.mean_keepdim(D::Minus1)?;
        let xc = x32.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
        let xn = xc.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        let w = self.weight.to_dtype(DType::F32)?;
        let b = self.bias.to_dtype(DType::F32)?;
        broadcast_add_const(&broadcast_mul_const(&xn, &w)?, &b)?.to_dtype(dtype)
    }
}
