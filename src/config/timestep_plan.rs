//! `timestep_distribution` (OneTrainer's names, any case), the `noising_weight` and
//! `noising_bias` that shape it, and `timestep_shift`, resolved to a
//! [`TimestepDistribution`] (the formulas: src/diffusion/timesteps.rs). Each distribution reads
//! the keys OneTrainer reads for it, and a key it does not read is refused naming it:
//!
//! | distribution | noising_weight | noising_bias |
//! |---|---|---|
//! | uniform, cos_map | — | — |
//! | logit_normal | scale − 1, above −1 (0) | mean (0) |
//! | heavy_tail | s, in [−1, 2/(π − 2)] (0) | — |
//! | beta | α, above 0 (1) | β, above 0 (1) |
//! | sigmoid, inverted_parabola | steepness (0) | centre − 0.5 (0) |

use super::ctx::Ctx;
use super::error::ConfigError;
use super::train_file::TrainFile;
use crate::diffusion::timesteps::{TimestepDistribution, TimestepRange};

/// The distribution names, as train.json spells them.
const NAMES: &str = "\"uniform\", \"logit_normal\", \"heavy_tail\", \"beta\", \"cos_map\", \
                     \"sigmoid\" or \"inverted_parabola\"";

/// The heavy tail's largest `s` that keeps its map monotone: 2/(π − 2).
fn heavy_tail_max() -> f64 {
    2.0 / (std::f64::consts::PI - 2.0)
}

/// `timestep_shift`: above 0, 1 (no shift) when left out.
pub(super) fn resolve_shift(file: &TrainFile, ctx: &Ctx<'_>) -> Result<f64, ConfigError> {
    match file.timestep_shift {
        None => Ok(1.0),
        Some(s) if s.is_finite() && s > 0.0 => Ok(s),
        Some(s) => Err(ctx.invalid(
            "timestep_shift",
            format!("must be above 0 (1 leaves timesteps in place; got {s})"),
        )),
    }
}

/// The distribution over `[start, end)`; a discrete one must give some timestep a weight.
pub(super) fn resolve_distribution(
    file: &TrainFile,
    ctx: &Ctx<'_>,
    start: u32,
    end: u32,
) -> Result<TimestepDistribution, ConfigError> {
    let name = file
        .timestep_distribution
        .as_deref()
        .unwrap_or("uniform")
        .to_ascii_lowercase();
    let unused = |key: &str, set: bool| -> Result<(), ConfigError> {
        if set {
            return Err(ctx.invalid(
                key,
                format!("does not shape the {name} timestep_distribution; leave it out"),
            ));
        }
        Ok(())
    };
    let finite = |key: &str, v: Option<f64>, default: f64| -> Result<f64, ConfigError> {
        match v {
            None => Ok(default),
            Some(v) if v.is_finite() => Ok(v),
            Some(v) => Err(ctx.invalid(key, format!("must be finite (got {v})"))),
        }
    };
    let (weight, bias) = (file.noising_weight, file.noising_bias);
    let d = match name.as_str() {
        "uniform" | "cos_map" => {
            unused("noising_weight", weight.is_some())?;
            unused("noising_bias", bias.is_some())?;
            if name == "uniform" {
                TimestepDistribution::Uniform
            } else {
                TimestepDistribution::CosMap
            }
        }
        "logit_normal" => {
            let w = finite("noising_weight", weight, 0.0)?;
            if w <= -1.0 {
                return Err(ctx.invalid(
                    "noising_weight",
                    format!(
                        "must be above -1 (the normal's deviation is noising_weight + 1; got {w})"
                    ),
                ));
            }
            TimestepDistribution::LogitNormal {
                bias: finite("noising_bias", bias, 0.0)?,
                scale: w + 1.0,
            }
        }
        "heavy_tail" => {
            unused("noising_bias", bias.is_some())?;
            let s = finite("noising_weight", weight, 0.0)?;
            if !(-1.0..=heavy_tail_max()).contains(&s) {
                return Err(ctx.invalid(
                    "noising_weight",
                    format!(
                        "must be between -1 and 2/(π − 2) = {:.4} for the heavy_tail \
                         distribution, where its map stays monotone (got {s})",
                        heavy_tail_max()
                    ),
                ));
            }
            TimestepDistribution::HeavyTail { scale: s }
        }
        "beta" => {
            let positive = |key: &str, v: Option<f64>, what: &str| {
                let v = finite(key, v, 1.0)?;
                if v <= 0.0 {
                    return Err(ctx.invalid(
                        key,
                        format!("is the beta distribution's {what}; it must be above 0 (got {v})"),
                    ));
                }
                Ok(v)
            };
            TimestepDistribution::Beta {
                alpha: positive("noising_weight", weight, "α")?,
                beta: positive("noising_bias", bias, "β")?,
            }
        }
        "sigmoid" => TimestepDistribution::Sigmoid {
            weight: finite("noising_weight", weight, 0.0)?,
            bias: finite("noising_bias", bias, 0.0)?,
        },
        "inverted_parabola" => TimestepDistribution::InvertedParabola {
            weight: finite("noising_weight", weight, 0.0)?,
            bias: finite("noising_bias", bias, 0.0)?,
        },
        other => {
            return Err(ctx.invalid(
                "timestep_distribution",
                format!("is \"{other}\"; it must be {NAMES}"),
            ))
        }
    };
    let range = TimestepRange {
        start,
        end,
        num_train: super::objective_plan::MAX_TIMESTEP as u32,
        shift: resolve_shift(file, ctx)?,
    };
    d.check(&range).map_err(|why| {
        ctx.invalid(
            "timestep_distribution",
            format!("\"{name}\" with noising_weight {weight:?} and noising_bias {bias:?} {why}"),
        )
    })?;
    Ok(d)
}
