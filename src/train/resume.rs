//! Save points for an exact resume: `state-step-NNNNNN/` in the run folder, beside the saved
//! weights.
//!
//! A save point holds everything the next step depends on:
//! - `params.safetensors`: every trained parameter, f32, by `<group>/<name>`;
//! - `optimizer-<group>.safetensors`: each group's optimizer state (`Optimizer::save_state`);
//! - `ema.safetensors`, with EMA on: the EMA copy, by the same names as `params.safetensors`;
//! - `trainer_state.json`: the step, the epoch and the position in its data order, the seed, the
//!   loss scaler, the OOM-adjusted micro-batch, and the counters and losses the summary reports.
//!
//! Every random draw is a function of the seed and the step (the data order of the epoch, each
//! sample's seeds), so no generator state needs saving: a resumed run makes the same draws.
//!
//! Writes are atomic: the folder is written as `state-step-NNNNNN.partial` (trainer_state.json
//! last, every file fsynced) and renamed. A kill during a save leaves a `.partial` folder that
//! resume ignores and the next save removes; the previous save point stays loadable.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor, Var};
use serde::{Deserialize, Serialize};

use super::micro_batch::MicroBatching;
use super::optimizer_step::Optimization;
use super::param_groups::{group_names, named_params};
use crate::optim::Optimizer;
use crate::precision::ScalerState;
/// Where a save point goes: the run folder's layout decides ([`crate::run_layout`]).
pub use crate::run_layout::state_dir;
use crate::run_layout::{is_save_point, save_points, STATE_FILE, STATE_PREFIX as PREFIX};

const PARAMS_FILE: &str = "params.safetensors";
/// The EMA copy in a save point (with `ema_decay_rate` or `ema_strength_target`).
pub const EMA_FILE: &str = "ema.safetensors";
const PARTIAL: &str = "partial";
const VERSION: u32 = 1;

/// What a resumed run must share with the saved one for the resume to be exact. A difference
/// is reported; the run goes on with the new value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunKey {
    pub model: String,
    pub mode: String,
    pub data_root: PathBuf,
    pub resolution: usize,
    pub batch_size: usize,
    pub grad_accum: usize,
    /// The settings that shape the data order and crops (buckets, `crop_jitter`); empty in save
    /// points written before they were recorded.
    #[serde(default)]
    pub data_shape: String,
}

impl RunKey {
    /// `key: saved → now` for each field that differs.
    pub fn differences(&self, now: &RunKey) -> Vec<String> {
        let mut out = Vec::new();
        let mut check = |key: &str, a: String, b: String| {
            if a != b {
                out.push(format!("{key}: {a} → {b}"));
            }
        };
        check("model", self.model.clone(), now.model.clone());
        check("mode", self.mode.clone(), now.mode.clone());
        check(
            "data_root",
            self.data_root.display().to_string(),
            now.data_root.display().to_string(),
        );
        check(
            "resolution",
            self.resolution.to_string(),
            now.resolution.to_string(),
        );
        check(
            "batch_size",
            self.batch_size.to_string(),
            now.batch_size.to_string(),
        );
        check(
            "grad_accum",
            self.grad_accum.to_string(),
            now.grad_accum.to_string(),
        );
        if !self.data_shape.is_empty() {
            check(
                "buckets or crop_jitter",
                self.data_shape.clone(),
                now.data_shape.clone(),
            );
        }
        out
    }
}

