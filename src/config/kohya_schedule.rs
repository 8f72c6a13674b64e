//! A kohya config's learning-rate schedule (`super::kohya_optimizer`), as kohya sd-scripts'
//! `get_scheduler_fix` (library/train_util.py) builds it: `lr_scheduler` with its warmup, the
//! settings it passes to each schedule (`lr_scheduler_num_cycles`, `lr_scheduler_power`,
//! `lr_scheduler_timescale`, `lr_scheduler_min_lr_ratio`, `lr_decay_steps`) and the
//! `lr_scheduler_args` each schedule function accepts, each a Python literal.
//!
//! Every schedule decays over the whole run (kohya's `num_training_steps`). What kohya would
//! fail on is refused with kohya's reason: an argument the schedule function does not take, one
//! kohya passes as well (a Python "multiple values" error), `cosine_with_min_lr` with no
//! minimum. A setting kohya reads only for another schedule is ignored, as kohya ignores it,
//! and said in a note.

use serde_json::{json, Map, Value};

use super::error::ConfigError;
use super::kohya_config::Translation;
use super::kohya_optimizer::{py_literal, RunLengths};

/// kohya's scheduler names, and sdtrain's for each.
fn ours(name: &str) -> Option<&'static str> {
    Some(match name {
        "constant" | "constant_with_warmup" => "constant",
        "linear" => "linear",
        "cosine" => "cosine",
        "cosine_with_restarts" => "cosine_with_restarts",
        "polynomial" => "polynomial",
        "cosine_with_min_lr" => "cosine_with_min_lr",
        "inverse_sqrt" => "inverse_sqrt",
        "warmup_stable_decay" => "warmup_stable_decay",
        _ => return None,
    })
}

/// The `lr_scheduler_args` each schedule function takes beyond what kohya passes itself.
fn accepted_args(name: &str) -> &'static [&'static str] {
    match name {
        "polynomial" => &["lr_end"],
        "cosine" => &["num_cycles"],
        "cosine_with_min_lr" => &["min_lr"],
        "warmup_stable_decay" => &["warmup_type", "decay_type"],
        _ => &[],
    }
}

/// The arguments kohya passes to the schedule by name, which `lr_scheduler_args` may not repeat.
fn passed_by_kohya(name: &str) -> &'static [&'static str] {
    match name {
        "constant_with_warmup" => &["num_warmup_steps"],
        "linear" | "cosine" => &["num_warmup_steps", "num_training_steps"],
        "inverse_sqrt" => &["num_warmup_steps", "timescale"],
        "cosine_with_restarts" => &["num_warmup_steps", "num_training_steps", "num_cycles"],
        "polynomial" => &["num_warmup_steps", "num_training_steps", "power"],
        "cosine_with_min_lr" => &[
            "num_warmup_steps",
            "num_training_steps",
            "num_cycles",
            "min_lr_rate",
        ],
        "warmup_stable_decay" => &[
            "num_warmup_steps",
            "num_stable_steps",
            "num_decay_steps",
            "num_cycles",
            "min_lr_ratio",
        ],
        _ => &[],
    }
}

