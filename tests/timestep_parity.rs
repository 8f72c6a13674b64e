//! OneTrainer's timestep distributions and timestep shift against OneTrainer's own
//! `_get_timestep_discrete` (tests/fixtures/timestep_reference.py, its docstring has the rerun
//! command and the commit; expected numbers in
//! tests/fixtures/reference/timesteps_onetrainer.json):
//! - the continuous kinds (uniform, logit-normal, heavy tail, beta with α or β at 1), each with
//!   and without a shift and over a narrowed range: every timestep equal for the same recorded
//!   uniform or normal draws;
//! - the discrete kinds (cos_map, sigmoid, inverted parabola), with and without a shift: the
//!   weight of every timestep of the range (their draw in proportion is checked in
//!   src/diffusion/timesteps.rs).

mod common;

use sdtrain::diffusion::timesteps::{TimestepDistribution, TimestepRange};
use serde_json::Value;

fn reference() -> Value {
    common::reference_json("reference/timesteps_onetrainer.json")
}

/// OneTrainer's distribution and its settings, as sdtrain's config importer maps them.
fn distribution(c: &Value) -> TimestepDistribution {
    let w = c["noising_weight"].as_f64().unwrap();
    let b = c["noising_bias"].as_f64().unwrap();
    match c["kind"].as_str().unwrap() {
        "UNIFORM" => TimestepDistribution::Uniform,
        "LOGIT_NORMAL" => TimestepDistribution::LogitNormal {
            bias: b,
            scale: w + 1.0,
        },
        "HEAVY_TAIL" => TimestepDistribution::HeavyTail { scale: w },
        "BETA" => TimestepDistribution::Beta {
            alpha: w.max(1e-4),
            beta: b.max(1e-4),
        },
        "COS_MAP" => TimestepDistribution::CosMap,
        "SIGMOID" => TimestepDistribution::Sigmoid { weight: w, bias: b },
        "INVERTED_PARABOLA" => TimestepDistribution::InvertedParabola { weight: w, bias: b },
        other => panic!("unknown kind {other}"),
    }
}

fn range(c: &Value) -> TimestepRange {
    TimestepRange {
        start: c["start"].as_u64().unwrap() as u32,
        end: c["end"].as_u64().unwrap() as u32,
        num_train: 1000,
        shift: c["shift"].as_f64().unwrap(),
    }
}

#[test]
fn continuous_timesteps_match_onetrainer() {
    let r = reference();
    let cases = r["continuous"].as_array().unwrap();
    assert!(cases.len() >= 40);
    let mut outside = 0;
    for c in cases {
        let (d, range) = (distribution(c), range(c));
        let (lo, hi) = d.bounds(&range);
        let draws = common::floats(&c["draws"]);
        let want = common::floats(&c["timesteps"]);
        for (x, want) in draws.iter().zip(want) {
            let ours = d.continuous_at(*x as f32, &range);
            // OneTrainer gives one past the range where the unit draw maps to exactly 1
            // (module docs of timesteps.rs); sdtrain keeps the range.
            let want = want as u32;
            if want > hi {
                outside += 1;
            }
            assert_eq!(
                ours,
                want.clamp(lo, hi),
                "{} w {} b {} shift {} [{}, {}), draw {x}",
                c["kind"],
                c["noising_weight"],
                c["noising_bias"],
                range.shift,
                range.start,
                range.end
            );
        }
    }
    // The clamp is exercised (σ of 20, u = 0 under the heavy tail), not everything.
    assert!((1..200).contains(&outside), "{outside}");
}

#[test]
fn discrete_weights_match_onetrainer() {
    let r = reference();
    let cases = r["discrete"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for c in cases {
        let (d, range) = (distribution(c), range(c));
        let want = common::floats(&c["weights"]);
        let ours = d.weights(&range);
        assert_eq!(ours.len(), want.len(), "{c}");
        let worst = ours
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
            .fold(0.0f64, f64::max);
        // OneTrainer computes in f32.
        assert!(
            worst < 2e-5,
            "{} w {} b {} shift {} [{}, {}): worst rel err {worst:.1e}",
            c["kind"],
            c["noising_weight"],
            c["noising_bias"],
            range.shift,
            range.start,
            range.end
        );
    }
}
