//! The training loop: load the model and data from a [`TrainPlan`], then run optimizer steps of
//! `batch_size × grad_accum` samples through epochs, logging, saving diffusers folders every
//! `save_every_n_epochs` and at the end, and saving then stopping cleanly on Ctrl-C. With EMA on
//! ([`super::ema`]), each save also writes the EMA weights under an `-ema` name.
//!
//! A step is an optimizer step; `max_steps`, the LR schedule and `log_step` count these.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor, Var};

use super::accumulate::{Accumulated, GradAccumulator};
use super::adapters::{self, SaveInfo, TrainedAdapters};
use super::data_feed::{self, DataFeed, StepData};
use super::ema::Ema;
use super::interrupt::Interrupt;
use super::latent_cache::{self, CacheSpec};
use super::log::{tensorboard_scalars, JsonlLog, LogRecord};
use super::loss_stats::{first_last_means, Smoothed};
use super::micro_batch::{next_rungs, rung_lines, GaveUp, MicroBatching};
use super::oom::{find_oom, injected, OutOfMemory};
use super::progress::Progress;
use super::resume::{self, RunKey, TrainerState};
use super::run_dir::RunDir;
use super::samples::TrainingSamples;
use super::step::{forward_backward, prepare_batch, sample_rngs, SampleData, StepSettings};
use super::te_freeze::text_encoder_param_trains;
use super::text_cache::TextCache;
use super::validation::Validation;
use crate::config::{CacheLatents, EmaDevice, TextCacheDecision};
use crate::config::{OptimizerKind, ParamGroupPlan};
use crate::config::{TrainMode, TrainPlan};
use crate::data::epoch_plan::BucketCount;
use crate::data::{load_data_root_limited, LoadedDataset};
use crate::diffusion::{NoiseSchedule, Objective, ObjectiveConfig};
use crate::memory::{prepare_device, trim_pool, DeviceSettings, MemoryUsage};
use crate::model::family::ModelLayout;
use crate::model::files::Component;
use crate::model::pipeline::{LoadOptions, StableDiffusion};
use crate::model::source::ModelSource;
use crate::nn::Checkpointing;
use crate::optim::{
    clip_grad_norm, Adafactor, AdafactorParams, AdamW, AdamW8bit, AdamWParams, GroupOptimizer,
    Lion, LionParams, LrSchedule, OptimError, Optimizer, StepCheck, UpdateRule,
};
use crate::precision::{scaler_for, Amp, LossScaler, ScaleChange};
use crate::sample::UnetRun;
use crate::tensorboard::EventWriter;

/// How to run, beyond the plan.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub device: Device,
    pub show_progress: bool,
}

/// What a finished (or interrupted) run did.
#[derive(Debug, Clone)]
pub struct TrainOutcome {
    pub run_dir: PathBuf,
    pub steps: usize,
    pub epochs_completed: usize,
    pub images_seen: usize,
    pub losses: Vec<f64>,
    pub skipped_steps: usize,
    pub skipped_images: usize,
    pub saved: Vec<PathBuf>,
    pub interrupted: bool,
    pub wall_secs: f64,
    /// Memory at the end of the run, with the run's peak (device pool on CUDA, RSS on the CPU).
    pub memory: Option<MemoryUsage>,
    /// The micro-batch size at the end and the out-of-memory retries that set it.
    pub micro: MicroBatching,
    /// `vram_limit_gb` in force, described (`12.0 GiB of a 79.6 GiB card …`).
    pub vram_cap: Option<String>,
    /// `(step, loss)` of each validation, and the validation set's size.
    pub val_losses: Vec<(usize, f64)>,
    pub val_images: usize,
    /// Images per aspect bucket.
    pub buckets: Vec<BucketCount>,
    /// Samples repeated to fill runt batches, over the run's epochs.
    pub repeated_samples: usize,
    /// Samples left out of a step because their file failed to decode.
    pub failed_samples: usize,
    /// What the latent and text-encoder caches did, in words.
    pub caches: Vec<String>,
}

impl TrainOutcome {
    /// Mean loss of the first and last 20% of steps.
    pub fn first_last_loss(&self) -> Option<(f64, f64)> {
        first_last_means(&self.losses, 0.2)
    }
}

/// One optimizer over one parameter group, with its schedule.
struct Group {
    name: &'static str,
    optimizer: Box<dyn Optimizer>,
    /// The group's parameters, for clipping and the gradient check.
    vars: Vec<Var>,
    /// Their names in the optimizer state (and, prefixed by the group, in a save point).
    names: Vec<String>,
    schedule: LrSchedule,
    base_lr: f64,
}

/// The optimizer a group's plan names, over `params`.
pub(crate) fn build_optimizer(
    plan: &ParamGroupPlan,
    params: Vec<(String, Var)>,
) -> crate::optim::Result<GroupOptimizer> {
    GroupOptimizer::new(update_rule(plan)?, params, plan.lr)
}

/// The update rule a group's plan names.
pub(crate) fn update_rule(plan: &ParamGroupPlan) -> crate::optim::Result<Box<dyn UpdateRule>> {
    let adam = AdamWParams {
        lr: plan.lr,
        beta1: plan.betas.0,
        beta2: plan.betas.1,
        eps: plan.epsilon,
        weight_decay: plan.weight_decay,
    };
    let lion = LionParams {
        beta1: plan.betas.0,
        beta2: plan.betas.1,
        weight_decay: plan.weight_decay,
    };
    Ok(match plan.optimizer {
        OptimizerKind::AdamW => Box::new(AdamW::rule(adam)?),
        OptimizerKind::AdamW8bit => Box::new(AdamW8bit::rule(adam)?),
        OptimizerKind::Lion => Box::new(Lion::rule(lion, false)?),
        OptimizerKind::Lion8bit => Box::new(Lion::rule(lion, true)?),
        OptimizerKind::Adafactor => Box::new(Adafactor::rule(AdafactorParams {
            eps: plan.adafactor.eps,
            clip_threshold: plan.adafactor.clip_threshold,
            decay_rate: plan.adafactor.decay_rate,
            beta1: plan.adafactor.beta1,
            weight_decay: plan.weight_decay,
            scale_parameter: plan.adafactor.scale_parameter,
        })?),
    })
}

impl Group {
    fn new(
        name: &'static str,
        params: Vec<(String, Var)>,
        plan: &ParamGroupPlan,
        total_steps: u64,
    ) -> anyhow::Result<Self> {
        let resolved = plan.schedule.resolve(total_steps);
        let schedule = LrSchedule {
            kind: resolved.kind,
            warmup_steps: resolved.warmup_steps as usize,
            decay_steps: resolved.decay_steps as usize,
        };
        schedule
            .validate(plan.lr)
            .with_context(|| format!("{name} lr schedule"))?;
        let vars = params.iter().map(|(_, v)| v.clone()).collect();
        let names = params.iter().map(|(n, _)| n.clone()).collect();
        let optimizer =
            build_optimizer(plan, params).with_context(|| format!("{name} optimizer"))?;
        Ok(Self {
            name,
            optimizer: Box::new(optimizer),
            vars,
            names,
            schedule,
            base_lr: plan.lr,
        })
    }

    fn set_lr_for_step(&mut self, step: usize) -> f64 {
        let lr = self.schedule.lr_at(self.base_lr, step);
        self.optimizer.set_learning_rate(lr);
        lr
    }
}

/// Runs the whole training described by `plan`: setup, optimizer steps through the epochs, and
/// saves.
pub fn train(plan: &TrainPlan, opts: &RunOptions) -> anyhow::Result<TrainOutcome> {
    let session = Session::setup(plan, opts)?;
    session.run()
}

