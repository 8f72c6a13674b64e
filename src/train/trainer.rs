//! The training run: [`train`] sets a [`Session`] up ([`super::setup`]) and runs optimizer steps
//! of `batch_size × grad_accum` samples through the epochs ([`super::optimizer_step`]), logging,
//! sampling, validating and saving ([`super::saving`]) as the plan asks, and saving then
//! stopping cleanly on Ctrl-C.
//!
//! A step is an optimizer step; `max_steps`, the LR schedule and `log_step` count these.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use candle_core::Device;

use super::adapters::TrainedAdapters;
use super::data_feed::{DataFeed, Shard};
use super::ema::Ema;
use super::interrupt::Interrupt;
use super::log::{LogRecord, RunLog};
use super::loss_stats::Smoothed;
use super::micro_batch::{next_rungs, rung_lines, GaveUp};
use super::oom_policy::{retry_once_on_oom, OomExhausted};
use super::optimizer_step::{skipped_message, Optimization, StepReport};
use super::outcome::TrainOutcome;
use super::param_groups::group_names;
use super::progress::Progress;
use super::resume::{RunKey, TrainerState};
use super::run_dir::RunDir;
use super::samples::TrainingSamples;
use super::saving::{SavePoint, Saver};
use super::step::StepSettings;
use super::text_cache::TextCache;
use super::validation::{EpochPoint, Validation};
use crate::config::TrainPlan;
use crate::data::epoch_plan::MicroBatch;
use crate::data::schedule::write_schedule;
use crate::diffusion::Objective;
use crate::memory::{MemoryUsage, StepWatch};
use crate::model::layout::ModelLayout;
use crate::model::pipeline::StableDiffusion;
use crate::nn::Checkpointing;
use crate::precision::Amp;

/// How to run, beyond the plan.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub device: Device,
    pub show_progress: bool,
}

/// Runs the whole training described by `plan`: setup, optimizer steps through the epochs, and
/// saves.
pub fn train(plan: &TrainPlan, opts: &RunOptions) -> anyhow::Result<TrainOutcome> {
    let session = Session::setup(plan, opts)?;
    session.run()
}

/// The model being trained and how it computes.
pub(super) struct Model {
    pub layout: ModelLayout,
    pub sd: StableDiffusion,
    pub adapters: Option<TrainedAdapters>,
    /// Textual inversion's vectors (`mode: "textual_inversion"`).
    pub embedding: Option<super::embeddings::TrainedEmbedding>,
    pub objective: Objective,
    pub amp: Amp,
    pub resolution: usize,
    pub checkpointing: Option<Checkpointing>,
    /// Cached caption encodings, when the text encoders were released.
    pub text_cache: Option<TextCache>,
}

impl Model {
    /// The step's settings from the plan (`te_trains`: whether a text encoder trains).
    pub fn step_settings<'s>(&'s self, plan: &'s TrainPlan, te_trains: bool) -> StepSettings<'s> {
        let data = &plan.data;
        StepSettings {
            objective: &self.objective,
            flip_p: data.flip_p,
            cond_dropout: data.cond_dropout,
            shuffle_tags: data.shuffle_tags,
            keep_tags: data.keep_tags,
            tag_dropout: data.tag_dropout,
            clip_skip_layers: plan.objective.clip_skip_layers,
            caption_chunks: data.caption_chunks,
            weighted_captions: data.weighted_captions,
            caption_templates: self
                .embedding
                .as_ref()
                .map_or(&[][..], |e| e.templates.as_slice()),
            kohya_captions: data.kohya_captions.any().then_some(&data.kohya_captions),
            clock: Default::default(),
            train_text_encoder: te_trains,
            compute_dtype: self.amp.compute_dtype(),
            checkpointing: self.checkpointing.as_ref(),
            text_cache: self.text_cache.as_ref(),
            unmasked_probability: plan.objective.loss.mask.map(|m| m.unmasked_probability),
            prior_adapters: self
                .adapters
                .as_ref()
                .filter(|_| self.objective.wants_prior())
                .map(|a| a.modules.as_slice()),
        }
    }

    /// `f` with the adapters in inference mode (no dropout), as sampling and validation run.
    pub fn evaluating<T>(&mut self, f: impl FnOnce(&mut Self) -> T) -> T {
        if let Some(a) = &self.adapters {
            crate::adapter::set_training(&a.modules, false);
        }
        let result = f(self);
        if let Some(a) = &self.adapters {
            crate::adapter::set_training(&a.modules, true);
        }
        result
    }
}

