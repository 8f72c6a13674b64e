//! A kohya config's optimizer and schedule (`super::kohya_config`): `optimizer_type`,
//! `optimizer_args`, `learning_rate` (and a full fine-tune's `learning_rate_te*`),
//! `lr_scheduler` and its lengths, as an optimizer.json object.
//!
//! Each optimizer starts from its package's defaults (what kohya constructs), not
//! optimizer.json's: AdamW's weight decay 0.01, Lion's betas (0.9, 0.99), Prodigy's
//! `safeguard_warmup` and `use_bias_correction` false, Adafactor's `scale_parameter` true, ….
//! `optimizer_args` (`key=value`, the value a Python literal as kohya's `ast.literal_eval` reads
//! it) override them. kohya's schedules decay over the whole run (`max_train_steps`, or the
//! steps its epochs make) and warm up for `lr_warmup_steps` steps, or that fraction of the run
//! when it is a float: [`RunLengths`].

use serde_json::{json, Map, Value};

use super::error::ConfigError;
use super::kohya_config::Translation;
use super::kohya_config_keys::defaults;

/// The warmup and decay as kohya measures them: the decay over the run, the warmup a fraction
/// of it when kohya's `lr_warmup_steps` is a float.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RunLengths {
    pub warmup_fraction: Option<f64>,
}

/// sdtrain's optimizer for kohya's `optimizer_type` (case-insensitive, as kohya compares it).
fn kind(name: &str) -> Option<&'static str> {
    Some(match name.to_ascii_lowercase().as_str() {
        "adamw" => "adamw",
        "adamw8bit" | "pagedadamw8bit" | "bitsandbytes.optim.adamw8bit" => "adamw8bit",
        "lion" | "lion_pytorch.lion" => "lion",
        "lion8bit" | "pagedlion8bit" | "bitsandbytes.optim.lion8bit" => "lion8bit",
        "adafactor" | "transformers.optimization.adafactor" => "adafactor",
        "prodigy" | "prodigyopt.prodigy" => "prodigy",
        "dadaptadam" => "dadapt_adam",
        "dadaptlion" => "dadapt_lion",
        "dadaptsgd" => "dadapt_sgd",
        "dadaptadan" => "dadapt_adan",
        "adamwschedulefree" | "schedulefree.adamwschedulefree" => "adamw_schedulefree",
        "came_pytorch.came" => "came",
        _ => return None,
    })
}

