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
        let suffixes: &[&str] = match self.ema {
            Some(_) => &["", EMA_SUFFIX],
            None => &[""],
        };
        suffixes
            .iter()
            .flat_map(|sfx| match (self.adapters, self.embedding) {
                (None, None) => {
                    let dir = with_suffix(&self.run.step_dir(step), sfx);
                    vec![self.single_file_path(&dir), dir]
                }
                _ => vec![self.adapter_path(SavePoint::Step(step), sfx)],
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
            crate::model::export::save_single_file(self.layout, &file, &updated, dtype)
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
        let metadata = [
            ("token_string", e.token_string.clone()),
            ("num_vectors_per_token", e.num_vectors.to_string()),
            ("steps", steps.to_string()),
            ("epoch", epoch.to_string()),
            ("base_model", self.plan.model.clone()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
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
        let name = self.adapter_name(point, suffix);
        let path = self.adapter_path(point, suffix);
        let info = SaveInfo {
            steps,
            epoch,
            num_train_images: self.images,
            resolution: self.resolution,
            seed: self.seed,
            unet_lr: groups[0].base_lr,
            text_encoder_lr: groups.get(1).map(|g| g.base_lr),
            output_name: &name,
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
