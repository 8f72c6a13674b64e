//! Setting a run up, in the order that fails fast: the output folder and the save point to
//! resume first (a run that cannot save or resume should not load anything), then the model in
//! the run's precision with its adapters, the data and its buckets, the optimizer groups, the
//! run folder and logs; then the resumed state, EMA, samples and caches.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use candle_core::{DType, Device, Var};

use super::adapters;
use super::caches;
use super::class_images;
use super::data_feed::{self, DataFeed};
use super::data_parallel::RankLink;
use super::ema::Ema;
use super::interrupt::Interrupt;
use super::kohya_run_metadata::{KohyaRunMetadata, RunFacts};
use super::log::RunLog;
use super::loss_stats::Smoothed;
use super::micro_batch::MicroBatching;
use super::optimizer_step::Optimization;
use super::param_groups::{named_params, param_groups, schedule_change};
use super::resume::{self, RunKey, TrainerState};
use super::run_dir::RunDir;
use super::samples;
use super::trainer::{Extras, Model, Outputs, Position, RunOptions, Session};
use super::validation::Validation;
use crate::config::{
    CheckpointChoice, DataPlan, RegularizationPlan, RunShape, TrainMode, TrainPlan,
};
use crate::data::regularization::{add_regularization, RegularizationSummary};
use crate::data::{load_source, undersized, DataSource, ImageMeta, LoadedDataset};
use crate::diffusion::loss::LossConfig;
use crate::diffusion::{Objective, ObjectiveConfig};
use crate::memory::{prepare_device, DeviceSettings};
use crate::model::layout::ModelLayout;
use crate::model::pipeline::{LoadOptions, StableDiffusion};
use crate::model::source::ModelSource;
use crate::model::unet::CheckpointedBlocks;
use crate::nn::Checkpointing;
use crate::precision::{scaler_for, Amp, WeightDtype};

impl<'a> Session<'a> {
    /// Loads the model (frozen weights in the compute dtype, trainable ones as f32 masters),
    /// attaches adapters, reads the data, builds the optimizer groups and creates the run folder;
    /// then restores a save point and starts EMA, samples and caches.
    pub(super) fn setup(plan: &'a TrainPlan, opts: &'a RunOptions) -> anyhow::Result<Self> {
        Self::setup_with(plan, opts, None)
    }

    /// [`Session::setup`] for one rank of a data-parallel run. Rank 0 writes the run's folder
    /// and logs; every other rank keeps its log in a scratch folder removed at its end.
    pub(super) fn setup_rank(
        plan: &'a TrainPlan,
        opts: &'a RunOptions,
        link: RankLink,
    ) -> anyhow::Result<Self> {
        Self::setup_with(plan, opts, Some(link))
    }