/// `lr_scheduler` and everything it reads, into the optimizer.json `base` section.
pub(super) fn schedule(
    t: &mut Translation<'_>,
    kind: &str,
    learning_rate: f64,
    base: &mut Map<String, Value>,
) -> Result<RunLengths, ConfigError> {
    let name = t
        .take_str("lr_scheduler")?
        .unwrap_or_else(|| "constant".into());
    let warmup = t.take("lr_warmup_steps");
    let decay = t.take("lr_decay_steps").filter(|v| !is_zero(v));
    let cycles = t.take_i64("lr_scheduler_num_cycles")?;
    let power = t.take_f64("lr_scheduler_power")?;
    let timescale = t.take_i64("lr_scheduler_timescale")?;
    let min_lr_ratio = t.take_f64("lr_scheduler_min_lr_ratio")?;
    let args = scheduler_args(t)?;
    if kind == "adamw_schedulefree" {
        // kohya gives a schedule-free optimizer a dummy scheduler: no schedule, no warmup.
        base.insert("lr_scheduler".into(), json!("constant"));
        base.insert("lr_warmup_steps".into(), json!(0));
        return Ok(RunLengths::default());
    }
    let Some(ours) = ours(&name) else {
        return Err(t.invalid("lr_scheduler", unknown(&name)));
    };
    base.insert("lr_scheduler".into(), json!(ours));
    let lengths = warmup_length(t, &name, warmup.as_ref(), base)?;
    for (key, value) in &args {
        scheduler_arg(t, &name, key, value)?;
    }
    let ignored = |key: &str, set: bool| (set && !reads(&name, key)).then(|| key.to_string());
    let ignored: Vec<String> = [
        ignored("lr_scheduler_num_cycles", cycles.is_some_and(|c| c != 1)),
        ignored("lr_scheduler_power", power.is_some_and(|p| p != 1.0)),
        ignored("lr_scheduler_timescale", timescale.is_some()),
        ignored("lr_scheduler_min_lr_ratio", min_lr_ratio.is_some()),
        ignored("lr_decay_steps", decay.is_some()),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !ignored.is_empty() {
        crate::console::say(format_args!(
            "note: {}: {} have no effect with lr_scheduler \"{name}\", as in kohya (its \
             get_scheduler_fix passes them to other schedules)",
            t.path.display(),
            ignored.join(", ")
        ));
    }
    let arg = |key: &str| args.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
    match name.as_str() {
        "cosine_with_restarts" => {
            if let Some(c) = cycles {
                base.insert("lr_scheduler_num_cycles".into(), json!(c));
            }
        }
        "polynomial" => {
            if let Some(p) = power {
                base.insert("lr_scheduler_power".into(), json!(p));
            }
            if let Some(end) = arg("lr_end") {
                base.insert("lr_scheduler_lr_end".into(), end);
            }
        }
        "cosine" => {
            // transformers' cosine with `num_cycles` waves is a floorless cosine_with_min_lr
            // of twice as many half waves; its default 0.5 is the plain half cosine.
            if let Some(c) = arg("num_cycles").filter(|c| c.as_f64() != Some(0.5)) {
                let half_waves = c.as_f64().unwrap_or(0.0) * 2.0;
                base.insert("lr_scheduler".into(), json!("cosine_with_min_lr"));
                base.insert("lr_scheduler_num_cycles".into(), json!(half_waves));
            }
        }
        "cosine_with_min_lr" => {
            let ratio = min_ratio(t, min_lr_ratio, arg("min_lr"), learning_rate)?;
            base.insert("lr_scheduler_min_lr_ratio".into(), json!(ratio));
            base.insert("lr_scheduler_num_cycles".into(), json!(cycles.unwrap_or(1)));
        }
        "inverse_sqrt" => {
            if let Some(n) = timescale {
                base.insert("lr_scheduler_timescale".into(), json!(n));
            }
        }
        "warmup_stable_decay" => {
            let phase = decay_length(t, decay.as_ref())?;
            base.insert("lr_wsd_decay_steps".into(), phase);
            base.insert("lr_scheduler_num_cycles".into(), json!(cycles.unwrap_or(1)));
            if let Some(r) = min_lr_ratio {
                base.insert("lr_scheduler_min_lr_ratio".into(), json!(r));
            }
            for (key, ours) in [
                ("warmup_type", "lr_wsd_warmup_type"),
                ("decay_type", "lr_wsd_decay_type"),
            ] {
                if let Some(v) = arg(key) {
                    base.insert(ours.into(), v);
                }
            }
        }
        _ => {}
    }
    Ok(lengths)
}

fn unknown(name: &str) -> String {
    let why = match name {
        "piecewise_constant" => "diffusers' piecewise_constant (step_rules) is not supported",
        "cosine_warmup_with_min_lr" => {
            "kohya's get_scheduler_fix passes it num_decay_steps, which it does not take, so \
             kohya cannot build it either; use cosine_with_min_lr"
        }
        "reduce_lr_on_plateau" | "greedy" => {
            "kohya's get_scheduler_fix passes it num_warmup_steps, which it does not take, so \
             kohya cannot build it either"
        }
        n if n.starts_with("adafactor") => {
            "Adafactor's own relative-step schedule is not supported; use optimizer_type \
             \"AdaFactor\" with relative_step=False and a schedule"
        }
        _ => "",
    };
    match why {
        "" => format!(
            "is \"{name}\"; sdtrain has kohya's constant, constant_with_warmup, linear, cosine, \
             cosine_with_restarts, polynomial, cosine_with_min_lr, inverse_sqrt and \
             warmup_stable_decay"
        ),
        why => format!("is \"{name}\": {why}"),
    }
}

/// Whether kohya passes `key` (an option) to the schedule `name`.
fn reads(name: &str, key: &str) -> bool {
    match key {
        "lr_scheduler_num_cycles" => matches!(
            name,
            "cosine_with_restarts" | "cosine_with_min_lr" | "warmup_stable_decay"
        ),
        "lr_scheduler_power" => name == "polynomial",
        "lr_scheduler_timescale" => name == "inverse_sqrt",
        "lr_scheduler_min_lr_ratio" => matches!(name, "cosine_with_min_lr" | "warmup_stable_decay"),
        "lr_decay_steps" => name == "warmup_stable_decay",
        _ => false,
    }
}

fn is_zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}

