//! `model` and `resume_ckpt`: the base model, and the run to continue.
//!
//! `resume_ckpt` naming a run folder (with `plan.json`) or a save point's `state-step-NNNNNN`
//! folder is the run to continue, and `"last_run"` the newest run under `output_dir` with a save
//! point; anything else is EveryDream2's meaning, the base model, and so is `"findlast"`: as in
//! EveryDream2, the newest diffusers model saved under `output_dir` starts a new run (its
//! chaining: each session trains on from the last one's model with its own settings). The run
//! folder's layout is [`crate::run_layout`]'s.

use std::path::{Path, PathBuf};

use super::ctx::Ctx;
use super::error::ConfigError;
use super::train_file::TrainFile;
use crate::run_layout;

/// The run to continue, from `resume_ckpt`; `None` when it names none (or is unset).
pub(super) fn resolve_resume(
    file: &TrainFile,
    ctx: &Ctx<'_>,
) -> Result<Option<PathBuf>, ConfigError> {
    let Some(raw) = file.resume_ckpt.as_deref() else {
        return Ok(None);
    };
    if raw == "last_run" {
        let out = ctx.output_path("output_dir", file.output_dir.as_deref().unwrap_or("output"))?;
        return match run_layout::find_last_run(&out) {
            Some(run) => Ok(Some(run)),
            None => Err(ctx.invalid(
                "resume_ckpt",
                format!(
                    "is \"last_run\", but output_dir {} holds no run with a save point",
                    out.display()
                ),
            )),
        };
    }
    if raw == "findlast" {
        return Ok(None);
    }
    let path = ctx.input_path("resume_ckpt", raw)?;
    let resumable = run_layout::is_run(&path) || run_layout::is_save_point(&path);
    Ok((path.is_dir() && resumable).then_some(path))
}

/// `resume_ckpt: "findlast"`: the newest diffusers model saved under `output_dir` (a run's
/// `final/`, `epoch-NNNN/`, `step-NNNNNN/` or `interrupted-step-NNNNNN/`), over `model`.
fn find_last_model(file: &TrainFile, ctx: &Ctx<'_>) -> Result<String, ConfigError> {
    let out = ctx.output_path("output_dir", file.output_dir.as_deref().unwrap_or("output"))?;
    match run_layout::find_last_model(&out, 3, false) {
        Ok(Some(found)) => Ok(ctx.absolute("resume_ckpt", &found)?.display().to_string()),
        Ok(None) => Err(ctx.invalid(
            "resume_ckpt",
            format!(
                "is \"findlast\" (EveryDream2's: the newest saved model starts this run), but \
                 output_dir {} holds no saved diffusers model; an adapter run saves none (start \
                 from its file with `adapter.init_from`), and `\"last_run\"` resumes a run from \
                 its save point instead",
                out.display()
            ),
        )),
        Err(message) => Err(ctx.invalid("resume_ckpt", message)),
    }
}

/// The base model: `model`, else `resume_ckpt` as EveryDream2 uses it, else the model of the
/// run being resumed (from its `plan.json`).
pub(super) fn resolve_model(
    file: &TrainFile,
    ctx: &Ctx<'_>,
    resume: Option<&Path>,
) -> Result<String, ConfigError> {
    let resume_ckpt = if resume.is_some() {
        None
    } else {
        file.resume_ckpt.clone()
    };
    if let (None, Some(run)) = (&file.model, resume) {
        return run_layout::model_of(run).map_err(|message| ctx.invalid("resume_ckpt", message));
    }
    if file.resume_ckpt.as_deref() == Some("findlast") {
        return find_last_model(file, ctx);
    }
    let spec = match (&file.model, &resume_ckpt) {
        (Some(m), Some(r)) if m != r => {
            let candidates: Vec<PathBuf> = ctx
                .input_candidates(r)
                .into_iter()
                .map(|p| std::path::absolute(&p).unwrap_or(p))
                .collect();
            let exists = candidates.iter().any(|p| p.exists());
            return Err(ConfigError::ModelConflict {
                file: ctx.file.to_path_buf(),
                model: m.clone(),
                resume_ckpt: r.clone(),
                missing_at: if exists { Vec::new() } else { candidates },
            });
        }
        (Some(m), _) => ("model", m),
        (None, Some(r)) => ("resume_ckpt", r),
        (None, None) => {
            return Err(ConfigError::Missing {
                file: ctx.file.to_path_buf(),
                field: "model",
                hint: "a hub id `org/name[@revision]`, a diffusers folder or a .safetensors file \
                       (EveryDream2's `resume_ckpt` is accepted too)",
            })
        }
    };
    let (field, raw) = spec;
    if raw.trim().is_empty() {
        return Err(ctx.invalid(field, "is empty".to_string()));
    }
    if raw == "findlast" {
        return Err(ctx.invalid(
            field,
            "is \"findlast\", which only `resume_ckpt` takes (EveryDream2's search for the last \
             saved model)"
                .to_string(),
        ));
    }
    // A local path wins when it exists; anything else is left for the model loader to read as a
    // hub id (or to report as missing).
    match ctx.input_candidates(raw).iter().find(|p| p.exists()) {
        Some(local) => Ok(ctx.absolute(field, local)?.display().to_string()),
        None => Ok(raw.clone()),
    }
}
