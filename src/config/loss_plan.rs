//! [`LossPlan`]: the loss keys of train.json resolved: `loss_type` in EveryDream2's and kohya's
//! meanings, kohya's Huber schedule, debiased estimation, and the masked loss (kohya's and
//! OneTrainer's names). Formulas: `crate::diffusion::loss`.
//!
//! `"huber"` is EveryDream2's (torch `huber_loss`, δ = 1); kohya's scheduled Huber is
//! `"pseudo_huber"`. The Huber-schedule keys are refused beside any other loss type, where they
//! would do nothing.

use serde::Serialize;

use super::ctx::Ctx;
use super::error::ConfigError;
use super::train_file::TrainFile;
use crate::diffusion::loss::{HuberSchedule, HuberScheduleKind, LossType, MaskWeighting};

/// kohya's defaults: `--huber_schedule snr`, `--huber_c 0.1`, `--huber_scale 1.0`.
pub const KOHYA_HUBER_C: f64 = 0.1;
/// OneTrainer's `unmasked_weight` default, used with its `masked_training` key.
pub const ONETRAINER_UNMASKED_WEIGHT: f64 = 0.1;

const LOSS_TYPES: &str = "\"mse\", \"huber\", \"mse_huber\", \"huber_mse\" (EveryDream2), \
                          \"l2\", \"l1\", \"pseudo_huber\", \"smooth_l1\" (kohya)";

/// Where a sample's loss mask comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MaskSource {
    /// `<image stem>-masklabel.png` beside the image (OneTrainer's convention).
    MaskLabel,
    /// The image's own alpha channel (kohya's `alpha_mask`).
    Alpha,
}

/// Masked loss: where the masks come from and how they weigh.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MaskedLossPlan {
    pub source: MaskSource,
    pub weighting: MaskWeighting,
}

/// The loss function and its weighting.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LossPlan {
    pub loss_type: LossType,
    /// kohya's `debiased_estimation_loss`.
    pub debiased_estimation: bool,
    /// `None`: no mask.
    pub masked: Option<MaskedLossPlan>,
}

pub(super) fn resolve_loss(file: &TrainFile, ctx: &Ctx<'_>) -> Result<LossPlan, ConfigError> {
    let name = file.loss_type.as_deref().unwrap_or("mse");
    let huber_keys = [
        ("huber_schedule", file.huber_schedule.is_some()),
        ("huber_c", file.huber_c.is_some()),
        ("huber_scale", file.huber_scale.is_some()),
    ];
    let set_huber_key = huber_keys.iter().find(|(_, set)| *set).map(|(k, _)| *k);
    let loss_type = match name {
        "mse" | "l2" => LossType::Mse,
        "huber" => LossType::Huber,
        "mse_huber" => LossType::MseHuber,
        "huber_mse" => LossType::HuberMse,
        "l1" => LossType::L1,
        "pseudo_huber" => LossType::PseudoHuber(huber_schedule(file, ctx)?),
        "smooth_l1" => LossType::SmoothL1(huber_schedule(file, ctx)?),
        other => {
            return Err(ctx.invalid(
                "loss_type",
                format!("is \"{other}\"; it must be one of {LOSS_TYPES}"),
            ))
        }
    };
    if let (Some(key), LossType::Mse | LossType::L1 | LossType::MseHuber | LossType::HuberMse) =
        (set_huber_key, loss_type)
    {
        return Err(ctx.invalid(
            key,
            format!(
                "is kohya's Huber schedule, used only with loss_type \"pseudo_huber\" or \
                 \"smooth_l1\" (loss_type is \"{name}\")"
            ),
        ));
    }
    if let (Some(key), LossType::Huber) = (set_huber_key, loss_type) {
        return Err(ctx.invalid(
            key,
            "is set beside loss_type \"huber\", which is EveryDream2's Huber loss (torch \
             huber_loss, δ = 1, no schedule); for kohya's scheduled Huber loss write \
             loss_type \"pseudo_huber\""
                .to_string(),
        ));
    }
    Ok(LossPlan {
        loss_type,
        debiased_estimation: file.debiased_estimation_loss.unwrap_or(false),
        masked: resolve_mask(file, ctx)?,
    })
}

/// kohya's `huber_schedule` (`"snr"`), `huber_c` (0.1, in (0, 1]) and `huber_scale` (1, > 0;
/// not used by the `snr` schedule, as in kohya, so refused there).
fn huber_schedule(file: &TrainFile, ctx: &Ctx<'_>) -> Result<HuberSchedule, ConfigError> {
    let kind = match file.huber_schedule.as_deref().unwrap_or("snr") {
        "snr" => HuberScheduleKind::Snr,
        "constant" => HuberScheduleKind::Constant,
        "exponential" => HuberScheduleKind::Exponential,
        other => {
            return Err(ctx.invalid(
                "huber_schedule",
                format!("is \"{other}\"; it must be \"snr\", \"constant\" or \"exponential\""),
            ))
        }
    };
    let c = file.huber_c.unwrap_or(KOHYA_HUBER_C);
    if !(c.is_finite() && c > 0.0 && c <= 1.0) {
        return Err(ctx.invalid("huber_c", format!("must be in (0, 1] (got {c})")));
    }
    let scale = ctx
        .opt_positive("huber_scale", file.huber_scale, "greater than 0")?
        .unwrap_or(1.0);
    if kind == HuberScheduleKind::Snr && file.huber_scale.is_some() {
        return Err(ctx.invalid(
            "huber_scale",
            "does nothing with huber_schedule \"snr\" (kohya ignores it there); use \"constant\" \
             or \"exponential\", or leave it out"
                .to_string(),
        ));
    }
    Ok(HuberSchedule { kind, c, scale })
}

/// kohya's `masked_loss` (masks from `-masklabel.png` files here) or `alpha_mask` (masks from
/// the alpha channel), each with `unmasked_weight` 0; or OneTrainer's `masked_training`, with
/// its `unmasked_weight` 0.1. `normalize_masked_area_loss` (OneTrainer) applies to all.
fn resolve_mask(file: &TrainFile, ctx: &Ctx<'_>) -> Result<Option<MaskedLossPlan>, ConfigError> {
    let kohya = file.masked_loss.unwrap_or(false);
    let onetrainer = file.masked_training.unwrap_or(false);
    let alpha = file.alpha_mask.unwrap_or(false);
    if kohya && onetrainer {
        return Err(ctx.invalid(
            "masked_training",
            "is OneTrainer's name for kohya's masked_loss, which is set too; give one (their \
             unmasked_weight defaults differ: 0.1 and 0)"
                .to_string(),
        ));
    }
    if !(kohya || onetrainer || alpha) {
        for (key, set) in [
            ("unmasked_weight", file.unmasked_weight.is_some()),
            (
                "normalize_masked_area_loss",
                file.normalize_masked_area_loss.is_some(),
            ),
        ] {
            if set {
                return Err(ctx.invalid(
                    key,
                    "needs masked loss on (masked_loss, masked_training or alpha_mask)".to_string(),
                ));
            }
        }
        return Ok(None);
    }
    let default_weight = if onetrainer {
        ONETRAINER_UNMASKED_WEIGHT
    } else {
        0.0
    };
    Ok(Some(MaskedLossPlan {
        source: if alpha {
            MaskSource::Alpha
        } else {
            MaskSource::MaskLabel
        },
        weighting: MaskWeighting {
            unmasked_weight: ctx.fraction(
                "unmasked_weight",
                file.unmasked_weight,
                default_weight,
            )?,
            normalize: file.normalize_masked_area_loss.unwrap_or(false),
        },
    }))
}
