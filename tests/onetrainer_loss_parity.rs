//! OneTrainer's loss options against OneTrainer's own code (tests/fixtures/
//! onetrainer_loss_reference.py, its docstring has the rerun command and the commit; expected
//! numbers in tests/fixtures/reference/onetrainer_losses.json):
//! - its weighted sum of MSE, MAE, Huber (with `huber_delta`) and log-cosh, its P2, min-SNR and
//!   debiased-estimation weights (ε and v prediction) and its `loss_scaler`, as the loss of a
//!   fixed batch;
//! - its generalized offset noise's ψ schedule, and how its noise is composed from its draws
//!   (`main + ψ_t·w·offset + w_p·perturbation`), which sdtrain's objective then follows: the
//!   offset scaled by ψ of the sample's own timestep, the perturbation in the target too;
//! - its masked prior preservation (`masked_losses_with_prior`), MSE and MAE, with and without
//!   normalising.

mod common;

use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, SeedableRng};
use sdtrain::config::LossScaler;
use sdtrain::diffusion::generalized_offset::psi_schedule;
use sdtrain::diffusion::loss::{LossConfig, LossInputs, LossMix, LossType, MaskWeighting};
use sdtrain::diffusion::noise_schedule::NoiseSchedule;
use sdtrain::diffusion::objective::{
    sample_noise, sample_noise_offset, NoiseOffset, Objective, ObjectiveConfig, OffsetVariant,
};
use sdtrain::diffusion::timesteps::TimestepRange;
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

/// The reference's fixed batch: its shape, predictions, targets and timesteps.
fn inputs(r: &Value) -> (Vec<usize>, Tensor, Tensor, Vec<u32>) {
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
    (shape, pred, target, timesteps)
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
        debiased_estimation: weight_fn == "DEBIASED_ESTIMATION",
        debiased_v_sqrt: true,
        scale: scaler.factor(3, 2),
        ..LossConfig::mse()
    }
}

#[test]
fn losses_weights_and_scaler_match_onetrainer() {
    let r = reference();
    let (_, pred, target, timesteps) = inputs(&r);
    let cases = r["losses"].as_array().unwrap();
    assert_eq!(cases.len(), 35);
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

#[test]
fn psi_schedule_matches_onetrainer() {
    let r = reference();
    let want = common::floats(&r["psi"]);
    let ours = psi_schedule(schedule("epsilon").alphas_cumprod());
    assert_eq!(ours.len(), want.len());
    let worst = ours
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs() / b.abs())
        .fold(0.0f64, f64::max);
    // OneTrainer starts from the f32 betas diffusers keeps; sdtrain from its f64 ᾱ.
    assert!(worst < 1e-5, "worst rel err {worst:.1e}");
}

/// OneTrainer's noise is `main + ψ_t·w·offset + w_p·perturbation` for its recorded draws (the
/// formula sdtrain's objective follows; checked on sdtrain's own draws below).
#[test]
fn onetrainers_noise_is_composed_as_sdtrain_composes_it() {
    let r = reference();
    let psi = common::floats(&r["psi"]);
    let t: Vec<usize> = common::floats(&r["inputs"]["timesteps"])
        .iter()
        .map(|&t| t as usize)
        .collect();
    let shape = common::floats(&r["inputs"]["shape"]);
    let (c, plane) = (shape[1] as usize, (shape[2] * shape[3]) as usize);
    for case in r["noise"].as_array().unwrap() {
        let w = case["offset_noise_weight"].as_f64().unwrap();
        let wp = case["perturbation_noise_weight"].as_f64().unwrap();
        let generalized = case["generalized_offset_noise"].as_bool().unwrap();
        let (main, offset, pert) = (
            common::floats(&case["main"]),
            common::floats(&case["offset"]),
            common::floats(&case["perturbation"]),
        );
        for (k, got) in common::floats(&case["noise"]).iter().enumerate() {
            let (sample, channel) = (k / (c * plane), (k / plane) % c);
            let scale = if generalized { psi[t[sample]] } else { 1.0 };
            let mut want = main[k];
            if w > 0.0 {
                want += scale * w * offset[sample * c + channel];
            }
            if wp > 0.0 {
                want += wp * pert[k];
            }
            assert!((got - want).abs() < 1e-6, "{case}: {k}: {got} vs {want}");
        }
    }
}

