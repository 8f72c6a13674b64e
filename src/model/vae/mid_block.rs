//! The VAE's middle block, diffusers' `UNetMidBlock2D` as `Encoder`/`Decoder` build it (no time
//! embedding, output_scale_factor 1): `resnets.0 → attentions.0 → resnets.1`.
//!
//! The attention is diffusers' `Attention(C, heads = C / attention_head_dim, dim_head =
//! attention_head_dim, eps = 1e-6, norm_num_groups = resnet_groups, residual_connection = True,
//! rescale_output_factor = 1, bias = True)` with `attention_head_dim = C`, i.e. a single head:
//! `out = x + to_out(softmax(q·kᵀ/√C)·v)` over the H·W positions, where q, k, v are projections
//! of `group_norm(x)`. The scores are an f32 `[B, 1, HW, HW]` buffer: 64 MiB per sample for a
//! 512 px image (64×64 latent positions), 1 GiB at 1024 px.

use candle_core::{Result, Tensor};

use crate::model::attention::Attention;
use crate::model::resnet::ResnetBlock2D;
use crate::model::weights::{Weights, WeightsError};
use crate::nn::{GroupNorm, LayerMut, Linear, VisitLayers};

/// The epsilon diffusers passes to every VAE resnet, norm and the mid-block attention's norm.
pub const VAE_EPS: f64 = 1e-6;

/// The mid-block self-attention with its group norm and residual.
#[derive(Debug, Clone)]
pub struct VaeAttention {
    pub group_norm: GroupNorm,
    pub attn: Attention,
}

impl VaeAttention {
    /// Reads `<w>.group_norm` and the projections. Current diffusers files name them
    /// `to_q/to_k/to_v/to_out.0`; VAEs saved by diffusers before 0.14 use the deprecated
    /// `query/key/value/proj_attn` (the same Linear shapes), which diffusers still converts on load,
    /// so both are accepted here.
    pub fn new(
        w: &Weights,
        channels: usize,
        groups: usize,
    ) -> std::result::Result<Self, WeightsError> {
        let group_norm = GroupNorm::new(&w.pp("group_norm"), groups, channels, VAE_EPS)?;
        let attn = if w.contains("to_q.weight") || !w.contains("query.weight") {
            Attention::new(w, channels, None, 1, channels, true)?
        } else {
            Attention {
                to_q: Linear::new(&w.pp("query"), channels, channels, true)?,
                to_k: Linear::new(&w.pp("key"), channels, channels, true)?,
                to_v: Linear::new(&w.pp("value"), channels, channels, true)?,
                to_out: Linear::new(&w.pp("proj_attn"), channels, channels, true)?,
                heads: 1,
            }
        };
        Ok(Self { group_norm, attn })
    }

    /// `x` `[B, C, H, W]` → `[B, C, H, W]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, c, h, w) = x.dims4()?;
        let tokens = self
            .group_norm
            .forward(x)?
            .reshape((b, c, h * w))?
            .transpose(1, 2)?;
        let out = self.attn.forward(&tokens, None)?;
        let out = out.transpose(1, 2)?.reshape((b, c, h, w))?;
        x + out
    }
}

impl VisitLayers for VaeAttention {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        self.attn.visit_layers(f)
    }
}

/// `resnets.0`, optional `attentions.0` (`mid_block_add_attention`), `resnets.1`.
#[derive(Debug, Clone)]
pub struct VaeMidBlock {
    pub resnets: Vec<ResnetBlock2D>,
    pub attention: Option<VaeAttention>,
}

impl VaeMidBlock {
    pub fn new(
        w: &Weights,
        channels: usize,
        groups: usize,
        add_attention: bool,
    ) -> std::result::Result<Self, WeightsError> {
        let resnet = |i: usize| {
            ResnetBlock2D::new(
                &w.pp("resnets").pp(i),
                channels,
                channels,
                None,
                groups,
                VAE_EPS,
            )
        };
        let first = resnet(0)?;
        let attention = if add_attention {
            Some(VaeAttention::new(
                &w.pp("attentions").pp(0),
                channels,
                groups,
            )?)
        } else {
            None
        };
        let second = resnet(1)?;
        Ok(Self {
            resnets: vec![first, second],
            attention,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let Some((first, rest)) = self.resnets.split_first() else {
            candle_core::bail!("VAE mid block has no resnets")
        };
        let mut h = first.forward(x, None)?;
        if let Some(attn) = &self.attention {
            h = attn.forward(&h)?;
        }
        for resnet in rest {
            h = resnet.forward(&h, None)?;
        }
        Ok(h)
    }
}

impl VisitLayers for VaeMidBlock {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        if let Some((first, rest)) = self.resnets.split_first_mut() {
            first.visit_layers(f);
            self.attention.visit_layers(f);
            for resnet in rest {
                resnet.visit_layers(f);
            }
        }
    }
}