/// The trainer's state at a save point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    pub version: u32,
    /// Optimizer steps completed.
    pub steps: usize,
    /// The (0-based) epoch the next step belongs to, and how many of its steps are done.
    pub epoch: usize,
    pub steps_in_epoch: usize,
    pub epochs_completed: usize,
    pub images_seen: usize,
    pub skipped_steps: usize,
    /// Every step's loss, for the summary.
    pub losses: Vec<f64>,
    pub micro: MicroBatching,
    pub scaler: Option<ScalerState>,
    /// The run's seed (a random seed, `-1`, was drawn once and is kept).
    pub seed: u64,
    pub key: RunKey,
    /// The optimizer groups, in order.
    pub groups: Vec<String>,
    /// The run's length in steps when saved, which its LR schedule was computed for (absent
    /// from save points of earlier versions).
    #[serde(default)]
    pub total_steps: Option<usize>,
    /// The data-parallel ranks of the run that saved it (absent from earlier versions: 1). A
    /// save point resumes on any number of ranks: the data order and the effective batch depend
    /// on the config alone.
    #[serde(default)]
    pub world_size: Option<usize>,
}

impl TrainerState {
    pub fn new(steps: usize, key: RunKey, groups: Vec<String>, seed: u64) -> Self {
        Self {
            version: VERSION,
            steps,
            epoch: 0,
            steps_in_epoch: 0,
            epochs_completed: 0,
            images_seen: 0,
            skipped_steps: 0,
            losses: Vec::new(),
            micro: MicroBatching::new(key.batch_size),
            scaler: None,
            seed,
            key,
            groups,
            total_steps: None,
            world_size: None,
        }
    }
}

/// A group's optimizer state file in save point `dir`.
pub fn optimizer_file(dir: &Path, group: &str) -> PathBuf {
    dir.join(format!("optimizer-{group}.safetensors"))
}

/// Writes the save point `dir` atomically. `params` are the trained parameters by name;
/// `write_optimizers` writes each group's file into the folder it is given.
pub fn write(
    dir: &Path,
    state: &TrainerState,
    params: &[(String, Var)],
    write_optimizers: impl FnOnce(&Path) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let partial = dir.with_extension(PARTIAL);
    if partial.exists() {
        std::fs::remove_dir_all(&partial)
            .with_context(|| format!("removing the unfinished {}", partial.display()))?;
    }
    std::fs::create_dir_all(&partial).with_context(|| format!("creating {}", partial.display()))?;
    let tensors: HashMap<String, Tensor> = params
        .iter()
        .map(|(name, var)| Ok((name.clone(), var.as_tensor().to_dtype(DType::F32)?)))
        .collect::<candle_core::Result<_>>()?;
    let params_path = partial.join(PARAMS_FILE);
    candle_core::safetensors::save(&tensors, &params_path)
        .map_err(crate::error_chain::External)
        .with_context(|| format!("writing {}", params_path.display()))?;
    sync_file(&params_path)?;
    write_optimizers(&partial)?;
    let json = serde_json::to_string_pretty(state)?;
    crate::fsutil::write_atomic(&partial.join(STATE_FILE), json)?;
    if dir.exists() {
        // Saved before at this step (a step save, then Ctrl-C): the same state.
        std::fs::remove_dir_all(dir).with_context(|| format!("replacing {}", dir.display()))?;
    }
    std::fs::rename(&partial, dir)
        .with_context(|| format!("renaming {} to {}", partial.display(), dir.display()))?;
    if let Some(parent) = dir.parent() {
        sync_dir(parent)?;
    }
    Ok(())
}

fn sync_file(path: &Path) -> anyhow::Result<()> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("syncing {}", path.display()))
}

fn sync_dir(path: &Path) -> anyhow::Result<()> {
    // Directories cannot be opened for syncing everywhere; where they can, make the rename
    // durable.
    if let Ok(d) = std::fs::File::open(path) {
        d.sync_all().ok();
    }
    Ok(())
}

/// The save point `resume` names: a state folder itself, or a run folder's newest one.
pub fn locate(resume: &Path) -> anyhow::Result<PathBuf> {
    if is_save_point(resume) {
        return Ok(resume.to_path_buf());
    }
    match save_points(resume).pop() {
        Some((_, dir)) => Ok(dir),
        None => bail!(
            "resume_ckpt {} has no complete save point (a `{PREFIX}NNNNNN` folder with {STATE_FILE}); \
             runs write one with save_every_n_steps, at each save_every_n_epochs and on Ctrl-C",
            resume.display()
        ),
    }
}

