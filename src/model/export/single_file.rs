//! Writing a model as a single-file checkpoint in the LDM layout (A1111 and ComfyUI load it):
//! the base model's tensors ([`ModelLayout`], a diffusers folder or a single file) with the
//! trained ones replacing them, renamed by [`names`] (VAE attention weights as 1×1 convs,
//! OpenCLIP's q/k/v fused by rows and its projection transposed), as diffusers' conversion
//! scripts write them. SD2's text encoder is written with the layers it has (23 for the real
//! model), as diffusers' script does; loaders of the original code ignore the missing 24th.
//!
//! The metadata carries every config the file was made from (`sdtrain.model_index`,
//! `sdtrain.scheduler_config`, `sdtrain.<component>_config`, and each tokenizer's pad token and
//! length as `sdtrain.tokenizer[_2]`), so sdtrain reopens its own files with exactly those
//! configs, whatever their shapes. The file is written to a temp file and renamed.

use std::collections::BTreeMap;
use std::path::Path;
use std::rc::Rc;

use candle_core::{DType, Tensor};
use serde_json::{json, Value};

use super::tensors::{merged_tensors, write_safetensors, BaseTensors, OutTensor};
use super::{ExportError, ExportTensor};
use crate::error_chain::chain_text;
use crate::model::family::ModelFamily;
use crate::model::files::Component;
use crate::model::layout::ModelLayout;
use crate::model::single_file::names::{self, OpenClipPart, VaeBlocks};
use crate::model::single_file::{
    config_key, meta_key, text_encoder_kind, text_encoder_prefix, unet_blocks, TextEncoderKind,
    UNET, VAE,
};
use crate::model::unet::UnetConfig;

/// Makes one output tensor.
type Loader<'a> = Box<dyn Fn() -> candle_core::Result<Tensor> + 'a>;

/// One LDM tensor made of diffusers tensors (indexes into the component's merged tensors).
enum Part {
    Whole(usize),
    /// 1×1 conv: the linear weight with two unit dims appended.
    Conv(usize),
    Transposed(usize),
    /// q, k, v stacked by rows.
    Fused([Option<usize>; 3]),
}

/// LDM name → how it is made from the component's diffusers tensors.
type Parts = BTreeMap<String, Part>;

fn invalid(component: Component, name: &str, message: &str) -> ExportError {
    ExportError::Tensor {
        component,
        name: name.to_string(),
        source: Box::new(candle_core::Error::Msg(message.to_string())),
    }
}

/// The tokenizer settings recorded in the metadata: pad token and length.
fn tokenizer_meta(layout: &ModelLayout, i: usize) -> Value {
    let Some(t) = layout.tokenizers.get(i) else {
        return json!({});
    };
    if let Some(b) = &t.builtin {
        return json!({"pad_token": b.pad, "model_max_length": b.max_length});
    }
    let read = |f: &str| -> Option<Value> {
        let text = std::fs::read_to_string(t.dir()?.join(f)).ok()?;
        serde_json::from_str(&text).ok()
    };
    let token = |v: &Value| match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => m.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    };
    let cfg = read("tokenizer_config.json");
    let map = read("special_tokens_map.json");
    let pad = [&cfg, &map]
        .into_iter()
        .flatten()
        .find_map(|v| v.get("pad_token").and_then(token))
        .unwrap_or_else(|| "<|endoftext|>".to_string());
    let len = cfg
        .as_ref()
        .and_then(|c| c.get("model_max_length"))
        .and_then(Value::as_f64)
        .filter(|n| *n < 1e12)
        .map_or(77, |n| n as u64);
    json!({"pad_token": pad, "model_max_length": len})
}

/// Writes `path`: the `base` model with the `updated` components' tensors (by checkpoint name)
/// replaced, float tensors of those components in `dtype`. The other components' tensors are as
/// stored, except that a half `dtype` (f16, bf16) makes the whole file half, as EveryDream2's
/// converter's `half` and A1111's fp16 checkpoints are.
pub fn save_single_file<T: ExportTensor>(
    base: &ModelLayout,
    path: &Path,
    updated: &[(Component, Vec<(String, T)>)],
    dtype: DType,
) -> Result<(), ExportError> {
    save_single_file_with(base, path, updated, dtype, &[])
}

