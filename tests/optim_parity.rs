//! The optimizers against their references: bitsandbytes' dynamic maps, lion-pytorch's Lion and
//! transformers' Adafactor on fixture numbers (tests/fixtures/optim_reference.json, made by
//! tests/fixtures/optim_reference.py), and save → load → continue for every optimizer.

mod common;

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use serde::Deserialize;

use sdtrain::optim::quant8::DynamicMap;
use sdtrain::optim::{
    AdaCoor, AdaCoorParams, Adafactor, AdafactorParams, AdamW, AdamW8bit, AdamWParams,
    CoordinateDowg, DAdaptAdam, DAdaptAdamParams, DAdaptAdan, DAdaptAdanParams, DAdaptLion,
    DAdaptLionParams, DAdaptSgd, DAdaptSgdParams, DowgParams, GroupOptimizer, Lion, LionParams,
    Optimizer, Prodigy, ProdigyParams, ScalarDowg, UpdateRule,
};

#[derive(Deserialize)]
struct Fixture {
    maps: Maps,
    lion: Run,
    adafactor: HashMap<String, Run>,
}

#[derive(Deserialize)]
struct Maps {
    signed: Vec<f32>,
    unsigned: Vec<f32>,
}

#[derive(Deserialize)]
struct Run {
    shapes: HashMap<String, Vec<usize>>,
    init: HashMap<String, Vec<f32>>,
    grads: Vec<HashMap<String, Vec<f32>>>,
    params_after_step: Vec<HashMap<String, Vec<f32>>>,
    hyper: serde_json::Value,
}