/// `lr_scheduler_args`: `key=value` texts, each value a Python literal.
fn scheduler_args(t: &mut Translation<'_>) -> Result<Vec<(String, Value)>, ConfigError> {
    let pairs = t.take_key_values("lr_scheduler_args")?;
    pairs
        .into_iter()
        .map(|(key, text)| match py_literal(&text) {
            Some(v) => Ok((key, v)),
            None => Err(t.invalid(
                "lr_scheduler_args",
                format!("`{key}={text}`: the value is not a Python literal kohya can read"),
            )),
        })
        .collect()
}

/// One `lr_scheduler_args` entry: taken by the schedule, or refused with kohya's error.
fn scheduler_arg(
    t: &Translation<'_>,
    name: &str,
    key: &str,
    value: &Value,
) -> Result<(), ConfigError> {
    let refuse =
        |why: String| Err(t.invalid("lr_scheduler_args", format!("`{key}={value}`: {why}")));
    if name == "constant" {
        return refuse("kohya builds \"constant\" with no settings".into());
    }
    if passed_by_kohya(name).contains(&key) {
        let option = match key {
            "num_warmup_steps" => "lr_warmup_steps",
            "num_training_steps" | "num_stable_steps" => "max_train_steps",
            "num_decay_steps" => "lr_decay_steps",
            "num_cycles" => "lr_scheduler_num_cycles",
            "power" => "lr_scheduler_power",
            "timescale" => "lr_scheduler_timescale",
            _ => "lr_scheduler_min_lr_ratio",
        };
        return refuse(format!(
            "kohya passes {key} to {name} itself, so Python refuses it twice (\"got multiple \
             values for keyword argument\"); set {option} instead"
        ));
    }
    if !accepted_args(name).contains(&key) {
        let takes = match accepted_args(name) {
            [] => "no other settings".to_string(),
            keys => keys.join(", "),
        };
        return refuse(format!("{name} takes {takes}"));
    }
    let ok = match key {
        "lr_end" | "min_lr" => value.as_f64().is_some_and(|x| x.is_finite() && x >= 0.0),
        "num_cycles" => value.as_f64().is_some_and(|x| x.is_finite() && x > 0.0),
        "warmup_type" | "decay_type" => value
            .as_str()
            .is_some_and(|s| crate::optim::Ramp::parse(s).is_some()),
        _ => true,
    };
    if !ok {
        let want = match key {
            "warmup_type" | "decay_type" => "'linear', 'cosine' or '1-sqrt'",
            "num_cycles" => "a number above 0",
            _ => "a number, 0 or more",
        };
        return refuse(format!("must be {want}"));
    }
    Ok(())
}