/// Reads a save point's trainer state.
pub fn read_state(dir: &Path) -> anyhow::Result<TrainerState> {
    let path = dir.join(STATE_FILE);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let state: TrainerState = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a trainer state", path.display()))?;
    if state.version != VERSION {
        bail!(
            "{} has format version {}, this build reads {VERSION}",
            path.display(),
            state.version
        );
    }
    Ok(state)
}

/// Sets every parameter in `params` from the save point's `params.safetensors`; the file must
/// hold exactly these names with these shapes.
pub fn load_params(dir: &Path, params: &[(String, Var)]) -> anyhow::Result<()> {
    let (path, saved) = read_params(dir)?;
    if let Some(mismatch) = mismatch(&path, &saved, params) {
        bail!(mismatch.with_hint());
    }
    set_params(&saved, params)
}

/// [`load_params`] for a resume: when the saved parameters do not fit this run's and the save
/// point was made from another model (`saved.model`, `now.model`), the error says so first,
/// before any parameter is set.
pub fn restore_params(
    dir: &Path,
    saved_key: &RunKey,
    now: &RunKey,
    params: &[(String, Var)],
) -> anyhow::Result<()> {
    let (path, saved) = read_params(dir)?;
    if let Some(mismatch) = mismatch(&path, &saved, params) {
        if saved_key.model != now.model {
            bail!(
                "the save point {} was made from model {}, and this run uses model {}: resume \
                 it with its own model (leave `model` out to take the run's), or start a new \
                 run ({})",
                dir.display(),
                saved_key.model,
                now.model,
                mismatch.detail
            );
        }
        bail!(mismatch.with_hint());
    }
    set_params(&saved, params)
}

fn read_params(dir: &Path) -> anyhow::Result<(PathBuf, HashMap<String, Tensor>)> {
    let path = dir.join(PARAMS_FILE);
    let saved = candle_core::safetensors::load(&path, &Device::Cpu)
        .map_err(crate::error_chain::External)
        .with_context(|| format!("reading {}", path.display()))?;
    Ok((path, saved))
}

/// Why the saved tensors are not this run's parameters.
struct Mismatch {
    detail: String,
    /// The saved names are not this run's: another mode or adapter is the likely cause when the
    /// model is the same.
    names: bool,
}

impl Mismatch {
    fn with_hint(self) -> String {
        match self.names {
            true => format!(
                "{}: was it saved by a run with another mode or adapter (or, for a full \
                 fine-tune, other blocks at 0 in block_lr, or other text-encoder layers \
                 frozen)?",
                self.detail
            ),
            false => self.detail,
        }
    }
}

/// What keeps the saved tensors (read from `path`) from being `params`, if anything: a name
/// this run does not train, a name missing, or a shape.
fn mismatch(
    path: &Path,
    saved: &HashMap<String, Tensor>,
    params: &[(String, Var)],
) -> Option<Mismatch> {
    let mut unknown: Vec<&String> = saved
        .keys()
        .filter(|k| !params.iter().any(|(n, _)| n == *k))
        .collect();
    if !unknown.is_empty() {
        unknown.sort();
        return Some(Mismatch {
            detail: format!(
                "{} holds {} parameter(s) this run does not train, e.g. `{}`",
                path.display(),
                unknown.len(),
                unknown[0]
            ),
            names: true,
        });
    }
    for (name, var) in params {
        let detail = match saved.get(name) {
            None => format!("{} has no parameter `{name}`", path.display()),
            Some(t) if t.dims() != var.dims() => format!(
                "{}: `{name}` is {:?}, this run's is {:?}",
                path.display(),
                t.dims(),
                var.dims()
            ),
            Some(_) => continue,
        };
        return Some(Mismatch {
            detail,
            names: false,
        });
    }
    None
}

fn set_params(saved: &HashMap<String, Tensor>, params: &[(String, Var)]) -> anyhow::Result<()> {
    for (name, var) in params {
        if let Some(t) = saved.get(name) {
            var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
        }
    }
    Ok(())
}

