//! A OneTrainer config's optimizer and learning-rate schedule (`super::onetrainer_config`), as
//! an optimizer.json object.
//!
//! Each optimizer is built as OneTrainer's `create.create_optimizer` builds it: a setting left
//! `null` takes the fallback it writes there (AdamW's weight decay 0.01, Lion's betas (0.9, 0.99),
//! Adafactor's eps (1e-30, 1e-3), …), not the package's default, and its on/off settings take
//! OneTrainer's (Prodigy's `decouple` and Adafactor's `scale_parameter` off unless the file turns
//! them on). The schedule decays over the whole run and warms up from 0 for
//! `learning_rate_warmup_steps` micro-batches (divided by the accumulation, as OneTrainer
//! divides them), or that fraction of the run when it is at most 1.

use serde_json::{json, Map, Value};

use super::error::ConfigError;
use super::onetrainer_config::{same, Translation};

/// The optimizers sdtrain has, by OneTrainer's name.
const KINDS: &[(&str, &str)] = &[
    ("ADAMW", "adamw"),
    ("ADAMW_8BIT", "adamw8bit"),
    ("ADAM", "adamw"),
    ("ADAM_8BIT", "adamw"),
    ("LION", "lion"),
    ("LION_8BIT", "lion8bit"),
    ("ADAFACTOR", "adafactor"),
    ("PRODIGY", "prodigy"),
    ("DADAPT_ADAM", "dadapt_adam"),
    ("DADAPT_LION", "dadapt_lion"),
    ("DADAPT_SGD", "dadapt_sgd"),
    ("DADAPT_ADAN", "dadapt_adan"),
    ("SCHEDULE_FREE_ADAMW", "adamw_schedulefree"),
    ("CAME", "came"),
];

/// OneTrainer's fallbacks for the settings it passes (`create.py`), before the file's values.
fn fallbacks(ot: &str) -> Value {
    match ot {
        "ADAMW" | "ADAMW_8BIT" => {
            json!({"betas": [0.9, 0.999], "epsilon": 1e-8, "weight_decay": 0.01})
        }
        "ADAM" | "ADAM_8BIT" => {
            json!({"betas": [0.9, 0.999], "epsilon": 1e-8, "weight_decay": 0.0})
        }
        "LION" => json!({"betas": [0.9, 0.99], "weight_decay": 0.0}),
        "LION_8BIT" => json!({"betas": [0.9, 0.999], "weight_decay": 0.0}),
        "ADAFACTOR" => json!({"weight_decay": 0.0, "adafactor": {
            "eps": [1e-30, 1e-3], "clip_threshold": 1.0, "decay_rate": -0.8,
            "beta1": null, "scale_parameter": false}}),
        "PRODIGY" => json!({"betas": [0.9, 0.999], "epsilon": 1e-8, "weight_decay": 0.0,
            "decouple": false, "use_bias_correction": false, "safeguard_warmup": false,
            "d0": 1e-6}),
        "DADAPT_ADAM" => json!({"betas": [0.9, 0.999], "epsilon": 1e-8, "weight_decay": 0.0,
            "decouple": false, "use_bias_correction": false, "d0": 1e-6}),
        "DADAPT_LION" => json!({"betas": [0.9, 0.999], "weight_decay": 0.0, "d0": 1e-6}),
        "DADAPT_SGD" => json!({"momentum": 0.0, "weight_decay": 0.0, "d0": 1e-6}),
        "DADAPT_ADAN" => json!({"betas": [0.98, 0.92, 0.99], "epsilon": 1e-8,
            "weight_decay": 0.02, "no_prox": false, "d0": 1e-6}),
        "SCHEDULE_FREE_ADAMW" => json!({"betas": [0.9, 0.999], "epsilon": 1e-8,
            "weight_decay": 0.01, "schedulefree": {"warmup_steps": 0, "r": 0.0,
            "weight_lr_power": 2.0}}),
        _ => {
            json!({"betas": [0.9, 0.999, 0.9999], "weight_decay": 0.0, "came": {"eps": [1e-30, 1e-16]}})
        }
    }
}

