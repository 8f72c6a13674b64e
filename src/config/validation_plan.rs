//! [`ValidationPlan`]: the validation loss, from train.json's `validation_split` /
//! `validation_data_root` / `validation_every_n_steps`, or from EveryDream2's validation file
//! named by `validation_config` (`data/every_dream_validation.py`, `validation_default.json`,
//! `doc/VALIDATION.md`).
//!
//! EveryDream2's file, key by key (its defaults in brackets):
//! - `validate_training` [true]: the `val` set at all;
//! - `val_split_mode` [`automatic`]: `automatic` holds `auto_split_proportion` [0.15] of
//!   `data_root` out of training (`ceil(p·n)`, at least 1, drawn as EveryDream2 draws it);
//!   `manual` reads `manual_data_root` instead; `none`: no `val` set;
//! - `extra_manual_datasets` [{}]: `{name: folder}`, each scored and logged under its name;
//! - `stabilize_training_loss` [false], `stabilize_split_proportion` [0.15]: a fixed subset of the
//!   training images (still trained on) scored like a validation set, `stabilize-train`;
//! - `every_n_epochs` [1]: whole or fractional (0.5: twice an epoch); every set is also scored
//!   before the first step, as EveryDream2 does;
//! - `seed` [555]: the validation draws and the splits;
//! - `use_relative_loss` [false]: each set's loss is logged minus its first (pre-training)
//!   value, as the option was written (EveryDream2's current code reads it and ignores it);
//! - `batch_size` [the training batch size]: the validation micro-batch;
//! - `documentation` is ignored, as EveryDream2 ignores it; the old names `val_data_root` and
//!   `val_split_proportion` are read as EveryDream2 reads them.
//!
//! Deliberate differences: an unknown key or a wrong type is an error naming the file (EveryDream2
//! merges any key into its config); `validate_training: false` turns `manual` off too, as its
//! documentation says (its code still loads `manual_data_root`); a string `"true"`/`"false"` in
//! any case (EveryDream2's own `validation_coco.json` writes one; Python users write `"True"`) and
//! 1/0 are read as the boolean, where EveryDream2 takes any non-empty string, `"False"` too, as
//! true; any other string is an error.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::ctx::Ctx;
use super::error::ConfigError;
use super::strict::{into_object, known_keys, read_json, Section};
use super::train_file::TrainFile;

/// EveryDream2's validation seed default.
pub const DEFAULT_VALIDATION_SEED: u64 = 555;

/// How the held-out split is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SplitRule {
    /// `validation_split`: `round(p·n)` images, at least one, and one left to train.
    Sdtrain,
    /// EveryDream2's `get_random_split`: sorted by path, shuffled by Python's generator seeded
    /// with the validation seed, the first `ceil(p·n)` (at least one).
    EveryDream2,
    /// kohya's `split_train_val` of each dataset-config subset, at its dataset's split and seed
    /// (`crate::data::kohya_split`); `split` is then the largest of them.
    Kohya,
}

/// When the validation loss is computed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ValidationWhen {
    /// At the end of each epoch (train.json's default).
    EachEpoch,
    /// Every N optimizer steps (`validation_every_n_steps`).
    EveryNSteps(u64),
    /// EveryDream2's `every_n_epochs`, whole or fractional.
    EveryNEpochs(f64),
}

/// A validation set read from its own folder.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NamedSet {
    pub name: String,
    pub data_root: PathBuf,
}

/// The validation loss: which images, and how often.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ValidationPlan {
    /// A seeded fraction of `data_root` held out of training as the `val` set, in (0, 1).
    pub split: Option<f64>,
    pub split_rule: SplitRule,
    /// Or the `val` set's own folder.
    pub data_root: Option<PathBuf>,
    /// More sets, each logged under its name (`extra_manual_datasets`).
    pub extra: Vec<NamedSet>,
    /// This fraction of the training images (kept in training) scored as `stabilize-train`.
    pub stabilize_split: Option<f64>,
    pub when: ValidationWhen,
    /// Score every set before the first step too (EveryDream2 does).
    pub before_training: bool,
    /// The validation draws' seed; `None`: from the run's seed.
    pub seed: Option<u64>,
    /// Log each loss minus its first value.
    pub relative: bool,
    /// The validation micro-batch; `None`: the training micro-batch.
    pub batch_size: Option<usize>,
    /// The file it came from, when `validation_config` named one.
    pub config_file: Option<PathBuf>,
}

