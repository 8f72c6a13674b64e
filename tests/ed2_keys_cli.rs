//! EveryDream2's saving, logging, schedule and text-encoder freezing keys, from the CLI on the
//! tiny SD1.5 fixture: `save_ckpt_dir`, `save_full_precision`, `no_prepend_last`,
//! `save_ckpts_from_n_epochs`, `run_name`, `lr_scheduler`/`lr_warmup_steps`/`lr_decay_steps` in
//! train.json, and optimizer.json's `log_grad_norm` and `text_encoder_freezing` keys. Each check
//! fails if its key were ignored.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::cli::{demo_data, rewrite_after_first_log, sdtrain, text, write_config};

fn load(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn changed(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>, key: &str) -> bool {
    let (a, b) = (&a[key], &b[key]);
    let a = a.to_dtype(DType::F32).unwrap();
    let b = b.to_dtype(DType::F32).unwrap();
    common::max_abs_diff(&a, &b) > 0.0
}

fn only_run(out: &Path) -> PathBuf {
    let runs: Vec<PathBuf> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    runs[0].clone()
}

#[test]
fn ed2_saving_schedule_and_freezing_keys_work_end_to_end() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::write(
        dir.join("optimizer.json"),
        serde_json::to_string(&serde_json::json!({
            "base": {"optimizer": "adamw", "lr": 1e-3, "lr_scheduler": null,
                     "lr_warmup_steps": null, "lr_decay_steps": null, "weight_decay": 0.0},
            "text_encoder_overrides": {"lr": null},
            "text_encoder_freezing": {"unfreeze_last_n_layers": 1, "freeze_embeddings": false,
                                      "freeze_final_layer_norm": true},
            "log_grad_norm": false
        }))
        .unwrap(),
    )
    .unwrap();
    let cfg = write_config(
        dir,
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({
            "mode": "full", "lr": null, "batch_size": 4, "max_steps": null, "max_epochs": 3,
            "optimizer_config": "optimizer.json", "project_name": "ed2", "run_name": "try1",
            "save_every_n_epochs": 1, "save_ckpts_from_n_epochs": 2,
            "save_ckpt_format": "both", "save_ckpt_dir": "ckpts", "save_full_precision": false,
            "no_prepend_last": true,
            "lr_scheduler": "linear", "lr_warmup_steps": 0, "lr_decay_steps": 6,
            "ckpt_every_n_minutes": 0, "gpuid": 0
        }),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir);
    assert!(out.status.success(), "{}", text(&out));
    let run = only_run(&dir.join("out"));
    let name = run.file_name().unwrap().to_string_lossy().to_string();
    assert!(name.starts_with("ed2-try1-"), "run_name: {name}");

    // 8 images at batch 4: 2 steps an epoch, 6 in all. Epoch saves from epoch 2 (epoch 3 is the
    // end); the end takes a step save's name.
    assert!(!run.join("epoch-0001").exists(), "save_ckpts_from_n_epochs");
    assert!(run.join("epoch-0002/unet").is_dir());
    assert!(!run.join("final").exists(), "no_prepend_last");
    assert!(run.join("step-000006/unet").is_dir(), "no_prepend_last");
    // Single files in save_ckpt_dir, in f16.
    let ckpts = dir.join("ckpts");
    for save in ["epoch-0002", "step-000006"] {
        let file = ckpts.join(format!("{name}-{save}.safetensors"));
        let tensors = load(&file);
        assert!(
            tensors.values().all(|t| t.dtype() == DType::F16),
            "save_full_precision false: {save}"
        );
        assert!(!run.join(format!("{save}.safetensors")).exists());
    }

    // The linear schedule from train.json, and no grad norm.
    let log = std::fs::read_to_string(run.join("train_log.jsonl")).unwrap();
    let records: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 6);
    let lrs: Vec<f64> = records
        .iter()
        .map(|r| r["lr_unet"].as_f64().unwrap())
        .collect();
    assert!(lrs.windows(2).all(|w| w[1] < w[0]), "linear decay: {lrs:?}");
    // torch's LambdaLR as diffusers' get_scheduler builds it: step k (from 1) trains at
    // lr·(1 − (k−1)/6); a schedule read one step ahead starts at 5/6.
    for (k, lr) in lrs.iter().enumerate() {
        let want = 1e-3 * (6 - k) as f64 / 6.0;
        assert!(
            (lr - want).abs() < 1e-9,
            "step {}: lr {lr}, want {want}",
            k + 1
        );
    }
    assert!(
        records.iter().all(|r| r.get("grad_norm").is_none()),
        "{log}"
    );

    // Text-encoder freezing: the last of 4 layers and the embeddings train; the earlier layers
    // and the final layer norm do not.
    let base = load(&common::fixture("tiny-sd15").join("text_encoder/model.safetensors"));
    let saved = load(&run.join("step-000006/text_encoder/model.safetensors"));
    let key = |k: &str| format!("text_model.{k}");
    assert!(changed(
        &base,
        &saved,
        &key("encoder.layers.3.mlp.fc1.weight")
    ));
    assert!(!changed(
        &base,
        &saved,
        &key("encoder.layers.2.mlp.fc1.weight")
    ));
    assert!(!changed(&base, &saved, &key("final_layer_norm.weight")));
    assert!(changed(
        &base,
        &saved,
        &key("embeddings.token_embedding.weight")
    ));
}

