//! The settings of `adamw_schedulefree` (a group's `schedulefree` object) and of `came` and
//! `came8bit` (a group's `came` object), resolved; and the check that a schedule-free group runs
//! without an lr schedule of its own.
//!
//! The names are the packages' (and kohya's `optimizer_args`, OneTrainer's fields): the
//! schedulefree package's `warmup_steps`, `r`, `weight_lr_power`; came-pytorch's `eps` pair and
//! `clip_threshold`. lr, betas (two for schedule-free, three for CAME), `epsilon` (schedule-free's
//! `eps`) and weight_decay are the group's keys, as for every optimizer.

use std::path::Path;

use serde::Serialize;

use super::error::ConfigError;
use super::optimizer_file::{CameFile, ScheduleFreeFile};
use super::optimizer_plan::{OptimizerKind, ScheduleKind, ScheduleSpec, StepCount};
use crate::optim::{CameParams, ScheduleFreeParams};

/// `adamw_schedulefree`'s own settings; defaults are the package's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ScheduleFreePlan {
    /// Steps of the optimizer's linear lr warmup.
    pub warmup_steps: u64,
    pub r: f64,
    pub weight_lr_power: f64,
}

impl Default for ScheduleFreePlan {
    fn default() -> Self {
        let d = ScheduleFreeParams::default();
        Self {
            warmup_steps: d.warmup_steps,
            r: d.r,
            weight_lr_power: d.weight_lr_power,
        }
    }
}

/// `came`'s and `came8bit`'s own settings; defaults are came-pytorch's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CamePlan {
    pub eps: (f64, f64),
    pub clip_threshold: f64,
}

impl Default for CamePlan {
    fn default() -> Self {
        let d = CameParams::default();
        Self {
            eps: d.eps,
            clip_threshold: d.clip_threshold,
        }
    }
}

/// CAME's betas when a group sets none: came-pytorch's.
pub const CAME_BETAS_DEFAULT: (f64, f64, f64) = (0.9, 0.999, 0.9999);

fn invalid(file: &Path, field: String, message: String) -> ConfigError {
    ConfigError::Invalid {
        file: file.to_path_buf(),
        field,
        message,
    }
}

/// Checks a `schedulefree` object; `field` names it in errors.
pub(super) fn check_schedulefree(
    s: &ScheduleFreeFile,
    file: &Path,
    field: &str,
) -> Result<ScheduleFreePlan, ConfigError> {
    let d = ScheduleFreePlan::default();
    let key = |k: &str| format!("{field}.{k}");
    let warmup_steps = match s.warmup_steps {
        Some(n) if n < 0 => {
            return Err(invalid(
                file,
                key("warmup_steps"),
                format!("must be 0 or more (got {n})"),
            ))
        }
        Some(n) => n.unsigned_abs(),
        None => d.warmup_steps,
    };
    let power = |k: &str, v: Option<f64>, default: f64| match v {
        Some(x) if !(x.is_finite() && x >= 0.0) => Err(invalid(
            file,
            key(k),
            format!("must be 0 or more (got {x})"),
        )),
        other => Ok(other.unwrap_or(default)),
    };
    Ok(ScheduleFreePlan {
        warmup_steps,
        r: power("r", s.r, d.r)?,
        weight_lr_power: power("weight_lr_power", s.weight_lr_power, d.weight_lr_power)?,
    })
}

/// Checks a `came` object; `field` names it in errors.
pub(super) fn check_came(c: &CameFile, file: &Path, field: &str) -> Result<CamePlan, ConfigError> {
    let d = CamePlan::default();
    let key = |k: &str| format!("{field}.{k}");
    let eps = match c.eps.as_deref() {
        None => d.eps,
        Some([e1, e2]) if *e1 >= 0.0 && *e2 >= 0.0 => (*e1, *e2),
        Some(other) => {
            return Err(invalid(
                file,
                key("eps"),
                format!("must be two numbers [eps1, eps2], each 0 or more (got {other:?})"),
            ))
        }
    };
    let clip_threshold = c.clip_threshold.unwrap_or(d.clip_threshold);
    if !(clip_threshold.is_finite() && clip_threshold > 0.0) {
        return Err(invalid(
            file,
            key("clip_threshold"),
            format!("must be greater than 0 (got {clip_threshold})"),
        ));
    }
    Ok(CamePlan {
        eps,
        clip_threshold,
    })
}

/// A schedule-free group's lr schedule must be constant without warmup: the optimizer warms up
/// itself (`schedulefree.warmup_steps`) and averages the weights by the lr it sees, so an external
/// schedule changes what it computes (kohya gives these optimizers no scheduler either).
pub(super) fn check_schedule(
    optimizer: OptimizerKind,
    schedule: &ScheduleSpec,
    file: &Path,
    section: &str,
) -> Result<(), ConfigError> {
    if optimizer != OptimizerKind::AdamWScheduleFree {
        return Ok(());
    }
    let field = |k: &str| format!("{section}.{k}");
    if schedule.kind != ScheduleKind::Constant {
        return Err(invalid(
            file,
            field("lr_scheduler"),
            format!(
                "is \"{}\" (here or in train.json); adamw_schedulefree needs no lr schedule: use \
                 \"constant\", and `{section}.schedulefree.warmup_steps` for a warmup",
                schedule.kind.name()
            ),
        ));
    }
    if let StepCount::Steps(n @ 1..) = schedule.warmup_steps {
        return Err(invalid(
            file,
            field("lr_warmup_steps"),
            format!(
                "is {n} (here or in train.json); adamw_schedulefree warms up itself: set \
                 `{section}.schedulefree.warmup_steps` instead"
            ),
        ));
    }
    Ok(())
}
