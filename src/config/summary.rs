//! The human-readable form of a [`TrainPlan`], printed by `--dry-run` and at the start of a run.
//! plan.json (the `Serialize` form) is the exact record; this is the one-screen view: one row per
//! concern, each row's text made by a function of its own.

use std::fmt;

use super::plan::{TrainMode, TrainPlan};
use super::{AmpChoice, CacheLatents, EmaDecay, EmaDevice, TextCacheDecision};

impl fmt::Display for TrainPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        row(f, "config", &self.train_config.display())?;
        for o in &self.overrides {
            row(f, "  --set", o)?;
        }
        row(f, "model", &self.model)?;
        if let Some(vae) = &self.model_file.vae {
            row(f, "vae", &format!("{vae} (in place of the model's)"))?;
        }
        for (path, m) in &self.model_file.base_weights {
            row(
                f,
                "base_weights",
                &format!("{} ×{m}, merged into the model", path.display()),
            )?;
        }
        row(f, "mode", &self.mode_text())?;
        let d = &self.data;
        match (&d.dataset_config, &d.layout) {
            (Some(config), _) => fmt_dataset_config(f, config)?,
            (None, crate::data::DataLayout::Everydream) => {
                row(f, "data_root", &d.data_root.display())?
            }
            (None, crate::data::DataLayout::ImageFolder { caption_column }) => row(
                f,
                "data_root",
                &format!(
                    "{} (Hugging Face's imagefolder: its metadata rows, captions in `{caption_column}`)",
                    d.data_root.display()
                ),
            )?,
            (None, crate::data::DataLayout::Kohya { caption_extension }) => row(
                f,
                "data_root",
                &format!(
                    "{} (kohya's `<repeats>_<class tokens>` folders, captions in {caption_extension})",
                    d.data_root.display()
                ),
            )?,
        }
        if let Some(prompt) = &d.instance_prompt {
            row(
                f,
                "captions",
                &format!(
                    "\"{prompt}\" for every image without a caption file (diffusers' instance_prompt)"
                ),
            )?;
        }
        if let Some(reg) = &d.regularization {
            row(
                f,
                "reg_data_root",
                &format!(
                    "{} (sized to data_root's samples per epoch as kohya sizes it; loss × {})",
                    reg.data_root.display(),
                    reg.prior_loss_weight
                ),
            )?;
            if let Some(class) = &reg.class_images {
                row(
                    f,
                    "class images",
                    &format!(
                        "{} of \"{}\": those reg_data_root lacks are drawn by the base model \
                         before training (diffusers' DreamBooth: its scheduler, 50 steps, cfg 7.5)",
                        class.count, class.prompt
                    ),
                )?;
            }
        }
        let resolution = d
            .resolution
            .map_or("model's native".to_string(), |r| format!("{r} px"));
        let mixed = d.dataset_config.as_ref().is_some_and(|c| c.mixed_shapes());
        let first = if mixed {
            " (datasets[0]'s; each dataset's above)"
        } else {
            ""
        };
        row(f, "resolution", &format!("{resolution}{first}"))?;
        let buckets = match mixed {
            true => "each dataset's (above)".to_string(),
            false => self.buckets_text(),
        };
        row(f, "aspect buckets", &buckets)?;
        let augmentation = match d.dataset_config {
            Some(_) => format!(
                "each subset's flips and captions (above), crop_jitter {}",
                d.crop_jitter
            ),
            None => format!(
                "flip_p {}, cond_dropout {}, shuffle_tags {}, crop_jitter {}",
                d.flip_p, d.cond_dropout, d.shuffle_tags, d.crop_jitter
            ),
        };
        row(f, "augmentation", &augmentation)?;
        if d.weighted_captions {
            row(
                f,
                "captions",
                &"weighted by their A1111 emphasis (kohya's weighted_captions)",
            )?;
        }
        if d.caption_chunks > 1 {
            let tokens = 75 * d.caption_chunks;
            row(
                f,
                "captions",
                &format!(
                    "up to {tokens} tokens, in {} chunks of 75 (kohya's max_token_length)",
                    d.caption_chunks
                ),
            )?;
        }
        let latents = match d.cache_latents {
            CacheLatents::Off => "off (the VAE encodes every step)",
            CacheLatents::Memory => "in memory",
            CacheLatents::Disk => "on disk, beside the runs in output_dir",
        };
        row(f, "latent cache", &latents)?;
        let text = match d.text_cache {
            TextCacheDecision::Off(why) => format!("off: {why}"),
            TextCacheDecision::On => {
                "on: each caption encoded once, text encoders released".to_string()
            }
        };
        row(f, "text cache", &text)?;
        row(
            f,
            "batch",
            &match mixed {
                false => format!(
                    "batch_size {} x grad_accum {} = {} images per step",
                    self.batch_size,
                    self.grad_accum,
                    self.batch_size * self.grad_accum
                ),
                true => format!(
                    "each dataset's batch_size (above) x grad_accum {}: a step is {} \
                     micro-batch{}, each of one dataset",
                    self.grad_accum,
                    self.grad_accum,
                    if self.grad_accum == 1 { "" } else { "es" }
                ),
            },
        )?;
        row(f, "stop after", &self.stop_text())?;
        let seed = if self.random_seed {
            format!("{} (drawn at random)", self.seed)
        } else {
            self.seed.to_string()
        };
        row(f, "seed", &seed)?;
        self.fmt_objective_and_optimizer(f)?;
        self.fmt_outputs(f)
    }
}

