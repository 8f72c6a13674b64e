//! Data parallel end to end on the CPU: LoRA runs on the tiny SD1.5 fixture on 2, 3 and 4
//! in-process ranks against the same run in one process.

use std::path::Path;
use std::time::Duration;

use candle_core::Device;

use super::data_parallel::train_ranks;
use super::test_runs::{lora, max_abs, repo};
use super::{train, RunOptions, TrainOutcome};
use crate::config::TrainPlan;

/// The runs here share the process-wide rank hook of [`super::oom::inject`]: one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A LoRA run of `steps` steps of 1 × `accum` samples, logging every step with its gradient
/// norm.
fn plan(dir: &Path, accum: usize, steps: usize) -> TrainPlan {
    plan_batch(dir, 1, accum, steps)
}

fn plan_batch(dir: &Path, batch: usize, accum: usize, steps: usize) -> TrainPlan {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("optimizer.json"), r#"{"log_grad_norm": true}"#).unwrap();
    let cfg = serde_json::json!({
        "model": repo().join("tests/fixtures/tiny-sd15"),
        "data_root": repo().join("data/demo"),
        "output_dir": dir.join("out"),
        "optimizer_config": dir.join("optimizer.json"),
        "project_name": "dp",
        "mode": "lora",
        "adapter": {"save_dtype": "fp32"},
        "resolution": 64,
        "batch_size": batch,
        "grad_accum": accum,
        "max_steps": steps,
        "lr": 1e-3,
        "log_step": 1,
        "seed": 11,
    });
    let path = dir.join("train.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    TrainPlan::resolve(&path, &[]).unwrap()
}

fn one_process(plan: &TrainPlan) -> TrainOutcome {
    let opts = RunOptions {
        device: Device::Cpu,
        show_progress: false,
    };
    train(plan, &opts).unwrap()
}

/// Each logged step's gradient norm.
fn grad_norms(out: &TrainOutcome) -> Vec<f64> {
    let log = std::fs::read_to_string(out.run_dir.join("train_log.jsonl")).unwrap();
    log.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["grad_norm"].as_f64())
        .collect()
}

fn assert_close(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    for (x, y) in got.iter().zip(want) {
        assert!(
            (x - y).abs() <= 1e-5 * y.abs().max(1e-6),
            "{what}: {got:?} vs {want:?}"
        );
    }
}

#[test]
fn ranks_train_the_same_weights_as_one_process() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let (accum, steps) = (4, 3);
    let single = one_process(&plan(&tmp.path().join("one"), accum, steps));
    let norms = grad_norms(&single);
    assert_eq!(norms.len(), steps);
    // 3 ranks over 4 micro-batches: rank 0 takes two of them.
    for world in [2, 3, 4] {
        let dir = tmp.path().join(format!("ranks{world}"));
        let p = plan(&dir, accum, steps);
        let devices = vec![Device::Cpu; world];
        let out = train_ranks(&p, &devices, false, Duration::from_secs(120)).unwrap();
        let what = format!("{world} ranks");
        assert_eq!(out.images_seen, single.images_seen, "{what}");
        assert_eq!(out.images_seen, accum * steps, "{what}");
        // The summed loss and gradient: an average over the ranks instead of a sum, or a rank
        // left out of it, moves both.
        assert_close(&format!("{what}: losses"), &out.losses, &single.losses);
        assert_close(
            &format!("{what}: gradient norms"),
            &grad_norms(&out),
            &norms,
        );
        let (got, want) = (
            lora(out.saved.last().unwrap()),
            lora(single.saved.last().unwrap()),
        );
        assert_eq!(got.len(), want.len(), "{what}");
        for (name, w) in &want {
            let (scale, diff) = (max_abs(w), max_abs(&(&got[name] - w).unwrap()));
            assert!(
                diff <= 1e-4 * scale.max(1e-3),
                "{what}: {name} differs by {diff} (scale {scale})"
            );
        }
        // Rank 0 alone wrote a run folder.
        let runs = std::fs::read_dir(dir.join("out")).unwrap().count();
        assert_eq!(runs, 1, "{what}: run folders in the output dir");
    }
}

#[test]
fn options_that_cannot_run_data_parallel_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mut p = plan(tmp.path(), 2, 1);
    p.precision.fused_backward_pass = true;
    let e = train_ranks(
        &p,
        &[Device::Cpu, Device::Cpu],
        false,
        Duration::from_secs(5),
    );
    assert!(format!("{:#}", e.unwrap_err()).contains("fused_backward_pass"));
}

/// An out-of-memory error on one rank: that rank halves its micro-batch and retries the same
/// samples, every rank goes on at the halved size, and the run trains what one process does.
#[test]
fn an_oom_on_one_rank_halves_every_rank_and_keeps_the_update() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let steps = 3;
    let single = one_process(&plan_batch(&tmp.path().join("one"), 2, 2, steps));
    let p = plan_batch(&tmp.path().join("ranks"), 2, 2, steps);
    let fired = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = fired.clone();
    super::oom::inject::set_for_ranks(move |rank, step, ids| {
        let fire = rank == 1 && step == 1 && ids.len() > 1;
        if fire {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        fire
    });
    let out = train_ranks(
        &p,
        &[Device::Cpu, Device::Cpu],
        false,
        Duration::from_secs(120),
    );
    super::oom::inject::clear_ranks();
    let out = out.unwrap();
    assert_eq!(fired.load(std::sync::atomic::Ordering::SeqCst), 1);
    // Rank 0 never ran out of memory, yet goes on at rank 1's halved size.
    assert_eq!(out.micro.size, 1, "{:?}", out.micro);
    assert_eq!(out.images_seen, single.images_seen);
    assert_close("losses", &out.losses, &single.losses);
    assert_close("gradient norms", &grad_norms(&out), &grad_norms(&single));
    let (got, want) = (
        lora(out.saved.last().unwrap()),
        lora(single.saved.last().unwrap()),
    );
    for (name, w) in &want {
        let (scale, diff) = (max_abs(w), max_abs(&(&got[name] - w).unwrap()));
        assert!(
            diff <= 1e-4 * scale.max(1e-3),
            "{name}: differs by {diff} (scale {scale})"
        );
    }
}
