//! The learning-rate schedules against diffusers' `get_scheduler` (the function EveryDream2
//! calls; kohya's names for these kinds are diffusers'), update by update:
//! tests/fixtures/reference/schedules.json, written by tests/fixtures/schedule_reference.py
//! (its docstring has the rerun command). Constant with warmup, linear, cosine, polynomial and
//! cosine with hard restarts at 1, 3, 4 and 7 cycles, with and without warmup.
//!
//! The newer kinds and settings against the trainers that have them:
//! tests/fixtures/reference/schedules_peers.json, written by
//! tests/fixtures/schedule_peers_reference.py: transformers' cosine_with_min_lr,
//! warmup_stable_decay, inverse_sqrt and polynomial's lr_end as kohya sd-scripts calls them, and
//! OneTrainer's five decaying schedules with its min factor and fractional cycles.

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
            num_cycles: c["num_cycles"].as_f64().unwrap(),
            power: c["power"].as_f64().unwrap_or(1.0),
            shape: Default::default(),
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

fn peers() -> Value {
    let path = common::fixture("reference/schedules_peers.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Catches, among others: kohya's cycles not halved (a cosine_with_min_lr that goes back up),
/// the floor applied as `r·λ` or left out, REX's 0.9 reflection, warmup_stable_decay's decay
/// starting after the warmup instead of before the end, its warmup starting at 0 instead of the
/// floor, a 1-sqrt ramp the wrong way round, inverse_sqrt's timescale shift, OneTrainer's
/// smooth restarts counted in whole instead of half waves, and fractional hard restarts.
#[test]
fn newer_schedules_match_transformers_and_onetrainer_update_by_update() {
    let r = peers();
    let cases = r["cases"].as_array().unwrap();
    let mut kinds = std::collections::BTreeSet::new();
    let mut worst = 0.0f64;
    for c in cases {
        let schedule: LrSchedule = serde_json::from_value(c["ours"].clone())
            .unwrap_or_else(|e| panic!("{}: {e}", c["source"]));
        let base = c["base_lr"].as_f64().unwrap();
        schedule
            .validate(base)
            .unwrap_or_else(|e| panic!("{}: {e}", c["source"]));
        kinds.insert(schedule.kind.name());
        for (step, want) in c["lrs"].as_array().unwrap().iter().enumerate() {
            let want = want.as_f64().unwrap();
            let got = schedule.lr_at(base, step);
            worst = worst.max((got - want).abs() / base);
            assert!(
                (got - want).abs() <= 1e-12 * base,
                "{}: step {step}: {got} vs {want}",
                c["source"]
            );
        }
    }
    eprintln!(
        "{} cases, worst difference {worst:e} of the base lr",
        cases.len()
    );
    for kind in [
        "linear",
        "cosine",
        "polynomial",
        "cosine_with_restarts",
        "cosine_with_min_lr",
        "rex",
        "inverse_sqrt",
        "warmup_stable_decay",
    ] {
        assert!(kinds.contains(kind), "no case of {kind}");
    }
}