fn fixture() -> Fixture {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/optim_reference.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn dynamic_maps_equal_bitsandbytes() {
    let f = fixture();
    assert_eq!(DynamicMap::new(true).code.to_vec(), f.maps.signed);
    assert_eq!(DynamicMap::new(false).code.to_vec(), f.maps.unsigned);
}

/// Runs `rule` over the fixture's tensors and gradients; returns the worst relative error of the
/// parameters after each step against the reference.
fn replay(rule: Box<dyn UpdateRule>, run: &Run, lr: f64) -> f64 {
    let names: Vec<&String> = {
        let mut n: Vec<&String> = run.shapes.keys().collect();
        n.sort();
        n
    };
    let vars: Vec<(String, Var)> = names
        .iter()
        .map(|n| {
            let t = Tensor::from_slice(&run.init[*n], run.shapes[*n].as_slice(), &Device::Cpu);
            ((*n).clone(), Var::from_tensor(&t.unwrap()).unwrap())
        })
        .collect();
    let mut opt = GroupOptimizer::new(rule, vars.clone(), lr).unwrap();
    let mut worst = 0f64;
    for (grads, want) in run.grads.iter().zip(&run.params_after_step) {
        let mut store = GradStore::default();
        for (n, v) in &vars {
            let g = Tensor::from_slice(&grads[n], v.shape(), &Device::Cpu).unwrap();
            store.insert(v.as_tensor(), g);
        }
        assert!(!opt.step(&store).unwrap().skipped_nonfinite);
        for (n, v) in &vars {
            let got = v.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for (a, b) in got.iter().zip(&want[n]) {
                let e = f64::from((a - b).abs()) / f64::from(b.abs()).max(1e-3);
                worst = worst.max(e);
            }
        }
    }
    worst
}

#[test]
fn lion_matches_lion_pytorch() {
    let f = fixture();
    let h = &f.lion.hyper;
    let params = LionParams {
        beta1: h["beta1"].as_f64().unwrap(),
        beta2: h["beta2"].as_f64().unwrap(),
        weight_decay: h["weight_decay"].as_f64().unwrap(),
    };
    let lr = h["lr"].as_f64().unwrap();
    let e = replay(Box::new(Lion::rule(params, false).unwrap()), &f.lion, lr);
    eprintln!("lion: worst relative error {e:.2e}");
    assert!(e < 1e-6, "{e}");
}

#[test]
fn adafactor_matches_transformers() {
    let f = fixture();
    for (name, run) in &f.adafactor {
        let h = &run.hyper;
        let params = AdafactorParams {
            beta1: h["beta1"].as_f64(),
            weight_decay: h["weight_decay"].as_f64().unwrap(),
            scale_parameter: h["scale_parameter"].as_bool().unwrap(),
            ..AdafactorParams::default()
        };
        let lr = h["lr"].as_f64().unwrap();
        let e = replay(Box::new(Adafactor::rule(params).unwrap()), run, lr);
        eprintln!("adafactor {name}: worst relative error {e:.2e}");
        assert!(e < 1e-5, "{name}: {e}");
    }
}

/// Every optimizer, over one tensor big enough for 8-bit state (with a ragged last block) and
/// one small one: 3 steps, save, load into a fresh optimizer over copies of the parameters, then
/// 2 more steps in both; parameters and state must agree bit for bit.
type MakeRule = Box<dyn Fn() -> Box<dyn UpdateRule>>;

/// Every optimizer sdtrain has, by name, with `adam`'s and `lion`'s settings (Adafactor with
/// momentum, parameter scaling and weight decay 0.1).
fn every_rule(adam: AdamWParams, lion: LionParams) -> Vec<(&'static str, MakeRule)> {
    vec![
        (
            "adamw",
            Box::new(move || Box::new(AdamW::rule(adam).unwrap())),
        ),
        (
            "adamw8bit",
            Box::new(move || Box::new(AdamW8bit::rule(adam).unwrap())),
        ),
        (
            "lion",
            Box::new(move || Box::new(Lion::rule(lion, false).unwrap())),
        ),
        (
            "lion8bit",
            Box::new(move || Box::new(Lion::rule(lion, true).unwrap())),
        ),
        (
            "adafactor",
            Box::new(|| {
                let p = AdafactorParams {
                    beta1: Some(0.9),
                    scale_parameter: true,
                    weight_decay: 0.1,
                    ..AdafactorParams::default()
                };
                Box::new(Adafactor::rule(p).unwrap())
            }),
        ),
    ]
}

/// [`every_rule`] with AdamW at `lr`, and weight decay 0.1 for AdamW and Lion.
fn every_rule_decayed(lr: f64) -> Vec<(&'static str, MakeRule)> {
    let adam = AdamWParams {
        lr,
        weight_decay: 0.1,
        ..AdamWParams::default()
    };
    let lion = LionParams {
        weight_decay: 0.1,
        ..LionParams::default()
    };
    let mut rules = every_rule(adam, lion);
    rules.extend(learning_rate_free());
    rules
}

/// The step-size estimators and the learning-rate-free rules, with weight decay where they have
/// it (their own parity tests are in tests/adaptive_optim_parity.rs).
fn learning_rate_free() -> Vec<(&'static str, MakeRule)> {
    vec![
        (
            "prodigy",
            Box::new(|| {
                let p = ProdigyParams {
                    weight_decay: 0.1,
                    use_bias_correction: true,
                    ..ProdigyParams::default()
                };
                Box::new(Prodigy::rule(p).unwrap())
            }),
        ),
        (
            "dadapt_adam",
            Box::new(|| {
                let p = DAdaptAdamParams {
                    weight_decay: 0.1,
                    decouple: true,
                    ..DAdaptAdamParams::default()
                };
                Box::new(DAdaptAdam::rule(p).unwrap())
            }),
        ),
        (
            "dadapt_adan",
            Box::new(|| Box::new(DAdaptAdan::rule(DAdaptAdanParams::default()).unwrap())),
        ),
        (
            "dadapt_lion",
            Box::new(|| {
                let p = DAdaptLionParams {
                    weight_decay: 0.1,
                    ..DAdaptLionParams::default()
                };
                Box::new(DAdaptLion::rule(p).unwrap())
            }),
        ),
        (
            "dadapt_sgd",
            Box::new(|| {
                let p = DAdaptSgdParams {
                    momentum: 0.9,
                    weight_decay: 0.1,
                    ..DAdaptSgdParams::default()
                };
                Box::new(DAdaptSgd::rule(p).unwrap())
            }),
        ),
        (
            "coordinate_dowg",
            Box::new(|| Box::new(CoordinateDowg::rule(DowgParams::default()).unwrap())),
        ),
        (
            "scalar_dowg",
            Box::new(|| Box::new(ScalarDowg::rule(DowgParams::default()).unwrap())),
        ),
        (
            "adacoor",
            Box::new(|| Box::new(AdaCoor::rule(AdaCoorParams { eps: 1e-8 }).unwrap())),
        ),
    ]
}

#[test]
fn save_load_continue_is_bit_exact_for_every_optimizer() {
    let rules = every_rule_decayed(1e-2);
    let dir = tempfile::tempdir().unwrap();
    for (name, make) in rules {
        let shapes: [&[usize]; 2] = [&[40, 130], &[7]];
        let init = || -> Vec<(String, Var)> {
            shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let t = common::randn(s, i as u64);
                    (format!("p{i}"), Var::from_tensor(&t).unwrap())
                })
                .collect()
        };
        let vars = init();
        let grad = |k: usize, vars: &[(String, Var)]| {
            let mut g = GradStore::default();
            for (i, (_, v)) in vars.iter().enumerate() {
                let n = v.elem_count();
                let vals: Vec<f32> = (0..n)
                    .map(|j| (((j * 31 + k * 17 + i * 7) % 97) as f32 - 48.0) * 1e-3)
                    .collect();
                g.insert(
                    v.as_tensor(),
                    Tensor::from_vec(vals, v.shape(), &Device::Cpu).unwrap(),
                );
            }
            g
        };
        let mut a = GroupOptimizer::new(make(), vars.clone(), 1e-2).unwrap();
        for k in 0..3 {
            a.step(&grad(k, &vars)).unwrap();
        }
        let path = dir.path().join(format!("{name}.safetensors"));
        a.save_state(&path).unwrap();
        let copies: Vec<(String, Var)> = vars
            .iter()
            .map(|(n, v)| {
                (
                    n.clone(),
                    Var::from_tensor(&v.as_tensor().copy().unwrap()).unwrap(),
                )
            })
            .collect();
        let mut b = GroupOptimizer::new(make(), copies.clone(), 1e-2).unwrap();
        b.load_state(&path).unwrap();
        assert_eq!(b.state_bytes(), a.state_bytes(), "{name}");
        for k in 3..5 {
            a.step(&grad(k, &vars)).unwrap();
            b.step(&grad(k, &copies)).unwrap();
        }
        for ((n, va), (_, vb)) in vars.iter().zip(&copies) {
            let (x, y) = (
                va.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                vb.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert_eq!(x, y, "{name}: {n} differs after resume");
            let (sa, sb) = (a.state(n).unwrap(), b.state(n).unwrap());
            assert_eq!(sa.step(), 5);
            for ((s, ta), (_, tb)) in sa.tensors().iter().zip(sb.tensors()) {
                let bytes = |t: &Tensor| {
                    t.flatten_all()
                        .unwrap()
                        .to_dtype(candle_core::DType::F32)
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                };
                assert_eq!(bytes(ta), bytes(tb), "{name}: {n}.{s} differs after resume");
            }
        }
        // A file from another optimizer is refused, naming both.
        if name != "adamw" {
            let other = dir.path().join("adamw.safetensors");
            let mut c = GroupOptimizer::new(make(), init(), 1e-2).unwrap();
            let err = c.load_state(&other).unwrap_err().to_string();
            assert!(err.contains("adamw") && err.contains(name), "{err}");
        }
    }
}