impl TrainPlan {
    fn embedding_text(&self) -> String {
        let Some(e) = &self.embedding else {
            return "textual inversion".to_string();
        };
        let start = match (&e.init_from, &e.init_word) {
            (Some(p), _) => format!("from {}", p.display()),
            (None, Some(w)) => format!("from the init word {w:?}"),
            (None, None) => String::new(),
        };
        let captions = match e.template {
            Some(t) => format!(", captions from kohya's {t:?} templates").to_lowercase(),
            None => String::new(),
        };
        format!(
            "textual inversion: `{}` as {} vector(s) {start}{captions}, saved as {:?}",
            e.token_string, e.num_vectors, e.save_dtype
        )
    }

    fn mode_text(&self) -> String {
        let kind = match self.mode {
            TrainMode::Full => return "full fine-tune".to_string(),
            TrainMode::Lora => "LoRA",
            TrainMode::Locon => "LoCon",
            TrainMode::Loha => "LoHa",
            TrainMode::Lokr => "LoKr",
            TrainMode::Dora => "DoRA",
            TrainMode::TextualInversion => return self.embedding_text(),
        };
        let base = match &self.adapter {
            Some(a) => format!(
                "{kind} rank {} alpha {} (conv rank {} alpha {}), text encoder {}, saved as {:?}",
                a.rank,
                a.alpha,
                a.conv_rank,
                a.conv_alpha,
                if a.train_text_encoder {
                    "trained"
                } else {
                    "frozen"
                },
                a.save_dtype
            ),
            None => kind.to_string(),
        };
        let base = match self.adapter.as_ref().and_then(|a| a.blocks.as_ref()) {
            Some(b) => {
                let args: Vec<String> = b
                    .network_args()
                    .into_iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                format!("{base}; block-wise (kohya): {}", args.join(" "))
            }
            None => base,
        };
        let base = match self.adapter.as_ref().and_then(|a| a.layer_filter.as_ref()) {
            Some(f) => format!(
                "{base}; UNet layers matching {} {:?} (layer_filter)",
                if f.regex { "regex" } else { "any of" },
                f.patterns
            ),
            None => base,
        };
        match &self.embedding {
            Some(e) => format!(
                "{base}; with the token `{}` as {} vector(s) (pivotal tuning, bundled in the file)",
                e.token_string, e.num_vectors
            ),
            None => base,
        }
    }

    fn buckets_text(&self) -> String {
        buckets_text(self.data.buckets.as_ref(), self.data.resolution)
    }
}

/// How the buckets `b` at `resolution` (`None`: the model's) are made.
fn buckets_text(b: Option<&super::BucketPlan>, resolution: Option<usize>) -> String {
    let Some(b) = b else {
        return "off: centre-cropped squares".to_string();
    };
    let sizes = match (&b.aspects, b.kohya) {
        (Some(a), _) => format!("{} sizes from aspects", a.len()),
        (None, Some(k)) if k.no_upscale => format!(
            "each image its own, never scaled up (kohya's bucket_no_upscale), sides in steps \
                 of {}",
            k.steps
        ),
        (None, Some(k)) => format!(
            "kohya's, sides {} to {} in steps of {}",
            k.min, k.max, k.steps
        ),
        (None, None) => match resolution {
            Some(r) if !crate::data::bucket::has_ed2_table(r) => {
                format!("generated for {r} px (kohya's rule; EveryDream2 has no table)")
            }
            _ => "EveryDream2's table for the resolution".to_string(),
        },
    };
    match b.max_ratio {
        Some(r) => format!("{sizes}, up to {r}:1"),
        None => sizes,
    }
}

