//! The loss and noise options from `sdtrain --config train.json` on the tiny fixtures: each group
//! changes the first step's loss (so an ignored key fails here), and `train_sampler` `ddim`
//! trains exactly as `ddpm`, while `pndm` on a v-prediction model is refused as EveryDream2
//! fails there.

mod common;

use common::cli::{demo_data, run_folder, sdtrain, step_losses, text, write_config};

/// The run's step losses (1 step), trained from `extra` in its own temp dir.
fn first_loss(fixture: &str, extra: serde_json::Value) -> f64 {
    let tmp = tempfile::tempdir().unwrap();
    let mut extra = extra;
    extra["max_steps"] = 1.into();
    let cfg = write_config(tmp.path(), fixture, &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(out.status.success(), "{}", text(&out));
    let losses = step_losses(&run_folder(tmp.path()));
    assert_eq!(losses.len(), 1);
    losses[0]
}

#[test]
fn each_loss_and_noise_group_changes_the_loss() {
    let base = serde_json::json!({"zero_frequency_noise_ratio": 0.0, "cond_dropout": 0.0});
    let with = |extra: serde_json::Value| {
        let mut cfg = base.clone();
        cfg.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        first_loss("tiny-sd15", cfg)
    };
    let plain = with(serde_json::json!({}));
    let groups = [
        serde_json::json!({"loss_type": "huber_mse"}),
        serde_json::json!({"loss_type": "pseudo_huber", "huber_schedule": "constant", "huber_c": 0.3}),
        serde_json::json!({"debiased_estimation_loss": true}),
        serde_json::json!({"ip_noise_gamma": 0.5}),
        serde_json::json!({"embedding_perturbation": 2.0}),
        serde_json::json!({"min_timestep": 900}),
        serde_json::json!({"timestep_distribution": "logit_normal", "noising_bias": 2.0}),
        serde_json::json!({"timestep_distribution": "cos_map"}),
        serde_json::json!({"timestep_shift": 3.0}),
        serde_json::json!({"mae_strength": 0.5}),
        serde_json::json!({"loss_type": "log_cosh"}),
        serde_json::json!({"p2_loss_gamma": 1.0}),
        serde_json::json!({"perturbation_noise_weight": 0.3}),
    ];
    for g in groups {
        let l = with(g.clone());
        // The tiny UNet barely reads its input: input perturbation moves the loss by ~4e-5.
        assert!(
            l.is_finite() && (l / plain - 1.0).abs() > 1e-5,
            "{g}: {l} vs {plain}"
        );
    }
    // The same keys under their other names train the same.
    assert_eq!(
        with(serde_json::json!({"input_perturbation": 0.5})),
        with(serde_json::json!({"ip_noise_gamma": 0.5}))
    );
    assert_eq!(with(serde_json::json!({"loss_type": "l2"})), plain);
    // Generalized offset noise scales the offset by ψ_t: not the plain offset.
    let offset = serde_json::json!({"zero_frequency_noise_ratio": 0.5});
    let mut generalized = offset.clone();
    generalized["generalized_offset_noise"] = true.into();
    assert_ne!(with(offset), with(generalized));
    // One plain loss at strength 1 is that loss; OneTrainer's loss_scaler multiplies the loss
    // by the batch size (2 here) or the accumulation.
    assert_eq!(
        with(serde_json::json!({"mse_strength": 0.0, "mae_strength": 1.0})),
        with(serde_json::json!({"loss_type": "l1"}))
    );
    let batch = |scaler: &str| {
        with(serde_json::json!({"batch_size": 2, "grad_accum": 3, "loss_scaler": scaler}))
    };
    let none = batch("none");
    for (scaler, factor) in [
        ("batch", 2.0),
        ("gradient_accumulation", 3.0),
        ("both", 6.0),
    ] {
        let l = batch(scaler);
        // The logged loss is the f32 losses' mean: equal up to their rounding.
        assert!(
            (l / (factor * none) - 1.0).abs() < 1e-6,
            "{scaler}: {l} vs {none}"
        );
    }
}

#[test]
fn train_sampler_ddim_is_ddpm_and_pndm_refuses_v_prediction() {
    let ddpm = first_loss("tiny-sd21", serde_json::json!({"train_sampler": "ddpm"}));
    let ddim = first_loss("tiny-sd21", serde_json::json!({"train_sampler": "DDIM"}));
    assert_eq!(ddpm, ddim);
    let tmp = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({"train_sampler": "pndm"});
    let cfg = write_config(tmp.path(), "tiny-sd21", &demo_data(), extra);
    let out = sdtrain(&["--config", cfg.to_str().unwrap(), "--cpu"], tmp.path());
    assert!(!out.status.success());
    assert!(text(&out).contains("get_velocity"), "{}", text(&out));
}
