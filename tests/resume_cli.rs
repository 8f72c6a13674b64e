//! Exact resume from the CLI: a run stopped (SIGKILL for a LoRA, Ctrl-C for a full fine-tune)
//! and resumed with `resume_ckpt` gives the same per-step losses and the same final weights,
//! bit for bit on the CPU, as the run that never stopped; `checkpoints_total_limit` keeps the
//! newest save points; the EMA copy survives a save point.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use common::cli::{demo_data, run_folder, sdtrain, text, write_config};

const STEPS: u64 = 6;

fn config(dir: &Path, extra: serde_json::Value) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let mut cfg = serde_json::json!({
        "max_steps": STEPS,
        "save_every_n_steps": 2,
        "seed": 11,
        "batch_size": 2,
        "log_step": 1,
    });
    if let (Some(c), Some(e)) = (cfg.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    write_config(dir, "tiny-sd15", &demo_data(), cfg)
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

fn tensors(path: &Path) -> HashMap<String, Tensor> {
    if path.is_dir() {
        let file = path.join("unet/diffusion_pytorch_model.safetensors");
        return candle_core::safetensors::load(file, &Device::Cpu).unwrap();
    }
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn assert_bit_equal(a: &Path, b: &Path) {
    let (x, y) = (tensors(a), tensors(b));
    assert_eq!(x.len(), y.len());
    for (name, t) in &x {
        let (p, q) = (
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            y[name].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        let same = p.iter().zip(&q).all(|(u, v)| u.to_bits() == v.to_bits());
        assert!(
            same,
            "{name} differs between {} and {}",
            a.display(),
            b.display()
        );
    }
}

/// Starts the run, waits for save point `state-step-000002`, stops it with `signal`, checks it
/// stopped before the end, then resumes it with `resume_ckpt` and returns its run folder.
fn stop_and_resume(dir: &Path, cfg: &Path, signal: &str) -> PathBuf {
    let child = Command::new(env!("CARGO_BIN_EXE_sdtrain"))
        .args(["--config", cfg.to_str().unwrap(), "--cpu"])
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let saved = |d: &Path| {
        std::fs::read_dir(d.join("out"))
            .ok()
            .and_then(|mut r| r.next())
            .is_some_and(|run| run.unwrap().path().join("state-step-000002").is_dir())
    };
    while !saved(dir) {
        assert!(
            start.elapsed() < Duration::from_secs(180),
            "no save point in 3 minutes"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let sent = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let status = child.wait_with_output().unwrap().status;
    let run = run_folder(dir);
    let done = losses(&run).last().map_or(0, |l| l.0);
    assert!(
        done < STEPS,
        "the run ended ({status:?}) before it was stopped: pick more steps"
    );
    let resume = format!("resume_ckpt={}", run.display());
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--cpu", "--set", &resume],
        dir,
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("resumed from"), "{}", text(&out));
    assert_eq!(
        run_folder(dir),
        run,
        "a resumed run continues in its own folder"
    );
    run
}

/// `extra` keys beyond the mode; `final_weights` are compared bit for bit.
fn check_resume(mode: &str, signal: &str, more: serde_json::Value, final_weights: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    // LoRA with dropout: its masks must be drawn again exactly too.
    let extra =
        serde_json::json!({"mode": mode, "adapter": {"save_dtype": "fp32", "dropout": 0.2}});
    let mut extra = if mode == "full" {
        serde_json::json!({"mode": "full"})
    } else {
        extra
    };
    if let (Some(e), Some(m)) = (extra.as_object_mut(), more.as_object()) {
        e.extend(m.clone());
    }
    let (a, b) = (tmp.path().join("straight"), tmp.path().join("stopped"));
    let out = sdtrain(
        &[
            "--config",
            config(&a, extra.clone()).to_str().unwrap(),
            "--cpu",
        ],
        &a,
    );
    assert!(out.status.success(), "{}", text(&out));
    let straight = run_folder(&a);
    let resumed = stop_and_resume(&b, &config(&b, extra), signal);
    let (want, got) = (losses(&straight), losses(&resumed));
    assert_eq!(want.len(), STEPS as usize);
    // Identical f64s, every step once.
    assert_eq!(got, want, "{mode}: per-step losses");
    for w in final_weights {
        assert_bit_equal(&straight.join(w), &resumed.join(w));
    }
}

#[test]
fn a_killed_lora_run_resumes_exactly() {
    check_resume(
        "lora",
        "-KILL",
        serde_json::json!({}),
        &["sdtrain.safetensors"],
    );
}

/// kohya's dataset config with two datasets at their own resolution and batch size (64 px in
/// twos, 128 px one at a time): the resumed run draws the same mixed micro-batches, and a step's
/// effective batch (1 or 2 images) is restored with it. Catches a resume that rebuilds the epoch
/// with one batch size, or the retry's micro-batch from the first dataset's.
#[test]
fn a_killed_run_on_datasets_of_two_resolutions_resumes_exactly() {
    let toml = tempfile::tempdir().unwrap();
    let path = toml.path().join("datasets.toml");
    common::cli::two_resolution_datasets(&path, &demo_data());
    check_resume(
        "lora",
        "-KILL",
        serde_json::json!({"dataset_config": path}),
        &["sdtrain.safetensors"],
    );
}

/// A step-size estimator's group scalars (Prodigy's `d`, its maximum, numerator and step count)
/// are saved with the optimizer state and restored: catches an estimate restarted at `d0`.
#[test]
fn a_killed_prodigy_lora_run_resumes_exactly() {
    let opt = tempfile::tempdir().unwrap();
    let path = opt.path().join("optimizer.json");
    let group = serde_json::json!({"optimizer": "prodigy", "lr": 1.0, "d0": 1e-4});
    std::fs::write(&path, serde_json::json!({"base": group}).to_string()).unwrap();
    check_resume(
        "lora",
        "-KILL",
        serde_json::json!({"optimizer_config": path}),
        &["sdtrain.safetensors"],
    );
}

/// The EMA is saved into the save point and restored: the resumed run's EMA file equals the
/// uninterrupted run's. Catches an EMA restarted from the resumed weights, or not saved.
#[test]
fn a_killed_lora_run_with_ema_resumes_exactly() {
    let ema = serde_json::json!({"ema_decay_rate": 0.9, "ema_update_interval": 1});
    check_resume(
        "lora",
        "-KILL",
        ema,
        &["sdtrain.safetensors", "sdtrain-ema.safetensors"],
    );
}

/// With EMA on: the EMA folder matches too (a full fine-tune's EMA covers the UNet and the text
/// encoder).
#[test]
fn an_interrupted_full_run_with_ema_resumes_exactly() {
    let ema = serde_json::json!({"ema_decay_rate": 0.9, "ema_update_interval": 1});
    check_resume("full", "-INT", ema, &["final", "final-ema"]);
}

/// bf16 weights with stochastic rounding: the rounding is seeded by the run's seed, each
/// parameter's name and its update count, all restored from the save point, so the resumed run
/// rounds as the straight one did. Catches a rounding seed drawn afresh, or from the step count
/// of the resumed process.
#[test]
fn an_interrupted_bf16_weight_run_resumes_exactly() {
    let bf16 = serde_json::json!({"weight_dtype": "bf16"});
    check_resume("full", "-INT", bf16, &["final"]);
}

/// With `seed: -1` the seed is drawn once and kept in the save point: a run resumed from its
/// step-2 save point retrains steps 3–6 exactly as the run did (losses and final weights, bit
/// for bit), though the resumed process draws a fresh seed of its own. Catches a resume that
/// keeps the fresh seed instead of the saved one, for the data and noise draws and for the
/// LoRA dropout masks (drawn from the seed the adapters are attached with).
#[test]
fn a_random_seed_is_restored_on_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({
        "mode": "lora",
        "adapter": {"save_dtype": "fp32", "dropout": 0.2},
        "seed": -1,
    });
    let cfg = config(tmp.path(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let run = run_folder(tmp.path());
    let want = losses(&run);
    assert_eq!(want.len(), STEPS as usize);
    let weights = run.join("sdtrain.safetensors");
    let finished = tmp.path().join("finished.safetensors");
    std::fs::copy(&weights, &finished).unwrap();

    let resume = format!("resume_ckpt={}", run.join("state-step-000002").display());
    let out = sdtrain(
        &["--config", cfg.to_str().unwrap(), "--cpu", "--set", &resume],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("at step 2"), "{}", text(&out));
    assert_eq!(losses(&run), want, "per-step losses after the resume");
    assert_bit_equal(&finished, &weights);
}

/// `checkpoints_total_limit` keeps the newest save points and the step saves that go with them;
/// `resume_ckpt: "last_run"` finds the run.
#[test]
fn old_save_points_are_pruned_and_last_run_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({"mode": "lora", "checkpoints_total_limit": 1});
    let cfg = config(tmp.path(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let run = run_folder(tmp.path());
    let mut names: Vec<String> = std::fs::read_dir(&run)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("step-"))
        .collect();
    names.sort();
    // Save points at steps 2, 4 and 6 (the end of a run with save points on leaves one):
    // only the newest stays, and the step saves of 2 and 4 went with theirs.
    assert_eq!(names, ["state-step-000006"]);
    // The run is finished: last_run resumes at its end, step 6, with nothing left to train.
    let out = sdtrain(
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--cpu",
            "--set",
            "resume_ckpt=last_run",
        ],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("at step 6"), "{}", text(&out));
    let steps: Vec<u64> = losses(&run).iter().map(|l| l.0).collect();
    assert_eq!(steps, vec![1, 2, 3, 4, 5, 6]);
}

/// EveryDream2's chaining: `resume_ckpt: "findlast"` starts a **new** run (its own folder and
/// settings, here without the text encoder) from the newest diffusers model saved under
/// `output_dir`, and leaves the first run's folder as it was. An adapter-only output has no
/// model to find, and says so. Catches findlast resuming the old run (it then trained nothing,
/// or trained on in the first run's folder and overwrote its `final/`).
#[test]
fn findlast_starts_a_new_run_from_the_newest_saved_model() {
    let tmp = tempfile::tempdir().unwrap();
    let first = config(
        tmp.path(),
        serde_json::json!({"mode": "full", "max_steps": 2, "save_every_n_steps": null}),
    );
    let out = sdtrain(&["--config", first.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let run1 = run_folder(tmp.path());
    let final1 = run1.join("final/unet/diffusion_pytorch_model.safetensors");
    let before = std::fs::read(&final1).unwrap();
    let out = sdtrain(
        &[
            "--config",
            first.to_str().unwrap(),
            "--cpu",
            "--set",
            "resume_ckpt=findlast",
            "--set",
            "disable_textenc_training=true",
            "--set",
            "max_steps=1",
        ],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out));
    let runs: Vec<PathBuf> = std::fs::read_dir(tmp.path().join("out"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p != &run1)
        .collect();
    assert_eq!(runs.len(), 1, "a second run folder");
    let plan: serde_json::Value =
        serde_json::from_slice(&std::fs::read(runs[0].join("plan.json")).unwrap()).unwrap();
    assert_eq!(
        Path::new(plan["model"].as_str().unwrap()),
        std::path::absolute(run1.join("final")).unwrap()
    );
    assert_eq!(losses(&runs[0]).len(), 1);
    assert_eq!(
        std::fs::read(&final1).unwrap(),
        before,
        "run 1's model kept"
    );

    let lora = tmp.path().join("lora");
    let cfg = config(
        &lora,
        serde_json::json!({"mode": "lora", "resume_ckpt": "findlast"}),
    );
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("holds no saved diffusers model"),
        "{}",
        text(&out)
    );
}