/// The settings OneTrainer's `create.py` passes to each optimizer; it reads no other field of the
/// optimizer object (the UI keeps them for other optimizers), and neither does sdtrain.
fn passed(ot: &str) -> &'static [&'static str] {
    const ADAM: &[&str] = &[
        "beta1",
        "beta2",
        "eps",
        "weight_decay",
        "amsgrad",
        "foreach",
        "maximize",
        "capturable",
        "differentiable",
        "fused",
        "stochastic_rounding",
        "fused_back_pass",
    ];
    const BNB: &[&str] = &[
        "beta1",
        "beta2",
        "eps",
        "weight_decay",
        "min_8bit_size",
        "percentile_clipping",
        "block_wise",
        "is_paged",
    ];
    match ot {
        "ADAMW" | "ADAM" => ADAM,
        "ADAMW_8BIT" | "ADAM_8BIT" | "LION_8BIT" => BNB,
        "LION" => &["beta1", "beta2", "weight_decay", "use_triton"],
        "ADAFACTOR" => &[
            "eps",
            "eps2",
            "clip_threshold",
            "decay_rate",
            "beta1",
            "weight_decay",
            "scale_parameter",
            "relative_step",
            "warmup_init",
            "stochastic_rounding",
            "fused_back_pass",
        ],
        "CAME" => &[
            "beta1",
            "beta2",
            "beta3",
            "eps",
            "eps2",
            "weight_decay",
            "stochastic_rounding",
            "use_cautious",
            "fused_back_pass",
        ],
        "PRODIGY" => &[
            "beta1",
            "beta2",
            "beta3",
            "eps",
            "weight_decay",
            "decouple",
            "use_bias_correction",
            "safeguard_warmup",
            "d0",
            "d_coef",
            "growth_rate",
            "fsdp_in_use",
            "slice_p",
        ],
        "DADAPT_ADAM" => &[
            "beta1",
            "beta2",
            "eps",
            "weight_decay",
            "log_every",
            "decouple",
            "use_bias_correction",
            "d0",
            "growth_rate",
            "fsdp_in_use",
        ],
        "DADAPT_LION" => &[
            "beta1",
            "beta2",
            "weight_decay",
            "log_every",
            "d0",
            "fsdp_in_use",
        ],
        "DADAPT_SGD" => &[
            "momentum",
            "weight_decay",
            "log_every",
            "d0",
            "growth_rate",
            "fsdp_in_use",
        ],
        "DADAPT_ADAN" => &[
            "beta1",
            "beta2",
            "beta3",
            "eps",
            "weight_decay",
            "no_prox",
            "log_every",
            "d0",
            "growth_rate",
        ],
        "SCHEDULE_FREE_ADAMW" => &[
            "beta1",
            "beta2",
            "eps",
            "weight_decay",
            "r",
            "weight_lr_power",
            "foreach",
        ],
        _ => &[],
    }
}

/// Settings OneTrainer passes that change nothing here (how torch runs the step, logging), or
/// that sdtrain's optimizers do their own way (its 8-bit state is always block-wise; bf16
/// weights always round stochastically).
const NO_EFFECT: &[&str] = &[
    "fused",
    "foreach",
    "capturable",
    "differentiable",
    "is_paged",
    "fsdp_in_use",
    "use_triton",
    "log_every",
    "compile",
    "min_8bit_size",
    "quant_block_size",
    "block_wise",
    "stochastic_rounding",
];

/// The optimizer.json object and the warmup as a fraction of the run (`None`: in steps).
pub(super) fn optimizer(
    t: &mut Translation<'_>,
    lrs: (f64, f64),
) -> Result<(Map<String, Value>, Option<f64>), ConfigError> {
    let ot = t.str("optimizer.optimizer")?.to_string();
    let Some(kind) = KINDS.iter().find(|(k, _)| *k == ot).map(|(_, v)| *v) else {
        let names: Vec<&str> = KINDS.iter().map(|(k, _)| *k).collect();
        return Err(t.invalid(
            "optimizer.optimizer",
            format!(
                "is \"{ot}\"; sdtrain has {} (docs/OPTIMIZERS.md)",
                super::onetrainer_config::quoted_list(&names)
            ),
        ));
    };
    let mut base = match fallbacks(&ot) {
        Value::Object(m) => m,
        _ => Map::new(),
    };
    base.insert("optimizer".into(), json!(kind));
    settings(t, &ot, &mut base)?;
    if matches!(ot.as_str(), "ADAM" | "ADAM_8BIT") && base["weight_decay"].as_f64() != Some(0.0) {
        return Err(t.invalid(
            "optimizer.weight_decay",
            format!(
                "is {} with {ot}, torch's Adam, whose decay is an L2 term in the gradient; \
                 sdtrain's AdamW decays the weights (choose ADAMW)",
                base["weight_decay"]
            ),
        ));
    }
    base.insert("lr".into(), json!(lrs.0));
    let warmup_fraction = schedule(t, kind, &mut base)?;
    let mut optimizer = Map::new();
    optimizer.insert("base".into(), Value::Object(base));
    if lrs.1 != lrs.0 {
        optimizer.insert("text_encoder_overrides".into(), json!({"lr": lrs.1}));
    }
    if passed(&ot).contains(&"fused_back_pass") && t.bool("optimizer.fused_back_pass")? {
        t.set(
            "fused_backward_pass",
            json!(true),
            "optimizer.fused_back_pass",
        )?;
    }
    Ok((optimizer, warmup_fraction))
}

