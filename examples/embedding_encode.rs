//! Encodes a prompt with sdtrain's own text encoders after adding a textual-inversion file, and
//! writes the conditioning (`context`, and SDXL's `pooled`).
//! `tests/fixtures/check_embedding_diffusers.py` compares it with diffusers'
//! `load_textual_inversion`.
//!
//! ```text
//! cargo run --release --example embedding_encode -- <pipeline dir> <embedding file> <token> "<prompt>" <out.safetensors>
//! ```

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::Context;
use candle_core::{DType, Device, Tensor};
use sdtrain::adapter::embedding_file::load_embedding;
use sdtrain::model::layout::ModelLayout;
use sdtrain::model::pipeline::{LoadOptions, StableDiffusion};
use sdtrain::model::textual_inversion::add_embedding;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir, file, token, prompt, out] = args.as_slice() else {
        anyhow::bail!("usage: embedding_encode <pipeline dir> <embedding> <token> <prompt> <out>");
    };
    let layout = ModelLayout::read(&PathBuf::from(dir), None)?;
    let opts = LoadOptions {
        dtype: DType::F32,
        trained_dtype: DType::F32,
        vae_dtype: None,
        device: Device::Cpu,
        train_unet: false,
        train_text_encoders: false,
        fp8_unet: false,
        fp8_text_encoders: false,
    };
    let mut sd = StableDiffusion::load(layout, &opts)?;
    let widths: Vec<usize> = sd
        .text_encoders
        .iter()
        .map(|te| te.model.token_embedding.dim())
        .collect();
    let vectors = load_embedding(&PathBuf::from(file), &Device::Cpu)?.for_encoders(&widths)?;
    add_embedding(&mut sd, token, &vectors).context("adding the embedding")?;
    let cond = sd.encode_prompts(&[prompt.as_str()], 0)?;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    tensors.insert("context".into(), cond.context);
    if let Some(p) = cond.pooled {
        tensors.insert("pooled".into(), p);
    }
    candle_core::safetensors::save(&tensors, out)?;
    Ok(())
}