    fn setup_with(
        plan: &'a TrainPlan,
        opts: &'a RunOptions,
        mut link: Option<RankLink>,
    ) -> anyhow::Result<Self> {
        let started = Instant::now();
        // Before anything slow loads: a run that cannot save, or resume, should not start. Only
        // the rank that saves checks (ranks checking the same folder at once race).
        if link.as_ref().is_none_or(RankLink::leads) {
            super::run_dir::ensure_output_dir(&plan.output_dir)?;
            if let Some(dir) = &plan.saving.ckpt_dir {
                super::run_dir::ensure_output_dir(dir).context("save_ckpt_dir")?;
            }
        }
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
        // The run's seed: a resumed run draws as the saved one did (adapter dropout masks, the
        // validation split, the data order).
        let data_seed = resume_from.as_ref().map_or(plan.seed, |(_, st)| st.seed);
        let world = link.as_ref().map_or(1, RankLink::world);
        let mut model = load(plan, opts, data_seed, (world, &interrupt))?;
        let (feed, validation) = load_data(plan, &model, data_seed, opts.show_progress)?;
        if let Some(e) = &model.embedding {
            let captions: Vec<&str> = feed
                .dataset
                .items
                .iter()
                .map(|m| m.caption.as_str())
                .collect();
            e.check_captions(&model.sd, &captions)?;
        }
        if let Some(l) = link.as_mut() {
            let init_from = plan
                .adapter
                .as_ref()
                .and_then(|a| a.init_from.as_deref())
                .or(plan.embedding.as_ref().and_then(|e| e.init_from.as_deref()));
            let save_point = resume_from.as_ref().map(|(dir, _)| dir.as_path());
            let files =
                super::rank_agreement::start_files(&model.sd.layout, init_from, save_point)?;
            super::rank_agreement::check_same_files(l.coll.as_mut(), &files)?;
            let reg_root = plan
                .data
                .regularization
                .as_ref()
                .map(|r| r.data_root.as_path());
            let roots: Vec<&Path> = std::iter::once(plan.data.data_root.as_path())
                .chain(reg_root)
                .collect();
            super::rank_agreement::check_same_data(l.coll.as_mut(), &feed.dataset.items, &roots)?;
        }
        let steps_per_epoch = feed.steps_in(&feed.epoch(data_seed, 0));
        let total_steps = plan.total_steps(|e| feed.steps_in(&feed.epoch(data_seed, e)));
        let mut opt = optimization(plan, &mut model, total_steps, data_seed, &opts.device)?;
        opt.te_stop = plan.text_encoder_stop(|e| feed.steps_in(&feed.epoch(data_seed, e)));
        let follower = link.as_ref().filter(|l| !l.leads()).map(RankLink::rank);
        opt.dist = link;
        let shape = StartShape {
            shape: RunShape {
                resolution: model.resolution,
                amp: model.amp,
            },
            steps_per_epoch,
            total_steps,
        };
        let resumed = resume_from
            .as_ref()
            .map(|(dir, state)| (dir.as_path(), state.steps));
        let outputs = match follower {
            Some(rank) => follower_outputs(rank, started)?,
            None => open_outputs(plan, resumed, &shape, started)?,
        };
        if follower.is_none() {
            crate::console::say(format_args!(
                "run folder: {}\n{} samples/epoch, {} steps/epoch of {}×{}, {} steps in all",
                outputs.run.path.display(),
                feed.dataset.epoch_len(),
                steps_per_epoch,
                batch_sizes(plan),
                plan.grad_accum,
                total_steps
            ));
            report_undersized(&feed, &outputs.run.path, &plan.data.data_root)?;
        }
        let mut session = Self {
            plan,
            opts,
            pos: Position {
                seed: plan.seed,
                key: run_key(plan, model.resolution),
                epoch: 0,
                steps_in_epoch: 0,
                resumed: None,
            },
            model,
            feed,
            opt,
            outputs,
            extras: Extras {
                ema: None,
                samples: None,
                // Rank 0 alone validates: the others leave the held-out images out of training
                // (the split above) but do not keep or cache them.
                validation: validation.filter(|_| follower.is_none()),
                val_loss: None,
                val_sets: Default::default(),
                vram_cap,
                smoothed: Smoothed::new(0.9),
                interrupt,
                skips: Default::default(),
                watch: Default::default(),
                save_clock: Default::default(),
                live: super::settings_reload::LiveSettings::of(plan),
                reloaded: None,
            },
        };
        if follower.is_none() && plan.mode.is_adapter() {
            session.outputs.kohya = Some(session.kohya_metadata(steps_per_epoch, total_steps)?);
        }
        session.start_extras(resume_from)?;
        Ok(session)
    }

    /// The run's kohya metadata for its adapter files ([`KohyaRunMetadata`]).
    fn kohya_metadata(
        &self,
        steps_per_epoch: usize,
        total_steps: usize,
    ) -> anyhow::Result<KohyaRunMetadata> {
        let validation = self.extras.validation.as_ref();
        let facts = RunFacts {
            plan: self.plan,
            items: &self.feed.dataset.items,
            buckets: &self.feed.buckets,
            amp: self.model.amp,
            checkpointing: self.model.checkpointing.is_some(),
            steps_per_epoch,
            total_steps,
            world: self.opt.dist.as_ref().map_or(1, |l| l.world()),
            validation_images: validation.map_or(0, |v| v.sets.iter().map(|s| s.items.len()).sum()),
            regularization: self.feed.regularization.as_ref(),
            session_id: rand::random(),
        };
        KohyaRunMetadata::of(&facts)
            .with_context(|| format!("hashing the base model {}", self.plan.model))
    }

    /// Restores the save point, if any, then starts the EMA, the samples and the caches.
    fn start_extras(&mut self, resume_from: Option<(PathBuf, TrainerState)>) -> anyhow::Result<()> {
        let resumed_dir = match resume_from {
            Some((dir, state)) => {
                self.restore(&dir, state)?;
                Some(dir)
            }
            None => None,
        };
        let resumed = resumed_dir.is_some();
        let ema_file = resumed_dir.map(|d| d.join(resume::EMA_FILE));
        let named = named_params(&self.opt.groups);
        let (total, device) = (self.opt.total_steps, &self.opts.device);
        self.extras.ema = Ema::start(
            self.plan.ema.as_ref(),
            &named,
            total,
            ema_file.as_deref(),
            device,
        )?;
        if let (Some(ema), Some(source)) = (&mut self.extras.ema, &self.plan.ema_resume_model) {
            match resumed {
                true => crate::console::say(format_args!(
                    "ema: ema_resume_model `{source}` is not used: the save point's EMA continues"
                )),
                false => super::ema_init::start_ema_from(ema, self.plan, source)?,
            }
        }
        // Before the caches: a text cache releases the encoders the prompts need.
        let captions: Vec<String> = self
            .feed
            .dataset
            .items
            .iter()
            .map(|m| m.caption.clone())
            .collect();
        // Rank 0 alone samples: the other ranks neither encode the prompts nor announce a round.
        let leads = self.opt.dist.as_ref().is_none_or(RankLink::leads);
        self.extras.samples = match leads {
            false => None,
            true => samples::start(
                self.plan,
                &self.model.sd,
                &self.outputs.run.path,
                self.pos.seed,
                self.model.resolution,
                &captions,
                self.opt.text_encoder_trains(),
                self.model.amp,
                device,
            )?,
        };
        let built = caches::build(
            self.plan,
            &mut self.model.sd,
            &mut self.feed,
            self.extras.validation.as_mut(),
            device,
            self.opt
                .dist
                .as_mut()
                .map(|l| l.coll.as_mut() as &mut dyn crate::dist::Collective),
        )?;
        self.model.text_cache = built.text;
        self.outputs.caches = built.lines;
        Ok(())
    }