impl super::TrainPlan {
    fn stop_text(&self) -> String {
        match (self.max_epochs, self.max_steps) {
            (Some(e), Some(s)) => format!("{e} epochs or {s} steps, whichever comes first"),
            (Some(e), None) => format!("{e} epochs"),
            (None, Some(s)) => format!("{s} steps"),
            (None, None) => "never (invalid plan)".to_string(),
        }
    }

    /// The objective, clip skip, text encoder and optimizer rows.
    fn fmt_objective_and_optimizer(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.objective;
        let mut snr = o.min_snr_gamma.map_or("off".to_string(), |g| g.to_string());
        if o.zero_terminal_snr {
            snr.push_str(", zero terminal SNR");
        }
        if let Some(p) = &o.pyramid_noise {
            let style = match p.style {
                crate::diffusion::PyramidStyle::EveryDream2 => "EveryDream2",
                crate::diffusion::PyramidStyle::Kohya => "kohya",
            };
            snr.push_str(&format!(
                ", pyramid noise ({style}: discount {}, up to {} levels)",
                p.discount, p.iterations
            ));
        }
        row(
            f,
            "objective",
            &format!(
                "timesteps [{}, {}), zero_frequency_noise_ratio {}, min_snr_gamma {snr}",
                o.timestep_start, o.timestep_end, o.zero_frequency_noise_ratio
            ),
        )?;
        row(f, "loss", &o.loss_text())?;
        row(
            f,
            "clip_skip",
            &format!("{} ({} layers dropped)", o.clip_skip, o.clip_skip_layers),
        )?;
        let freeze = &self.text_encoder_freeze;
        let te = match (self.train_text_encoder, freeze.trains_everything()) {
            // Adapter modes: the base is frozen; `adapter.train_text_encoder` decides.
            _ if self.adapter.is_none() && self.embedding.is_some() => {
                "frozen, the token's new vectors train".to_string()
            }
            _ if self.adapter.is_some() => {
                let adapter = match &self.adapter {
                    Some(a) if a.train_text_encoder => "frozen, its adapter trains",
                    _ => "frozen, no adapter",
                };
                match self.embedding {
                    Some(_) => format!("{adapter}; the token's new vectors train"),
                    None => adapter.to_string(),
                }
            }
            (false, _) => "frozen".to_string(),
            (true, true) => "trained (every layer)".to_string(),
            (true, false) => format!("trained ({freeze})"),
        };
        let stop = match (
            self.stop_text_encoder_training,
            self.stop_text_encoder_training_epochs,
        ) {
            (Some(s), Some(e)) => format!("; stops after {s} steps or {e} epochs, the earlier"),
            (Some(s), None) => format!("; stops after {s} steps"),
            (None, Some(e)) => format!("; stops after {e} epoch{}", if e == 1 { "" } else { "s" }),
            (None, None) => String::new(),
        };
        row(f, "text encoder", &format!("{te}{stop}"))?;
        let source = self
            .optimizer
            .source
            .as_ref()
            .map_or("built-in default".to_string(), |p| p.display().to_string());
        row(f, "optimizer", &source)?;
        let clip = match (self.clip_grad_norm, self.clip_scope) {
            (None, _) => "off".to_string(),
            (Some(m), crate::optim::ClipScope::PerGroup) => {
                format!("each group's gradient L2 norm to {m} (clip_grad_norm)")
            }
            (Some(m), crate::optim::ClipScope::Global) => {
                format!("the gradients' global L2 norm to {m} (max_grad_norm)")
            }
        };
        row(f, "  clipping", &clip)?;
        if self.embedding.is_some() && self.adapter.is_none() {
            // One group, at the base settings (train.json's `lr`).
            return row(f, "  embedding", &self.optimizer.unet);
        }
        row(f, "  unet", &self.optimizer.unet)?;
        row(f, "  text_encoder", &self.optimizer.text_encoder)?;
        match self.embedding {
            Some(_) => row(f, "  embedding", &self.optimizer.unet),
            None => Ok(()),
        }
    }