/// Bytes of state per parameter over SD-like shapes: AdamW8bit ≤ 2.05 (the bound).
#[test]
fn adamw8bit_state_is_at_most_2_05_bytes_per_parameter() {
    let rule = AdamW8bit::rule(AdamWParams::default()).unwrap();
    let shapes: [&[usize]; 4] = [&[320, 320, 3, 3], &[1280, 5120], &[640], &[4096 + 1]];
    let n: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    let bytes: usize = shapes.iter().map(|s| rule.state_bytes(s)).sum();
    let per = bytes as f64 / n as f64;
    eprintln!("adamw8bit: {per:.4} bytes/parameter");
    assert!(per <= 2.05, "{per}");
    // The allocated state agrees with the estimate.
    let v = Var::zeros((1280, 512), candle_core::DType::F32, &Device::Cpu).unwrap();
    let opt = GroupOptimizer::new(Box::new(rule), vec![("w".into(), v)], 1e-3).unwrap();
    assert_eq!(opt.state_bytes(), rule.state_bytes(&[1280, 512]));
}

/// `update_one` (what a fused backward pass calls as each gradient is ready) does exactly what a
/// step with that gradient alone does, and refuses a non-finite gradient without a change.
#[test]
fn update_one_equals_a_step_with_that_gradient_alone() {
    let rule =
        || -> Box<dyn UpdateRule> { Box::new(AdamW8bit::rule(AdamWParams::default()).unwrap()) };
    let make = || {
        let t = Tensor::arange(0f32, 5000.0, &Device::Cpu).unwrap();
        Var::from_tensor(&(t / 5000.0).unwrap()).unwrap()
    };
    let (a, b, other) = (make(), make(), make());
    let mut by_step = GroupOptimizer::new(rule(), vec![("a".into(), a.clone())], 1e-2).unwrap();
    let mut by_one = GroupOptimizer::new(
        rule(),
        vec![("b".into(), b.clone()), ("other".into(), other.clone())],
        1e-2,
    )
    .unwrap();
    let g = Tensor::full(0.5f32, 5000, &Device::Cpu).unwrap();
    let mut store = GradStore::default();
    store.insert(a.as_tensor(), g.clone());
    by_step.step(&store).unwrap();
    by_one.update_one(&b, &g).unwrap();
    let values = |v: &Var| v.to_vec1::<f32>().unwrap();
    assert_eq!(values(&a), values(&b));
    assert_eq!(by_one.param_step("b"), Some(1));
    assert_eq!(by_one.param_step("other"), Some(0));
    let bad = Tensor::full(f32::NAN, 5000, &Device::Cpu).unwrap();
    let before = values(&b);
    assert!(by_one.update_one(&b, &bad).is_err());
    assert_eq!(values(&b), before);
    assert_eq!(by_one.param_step("b"), Some(1));
    let stranger = make();
    assert!(by_one.update_one(&stranger, &g).is_err());
}