    /// Continues from save point `dir`: parameters, optimizer states, the loss scaler and the
    /// micro-batch ([`resume::restore`]), then the seed and the position in the data order.
    fn restore(&mut self, dir: &Path, state: TrainerState) -> anyhow::Result<()> {
        resume::restore(dir, &state, &mut self.opt, &self.pos.key)?;
        if state.seed != self.pos.seed {
            crate::console::say(format_args!(
                "resume: seed {} from the save point",
                state.seed
            ));
        }
        self.pos.seed = state.seed;
        (self.pos.epoch, self.pos.steps_in_epoch) = (state.epoch, state.steps_in_epoch);
        let total = self.opt.total_steps;
        if let Some(saved) = state.total_steps.filter(|&t| t != total) {
            crate::console::say(format_args!(
                "warning: resume: the run's length changed from {saved} to {total} steps; {}",
                schedule_change(&self.opt.groups, saved, state.steps)
            ));
        }
        self.pos.resumed = Some(state);
        Ok(())
    }
}

/// The optimizer groups over the model's trainable parameters, the loss scaler and the
/// micro-batch; gradient checkpointing is attached for those parameters when on.
/// The optimizer groups, checkpointing and loss scaler; `seed` (the run's) seeds the stochastic
/// rounding of bf16/f16 trained weights.
fn optimization(
    plan: &TrainPlan,
    model: &mut Model,
    total_steps: usize,
    seed: u64,
    device: &Device,
) -> anyhow::Result<Optimization> {
    let shape = super::param_groups::GroupShape {
        total_steps: total_steps as u64,
        rounding_seed: seed,
    };
    let trained = super::param_groups::Trained {
        adapters: model.adapters.as_ref(),
        embedding: model.embedding.as_ref(),
    };
    let groups = param_groups(&model.sd, plan, trained, shape)?;
    let params: Vec<Var> = groups.iter().flat_map(|g| g.vars.iter().cloned()).collect();
    let fused = plan.precision.fused_backward_pass;
    if fused && model.amp == Amp::Fp16 {
        bail!(
            "fused_backward_pass: this card computes in fp16 (no bf16), whose loss scaler must \
             see every gradient before any update; set amp to \"off\" or turn \
             fused_backward_pass off"
        );
    }
    if let Some(blocks) = checkpointed_blocks(plan, model, device)? {
        // The text encoders are checkpointed with every UNet block (`true`), not by `"auto"`.
        let te_trains = groups.len() > 1 && blocks.is_all();
        let ck = attach_checkpointing(&mut model.sd, &params, te_trains, device)?;
        ck.track_uses(fused);
        model.sd.unet.checkpointed = blocks;
        model.checkpointing = Some(ck);
    }
    let scaler = scaler_for(
        model.amp,
        plan.precision.scaler,
        plan.optimizer.grad_scaler_step_tweaks,
    );
    Ok(Optimization {
        groups,
        params,
        scaler,
        micro: MicroBatching::new(plan.largest_batch()),
        total_steps,
        fused,
        dist: None,
        te_stop: plan.stop_text_encoder_training,
    })
}

