//! End-to-end `sdtrain --config train.json` runs on the tiny fixtures, each in its own temp dir:
//! training, outputs, exit codes, skipped images and Ctrl-C.

mod common;

use std::path::{Path, PathBuf};

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use sdtrain::model::layout::ModelLayout;
use sdtrain::model::pipeline::{LoadOptions, StableDiffusion};

fn check_trained(fixture: &str, extra: serde_json::Value) {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(tmp.path(), fixture, &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{fixture}: {}", text(&out));
    assert!(text(&out).contains("steps           2"), "{}", text(&out));
    let run = run_folder(tmp.path());
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("plan.json")).unwrap()).unwrap();
    assert_eq!(plan["max_steps"], 2);
    let log = std::fs::read_to_string(run.join("train_log.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{log}");
    for l in &lines {
        assert!(
            l["loss"].as_f64().unwrap().is_finite() && l["grad_norm"].as_f64().unwrap() > 0.0,
            "{l}"
        );
        // On the CPU the memory is the process's resident set: in use ≤ peak, both non-zero.
        let m = &l["memory"];
        assert_eq!(m["source"], "process_rss", "{l}");
        let (in_use, peak) = (
            m["in_use_bytes"].as_u64().unwrap(),
            m["peak_bytes"].as_u64().unwrap(),
        );
        assert!(in_use > 0 && in_use <= peak, "{l}");
    }
    let summary = text(&out);
    assert!(
        summary
            .lines()
            .any(|l| l.starts_with("memory          peak ") && l.contains(" RSS (in use ")),
        "{summary}"
    );
    // The saved folder is a complete diffusers pipeline that our loader reads.
    let layout = ModelLayout::read(&run.join("final"), None).unwrap();
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
    StableDiffusion::load(layout, &opts).unwrap();
}

#[test]
fn trains_tiny_sd15_end_to_end() {
    check_trained("tiny-sd15", serde_json::json!({}));
}

#[test]
fn trains_tiny_sdxl_end_to_end_with_accumulation() {
    check_trained(
        "tiny-sdxl",
        serde_json::json!({"grad_accum": 2, "flip_p": 0.5, "shuffle_tags": true}),
    );
}

#[test]
fn frozen_text_encoder_is_saved_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({"disable_textenc_training": true, "max_steps": 1});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let saved = run_folder(tmp.path()).join("final");
    let base = common::fixture("tiny-sd15");
    let read = |root: &Path, rel: &str| std::fs::read(root.join(rel)).unwrap();
    let te = "text_encoder/model.safetensors";
    assert_eq!(
        read(&saved, te),
        read(&base, te),
        "frozen text encoder changed"
    );
    let unet = "unet/diffusion_pytorch_model.safetensors";
    assert_ne!(
        read(&saved, unet),
        read(&base, unet),
        "the UNet did not train"
    );
}