impl ValidationPlan {
    /// The sets, for the summary: "15% of data_root", a folder, "stabilize-train 15%", names.
    pub fn sets_text(&self) -> String {
        let mut parts = Vec::new();
        match (&self.data_root, self.split) {
            (Some(root), _) => parts.push(root.display().to_string()),
            (None, Some(_)) if self.split_rule == SplitRule::Kohya => parts.push(
                "each dataset's validation_split of its subsets (kohya's split_train_val)".into(),
            ),
            (None, Some(s)) => parts.push(format!("{:.0}% of data_root", s * 100.0)),
            (None, None) => {}
        }
        if let Some(s) = self.stabilize_split {
            parts.push(format!("stabilize-train {:.0}%", s * 100.0));
        }
        parts.extend(self.extra.iter().map(|e| e.name.clone()));
        parts.join(", ")
    }

    /// When the sets are scored, for the summary.
    pub fn when_text(&self) -> String {
        let when = match self.when {
            ValidationWhen::EachEpoch => "at each epoch's end".to_string(),
            ValidationWhen::EveryNSteps(n) => format!("every {n} steps"),
            ValidationWhen::EveryNEpochs(e) => format!("every {e} epochs"),
        };
        match self.before_training {
            true => format!("{when} and before training"),
            false => when,
        }
    }
}

/// A boolean as Python users write one: `true`/`false`, the strings `"True"`/`"False"` in any
/// case, or `1`/`0`. Anything else is an error that lists these forms.
#[derive(Debug, Clone, Copy, Serialize)]
struct Flag(bool);

/// What [`Flag`] accepts, for error messages.
const FLAG_FORMS: &str = "true or false (also \"true\"/\"false\" in any case, or 1/0)";

impl<'de> Deserialize<'de> for Flag {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl serde::de::Visitor<'_> for Visit {
            type Value = Flag;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(FLAG_FORMS)
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Flag, E> {
                Ok(Flag(v))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Flag, E> {
                match v {
                    0 | 1 => Ok(Flag(v == 1)),
                    _ => Err(E::custom(format!(
                        "expected {FLAG_FORMS}, found the number {v}"
                    ))),
                }
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Flag, E> {
                match u64::try_from(v) {
                    Ok(u) => self.visit_u64(u),
                    Err(_) => Err(E::custom(format!(
                        "expected {FLAG_FORMS}, found the number {v}"
                    ))),
                }
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Flag, E> {
                if v.eq_ignore_ascii_case("true") {
                    Ok(Flag(true))
                } else if v.eq_ignore_ascii_case("false") {
                    Ok(Flag(false))
                } else {
                    Err(E::custom(format!(
                        "expected {FLAG_FORMS}, found the string {v:?}"
                    )))
                }
            }
        }
        d.deserialize_any(Visit)
    }
}

impl Flag {
    fn get(self) -> bool {
        self.0
    }
}

/// EveryDream2's validation file as written.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct ValidationFile {
    validate_training: Option<Flag>,
    val_split_mode: Option<String>,
    auto_split_proportion: Option<f64>,
    val_split_proportion: Option<f64>,
    manual_data_root: Option<String>,
    val_data_root: Option<String>,
    extra_manual_datasets: Option<BTreeMap<String, String>>,
    stabilize_training_loss: Option<Flag>,
    stabilize_split_proportion: Option<f64>,
    every_n_epochs: Option<f64>,
    seed: Option<i64>,
    use_relative_loss: Option<Flag>,
    batch_size: Option<i64>,
}