#[test]
fn a_card_that_does_not_exist_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(
        tmp.path(),
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({"gpuid": 7}),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("gpuid 7 in train.json"),
        "{}",
        text(&out)
    );
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--device", "cuda:5"],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("--device cuda:5"), "{}", text(&out));
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--device", "tpu"],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    // gpuid is overridden by --device cpu.
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--device", "cpu"],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn disable_unet_training_trains_the_text_encoder_alone() {
    for checkpointing in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let cfg = write_config(
            dir,
            "tiny-sd15",
            &demo_data(),
            serde_json::json!({
                "mode": "full", "disable_unet_training": true, "batch_size": 2,
                "gradient_checkpointing": checkpointing
            }),
        );
        let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir);
        assert!(out.status.success(), "{}", text(&out));
        let run = only_run(&dir.join("out"));
        let fixture = common::fixture("tiny-sd15");
        let unet = "unet/diffusion_pytorch_model.safetensors";
        let (base, saved) = (
            load(&fixture.join(unet)),
            load(&run.join("final").join(unet)),
        );
        for (name, t) in &base {
            assert!(
                !changed(&base, &saved, name),
                "checkpointing {checkpointing}: UNet {name} changed ({:?})",
                t.dims()
            );
        }
        let te = "text_encoder/model.safetensors";
        let (base, saved) = (load(&fixture.join(te)), load(&run.join("final").join(te)));
        assert!(changed(
            &base,
            &saved,
            "text_model.encoder.layers.0.mlp.fc1.weight"
        ));
        let log = std::fs::read_to_string(run.join("train_log.jsonl")).unwrap();
        assert!(log.lines().all(|l| !l.contains("lr_unet")), "{log}");
        assert!(log.contains("lr_text_encoder"), "{log}");
    }
    // Both parts disabled are refused (in an adapter mode, disable_unet_training trains the
    // text encoders' adapters alone: tests/text_encoder_only_cli.rs).
    let tmp = tempfile::tempdir().unwrap();
    for extra in [
        serde_json::json!({"mode": "full", "disable_unet_training": true,
                           "disable_textenc_training": true}),
        serde_json::json!({"mode": "lora", "disable_unet_training": true,
                           "disable_textenc_training": true}),
    ] {
        let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
        let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(
            text(&out).contains("disable_unet_training"),
            "{}",
            text(&out)
        );
    }
}

#[test]
fn load_settings_every_epoch_applies_a_changed_log_step() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let cfg = write_config(
        &dir,
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({
            "mode": "lora", "batch_size": 1, "max_steps": null, "max_epochs": 3,
            "load_settings_every_epoch": true, "log_step": 1
        }),
    );
    let original = std::fs::read_to_string(&cfg).unwrap();
    let changed = original.replace("\"log_step\": 1", "\"log_step\": 100");
    assert_ne!(original, changed);
    // Rewrite train.json once the first step is logged (8 steps an epoch, 24 in all).
    let watcher = rewrite_after_first_log(&dir, &cfg, changed);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], &dir);
    assert!(watcher.join().unwrap(), "the first step was never logged");
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("load_settings_every_epoch: epoch")
            && text(&out).contains("applied log_step"),
        "{}",
        text(&out)
    );
    let run = only_run(&dir.join("out"));
    let steps: Vec<u64> = std::fs::read_to_string(run.join("train_log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    // The last epoch logs only its last step under log_step 100.
    assert!(steps.iter().all(|s| !(17..24).contains(s)), "{steps:?}");
    assert_eq!(steps.last(), Some(&24));
    assert!(
        steps.contains(&2),
        "epoch 1 ran under log_step 1: {steps:?}"
    );
}
