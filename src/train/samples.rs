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

use std::path::{Path, PathBuf};

use candle_core::Device;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::config::SamplePlan;
use crate::model::files::Component;
use crate::model::pipeline::{load_vae, LoadOptions, StableDiffusion};
use crate::sample::generate::{zero_empty_negative, PromptConds, UnetRun};
use crate::sample::jobs::{self, PromptImages, PromptJob, RoundFiles};
use crate::sample::{image_out, SchedulerConfig};

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
    ) -> anyhow::Result<Self> {
        let align = sd.vae_scale << sd.unet.config.num_downsamples();
        let jobs = jobs::resolve(&plan.set, seed, resolution, align, captions)
            .map_err(anyhow::Error::msg)?;
        let scheduler = SchedulerConfig::from_layout(&sd.layout)?;
        for j in &jobs {
            j.sampler
                .build(&scheduler, j.steps)
                .map_err(|e| anyhow::anyhow!("{}: {e}", plan.prompts_file.display()))?;
        }
        let zero_negative = zero_empty_negative(sd);
        let conds = match te_trains {
            true => None,
            false => Some(
                jobs.iter()
                    .map(|j| encode(sd, j, clip_skip, zero_negative)?.to_device(&Device::Cpu))
                    .collect::<candle_core::Result<Vec<_>>>()?,
            ),
        };
        Ok(Self {
            plan: plan.clone(),
            jobs,
            dir: samples_dir(run_dir),
            scheduler,
            conds,
            clip_skip,
            zero_negative,
            rng: StdRng::seed_from_u64(seed ^ 0x5a4d_504c_4553),
            vae_load,
        })
    }

    /// Whether optimizer step `step` (1-based) ends with samples.
    pub fn due(&self, step: usize) -> bool {
        step > 0 && step.is_multiple_of(self.plan.every_n_steps)
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
                None => encode(sd, job, self.clip_skip, self.zero_negative)?,
            };
            let mut images = Vec::with_capacity(job.cfgs.len());
            for req in job.requests(seed) {
                let sampler = req
                    .sampler
                    .build(&self.scheduler, req.steps)
                    .map_err(anyhow::Error::msg)?;
                let conds = PromptConds {
                    cond: conds.cond.clone(),
                    uncond: conds.uncond.clone().filter(|_| req.guided()),
                };
                let image = crate::sample::generate(sd, vae, run, sampler.as_ref(), &conds, &req)?;
                images.push(image_out::to_rgb(&image)?);
            }
            round.push(PromptImages { job, seed, images });
        }
        Ok(jobs::write_round(&self.dir, step, label, &round)?)
    }
}

/// A job's conditioning, with the negative half whenever any of its scales guides.
fn encode(
    sd: &StableDiffusion,
    job: &PromptJob,
    clip_skip: usize,
    zero_negative: bool,
) -> candle_core::Result<PromptConds> {
    let guided = job.cfgs.iter().any(|&c| c > 1.0);
    PromptConds::encode(
        sd,
        &job.prompt,
        &job.negative_prompt,
        guided,
        clip_skip,
        zero_negative,
    )
}
