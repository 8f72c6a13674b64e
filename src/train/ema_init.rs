//! EveryDream2's `ema_resume_model`: the EMA copy of a new run starts from another model's
//! weights instead of the trained ones (EveryDream2 loads an "EMA decay" checkpoint, e.g.
//! `stabilityai/stable-diffusion-2-1-ema-decay`, into its `unet_ema`/`text_encoder_ema`).
//!
//! - Full fine-tunes: a model as `model` takes it (a hub id, a diffusers folder or a single
//!   file, sdtrain's own `final-ema/` included). Its UNet, and text encoders when they train, are
//!   read on the CPU in f32, and each EMA tensor takes the weight of the same name.
//! - Adapter modes: a kohya LoRA/LoCon file (sdtrain's own `<project>-ema.safetensors`); each EMA
//!   tensor takes the file's tensor of the same kohya name.
//!
//! Every EMA tensor must be found with its shape; a model of another architecture or an adapter
//! file of another rank or target set is an error naming the first tensor that does not fit. A
//! resumed run continues its save point's EMA instead.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor};

use super::ema::Ema;
use crate::config::{TrainMode, TrainPlan};
use crate::model::files::Component;
use crate::model::layout::ModelLayout;
use crate::model::pipeline::{LoadOptions, StableDiffusion};
use crate::model::source::ModelSource;

/// Starts `ema` from `source` (the plan's `ema_resume_model`).
pub(super) fn start_ema_from(ema: &mut Ema, plan: &TrainPlan, source: &str) -> anyhow::Result<()> {
    let values = match plan.mode {
        TrainMode::Full => model_values(plan, source),
        TrainMode::Lora
        | TrainMode::Locon
        | TrainMode::Loha
        | TrainMode::Lokr
        | TrainMode::Dora => adapter_values(Path::new(source)),
        TrainMode::TextualInversion => super::embeddings::ema_values(Path::new(source)),
    }
    .with_context(|| format!("ema_resume_model `{source}`"))?;
    ema.start_from(|name| values.get(name).cloned())
        .with_context(|| format!("ema_resume_model `{source}`"))?;
    crate::console::say(format_args!("ema: starts from {source}"));
    Ok(())
}

/// A model's UNet (and trained text encoders') weights, by the EMA's names: `unet/<name>` and
/// `text_encoder/<component>.<name>`, as the optimizer groups name them.
fn model_values(plan: &TrainPlan, source: &str) -> anyhow::Result<HashMap<String, Tensor>> {
    let dir = ModelSource::parse(source)?.resolve()?;
    let layout = dir.noting_copy(ModelLayout::read_with(
        &dir.path,
        None,
        &plan.single_file_options(),
    ))?;
    let load = LoadOptions {
        dtype: DType::F32,
        trained_dtype: DType::F32,
        vae_dtype: None,
        device: Device::Cpu,
        train_unet: true,
        train_text_encoders: plan.train_text_encoder,
        fp8_unet: false,
        fp8_text_encoders: false,
    };
    let sd = StableDiffusion::load(layout, &load)?;
    let mut values: HashMap<String, Tensor> = sd
        .unet_weights
        .params()
        .into_iter()
        .map(|(n, v)| (format!("unet/{n}"), v.as_tensor().clone()))
        .collect();
    if plan.train_text_encoder {
        let folders = [Component::TextEncoder, Component::TextEncoder2];
        for (te, folder) in sd.text_encoders.iter().zip(folders) {
            for (n, v) in te.weights.params() {
                values.insert(format!("text_encoder/{folder}.{n}"), v.as_tensor().clone());
            }
        }
    }
    Ok(values)
}

/// A kohya adapter file's tensors, by the EMA's names (`unet/lora_unet_…`,
/// `text_encoder/lora_te…`).
fn adapter_values(path: &Path) -> anyhow::Result<HashMap<String, Tensor>> {
    if !path.is_file() {
        bail!("is not a file: in lora/locon mode it names a kohya adapter file (.safetensors)");
    }
    let tensors = candle_core::safetensors::load(path, &Device::Cpu)
        .with_context(|| format!("reading {}", path.display()))?;
    Ok(tensors
        .into_iter()
        .map(|(name, t)| {
            let group = if name.starts_with("lora_unet") {
                "unet"
            } else {
                "text_encoder"
            };
            (format!("{group}/{name}"), t)
        })
        .collect())
}
