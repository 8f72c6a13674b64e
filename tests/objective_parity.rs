//! The training objective against diffusers 0.42.1: `DDPMScheduler.from_config(...)`'s
//! `alphas_cumprod`, `add_noise` and `get_velocity`, `training_utils.compute_snr`, and the
//! min-SNR-γ loss of `examples/text_to_image/train_text_to_image.py`, for the fixture pipelines'
//! scheduler configs (PNDM ε, DDIM v, Euler ε) and inline configs (default linear,
//! squaredcos_cap_v2, zero-terminal-SNR rescale, trained_betas).
//!
//! Expected numbers: `tests/fixtures/objective_reference.json`, written by
//! `tests/fixtures/objective_reference.py` (rerun: `python tests/fixtures/objective_reference.py`).
//! diffusers keeps ᾱ in f32 and sdtrain in f64, which bounds the agreement (≤ 1e-6 absolute on ᾱ).

mod common;

use std::path::Path;

use candle_core::{Device, Tensor};
use sdtrain::diffusion::objective::{min_snr_weights, mse_loss};
use sdtrain::diffusion::NoiseSchedule;
use sdtrain::model::family::PredictionType;
use serde_json::Value;

fn reference() -> Value {
    common::reference_json("objective_reference.json")
}

use common::floats;

struct Inputs {
    x0: Tensor,
    noise: Tensor,
    pred: Tensor,
    timesteps: Vec<u32>,
}

fn inputs(r: &Value) -> Inputs {
    let i = &r["inputs"];
    let shape: Vec<usize> = floats(&i["shape"]).iter().map(|&x| x as usize).collect();
    let t = |k: &str| {
        let v: Vec<f32> = floats(&i[k]).iter().map(|&x| x as f32).collect();
        Tensor::from_vec(v, shape.as_slice(), &Device::Cpu).unwrap()
    };
    Inputs {
        x0: t("x0"),
        noise: t("noise"),
        pred: t("pred"),
        timesteps: floats(&i["timesteps"]).iter().map(|&x| x as u32).collect(),
    }
}

/// Each reference schedule with ours, built from the same config.
fn schedules(r: &Value) -> Vec<(String, &Value, NoiseSchedule)> {
    r["schedules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let name = s["name"].as_str().unwrap().to_string();
            let ours = match s.get("file").and_then(Value::as_str) {
                Some(file) => NoiseSchedule::from_file(&common::fixture(file)).unwrap(),
                None => NoiseSchedule::from_config(&s["config"], Path::new(&name)).unwrap(),
            };
            (name, s, ours)
        })
        .collect()
}

