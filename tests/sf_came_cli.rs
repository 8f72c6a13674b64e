//! adamw_schedulefree, came and came8bit from the CLI on tiny-sd15 (train.json with an
//! optimizer.json), LoRA and full fine-tune:
//! - schedule-free saves its evaluation weights `x = y + (1 − 1/β1)·(z − y)` (computed here from
//!   the save point's training weights `y` and optimizer state `z`), and a run that samples,
//!   validates and saves at every step ends bit for bit where one that does none of it ends;
//! - CAME's and came8bit's state files hold their own tensors (CAME's instability rows and
//!   columns, came8bit's 8-bit codes), so a run that fell back to another optimizer fails.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use common::cli::{demo_data, run_folder, sdtrain, step_losses, text, write_config};

fn optimizer_json(dir: &Path, base: serde_json::Value) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("optimizer.json");
    std::fs::write(&path, serde_json::json!({ "base": base }).to_string()).unwrap();
    path
}

/// Runs sdtrain on tiny-sd15 in `dir` with `extra` train.json keys; returns the run folder.
fn train(dir: &Path, extra: serde_json::Value) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = write_config(dir, "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir);
    assert!(out.status.success(), "{}", text(&out));
    run_folder(dir)
}

fn load(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

const SF_BETA1: f64 = 0.9;

fn schedulefree(dir: &Path) -> PathBuf {
    let group = serde_json::json!({"optimizer": "adamw_schedulefree", "lr": 1e-2,
        "betas": [SF_BETA1, 0.999], "weight_decay": 0.01, "schedulefree": {"warmup_steps": 2}});
    optimizer_json(dir, group)
}

#[test]
fn schedulefree_lora_saves_the_evaluation_weights_and_trains_on_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("prompts.txt");
    std::fs::write(&prompts, "a photo of a cat\n").unwrap();
    let opt = schedulefree(&tmp.path().join("opt"));
    let base = serde_json::json!({"mode": "lora", "adapter": {"save_dtype": "fp32"},
        "max_steps": 4, "seed": 5, "batch_size": 2, "optimizer_config": opt,
        "save_every_n_steps": 4});
    let quiet = train(&tmp.path().join("quiet"), base.clone());
    let mut busy = base.clone();
    busy.as_object_mut().unwrap().extend(
        serde_json::json!({"save_every_n_steps": 1, "sample_prompts": prompts,
            "sample_steps": 2, "validation_split": 0.3, "validation_every_n_steps": 1})
        .as_object()
        .unwrap()
        .clone(),
    );
    let busy = train(&tmp.path().join("busy"), busy);

    // The saved file holds x, from the save point's y (`<group>/<name>`) and z (the group's
    // optimizer file, `<name>.z`).
    let state = busy.join("state-step-000004");
    let y = load(&state.join("params.safetensors"));
    let x = load(&busy.join("sdtrain.safetensors"));
    let w = (1.0 - 1.0 / SF_BETA1) as f32;
    let mut moved = 0f32;
    for (key, yt) in &y {
        let (group, name) = key.split_once('/').unwrap();
        let z = load(&state.join(format!("optimizer-{group}.safetensors")));
        let (yv, zv, got) = (
            values(yt),
            values(&z[&format!("{name}.z")]),
            values(&x[name]),
        );
        for ((y, z), got) in yv.iter().zip(&zv).zip(&got) {
            let want = y + w * (z - y);
            assert!(
                (got - want).abs() <= 1e-6 + 1e-5 * want.abs(),
                "{key}: {got} vs {want}"
            );
            moved = moved.max((got - y).abs());
        }
    }
    assert!(moved > 0.0, "the saved weights are the training weights");

    // Sampling, validating and saving at every step swapped the training weights out and back
    // each time: the busy run trains exactly as one that saves but neither samples nor validates
    // (the same validation split, so the same training images; its validation never falls due).
    // Putting y back as the package does, lerp(x, z, 1 − β1), would not be exact.
    let mut saves_only = base;
    saves_only.as_object_mut().unwrap().extend(
        serde_json::json!({"save_every_n_steps": 1, "validation_split": 0.3,
            "validation_every_n_steps": 1000})
        .as_object()
        .unwrap()
        .clone(),
    );
    let saves_only = train(&tmp.path().join("saves-only"), saves_only);
    assert_eq!(step_losses(&saves_only), step_losses(&busy));
    let last = |run: &Path| load(&run.join("state-step-000004").join("params.safetensors"));
    let (a, b) = (last(&saves_only), last(&busy));
    for (name, t) in &a {
        assert_eq!(values(t), values(&b[name]), "{name}");
    }
    assert_eq!(step_losses(&quiet).len(), 4);
    assert_ne!(
        step_losses(&quiet),
        step_losses(&busy),
        "the split held out no image"
    );
}

fn check_came(name: &str, mode: &str, state_tensor: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let group = serde_json::json!({"optimizer": name, "lr": 1e-3,
        "betas": [0.9, 0.999, 0.9999], "weight_decay": 0.01, "came": {"clip_threshold": 1.0}});
    let opt = optimizer_json(&tmp.path().join("opt"), group);
    let run = train(
        tmp.path(),
        serde_json::json!({"mode": mode, "max_steps": 2, "optimizer_config": opt,
            "save_every_n_steps": 2}),
    );
    let state = load(
        &run.join("state-step-000002")
            .join("optimizer-unet.safetensors"),
    );
    assert!(
        state.keys().any(|k| k.ends_with(state_tensor)),
        "{name} {mode}: no `{state_tensor}` in the state: {:?}",
        state.keys().take(6).collect::<Vec<_>>()
    );
    let losses = step_losses(&run);
    assert_eq!(losses.len(), 2);
    assert!(losses.iter().all(|l| l.is_finite()));
}

#[test]
fn came_trains_lora_and_full() {
    check_came("came", "lora", ".exp_avg_res_row");
    check_came("came", "full", ".exp_avg_res_col");
}

#[test]
fn came8bit_trains_lora_and_full_with_8bit_moments() {
    // The full UNet has tensors of 4096 elements and more, whose first moment is 8-bit.
    check_came("came8bit", "full", ".exp_avg_absmax");
    check_came("came8bit", "lora", ".exp_avg_res_row");
}

#[test]
fn schedulefree_refuses_an_lr_schedule() {
    let tmp = tempfile::tempdir().unwrap();
    let group = serde_json::json!({"optimizer": "adamw_schedulefree", "lr_scheduler": "cosine"});
    let opt = optimizer_json(&tmp.path().join("opt"), group);
    let cfg = write_config(
        tmp.path(),
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({"optimizer_config": opt}),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(!out.status.success());
    assert!(
        text(&out).contains("base.schedulefree.warmup_steps"),
        "{}",
        text(&out)
    );
}
