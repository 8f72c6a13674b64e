//! Config errors end to end: each test writes a train.json (and an optimizer.json when it needs
//! one) into its own temp folder and resolves it with `TrainPlan::resolve`, as the CLI does, then
//! checks that the message names the file, the field and what is allowed. Also checks that the
//! optimizer presets the repository ships resolve.

use std::path::{Path, PathBuf};

use sdtrain::config::{ConfigError, OptimizerKind, ScheduleKind, StepCount, TrainPlan};
use serde_json::{json, Value};

/// A temp folder holding `data/` and the config files of one test.
struct Setup {
    dir: tempfile::TempDir,
}

impl Setup {
    fn new() -> Setup {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir(dir.path().join("data")).expect("data dir");
        Setup { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn write(&self, name: &str, value: &Value) -> PathBuf {
        let path = self.path(name);
        std::fs::write(&path, serde_json::to_string_pretty(value).expect("json")).expect("write");
        path
    }

    /// Writes `extra` over a minimal valid train.json and resolves it.
    fn resolve(&self, extra: Value, overrides: &[&str]) -> Result<TrainPlan, ConfigError> {
        let mut train = json!({"model": "org/model", "data_root": "data"});
        if let (Value::Object(t), Value::Object(e)) = (&mut train, extra) {
            t.extend(e);
        }
        let path = self.write("train.json", &train);
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        TrainPlan::resolve(&path, &overrides)
    }

    /// The error message, which must be a usage error (exit code 2).
    fn error(&self, extra: Value, overrides: &[&str]) -> String {
        match self.resolve(extra, overrides) {
            Ok(plan) => panic!("expected an error, got a plan:\n{plan}"),
            Err(err) => {
                assert!(err.is_usage(), "not a usage error: {err}");
                err.to_string()
            }
        }
    }

    fn train_json(&self) -> String {
        self.path("train.json").display().to_string()
    }
}

fn repo_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(name)
}

#[test]
fn unknown_key_suggests_the_closest_key() {
    let s = Setup::new();
    let msg = s.error(json!({"bach_size": 4}), &[]);
    assert_eq!(
        msg,
        format!(
            "unknown key `bach_size` in {}; did you mean `batch_size`?",
            s.train_json()
        )
    );
}

#[test]
fn wrong_type_names_the_field_and_the_expected_type() {
    let s = Setup::new();
    let msg = s.error(json!({"batch_size": "4"}), &[]);
    assert_eq!(
        msg,
        format!(
            "`batch_size` in {} has the wrong type: expected an integer, found the string \"4\"",
            s.train_json()
        )
    );
}

#[test]
fn unknown_optimizer_lists_the_valid_names() {
    let s = Setup::new();
    s.write("optimizer.json", &json!({"base": {"optimizer": "sgd"}}));
    let msg = s.error(json!({}), &[]);
    assert!(msg.starts_with("`base.optimizer` in "), "{msg}");
    assert!(msg.contains("optimizer.json"), "{msg}");
    assert!(
        msg.contains("unknown optimizer; valid names: adamw, adamw8bit, lion, lion8bit"),
        "{msg}"
    );
}

#[test]
fn ed2_stock_optimizer_resolves_and_bad_optimizer_settings_are_named() {
    let s = Setup::new();
    // EveryDream2's stock optimizer.json uses adamw8bit.
    s.write(
        "opt.json",
        &json!({"base": {"optimizer": "adamw8bit"}, "apply_grad_scaler_step_tweaks": false}),
    );
    let plan = s
        .resolve(json!({"optimizer_config": "opt.json"}), &[])
        .expect("plan");
    assert_eq!(plan.optimizer.unet.optimizer, OptimizerKind::AdamW8bit);
    s.write(
        "bad.json",
        &json!({"base": {"optimizer": "adafactor", "adafactor": {"decay_rate": 0.8}}}),
    );
    let msg = s.error(json!({"optimizer_config": "bad.json"}), &[]);
    assert!(msg.starts_with("`base.adafactor.decay_rate` in "), "{msg}");
    s.write(
        "typo.json",
        &json!({"base": {"optimizer": "adafactor", "adafactor": {"beta_1": 0.9}}}),
    );
    let msg = s.error(json!({"optimizer_config": "typo.json"}), &[]);
    assert!(msg.contains("beta_1"), "{msg}");
    let msg = s.error(json!({"clip_grad_norm": 0.0}), &[]);
    assert!(msg.starts_with("`clip_grad_norm` in "), "{msg}");
    let plan = s
        .resolve(json!({"clip_grad_norm": 1.5}), &[])
        .expect("plan");
    assert_eq!(plan.clip_grad_norm, Some(1.5));
}

#[test]
fn grad_scaler_tweaks_are_accepted() {
    let s = Setup::new();
    s.write(
        "optimizer.json",
        &json!({"apply_grad_scaler_step_tweaks": true}),
    );
    let plan = s.resolve(json!({"amp": "fp16"}), &[]).expect("plan");
    assert!(plan.optimizer.grad_scaler_step_tweaks);
}

#[test]
fn missing_data_root_key() {
    let s = Setup::new();
    let msg = s.error(json!({"data_root": null}), &[]);
    assert_eq!(
        msg,
        format!(
            "`data_root` is missing from {}: the folder of training images",
            s.train_json()
        )
    );
}

#[test]
fn data_root_that_does_not_exist() {
    let s = Setup::new();
    let msg = s.error(json!({"data_root": "no-such-folder"}), &[]);
    assert!(
        msg.starts_with("data_root `no-such-folder` does not exist"),
        "{msg}"
    );
    assert!(msg.contains(&s.train_json()), "{msg}");
}

#[test]
fn data_root_that_is_a_file() {
    let s = Setup::new();
    std::fs::write(s.path("images.txt"), "not a folder").expect("write");
    let msg = s.error(json!({"data_root": "images.txt"}), &[]);
    assert!(
        msg.starts_with("data_root `images.txt` is not a folder"),
        "{msg}"
    );
}

#[test]
fn resolution_not_a_multiple_of_64() {
    let s = Setup::new();
    let msg = s.error(json!({"resolution": 500}), &[]);
    assert_eq!(
        msg,
        format!(
            "`resolution` in {} must be a multiple of 64 between 64 and 4096 (got 500)",
            s.train_json()
        )
    );
}

#[test]
fn amp_and_checkpointing_keys_resolve() {
    let s = Setup::new();
    let plan = s
        .resolve(
            json!({"gradient_checkpointing": true, "amp": "bf16", "grad_scaler_growth_interval": 7}),
            &[],
        )
        .expect("plan");
    assert_eq!(
        plan.precision.gradient_checkpointing,
        sdtrain::config::CheckpointChoice::On
    );
    assert_eq!(
        plan.precision.amp,
        sdtrain::config::AmpChoice::Set(sdtrain::precision::Amp::Bf16)
    );
    assert_eq!(plan.precision.scaler.growth_interval, 7);
    let msg = s.error(json!({"amp": "bf16", "disable_amp": true}), &[]);
    assert!(msg.contains("disable_amp"), "{msg}");
    let msg = s.error(json!({"amp": "int8"}), &[]);
    assert!(msg.contains("`amp`") || msg.contains("amp"), "{msg}");
}

/// EveryDream2's validation_default.json as it ships it (5098db8).
const ED2_VALIDATION_DEFAULT_JSON: &str = include_str!("fixtures/ed2_validation_default.json");

/// EveryDream2's train.json (victorchall/EveryDream2trainer at 5098db8, 2025-05), verbatim
/// except `data_root`, which points into the test's temp folder.
const ED2_SAMPLE_TRAIN_JSON: &str = r#"{
  "attn_type": "sdp",
  "batch_size": 8,
  "ckpt_every_n_minutes": null,
  "clip_grad_norm": null,
  "clip_skip": 0,
  "cond_dropout": 0.04,
  "data_root": "data",
  "disable_amp": false,
  "disable_textenc_training": false,
  "embedding_perturbation": 0.0,
  "flip_p": 0.0,
  "gpuid": 0,
  "gradient_checkpointing": true,
  "grad_accum": 1,
  "logdir": "logs",
  "log_step": 25,
  "loss_type": "mse",
  "max_epochs": 40,
  "notebook": false,
  "optimizer_config": "optimizer.json",
  "project_name": "project_abc",
  "resolution": 512,
  "resume_ckpt": "panopstor/EveryDream",
  "run_name": null,
  "sample_prompts": "sample_prompts.txt",
  "sample_steps": 300,
  "save_ckpt_dir": null,
  "save_ckpts_from_n_epochs": 0,
  "save_every_n_epochs": 20,
  "save_optimizer": false,
  "seed": -1,
  "timestep_start": 0,
  "timestep_end": 1000,
  "shuffle_tags": false,
  "validation_config": "validation_default.json",
  "wandb": false,
  "write_schedule": false,
  "zero_frequency_noise_ratio": 0.02,
  "pyramid_noise_discount": 0.03,
  "enable_zero_terminal_snr": false,
  "load_settings_every_epoch": false,
  "min_snr_gamma": 5.0,
  "ema_decay_rate": null,
  "ema_strength_target": null,
  "ema_update_interval": null,
  "ema_device": null,
  "ema_sample_nonema_model": false,
  "ema_sample_ema_model": false,
  "ema_resume_model" : null
}"#;

