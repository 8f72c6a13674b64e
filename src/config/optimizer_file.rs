//! [`OptimizerFile`]: the serde mirror of optimizer.json in EveryDream2's layout, and its strict
//! parse. Resolution (inheritance, defaults, validation) is in [`super::optimizer_plan`].
//!
//! ```json
//! { "doc": …, "base": {optimizer, lr, lr_scheduler, lr_warmup_steps, lr_decay_steps, betas,
//!   epsilon, weight_decay, adafactor, d0, decouple, growth_rate, momentum, no_prox,
//!   safeguard_warmup, use_bias_correction, schedulefree, came}, "text_encoder_overrides": {same keys}, "text_encoder_freezing":
//!   {unfreeze_last_n_layers}, "apply_grad_scaler_step_tweaks": false }
//! ```
//!
//! `doc` is free-form and ignored. In `text_encoder_overrides`, `null` (or absent) inherits from
//! `base`, and any value, 0 included, is used as written. EveryDream2 used Python's `or`, so a
//! text-encoder `weight_decay: 0` silently became the base value; here it means 0.

use std::collections::HashMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::error::ConfigError;
use super::strict::{known_keys, Section};

/// The repository's `optimizer.json`, used when train.json names none and no `optimizer.json`
/// sits beside train.json or in the working directory (EveryDream2 also falls back to built-in
/// defaults there).
pub const DEFAULT_OPTIMIZER_JSON: &str = include_str!("../../optimizer.json");

/// optimizer.json as written.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerFile {
    /// Free-form documentation; ignored.
    #[serde(default)]
    pub doc: Value,
    /// Settings for the UNet, and the defaults the text encoder inherits.
    #[serde(default)]
    pub base: Option<GroupFile>,
    /// Text-encoder settings; each `null` inherits from `base`.
    #[serde(default)]
    pub text_encoder_overrides: Option<GroupFile>,
    #[serde(default)]
    pub text_encoder_freezing: Option<FreezingFile>,
    /// EveryDream2 retunes its fp16 grad scaler at steps 500/1000/2000/4000.
    #[serde(default)]
    pub apply_grad_scaler_step_tweaks: Option<bool>,
    /// Log the groups' gradient norms (EveryDream2's default true).
    #[serde(default)]
    pub log_grad_norm: Option<bool>,
    /// The text encoder's learning rate as a multiple of the UNet's, when
    /// `text_encoder_overrides.lr` is not set (EveryDream2's doc/OPTIMIZER.md).
    #[serde(default)]
    pub text_encoder_lr_scale: Option<f64>,
}

/// One optimizer section (`base` or `text_encoder_overrides`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupFile {
    #[serde(default)]
    pub optimizer: Option<String>,
    #[serde(default)]
    pub lr: Option<f64>,
    #[serde(default)]
    pub lr_scheduler: Option<String>,
    #[serde(default)]
    pub lr_warmup_steps: Option<i64>,
    #[serde(default)]
    pub lr_decay_steps: Option<i64>,
    /// `cosine_with_restarts`' cycles (kohya's `lr_scheduler_num_cycles`; default 1), and
    /// `cosine_with_min_lr`'s and `warmup_stable_decay`'s half cosines.
    #[serde(default)]
    pub lr_scheduler_num_cycles: Option<f64>,
    /// polynomial's power (kohya's `lr_scheduler_power`, diffusers' `power`; default 1).
    #[serde(default)]
    pub lr_scheduler_power: Option<f64>,
    /// polynomial's end lr (diffusers' `lr_end`; default 1e-7).
    #[serde(default)]
    pub lr_scheduler_lr_end: Option<f64>,
    /// The floor of the decaying schedules as a fraction of `lr` (kohya's
    /// `lr_scheduler_min_lr_ratio`, OneTrainer's `learning_rate_min_factor`).
    #[serde(default)]
    pub lr_scheduler_min_lr_ratio: Option<f64>,
    /// inverse_sqrt's timescale (kohya's `lr_scheduler_timescale`).
    #[serde(default)]
    pub lr_scheduler_timescale: Option<i64>,
    /// warmup_stable_decay's final decay: steps, or a fraction (below 1) of the run (kohya's
    /// `lr_decay_steps`).
    #[serde(default)]
    pub lr_wsd_decay_steps: Option<f64>,
    /// warmup_stable_decay's warmup: `linear`, `cosine` or `1-sqrt` (transformers'
    /// `warmup_type`).
    #[serde(default)]
    pub lr_wsd_warmup_type: Option<String>,
    /// warmup_stable_decay's decay (transformers' `decay_type`; default `cosine`).
    #[serde(default)]
    pub lr_wsd_decay_type: Option<String>,
    /// Checked to have two entries during resolution, with a better message than serde's.
    #[serde(default)]
    pub betas: Option<Vec<f64>>,
    #[serde(default)]
    pub epsilon: Option<f64>,
    #[serde(default)]
    pub weight_decay: Option<f64>,
    /// Adafactor's own settings; ignored by the other optimizers.
    #[serde(default)]
    pub adafactor: Option<AdafactorFile>,
    /// The step-size estimators' settings (EveryDream2 reads them from the same section): the
    /// starting `d` of Prodigy and D-Adaptation.
    #[serde(default)]
    pub d0: Option<f64>,
    /// Decoupled weight decay (prodigy, dadapt_adam).
    #[serde(default)]
    pub decouple: Option<bool>,
    /// The most `d` may grow per step (prodigy, dadapt_adam, dadapt_adan, dadapt_sgd).
    #[serde(default)]
    pub growth_rate: Option<f64>,
    /// dadapt_sgd's momentum.
    #[serde(default)]
    pub momentum: Option<f64>,
    /// dadapt_adan's decay form.
    #[serde(default)]
    pub no_prox: Option<bool>,
    /// prodigy's `safeguard_warmup`.
    #[serde(default)]
    pub safeguard_warmup: Option<bool>,
    /// Adam's bias correction inside `d·lr` (prodigy, dadapt_adam).
    #[serde(default)]
    pub use_bias_correction: Option<bool>,
    /// adamw_schedulefree's own settings; ignored by the other optimizers.
    #[serde(default)]
    pub schedulefree: Option<ScheduleFreeFile>,
    /// came's and came8bit's own settings; ignored by the other optimizers.
    #[serde(default)]
    pub came: Option<CameFile>,
}

