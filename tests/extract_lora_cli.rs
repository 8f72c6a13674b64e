//! `sdtrain extract-lora` against kohya sd-scripts' `extract_lora_from_models.py`: the factors of
//! a tuned copy of the tiny SD1.5 fixture equal what kohya's own SVD lines give
//! (tests/fixtures/extract_lora_reference.py), every LoCon target is extracted, the text
//! encoders are left out below `--min-diff`, and bad input is refused with the reason.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::cli::{sdtrain, text};

/// kohya's reference script's δ for tensor `name`: a hash of the flat index, ±0.025.
fn delta(name: &str, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let s = name.len() as u64;
    let values: Vec<f32> = (0..n as u64)
        .map(|t| {
            let x = (t.wrapping_mul(2654435761).wrapping_add(s) % (1 << 32)) as f64;
            (0.05 * (x / (1u64 << 32) as f64 - 0.5)) as f32
        })
        .collect();
    Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
}

/// The fixture with δ added to every UNet and text-encoder tensor (the reference's tuned model).
fn tuned_copy(dir: &Path) -> PathBuf {
    let tuned = dir.join("tuned");
    common::copy_dir(&common::fixture("tiny-sd15"), &tuned);
    for file in [
        "unet/diffusion_pytorch_model.safetensors",
        "text_encoder/model.safetensors",
    ] {
        let path = tuned.join(file);
        let tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        let moved: HashMap<String, Tensor> = tensors
            .into_iter()
            .map(|(k, v)| {
                let d = delta(&k, v.dims());
                let v = (v.to_dtype(DType::F32).unwrap() + d).unwrap();
                (k, v)
            })
            .collect();
        candle_core::safetensors::save(&moved, &path).unwrap();
    }
    tuned
}

fn extract(dir: &Path, tuned: &Path, extra: &[&str]) -> std::process::Output {
    let base = common::fixture("tiny-sd15").display().to_string();
    let tuned = tuned.display().to_string();
    let mut args = vec![
        "extract-lora",
        "--base",
        &base,
        "--tuned",
        &tuned,
        "--out",
        "x.safetensors",
    ];
    args.extend_from_slice(extra);
    sdtrain(&args, dir)
}

fn load(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

/// The factors equal kohya's (its SVD lines on the same δ, float32 there, f64 here) to 1e-4 of
/// their largest value. Catches `S` left out of `up`, the quantile clamp skipped or taken per
/// factor, the conv flattened the wrong way, the rank not capped by the channels, or
/// base − tuned instead of tuned − base.
#[test]
fn extracted_factors_match_kohyas() {
    let tmp = tempfile::tempdir().unwrap();
    let tuned = tuned_copy(tmp.path());
    let out = extract(tmp.path(), &tuned, &["--rank", "4", "--conv-rank", "2"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("text encoders: largest change"),
        "{}",
        text(&out)
    );
    let got = load(&tmp.path().join("x.safetensors"));
    let reference = load(&common::fixture("reference/extract_lora.safetensors"));
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::fixture("reference/extract_lora.json")).unwrap(),
    )
    .unwrap();
    for m in meta["modules"].as_array().unwrap() {
        let name = m["name"].as_str().unwrap();
        for part in ["lora_up.weight", "lora_down.weight"] {
            let key = format!("{name}.{part}");
            let (g, r) = (&got[&key], &reference[&key]);
            assert_eq!(g.dims(), r.dims(), "{key}");
            let scale = r.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
            let scale = scale.to_scalar::<f32>().unwrap();
            let diff = common::max_abs_diff(g, r);
            assert!(diff <= 1e-4 * scale, "{key}: off by {diff} (scale {scale})");
        }
        let alpha = got[&format!("{name}.alpha")].to_dtype(DType::F32).unwrap();
        let rank = m["rank"].as_f64().unwrap() as f32;
        assert_eq!(alpha.to_scalar::<f32>().unwrap(), rank, "{name}.alpha");
    }
    // Every LoCon target of the UNet (198) and of the text encoder (24): the text encoder moved
    // by 0.025, above kohya's --min-diff 0.01.
    let modules = got.keys().filter(|k| k.ends_with(".alpha")).count();
    assert_eq!(modules, 222);

    // Above the change, the text encoder is left out; without --conv-rank, the 3×3 convs are.
    let out = extract(tmp.path(), &tuned, &["--min-diff", "0.1"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("left out (the UNet alone)"),
        "{}",
        text(&out)
    );
    let got = load(&tmp.path().join("x.safetensors"));
    assert!(got.keys().all(|k| k.starts_with("lora_unet_")));
    assert!(!got.contains_key("lora_unet_down_blocks_0_resnets_0_conv1.alpha"));
    assert!(got.contains_key("lora_unet_down_blocks_0_attentions_0_proj_in.alpha"));
}

#[test]
fn bad_extractions_are_refused_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let sdxl = common::fixture("tiny-sdxl");
    let out = extract(tmp.path(), &sdxl, &[]);
    assert!(!out.status.success());
    assert!(text(&out).contains("one family"), "{}", text(&out));
    let same = common::fixture("tiny-sd15");
    for (flags, needle) in [
        (
            &["--rank", "0"][..],
            "--rank and --conv-rank must be at least 1",
        ),
        (
            &["--clamp-quantile", "1.5"][..],
            "--clamp-quantile must be in (0, 1]",
        ),
        (&["--min-diff=-1"][..], "--min-diff must be 0 or more"),
    ] {
        let out = extract(tmp.path(), &same, flags);
        assert!(!out.status.success(), "{flags:?}");
        assert!(text(&out).contains(needle), "{flags:?}: {}", text(&out));
    }
    let out = extract(tmp.path(), &tmp.path().join("nowhere"), &[]);
    assert!(!out.status.success());
    assert!(text(&out).contains("--tuned"), "{}", text(&out));
}