/// Everything a run holds between setup and the final save.
struct Session<'a> {
    plan: &'a TrainPlan,
    opts: &'a RunOptions,
    started: Instant,
    started_unix: f64,
    interrupt: Interrupt,
    layout: ModelLayout,
    sd: StableDiffusion,
    adapters: Option<TrainedAdapters>,
    resolution: usize,
    feed: DataFeed,
    /// Cached caption encodings, when the text encoders were released.
    text_cache: Option<TextCache>,
    /// What the caches did, for the summary.
    caches: Vec<String>,
    objective: Objective,
    total_steps: usize,
    groups: Vec<Group>,
    /// Every trainable parameter, over all groups.
    params: Vec<Var>,
    run: RunDir,
    log: JsonlLog,
    /// TensorBoard event files beside the log (`log_with`); `None` when off. Anything may add to
    /// them, e.g. sample images with [`EventWriter::add_image_png`].
    tensorboard: Option<EventWriter>,
    amp: Amp,
    scaler: Box<dyn LossScaler>,
    checkpointing: Option<Checkpointing>,
    /// The micro-batch size in force (halved by out-of-memory retries).
    micro: MicroBatching,
    /// The last step's log record when `log_step` skipped it, until a save writes it.
    unlogged: Option<LogRecord>,
    /// The run's seed: the plan's, or the save point's when resuming.
    seed: u64,
    /// What a resume must share with this run.
    key: RunKey,
    /// The (0-based) epoch of the next step, and the steps of it already done.
    position: (usize, usize),
    /// The save point this run resumed from.
    start: Option<TrainerState>,
    /// The progress bar's smoothed loss.
    smoothed: Smoothed,
    /// `vram_limit_gb`'s hold on the rest of the card, for the whole run.
    vram_cap: Option<crate::memory::vram_cap::VramCap>,
    /// The held-out set, when validation is on.
    validation: Option<Validation>,
    /// The validation loss computed after the current step, for its log record.
    val_loss: Option<f64>,
    /// The EMA copy of `params`, when `ema_decay_rate` or `ema_strength_target` is set.
    ema: Option<Ema>,
    /// Sample images every `sample_steps`, when `sample_prompts` is set.
    samples: Option<TrainingSamples>,
}

/// Whether the epoch loop goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Continue,
    Stop,
}

/// The run ran out of memory where halving cannot help: [`Session::run`] saves and stops.
#[derive(Debug, thiserror::Error)]
#[error("out of device memory {place}: {oom}")]
struct OomExhausted {
    place: String,
    oom: OutOfMemory,
}

/// What one optimizer step did.
struct StepReport {
    loss: f64,
    grad_norm: f64,
    /// False when a gradient or the loss was non-finite and the update was skipped.
    applied: bool,
    lrs: Vec<f64>,
    images: usize,
    /// The step's wall time: forward, backward and update (the data is decoded ahead, on its
    /// own thread).
    secs: f64,
    scale: ScaleChange,
    /// One line per out-of-memory retry during the step.
    retries: Vec<String>,
}

impl<'a> Session<'a> {
    /// Loads the model (frozen weights in the compute dtype, trainable ones as f32 masters),
    /// attaches adapters, reads the data, builds the optimizer groups and creates the run folder.
    fn setup(plan: &'a TrainPlan, opts: &'a RunOptions) -> anyhow::Result<Self> {
        let started = Instant::now();
        let started_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let full = plan.mode == TrainMode::Full;
        // Before anything slow loads: a run that cannot save, or resume, should not start.
        super::run_dir::ensure_output_dir(&plan.output_dir)?;
        let resume_from = match &plan.resume {
            Some(r) => {
                let dir = resume::locate(r)?;
                let state = resume::read_state(&dir)?;
                Some((dir, state))
            }
            None => None,
        };
        let interrupt = Interrupt::install();
        // Before anything is allocated: event tracking applies to tensors created afterwards.
        prepare_device(&opts.device, DeviceSettings::default()).context("preparing the device")?;
        let vram_cap = vram_limit(plan, &opts.device)?;
        let amp = plan.precision.amp.resolve(&opts.device);
        let layout = open_model(plan, amp)?;
        let mut sd = load_model(&layout, plan, opts, amp)?;
        let adapters = if full {
            None
        } else {
            Some(adapters::attach(&mut sd, plan)?)
        };
        let resolution = plan.data.resolution.unwrap_or(layout.native_resolution);
        check_resolution(&sd, resolution)?;
        let mut dataset = load_data_root_limited(
            &plan.data.data_root,
            opts.show_progress,
            plan.data.max_image_pixels,
        )?;
        let align = sd.vae_scale << sd.unet.config.num_downsamples();
        let bucket_list = data_feed::bucket_list(plan.data.buckets.as_ref(), resolution, align)?;
        // Held out before anything counts the training set; a resumed run holds out the same.
        let data_seed = resume_from.as_ref().map_or(plan.seed, |(_, st)| st.seed);
        let validation = hold_out_validation(plan, &mut dataset, data_seed, &bucket_list)?;
        report_dataset(&dataset);
        let objective = build_objective(plan, &layout)?;
        if dataset.epoch_len() == 0 {
            bail!(
                "data_root {} has no samples per epoch (the multipliers add up to less than 1)",
                plan.data.data_root.display(),
            );
        }
        let buckets = data_feed::assign(&dataset.items, &bucket_list);
        let feed = DataFeed::new(
            dataset,
            buckets,
            &plan.data,
            plan.batch_size,
            plan.grad_accum,
        );
        report_buckets(&feed, plan.data.buckets.is_some());
        let steps_per_epoch = feed.steps_in(&feed.epoch(data_seed, 0));
        let total_steps = total_steps(plan, &feed, data_seed);
        let groups = param_groups(&sd, plan, adapters.as_ref(), total_steps as u64)?;
        let params: Vec<Var> = groups.iter().flat_map(|g| g.vars.iter().cloned()).collect();
        let checkpointing = match plan.precision.gradient_checkpointing {
            true => Some(attach_checkpointing(
                &mut sd,
                &params,
                groups.len() > 1,
                &opts.device,
            )?),
            false => None,
        };
        // A resumed run continues in its own folder and log.
        let run = match &resume_from {
            Some((dir, _)) => RunDir {
                path: dir.parent().unwrap_or(dir).to_path_buf(),
            },
            None => {
                let run = RunDir::create(&plan.output_dir, &plan.project_name)?;
                write_plan(plan, &run, resolution, steps_per_epoch, total_steps, amp)?;
                run
            }
        };
        let resumed_steps = resume_from.as_ref().map(|(_, state)| state.steps);
        let (log, tensorboard) = open_logs(plan, &run, resumed_steps)?;
        eprintln!(
            "run folder: {}\n{} samples/epoch, {} steps/epoch of {}×{}, {} steps in all",
            run.path.display(),
            feed.dataset.epoch_len(),
            steps_per_epoch,
            plan.batch_size,
            plan.grad_accum,
            total_steps
        );
        let scaler = scaler_for(
            amp,
            plan.precision.scaler,
            plan.optimizer.grad_scaler_step_tweaks,
        );
        let key = run_key(plan, resolution);
        let mut session = Self {
            plan,
            opts,
            started,
            started_unix,
            interrupt,
            layout,
            sd,
            adapters,
            resolution,
            feed,
            text_cache: None,
            caches: Vec::new(),
            objective,
            total_steps,
            groups,
            params,
            run,
            log,
            tensorboard,
            amp,
            scaler,
            checkpointing,
            micro: MicroBatching::new(plan.batch_size),
            unlogged: None,
            seed: plan.seed,
            key,
            position: (0, 0),
            start: None,
            smoothed: Smoothed::new(0.9),
            vram_cap,
            validation,
            val_loss: None,
            ema: None,
            samples: None,
        };
        let resumed_dir = match resume_from {
            Some((dir, state)) => {
                session.restore(&dir, state)?;
                Some(dir)
            }
            None => None,
        };
        session.ema = session.start_ema(resumed_dir.as_deref())?;
        // Before the caches: a text cache releases the encoders the prompts need.
        session.samples = session.start_samples()?;
        session.build_caches()?;
        Ok(session)
    }

