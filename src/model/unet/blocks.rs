//! The UNet's down, mid and up blocks (diffusers' `CrossAttnDownBlock2D`/`DownBlock2D`,
//! `UNetMidBlock2DCrossAttn`, `CrossAttnUpBlock2D`/`UpBlock2D`). Each block is a separable unit
//! with a plain `forward`, so gradient checkpointing can recompute one block at a time.

use candle_core::{Result, Tensor};

use super::config::{BlockConfig, BlockKind};
use super::transformer::{Transformer2DModel, TransformerSpec};
use crate::model::resnet::ResnetBlock2D;
use crate::model::sampling::{Downsample2D, Upsample2D};
use crate::model::weights::{Weights, WeightsError};
use crate::nn::{Checkpointing, LayerMut, VisitLayers};

/// `resnet(x, temb)`, recomputed in backward under checkpointing.
fn run_resnet(
    resnet: &ResnetBlock2D,
    x: &Tensor,
    temb: &Tensor,
    ck: Option<&Checkpointing>,
) -> Result<Tensor> {
    match ck {
        None => resnet.forward(x, Some(temb)),
        Some(ck) => {
            let r = resnet.clone();
            ck.run(
                x,
                Some(temb),
                std::sync::Arc::new(move |x: &Tensor, t: Option<&Tensor>| r.forward(x, t)),
            )
        }
    }
}

/// `resnet(cat(h, skip), temb)`, an up block's resnet. Under checkpointing `h` and `skip` are
/// the segment's inputs and the concatenation happens inside it: the outer graph keeps the skip
/// anyway (it is a down block's output), so keeping their concatenation too would hold the skip
/// twice.
fn run_resnet_on_skip(
    resnet: &ResnetBlock2D,
    h: &Tensor,
    skip: &Tensor,
    temb: &Tensor,
    ck: Option<&Checkpointing>,
) -> Result<Tensor> {
    // A skip from below the first adapter is a constant: no gradient is stored for it.
    let on_skip = |r: &ResnetBlock2D, h: &Tensor, skip: &Tensor, t: &Tensor| {
        r.forward(&crate::nn::cat_with_const(h, skip, 1)?, Some(t))
    };
    match ck {
        None => on_skip(resnet, h, skip, temb),
        Some(ck) => {
            let r = resnet.clone();
            ck.run_n(
                &[h, skip, temb],
                std::sync::Arc::new(move |xs: &[Tensor]| match xs {
                    [h, skip, t] => on_skip(&r, h, skip, t),
                    _ => candle_core::bail!("an up block's resnet lost its inputs"),
                }),
            )
        }
    }
}

/// `attn(x, context)`, recomputed in backward under checkpointing.
fn run_attention(
    attn: &Transformer2DModel,
    x: &Tensor,
    context: &Tensor,
    ck: Option<&Checkpointing>,
) -> Result<Tensor> {
    match ck {
        None => attn.forward(x, context),
        Some(ck) => {
            let a = attn.clone();
            // More than one transformer block: each is a segment too, nested in this one.
            let inner = (a.transformer_blocks.len() > 1).then(|| ck.clone());
            ck.run(
                x,
                Some(context),
                std::sync::Arc::new(move |x: &Tensor, c: Option<&Tensor>| match c {
                    Some(c) => a.forward_layers(x, c, inner.as_ref()),
                    None => candle_core::bail!("checkpointed attention lost its context"),
                }),
            )
        }
    }
}

/// Settings every block shares.
#[derive(Debug, Clone, Copy)]
pub struct BlockCommon {
    pub temb_channels: usize,
    pub groups: usize,
    pub eps: f64,
    pub linear_projection: bool,
}

fn transformer_spec(
    common: BlockCommon,
    cfg: &BlockConfig,
    channels: usize,
    layers: usize,
) -> TransformerSpec {
    TransformerSpec {
        channels,
        heads: cfg.heads,
        layers,
        context_dim: cfg.cross_attention_dim,
        groups: common.groups,
        linear_projection: common.linear_projection,
    }
}

