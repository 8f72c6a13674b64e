//! 2-D convolution with torch's weight layout `[out, in, kh, kw]` (groups = 1, dilation = 1).

use candle_core::{DType, Result, Tensor};

use std::sync::Arc;

use super::{cast_like, BaseWeight, LayerAdapter};
use crate::weights::{Init, Weights, WeightsError};

#[derive(Debug, Clone, Copy)]
pub struct Conv2dConfig {
    pub kernel: usize,
    pub stride: usize,
    pub padding: usize,
}

impl Conv2dConfig {
    pub fn same(kernel: usize) -> Self {
        Self {
            kernel,
            stride: 1,
            padding: kernel / 2,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Conv2d {
    /// The diffusers module path, e.g. `down_blocks.0.resnets.1.conv1`.
    pub path: String,
    /// The weight `[out, in, kh, kw]`, or its e4m3 codes when `weight_scale` is set.
    pub weight: Tensor,
    /// The per-output-channel scales of an fp8 base weight (see [`super::Linear::weight_scale`]).
    pub weight_scale: Option<Tensor>,
    pub bias: Option<Tensor>,
    pub cfg: Conv2dConfig,
    /// A trainable addition (LoCon): `y = conv(x) + adapter.delta(x)`.
    pub adapter: Option<Arc<dyn LayerAdapter>>,
}

impl Conv2d {
    pub fn new(
        w: &Weights,
        in_ch: usize,
        out_ch: usize,
        cfg: Conv2dConfig,
    ) -> std::result::Result<Self, WeightsError> {
        let k = cfg.kernel;
        let bound = 1.0 / ((in_ch * k * k) as f64).sqrt();
        let weight = w.get_init((out_ch, in_ch, k, k), "weight", Init::Uniform(bound))?;
        let (weight, weight_scale) = super::fp8::layer_weight(w, "weight", weight)?;
        let bias = Some(w.get_init(out_ch, "bias", Init::Uniform(bound))?);
        Ok(Self {
            path: w.prefix(),
            weight,
            weight_scale,
            bias,
            cfg,
            adapter: None,
        })
    }

    /// The weight as stored, for the frozen ops.
    pub fn base_weight(&self) -> BaseWeight {
        BaseWeight::of(&self.weight, self.weight_scale.as_ref())
    }

    pub fn in_channels(&self) -> usize {
        self.weight.dims()[1]
    }

    pub fn out_channels(&self) -> usize {
        self.weight.dims()[0]
    }

    /// `base(x) + adapter.delta(x)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_plus(x, None)
    }

    /// `residual + forward(x)` (a transformer's `x + proj_out(…)`): added inside an adapted
    /// frozen layer's op, as [`super::Linear::forward_add`] does.
    pub fn forward_add(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.forward_plus(x, Some(residual))
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
            let base = super::FrozenBase::Conv {
                w: self.base_weight(),
                b: self.bias.as_ref(),
                padding: self.cfg.padding,
                stride: self.cfg.stride,
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

    /// `conv2d(x, W) + b`. A frozen layer (weight and bias plain tensors, not Vars) goes through
    /// [`super::frozen_conv2d_bias`], whose backward computes no weight or bias gradient.
    pub fn base_forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.weight_scale.is_some() {
            // fp8: dequantised in the forward and again in the backward (`handover`).
            return super::handover::frozen_conv2d_stored(
                x,
                &self.base_weight(),
                self.bias.as_ref(),
                self.cfg.padding,
                self.cfg.stride,
            );
        }
        if super::cpu_bf16(x) {
            if x.track_op() && self.is_frozen() {
                return super::handover::frozen_conv2d_stored(
                    x,
                    &self.base_weight(),
                    self.bias.as_ref(),
                    self.cfg.padding,
                    self.cfg.stride,
                );
            }
            return self
                .base_forward(&x.to_dtype(DType::F32)?)?
                .to_dtype(DType::BF16);
        }
        let w = cast_like(&self.weight, x)?;
        if self.is_frozen() && super::frozen::supported(x) {
            let b = self.bias.as_ref().map(|b| cast_like(b, x)).transpose()?;
            return super::frozen_conv2d_bias(x, &w, b.as_ref(), self.cfg.padding, self.cfg.stride);
        }
        // Trainable: the same conv with a GEMM-based input gradient, right for every input shape
        // (candle's own backward is not: see `conv_grad`).
        let y = super::conv_grad::conv2d(x, &w, self.cfg.padding, self.cfg.stride)?;
        match &self.bias {
            Some(b) => {
                let b = cast_like(b, x)?.reshape((1, self.out_channels(), 1, 1))?;
                y.broadcast_add(&b)
            }
            None => Ok(y),
        }
    }
}