    /// Every trained parameter, named `<group>/<name>` as a save point stores it.
    fn named_params(&self) -> Vec<(String, Var)> {
        self.groups
            .iter()
            .flat_map(|g| {
                g.names
                    .iter()
                    .zip(&g.vars)
                    .map(|(n, v)| (format!("{}/{n}", g.name), v.clone()))
            })
            .collect()
    }

    /// Continues from save point `dir`: parameters, optimizer states, the loss scaler, the
    /// micro-batch, the seed and the position in the data order.
    fn restore(&mut self, dir: &std::path::Path, state: TrainerState) -> anyhow::Result<()> {
        let groups: Vec<String> = self.groups.iter().map(|g| g.name.to_string()).collect();
        if groups != state.groups {
            bail!(
                "{} was saved with optimizer groups {:?}, this run has {:?} (train_text_encoder                  differs?)",
                dir.display(),
                state.groups,
                groups
            );
        }
        resume::restore_params(dir, &state.key, &self.key, &self.named_params())?;
        for g in self.groups.iter_mut() {
            let path = resume::optimizer_file(dir, g.name);
            g.optimizer
                .load_state(&path)
                .with_context(|| format!("resuming the {} optimizer", g.name))?;
        }
        if let Some(s) = &state.scaler {
            self.scaler.restore(s);
        }
        for d in state.key.differences(&self.key) {
            eprintln!("warning: resumed run changed {d}; the resume is not exact");
        }
        if state.seed != self.seed {
            eprintln!("resume: seed {} from the save point", state.seed);
        }
        self.seed = state.seed;
        self.micro = state.micro;
        self.position = (state.epoch, state.steps_in_epoch);
        eprintln!(
            "resumed from {} at step {} (epoch {}, {} steps into it)",
            dir.display(),
            state.steps,
            state.epoch + 1,
            state.steps_in_epoch
        );
        self.start = Some(state);
        Ok(())
    }

    /// The EMA copy, when asked for: the trainable weights as they start this run, or a resumed
    /// run's save point's `ema.safetensors`, which must then exist.
    fn start_ema(&self, resumed: Option<&std::path::Path>) -> anyhow::Result<Option<Ema>> {
        let ema_file = resumed.map(|d| d.join(resume::EMA_FILE));
        let Some(plan) = &self.plan.ema else {
            if let Some(f) = ema_file.filter(|f| f.is_file()) {
                eprintln!(
                    "warning: {} is not continued: this run has no ema_decay_rate",
                    f.display()
                );
            }
            return Ok(None);
        };
        let device = match plan.device {
            EmaDevice::Cpu => Device::Cpu,
            EmaDevice::Training => self.opts.device.clone(),
        };
        let decay = plan.decay_for_run(self.total_steps);
        let mut ema = Ema::new(&self.named_params(), decay, plan.update_interval, &device)?;
        if let Some(f) = &ema_file {
            if !f.is_file() {
                bail!(
                    "{} is missing: the save point was written without EMA, this run has it on",
                    f.display()
                );
            }
            ema.load(f).context("resuming the EMA")?;
        }
        eprintln!(
            "ema: decay {decay} every {} steps, on {}",
            plan.update_interval,
            if device.is_cpu() {
                "the CPU"
            } else {
                "the device"
            }
        );
        if self.total_steps < plan.update_interval {
            eprintln!(
                "warning: ema_update_interval {} is more than the run's {} steps: the EMA \
                 weights will equal the starting ones",
                plan.update_interval, self.total_steps
            );
        }
        Ok(Some(ema))
    }

    /// The sampling state, when `sample_prompts` is set.
    fn start_samples(&self) -> anyhow::Result<Option<TrainingSamples>> {
        let Some(plan) = &self.plan.samples else {
            return Ok(None);
        };
        let captions: Vec<String> = self
            .feed
            .dataset
            .items
            .iter()
            .map(|m| m.caption.clone())
            .collect();
        let vae_load = LoadOptions {
            dtype: self.amp.compute_dtype(),
            vae_dtype: (self.amp == Amp::Fp16).then_some(DType::F32),
            device: self.opts.device.clone(),
            train_unet: false,
            train_text_encoders: false,
        };
        let samples = TrainingSamples::setup(
            plan,
            &self.sd,
            &self.run.path,
            self.seed,
            self.resolution,
            &captions,
            self.groups.len() > 1,
            self.plan.objective.clip_skip_layers,
            vae_load,
        )
        .context("sample_prompts")?;
        eprintln!(
            "samples: {} prompts every {} steps into {}",
            plan.set.prompts.len(),
            plan.every_n_steps,
            super::samples::samples_dir(&self.run.path).display()
        );
        Ok(Some(samples))
    }

    /// Draws the samples of step `step` when they are due (or `force`d, before the first step).
    /// Running out of memory skips the round with a warning; the run goes on.
    fn sample_if_due(
        &mut self,
        step: usize,
        force: bool,
        progress: &Progress,
    ) -> anyhow::Result<()> {
        let Some(samples) = &mut self.samples else {
            return Ok(());
        };
        if !force && !samples.due(step) {
            return Ok(());
        }
        let started = Instant::now();
        if let Some(a) = &self.adapters {
            crate::adapter::set_training(&a.modules, false);
        }
        let own_checkpointing = self.sd.unet.checkpointing.is_none();
        if own_checkpointing {
            self.sd.unet.checkpointing = Some(Checkpointing::new(Vec::new(), &self.opts.device)?);
        }
        let run = UnetRun {
            dtype: self.amp.compute_dtype(),
            batch_halves: self.micro.size >= 2,
        };
        let (trained, ema_too) = (samples.plan.trained_model, samples.plan.ema_model);
        let sd = &self.sd;
        let mut result = Ok(Vec::new());
        if trained {
            result = samples.round(sd, run, step, "").map(|r| vec![r]);
        }
        if let (Ok(rounds), true, Some(ema)) = (&mut result, ema_too, &self.ema) {
            match ema.with_weights(&self.params, || samples.round(sd, run, step, "ema")) {
                Ok(r) => rounds.push(r),
                Err(e) => result = Err(e),
            }
        }
        if own_checkpointing {
            self.sd.unet.checkpointing = None;
        }
        if let Some(a) = &self.adapters {
            crate::adapter::set_training(&a.modules, true);
        }
        match result {
            Ok(rounds) => {
                if let Some(tb) = &mut self.tensorboard {
                    for s in rounds.iter().flat_map(|r| &r.strips) {
                        let (w, h) = s.image.dimensions();
                        tb.add_image_png(&s.tag, step, &s.png, w, h)?;
                    }
                }
                let grids: Vec<String> = rounds
                    .iter()
                    .filter_map(|r| r.paths.last())
                    .map(|p| p.display().to_string())
                    .collect();
                progress.println(format!(
                    "step {step}: samples in {} ({:.1}s)",
                    grids.join(", "),
                    started.elapsed().as_secs_f64()
                ));
                Ok(())
            }
            Err(e) => match find_oom(&e) {
                Some(oom) => {
                    trim_pool(&self.opts.device).context("freeing memory after an OOM")?;
                    progress.println(format!(
                        "warning: step {step}: samples skipped, out of device memory ({})",
                        oom.detail
                    ));
                    Ok(())
                }
                None => Err(e.context(format!("drawing the samples of step {step}"))),
            },
        }
    }

    /// The trainer's state after `out`'s steps, for a save point.
    fn trainer_state(&self, out: &TrainOutcome) -> TrainerState {
        let groups = self.groups.iter().map(|g| g.name.to_string()).collect();
        let mut st = TrainerState::new(out.steps, self.key.clone(), groups, self.seed);
        (st.epoch, st.steps_in_epoch) = self.position;
        st.epochs_completed = out.epochs_completed;
        st.images_seen = out.images_seen;
        st.skipped_steps = out.skipped_steps;
        st.losses = out.losses.clone();
        st.micro = self.micro;
        st.scaler = self.scaler.state();
        st
    }