/// The package defaults kohya's optimizer starts from.
fn package_defaults(kind: &str) -> Map<String, Value> {
    let v = match kind {
        "adamw" | "adamw8bit" => {
            json!({"betas": [0.9, 0.999], "epsilon": 1e-8, "weight_decay": 0.01})
        }
        "lion" | "lion8bit" => json!({"betas": [0.9, 0.99], "weight_decay": 0.0}),
        "adafactor" => json!({"weight_decay": 0.0, "adafactor": {
            "eps": [1e-30, 1e-3], "clip_threshold": 1.0, "decay_rate": -0.8,
            "beta1": null, "scale_parameter": true}}),
        "prodigy" => json!({"betas": [0.9, 0.999], "epsilon": 1e-8, "weight_decay": 0.0,
            "decouple": true, "use_bias_correction": false, "safeguard_warmup": false,
            "d0": 1e-6}),
        "dadapt_adam" => json!({"betas": [0.9, 0.999], "epsilon": 1e-8, "weight_decay": 0.0,
            "decouple": false, "use_bias_correction": false, "d0": 1e-6}),
        "dadapt_lion" => json!({"betas": [0.9, 0.99], "weight_decay": 0.0, "d0": 1e-6}),
        "dadapt_sgd" => json!({"momentum": 0.0, "weight_decay": 0.0, "d0": 1e-6}),
        "dadapt_adan" => json!({"betas": [0.98, 0.92, 0.99], "epsilon": 1e-8,
            "weight_decay": 0.02, "no_prox": false, "d0": 1e-6}),
        "adamw_schedulefree" => json!({"betas": [0.9, 0.999], "epsilon": 1e-8,
            "weight_decay": 0.0, "schedulefree": {"warmup_steps": 0, "r": 0.0,
            "weight_lr_power": 2.0}}),
        _ => json!({"betas": [0.9, 0.999, 0.9999], "weight_decay": 0.0}),
    };
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

/// The optimizer.json object and the run-relative lengths.
pub(super) fn optimizer(
    t: &mut Translation<'_>,
    mode: Option<&str>,
) -> Result<(Map<String, Value>, RunLengths), ConfigError> {
    let kind = optimizer_kind(t)?;
    let mut base = package_defaults(kind);
    base.insert("optimizer".into(), json!(kind));
    for (key, value) in optimizer_args(t)? {
        optimizer_arg(t, kind, &mut base, &key, value)?;
    }
    let lr = t
        .take_f64("learning_rate")?
        .unwrap_or(defaults::LEARNING_RATE);
    base.insert("lr".into(), json!(lr));
    let lengths = super::kohya_schedule::schedule(t, kind, lr, &mut base)?;
    let mut optimizer = Map::new();
    optimizer.insert("base".into(), Value::Object(base));
    if mode.is_none() {
        full_text_encoder(t, &mut optimizer)?;
    }
    Ok((optimizer, lengths))
}

fn optimizer_kind(t: &mut Translation<'_>) -> Result<&'static str, ConfigError> {
    let adam8 = t.take_bool("use_8bit_adam")?;
    let lion = t.take_bool("use_lion_optimizer")?;
    let name = t.take_str("optimizer_type")?.filter(|n| !n.is_empty());
    match (name, adam8, lion) {
        (None, true, true) => Err(t.invalid(
            "use_8bit_adam",
            "and use_lion_optimizer are both true; give one (or optimizer_type)".into(),
        )),
        (None, true, false) => Ok("adamw8bit"),
        (None, false, true) => Ok("lion"),
        (None, false, false) => Ok("adamw"),
        (Some(_), true, _) | (Some(_), _, true) => Err(t.invalid(
            "optimizer_type",
            "and use_8bit_adam or use_lion_optimizer are both set; give optimizer_type alone"
                .into(),
        )),
        (Some(n), false, false) => kind(&n).ok_or_else(|| {
            t.invalid(
                "optimizer_type",
                format!(
                    "is \"{n}\"; sdtrain trains with AdamW, AdamW8bit (PagedAdamW8bit), Lion, \
                     Lion8bit (PagedLion8bit), AdaFactor, Prodigy, DAdaptAdam, DAdaptLion, \
                     DAdaptSGD, DAdaptAdan, AdamWScheduleFree and came_pytorch.CAME \
                     (docs/OPTIMIZERS.md)"
                ),
            )
        }),
    }
}

/// `optimizer_args`, each value a Python literal as kohya's `ast.literal_eval` reads it.
fn optimizer_args(t: &mut Translation<'_>) -> Result<Vec<(String, Value)>, ConfigError> {
    let pairs = t.take_key_values("optimizer_args")?;
    pairs
        .into_iter()
        .map(|(k, v)| {
            let value = py_literal(&v).ok_or_else(|| {
                t.invalid(
                    "optimizer_args",
                    format!(
                        "`{k}={v}`: the value is not a Python literal (a number, True, a tuple)"
                    ),
                )
            })?;
            Ok((k, value))
        })
        .collect()
}

/// A Python literal as `ast.literal_eval` reads the values kohya's optimizers take: numbers,
/// `True`/`False`/`None`, quoted texts, and tuples or lists of them (`0.9,0.99` is a tuple).
pub(super) fn py_literal(text: &str) -> Option<Value> {
    let text = text.trim();
    let inner = text
        .strip_prefix('(')
        .and_then(|s| s.strip_suffix(')'))
        .or_else(|| text.strip_prefix('[').and_then(|s| s.strip_suffix(']')));
    if let Some(inner) = inner {
        let items: Option<Vec<Value>> = inner
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(py_literal)
            .collect();
        return items.map(Value::Array);
    }
    if text.contains(',') {
        return py_literal(&format!("({text})"));
    }
    match text {
        "True" => return Some(json!(true)),
        "False" => return Some(json!(false)),
        "None" => return Some(Value::Null),
        _ => {}
    }
    for q in ['"', '\''] {
        if let Some(s) = text.strip_prefix(q).and_then(|s| s.strip_suffix(q)) {
            return Some(json!(s));
        }
    }
    if let Ok(i) = text.parse::<i64>() {
        return Some(json!(i));
    }
    let f: f64 = match text {
        "float('inf')" | "float(\"inf\")" => f64::INFINITY,
        _ => text.parse().ok()?,
    };
    Some(if f.is_finite() { json!(f) } else { Value::Null })
}

/// One `optimizer_args` entry into the base section.
fn optimizer_arg(
    t: &Translation<'_>,
    kind: &str,
    base: &mut Map<String, Value>,
    key: &str,
    value: Value,
) -> Result<(), ConfigError> {
    let refuse = |why: &str| t.invalid("optimizer_args", format!("`{key}={value}`: {why}"));
    let nested = |base: &mut Map<String, Value>, section: &str, k: &str, v: Value| {
        if let Some(Value::Object(m)) = base.get_mut(section) {
            m.insert(k.to_string(), v);
        }
    };
    match (kind, key) {
        (_, "fused" | "foreach" | "capturable" | "differentiable" | "is_paged") => Ok(()),
        (_, "weight_decay") => {
            base.insert("weight_decay".into(), value);
            Ok(())
        }
        ("adafactor", "eps") => {
            nested(base, "adafactor", "eps", value);
            Ok(())
        }
        ("came", "eps") => {
            base.insert("came".into(), json!({"eps": value}));
            Ok(())
        }
        (_, "eps") => {
            base.insert("epsilon".into(), value);
            Ok(())
        }
        (_, "betas") => {
            base.insert("betas".into(), value);
            Ok(())
        }
        ("adafactor", "relative_step" | "warmup_init") => match value {
            Value::Bool(false) => Ok(()),
            _ => Err(refuse(
                "sdtrain's Adafactor takes the learning rate you give (kohya's advice: \
                 relative_step=False scale_parameter=False warmup_init=False)",
            )),
        },
        ("adafactor", "scale_parameter" | "clip_threshold" | "decay_rate" | "beta1") => {
            nested(base, "adafactor", key, value);
            Ok(())
        }
        ("adamw_schedulefree", "warmup_steps" | "r" | "weight_lr_power") => {
            nested(base, "schedulefree", key, value);
            Ok(())
        }
        (
            "prodigy" | "dadapt_adam" | "dadapt_lion" | "dadapt_sgd" | "dadapt_adan",
            "d0"
            | "growth_rate"
            | "decouple"
            | "use_bias_correction"
            | "safeguard_warmup"
            | "momentum"
            | "no_prox",
        ) => {
            base.insert(key.to_string(), value);
            Ok(())
        }
        ("prodigy" | "dadapt_adam" | "dadapt_adan", "d_coef") => match value.as_f64() {
            Some(1.0) => Ok(()),
            _ => Err(refuse(
                "sdtrain's estimators have no d_coef (the learning rate multiplies d); only 1 \
                 is taken",
            )),
        },
        ("prodigy", "beta3") => {
            if let Some(Value::Array(b)) = base.get_mut("betas") {
                b.truncate(2);
                b.push(value);
            }
            Ok(())
        }
        (_, "amsgrad" | "maximize" | "nesterov") if !value.as_bool().unwrap_or(true) => Ok(()),
        _ => Err(refuse(&format!(
            "not an argument sdtrain's {kind} takes (docs/OPTIMIZERS.md lists them)"
        ))),
    }
}

/// A full fine-tune's text encoder: trained only with `train_text_encoder` (fine_tune.py,
/// sdxl_train.py) or `stop_text_encoder_training` (which only train_db.py has, and train_db.py
/// trains the text encoder), at `learning_rate_te` (or sdxl_train.py's `learning_rate_te1`/`te2`, which
/// sdtrain needs equal) when given.
fn full_text_encoder(
    t: &mut Translation<'_>,
    optimizer: &mut Map<String, Value>,
) -> Result<(), ConfigError> {
    let mut train = t.take_bool("train_text_encoder")?;
    if let Some(n) = t.take_i64("stop_text_encoder_training")? {
        // Only train_db.py has it, and train_db.py always trains the text encoder.
        train = true;
        t.set(
            "stop_text_encoder_training",
            json!(n),
            "stop_text_encoder_training",
        )?;
    }
    let te = t.take_f64("learning_rate_te")?;
    let te1 = t.take_f64("learning_rate_te1")?;
    let te2 = t.take_f64("learning_rate_te2")?;
    let lr = match (te, te1, te2) {
        (Some(a), None, None) | (None, Some(a), None) | (None, None, Some(a)) => Some(a),
        (None, Some(a), Some(b)) if a == b => Some(a),
        (None, None, None) => None,
        _ => {
            return Err(t.invalid(
                "learning_rate_te1",
                "and learning_rate_te2 (or learning_rate_te) differ; sdtrain trains the text \
                 encoders at one rate"
                    .into(),
            ))
        }
    };
    if !train {
        crate::console::say(format_args!(
            "note: {}: the text encoder is frozen, as fine_tune.py and sdxl_train.py leave it \
             without train_text_encoder (train_db.py trains it); train_text_encoder = true \
             trains it",
            t.path.display()
        ));
        return t.set(
            "disable_textenc_training",
            json!(true),
            "train_text_encoder",
        );
    }
    if let Some(lr) = lr {
        if lr == 0.0 {
            return t.set("disable_textenc_training", json!(true), "learning_rate_te");
        }
        optimizer.insert("text_encoder_overrides".into(), json!({"lr": lr}));
    }
    Ok(())
}
