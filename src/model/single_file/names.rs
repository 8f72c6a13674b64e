//! LDM (A1111/ComfyUI, the original CompVis/Stability code) tensor names ↔ diffusers names, per
//! component, in both directions. The tables are those of diffusers'
//! `scripts/convert_diffusers_to_original_stable_diffusion.py` and
//! `scripts/convert_diffusers_to_original_sdxl.py` (and kohya's `library/model_util.py`), written
//! for any number of levels and layers per block instead of SD's fixed four and two:
//!
//! UNet (`model.diffusion_model.`), `L` = layers per block:
//! - `input_blocks.0.0` = `conv_in`; `time_embed.{0,2}` = `time_embedding.linear_{1,2}`;
//!   `label_emb.0.{0,2}` = `add_embedding.linear_{1,2}` (SDXL); `out.{0,2}` =
//!   `conv_norm_out`/`conv_out`;
//! - `input_blocks.{1 + i(L+1) + j}.0` = `down_blocks.i.resnets.j`, `.1` = `…attentions.j`;
//!   `input_blocks.{(i+1)(L+1)}.0.op` = `down_blocks.i.downsamplers.0.conv`;
//! - `middle_block.{0,1,2}` = `mid_block.resnets.0`, `mid_block.attentions.0`,
//!   `mid_block.resnets.1`;
//! - `output_blocks.{i(L+1) + j}.0` = `up_blocks.i.resnets.j` (j ≤ L), `.1` = `…attentions.j`;
//!   the upsampler `up_blocks.i.upsamplers.0` is `output_blocks.{i(L+1) + L}.{1, or 2 when the
//!   level has attention}`;
//! - inside a resnet: `in_layers.0` norm1, `in_layers.2` conv1, `emb_layers.1` time_emb_proj,
//!   `out_layers.0` norm2, `out_layers.3` conv2, `skip_connection` conv_shortcut. Transformer
//!   names are the same in both.
//!
//! VAE (`first_stage_model.`), `N` levels: `{encoder,decoder}.mid.block_{1,2}` = `mid_block.
//! resnets.{0,1}`, `mid.attn_1.{norm,q,k,v,proj_out}` = `mid_block.attentions.0.{group_norm,
//! to_q,to_k,to_v,to_out.0}` (1×1 convs in LDM, linear in diffusers), `encoder.down.i.block.j` =
//! `encoder.down_blocks.i.resnets.j`, `encoder.down.i.downsample` = `…downsamplers.0`,
//! `decoder.up.{N−1−i}.block.j` = `decoder.up_blocks.i.resnets.j` (numbered in reverse),
//! `decoder.up.{N−1−i}.upsample` = `…upsamplers.0`, `nin_shortcut` = `conv_shortcut`, `norm_out`
//! = `conv_norm_out`.
//!
//! Text encoders: OpenAI CLIP (SD1 `cond_stage_model.transformer.`, SDXL
//! `conditioner.embedders.0.transformer.`) stores transformers' own names, with or without
//! `text_model.`. OpenCLIP (SD2 `cond_stage_model.model.`, SDXL `conditioner.embedders.1.model.`):
//! `token_embedding`, `positional_embedding`, `ln_final`, `transformer.resblocks.N.{ln_1, ln_2,
//! attn.in_proj_{weight,bias} (q, k, v stacked by rows), attn.out_proj, mlp.c_fc, mlp.c_proj}`
//! and `text_projection` (`x @ P`, so the diffusers weight is `Pᵀ`; diffusers' SDXL script
//! writes it as `text_projection.weight`, already transposed).

use crate::tensor_view::ViewOp;

/// The block structure the UNet's LDM names depend on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnetBlocks {
    /// Layers per down block (`layers_per_block`); up blocks have one more.
    pub layers: usize,
    /// Whether each down level has attentions.
    pub down_attn: Vec<bool>,
    /// Whether each up level (diffusers' order) has attentions.
    pub up_attn: Vec<bool>,
}

impl UnetBlocks {
    pub fn levels(&self) -> usize {
        self.down_attn.len()
    }
}

/// The block structure the VAE's LDM names depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VaeBlocks {
    pub levels: usize,
}