/// Where the run writes, and since when.
pub(super) struct Outputs {
    pub run: RunDir,
    pub log: RunLog,
    pub started: Instant,
    pub started_unix: f64,
    /// What the caches did, for the summary.
    pub caches: Vec<String>,
    /// A data-parallel follower's scratch folder (its log), removed with it.
    pub _scratch: Option<super::data_parallel::ScratchDir>,
    /// What adapter files record of the run (kohya's metadata), on the rank that saves.
    pub kohya: Option<super::kohya_run_metadata::KohyaRunMetadata>,
}

/// Where the run is in its data.
pub(super) struct Position {
    /// The run's seed: the plan's, or the save point's when resuming.
    pub seed: u64,
    /// What a resume must share with this run.
    pub key: RunKey,
    /// The (0-based) epoch of the next step, and the steps of it already done.
    pub epoch: usize,
    pub steps_in_epoch: usize,
    /// The save point this run resumed from.
    pub resumed: Option<TrainerState>,
}

/// The parts a plan may leave off.
pub(super) struct Extras {
    /// The EMA copy of the trained parameters, when `ema_decay_rate` or `ema_strength_target`
    /// is set.
    pub ema: Option<Ema>,
    /// Sample images every `sample_steps`, when `sample_prompts` is set.
    pub samples: Option<TrainingSamples>,
    /// The held-out set, when validation is on.
    pub validation: Option<Validation>,
    /// The validation loss computed after the current step, for its log record.
    pub val_loss: Option<f64>,
    /// The other validation sets' losses, by name, for the same record.
    pub val_sets: std::collections::BTreeMap<String, f64>,
    /// `vram_limit_gb`'s hold on the rest of the card, for the whole run.
    pub vram_cap: Option<crate::memory::vram_cap::VramCap>,
    /// The progress bar's smoothed loss.
    pub smoothed: Smoothed,
    pub interrupt: Interrupt,
    /// The skipped steps since the last applied update ([`SkipCount`]), and the updates applied
    /// in this process.
    pub skips: SkipCount,
    /// Memory creep and slow steps, judged after each step ([`StepWatch`]).
    pub watch: StepWatch,
    /// The clock of `ckpt_every_n_minutes`.
    pub save_clock: super::save_schedule::SaveClock,
    /// `log_step` and when to save, as train.json last said (`load_settings_every_epoch`).
    pub live: super::settings_reload::LiveSettings,
    /// The plan train.json last resolved to, once `load_settings_every_epoch` reloaded it.
    pub reloaded: Option<Box<TrainPlan>>,
}

/// Steps skipped for a non-finite loss or gradient, counted toward
/// `max_consecutive_skipped_steps`.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct SkipCount {
    pub in_a_row: usize,
    pub applied: usize,
}

impl SkipCount {
    /// Counts `report`. An fp16 overflow that lowered the loss scale with a finite loss is the
    /// scaler doing its work, not a failure, until the scale is down to 1.
    fn count(&mut self, report: &StepReport) {
        if report.applied {
            self.in_a_row = 0;
            self.applied += 1;
            return;
        }
        let scaler_at_work = report.loss.is_finite()
            && matches!(report.scale, crate::precision::ScaleChange::BackedOff(s) if s > 1.0);
        if !scaler_at_work {
            self.in_a_row += 1;
        }
    }
}

/// Everything a run holds between setup and the final save.
pub(super) struct Session<'a> {
    pub plan: &'a TrainPlan,
    pub opts: &'a RunOptions,
    pub model: Model,
    pub feed: DataFeed,
    pub opt: Optimization,
    pub outputs: Outputs,
    pub pos: Position,
    pub extras: Extras,
}

/// Whether the epoch loop goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Continue,
    Stop,
}

