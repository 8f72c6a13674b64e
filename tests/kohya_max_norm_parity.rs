//! kohya's max-norm regularization (`adapter.scale_weight_norms`) against kohya's own
//! `apply_max_norm_regularization` (tests/fixtures/reference/kohya_max_norm.json, written by
//! tests/fixtures/kohya_max_norm_reference.py, whose docstring has the rerun command): Linear,
//! 1×1 and 3×3 conv factors above, below and between the cap, the factors after and the three
//! logged numbers.

mod common;

use candle_core::{Device, Tensor, Var};
use sdtrain::adapter::max_norm::regularize;
use serde_json::Value;

fn reference() -> Value {
    let path = common::fixture("reference/kohya_max_norm.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn shape(v: &Value) -> Vec<usize> {
    common::dims(v)
}

/// Catches a wrong scale (alpha/rank left out or inverted), the square root of the ratio left
/// out (the norm would fall to ratio², not ratio), a conv's factors composed wrongly, modules
/// under the cap touched, and the logged numbers taken before the scaling.
#[test]
fn max_norm_matches_kohyas_apply_max_norm_regularization() {
    let r = reference();
    let mut vars = Vec::new();
    for m in r["modules"].as_array().unwrap() {
        let var = |key: &str, dims: &str| {
            let t = Tensor::from_vec(floats(&m[key]), shape(&m[dims]), &Device::Cpu).unwrap();
            Var::from_tensor(&t).unwrap()
        };
        let rank = shape(&m["down_shape"])[0] as f64;
        let scale = m["alpha"].as_f64().unwrap() / rank;
        vars.push((var("up", "up_shape"), var("down", "down_shape"), scale, m));
    }
    let pairs: Vec<(&Var, &Var, f64)> = vars.iter().map(|(u, d, s, _)| (u, d, *s)).collect();
    let max = r["max_norm_value"].as_f64().unwrap();
    let stats = regularize(&pairs, max).unwrap();
    assert_eq!(stats.keys_scaled as u64, r["keys_scaled"].as_u64().unwrap());
    let close = |a: f64, b: f64| (a - b).abs() <= 2e-6 * b.abs().max(1e-3);
    assert!(
        close(
            stats.average_key_norm,
            r["average_key_norm"].as_f64().unwrap()
        ),
        "{stats:?}"
    );
    assert!(
        close(stats.max_key_norm, r["max_key_norm"].as_f64().unwrap()),
        "{stats:?}"
    );
    for (up, down, _, m) in &vars {
        for (v, key) in [(up, "up_after"), (down, "down_after")] {
            let got: Vec<f32> = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            let want = floats(&m[key]);
            for (a, b) in got.iter().zip(&want) {
                assert!(
                    close(f64::from(*a), f64::from(*b)),
                    "{} {key}: {a} vs {b}",
                    m["name"]
                );
            }
        }
    }
}