/// train.json's validation keys, or the file `validation_config` names.
pub(super) fn resolve_validation(
    file: &TrainFile,
    ctx: &Ctx<'_>,
) -> Result<Option<ValidationPlan>, ConfigError> {
    let from_keys = resolve_train_keys(file, ctx)?;
    let Some(raw) = file.validation_config.as_deref() else {
        return Ok(from_keys);
    };
    if from_keys.is_some() {
        return Err(ctx.invalid(
            "validation_config",
            "and `validation_split`/`validation_data_root` are both set; give one".into(),
        ));
    }
    let path = ctx.input_path("validation_config", raw)?;
    read_validation_file(&path).map(Some)
}

/// Reads EveryDream2's validation file at `path`.
fn read_validation_file(path: &Path) -> Result<ValidationPlan, ConfigError> {
    let mut obj = into_object(read_json(path)?, path)?;
    obj.remove("documentation");
    let no_set = HashMap::new();
    let section = Section {
        file: path,
        prefix: "",
        set_args: &no_set,
    };
    section.check_unknown(&obj, &known_keys::<ValidationFile>(), &[], |_| None)?;
    // JSON nulls mean "not set", as EveryDream2's shipped file writes `manual_data_root: null`.
    obj.retain(|_, v| !v.is_null());
    if let Some(err) = section.type_error::<ValidationFile>(&obj) {
        return Err(err);
    }
    let vf: ValidationFile = serde_json::from_value(Value::Object(obj))
        .map_err(|e| section.wrong_type("", &Value::Null, &e))?;
    let ctx = Ctx::new(path);
    plan_from_file(vf, &ctx)
}

fn plan_from_file(vf: ValidationFile, ctx: &Ctx<'_>) -> Result<ValidationPlan, ConfigError> {
    let proportion = |key: &str, v: Option<f64>| -> Result<f64, ConfigError> {
        match v.unwrap_or(0.15) {
            p if p > 0.0 && p < 1.0 => Ok(p),
            p => Err(ctx.invalid(key, format!("must be between 0 and 1, exclusive (got {p})"))),
        }
    };
    let validate = vf.validate_training.is_none_or(Flag::get);
    let mode = vf.val_split_mode.as_deref().unwrap_or("automatic");
    let manual_root = vf.manual_data_root.or(vf.val_data_root);
    let (split, data_root) = match (validate, mode) {
        (_, "automatic" | "manual" | "none") if !validate => (None, None),
        (_, "automatic") => {
            let p = vf.auto_split_proportion.or(vf.val_split_proportion);
            (Some(proportion("auto_split_proportion", p)?), None)
        }
        (_, "manual") => match manual_root.as_deref() {
            Some(raw) => (None, Some(folder(ctx, "manual_data_root", raw)?)),
            None if vf
                .extra_manual_datasets
                .as_ref()
                .is_some_and(|m| !m.is_empty()) =>
            {
                (None, None)
            }
            None => {
                return Err(ctx.invalid(
                    "val_split_mode",
                    "is `manual` but neither `manual_data_root` nor `extra_manual_datasets` \
                     names a folder"
                        .into(),
                ))
            }
        },
        (_, "none") => (None, None),
        (_, other) => {
            return Err(ctx.invalid(
                "val_split_mode",
                format!("must be `automatic`, `manual` or `none` (got `{other}`)"),
            ))
        }
    };
    let mut extra = Vec::new();
    for (name, raw) in vf.extra_manual_datasets.unwrap_or_default() {
        let field = format!("extra_manual_datasets.{name}");
        if name == "val" || name == "stabilize-train" {
            return Err(ctx.invalid(&field, "is a name sdtrain uses for its own sets".into()));
        }
        extra.push(NamedSet {
            data_root: folder(ctx, &field, &raw)?,
            name,
        });
    }
    let stabilize_split = match vf.stabilize_training_loss.is_some_and(Flag::get) {
        true => Some(proportion(
            "stabilize_split_proportion",
            vf.stabilize_split_proportion,
        )?),
        false => None,
    };
    let every = vf.every_n_epochs.unwrap_or(1.0);
    if !(every.is_finite() && every > 0.0) {
        return Err(ctx.invalid(
            "every_n_epochs",
            format!("must be a positive number (got {every})"),
        ));
    }
    Ok(ValidationPlan {
        split,
        split_rule: SplitRule::EveryDream2,
        data_root,
        extra,
        stabilize_split,
        when: ValidationWhen::EveryNEpochs(every),
        before_training: true,
        seed: Some(
            ctx.opt_at_least("seed", vf.seed, 0)?
                .unwrap_or(DEFAULT_VALIDATION_SEED),
        ),
        relative: vf.use_relative_loss.is_some_and(Flag::get),
        batch_size: ctx
            .opt_at_least("batch_size", vf.batch_size, 1)?
            .map(|b| b as usize),
        config_file: Some(ctx.file.to_path_buf()),
    })
}

