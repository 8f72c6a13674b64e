//! EveryDream2's `load_settings_every_epoch`: at the start of each epoch train.json (with the
//! run's `--set` overrides) is read and checked again, and the settings a running run can change
//! take effect:
//! - the objective: timestep range, noise offset, pyramid noise, min-SNR-γ, zero terminal SNR
//!   and the loss options (EveryDream2 reads these from `args` at every step);
//! - `log_step`;
//! - when the run saves: `save_every_n_epochs`, `save_every_n_steps`, `ckpt_every_n_minutes`,
//!   `save_ckpts_from_n_epochs`.
//!
//! Other changes (the model, the data, the batch, the optimizer) are named as needing a new run,
//! and kept as they were, as EveryDream2's objects built at the start keep theirs. A file that
//! no longer loads, or no longer checks, is reported and the settings stay as they were
//! (EveryDream2 prints the error and goes on).

use serde_json::Value;

use crate::config::{SavePlan, TrainPlan};

/// The settings of a running run that a reload may change (the objective lives in the model).
#[derive(Debug, Clone)]
pub(super) struct LiveSettings {
    pub log_step: u64,
    pub saving: SavePlan,
}

impl LiveSettings {
    pub fn of(plan: &TrainPlan) -> Self {
        Self {
            log_step: plan.log_step,
            saving: plan.saving.clone(),
        }
    }
}

/// What a reload found.
pub(super) enum Reload {
    /// The file is as last read.
    Unchanged,
    /// The newly resolved plan, the keys that take effect now, and those that need a new run.
    Changed {
        plan: Box<TrainPlan>,
        applied: Vec<String>,
        ignored: Vec<String>,
    },
    /// The file could not be read or checked; the message says why.
    Failed(String),
}

/// The plan's fields that a reload applies (the save fields by their own names).
const LIVE: &[&str] = &["objective", "log_step", "saving"];
/// The save fields a reload applies.
const LIVE_SAVING: &[&str] = &[
    "every_n_epochs",
    "every_n_steps",
    "every_n_minutes",
    "from_n_epochs",
];

/// Reads train.json again as `last` was read (its file and overrides) and compares the result
/// with `last`.
pub(super) fn reload(last: &TrainPlan) -> Reload {
    let new = match TrainPlan::resolve(&last.train_config, &last.overrides) {
        Ok(p) => p,
        Err(e) => return Reload::Failed(crate::error_chain::chain_text(&e)),
    };
    let (before, after) = match (serde_json::to_value(last), serde_json::to_value(&new)) {
        (Ok(Value::Object(a)), Ok(Value::Object(b))) => (a, b),
        _ => return Reload::Failed("the plan cannot be compared".to_string()),
    };
    let mut applied = Vec::new();
    let mut ignored = Vec::new();
    for (key, was) in &before {
        let now = after.get(key).unwrap_or(&Value::Null);
        // A random seed (`seed: -1`) is drawn again by every read.
        if was == now || (key == "seed" && last.random_seed && new.random_seed) {
            continue;
        }
        match key.as_str() {
            "saving" => split_saving(was, now, &mut applied, &mut ignored),
            k if LIVE.contains(&k) => applied.push(k.to_string()),
            k => ignored.push(k.to_string()),
        }
    }
    if applied.is_empty() && ignored.is_empty() {
        return Reload::Unchanged;
    }
    Reload::Changed {
        plan: Box::new(new),
        applied,
        ignored,
    }
}

/// The changed save fields, `saving.<field>`, split into those applied and those not.
fn split_saving(was: &Value, now: &Value, applied: &mut Vec<String>, ignored: &mut Vec<String>) {
    let (Value::Object(was), Value::Object(now)) = (was, now) else {
        return;
    };
    for (field, v) in was {
        if now.get(field) == Some(v) {
            continue;
        }
        let name = format!("saving.{field}");
        match LIVE_SAVING.contains(&field.as_str()) {
            true => applied.push(name),
            false => ignored.push(name),
        }
    }
}

/// `live` with the reloaded plan's live settings, keeping the rest of `live`'s saving (the save
/// folder, precision and names are fixed for the run).
pub(super) fn apply(live: &mut LiveSettings, new: &TrainPlan) {
    live.log_step = new.log_step;
    let s = &new.saving;
    live.saving.every_n_epochs = s.every_n_epochs;
    live.saving.every_n_steps = s.every_n_steps;
    live.saving.every_n_minutes = s.every_n_minutes;
    live.saving.from_n_epochs = s.from_n_epochs;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan_from(dir: &std::path::Path, v: Value) -> TrainPlan {
        let path = dir.join("train.json");
        std::fs::write(&path, v.to_string()).unwrap();
        TrainPlan::resolve(&path, &["log_step=3".to_string()]).unwrap()
    }

    #[test]
    fn live_keys_apply_and_the_rest_are_named() {
        let tmp = tempfile::tempdir().unwrap();
        let base = serde_json::json!({"data_root": ".", "model": "org/m", "min_snr_gamma": 5.0, "batch_size": 2,
                                      "save_every_n_epochs": 2});
        let last = plan_from(tmp.path(), base);
        assert!(matches!(reload(&last), Reload::Unchanged));
        let changed = serde_json::json!({"data_root": ".", "model": "org/m", "min_snr_gamma": 1.0, "batch_size": 4,
                                         "save_every_n_epochs": 1, "save_ckpt_dir": "c"});
        std::fs::write(tmp.path().join("train.json"), changed.to_string()).unwrap();
        let Reload::Changed {
            plan,
            applied,
            ignored,
        } = reload(&last)
        else {
            panic!("not seen as changed")
        };
        assert_eq!(plan.objective.min_snr_gamma, Some(1.0));
        // The run's `--set` overrides are applied again.
        assert_eq!(plan.log_step, 3);
        assert!(applied.contains(&"objective".to_string()), "{applied:?}");
        assert!(applied.contains(&"saving.every_n_epochs".to_string()));
        assert!(ignored.contains(&"batch_size".to_string()), "{ignored:?}");
        assert!(
            ignored.contains(&"saving.ckpt_dir".to_string()),
            "{ignored:?}"
        );
        let mut live = LiveSettings::of(&last);
        apply(&mut live, &plan);
        assert_eq!(live.saving.every_n_epochs, Some(1));
        assert_eq!(live.saving.ckpt_dir, None);

        std::fs::write(tmp.path().join("train.json"), "{ not json").unwrap();
        let Reload::Failed(why) = reload(&last) else {
            panic!("a broken file is a failure")
        };
        assert!(why.contains("train.json"), "{why}");
    }
}
