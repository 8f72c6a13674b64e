//! Sample images during a run (`sample_prompts`): every `sample_steps` steps, between optimizer
//! steps (no gradients or activations of training are alive then), each prompt is drawn at each
//! of its guidance scales and written to `<run>/samples/` ([`crate::sample::jobs`]).
//!
//! - The prompts are encoded once at the start when no text encoder trains, before a text
//!   cache releases the encoders; a run that trains one encodes them at each round.
//! - A run that released its VAE (latent cache) loads it again for the round and drops it after.
//! - The guidance halves run as one batch of 2 only when the training micro-batch is 2 or more;
//!   otherwise one after the other, as a micro-batch of 1. The UNet runs under checkpointing
//!   (the run's own, or one made for the round), so a forward keeps only block inputs alive
//!   even where its weights are training variables.
//! - A run with `zero_terminal_snr` draws on the rescaled schedule with guidance rescale 0.7
//!   ([`super::trained_schedule`]), following `load_settings_every_epoch` when it changes.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use candle_core::{DType, Device, Var};
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::ema::Ema;
use super::oom::find_oom;
use super::progress::Progress;
use crate::config::{SamplePlan, TrainPlan};
use crate::memory::trim_pool;
use crate::model::files::Component;
use crate::model::layout::ModelLayout;
use crate::model::pipeline::{load_vae, LoadOptions, StableDiffusion};
use crate::nn::Checkpointing;
use crate::precision::Amp;
use crate::sample::generate::{zero_empty_negative, PromptConds, UnetRun};
use crate::sample::jobs::{self, PromptImages, PromptJob, RoundFiles};
use crate::sample::SchedulerConfig;
use crate::tensorboard::EventWriter;

/// The run's sampling state.
pub struct TrainingSamples {
    pub plan: SamplePlan,
    jobs: Vec<PromptJob>,
    dir: PathBuf,
    scheduler: SchedulerConfig,
    /// One per job (host memory), when no text encoder trains.
    conds: Option<Vec<PromptConds>>,
    clip_skip: usize,
    zero_negative: bool,
    /// Draws the seeds of `-1` prompts.
    rng: StdRng,
    /// How the VAE is loaded again when the run released it.
    vae_load: LoadOptions,
}

/// What a round draws with, beside the model: the training state it must not disturb.
pub(super) struct Round<'a> {
    /// The EMA copy, when the plan samples the EMA weights too.
    pub ema: Option<&'a Ema>,
    /// The trained parameters (the EMA weights are swapped into them for its round).
    pub params: &'a [Var],
    /// The training micro-batch size in force.
    pub micro: usize,
    pub tensorboard: Option<&'a mut EventWriter>,
    pub device: &'a Device,
}

/// Where a run's samples go.
pub fn samples_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("samples")
}