    /// The output, save, EMA, samples, validation, VRAM, resume, precision and log rows.
    fn fmt_outputs(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        row(
            f,
            "output",
            &format!(
                "{}/{}-<timestamp>/",
                self.output_dir.display(),
                self.run_folder_prefix()
            ),
        )?;
        row(f, "save", &self.save_text())?;
        if let Some(ema) = self.ema_text() {
            row(f, "ema", &ema)?;
        }
        if let Some(samples) = self.samples_text() {
            row(f, "samples", &samples)?;
        }
        if let Some(v) = &self.data.validation {
            let text = format!("{}, {}", v.sets_text(), v.when_text());
            row(f, "validation", &text)?;
        }
        if let Some(gb) = self.vram_limit_gb {
            row(
                f,
                "vram limit",
                &format!("{gb} GiB (CUDA; the rest of the card is held back)"),
            )?;
        }
        if let Some(r) = &self.resume {
            row(f, "resume", &r.display().to_string())?;
        }
        row(f, "precision", &self.precision_text())?;
        row(f, "logs", &self.logs_text())
    }

    fn save_text(&self) -> String {
        let s = &self.saving;
        let mut saves: Vec<String> = Vec::new();
        if let Some(n) = s.every_n_steps {
            saves.push(format!("every {n} steps"));
        }
        if let Some(n) = s.every_n_epochs {
            match s.from_n_epochs {
                0 | 1 => saves.push(format!("every {n} epochs")),
                from => saves.push(format!("every {n} epochs from epoch {from}")),
            }
        }
        if let Some(m) = s.every_n_minutes {
            saves.push(format!("every {m} minutes"));
        }
        saves.push("at the end".to_string());
        let mut save = saves.join(", ");
        if self.save_optimizer {
            save.push_str(" (with a save point)");
        }
        if let Some(n) = s.total_limit {
            save.push_str(&format!("; keep the newest {n} save points"));
        }
        if let Some(dir) = &s.ckpt_dir {
            save.push_str(&format!("; single files in {}", dir.display()));
        }
        save
    }

    fn ema_text(&self) -> Option<String> {
        let ema = self.ema.as_ref()?;
        let decay = match ema.decay {
            EmaDecay::Rate(d) => format!("decay {d}"),
            EmaDecay::StrengthTarget(t) => {
                format!("strength target {t} (decay from the run's length)")
            }
        };
        let device = match ema.device {
            EmaDevice::Cpu => "on the CPU",
            EmaDevice::Training => "on the training device",
        };
        Some(format!(
            "{decay}, every {} steps, {device}; saved beside the weights as `-ema`",
            ema.update_interval
        ))
    }

    fn samples_text(&self) -> Option<String> {
        let sp = self.samples.as_ref()?;
        let models = match (sp.trained_model, sp.ema_model) {
            (true, true) => ", trained and EMA weights",
            (false, true) => ", EMA weights",
            _ => "",
        };
        let (count, file) = (sp.set.prompts.len(), sp.prompts_file.display());
        let prompts = if sp.set.filled_in {
            format!("{count} random training captions ({file} lists no samples)")
        } else {
            format!("{count} prompts from {file}")
        };
        let every = match sp.every_n_epochs {
            Some(e) => format!("at the end of every {e} epoch(s)"),
            None => format!("every {} steps", sp.every_n_steps),
        };
        Some(format!(
            "{prompts} {every}{}{models}; {} by default",
            if sp.set.at_start {
                " and before training"
            } else {
                ""
            },
            sp.set.sampler,
        ))
    }

    fn precision_text(&self) -> String {
        let amp = match self.precision.amp {
            AmpChoice::DeviceDefault => {
                "device default (bf16 on CUDA 8.0+, fp16 on older cards, f32 on the CPU)"
                    .to_string()
            }
            AmpChoice::Set(a) => a.name().to_string(),
        };
        let ckpt = match self.precision.gradient_checkpointing {
            super::CheckpointChoice::Auto => "auto (the fewest UNet blocks that fit the card)",
            other => other.name(),
        };
        let weights = match self.precision.weight_dtype {
            crate::precision::WeightDtype::F32 => String::new(),
            w => format!("; trained weights {} with stochastic rounding", w.name()),
        };
        let fused = if self.precision.fused_backward_pass {
            "; fused backward pass"
        } else {
            ""
        };
        let base = match self.precision.base_weight_dtype {
            super::BaseWeightDtype::Amp => "",
            super::BaseWeightDtype::Fp8 => "; frozen base fp8 (e4m3, a scale per output channel)",
            super::BaseWeightDtype::Fp8Unet => {
                "; frozen UNet fp8 (e4m3, a scale per output channel), text encoders in the \
                 compute dtype"
            }
        };
        format!("amp {amp}; gradient checkpointing {ckpt}{weights}{base}{fused}")
    }