#[derive(Debug, Clone)]
pub struct DownBlock {
    pub resnets: Vec<ResnetBlock2D>,
    pub attentions: Vec<Transformer2DModel>,
    pub downsampler: Option<Downsample2D>,
}

impl DownBlock {
    pub fn new(
        w: &Weights,
        cfg: &BlockConfig,
        common: BlockCommon,
        in_ch: usize,
        out_ch: usize,
        downsample_padding: Option<usize>,
    ) -> std::result::Result<Self, WeightsError> {
        let mut resnets = Vec::with_capacity(cfg.layers);
        let mut attentions = Vec::new();
        for j in 0..cfg.layers {
            let rin = if j == 0 { in_ch } else { out_ch };
            let r = ResnetBlock2D::new(
                &w.pp("resnets").pp(j),
                rin,
                out_ch,
                Some(common.temb_channels),
                common.groups,
                common.eps,
            )?;
            resnets.push(r);
            if cfg.kind == BlockKind::CrossAttn {
                let spec = transformer_spec(common, cfg, out_ch, cfg.transformer_layers);
                attentions.push(Transformer2DModel::new(&w.pp("attentions").pp(j), spec)?);
            }
        }
        let downsampler = match downsample_padding {
            Some(p) => Some(Downsample2D::new(&w.pp("downsamplers").pp(0), out_ch, p)?),
            None => None,
        };
        Ok(Self {
            resnets,
            attentions,
            downsampler,
        })
    }

    /// Returns the block output and the skip tensors it adds (one per resnet, plus the
    /// downsampled output). With `ck`, each resnet and attention is checkpointed.
    pub fn forward(
        &self,
        x: &Tensor,
        temb: &Tensor,
        context: &Tensor,
        ck: Option<&Checkpointing>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let mut h = x.clone();
        let mut skips = Vec::with_capacity(self.resnets.len() + 1);
        for (j, resnet) in self.resnets.iter().enumerate() {
            h = run_resnet(resnet, &h, temb, ck)?;
            if let Some(attn) = self.attentions.get(j) {
                h = run_attention(attn, &h, context, ck)?;
            }
            skips.push(h.clone());
        }
        if let Some(down) = &self.downsampler {
            h = down.forward(&h)?;
            skips.push(h.clone());
        }
        Ok((h, skips))
    }
}

#[derive(Debug, Clone)]
pub struct MidBlock {
    pub resnets: Vec<ResnetBlock2D>,
    pub attentions: Vec<Transformer2DModel>,
}

impl MidBlock {
    /// `cfg` is the last down block's settings, as diffusers uses for the mid block.
    pub fn new(
        w: &Weights,
        cfg: &BlockConfig,
        common: BlockCommon,
        channels: usize,
    ) -> std::result::Result<Self, WeightsError> {
        let resnet = |j: usize| {
            ResnetBlock2D::new(
                &w.pp("resnets").pp(j),
                channels,
                channels,
                Some(common.temb_channels),
                common.groups,
                common.eps,
            )
        };
        let spec = transformer_spec(common, cfg, channels, cfg.transformer_layers);
        Ok(Self {
            resnets: vec![resnet(0)?, resnet(1)?],
            attentions: vec![Transformer2DModel::new(&w.pp("attentions").pp(0), spec)?],
        })
    }

    pub fn forward(
        &self,
        x: &Tensor,
        temb: &Tensor,
        context: &Tensor,
        ck: Option<&Checkpointing>,
    ) -> Result<Tensor> {
        let mut h = run_resnet(&self.resnets[0], x, temb, ck)?;
        for (attn, resnet) in self.attentions.iter().zip(&self.resnets[1..]) {
            h = run_attention(attn, &h, context, ck)?;
            h = run_resnet(resnet, &h, temb, ck)?;
        }
        Ok(h)
    }
}