impl Session<'_> {
    /// Whether this process writes the run's outputs: always, but for data-parallel ranks
    /// other than 0.
    fn leads(&self) -> bool {
        self.opt.dist.as_ref().is_none_or(|l| l.leads())
    }

    /// The part of each step this process trains.
    fn shard(&self) -> Shard {
        self.opt.dist.as_ref().map_or(Shard::WHOLE, |l| Shard {
            rank: l.rank(),
            world: l.world(),
        })
    }

    /// Whether to stop for Ctrl-C; data-parallel ranks agree, so all stop at the same step.
    fn interrupt_agreed(&mut self) -> anyhow::Result<bool> {
        let asked = self.extras.interrupt.requested();
        match self.opt.dist.as_mut() {
            Some(link) => super::data_parallel::agree_flag(link.coll.as_mut(), asked),
            None => Ok(asked),
        }
    }

    /// The epoch loop: steps, progress, logs, periodic and final saves, Ctrl-C. A resumed run
    /// starts at its save point's epoch, past the steps of it already done.
    pub(super) fn run(mut self) -> anyhow::Result<TrainOutcome> {
        let plan = self.plan;
        let progress = Progress::new(self.opt.total_steps, self.opts.show_progress);
        let mut out = self.initial_outcome();
        let max_epochs = plan.max_epochs.map_or(usize::MAX, |e| e as usize);
        let (first_epoch, skip) = (self.pos.epoch, self.pos.steps_in_epoch);
        let at_start = self
            .extras
            .samples
            .as_ref()
            .is_some_and(|s| s.plan.set.at_start);
        if out.steps == 0 && at_start {
            self.sample_if_due(0, true, &progress)?;
        }
        if out.steps == 0
            && self
                .extras
                .validation
                .as_ref()
                .is_some_and(|v| v.before_training)
        {
            // Printed and kept in the outcome at step 0; no step record carries it.
            self.validate(&mut out, &progress)?;
            self.extras.val_loss = None;
            self.extras.val_sets.clear();
        }
        for epoch in first_epoch..max_epochs {
            if plan.load_settings_every_epoch && epoch > first_epoch {
                self.reload_settings(epoch, &progress)?;
            }
            let skip = if epoch == first_epoch { skip } else { 0 };
            if self.train_epoch(epoch, skip, &mut out, &progress)? == Flow::Stop {
                break;
            }
            out.epochs_completed = epoch + 1;
            (self.pos.epoch, self.pos.steps_in_epoch) = (epoch + 1, 0);
            let by_epoch = self.extras.samples.as_ref();
            if by_epoch.is_some_and(|s| s.due_at_epoch_end(epoch + 1)) {
                self.sample_if_due(out.steps, true, &progress)?;
            }
            let last = out.steps >= self.opt.total_steps || epoch + 1 == max_epochs;
            if super::save_schedule::epoch_save_due(&self.extras.live.saving, epoch + 1, last) {
                let point = SavePoint::Epoch(epoch + 1);
                let saved = self.save_point(point, &out, epoch + 1, &progress)?;
                out.saved.extend(saved);
            }
            if last {
                break;
            }
        }
        let started_at = self.pos.resumed.as_ref().map_or(0, |s| s.steps);
        // A run whose every skip was the fp16 scaler lowering its scale is left to the scaler.
        let skips = self.extras.skips;
        if out.steps > started_at && skips.applied == 0 && skips.in_a_row > 0 {
            let epoch = out.epochs_completed.saturating_sub(1);
            let skipped = out.steps - started_at;
            return Err(self.stop_after_skips(&out, epoch, skipped, &progress));
        }
        if !out.interrupted {
            let epochs = out.epochs_completed;
            let saved = self.save_point(SavePoint::Final, &out, epochs, &progress)?;
            out.saved.extend(saved);
        }
        progress.finish();
        out.wall_secs = self.outputs.started.elapsed().as_secs_f64();
        out.memory = read_memory(&self.opts.device);
        Ok(out)
    }

    /// The steps of `epoch`, from its `skip`-th.
    fn train_epoch(
        &mut self,
        epoch: usize,
        skip: usize,
        out: &mut TrainOutcome,
        progress: &Progress,
    ) -> anyhow::Result<Flow> {
        let seed = self.pos.seed;
        let batches = self.feed.epoch(seed, epoch);
        if self.plan.data.write_schedule && skip == 0 && self.leads() {
            let items = &self.feed.dataset.items;
            write_schedule(&self.outputs.run.path, epoch, &batches.batches, items)?;
        }
        out.repeated_samples += batches.repeated;
        let steps_in_epoch = self.feed.steps_in(&batches);
        let steps = self.feed.steps(&batches, skip);
        let left = self.opt.total_steps.saturating_sub(out.steps);
        let shard = self.shard();
        self.feed
            .start(seed, &steps[..steps.len().min(left)], out.steps, shard);
        for (i, micro) in steps.iter().enumerate().map(|(k, m)| (k + skip, m)) {
            if out.steps >= self.opt.total_steps {
                return Ok(Flow::Stop);
            }
            let report = self.one_step(micro, epoch, out, progress)?;
            let last_of_epoch = i + 1 == steps_in_epoch;
            (self.pos.epoch, self.pos.steps_in_epoch) = match last_of_epoch {
                true => (epoch + 1, 0),
                false => (epoch, i + 1),
            };
            let Some(report) = report else {
                continue;
            };
            if last_of_epoch {
                out.epochs_completed = epoch + 1;
            }
            let at = EpochPoint {
                epoch,
                done: i + 1,
                steps_in_epoch,
            };
            self.validate_if_due(out, at, progress)?;
            self.record_step(&report, out, epoch, progress)?;
            let limit = self.plan.max_consecutive_skipped_steps;
            if limit.is_some_and(|n| self.extras.skips.in_a_row >= n) {
                let in_a_row = self.extras.skips.in_a_row;
                return Err(self.stop_after_skips(out, epoch, in_a_row, progress));
            }
            self.sample_if_due(out.steps, false, progress)?;
            if self.interrupt_agreed()? {
                out.interrupted = true;
                let point = SavePoint::Interrupted(out.steps);
                let saved = self.save_point(point, out, epoch + 1, progress)?;
                out.saved.extend(saved);
                return Ok(Flow::Stop);
            }
            let (saving, total) = (&self.extras.live.saving, self.opt.total_steps);
            let now = std::time::Instant::now();
            if self
                .extras
                .save_clock
                .step_save_due(saving, out.steps, total, now)
            {
                let point = SavePoint::Step(out.steps);
                let saved = self.save_point(point, out, epoch + 1, progress)?;
                out.saved.extend(saved);
            }
        }
        Ok(Flow::Continue)
    }

    /// One optimizer step over the samples of `micro` (the step's micro-batches), counted in
    /// `out`; the EMA follows an applied update. A step whose images all failed to decode
    /// passes with no update and no report, as a non-finite one passes with no update.
    fn one_step(
        &mut self,
        micro: &[MicroBatch],
        epoch: usize,
        out: &mut TrainOutcome,
        progress: &Progress,
    ) -> anyhow::Result<Option<StepReport>> {
        let dist = &mut self.opt.dist;
        let data = self
            .feed
            .next(self.pos.seed, out.steps, micro, |own| match dist {
                Some(link) => super::data_parallel::agree_failures(link.coll.as_mut(), own),
                None => Ok(own),
            })?;
        for (path, why) in &data.failed {
            let step = out.steps + 1;
            progress.println(format!(
                "warning: step {step}: left out {}: {why}",
                path.display()
            ));
        }
        out.failed_samples += data.failed.len();
        if data.is_empty() {
            progress.println(format!(
                "warning: step {}: skipped, none of its images could be decoded",
                out.steps + 1
            ));
            out.skipped_steps += 1;
            out.steps += 1;
            return Ok(None);
        }
        if let Some(a) = &self.model.adapters {
            a.begin_step(out.steps);
        }
        let mut settings = self
            .model
            .step_settings(self.plan, self.opt.text_encoder_trains());
        settings.clock = super::step::CaptionClock {
            epoch: Some(self.pos.epoch),
            step: out.steps,
            total_steps: self.opt.total_steps,
        };
        let clip = self.plan.clip_grad_norm.map(|max| crate::optim::GradClip {
            max,
            scope: self.plan.clip_scope,
        });
        let device = &self.opts.device;
        let result = self
            .opt
            .step(&self.model.sd, &settings, &data, out.steps, clip, device);
        let mut report = match result {
            Ok(report) => report,
            Err(e) => return Err(self.stop_after_oom(e, out, epoch, progress)),
        };
        // kohya's max-norm regularization, after the update and before the EMA follows it.
        let cap = self
            .plan
            .adapter
            .as_ref()
            .and_then(|a| a.scale_weight_norms);
        if let (Some(cap), Some(a), true) = (cap, &self.model.adapters, report.applied) {
            report.max_norm = crate::adapter::max_norm::apply_max_norm(&a.modules, cap)
                .with_context(|| format!("scale_weight_norms at step {}", out.steps + 1))?;
        }
        for line in &report.retries {
            progress.println(line.clone());
        }
        out.micro = self.opt.micro;
        out.images_seen += report.images;
        if !report.applied {
            out.skipped_steps += 1;
            progress.println(skipped_message(out.steps + 1, report.scale));
        }
        out.steps += 1;
        out.losses.push(report.loss);
        self.extras.skips.count(&report);
        if let Some(ema) = &mut self.extras.ema {
            // After the update the step applied; a skipped step leaves the EMA as it is.
            if report.applied && ema.due(out.steps) {
                ema.update(&self.opt.params, out.steps)
                    .with_context(|| format!("EMA update at step {}", out.steps))?;
            }
        }
        Ok(Some(report))
    }
}

