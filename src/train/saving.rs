//! Saving a run: the trained weights at each save point (a diffusers folder and/or a single
//! file for a full fine-tune, a kohya LoRA file for adapter modes), the EMA weights beside them
//! under an `-ema` name, and the resume save point (parameters, optimizer states, EMA, trainer
//! state), pruned to `checkpoints_total_limit`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use candle_core::DType;

use super::adapters::{SaveInfo, TrainedAdapters};
use super::ema::Ema;
use super::optimizer_step::Optimization;
use super::param_groups::{named_params, Group};
use super::progress::Progress;
use super::resume::{self, TrainerState};
use super::run_dir::RunDir;
use crate::config::TrainPlan;
use crate::model::files::Component;
use crate::model::layout::ModelLayout;
use crate::model::pipeline::StableDiffusion;
use crate::optim::Optimizer;

/// When a save happens.
#[derive(Debug, Clone, Copy)]
pub(super) enum SavePoint {
    Epoch(usize),
    Final,
    Interrupted(usize),
    /// The last completed step, saved when a run gives up on an out-of-memory error.
    Errored(usize),
    /// Every `save_every_n_steps`.
    Step(usize),
}

/// What the EMA weights' folder or file adds to the normal name (EveryDream2 saves `<name>_ema`).
const EMA_SUFFIX: &str = "-ema";

/// Everything a save needs but the optimizer groups (which the loop mutates between saves).
pub(super) struct Saver<'a> {
    pub sd: &'a StableDiffusion,
    pub layout: &'a ModelLayout,
    pub plan: &'a TrainPlan,
    pub adapters: Option<&'a TrainedAdapters>,
    /// Textual inversion's vectors, saved as an embedding file.
    pub embedding: Option<&'a super::embeddings::TrainedEmbedding>,
    pub run: &'a RunDir,
    pub resolution: usize,
    /// Samples per epoch, repeats counted (kohya's `num_train_images`).
    pub images: usize,
    /// The run's kohya metadata for adapter files.
    pub kohya: Option<&'a super::kohya_run_metadata::KohyaRunMetadata>,
    pub started_unix: f64,
    pub seed: u64,
    /// The EMA copy, whose weights each save also writes (under [`EMA_SUFFIX`]).
    pub ema: Option<&'a Ema>,
    /// Steps done when the save happens (names the end-of-run save under `no_prepend_last`).
    pub steps_done: usize,
}

