//! The UNet2DConditionModel `config.json`, read as diffusers writes it, and resolved into per-block
//! settings. Mirrors diffusers' `UNet2DConditionModel.__init__` (models/unets/unet_2d_condition.py),
//! including its quirk `num_attention_heads = num_attention_heads or attention_head_dim`: SD1.5's
//! `attention_head_dim: 8` means 8 heads, SD2's `[5, 10, 20, 20]` means heads per block.
//!
//! Only the options SD1.x, SD2.x and SDXL use are accepted; any other value of an option that would
//! change the architecture is an error naming the field, never silently ignored.

use std::path::Path;

use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum UnetConfigError {
    #[error("cannot read UNet config {path}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid UNet config {path}{field}")]
    Parse {
        path: String,
        /// `: field `key``, where the error names one ([`crate::py_json::field_at`]).
        field: String,
        source: serde_json::Error,
    },
    #[error("UNet config {path}: field `{field}`: {message}")]
    Field {
        path: String,
        field: &'static str,
        message: String,
    },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(usize),
    Many(Vec<usize>),
    Nested(#[allow(dead_code)] Vec<Vec<usize>>),
}

fn default_true() -> bool {
    true
}
fn default_4() -> usize {
    4
}
fn default_2() -> OneOrMany {
    OneOrMany::One(2)
}
fn default_1() -> OneOrMany {
    OneOrMany::One(1)
}
fn default_8() -> OneOrMany {
    OneOrMany::One(8)
}
fn default_1280() -> OneOrMany {
    OneOrMany::One(1280)
}
fn default_groups() -> Option<usize> {
    Some(32)
}
fn default_eps() -> f64 {
    1e-5
}
fn default_pad() -> usize {
    1
}
fn default_one_f() -> f64 {
    1.0
}
fn default_k3() -> usize {
    3
}
fn default_silu() -> String {
    "silu".into()
}
fn default_mid() -> Option<String> {
    Some("UNetMidBlock2DCrossAttn".into())
}
fn default_default() -> String {
    "default".into()
}
fn default_positional() -> String {
    "positional".into()
}

/// `config.json` as diffusers writes it. Keys we don't model (`_class_name`, …) are ignored.
#[derive(Debug, Clone, Deserialize)]
struct RawUnetConfig {
    sample_size: Option<usize>,
    #[serde(default = "default_4")]
    in_channels: usize,
    #[serde(default = "default_4")]
    out_channels: usize,
    #[serde(default, deserialize_with = "crate::py_json::null_is_false")]
    center_input_sample: bool,
    #[serde(
        default = "default_true",
        deserialize_with = "crate::py_json::null_is_false"
    )]
    flip_sin_to_cos: bool,
    #[serde(default)]
    freq_shift: usize,
    down_block_types: Vec<String>,
    #[serde(default = "default_mid")]
    mid_block_type: Option<String>,
    up_block_types: Vec<String>,
    #[serde(default)]
    only_cross_attention: serde_json::Value,
    block_out_channels: Vec<usize>,
    #[serde(default = "default_2")]
    layers_per_block: OneOrMany,
    #[serde(default = "default_pad")]
    downsample_padding: usize,
    #[serde(default = "default_one_f")]
    mid_block_scale_factor: f64,
    #[serde(default = "default_silu")]
    act_fn: String,
    #[serde(default = "default_groups")]
    norm_num_groups: Option<usize>,
    #[serde(default = "default_eps")]
    norm_eps: f64,
    #[serde(default = "default_1280")]
    cross_attention_dim: OneOrMany,
    #[serde(default = "default_1")]
    transformer_layers_per_block: OneOrMany,
    reverse_transformer_layers_per_block: Option<serde_json::Value>,
    #[serde(default = "default_8")]
    attention_head_dim: OneOrMany,
    num_attention_heads: Option<OneOrMany>,
    #[serde(default, deserialize_with = "crate::py_json::null_is_false")]
    dual_cross_attention: bool,
    #[serde(default, deserialize_with = "crate::py_json::null_is_false")]
    use_linear_projection: bool,
    class_embed_type: Option<String>,
    addition_embed_type: Option<String>,
    addition_time_embed_dim: Option<usize>,
    projection_class_embeddings_input_dim: Option<usize>,
    #[serde(default, deserialize_with = "crate::py_json::null_is_false")]
    upcast_attention: bool,
    #[serde(default = "default_default")]
    resnet_time_scale_shift: String,
    #[serde(default = "default_positional")]
    time_embedding_type: String,
    time_embedding_dim: Option<usize>,
    time_cond_proj_dim: Option<usize>,
    encoder_hid_dim: Option<usize>,
    #[serde(default = "default_k3")]
    conv_in_kernel: usize,
    #[serde(default = "default_k3")]
    conv_out_kernel: usize,
    #[serde(default = "default_default")]
    attention_type: String,
    /// Options that change the architecture or the training in diffusers, kept as written so any
    /// value other than their SD default is refused by name ([`check_sd_defaults`]).
    #[serde(default)]
    resnet_out_scale_factor: serde_json::Value,
    #[serde(default)]
    resnet_skip_time_act: serde_json::Value,
    #[serde(default)]
    time_embedding_act_fn: serde_json::Value,
    #[serde(default)]
    timestep_post_act: serde_json::Value,
    #[serde(default)]
    cross_attention_norm: serde_json::Value,
    #[serde(default)]
    num_class_embeds: serde_json::Value,
    #[serde(default)]
    encoder_hid_dim_type: serde_json::Value,
    #[serde(default)]
    dropout: serde_json::Value,
}