impl Session<'_> {
    /// The outcome before the first step: empty, or the save point's counters when resuming.
    fn initial_outcome(&self) -> TrainOutcome {
        let mut out = TrainOutcome {
            run_dir: self.outputs.run.path.clone(),
            steps: 0,
            epochs_completed: 0,
            images_seen: 0,
            losses: Vec::new(),
            skipped_steps: 0,
            skipped_images: self.feed.dataset.skipped.len(),
            saved: Vec::new(),
            interrupted: false,
            wall_secs: 0.0,
            memory: None,
            micro: self.opt.micro,
            vram_cap: self.extras.vram_cap.as_ref().map(|c| c.describe()),
            val_losses: Vec::new(),
            val_images: self
                .extras
                .validation
                .as_ref()
                .map_or(0, |v| v.items().count()),
            buckets: self.feed.bucket_counts(),
            repeated_samples: 0,
            failed_samples: 0,
            caches: self.outputs.caches.clone(),
        };
        if let Some(st) = &self.pos.resumed {
            out.steps = st.steps;
            out.epochs_completed = st.epochs_completed;
            out.images_seen = st.images_seen;
            out.losses = st.losses.clone();
            out.skipped_steps = st.skipped_steps;
        }
        out
    }

    /// `load_settings_every_epoch`: reads train.json again before `epoch` and applies what a
    /// running run can change (the objective, `log_step`, when to save).
    fn reload_settings(&mut self, epoch: usize, progress: &Progress) -> anyhow::Result<()> {
        use super::settings_reload::{apply, reload, Reload};
        let last = self.extras.reloaded.as_deref().unwrap_or(self.plan);
        match reload(last) {
            Reload::Unchanged => {}
            Reload::Failed(why) => progress.println(format!(
                "load_settings_every_epoch: epoch {}: train.json not reloaded, the settings stay \
                 as they were: {why}",
                epoch + 1
            )),
            Reload::Changed {
                plan,
                applied,
                ignored,
            } => {
                if applied.iter().any(|k| k == "objective") {
                    self.model.objective =
                        super::setup::build_objective(&plan, &self.model.layout)?;
                    if let Some(samples) = &mut self.extras.samples {
                        let zero_snr = plan.objective.zero_terminal_snr;
                        samples.follow_schedule(&self.model.layout, zero_snr)?;
                    }
                }
                apply(&mut self.extras.live, &plan);
                let list = |keys: &[String]| keys.join(", ");
                if !applied.is_empty() {
                    progress.println(format!(
                        "load_settings_every_epoch: epoch {}: applied {}",
                        epoch + 1,
                        list(&applied)
                    ));
                }
                if !ignored.is_empty() {
                    progress.println(format!(
                        "load_settings_every_epoch: epoch {}: {} changed but take effect only in \
                         a new run",
                        epoch + 1,
                        list(&ignored)
                    ));
                }
                self.extras.reloaded = Some(plan);
            }
        }
        Ok(())
    }

    /// Each group's optimizer estimate after the step (`<group>/d`, …; the step count `k` left
    /// out), for the log.
    fn estimates(&self) -> std::collections::BTreeMap<String, f64> {
        self.opt
            .groups
            .iter()
            .flat_map(|g| {
                g.optimizer
                    .estimate_values()
                    .into_iter()
                    .filter(|(name, _)| *name != "k")
                    .map(move |(name, v)| (format!("{}/{name}", g.name), v))
            })
            .collect()
    }

    /// The learning rate of the group called `name` in `lrs` (one per group, in order).
    fn group_lr(&self, lrs: &[f64], name: &str) -> Option<f64> {
        let i = self.opt.groups.iter().position(|g| g.name == name)?;
        lrs.get(i).copied()
    }

    /// The progress line and, every `log_step` steps, the JSONL record.
    fn record_step(
        &mut self,
        report: &StepReport,
        out: &TrainOutcome,
        epoch: usize,
        progress: &Progress,
    ) -> anyhow::Result<()> {
        self.extras.smoothed.push(report.loss);
        let smoothed = self.extras.smoothed.get();
        // Driver counters, not a stream sync. A failed reading only costs the display: it must
        // not end a run.
        let memory = read_memory(&self.opts.device);
        let (secs, watched) = watched_reading(out.steps, report.secs, memory);
        let warnings = self.extras.watch.observe(
            out.steps,
            secs,
            report.pixels as f64,
            watched.as_ref(),
            !report.retries.is_empty(),
        );
        for w in &warnings {
            progress.println(format!("warning: {}", w.message()));
        }
        let lr = report.lrs[0];
        progress.update(
            out.steps,
            epoch + 1,
            smoothed,
            lr,
            out.images_seen,
            memory.as_ref(),
        );
        let micro = self.opt.micro;
        let record = LogRecord {
            step: out.steps,
            epoch: epoch + 1,
            loss: report.loss,
            lr_unet: self.group_lr(&report.lrs, "unet"),
            lr_text_encoder: self.group_lr(&report.lrs, "text_encoder"),
            grad_norm: self
                .plan
                .optimizer
                .log_grad_norm
                .then_some(report.grad_norm),
            images: out.images_seen,
            images_per_s: report.images as f64 / report.secs.max(1e-9),
            time_s: self.outputs.started.elapsed().as_secs_f64(),
            skipped_nonfinite: !report.applied,
            loss_scale: (self.model.amp == Amp::Fp16).then(|| self.opt.scaler.scale()),
            micro_batch: (micro.oom_retries > 0).then_some(micro.size),
            val_loss: self.extras.val_loss.take(),
            val_sets: std::mem::take(&mut self.extras.val_sets),
            estimates: self.estimates(),
            oom_retries: micro.oom_retries,
            memory,
            warnings,
            max_norm: report.max_norm,
        };
        let due = out.steps.is_multiple_of(self.extras.live.log_step as usize)
            || out.steps == 1
            || out.steps == self.opt.total_steps
            || !report.retries.is_empty()
            || record.val_loss.is_some()
            || !record.warnings.is_empty();
        match due {
            true => self.outputs.log.write(&record)?,
            false => self.outputs.log.hold(record),
        }
        Ok(())
    }

    /// The validation loss after this step when it is due, printed and kept for the step's log
    /// record.
    fn validate_if_due(
        &mut self,
        out: &mut TrainOutcome,
        at: EpochPoint,
        progress: &Progress,
    ) -> anyhow::Result<()> {
        let Some(val) = &self.extras.validation else {
            return Ok(());
        };
        if !val.due(out.steps, self.opt.total_steps, at) {
            return Ok(());
        }
        self.validate(out, progress)
    }

    /// Scores every validation set now: the first set's loss is the step's `val_loss`, the others
    /// go to its `val_sets` by name (with their mean, EveryDream2's `_all_val_combined`, when
    /// there are several).
    fn validate(&mut self, out: &mut TrainOutcome, progress: &Progress) -> anyhow::Result<()> {
        if !self.leads() {
            return Ok(());
        }
        let Some(val) = &mut self.extras.validation else {
            return Ok(());
        };
        let te_trains = self.opt.text_encoder_trains();
        let (plan, micro) = (self.plan, self.opt.micro.size);
        let model = &mut self.model;
        let losses = self.opt.with_eval_weights(|_| {
            model.evaluating(|m| {
                let settings = m.step_settings(plan, te_trains);
                val.losses(&m.sd, &settings, micro)
            })
        });
        let losses = val.logged(losses.context("validation loss")?);
        let Some((_, loss)) = losses.first().cloned() else {
            return Ok(());
        };
        let text: Vec<String> = losses.iter().map(|(n, l)| format!("{n} {l:.4}")).collect();
        progress.println(format!(
            "step {}: validation loss {}",
            out.steps,
            text.join(", ")
        ));
        out.val_losses.push((out.steps, loss));
        self.extras.val_loss = Some(loss);
        if losses.len() > 1 {
            let mean = losses.iter().map(|(_, l)| l).sum::<f64>() / losses.len() as f64;
            self.extras.val_sets = losses.into_iter().skip(1).collect();
            self.extras
                .val_sets
                .insert("_all_val_combined".into(), mean);
        }
        Ok(())
    }

    /// Draws the samples of step `step` when they are due (or `force`d, before the first step).
    fn sample_if_due(
        &mut self,
        step: usize,
        force: bool,
        progress: &Progress,
    ) -> anyhow::Result<()> {
        if !self.leads() {
            return Ok(());
        }
        let Some(samples) = &mut self.extras.samples else {
            return Ok(());
        };
        if !force && !samples.due(step) {
            return Ok(());
        }
        let (model, ema) = (&mut self.model, self.extras.ema.as_ref());
        let (tensorboard, device) = (self.outputs.log.tensorboard.as_mut(), &self.opts.device);
        self.opt.with_eval_weights(|opt| {
            let round = super::samples::Round {
                ema,
                params: &opt.params,
                micro: opt.micro.size,
                tensorboard,
                device,
            };
            model.evaluating(|m| samples.draw(&mut m.sd, m.amp, round, step, progress))
        })
    }

    /// The trainer's state after `out`'s steps, for a save point.
    fn trainer_state(&self, out: &TrainOutcome) -> TrainerState {
        let groups = group_names(&self.opt.groups);
        let mut st = TrainerState::new(out.steps, self.pos.key.clone(), groups, self.pos.seed);
        (st.epoch, st.steps_in_epoch) = (self.pos.epoch, self.pos.steps_in_epoch);
        st.epochs_completed = out.epochs_completed;
        st.images_seen = out.images_seen;
        st.skipped_steps = out.skipped_steps;
        st.losses = out.losses.clone();
        st.micro = self.opt.micro;
        st.scaler = self.opt.scaler.state();
        st.total_steps = Some(self.opt.total_steps);
        st.world_size = Some(self.opt.dist.as_ref().map_or(1, |l| l.world()));
        st
    }

    /// Saves at `point` ([`Saver::save_point`]), the held log record of the step first. An
    /// out-of-memory error frees the pool and retries once; a second one gives up.
    fn save_point(
        &mut self,
        point: SavePoint,
        out: &TrainOutcome,
        epoch: usize,
        progress: &Progress,
    ) -> anyhow::Result<Vec<PathBuf>> {
        if !self.leads() {
            return Ok(Vec::new());
        }
        self.outputs.log.write_held()?;
        let state = self.trainer_state(out);
        let live = self.extras.reloaded.as_deref().unwrap_or(self.plan);
        let layout = super::trained_schedule::trained_layout(
            &self.model.layout,
            live.objective.zero_terminal_snr,
        )?;
        let saver = Saver {
            sd: &self.model.sd,
            layout: &layout,
            plan: self.plan,
            adapters: self.model.adapters.as_ref(),
            embedding: self.model.embedding.as_ref(),
            run: &self.outputs.run,
            resolution: self.model.resolution,
            images: self.feed.train_samples(),
            kohya: self.outputs.kohya.as_ref(),
            started_unix: self.outputs.started_unix,
            seed: self.pos.seed,
            ema: self.extras.ema.as_ref(),
            steps_done: out.steps,
        };
        let place = || format!("while saving at step {}", out.steps);
        retry_once_on_oom(&self.opts.device, place, || {
            saver.save_point(&mut self.opt, &state, point, epoch, progress)
        })
    }

    /// What a failed step becomes. An [`OomExhausted`] saves the last completed step as an
    /// `errored` checkpoint and becomes [`GaveUp`], with the rungs to take for this run; any
    /// other error is returned as it is.
    fn stop_after_oom(
        &mut self,
        e: anyhow::Error,
        out: &TrainOutcome,
        epoch: usize,
        progress: &Progress,
    ) -> anyhow::Error {
        let Some(exhausted) = e.downcast_ref::<OomExhausted>() else {
            return e;
        };
        let place = format!("{} ({})", exhausted.place, exhausted.oom.detail);
        let saved = match self.save_errored(out, epoch, progress) {
            Ok(paths) => format!(
                "the last completed step ({}) is saved in {paths}",
                out.steps
            ),
            Err(err) => format!("saving the last completed step failed too: {err:#}"),
        };
        progress.finish();
        let every_block =
            self.model.checkpointing.is_some() && self.model.sd.unet.checkpointed.is_all();
        let rungs = next_rungs(
            self.plan,
            self.model.amp,
            self.model.resolution,
            every_block,
        );
        GaveUp {
            place,
            saved,
            rungs: rung_lines(&rungs),
        }
        .into()
    }
}