impl Saver<'_> {
    /// Saves at `point`: the weights, the EMA weights and, except at the end of a run that
    /// writes no save points ([`TrainPlan::writes_save_points`]), a resume save point holding
    /// `state`. Returns the weights' paths.
    ///
    /// The weights are the evaluation weights ([`Optimization::with_eval_weights`]: schedule-free
    /// AdamW's `x`, as kohya and OneTrainer save them); the save point keeps the training weights,
    /// so a resumed run goes on exactly.
    pub fn save_point(
        &self,
        opt: &mut Optimization,
        state: &TrainerState,
        point: SavePoint,
        epoch: usize,
        progress: &Progress,
    ) -> anyhow::Result<Vec<PathBuf>> {
        let steps = state.steps;
        let mut paths =
            opt.with_eval_weights(|opt| self.save(&opt.groups, point, steps, epoch, progress, ""))?;
        if let Some((old, key, n)) = retired(&self.plan.saving, point, steps) {
            for p in self.outputs(old).into_iter().filter(|p| p.exists()) {
                remove(&p)?;
                progress.println(format!("removed {} ({key} {n})", p.display()));
            }
        }
        if let Some(ema) = self.ema {
            paths.extend(ema.with_weights(&opt.params, || {
                self.save(&opt.groups, point, steps, epoch, progress, EMA_SUFFIX)
            })?);
        }
        if matches!(point, SavePoint::Final) && !self.plan.writes_save_points() {
            return Ok(paths);
        }
        self.write_state(opt, state)?;
        if let Some(keep) = self.plan.saving.total_limit {
            for step in resume::prune(&self.run.path, keep, |s| self.step_outputs(s))? {
                progress.println(format!(
                    "removed the save point of step {step} (checkpoints_total_limit {keep})"
                ));
            }
        }
        Ok(paths)
    }

    /// The resume save point of `state.steps`: parameters, optimizer states, EMA and `state`.
    fn write_state(&self, opt: &Optimization, state: &TrainerState) -> anyhow::Result<()> {
        let dir = resume::state_dir(&self.run.path, state.steps);
        let groups = &opt.groups;
        resume::write(&dir, state, &named_params(groups), |d| {
            for g in groups {
                let p = resume::optimizer_file(d, g.name);
                g.optimizer
                    .save_state(&p)
                    .with_context(|| format!("saving {}", p.display()))?;
            }
            if let Some(ema) = self.ema {
                ema.save(&d.join(resume::EMA_FILE))?;
            }
            Ok(())
        })
    }

    /// The weights a step save of `step` wrote (removed with its save point by
    /// `checkpoints_total_limit`).
    fn step_outputs(&self, step: usize) -> Vec<PathBuf> {
        self.outputs(SavePoint::Step(step))
    }

    /// The weights an epoch or step save wrote: its folder and single file (a full
    /// fine-tune) or its file, and the EMA's.
    fn outputs(&self, point: SavePoint) -> Vec<PathBuf> {
        let suffixes: &[&str] = match self.ema {
            Some(_) => &["", EMA_SUFFIX],
            None => &[""],
        };
        suffixes
            .iter()
            .flat_map(|sfx| match (self.adapters, self.embedding, point) {
                (None, None, SavePoint::Epoch(e)) => {
                    let dir = with_suffix(&self.run.epoch_dir(e), sfx);
                    vec![self.single_file_path(&dir), dir]
                }
                (None, None, _) => {
                    let dir = with_suffix(&self.run.step_dir(point_step(point)), sfx);
                    vec![self.single_file_path(&dir), dir]
                }
                _ => vec![self.adapter_path(point, sfx)],
            })
            .collect()
    }

    /// Saves the trained weights: a complete diffusers folder (full fine-tune) or a kohya LoRA
    /// file (adapter modes), its name followed by `suffix`. Returns the paths.
    fn save(
        &self,
        groups: &[Group],
        point: SavePoint,
        steps: usize,
        epoch: usize,
        progress: &Progress,
        suffix: &str,
    ) -> anyhow::Result<Vec<PathBuf>> {
        let paths = match (self.adapters, self.embedding) {
            (Some(a), e) => {
                let bundle = e.map(|e| e.bundle()).unwrap_or_default();
                let at = (point, steps, epoch);
                vec![self.save_adapters(a, groups, at, &bundle, suffix)?]
            }
            (None, Some(e)) => vec![self.save_embedding(e, point, steps, epoch, suffix)?],
            (None, None) => self.save_model(point, suffix)?,
        };
        for p in &paths {
            progress.println(format!("saved {}", p.display()));
        }
        Ok(paths)
    }

    /// A full fine-tune's weights, as `save_ckpt_format` asks: a diffusers folder, a single
    /// file beside it, or both.
    fn save_model(&self, point: SavePoint, suffix: &str) -> anyhow::Result<Vec<PathBuf>> {
        let dir = match self.named_as(point) {
            SavePoint::Epoch(e) => self.run.epoch_dir(e),
            SavePoint::Final => self.run.final_dir(),
            SavePoint::Interrupted(s) => self.run.interrupted_dir(s),
            SavePoint::Errored(s) => self.run.errored_dir(s),
            SavePoint::Step(s) => self.run.step_dir(s),
        };
        let dir = with_suffix(&dir, suffix);
        // Under the names the base files store them, so each component keeps its checkpoint's
        // key layout (a text encoder with or without `text_model.`).
        let mut updated = vec![(Component::Unet, self.sd.unet_weights.checkpoint_params())];
        if self.plan.train_text_encoder {
            let comps = [Component::TextEncoder, Component::TextEncoder2];
            for (te, comp) in self.sd.text_encoders.iter().zip(comps) {
                updated.push((comp, te.weights.checkpoint_params()));
            }
        }
        let format = self.plan.model_file.save_ckpt_format;
        let file = self.single_file_path(&dir);
        if format.single_file() {
            let dtype = self.plan.saving.single_file_dtype();
            let spec = self.modelspec(super::modelspec::Saved::Checkpoint);
            crate::model::export::save_single_file_with(self.layout, &file, &updated, dtype, &spec)
                .with_context(|| format!("saving {}", file.display()))?;
        }
        let mut written = Vec::new();
        if format.diffusers() {
            crate::model::export::save_diffusers_folder(self.layout, &dir, &updated, DType::F32)
                .with_context(|| format!("saving {}", dir.display()))?;
            written.push(dir);
        }
        if format.single_file() {
            written.push(file);
        }
        Ok(written)
    }

    /// The ModelSpec keys of an embedding or a single-file checkpoint of this run, titled by
    /// the run's name.
    fn modelspec(&self, saved: super::modelspec::Saved) -> Vec<(String, String)> {
        let model = (self.sd.family(), self.sd.layout.prediction_type);
        super::modelspec::modelspec(
            saved,
            model,
            self.plan,
            &self.plan.project_name,
            self.resolution,
        )
    }

    /// Textual inversion's embedding file, named as an adapter file is, with the token and the
    /// run's position in its header.
    fn save_embedding(
        &self,
        embedding: &super::embeddings::TrainedEmbedding,
        point: SavePoint,
        steps: usize,
        epoch: usize,
        suffix: &str,
    ) -> anyhow::Result<PathBuf> {
        let path = self.adapter_path(point, suffix);
        let e = &embedding.plan;
        let spec = self.modelspec(super::modelspec::Saved::TextualInversion);
        let metadata = [
            ("token_string", e.token_string.clone()),
            ("num_vectors_per_token", e.num_vectors.to_string()),
            ("steps", steps.to_string()),
            ("epoch", epoch.to_string()),
            ("base_model", self.plan.model.clone()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .chain(spec)
        .collect();
        embedding
            .save(&path, &metadata)
            .with_context(|| format!("saving {}", path.display()))?;
        Ok(path)
    }

    /// An adapter mode's kohya file, with the metadata kohya writes.
    /// `bundle`: a token's vectors saved in the file too (pivotal tuning).
    fn save_adapters(
        &self,
        adapters: &TrainedAdapters,
        groups: &[Group],
        (point, steps, epoch): (SavePoint, usize, usize),
        bundle: &[(String, candle_core::Tensor)],
        suffix: &str,
    ) -> anyhow::Result<PathBuf> {
        let path = self.adapter_path(point, suffix);
        let info = SaveInfo {
            steps,
            epoch,
            num_train_images: self.images,
            resolution: self.resolution,
            seed: self.seed,
            // By name: a text-encoder-only run has no UNet group (its file records the base
            // lr there, as kohya's `ss_learning_rate`).
            unet_lr: group_lr(groups, "unet").unwrap_or(self.plan.optimizer.unet.lr),
            text_encoder_lr: group_lr(groups, "text_encoder"),
            // kohya's `ss_output_name` and ModelSpec title: `output_name` alone, the same in
            // every epoch's and step's file.
            output_name: &self.plan.project_name,
            started_at: self.started_unix,
            run: self.kohya,
            bundle,
        };
        adapters
            .save(&path, info)
            .with_context(|| format!("saving {}", path.display()))?;
        Ok(path)
    }
}

impl Saver<'_> {
    /// The point whose name a save at `point` takes: the end of the run takes a step save's
    /// name under `no_prepend_last`.
    fn named_as(&self, point: SavePoint) -> SavePoint {
        match point {
            SavePoint::Final if self.plan.saving.final_as_step => SavePoint::Step(self.steps_done),
            other => other,
        }
    }

    /// An adapter file's name at `point` (kohya's `output_name`), followed by `suffix`.
    fn adapter_name(&self, point: SavePoint, suffix: &str) -> String {
        let project = &self.plan.project_name;
        let name = match self.named_as(point) {
            SavePoint::Epoch(e) => format!("{project}-epoch-{e:04}"),
            SavePoint::Final => project.clone(),
            SavePoint::Interrupted(s) | SavePoint::Step(s) => format!("{project}-step-{s:06}"),
            SavePoint::Errored(s) => format!("{project}-errored-step-{s:06}"),
        };
        name + suffix
    }

    /// Where the adapter file of `point` goes.
    fn adapter_path(&self, point: SavePoint, suffix: &str) -> PathBuf {
        let name = self.adapter_name(point, suffix);
        self.in_ckpt_dir(self.run.file(&format!("{name}.safetensors")))
    }

    /// The single-file checkpoint saved with a diffusers folder: `final/` →
    /// `final.safetensors` beside it.
    fn single_file_path(&self, dir: &Path) -> PathBuf {
        self.in_ckpt_dir(with_suffix(dir, ".safetensors"))
    }

    /// `file` (in the run folder), moved to `save_ckpt_dir` when one is set, as
    /// `<run folder>-<file name>` so that runs do not overwrite each other's files.
    fn in_ckpt_dir(&self, file: PathBuf) -> PathBuf {
        let Some(dir) = &self.plan.saving.ckpt_dir else {
            return file;
        };
        let run = self
            .run
            .path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy();
        let name = file.file_name().unwrap_or_default().to_string_lossy();
        dir.join(format!("{run}-{name}"))
    }
}

