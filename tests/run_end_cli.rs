//! How a run ends, from the CLI:
//! - a run with save points on leaves one at its last step, so a finished run can be extended
//!   with a larger `max_steps` exactly, as kohya's `--save_state_on_train_end` allows;
//! - a run whose steps are skipped for a non-finite loss (lr 1e30) stops after
//!   `max_consecutive_skipped_steps`, saves what was last good, names the cause and the rungs
//!   to try, and exits 1 — never 0.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use common::cli::{demo_data, run_folder, sdtrain, text, write_config};

fn config(dir: &Path, extra: serde_json::Value) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let mut cfg = serde_json::json!({
        "mode": "lora",
        "adapter": {"save_dtype": "fp32"},
        "seed": 5,
        "batch_size": 2,
        "log_step": 1,
    });
    if let (Some(c), Some(e)) = (cfg.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    write_config(dir, "tiny-sd15", &demo_data(), cfg)
}

fn train(dir: &Path, cfg: &Path, set: &[&str]) -> std::process::Output {
    let mut args = vec!["--config", cfg.to_str().unwrap(), "--cpu"];
    for s in set {
        args.extend(["--set", s]);
    }
    sdtrain(&args, dir)
}

/// Each logged step's loss, by step.
fn losses(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("train_log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
        })
        .collect()
}

fn bits(path: &Path) -> HashMap<String, Vec<u32>> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, t): (String, Tensor)| {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (k, v.iter().map(|x| x.to_bits()).collect())
        })
        .collect()
}

/// A 4-step run with save points, extended to 6 steps by resuming its end, equals a 6-step run
/// bit for bit: the same losses at every step and the same final LoRA. Without a save point at
/// the end, the resume would start at step 2 (or fail); with a wrong position it would see
/// other samples.
#[test]
fn a_finished_run_extends_exactly_from_its_last_save_point() {
    let tmp = tempfile::tempdir().unwrap();
    let every = serde_json::json!({"save_every_n_steps": 2});
    let (a, b) = (tmp.path().join("straight"), tmp.path().join("extended"));
    let cfg_a = config(&a, every.clone());
    let out = train(&a, &cfg_a, &["max_steps=6"]);
    assert!(out.status.success(), "{}", text(&out));
    let cfg_b = config(&b, every);
    let out = train(&b, &cfg_b, &["max_steps=4"]);
    assert!(out.status.success(), "{}", text(&out));
    let run = run_folder(&b);
    assert!(
        run.join("state-step-000004").is_dir(),
        "no save point at the end"
    );
    let resume = format!("resume_ckpt={}", run.display());
    let out = train(&b, &cfg_b, &["max_steps=6", &resume]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("at step 4"), "{}", text(&out));
    // The run's length changed: the resume says how the learning rate goes on.
    assert!(
        text(&out).contains("length changed from 4 to 6 steps"),
        "{}",
        text(&out)
    );
    let straight = run_folder(&a);
    assert_eq!(losses(&run), losses(&straight));
    let name = "sdtrain.safetensors";
    assert!(
        bits(&run.join(name)) == bits(&straight.join(name)),
        "final LoRA differs"
    );
}

/// lr 1e30: the first update blows the weights up and every later step is skipped. The run
/// stops after 3 skipped steps in a row, saves an errored checkpoint, names the cause and the
/// rungs, and exits 1.
#[test]
fn a_run_that_only_skips_steps_stops_and_fails() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(
        tmp.path(),
        serde_json::json!({"lr": 1e30, "max_steps": 20, "max_consecutive_skipped_steps": 3}),
    );
    let out = train(tmp.path(), &cfg, &[]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(all.contains("3 steps in a row were skipped"), "{all}");
    assert!(all.contains("lower the learning rate"), "{all}");
    assert!(all.contains("clip_grad_norm"), "{all}");
    let run = run_folder(tmp.path());
    // Non-finite losses are logged as null: read the step alone.
    let log = std::fs::read_to_string(run.join("train_log.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(log.lines().last().unwrap()).unwrap();
    let steps = last["step"].as_u64().unwrap();
    assert!(steps < 20, "the run went on to step {steps}");
    let errored = format!("sdtrain-errored-step-{steps:06}.safetensors");
    assert!(run.join(&errored).is_file(), "{errored} missing: {all}");
}