impl TrainingSamples {
    /// Resolves the prompts for this model and encodes them when `te_trains` is false.
    #[allow(clippy::too_many_arguments)]
    pub fn setup(
        plan: &SamplePlan,
        sd: &StableDiffusion,
        run_dir: &Path,
        seed: u64,
        resolution: usize,
        captions: &[String],
        te_trains: bool,
        clip_skip: usize,
        vae_load: LoadOptions,
        zero_terminal_snr: bool,
    ) -> anyhow::Result<Self> {
        let align = sd.vae_scale << sd.unet.config.num_downsamples();
        let jobs = jobs::resolve(&plan.set, seed, resolution, align, captions)
            .map_err(anyhow::Error::msg)?;
        let scheduler = SchedulerConfig::from_layout(&sd.layout)?;
        let zero_negative = zero_empty_negative(sd);
        let conds = match te_trains {
            true => None,
            false => Some(
                jobs.iter()
                    .map(|j| {
                        j.encode(sd, clip_skip, zero_negative)?
                            .to_device(&Device::Cpu)
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?,
            ),
        };
        let mut samples = Self {
            plan: plan.clone(),
            jobs,
            dir: samples_dir(run_dir),
            scheduler,
            conds,
            clip_skip,
            zero_negative,
            rng: StdRng::seed_from_u64(seed ^ 0x5a4d_504c_4553),
            vae_load,
        };
        samples.follow_schedule(&sd.layout, zero_terminal_snr)?;
        Ok(samples)
    }

    /// Draws on the schedule a run with `zero_terminal_snr` trains on, from the model `layout`
    /// ([`super::trained_schedule`]); refuses, naming the prompts file, a sampler that cannot.
    pub fn follow_schedule(
        &mut self,
        layout: &ModelLayout,
        zero_terminal_snr: bool,
    ) -> anyhow::Result<()> {
        let layout = super::trained_schedule::trained_layout(layout, zero_terminal_snr)?;
        let scheduler = SchedulerConfig::from_layout(&layout)?;
        for j in &self.jobs {
            j.sampler.build(&scheduler, j.steps).map_err(|e| {
                let why = match zero_terminal_snr {
                    true => " (zero_terminal_snr: the run's samples draw on its rescaled schedule)",
                    false => "",
                };
                anyhow::anyhow!("{}: {e}{why}", self.plan.prompts_file.display())
            })?;
        }
        self.scheduler = scheduler;
        let rescale = super::trained_schedule::sample_guidance_rescale(zero_terminal_snr);
        for j in &mut self.jobs {
            j.guidance_rescale = rescale;
        }
        Ok(())
    }

    /// Whether optimizer step `step` (1-based) ends with samples (never when they are drawn by
    /// epochs).
    pub fn due(&self, step: usize) -> bool {
        self.plan.every_n_epochs.is_none()
            && step > 0
            && step.is_multiple_of(self.plan.every_n_steps)
    }

    /// Whether the end of epoch `epochs_done` (1-based) is drawn (kohya's
    /// `sample_every_n_epochs`).
    pub fn due_at_epoch_end(&self, epochs_done: usize) -> bool {
        self.plan
            .every_n_epochs
            .is_some_and(|n| epochs_done.is_multiple_of(n))
    }

    /// Draws every prompt at each of its guidance scales and writes the round's files, marked
    /// with `label` (`""`, or `"ema"` for the EMA weights).
    pub fn round(
        &mut self,
        sd: &StableDiffusion,
        run: UnetRun,
        step: usize,
        label: &str,
    ) -> anyhow::Result<RoundFiles> {
        let reloaded;
        let vae = match &sd.vae {
            Some(v) => v,
            None => {
                let files = sd
                    .layout
                    .component(Component::Vae)
                    .ok_or_else(|| anyhow::anyhow!("the model has no VAE to draw samples with"))?;
                reloaded = load_vae(files, &self.vae_load)?;
                &reloaded
            }
        };
        let mut round = Vec::with_capacity(self.jobs.len());
        for (i, job) in self.jobs.iter().enumerate() {
            let seed = job.seed_for_round(&mut self.rng);
            let conds = match &self.conds {
                Some(c) => c[i].clone(),
                None => job.encode(sd, self.clip_skip, self.zero_negative)?,
            };
            let images = job.draw(sd, vae, run, &self.scheduler, &conds, seed)?;
            round.push(PromptImages { job, seed, images });
        }
        Ok(jobs::write_round(&self.dir, step, label, &round)?)
    }
}

/// The run's sampling state when `plan` sets `sample_prompts`, announced on stderr.
#[allow(clippy::too_many_arguments)]
pub(super) fn start(
    plan: &TrainPlan,
    sd: &StableDiffusion,
    run_dir: &Path,
    seed: u64,
    resolution: usize,
    captions: &[String],
    te_trains: bool,
    amp: Amp,
    device: &Device,
) -> anyhow::Result<Option<TrainingSamples>> {
    let Some(samples) = &plan.samples else {
        return Ok(None);
    };
    let vae_load = LoadOptions {
        dtype: amp.compute_dtype(),
        vae_dtype: (amp == Amp::Fp16).then_some(DType::F32),
        device: device.clone(),
        train_unet: false,
        train_text_encoders: false,
        fp8_unet: false,
        fp8_text_encoders: false,
        trained_dtype: candle_core::DType::F32,
    };
    let clip_skip = plan.objective.clip_skip_layers;
    let started = TrainingSamples::setup(
        samples,
        sd,
        run_dir,
        seed,
        resolution,
        captions,
        te_trains,
        clip_skip,
        vae_load,
        plan.objective.zero_terminal_snr,
    )
    .context("sample_prompts")?;
    let n = samples.set.prompts.len();
    let every = match samples.every_n_epochs {
        Some(1) => "at the end of every epoch".to_string(),
        Some(e) => format!("at the end of every {e} epochs"),
        None => format!("every {} steps", samples.every_n_steps),
    };
    eprintln!(
        "samples: {n} prompt{} {every} into {}",
        if n == 1 { "" } else { "s" },
        samples_dir(run_dir).display()
    );
    Ok(Some(started))
}

impl TrainingSamples {
    /// Draws the round of step `step` with the trained weights and/or the EMA weights, as the
    /// plan asks. The UNet runs under checkpointing (one is made for the round when the run has
    /// none). Running out of memory skips the round with a warning; the run goes on.
    pub(super) fn draw(
        &mut self,
        sd: &mut StableDiffusion,
        amp: Amp,
        round: Round<'_>,
        step: usize,
        progress: &Progress,
    ) -> anyhow::Result<()> {
        let started = Instant::now();
        let own_checkpointing = sd.unet.checkpointing.is_none();
        if own_checkpointing {
            sd.unet.checkpointing = Some(Checkpointing::new(Vec::new(), round.device)?);
        }
        let run = UnetRun {
            dtype: amp.compute_dtype(),
            batch_halves: round.micro >= 2,
        };
        let result = self.rounds(sd, run, step, round.ema, round.params);
        if own_checkpointing {
            sd.unet.checkpointing = None;
        }
        let rounds = match result {
            Ok(rounds) => rounds,
            Err(e) => return skip_on_oom(e, step, round.device, progress),
        };
        if let Some(tb) = round.tensorboard {
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

    /// The trained weights' round and, when asked, the EMA weights'.
    fn rounds(
        &mut self,
        sd: &StableDiffusion,
        run: UnetRun,
        step: usize,
        ema: Option<&Ema>,
        params: &[Var],
    ) -> anyhow::Result<Vec<RoundFiles>> {
        let mut rounds = Vec::new();
        if self.plan.trained_model {
            rounds.push(self.round(sd, run, step, "")?);
        }
        if let (true, Some(ema)) = (self.plan.ema_model, ema) {
            rounds.push(ema.with_weights(params, || self.round(sd, run, step, "ema"))?);
        }
        Ok(rounds)
    }
}

/// A round that ran out of memory, or whose latents came out NaN or Inf, is skipped with a
/// warning (training's own checks judge the weights); any other error ends the run.
fn skip_on_oom(
    e: anyhow::Error,
    step: usize,
    device: &Device,
    progress: &Progress,
) -> anyhow::Result<()> {
    if let Some(bad) = e.downcast_ref::<crate::sample::generate::NonFiniteSample>() {
        progress.println(format!("warning: step {step}: samples skipped: {bad}"));
        return Ok(());
    }
    let Some(oom) = find_oom(&e) else {
        return Err(e.context(format!("drawing the samples of step {step}")));
    };
    drop(e);
    trim_pool(device).context("freeing memory after an OOM")?;
    progress.println(format!(
        "warning: step {step}: samples skipped, out of device memory ({})",
        oom.detail
    ));
    Ok(())
}
