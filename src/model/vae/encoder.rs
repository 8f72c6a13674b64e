//! The VAE encoder, diffusers' `Encoder` (`models/autoencoders/vae.py`) with `double_z = True`:
//! `conv_out(silu(conv_norm_out(mid_block(down_blocks(conv_in(x))))))` → `[B, 2·latent, H/f, W/f]`
//! (mean and log-variance stacked on the channels), f = 2^(blocks − 1).
//!
//! Each `DownEncoderBlock2D` is `layers_per_block` resnets and, except on the last block, a
//! stride-2 conv after padding the right and bottom by one (`downsample_padding = 0`).

use candle_core::{Result, Tensor};

use super::config::VaeConfig;
use super::mid_block::{VaeMidBlock, VAE_EPS};
use crate::model::resnet::ResnetBlock2D;
use crate::model::sampling::Downsample2D;
use crate::model::weights::{Weights, WeightsError};
use crate::nn::{Conv2d, Conv2dConfig, GroupNorm, LayerMut, VisitLayers};

/// diffusers' `DownEncoderBlock2D`.
#[derive(Debug, Clone)]
pub struct DownEncoderBlock2D {
    pub resnets: Vec<ResnetBlock2D>,
    pub downsampler: Option<Downsample2D>,
}

impl DownEncoderBlock2D {
    pub fn new(
        w: &Weights,
        in_ch: usize,
        out_ch: usize,
        layers: usize,
        groups: usize,
        add_downsample: bool,
    ) -> std::result::Result<Self, WeightsError> {
        let resnets = (0..layers)
            .map(|j| {
                let cin = if j == 0 { in_ch } else { out_ch };
                ResnetBlock2D::new(&w.pp("resnets").pp(j), cin, out_ch, None, groups, VAE_EPS)
            })
            .collect::<std::result::Result<Vec<_>, WeightsError>>()?;
        let downsampler = if add_downsample {
            Some(Downsample2D::new(&w.pp("downsamplers").pp(0), out_ch, 0)?)
        } else {
            None
        };
        Ok(Self {
            resnets,
            downsampler,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for resnet in &self.resnets {
            h = resnet.forward(&h, None)?;
        }
        match &self.downsampler {
            Some(d) => d.forward(&h),
            None => Ok(h),
        }
    }
}

impl VisitLayers for DownEncoderBlock2D {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        self.resnets.visit_layers(f);
        self.downsampler.visit_layers(f);
    }
}

/// diffusers' `Encoder`.
#[derive(Debug, Clone)]
pub struct Encoder {
    pub conv_in: Conv2d,
    pub down_blocks: Vec<DownEncoderBlock2D>,
    pub mid_block: VaeMidBlock,
    pub conv_norm_out: GroupNorm,
    pub conv_out: Conv2d,
}

impl Encoder {
    /// Reads `<w>.*` (the caller passes `w.pp("encoder")`). `cfg` must be validated.
    pub fn new(w: &Weights, cfg: &VaeConfig) -> std::result::Result<Self, WeightsError> {
        let ch = &cfg.block_out_channels;
        let groups = cfg.norm_num_groups;
        let (first, last) = match (ch.first(), ch.last()) {
            (Some(&first), Some(&last)) => (first, last),
            _ => {
                return Err(WeightsError::Config(
                    "VAE block_out_channels is empty".into(),
                ))
            }
        };
        let conv_in = Conv2d::new(
            &w.pp("conv_in"),
            cfg.in_channels,
            first,
            Conv2dConfig::same(3),
        )?;
        let mut down_blocks = Vec::with_capacity(ch.len());
        let mut in_ch = first;
        for (i, &out_ch) in ch.iter().enumerate() {
            let is_final = i + 1 == ch.len();
            down_blocks.push(DownEncoderBlock2D::new(
                &w.pp("down_blocks").pp(i),
                in_ch,
                out_ch,
                cfg.layers_per_block,
                groups,
                !is_final,
            )?);
            in_ch = out_ch;
        }
        let mid_block = VaeMidBlock::new(
            &w.pp("mid_block"),
            last,
            groups,
            cfg.mid_block_add_attention,
        )?;
        let conv_norm_out = GroupNorm::new(&w.pp("conv_norm_out"), groups, last, VAE_EPS)?;
        let conv_out = Conv2d::new(
            &w.pp("conv_out"),
            last,
            2 * cfg.latent_channels,
            Conv2dConfig::same(3),
        )?;
        Ok(Self {
            conv_in,
            down_blocks,
            mid_block,
            conv_norm_out,
            conv_out,
        })
    }

    /// `x` `[B, in, H, W]` → `[B, 2·latent, H/f, W/f]`. H and W should be multiples of f; other
    /// sizes work as in diffusers (each downsample rounds down after its one-pixel pad).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = self.conv_in.forward(x)?;
        for block in &self.down_blocks {
            h = block.forward(&h)?;
        }
        let h = self.mid_block.forward(&h)?;
        let h = self.conv_norm_out.forward_silu(&h)?;
        self.conv_out.forward(&h)
    }
}

impl VisitLayers for Encoder {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        self.conv_in.visit_layers(f);
        self.down_blocks.visit_layers(f);
        self.mid_block.visit_layers(f);
        self.conv_out.visit_layers(f);
    }
}