/// The UNet blocks to checkpoint: none, all (`true`), or what `"auto"` chooses to fit
/// `vram_limit_gb`, else the card's free memory (nothing on the CPU without `vram_limit_gb`).
fn checkpointed_blocks(
    plan: &TrainPlan,
    model: &Model,
    device: &Device,
) -> anyhow::Result<Option<CheckpointedBlocks>> {
    let cfg = &model.sd.unet.config;
    match plan.precision.gradient_checkpointing {
        CheckpointChoice::Off => return Ok(None),
        CheckpointChoice::On => return Ok(Some(CheckpointedBlocks::all(cfg))),
        CheckpointChoice::Auto => {}
    }
    const GIB: f64 = (1u64 << 30) as f64;
    let card = match plan.vram_limit_gb {
        Some(gb) => Some((gb * GIB, "vram_limit_gb".to_string())),
        None => crate::memory::MemoryUsage::read(device)?
            .and_then(|u| u.device_free_bytes)
            .map(|b| (b as f64, "the card's free memory at the start".to_string())),
    };
    let census = super::state_estimate::estimate(plan)
        .context("gradient_checkpointing \"auto\": pricing the model")?
        .census;
    let native = model.layout.native_resolution;
    let memory = super::memory_plan::plan_memory(plan, model.amp, cfg, native, &census, card);
    let decision = memory.checkpointing;
    if let Some(note) = &decision.note {
        crate::console::say(format_args!("gradient checkpointing {note}"));
    }
    Ok(decision.blocks)
}

/// What the run's shape resolved to at its start, written into plan.json.
struct StartShape {
    shape: RunShape,
    steps_per_epoch: usize,
    total_steps: usize,
}

/// The model for `plan` in its precision, with its adapters (drawn from `seed`), objective and
/// resolution, and described on stderr. The class images `reg_data_root` lacks are drawn with
/// the base model first (`ranks`: the run's rank count and its Ctrl-C).
fn load(
    plan: &TrainPlan,
    opts: &RunOptions,
    seed: u64,
    (world, interrupt): (usize, &Interrupt),
) -> anyhow::Result<Model> {
    let layout = open_model(plan, true)?;
    let RunShape { resolution, amp } =
        plan.run_shape(layout.native_resolution, Amp::default_for(&opts.device));
    describe_model(plan, &layout, amp);
    let mut sd = load_model(&layout, plan, opts, amp)?;
    let regularization = plan.data.regularization.as_ref();
    if let Some(reg) = regularization.filter(|r| r.class_images.is_some()) {
        // As a training run's samples: the UNet under a checkpointing of no parameters, which
        // keeps no block's activations for a backward that never comes.
        let own_checkpointing = sd.unet.checkpointing.is_none();
        if own_checkpointing {
            sd.unet.checkpointing = Some(Checkpointing::new(Vec::new(), &opts.device)?);
        }
        let cx = class_images::DrawContext {
            sd: &sd,
            amp,
            resolution: layout.native_resolution,
            seed,
            world,
            interrupt,
        };
        let drawn = class_images::fill(reg, &plan.data.layout, &cx);
        if own_checkpointing {
            sd.unet.checkpointing = None;
        }
        drawn.context("class_prompt")?;
    }
    let adapters = match plan.mode {
        TrainMode::Full | TrainMode::TextualInversion => None,
        _ => Some(adapters::attach(&mut sd, plan, seed)?),
    };
    // Textual inversion's vectors, or a LoRA's (pivotal tuning), after any adapters attach.
    let embedding = match plan.embedding {
        Some(_) => Some(super::embeddings::attach(&mut sd, plan, &opts.device)?),
        None => None,
    };
    check_resolution(&sd, resolution)?;
    for shape in plan.dataset_shapes() {
        check_resolution(&sd, shape.resolution_or(layout.native_resolution))?;
    }
    let objective = build_objective(plan, &layout)?;
    Ok(Model {
        layout,
        sd,
        adapters,
        embedding,
        objective,
        amp,
        resolution,
        checkpointing: None,
        text_cache: None,
    })
}

/// The training data in its buckets, and the validation set held out of it (or read from its
/// own folder), both announced on stderr.
fn load_data(
    plan: &TrainPlan,
    model: &Model,
    data_seed: u64,
    show_progress: bool,
) -> anyhow::Result<(DataFeed, Option<Validation>)> {
    let data = &plan.data;
    let (mut dataset, config_reg) = match &data.dataset_config {
        Some(config) => {
            let mut images =
                super::config_subsets::load_subsets(config, data.max_image_pixels, show_progress)?;
            let reg = images.take_regularization();
            (images.train, Some((reg, config.prior_loss_weight)))
        }
        None => {
            let source = data_source("data_root", &data.data_root, data);
            (load_source(&source, show_progress)?, None)
        }
    };
    let align = model.sd.vae_scale << model.sd.unet.config.num_downsamples();
    let native = model.layout.native_resolution;
    let rules = data_feed::DatasetRules::of(plan, native, align)?;
    let mut validation = hold_out_validation(plan, &mut dataset, data_seed, &rules)?;
    prepare_captions(&mut dataset.items, data);
    for set in validation.iter_mut().flat_map(|v| v.sets.iter_mut()) {
        prepare_captions(&mut set.items, data);
    }
    report_dataset(&dataset);
    if dataset.epoch_len() == 0 {
        bail!(
            "data_root {} has no samples per epoch (the multipliers add up to less than 1)",
            data.data_root.display(),
        );
    }
    let regularization = match (&data.regularization, config_reg) {
        (Some(reg), _) => Some(load_regularization(reg, data, &mut dataset, show_progress)?),
        (None, Some((sets, weight))) => {
            let summary =
                super::config_subsets::add_config_regularization(&mut dataset, sets, weight);
            if let Some(s) = &summary {
                crate::console::say(format_args!("{}", s.describe(weight)));
            }
            summary
        }
        (None, None) => None,
    };
    if data.weighted_captions {
        let val = validation.iter().flat_map(|v| v.sets.iter());
        let items = dataset.items.iter().chain(val.flat_map(|s| s.items.iter()));
        super::weighted_captions::check_captions(
            items.map(|i| (i.path.as_path(), i.caption.as_str())),
        )?;
    }
    let masks = plan.objective.loss.mask.map(|m| m.source);
    let mut feed = DataFeed::new(dataset, &rules, data, plan.grad_accum, masks);
    feed.regularization = regularization;
    if rules.is_mixed() {
        report_datasets(plan, &rules, &feed);
    } else if data.buckets.is_some() {
        let list: Vec<String> = feed
            .bucket_counts()
            .iter()
            .map(|c| format!("{} ×{}", c.bucket, c.images))
            .collect();
        crate::console::say(format_args!("aspect buckets: {}", list.join(", ")));
    }
    Ok((feed, validation))
}