/// The optimizer object's settings over the fallbacks: each one set away from OneTrainer's
/// default is taken where sdtrain's optimizer has it, and refused where it does not.
fn settings(
    t: &Translation<'_>,
    ot: &str,
    base: &mut Map<String, Value>,
) -> Result<(), ConfigError> {
    let Value::Object(fields) = t.get("optimizer").clone() else {
        return Err(t.invalid("optimizer", "must be an object".into()));
    };
    let adafactor = ot == "ADAFACTOR";
    for (key, value) in fields {
        let at = format!("optimizer.{key}");
        let read = passed(ot).contains(&key.as_str()) && !NO_EFFECT.contains(&key.as_str());
        if !read || value.is_null() || t.is_default(&at) {
            continue;
        }
        let shown = value.to_string();
        let refuse = |why: &str| Err(t.invalid(&at, format!("is {shown}: {why}")));
        let nested = |base: &mut Map<String, Value>, section: &str, k: &str, v: Value| {
            let entry = base.entry(section).or_insert_with(|| json!({}));
            if let Value::Object(m) = entry {
                m.insert(k.to_string(), v);
            }
        };
        match (ot, key.as_str()) {
            (_, "weight_decay") => {
                base.insert("weight_decay".into(), value);
            }
            (_, "beta1" | "beta2" | "beta3") => {
                if !set_beta(base, adafactor, &key, value) {
                    return refuse("a beta is set without the one before it");
                }
            }
            ("ADAFACTOR" | "CAME", "eps" | "eps2") => set_eps_pair(base, ot, &key, value),
            (_, "eps") => {
                base.insert("epsilon".into(), value);
            }
            ("ADAFACTOR", "clip_threshold" | "decay_rate" | "scale_parameter") => {
                nested(base, "adafactor", &key, value);
            }
            ("ADAFACTOR", "relative_step" | "warmup_init") => {
                return refuse(
                    "sdtrain's Adafactor takes the learning rate you give (relative_step and \
                     warmup_init off)",
                )
            }
            ("SCHEDULE_FREE_ADAMW", "r" | "weight_lr_power") => {
                nested(base, "schedulefree", &key, value);
            }
            (
                "PRODIGY" | "DADAPT_ADAM" | "DADAPT_LION" | "DADAPT_SGD" | "DADAPT_ADAN",
                "d0"
                | "growth_rate"
                | "decouple"
                | "use_bias_correction"
                | "safeguard_warmup"
                | "momentum"
                | "no_prox",
            ) => {
                let v = match value.as_str() {
                    Some("inf") => Value::Null,
                    _ => value,
                };
                if !v.is_null() {
                    base.insert(key.clone(), v);
                }
            }
            ("PRODIGY", "slice_p") => {
                t.differences_note(format!(
                    "Prodigy estimates d from every element of the weights (OneTrainer's \
                     optimizer.slice_p {value} uses every {value}th)"
                ));
            }
            ("PRODIGY" | "DADAPT_ADAM" | "DADAPT_ADAN", "d_coef") if same(&value, &json!(1.0)) => {}
            ("ADAMW_8BIT" | "ADAM_8BIT" | "LION_8BIT", "percentile_clipping")
                if same(&value, &json!(100)) => {}
            // `optimizer` reads it.
            (_, "fused_back_pass") => {}
            _ => {
                return refuse(&format!(
                    "not a setting sdtrain's {} takes (docs/OPTIMIZERS.md lists them)",
                    base["optimizer"].as_str().unwrap_or(ot)
                ))
            }
        }
    }
    Ok(())
}

/// OneTrainer's `beta1`/`beta2`/`beta3` into optimizer.json's `betas` (Adafactor's `beta1` into
/// its own section); false when a later beta comes without the ones before it.
fn set_beta(base: &mut Map<String, Value>, adafactor: bool, key: &str, value: Value) -> bool {
    let i = match key {
        "beta1" => 0,
        "beta2" => 1,
        _ => 2,
    };
    if adafactor && i == 0 {
        if let Value::Object(m) = base.entry("adafactor").or_insert_with(|| json!({})) {
            m.insert("beta1".into(), value);
        }
        return true;
    }
    let betas = base.entry("betas").or_insert_with(|| json!([0.9, 0.999]));
    match betas {
        Value::Array(b) => {
            while b.len() <= i {
                b.push(Value::Null);
            }
            b[i] = value;
            !b.iter().any(Value::is_null)
        }
        _ => false,
    }
}

