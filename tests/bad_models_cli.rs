//! Broken model folders, through the binary: the most telling of what `scripts/fuzz-model` found,
//! each a copy of a tiny fixture with one thing changed. Each must end with exit 1 or 2 and an
//! error line naming the file and key (or tensor), never a panic or an aborted allocation.
//! Each test is named after what used to happen.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Output;

use candle_core::{Device, Tensor};
use common::cli::{demo_data, sdtrain, text, write_config};

/// A copy of `fixture` in `dir/model` with `key` of the JSON file `rel` set to `value`.
fn model_with(
    dir: &Path,
    fixture: &str,
    rel: &str,
    key: &str,
    value: serde_json::Value,
) -> PathBuf {
    let model = dir.join("model");
    common::copy_dir(&common::fixture(fixture), &model);
    let path = model.join(rel);
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg[key] = value;
    std::fs::write(&path, cfg.to_string()).unwrap();
    model
}

/// One LoRA step on `model`.
fn train(dir: &Path, model: &Path) -> Output {
    let cfg = write_config(
        dir,
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({"model": model, "max_steps": 1, "mode": "lora"}),
    );
    sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir)
}

/// One 32x32 sampling step from `model`.
fn sample(dir: &Path, model: &Path) -> Output {
    let out = dir.join("x.png");
    let args = [
        "sample",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "a cat",
        "--steps",
        "1",
        "--width",
        "32",
        "--height",
        "32",
        "--cpu",
        "--out",
        out.to_str().unwrap(),
    ];
    sdtrain(&args, dir)
}

/// Asserts exit `code`, no panic or abort, and an `error:` line holding each of `names`.
fn refused(out: &Output, code: i32, names: &[&str]) {
    let msg = text(out);
    assert_eq!(out.status.code(), Some(code), "{msg}");
    assert!(
        !msg.contains("panicked") && !msg.contains("memory allocation"),
        "{msg}"
    );
    let line = &msg[msg.rfind("error:").expect("no error line")..];
    for name in names {
        assert!(line.contains(name), "no {name}: {msg}");
    }
}

/// `"layers_per_block": 2^40` in the UNet's config aborted the process (SIGABRT) allocating
/// room for 2^40 resnets. It is refused naming the file, the key and the range.
#[test]
fn a_huge_unet_layers_per_block_aborted_on_allocation() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_with(
        tmp.path(),
        "tiny-sdxl",
        "unet/config.json",
        "layers_per_block",
        (1u64 << 40).into(),
    );
    let unet = model.join("unet/config.json");
    refused(
        &train(tmp.path(), &model),
        2,
        &[unet.to_str().unwrap(), "`layers_per_block`", "1 to 1024"],
    );
}

/// A VAE `layers_per_block` of 0 failed in the first group norm: "group norm: weight [16], want
/// [8] for input [1, 8, 32, 32]", naming no file.
#[test]
fn a_zero_vae_layers_per_block_failed_in_a_group_norm() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_with(
        tmp.path(),
        "tiny-sd15",
        "vae/config.json",
        "layers_per_block",
        0.into(),
    );
    let vae = model.join("vae/config.json");
    refused(
        &sample(tmp.path(), &model),
        2,
        &[vae.to_str().unwrap(), "layers_per_block"],
    );
}

/// SDXL's `addition_time_embed_dim` edited to disagree with the added-embedding input failed at
/// the first step: "frozen linear: input has 128 features, weight [32, 80] wants 80".
#[test]
fn an_sdxl_time_embed_dim_mismatch_failed_in_a_matmul() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_with(
        tmp.path(),
        "tiny-sdxl",
        "unet/config.json",
        "addition_time_embed_dim",
        16.into(),
    );
    let unet = model.join("unet/config.json");
    let te2 = model.join("text_encoder_2/config.json");
    refused(
        &sample(tmp.path(), &model),
        2,
        &[
            unet.to_str().unwrap(),
            te2.to_str().unwrap(),
            "addition_time_embed_dim",
        ],
    );
}

