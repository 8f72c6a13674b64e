//! diffusers' `Downsample2D` and `Upsample2D` (the conv variants SD uses).
//! - Down: a 3×3 stride-2 conv. With `padding = 0` (the VAE encoder) the input is first padded
//!   by one on the right and bottom only, as diffusers does.
//! - Up: nearest-neighbour ×2 (or to an explicit size), then a 3×3 conv.

use candle_core::{Result, Tensor};

use super::weights::{Weights, WeightsError};
use crate::nn::{Conv2d, Conv2dConfig, LayerMut, VisitLayers};

#[derive(Debug, Clone)]
pub struct Downsample2D {
    pub conv: Conv2d,
    asymmetric_pad: bool,
}

impl Downsample2D {
    /// Reads `<w>.conv`. `padding` is the model's `downsample_padding` (1 in the UNet, 0 in the
    /// VAE encoder).
    pub fn new(
        w: &Weights,
        channels: usize,
        padding: usize,
    ) -> std::result::Result<Self, WeightsError> {
        let cfg = Conv2dConfig {
            kernel: 3,
            stride: 2,
            padding,
        };
        Ok(Self {
            conv: Conv2d::new(&w.pp("conv"), channels, channels, cfg)?,
            asymmetric_pad: padding == 0,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.asymmetric_pad {
            let x = x.pad_with_zeros(3, 0, 1)?.pad_with_zeros(2, 0, 1)?;
            self.conv.forward(&x)
        } else {
            self.conv.forward(x)
        }
    }
}

#[derive(Debug, Clone)]
pub struct Upsample2D {
    pub conv: Conv2d,
}

impl Upsample2D {
    pub fn new(w: &Weights, channels: usize) -> std::result::Result<Self, WeightsError> {
        Ok(Self {
            conv: Conv2d::new(&w.pp("conv"), channels, channels, Conv2dConfig::same(3))?,
        })
    }

    /// Upsamples to `size` `(h, w)` when given (the UNet passes its skip's size), else ×2.
    /// Only integer factors are supported (`nn::upsample_nearest` repeats each value over a
    /// whole block).
    pub fn forward(&self, x: &Tensor, size: Option<(usize, usize)>) -> Result<Tensor> {
        let (_, _, h, w) = x.dims4()?;
        let (th, tw) = size.unwrap_or((h * 2, w * 2));
        if th % h != 0 || tw % w != 0 {
            candle_core::bail!(
                "upsampling {h}x{w} to {th}x{tw} is not an integer factor; use a latent size that \
                 is a multiple of the UNet's total downsampling"
            );
        }
        let up = crate::nn::upsample_nearest(x, th / h, tw / w)?;
        self.conv.forward(&up)
    }
}

impl VisitLayers for Downsample2D {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        self.conv.visit_layers(f)
    }
}

impl VisitLayers for Upsample2D {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        self.conv.visit_layers(f)
    }
}
