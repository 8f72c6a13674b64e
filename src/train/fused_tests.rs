//! The fused backward pass end to end on the CPU: full fine-tunes of the tiny SD1.5 fixture with
//! `fused_backward_pass` on and off, compared bit for bit, and an out-of-memory retry under it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use super::oom::inject;
use super::{train, RunOptions, TrainOutcome};
use crate::config::TrainPlan;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A full fine-tune (UNet and text encoder) of `steps` steps with `extra` keys and the optimizer
/// `optimizer`.
fn plan(dir: &Path, optimizer: &str, steps: usize, extra: serde_json::Value) -> TrainPlan {
    std::fs::create_dir_all(dir).unwrap();
    let opt =
        serde_json::json!({"base": {"optimizer": optimizer, "lr": 1e-4, "weight_decay": 0.01}});
    std::fs::write(dir.join("optimizer.json"), opt.to_string()).unwrap();
    let mut cfg = serde_json::json!({
        "model": repo().join("tests/fixtures/tiny-sd15"),
        "data_root": repo().join("data/demo"),
        "output_dir": dir.join("out"),
        "mode": "full",
        "resolution": 64,
        "batch_size": 2,
        "max_steps": steps,
        "log_step": 1,
        "seed": 9,
        "optimizer_config": dir.join("optimizer.json"),
    });
    if let (Some(c), Some(e)) = (cfg.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    let path = dir.join("train.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    TrainPlan::resolve(&path, &[]).unwrap()
}

fn run(plan: &TrainPlan) -> TrainOutcome {
    let opts = RunOptions {
        device: Device::Cpu,
        show_progress: false,
    };
    train(plan, &opts).unwrap()
}

/// Every tensor of the final save (a diffusers folder), by file and name.
fn weights(outcome: &TrainOutcome) -> HashMap<String, Tensor> {
    let dir = outcome.saved.last().expect("a final save");
    let mut out = HashMap::new();
    for component in ["unet", "text_encoder"] {
        for entry in std::fs::read_dir(dir.join(component)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "safetensors") {
                for (k, v) in candle_core::safetensors::load(&path, &Device::Cpu).unwrap() {
                    out.insert(format!("{component}/{k}"), v);
                }
            }
        }
    }
    out
}

fn bits(t: &Tensor) -> Vec<u32> {
    let v = t
        .flatten_all()
        .unwrap()
        .to_dtype(candle_core::DType::F32)
        .unwrap();
    v.to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// Trains `extra` with the fused backward pass off and on and checks the final weights and the
/// per-step losses are identical.
fn fused_matches_unfused(tmp: &Path, optimizer: &str, extra: serde_json::Value) {
    let with = |fused: bool| {
        let mut e = extra.clone();
        e["fused_backward_pass"] = fused.into();
        let dir = tmp.join(format!("{optimizer}-{fused}"));
        run(&plan(&dir, optimizer, 2, e))
    };
    let (plain, fused) = (with(false), with(true));
    assert_eq!(plain.losses, fused.losses, "{optimizer}: losses");
    let (want, got) = (weights(&plain), weights(&fused));
    assert_eq!(want.len(), got.len());
    let changed = want.iter().any(|(k, w)| {
        let before = candle_core::safetensors::load(
            repo().join(format!(
                "tests/fixtures/tiny-sd15/{}",
                if k.starts_with("unet/") {
                    "unet/diffusion_pytorch_model.safetensors"
                } else {
                    "text_encoder/model.safetensors"
                }
            )),
            &Device::Cpu,
        )
        .unwrap();
        let name = k.split_once('/').unwrap().1;
        before.get(name).is_some_and(|b| bits(b) != bits(w))
    });
    assert!(changed, "{optimizer}: the run changed no weight");
    for (name, w) in &want {
        assert!(bits(&got[name]) == bits(w), "{optimizer}: {name} differs");
    }
}

/// With clipping off, the fused backward pass updates every parameter of the UNet and the text
/// encoder bit for bit as the unfused step, for every optimizer. Catches a gradient applied
/// before its last part arrived, a parameter updated twice or not at all, a loss scale or share
/// applied twice, and the wrong group's optimizer.
#[test]
fn fused_updates_equal_unfused_bit_for_bit_for_every_optimizer() {
    let tmp = tempfile::tempdir().unwrap();
    for optimizer in ["adamw", "adamw8bit", "lion", "lion8bit", "adafactor"] {
        fused_matches_unfused(tmp.path(), optimizer, serde_json::json!({}));
    }
}

/// The same with gradient accumulation (the earlier micro-batch's gradients added before the
/// fused update), checkpointing (the segments' parameters updated from their recomputation) and
/// bf16 weights with stochastic rounding.
#[test]
fn fused_with_accumulation_and_checkpointing_equals_unfused() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({
        "batch_size": 1,
        "grad_accum": 2,
        "gradient_checkpointing": true,
        "weight_dtype": "bf16",
    });
    fused_matches_unfused(tmp.path(), "adamw", extra);
}

/// LoRA and LoCon (the adapters' parameters, through the frozen layers' single ops), with
/// dropout replayed by checkpointing and the text encoder's adapters in their own group.
#[test]
fn fused_adapters_equal_unfused() {
    let tmp = tempfile::tempdir().unwrap();
    for mode in ["lora", "locon"] {
        let extra = serde_json::json!({
            "mode": mode,
            "adapter": {"save_dtype": "fp32", "dropout": 0.1, "train_text_encoder": true},
            "gradient_checkpointing": true,
        });
        let with = |fused: bool| {
            let mut e = extra.clone();
            e["fused_backward_pass"] = fused.into();
            run(&plan(
                &tmp.path().join(format!("{mode}-{fused}")),
                "adamw",
                2,
                e,
            ))
        };
        let (plain, fused) = (with(false), with(true));
        assert_eq!(plain.losses, fused.losses, "{mode}");
        let load = |o: &TrainOutcome| {
            candle_core::safetensors::load(o.saved.last().unwrap(), &Device::Cpu).unwrap()
        };
        let (want, got) = (load(&plain), load(&fused));
        assert_eq!(want.len(), got.len());
        for (name, w) in &want {
            assert!(bits(&got[name]) == bits(w), "{mode}: {name} differs");
        }
    }
}

/// An out-of-memory error in the last micro-batch's forward, before any fused update: the same
/// samples are retried at half the micro-batch, and the run's weights equal, bit for bit, those
/// of the unfused run that met the same error (whose retry equals an unfailed run to f32
/// rounding: `retry_tests`). Catches a parameter updated by the failed attempt and again by the
/// retry, and the earlier half's gradients lost.
#[test]
fn an_oom_before_the_fused_updates_retries_as_the_unfused_step_does() {
    let tmp = tempfile::tempdir().unwrap();
    let with = |fused: bool| {
        let extra = serde_json::json!({ "fused_backward_pass": fused });
        let p = plan(&tmp.path().join(format!("oom-{fused}")), "adamw", 2, extra);
        inject::set(|step, ids| step == 1 && ids.len() > 1);
        let out = train(
            &p,
            &RunOptions {
                device: Device::Cpu,
                show_progress: false,
            },
        );
        inject::clear();
        out.unwrap()
    };
    let (plain, fused) = (with(false), with(true));
    assert_eq!((fused.micro.size, fused.micro.oom_retries), (1, 1));
    assert_eq!(fused.images_seen, plain.images_seen);
    assert_eq!(plain.losses, fused.losses);
    let (want, got) = (weights(&plain), weights(&fused));
    for (name, w) in &want {
        assert!(bits(&got[name]) == bits(w), "{name} differs");
    }
}

/// Each group's per-parameter update counts in the final save point's optimizer state.
fn update_counts(outcome: &TrainOutcome) -> Vec<u64> {
    let points = crate::run_layout::save_points(&outcome.run_dir);
    let (_, dir) = points.last().expect("a save point");
    let mut counts = Vec::new();
    for group in ["unet", "text_encoder"] {
        let file = super::resume::optimizer_file(dir, group);
        let steps: HashMap<String, u64> = crate::optim::state::read(&file, |r| {
            Ok(serde_json::from_str(r.meta("adamw.steps")?).unwrap())
        })
        .unwrap();
        counts.extend(steps.into_values());
    }
    counts
}

/// An out-of-memory error in the middle of the fused updates (after 10 parameters were
/// updated): the step goes on at half the micro-batch, says it is not exact, and every
/// parameter is still updated exactly once per step. Catches the retry updating the first
/// 10 parameters a second time, or skipping the others.
#[test]
fn an_oom_during_the_fused_updates_updates_each_parameter_once() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({"fused_backward_pass": true, "save_optimizer": true});
    let p = plan(&tmp.path().join("mid"), "adamw", 2, extra);
    super::fused::inject::after(Some(10));
    let out = train(
        &p,
        &RunOptions {
            device: Device::Cpu,
            show_progress: false,
        },
    );
    super::fused::inject::after(None);
    let out = out.unwrap();
    assert_eq!((out.micro.size, out.micro.oom_retries), (1, 1));
    let counts = update_counts(&out);
    assert!(!counts.is_empty());
    assert!(counts.iter().all(|&c| c == 2), "update counts {counts:?}");
    let log = std::fs::read_to_string(out.run_dir.join("train_log.jsonl")).unwrap();
    assert!(out.losses.iter().all(|l| l.is_finite()), "{log}");
}
