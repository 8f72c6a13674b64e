//! [`SavePlan`]: when a run saves and where and how its weights go: `save_every_n_epochs`,
//! `save_every_n_steps`, EveryDream2's `ckpt_every_n_minutes` and `save_ckpts_from_n_epochs`,
//! `checkpoints_total_limit`, and EveryDream2's `save_ckpt_dir`, `save_full_precision` and
//! `no_prepend_last`.

use std::path::PathBuf;

use candle_core::DType;
use serde::Serialize;

use super::ctx::Ctx;
use super::error::ConfigError;
use super::train_file::TrainFile;

/// When and how the run saves.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SavePlan {
    /// Save a model every N epochs; `None` saves only at the end (always done).
    pub every_n_epochs: Option<u64>,
    /// Save the weights and a resume state every N optimizer steps.
    pub every_n_steps: Option<u64>,
    /// Save the weights and a resume state when this many minutes have passed since the run
    /// started or the last timed save (EveryDream2's `ckpt_every_n_minutes`).
    pub every_n_minutes: Option<f64>,
    /// Epoch saves start once this many epochs are complete (EveryDream2's
    /// `save_ckpts_from_n_epochs`; 0 saves from the first).
    pub from_n_epochs: u64,
    /// Keep only the newest N resume states; the step saves they belong to go with them.
    pub total_limit: Option<usize>,
    /// Where single-file checkpoints and adapter files go (EveryDream2's `save_ckpt_dir`),
    /// named `<run folder>-<name>`; `None` keeps them in the run folder.
    pub ckpt_dir: Option<PathBuf>,
    /// Single-file checkpoints in f32 (EveryDream2's `save_full_precision`); false writes
    /// them in f16, as EveryDream2 does by default. Diffusers folders are always f32.
    pub full_precision: bool,
    /// EveryDream2's `no_prepend_last`: the end-of-run weights take a step save's name
    /// (`step-NNNNNN`) instead of `final`.
    pub final_as_step: bool,
    /// kohya's `save_last_n_epochs`: each epoch save removes the weights saved
    /// `every_n_epochs · N` epochs before it, so the newest N epoch saves remain.
    pub last_n_epochs: Option<u64>,
    /// kohya's `save_last_n_steps`: each step save removes the newest step save at least N + 1
    /// steps before it (kohya's `get_remove_step_no`), so the saves of the last N steps remain.
    pub last_n_steps: Option<u64>,
}

impl SavePlan {
    /// Saves only at the end (train.json's defaults), for tests to build on.
    #[cfg(test)]
    pub(crate) fn at_end() -> SavePlan {
        SavePlan {
            every_n_epochs: None,
            every_n_steps: None,
            every_n_minutes: None,
            from_n_epochs: 0,
            total_limit: None,
            ckpt_dir: None,
            full_precision: false,
            final_as_step: false,
            last_n_epochs: None,
            last_n_steps: None,
        }
    }

    /// The dtype of a full fine-tune's single-file checkpoint.
    pub fn single_file_dtype(&self) -> DType {
        if self.full_precision {
            DType::F32
        } else {
            DType::F16
        }
    }
}

pub(super) fn resolve_saves(file: &TrainFile, ctx: &Ctx<'_>) -> Result<SavePlan, ConfigError> {
    let every_n_minutes = match file.ckpt_every_n_minutes {
        Some(m) if !m.is_finite() || m < 0.0 => {
            return Err(ctx.invalid(
                "ckpt_every_n_minutes",
                format!("must be 0 or more minutes, or null (got {m})"),
            ))
        }
        // 0 (or below 1, as EveryDream2's `ckpt_every_n_minutes < 1`) turns timed saves off.
        Some(m) if m < 1.0 => None,
        m => m,
    };
    let every_n_epochs = ctx
        .opt_at_least("save_every_n_epochs", file.save_every_n_epochs, 0)?
        .filter(|n| *n > 0);
    let every_n_steps = ctx.opt_at_least("save_every_n_steps", file.save_every_n_steps, 1)?;
    let last_n = |key: &str, v: Option<i64>, every: Option<u64>, by: &str| {
        let n = ctx.opt_at_least(key, v, 1)?;
        if n.is_some() && every.is_none() {
            return Err(ctx.invalid(
                key,
                format!("keeps the last of the saves {by} makes, and {by} is not set"),
            ));
        }
        Ok(n)
    };
    let last_n_epochs = last_n(
        "save_last_n_epochs",
        file.save_last_n_epochs,
        every_n_epochs,
        "save_every_n_epochs",
    )?;
    let last_n_steps = last_n(
        "save_last_n_steps",
        file.save_last_n_steps,
        every_n_steps,
        "save_every_n_steps",
    )?;
    Ok(SavePlan {
        // 0 disables periodic saving, as EveryDream2's `save_every_n_epochs < 1`.
        every_n_epochs,
        every_n_steps,
        every_n_minutes,
        from_n_epochs: ctx.at_least(
            "save_ckpts_from_n_epochs",
            file.save_ckpts_from_n_epochs,
            0,
            0,
        )?,
        total_limit: ctx
            .opt_at_least("checkpoints_total_limit", file.checkpoints_total_limit, 1)?
            .map(|n| n as usize),
        ckpt_dir: file
            .save_ckpt_dir
            .as_deref()
            .map(|d| ctx.output_path("save_ckpt_dir", d))
            .transpose()?,
        full_precision: file.save_full_precision.unwrap_or(false),
        final_as_step: file.no_prepend_last.unwrap_or(false),
        last_n_epochs,
        last_n_steps,
    })
}
