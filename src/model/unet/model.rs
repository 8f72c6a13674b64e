//! `UNet2DConditionModel`: conv_in → down blocks → mid block → up blocks (with skips) → norm,
//! SiLU, conv_out. Timesteps are per sample (`[B]`). SDXL adds `text_time` conditioning:
//! `emb += add_embedding(cat(text_embeds, flatten(sinusoid(time_ids))))`.

use candle_core::{Result, Tensor};

use super::blocks::{BlockCommon, DownBlock, MidBlock, UpBlock, UpChannels};
use super::checkpoint_blocks::{BlockRef, CheckpointedBlocks};
use super::config::{BlockConfig, UnetConfig};
use super::embeddings::{timestep_embedding, TimestepEmbedding};
use crate::model::weights::{Weights, WeightsError};
use crate::nn::{Conv2d, Conv2dConfig, GroupNorm, LayerMut, VisitLayers};

/// SDXL's added conditions.
#[derive(Debug, Clone)]
pub struct AddedConditions {
    /// Pooled, projected text embedding of the second text encoder `[B, 1280]`.
    pub text_embeds: Tensor,
    /// `[B, 6]`: original size (h, w), crop top-left (y, x), target size (h, w).
    pub time_ids: Tensor,
}

#[derive(Debug, Clone)]
pub struct UNet2DConditionModel {
    pub config: UnetConfig,
    pub conv_in: Conv2d,
    pub time_embedding: TimestepEmbedding,
    pub add_embedding: Option<TimestepEmbedding>,
    pub down_blocks: Vec<DownBlock>,
    pub mid_block: MidBlock,
    pub up_blocks: Vec<UpBlock>,
    pub conv_norm_out: GroupNorm,
    pub conv_out: Conv2d,
    /// Gradient checkpointing of the resnets and transformer blocks of `checkpointed`, when set.
    pub checkpointing: Option<crate::nn::Checkpointing>,
    /// The blocks `checkpointing` applies to (every block unless `"auto"` chose fewer).
    pub checkpointed: CheckpointedBlocks,
}

impl UNet2DConditionModel {
    /// Builds the model from `w` (rooted at the unet's checkpoint keys).
    pub fn new(w: &Weights, cfg: &UnetConfig) -> std::result::Result<Self, WeightsError> {
        let boc = &cfg.block_out_channels;
        let n = boc.len();
        let temb = cfg.time_embed_dim();
        let common = BlockCommon {
            temb_channels: temb,
            groups: cfg.norm_num_groups,
            eps: cfg.norm_eps,
            linear_projection: cfg.use_linear_projection,
        };
        let conv_in = Conv2d::new(
            &w.pp("conv_in"),
            cfg.in_channels,
            boc[0],
            Conv2dConfig::same(3),
        )?;
        let time_embedding = TimestepEmbedding::new(&w.pp("time_embedding"), boc[0], temb)?;
        let add_embedding = match &cfg.text_time {
            Some(tt) => Some(TimestepEmbedding::new(
                &w.pp("add_embedding"),
                tt.input_dim,
                temb,
            )?),
            None => None,
        };
        let down_blocks = Self::new_down_blocks(w, cfg, common)?;
        let mid_block = MidBlock::new(
            &w.pp("mid_block"),
            &cfg.down_blocks[n - 1],
            common,
            boc[n - 1],
        )?;
        let up_blocks = Self::new_up_blocks(w, cfg, common)?;
        Ok(Self {
            config: cfg.clone(),
            conv_in,
            time_embedding,
            add_embedding,
            down_blocks,
            mid_block,
            up_blocks,
            conv_norm_out: GroupNorm::new(
                &w.pp("conv_norm_out"),
                cfg.norm_num_groups,
                boc[0],
                cfg.norm_eps,
            )?,
            conv_out: Conv2d::new(
                &w.pp("conv_out"),
                boc[0],
                cfg.out_channels,
                Conv2dConfig::same(3),
            )?,
            checkpointing: None,
            checkpointed: CheckpointedBlocks::all(cfg),
        })
    }

    /// Builds the down blocks, each taking the previous block's output channels.
    fn new_down_blocks(
        w: &Weights,
        cfg: &UnetConfig,
        common: BlockCommon,
    ) -> std::result::Result<Vec<DownBlock>, WeightsError> {
        let boc = &cfg.block_out_channels;
        let n = boc.len();
        let mut down_blocks = Vec::with_capacity(n);
        let mut out_ch = boc[0];
        for (i, bc) in cfg.down_blocks.iter().enumerate() {
            let in_ch = out_ch;
            out_ch = boc[i];
            let pad = (i + 1 < n).then_some(cfg.downsample_padding);
            down_blocks.push(DownBlock::new(
                &w.pp("down_blocks").pp(i),
                bc,
                common,
                in_ch,
                out_ch,
                pad,
            )?);
        }
        Ok(down_blocks)
    }