    fn saver(&self) -> Saver<'_> {
        Saver {
            sd: &self.sd,
            layout: &self.layout,
            plan: self.plan,
            adapters: self.adapters.as_ref(),
            run: &self.run,
            resolution: self.resolution,
            images: self.feed.dataset.items.len(),
            started_unix: self.started_unix,
            seed: self.seed,
            ema: self.ema.is_some(),
        }
    }

    /// Forward and backward over every sample of `data`, `micro.size` at a time within each
    /// micro-batch, halving `micro` on an out-of-memory error and retrying the same samples.
    /// Returns the accumulated loss and gradients, and one line per retry.
    fn forward_backward_all(
        &self,
        data: &StepData,
        step: usize,
        micro: &mut MicroBatching,
        loss_scale: f64,
    ) -> anyhow::Result<(Accumulated, Vec<String>)> {
        let settings = self.step_settings();
        let effective = data.samples.len();
        let mut acc = GradAccumulator::new(&self.params);
        let mut retries = Vec::new();
        let mut offset = 0;
        for mb in &data.micro {
            let end = offset + mb.ids.len();
            let mut start = offset;
            while start < end {
                let n = micro.size.min(end - start);
                let ids = &mb.ids[start - offset..start - offset + n];
                let samples: Vec<&SampleData> = data.samples[start..start + n].iter().collect();
                let seeds = &data.seeds[start..start + n];
                let share = n as f64 / effective as f64 * mb.weight;
                let result = micro_batch(&self.sd, &samples, seeds, &settings, share, loss_scale)
                    .and_then(|r| match injected(step, ids) {
                        true => Err(anyhow::Error::new(OutOfMemory {
                            detail: "injected by a test".into(),
                        })),
                        false => Ok(r),
                    });
                match result {
                    Ok((loss, grads)) => {
                        acc.add(loss, grads, n)?;
                        start += n;
                    }
                    Err(e) => {
                        let Some(oom) = find_oom(&e) else {
                            return Err(e);
                        };
                        // The failed micro-batch's graph is gone with `e`'s stack frame.
                        trim_pool(&self.opts.device).context("freeing memory after an OOM")?;
                        let old = micro.size;
                        if !micro.halve() {
                            return Err(OomExhausted {
                                place: format!("at step {} with batch 1", step + 1),
                                oom,
                            }
                            .into());
                        }
                        retries.push(micro.retry_line(step + 1, old, effective));
                    }
                }
            }
            offset = end;
        }
        match acc.finish(loss_scale)? {
            Some(done) => Ok((done, retries)),
            None => bail!("optimizer step {} had no micro-batches", step + 1),
        }
    }

    /// One optimizer step over `data` (the step's micro-batches, each of one bucket, and their
    /// samples): the samples go through forward and backward `self.micro.size` at a time, each
    /// with its own seeded draws; an out-of-memory error halves the micro-batch and retries the
    /// same samples, keeping the gradients already accumulated. Then the one device→host check,
    /// the scaler's update and, when everything is finite, the optimizer update.
    fn optimizer_step(&mut self, data: &StepData, step: usize) -> anyhow::Result<StepReport> {
        let started = Instant::now();
        self.scaler.begin_step(step);
        if let Some(a) = &self.adapters {
            a.begin_step(step);
        }
        let loss_scale = self.scaler.scale();
        let mut micro = self.micro;
        let result = self.forward_backward_all(data, step, &mut micro, loss_scale);
        // Kept whether the step succeeded or ran out of memory at batch 1: the save says so.
        self.micro = micro;
        let (mut done, retries) = result?;
        // EveryDream2's clip_grad_norm: each group clipped to the norm on its own (UNet, text
        // encoder); the logged norm is the global one before clipping.
        let pre_clip = match self.plan.clip_grad_norm {
            Some(max) => {
                let mut sq = 0f64;
                for g in &self.groups {
                    let n = clip_grad_norm(&g.vars, &mut done.grads, max)
                        .with_context(|| format!("{} gradient clipping", g.name))?;
                    sq += f64::from(n).powi(2);
                }
                Some(sq.sqrt())
            }
            None => None,
        };
        // The step's one device→host sync: the loss and every gradient's sum of squares.
        let present: Vec<&Tensor> = self
            .params
            .iter()
            .filter_map(|v| done.grads.get(v))
            .collect();
        let check = StepCheck::fetch(&done.loss, &present)?;
        let lrs: Vec<f64> = self
            .groups
            .iter_mut()
            .map(|g| g.set_lr_for_step(step))
            .collect();
        let finite = check.finite();
        let scale = self.scaler.update(finite.is_some());
        if let Some(finite) = finite {
            for g in self.groups.iter_mut() {
                update_group(g, &done.grads, finite, &self.opts.device, step)?;
            }
        }
        Ok(StepReport {
            loss: check.loss,
            grad_norm: pre_clip.unwrap_or(f64::from(check.grad_norm)),
            applied: finite.is_some(),
            lrs,
            images: done.samples,
            secs: started.elapsed().as_secs_f64(),
            scale,
            retries,
        })
    }

    /// The epoch loop: steps, progress, logs, periodic and final saves, Ctrl-C. A resumed run
    /// starts at its save point's epoch, past the steps of it already done.
    fn run(mut self) -> anyhow::Result<TrainOutcome> {
        let plan = self.plan;
        let progress = Progress::new(self.total_steps, self.opts.show_progress);
        let mut out = self.initial_outcome();
        let max_epochs = plan.max_epochs.map_or(usize::MAX, |e| e as usize);
        let (first_epoch, skip) = self.position;
        if out.steps == 0 && self.samples.as_ref().is_some_and(|s| s.plan.set.at_start) {
            self.sample_if_due(0, true, &progress)?;
        }
        for epoch in first_epoch..max_epochs {
            let skip = if epoch == first_epoch { skip } else { 0 };
            if self.train_epoch(epoch, skip, &mut out, &progress)? == Flow::Stop {
                break;
            }
            out.epochs_completed = epoch + 1;
            self.position = (epoch + 1, 0);
            let last = out.steps >= self.total_steps || epoch + 1 == max_epochs;
            if let Some(every) = plan.save_every_n_epochs {
                if !last && (epoch + 1).is_multiple_of(every as usize) {
                    let saved =
                        self.save_point(SavePoint::Epoch(epoch + 1), &out, epoch + 1, &progress)?;
                    out.saved.extend(saved);
                }
            }
            if last {
                break;
            }
        }
        if !out.interrupted {
            let epochs = out.epochs_completed;
            let saved = self.save_point(SavePoint::Final, &out, epochs, &progress)?;
            out.saved.extend(saved);
        }
        progress.finish();
        out.wall_secs = self.started.elapsed().as_secs_f64();
        out.memory = read_memory(&self.opts.device);
        Ok(out)
    }

    /// The step's settings from the plan.
    fn step_settings(&self) -> StepSettings<'_> {
        let data = &self.plan.data;
        StepSettings {
            objective: &self.objective,
            flip_p: data.flip_p,
            cond_dropout: data.cond_dropout,
            shuffle_tags: data.shuffle_tags,
            clip_skip_layers: self.plan.objective.clip_skip_layers,
            train_text_encoder: self.groups.len() > 1,
            compute_dtype: self.amp.compute_dtype(),
            checkpointing: self.checkpointing.as_ref(),
            text_cache: self.text_cache.as_ref(),
        }
    }

    /// The text-encoder output cache and the latent cache, when they apply; each releases the
    /// model it replaces.
    fn build_caches(&mut self) -> anyhow::Result<()> {
        let data = &self.plan.data;
        let batch = self.plan.batch_size.max(1);
        let line = match data.text_cache {
            TextCacheDecision::Off(why) => format!("text-encoder cache: off ({why})"),
            TextCacheDecision::On => {
                let started = Instant::now();
                let mut captions: Vec<&str> = self
                    .feed
                    .dataset
                    .items
                    .iter()
                    .map(|i| i.caption.as_str())
                    .collect();
                if let Some(v) = &self.validation {
                    captions.extend(v.items.iter().map(|i| i.caption.as_str()));
                }
                let cache = TextCache::build(
                    &self.sd,
                    captions,
                    self.plan.objective.clip_skip_layers,
                    batch,
                )
                .context("caching the text encoders' outputs")?;
                self.sd.release_text_encoders();
                let line = format!(
                    "text-encoder cache: {} captions encoded in {:.1} s; text encoders released",
                    cache.len(),
                    started.elapsed().as_secs_f64()
                );
                self.text_cache = Some(cache);
                line
            }
        };
        eprintln!("{line}");
        self.caches.push(line);
        if data.cache_latents == CacheLatents::Off {
            self.caches
                .push("latent cache: off (the VAE encodes every step)".into());
            return Ok(());
        }
        let started = Instant::now();
        let dir = (data.cache_latents == CacheLatents::Disk)
            .then(|| self.plan.output_dir.join(latent_cache::CACHE_DIR));
        let spec = CacheSpec {
            items: &self.feed.dataset.items,
            buckets: &self.feed.buckets,
            with_flip: data.flip_p > 0.0,
            dir: dir.clone(),
            max_pixels: data.max_image_pixels,
            batch,
        };
        let (store, stats) =
            latent_cache::build(&self.sd, &spec, &self.opts.device).context("caching latents")?;
        self.feed.use_latents(store);
        if let Some(v) = &mut self.validation {
            v.cache_latents(&self.sd, dir.clone(), batch, &self.opts.device)
                .context("caching the validation images' latents")?;
        }
        self.sd.release_vae();
        trim_pool(&self.opts.device).context("freeing the VAE")?;
        let place = match &dir {
            Some(d) => format!("in {}", d.display()),
            None => "in memory".into(),
        };
        let line = format!(
            "latent cache {place}: {} encoded, {} reused, in {:.1} s; VAE released",
            stats.encoded,
            stats.reused,
            started.elapsed().as_secs_f64()
        );
        eprintln!("{line}");
        self.caches.push(line);
        Ok(())
    }

    /// The validation loss after this step when it is due (every `validation_every_n_steps`, or
    /// at the end of each epoch, and after the last step), printed and kept for the step's log
    /// record.
    fn validate_if_due(
        &mut self,
        out: &mut TrainOutcome,
        last_of_epoch: bool,
        progress: &Progress,
    ) -> anyhow::Result<()> {
        let Some(val) = &self.validation else {
            return Ok(());
        };
        // And always after the run's last step, so a run that ends mid-epoch reports one.
        let due = out.steps >= self.total_steps
            || match val.every_n_steps {
                Some(n) => out.steps.is_multiple_of(n),
                None => last_of_epoch,
            };
        if !due {
            return Ok(());
        }
        let settings = self.step_settings();
        if let Some(a) = &self.adapters {
            crate::adapter::set_training(&a.modules, false);
        }
        let loss = val.loss(&self.sd, &settings, self.micro.size);
        if let Some(a) = &self.adapters {
            crate::adapter::set_training(&a.modules, true);
        }
        let loss = loss.context("validation loss")?;
        progress.println(format!("step {}: validation loss {loss:.4}", out.steps));
        out.val_losses.push((out.steps, loss));
        self.val_loss = Some(loss);
        Ok(())
    }

    /// The outcome before the first step: empty, or the save point's counters when resuming.
    fn initial_outcome(&self) -> TrainOutcome {
        let mut out = TrainOutcome {
            run_dir: self.run.path.clone(),
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
            micro: self.micro,
            vram_cap: self.vram_cap.as_ref().map(|c| c.describe()),
            val_losses: Vec::new(),
            val_images: self.validation.as_ref().map_or(0, |v| v.items.len()),
            buckets: self.feed.bucket_counts(),
            repeated_samples: 0,
            failed_samples: 0,
            caches: self.caches.clone(),
        };
        if let Some(st) = &self.start {
            out.steps = st.steps;
            out.epochs_completed = st.epochs_completed;
            out.images_seen = st.images_seen;
            out.losses = st.losses.clone();
            out.skipped_steps = st.skipped_steps;
        }
        out
    }

    /// The steps of `epoch`, from its `skip`-th: each step, its log, a step save every
    /// `save_every_n_steps`, and the save and stop on Ctrl-C or at the last step.
    fn train_epoch(
        &mut self,
        epoch: usize,
        skip: usize,
        out: &mut TrainOutcome,
        progress: &Progress,
    ) -> anyhow::Result<Flow> {
        let plan = self.plan;
        let batches = self.feed.epoch(self.seed, epoch);
        out.repeated_samples += batches.repeated;
        let steps_in_epoch = self.feed.steps_in(&batches);
        let steps = self.feed.steps(&batches, skip);
        let left = self.total_steps.saturating_sub(out.steps);
        self.feed
            .start(self.seed, &steps[..steps.len().min(left)], out.steps);
        for (i, micro) in steps.iter().enumerate().map(|(k, m)| (k + skip, m)) {
            if out.steps >= self.total_steps {
                return Ok(Flow::Stop);
            }
            let data = self.feed.next(self.seed, out.steps, micro)?;
            for (path, why) in &data.failed {
                progress.println(format!(
                    "warning: step {}: left out {}: {why}",
                    out.steps + 1,
                    path.display()
                ));
            }
            out.failed_samples += data.failed.len();
            if data.samples.is_empty() {
                // Nothing to train on: the step passes with no update, as a non-finite one does.
                progress.println(format!(
                    "warning: step {}: skipped, none of its images could be decoded",
                    out.steps + 1
                ));
                out.skipped_steps += 1;
                out.steps += 1;
                self.position = if i + 1 == steps_in_epoch {
                    (epoch + 1, 0)
                } else {
                    (epoch, i + 1)
                };
                continue;
            }
            let report = match self.optimizer_step(&data, out.steps) {
                Ok(report) => report,
                Err(e) => return Err(self.stop_after_oom(e, out, epoch, progress)),
            };
            for line in &report.retries {
                progress.println(line.clone());
            }
            out.micro = self.micro;
            out.images_seen += report.images;
            if !report.applied {
                out.skipped_steps += 1;
                progress.println(skipped_message(out.steps + 1, report.scale));
            }
            out.steps += 1;
            out.losses.push(report.loss);
            if let Some(ema) = &mut self.ema {
                // After the update the step applied; a skipped step leaves the EMA as it is.
                if report.applied && ema.due(out.steps) {
                    ema.update(&self.params)
                        .with_context(|| format!("EMA update at step {}", out.steps))?;
                }
            }
            self.position = if i + 1 == steps_in_epoch {
                out.epochs_completed = epoch + 1;
                (epoch + 1, 0)
            } else {
                (epoch, i + 1)
            };
            let last_of_epoch = i + 1 == steps_in_epoch;
            self.validate_if_due(out, last_of_epoch, progress)?;
            self.record_step(&report, out, epoch, progress)?;
            self.sample_if_due(out.steps, false, progress)?;
            if self.interrupt.requested() {
                out.interrupted = true;
                let point = SavePoint::Interrupted(out.steps);
                let saved = self.save_point(point, out, epoch + 1, progress)?;
                out.saved.extend(saved);
                return Ok(Flow::Stop);
            }
            let every = plan.save_every_n_steps.map_or(0, |n| n as usize);
            if every > 0 && out.steps.is_multiple_of(every) && out.steps < self.total_steps {
                let saved =
                    self.save_point(SavePoint::Step(out.steps), out, epoch + 1, progress)?;
                out.saved.extend(saved);
            }
        }
        Ok(Flow::Continue)
    }

    /// The progress line and, every `log_step` steps, the JSONL record.
    fn record_step(
        &mut self,
        report: &StepReport,
        out: &TrainOutcome,
        epoch: usize,
        progress: &Progress,
    ) -> anyhow::Result<()> {
        self.smoothed.push(report.loss);
        let smoothed = self.smoothed.get();
        // Driver counters, not a stream sync. A failed reading only costs the display: it must
        // not end a run.
        let memory = read_memory(&self.opts.device);
        progress.update(
            out.steps,
            epoch + 1,
            smoothed,
            report.lrs[0],
            out.images_seen,
            memory.as_ref(),
        );
        let record = LogRecord {
            step: out.steps,
            epoch: epoch + 1,
            loss: report.loss,
            lr_unet: report.lrs[0],
            lr_text_encoder: report.lrs.get(1).copied(),
            grad_norm: report.grad_norm,
            images: out.images_seen,
            images_per_s: report.images as f64 / report.secs.max(1e-9),
            time_s: self.started.elapsed().as_secs_f64(),
            skipped_nonfinite: !report.applied,
            loss_scale: (self.amp == Amp::Fp16).then(|| self.scaler.scale()),
            micro_batch: (self.micro.oom_retries > 0).then_some(self.micro.size),
            val_loss: self.val_loss.take(),
            oom_retries: self.micro.oom_retries,
            memory,
        };
        if out.steps.is_multiple_of(self.plan.log_step as usize)
            || out.steps == 1
            || out.steps == self.total_steps
            || !report.retries.is_empty()
            || record.val_loss.is_some()
        {
            self.write_log(&record)?;
            self.unlogged = None;
        } else {
            // Written if a save comes before the next logged step: the log then holds every
            // step a save holds.
            self.unlogged = Some(record);
        }
        Ok(())
    }

    /// Writes a step's record to the JSON-lines log and, when on, to TensorBoard.
    fn write_log(&mut self, record: &LogRecord) -> anyhow::Result<()> {
        self.log
            .write(record)
            .with_context(|| format!("writing {}", self.log.path().display()))?;
        if let Some(tb) = &mut self.tensorboard {
            tb.add_scalars(record.step, &tensorboard_scalars(record))?;
        }
        Ok(())
    }

    /// Saves at `point`: the weights ([`Saver::save`]) and, except at the end of a run without
    /// `save_optimizer`, a resume save point; the log record of the step comes first. An
    /// out-of-memory error frees the pool and retries once; a second one gives up.
    fn save_point(
        &mut self,
        point: SavePoint,
        out: &TrainOutcome,
        epoch: usize,
        progress: &Progress,
    ) -> anyhow::Result<Vec<PathBuf>> {
        if let Some(record) = self.unlogged.take() {
            self.write_log(&record)?;
        }
        let place = || format!("while saving at step {}", out.steps);
        retry_once_on_oom(&self.opts.device, place, || {
            self.save_once(point, out, epoch, progress)
        })
    }

    fn save_once(
        &self,
        point: SavePoint,
        out: &TrainOutcome,
        epoch: usize,
        progress: &Progress,
    ) -> anyhow::Result<Vec<PathBuf>> {
        let saver = self.saver();
        let mut paths = saver.save(&self.groups, point, out.steps, epoch, progress, "")?;
        if let Some(ema) = &self.ema {
            paths.extend(ema.with_weights(&self.params, || {
                saver.save(&self.groups, point, out.steps, epoch, progress, EMA_SUFFIX)
            })?);
        }
        if matches!(point, SavePoint::Final) && !self.plan.save_optimizer {
            return Ok(paths);
        }
        let dir = resume::state_dir(&self.run.path, out.steps);
        let groups = &self.groups;
        let ema = self.ema.as_ref();
        resume::write(&dir, &self.trainer_state(out), &self.named_params(), |d| {
            for g in groups {
                let p = resume::optimizer_file(d, g.name);
                g.optimizer
                    .save_state(&p)
                    .with_context(|| format!("saving {}", p.display()))?;
            }
            if let Some(ema) = ema {
                ema.save(&d.join(resume::EMA_FILE))?;
            }
            Ok(())
        })?;
        if let Some(keep) = self.plan.checkpoints_total_limit {
            for step in resume::prune(&self.run.path, keep, |s| saver.step_outputs(s))? {
                progress.println(format!(
                    "removed the save point of step {step} (checkpoints_total_limit {keep})"
                ));
            }
        }
        Ok(paths)
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
        let point = SavePoint::Errored(out.steps);
        let saved = match self.save_point(point, out, epoch + 1, progress) {
            Ok(paths) => format!(
                "the last completed step ({}) is saved in {}",
                out.steps,
                paths
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Err(err) => format!(
                "saving the last completed step failed too: {}",
                crate::cli::error_text(&err)
            ),
        };
        progress.finish();
        GaveUp {
            place,
            saved,
            rungs: rung_lines(&next_rungs(self.plan, self.amp, self.resolution)),
        }
        .into()
    }
}

