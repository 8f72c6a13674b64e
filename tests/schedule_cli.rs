//! optimizer.json's newer schedule keys reach the run: the learning rate each step logs is the
//! schedule's, from the CLI on the tiny SD1.5 fixture. The formulas themselves are checked
//! against transformers and OneTrainer in tests/schedule_parity.rs; here a key that were
//! dropped or misread between the file and the optimizer fails.

mod common;

use common::cli::{demo_data, sdtrain, text, write_config};
use sdtrain::optim::{LrSchedule, Ramp, ScheduleKind, ScheduleShape};

fn run(dir: &std::path::Path, base: serde_json::Value) -> std::process::Output {
    std::fs::write(
        dir.join("optimizer.json"),
        serde_json::json!({"base": base}).to_string(),
    )
    .unwrap();
    let cfg = write_config(
        dir,
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({
            "mode": "lora", "lr": null, "batch_size": 2, "max_steps": 8,
            "optimizer_config": "optimizer.json", "project_name": "wsd",
            "save_every_n_epochs": 0
        }),
    );
    sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], dir)
}

fn logged_lrs(dir: &std::path::Path) -> Vec<f64> {
    let out = dir.join("out");
    let run = std::fs::read_dir(&out)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::read_to_string(run.join("train_log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["lr_unet"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

/// warmup_stable_decay with a cosine warmup from its floor, half the run's 8 steps of decay
/// (a fraction), two half waves and a floor of 0.1: each step's lr is the schedule's over the
/// run's 8 steps. Catches the decay length, ramps, cycles or floor dropped, and the automatic
/// decay (1.5 × the run) used instead of the run.
#[test]
fn warmup_stable_decay_from_optimizer_json_sets_each_steps_lr() {
    let tmp = tempfile::tempdir().unwrap();
    let out = run(
        tmp.path(),
        serde_json::json!({
            "optimizer": "adamw", "lr": 1e-3, "lr_scheduler": "warmup_stable_decay",
            "lr_warmup_steps": 2, "lr_wsd_decay_steps": 0.5, "lr_wsd_warmup_type": "cosine",
            "lr_scheduler_num_cycles": 2, "lr_scheduler_min_lr_ratio": 0.1
        }),
    );
    assert!(out.status.success(), "{}", text(&out));
    let want = LrSchedule {
        kind: ScheduleKind::WarmupStableDecay,
        warmup_steps: 2,
        decay_steps: 8,
        num_cycles: 2.0,
        power: 1.0,
        shape: ScheduleShape {
            min_lr_ratio: 0.1,
            decay_phase_steps: 4,
            warmup_ramp: Ramp::Cosine,
            decay_ramp: Ramp::Cosine,
            ..ScheduleShape::default()
        },
    };
    let lrs = logged_lrs(tmp.path());
    assert_eq!(lrs.len(), 8);
    for (step, lr) in lrs.iter().enumerate() {
        let expect = want.lr_at(1e-3, step);
        assert!(
            (lr - expect).abs() < 1e-12,
            "step {step}: {lr} vs {expect}: {lrs:?}"
        );
    }
    // The warmup starts at the floor, and two half waves come back up to the lr at the end.
    assert!((lrs[0] - 1e-4).abs() < 1e-12, "{lrs:?}");
    assert!(lrs[6] < lrs[7], "{lrs:?}");
}

/// A schedule key that belongs to another schedule, or a bad value, is refused before anything
/// loads, naming the key.
#[test]
fn schedule_keys_of_another_schedule_are_refused() {
    for (base, field) in [
        (
            serde_json::json!({"lr_scheduler": "cosine", "lr_wsd_decay_steps": 3}),
            "base.lr_wsd_decay_steps",
        ),
        (
            serde_json::json!({"lr_scheduler": "warmup_stable_decay"}),
            "base.lr_wsd_decay_steps",
        ),
        (
            serde_json::json!({"lr_scheduler": "warmup_stable_decay", "lr_wsd_decay_steps": 2,
                               "lr_wsd_decay_type": "exp"}),
            "base.lr_wsd_decay_type",
        ),
        (
            serde_json::json!({"lr_scheduler": "constant", "lr_scheduler_min_lr_ratio": 0.1}),
            "base.lr_scheduler_min_lr_ratio",
        ),
        (
            serde_json::json!({"lr_scheduler": "rex", "lr_scheduler_min_lr_ratio": 1.5}),
            "base.lr_scheduler_min_lr_ratio",
        ),
        (
            serde_json::json!({"lr_scheduler": "inverse_sqrt", "lr_scheduler_timescale": 0}),
            "base.lr_scheduler_timescale",
        ),
        (
            serde_json::json!({"lr_scheduler": "cosine_with_min_lr", "lr_scheduler_num_cycles": 0}),
            "base.lr_scheduler_num_cycles",
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let out = run(tmp.path(), base.clone());
        let log = text(&out);
        assert_eq!(out.status.code(), Some(2), "{base}: {log}");
        assert!(log.contains(field), "{base}: {log}");
    }
}