/// `path` with `suffix` added to its last component (`final` → `final-ema`).
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

/// The base learning rate of the group named `name`, if the run has one.
fn group_lr(groups: &[Group], name: &str) -> Option<f64> {
    groups.iter().find(|g| g.name == name).map(|g| g.base_lr)
}

fn point_step(point: SavePoint) -> usize {
    match point {
        SavePoint::Step(s) | SavePoint::Interrupted(s) | SavePoint::Errored(s) => s,
        SavePoint::Epoch(_) | SavePoint::Final => 0,
    }
}

/// The older save a new one at `point` (after `steps` steps) retires under kohya's
/// `save_last_n_epochs` or `save_last_n_steps` (`get_remove_epoch_no`, `get_remove_step_no`),
/// with the key and its value for the message. The final save at a step kohya would also save
/// by steps retires as that step save would.
fn retired(
    saving: &crate::config::SavePlan,
    point: SavePoint,
    steps: usize,
) -> Option<(SavePoint, &'static str, u64)> {
    let point = match (point, saving.every_n_steps) {
        (SavePoint::Final, Some(every)) if steps > 0 && (steps as u64).is_multiple_of(every) => {
            SavePoint::Step(steps)
        }
        (p, _) => p,
    };
    match point {
        SavePoint::Epoch(e) => {
            let (every, n) = (saving.every_n_epochs?, saving.last_n_epochs?);
            let old = (e as u64).checked_sub(every * n)?;
            (old > 0).then_some((SavePoint::Epoch(old as usize), "save_last_n_epochs", n))
        }
        SavePoint::Step(s) => {
            let (every, n) = (saving.every_n_steps?, saving.last_n_steps?);
            let old = (s as u64).checked_sub(n + 1)?;
            let old = old - old % every;
            (old > 0).then_some((SavePoint::Step(old as usize), "save_last_n_steps", n))
        }
        _ => None,
    }
}

