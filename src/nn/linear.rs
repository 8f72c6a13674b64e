//! `y = x·Wᵀ + b` over the last dimension, with W `[out, in]` as torch stores it.

use candle_core::{DType, Result, Tensor};

use std::sync::Arc;

use super::{cast_like, BaseWeight, LayerAdapter};
use crate::weights::{Init, Weights, WeightsError};

#[derive(Debug, Clone)]
pub struct Linear {
    /// The diffusers/transformers module path, e.g. `down_blocks.1.attentions.0.proj_in`.
    pub path: String,
    /// The weight `[out, in]`, or its e4m3 codes when `weight_scale` is set.
    pub weight: Tensor,
    /// The per-output-channel scales of an fp8 base weight (`base_weight_dtype: "fp8"`): the
    /// layer is then frozen, and [`BaseWeight`] dequantises the weight where it is used.
    pub weight_scale: Option<Tensor>,
    pub bias: Option<Tensor>,
    /// A trainable addition (LoRA): `y = x·Wᵀ + b + adapter.delta(x)`.
    pub adapter: Option<Arc<dyn LayerAdapter>>,
}

impl Linear {
    /// Loads `<prefix>.weight` `[out, in]` and, if `bias`, `<prefix>.bias` `[out]`.
    pub fn new(
        w: &Weights,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> std::result::Result<Self, WeightsError> {
        let bound = 1.0 / (in_dim as f64).sqrt();
        let weight = w.get_init((out_dim, in_dim), "weight", Init::Uniform(bound))?;
        let (weight, weight_scale) = super::fp8::layer_weight(w, "weight", weight)?;
        let bias = if bias {
            Some(w.get_init(out_dim, "bias", Init::Uniform(bound))?)
        } else {
            None
        };
        Ok(Self {
            path: w.prefix(),
            weight,
            weight_scale,
            bias,
            adapter: None,
        })
    }

    /// The weight as stored, for the frozen ops.
    pub fn base_weight(&self) -> BaseWeight {
        BaseWeight::of(&self.weight, self.weight_scale.as_ref())
    }

    pub fn in_dim(&self) -> usize {
        self.weight.dims()[1]
    }

    pub fn out_dim(&self) -> usize {
        self.weight.dims()[0]
    }

    /// `base(x) + adapter.delta(x)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_plus(x, None)
    }

    /// `residual + forward(x)`, the residual add after a layer (a transformer block's `x +
    /// to_out(…)`). An adapted frozen layer adds it inside its op, which then keeps no
    /// output-sized tensor of its own for the backward (`nn::low_rank`); the values are those of
    /// the add.
    pub fn forward_add(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.forward_plus(x, Some(residual))
    }

    /// `residual + forward(geglu(p))`, for the feed-forward's output layer: an adapted frozen
    /// layer runs the GEGLU inside its op and keeps only `p` (`nn::geglu_low_rank`); otherwise
    /// the GEGLU is its own op ([`super::geglu_layer`]) before [`Self::forward_add`].
    pub fn forward_geglu_add(&self, p: &Tensor, residual: &Tensor) -> Result<Tensor> {
        if let Some(a) = self.adapter.as_ref().filter(|a| a.active()) {
            if self.is_frozen() && super::frozen::supported(p) && super::fused_op::use_fused(p) {
                let base = super::FrozenBase::Linear {
                    w: self.base_weight(),
                    b: self.bias.as_ref(),
                };
                let geglu = super::DerivedInput::Geglu;
                if let Some(y) = a.forward_frozen_on(p, &geglu, None, base, Some(residual)) {
                    return y;
                }
            }
        }
        self.forward_add(&super::geglu_layer(p)?, residual)
    }

    /// `forward(norm(x))` for the norm's output `n`: an adapted frozen layer after a frozen norm
    /// takes the norm inside its op and keeps only `x` (`nn::low_rank_input`); otherwise the
    /// norm's output is a tensor of the graph, made once for the layers that share it.
    pub fn forward_normed(&self, n: &super::Normed<'_>) -> Result<Tensor> {
        if let (Some(a), Some(input)) = (self.adapter.as_ref().filter(|a| a.active()), n.derived())
        {
            if a.derives_inputs() && self.is_frozen() && super::frozen::supported(n.x) {
                let base = super::FrozenBase::Linear {
                    w: self.base_weight(),
                    b: self.bias.as_ref(),
                };
                if let Some(y) = a.forward_frozen_on(n.x, &input, Some(n.value()?), base, None) {
                    return y;
                }
            }
        }
        self.forward(n.tracked()?)
    }

    fn forward_plus(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
        let plus = |y: Tensor| match residual {
            Some(r) => super::add_maybe_const(&y, r),
            None => Ok(y),
        };
        let Some(a) = self.adapter.as_ref().filter(|a| a.active()) else {
            return plus(self.base_forward(x)?);
        };
        if self.is_frozen() && super::frozen::supported(x) {
            let base = super::FrozenBase::Linear {
                w: self.base_weight(),
                b: self.bias.as_ref(),
            };
            if let Some(y) = a.forward_frozen(x, base, residual) {
                return y;
            }
        }
        // A frozen layer on an untracked input has an untracked output: `add_maybe_const`
        // stores no gradient for it.
        plus(super::add_maybe_const(
            &self.base_forward(x)?,
            &a.delta_on(x, &self.base_weight())?,
        )?)
    }

    /// Whether the weight and the bias are plain tensors (no gradient wanted).
    fn is_frozen(&self) -> bool {
        super::frozen::is_frozen(&self.weight)
            && self.bias.as_ref().is_none_or(super::frozen::is_frozen)
    }

    /// `x·Wᵀ + b`. A frozen layer (weight and bias plain tensors, not Vars) goes through
    /// [`super::frozen_linear`], whose backward computes no weight or bias gradient.
    pub fn base_forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.weight_scale.is_some() {
            // fp8: dequantised in the forward and again in the backward (`handover`).
            return super::handover::frozen_linear_stored(
                x,
                &self.base_weight(),
                self.bias.as_ref(),
            );
        }
        if super::cpu_bf16(x) {
            if x.track_op() && self.is_frozen() {
                return super::handover::frozen_linear_stored(
                    x,
                    &self.base_weight(),
                    self.bias.as_ref(),
                );
            }
            return self
                .base_forward(&x.to_dtype(DType::F32)?)?
                .to_dtype(DType::BF16);
        }
        let w = cast_like(&self.weight, x)?;
        let dims = x.dims().to_vec();
        let in_dim = dims[dims.len() - 1];
        let rows = x.elem_count() / in_dim.max(1);
        let x2d = x.reshape((rows, in_dim))?;
        let frozen = super::frozen::is_frozen(&self.weight)
            && self.bias.as_ref().is_none_or(super::frozen::is_frozen)
            && super::frozen::supported(x);
        let y = if frozen {
            let b = self.bias.as_ref().map(|b| cast_like(b, x)).transpose()?;
            super::frozen_linear(&x2d, &w, b.as_ref())?
        } else {
            let y = x2d.matmul(&w.t()?)?;
            match &self.bias {
                Some(b) => y.broadcast_add(&cast_like(b, x)?)?,
                None => y,
            }
        };
        let mut out_dims = dims;
        let last = out_dims.len() - 1;
        out_dims[last] = self.out_dim();
        y.reshape(out_dims)
    }
}