#[test]
fn everydream2_sample_train_json_lists_what_is_missing() {
    // Its model key, defaults and nulls are accepted, and each key asking for a feature sdtrain
    // lacks is reported, all in one message.
    let s = Setup::new();
    let ed2: Value = serde_json::from_str(ED2_SAMPLE_TRAIN_JSON).expect("sample parses");
    // Every key is read now: its validation file (validation_default.json, as EveryDream2 ships
    // it) is read beside it.
    std::fs::write(
        s.path("validation_default.json"),
        ED2_VALIDATION_DEFAULT_JSON,
    )
    .expect("write");
    let fixed = ed2;
    s.write("optimizer.json", &json!({}));
    // Its sample prompts file is read beside it (EveryDream2 ships one).
    std::fs::write(s.path("sample_prompts.txt"), "a photo of ted bennet\n").expect("write");
    let plan = TrainPlan::resolve(&s.write("train.json", &fixed), &[]).expect("plan");
    assert_eq!(plan.model, "panopstor/EveryDream");
    let samples = plan.samples.as_ref().expect("sampling on");
    assert_eq!((samples.every_n_steps, samples.set.prompts.len()), (300, 1));
    assert!(plan.random_seed);
    assert_eq!(plan.objective.min_snr_gamma, Some(5.0));
    let val = plan.data.validation.as_ref().expect("validation on");
    assert_eq!((val.split, val.seed), (Some(0.15), Some(555)));
    assert_eq!(plan.objective.pyramid_noise.map(|p| p.discount), Some(0.03));
    // Its loss_type "mse", embedding_perturbation 0 and train_sampler "ddpm" are read (the
    // argparser's default loss_type is mse_huber; the shipped file and sdtrain say mse).
    assert_eq!(
        plan.objective.loss.loss_type,
        sdtrain::diffusion::loss::LossType::Mse
    );
    assert_eq!(plan.objective.embedding_perturbation, 0.0);
    assert_eq!(
        plan.objective.train_sampler,
        sdtrain::diffusion::train_sampler::TrainSampler::Ddpm
    );
    assert_eq!(
        plan.precision.gradient_checkpointing,
        sdtrain::config::CheckpointChoice::On
    );
    assert_eq!(
        plan.precision.amp,
        sdtrain::config::AmpChoice::DeviceDefault
    );
}