/// Adafactor's and CAME's `eps` and `eps2`: the two ends of their `eps` pair.
fn set_eps_pair(base: &mut Map<String, Value>, ot: &str, key: &str, value: Value) {
    let (section, pair) = match ot {
        "ADAFACTOR" => ("adafactor", json!([1e-30, 1e-3])),
        _ => ("came", json!([1e-30, 1e-16])),
    };
    let entry = base.entry(section).or_insert_with(|| json!({}));
    if let Value::Object(m) = entry {
        if let Value::Array(e) = m.entry("eps").or_insert(pair) {
            e[usize::from(key == "eps2")] = value;
        }
    }
}

/// `learning_rate_scheduler` and its warmup and cycles; the warmup as a fraction of the run when
/// OneTrainer's is one.
fn schedule(
    t: &Translation<'_>,
    kind: &str,
    base: &mut Map<String, Value>,
) -> Result<Option<f64>, ConfigError> {
    let name = t.str("learning_rate_scheduler")?;
    let warmup = t.f64("learning_rate_warmup_steps")?;
    let accumulation = t.i64("gradient_accumulation_steps")?.max(1);
    if kind == "adamw_schedulefree" {
        // OneTrainer gives a schedule-free optimizer no schedule, and the warmup as written.
        let steps = warmup.max(0.0).trunc();
        if let Some(Value::Object(m)) = base.get_mut("schedulefree") {
            m.insert("warmup_steps".into(), json!(steps as i64));
        }
        base.insert("lr_scheduler".into(), json!("constant"));
        base.insert("lr_warmup_steps".into(), json!(0));
        return Ok(None);
    }
    let ours = match name {
        "CONSTANT" => "constant",
        "LINEAR" => "linear",
        "COSINE" => "cosine",
        "COSINE_WITH_HARD_RESTARTS" => "cosine_with_restarts",
        // cos(2π·c·p): cosine_with_min_lr's half waves are twice OneTrainer's cycles.
        "COSINE_WITH_RESTARTS" => "cosine_with_min_lr",
        "REX" => "rex",
        "ADAFACTOR" => {
            return Err(t.invalid(
                "learning_rate_scheduler",
                "is \"ADAFACTOR\", Adafactor's own relative-step schedule, which sdtrain does \
                 not have; use ADAFACTOR with relative_step off and another schedule"
                    .into(),
            ))
        }
        other => {
            return Err(t.invalid(
                "learning_rate_scheduler",
                format!(
                    "is \"{other}\"; sdtrain has CONSTANT, LINEAR, COSINE, COSINE_WITH_RESTARTS, \
                     COSINE_WITH_HARD_RESTARTS and REX"
                ),
            ))
        }
    };
    base.insert("lr_scheduler".into(), json!(ours));
    // OneTrainer floors every schedule but CONSTANT: min + (1 − min)·λ.
    let min_factor = t.f64("learning_rate_min_factor")?;
    if name != "CONSTANT" && min_factor != 0.0 {
        if !(0.0..=1.0).contains(&min_factor) {
            return Err(t.invalid(
                "learning_rate_min_factor",
                format!("is {min_factor}: sdtrain takes a floor from 0 to 1 of the learning rate"),
            ));
        }
        base.insert("lr_scheduler_min_lr_ratio".into(), json!(min_factor));
    }
    // Only the restarts read the cycles; OneTrainer ignores them elsewhere.
    if name.starts_with("COSINE_WITH_") {
        let cycles = t.f64("learning_rate_cycles")?;
        if !(cycles.is_finite() && cycles > 0.0) {
            return Err(t.invalid(
                "learning_rate_cycles",
                format!("is {cycles}: the restarts need a number of cycles above 0"),
            ));
        }
        let ours_cycles = match name {
            "COSINE_WITH_RESTARTS" => cycles * 2.0,
            _ => cycles,
        };
        base.insert("lr_scheduler_num_cycles".into(), json!(ours_cycles));
    }
    // OneTrainer's `create_lr_scheduler`: above 1, micro-batches over the accumulation;
    // up to 1, a fraction of the run.
    let (steps, fraction) = match warmup {
        w if w > 1.0 => ((w / accumulation as f64).trunc() as i64, None),
        w if w > 0.0 => (0, Some(w)),
        _ => (0, None),
    };
    base.insert("lr_warmup_steps".into(), json!(steps));
    Ok(fraction)
}