/// What one LDM tensor becomes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mapped {
    /// These diffusers tensors, each the stored one through an op.
    To(Vec<(String, ViewOp)>),
    /// Not a weight of the diffusers model; the reason is reported.
    Skip(&'static str),
    /// A name this component does not have.
    Unknown,
}

fn to(name: String) -> Mapped {
    Mapped::To(vec![(name, ViewOp::Same)])
}

/// `"12.rest"` → `(12, "rest")`.
fn index(s: &str) -> Option<(usize, &str)> {
    let (n, rest) = s.split_once('.')?;
    Some((n.parse().ok()?, rest))
}

const UNET_RESNET: [(&str, &str); 6] = [
    ("in_layers.0.", "norm1."),
    ("in_layers.2.", "conv1."),
    ("emb_layers.1.", "time_emb_proj."),
    ("out_layers.0.", "norm2."),
    ("out_layers.3.", "conv2."),
    ("skip_connection.", "conv_shortcut."),
];

const UNET_TOP: [(&str, &str); 7] = [
    ("time_embed.0.", "time_embedding.linear_1."),
    ("time_embed.2.", "time_embedding.linear_2."),
    ("label_emb.0.0.", "add_embedding.linear_1."),
    ("label_emb.0.2.", "add_embedding.linear_2."),
    ("input_blocks.0.0.", "conv_in."),
    ("out.0.", "conv_norm_out."),
    ("out.2.", "conv_out."),
];

/// Replaces the first prefix of `table` (column `from`) that `name` starts with.
fn swap_prefix(name: &str, table: &[(&str, &str)], reverse: bool) -> Option<String> {
    table.iter().find_map(|&(l, d)| {
        let (from, to) = if reverse { (d, l) } else { (l, d) };
        name.strip_prefix(from).map(|rest| format!("{to}{rest}"))
    })
}

/// A UNet LDM name (without `model.diffusion_model.`) as its diffusers name.
pub fn unet_to_diffusers(name: &str, b: &UnetBlocks) -> Option<String> {
    if let Some(n) = swap_prefix(name, &UNET_TOP, false) {
        return Some(n);
    }
    let l1 = b.layers + 1;
    let levels = b.levels();
    let resnet = |prefix: String, rest: &str| {
        swap_prefix(rest, &UNET_RESNET, false).map(|r| format!("{prefix}{r}"))
    };
    if let Some(rest) = name.strip_prefix("input_blocks.") {
        let (n, rest) = index(rest)?;
        let (m, rest) = index(rest)?;
        let (i, j) = ((n.checked_sub(1)?) / l1, (n - 1) % l1);
        if j < b.layers && i < levels {
            return match m {
                0 => resnet(format!("down_blocks.{i}.resnets.{j}."), rest),
                1 if b.down_attn[i] => Some(format!("down_blocks.{i}.attentions.{j}.{rest}")),
                _ => None,
            };
        }
        // n = (i + 1)(L + 1): the downsampler closing level i.
        let i = n / l1 - 1;
        let rest = rest.strip_prefix("op.")?;
        return (m == 0 && i + 1 < levels)
            .then(|| format!("down_blocks.{i}.downsamplers.0.conv.{rest}"));
    }
    if let Some(rest) = name.strip_prefix("middle_block.") {
        let (m, rest) = index(rest)?;
        return match m {
            0 | 2 => resnet(format!("mid_block.resnets.{}.", m / 2), rest),
            1 => Some(format!("mid_block.attentions.0.{rest}")),
            _ => None,
        };
    }
    let rest = name.strip_prefix("output_blocks.")?;
    let (n, rest) = index(rest)?;
    let (m, rest) = index(rest)?;
    let (i, j) = (n / l1, n % l1);
    if i >= levels {
        return None;
    }
    let up_pos = 1 + usize::from(b.up_attn[i]);
    match m {
        0 => resnet(format!("up_blocks.{i}.resnets.{j}."), rest),
        1 if b.up_attn[i] => Some(format!("up_blocks.{i}.attentions.{j}.{rest}")),
        _ if m == up_pos && j == b.layers && i + 1 < levels => {
            let rest = rest.strip_prefix("conv.")?;
            Some(format!("up_blocks.{i}.upsamplers.0.conv.{rest}"))
        }
        _ => None,
    }
}