/// The image folder train.json's `key` names, read in the run's layout and pixel limit.
fn data_source<'a>(key: &'static str, root: &'a Path, data: &'a DataPlan) -> DataSource<'a> {
    // diffusers' DreamBooth prompts caption the images that have no caption of their own.
    let default_caption = match key {
        "reg_data_root" => data
            .regularization
            .as_ref()
            .and_then(|r| r.class_images.as_ref())
            .map(|c| c.prompt.as_str()),
        _ => data.instance_prompt.as_deref(),
    };
    DataSource {
        key,
        root,
        layout: &data.layout,
        max_pixels: data.max_image_pixels,
        all_caption_lines: data.kohya_captions.wildcard,
        default_caption,
    }
}

/// kohya's `caption_prefix` and `caption_suffix` on every image of `items`, and, when captions
/// do not change from step to step (no shuffle, tag dropout or wildcards), kohya's
/// `secondary_separator` replaced once, so the text cache holds the captions that train.
fn prepare_captions(items: &mut [ImageMeta], data: &DataPlan) {
    let (prefix, suffix) = (
        data.caption_prefix.as_deref(),
        data.caption_suffix.as_deref(),
    );
    let k = &data.kohya_captions;
    let per_step =
        data.shuffle_tags || data.tag_dropout > 0.0 || k.wildcard || k.token_warmup.is_some();
    let secondary = k.secondary_separator.as_deref().filter(|_| !per_step);
    for item in items {
        // A dataset config's subset (a validation image split out of one too): its own affixes
        // are on already; its secondary separator is replaced once unless its captions change
        // per step (validation images train with no per-step change).
        if let Some(index) = item.options.subset {
            let subset = data
                .dataset_config
                .as_ref()
                .and_then(|c| c.subsets.get(index));
            if let Some(rules) = subset.map(|s| &s.captions) {
                if item.options.subset_captions.is_none() || !rules.per_step() {
                    item.caption = crate::data::kohya_caption::replace_secondary_with(
                        &item.caption,
                        rules.keys.secondary_separator.as_deref(),
                        &rules.separator,
                    );
                }
            }
            continue;
        }
        item.add_affixes(prefix, suffix);
        if secondary.is_some() {
            item.caption = crate::data::kohya_caption::replace_secondary(&item.caption, secondary);
        }
    }
}

/// `reg_data_root`'s images, read in the run's layout and added to `dataset` balanced and
/// weighed ([`crate::data::regularization`]), announced on stderr.
fn load_regularization(
    reg: &RegularizationPlan,
    data: &DataPlan,
    dataset: &mut LoadedDataset,
    show_progress: bool,
) -> anyhow::Result<RegularizationSummary> {
    let source = data_source("reg_data_root", &reg.data_root, data);
    let mut images = load_source(&source, show_progress)?;
    prepare_captions(&mut images.items, data);
    for (path, why) in &images.skipped {
        crate::console::say(format_args!("  skipped {}: {why}", path.display()));
    }
    let summary = add_regularization(dataset, images, reg.prior_loss_weight);
    crate::console::say(format_args!("{}", summary.describe(reg.prior_loss_weight)));
    Ok(summary)
}