#[test]
fn set_override_is_applied() {
    let s = Setup::new();
    let plan = s
        .resolve(
            json!({"lr": 1e-6, "project_name": "a"}),
            &["lr=1e-5", "project_name=foo", "seed=7", "resolution=768"],
        )
        .expect("plan");
    assert_eq!(plan.optimizer.unet.lr, 1e-5);
    assert_eq!(plan.optimizer.text_encoder.lr, 1e-5);
    assert_eq!(plan.project_name, "foo");
    assert_eq!(plan.seed, 7);
    assert_eq!(plan.data.resolution, Some(768));
}

#[test]
fn set_unknown_key_is_rejected() {
    let s = Setup::new();
    let msg = s.error(json!({}), &["learning_rate=1e-5"]);
    assert!(msg.starts_with("unknown key `learning_rate` in "), "{msg}");
    assert!(msg.contains("(from --set learning_rate=1e-5)"), "{msg}");
    let msg = s.error(json!({}), &["max_epoch=3"]);
    assert!(msg.contains("did you mean `max_epochs`?"), "{msg}");
}

#[test]
fn set_without_equals_is_rejected() {
    let s = Setup::new();
    let msg = s.error(json!({}), &["lr"]);
    assert_eq!(msg, "--set `lr`: expected KEY=VALUE, e.g. --set lr=1e-5");
}

