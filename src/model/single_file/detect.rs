//! The diffusers configs of a single-file checkpoint without sdtrain's metadata, detected from its
//! tensor names and shapes (as kohya's `model_util.py`, diffusers' `single_file_utils.py` and
//! ComfyUI's `model_detection.py` do).
//!
//! From the shapes: the family (which text-encoder keys exist), every channel count, the number
//! of levels, layers per block and transformer depth per level, attention per level, in/out and
//! latent channels, `use_linear_projection` (a 2-D `proj_in`), the cross-attention width, SDXL's
//! added-embedding widths, and each text encoder's width, depth, MLP width, positions and
//! vocabulary. Not in the shapes, so chosen by family as the real models have them:
//! - UNet heads: SD1 8 heads per block (`attention_head_dim: 8`); SD2 and SDXL a head width of
//!   64 (`channels / 64` heads). A width not divisible by 64 gets 8 heads (1 if 8 does not
//!   divide it either);
//! - text-encoder heads: width / 64, else width / 8, else 1; activation `quick_gelu` for OpenAI
//!   CLIP (SD1, SDXL's first), `gelu` for OpenCLIP (SD2, SDXL's second);
//! - group-norm groups: `min(32, gcd(channels))` (32 for the real models);
//! - SD2: `upcast_attention` on and the prediction type v_prediction (diffusers' default for an
//!   SD2 file; SD2-base is epsilon: set `prediction_type`), 768 px; SD1 512 px, SDXL 1024 px;
//! - VAE `scaling_factor` 0.13025 for SDXL, 0.18215 otherwise;
//! - schedulers: the ones the real pipelines ship (PNDM for SD1, DDIM for SD2, Euler for SDXL),
//!   all with SD's scaled-linear betas 0.00085–0.012 over 1000 steps.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{json, Value};

use super::{TextEncoderKind, UNET, VAE};
use crate::model::family::{ModelFamily, PredictionType};

/// Tensor name → shape, the header of the file.
pub type Shapes = BTreeMap<String, Vec<usize>>;

/// What detection decided: one config per component and the tokenizers' pad tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Detected {
    pub unet: Value,
    pub vae: Value,
    /// One per text encoder, with the pad token its tokenizer uses.
    pub text_encoders: Vec<(Value, &'static str)>,
    pub scheduler: Value,
    pub model_index: Value,
}

/// OpenAI CLIP pads with its end token, OpenCLIP with `!` (id 0).
pub fn pad_token(kind: TextEncoderKind) -> &'static str {
    match kind {
        TextEncoderKind::Clip { .. } => "<|endoftext|>",
        TextEncoderKind::OpenClip { .. } => "!",
    }
}

fn shape<'a>(h: &'a Shapes, name: &str) -> Result<&'a [usize], String> {
    h.get(name)
        .map(Vec::as_slice)
        .ok_or_else(|| format!("`{name}` is missing"))
}

/// The shape of `name`, which must have `rank` dimensions, none of them 0 (a size read from a
/// reshaped or emptied tensor would make a config no loader can build).
fn sized<'a>(h: &'a Shapes, name: &str, rank: usize) -> Result<&'a [usize], String> {
    let s = shape(h, name)?;
    if s.len() != rank || s.contains(&0) {
        let what = if rank == 4 {
            "a conv weight"
        } else {
            "a matrix"
        };
        return Err(format!(
            "`{name}` has shape {s:?}, not {what} ({rank} dims, none 0)"
        ));
    }
    Ok(s)
}

/// Dimension `i` of `name`, a tensor of `rank` dimensions ([`sized`]).
fn dim(h: &Shapes, name: &str, rank: usize, i: usize) -> Result<usize, String> {
    Ok(sized(h, name, rank)?[i])
}

/// The indices `N` of names `prefix N.…`.
fn indices(h: &Shapes, prefix: &str) -> BTreeSet<usize> {
    h.range(prefix.to_string()..)
        .take_while(|(k, _)| k.starts_with(prefix))
        .filter_map(|(k, _)| k[prefix.len()..].split('.').next()?.parse().ok())
        .collect()
}

