//! Damaged adapter files and single-file checkpoints, each run through the `sdtrain` binary in its
//! own temp folder: the representative cases scripts/fuzz-files found (one mutation of a fixture
//! each). Every case checks the exit code, that the `error:` line names the file and the tensor,
//! and that nothing panicked. Each test is named after what used to happen.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Output;

use candle_core::{DType, Device, Tensor};
use common::cli::{demo_data, run_folder, sdtrain, text, write_config};
use common::fixture;

/// The header and data of a safetensors file.
fn read_st(path: &Path) -> (serde_json::Value, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header, bytes[8 + n..].to_vec())
}

/// Writes `header` and `data` as a safetensors file (the header is not checked).
fn write_st(path: &Path, header: &serde_json::Value, data: &[u8]) {
    let mut h = header.to_string().into_bytes();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&h);
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

/// A copy of fixture file `rel` in `dir` with its header edited by `edit`.
fn with_header(dir: &Path, rel: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let src = fixture(rel);
    let (mut header, data) = read_st(&src);
    edit(&mut header);
    let out = dir.join(src.file_name().unwrap());
    write_st(&out, &header, &data);
    out
}

/// A copy of fixture file `rel` in `dir` with tensor `name` replaced by `make(old)`.
fn with_tensor(dir: &Path, rel: &str, name: &str, make: impl FnOnce(&Tensor) -> Tensor) -> PathBuf {
    let src = fixture(rel);
    let mut t: HashMap<String, Tensor> =
        candle_core::safetensors::load(&src, &Device::Cpu).unwrap();
    let new = make(&t[name]);
    t.insert(name.to_string(), new);
    let out = dir.join(src.file_name().unwrap());
    candle_core::safetensors::save(&t, &out).unwrap();
    out
}

/// The last `error:` line and what follows it.
fn last_error(out: &Output) -> String {
    let all = text(out);
    all.rfind("error:")
        .map(|i| all[i..].to_string())
        .unwrap_or_default()
}

/// Exit `code`, no panic, and an error naming `file` and each of `names`.
fn assert_refused(out: &Output, code: i32, file: &Path, names: &[&str]) {
    let all = text(out);
    assert_eq!(out.status.code(), Some(code), "{all}");
    assert!(!all.contains("panicked"), "{all}");
    let err = last_error(out);
    assert!(
        err.contains(&file.display().to_string()),
        "the file is not named: {err}"
    );
    for n in names {
        assert!(err.contains(n), "`{n}` is not named: {err}");
    }
}

fn sample_args<'a>(model: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![
        "sample", "--model", model, "--prompt", "a cat", "--steps", "1", "--width", "32",
        "--height", "32", "--cpu", "--out", out,
    ]
}

/// A LoRA whose header claims a rank of 2^31 for one `lora_down` (the data unchanged) was refused
/// with safetensors' "invalid shape, data type, or offset for tensor", naming no tensor.
#[test]
fn a_lora_rank_of_2_pow_31_in_the_header_named_no_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let key = "lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight";
    let file = with_header(tmp.path(), "kohya_tiny_sd15.safetensors", |h| {
        h[key]["shape"][0] = serde_json::json!(1u64 << 31);
    });
    let model = fixture("tiny-sd15");
    let mut args = sample_args(model.to_str().unwrap(), "x.png");
    args.extend(["--lora", file.to_str().unwrap()]);
    let out = sdtrain(&args, tmp.path());
    assert_refused(&out, 1, &file, &[key, "[2147483648, 8, 3, 3]"]);
}

/// A LoRA whose header gives one tensor a dtype of another size (U64 for F16, the data
/// unchanged), as `adapter.init_from`: refused with "invalid shape, data type, or offset for
/// tensor", naming none.
#[test]
fn a_wrong_dtype_size_in_an_init_from_named_no_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let down = "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight";
    let file = with_header(tmp.path(), "kohya_tiny_sd15.safetensors", |h| {
        h[down]["dtype"] = serde_json::json!("U64");
    });
    let extra = serde_json::json!({
        "mode": "locon", "max_steps": 1,
        "adapter": {"rank": 4, "alpha": 4, "conv_rank": 2, "init_from": file},
    });
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert_refused(&out, 1, &file, &[down, "dtype U64"]);
}