/// A group's `schedulefree` object (the schedulefree package's `AdamWScheduleFree` arguments
/// beyond lr, betas, eps and weight_decay, which are the group's).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleFreeFile {
    #[serde(default)]
    pub warmup_steps: Option<i64>,
    #[serde(default)]
    pub r: Option<f64>,
    #[serde(default)]
    pub weight_lr_power: Option<f64>,
}

/// A group's `came` object (came-pytorch's `CAME` arguments beyond lr, betas and weight_decay,
/// which are the group's).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CameFile {
    #[serde(default)]
    pub eps: Option<Vec<f64>>,
    #[serde(default)]
    pub clip_threshold: Option<f64>,
}

/// A group's `adafactor` object (transformers' `Adafactor` arguments; the lr is the group's).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdafactorFile {
    #[serde(default)]
    pub eps: Option<Vec<f64>>,
    #[serde(default)]
    pub clip_threshold: Option<f64>,
    #[serde(default)]
    pub decay_rate: Option<f64>,
    #[serde(default)]
    pub beta1: Option<f64>,
    #[serde(default)]
    pub scale_parameter: Option<bool>,
}

/// `text_encoder_freezing`, as EveryDream2's `_apply_text_encoder_freeze` reads it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FreezingFile {
    /// Train only the last N encoder layers (and the final layer norm); null trains all.
    #[serde(default)]
    pub unfreeze_last_n_layers: Option<i64>,
    /// EveryDream2's older form: N > 0 freezes the first N layers, N < 0 trains the last −N.
    /// `unfreeze_last_n_layers` wins when both are set.
    #[serde(default)]
    pub freeze_front_n_layers: Option<i64>,
    /// Freeze (true) or train (false) the token and position embeddings; when unset they
    /// freeze exactly when fewer than all layers train.
    #[serde(default)]
    pub freeze_embeddings: Option<bool>,
    /// Freeze the final layer norm (trained by default).
    #[serde(default)]
    pub freeze_final_layer_norm: Option<bool>,
}

const SECTIONS: [&str; 3] = ["base", "text_encoder_overrides", "text_encoder_freezing"];

impl OptimizerFile {
    /// Checks and parses optimizer.json's top-level object. `file` names it in errors.
    pub fn from_object(obj: Map<String, Value>, file: &Path) -> Result<OptimizerFile, ConfigError> {
        let no_set = HashMap::new();
        let top = Section {
            file,
            prefix: "",
            set_args: &no_set,
        };
        top.check_unknown(&obj, &known_keys::<OptimizerFile>(), &[], |_| None)?;
        for name in SECTIONS {
            let Some(Value::Object(sub)) = obj.get(name) else {
                continue;
            };
            let section = Section {
                file,
                prefix: name,
                set_args: &no_set,
            };
            let known = match name {
                "text_encoder_freezing" => known_keys::<FreezingFile>(),
                _ => known_keys::<GroupFile>(),
            };
            section.check_unknown(sub, &known, &[], |_| None)?;
        }
        if let Some(err) = type_error(&obj, file) {
            return Err(err);
        }
        serde_json::from_value(Value::Object(obj)).map_err(|e| ConfigError::Invalid {
            file: file.to_path_buf(),
            field: "(top level)".to_string(),
            message: format!("does not parse: {e}"),
        })
    }

    /// The built-in default, [`DEFAULT_OPTIMIZER_JSON`].
    pub fn builtin() -> Result<OptimizerFile, ConfigError> {
        let file = Path::new("<built-in optimizer.json>");
        let value = super::strict::parse_json(DEFAULT_OPTIMIZER_JSON, file)?;
        OptimizerFile::from_object(super::strict::into_object(value, file)?, file)
    }
}

