//! kohya's v-prediction loss scalings and adaptive noise offset against kohya's own functions
//! (tests/fixtures/kohya_noise_weights_reference.py → reference/kohya_noise_weights.json).

mod common;

use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, SeedableRng};
use sdtrain::diffusion::loss::{v_pred_weights, LossConfig, VPredScaling};
use sdtrain::diffusion::noise_schedule::NoiseSchedule;
use sdtrain::diffusion::objective::{
    offset_scales, Objective, ObjectiveConfig, ObjectiveError, OffsetVariant,
};
use sdtrain::model::family::PredictionType;
use serde_json::Value;

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn schedule() -> NoiseSchedule {
    NoiseSchedule::from_file(&common::fixture(
        "tiny-sd15/scheduler/scheduler_config.json",
    ))
    .unwrap()
}

/// Each sample's weight is kohya's `get_snr_scale` product: `s` for
/// `scale_v_pred_loss_like_noise_pred`, `1 + v/s` for `v_pred_like_loss`, with the SNR capped at
/// 1000 at t = 0. Catches a missing cap, `s` inverted, or `v` added instead of scaled.
#[test]
fn v_prediction_scalings_are_kohyas() {
    let r = common::reference_json("reference/kohya_noise_weights.json");
    let s = schedule();
    let ts: Vec<u32> = r["timesteps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let close = |got: &[f64], want: &[f64], what: &str| {
        for (g, w) in got.iter().zip(want) {
            assert!(
                (g - w).abs() <= 2e-5 * w.abs().max(1.0),
                "{what}: {got:?} vs {want:?}"
            );
        }
    };
    let like_noise = VPredScaling {
        like_noise: true,
        like_v: 0.0,
    };
    let got = v_pred_weights(&s, &ts, like_noise).unwrap().unwrap();
    close(
        &got,
        &floats(&r["scale_v_pred_loss_like_noise_pred"]),
        "like noise",
    );
    for (v, want) in r["v_pred_like_loss"].as_object().unwrap() {
        let like_v = VPredScaling {
            like_noise: false,
            like_v: v.parse().unwrap(),
        };
        let got = v_pred_weights(&s, &ts, like_v).unwrap().unwrap();
        close(&got, &floats(want), &format!("v_pred_like_loss {v}"));
    }
    assert!(v_pred_weights(&s, &ts, VPredScaling::default())
        .unwrap()
        .is_none());
}

/// The adaptive offset scale of each sample and channel is kohya's `apply_noise_offset`'s
/// `max(offset + a·|mean|, 0)`. Catches the mean taken over the wrong axes, its sign kept, or
/// no clamp for a negative scale.
#[test]
fn the_adaptive_noise_offset_is_kohyas() {
    let r = common::reference_json("reference/kohya_noise_weights.json");
    let shape: Vec<usize> = common::dims(&r["latent_shape"]);
    let latents: Vec<f32> = floats(&r["latents"]).iter().map(|&x| x as f32).collect();
    let x0 = Tensor::from_vec(latents, shape.as_slice(), &Device::Cpu).unwrap();
    let means: Vec<f32> = x0
        .mean((2, 3))
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    for (key, want) in r["noise_offsets"].as_object().unwrap() {
        let (offset, adaptive) = key.split_once(',').unwrap();
        let adaptive = adaptive.parse::<f64>().ok();
        let got = offset_scales(offset.parse().unwrap(), adaptive, &means);
        for (g, w) in got.iter().zip(floats(want)) {
            assert!((*g as f64 - w).abs() < 1e-6, "{key}: {got:?} vs {want}");
        }
    }
}

/// In a step, the offset grows with the channel's |mean| (a planted constant latent per channel
/// shows it), and random strength shrinks it; neither changes the draws of the other samples.
#[test]
fn a_step_draws_the_varied_offset() {
    let s = schedule();
    // Channel means 0 and 40: with a = 0.05 the second channel's offset is 0.1 + 2.
    let mut values = vec![0.0f32; 2 * 4 * 4];
    values[16..].iter_mut().for_each(|v| *v = 40.0);
    let x0 = Tensor::from_vec(values, (1, 2, 4, 4), &Device::Cpu).unwrap();
    let noise = |variant: OffsetVariant| {
        let cfg = ObjectiveConfig {
            zero_frequency_noise_ratio: 0.1,
            offset_variant: variant,
            ..ObjectiveConfig::plain(1000)
        };
        let obj = Objective::new(s.clone(), cfg).unwrap();
        let mut rngs = [StdRng::seed_from_u64(9)];
        let b = obj.noise_per_sample(&mut rngs, &x0).unwrap();
        // Recover the noise from the target (ε prediction: the target is the noise).
        b.target
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let plain = noise(OffsetVariant::default());
    let adaptive = noise(OffsetVariant {
        random_strength: false,
        adaptive_scale: Some(0.05),
    });
    // Channel 0's offset scale is unchanged (mean 0); channel 1's is 21 times larger, so the
    // difference there is a constant 20 times channel 1's plain offset.
    assert_eq!(plain[..16], adaptive[..16]);
    let shift: Vec<f32> = plain[16..]
        .iter()
        .zip(&adaptive[16..])
        .map(|(p, a)| a - p)
        .collect();
    assert!(
        shift.iter().all(|d| (d - shift[0]).abs() < 1e-4),
        "{shift:?}"
    );
    assert!(shift[0].abs() > 1e-3);
    let random = noise(OffsetVariant {
        random_strength: true,
        adaptive_scale: None,
    });
    assert_ne!(plain, random);
}

/// Each scaling is refused on the other prediction type, as kohya refuses it.
#[test]
fn each_scaling_needs_its_prediction_type() {
    let eps = schedule();
    let path = common::fixture("tiny-sd15/scheduler/scheduler_config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["prediction_type"] = "v_prediction".into();
    let v = NoiseSchedule::from_config(&config, &path).unwrap();
    assert_eq!(v.prediction_type(), PredictionType::VPrediction);
    let cfg = |like_noise, like_v| ObjectiveConfig {
        loss: LossConfig {
            v_pred: VPredScaling { like_noise, like_v },
            ..LossConfig::mse()
        },
        ..ObjectiveConfig::plain(1000)
    };
    let refused = |s: &NoiseSchedule, c| match Objective::new(s.clone(), c) {
        Err(e @ ObjectiveError::PredictionType { .. }) => e.to_string(),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("accepted"),
    };
    assert!(refused(&eps, cfg(true, 0.0)).contains("scale_v_pred_loss_like_noise_pred"));
    assert!(refused(&v, cfg(false, 0.1)).contains("v_pred_like_loss"));
    assert!(Objective::new(v, cfg(true, 0.0)).is_ok());
    assert!(Objective::new(eps, cfg(false, 0.1)).is_ok());
}