/// A UNet diffusers name as its LDM name (without `model.diffusion_model.`).
pub fn unet_to_ldm(name: &str, b: &UnetBlocks) -> Option<String> {
    if let Some(n) = swap_prefix(name, &UNET_TOP, true) {
        return Some(n);
    }
    let l1 = b.layers + 1;
    let resnet = |prefix: String, rest: &str| {
        swap_prefix(rest, &UNET_RESNET, true).map(|r| format!("{prefix}{r}"))
    };
    if let Some(rest) = name.strip_prefix("down_blocks.") {
        let (i, rest) = index(rest)?;
        if let Some(rest) = rest.strip_prefix("resnets.") {
            let (j, rest) = index(rest)?;
            return resnet(format!("input_blocks.{}.0.", 1 + i * l1 + j), rest);
        }
        if let Some(rest) = rest.strip_prefix("attentions.") {
            let (j, rest) = index(rest)?;
            return Some(format!("input_blocks.{}.1.{rest}", 1 + i * l1 + j));
        }
        let rest = rest.strip_prefix("downsamplers.0.conv.")?;
        return Some(format!("input_blocks.{}.0.op.{rest}", (i + 1) * l1));
    }
    if let Some(rest) = name.strip_prefix("mid_block.") {
        if let Some(rest) = rest.strip_prefix("attentions.0.") {
            return Some(format!("middle_block.1.{rest}"));
        }
        let (j, rest) = index(rest.strip_prefix("resnets.")?)?;
        return resnet(format!("middle_block.{}.", 2 * j), rest);
    }
    let rest = name.strip_prefix("up_blocks.")?;
    let (i, rest) = index(rest)?;
    if let Some(rest) = rest.strip_prefix("resnets.") {
        let (j, rest) = index(rest)?;
        return resnet(format!("output_blocks.{}.0.", i * l1 + j), rest);
    }
    if let Some(rest) = rest.strip_prefix("attentions.") {
        let (j, rest) = index(rest)?;
        return Some(format!("output_blocks.{}.1.{rest}", i * l1 + j));
    }
    let rest = rest.strip_prefix("upsamplers.0.conv.")?;
    let pos = 1 + usize::from(*b.up_attn.get(i)?);
    Some(format!(
        "output_blocks.{}.{pos}.conv.{rest}",
        i * l1 + b.layers
    ))
}

const VAE_ATTN: [(&str, &str); 5] = [
    ("norm.", "group_norm."),
    ("q.", "to_q."),
    ("k.", "to_k."),
    ("v.", "to_v."),
    ("proj_out.", "to_out.0."),
];