/// `vram_limit_gb`'s hold on the rest of the card, when set (a note on the CPU).
fn vram_limit(
    plan: &TrainPlan,
    device: &Device,
) -> anyhow::Result<Option<crate::memory::vram_cap::VramCap>> {
    let Some(gb) = plan.vram_limit_gb else {
        return Ok(None);
    };
    let cap = crate::memory::vram_cap::cap(device, gb).context("vram_limit_gb")?;
    match &cap {
        Some(c) => eprintln!("vram_limit_gb: this run has {}", c.describe()),
        None => eprintln!("vram_limit_gb {gb} applies to CUDA cards; not on the CPU"),
    }
    Ok(cap)
}

/// The plan's model, resolved (hub cache, folder or single file) and described on stderr.
fn open_model(plan: &TrainPlan, amp: Amp) -> anyhow::Result<ModelLayout> {
    let source =
        ModelSource::parse(&plan.model).with_context(|| format!("model `{}`", plan.model))?;
    let dir = source
        .resolve()
        .with_context(|| format!("model `{}`", plan.model))?;
    let layout = ModelLayout::read_with(&dir.path, None, &plan.single_file_options())?;
    eprintln!(
        "model: {} ({}, {} prediction, native {}px); precision {}{}",
        plan.model,
        layout.family.name(),
        layout.prediction_type.name(),
        layout.native_resolution,
        amp.name(),
        if plan.precision.gradient_checkpointing {
            ", gradient checkpointing"
        } else {
            ""
        }
    );
    Ok(layout)
}

