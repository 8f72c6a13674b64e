//! Computes sdtrain's own UNet output for a pipeline with a LoRA/LoCon file applied, on the
//! reference inputs of a fixture (`unet.sample`, `unet.timesteps`, `unet.encoder_hidden_states`
//! and, for SDXL, `unet.text_embeds`/`unet.time_ids`), and writes it with the output without the
//! adapter. `tests/fixtures/check_lora_diffusers.py` compares them with diffusers'
//! `load_lora_weights`.
//!
//! ```text
//! cargo run --release --example lora_forward -- <pipeline dir> <lora file> <reference.safetensors> <out.safetensors> [lora|locon]
//! ```

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::Context;
use candle_core::{DType, Device, Tensor};
use sdtrain::config::{AdapterPlan, SaveDtype, TrainMode};
use sdtrain::model::layout::ModelLayout;
use sdtrain::model::pipeline::{LoadOptions, StableDiffusion};
use sdtrain::model::unet::AddedConditions;
use sdtrain::train::adapters::attach_with;

fn unet_out(sd: &StableDiffusion, refs: &HashMap<String, Tensor>) -> anyhow::Result<Tensor> {
    let get = |k: &str| {
        refs.get(k)
            .cloned()
            .with_context(|| format!("reference lacks {k}"))
    };
    let added = match (refs.get("unet.text_embeds"), refs.get("unet.time_ids")) {
        (Some(t), Some(ids)) => Some(AddedConditions {
            text_embeds: t.clone(),
            time_ids: ids.clone(),
        }),
        _ => None,
    };
    Ok(sd.unet.forward(
        &get("unet.sample")?,
        &get("unet.timesteps")?,
        &get("unet.encoder_hidden_states")?,
        added.as_ref(),
    )?)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    anyhow::ensure!(
        args.len() >= 5,
        "usage: lora_forward <pipeline> <lora> <reference> <out> [lora|locon]"
    );
    let layout = ModelLayout::read(&PathBuf::from(&args[1]), None)?;
    let opts = LoadOptions {
        dtype: DType::F32,
        vae_dtype: None,
        device: Device::Cpu,
        train_unet: false,
        train_text_encoders: false,
        fp8_unet: false,
        fp8_text_encoders: false,
        trained_dtype: candle_core::DType::F32,
    };
    let mut sd = StableDiffusion::load(layout, &opts)?;
    let refs = candle_core::safetensors::load(&args[3], &Device::Cpu)?;
    let base = unet_out(&sd, &refs)?;
    let header = safetensors::SafeTensors::read_metadata(&std::fs::read(&args[2])?)?.1;
    let meta = header.metadata().clone().unwrap_or_default();
    let num = |k: &str| meta.get(k).and_then(|v| v.parse::<f64>().ok());
    let rank = num("ss_network_dim").context("ss_network_dim")? as usize;
    let alpha = num("ss_network_alpha").context("ss_network_alpha")?;
    let args_json: serde_json::Value = meta
        .get("ss_network_args")
        .and_then(|v| serde_json::from_str(v).ok())
        .unwrap_or_default();
    let arg = |k: &str| {
        args_json
            .get(k)
            .and_then(|v| v.as_str())
            .and_then(|v| v.parse::<f64>().ok())
    };
    let (conv_rank, conv_alpha) = (
        arg("conv_dim").map_or(rank, |v| v as usize),
        arg("conv_alpha").unwrap_or(alpha),
    );
    let mode = if args.get(5).map(String::as_str) == Some("locon") {
        TrainMode::Locon
    } else {
        TrainMode::Lora
    };
    let te = meta.get("ss_text_encoder_lr").is_some_and(|v| v != "None");
    let plan = AdapterPlan {
        rank,
        alpha,
        conv_rank,
        conv_alpha,
        train_text_encoder: te,
        train_unet: true,
        unet_lr: None,
        text_encoder_lr: None,
        dropout: 0.0,
        factor: -1,
        init_from: Some(PathBuf::from(&args[2])),
        save_dtype: SaveDtype::Fp16,
        training_metadata: true,
        training_comment: None,
        dim_from_weights: false,
        loraplus: Default::default(),
        rank_dropout: 0.0,
        module_dropout: 0.0,
        blocks: None,
        layer_filter: None,
        scale_weight_norms: None,
    };
    let adapters = attach_with(&mut sd, mode, plan, 0)?;
    sdtrain::adapter::set_training(&adapters.modules, false);
    let with = unet_out(&sd, &refs)?;
    let out: HashMap<String, Tensor> =
        [("base".to_string(), base), ("with_lora".to_string(), with)].into();
    candle_core::safetensors::save(&out, &args[4])?;
    println!(
        "wrote {} ({} adapter modules)",
        args[4],
        adapters.modules.len()
    );
    Ok(())
}