/// The kind of a down or up block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// `CrossAttnDownBlock2D` / `CrossAttnUpBlock2D`: resnets interleaved with transformers.
    CrossAttn,
    /// `DownBlock2D` / `UpBlock2D`: resnets only.
    Plain,
}

/// One down block's resolved settings (up blocks use the reversed lists, as diffusers does).
#[derive(Debug, Clone)]
pub struct BlockConfig {
    pub kind: BlockKind,
    pub layers: usize,
    pub heads: usize,
    pub transformer_layers: usize,
    pub cross_attention_dim: usize,
}

/// SDXL's `addition_embed_type: "text_time"` settings.
#[derive(Debug, Clone, Copy)]
pub struct TextTimeConfig {
    /// Width of each sinusoidal time-id embedding (256 in SDXL).
    pub time_embed_dim: usize,
    /// Input width of `add_embedding` = pooled text width + 6·time_embed_dim (2816 in SDXL).
    pub input_dim: usize,
}

/// The resolved, validated UNet architecture.
#[derive(Debug, Clone)]
pub struct UnetConfig {
    pub sample_size: Option<usize>,
    pub in_channels: usize,
    pub out_channels: usize,
    pub flip_sin_to_cos: bool,
    pub freq_shift: f64,
    pub block_out_channels: Vec<usize>,
    pub down_blocks: Vec<BlockConfig>,
    pub up_kinds: Vec<BlockKind>,
    pub downsample_padding: usize,
    pub norm_num_groups: usize,
    pub norm_eps: f64,
    pub use_linear_projection: bool,
    pub upcast_attention: bool,
    pub text_time: Option<TextTimeConfig>,
}

impl UnetConfig {
    pub fn from_file(path: &Path) -> Result<Self, UnetConfigError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| UnetConfigError::Io {
            path: p.clone(),
            source,
        })?;
        Self::from_json(&text, &p)
    }

    /// Parses `text`; `origin` names the file in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<Self, UnetConfigError> {
        let raw: RawUnetConfig =
            crate::py_json::from_str(text).map_err(|source| UnetConfigError::Parse {
                path: origin.to_string(),
                field: crate::py_json::field_at(text, &source),
                source,
            })?;
        resolve(raw, origin)
    }

    /// Width of the time embedding (`time_embedding.linear_2` out) = 4 · block_out_channels[0].
    pub fn time_embed_dim(&self) -> usize {
        self.block_out_channels[0] * 4
    }

    /// How many times the UNet halves the latent: latents must be a multiple of `2^this`.
    pub fn num_downsamples(&self) -> usize {
        self.block_out_channels.len() - 1
    }
}

