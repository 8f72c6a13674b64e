//! A kohya config's network options (`super::kohya_config`): `network_module`, `network_dim`,
//! `network_alpha`, `network_args`, `unet_lr` and `text_encoder_lr`, as train.json's `mode` and
//! `adapter` section.
//!
//! - `networks.lora` is `lora`, or `locon` when `network_args` gives `conv_dim` (kohya's
//!   LoRA-C3Lier: the 3×3 convs too);
//! - `lycoris.kohya` is its `algo`: `lora`/`locon` as above, `loha`, `lokr`, and `lora` with
//!   `dora_wd=True` is `dora`;
//! - `network_args` are kohya's `key=value` texts; each key is one of the adapter section's
//!   (`conv_dim` is `conv_rank`, `block_dims` and the other block-wise lists pass as kohya's
//!   comma-separated texts), or refused with the reason. kohya's rank is 4 and its alpha 1 when
//!   the file gives none;
//! - a `text_encoder_lr` of 0 trains no text encoder (kohya leaves a group of lr 0 out of the
//!   optimizer).

use serde_json::{json, Value};

use super::error::ConfigError;
use super::kohya_config::Translation;
use super::kohya_config_keys::defaults;

/// `network_args` keys that are adapter-section keys of the same name.
const SAME_ARGS: &[&str] = &[
    "conv_alpha",
    "rank_dropout",
    "module_dropout",
    "factor",
    "block_dims",
    "block_alphas",
    "conv_block_dims",
    "conv_block_alphas",
    "down_lr_weight",
    "mid_lr_weight",
    "up_lr_weight",
    "block_lr_zero_threshold",
    "loraplus_lr_ratio",
    "loraplus_unet_lr_ratio",
    "loraplus_text_encoder_lr_ratio",
];

/// LyCORIS switches sdtrain does not implement: refused when on.
const OFF_ARGS: &[(&str, &str)] = &[
    ("use_tucker", "LyCORIS's Tucker decomposition of 3×3 convs"),
    ("use_cp", "LyCORIS's CP decomposition of 3×3 convs"),
    ("use_scalar", "LyCORIS's trained scalar"),
    ("train_norm", "training the norm layers"),
    ("rank_stabilized", "rank-stabilized scaling"),
    ("bypass_mode", "LyCORIS's bypass mode"),
    (
        "weight_decompose",
        "LyCORIS's weight decomposition (DoRA is `dora_wd=True`)",
    ),
    (
        "unbalanced_factorization",
        "LyCORIS's unbalanced LoKr factorization",
    ),
    ("decompose_both", "LoKr's decomposition of both halves"),
    ("full_matrix", "LoKr's full matrices"),
    ("rank_dropout_scale", "LyCORIS's rank dropout rescaling"),
    ("rescaled", "LyCORIS's rescaled OFT"),
    ("constrain", "LyCORIS's OFT constraint"),
    ("train_on_input", "LyCORIS's IA3 on inputs"),
    (
        "wd_on_output",
        "LyCORIS's DoRA on the output axis (sdtrain's DoRA is the input axis)",
    ),
];

/// The run's mode (`None`: a full fine-tune), with the adapter keys written into `t.adapter`.
pub(super) fn network(t: &mut Translation<'_>) -> Result<Option<String>, ConfigError> {
    let Some(module) = t.take_str("network_module")? else {
        for key in ["network_dim", "network_alpha", "network_args"] {
            if t.take(key).is_some() {
                return Err(t.invalid(
                    key,
                    "is a network option, and this config has no network_module (a full \
                     fine-tune); set network_module = \"networks.lora\" for a LoRA"
                        .into(),
                ));
            }
        }
        return Ok(None);
    };
    let mut args = t.take_key_values("network_args")?;
    let conv = args.iter().any(|(k, _)| k == "conv_dim");
    let mode = match module.as_str() {
        "networks.lora" => {
            if let Some((k, _)) = args.iter().find(|(k, _)| k == "algo" || k == "dora_wd") {
                return Err(t.invalid(
                    "network_args",
                    format!("`{k}` is LyCORIS's; set network_module = \"lycoris.kohya\""),
                ));
            }
            if conv { "locon" } else { "lora" }.to_string()
        }
        "lycoris.kohya" => lycoris_mode(t, &mut args, conv)?,
        other => {
            return Err(t.invalid(
                "network_module",
                format!(
                    "is \"{other}\"; sdtrain trains \"networks.lora\" (LoRA, LoCon with \
                     conv_dim) and \"lycoris.kohya\" (algo lora, locon, loha, lokr; dora_wd)"
                ),
            ))
        }
    };
    let rank = t.take_i64("network_dim")?.unwrap_or(defaults::NETWORK_DIM);
    let alpha = t
        .take_f64("network_alpha")?
        .unwrap_or(defaults::NETWORK_ALPHA);
    t.adapter.insert("rank".into(), json!(rank));
    t.adapter.insert("alpha".into(), json!(alpha));
    for (key, raw) in args {
        network_arg(t, &key, &raw)?;
    }
    match t.take_f64("unet_lr")? {
        // kohya leaves a group of lr 0 out of the optimizer: a text-encoder-only run.
        Some(0.0) => t.set("disable_unet_training", json!(true), "unet_lr")?,
        Some(lr) => {
            t.adapter.insert("unet_lr".into(), json!(lr));
        }
        None => {}
    }
    text_encoder_lr(t)?;
    Ok(Some(mode))
}