    fn logs_text(&self) -> String {
        let logs = self
            .logdir
            .as_ref()
            .map_or("the run folder".to_string(), |d| {
                format!("{}/<run name>/", d.display())
            });
        let tensorboard = if self.tensorboard {
            " (JSON lines and TensorBoard)"
        } else {
            " (JSON lines)"
        };
        format!("{logs}{tensorboard}, every {} steps", self.log_step)
    }
}

/// One line: the label padded to 15 columns, then the value.
fn row(f: &mut fmt::Formatter<'_>, label: &str, value: &dyn fmt::Display) -> fmt::Result {
    writeln!(f, "{label:<15}{value}")
}

impl super::ObjectivePlan {
    /// The loss, its weighting and the perturbations, for the summary.
    fn loss_text(&self) -> String {
        use crate::diffusion::loss::LossType;
        use crate::diffusion::timesteps::TimestepDistribution;
        let mut parts = vec![match self.loss.loss_type {
            LossType::Mse => "mse".to_string(),
            LossType::Huber => "huber (EveryDream2, δ 1)".to_string(),
            LossType::MseHuber => "mse_huber (EveryDream2)".to_string(),
            LossType::HuberMse => "huber_mse (EveryDream2)".to_string(),
            LossType::L1 => "l1".to_string(),
            LossType::PseudoHuber(s) => format!("pseudo_huber (kohya), {s:?}"),
            LossType::SmoothL1(s) => format!("smooth_l1 (kohya), {s:?}"),
            LossType::Mix(m) => {
                let mut terms = Vec::new();
                for (s, name) in [(m.mse, "mse"), (m.mae, "mae"), (m.log_cosh, "log-cosh")] {
                    if s != 0.0 {
                        terms.push(format!("{s}·{name}"));
                    }
                }
                if m.huber != 0.0 {
                    terms.push(format!("{}·huber (δ {})", m.huber, m.huber_delta));
                }
                format!("{} (OneTrainer)", terms.join(" + "))
            }
        }];
        if self.loss.debiased_estimation {
            parts.push(match self.loss.debiased_v_sqrt {
                true => "debiased estimation (OneTrainer's 1/√(SNR+1) for v)".to_string(),
                false => "debiased estimation".to_string(),
            });
        }
        if let Some(g) = self.loss.p2_gamma {
            parts.push(format!("P2 weighting γ {g}"));
        }
        if self.loss.scaler != super::loss_plan::LossScaler::None {
            parts.push(format!("loss_scaler {:?}", self.loss.scaler).to_lowercase());
        }
        match self.timestep_distribution {
            TimestepDistribution::Uniform => {}
            TimestepDistribution::LogitNormal { bias, scale } => parts.push(format!(
                "logit-normal timesteps (bias {bias}, scale {scale})"
            )),
            TimestepDistribution::HeavyTail { scale } => {
                parts.push(format!("heavy-tailed timesteps (s {scale})"))
            }
            TimestepDistribution::Beta { alpha, beta } => {
                parts.push(format!("beta timesteps (α {alpha}, β {beta})"))
            }
            TimestepDistribution::CosMap => parts.push("cos-map timesteps".to_string()),
            TimestepDistribution::Sigmoid { weight, bias } => {
                parts.push(format!("sigmoid timesteps (weight {weight}, bias {bias})"))
            }
            TimestepDistribution::InvertedParabola { weight, bias } => parts.push(format!(
                "inverted-parabola timesteps (weight {weight}, bias {bias})"
            )),
        }
        if self.timestep_shift != 1.0 {
            parts.push(format!("timestep shift {}", self.timestep_shift));
        }
        if let Some(p) = self.input_perturbation {
            let random = if p.random_strength {
                ", random strength"
            } else {
                ""
            };
            parts.push(format!("input perturbation {}{random}", p.gamma));
        }
        if let Some(m) = self
            .loss
            .mask
            .filter(|m| m.weighting.prior_preservation > 0.0)
        {
            parts.push(format!(
                "masked prior preservation {}",
                m.weighting.prior_preservation
            ));
        }
        if self.generalized_offset_noise {
            parts.push("generalized offset noise (ψ_t)".to_string());
        }
        if self.perturbation_noise_weight > 0.0 {
            parts.push(format!(
                "perturbation noise {}",
                self.perturbation_noise_weight
            ));
        }
        if self.embedding_perturbation > 0.0 {
            parts.push(format!(
                "embedding perturbation {}",
                self.embedding_perturbation
            ));
        }
        parts.push(format!("train_sampler {:?}", self.train_sampler).to_lowercase());
        parts.join(", ")
    }
}