#[derive(Debug, Clone)]
pub struct UpBlock {
    pub resnets: Vec<ResnetBlock2D>,
    pub attentions: Vec<Transformer2DModel>,
    pub upsampler: Option<Upsample2D>,
}

/// Channel plumbing of one up block, as diffusers computes it.
#[derive(Debug, Clone, Copy)]
pub struct UpChannels {
    /// The block's output width (`reversed_block_out_channels[i]`).
    pub out_ch: usize,
    /// The width of the previous up block's output.
    pub prev_out: usize,
    /// The width of the deepest skip this block consumes (`reversed_block_out_channels[i+1]`).
    pub skip_in: usize,
}

impl UpBlock {
    /// `cfg.layers` is the number of resnets (layers_per_block + 1) for this block.
    pub fn new(
        w: &Weights,
        cfg: &BlockConfig,
        common: BlockCommon,
        ch: UpChannels,
        add_upsample: bool,
    ) -> std::result::Result<Self, WeightsError> {
        let mut resnets = Vec::with_capacity(cfg.layers);
        let mut attentions = Vec::new();
        for j in 0..cfg.layers {
            let skip = if j == cfg.layers - 1 {
                ch.skip_in
            } else {
                ch.out_ch
            };
            let rin = if j == 0 { ch.prev_out } else { ch.out_ch };
            resnets.push(ResnetBlock2D::new(
                &w.pp("resnets").pp(j),
                rin + skip,
                ch.out_ch,
                Some(common.temb_channels),
                common.groups,
                common.eps,
            )?);
            if cfg.kind == BlockKind::CrossAttn {
                let spec = transformer_spec(common, cfg, ch.out_ch, cfg.transformer_layers);
                attentions.push(Transformer2DModel::new(&w.pp("attentions").pp(j), spec)?);
            }
        }
        let upsampler = if add_upsample {
            Some(Upsample2D::new(&w.pp("upsamplers").pp(0), ch.out_ch)?)
        } else {
            None
        };
        Ok(Self {
            resnets,
            attentions,
            upsampler,
        })
    }

    /// `skips` are this block's skip tensors, deepest last (they are consumed from the end).
    /// `upsample_to` is the spatial size of the next block's skips.
    pub fn forward(
        &self,
        x: &Tensor,
        skips: &[Tensor],
        temb: &Tensor,
        context: &Tensor,
        upsample_to: Option<(usize, usize)>,
        ck: Option<&Checkpointing>,
    ) -> Result<Tensor> {
        if skips.len() != self.resnets.len() {
            candle_core::bail!(
                "up block got {} skips for {} resnets",
                skips.len(),
                self.resnets.len()
            );
        }
        let mut h = x.clone();
        for (j, resnet) in self.resnets.iter().enumerate() {
            let skip = &skips[skips.len() - 1 - j];
            h = run_resnet_on_skip(resnet, &h, skip, temb, ck)?;
            if let Some(attn) = self.attentions.get(j) {
                h = run_attention(attn, &h, context, ck)?;
            }
        }
        match &self.upsampler {
            Some(up) => up.forward(&h, upsample_to),
            None => Ok(h),
        }
    }
}

impl VisitLayers for DownBlock {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        for j in 0..self.resnets.len() {
            self.resnets[j].visit_layers(f);
            if let Some(a) = self.attentions.get_mut(j) {
                a.visit_layers(f);
            }
        }
        self.downsampler.visit_layers(f);
    }
}

impl VisitLayers for MidBlock {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        self.resnets[0].visit_layers(f);
        for (a, r) in self.attentions.iter_mut().zip(self.resnets[1..].iter_mut()) {
            a.visit_layers(f);
            r.visit_layers(f);
        }
    }
}

impl VisitLayers for UpBlock {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        for j in 0..self.resnets.len() {
            self.resnets[j].visit_layers(f);
            if let Some(a) = self.attentions.get_mut(j) {
                a.visit_layers(f);
            }
        }
        self.upsampler.visit_layers(f);
    }
}