/// A VAE whose `latent_channels` disagree with the UNet was refused naming only the UNet's
/// config, so the changed file went unnamed.
#[test]
fn a_vae_latent_channel_mismatch_named_only_the_unet() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_with(
        tmp.path(),
        "tiny-sd15",
        "vae/config.json",
        "latent_channels",
        16.into(),
    );
    let vae = model.join("vae/config.json");
    refused(
        &train(tmp.path(), &model),
        2,
        &[vae.to_str().unwrap(), "latent_channels"],
    );
}

/// A UNet whose stored `conv_in.weight` is all NaN stopped the run on a NaN loss with advice to
/// lower the learning rate; the error now names the tensor and the file first.
#[test]
fn nan_weights_were_blamed_on_the_learning_rate() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::copy_dir(&common::fixture("tiny-sd15"), &model);
    let file = model.join("unet/diffusion_pytorch_model.safetensors");
    let mut tensors: HashMap<String, Tensor> =
        candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    let w = &tensors["conv_in.weight"];
    let nan = (w.ones_like().unwrap() * f64::NAN).unwrap();
    tensors.insert("conv_in.weight".into(), nan);
    candle_core::safetensors::save(&tensors, &file).unwrap();
    refused(
        &train(tmp.path(), &model),
        1,
        &["`conv_in.weight`", file.to_str().unwrap(), "NaN"],
    );
}

/// A vocab.json giving words ids past the text encoder's 2514 embedding rows failed at the first
/// prompt with "token id 60000 is out of range …", naming no file.
#[test]
fn a_vocab_past_the_embedding_failed_at_the_first_prompt() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_with(
        tmp.path(),
        "tiny-sd15",
        "tokenizer/vocab.json",
        "cat</w>",
        60000.into(),
    );
    let te = model.join("text_encoder/config.json");
    let tok = model.join("tokenizer");
    refused(
        &sample(tmp.path(), &model),
        2,
        &[te.to_str().unwrap(), tok.to_str().unwrap(), "`vocab_size`"],
    );
}

/// A UNet `sample_size` of 65536 made the native resolution, the default training size,
/// 131072 pixels: the first step aborted allocating 51 GB (SIGABRT).
#[test]
fn a_huge_sample_size_aborted_the_first_step() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_with(
        tmp.path(),
        "tiny-sd15",
        "unet/config.json",
        "sample_size",
        65536.into(),
    );
    let cfg = write_config(
        tmp.path(),
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({"model": model, "max_steps": 1, "resolution": null}),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let unet = model.join("unet/config.json");
    refused(&out, 2, &[unet.to_str().unwrap(), "`sample_size`", "4096"]);
}

/// A `model_index.json` or `special_tokens_map.json` holding a list, and a special token that is
/// a number, were accepted (the special token silently replaced by CLIP's default), where
/// diffusers and transformers stop on them.
#[test]
fn json_files_of_the_wrong_shape_were_accepted() {
    for (rel, key) in [
        ("model_index.json", None),
        ("tokenizer/special_tokens_map.json", None),
        ("tokenizer/tokenizer_config.json", Some("pad_token")),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let model = match key {
            Some(k) => model_with(tmp.path(), "tiny-sd15", rel, k, serde_json::json!(5)),
            None => {
                let model = tmp.path().join("model");
                common::copy_dir(&common::fixture("tiny-sd15"), &model);
                std::fs::write(model.join(rel), "[1, 2]").unwrap();
                model
            }
        };
        let file = model.join(rel).display().to_string();
        let out = sample(tmp.path(), &model);
        match key {
            Some(k) => refused(&out, 2, &[&file, &format!("`{k}`"), "is not a token"]),
            None => refused(
                &out,
                2,
                &[&file, "holds a list where a JSON object is expected"],
            ),
        }
    }
}