/// A VAE LDM name (without `first_stage_model.`) as its diffusers name, and whether it is a
/// 1×1-conv attention weight (stored 4-D in LDM, 2-D in diffusers).
pub fn vae_to_diffusers(name: &str, b: VaeBlocks) -> Option<(String, bool)> {
    for top in ["quant_conv.", "post_quant_conv."] {
        if name.starts_with(top) {
            return Some((name.to_string(), false));
        }
    }
    let (half, rest) = name.split_once('.')?;
    if half != "encoder" && half != "decoder" {
        return None;
    }
    let resnet = |prefix: String, rest: &str| {
        let rest = match rest.strip_prefix("nin_shortcut.") {
            Some(r) => format!("conv_shortcut.{r}"),
            None => ["norm1.", "conv1.", "norm2.", "conv2."]
                .iter()
                .any(|p| rest.starts_with(p))
                .then(|| rest.to_string())?,
        };
        Some((format!("{half}.{prefix}{rest}"), false))
    };
    for same in ["conv_in.", "conv_out."] {
        if rest.starts_with(same) {
            return Some((name.to_string(), false));
        }
    }
    if let Some(r) = rest.strip_prefix("norm_out.") {
        return Some((format!("{half}.conv_norm_out.{r}"), false));
    }
    if let Some(r) = rest.strip_prefix("mid.") {
        if let Some(r) = r.strip_prefix("block_1.") {
            return resnet("mid_block.resnets.0.".into(), r);
        }
        if let Some(r) = r.strip_prefix("block_2.") {
            return resnet("mid_block.resnets.1.".into(), r);
        }
        let r = r.strip_prefix("attn_1.")?;
        let d = swap_prefix(r, &VAE_ATTN, false)?;
        let conv_weight = d.ends_with(".weight") && !d.starts_with("group_norm.");
        return Some((format!("{half}.mid_block.attentions.0.{d}"), conv_weight));
    }
    let (dir, level_word) = if half == "encoder" {
        ("down.", "down_blocks")
    } else {
        ("up.", "up_blocks")
    };
    let (k, r) = index(rest.strip_prefix(dir)?)?;
    if k >= b.levels {
        return None;
    }
    let i = if half == "encoder" {
        k
    } else {
        b.levels - 1 - k
    };
    if let Some(r) = r.strip_prefix("block.") {
        let (j, r) = index(r)?;
        return resnet(format!("{level_word}.{i}.resnets.{j}."), r);
    }
    let sampler = if half == "encoder" {
        "downsample.conv."
    } else {
        "upsample.conv."
    };
    let r = r.strip_prefix(sampler)?;
    let kind = if half == "encoder" {
        "downsamplers"
    } else {
        "upsamplers"
    };
    Some((format!("{half}.{level_word}.{i}.{kind}.0.conv.{r}"), false))
}

/// A VAE diffusers name as its LDM name (without `first_stage_model.`), and whether it is an
/// attention weight to store as a 1×1 conv.
pub fn vae_to_ldm(name: &str, b: VaeBlocks) -> Option<(String, bool)> {
    if name.starts_with("quant_conv.") || name.starts_with("post_quant_conv.") {
        return Some((name.to_string(), false));
    }
    let (half, rest) = name.split_once('.')?;
    if half != "encoder" && half != "decoder" {
        return None;
    }
    let resnet = |prefix: String, rest: &str| {
        let rest = match rest.strip_prefix("conv_shortcut.") {
            Some(r) => format!("nin_shortcut.{r}"),
            None => rest.to_string(),
        };
        Some((format!("{half}.{prefix}{rest}"), false))
    };
    if rest.starts_with("conv_in.") || rest.starts_with("conv_out.") {
        return Some((name.to_string(), false));
    }
    if let Some(r) = rest.strip_prefix("conv_norm_out.") {
        return Some((format!("{half}.norm_out.{r}"), false));
    }
    if let Some(r) = rest.strip_prefix("mid_block.") {
        if let Some(r) = r.strip_prefix("attentions.0.") {
            let l = swap_prefix(r, &VAE_ATTN, true)?;
            let conv_weight = l.ends_with(".weight") && !l.starts_with("norm.");
            return Some((format!("{half}.mid.attn_1.{l}"), conv_weight));
        }
        let (j, r) = index(r.strip_prefix("resnets.")?)?;
        return resnet(format!("mid.block_{}.", j + 1), r);
    }
    let (level_word, dir) = if half == "encoder" {
        ("down_blocks.", "down")
    } else {
        ("up_blocks.", "up")
    };
    let (i, r) = index(rest.strip_prefix(level_word)?)?;
    let k = if half == "encoder" {
        i
    } else {
        b.levels.checked_sub(1 + i)?
    };
    if let Some(r) = r.strip_prefix("resnets.") {
        let (j, r) = index(r)?;
        return resnet(format!("{dir}.{k}.block.{j}."), r);
    }
    let sampler = if half == "encoder" {
        "downsamplers.0.conv."
    } else {
        "upsamplers.0.conv."
    };
    let r = r.strip_prefix(sampler)?;
    Some((format!("{half}.{dir}.{k}.{dir}sample.conv.{r}"), false))
}

/// An OpenAI CLIP LDM name (after `…transformer.`) as its diffusers (transformers) name.
pub fn clip_to_diffusers(name: &str) -> Mapped {
    let full = if name.starts_with("text_model.") || name == "text_projection.weight" {
        name.to_string()
    } else {
        format!("text_model.{name}")
    };
    if full.ends_with("embeddings.position_ids") {
        return Mapped::Skip("a position-id buffer, not a weight");
    }
    if name == "logit_scale" {
        return Mapped::Skip("CLIP's contrastive logit scale, unused by a text encoder");
    }
    to(full)
}