/// kohya's `--dim_from_weights`: a file whose ranks differ by module (an extraction capped by
/// the level-0 channels: 8 there, 12 elsewhere) trains on from `init_from` with each module's own
/// rank and alpha, and saves them; without it the ranks must match and the run is refused.
/// Catches the file's ranks ignored, or modules outside the file attached.
#[test]
fn dim_from_weights_takes_each_modules_rank_from_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let tuned = tuned_copy(tmp.path());
    // The UNet alone (the text encoders left out): no text-encoder module may be attached.
    let flags = ["--rank", "12", "--conv-rank", "12", "--min-diff", "0.1"];
    let out = extract(tmp.path(), &tuned, &flags);
    assert!(out.status.success(), "{}", text(&out));
    let init = tmp.path().join("x.safetensors");
    let file = load(&init);
    let rank_of = |t: &HashMap<String, Tensor>, k: &str| t[k].dims()[0];
    let small =
        "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight";
    let large = "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight";
    assert_eq!((rank_of(&file, small), rank_of(&file, large)), (8, 12));
    let run = |adapter: serde_json::Value, dir: &Path| {
        let extra = serde_json::json!({"mode": "locon", "max_steps": 1, "adapter": adapter});
        let cfg = common::cli::write_config(dir, "tiny-sd15", &common::cli::demo_data(), extra);
        sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir)
    };
    let dir = tmp.path().join("from");
    std::fs::create_dir_all(&dir).unwrap();
    let out = run(
        serde_json::json!({"init_from": init, "dim_from_weights": true}),
        &dir,
    );
    assert!(out.status.success(), "{}", text(&out));
    let saved = load(&common::cli::run_folder(&dir).join("sdtrain.safetensors"));
    assert_eq!(
        saved.keys().filter(|k| k.ends_with(".alpha")).count(),
        file.keys().filter(|k| k.ends_with(".alpha")).count()
    );
    for k in file.keys().filter(|k| k.ends_with("lora_down.weight")) {
        assert_eq!(saved[k].dims(), file[k].dims(), "{k}");
    }
    let dir = tmp.path().join("fixed");
    std::fs::create_dir_all(&dir).unwrap();
    let out = run(
        serde_json::json!({"init_from": init, "rank": 12, "conv_rank": 12}),
        &dir,
    );
    assert!(!out.status.success());
    assert!(text(&out).contains("shape mismatch"), "{}", text(&out));
    let out = run(serde_json::json!({"dim_from_weights": true}), &dir);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("adapter.dim_from_weights"),
        "{}",
        text(&out)
    );
}