fn has_prefix(h: &Shapes, prefix: &str) -> bool {
    h.range(prefix.to_string()..)
        .next()
        .is_some_and(|(k, _)| k.starts_with(prefix))
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// `min(32, gcd(channels))`: 32 for the real models, what divides the tiny ones.
fn groups(channels: &[usize]) -> usize {
    channels.iter().fold(0, |g, &c| gcd(g, c)).clamp(1, 32)
}

/// Heads for `width` channels at a head width of 64, else 8 heads, else 1.
fn heads_64(width: usize) -> usize {
    if width.is_multiple_of(64) {
        width / 64
    } else if width.is_multiple_of(8) {
        8
    } else {
        1
    }
}

/// The UNet's `sample_size`: the native resolution over the VAE's factor of 8.
fn sample_size(family: ModelFamily, prediction: PredictionType) -> usize {
    match (family, prediction) {
        (ModelFamily::Sd1, _) | (ModelFamily::Sd2, PredictionType::Epsilon) => 64,
        (ModelFamily::Sd2, PredictionType::VPrediction) => 96,
        (ModelFamily::Sdxl, _) => 128,
    }
}

/// The UNet config. `pooled_dim`: SDXL's pooled text width (the second encoder's projection).
pub fn unet(
    h: &Shapes,
    family: ModelFamily,
    prediction: PredictionType,
    pooled_dim: Option<usize>,
) -> Result<Value, String> {
    let p = |s: &str| format!("{UNET}{s}");
    let (c0, in_channels) = unet_conv_in(h)?;
    let out_channels = dim(h, &p("out.2.weight"), 4, 0)?;
    if out_channels > in_channels {
        // An inpainting or depth UNet takes more channels than it gives; never fewer.
        return Err(format!(
            "`{}` gives {out_channels} channels, more than conv_in `{}` takes ({in_channels})",
            p("out.2.weight"),
            p("input_blocks.0.0.weight")
        ));
    }
    let (layers, levels) = unet_layers(h)?;
    let l1 = layers + 1;
    let mut channels = Vec::new();
    let mut down_attn = Vec::new();
    let mut depth = Vec::new();
    for i in 0..levels {
        let n = 1 + i * l1;
        channels.push(dim(
            h,
            &p(&format!("input_blocks.{n}.0.out_layers.3.weight")),
            4,
            0,
        )?);
        let attn = p(&format!("input_blocks.{n}.1."));
        down_attn.push(has_prefix(h, &attn));
        depth.push(
            indices(h, &format!("{attn}transformer_blocks."))
                .len()
                .max(1),
        );
    }
    if channels[0] != c0 {
        return Err(format!(
            "conv_in `{}` has {c0} output channels but the first level's resnet `{}` {}",
            p("input_blocks.0.0.weight"),
            p("input_blocks.1.0.out_layers.3.weight"),
            channels[0]
        ));
    }
    let up_attn: Vec<bool> = (0..levels)
        .map(|i| has_prefix(h, &p(&format!("output_blocks.{}.1.", i * l1))))
        .collect();
    let (cross, linear) = unet_attention(h, &down_attn, l1)?;
    check_unet_mid(h, &depth)?;
    let heads: Value = match family {
        ModelFamily::Sd1 => json!(8),
        ModelFamily::Sd2 | ModelFamily::Sdxl => {
            json!(channels.iter().map(|&c| heads_64(c)).collect::<Vec<_>>())
        }
    };
    let mut cfg = json!({
        "_class_name": "UNet2DConditionModel",
        "act_fn": "silu",
        "attention_head_dim": heads,
        "block_out_channels": channels,
        "center_input_sample": false,
        "cross_attention_dim": cross,
        "down_block_types": down_attn.iter().map(|&a| unet_block_type(a, true)).collect::<Vec<_>>(),
        "downsample_padding": 1,
        "flip_sin_to_cos": true,
        "freq_shift": 0,
        "in_channels": in_channels,
        "layers_per_block": layers,
        "mid_block_scale_factor": 1,
        "mid_block_type": "UNetMidBlock2DCrossAttn",
        "norm_eps": 1e-5,
        "norm_num_groups": groups(&channels),
        "out_channels": out_channels,
        "sample_size": sample_size(family, prediction),
        "transformer_layers_per_block": depth,
        "up_block_types": up_attn.iter().map(|&a| unet_block_type(a, false)).collect::<Vec<_>>(),
        "upcast_attention": family == ModelFamily::Sd2,
        "use_linear_projection": linear,
    });
    if family == ModelFamily::Sdxl {
        add_sdxl_conditions(h, pooled_dim, &mut cfg)?;
    }
    Ok(cfg)
}

/// The first level's channels and the input channels, from `conv_in`'s weight.
fn unet_conv_in(h: &Shapes) -> Result<(usize, usize), String> {
    let key = format!("{UNET}input_blocks.0.0.weight");
    match sized(h, &key, 4)? {
        [c, i, _, _] => Ok((*c, *i)),
        s => Err(format!("`{key}` has shape {s:?}, not a conv")),
    }
}

/// The resnet layers per level and the number of levels, from the input blocks.
fn unet_layers(h: &Shapes) -> Result<(usize, usize), String> {
    let p = |s: &str| format!("{UNET}{s}");
    let inputs = indices(h, &p("input_blocks."));
    let max_n = *inputs.iter().max().ok_or("no `input_blocks`")?;
    let first_op = inputs
        .iter()
        .find(|&&n| h.contains_key(&p(&format!("input_blocks.{n}.0.op.weight"))))
        .copied();
    // Without a downsampler there is one level holding every input block.
    let layers = first_op.map_or(max_n, |n| n.saturating_sub(1));
    let l1 = layers + 1;
    if layers == 0 || !(max_n + 1).is_multiple_of(l1) {
        return Err(format!(
            "{max_n} input blocks do not form levels of {layers} layers and a downsampler"
        ));
    }
    Ok((layers, (max_n + 1) / l1))
}

/// The cross-attention width and whether projections are linear, from the first attention level.
fn unet_attention(h: &Shapes, down_attn: &[bool], l1: usize) -> Result<(usize, bool), String> {
    let p = |s: &str| format!("{UNET}{s}");
    let Some(first_attn) = down_attn.iter().position(|&a| a) else {
        return Err("no level has cross-attention".into());
    };
    let attn = p(&format!("input_blocks.{}.1.", 1 + first_attn * l1));
    let cross = dim(
        h,
        &format!("{attn}transformer_blocks.0.attn2.to_k.weight"),
        2,
        1,
    )?;
    let linear = shape(h, &format!("{attn}proj_in.weight"))?.len() == 2;
    Ok((cross, linear))
}

/// Checks that the middle block has attention as deep as the last level's.
fn check_unet_mid(h: &Shapes, depth: &[usize]) -> Result<(), String> {
    let p = |s: &str| format!("{UNET}{s}");
    if !has_prefix(h, &p("middle_block.1.")) {
        return Err("the middle block has no attention (not an SD UNet)".into());
    }
    let mid_depth = indices(h, &p("middle_block.1.transformer_blocks.")).len();
    if Some(&mid_depth) != depth.last() {
        return Err(format!(
            "the middle block has {mid_depth} transformer layers, the last level {}: diffusers \
             gives both the same",
            depth.last().copied().unwrap_or(0)
        ));
    }
    Ok(())
}

/// The diffusers block type of a level with (`a`) or without attention, down or up.
fn unet_block_type(a: bool, down: bool) -> &'static str {
    match (a, down) {
        (true, true) => "CrossAttnDownBlock2D",
        (false, true) => "DownBlock2D",
        (true, false) => "CrossAttnUpBlock2D",
        (false, false) => "UpBlock2D",
    }
}