const OPENCLIP_LAYER: [(&str, &str); 6] = [
    ("ln_1.", "layer_norm1."),
    ("ln_2.", "layer_norm2."),
    ("attn.out_proj.", "self_attn.out_proj."),
    ("mlp.c_fc.", "mlp.fc1."),
    ("mlp.c_proj.", "mlp.fc2."),
    ("attn.in_proj_", "self_attn.in_proj_"),
];

const OPENCLIP_TOP: [(&str, &str); 3] = [
    ("token_embedding.", "text_model.embeddings.token_embedding."),
    ("ln_final.", "text_model.final_layer_norm."),
    (
        "positional_embedding",
        "text_model.embeddings.position_embedding.weight",
    ),
];

/// An OpenCLIP LDM name (after `…model.`) of a tensor of `shape` as diffusers names: the first
/// `layers` resblocks are the model's; later ones are skipped (SD2 conditions on the penultimate
/// layer, so its 24th block is never used). `projection`: whether the diffusers model has a
/// `text_projection` (SDXL's `text_encoder_2`; SD2's `CLIPTextModel` has none).
pub fn openclip_to_diffusers(
    name: &str,
    shape: &[usize],
    layers: usize,
    projection: bool,
) -> Mapped {
    if name == "logit_scale" {
        return Mapped::Skip("CLIP's contrastive logit scale, unused by a text encoder");
    }
    if name == "text_projection" || name == "text_projection.weight" {
        if !projection {
            return Mapped::Skip("the text projection, which SD2's text encoder does not use");
        }
        let op = if name == "text_projection" {
            ViewOp::Transpose
        } else {
            ViewOp::Same
        };
        return Mapped::To(vec![("text_projection.weight".into(), op)]);
    }
    if let Some(n) = swap_prefix(name, &OPENCLIP_TOP, false) {
        return to(n);
    }
    let Some((i, rest)) = name.strip_prefix("transformer.resblocks.").and_then(index) else {
        return Mapped::Unknown;
    };
    if i >= layers {
        return Mapped::Skip("a text-encoder layer after the one the UNet is conditioned on");
    }
    let Some(d) = swap_prefix(rest, &OPENCLIP_LAYER, false) else {
        return Mapped::Unknown;
    };
    let prefix = format!("text_model.encoder.layers.{i}.");
    match d.strip_prefix("self_attn.in_proj_") {
        Some(kind @ ("weight" | "bias")) => {
            let Some(&rows) = shape.first().filter(|&&r| r % 3 == 0) else {
                return Mapped::Unknown;
            };
            let len = rows / 3;
            let parts = ["q", "k", "v"]
                .iter()
                .enumerate()
                .map(|(p, qkv)| {
                    (
                        format!("{prefix}self_attn.{qkv}_proj.{kind}"),
                        ViewOp::Rows {
                            start: p * len,
                            len,
                        },
                    )
                })
                .collect();
            Mapped::To(parts)
        }
        Some(_) => Mapped::Unknown,
        None => to(format!("{prefix}{d}")),
    }
}

/// Where a diffusers text-encoder tensor goes in OpenCLIP's layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenClipPart {
    /// The whole tensor, under this name.
    Whole(String),
    /// Rows `index·n..(index+1)·n` of this fused q/k/v name.
    Fused(String, usize),
    /// The transpose, under this name.
    Transposed(String),
}

