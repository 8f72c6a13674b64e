//! [`LossPlan`]: the loss keys of train.json resolved: `loss_type` in EveryDream2's and kohya's
//! meanings, kohya's Huber schedule and debiased estimation. Formulas: `crate::diffusion::loss`.
//!
//! `"huber"` is EveryDream2's (torch `huber_loss`, δ = 1 unless `huber_delta` says otherwise);
//! kohya's scheduled Huber is `"pseudo_huber"`. OneTrainer's weighted sum of losses comes from
//! its strength keys ([`super::loss_mix_plan`]), its P2 weighting from `p2_loss_gamma`, and its
//! `loss_scaler` multiplies the loss. The Huber-schedule keys are refused beside any other loss type, where they
//! would do nothing.

use serde::Serialize;

use super::ctx::Ctx;
use super::error::ConfigError;
use super::loss_mix_plan::{huber_or_log_cosh, mix_given, resolve_mix};
use super::mask_plan::{resolve_mask, MaskPlan};
use super::train_file::TrainFile;
use crate::diffusion::loss::{HuberSchedule, HuberScheduleKind, LossType, VPredScaling};

/// kohya's defaults: `--huber_schedule snr`, `--huber_c 0.1`, `--huber_scale 1.0`.
pub const KOHYA_HUBER_C: f64 = 0.1;

const LOSS_TYPES: &str = "\"mse\", \"huber\", \"mse_huber\", \"huber_mse\" (EveryDream2), \
                          \"l2\", \"l1\", \"pseudo_huber\", \"smooth_l1\" (kohya), \"log_cosh\" \
                          (OneTrainer)";

/// OneTrainer's `loss_scaler`: the loss is multiplied by the batch size, the accumulation
/// steps, both, or nothing. sdtrain's `batch_size` already counts every rank's samples, so
/// OneTrainer's `GLOBAL_` forms are these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LossScaler {
    None,
    Batch,
    GradientAccumulation,
    Both,
}

impl LossScaler {
    /// The factor for a run of `batch_size` × `grad_accum` samples per step.
    pub fn factor(self, batch_size: usize, grad_accum: usize) -> f64 {
        match self {
            Self::None => 1.0,
            Self::Batch => batch_size as f64,
            Self::GradientAccumulation => grad_accum as f64,
            Self::Both => (batch_size * grad_accum) as f64,
        }
    }
}

/// The loss function and its weighting.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LossPlan {
    pub loss_type: LossType,
    /// kohya's `debiased_estimation_loss`.
    pub debiased_estimation: bool,
    /// OneTrainer's `1/√(SNR + 1)` for a v target (`debiased_estimation_style` `"onetrainer"`).
    pub debiased_v_sqrt: bool,
    /// kohya's `scale_v_pred_loss_like_noise_pred` and `v_pred_like_loss` (checked against the
    /// model's prediction type when it is loaded).
    pub v_pred: VPredScaling,
    /// Masked loss, when on.
    pub mask: Option<MaskPlan>,
    /// OneTrainer's P2 weighting γ.
    pub p2_gamma: Option<f64>,
    pub scaler: LossScaler,
}

pub(super) fn resolve_loss(file: &TrainFile, ctx: &Ctx<'_>) -> Result<LossPlan, ConfigError> {
    let name = file.loss_type.as_deref().unwrap_or("mse");
    let huber_keys = [
        ("huber_schedule", file.huber_schedule.is_some()),
        ("huber_c", file.huber_c.is_some()),
        ("huber_scale", file.huber_scale.is_some()),
    ];
    let set_huber_key = huber_keys.iter().find(|(_, set)| *set).map(|(k, _)| *k);
    let loss_type = match (name, mix_given(file)) {
        (_, Some(key)) if file.loss_type.is_some() => {
            return Err(ctx.invalid(
                "loss_type",
                format!(
                    "is \"{name}\" but {key} is given too: write loss_type, or OneTrainer's \
                     strengths (mse_strength, mae_strength, huber_strength, log_cosh_strength)"
                ),
            ))
        }
        (_, Some(_)) => resolve_mix(file, ctx)?,
        ("huber" | "log_cosh", None) => huber_or_log_cosh(name, file, ctx)?,
        (_, None) if file.huber_delta.is_some() => {
            return Err(ctx.invalid(
                "huber_delta",
                format!("shapes the Huber loss; loss_type is \"{name}\""),
            ))
        }
        (name, None) => plain_loss(name, file, ctx)?,
    };
    if let (
        Some(key),
        LossType::Mse | LossType::L1 | LossType::MseHuber | LossType::HuberMse | LossType::Mix(_),
    ) = (set_huber_key, loss_type)
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
    let like_v = match file.v_pred_like_loss {
        Some(v) if !(v.is_finite() && v >= 0.0) => {
            return Err(ctx.invalid(
                "v_pred_like_loss",
                format!("must be 0 or more, 0 is off (got {v}); kohya suggests 0.1"),
            ))
        }
        v => v.unwrap_or(0.0),
    };
    Ok(LossPlan {
        loss_type,
        debiased_estimation: file.debiased_estimation_loss.unwrap_or(false),
        debiased_v_sqrt: debiased_style(file, ctx)?,
        v_pred: VPredScaling {
            like_noise: file.scale_v_pred_loss_like_noise_pred.unwrap_or(false),
            like_v,
        },
        mask: resolve_mask(file, ctx)?,
        p2_gamma: ctx.opt_positive("p2_loss_gamma", file.p2_loss_gamma, "greater than 0")?,
        scaler: match file
            .loss_scaler
            .as_deref()
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            None | Some("none") => LossScaler::None,
            Some("batch") => LossScaler::Batch,
            Some("gradient_accumulation") => LossScaler::GradientAccumulation,
            Some("both") => LossScaler::Both,
            Some(other) => {
                return Err(ctx.invalid(
                    "loss_scaler",
                    format!(
                        "is \"{other}\"; it must be \"none\", \"batch\", \
                         \"gradient_accumulation\" or \"both\""
                    ),
                ))
            }
        },
    })
}

/// `debiased_estimation_style`: `"kohya"` (the default) or `"onetrainer"`, beside
/// `debiased_estimation_loss`; whether a v target takes OneTrainer's `1/√(SNR + 1)`.
fn debiased_style(file: &TrainFile, ctx: &Ctx<'_>) -> Result<bool, ConfigError> {
    let Some(style) = file.debiased_estimation_style.as_deref() else {
        return Ok(false);
    };
    if !file.debiased_estimation_loss.unwrap_or(false) {
        return Err(ctx.invalid(
            "debiased_estimation_style",
            "shapes debiased_estimation_loss, which is off".to_string(),
        ));
    }
    match style.to_ascii_lowercase().as_str() {
        "kohya" => Ok(false),
        "onetrainer" => Ok(true),
        other => Err(ctx.invalid(
            "debiased_estimation_style",
            format!(
                "is \"{other}\"; it must be \"kohya\" (1/(SNR+1) for v-prediction) or \
                 \"onetrainer\" (1/√(SNR+1))"
            ),
        )),
    }
}

/// EveryDream2's and kohya's loss types but `huber` (with its δ).
fn plain_loss(name: &str, file: &TrainFile, ctx: &Ctx<'_>) -> Result<LossType, ConfigError> {
    Ok(match name {
        "mse" | "l2" => LossType::Mse,
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