/// sdtrain's objective: each sample's offset scaled by ψ of its own timestep (drawn before its
/// noise), and the perturbation noise in the noisy input and the ε target alike. Catches ψ
/// left out or read at another timestep, and a perturbation that misses the target.
#[test]
fn the_objective_scales_the_offset_by_psi_and_perturbs_the_target() {
    let s = schedule("epsilon");
    let psi = psi_schedule(s.alphas_cumprod());
    let (ratio, wp) = (0.3, 0.2);
    let cfg = ObjectiveConfig {
        zero_frequency_noise_ratio: ratio,
        generalized_offset_noise: true,
        perturbation_noise_weight: wp,
        ..ObjectiveConfig::plain(1000)
    };
    let obj = Objective::new(s.clone(), cfg.clone()).unwrap();
    let dims = (1, 4, 3, 3);
    let x0 = Tensor::zeros((4, 4, 3, 3), DType::F32, &Device::Cpu).unwrap();
    let seeds = [3u64, 4, 5, 6];
    let mut rngs: Vec<StdRng> = seeds.iter().map(|&s| StdRng::seed_from_u64(s)).collect();
    let batch = obj.noise_per_sample(&mut rngs, &x0).unwrap();
    let range = TimestepRange::unshifted(0, 1000, 1000);
    for (i, &seed) in seeds.iter().enumerate() {
        // The same sample's draws: its timestep, its noise with the plain offset (ψ = 1) and
        // without, then its perturbation.
        let draw = |psi_t: f32, ratio: f64| {
            let mut rng = StdRng::seed_from_u64(seed);
            let t = cfg.timestep_distribution.draw(&mut rng, &range);
            let offset = NoiseOffset {
                ratio,
                variant: OffsetVariant::default(),
                channel_means: &[],
                psi: psi_t,
            };
            let n = sample_noise_offset(&mut rng, dims, &offset, None, DType::F32, &Device::Cpu)
                .unwrap();
            let xi = sample_noise(&mut rng, dims, 0.0, DType::F32, &Device::Cpu).unwrap();
            (t, n, xi)
        };
        let (t, plain, xi) = draw(1.0, ratio);
        assert_eq!(t, batch.timesteps[i]);
        let (_, main, _) = draw(1.0, 0.0);
        let p = psi[t as usize];
        let want = (&main + ((plain - &main).unwrap() * p).unwrap() + (xi * wp).unwrap()).unwrap();
        let got = batch.target.get(i).unwrap().unsqueeze(0).unwrap();
        let err = (got - want)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(err < 1e-6, "sample {i} (t {t}, ψ {p}): {err}");
    }
}

#[test]
fn masked_prior_preservation_matches_onetrainer() {
    let r = reference();
    let (shape, pred, target, timesteps) = inputs(&r);
    let m = &r["masked_prior"];
    let prior = tensor(&m["prior"], &shape);
    let mask_shape: Vec<usize> = common::floats(&m["mask_shape"])
        .iter()
        .map(|&d| d as usize)
        .collect();
    let mask = tensor(&m["mask"], &mask_shape);
    let s = schedule("epsilon");
    for c in m["cases"].as_array().unwrap() {
        let cfg = LossConfig {
            loss_type: match c["loss"].as_str().unwrap() {
                "mse" => LossType::Mse,
                _ => LossType::L1,
            },
            mask: MaskWeighting {
                unmasked_weight: c["unmasked_weight"].as_f64().unwrap(),
                normalize: c["normalize"].as_bool().unwrap(),
                prior_preservation: c["masked_prior_preservation_weight"].as_f64().unwrap(),
            },
            ..LossConfig::mse()
        };
        let inputs = LossInputs {
            pred: &pred,
            target: &target,
            timesteps: &timesteps,
            mask: Some(&mask),
            sample_weights: None,
        };
        let ours = cfg
            .loss_with_prior(&s, s.prediction_type(), &inputs, Some(&prior))
            .unwrap()
            .to_scalar::<f32>()
            .unwrap() as f64;
        let want = c["value"].as_f64().unwrap();
        assert!(
            (ours - want).abs() <= 2e-6 * want.abs(),
            "{c}: ours {ours}, OneTrainer {want}"
        );
    }
}
