//! The learning-rate-free optimizers against their references over 25 steps
//! (tests/fixtures/adaptive_reference.json, made by tests/fixtures/adaptive_reference.py):
//! Prodigy (prodigyopt), D-Adaptation Adam, Adan, Lion and SGD (dadaptation), coordinate and
//! scalar DoWG (dowg) and EveryDream2's AdaCoor. Both the weights after every step and the
//! group's estimate (`d` and its companions) must match. Also: the fused form (one pass per
//! parameter, as inside a fused backward pass) of the D-Adaptation rules whose second pass does
//! not read the new `d` equals the two-pass step bit for bit.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use serde::Deserialize;
use serde_json::Value;

use sdtrain::optim::{
    AdaCoor, AdaCoorParams, CoordinateDowg, DAdaptAdam, DAdaptAdamParams, DAdaptAdan,
    DAdaptAdanParams, DAdaptLion, DAdaptLionParams, DAdaptSgd, DAdaptSgdParams, DowgParams,
    GroupOptimizer, Optimizer, Prodigy, ProdigyParams, ScalarDowg, UpdateRule,
};

#[derive(Deserialize)]
struct Case {
    optimizer: String,
    hyper: HashMap<String, Value>,
    lrs: Vec<f64>,
    shapes: HashMap<String, Vec<usize>>,
    init: HashMap<String, Vec<f32>>,
    target: HashMap<String, Vec<f32>>,
    noise: Vec<HashMap<String, Vec<f32>>>,
    steps: Vec<Step>,
}

#[derive(Deserialize)]
struct Step {
    params: HashMap<String, Vec<f32>>,
    estimate: HashMap<String, f64>,
}

fn cases() -> HashMap<String, Case> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/adaptive_reference.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn num(h: &HashMap<String, Value>, key: &str, default: f64) -> f64 {
    match h.get(key) {
        Some(Value::String(s)) if s == "inf" => f64::INFINITY,
        Some(v) => v.as_f64().unwrap(),
        None => default,
    }
}

fn flag(h: &HashMap<String, Value>, key: &str, default: bool) -> bool {
    h.get(key).map_or(default, |v| v.as_bool().unwrap())
}

fn betas(h: &HashMap<String, Value>) -> Option<Vec<f64>> {
    h.get("betas").map(|v| {
        v.as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_f64().unwrap())
            .collect()
    })
}

