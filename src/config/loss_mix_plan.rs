//! OneTrainer's weighted sum of losses in train.json: `mse_strength` (1 when left out, as in
//! OneTrainer), `mae_strength`, `huber_strength` with `huber_delta`, and `log_cosh_strength`
//! (0 when left out). Formulas: `crate::diffusion::loss`.
//!
//! A sum that is one plain loss at strength 1 is that loss (`mse`, `l1`, or EveryDream2's
//! `huber` at δ 1), so the run, its summary and its metadata read as the plain loss does.
//! `loss_type` `"log_cosh"` is log-cosh alone, and `huber_delta` beside `loss_type` `"huber"`
//! sets that Huber loss's δ.

use super::ctx::Ctx;
use super::error::ConfigError;
use super::train_file::TrainFile;
use crate::diffusion::loss::{LossMix, LossType};

/// The strength keys, as train.json (and OneTrainer) spell them.
const STRENGTHS: [&str; 4] = [
    "mse_strength",
    "mae_strength",
    "huber_strength",
    "log_cosh_strength",
];

/// Whether train.json gives a strength of OneTrainer's loss sum.
pub(super) fn mix_given(file: &TrainFile) -> Option<&'static str> {
    let set = [
        file.mse_strength,
        file.mae_strength,
        file.huber_strength,
        file.log_cosh_strength,
    ];
    STRENGTHS
        .iter()
        .zip(set)
        .find(|(_, v)| v.is_some())
        .map(|(k, _)| *k)
}

/// `huber_delta`: above 0, 1 when left out.
fn delta(file: &TrainFile, ctx: &Ctx<'_>) -> Result<f64, ConfigError> {
    match file.huber_delta {
        None => Ok(1.0),
        Some(d) if d.is_finite() && d > 0.0 => Ok(d),
        Some(d) => Err(ctx.invalid(
            "huber_delta",
            format!("must be above 0 (got {d}); torch's default is 1"),
        )),
    }
}

/// The loss from the strength keys (`mix_given` is some).
pub(super) fn resolve_mix(file: &TrainFile, ctx: &Ctx<'_>) -> Result<LossType, ConfigError> {
    let strength = |key: &str, v: Option<f64>, default: f64| match v {
        None => Ok(default),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(s),
        Some(s) => Err(ctx.invalid(key, format!("must be 0 or more (got {s})"))),
    };
    let mix = LossMix {
        mse: strength("mse_strength", file.mse_strength, 1.0)?,
        mae: strength("mae_strength", file.mae_strength, 0.0)?,
        huber: strength("huber_strength", file.huber_strength, 0.0)?,
        huber_delta: delta(file, ctx)?,
        log_cosh: strength("log_cosh_strength", file.log_cosh_strength, 0.0)?,
    };
    if mix.huber == 0.0 && file.huber_delta.is_some() {
        return Err(ctx.invalid(
            "huber_delta",
            "shapes the Huber loss, whose huber_strength is 0; leave it out".to_string(),
        ));
    }
    if [mix.mse, mix.mae, mix.huber, mix.log_cosh] == [0.0; 4] {
        return Err(ctx.invalid(
            "mse_strength",
            "and the other strengths are all 0: there is no loss to train on (mse_strength is \
             1 when left out)"
                .to_string(),
        ));
    }
    Ok(simplest(mix))
}

/// `loss_type` `"huber"` with `huber_delta`, or `"log_cosh"`.
pub(super) fn huber_or_log_cosh(
    name: &str,
    file: &TrainFile,
    ctx: &Ctx<'_>,
) -> Result<LossType, ConfigError> {
    let mut mix = LossMix {
        mse: 0.0,
        mae: 0.0,
        huber: 0.0,
        huber_delta: delta(file, ctx)?,
        log_cosh: 0.0,
    };
    match name {
        "log_cosh" if file.huber_delta.is_some() => {
            return Err(ctx.invalid(
                "huber_delta",
                "shapes the Huber loss; loss_type is \"log_cosh\"".to_string(),
            ))
        }
        "log_cosh" => mix.log_cosh = 1.0,
        _ => mix.huber = 1.0,
    }
    Ok(simplest(mix))
}

/// A sum of one plain loss at strength 1 as that loss.
fn simplest(mix: LossMix) -> LossType {
    let one = |s: f64, others: [f64; 3]| s == 1.0 && others == [0.0; 3];
    if one(mix.mse, [mix.mae, mix.huber, mix.log_cosh]) {
        LossType::Mse
    } else if one(mix.mae, [mix.mse, mix.huber, mix.log_cosh]) {
        LossType::L1
    } else if one(mix.huber, [mix.mse, mix.mae, mix.log_cosh]) && mix.huber_delta == 1.0 {
        LossType::Huber
    } else {
        LossType::Mix(mix)
    }
}
