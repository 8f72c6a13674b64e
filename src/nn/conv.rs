//! 2-D convolution with torch's weight layout `[out, in, kh, kw]` (groups = 1, dilation = 1).

use candle_core::{DType, Result, Tensor};

use std::sync::Arc;

use super::{cast_like, LayerAdapter};
use crate::model::weights::{Init, Weights, WeightsError};

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
    pub weight: Tensor,
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
        let bias = Some(w.get_init(out_ch, "bias", Init::Uniform(bound))?);
        Ok(Self {
            path: w.prefix(),
            weight,
            bias,
            cfg,
            adapter: None,
        })
    }

    pub fn in_channels(&self) -> usize {
        self.weight.dims()[1]
    }

    pub fn out_channels(&self) -> usize {
        self.weight.dims()[0]
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if super::cpu_bf16(x) {
            return self
                .forward(&x.to_dtype(DType::F32)?)?
                .to_dtype(DType::BF16);
        }
        let w = cast_like(&self.weight, x)?;
        let y = x.conv2d(&w, self.cfg.padding, self.cfg.stride, 1, 1)?;
        match &self.bias {
            Some(b) => {
                let b = cast_like(b, x)?.reshape((1, self.out_channels(), 1, 1))?;
                y.broadcast_add(&b)
            }
            None => Ok(y),
        }
    }
}
