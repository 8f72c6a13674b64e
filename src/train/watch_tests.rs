//! The memory creep and slow-step warnings end to end on the CPU: a LoRA run on the tiny SD1.5
//! fixture whose step times and memory readings are injected ([`super::trainer::watch_inject`]),
//! read back from `train_log.jsonl`.

use std::path::{Path, PathBuf};

use candle_core::Device;

use super::trainer::watch_inject;
use super::{train, RunOptions};
use crate::config::TrainPlan;
use crate::memory::{MemorySource, MemoryUsage};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A 45-step LoRA run logging every 20 steps, so only warnings add records in between.
fn plan(dir: &Path) -> TrainPlan {
    let cfg = serde_json::json!({
        "model": repo().join("tests/fixtures/tiny-sd15"),
        "data_root": repo().join("data/demo"),
        "output_dir": dir.join("out"),
        "project_name": "watch",
        "mode": "lora",
        "resolution": 64,
        "batch_size": 1,
        "max_steps": 45,
        "lr": 1e-3,
        "log_step": 20,
        "log_with": "none",
        "seed": 3,
    });
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("train.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    TrainPlan::resolve(&path, &[]).unwrap()
}

fn records(dir: &Path) -> Vec<serde_json::Value> {
    let out = dir.join("out");
    let run = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_dir())
        .unwrap();
    std::fs::read_to_string(run.join("train_log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// From step 15 the pool grows by 16 MiB a step; step 40 takes 5 s against 0.2 s. The log gets
/// one `memory_creep` warning (16 MiB per step) and one `slow_step` (5 s, median 0.2 s), each on
/// a record of its own step, beside the records `log_step` asks for.
#[test]
fn injected_creep_and_slow_step_reach_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan(dir.path());
    watch_inject::set(|step| {
        let grown = step.saturating_sub(15) as u64 * (16 << 20);
        let m = MemoryUsage {
            source: MemorySource::CudaPool,
            in_use_bytes: (2 << 30) + grown,
            peak_bytes: (2 << 30) + grown,
            device_free_bytes: None,
            device_total_bytes: None,
        };
        (if step == 40 { 5.0 } else { 0.2 }, Some(m))
    });
    let out = train(
        &plan,
        &RunOptions {
            device: Device::Cpu,
            show_progress: false,
        },
    );
    watch_inject::clear();
    out.unwrap();
    let recs = records(dir.path());
    let warned: Vec<(u64, &serde_json::Value)> = recs
        .iter()
        .flat_map(|r| {
            let step = r["step"].as_u64().unwrap();
            r["warnings"]
                .as_array()
                .into_iter()
                .flatten()
                .map(move |w| (step, w))
        })
        .collect();
    assert_eq!(warned.len(), 2, "{recs:?}");
    let (creep_step, creep) = warned[0];
    assert_eq!(creep["kind"], "memory_creep");
    assert_eq!(creep["mib_per_step"], 16.0);
    assert_eq!(creep["source"], "cuda_pool");
    assert!((16..=35).contains(&creep_step), "{creep_step}");
    let (slow_step, slow) = warned[1];
    assert_eq!((slow_step, slow["kind"].as_str()), (40, Some("slow_step")));
    assert_eq!(
        (slow["secs"].as_f64(), slow["expected_secs"].as_f64()),
        (Some(5.0), Some(0.2))
    );
    let steps: Vec<u64> = recs.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert!(steps.contains(&20) && steps.contains(&45), "{steps:?}");
}
