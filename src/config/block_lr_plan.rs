//! `block_lr`: kohya sd-scripts' per-block learning rates of an SDXL full fine-tune
//! (sdxl_train.py's `--block_lr`): 23 rates, one for each of the UNet's blocks in kohya's
//! order (0 the time and label embeddings, 1–9 `input_blocks.0–8`, 10–12 `middle_block.0–2`,
//! 13–21 `output_blocks.0–8`, 22 `out`). A block at 0 does not train, as kohya leaves it out
//! of the optimizer. The blocks are found in the run (`train::block_lr`).

use serde_json::Value;

use super::ctx::Ctx;
use super::error::ConfigError;
use super::optimizer_plan::ParamGroupPlan;
use super::plan::TrainMode;

/// How many rates `block_lr` holds (kohya's `UNET_NUM_BLOCKS_FOR_BLOCK_LR`).
pub const SDXL_BLOCKS: usize = 23;

/// The 23 rates, from a list of numbers or kohya's comma-separated text.
pub(super) fn resolve_block_lr(
    raw: Option<&Value>,
    mode: TrainMode,
    train_unet: bool,
    unet: &ParamGroupPlan,
    ctx: &Ctx<'_>,
) -> Result<Option<Vec<f64>>, ConfigError> {
    let Some(raw) = raw.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let bad = |why: String| Err(ctx.invalid("block_lr", why));
    let rates: Vec<f64> = match raw {
        Value::Array(items) => match items.iter().map(Value::as_f64).collect() {
            Some(r) => r,
            None => return bad(format!("must hold numbers (got {raw})")),
        },
        Value::String(s) => match s.split(',').map(|x| x.trim().parse::<f64>()).collect() {
            Ok(r) => r,
            Err(_) => {
                return bad(format!(
                    "\"{s}\" is not {SDXL_BLOCKS} comma-separated numbers"
                ))
            }
        },
        other => {
            return bad(format!(
                "must be a list of {SDXL_BLOCKS} learning rates (got {other})"
            ))
        }
    };
    if mode != TrainMode::Full {
        return bad(
            "is sdxl_train.py's, for a full fine-tune; an adapter run weighs its blocks with \
             adapter.down_lr_weight, mid_lr_weight and up_lr_weight"
                .into(),
        );
    }
    if !train_unet {
        return bad("is set, but the UNet does not train (disable_unet_training)".into());
    }
    if rates.len() != SDXL_BLOCKS {
        return bad(format!(
            "has {} rates; kohya's SDXL UNet has {SDXL_BLOCKS} blocks (time and label \
             embeddings, 9 input blocks, 3 middle, 9 output, out)",
            rates.len()
        ));
    }
    if let Some((i, r)) = rates
        .iter()
        .enumerate()
        .find(|(_, r)| !(r.is_finite() && **r >= 0.0))
    {
        return bad(format!("rate {i} is {r}: each must be 0 or more"));
    }
    if rates.iter().all(|r| *r == 0.0) {
        return bad("is 0 for every block, so the UNet would train nothing".into());
    }
    let switches_only = rates.iter().all(|r| *r == 0.0 || *r == unet.lr);
    if !switches_only && !unet.optimizer.scales_per_parameter() {
        return bad(format!(
            "gives the blocks their own learning rates, but optimizer \"{}\" (base in the \
             optimizer config) computes its step size for the whole group; use adamw, adamw8bit, \
             lion, lion8bit, adafactor or came, or rates of 0 and the UNet's lr ({:e}) only \
             (which switch blocks off)",
            unet.optimizer.name(),
            unet.lr
        ));
    }
    Ok(Some(rates))
}