/// A diffusers text-encoder name (with `text_model.`) in OpenCLIP's layout (after `…model.`).
/// `None` for buffers OpenCLIP has no place for (`position_ids`).
pub fn openclip_to_ldm(name: &str) -> Option<OpenClipPart> {
    if name == "text_projection.weight" {
        return Some(OpenClipPart::Transposed("text_projection".into()));
    }
    if let Some(n) = swap_prefix(name, &OPENCLIP_TOP, true) {
        return Some(OpenClipPart::Whole(n));
    }
    let rest = name.strip_prefix("text_model.encoder.layers.")?;
    let (i, rest) = index(rest)?;
    let prefix = format!("transformer.resblocks.{i}.");
    for (p, qkv) in ["q", "k", "v"].iter().enumerate() {
        if let Some(kind) = rest.strip_prefix(&format!("self_attn.{qkv}_proj.")) {
            return Some(OpenClipPart::Fused(
                format!("{prefix}attn.in_proj_{kind}"),
                p,
            ));
        }
    }
    let l = swap_prefix(rest, &OPENCLIP_LAYER[..5], true)?;
    Some(OpenClipPart::Whole(format!("{prefix}{l}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SD1.5's UNet: four levels, two layers, no attention in `down_blocks.3` / `up_blocks.0`.
    fn sd15() -> UnetBlocks {
        UnetBlocks {
            layers: 2,
            down_attn: vec![true, true, true, false],
            up_attn: vec![false, true, true, true],
        }
    }

    /// SDXL's UNet: three levels, attention in the two deeper ones.
    fn sdxl() -> UnetBlocks {
        UnetBlocks {
            layers: 2,
            down_attn: vec![false, true, true],
            up_attn: vec![true, true, false],
        }
    }

    /// Pairs from diffusers' conversion scripts' tables (`unet_conversion_map_layer` for SD's
    /// four levels and SDXL's three), one per block kind.
    #[test]
    fn unet_names_match_the_diffusers_tables() {
        let sd = [
            ("input_blocks.0.0.weight", "conv_in.weight"),
            ("time_embed.2.bias", "time_embedding.linear_2.bias"),
            ("out.0.weight", "conv_norm_out.weight"),
            ("out.2.bias", "conv_out.bias"),
            (
                "input_blocks.1.0.in_layers.0.weight",
                "down_blocks.0.resnets.0.norm1.weight",
            ),
            (
                "input_blocks.2.0.in_layers.2.bias",
                "down_blocks.0.resnets.1.conv1.bias",
            ),
            (
                "input_blocks.4.0.skip_connection.weight",
                "down_blocks.1.resnets.0.conv_shortcut.weight",
            ),
            (
                "input_blocks.5.0.emb_layers.1.weight",
                "down_blocks.1.resnets.1.time_emb_proj.weight",
            ),
            (
                "input_blocks.4.1.proj_in.weight",
                "down_blocks.1.attentions.0.proj_in.weight",
            ),
            (
                "input_blocks.8.1.transformer_blocks.0.attn2.to_k.weight",
                "down_blocks.2.attentions.1.transformer_blocks.0.attn2.to_k.weight",
            ),
            (
                "input_blocks.3.0.op.weight",
                "down_blocks.0.downsamplers.0.conv.weight",
            ),
            (
                "input_blocks.9.0.op.bias",
                "down_blocks.2.downsamplers.0.conv.bias",
            ),
            (
                "input_blocks.11.0.out_layers.3.weight",
                "down_blocks.3.resnets.1.conv2.weight",
            ),
            (
                "middle_block.0.out_layers.0.bias",
                "mid_block.resnets.0.norm2.bias",
            ),
            (
                "middle_block.1.norm.weight",
                "mid_block.attentions.0.norm.weight",
            ),
            (
                "middle_block.2.in_layers.0.weight",
                "mid_block.resnets.1.norm1.weight",
            ),
            (
                "output_blocks.0.0.skip_connection.bias",
                "up_blocks.0.resnets.0.conv_shortcut.bias",
            ),
            (
                "output_blocks.2.1.conv.weight",
                "up_blocks.0.upsamplers.0.conv.weight",
            ),
            (
                "output_blocks.3.1.proj_out.bias",
                "up_blocks.1.attentions.0.proj_out.bias",
            ),
            (
                "output_blocks.5.2.conv.bias",
                "up_blocks.1.upsamplers.0.conv.bias",
            ),
            (
                "output_blocks.8.2.conv.weight",
                "up_blocks.2.upsamplers.0.conv.weight",
            ),
            (
                "output_blocks.11.1.norm.bias",
                "up_blocks.3.attentions.2.norm.bias",
            ),
        ];
        for (ldm, diffusers) in sd {
            assert_eq!(
                unet_to_diffusers(ldm, &sd15()).as_deref(),
                Some(diffusers),
                "{ldm}"
            );
            assert_eq!(
                unet_to_ldm(diffusers, &sd15()).as_deref(),
                Some(ldm),
                "{diffusers}"
            );
        }
        let xl = [
            ("label_emb.0.0.weight", "add_embedding.linear_1.weight"),
            ("label_emb.0.2.bias", "add_embedding.linear_2.bias"),
            (
                "input_blocks.4.1.proj_in.weight",
                "down_blocks.1.attentions.0.proj_in.weight",
            ),
            (
                "input_blocks.6.0.op.weight",
                "down_blocks.1.downsamplers.0.conv.weight",
            ),
            (
                "output_blocks.2.2.conv.weight",
                "up_blocks.0.upsamplers.0.conv.weight",
            ),
            (
                "output_blocks.5.2.conv.bias",
                "up_blocks.1.upsamplers.0.conv.bias",
            ),
            (
                "output_blocks.8.0.out_layers.3.weight",
                "up_blocks.2.resnets.2.conv2.weight",
            ),
        ];
        for (ldm, diffusers) in xl {
            assert_eq!(
                unet_to_diffusers(ldm, &sdxl()).as_deref(),
                Some(diffusers),
                "{ldm}"
            );
            assert_eq!(
                unet_to_ldm(diffusers, &sdxl()).as_deref(),
                Some(ldm),
                "{diffusers}"
            );
        }
    }

    #[test]
    fn unet_names_outside_the_structure_are_unknown() {
        for ldm in [
            "input_blocks.10.1.norm.weight", // down_blocks.3 has no attention in SD1.5
            "input_blocks.12.0.op.weight",   // no downsampler after the last level
            "output_blocks.1.1.norm.weight", // up_blocks.0 has no attention
            "output_blocks.11.2.conv.weight", // no upsampler after the last level
            "output_blocks.12.0.in_layers.0.weight",
            "input_blocks.1.0.in_layers.1.weight",
            "middle_block.3.in_layers.0.weight",
        ] {
            assert_eq!(unet_to_diffusers(ldm, &sd15()), None, "{ldm}");
        }
    }

    #[test]
    fn vae_names_match_the_diffusers_tables() {
        let b = VaeBlocks { levels: 4 };
        let pairs = [
            ("encoder.conv_in.weight", "encoder.conv_in.weight", false),
            ("encoder.norm_out.bias", "encoder.conv_norm_out.bias", false),
            (
                "encoder.down.1.block.0.nin_shortcut.weight",
                "encoder.down_blocks.1.resnets.0.conv_shortcut.weight",
                false,
            ),
            (
                "encoder.down.2.downsample.conv.bias",
                "encoder.down_blocks.2.downsamplers.0.conv.bias",
                false,
            ),
            (
                "decoder.up.3.block.2.conv2.weight",
                "decoder.up_blocks.0.resnets.2.conv2.weight",
                false,
            ),
            (
                "decoder.up.1.upsample.conv.weight",
                "decoder.up_blocks.2.upsamplers.0.conv.weight",
                false,
            ),
            (
                "decoder.mid.block_2.norm1.weight",
                "decoder.mid_block.resnets.1.norm1.weight",
                false,
            ),
            (
                "encoder.mid.attn_1.norm.weight",
                "encoder.mid_block.attentions.0.group_norm.weight",
                false,
            ),
            (
                "encoder.mid.attn_1.q.weight",
                "encoder.mid_block.attentions.0.to_q.weight",
                true,
            ),
            (
                "decoder.mid.attn_1.k.bias",
                "decoder.mid_block.attentions.0.to_k.bias",
                false,
            ),
            (
                "decoder.mid.attn_1.v.weight",
                "decoder.mid_block.attentions.0.to_v.weight",
                true,
            ),
            (
                "decoder.mid.attn_1.proj_out.weight",
                "decoder.mid_block.attentions.0.to_out.0.weight",
                true,
            ),
            ("post_quant_conv.weight", "post_quant_conv.weight", false),
        ];
        for (ldm, diffusers, conv) in pairs {
            assert_eq!(
                vae_to_diffusers(ldm, b),
                Some((diffusers.to_string(), conv)),
                "{ldm}"
            );
            assert_eq!(
                vae_to_ldm(diffusers, b),
                Some((ldm.to_string(), conv)),
                "{diffusers}"
            );
        }
        assert_eq!(
            vae_to_diffusers("decoder.up.4.block.0.conv1.weight", b),
            None
        );
        assert_eq!(vae_to_diffusers("encoder.mid.attn_1.x.weight", b), None);
    }

    #[test]
    fn openclip_splits_q_k_v_in_order_and_transposes_the_projection() {
        let m = openclip_to_diffusers(
            "transformer.resblocks.3.attn.in_proj_weight",
            &[12, 4],
            23,
            false,
        );
        let want: Vec<(String, ViewOp)> = ["q", "k", "v"]
            .iter()
            .enumerate()
            .map(|(i, x)| {
                (
                    format!("text_model.encoder.layers.3.self_attn.{x}_proj.weight"),
                    ViewOp::Rows {
                        start: 4 * i,
                        len: 4,
                    },
                )
            })
            .collect();
        assert_eq!(m, Mapped::To(want));
        assert_eq!(
            openclip_to_diffusers("text_projection", &[8, 8], 4, true),
            Mapped::To(vec![("text_projection.weight".into(), ViewOp::Transpose)])
        );
        assert_eq!(
            openclip_to_diffusers("text_projection.weight", &[8, 8], 4, true),
            Mapped::To(vec![("text_projection.weight".into(), ViewOp::Same)])
        );
        assert!(matches!(
            openclip_to_diffusers("text_projection", &[8, 8], 4, false),
            Mapped::Skip(_)
        ));
        // SD2: the 24th block is skipped, the 23rd kept.
        assert!(matches!(
            openclip_to_diffusers("transformer.resblocks.23.ln_1.weight", &[8], 23, false),
            Mapped::Skip(_)
        ));
        assert_eq!(
            openclip_to_diffusers("transformer.resblocks.22.mlp.c_proj.bias", &[8], 23, false),
            to("text_model.encoder.layers.22.mlp.fc2.bias".into())
        );
        assert_eq!(
            openclip_to_diffusers("positional_embedding", &[77, 8], 23, false),
            to("text_model.embeddings.position_embedding.weight".into())
        );
        assert_eq!(
            openclip_to_diffusers("transformer.resblocks.0.attn.x", &[8], 23, false),
            Mapped::Unknown
        );
        // And back.
        assert_eq!(
            openclip_to_ldm("text_model.encoder.layers.3.self_attn.k_proj.bias"),
            Some(OpenClipPart::Fused(
                "transformer.resblocks.3.attn.in_proj_bias".into(),
                1
            ))
        );
        assert_eq!(
            openclip_to_ldm("text_model.encoder.layers.0.self_attn.out_proj.weight"),
            Some(OpenClipPart::Whole(
                "transformer.resblocks.0.attn.out_proj.weight".into()
            ))
        );
        assert_eq!(
            openclip_to_ldm("text_model.final_layer_norm.bias"),
            Some(OpenClipPart::Whole("ln_final.bias".into()))
        );
        assert_eq!(
            openclip_to_ldm("text_projection.weight"),
            Some(OpenClipPart::Transposed("text_projection".into()))
        );
        assert_eq!(openclip_to_ldm("text_model.embeddings.position_ids"), None);
    }

    #[test]
    fn clip_names_gain_text_model_and_skip_buffers() {
        assert_eq!(
            clip_to_diffusers("encoder.layers.0.mlp.fc1.weight"),
            to("text_model.encoder.layers.0.mlp.fc1.weight".into())
        );
        assert_eq!(
            clip_to_diffusers("text_model.final_layer_norm.weight"),
            to("text_model.final_layer_norm.weight".into())
        );
        assert!(matches!(
            clip_to_diffusers("text_model.embeddings.position_ids"),
            Mapped::Skip(_)
        ));
    }
}
