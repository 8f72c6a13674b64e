//! The learning-rate schedules against diffusers' `get_scheduler` (the function EveryDream2
//! calls; kohya's names for these kinds are diffusers'), update by update:
//! tests/fixtures/reference/schedules.json, written by tests/fixtures/schedule_reference.py
//! (its docstring has the rerun command). Constant with warmup, linear, cosine, polynomial and
//! cosine with hard restarts at 1, 3, 4 and 7 cycles, with and without warmup.

mod common;

use sdtrain::optim::{LrSchedule, ScheduleKind};
use serde_json::Value;

fn reference() -> Value {
    let path = common::fixture("reference/schedules.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Catches a restart at the wrong step (cycles counted from step 0 instead of after the
/// warmup), a cycle that runs a half cosine instead of a whole one, an lr that does not stay 0
/// after the last cycle, and any drift in the other kinds.
#[test]
fn every_schedule_matches_diffusers_update_by_update() {
    let r = reference();
    let cases = r["cases"].as_array().unwrap();
    for c in cases {
        let kind = match c["name"].as_str().unwrap() {
            "constant_with_warmup" => ScheduleKind::Constant,
            "cosine_with_restarts" => ScheduleKind::CosineWithRestarts,
            name => name.parse().unwrap(),
        };
        let schedule = LrSchedule {
            kind,
            warmup_steps: c["warmup"].as_u64().unwrap() as usize,
            decay_steps: c["total"].as_u64().unwrap() as usize,
            num_cycles: c["num_cycles"].as_u64().unwrap() as u32,
            power: c["power"].as_f64().unwrap_or(1.0),
        };
        let base = c["base_lr"].as_f64().unwrap();
        for (step, want) in c["lrs"].as_array().unwrap().iter().enumerate() {
            let want = want.as_f64().unwrap();
            let got = schedule.lr_at(base, step);
            assert!(
                (got - want).abs() <= 1e-12 * base,
                "{} cycles {} warmup {}: step {step}: {got} vs {want}",
                c["name"],
                c["num_cycles"],
                c["warmup"]
            );
        }
    }
    assert!(cases.len() >= 14);
}
