//! OneTrainer's loss options against OneTrainer's own code (tests/fixtures/
//! onetrainer_loss_reference.py, its docstring has the rerun command and the commit; expected
//! numbers in tests/fixtures/reference/onetrainer_losses.json):
//! - its weighted sum of MSE, MAE, Huber (with `huber_delta`) and log-cosh, its P2 and min-SNR
//!   weights (ε and v prediction) and its `loss_scaler`, as the loss of a fixed batch.

mod common;

use candle_core::{Device, Tensor};
use sdtrain::config::LossScaler;
use sdtrain::diffusion::loss::{LossConfig, LossInputs, LossMix, LossType};
use sdtrain::diffusion::noise_schedule::NoiseSchedule;
use serde_json::Value;

fn reference() -> Value {
    common::reference_json("reference/onetrainer_losses.json")
}

fn schedule(prediction_type: &str) -> NoiseSchedule {
    let path = common::fixture("tiny-sd15/scheduler/scheduler_config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["prediction_type"] = prediction_type.into();
    NoiseSchedule::from_config(&config, &path).unwrap()
}

fn tensor(v: &Value, shape: &[usize]) -> Tensor {
    let data: Vec<f32> = common::floats(v).iter().map(|&x| x as f32).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// The case's loss as train.json would give it: the mix, P2 or min-SNR, and the scaler for
/// OneTrainer's batch 3 × accumulation 2.
fn config(c: &Value) -> LossConfig {
    let f = |k: &str| c[k].as_f64().unwrap();
    let strength = f("loss_weight_strength");
    let scaler = match c["loss_scaler"].as_str().unwrap() {
        "NONE" => LossScaler::None,
        "BATCH" => LossScaler::Batch,
        "GRADIENT_ACCUMULATION" => LossScaler::GradientAccumulation,
        "BOTH" => LossScaler::Both,
        other => panic!("{other}"),
    };
    let weight_fn = c["loss_weight_fn"].as_str().unwrap();
    LossConfig {
        loss_type: LossType::Mix(LossMix {
            mse: f("mse_strength"),
            mae: f("mae_strength"),
            huber: f("huber_strength"),
            huber_delta: f("huber_delta"),
            log_cosh: f("log_cosh_strength"),
        }),
        min_snr_gamma: (weight_fn == "MIN_SNR_GAMMA").then_some(strength),
        p2_gamma: (weight_fn == "P2").then_some(strength),
        scale: scaler.factor(3, 2),
        ..LossConfig::mse()
    }
}

#[test]
fn losses_weights_and_scaler_match_onetrainer() {
    let r = reference();
    let x = &r["inputs"];
    let shape: Vec<usize> = common::floats(&x["shape"])
        .iter()
        .map(|&d| d as usize)
        .collect();
    let (pred, target) = (tensor(&x["pred"], &shape), tensor(&x["target"], &shape));
    let timesteps: Vec<u32> = common::floats(&x["timesteps"])
        .iter()
        .map(|&t| t as u32)
        .collect();
    let cases = r["losses"].as_array().unwrap();
    assert_eq!(cases.len(), 25);
    let mut worst: f64 = 0.0;
    for c in cases {
        let s = schedule(c["prediction_type"].as_str().unwrap());
        let inputs = LossInputs {
            pred: &pred,
            target: &target,
            timesteps: &timesteps,
            mask: None,
            sample_weights: None,
        };
        let ours = config(c)
            .loss(&s, s.prediction_type(), &inputs)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap() as f64;
        let want = c["loss"].as_f64().unwrap();
        let rel = (ours - want).abs() / want.abs();
        worst = worst.max(rel);
        assert!(rel < 2e-6, "{c}: ours {ours}, OneTrainer {want}");
    }
    println!("OneTrainer losses: worst rel err {worst:.1e}");
}