/// The run's folder and logs: the save point's run continues in its own folder and log, a new
/// run gets a new folder with plan.json.
fn open_outputs(
    plan: &TrainPlan,
    resumed: Option<(&Path, usize)>,
    shape: &StartShape,
    started: Instant,
) -> anyhow::Result<Outputs> {
    let run = match resumed {
        Some((dir, _)) => RunDir {
            path: dir.parent().unwrap_or(dir).to_path_buf(),
        },
        None => {
            let run = RunDir::create(&plan.output_dir, &plan.run_folder_prefix())?;
            write_plan(plan, &run, shape)?;
            run
        }
    };
    let log = RunLog::open(
        &plan.log_folder(&run.path),
        plan.tensorboard,
        resumed.map(|r| r.1),
    )?;
    let started_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    Ok(Outputs {
        run,
        log,
        started,
        started_unix,
        caches: Vec::new(),
        _scratch: None,
        kohya: None,
    })
}

/// A data-parallel follower's outputs: its log in a scratch folder of its own, removed when the
/// rank ends (rank 0 writes the run's).
fn follower_outputs(rank: usize, started: Instant) -> anyhow::Result<Outputs> {
    let scratch = super::data_parallel::ScratchDir::create(rank)?;
    let log = RunLog::open(&scratch.path().join("logs"), false, None)?;
    Ok(Outputs {
        run: RunDir {
            path: scratch.path().to_path_buf(),
        },
        log,
        started,
        started_unix: 0.0,
        caches: Vec::new(),
        _scratch: Some(scratch),
        kohya: None,
    })
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
        Some(c) => {
            crate::console::say(format_args!("vram_limit_gb: this run has {}", c.describe()))
        }
        None => crate::console::say(format_args!(
            "vram_limit_gb {gb} applies to CUDA cards; not on the CPU"
        )),
    }
    Ok(cap)
}

/// The plan's model, resolved (hub cache, folder or single file), with the plan's `vae` in
/// place of its own. `say`: tell the console which VAE is used.
pub(super) fn open_model(plan: &TrainPlan, say: bool) -> anyhow::Result<ModelLayout> {
    let source =
        ModelSource::parse(&plan.model).with_context(|| format!("model `{}`", plan.model))?;
    let variant = plan.model_file.variant.as_deref();
    let dir = source
        .resolve_for(variant)
        .with_context(|| format!("model `{}`", plan.model))?;
    let layout = dir.noting_copy(ModelLayout::read_with(
        &dir.path,
        variant,
        &plan.single_file_options(),
    ))?;
    let Some(spec) = &plan.model_file.vae else {
        return Ok(layout);
    };
    let vae = vae_override(&layout, spec, variant)?;
    if say {
        crate::console::say(format_args!(
            "vae: {}, in place of the model's",
            vae.described
        ));
    }
    Ok(layout.with_vae(vae.files))
}

/// The plan's `vae` read against `layout`'s own VAE.
pub(super) fn vae_override(
    layout: &ModelLayout,
    spec: &str,
    variant: Option<&str>,
) -> anyhow::Result<crate::model::vae_source::VaeOverride> {
    let base = layout
        .component(crate::model::files::Component::Vae)
        .context("the model has no VAE to replace")?;
    Ok(crate::model::vae_source::open_vae(spec, base, variant)?)
}

/// The model and the run's precision, on stderr.
fn describe_model(plan: &TrainPlan, layout: &ModelLayout, amp: Amp) {
    let weights = match plan.precision.weight_dtype {
        WeightDtype::F32 => String::new(),
        w => format!(", trained weights {} (stochastic rounding)", w.name()),
    };
    let from = match layout.single_file() {
        Some(sf) => format!(" (from {})", sf.prediction_from),
        None => String::new(),
    };
    crate::console::say(format_args!(
        "model: {} ({}, {} prediction{from}, native {}px); precision {}{weights}{}",
        plan.model,
        layout.family.name(),
        layout.prediction_type.name(),
        layout.native_resolution,
        amp.name(),
        match plan.precision.gradient_checkpointing {
            CheckpointChoice::Off => "",
            CheckpointChoice::On => ", gradient checkpointing",
            CheckpointChoice::Auto => ", gradient checkpointing auto",
        }
    ));
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
    let load = LoadOptions {
        dtype: amp.compute_dtype(),
        vae_dtype: (amp == Amp::Fp16).then_some(DType::F32),
        device: opts.device.clone(),
        // Adapter modes keep the base frozen (plain tensors): only the adapters are Vars.
        train_unet: full && plan.train_unet,
        train_text_encoders: full && plan.train_text_encoder,
        trained_dtype: plan.precision.weight_dtype.dtype(),
        fp8_unet: plan.precision.base_weight_dtype.fp8_unet(),
        fp8_text_encoders: plan.precision.base_weight_dtype.fp8_text_encoders(),
    };
    let mut sd = StableDiffusion::load(layout.clone(), &load)?;
    if load.fp8_unet {
        describe_fp8_base(&mut sd, amp);
    }
    merge_base_weights(&mut sd, plan, &opts.device)?;
    Ok(sd)
}