#[test]
fn dry_run_prints_the_plan_and_trains_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), serde_json::json!({}));
    let out = sdtrain(
        &[
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--dry-run",
            "--set",
            "max_steps=7",
        ],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    // The override took effect: the plan stops after 7 steps (the file says 2).
    assert_eq!(stop_after(&text(&out)), "7 steps", "{}", text(&out));
    // The optimizer state each group will hold, priced from the model's headers: the tiny UNet's
    // 8-bit state is 2.03 bytes per parameter over its tensors of 4096 elements and up, f32 below.
    let t = text(&out);
    let line = t
        .lines()
        .find(|l| l.starts_with("optim. state   unet: adamw8bit, "))
        .unwrap_or_else(|| panic!("{t}"));
    assert!(line.contains("bytes/parameter"), "{line}");
    // The memory plan, by term, checked against a card.
    for term in [
        "memory plan    weights ",
        "optimizer state",
        "activations",
        "expected peak",
    ] {
        assert!(t.contains(term), "{term}: {t}");
    }
    // Checked against a 12 GiB card, or the card this machine has (a `--features cuda` build on
    // a GPU machine).
    let verdict = t
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("expected peak "))
        .unwrap_or_else(|| panic!("{t}"));
    let (_, verdict) = verdict
        .split_once(": ")
        .unwrap_or_else(|| panic!("{verdict}"));
    assert!(
        verdict == "fits 12.00 GiB (a 12 GiB card; set vram_limit_gb for another)"
            || (verdict.starts_with("fits ") && verdict.ends_with(" GiB (the detected card)")),
        "{t}"
    );
    let small = sdtrain(
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--dry-run",
            "--set",
            "vram_limit_gb=0.1",
        ],
        tmp.path(),
    );
    let t = text(&small);
    assert!(
        t.contains("does NOT fit") && t.contains("first rung to take"),
        "{t}"
    );
    assert_eq!(stop_after(&t), "2 steps", "{t}");
    assert!(!t.contains("EMA on the device"), "{t}");
    // An EMA on the device is an f32 copy of the trained weights.
    let ema = sdtrain(
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--dry-run",
            "--set",
            "ema_decay_rate=0.9",
            "--set",
            "ema_device=cuda",
        ],
        tmp.path(),
    );
    let t = text(&ema);
    assert!(ema.status.success(), "{t}");
    // f32 like the gradients (one buffer at grad_accum 1): the two figures print the same.
    let after = |key: &str| {
        let i = t.find(key).unwrap_or_else(|| panic!("{key}: {t}")) + key.len();
        t[i..].split([',', '\n']).next().unwrap().trim().to_string()
    };
    assert_eq!(after("EMA on the device "), after("gradients "), "{t}");
    assert!(!tmp.path().join("out").exists());
}

/// The `stop after` row of a `--dry-run` plan (`7 steps`, `3 epochs`, …).
fn stop_after(plan: &str) -> &str {
    plan.lines()
        .find_map(|l| l.strip_prefix("stop after"))
        .unwrap_or_else(|| panic!("no `stop after` row: {plan}"))
        .trim()
}

#[test]
fn config_error_exits_2_with_a_suggestion() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(
        tmp.path(),
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({"bach_size": 2}),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("batch_size"), "{}", text(&out));
}

#[test]
fn corrupt_images_are_skipped_and_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    for entry in std::fs::read_dir(demo_data()).unwrap().take(4) {
        let p = entry.unwrap().path();
        std::fs::copy(&p, data.join(p.file_name().unwrap())).unwrap();
    }
    std::fs::write(data.join("broken_1.png"), b"not a png at all").unwrap();
    std::fs::write(data.join("empty_2.jpg"), b"").unwrap();
    let cfg = write_config(
        tmp.path(),
        "tiny-sd15",
        &data,
        serde_json::json!({"max_steps": 1}),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains("broken_1.png") && t.contains("empty_2.jpg"),
        "{t}"
    );
    assert!(t.contains("skipped images  2"), "{t}");
}

#[test]
fn folder_without_images_exits_2() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("empty");
    std::fs::create_dir(&data).unwrap();
    let cfg = write_config(tmp.path(), "tiny-sd15", &data, serde_json::json!({}));
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("no images"), "{}", text(&out));
}

#[test]
fn ctrl_c_saves_then_exits_0() {
    let saved = ctrl_c_run(serde_json::json!({"max_steps": 1000}));
    assert!(saved.starts_with("interrupted-step-"), "{saved}");
}

#[test]
fn ctrl_c_saves_the_lora_then_exits_0() {
    // log_step 1000: only step 1 is logged by the rule; the save must log its own step.
    let saved =
        ctrl_c_run(serde_json::json!({"max_steps": 1000, "mode": "lora", "log_step": 1000}));
    assert!(
        saved.starts_with("sdtrain-step-") && saved.ends_with(".safetensors"),
        "{saved}"
    );
}

/// Starts a long run, sends SIGINT once a step is logged, and returns the name of what it saved.
fn ctrl_c_run(extra: serde_json::Value) -> String {
    ctrl_c_run_on(extra, &["--cpu"]).0
}