#[test]
fn invalid_json_reports_line_and_column() {
    let s = Setup::new();
    let path = s.path("train.json");
    std::fs::write(&path, "{\n  \"batch_size\": 4,\n}\n").expect("write");
    let err = TrainPlan::resolve(&path, &[]).expect_err("syntax error");
    assert!(err.is_usage());
    let ConfigError::Syntax { line, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(*line, 3);
}

#[test]
fn missing_train_json_is_a_usage_error() {
    let s = Setup::new();
    let err = TrainPlan::resolve(&s.path("nope.json"), &[]).expect_err("missing file");
    assert!(err.is_usage());
    assert!(err.to_string().starts_with("cannot read "), "{err}");
}

#[test]
fn adapter_section_is_validated_and_only_for_adapter_modes() {
    let s = Setup::new();
    let msg = s.error(json!({"mode": "lora", "adapter": {"rank": 0}}), &[]);
    assert!(msg.contains("adapter.rank"), "{msg}");
    let msg = s.error(json!({"mode": "lora", "adapter": {"rnak": 4}}), &[]);
    assert!(msg.contains("did you mean `adapter.rank`"), "{msg}");
    let msg = s.error(json!({"adapter": {"rank": 4}}), &[]);
    assert!(msg.contains("adapter") && msg.contains("lora"), "{msg}");
    let msg = s.error(json!({"mode": "glora"}), &[]);
    assert!(msg.contains("\"lokr\""), "{msg}");
    // The LyCORIS modes resolve, with LoKr's factor; factor and dropout are refused where the
    // mode does not use them.
    for mode in ["loha", "lokr", "dora"] {
        let plan = s.resolve(json!({"mode": mode}), &[]).expect(mode);
        assert_eq!(plan.adapter.expect(mode).factor, -1);
    }
    let plan = s.resolve(json!({"mode": "lokr", "adapter": {"factor": 8}}), &[]);
    assert_eq!(plan.expect("lokr").adapter.expect("adapter").factor, 8);
    let msg = s.error(json!({"mode": "loha", "adapter": {"factor": 8}}), &[]);
    assert!(msg.contains("adapter.factor"), "{msg}");
    let msg = s.error(json!({"mode": "dora", "adapter": {"dropout": 0.1}}), &[]);
    assert!(msg.contains("adapter.dropout"), "{msg}");
}

#[test]
fn text_encoder_zero_weight_decay_means_zero() {
    let s = Setup::new();
    s.write(
        "optimizer.json",
        &json!({"base": {"weight_decay": 0.05},
                "text_encoder_overrides": {"weight_decay": 0, "epsilon": null}}),
    );
    let plan = s.resolve(json!({}), &[]).expect("plan");
    assert_eq!(plan.optimizer.unet.weight_decay, 0.05);
    assert_eq!(plan.optimizer.text_encoder.weight_decay, 0.0);
    assert_eq!(plan.optimizer.text_encoder.epsilon, 1e-8);
}

#[test]
fn shipped_optimizer_presets_resolve() {
    let s = Setup::new();
    let resolve = |name: &str| {
        let path = repo_file(name);
        s.resolve(json!({"optimizer_config": path.display().to_string()}), &[])
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let default = resolve("optimizer.json");
    assert_eq!(default.optimizer.unet.optimizer, OptimizerKind::AdamW8bit);
    assert_eq!(default.optimizer.unet, default.optimizer.text_encoder);
    assert!(default.text_encoder_freeze.trains_everything());

    let slower = resolve("configs/optimizer-adamw-te-slower.json");
    assert_eq!(slower.optimizer.unet.lr, 1e-6);
    assert_eq!(slower.optimizer.text_encoder.lr, 5e-7);

    let frozen = resolve("configs/optimizer-frozen-te-layers.json");
    assert_eq!(frozen.text_encoder_freeze.trained_layers(12), 2);
    assert_eq!(frozen.optimizer.text_encoder.lr, 3e-7);

    let cosine = resolve("configs/optimizer-adamw-cosine.json");
    assert_eq!(cosine.optimizer.unet.schedule.kind, ScheduleKind::Cosine);
    assert_eq!(cosine.optimizer.unet.schedule.decay_steps, StepCount::Auto);

    let adamw = resolve("configs/optimizer-adamw.json");
    assert_eq!(adamw.optimizer.unet.optimizer, OptimizerKind::AdamW);
    let lion = resolve("configs/optimizer-lion.json");
    assert_eq!(lion.optimizer.unet.optimizer, OptimizerKind::Lion8bit);
    assert_eq!(lion.optimizer.unet.betas, (0.9, 0.99));
    // Lion: a smaller lr and a larger weight decay than the AdamW preset.
    assert!(lion.optimizer.unet.lr * 3.0 <= adamw.optimizer.unet.lr);
    assert!(lion.optimizer.unet.weight_decay >= 3.0 * adamw.optimizer.unet.weight_decay);
    let adafactor = resolve("configs/optimizer-adafactor.json");
    assert_eq!(adafactor.optimizer.unet.optimizer, OptimizerKind::Adafactor);
    assert!(!adafactor.optimizer.unet.adafactor.scale_parameter);
}

#[test]
fn plan_json_round_trips_through_serde() {
    let s = Setup::new();
    let plan = s.resolve(json!({"max_steps": 20}), &[]).expect("plan");
    let text = serde_json::to_string_pretty(&plan).expect("serialize");
    let value: Value = serde_json::from_str(&text).expect("valid json");
    assert_eq!(value["max_steps"], json!(20));
    assert_eq!(value["model"], json!("org/model"));
}

#[test]
fn loss_and_noise_keys_refuse_what_would_be_ignored_or_ambiguous() {
    let s = Setup::new();
    let cases = [
        (
            json!({"loss_type": "huber", "huber_c": 0.2}),
            "pseudo_huber",
        ),
        (
            json!({"loss_type": "mse", "huber_schedule": "snr"}),
            "huber_schedule",
        ),
        (
            json!({"loss_type": "pseudo_huber", "huber_scale": 2.0}),
            "huber_scale",
        ),
        (
            json!({"loss_type": "pseudo_huber", "huber_c": 0.0}),
            "huber_c",
        ),
        (json!({"loss_type": "cross_entropy"}), "loss_type"),
        (
            json!({"timestep_start": 10, "min_timestep": 20}),
            "min_timestep",
        ),
        (json!({"max_timestep": 1001}), "max_timestep"),
        (
            json!({"ip_noise_gamma": 0.1, "input_perturbation": 0.2}),
            "input_perturbation",
        ),
        (
            json!({"ip_noise_gamma_random_strength": true}),
            "ip_noise_gamma_random_strength",
        ),
        (json!({"noising_weight": 0.5}), "noising_weight"),
        (
            json!({"timestep_distribution": "logit_normal", "noising_weight": -1.0}),
            "noising_weight",
        ),
        (
            json!({"timestep_distribution": "cosmap"}),
            "timestep_distribution",
        ),
        (
            json!({"timestep_distribution": "cos_map", "noising_bias": 0.1}),
            "noising_bias",
        ),
        (
            json!({"timestep_distribution": "heavy_tail", "noising_weight": 1.8}),
            "noising_weight",
        ),
        (
            json!({"timestep_distribution": "beta", "noising_bias": 0.0}),
            "noising_bias",
        ),
        (
            json!({"timestep_distribution": "inverted_parabola", "noising_weight": 100.0,
                   "noising_bias": 2.0}),
            "timestep_distribution",
        ),
        (json!({"timestep_shift": 0.0}), "timestep_shift"),
        (
            json!({"loss_type": "mse", "mae_strength": 0.5}),
            "loss_type",
        ),
        (json!({"mse_strength": 0.0}), "mse_strength"),
        (json!({"mae_strength": -1.0}), "mae_strength"),
        (json!({"huber_delta": 0.5}), "huber_delta"),
        (
            json!({"loss_type": "huber", "huber_delta": 0.0}),
            "huber_delta",
        ),
        (
            json!({"mse_strength": 1.0, "huber_delta": 2.0}),
            "huber_delta",
        ),
        (json!({"mae_strength": 0.5, "huber_c": 0.2}), "huber_c"),
        (json!({"p2_loss_gamma": 0.0}), "p2_loss_gamma"),
        (json!({"loss_scaler": "global_batch"}), "loss_scaler"),
        (
            json!({"generalized_offset_noise": true, "zero_frequency_noise_ratio": 0.0}),
            "generalized_offset_noise",
        ),
        (
            json!({"generalized_offset_noise": true, "zero_terminal_snr": true}),
            "generalized_offset_noise",
        ),
        (
            json!({"perturbation_noise_weight": -0.1}),
            "perturbation_noise_weight",
        ),
        (
            json!({"masked_prior_preservation_weight": 0.5}),
            "masked_prior_preservation_weight",
        ),
        (
            json!({"debiased_estimation_style": "onetrainer"}),
            "debiased_estimation_style",
        ),
        (
            json!({"debiased_estimation_loss": true, "debiased_estimation_style": "ot"}),
            "debiased_estimation_style",
        ),
        (
            json!({"masked_loss": true, "masked_prior_preservation_weight": -1.0}),
            "masked_prior_preservation_weight",
        ),
        (
            json!({"embedding_perturbation": -1.0}),
            "embedding_perturbation",
        ),
        (json!({"train_sampler": "euler"}), "train_sampler"),
    ];
    for (extra, field) in cases {
        let err = s.error(extra.clone(), &[]);
        assert!(err.contains(field), "{extra}: {err}");
    }
    let plan = s
        .resolve(
            json!({"min_timestep": 100, "max_timestep": 900, "timestep_end": 900,
                   "loss_type": "smooth_l1", "timestep_distribution": "LOGIT_NORMAL",
                   "noising_weight": 0.5, "noising_bias": -0.2, "train_sampler": "PNDM"}),
            &[],
        )
        .expect("plan");
    let o = &plan.objective;
    assert_eq!((o.timestep_start, o.timestep_end), (100, 900));
    assert_eq!(
        o.timestep_distribution,
        sdtrain::diffusion::TimestepDistribution::LogitNormal {
            bias: -0.2,
            scale: 1.5
        }
    );
    assert!(matches!(
        o.loss.loss_type,
        sdtrain::diffusion::loss::LossType::SmoothL1(h) if h.c == 0.1 && h.scale == 1.0
    ));
}
