//! diffusers' `ResnetBlock2D` (default time-embedding norm, no up/down inside), shared by the UNet
//! (with a time embedding) and the VAE (without):
//! `out = shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))) + proj(silu(temb)))))`.

use candle_core::{Result, Tensor};

use super::weights::{Weights, WeightsError};
use crate::nn::{
    group_norm_silu_conv, group_norm_silu_conv_applies, silu, Conv2d, Conv2dConfig, Extra,
    GroupNorm, LayerMut, Linear, VisitLayers,
};

#[derive(Debug, Clone)]
pub struct ResnetBlock2D {
    pub norm1: GroupNorm,
    pub conv1: Conv2d,
    pub time_emb_proj: Option<Linear>,
    pub norm2: GroupNorm,
    pub conv2: Conv2d,
    pub conv_shortcut: Option<Conv2d>,
}

impl ResnetBlock2D {
    /// `temb_channels` is `None` for the VAE's blocks.
    pub fn new(
        w: &Weights,
        in_ch: usize,
        out_ch: usize,
        temb_channels: Option<usize>,
        groups: usize,
        eps: f64,
    ) -> std::result::Result<Self, WeightsError> {
        let time_emb_proj = match temb_channels {
            Some(t) => Some(Linear::new(&w.pp("time_emb_proj"), t, out_ch, true)?),
            None => None,
        };
        let conv_shortcut = if in_ch != out_ch {
            Some(Conv2d::new(
                &w.pp("conv_shortcut"),
                in_ch,
                out_ch,
                Conv2dConfig::same(1),
            )?)
        } else {
            None
        };
        Ok(Self {
            norm1: GroupNorm::new(&w.pp("norm1"), groups, in_ch, eps)?,
            conv1: Conv2d::new(&w.pp("conv1"), in_ch, out_ch, Conv2dConfig::same(3))?,
            time_emb_proj,
            norm2: GroupNorm::new(&w.pp("norm2"), groups, out_ch, eps)?,
            conv2: Conv2d::new(&w.pp("conv2"), out_ch, out_ch, Conv2dConfig::same(3))?,
            conv_shortcut,
        })
    }

    /// `x` `[B, C, H, W]`, `temb` `[B, T]` (the UNet's, before its SiLU).
    pub fn forward(&self, x: &Tensor, temb: Option<&Tensor>) -> Result<Tensor> {
        let t = match (&self.time_emb_proj, temb) {
            (Some(proj), Some(t)) => Some(proj.forward(&silu(t)?)?),
            _ => None,
        };
        if let Some(out) = self.forward_frozen(x, t.as_ref())? {
            return Ok(out);
        }
        let mut h = self.conv1.forward(&self.norm1.forward_silu(x)?)?;
        if let Some(t) = t {
            let t = t.unsqueeze(2)?.unsqueeze(3)?;
            // A frozen projection of a frozen embedding is a constant: store no gradient for it.
            h = crate::nn::broadcast_add_const(&h, &t)?;
        }
        let h = self.conv2.forward(&self.norm2.forward_silu(&h)?)?;
        let shortcut = match &self.conv_shortcut {
            Some(c) => c.forward(x)?,
            None => x.clone(),
        };
        crate::nn::add_maybe_const(&shortcut, &h)
    }
}

impl ResnetBlock2D {
    /// Both halves as [`group_norm_silu_conv`] ops when the block is frozen and carries no
    /// adapter: the graph keeps the block's input, the first half's output and the time
    /// embedding, not the norms' and convs' outputs. `None`: compose the layers.
    fn forward_frozen(&self, x: &Tensor, t: Option<&Tensor>) -> Result<Option<Tensor>> {
        let Some(t) = t else {
            return Ok(None);
        };
        let second = |r| match &self.conv_shortcut {
            Some(c) => Extra::Shortcut(r, c),
            None => Extra::Residual(r),
        };
        // Both halves or neither, so the first is never computed twice. The first half's output
        // has `x`'s dtype and device, which is what the second one's checks read.
        let both = group_norm_silu_conv_applies(x, &self.norm1, &self.conv1, &Extra::Channels(t))
            && group_norm_silu_conv_applies(x, &self.norm2, &self.conv2, &second(x));
        if !both {
            return Ok(None);
        }
        let Some(h) = group_norm_silu_conv(x, &self.norm1, &self.conv1, Extra::Channels(t))? else {
            return Ok(None);
        };
        group_norm_silu_conv(&h, &self.norm2, &self.conv2, second(x))
    }
}

impl VisitLayers for ResnetBlock2D {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        self.conv1.visit_layers(f);
        self.time_emb_proj.visit_layers(f);
        self.conv2.visit_layers(f);
        self.conv_shortcut.visit_layers(f);
    }
}
