//! Mixed precision and gradient checkpointing end to end on the tiny fixtures (CPU):
//! - `amp` and `gradient_checkpointing` train every fixture in full, LoRA and LoCon modes from
//!   the CLI;
//! - bf16 and fp16 runs track the f32 run (final-loss ratio printed, asserted within 10%);
//! - an fp16 overflow skips the step, halves the loss scale and leaves the weights alone.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use sdtrain::config::TrainPlan;
use sdtrain::train::{train, RunOptions, TrainOutcome};

/// `common::cli::write_config` with no flips and no caption dropout, so runs compare exactly.
fn write_config(dir: &Path, fixture: &str, extra: serde_json::Value) -> PathBuf {
    let mut cfg = serde_json::json!({"flip_p": 0.0, "cond_dropout": 0.0});
    if let (Some(c), Some(e)) = (cfg.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    common::cli::write_config(dir, fixture, &common::cli::demo_data(), cfg)
}

fn log_lines(run_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run_dir.join("train_log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn amp_and_checkpointing_train_every_fixture_in_every_mode() {
    let cases = [
        ("tiny-sd15", "full", "bf16"),
        ("tiny-sd15", "lora", "fp16"),
        ("tiny-sd15", "locon", "bf16"),
        ("tiny-sd21", "full", "fp16"),
        ("tiny-sd21", "lora", "bf16"),
        ("tiny-sd21", "locon", "fp16"),
        ("tiny-sdxl", "full", "bf16"),
        ("tiny-sdxl", "lora", "bf16"),
        ("tiny-sdxl", "locon", "fp16"),
    ];
    for (fixture, mode, amp) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = write_config(
            tmp.path(),
            fixture,
            serde_json::json!({"mode": mode, "amp": amp, "gradient_checkpointing": true}),
        );
        let out = Command::new(env!("CARGO_BIN_EXE_sdtrain"))
            .args(["--config", cfg.to_str().unwrap(), "--cpu"])
            .current_dir(tmp.path())
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let what = format!("{fixture} {mode} {amp}");
        assert!(out.status.success(), "{what}: {text}");
        assert!(
            text.contains(&format!("precision {amp}, gradient checkpointing")),
            "{what}: {text}"
        );
        let runs: Vec<PathBuf> = std::fs::read_dir(tmp.path().join("out"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        let lines = log_lines(&runs[0]);
        assert_eq!(lines.len(), 2, "{what}");
        for l in &lines {
            assert!(l["loss"].as_f64().unwrap().is_finite(), "{what}: {l}");
            assert!(l["grad_norm"].as_f64().unwrap() > 0.0, "{what}: {l}");
            assert_eq!(l["loss_scale"].is_number(), amp == "fp16", "{what}: {l}");
        }
        let plan: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(runs[0].join("plan.json")).unwrap())
                .unwrap();
        assert_eq!(plan["resolved_at_start"]["amp"], amp, "{what}");
    }
}

fn run_in_process(dir: &Path, extra: serde_json::Value) -> TrainOutcome {
    let cfg = write_config(dir, "tiny-sd15", extra);
    let plan = TrainPlan::resolve(&cfg, &[]).unwrap();
    let opts = RunOptions {
        device: candle_core::Device::Cpu,
        show_progress: false,
    };
    train(&plan, &opts).unwrap()
}

#[test]
fn bf16_and_fp16_track_f32() {
    let common_keys = serde_json::json!({
        "mode": "lora", "adapter": {"rank": 8, "alpha": 8}, "lr": 1e-2, "max_steps": 12,
        "seed": 3,
    });
    let run = |amp: &str| {
        let tmp = tempfile::tempdir().unwrap();
        let mut extra = common_keys.clone();
        extra["amp"] = amp.into();
        run_in_process(tmp.path(), extra)
    };
    let f32_run = run("off");
    let (f32_first, f32_last) = f32_run.first_last_loss().unwrap();
    assert!(
        f32_last < f32_first,
        "the f32 run learns: {f32_first} → {f32_last}"
    );
    for amp in ["bf16", "fp16"] {
        let out = run(amp);
        assert_eq!(out.skipped_steps, 0, "{amp}");
        let (_, last) = out.first_last_loss().unwrap();
        let ratio = last / f32_last;
        eprintln!("{amp}: final loss {last:.5} vs f32 {f32_last:.5}, ratio {ratio:.4}");
        assert!(
            (ratio - 1.0).abs() < 0.10,
            "{amp}: final-loss ratio {ratio}"
        );
    }
}

#[test]
fn fp16_overflow_skips_the_step_and_halves_the_scale() {
    let tmp = tempfile::tempdir().unwrap();
    // A scale this large (2^100) overflows every f16 gradient: each step must be skipped.
    let init = 2f64.powi(100);
    let out = run_in_process(
        tmp.path(),
        serde_json::json!({"mode": "lora", "amp": "fp16", "max_steps": 3,
                           "grad_scaler_init_scale": init}),
    );
    assert_eq!(out.skipped_steps, 3);
    let scales: Vec<f64> = log_lines(&out.run_dir)
        .iter()
        .map(|l| {
            assert_eq!(l["skipped_nonfinite"], true, "{l}");
            l["loss_scale"].as_f64().unwrap()
        })
        .collect();
    assert_eq!(scales, [init / 2.0, init / 4.0, init / 8.0]);
    // No update reached the adapters: `up` starts at zero and stays there.
    let file = out.saved.last().unwrap();
    let tensors = candle_core::safetensors::load(file, &candle_core::Device::Cpu).unwrap();
    let ups: Vec<_> = tensors
        .iter()
        .filter(|(k, _)| k.contains("lora_up"))
        .collect();
    assert!(!ups.is_empty());
    for (k, t) in ups {
        let m = t
            .to_dtype(candle_core::DType::F32)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(m, 0.0, "{k} was updated by a skipped step");
    }
}

/// The plan's total in GiB after `marker` (`… the plan, 1.66 GiB, …`).
fn planned_gib(text: &str, marker: &str) -> f64 {
    let line = text
        .lines()
        .find(|l| l.contains(marker))
        .unwrap_or_else(|| panic!("no `{marker}` in: {text}"));
    let after = &line[line.find("the plan, ").unwrap() + "the plan, ".len()..];
    after.split(' ').next().unwrap().parse().unwrap()
}

/// `gradient_checkpointing: "auto"` from the CLI: `--dry-run` names no block when the plan fits
/// without, every block when nothing fits, and, with a `vram_limit_gb` between the two, some of
/// the blocks, largest activations first; a training run under `"auto"` says what it chose and
/// trains. Catches `"auto"` read as `true` or `false`, or the limit ignored.
#[test]
fn auto_checkpointing_picks_the_fewest_blocks_that_fit() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(
        tmp.path(),
        "tiny-sd15",
        serde_json::json!({"mode": "full", "gradient_checkpointing": "auto", "resolution": 2048}),
    );
    let dry = |limit: f64| {
        let set = format!("vram_limit_gb={limit}");
        let out = common::cli::sdtrain(
            &[
                "--config",
                cfg.to_str().unwrap(),
                "--dry-run",
                "--set",
                &set,
            ],
            tmp.path(),
        );
        assert!(out.status.success(), "{}", common::cli::text(&out));
        common::cli::text(&out)
    };
    let roomy = dry(100.0);
    let none = planned_gib(&roomy, "gradient checkpointing auto: no block");
    let tight = dry(0.05);
    let all = planned_gib(&tight, "auto: every block, and the plan");
    assert!(all < none, "{all} vs {none}");
    let between = dry((all + none) / 2.0);
    let line = between
        .lines()
        .find(|l| l.contains("largest activations first"))
        .unwrap_or_else(|| panic!("{between}"));
    // The tiny fixture has three levels: its outermost up block, up_blocks.2, holds the most
    // activations and comes first.
    assert!(line.contains("up_blocks.2"), "{line}");
    assert!(!line.contains("6 of 6"), "{line}");
    let run_dir = tmp.path().join("run");
    std::fs::create_dir_all(&run_dir).unwrap();
    let run = write_config(
        &run_dir,
        "tiny-sd15",
        serde_json::json!({"mode": "full", "gradient_checkpointing": "auto", "vram_limit_gb": 0.05}),
    );
    let out = common::cli::sdtrain(&["--config", run.to_str().unwrap(), "--cpu"], tmp.path());
    let text = common::cli::text(&out);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("gradient checkpointing auto: every block"),
        "{text}"
    );
}

/// `fused_backward_pass` from the CLI: a full fine-tune with bf16 weights and checkpointing
/// trains, and beside `amp: "fp16"` it is refused, naming the key.
#[test]
fn fused_backward_pass_trains_from_the_cli_and_refuses_fp16() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(
        tmp.path(),
        "tiny-sdxl",
        serde_json::json!({"mode": "full", "fused_backward_pass": true, "amp": "bf16",
            "weight_dtype": "bf16", "gradient_checkpointing": true, "grad_accum": 2}),
    );
    let out = common::cli::sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    let text = common::cli::text(&out);
    assert!(out.status.success(), "{text}");
    let fp16 = common::cli::sdtrain(
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--cpu",
            "--set",
            "amp=fp16",
        ],
        tmp.path(),
    );
    let text = common::cli::text(&fp16);
    assert!(!fp16.status.success());
    assert!(
        text.contains("fused_backward_pass") && text.contains("fp16"),
        "{text}"
    );
}