/// The rule a case names, with the case's hyper-parameters over the package's defaults.
fn rule(case: &Case) -> Box<dyn UpdateRule> {
    let h = &case.hyper;
    match case.optimizer.as_str() {
        "prodigy" => {
            let d = ProdigyParams::default();
            let b = betas(h).unwrap_or(vec![d.beta1, d.beta2]);
            Box::new(
                Prodigy::rule(ProdigyParams {
                    beta1: b[0],
                    beta2: b[1],
                    beta3: None,
                    eps: num(h, "eps", d.eps),
                    weight_decay: num(h, "weight_decay", d.weight_decay),
                    decouple: flag(h, "decouple", d.decouple),
                    use_bias_correction: flag(h, "use_bias_correction", d.use_bias_correction),
                    safeguard_warmup: flag(h, "safeguard_warmup", d.safeguard_warmup),
                    d0: num(h, "d0", d.d0),
                    d_coef: num(h, "d_coef", d.d_coef),
                    growth_rate: num(h, "growth_rate", d.growth_rate),
                })
                .unwrap(),
            )
        }
        "dadapt_adam" => {
            let d = DAdaptAdamParams::default();
            let b = betas(h).unwrap_or(vec![d.beta1, d.beta2]);
            Box::new(
                DAdaptAdam::rule(DAdaptAdamParams {
                    beta1: b[0],
                    beta2: b[1],
                    eps: num(h, "eps", d.eps),
                    weight_decay: num(h, "weight_decay", d.weight_decay),
                    decouple: flag(h, "decouple", d.decouple),
                    use_bias_correction: flag(h, "use_bias_correction", d.use_bias_correction),
                    d0: num(h, "d0", d.d0),
                    growth_rate: num(h, "growth_rate", d.growth_rate),
                })
                .unwrap(),
            )
        }
        "dadapt_lion" => {
            let d = DAdaptLionParams::default();
            let b = betas(h).unwrap_or(vec![d.beta1, d.beta2]);
            Box::new(
                DAdaptLion::rule(DAdaptLionParams {
                    beta1: b[0],
                    beta2: b[1],
                    weight_decay: num(h, "weight_decay", d.weight_decay),
                    d0: num(h, "d0", d.d0),
                })
                .unwrap(),
            )
        }
        "dadapt_adan" => {
            let d = DAdaptAdanParams::default();
            let b = betas(h).unwrap_or(vec![d.beta1, d.beta2, d.beta3]);
            Box::new(
                DAdaptAdan::rule(DAdaptAdanParams {
                    beta1: b[0],
                    beta2: b[1],
                    beta3: b[2],
                    eps: num(h, "eps", d.eps),
                    weight_decay: num(h, "weight_decay", d.weight_decay),
                    no_prox: flag(h, "no_prox", d.no_prox),
                    d0: num(h, "d0", d.d0),
                    growth_rate: num(h, "growth_rate", d.growth_rate),
                })
                .unwrap(),
            )
        }
        "dadapt_sgd" => {
            let d = DAdaptSgdParams::default();
            Box::new(
                DAdaptSgd::rule(DAdaptSgdParams {
                    momentum: num(h, "momentum", d.momentum),
                    weight_decay: num(h, "weight_decay", d.weight_decay),
                    d0: num(h, "d0", d.d0),
                    growth_rate: num(h, "growth_rate", d.growth_rate),
                })
                .unwrap(),
            )
        }
        "coordinate_dowg" | "scalar_dowg" => {
            let d = DowgParams::default();
            let p = DowgParams {
                eps: num(h, "eps", d.eps),
                clip: num(h, "clip", d.clip),
            };
            if case.optimizer == "scalar_dowg" {
                Box::new(ScalarDowg::rule(p).unwrap())
            } else {
                Box::new(CoordinateDowg::rule(p).unwrap())
            }
        }
        "adacoor" => Box::new(
            AdaCoor::rule(AdaCoorParams {
                eps: num(h, "eps", 1e-8),
            })
            .unwrap(),
        ),
        other => panic!("no rule for {other}"),
    }
}

fn params(case: &Case) -> Vec<(String, Var)> {
    let mut names: Vec<&String> = case.shapes.keys().collect();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let t = Tensor::from_slice(&case.init[n], case.shapes[n].as_slice(), &Device::Cpu);
            (n.clone(), Var::from_tensor(&t.unwrap()).unwrap())
        })
        .collect()
}

/// The case's gradient at step `k` for the current weights: `0.5·(p − target) + noise_k`.
fn grads(case: &Case, vars: &[(String, Var)], k: usize) -> Vec<(Var, Tensor)> {
    vars.iter()
        .map(|(n, v)| {
            let target = Tensor::from_slice(&case.target[n], v.shape(), &Device::Cpu).unwrap();
            let noise = Tensor::from_slice(&case.noise[k][n], v.shape(), &Device::Cpu).unwrap();
            let g = ((v.as_tensor() - target).unwrap() * 0.5).unwrap();
            (v.clone(), (g + noise).unwrap())
        })
        .collect()
}

fn store(grads: &[(Var, Tensor)]) -> GradStore {
    let mut s = GradStore::default();
    for (v, g) in grads {
        s.insert(v.as_tensor(), g.clone());
    }
    s
}

/// `|a − b|` relative to `max(|b|, floor)`.
fn rel(a: f64, b: f64, floor: f64) -> f64 {
    (a - b).abs() / b.abs().max(floor)
}