/// Adds SDXL's `text_time` conditioning to `cfg`, from `label_emb` and the pooled width.
fn add_sdxl_conditions(
    h: &Shapes,
    pooled_dim: Option<usize>,
    cfg: &mut Value,
) -> Result<(), String> {
    let p = |s: &str| format!("{UNET}{s}");
    let adm = dim(h, &p("label_emb.0.0.weight"), 2, 1)?;
    let pooled = pooled_dim.ok_or("SDXL needs the second text encoder's projection width")?;
    let time_ids = adm
        .checked_sub(pooled)
        .filter(|d| d.is_multiple_of(6) && *d > 0)
        .ok_or_else(|| {
            format!(
                "`{}` takes {adm} inputs: not {pooled} pooled + a multiple of 6 time-id \
                 features",
                p("label_emb.0.0.weight")
            )
        })?;
    cfg["addition_embed_type"] = json!("text_time");
    cfg["addition_time_embed_dim"] = json!(time_ids / 6);
    cfg["projection_class_embeddings_input_dim"] = json!(adm);
    Ok(())
}

/// The VAE config.
pub fn vae(h: &Shapes, family: ModelFamily, resolution: usize) -> Result<Value, String> {
    let p = |s: &str| format!("{VAE}{s}");
    let levels = indices(h, &p("encoder.down.")).len();
    if levels == 0 {
        return Err(format!("no `{}` blocks", p("encoder.down.")));
    }
    let layers = indices(h, &p("encoder.down.0.block.")).len();
    let channels = (0..levels)
        .map(|i| {
            dim(
                h,
                &p(&format!("encoder.down.{i}.block.0.conv2.weight")),
                4,
                0,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let scaling = match family {
        ModelFamily::Sdxl => 0.13025,
        ModelFamily::Sd1 | ModelFamily::Sd2 => 0.18215,
    };
    Ok(json!({
        "_class_name": "AutoencoderKL",
        "act_fn": "silu",
        "block_out_channels": channels,
        "down_block_types": vec!["DownEncoderBlock2D"; levels],
        "force_upcast": true,
        "in_channels": dim(h, &p("encoder.conv_in.weight"), 4, 1)?,
        "latent_channels": dim(h, &p("decoder.conv_in.weight"), 4, 1)?,
        "layers_per_block": layers,
        "mid_block_add_attention": h.contains_key(&p("encoder.mid.attn_1.q.weight")),
        "norm_num_groups": groups(&channels),
        "out_channels": dim(h, &p("decoder.conv_out.weight"), 4, 0)?,
        "sample_size": resolution,
        "scaling_factor": scaling,
        "up_block_types": vec!["UpDecoderBlock2D"; levels],
        "use_post_quant_conv": h.contains_key(&p("post_quant_conv.weight")),
        "use_quant_conv": h.contains_key(&p("quant_conv.weight")),
    }))
}

/// SD2's text encoder uses 23 of OpenCLIP ViT-H's 24 blocks (the UNet is conditioned on the
/// penultimate layer; diffusers' `stable-diffusion-2-1/text_encoder` has 23 layers and its
/// single-file loader ignores `resblocks.23`). A file with fewer blocks (diffusers' own
/// conversion script writes only the 23) uses them all.
pub const SD2_TEXT_LAYERS: usize = 23;

/// The text encoder of `kind` stored under `prefix`, and its projection width (OpenCLIP with a
/// projection only).
pub fn text_encoder(
    h: &Shapes,
    prefix: &str,
    kind: TextEncoderKind,
) -> Result<(Value, Option<usize>), String> {
    let (tok, pos, layers, fc1, act, arch, projection) = match kind {
        TextEncoderKind::Clip { text_model } => {
            let q = if text_model {
                format!("{prefix}text_model.")
            } else {
                prefix.to_string()
            };
            (
                format!("{q}embeddings.token_embedding.weight"),
                format!("{q}embeddings.position_embedding.weight"),
                indices(h, &format!("{q}encoder.layers.")).len(),
                format!("{q}encoder.layers.0.mlp.fc1.weight"),
                "quick_gelu",
                "CLIPTextModel",
                None,
            )
        }
        TextEncoderKind::OpenClip { projection } => open_clip_layout(h, prefix, projection)?,
    };
    let (vocab, hidden) = match sized(h, &tok, 2)? {
        [v, d] => (*v, *d),
        s => return Err(format!("`{tok}` has shape {s:?}, not [vocab, width]")),
    };
    if layers == 0 {
        return Err(format!("no text-encoder layers under `{prefix}`"));
    }
    let heads = if hidden.is_multiple_of(64) {
        hidden / 64
    } else if hidden.is_multiple_of(8) {
        hidden / 8
    } else {
        1
    };
    let eos = vocab as i64 - 1;
    let pad = match pad_token(kind) {
        "!" => 0,
        _ => eos,
    };
    let cfg = json!({
        "architectures": [arch],
        "attention_dropout": 0.0,
        "bos_token_id": vocab as i64 - 2,
        "eos_token_id": eos,
        "hidden_act": act,
        "hidden_size": hidden,
        "initializer_factor": 1.0,
        "initializer_range": 0.02,
        "intermediate_size": dim(h, &fc1, 2, 0)?,
        "layer_norm_eps": 1e-5,
        "max_position_embeddings": dim(h, &pos, 2, 0)?,
        "model_type": "clip_text_model",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "pad_token_id": pad,
        "projection_dim": projection.unwrap_or(hidden),
        "vocab_size": vocab,
    });
    Ok((cfg, projection))
}

/// The tensor holding the position embeddings of a text encoder of `kind` under `prefix`.
pub fn position_key(prefix: &str, kind: TextEncoderKind) -> String {
    match kind {
        TextEncoderKind::Clip { text_model: true } => {
            format!("{prefix}text_model.embeddings.position_embedding.weight")
        }
        TextEncoderKind::Clip { text_model: false } => {
            format!("{prefix}embeddings.position_embedding.weight")
        }
        TextEncoderKind::OpenClip { .. } => format!("{prefix}positional_embedding"),
    }
}

/// The embeddings, layer-count, MLP and architecture layout of a text encoder.
type TextLayout = (
    String,
    String,
    usize,
    String,
    &'static str,
    &'static str,
    Option<usize>,
);

/// The layout of an OpenCLIP text encoder under `prefix`, with its projection width if any.
fn open_clip_layout(h: &Shapes, prefix: &str, projection: bool) -> Result<TextLayout, String> {
    let blocks = indices(h, &format!("{prefix}transformer.resblocks.")).len();
    let proj = if !projection {
        None
    } else if h.contains_key(&format!("{prefix}text_projection")) {
        Some(dim(h, &format!("{prefix}text_projection"), 2, 1)?)
    } else {
        Some(dim(h, &format!("{prefix}text_projection.weight"), 2, 0)?)
    };
    Ok((
        format!("{prefix}token_embedding.weight"),
        format!("{prefix}positional_embedding"),
        if projection {
            blocks
        } else {
            blocks.min(SD2_TEXT_LAYERS)
        },
        format!("{prefix}transformer.resblocks.0.mlp.c_fc.weight"),
        "gelu",
        if projection {
            "CLIPTextModelWithProjection"
        } else {
            "CLIPTextModel"
        },
        proj,
    ))
}

/// The scheduler the family's real pipeline ships, with `prediction`.
pub fn scheduler(family: ModelFamily, prediction: PredictionType) -> Value {
    let mut s = json!({
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "beta_start": 0.00085,
        "num_train_timesteps": 1000,
        "prediction_type": prediction.name(),
        "set_alpha_to_one": false,
        "steps_offset": 1,
        "timestep_spacing": "leading",
        "trained_betas": null,
    });
    let extra = match family {
        ModelFamily::Sd1 => json!({"_class_name": "PNDMScheduler", "skip_prk_steps": true}),
        ModelFamily::Sd2 => json!({"_class_name": "DDIMScheduler", "clip_sample": false}),
        ModelFamily::Sdxl => json!({
            "_class_name": "EulerDiscreteScheduler",
            "interpolation_type": "linear",
            "use_karras_sigmas": false
        }),
    };
    if let (Some(s), Some(e)) = (s.as_object_mut(), extra.as_object()) {
        s.extend(e.clone());
    }
    s
}

/// The `model_index.json` of the family's pipeline.
pub fn model_index(family: ModelFamily) -> Value {
    let mut idx = json!({
        "feature_extractor": [null, null],
        "image_encoder": [null, null],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    });
    let extra = match family {
        ModelFamily::Sd1 | ModelFamily::Sd2 => json!({
            "_class_name": "StableDiffusionPipeline",
            "requires_safety_checker": false,
            "safety_checker": [null, null],
            "scheduler": ["diffusers", if family == ModelFamily::Sd1 { "PNDMScheduler" } else { "DDIMScheduler" }],
        }),
        ModelFamily::Sdxl => json!({
            "_class_name": "StableDiffusionXLPipeline",
            "force_zeros_for_empty_prompt": true,
            "scheduler": ["diffusers", "EulerDiscreteScheduler"],
            "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
            "tokenizer_2": ["transformers", "CLIPTokenizer"],
        }),
    };
    if let (Some(i), Some(e)) = (idx.as_object_mut(), extra.as_object()) {
        i.extend(e.clone());
    }
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_and_heads_fall_back_for_tiny_widths() {
        assert_eq!(groups(&[320, 640, 1280, 1280]), 32);
        assert_eq!(groups(&[8, 16, 24]), 8);
        assert_eq!(groups(&[6, 9]), 3);
        assert_eq!(heads_64(1280), 20);
        assert_eq!(heads_64(24), 8);
        assert_eq!(heads_64(12), 1);
    }

    #[test]
    fn indices_read_only_their_prefix() {
        let h: Shapes = [
            "a.blocks.0.x",
            "a.blocks.1.y",
            "a.blocks.10.z",
            "a.blocksX.3.w",
            "b.blocks.7.x",
        ]
        .iter()
        .map(|n| (n.to_string(), vec![1]))
        .collect();
        assert_eq!(indices(&h, "a.blocks."), BTreeSet::from([0, 1, 10]));
    }

    /// A size is read only from a tensor of the rank it should have, with no 0 dimension, and
    /// the error names it: scripts/fuzz-files found a flattened `out.2.weight` [288] detected as
    /// 288 output channels (refused later as "an inpainting UNet", naming no tensor), and a
    /// conv_in/first-level mismatch that named neither tensor.
    #[test]
    fn sizes_come_from_tensors_of_the_right_rank() {
        let base: Shapes = [
            ("input_blocks.0.0.weight", vec![8, 4, 3, 3]),
            ("input_blocks.1.0.out_layers.3.weight", vec![8, 8, 3, 3]),
            ("out.2.weight", vec![4, 8, 3, 3]),
        ]
        .into_iter()
        .map(|(n, s)| (format!("{UNET}{n}"), s))
        .collect();
        let out = format!("{UNET}out.2.weight");
        for bad in [vec![288], vec![0, 8, 3, 3], vec![4, 8]] {
            let mut h = base.clone();
            h.insert(out.clone(), bad.clone());
            let e = unet(&h, ModelFamily::Sd1, PredictionType::Epsilon, None).unwrap_err();
            assert!(
                e.contains(&format!("`{out}` has shape {bad:?}, not a conv weight")),
                "{e}"
            );
        }
        let mut h = base.clone();
        h.insert(out.clone(), vec![5, 8, 3, 3]);
        let e = unet(&h, ModelFamily::Sd1, PredictionType::Epsilon, None).unwrap_err();
        assert!(
            e.contains(&format!("`{out}` gives 5 channels, more than conv_in")),
            "{e}"
        );
        let mut h = base.clone();
        h.insert(format!("{UNET}input_blocks.0.0.weight"), vec![9, 4, 3, 3]);
        let e = unet(&h, ModelFamily::Sd1, PredictionType::Epsilon, None).unwrap_err();
        assert!(
            e.contains("input_blocks.0.0.weight` has 9 output channels")
                && e.contains("input_blocks.1.0.out_layers.3.weight` 8"),
            "{e}"
        );
        let mut h = base;
        h.insert(format!("{UNET}input_blocks.0.0.weight"), vec![0, 4, 3, 3]);
        let e = unet(&h, ModelFamily::Sd1, PredictionType::Epsilon, None).unwrap_err();
        assert!(
            e.contains("input_blocks.0.0.weight` has shape [0, 4, 3, 3]"),
            "{e}"
        );
        let tok = "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight";
        let h: Shapes = [(tok.to_string(), vec![2514, 0])].into_iter().collect();
        let kind = TextEncoderKind::Clip { text_model: true };
        let e = text_encoder(&h, "cond_stage_model.transformer.", kind).unwrap_err();
        assert!(
            e.contains(&format!("`{tok}` has shape [2514, 0], not a matrix")),
            "{e}"
        );
    }

    /// A downsampler on the first input block (where conv_in is) is an error, not an underflow.
    #[test]
    fn a_downsampler_at_block_zero_is_an_error() {
        let h: Shapes = [
            ("input_blocks.0.0.weight", vec![8, 4, 3, 3]),
            ("input_blocks.0.0.op.weight", vec![8, 8, 3, 3]),
            ("input_blocks.1.0.in_layers.2.weight", vec![8, 8, 3, 3]),
            ("out.2.weight", vec![4, 8, 3, 3]),
        ]
        .into_iter()
        .map(|(n, s)| (format!("{UNET}{n}"), s))
        .collect();
        let e = unet(&h, ModelFamily::Sd1, PredictionType::Epsilon, None).unwrap_err();
        assert!(e.contains("do not form levels"), "{e}");
    }
}