fn max_abs_diff(a: &Tensor, want: &[f64]) -> f64 {
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(a.len(), want.len());
    a.iter()
        .zip(want)
        .map(|(x, y)| (*x as f64 - y).abs())
        .fold(0.0, f64::max)
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

#[test]
fn alphas_cumprod_match_diffusers_ddpm() {
    let r = reference();
    for (name, s, ours) in schedules(&r) {
        let want = floats(&s["alphas_cumprod"]);
        assert_eq!(ours.num_train_timesteps(), want.len(), "{name}");
        let err = ours
            .alphas_cumprod()
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        println!("{name}: alphas_cumprod max abs err {err:.2e}");
        assert!(err <= 1e-6, "{name}: alphas_cumprod max abs err {err}");
    }
}

#[test]
fn zero_snr_rescale_and_cosine_reach_diffusers_terminal_values() {
    let r = reference();
    for (name, s, ours) in schedules(&r) {
        let want = floats(&s["alphas_cumprod"]);
        let (a, b) = (ours.alphas_cumprod()[999], want[999]);
        match name.as_str() {
            "zero-snr-v" => {
                assert_eq!((a, b), (0.0, 0.0));
                assert_eq!(ours.prediction_type(), PredictionType::VPrediction);
            }
            "squaredcos_cap_v2" => assert!(rel(a, b) < 1e-4, "{a} vs {b}"),
            _ => {}
        }
    }
}

/// `zero_terminal_snr` rescales a schedule read without `rescale_betas_zero_snr`: the result
/// equals diffusers' `rescale_zero_terminal_snr` schedule (the "zero-snr-v" reference), every ᾱ,
/// and rescaling it again changes nothing.
#[test]
fn zero_terminal_snr_on_a_plain_schedule_matches_diffusers() {
    let r = reference();
    let (_, s, _) = schedules(&r)
        .into_iter()
        .find(|(n, _, _)| n == "zero-snr-v")
        .expect("the zero-snr-v reference");
    let mut plain = s["config"].clone();
    plain["rescale_betas_zero_snr"] = Value::Bool(false);
    let base = NoiseSchedule::from_config(&plain, Path::new("plain")).unwrap();
    assert!(base.alphas_cumprod()[999] > 0.0);
    let ours = base.with_zero_terminal_snr();
    let want = floats(&s["alphas_cumprod"]);
    for (t, (a, b)) in ours.alphas_cumprod().iter().zip(&want).enumerate() {
        // diffusers computes in f32: a few ulps.
        assert!((a - b).abs() <= 1e-6, "t={t}: {a} vs {b}");
    }
    assert_eq!(ours.alphas_cumprod()[999], 0.0);
    let again = ours.with_zero_terminal_snr();
    for (a, b) in again.alphas_cumprod().iter().zip(ours.alphas_cumprod()) {
        assert!((a - b).abs() <= 1e-12, "{a} vs {b}");
    }
}

#[test]
fn add_noise_and_velocity_match_diffusers() {
    let r = reference();
    let i = inputs(&r);
    for (name, s, ours) in schedules(&r) {
        let noisy = ours.add_noise(&i.x0, &i.noise, &i.timesteps).unwrap();
        let v = ours.velocity(&i.x0, &i.noise, &i.timesteps).unwrap();
        let e1 = max_abs_diff(&noisy, &floats(&s["add_noise"]));
        let e2 = max_abs_diff(&v, &floats(&s["velocity"]));
        println!("{name}: add_noise max abs err {e1:.2e}, velocity {e2:.2e}");
        // Inputs are O(1..4). diffusers computes √(1 − ᾱ) from an f32 ᾱ: near t = 0 (1 − ᾱ
        // down to 4e-5 for the cosine schedule) one ulp of ᾱ moves √(1 − ᾱ) by ~1e-6·|ε|.
        assert!(e1 <= 1e-5 && e2 <= 1e-5, "{name}: {e1} {e2}");
        // The scheduler's own target follows its prediction type.
        let target = ours
            .target(ours.prediction_type(), &i.x0, &i.noise, &i.timesteps)
            .unwrap();
        let want = match ours.prediction_type() {
            PredictionType::Epsilon => i.noise.clone(),
            PredictionType::VPrediction => v,
        };
        assert_eq!(max_abs_diff(&target, &to_f64(&want)), 0.0, "{name}");
    }
}

fn to_f64(t: &Tensor) -> Vec<f64> {
    let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    v.into_iter().map(f64::from).collect()
}

#[test]
fn snr_matches_diffusers_compute_snr() {
    let r = reference();
    let i = inputs(&r);
    for (name, s, ours) in schedules(&r) {
        let want = floats(&s["snr"]);
        for (&t, &w) in i.timesteps.iter().zip(&want) {
            let got = ours.snr(t).unwrap();
            if w == 0.0 {
                assert_eq!(got, 0.0, "{name} t={t}");
                continue;
            }
            // diffusers holds ᾱ in f32: its cumprod of t + 1 factors is off by up to about
            // (t + 1)·ε/2 relative, and 1 − ᾱ by about one ulp of 1.0, i.e. 6e-8/(1 − ᾱ)
            // relative (7e-5 at t = 0). sdtrain's f64 value is the exact one; the bound allows
            // diffusers' rounding.
            let eps = f64::from(f32::EPSILON);
            let one_minus = 1.0 - ours.alphas_cumprod()[t as usize];
            let tol = 2e-6 + f64::from(t + 1) * eps / 2.0 + 2.0 * eps / one_minus;
            let err = rel(got, w);
            println!("{name} t={t}: SNR {got:.6} vs {w:.6} (rel {err:.1e}, allowed {tol:.1e})");
            assert!(err <= tol, "{name} t={t}: {got} vs {w}");
        }
    }
}

#[test]
fn min_snr_loss_matches_diffusers_training_script() {
    let r = reference();
    let i = inputs(&r);
    let gamma = r["gamma"].as_f64().unwrap();
    for (name, s, ours) in schedules(&r) {
        let v = ours.velocity(&i.x0, &i.noise, &i.timesteps).unwrap();
        for (prediction, target, key, plain_key) in [
            (
                PredictionType::Epsilon,
                &i.noise,
                "loss_eps_min_snr",
                "loss_eps_plain",
            ),
            (
                PredictionType::VPrediction,
                &v,
                "loss_v_min_snr",
                "loss_v_plain",
            ),
        ] {
            let w = min_snr_weights(&ours, &i.timesteps, prediction, gamma).unwrap();
            let loss = mse_loss(&i.pred, target, Some(&w)).unwrap();
            let loss = loss.to_scalar::<f32>().unwrap() as f64;
            match s[key].as_f64() {
                Some(want) => {
                    let err = rel(loss, want);
                    println!(
                        "{name} {prediction}: min-SNR loss {loss:.7} vs {want:.7} (rel {err:.1e})"
                    );
                    assert!(err <= 1e-5, "{name} {prediction}: {loss} vs {want}");
                }
                None => {
                    // diffusers: 0/0 at SNR = 0; ours uses the limit weight 1 and stays finite.
                    assert!(loss.is_finite(), "{name} {prediction}");
                    println!("{name} {prediction}: diffusers NaN (SNR 0), ours {loss:.7}");
                }
            }
            let plain = mse_loss(&i.pred, target, None).unwrap();
            let plain = plain.to_scalar::<f32>().unwrap() as f64;
            let want = s[plain_key].as_f64().unwrap();
            assert!(
                rel(plain, want) <= 1e-5,
                "{name} {prediction} plain: {plain} vs {want}"
            );
        }
    }
}