impl Session<'_> {
    /// The run trained nothing for `in_a_row` steps in a row (`max_consecutive_skipped_steps`, or
    /// all of this run's steps):
    /// saves the last completed step as an `errored` checkpoint (the skipped steps left the
    /// weights as the last applied update made them) and becomes [`NonFiniteStop`].
    fn stop_after_skips(
        &mut self,
        out: &TrainOutcome,
        epoch: usize,
        in_a_row: usize,
        progress: &Progress,
    ) -> anyhow::Error {
        let saved = match self.save_errored(out, epoch, progress) {
            Ok(paths) => format!("the weights as of the last applied update are saved in {paths}"),
            Err(err) => format!("saving them failed too: {err:#}"),
        };
        progress.finish();
        NonFiniteStop {
            in_a_row,
            step: out.steps,
            last_loss: out.losses.last().copied().unwrap_or(f64::NAN),
            saved,
            rungs: rung_lines(&nonfinite_rungs(
                self.plan,
                self.model.amp,
                &self.model.layout,
            )),
        }
        .into()
    }
}

impl Session<'_> {
    /// Saves the last completed step as an `errored` checkpoint, for a run that stops on an
    /// error; returns the paths written, comma-separated.
    fn save_errored(
        &mut self,
        out: &TrainOutcome,
        epoch: usize,
        progress: &Progress,
    ) -> anyhow::Result<String> {
        let paths = self.save_point(SavePoint::Errored(out.steps), out, epoch + 1, progress)?;
        let shown: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        Ok(shown.join(", "))
    }
}