fn resolve(raw: RawUnetConfig, origin: &str) -> Result<UnetConfig, UnetConfigError> {
    let err = |field: &'static str, message: String| UnetConfigError::Field {
        path: origin.to_string(),
        field,
        message,
    };
    let n = raw.block_out_channels.len();
    if n == 0 {
        return Err(err("block_out_channels", "must not be empty".into()));
    }
    if raw.down_block_types.len() != n || raw.up_block_types.len() != n {
        return Err(err(
            "down_block_types",
            format!(
                "{} down and {} up block types for {n} block_out_channels",
                raw.down_block_types.len(),
                raw.up_block_types.len()
            ),
        ));
    }
    let (down_blocks, up_kinds) = resolve_blocks(&raw, &err)?;
    check_sizes(&raw, &down_blocks, &err)?;
    check_unsupported(&raw, &err)?;
    let text_time = resolve_text_time(&raw, &err)?;
    let norm_num_groups = raw
        .norm_num_groups
        .ok_or_else(|| err("norm_num_groups", "null is not supported".into()))?;
    Ok(UnetConfig {
        sample_size: raw.sample_size,
        in_channels: raw.in_channels,
        out_channels: raw.out_channels,
        flip_sin_to_cos: raw.flip_sin_to_cos,
        freq_shift: raw.freq_shift as f64,
        block_out_channels: raw.block_out_channels,
        down_blocks,
        up_kinds,
        downsample_padding: raw.downsample_padding,
        norm_num_groups,
        norm_eps: raw.norm_eps,
        use_linear_projection: raw.use_linear_projection,
        upcast_attention: raw.upcast_attention,
        text_time,
    })
}