/// The first field with a wrong type, looking inside the sections so the error says
/// `base.lr`, not just `base`.
fn type_error(obj: &Map<String, Value>, file: &Path) -> Option<ConfigError> {
    let no_set = HashMap::new();
    for name in SECTIONS {
        let Some(Value::Object(sub)) = obj.get(name) else {
            continue;
        };
        let section = Section {
            file,
            prefix: name,
            set_args: &no_set,
        };
        let err = match name {
            "text_encoder_freezing" => section.type_error::<FreezingFile>(sub),
            _ => section.type_error::<GroupFile>(sub),
        };
        if err.is_some() {
            return err;
        }
    }
    let top = Section {
        file,
        prefix: "",
        set_args: &no_set,
    };
    top.type_error::<OptimizerFile>(obj)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use serde_json::json;

    use super::*;

    fn parse(v: Value) -> Result<OptimizerFile, ConfigError> {
        let Value::Object(obj) = v else {
            panic!("test input must be an object")
        };
        OptimizerFile::from_object(obj, &PathBuf::from("optimizer.json"))
    }

    #[test]
    fn builtin_default_parses() {
        let file = OptimizerFile::builtin().unwrap();
        let base = file.base.unwrap();
        assert_eq!(base.optimizer.as_deref(), Some("adamw8bit"));
        assert_eq!(file.apply_grad_scaler_step_tweaks, Some(false));
    }

    #[test]
    fn doc_may_hold_anything() {
        let file = parse(json!({"doc": {"x": [1, "y"]}, "base": {"lr": 2e-6}})).unwrap();
        assert_eq!(file.base.unwrap().lr, Some(2e-6));
    }

    #[test]
    fn nested_unknown_key_is_named_with_its_section() {
        let err = parse(json!({"base": {"lr_sheduler": "cosine"}})).unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown key `base.lr_sheduler` in optimizer.json; did you mean `base.lr_scheduler`?"
        );
        let err = parse(json!({"text_encoder_override": {}})).unwrap_err();
        assert!(
            err.to_string()
                .contains("did you mean `text_encoder_overrides`?"),
            "{err}"
        );
    }

    #[test]
    fn nested_wrong_type_is_named_with_its_section() {
        let err = parse(json!({"text_encoder_overrides": {"weight_decay": "0"}})).unwrap_err();
        assert_eq!(
            err.to_string(),
            "`text_encoder_overrides.weight_decay` in optimizer.json has the wrong type: \
             expected a number, found the string \"0\""
        );
        let err = parse(json!({"base": 5})).unwrap_err();
        assert!(err.to_string().contains("`base`"), "{err}");
        assert!(err.to_string().contains("expected an object"), "{err}");
    }

    #[test]
    fn ed2_keys_are_read() {
        // The step-size estimators' keys are read, in both sections.
        let file = parse(
            json!({"base": {"optimizer": "dadapt_adam", "d0": 1e-6, "decouple": true,
                 "growth_rate": 1.02, "momentum": 0.9, "no_prox": false,
                 "safeguard_warmup": true, "use_bias_correction": true},
            "text_encoder_overrides": {"d0": null}}),
        )
        .unwrap();
        let base = file.base.unwrap();
        assert_eq!((base.d0, base.growth_rate), (Some(1e-6), Some(1.02)));
        assert_eq!(base.use_bias_correction, Some(true));
        let file = parse(json!({
            "text_encoder_freezing": {"freeze_embeddings": false, "freeze_final_layer_norm": true,
                                      "freeze_front_n_layers": -2},
            "log_grad_norm": false, "text_encoder_lr_scale": 0.5}))
        .unwrap();
        let freezing = file.text_encoder_freezing.unwrap();
        assert_eq!(freezing.freeze_embeddings, Some(false));
        assert_eq!(freezing.freeze_final_layer_norm, Some(true));
        assert_eq!(freezing.freeze_front_n_layers, Some(-2));
        assert_eq!(file.log_grad_norm, Some(false));
        assert_eq!(file.text_encoder_lr_scale, Some(0.5));
        let err = parse(json!({"text_encoder_freezing": {"freeze_embedding": false}})).unwrap_err();
        assert!(err.to_string().contains("did you mean"), "{err}");
    }

    #[test]
    fn ed2_sd21_preset_parses() {
        // EveryDream2's optimizerSD21.json, minus its doc block.
        let file = parse(json!({
            "base": {"optimizer": "adamw8bit", "lr": 1e-6, "lr_scheduler": "constant",
                     "lr_decay_steps": null, "lr_warmup_steps": null, "betas": [0.9, 0.999],
                     "epsilon": 1e-8, "weight_decay": 0.010},
            "text_encoder_overrides": {"optimizer": null, "lr": 3e-7, "lr_scheduler": null,
                     "lr_decay_steps": null, "lr_warmup_steps": null, "betas": null,
                     "epsilon": null, "weight_decay": null},
            "text_encoder_freezing": {"unfreeze_last_n_layers": 2}
        }))
        .unwrap();
        assert_eq!(
            file.text_encoder_freezing.unwrap().unfreeze_last_n_layers,
            Some(2)
        );
    }
}