/// [`save_single_file`] with further header entries (a run's ModelSpec keys); the prediction
/// type's keys are the model's own whatever `extra` says.
pub fn save_single_file_with<T: ExportTensor>(
    base: &ModelLayout,
    path: &Path,
    updated: &[(Component, Vec<(String, T)>)],
    dtype: DType,
    extra: &[(String, String)],
) -> Result<(), ExportError> {
    let mut metadata = serde_json::Map::new();
    for (k, v) in extra {
        metadata.insert(k.clone(), json!(v));
    }
    metadata.insert(meta_key("format_version"), json!("1"));
    metadata.insert(
        meta_key("model_index"),
        json!(base.model_index_json()?.to_string()),
    );
    let scheduler = base.scheduler_json()?;
    metadata.insert(meta_key("scheduler_config"), json!(scheduler.to_string()));
    let mut bases = Vec::new();
    for c in &base.components {
        bases.push((c, BaseTensors::open(c)?));
    }
    let mut out: Vec<OutTensor<'_>> = Vec::new();
    let mut te_index = 0;
    for (c, source) in &bases {
        let component = c.component;
        let config = c.config_json()?;
        metadata.insert(config_key(component), json!(config.to_string()));
        if let Some(tokenizer) = component.tokenizer_folder() {
            metadata.insert(
                meta_key(tokenizer),
                json!(tokenizer_meta(base, te_index).to_string()),
            );
            te_index += 1;
        }
        let none: &[(String, T)] = &[];
        let (tensors, dt) = match updated.iter().find(|(k, _)| *k == component) {
            Some((_, t)) => (t.as_slice(), Some(dtype)),
            None => (none, (dtype != DType::F32).then_some(dtype)),
        };
        let diffusers = merged_tensors(c, source, tensors, dt)?;
        let parts = ldm_parts(base.family, component, &config, &diffusers)?;
        out.extend(ldm_tensors(component, parts, diffusers)?);
    }
    out.extend(declare_schedule(&scheduler, &mut metadata));
    out.sort_by(|a, b| a.name.cmp(&b.name));
    write_safetensors(path, metadata, &out)
}

/// What the file's tensors cannot say, in the forms other tools read
/// ([`prediction`](crate::model::single_file::prediction)): the prediction type as the ModelSpec
/// key kohya and OneTrainer read and ComfyUI's `modelspec.predict_key`, and for a v-prediction
/// model ComfyUI's empty `v_pred` tensor (and `ztsnr` when the schedule is rescaled to zero
/// terminal SNR), which ComfyUI and Forge read. Without them those tools take a v-prediction SD1
/// or SDXL file for epsilon.
fn declare_schedule<'a>(
    scheduler: &Value,
    metadata: &mut serde_json::Map<String, Value>,
) -> Vec<OutTensor<'a>> {
    let v = scheduler.get("prediction_type").and_then(Value::as_str) == Some("v_prediction");
    let name = if v { "v" } else { "epsilon" };
    metadata.insert("modelspec.prediction_type".into(), json!(name));
    metadata.insert("modelspec.predict_key".into(), json!(name));
    let ztsnr = scheduler
        .get("rescale_betas_zero_snr")
        .and_then(Value::as_bool)
        == Some(true);
    let markers: &[&str] = match (v, ztsnr) {
        (false, _) => &[],
        (true, false) => &["v_pred"],
        (true, true) => &["v_pred", "ztsnr"],
    };
    markers
        .iter()
        .map(|name| OutTensor {
            name: name.to_string(),
            shape: vec![0],
            dtype: DType::F32,
            component: Component::Unet,
            load: Box::new(|| Tensor::zeros(0, DType::F32, &candle_core::Device::Cpu)),
        })
        .collect()
}