/// With stochastic rounding, a bf16 parameter is updated as its f32 upcast would be (same rule,
/// same state, f32 math) and the result rounded with `tensor_seed(run seed, name, update)`, for
/// every optimizer, on its first and second update; state save/load keeps the update count the
/// seed depends on. Catches rounding to nearest, a seed that ignores the step or the name, and
/// math done in bf16.
#[test]
fn bf16_parameters_update_in_f32_and_round_stochastically() {
    use candle_core::DType;
    use sdtrain::optim::stochastic_round::{round_into, tensor_seed};
    let dir = tempfile::tempdir().unwrap();
    for (name, make) in every_rule_decayed(1e-3) {
        let init = common::fill(&[24, 70], 3).to_dtype(DType::BF16).unwrap();
        let p16 = Var::from_tensor(&init).unwrap();
        let p32 = Var::from_tensor(&init.to_dtype(DType::F32).unwrap()).unwrap();
        let lr = 1e-3;
        let mut sr = GroupOptimizer::new(make(), vec![("w".into(), p16.clone())], lr)
            .unwrap()
            .with_stochastic_rounding(77)
            .unwrap();
        let mut plain = GroupOptimizer::new(make(), vec![("w".into(), p32.clone())], lr).unwrap();
        for step in 1..=3u64 {
            let g = common::fill(&[24, 70], 10 + step);
            let (mut a, mut b) = (GradStore::default(), GradStore::default());
            a.insert(p16.as_tensor(), g.to_dtype(DType::BF16).unwrap());
            b.insert(
                p32.as_tensor(),
                g.to_dtype(DType::BF16)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap(),
            );
            p32.set(&p16.to_dtype(DType::F32).unwrap()).unwrap();
            sr.step(&a).unwrap();
            plain.step(&b).unwrap();
            let want = Var::zeros((24, 70), DType::BF16, &Device::Cpu).unwrap();
            round_into(&want, p32.as_tensor(), tensor_seed(77, "w", step)).unwrap();
            let bits = |v: &Var| {
                v.flatten_all()
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            };
            assert_eq!(bits(&p16), bits(&want), "{name}: update {step}");
            assert_eq!(p16.dtype(), DType::BF16);
            if step == 2 {
                // Through a state file: the update count, and so the seed, carry over.
                let file = dir.path().join(format!("{name}-sr.safetensors"));
                sr.save_state(&file).unwrap();
                sr = GroupOptimizer::new(make(), vec![("w".into(), p16.clone())], lr)
                    .unwrap()
                    .with_stochastic_rounding(77)
                    .unwrap();
                sr.load_state(&file).unwrap();
            }
        }
        // An f32 parameter is not rounded: a group with rounding on updates it as one without.
        let g = common::fill(&[24, 70], 11);
        let (x, y) = (
            Var::from_tensor(&init.to_dtype(DType::F32).unwrap()).unwrap(),
            Var::from_tensor(&init.to_dtype(DType::F32).unwrap()).unwrap(),
        );
        let mut with = GroupOptimizer::new(make(), vec![("w".into(), x.clone())], lr)
            .unwrap()
            .with_stochastic_rounding(77)
            .unwrap();
        let mut without = GroupOptimizer::new(make(), vec![("w".into(), y.clone())], lr).unwrap();
        let (mut gx, mut gy) = (GradStore::default(), GradStore::default());
        gx.insert(x.as_tensor(), g.clone());
        gy.insert(y.as_tensor(), g);
        with.step(&gx).unwrap();
        without.step(&gy).unwrap();
        let v = |v: &Var| v.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(v(&x), v(&y), "{name}: f32 parameter");
    }
}