/// LyCORIS's `algo` (default `lora`) and `dora_wd`.
fn lycoris_mode(
    t: &Translation<'_>,
    args: &mut Vec<(String, String)>,
    conv: bool,
) -> Result<String, ConfigError> {
    let take = |args: &mut Vec<(String, String)>, key: &str| {
        let at = args.iter().position(|(k, _)| k == key)?;
        Some(args.remove(at).1)
    };
    let algo = take(args, "algo").unwrap_or_else(|| "lora".into());
    let dora = take(args, "dora_wd").is_some_and(|v| truthy(&v));
    if let Some(preset) = take(args, "preset") {
        if preset != "full" {
            return Err(t.invalid(
                "network_args",
                format!(
                    "`preset={preset}`: sdtrain trains LyCORIS's \"full\" preset's modules \
                     (attention, resnets, samplers) only"
                ),
            ));
        }
    }
    let mode = match (algo.to_ascii_lowercase().as_str(), dora) {
        ("lora" | "locon", true) => "dora",
        ("lora" | "locon", false) if conv => "locon",
        ("lora" | "locon", false) => "lora",
        ("loha", false) => "loha",
        ("lokr", false) => "lokr",
        (a, true) => {
            return Err(t.invalid(
                "network_args",
                format!("`dora_wd` with `algo={a}`: sdtrain's DoRA is LyCORIS's lora with dora_wd"),
            ))
        }
        (a, false) => {
            return Err(t.invalid(
                "network_args",
                format!("`algo={a}`: sdtrain trains LyCORIS's lora, locon, loha and lokr"),
            ))
        }
    };
    Ok(mode.to_string())
}

/// A `network_args` switch as the network code reads it: `True`, or a number other than 0.
fn truthy(v: &str) -> bool {
    v.eq_ignore_ascii_case("true") || v.parse::<f64>().is_ok_and(|x| x != 0.0)
}

/// One `network_args` entry into the adapter section.
fn network_arg(t: &mut Translation<'_>, key: &str, raw: &str) -> Result<(), ConfigError> {
    let number = |t: &Translation<'_>| -> Result<Value, ConfigError> {
        if let Ok(i) = raw.parse::<i64>() {
            return Ok(json!(i));
        }
        raw.parse::<f64>().map(|f| json!(f)).map_err(|_| {
            t.invalid(
                "network_args",
                format!("`{key}={raw}`: the value must be a number"),
            )
        })
    };
    if key == "conv_dim" {
        let v = number(t)?;
        t.adapter.insert("conv_rank".into(), v);
        return Ok(());
    }
    if key == "dropout" {
        // LyCORIS's name for network_dropout.
        let v = number(t)?;
        t.adapter.insert("dropout".into(), v);
        return Ok(());
    }
    if let Some((_, what)) = OFF_ARGS.iter().find(|(k, _)| *k == key) {
        if truthy(raw) {
            return Err(t.invalid(
                "network_args",
                format!("`{key}={raw}`: {what} is not supported"),
            ));
        }
        return Ok(());
    }
    if !SAME_ARGS.contains(&key) {
        return Err(t.invalid(
            "network_args",
            format!(
                "`{key}={raw}` is not an argument sdtrain's adapters take; they take conv_dim, \
                 {} (docs/ADAPTERS.md)",
                SAME_ARGS.join(", ")
            ),
        ));
    }
    let lists = key.ends_with("_dims") || key.ends_with("_alphas") || key.ends_with("_weight");
    let value = if lists && raw.parse::<f64>().is_err() {
        Value::String(raw.to_string())
    } else {
        number(t)?
    };
    t.adapter.insert(key.to_string(), value);
    Ok(())
}

/// `text_encoder_lr`: one number, or kohya's list (one per SDXL text encoder, which sdtrain
/// trains at one rate).
fn text_encoder_lr(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    let lr = match t.take("text_encoder_lr") {
        None => return Ok(()),
        Some(Value::Array(a)) => {
            let lrs: Option<Vec<f64>> = a.iter().map(Value::as_f64).collect();
            match lrs.as_deref() {
                Some([]) => return Ok(()),
                Some([lr]) => *lr,
                Some([a, b]) if a == b => *a,
                Some([a, b]) => {
                    return Err(t.invalid(
                        "text_encoder_lr",
                        format!(
                            "gives the two SDXL text encoders {a} and {b}; sdtrain trains them \
                             at one rate"
                        ),
                    ))
                }
                _ => {
                    return Err(t.invalid(
                        "text_encoder_lr",
                        "must be a number, or a list of one or two".into(),
                    ))
                }
            }
        }
        Some(v) => v
            .as_f64()
            .ok_or_else(|| t.invalid("text_encoder_lr", format!("must be a number (got {v})")))?,
    };
    if lr == 0.0 {
        // kohya leaves a group of lr 0 out of the optimizer: its modules stay at their start
        // (zero up weights), which is a UNet-only run.
        return t.set("disable_textenc_training", json!(true), "text_encoder_lr");
    }
    t.adapter.insert("text_encoder_lr".into(), json!(lr));
    Ok(())
}