/// An existing folder named by `field`, relative to the file's folder.
fn folder(ctx: &Ctx<'_>, field: &str, raw: &str) -> Result<PathBuf, ConfigError> {
    let path = ctx.input_path(field, raw)?;
    if !path.is_dir() {
        return Err(ctx.invalid(
            field,
            format!("is {}, which is not a folder", path.display()),
        ));
    }
    Ok(path)
}

/// `validation_split`, `validation_data_root` and `validation_every_n_steps`.
fn resolve_train_keys(
    file: &TrainFile,
    ctx: &Ctx<'_>,
) -> Result<Option<ValidationPlan>, ConfigError> {
    let split = match file.validation_split {
        Some(x) if !(x > 0.0 && x < 1.0) => {
            return Err(ctx.invalid(
                "validation_split",
                format!("must be a fraction between 0 and 1, exclusive (got {x})"),
            ))
        }
        x => x,
    };
    let data_root = match file.validation_data_root.as_deref() {
        Some(raw) => Some(folder(ctx, "validation_data_root", raw)?),
        None => None,
    };
    let every_n_steps =
        ctx.opt_at_least("validation_every_n_steps", file.validation_every_n_steps, 1)?;
    match (split, &data_root) {
        (Some(_), Some(_)) => Err(ctx.invalid(
            "validation_split",
            "and `validation_data_root` are both set; give one".into(),
        )),
        (None, None) if every_n_steps.is_some() => Err(ctx.invalid(
            "validation_every_n_steps",
            "needs `validation_split` or `validation_data_root`".into(),
        )),
        (None, None) => Ok(None),
        _ => Ok(Some(ValidationPlan {
            split,
            split_rule: SplitRule::Sdtrain,
            data_root,
            extra: Vec::new(),
            stabilize_split: None,
            when: every_n_steps.map_or(ValidationWhen::EachEpoch, ValidationWhen::EveryNSteps),
            before_training: false,
            seed: None,
            relative: false,
            batch_size: None,
            config_file: None,
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(dir: &Path, v: Value) -> Result<ValidationPlan, ConfigError> {
        let path = dir.join("val.json");
        std::fs::write(&path, v.to_string()).unwrap();
        read_validation_file(&path)
    }

    #[test]
    fn ed2_default_file_reads_with_its_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let p = read(
            dir.path(),
            serde_json::json!({
                "documentation": {"seed": "text"},
                "validate_training": true, "val_split_mode": "automatic",
                "auto_split_proportion": 0.15, "manual_data_root": null,
                "extra_manual_datasets": {}, "stabilize_training_loss": false,
                "stabilize_split_proportion": 0.15, "every_n_epochs": 1, "seed": 555,
                "use_relative_loss": false
            }),
        )
        .unwrap();
        assert_eq!(p.split, Some(0.15));
        assert_eq!(p.split_rule, SplitRule::EveryDream2);
        assert_eq!(p.when, ValidationWhen::EveryNEpochs(1.0));
        assert_eq!(
            (p.seed, p.relative, p.before_training),
            (Some(555), false, true)
        );
        assert!(p.extra.is_empty() && p.stabilize_split.is_none() && p.data_root.is_none());
        let empty = read(dir.path(), serde_json::json!({})).unwrap();
        assert_eq!(empty.split, Some(0.15));
    }

    #[test]
    fn manual_extra_and_stabilize_are_read() {
        let dir = tempfile::tempdir().unwrap();
        for sub in ["v", "santa"] {
            std::fs::create_dir(dir.path().join(sub)).unwrap();
        }
        let p = read(
            dir.path(),
            serde_json::json!({
                "validate_training": "true", "val_split_mode": "manual", "val_data_root": "v",
                "extra_manual_datasets": {"santa suit": "santa"},
                "stabilize_training_loss": true, "stabilize_split_proportion": 0.2,
                "every_n_epochs": 0.5, "use_relative_loss": true, "batch_size": 3
            }),
        )
        .unwrap();
        assert_eq!(p.data_root.as_deref(), Some(dir.path().join("v").as_path()));
        assert_eq!(p.extra[0].name, "santa suit");
        assert_eq!(p.stabilize_split, Some(0.2));
        assert_eq!(p.when, ValidationWhen::EveryNEpochs(0.5));
        assert!(p.relative);
        assert_eq!(p.batch_size, Some(3));
        let off = read(
            dir.path(),
            serde_json::json!({"validate_training": false, "val_split_mode": "manual"}),
        )
        .unwrap();
        assert_eq!((off.split, off.data_root), (None, None));
    }

    #[test]
    fn errors_name_the_file_and_key() {
        let dir = tempfile::tempdir().unwrap();
        for (v, want) in [
            (
                serde_json::json!({"val_split_mod": "automatic"}),
                "val_split_mod",
            ),
            (
                serde_json::json!({"val_split_mode": "auto"}),
                "val_split_mode",
            ),
            (
                serde_json::json!({"val_split_mode": "manual"}),
                "manual_data_root",
            ),
            (
                serde_json::json!({"auto_split_proportion": 1.5}),
                "auto_split_proportion",
            ),
            (serde_json::json!({"every_n_epochs": 0}), "every_n_epochs"),
            (serde_json::json!({"seed": "x"}), "seed"),
            (
                serde_json::json!({"extra_manual_datasets": {"a": "missing"}}),
                "extra_manual",
            ),
        ] {
            let err = read(dir.path(), v.clone()).unwrap_err().to_string();
            assert!(err.contains("val.json") && err.contains(want), "{v}: {err}");
        }
    }

    /// Regression: `"validate_training": "True"` (and 1/0) gave serde's "data did not match any
    /// variant of untagged enum Flag".
    #[test]
    fn flags_take_python_spellings_and_name_the_forms_otherwise() {
        let dir = tempfile::tempdir().unwrap();
        for (flag, on) in [
            (serde_json::json!("True"), true),
            (serde_json::json!("TRUE"), true),
            (serde_json::json!(1), true),
            (serde_json::json!("False"), false),
            (serde_json::json!("false"), false),
            (serde_json::json!(0), false),
        ] {
            let p = read(
                dir.path(),
                serde_json::json!({"validate_training": flag, "use_relative_loss": flag}),
            )
            .unwrap();
            assert_eq!((p.split.is_some(), p.relative), (on, on), "{flag}");
        }
        for flag in [
            serde_json::json!("yes"),
            serde_json::json!(2),
            serde_json::json!(-1),
            serde_json::json!([true]),
        ] {
            let err = read(
                dir.path(),
                serde_json::json!({"stabilize_training_loss": flag}),
            )
            .unwrap_err()
            .to_string();
            assert!(
                err.contains("val.json")
                    && err.contains("stabilize_training_loss")
                    && err.contains("true or false (also \"true\"/\"false\" in any case, or 1/0)"),
                "{flag}: {err}"
            );
            assert!(!err.contains("untagged"), "{flag}: {err}");
        }
    }
}