/// The run stopped because its steps were skipped for a non-finite loss or gradient.
#[derive(Debug, thiserror::Error)]
#[error(
    "the run stopped at step {step}: {in_a_row} steps in a row were skipped for a non-finite \
     loss or gradient (last loss {last_loss}), so nothing was learned from them; {saved}.\n\
     To train, try, in this order:\n{rungs}"
)]
pub struct NonFiniteStop {
    pub in_a_row: usize,
    pub step: usize,
    pub last_loss: f64,
    pub saved: String,
    pub rungs: String,
}

/// What to change when the loss or gradients go non-finite, most likely first: a model whose
/// own files hold NaN or Inf (read again now, [`crate::model::nonfinite_weights::first_nonfinite`]) before the settings.
fn nonfinite_rungs(plan: &TrainPlan, amp: Amp, layout: &ModelLayout) -> Vec<String> {
    let mut rungs = Vec::new();
    if let Some(bad) = crate::model::nonfinite_weights::first_nonfinite(layout) {
        rungs.push(format!(
            "replace the model: tensor `{}` in {} holds {} (the base weights are broken; no \
             setting below can help)",
            bad.tensor,
            bad.file.display(),
            bad.value
        ));
    }
    let lr = plan.optimizer.unet.lr;
    rungs.push(format!(
        "lower the learning rate (the UNet's is {lr:e}; try {:e})",
        lr / 10.0
    ));
    if amp == Amp::Fp16 {
        rungs.push("use amp bf16 instead of fp16 (bf16 has fp32's range)".into());
    }
    if plan.clip_grad_norm.is_none() {
        rungs.push("set clip_grad_norm (1.0 is common)".into());
    }
    rungs
}