/// kohya's `base_weights`: each file merged into the frozen model, at its multiplier, before
/// anything trains or is cached.
fn merge_base_weights(
    sd: &mut StableDiffusion,
    plan: &TrainPlan,
    device: &Device,
) -> anyhow::Result<()> {
    if plan.model_file.base_weights.is_empty() {
        return Ok(());
    }
    let naming = crate::adapter::kohya_naming(sd);
    for (path, multiplier) in &plan.model_file.base_weights {
        let label = || format!("base_weights {}", path.display());
        let file = crate::adapter::kohya_file::load_kohya(path, device).with_context(label)?;
        let n = crate::adapter::merge::merge_kohya(sd, &naming, &file, *multiplier)
            .with_context(label)?;
        crate::console::say(format_args!(
            "base_weights: merged {n} modules of {} (×{multiplier}) into the model",
            path.display()
        ));
    }
    Ok(())
}

/// The fp8 base's layers and bytes, on stderr.
fn describe_fp8_base(sd: &mut StableDiffusion, amp: Amp) {
    use crate::nn::{LayerMut, VisitLayers};
    let (mut layers, mut elements) = (0usize, 0usize);
    let mut count = |l: LayerMut<'_>| {
        let (w, s) = match l {
            LayerMut::Linear(l) => (&l.weight, &l.weight_scale),
            LayerMut::Conv2d(c) => (&c.weight, &c.weight_scale),
        };
        if s.is_some() {
            layers += 1;
            elements += w.elem_count();
        }
    };
    sd.unet.visit_layers(&mut count);
    for te in sd.text_encoders.iter_mut() {
        te.model.visit_layers(&mut count);
    }
    let mib = |b: f64| b / (1u64 << 20) as f64;
    crate::console::say(format_args!(
        "frozen base fp8: {layers} layers in {:.1} MiB ({:.1} MiB in {}), dequantised to {} where \
         used",
        mib(elements as f64),
        mib((elements * amp.compute_dtype().size_in_bytes()) as f64),
        amp.compute_dtype().as_str(),
        amp.compute_dtype().as_str()
    ));
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

/// The objective of `plan` for the model in `layout`.
pub(super) fn build_objective(plan: &TrainPlan, layout: &ModelLayout) -> anyhow::Result<Objective> {
    let o = &plan.objective;
    let mut schedule = o
        .train_sampler
        .schedule(&layout.scheduler_json()?, &layout.scheduler_config)?;
    if o.zero_terminal_snr {
        schedule = schedule.with_zero_terminal_snr();
        if schedule.prediction_type() == crate::model::family::PredictionType::Epsilon {
            crate::console::say(format_args!(
                "warning: zero_terminal_snr on an epsilon-prediction model: at the last timestep \
                 the noisy latent is the noise itself, so that step teaches nothing; the paper \
                 pairs zero terminal SNR with v-prediction (SD2.x-v)"
            ));
        }
    }
    let loss = LossConfig {
        loss_type: o.loss.loss_type,
        min_snr_gamma: o.min_snr_gamma,
        debiased_estimation: o.loss.debiased_estimation,
        debiased_v_sqrt: o.loss.debiased_v_sqrt,
        v_pred: o.loss.v_pred,
        mask: match o.loss.mask {
            Some(m) => m.weighting,
            None => LossConfig::mse().mask,
        },
        p2_gamma: o.loss.p2_gamma,
        scale: o.loss.scaler.factor(plan.batch_size, plan.grad_accum),
    };
    Ok(Objective::new(
        schedule,
        ObjectiveConfig {
            timestep_start: o.timestep_start as u32,
            timestep_end: o.timestep_end as u32,
            timestep_distribution: o.timestep_distribution,
            timestep_shift: o.timestep_shift,
            zero_frequency_noise_ratio: o.zero_frequency_noise_ratio,
            offset_variant: o.offset_variant,
            pyramid: o.pyramid_noise,
            loss,
            input_perturbation: o.input_perturbation,
            embedding_perturbation: o.embedding_perturbation,
            generalized_offset_noise: o.generalized_offset_noise,
            perturbation_noise_weight: o.perturbation_noise_weight,
        },
    )?)
}

/// The validation set, when asked for: held out of `dataset` (or read from its own folder).
fn hold_out_validation(
    plan: &TrainPlan,
    dataset: &mut LoadedDataset,
    data_seed: u64,
    buckets: &data_feed::DatasetRules,
) -> anyhow::Result<Option<Validation>> {
    let Some(v) = &plan.data.validation else {
        return Ok(None);
    };
    let subsets = plan
        .data
        .dataset_config
        .as_ref()
        .map_or(&[][..], |c| c.subsets.as_slice());
    let mut val = Validation::setup(
        v,
        dataset,
        (data_seed, subsets),
        buckets,
        plan.data.max_image_pixels,
    )?;
    val.masks = plan.objective.loss.mask.map(|m| m.source);
    let sets: Vec<String> = val
        .sets
        .iter()
        .map(|s| format!("{} ({} images)", s.name, s.items.len()))
        .collect();
    let what = match val.sets.as_slice() {
        [one] => format!("{} images", one.items.len()),
        _ => sets.join(", "),
    };
    crate::console::say(format_args!("validation: {what}, {}", v.when_text()));
    Ok(Some(val))
}