/// How each LDM tensor of `component` is made from its merged diffusers tensors.
fn ldm_parts(
    family: ModelFamily,
    component: Component,
    config: &Value,
    diffusers: &[OutTensor<'_>],
) -> Result<Parts, ExportError> {
    match component {
        Component::Unet => unet_parts(config, diffusers),
        Component::Vae => vae_parts(config, diffusers),
        Component::TextEncoder | Component::TextEncoder2 => {
            text_encoder_parts(family, component, diffusers)
        }
    }
}

fn unet_parts(config: &Value, diffusers: &[OutTensor<'_>]) -> Result<Parts, ExportError> {
    let component = Component::Unet;
    let cfg_err = |m: String| invalid(component, "config", &m);
    let cfg = UnetConfig::from_json(&config.to_string(), "unet config")
        .map_err(|e| cfg_err(chain_text(&e)))?;
    let blocks = unet_blocks(&cfg).map_err(cfg_err)?;
    let mut parts = Parts::new();
    for (i, t) in diffusers.iter().enumerate() {
        let ldm = names::unet_to_ldm(&t.name, &blocks)
            .ok_or_else(|| invalid(component, &t.name, "has no LDM name"))?;
        parts.insert(format!("{UNET}{ldm}"), Part::Whole(i));
    }
    Ok(parts)
}

fn vae_parts(config: &Value, diffusers: &[OutTensor<'_>]) -> Result<Parts, ExportError> {
    let levels = config["block_out_channels"].as_array().map_or(0, Vec::len);
    let blocks = VaeBlocks { levels };
    let mut parts = Parts::new();
    for (i, t) in diffusers.iter().enumerate() {
        let (ldm, conv) = names::vae_to_ldm(&t.name, blocks)
            .ok_or_else(|| invalid(Component::Vae, &t.name, "has no LDM name"))?;
        let part = if conv && t.shape.len() == 2 {
            Part::Conv(i)
        } else {
            Part::Whole(i)
        };
        parts.insert(format!("{VAE}{ldm}"), part);
    }
    Ok(parts)
}

fn text_encoder_parts(
    family: ModelFamily,
    component: Component,
    diffusers: &[OutTensor<'_>],
) -> Result<Parts, ExportError> {
    let prefix = text_encoder_prefix(family, component)
        .ok_or_else(|| invalid(component, "config", &format!("{family} has no {component}")))?;
    let mut parts = Parts::new();
    for (i, t) in diffusers.iter().enumerate() {
        // transformers 5 may store a CLIPTextModel without `text_model.`.
        let name = if t.name.starts_with("text_model.") || t.name == "text_projection.weight" {
            t.name.clone()
        } else {
            format!("text_model.{}", t.name)
        };
        match text_encoder_kind(family, component, true) {
            TextEncoderKind::Clip { .. } => {
                parts.insert(format!("{prefix}{name}"), Part::Whole(i));
            }
            TextEncoderKind::OpenClip { .. } => match names::openclip_to_ldm(&name) {
                Some(OpenClipPart::Whole(l)) => {
                    parts.insert(format!("{prefix}{l}"), Part::Whole(i));
                }
                Some(OpenClipPart::Transposed(l)) => {
                    parts.insert(format!("{prefix}{l}"), Part::Transposed(i));
                }
                Some(OpenClipPart::Fused(l, k)) => {
                    let e = parts
                        .entry(format!("{prefix}{l}"))
                        .or_insert(Part::Fused([None; 3]));
                    if let Part::Fused(slots) = e {
                        slots[k] = Some(i);
                    }
                }
                // Buffers OpenCLIP has no place for (`position_ids`).
                None if name.ends_with("position_ids") => {}
                None => return Err(invalid(component, &t.name, "has no OpenCLIP name")),
            },
        }
    }
    Ok(parts)
}

/// The output tensors of one component: each LDM tensor with the loader that makes it.
fn ldm_tensors<'a>(
    component: Component,
    parts: Parts,
    diffusers: Vec<OutTensor<'a>>,
) -> Result<Vec<OutTensor<'a>>, ExportError> {
    let diffusers: Vec<Rc<OutTensor<'a>>> = diffusers.into_iter().map(Rc::new).collect();
    let mut out = Vec::with_capacity(parts.len());
    for (ldm, part) in parts {
        let (shape, dtype, load): (Vec<usize>, DType, Loader<'a>) = match part {
            Part::Whole(i) => {
                let t = diffusers[i].clone();
                (t.shape.clone(), t.dtype, Box::new(move || (t.load)()))
            }
            Part::Conv(i) => {
                let t = diffusers[i].clone();
                let mut s = t.shape.clone();
                s.extend([1, 1]);
                let shape = s.clone();
                (
                    s,
                    t.dtype,
                    Box::new(move || (t.load)()?.reshape(shape.as_slice())),
                )
            }
            Part::Transposed(i) => {
                let t = diffusers[i].clone();
                let s = t.shape.iter().rev().copied().collect();
                (s, t.dtype, Box::new(move || (t.load)()?.t()?.contiguous()))
            }
            Part::Fused(slots) => {
                let [Some(q), Some(k), Some(v)] = slots else {
                    return Err(invalid(component, &ldm, "lacks one of q, k, v"));
                };
                fused(&[
                    diffusers[q].clone(),
                    diffusers[k].clone(),
                    diffusers[v].clone(),
                ])
            }
        };
        out.push(OutTensor {
            name: ldm,
            shape,
            dtype,
            component,
            load,
        });
    }
    Ok(out)
}

/// q, k and v stacked by rows into one tensor: its shape, dtype and loader.
fn fused<'a>(ts: &[Rc<OutTensor<'a>>; 3]) -> (Vec<usize>, DType, Loader<'a>) {
    let mut shape = ts[0].shape.clone();
    shape[0] *= 3;
    let dtype = ts[0].dtype;
    let ts = ts.clone();
    let load: Loader<'a> = Box::new(move || {
        let parts = ts
            .iter()
            .map(|t| (t.load)())
            .collect::<candle_core::Result<Vec<_>>>()?;
        Tensor::cat(&parts, 0)
    });
    (shape, dtype, load)
}