/// The step time and memory reading the watch judges: the step's own, or under the unit tests
/// what a test injected for (1-based) `step` ([`watch_inject`]).
fn watched_reading(
    step: usize,
    secs: f64,
    memory: Option<MemoryUsage>,
) -> (f64, Option<MemoryUsage>) {
    #[cfg(test)]
    if let Some(injected) = watch_inject::reading(step) {
        return injected;
    }
    let _ = step;
    (secs, memory)
}

/// Step times and memory readings injected for the watch, for the unit tests (not a setting).
#[cfg(test)]
pub(crate) mod watch_inject {
    use std::cell::RefCell;

    use crate::memory::MemoryUsage;

    type Hook = Box<dyn Fn(usize) -> (f64, Option<MemoryUsage>)>;

    thread_local! {
        static HOOK: RefCell<Option<Hook>> = RefCell::new(None);
    }

    /// `f(step)` replaces each step's time and memory reading, on this thread.
    pub fn set(f: impl Fn(usize) -> (f64, Option<MemoryUsage>) + 'static) {
        HOOK.with(|h| *h.borrow_mut() = Some(Box::new(f)));
    }

    pub fn clear() {
        HOOK.with(|h| *h.borrow_mut() = None);
    }

    pub(super) fn reading(step: usize) -> Option<(f64, Option<MemoryUsage>)> {
        HOOK.with(|h| h.borrow().as_ref().map(|f| f(step)))
    }
}