/// EveryDream2's warning for training images smaller than their bucket (one line) and their
/// list in the run folder's `undersized_images.txt`.
fn report_undersized(feed: &DataFeed, run_dir: &Path, data_root: &Path) -> anyhow::Result<()> {
    let list = undersized::find_undersized(&feed.dataset.items, &feed.buckets);
    if !list.is_empty() {
        let written = undersized::write_list(run_dir, &list)?;
        crate::console::say(format_args!(
            "{}",
            undersized::warning_line(&list, data_root, &written)
        ));
    }
    Ok(())
}

/// One line per dataset of a dataset config whose datasets train at different resolutions,
/// batch sizes or buckets: its shape and its images per bucket.
fn report_datasets(plan: &TrainPlan, rules: &data_feed::DatasetRules, feed: &DataFeed) {
    for (d, shape) in plan.dataset_shapes().iter().enumerate() {
        let mut counts: Vec<(crate::data::Bucket, usize)> = Vec::new();
        for (item, bucket) in feed.dataset.items.iter().zip(&feed.buckets) {
            if rules.dataset_of(item) != d {
                continue;
            }
            match counts.iter_mut().find(|(b, _)| b == bucket) {
                Some((_, n)) => *n += 1,
                None => counts.push((*bucket, 1)),
            }
        }
        counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let list: Vec<String> = counts.iter().map(|(b, n)| format!("{b} ×{n}")).collect();
        crate::console::say(format_args!(
            "{}: {} px, batch {}, buckets: {}",
            shape.name,
            rules.resolutions[d],
            rules.batch_sizes[d],
            if list.is_empty() {
                "no images".to_string()
            } else {
                list.join(", ")
            }
        ));
    }
}

fn report_dataset(dataset: &LoadedDataset) {
    crate::console::say(format_args!(
        "data: {} images loaded, {} skipped",
        dataset.items.len(),
        dataset.skipped.len()
    ));
    for (path, why) in &dataset.skipped {
        crate::console::say(format_args!("  skipped {}: {why}", path.display()));
    }
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

/// What a resume must share with this run.
fn run_key(plan: &TrainPlan, resolution: usize) -> RunKey {
    RunKey {
        model: plan.model.clone(),
        mode: format!("{:?}", plan.mode).to_lowercase(),
        data_root: plan.data.data_root.clone(),
        resolution,
        batch_size: plan.largest_batch(),
        grad_accum: plan.grad_accum,
        data_shape: format!(
            "buckets {}, crop_jitter {}{}",
            match &plan.data.buckets {
                None => "off".to_string(),
                Some(b) => format!("{:?} up to {:?}", b.aspects, b.max_ratio),
            },
            plan.data.crop_jitter,
            // Only where the datasets differ, so older save points keep their key.
            match &plan.data.dataset_config {
                Some(c) if c.mixed_shapes() => format!(", datasets {:?}", c.shapes),
                _ => String::new(),
            }
        ),
    }
}

/// The run's micro-batch size, or each dataset's (`2/1`) when they differ.
fn batch_sizes(plan: &TrainPlan) -> String {
    let sizes: Vec<String> = plan
        .dataset_shapes()
        .iter()
        .map(|s| s.batch_size.to_string())
        .collect();
    match sizes.iter().all(|s| *s == sizes[0]) {
        true => plan.batch_size.to_string(),
        false => sizes.join("/"),
    }
}

fn write_plan(plan: &TrainPlan, run: &RunDir, shape: &StartShape) -> anyhow::Result<()> {
    let mut value = serde_json::to_value(plan)?;
    let total = shape.total_steps as u64;
    if let Some(obj) = value.as_object_mut() {
        obj.insert(
            "resolved_at_start".into(),
            serde_json::json!({
                "resolution": shape.shape.resolution,
                "amp": shape.shape.amp.name(),
                "steps_per_epoch": shape.steps_per_epoch,
                "total_steps": shape.total_steps,
                "unet_schedule": plan.optimizer.unet.schedule.resolve(total),
                "text_encoder_schedule": plan.optimizer.text_encoder.schedule.resolve(total),
            }),
        );
    }
    let text = serde_json::to_string_pretty(&value)?;
    crate::fsutil::write_atomic(&run.file("plan.json"), text)?;
    Ok(())
}