/// The validation set, when asked for: held out of `dataset` (or read from its own folder).
fn hold_out_validation(
    plan: &TrainPlan,
    dataset: &mut LoadedDataset,
    data_seed: u64,
    buckets: &[crate::data::Bucket],
) -> anyhow::Result<Option<Validation>> {
    let Some(v) = &plan.data.validation else {
        return Ok(None);
    };
    let val = Validation::setup(v, dataset, data_seed, buckets, plan.data.max_image_pixels)?;
    let when = v
        .every_n_steps
        .map_or("at the end of each epoch".to_string(), |n| {
            format!("every {n} steps")
        });
    eprintln!("validation: {} images, {when}", val.items.len());
    Ok(Some(val))
}

/// Gradient checkpointing of the UNet's blocks, and of the text encoders' layers when they
/// train, for the trainable `params`.
fn attach_checkpointing(
    sd: &mut StableDiffusion,
    params: &[Var],
    text_encoders_train: bool,
    device: &Device,
) -> anyhow::Result<Checkpointing> {
    let ck = Checkpointing::new(params.to_vec(), device)?;
    sd.unet.checkpointing = Some(ck.clone());
    if text_encoders_train {
        for te in sd.text_encoders.iter_mut() {
            te.model.checkpointing = Some(ck.clone());
        }
    }
    Ok(ck)
}