/// Deletes all but the newest `keep` save points in `run`; `also(step)` names what else goes
/// with each (the step's saved weights). Returns the steps removed.
pub fn prune(
    run: &Path,
    keep: usize,
    also: impl Fn(usize) -> Vec<PathBuf>,
) -> anyhow::Result<Vec<usize>> {
    let points = save_points(run);
    let excess = points.len().saturating_sub(keep);
    let mut removed = Vec::new();
    for (step, dir) in points.into_iter().take(excess) {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
        for extra in also(step) {
            if extra.is_dir() {
                std::fs::remove_dir_all(&extra).ok();
            } else if extra.is_file() {
                std::fs::remove_file(&extra).ok();
            }
        }
        removed.push(step);
    }
    Ok(removed)
}

/// Continues from save point `dir` with its `state`: the trained parameters, each group's
/// optimizer state, the loss scaler and the micro-batch. Warns about each way this run's `key`
/// differs from the saved one's.
pub(super) fn restore(
    dir: &Path,
    state: &TrainerState,
    opt: &mut Optimization,
    key: &RunKey,
) -> anyhow::Result<()> {
    let groups = group_names(&opt.groups);
    if groups != state.groups {
        bail!(
            "{} was saved with optimizer groups {:?}, this run has {:?} (train_text_encoder \
             differs?)",
            dir.display(),
            state.groups,
            groups
        );
    }
    restore_params(dir, &state.key, key, &named_params(&opt.groups))?;
    for g in opt.groups.iter_mut() {
        let path = optimizer_file(dir, g.name);
        g.optimizer
            .load_state(&path)
            .with_context(|| format!("resuming the {} optimizer", g.name))?;
    }
    if let Some(s) = &state.scaler {
        opt.scaler.restore(s);
    }
    opt.micro = state.micro;
    for d in state.key.differences(key) {
        crate::console::say(format_args!(
            "warning: resumed run changed {d}; the resume is not exact"
        ));
    }
    crate::console::say(format_args!(
        "resumed from {} at step {} (epoch {}, {} steps into it)",
        dir.display(),
        state.steps,
        state.epoch + 1,
        state.steps_in_epoch
    ));
    let world = opt.dist.as_ref().map_or(1, |l| l.world());
    if let Some(saved) = state.world_size.filter(|w| *w != world) {
        crate::console::say(format_args!(
            "note: the save point was written by {saved} rank(s) and this run has {world}: the \
             data order and the effective batch are the same"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run_layout::model_of;

    fn key() -> RunKey {
        RunKey {
            model: "m".into(),
            mode: "lora".into(),
            data_root: "data".into(),
            resolution: 64,
            batch_size: 2,
            grad_accum: 1,
            data_shape: "buckets off, crop_jitter 0".into(),
        }
    }

    fn params() -> Vec<(String, Var)> {
        vec![
            (
                "unet/a".into(),
                Var::new(&[1f32, 2.0], &Device::Cpu).unwrap(),
            ),
            ("unet/b".into(), Var::new(&[[3f32]], &Device::Cpu).unwrap()),
        ]
    }

    /// Written, found, read back; a `.partial` folder (a kill during a save) and a folder
    /// without its state file are ignored; pruning keeps the newest.
    #[test]
    fn save_points_round_trip_and_survive_a_killed_save() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path();
        std::fs::write(run.join("plan.json"), r#"{"model": "org/base"}"#).unwrap();
        let p = params();
        for steps in [2, 4] {
            let mut st = TrainerState::new(steps, key(), vec!["unet".into()], 7);
            st.losses = vec![0.5; steps];
            write(&state_dir(run, steps), &st, &p, |d| {
                std::fs::write(optimizer_file(d, "unet"), b"opt").map_err(Into::into)
            })
            .unwrap();
        }
        // A save killed half-way (no state file yet), and a stray folder without one.
        let killed = state_dir(run, 6).with_extension(PARTIAL);
        std::fs::create_dir_all(&killed).unwrap();
        std::fs::write(killed.join(PARAMS_FILE), b"trunc").unwrap();
        std::fs::create_dir_all(state_dir(run, 8)).unwrap();
        let found = locate(run).unwrap();
        assert_eq!(found, state_dir(run, 4));
        let st = read_state(&found).unwrap();
        assert_eq!((st.steps, st.losses.len(), st.seed), (4, 4, 7));
        assert!(optimizer_file(&found, "unet").is_file());
        let fresh = vec![
            (
                "unet/a".into(),
                Var::new(&[0f32, 0.0], &Device::Cpu).unwrap(),
            ),
            ("unet/b".into(), Var::new(&[[0f32]], &Device::Cpu).unwrap()),
        ];
        load_params(&found, &fresh).unwrap();
        assert_eq!(fresh[0].1.to_vec1::<f32>().unwrap(), vec![1.0, 2.0]);
        assert_eq!(model_of(&found).unwrap(), "org/base");
        assert_eq!(model_of(run).unwrap(), "org/base");
        // A save at step 6 replaces the killed one.
        write(
            &state_dir(run, 6),
            &TrainerState::new(6, key(), vec![], 7),
            &p,
            |_| Ok(()),
        )
        .unwrap();
        assert!(!killed.exists());
        assert_eq!(save_points(run).len(), 3);
        let gone = run.join("weights-2");
        std::fs::write(&gone, b"w").unwrap();
        let removed = prune(run, 2, |s| vec![run.join(format!("weights-{s}"))]).unwrap();
        assert_eq!(removed, vec![2]);
        assert!(!gone.exists());
        assert_eq!(locate(run).unwrap(), state_dir(run, 6));
    }

    #[test]
    fn mismatched_params_are_refused_by_name() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = state_dir(tmp.path(), 1);
        write(
            &dir,
            &TrainerState::new(1, key(), vec![], 1),
            &params(),
            |_| Ok(()),
        )
        .unwrap();
        let other = vec![(
            "unet/a".into(),
            Var::new(&[0f32, 0.0, 0.0], &Device::Cpu).unwrap(),
        )];
        let err = load_params(&dir, &other).unwrap_err().to_string();
        assert!(err.contains("unet/b"), "{err}");
        let wrong_shape = vec![
            (
                "unet/a".into(),
                Var::new(&[0f32, 0.0, 0.0], &Device::Cpu).unwrap(),
            ),
            ("unet/b".into(), Var::new(&[[0f32]], &Device::Cpu).unwrap()),
        ];
        let err = load_params(&dir, &wrong_shape).unwrap_err().to_string();
        assert!(err.contains("`unet/a` is [2]"), "{err}");
        // From another model: said first; with the same model, only the mismatch.
        let other_model = RunKey {
            model: "org/sdxl".into(),
            ..key()
        };
        let err = restore_params(&dir, &key(), &other_model, &wrong_shape).unwrap_err();
        let err = err.to_string();
        assert!(
            err.contains("was made from model m, and this run uses model org/sdxl")
                && err.contains("`unet/a` is [2]"),
            "{err}"
        );
        let err = restore_params(&dir, &key(), &key(), &wrong_shape).unwrap_err();
        assert!(!err.to_string().contains("made from model"), "{err}");
        assert!(locate(tmp.path().join("nothing").as_path()).is_err());
        let d = key().differences(&RunKey {
            batch_size: 4,
            ..key()
        });
        assert_eq!(d, vec!["batch_size: 2 → 4"]);
        let changed = RunKey {
            data_shape: "buckets None up to None, crop_jitter 0".into(),
            ..key()
        };
        assert_eq!(key().differences(&changed).len(), 1);
        // A save point from before the field existed compares nothing there.
        let old = RunKey {
            data_shape: String::new(),
            ..key()
        };
        assert!(old.differences(&changed).is_empty());
    }
}