/// A single file whose `out.2.weight` is stored flattened ([288] for [4, 8, 3, 3]) was detected
/// as a UNet giving 288 channels and refused as "an inpainting UNet", naming no tensor.
#[test]
fn a_flattened_unet_tensor_was_called_an_inpainting_unet() {
    let tmp = tempfile::tempdir().unwrap();
    let key = "model.diffusion_model.out.2.weight";
    let file = with_header(tmp.path(), "single-file/tiny-sd15.safetensors", |h| {
        h[key]["shape"] = serde_json::json!([288]);
    });
    let out = sdtrain(&["inspect", "--model", file.to_str().unwrap()], tmp.path());
    assert_refused(&out, 2, &file, &[key, "[288]"]);
    assert!(!last_error(&out).contains("inpainting"), "{}", text(&out));
}

/// conv_in and the first level disagreeing named neither tensor ("conv_in has 9 channels but the
/// first level 8").
#[test]
fn a_conv_in_mismatch_named_no_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let key = "model.diffusion_model.input_blocks.0.0.weight";
    let file = with_tensor(tmp.path(), "single-file/tiny-sd21.safetensors", key, |t| {
        Tensor::zeros((9, 4, 3, 3), t.dtype(), &Device::Cpu).unwrap()
    });
    let f = file.to_str().unwrap();
    let out = sdtrain(&sample_args(f, "x.png"), tmp.path());
    let resnet = "model.diffusion_model.input_blocks.1.0.out_layers.3.weight";
    assert_refused(&out, 2, &file, &[key, resnet]);
}

/// An SDXL file whose second text encoder has 78 positions (the first 77) loaded, then failed at
/// the first prompt with candle's "shape mismatch in cat", naming no file (exit 1).
#[test]
fn sdxl_encoders_of_unequal_length_failed_at_the_first_prompt() {
    let tmp = tempfile::tempdir().unwrap();
    let key = "conditioner.embedders.1.model.positional_embedding";
    let file = with_tensor(tmp.path(), "single-file/tiny-sdxl.safetensors", key, |t| {
        Tensor::zeros((78, 32), t.dtype(), &Device::Cpu).unwrap()
    });
    let out = sdtrain(&sample_args(file.to_str().unwrap(), "x.png"), tmp.path());
    assert_refused(&out, 2, &file, &[key, "78"]);
}

/// A single file with an fp8 (F8_E4M3) VAE tensor trained, then failed at its save: "vae: tensor
/// … has dtype F8E4M3, which the export cannot write". The frozen tensor is now written as F32.
#[test]
fn an_fp8_vae_tensor_failed_the_save_after_training() {
    let tmp = tempfile::tempdir().unwrap();
    let key = "first_stage_model.encoder.conv_in.weight";
    let file = with_tensor(tmp.path(), "single-file/tiny-sd15.safetensors", key, |t| {
        t.to_dtype(DType::F8E4M3).unwrap()
    });
    let extra = serde_json::json!({"model": file, "mode": "full", "max_steps": 1});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let saved = run_folder(tmp.path()).join("final/vae/diffusion_pytorch_model.safetensors");
    let (header, _) = read_st(&saved);
    assert_eq!(header["encoder.conv_in.weight"]["dtype"], "F32", "{header}");
}