/// The run's JSON-lines log and TensorBoard events in its log folder: new, or continued after
/// `resumed_steps` (later records dropped).
fn open_logs(
    plan: &TrainPlan,
    run: &RunDir,
    resumed_steps: Option<usize>,
) -> anyhow::Result<(JsonlLog, Option<EventWriter>)> {
    let log_dir = plan.log_folder(&run.path);
    std::fs::create_dir_all(&log_dir)
        .with_context(|| format!("cannot create {}", log_dir.display()))?;
    let log_path = log_dir.join("train_log.jsonl");
    let log = match resumed_steps {
        Some(steps) => JsonlLog::resume(&log_path, steps)?,
        None => JsonlLog::create(&log_path)?,
    };
    let tensorboard = match (plan.tensorboard, resumed_steps) {
        (false, _) => None,
        (true, Some(steps)) => Some(EventWriter::resume(&log_dir, steps)?),
        (true, None) => Some(EventWriter::create(&log_dir)?),
    };
    Ok((log, tensorboard))
}

/// What a resume must share with this run.
fn run_key(plan: &TrainPlan, resolution: usize) -> RunKey {
    RunKey {
        model: plan.model.clone(),
        mode: format!("{:?}", plan.mode).to_lowercase(),
        data_root: plan.data.data_root.clone(),
        resolution,
        batch_size: plan.batch_size,
        grad_accum: plan.grad_accum,
        data_shape: format!(
            "buckets {}, crop_jitter {}",
            match &plan.data.buckets {
                None => "off".to_string(),
                Some(b) => format!("{:?} up to {:?}", b.aspects, b.max_ratio),
            },
            plan.data.crop_jitter
        ),
    }
}

/// Draws, forward and backward for one micro-batch of `samples` with their seeds; the loss is
/// weighted by `weight` (the micro-batch's share of the effective batch, times a runt batch's
/// discount).
fn micro_batch(
    sd: &StableDiffusion,
    samples: &[&SampleData],
    seeds: &[u64],
    settings: &StepSettings<'_>,
    weight: f64,
    loss_scale: f64,
) -> anyhow::Result<(Tensor, candle_core::backprop::GradStore)> {
    let mut rngs = sample_rngs(seeds);
    let batch = prepare_batch(sd, samples, settings, &mut rngs)?;
    forward_backward(sd, &batch, settings, weight, loss_scale)
}

/// The run's steps: `max_steps`, or the steps of `max_epochs` epochs, whichever is fewer. The
/// epochs are counted one by one, since runt batches and fractional multipliers make their
/// lengths differ.
fn total_steps(plan: &TrainPlan, feed: &DataFeed, seed: u64) -> usize {
    let by_steps = plan.max_steps.map_or(usize::MAX, |s| s as usize);
    let Some(epochs) = plan.max_epochs else {
        return by_steps;
    };
    let mut total = 0usize;
    for epoch in 0..epochs as usize {
        total += feed.steps_in(&feed.epoch(seed, epoch));
        if total >= by_steps {
            return by_steps;
        }
    }
    total
}

fn report_buckets(feed: &DataFeed, bucketing: bool) {
    if !bucketing {
        return;
    }
    let counts = feed.bucket_counts();
    let list: Vec<String> = counts
        .iter()
        .map(|c| format!("{} ×{}", c.bucket, c.images))
        .collect();
    eprintln!("aspect buckets: {}", list.join(", "));
}

/// `f`, retried once after an out-of-memory error with the device's pool trimmed; a second
/// out-of-memory error becomes [`OomExhausted`] at `place`. Outside the micro-batches (the
/// optimizer step, saves) there is nothing to halve, so this is the whole policy there.
pub(super) fn retry_once_on_oom<T>(
    device: &Device,
    place: impl FnOnce() -> String,
    mut f: impl FnMut() -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    match f() {
        Err(e) if find_oom(&e).is_some() => {
            trim_pool(device).context("freeing memory after an OOM")?;
            f().map_err(|e| match find_oom(&e) {
                Some(oom) => OomExhausted {
                    place: place(),
                    oom,
                }
                .into(),
                None => e,
            })
        }
        result => result,
    }
}

/// The group's optimizer update, with [`retry_once_on_oom`]: a retry resumes from the
/// parameter the failed attempt stopped at, so none is updated twice.
fn update_group(
    g: &mut Group,
    grads: &candle_core::backprop::GradStore,
    finite: crate::optim::Finite,
    device: &Device,
    step: usize,
) -> anyhow::Result<()> {
    let name = g.name;
    let mut done = 0;
    let place = || format!("in the {name} optimizer step at step {}", step + 1);
    retry_once_on_oom(device, place, || {
        match g.optimizer.step_checked_from(grads, finite, done) {
            Ok(_) => Ok(()),
            Err(e) => {
                if let OptimError::Interrupted { updated, .. } = &e {
                    done = *updated;
                }
                Err(anyhow::Error::new(e).context(format!("{name} optimizer step")))
            }
        }
    })
}

/// The line printed for a skipped step.
fn skipped_message(step: usize, scale: ScaleChange) -> String {
    match scale {
        ScaleChange::BackedOff(s) => format!(
            "step {step}: gradients overflowed in fp16, step skipped; loss scale lowered to {s}"
        ),
        ScaleChange::Unchanged | ScaleChange::Grew(_) => {
            format!("step {step}: non-finite loss or gradient, step skipped")
        }
    }
}

/// Loads the model for `amp`: frozen weights in the compute dtype (the VAE in f32 under fp16),
/// trainable components as f32 masters; the text encoders compute in the compute dtype.
fn load_model(
    layout: &ModelLayout,
    plan: &TrainPlan,
    opts: &RunOptions,
    amp: Amp,
) -> anyhow::Result<StableDiffusion> {
    let full = plan.mode == TrainMode::Full;
    let compute = amp.compute_dtype();
    let load = LoadOptions {
        dtype: compute,
        vae_dtype: (amp == Amp::Fp16).then_some(DType::F32),
        device: opts.device.clone(),
        // Adapter modes keep the base frozen (plain tensors): only the adapters are Vars.
        train_unet: full,
        train_text_encoders: full && plan.train_text_encoder,
    };
    Ok(StableDiffusion::load(layout.clone(), &load)?)
}

fn build_objective(plan: &TrainPlan, layout: &ModelLayout) -> anyhow::Result<Objective> {
    let mut schedule =
        NoiseSchedule::from_config(&layout.scheduler_json()?, &layout.scheduler_config)?;
    if plan.objective.zero_terminal_snr {
        schedule = schedule.with_zero_terminal_snr();
        if schedule.prediction_type() == crate::model::family::PredictionType::Epsilon {
            eprintln!(
                "warning: zero_terminal_snr on an epsilon-prediction model: at the last timestep \
                 the noisy latent is the noise itself, so that step teaches nothing; the paper \
                 pairs zero terminal SNR with v-prediction (SD2.x-v)"
            );
        }
    }
    Ok(Objective::new(
        schedule,
        ObjectiveConfig {
            timestep_start: plan.objective.timestep_start as u32,
            timestep_end: plan.objective.timestep_end as u32,
            zero_frequency_noise_ratio: plan.objective.zero_frequency_noise_ratio,
            min_snr_gamma: plan.objective.min_snr_gamma,
        },
    )?)
}

/// The trainable text-encoder parameters: all of them unless `unfreeze_last_n_layers` freezes
/// the front, as EveryDream2 does.
fn trainable_text_encoder_params(sd: &StableDiffusion, plan: &TrainPlan) -> Vec<(String, Var)> {
    if !plan.train_text_encoder {
        return Vec::new();
    }
    let folders = [Component::TextEncoder, Component::TextEncoder2];
    sd.text_encoders
        .iter()
        .zip(folders)
        .flat_map(|(te, folder)| {
            let layers = te.model.num_layers();
            // Prefixed by the component: SDXL's two encoders share checkpoint names.
            te.weights
                .params()
                .into_iter()
                .filter_map(move |(name, var)| {
                    text_encoder_param_trains(&name, layers, plan.unfreeze_last_n_layers)
                        .then(|| (format!("{folder}.{name}"), var))
                })
        })
        .collect()
}