/// The dataset config's rows: the file, then one per subset with its images and settings.
fn fmt_dataset_config(
    f: &mut fmt::Formatter<'_>,
    config: &super::DatasetConfigPlan,
) -> fmt::Result {
    use crate::data::kohya_subsets::SubsetSource;
    row(
        f,
        "dataset_config",
        &format!(
            "{} (kohya's; {} subset{})",
            config.file.display(),
            config.subsets.len(),
            if config.subsets.len() == 1 { "" } else { "s" }
        ),
    )?;
    for shape in config.shapes.iter().filter(|_| config.mixed_shapes()) {
        row(
            f,
            "  dataset",
            &format!(
                "{}: {}, batch {}, buckets {}",
                shape.name,
                shape
                    .resolution
                    .map_or("model's native resolution".to_string(), |r| format!(
                        "{r} px"
                    )),
                shape.batch_size,
                buckets_text(shape.buckets.as_ref(), shape.resolution)
            ),
        )?;
    }
    for s in &config.subsets {
        let source = match &s.source {
            SubsetSource::DreamBooth {
                image_dir,
                class_tokens,
                caption_extension,
            } => format!(
                "{} (captions in {caption_extension}{})",
                image_dir.display(),
                class_tokens
                    .as_deref()
                    .map(|t| format!(", else \"{t}\""))
                    .unwrap_or_default()
            ),
            SubsetSource::FineTuning { metadata_file, .. } => {
                format!("{} (metadata)", metadata_file.display())
            }
            SubsetSource::Concept {
                image_dir,
                recursive,
                prompts,
                ..
            } => format!(
                "{}{} (OneTrainer concept, captions {})",
                image_dir.display(),
                if *recursive {
                    " and its subfolders"
                } else {
                    ""
                },
                match prompts {
                    crate::data::onetrainer_concept::ConceptPrompts::Sample =>
                        "in .txt".to_string(),
                    crate::data::onetrainer_concept::ConceptPrompts::FileName =>
                        "from file names".to_string(),
                    crate::data::onetrainer_concept::ConceptPrompts::File { path } =>
                        format!("from {}", path.display()),
                }
            ),
        };
        let c = &s.captions;
        let repeats = match &s.source {
            SubsetSource::Concept { balancing, .. } => match balancing {
                crate::data::onetrainer_concept::ConceptBalancing::Repeats(r) => format!("×{r}"),
                crate::data::onetrainer_concept::ConceptBalancing::Samples(n) => {
                    format!("{n} samples an epoch")
                }
            },
            _ => format!("×{}", s.num_repeats),
        };
        let mut notes = vec![repeats];
        if s.loss_weight != 1.0 {
            notes.push(format!("loss × {}", s.loss_weight));
        }
        if s.is_reg {
            notes.push(format!(
                "regularization, loss × {}",
                config.prior_loss_weight
            ));
        }
        if c.shuffle {
            notes.push(format!("shuffled after {} kept", c.keep_tokens));
        }
        if s.flip_p > 0.0 {
            notes.push(format!("flip_p {}", s.flip_p));
        }
        if s.caption_dropout > 0.0 {
            notes.push(format!("caption dropout {}", s.caption_dropout));
        }
        if c.tag_dropout > 0.0 {
            notes.push(format!("tag dropout {}", c.tag_dropout));
        }
        row(
            f,
            "  subset",
            &format!("{}: {source}: {}", s.name, notes.join(", ")),
        )?;
    }
    Ok(())
}