/// cosine_with_min_lr's floor: `lr_scheduler_min_lr_ratio`, or `min_lr` over the learning
/// rate (transformers divides by the optimizer's default lr, kohya's `learning_rate`).
fn min_ratio(
    t: &Translation<'_>,
    ratio: Option<f64>,
    min_lr: Option<Value>,
    learning_rate: f64,
) -> Result<f64, ConfigError> {
    match (ratio, min_lr) {
        (Some(_), Some(_)) => Err(t.invalid(
            "lr_scheduler_args",
            "gives min_lr beside lr_scheduler_min_lr_ratio; transformers takes one (\"Only one \
             of min_lr or min_lr_rate should be set\")"
                .into(),
        )),
        (Some(r), None) => Ok(r),
        (None, Some(v)) => {
            let ratio = v.as_f64().unwrap_or(0.0) / learning_rate;
            match (0.0..=1.0).contains(&ratio) {
                true => Ok(ratio),
                false => Err(t.invalid(
                    "lr_scheduler_args",
                    format!(
                        "`min_lr={v}` is above learning_rate ({learning_rate:e}): the floor \
                         must be at most the rate it decays from"
                    ),
                )),
            }
        }
        (None, None) => Err(t.invalid(
            "lr_scheduler",
            "is \"cosine_with_min_lr\" without a minimum, which transformers refuses (\"One of \
             min_lr or min_lr_rate should be set\"): set lr_scheduler_min_lr_ratio"
                .into(),
        )),
    }
}

/// warmup_stable_decay's `lr_decay_steps`: steps, or a float below 1 as a fraction of the run.
fn decay_length(t: &Translation<'_>, decay: Option<&Value>) -> Result<Value, ConfigError> {
    match decay {
        None => Err(t.invalid(
            "lr_decay_steps",
            "is 0, so warmup_stable_decay never decays (kohya holds the lr to the end): give \
             the decay's steps, or a fraction of the run, or use constant_with_warmup"
                .into(),
        )),
        Some(Value::Number(n)) if n.is_i64() && n.as_i64().is_some_and(|n| n > 0) => {
            Ok(json!(n.as_i64()))
        }
        Some(Value::Number(n)) if n.is_f64() && n.as_f64().is_some_and(|f| f > 0.0 && f < 1.0) => {
            Ok(json!(n.as_f64()))
        }
        Some(v) => Err(t.invalid(
            "lr_decay_steps",
            format!(
                "must be a number of steps above 0, or a fraction of the run below 1 (got {v})"
            ),
        )),
    }
}

/// `lr_warmup_steps`: steps, or a float below 1 as a fraction of the run.
fn warmup_length(
    t: &Translation<'_>,
    name: &str,
    warmup: Option<&Value>,
    base: &mut Map<String, Value>,
) -> Result<RunLengths, ConfigError> {
    let mut lengths = RunLengths::default();
    let steps = match warmup {
        None => 0,
        Some(Value::Number(n)) if n.is_i64() => n.as_i64().unwrap_or(0),
        Some(Value::Number(n)) => {
            let f = n.as_f64().unwrap_or(-1.0);
            if !(0.0..1.0).contains(&f) {
                return Err(t.invalid(
                    "lr_warmup_steps",
                    format!("is {f}: a float is a fraction of the run, at least 0 and below 1"),
                ));
            }
            lengths.warmup_fraction = Some(f);
            0
        }
        Some(v) => {
            return Err(t.invalid(
                "lr_warmup_steps",
                format!("must be a number of steps, or a fraction of the run (got {v})"),
            ))
        }
    };
    let warms = steps > 0 || lengths.warmup_fraction.is_some_and(|f| f > 0.0);
    if name == "constant" && warms {
        return Err(t.invalid(
            "lr_warmup_steps",
            "is set with lr_scheduler \"constant\", which kohya refuses (\"constant does not \
             require num_warmup_steps\"); use \"constant_with_warmup\""
                .into(),
        ));
    }
    base.insert("lr_warmup_steps".into(), json!(steps));
    Ok(lengths)
}