/// The optimizer groups: the UNet and, when trained, the text encoder(s); for adapter modes, the
/// adapter parameters with `adapter.unet_lr`/`text_encoder_lr` overriding the groups' lr.
fn param_groups(
    sd: &StableDiffusion,
    plan: &TrainPlan,
    adapters: Option<&TrainedAdapters>,
    total_steps: u64,
) -> anyhow::Result<Vec<Group>> {
    let (unet_params, te_params, unet_plan, te_plan) = match adapters {
        None => (
            sd.unet_weights.params(),
            trainable_text_encoder_params(sd, plan),
            plan.optimizer.unet,
            plan.optimizer.text_encoder,
        ),
        Some(a) => {
            let mut unet_plan = plan.optimizer.unet;
            let mut te_plan = plan.optimizer.text_encoder;
            if let Some(lr) = a.plan.unet_lr {
                unet_plan.lr = lr;
            }
            if let Some(lr) = a.plan.text_encoder_lr {
                te_plan.lr = lr;
            }
            (a.params(false), a.params(true), unet_plan, te_plan)
        }
    };
    let mut groups = vec![Group::new("unet", unet_params, &unet_plan, total_steps)?];
    if !te_params.is_empty() {
        groups.push(Group::new(
            "text_encoder",
            te_params,
            &te_plan,
            total_steps,
        )?);
    }
    Ok(groups)
}

/// When a save happens.
#[derive(Debug, Clone, Copy)]
enum SavePoint {
    Epoch(usize),
    Final,
    Interrupted(usize),
    /// The last completed step, saved when a run gives up on an out-of-memory error.
    Errored(usize),
    /// Every `save_every_n_steps`.
    Step(usize),
}

/// Everything a save needs but the optimizer groups (which the loop mutates between saves).
struct Saver<'a> {
    sd: &'a StableDiffusion,
    layout: &'a ModelLayout,
    plan: &'a TrainPlan,
    adapters: Option<&'a TrainedAdapters>,
    run: &'a RunDir,
    resolution: usize,
    images: usize,
    started_unix: f64,
    seed: u64,
    /// Whether each save also writes the EMA weights (under [`EMA_SUFFIX`]).
    ema: bool,
}

/// What the EMA weights' folder or file adds to the normal name (EveryDream2 saves `<name>_ema`).
const EMA_SUFFIX: &str = "-ema";

impl Saver<'_> {
    /// The weights a step save of `step` wrote (removed with its save point by
    /// `checkpoints_total_limit`).
    fn step_outputs(&self, step: usize) -> Vec<PathBuf> {
        let suffixes: &[&str] = if self.ema { &["", EMA_SUFFIX] } else { &[""] };
        let project = &self.plan.project_name;
        suffixes
            .iter()
            .flat_map(|sfx| match self.adapters {
                None => {
                    let dir = with_suffix(&self.run.step_dir(step), sfx);
                    vec![single_file_path(&dir), dir]
                }
                Some(_) => vec![self
                    .run
                    .file(&format!("{project}-step-{step:06}{sfx}.safetensors"))],
            })
            .collect()
    }

    /// Saves the trained weights: a complete diffusers folder (full fine-tune) or a kohya LoRA
    /// file (adapter modes), its name followed by `suffix`. Returns the path.
    fn save(
        &self,
        groups: &[Group],
        point: SavePoint,
        steps: usize,
        epoch: usize,
        progress: &Progress,
        suffix: &str,
    ) -> anyhow::Result<Vec<PathBuf>> {
        let plan = self.plan;
        let project = &plan.project_name;
        let paths = match self.adapters {
            None => {
                let dir = match point {
                    SavePoint::Epoch(e) => self.run.epoch_dir(e),
                    SavePoint::Final => self.run.final_dir(),
                    SavePoint::Interrupted(s) => self.run.interrupted_dir(s),
                    SavePoint::Errored(s) => self.run.errored_dir(s),
                    SavePoint::Step(s) => self.run.step_dir(s),
                };
                let dir = with_suffix(&dir, suffix);
                // Under the names the base files store them, so each component keeps its
                // checkpoint's key layout (a text encoder with or without `text_model.`).
                let mut updated = vec![(Component::Unet, self.sd.unet_weights.checkpoint_params())];
                if plan.train_text_encoder {
                    let comps = [Component::TextEncoder, Component::TextEncoder2];
                    for (te, comp) in self.sd.text_encoders.iter().zip(comps) {
                        updated.push((comp, te.weights.checkpoint_params()));
                    }
                }
                let format = plan.model_file.save_ckpt_format;
                let file = single_file_path(&dir);
                if format.single_file() {
                    crate::model::single_file::write::save_single_file(
                        self.layout,
                        &file,
                        &updated,
                        DType::F32,
                    )
                    .with_context(|| format!("saving {}", file.display()))?;
                }
                let mut written = Vec::new();
                if format.diffusers() {
                    crate::model::export::save_diffusers_folder(
                        self.layout,
                        &dir,
                        &updated,
                        DType::F32,
                    )
                    .with_context(|| format!("saving {}", dir.display()))?;
                    written.push(dir);
                }
                if format.single_file() {
                    written.push(file);
                }
                written
            }
            Some(a) => {
                let name = match point {
                    SavePoint::Epoch(e) => format!("{project}-epoch-{e:04}"),
                    SavePoint::Final => project.clone(),
                    SavePoint::Interrupted(s) => format!("{project}-step-{s:06}"),
                    SavePoint::Errored(s) => format!("{project}-errored-step-{s:06}"),
                    SavePoint::Step(s) => format!("{project}-step-{s:06}"),
                } + suffix;
                let path = self.run.file(&format!("{name}.safetensors"));
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
                };
                a.save(&path, info)
                    .with_context(|| format!("saving {}", path.display()))?;
                vec![path]
            }
        };
        for p in &paths {
            progress.println(format!("saved {}", p.display()));
        }
        Ok(paths)
    }
}

/// The single-file checkpoint saved beside a diffusers folder: `final/` → `final.safetensors`.
fn single_file_path(dir: &std::path::Path) -> PathBuf {
    with_suffix(dir, ".safetensors")
}

/// `path` with `suffix` added to its last component (`final` → `final-ema`).
fn with_suffix(path: &std::path::Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

/// The device's memory reading, or none where it cannot be read.
fn read_memory(device: &Device) -> Option<MemoryUsage> {
    MemoryUsage::read(device).ok().flatten()
}

fn check_resolution(sd: &StableDiffusion, resolution: usize) -> anyhow::Result<()> {
    let factor = sd.vae_scale << sd.unet.config.num_downsamples();
    if !resolution.is_multiple_of(factor) {
        bail!(
            "resolution {resolution} must be a multiple of {factor} for this model (VAE ×{} and UNet ×{})",
            sd.vae_scale,
            1usize << sd.unet.config.num_downsamples()
        );
    }
    Ok(())
}

fn report_dataset(dataset: &LoadedDataset) {
    eprintln!(
        "data: {} images loaded, {} skipped",
        dataset.items.len(),
        dataset.skipped.len()
    );
    for (path, why) in &dataset.skipped {
        eprintln!("  skipped {}: {why}", path.display());
    }
}

fn write_plan(
    plan: &TrainPlan,
    run: &RunDir,
    resolution: usize,
    steps_per_epoch: usize,
    total_steps: usize,
    amp: Amp,
) -> anyhow::Result<()> {
    let mut value = serde_json::to_value(plan)?;
    if let Some(obj) = value.as_object_mut() {
        obj.insert(
            "resolved_at_start".into(),
            serde_json::json!({
                "resolution": resolution,
                "amp": amp.name(),
                "steps_per_epoch": steps_per_epoch,
                "total_steps": total_steps,
                "unet_schedule": plan.optimizer.unet.schedule.resolve(total_steps as u64),
                "text_encoder_schedule": plan.optimizer.text_encoder.schedule.resolve(total_steps as u64),
            }),
        );
    }
    let text = serde_json::to_string_pretty(&value)?;
    crate::fsutil::write_atomic(&run.file("plan.json"), text)?;
    Ok(())
}
