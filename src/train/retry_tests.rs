//! The out-of-memory retry, end to end on the CPU: LoRA runs on the tiny SD1.5 fixture with
//! OOM errors injected at the typed-error level ([`super::oom::inject`]), against the same run
//! without them.

use std::cell::RefCell;
use std::path::Path;
use std::rc::Rc;

use candle_core::Device;

use super::micro_batch::GaveUp;
use super::oom::inject;
use super::test_runs::{lora, max_abs, repo};
use super::{train, RunOptions, TrainOutcome};
use crate::config::TrainPlan;

fn plan(dir: &Path, batch: usize, accum: usize, steps: usize) -> TrainPlan {
    let cfg = serde_json::json!({
        "model": repo().join("tests/fixtures/tiny-sd15"),
        "data_root": repo().join("data/demo"),
        "output_dir": dir.join("out"),
        "project_name": "retry",
        "mode": "lora",
        "adapter": {"save_dtype": "fp32"},
        "resolution": 64,
        "batch_size": batch,
        "grad_accum": accum,
        "max_steps": steps,
        "lr": 1e-3,
        "log_step": 1,
        "seed": 7,
    });
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("train.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    TrainPlan::resolve(&path, &[]).unwrap()
}

/// One micro-batch the trainer ran: its step, its samples, and whether an OOM was injected.
type Micro = (usize, Vec<usize>, bool);
type Seen = Rc<RefCell<Vec<Micro>>>;

/// Runs `plan` with `fail(step, ids)` deciding where an OOM is injected; returns the outcome
/// and every micro-batch seen.
fn run(
    plan: &TrainPlan,
    mut fail: impl FnMut(usize, &[usize]) -> bool + 'static,
) -> (anyhow::Result<TrainOutcome>, Vec<Micro>) {
    let seen: Seen = Rc::default();
    let log = seen.clone();
    inject::set(move |step, ids| {
        let f = fail(step, ids);
        log.borrow_mut().push((step, ids.to_vec(), f));
        f
    });
    let out = train(
        plan,
        &RunOptions {
            device: Device::Cpu,
            show_progress: false,
        },
    );
    inject::clear();
    let seen = seen.borrow().clone();
    (out, seen)
}

/// The samples each step trained on, in order, from the micro-batches that were not failed.
fn samples_per_step(seen: &[Micro]) -> Vec<Vec<usize>> {
    let mut steps: Vec<Vec<usize>> = Vec::new();
    for (step, ids, failed) in seen {
        if *failed {
            continue;
        }
        if steps.len() <= *step {
            steps.resize(step + 1, Vec::new());
        }
        steps[*step].extend(ids);
    }
    steps
}

#[test]
fn an_oom_retry_trains_the_same_samples_to_the_same_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let steps = 3;
    let (clean, clean_seen) = run(&plan(&a, 4, 1, steps), |_, _| false);
    let clean = clean.unwrap();
    // Step 1 fails at 4 and then at 2 samples: it finishes at 1, as do the steps after it.
    // The updates equal the clean run's to f32 rounding (amplified a little by the optimizer's
    // normalisation where a gradient is near 0).
    let (retried, seen) = run(&plan(&b, 4, 1, steps), |step, ids| {
        step == 1 && ids.len() > 1
    });
    let retried = retried.unwrap();
    assert_eq!(
        (retried.micro.size, retried.micro.oom_retries),
        (1, 2),
        "{seen:?}"
    );
    assert_eq!(clean.micro.oom_retries, 0);
    // The same samples in each step, and so the same effective batch.
    assert_eq!(samples_per_step(&seen), samples_per_step(&clean_seen));
    assert_eq!(samples_per_step(&seen)[1].len(), 4);
    assert_eq!(retried.images_seen, clean.images_seen);
    assert_eq!(retried.images_seen, 4 * steps);
    // Step 0 ran at 4 per micro-batch; step 1 failed at 4 and 2; then 1 at a time.
    let sizes = |step: usize| -> Vec<usize> {
        seen.iter()
            .filter(|(s, _, f)| *s == step && !f)
            .map(|(_, ids, _)| ids.len())
            .collect()
    };
    assert_eq!(
        (sizes(0), sizes(1), sizes(2)),
        (vec![4], vec![1; 4], vec![1; 4])
    );
    let failed: Vec<usize> = seen.iter().filter(|s| s.2).map(|s| s.1.len()).collect();
    assert_eq!(failed, vec![4, 2]);
    for (x, y) in retried.losses.iter().zip(&clean.losses) {
        assert!(
            (x - y).abs() <= 1e-5 * y.abs().max(1.0),
            "losses {x} vs {y}"
        );
    }
    let (got, want) = (
        lora(retried.saved.last().unwrap()),
        lora(clean.saved.last().unwrap()),
    );
    assert_eq!(got.len(), want.len());
    for (name, w) in &want {
        let (scale, diff) = (max_abs(w), max_abs(&(&got[name] - w).unwrap()));
        assert!(
            diff <= 1e-4 * scale.max(1e-3),
            "{name}: differs by {diff} (scale {scale})"
        );
    }
    // The log records the retries.
    let log = std::fs::read_to_string(retried.run_dir.join("train_log.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(log.lines().last().unwrap()).unwrap();
    assert_eq!(
        (last["oom_retries"].as_u64(), last["micro_batch"].as_u64()),
        (Some(2), Some(1))
    );
}

#[test]
fn an_oom_at_batch_one_saves_and_names_the_next_rungs() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = plan(tmp.path(), 2, 1, 3);
    let (out, seen) = run(&plan, |step, _| step == 1);
    let err = out.unwrap_err();
    let gave_up = err.downcast_ref::<GaveUp>().expect("a GaveUp error");
    let text = format!("{err:#}");
    assert!(text.contains("at step 2 with batch 1"), "{text}");
    assert!(text.contains("gradient checkpointing"), "{text}");
    assert!(text.contains("errored-step-000001"), "{text}");
    assert!(
        !gave_up.rungs.contains("LoRA instead"),
        "a LoRA run: {text}"
    );
    // Tried at 2, then 1; step 0 completed and is what was saved.
    let failed: Vec<usize> = seen.iter().filter(|s| s.2).map(|s| s.1.len()).collect();
    assert_eq!(failed, vec![2, 1]);
    let run_dir = std::fs::read_dir(tmp.path().join("out"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    assert!(run_dir
        .join("retry-errored-step-000001.safetensors")
        .is_file());
    let log = std::fs::read_to_string(run_dir.join("train_log.jsonl")).unwrap();
    assert_eq!(log.lines().count(), 1, "{log}");
    assert_eq!(crate::cli::exit_code(&err), std::process::ExitCode::FAILURE);
}

/// Outside the micro-batches (optimizer step, saves): one retry after an OOM, then give up
/// naming the place; any other error is returned at once, untried again.
#[test]
fn outside_the_step_an_oom_is_retried_once() {
    use super::oom::OutOfMemory;
    use super::oom_policy::retry_once_on_oom;
    let oom = || {
        anyhow::Error::new(OutOfMemory {
            detail: "test".into(),
        })
    };
    let mut calls = 0;
    let ok = retry_once_on_oom(
        &Device::Cpu,
        || "here".into(),
        || {
            calls += 1;
            if calls == 1 {
                Err(oom())
            } else {
                Ok(calls)
            }
        },
    );
    assert_eq!(ok.unwrap(), 2);
    let mut calls = 0;
    let err = retry_once_on_oom(
        &Device::Cpu,
        || "in the unet optimizer step".into(),
        || {
            calls += 1;
            Err::<(), _>(oom())
        },
    )
    .unwrap_err();
    assert_eq!(calls, 2);
    assert!(
        err.to_string().contains("in the unet optimizer step"),
        "{err}"
    );
    let mut calls = 0;
    let err = retry_once_on_oom(
        &Device::Cpu,
        || "x".into(),
        || {
            calls += 1;
            Err::<(), _>(anyhow::anyhow!("disk full"))
        },
    )
    .unwrap_err();
    assert_eq!((calls, err.to_string()), (1, "disk full".to_string()));
}