/// Expands a per-block setting given once or per block into one value per block.
fn expand_per_block(
    v: &OneOrMany,
    field: &'static str,
    n: usize,
    err: &dyn Fn(&'static str, String) -> UnetConfigError,
) -> Result<Vec<usize>, UnetConfigError> {
    match v {
        OneOrMany::One(x) => Ok(vec![*x; n]),
        OneOrMany::Many(xs) if xs.len() == n => Ok(xs.clone()),
        OneOrMany::Many(xs) => Err(err(
            field,
            format!("has {} entries, expected {n}", xs.len()),
        )),
        OneOrMany::Nested(_) => Err(err(field, "nested lists are not supported".into())),
    }
}

/// Resolves the down-block configs and the up-block kinds, checking head splits.
fn resolve_blocks(
    raw: &RawUnetConfig,
    err: &dyn Fn(&'static str, String) -> UnetConfigError,
) -> Result<(Vec<BlockConfig>, Vec<BlockKind>), UnetConfigError> {
    let n = raw.block_out_channels.len();
    let layers = expand_per_block(&raw.layers_per_block, "layers_per_block", n, err)?;
    let heads = match &raw.num_attention_heads {
        Some(h) => expand_per_block(h, "num_attention_heads", n, err)?,
        None => expand_per_block(&raw.attention_head_dim, "attention_head_dim", n, err)?,
    };
    let transformer_layers = expand_per_block(
        &raw.transformer_layers_per_block,
        "transformer_layers_per_block",
        n,
        err,
    )?;
    let cross = expand_per_block(&raw.cross_attention_dim, "cross_attention_dim", n, err)?;
    let down_kind = |t: &str| match t {
        "CrossAttnDownBlock2D" => Ok(BlockKind::CrossAttn),
        "DownBlock2D" => Ok(BlockKind::Plain),
        other => Err(err(
            "down_block_types",
            format!("unsupported block `{other}`"),
        )),
    };
    let up_kind = |t: &str| match t {
        "CrossAttnUpBlock2D" => Ok(BlockKind::CrossAttn),
        "UpBlock2D" => Ok(BlockKind::Plain),
        other => Err(err(
            "up_block_types",
            format!("unsupported block `{other}`"),
        )),
    };
    let mut down_blocks = Vec::with_capacity(n);
    for i in 0..n {
        let (ch, h) = (raw.block_out_channels[i], heads[i]);
        if h == 0 || ch % h != 0 {
            return Err(err(
                "attention_head_dim",
                format!("{ch} channels cannot be split into {h} heads"),
            ));
        }
        down_blocks.push(BlockConfig {
            kind: down_kind(&raw.down_block_types[i])?,
            layers: layers[i],
            heads: h,
            transformer_layers: transformer_layers[i],
            cross_attention_dim: cross[i],
        });
    }
    let up_kinds = raw
        .up_block_types
        .iter()
        .map(|t| up_kind(t))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok((down_blocks, up_kinds))
}

/// Refuses sizes no model has before anything is allocated for them (an absurd
/// `layers_per_block` aborted the process), and the values diffusers' UNet cannot run with.
fn check_sizes(
    raw: &RawUnetConfig,
    blocks: &[BlockConfig],
    err: &dyn Fn(&'static str, String) -> UnetConfigError,
) -> Result<(), UnetConfigError> {
    use crate::model::size_limits::{check, check_each, MAX_DEPTH, MAX_WIDTH};
    let per_block = |f: fn(&BlockConfig) -> usize| blocks.iter().map(f).collect::<Vec<_>>();
    let lists = [
        (
            "block_out_channels",
            raw.block_out_channels.clone(),
            1,
            MAX_WIDTH,
        ),
        ("layers_per_block", per_block(|b| b.layers), 1, MAX_DEPTH),
        (
            "transformer_layers_per_block",
            per_block(|b| b.transformer_layers),
            // diffusers builds a transformer of no blocks for 0 (proj_in, then proj_out).
            0,
            MAX_DEPTH,
        ),
        (
            "cross_attention_dim",
            per_block(|b| b.cross_attention_dim),
            1,
            MAX_WIDTH,
        ),
    ];
    for (field, values, min, max) in lists {
        check_each(&values, min, max).map_err(|m| err(field, m))?;
    }
    let scalars = [
        ("in_channels", Some(raw.in_channels), 1),
        ("out_channels", Some(raw.out_channels), 1),
        ("norm_num_groups", raw.norm_num_groups, 1),
        ("addition_time_embed_dim", raw.addition_time_embed_dim, 1),
        (
            "projection_class_embeddings_input_dim",
            raw.projection_class_embeddings_input_dim,
            1,
        ),
        ("sample_size", raw.sample_size, 1),
        ("freq_shift", Some(raw.freq_shift), 0),
    ];
    for (field, value, min) in scalars {
        if let Some(v) = value {
            check(v, min, MAX_WIDTH).map_err(|m| err(field, m))?;
        }
    }
    // diffusers pads a stride-2 conv by 1, or by (0, 1, 0, 1) by hand for 0; any other padding
    // gives feature maps the skip connections do not match.
    check(raw.downsample_padding, 0, 1).map_err(|m| err("downsample_padding", m))?;
    if let Some(g) = raw.norm_num_groups {
        if let Some(c) = raw.block_out_channels.iter().find(|&&c| c % g != 0) {
            return Err(err(
                "norm_num_groups",
                format!("{g} groups do not divide block_out_channels entry {c}"),
            ));
        }
    }
    if !(raw.norm_eps.is_finite() && raw.norm_eps > 0.0) {
        return Err(err(
            "norm_eps",
            format!("is {}; it must be a positive number", raw.norm_eps),
        ));
    }
    Ok(())
}

/// Resolves SDXL's `text_time` added conditioning, if `addition_embed_type` asks for it.
fn resolve_text_time(
    raw: &RawUnetConfig,
    err: &dyn Fn(&'static str, String) -> UnetConfigError,
) -> Result<Option<TextTimeConfig>, UnetConfigError> {
    Ok(match raw.addition_embed_type.as_deref() {
        None => None,
        Some("text_time") => Some(TextTimeConfig {
            time_embed_dim: raw.addition_time_embed_dim.ok_or_else(|| {
                err(
                    "addition_time_embed_dim",
                    "required with addition_embed_type text_time".into(),
                )
            })?,
            input_dim: raw.projection_class_embeddings_input_dim.ok_or_else(|| {
                err(
                    "projection_class_embeddings_input_dim",
                    "required with addition_embed_type text_time".into(),
                )
            })?,
        }),
        Some(other) => {
            return Err(err(
                "addition_embed_type",
                format!("unsupported value `{other}`"),
            ))
        }
    })
}

/// Rejects options that SD1.x/SD2.x/SDXL never set and that this model does not implement.
fn check_unsupported(
    raw: &RawUnetConfig,
    err: &dyn Fn(&'static str, String) -> UnetConfigError,
) -> Result<(), UnetConfigError> {
    let only_cross = match &raw.only_cross_attention {
        serde_json::Value::Null | serde_json::Value::Bool(false) => false,
        serde_json::Value::Array(a) => a.iter().any(|v| v.as_bool() == Some(true)),
        _ => true,
    };
    if only_cross {
        return Err(err("only_cross_attention", "true is not supported".into()));
    }
    if raw.mid_block_type.as_deref() != Some("UNetMidBlock2DCrossAttn") {
        return Err(err(
            "mid_block_type",
            format!("unsupported value {:?}", raw.mid_block_type),
        ));
    }
    if raw.mid_block_scale_factor != 1.0 {
        return Err(err(
            "mid_block_scale_factor",
            "only 1.0 is supported".into(),
        ));
    }
    if raw.center_input_sample {
        return Err(err("center_input_sample", "true is not supported".into()));
    }
    if raw.act_fn != "silu" {
        return Err(err("act_fn", format!("unsupported value `{}`", raw.act_fn)));
    }
    if raw.dual_cross_attention {
        return Err(err("dual_cross_attention", "true is not supported".into()));
    }
    check_unsupported_embeddings(raw, err)?;
    check_sd_defaults(raw, err)?;
    if raw.conv_in_kernel != 3 || raw.conv_out_kernel != 3 {
        return Err(err(
            "conv_in_kernel",
            "only 3×3 conv_in/conv_out are supported".into(),
        ));
    }
    if raw.attention_type != "default" {
        return Err(err(
            "attention_type",
            "only \"default\" is supported".into(),
        ));
    }
    if raw
        .reverse_transformer_layers_per_block
        .as_ref()
        .is_some_and(|v| !v.is_null())
    {
        return Err(err(
            "reverse_transformer_layers_per_block",
            "is not supported".into(),
        ));
    }
    Ok(())
}

/// Rejects options sdtrain's UNet does not read whose value differs from what every SD model
/// has: each changes the model in diffusers (a scaled resnet output, an extra activation or
/// norm, a class embedding, dropout while training), so ignoring it would train another model.
/// Absent and null keep the default, as in diffusers' constructor.
fn check_sd_defaults(
    raw: &RawUnetConfig,
    err: &dyn Fn(&'static str, String) -> UnetConfigError,
) -> Result<(), UnetConfigError> {
    use serde_json::Value;
    type Check<'a> = (&'static str, &'a Value, fn(&Value) -> bool, &'static str);
    let r = raw;
    let checks: [Check; 8] = [
        (
            "resnet_out_scale_factor",
            &r.resnet_out_scale_factor,
            |v| is_num(v, 1.0),
            "1.0",
        ),
        (
            "resnet_skip_time_act",
            &r.resnet_skip_time_act,
            |v| v.is_null() || v == &Value::Bool(false),
            "false",
        ),
        (
            "time_embedding_act_fn",
            &r.time_embedding_act_fn,
            Value::is_null,
            "null",
        ),
        (
            "timestep_post_act",
            &r.timestep_post_act,
            Value::is_null,
            "null",
        ),
        (
            "cross_attention_norm",
            &r.cross_attention_norm,
            Value::is_null,
            "null",
        ),
        (
            "num_class_embeds",
            &r.num_class_embeds,
            Value::is_null,
            "null",
        ),
        (
            "encoder_hid_dim_type",
            &r.encoder_hid_dim_type,
            Value::is_null,
            "null",
        ),
        ("dropout", &r.dropout, |v| is_num(v, 0.0), "0.0"),
    ];
    match checks.into_iter().find(|(_, v, ok, _)| !ok(v)) {
        Some((field, value, _, default)) => Err(err(
            field,
            format!("is {value}; sdtrain supports only {default}, what SD1.x, SD2.x and SDXL use"),
        )),
        None => Ok(()),
    }
}

/// Null (the default) or the number `want`.
fn is_num(v: &serde_json::Value, want: f64) -> bool {
    v.is_null() || v.as_f64() == Some(want)
}

/// Rejects class, custom time and encoder-projection embedding options.
fn check_unsupported_embeddings(
    raw: &RawUnetConfig,
    err: &dyn Fn(&'static str, String) -> UnetConfigError,
) -> Result<(), UnetConfigError> {
    if let Some(c) = &raw.class_embed_type {
        return Err(err("class_embed_type", format!("unsupported value `{c}`")));
    }
    if raw.resnet_time_scale_shift != "default" {
        return Err(err(
            "resnet_time_scale_shift",
            "only \"default\" is supported".into(),
        ));
    }
    if raw.time_embedding_type != "positional" {
        return Err(err(
            "time_embedding_type",
            "only \"positional\" is supported".into(),
        ));
    }
    if raw.time_embedding_dim.is_some() || raw.time_cond_proj_dim.is_some() {
        return Err(err(
            "time_embedding_dim",
            "custom time embeddings are not supported".into(),
        ));
    }
    if raw.encoder_hid_dim.is_some() {
        return Err(err(
            "encoder_hid_dim",
            "encoder projections are not supported".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// runwayml/stable-diffusion-v1-5 unet/config.json (abridged to the keys that matter).
    const SD15: &str = r#"{"_class_name":"UNet2DConditionModel","act_fn":"silu","attention_head_dim":8,
        "block_out_channels":[320,640,1280,1280],"center_input_sample":false,"cross_attention_dim":768,
        "down_block_types":["CrossAttnDownBlock2D","CrossAttnDownBlock2D","CrossAttnDownBlock2D","DownBlock2D"],
        "downsample_padding":1,"flip_sin_to_cos":true,"freq_shift":0,"in_channels":4,"layers_per_block":2,
        "mid_block_scale_factor":1,"norm_eps":1e-05,"norm_num_groups":32,"out_channels":4,"sample_size":64,
        "up_block_types":["UpBlock2D","CrossAttnUpBlock2D","CrossAttnUpBlock2D","CrossAttnUpBlock2D"]}"#;

    /// stabilityai/stable-diffusion-xl-base-1.0 unet/config.json (abridged).
    const SDXL: &str = r#"{"addition_embed_type":"text_time","addition_time_embed_dim":256,
        "attention_head_dim":[5,10,20],"block_out_channels":[320,640,1280],"cross_attention_dim":2048,
        "down_block_types":["DownBlock2D","CrossAttnDownBlock2D","CrossAttnDownBlock2D"],
        "projection_class_embeddings_input_dim":2816,"sample_size":128,"transformer_layers_per_block":[1,2,10],
        "up_block_types":["CrossAttnUpBlock2D","CrossAttnUpBlock2D","UpBlock2D"],"use_linear_projection":true,
        "num_attention_heads":null,"class_embed_type":null,"upcast_attention":null}"#;

    #[test]
    fn sd15_heads_come_from_attention_head_dim() {
        let c = UnetConfig::from_json(SD15, "sd15").unwrap();
        assert!(c
            .down_blocks
            .iter()
            .all(|b| b.heads == 8 && b.cross_attention_dim == 768));
        assert_eq!(c.down_blocks[3].kind, BlockKind::Plain);
        assert_eq!(c.time_embed_dim(), 1280);
        assert!(c.text_time.is_none());
    }

    #[test]
    fn sdxl_resolves_per_block_lists() {
        let c = UnetConfig::from_json(SDXL, "sdxl").unwrap();
        let heads: Vec<usize> = c.down_blocks.iter().map(|b| b.heads).collect();
        let tl: Vec<usize> = c.down_blocks.iter().map(|b| b.transformer_layers).collect();
        assert_eq!(heads, vec![5, 10, 20]);
        assert_eq!(tl, vec![1, 2, 10]);
        let tt = c.text_time.unwrap();
        assert_eq!((tt.time_embed_dim, tt.input_dim), (256, 2816));
    }

    /// A null boolean reads as false, as diffusers' constructor takes `None` (SDXL-base ships
    /// `"upcast_attention": null`); an absent one keeps its default (`flip_sin_to_cos` true).
    /// Catches a null refused (SDXL-base then cannot be trained) or read as the default.
    #[test]
    fn null_booleans_read_as_false() {
        assert!(
            !UnetConfig::from_json(SDXL, "sdxl")
                .unwrap()
                .upcast_attention
        );
        assert!(UnetConfig::from_json(SD15, "sd15").unwrap().flip_sin_to_cos);
        let nulls = SD15.replace(
            "\"flip_sin_to_cos\":true",
            "\"flip_sin_to_cos\":null,\"use_linear_projection\":null,\"dual_cross_attention\":null",
        );
        let c = UnetConfig::from_json(&nulls, "sd15").unwrap();
        assert!(!c.flip_sin_to_cos && !c.use_linear_projection);
        let bad = SD15.replace("\"center_input_sample\":false", "\"center_input_sample\":1");
        assert!(UnetConfig::from_json(&bad, "c").is_err());
    }

    /// An absurd size is refused naming the file and the key before the UNet is built: a
    /// `layers_per_block` of 2^40 aborted the process on allocating its resnets. A negative
    /// `norm_eps` made every loss NaN; a `downsample_padding` of 2 broke the skip shapes.
    /// Zero transformer layers are accepted, as diffusers builds them (proj_in, proj_out).
    #[test]
    fn absurd_sizes_name_the_file_and_key() {
        let cases = [
            (
                "\"layers_per_block\":2",
                "\"layers_per_block\":1099511627776",
                "layers_per_block",
            ),
            (
                "\"layers_per_block\":2",
                "\"layers_per_block\":0",
                "layers_per_block",
            ),
            (
                "\"cross_attention_dim\":768",
                "\"cross_attention_dim\":1099511627776",
                "cross_attention_dim",
            ),
            ("\"norm_eps\":1e-05", "\"norm_eps\":-1", "norm_eps"),
            (
                "\"downsample_padding\":1",
                "\"downsample_padding\":2",
                "downsample_padding",
            ),
            (
                "\"norm_num_groups\":32",
                "\"norm_num_groups\":7",
                "norm_num_groups",
            ),
            ("\"in_channels\":4", "\"in_channels\":0", "in_channels"),
            (
                "\"sample_size\":64",
                "\"sample_size\":1099511627776",
                "sample_size",
            ),
        ];
        for (from, to, field) in cases {
            let bad = SD15.replace(from, to);
            assert_ne!(bad, SD15, "{to}");
            let e = UnetConfig::from_json(&bad, "m/unet/config.json")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("m/unet/config.json") && e.contains(&format!("`{field}`")),
                "{to}: {e}"
            );
        }
        let zero = SD15.replace("\"freq_shift\":0", "\"transformer_layers_per_block\":0");
        let c = UnetConfig::from_json(&zero, "c").unwrap();
        assert!(c.down_blocks.iter().all(|b| b.transformer_layers == 0));
    }

    /// Options that change the model in diffusers but that sdtrain does not read were ignored
    /// whatever their value (`"resnet_out_scale_factor": 1.5` trained another model, `"dropout":
    /// "abc"` passed); a value other than the SD default is refused by name, null and the
    /// default pass.
    #[test]
    fn ignored_architecture_options_must_keep_their_defaults() {
        for (key, bad) in [
            ("resnet_out_scale_factor", "1.5"),
            ("resnet_skip_time_act", "true"),
            ("time_embedding_act_fn", "\"silu\""),
            ("timestep_post_act", "\"silu\""),
            ("cross_attention_norm", "\"layer_norm\""),
            ("num_class_embeds", "10"),
            ("encoder_hid_dim_type", "\"text_proj\""),
            ("dropout", "0.1"),
            ("dropout", "\"abc\""),
        ] {
            let bad = SD15.replace(
                "\"freq_shift\":0",
                &format!("\"freq_shift\":0,\"{key}\":{bad}"),
            );
            let e = UnetConfig::from_json(&bad, "m/unet/config.json")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("m/unet/config.json") && e.contains(&format!("`{key}`")),
                "{e}"
            );
        }
        let defaults = SD15.replace(
            "\"freq_shift\":0",
            "\"freq_shift\":0,\"resnet_out_scale_factor\":1.0,\"resnet_skip_time_act\":false,\
             \"time_embedding_act_fn\":null,\"cross_attention_norm\":null,\"dropout\":0.0",
        );
        UnetConfig::from_json(&defaults, "c").unwrap();
    }

    /// A value of the wrong type (`"layers_per_block": "abc"`) was reported with serde's line
    /// and column only; the error names the key too.
    #[test]
    fn a_wrong_type_names_the_key() {
        let bad = SD15.replace("\"layers_per_block\":2", "\"layers_per_block\":\"abc\"");
        let e = crate::error_chain::chain_text(
            &UnetConfig::from_json(&bad, "m/unet/config.json").unwrap_err(),
        );
        assert!(
            e.contains("m/unet/config.json: field `layers_per_block`: data did not match"),
            "{e}"
        );
    }

    #[test]
    fn unsupported_options_name_the_field() {
        let bad = SD15.replace("\"act_fn\":\"silu\"", "\"act_fn\":\"mish\"");
        let e = UnetConfig::from_json(&bad, "x/unet/config.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("x/unet/config.json") && e.contains("act_fn"),
            "{e}"
        );
        let bad = SD15.replace("\"layers_per_block\":2", "\"layers_per_block\":[2,2]");
        let e = UnetConfig::from_json(&bad, "c").unwrap_err().to_string();
        assert!(e.contains("layers_per_block"), "{e}");
    }
}