/// The device's memory reading, or none where it cannot be read.
pub(super) fn read_memory(device: &Device) -> Option<MemoryUsage> {
    MemoryUsage::read(device).ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precision::ScaleChange;

    fn report(applied: bool, loss: f64, scale: ScaleChange) -> StepReport {
        StepReport {
            loss,
            grad_norm: 0.0,
            applied,
            lrs: vec![1e-4],
            images: 1,
            pixels: 4096,
            secs: 0.1,
            scale,
            retries: Vec::new(),
            max_norm: None,
        }
    }

    /// Skips count in a row until an update applies; an fp16 overflow with a finite loss that
    /// lowered the scale is not counted until the scale reaches 1 (a rule that counted every
    /// backoff would stop fp16 runs in their first steps; one that never counted them would
    /// never stop a NaN fp16 run).
    #[test]
    fn skipped_steps_count_in_a_row_and_fp16_backoffs_only_at_scale_one() {
        let mut n = SkipCount::default();
        n.count(&report(false, f64::NAN, ScaleChange::Unchanged));
        n.count(&report(false, 0.3, ScaleChange::Unchanged));
        assert_eq!((n.in_a_row, n.applied), (2, 0));
        n.count(&report(false, 0.3, ScaleChange::BackedOff(1024.0)));
        assert_eq!(n.in_a_row, 2);
        n.count(&report(false, 0.3, ScaleChange::BackedOff(1.0)));
        n.count(&report(false, f64::NAN, ScaleChange::BackedOff(512.0)));
        assert_eq!(n.in_a_row, 4);
        n.count(&report(true, 0.3, ScaleChange::Unchanged));
        assert_eq!((n.in_a_row, n.applied), (0, 1));
    }
}