/// Removes a saved file or folder.
fn remove(path: &Path) -> anyhow::Result<()> {
    let done = match path.is_dir() {
        true => std::fs::remove_dir_all(path),
        false => std::fs::remove_file(path),
    };
    done.with_context(|| format!("removing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saving(
        every_e: Option<u64>,
        last_e: Option<u64>,
        every_s: Option<u64>,
        last_s: Option<u64>,
    ) -> crate::config::SavePlan {
        crate::config::SavePlan {
            every_n_epochs: every_e,
            every_n_steps: every_s,
            last_n_epochs: last_e,
            last_n_steps: last_s,
            ..crate::config::SavePlan::at_end()
        }
    }

    /// kohya's `get_remove_epoch_no` and `get_remove_step_no`, by their own examples: saving
    /// every 2 epochs and keeping 3, the save of epoch 8 retires epoch 2's; saving every 10
    /// steps and keeping 30 steps, step 50's retires step 10's (kohya's comment), and so would
    /// step 45's. Catches the product left out, the `+ 1` or the rounding down to a save step.
    #[test]
    fn the_retired_save_is_kohyas() {
        let s = saving(Some(2), Some(3), Some(10), Some(30));
        let epoch = |e| retired(&s, SavePoint::Epoch(e), 0).map(|(p, ..)| point_label(p));
        assert_eq!(epoch(8), Some("epoch 2".into()));
        assert_eq!(epoch(6), None, "epoch 0 was never saved");
        let step = |st| retired(&s, SavePoint::Step(st), st).map(|(p, ..)| point_label(p));
        assert_eq!(step(50), Some("step 10".into()));
        assert_eq!(step(45), Some("step 10".into()));
        assert_eq!(step(40), None);
        // The final save at step 50 retires as step 50's save would; at step 45 it is no step
        // save.
        let last = |st| retired(&s, SavePoint::Final, st).map(|(p, ..)| point_label(p));
        assert_eq!(last(50), Some("step 10".into()));
        assert_eq!(last(45), None);
        let off = saving(Some(2), None, Some(10), None);
        assert!(retired(&off, SavePoint::Epoch(8), 0).is_none());
    }

    fn point_label(p: SavePoint) -> String {
        match p {
            SavePoint::Epoch(e) => format!("epoch {e}"),
            SavePoint::Step(s) => format!("step {s}"),
            other => format!("{other:?}"),
        }
    }
}