/// Replays a case; returns the worst relative error of the weights (floor 1e-3) and of the
/// estimate's values over every step.
fn replay(case: &Case) -> (f64, f64) {
    let vars = params(case);
    let mut opt = GroupOptimizer::new(rule(case), vars.clone(), 1.0).unwrap();
    let (mut worst_p, mut worst_e) = (0f64, 0f64);
    for (k, want) in case.steps.iter().enumerate() {
        opt.set_learning_rate(case.lrs[k]);
        let stats = opt.step(&store(&grads(case, &vars, k))).unwrap();
        assert!(!stats.skipped_nonfinite);
        for (n, v) in &vars {
            let got = v.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for (a, b) in got.iter().zip(&want.params[n]) {
                worst_p = worst_p.max(rel(f64::from(*a), f64::from(*b), 1e-3));
            }
        }

        let values: HashMap<&str, f64> = opt.estimate_values().into_iter().collect();

        assert_eq!(values.len(), want.estimate.len(), "step {k}: {values:?}");
        for (name, b) in &want.estimate {
            let a = values[name.as_str()];
            worst_e = worst_e.max(rel(a, *b, 1e-12));
        }
    }
    assert_state_untracked(&opt, vars.iter().map(|(n, _)| n.clone()));
    (worst_p, worst_e)
}

/// No state tensor carries an autograd graph: a state computed from the tracked parameter would
/// keep every earlier step's tensors alive (schedule-free's `z` chain grew by the model's size
/// per step before `dense::value` detached).
fn assert_state_untracked(opt: &GroupOptimizer, names: impl Iterator<Item = String>) {
    for n in names {
        let state = opt.state(&n).unwrap();
        for (suffix, t) in state.tensors() {
            assert!(!t.track_op(), "{n}.{suffix} keeps an autograd graph");
        }
    }
}

#[test]
fn every_case_matches_its_reference_package() {
    let mut report = Vec::new();
    let mut sorted: Vec<(String, Case)> = cases().into_iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut bad = Vec::new();
    for (name, case) in &sorted {
        let (p, e) = replay(case);
        report.push(format!("{name}: weights {p:.1e}, estimate {e:.1e}"));
        if !(p < 2e-4 && e < 1e-5) {
            bad.push(name.as_str());
        }
    }
    eprintln!(
        "worst relative errors over 25 steps:\n{}",
        report.join("\n")
    );
    assert!(bad.is_empty(), "off the reference: {bad:?}");
}

#[test]
fn the_fused_form_equals_the_two_pass_step_where_the_second_pass_reads_the_old_d() {
    let all = cases();
    for name in [
        "dadapt_adam_everydream2",
        "dadapt_adam_coupled",
        "dadapt_lion",
        "dadapt_adan",
    ] {
        let case = &all[name];
        let (a, b) = (params(case), params(case));
        let mut two = GroupOptimizer::new(rule(case), a.clone(), 1.0).unwrap();
        let mut fused = GroupOptimizer::new(rule(case), b.clone(), 1.0).unwrap();
        for k in 0..case.steps.len() {
            two.set_learning_rate(case.lrs[k]);
            fused.set_learning_rate(case.lrs[k]);
            two.step(&store(&grads(case, &a, k))).unwrap();
            for (v, g) in grads(case, &b, k) {
                fused.update_one(&v, &g).unwrap();
            }
            fused.end_fused_step().unwrap();
            assert_eq!(
                two.estimate_values(),
                fused.estimate_values(),
                "{name} step {k}"
            );
        }
        for ((n, x), (_, y)) in a.iter().zip(&b) {
            let (x, y) = (
                x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert_eq!(x, y, "{name}: {n}");
        }
    }
}

#[test]
fn rules_that_need_every_gradient_first_refuse_the_fused_form() {
    let all = cases();
    for name in ["dadapt_sgd_plain", "scalar_dowg_everydream2"] {
        let case = &all[name];
        let vars = params(case);
        let mut opt = GroupOptimizer::new(rule(case), vars.clone(), 1.0).unwrap();
        let (v, g) = grads(case, &vars, 0).remove(0);
        let err = opt.update_one(&v, &g).unwrap_err().to_string();
        assert!(err.contains("fused"), "{name}: {err}");
    }
}
