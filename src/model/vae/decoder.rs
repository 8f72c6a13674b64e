//! The VAE decoder, diffusers' `Decoder` (`models/autoencoders/vae.py`) with `norm_type = "group"`:
//! `conv_out(silu(conv_norm_out(up_blocks(mid_block(conv_in(z))))))`, `z` `[B, latent, h, w]` →
//! `[B, out, h·f, w·f]`.
//!
//! The up blocks walk `block_out_channels` reversed. Each `UpDecoderBlock2D` is
//! `layers_per_block + 1` resnets and, except on the last block, a nearest ×2 upsample and 3×3 conv.
//! diffusers casts the mid block's output to the up blocks' parameter dtype; here every layer
//! computes in its input's dtype, so that cast is not needed.

use candle_core::{Result, Tensor};

use super::config::VaeConfig;
use super::mid_block::{VaeMidBlock, VAE_EPS};
use crate::model::resnet::ResnetBlock2D;
use crate::model::sampling::Upsample2D;
use crate::model::weights::{Weights, WeightsError};
use crate::nn::{Conv2d, Conv2dConfig, GroupNorm, LayerMut, VisitLayers};

/// diffusers' `UpDecoderBlock2D`.
#[derive(Debug, Clone)]
pub struct UpDecoderBlock2D {
    pub resnets: Vec<ResnetBlock2D>,
    pub upsampler: Option<Upsample2D>,
}

impl UpDecoderBlock2D {
    pub fn new(
        w: &Weights,
        in_ch: usize,
        out_ch: usize,
        layers: usize,
        groups: usize,
        add_upsample: bool,
    ) -> std::result::Result<Self, WeightsError> {
        let resnets = (0..layers)
            .map(|j| {
                let cin = if j == 0 { in_ch } else { out_ch };
                ResnetBlock2D::new(&w.pp("resnets").pp(j), cin, out_ch, None, groups, VAE_EPS)
            })
            .collect::<std::result::Result<Vec<_>, WeightsError>>()?;
        let upsampler = if add_upsample {
            Some(Upsample2D::new(&w.pp("upsamplers").pp(0), out_ch)?)
        } else {
            None
        };
        Ok(Self { resnets, upsampler })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for resnet in &self.resnets {
            h = resnet.forward(&h, None)?;
        }
        match &self.upsampler {
            Some(u) => u.forward(&h, None),
            None => Ok(h),
        }
    }
}

impl VisitLayers for UpDecoderBlock2D {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        self.resnets.visit_layers(f);
        self.upsampler.visit_layers(f);
    }
}

/// diffusers' `Decoder`.
#[derive(Debug, Clone)]
pub struct Decoder {
    pub conv_in: Conv2d,
    pub mid_block: VaeMidBlock,
    pub up_blocks: Vec<UpDecoderBlock2D>,
    pub conv_norm_out: GroupNorm,
    pub conv_out: Conv2d,
}

impl Decoder {
    /// Reads `<w>.*` (the caller passes `w.pp("decoder")`). `cfg` must be validated.
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
            cfg.latent_channels,
            last,
            Conv2dConfig::same(3),
        )?;
        let mid_block = VaeMidBlock::new(
            &w.pp("mid_block"),
            last,
            groups,
            cfg.mid_block_add_attention,
        )?;
        let mut up_blocks = Vec::with_capacity(ch.len());
        let mut in_ch = last;
        for (i, &out_ch) in ch.iter().rev().enumerate() {
            let is_final = i + 1 == ch.len();
            up_blocks.push(UpDecoderBlock2D::new(
                &w.pp("up_blocks").pp(i),
                in_ch,
                out_ch,
                cfg.layers_per_block + 1,
                groups,
                !is_final,
            )?);
            in_ch = out_ch;
        }
        let conv_norm_out = GroupNorm::new(&w.pp("conv_norm_out"), groups, first, VAE_EPS)?;
        let conv_out = Conv2d::new(
            &w.pp("conv_out"),
            first,
            cfg.out_channels,
            Conv2dConfig::same(3),
        )?;
        Ok(Self {
            conv_in,
            mid_block,
            up_blocks,
            conv_norm_out,
            conv_out,
        })
    }

    /// `z` `[B, latent, h, w]` (after `post_quant_conv`) → `[B, out, h·f, w·f]`.
    pub fn forward(&self, z: &Tensor) -> Result<Tensor> {
        let mut h = self.mid_block.forward(&self.conv_in.forward(z)?)?;
        for block in &self.up_blocks {
            h = block.forward(&h)?;
        }
        let h = self.conv_norm_out.forward_silu(&h)?;
        self.conv_out.forward(&h)
    }
}

impl VisitLayers for Decoder {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        self.conv_in.visit_layers(f);
        self.mid_block.visit_layers(f);
        self.up_blocks.visit_layers(f);
        self.conv_out.visit_layers(f);
    }
}
