//! `weight_dtype: "bf16"` from the CLI: a full fine-tune whose UNet weights are stored in bf16
//! and written back with stochastic rounding tracks the f32-weight run of the same seed over 200
//! steps of the tiny fixture.
//!
//! Measured when written (2026-11-24, lr 1e-4, AdamW): mean loss of the last 40 steps 0.7749 with
//! bf16 weights against 0.7753 with f32 (ratio 0.9995). The same bf16 run rounding to nearest
//! ends at 0.9825 (ratio 1.27): most updates are smaller than half a bf16 gap and are lost, so
//! the bound below fails without stochastic rounding.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::cli::{demo_data, run_folder, write_config};

const STEPS: usize = 200;

fn config(dir: &Path, weight_dtype: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    write_config(
        dir,
        "tiny-sd15",
        &demo_data(),
        serde_json::json!({
            "mode": "full",
            "max_steps": STEPS,
            "lr": 1e-4,
            "seed": 3,
            "amp": "off",
            "weight_dtype": weight_dtype,
            "cond_dropout": 0,
            "disable_textenc_training": true,
            "cache_latents": true,
            "save_every_n_epochs": 0,
        }),
    )
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

#[test]
fn bf16_weights_track_the_f32_run_over_200_steps() {
    let tmp = tempfile::tempdir().unwrap();
    // Both runs at once: each is mostly one thread on this size of model.
    let runs: Vec<(PathBuf, std::process::Child)> = ["f32", "bf16"]
        .iter()
        .map(|w| {
            let dir = tmp.path().join(w);
            let cfg = config(&dir, w);
            let child = Command::new(env!("CARGO_BIN_EXE_sdtrain"))
                .args(["--config", cfg.to_str().unwrap(), "--cpu"])
                .current_dir(&dir)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            (dir, child)
        })
        .collect();
    let mut tails = Vec::new();
    for (dir, child) in runs {
        let out = child.wait_with_output().unwrap();
        let log = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{}: {log}", dir.display());
        let l = common::cli::step_losses(&run_folder(&dir));
        assert_eq!(l.len(), STEPS, "{log}");
        tails.push((mean(&l[..STEPS / 5]), mean(&l[STEPS - STEPS / 5..]), log));
    }
    let (f32_run, bf16_run) = (&tails[0], &tails[1]);
    assert!(
        bf16_run.2.contains("trained weights bf16"),
        "the run does not say its weights are bf16: {}",
        bf16_run.2
    );
    let ratio = bf16_run.1 / f32_run.1;
    eprintln!(
        "final-loss ratio bf16/f32 {ratio:.4} (last {} steps: {:.4} vs {:.4}; first: {:.4} vs {:.4})",
        STEPS / 5,
        bf16_run.1,
        f32_run.1,
        bf16_run.0,
        f32_run.0
    );
    // The run trains (the loss falls by a fifth), and bf16 ends where f32 does.
    assert!(f32_run.1 < 0.85 * f32_run.0, "{f32_run:?}");
    assert!((ratio - 1.0).abs() < 0.02, "final-loss ratio {ratio}");
}
