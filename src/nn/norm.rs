//! The GroupNorm and LayerNorm layers: `y = (x − mean) / sqrt(var + eps) · γ + β`, with the
//! biased variance, statistics in f32 whatever the activation dtype (as torch does for half
//! inputs on CUDA). They run the fused ops of `group_norm.rs`/`layer_norm.rs` (analytic backward,
//! only `x`, `γ`, `β` and per-group statistics kept), or their composed references where custom
//! ops have no forward (Metal) or the fused ops are switched off.

use candle_core::{Result, Tensor};

use super::fused_op::use_fused;
use super::group_norm::{
    group_norm, group_norm_reference, group_norm_silu, group_norm_silu_reference,
};
use super::layer_norm::{layer_norm, layer_norm_reference};
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
        let (w, b, g, eps) = (&self.weight, &self.bias, self.groups, self.eps);
        if use_fused(x) {
            group_norm(x, w, b, g, eps)
        } else {
            group_norm_reference(x, w, b, g, eps)
        }
    }

    /// `silu(self.forward(x))` as one fused op, as diffusers' resnets and `conv_norm_out`s use it.
    pub fn forward_silu(&self, x: &Tensor) -> Result<Tensor> {
        let (w, b, g, eps) = (&self.weight, &self.bias, self.groups, self.eps);
        if use_fused(x) {
            group_norm_silu(x, w, b, g, eps)
        } else {
            group_norm_silu_reference(x, w, b, g, eps)
        }
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
        if use_fused(x) {
            layer_norm(x, &self.weight, &self.bias, self.eps)
        } else {
            layer_norm_reference(x, &self.weight, &self.bias, self.eps)
        }
    }
}