/// A single file sdtrain saved, with its `sdtrain.unet_config` metadata replaced by `[]`: the
/// error said "the unet config: invalid UNet config unet config: invalid length 0", naming no key.
#[test]
fn a_bad_sdtrain_config_in_the_metadata_named_no_key() {
    let tmp = tempfile::tempdir().unwrap();
    let extra =
        serde_json::json!({"mode": "full", "max_steps": 1, "save_ckpt_format": "safetensors"});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let run = run_folder(tmp.path());
    let saved = std::fs::read_dir(&run)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .expect("a single file");
    let (header, data) = read_st(&saved);
    // Each config the file carries; `[]` for the VAE's read as zero levels and blamed 28
    // tensors, and for the scheduler, tokenizer and model_index passed unnoticed.
    for key in [
        "unet_config",
        "vae_config",
        "text_encoder_config",
        "scheduler_config",
        "tokenizer",
        "model_index",
    ] {
        let mut header = header.clone();
        header["__metadata__"][format!("sdtrain.{key}")] = serde_json::json!("[]");
        let file = tmp.path().join(format!("bad_{key}.safetensors"));
        write_st(&file, &header, &data);
        let out = sdtrain(&["inspect", "--model", file.to_str().unwrap()], tmp.path());
        let named = format!("sdtrain.{key}");
        assert_refused(&out, 2, &file, &[&named]);
    }
}

/// A single file without one of its tensors named the tensor by its diffusers name only, which
/// a user cannot find in the file; the error now gives the file's own name too (for an OpenCLIP
/// q/k/v, the fused tensor it is a third of).
#[test]
fn a_missing_single_file_tensor_was_named_as_diffusers_names_it() {
    for (fixture_file, drop, names) in [
        (
            "single-file/tiny-sd15.safetensors",
            "model.diffusion_model.output_blocks.2.0.emb_layers.1.bias",
            &[
                "up_blocks.0.resnets.2.time_emb_proj.bias",
                "`model.diffusion_model.output_blocks.2.0.emb_layers.1.bias` in the file's names",
            ][..],
        ),
        (
            "single-file/tiny-sdxl.safetensors",
            "conditioner.embedders.1.model.transformer.resblocks.1.attn.in_proj_weight",
            &[
                "`conditioner.embedders.1.model.transformer.resblocks.1.attn.in_proj_weight` in \
               the file's names",
            ][..],
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let src = fixture(fixture_file);
        let mut t = candle_core::safetensors::load(&src, &Device::Cpu).unwrap();
        t.remove(drop).unwrap();
        let file = tmp.path().join(src.file_name().unwrap());
        candle_core::safetensors::save(&t, &file).unwrap();
        let model = file.to_str().unwrap();
        let out = sdtrain(&sample_args(model, "o.png"), tmp.path());
        assert_refused(&out, 2, &file, names);
    }
}

/// A single file with a NaN in a weight sampled a black image and exited 0; `sdtrain sample`
/// now refuses the image and names the tensor, and a run's samples before the first step skip
/// the round with a warning (the run then stops on its non-finite loss, naming the tensor).
#[test]
fn a_nan_weight_drew_a_black_sample() {
    let tmp = tempfile::tempdir().unwrap();
    let name = "cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc2.weight";
    let file = with_tensor(tmp.path(), "single-file/tiny-sd15.safetensors", name, |t| {
        let mut v = t
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        v[0] = f32::NAN;
        Tensor::from_vec(v, t.dims(), &Device::Cpu)
            .unwrap()
            .to_dtype(t.dtype())
            .unwrap()
    });
    let model = file.to_str().unwrap();
    let out = sdtrain(&sample_args(model, "o.png"), tmp.path());
    assert_refused(&out, 1, &file, &[name, "holds NaN", "NaN in the latents"]);
    assert!(!tmp.path().join("o.png").exists(), "the image was written");

    let prompts = tmp.path().join("p.json");
    let json = r#"{"generate_pretrain_samples": true, "cfgs": [1], "num_inference_steps": 1,
        "samples": [{"prompt": "a cat", "size": [32, 32]}]}"#;
    std::fs::write(&prompts, json).unwrap();
    let extra = serde_json::json!({"model": model, "sample_prompts": prompts, "max_steps": 2});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let all = text(&out);
    assert!(
        all.contains("samples skipped: sampling produced NaN"),
        "{all}"
    );
    assert!(!all.contains("panicked"), "{all}");
}