    /// Builds the up blocks, mirroring the down blocks with one extra layer each.
    fn new_up_blocks(
        w: &Weights,
        cfg: &UnetConfig,
        common: BlockCommon,
    ) -> std::result::Result<Vec<UpBlock>, WeightsError> {
        let boc = &cfg.block_out_channels;
        let n = boc.len();
        let mut up_blocks = Vec::with_capacity(n);
        let rev: Vec<usize> = boc.iter().rev().copied().collect();
        let mut out_ch = rev[0];
        for (i, kind) in cfg.up_kinds.iter().enumerate() {
            let down = &cfg.down_blocks[n - 1 - i];
            let bc = BlockConfig {
                kind: *kind,
                layers: down.layers + 1,
                ..down.clone()
            };
            let prev_out = out_ch;
            out_ch = rev[i];
            let ch = UpChannels {
                out_ch,
                prev_out,
                skip_in: rev[(i + 1).min(n - 1)],
            };
            up_blocks.push(UpBlock::new(
                &w.pp("up_blocks").pp(i),
                &bc,
                common,
                ch,
                i + 1 < n,
            )?);
        }
        Ok(up_blocks)
    }

    /// The time embedding `[B, 4·C0]` for per-sample `timesteps` `[B]`, plus SDXL's added
    /// conditions, in the dtype of `like`.
    pub fn time_embed(
        &self,
        timesteps: &Tensor,
        added: Option<&AddedConditions>,
        like: &Tensor,
    ) -> Result<Tensor> {
        let c = &self.config;
        let t = timestep_embedding(
            timesteps,
            c.block_out_channels[0],
            c.flip_sin_to_cos,
            c.freq_shift,
        )?
        .to_dtype(like.dtype())?;
        let emb = self.time_embedding.forward(&t)?;
        match (&self.add_embedding, &c.text_time, added) {
            (Some(add), Some(tt), Some(a)) => {
                let b = a.time_ids.dim(0)?;
                let ids = a.time_ids.flatten_all()?;
                let time =
                    timestep_embedding(&ids, tt.time_embed_dim, c.flip_sin_to_cos, c.freq_shift)?
                        .reshape((b, ()))?
                        .to_dtype(like.dtype())?;
                let text = a.text_embeds.to_dtype(like.dtype())?;
                emb + add.forward(&Tensor::cat(&[&text, &time], 1)?)?
            }
            (Some(_), _, None) => {
                candle_core::bail!(
                    "this UNet (SDXL) needs added conditions: text_embeds and time_ids"
                )
            }
            _ => Ok(emb),
        }
    }

    /// `sample` `[B, C, H, W]`, `timesteps` `[B]` (any float/int dtype), `context` `[B, L, D]`.
    /// H and W must be multiples of `2^num_downsamples`.
    pub fn forward(
        &self,
        sample: &Tensor,
        timesteps: &Tensor,
        context: &Tensor,
        added: Option<&AddedConditions>,
    ) -> Result<Tensor> {
        let (b, _, h, w) = sample.dims4()?;
        if timesteps.dims() != [b] {
            candle_core::bail!(
                "timesteps must be [{b}] (one per sample), got {:?}",
                timesteps.dims()
            );
        }
        let factor = 1usize << self.config.num_downsamples();
        if h % factor != 0 || w % factor != 0 {
            candle_core::bail!("latent size {h}x{w} must be a multiple of {factor} for this UNet");
        }
        let context = context.to_dtype(sample.dtype())?;
        let temb = self.time_embed(timesteps, added, sample)?;
        let ck = |on: bool| self.checkpointing.as_ref().filter(|_| on);
        let sel = &self.checkpointed;
        let mut x = self.conv_in.forward(sample)?;
        let mut skips = vec![x.clone()];
        for (i, block) in self.down_blocks.iter().enumerate() {
            let ck = ck(sel.contains(BlockRef::Down(i)));
            let (out, s) = block.forward(&x, &temb, &context, ck)?;
            x = out;
            skips.extend(s);
        }
        x = self.mid_block.forward(&x, &temb, &context, ck(sel.mid))?;
        for (i, block) in self.up_blocks.iter().enumerate() {
            let ck = ck(sel.contains(BlockRef::Up(i)));
            let take = block.resnets.len();
            let rest = skips.len() - take;
            let mine = skips.split_off(rest);
            let upsample_to = skips.last().map(|s| (s.dim(2), s.dim(3)));
            let upsample_to = match upsample_to {
                Some((Ok(h), Ok(w))) => Some((h, w)),
                _ => None,
            };
            x = block.forward(&x, &mine, &temb, &context, upsample_to, ck)?;
        }
        self.conv_out.forward(&self.conv_norm_out.forward_silu(&x)?)
    }
}

impl VisitLayers for UNet2DConditionModel {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        self.conv_in.visit_layers(f);
        self.time_embedding.visit_layers(f);
        self.add_embedding.visit_layers(f);
        self.down_blocks.visit_layers(f);
        self.mid_block.visit_layers(f);
        self.up_blocks.visit_layers(f);
        self.conv_out.visit_layers(f);
    }
}