/// [`ctrl_c_run`] with the device arguments `device`; also returns the run's output.
fn ctrl_c_run_on(extra: serde_json::Value, device: &[&str]) -> (String, String) {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let child = Command::new(env!("CARGO_BIN_EXE_sdtrain"))
        .args(["--config", cfg.to_str().unwrap()])
        .args(device)
        .current_dir(tmp.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let logged = || {
        std::fs::read_dir(tmp.path().join("out"))
            .ok()
            .and_then(|mut d| d.next())
            .is_some_and(|run| {
                std::fs::read_to_string(run.unwrap().path().join("train_log.jsonl"))
                    .is_ok_and(|l| !l.is_empty())
            })
    };
    while !logged() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no step logged in 2 minutes"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let run = run_folder(tmp.path());
    let saved: Vec<String> = std::fs::read_dir(&run)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("interrupted-step-") || n.starts_with("sdtrain-step-"))
        .collect();
    assert_eq!(saved.len(), 1, "{}", text(&out));
    // The log holds every step the save holds: it ends at the saved step.
    let step: usize = saved[0]
        .trim_end_matches(".safetensors")
        .rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no step in {}", saved[0]));
    let log = std::fs::read_to_string(run.join("train_log.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(log.lines().last().unwrap()).unwrap();
    assert_eq!(last["step"].as_u64(), Some(step as u64), "{log}");
    if saved[0].starts_with("interrupted-step-") {
        ModelLayout::read(&run.join(&saved[0]), None).unwrap();
    }
    (saved[0].clone(), text(&out))
}

/// Ctrl-C on a run whose ranks are threads of one process (`--devices cpu,cpu`): every rank's
/// flag is set by the one handler, the ranks stop at the same step and rank 0 saves, with no
/// warning about the handler. Catches a handler installed per rank (the second install fails
/// and warns) and a flag only the first rank sees.
#[test]
fn ctrl_c_stops_every_thread_rank_at_one_step_and_saves() {
    let (saved, out) = ctrl_c_run_on(
        serde_json::json!({"mode": "lora", "grad_accum": 2, "max_steps": 100000}),
        &["--devices", "cpu,cpu"],
    );
    assert!(saved.starts_with("sdtrain-step-"), "{saved}");
    assert!(!out.contains("Ctrl-C handler"), "{out}");
}

/// Trains an adapter from the CLI and checks the kohya file: prefixes, alphas and metadata.
fn check_adapter_run(fixture: &str, mode: &str, prefixes: &[&str], base_version: &str) -> PathBuf {
    let tmp = tempfile::tempdir().unwrap();
    let extra =
        serde_json::json!({"mode": mode, "adapter": {"rank": 4, "alpha": 2, "conv_rank": 2}});
    let cfg = write_config(tmp.path(), fixture, &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{fixture}: {}", text(&out));
    let run = run_folder(tmp.path());
    let file = run.join("sdtrain.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = header.metadata().clone().unwrap();
    assert_eq!(meta["ss_base_model_version"], base_version);
    assert_eq!(meta["ss_network_dim"], "4");
    assert_eq!(meta["ss_steps"], "2");
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for p in prefixes {
        assert!(
            st.names().iter().any(|n| n.starts_with(p)),
            "{fixture}: no {p} module"
        );
    }
    assert!(st.names().iter().all(|n| !n.contains("lora_unet_conv_in")));
    let alpha = st
        .names()
        .into_iter()
        .find(|n| n.ends_with(".alpha"))
        .unwrap()
        .to_string();
    assert!(
        st.tensor(&alpha).unwrap().shape().is_empty(),
        "alpha must be 0-d"
    );
    // Keep the folder alive for the caller by copying the file out.
    let keep = std::env::temp_dir().join(format!(
        "sdtrain-{fixture}-{mode}-{}.safetensors",
        std::process::id()
    ));
    std::fs::copy(&file, &keep).unwrap();
    keep
}

#[test]
fn lora_trains_on_tiny_sd15() {
    let f = check_adapter_run(
        "tiny-sd15",
        "lora",
        &["lora_unet_down_blocks_", "lora_te_text_model_"],
        "sd_v1",
    );
    std::fs::remove_file(f).ok();
}

#[test]
fn locon_trains_on_tiny_sd21_v() {
    let f = check_adapter_run(
        "tiny-sd21",
        "locon",
        &["lora_unet_down_blocks_0_resnets_0_conv1", "lora_te_"],
        "sd_v2_v",
    );
    std::fs::remove_file(f).ok();
}

#[test]
fn lora_trains_on_tiny_sdxl_with_ldm_names_and_resumes_from_its_file() {
    let f = check_adapter_run(
        "tiny-sdxl",
        "lora",
        &["lora_unet_input_blocks_4_1_", "lora_te1_", "lora_te2_"],
        "sdxl_base_v1-0",
    );
    // init_from: a second run starts from the first run's file.
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({"mode": "lora", "max_steps": 1, "adapter": {"rank": 4, "alpha": 2, "init_from": f}});
    let cfg = write_config(tmp.path(), "tiny-sdxl", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("0 new"), "{}", text(&out));
    // A rank mismatch is refused with both shapes named.
    let extra =
        serde_json::json!({"mode": "lora", "max_steps": 1, "adapter": {"rank": 8, "init_from": f}});
    let cfg = write_config(tmp.path(), "tiny-sdxl", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("file has [4,") && text(&out).contains("model wants [8,"),
        "{}",
        text(&out)
    );
    std::fs::remove_file(f).ok();
}

#[test]
fn shipped_configs_resolve() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(tmp.path().join("data/my-dataset")).unwrap();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    for name in ["demo-tiny", "sd15-lora-12gb", "sd21-lora", "sdxl-lora-12gb"] {
        let cfg = root.join("configs").join(format!("{name}.json"));
        let out = sdtrain(
            &[
                "--config",
                cfg.to_str().unwrap(),
                "--dry-run",
                "--set",
                "adapter.rank=32",
            ],
            tmp.path(),
        );
        assert!(out.status.success(), "{name}: {}", text(&out));
        assert!(text(&out).contains("rank 32"), "{name}: {}", text(&out));
    }
}

/// Every optimizer trains a LoRA on the tiny fixture from its optimizer.json and writes its
/// state: at rank 128 some adapters of both models reach 4096 elements, so the 8-bit optimizers
/// hold u8 codes for them (smaller tensors keep f32 state, as bitsandbytes does). One run clips.
#[test]
fn every_optimizer_trains_from_optimizer_json_and_saves_its_state() {
    for name in ["adamw", "adamw8bit", "lion", "lion8bit", "adafactor"] {
        let tmp = tempfile::tempdir().unwrap();
        let opt = tmp.path().join("optimizer.json");
        let group = serde_json::json!({"optimizer": name, "lr": 1e-4});
        std::fs::write(&opt, serde_json::json!({"base": group}).to_string()).unwrap();
        let clip = name == "lion8bit";
        let extra = serde_json::json!({
            "mode": "lora",
            "adapter": {"rank": 128, "alpha": 128},
            "optimizer_config": opt,
            "save_optimizer": true,
            "clip_grad_norm": if clip { serde_json::json!(1e-3) } else { serde_json::Value::Null },
        });
        let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
        let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
        assert!(out.status.success(), "{name}: {}", text(&out));
        let run = run_folder(tmp.path());
        let log = std::fs::read_to_string(run.join("train_log.jsonl")).unwrap();
        for l in log.lines() {
            let l: serde_json::Value = serde_json::from_str(l).unwrap();
            assert!(l["loss"].as_f64().unwrap().is_finite(), "{name}: {l}");
            if clip {
                // The logged norm is the one before clipping.
                assert!(l["grad_norm"].as_f64().unwrap() > 1e-3, "{name}: {l}");
            }
        }
        // save_optimizer: the final save writes a resume save point too.
        let states: Vec<PathBuf> = std::fs::read_dir(run.join("state-step-000002"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("optimizer-")
            })
            .collect();
        assert_eq!(states.len(), 2, "{name}: {states:?}");
        for path in states {
            let bytes = std::fs::read(&path).unwrap();
            let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
            let md = meta.metadata().clone().unwrap_or_default();
            assert_eq!(md["sdtrain.optimizer"], name, "{}", path.display());
            let has_codes = meta
                .tensors()
                .values()
                .any(|t| t.dtype == safetensors::Dtype::U8);
            assert_eq!(
                has_codes,
                name.ends_with("8bit"),
                "{name} {}",
                path.display()
            );
        }
    }
}

/// The learning-rate-free optimizers EveryDream2 offers train a LoRA from optimizer.json with
/// EveryDream2's lr of 1, and their state file carries the group's estimate. A fused backward
/// pass is refused for the two that need every gradient first.
#[test]
fn learning_rate_free_optimizers_train_and_keep_their_estimate() {
    let estimators = ["prodigy", "dadapt_adam", "dadapt_lion", "dadapt_sgd"];
    for name in [
        "prodigy",
        "dadapt_adam",
        "dadapt_adan",
        "dadapt_lion",
        "dadapt_sgd",
        "coordinate_dowg",
        "scalar_dowg",
        "adacoor",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let opt = tmp.path().join("optimizer.json");
        let mut group = serde_json::json!({"optimizer": name, "lr": 1.0, "d0": 1e-4});
        if name == "dadapt_adan" {
            group["betas"] = serde_json::json!([0.98, 0.92, 0.99]);
        }
        std::fs::write(&opt, serde_json::json!({"base": group}).to_string()).unwrap();
        let extra = serde_json::json!({
            "mode": "lora",
            "optimizer_config": opt,
            "save_optimizer": true,
        });
        let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
        let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
        assert!(out.status.success(), "{name}: {}", text(&out));
        let run = run_folder(tmp.path());
        let log = std::fs::read_to_string(run.join("train_log.jsonl")).unwrap();
        assert!(log.lines().count() >= 2, "{name}: {log}");
        for l in log.lines() {
            let l: serde_json::Value = serde_json::from_str(l).unwrap();
            assert!(l["loss"].as_f64().unwrap().is_finite(), "{name}: {l}");
        }
        let state = std::fs::read_dir(run.join("state-step-000002"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("optimizer-")
            })
            .unwrap();
        let bytes = std::fs::read(&state).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let md = meta.metadata().clone().unwrap_or_default();
        assert_eq!(md["sdtrain.optimizer"], name);
        if estimators.contains(&name) {
            let estimate: serde_json::Value =
                serde_json::from_str(&md[&format!("{name}.estimate")]).unwrap();
            assert!(
                estimate["d"].as_f64().unwrap() >= 1e-4,
                "{name}: {estimate}"
            );
            // The log carries the estimate of the step: the last record's `d` is the saved one.
            let last: serde_json::Value =
                serde_json::from_str(log.lines().last().unwrap()).unwrap();
            assert_eq!(
                last["estimates"]["unet/d"].as_f64(),
                estimate["d"].as_f64(),
                "{name}: {last}"
            );
        }
        if ["dadapt_sgd", "scalar_dowg"].contains(&name) {
            let fused = write_config(
                tmp.path(),
                "tiny-sd15",
                &demo_data(),
                serde_json::json!({"mode": "full", "optimizer_config": opt,
                                   "fused_backward_pass": true}),
            );
            let out = sdtrain(&["--config", fused.to_str().unwrap(), "--cpu"], tmp.path());
            assert_eq!(out.status.code(), Some(2), "{name}: {}", text(&out));
            let t = text(&out);
            assert!(t.contains("fused_backward_pass") && t.contains(name), "{t}");
        }
    }
}

/// Pyramid noise from EveryDream2's key and from kohya's trains and changes the losses (same
/// seed, same samples): catches a key read but never reaching the noise.
#[test]
fn pyramid_noise_trains_from_either_trainers_keys() {
    let losses = |extra: serde_json::Value| -> Vec<f64> {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
        let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
        assert!(out.status.success(), "{}", text(&out));
        let log = std::fs::read_to_string(run_folder(tmp.path()).join("train_log.jsonl")).unwrap();
        log.lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                    .as_f64()
                    .unwrap()
            })
            .collect()
    };
    let lora = serde_json::json!({"mode": "lora"});
    let plain = losses(lora.clone());
    let mut ed2 = lora.clone();
    ed2["pyramid_noise_discount"] = serde_json::json!(0.3);
    let mut kohya = lora;
    kohya["multires_noise_iterations"] = serde_json::json!(6);
    for (name, got) in [("EveryDream2", losses(ed2)), ("kohya", losses(kohya))] {
        assert_eq!(got.len(), plain.len(), "{name}");
        assert!(got.iter().all(|l| l.is_finite()), "{name}: {got:?}");
        assert_ne!(got, plain, "{name}: pyramid noise changed nothing");
    }
}

/// Bad inputs a new user tries: each is reported once, early, with the right exit code.
#[test]
fn bad_inputs_are_reported_early_and_once() {
    let tmp = tempfile::tempdir().unwrap();
    // An adapter.init_from that does not exist is a config error, found by --dry-run (exit 2).
    let missing = tmp.path().join("no-such-lora.safetensors");
    let extra = serde_json::json!({"mode": "lora", "adapter": {"init_from": missing}});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    for args in [vec!["--dry-run"], vec!["--cpu"]] {
        let mut all = vec!["--config", cfg.to_str().unwrap()];
        all.extend(args);
        let out = sdtrain(&all, tmp.path());
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(text(&out).contains("adapter.init_from"), "{}", text(&out));
        assert!(text(&out).contains("does not exist"), "{}", text(&out));
    }
    // vram_limit_gb must be positive; on the CPU it is noted and has no effect.
    let cfg = write_config(
        tmp.path(),
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({"vram_limit_gb": 0}),
    );
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--dry-run"],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("`vram_limit_gb`"), "{}", text(&out));
    let extra = serde_json::json!({"vram_limit_gb": 12, "max_steps": 1});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("not on the CPU"), "{}", text(&out));
    // An output_dir that is a file: exit 2 before the model loads.
    let file = tmp.path().join("taken");
    std::fs::write(&file, b"x").unwrap();
    let extra = serde_json::json!({"output_dir": file});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("output_dir"), "{}", text(&out));
    assert!(
        !text(&out).contains("model:"),
        "the model loaded first: {}",
        text(&out)
    );
    // A truncated safetensors: the cause appears once, and the file once; an invalid model
    // exits 2 (docs/models.md).
    let model = tmp.path().join("model");
    common::copy_dir(&common::fixture("tiny-sd15"), &model);
    let unet = std::fs::read_dir(model.join("unet"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    let bytes = std::fs::read(&unet).unwrap();
    std::fs::write(&unet, &bytes[..100]).unwrap();
    let extra = serde_json::json!({"model": model});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = text(&out);
    let line = err.lines().find(|l| l.starts_with("error:")).unwrap();
    assert_eq!(line.matches("invalid header length").count(), 1, "{line}");
    assert_eq!(line.matches(unet.to_str().unwrap()).count(), 1, "{line}");
}

/// `zero_terminal_snr` (and EveryDream2's `enable_zero_terminal_snr`) trains on the rescaled
/// schedule: on the v-prediction SD2.1 fixture quietly, on the epsilon SD1.5 one with a warning;
/// the two keys must agree.
#[test]
fn zero_terminal_snr_trains_from_either_key() {
    let tmp = tempfile::tempdir().unwrap();
    for (fixture, key, warns) in [
        ("tiny-sd21", "zero_terminal_snr", false),
        ("tiny-sd15", "enable_zero_terminal_snr", true),
        ("tiny-sdxl", "zero_terminal_snr", true),
    ] {
        let extra = serde_json::json!({ key: true, "max_steps": 1 });
        let cfg = write_config(tmp.path(), fixture, &demo_data(), extra);
        let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
        assert!(out.status.success(), "{fixture}: {}", text(&out));
        assert_eq!(
            text(&out).contains("epsilon-prediction model"),
            warns,
            "{}",
            text(&out)
        );
        let dry = sdtrain(
            &["--config", cfg.to_str().unwrap(), "--dry-run"],
            tmp.path(),
        );
        assert!(text(&dry).contains("zero terminal SNR"), "{}", text(&dry));
    }
    let extra = serde_json::json!({"zero_terminal_snr": true, "enable_zero_terminal_snr": false});
    let cfg = write_config(tmp.path(), "tiny-sd21", &demo_data(), extra);
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--dry-run"],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

/// Validation from a split: the held-out images leave the training set, the loss is logged at
/// its steps and in the summary; its draws are fixed, so it changes only with the weights and
/// repeats exactly in a second run of the same seed.
#[test]
fn validation_loss_is_logged_and_repeats_exactly() {
    let mut first = Vec::new();
    for run in 0..2 {
        let tmp = tempfile::tempdir().unwrap();
        let extra = serde_json::json!({
            "mode": "lora", "max_steps": 2, "validation_split": 0.25,
            "validation_every_n_steps": 1, "seed": 3, "lr": 1e-12,
        });
        let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
        let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
        assert!(out.status.success(), "{}", text(&out));
        let t = text(&out);
        assert!(t.contains("validation: 2 images"), "{t}");
        assert!(t.contains("6 samples/epoch"), "{t}");
        assert!(t.contains("validation      loss "), "{t}");
        let log = std::fs::read_to_string(run_folder(tmp.path()).join("train_log.jsonl")).unwrap();
        let vals: Vec<f64> = log
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["val_loss"]
                    .as_f64()
                    .unwrap()
            })
            .collect();
        assert_eq!(vals.len(), 2, "{log}");
        // At lr 1e-12 the weights hardly move between the two evaluations, so with fixed draws
        // the two losses agree; with fresh noise each time they would differ by ~1e-2.
        assert!(
            (vals[0] - vals[1]).abs() <= 1e-6 * vals[0].abs(),
            "{vals:?}"
        );
        if run == 0 {
            first = vals;
            // The adapter file records the split as kohya's `ss_validation_split`.
            let lora = std::fs::read_dir(run_folder(tmp.path()))
                .unwrap()
                .map(|e| e.unwrap().path())
                .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .expect("a LoRA file");
            let meta = common::cli::file_metadata(&lora);
            assert_eq!(meta["ss_validation_split"], "0.25");
            assert_eq!(meta["ss_validation_seed"], "None");
        } else {
            assert_eq!(
                vals[0].to_bits(),
                first[0].to_bits(),
                "same seed, same weights: same loss"
            );
        }
    }
    // The other two families, from a validation folder.
    for fixture in ["tiny-sd21", "tiny-sdxl"] {
        let tmp = tempfile::tempdir().unwrap();
        let extra = serde_json::json!({"mode": "lora", "max_steps": 1, "validation_data_root": demo_data()});
        let cfg = write_config(tmp.path(), fixture, &demo_data(), extra);
        let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
        assert!(out.status.success(), "{fixture}: {}", text(&out));
        let log = std::fs::read_to_string(run_folder(tmp.path()).join("train_log.jsonl")).unwrap();
        assert!(log.contains("\"val_loss\""), "{fixture}: {log}");
    }
    // Both sources at once is a config error.
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({"validation_split": 0.2, "validation_data_root": demo_data()});
    let cfg = write_config(tmp.path(), "tiny-sd15", &demo_data(), extra);
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--dry-run"],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

/// `variant` reads a folder's `<base>.<variant>.safetensors` weights, as diffusers'
/// `from_pretrained(variant=…)`: a folder holding only bf16-variant files trains with
/// `variant: "bf16"` and is refused without it (only `fp16` is a fallback). A single file takes
/// no variant. Catches the key not reaching the model's loading (the run is refused).
#[test]
fn variant_reads_a_folder_s_variant_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("bf16-only");
    common::copy_dir(&common::fixture("tiny-sd15"), &model);
    for (folder, base) in [
        ("unet", "diffusion_pytorch_model"),
        ("vae", "diffusion_pytorch_model"),
        ("text_encoder", "model"),
    ] {
        let dir = model.join(folder);
        std::fs::rename(
            dir.join(format!("{base}.safetensors")),
            dir.join(format!("{base}.bf16.safetensors")),
        )
        .unwrap();
    }
    let cfg = write_config(
        tmp.path(),
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({"model": model, "max_steps": 1, "mode": "lora"}),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let set = [
        "--config",
        cfg.to_str().unwrap(),
        "--cpu",
        "--set",
        "variant=bf16",
    ];
    let out = sdtrain(&set, tmp.path());
    assert!(out.status.success(), "{}", text(&out));

    let file = common::fixture("single-file").join("tiny-sd15.safetensors");
    let set_model = format!("model={}", file.display());
    let out = sdtrain(
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--cpu",
            "--set",
            "variant=bf16",
            "--set",
            &set_model,
        ],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("variant `bf16`"), "{}", text(&out));
}
