//! [`TrainPlan`]: the resolved, validated training plan, built in one place,
//! [`TrainPlan::resolve`], from train.json, its `--set` overrides and the optimizer config. Every
//! default is decided here (EveryDream2's train.py argparser defaults unless noted), every range
//! is checked here, and the rest of sdtrain reads only the plan. The plan is serializable so it
//! can be written into the run folder as `plan.json`.
//!
//! The sections have files of their own: the data and its caches ([`super::data_plan`]), the
//! objective ([`super::objective_plan`]), the base model and the run to resume
//! ([`super::resume_plan`]), the adapter, optimizer, precision, EMA, samples and model file.
//! Relative paths follow [`super::ctx`].
//!
//! A "step" is one optimizer update (`batch_size × grad_accum` images). Training stops after
//! `max_epochs` or `max_steps`, whichever comes first.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;

use super::adapter_file::{self, AdapterPlan};
use super::ctx::Ctx;
use super::data_plan::{resolve_data, DataPlan};
use super::ema_plan::EmaPlan;
use super::error::ConfigError;
use super::objective_plan::{resolve_objective, ObjectivePlan};
use super::optimizer_file::OptimizerFile;
use super::optimizer_plan::OptimizerPlan;
use super::overrides;
use super::precision_plan::PrecisionPlan;
use super::resume_plan::{resolve_model, resolve_resume};
use super::sample_plan::SamplePlan;
use super::strict::{into_object, read_json};
use super::train_file::TrainFile;

/// EveryDream2's `--batch_size` default.
pub const DEFAULT_BATCH_SIZE: u64 = 2;
/// The largest `batch_size` taken: a micro-batch is filled to its size by repeating images
/// (EveryDream2's runt rule), so a size far past any card's reach would fill memory before the
/// first step; `grad_accum` is the way to larger effective batches.
pub const MAX_BATCH_SIZE: u64 = 1 << 16;
/// EveryDream2's `--max_epochs` default, used when neither max_epochs nor max_steps is set.
pub const DEFAULT_MAX_EPOCHS: u64 = 300;
/// EveryDream2's `--seed` default.
pub const DEFAULT_SEED: u64 = 555;
/// EveryDream2's `--log_step` default.
pub const DEFAULT_LOG_STEP: u64 = 25;
/// Steps skipped in a row for a non-finite loss or gradient before a run stops.
pub const DEFAULT_MAX_CONSECUTIVE_SKIPPED_STEPS: usize = 5;

/// What is trained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TrainMode {
    /// Every weight of the UNet (and of the text encoders, unless disabled).
    Full,
    /// LoRA on the transformer blocks' Linear and 1×1 conv layers (kohya's targets).
    Lora,
    /// LoRA plus the resnets', downsamplers' and upsamplers' 3×3 convs (kohya's LoCon).
    Locon,
    /// LyCORIS LoHa (Hadamard product of two low-rank pairs) on LoCon's targets.
    Loha,
    /// LyCORIS LoKr (Kronecker product) on LoCon's targets.
    Lokr,
    /// DoRA (LoCon with a trained magnitude per input channel, the form A1111 and ComfyUI load).
    Dora,
    /// Textual inversion: new token vectors in the text encoders, the whole model frozen.
    TextualInversion,
}

impl TrainMode {
    /// Whether the mode trains adapters (every mode but `full`).
    pub fn is_adapter(self) -> bool {
        match self {
            TrainMode::Full | TrainMode::TextualInversion => false,
            TrainMode::Lora
            | TrainMode::Locon
            | TrainMode::Loha
            | TrainMode::Lokr
            | TrainMode::Dora => true,
        }
    }
}

/// The resolved training plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainPlan {
    /// The train.json this plan came from, as given.
    pub train_config: PathBuf,
    /// The `--set` arguments applied, in order.
    pub overrides: Vec<String>,
    /// Hub id `org/name[@revision]`, or the absolute path of a local folder or .safetensors file.
    pub model: String,
    pub mode: TrainMode,
    /// Adapter settings; `Some` exactly when `mode` is an adapter mode.
    pub adapter: Option<AdapterPlan>,
    /// Textual-inversion settings; `Some` exactly when `mode` is textual_inversion.
    pub embedding: Option<super::EmbeddingPlan>,
    /// Absolute; the run folder is `<output_dir>/<project_name>-<timestamp>`.
    pub output_dir: PathBuf,
    pub project_name: String,
    /// EveryDream2's `run_name`: added to the run folder's (and so the log folder's) name,
    /// `<project_name>-<run_name>-<timestamp>`.
    pub run_name: Option<String>,
    /// Where the JSON-lines log goes, as `<logdir>/<run name>/`; `None` logs into the run folder.
    pub logdir: Option<PathBuf>,
    pub seed: u64,
    /// True when train.json asked for a random seed (`-1`); `seed` then holds the one drawn.
    pub random_seed: bool,
    pub batch_size: usize,
    pub grad_accum: usize,
    /// At least one of `max_epochs` and `max_steps` is set; training stops at whichever comes
    /// first.
    pub max_epochs: Option<u64>,
    pub max_steps: Option<u64>,
    /// When the run saves, where single files go and in what precision.
    pub saving: super::SavePlan,
    /// The run stops (saving, exit 1) after this many steps in a row are skipped for a
    /// non-finite loss or gradient; `None` never stops.
    pub max_consecutive_skipped_steps: Option<usize>,
    /// CUDA: the GiB of the card the run may use; the rest is held back at the start.
    pub vram_limit_gb: Option<f64>,
    /// EveryDream2's `gpuid`: the CUDA card to train on (`--device` overrides it).
    pub gpuid: usize,
    /// Data parallel: the devices, one rank each, as `cpu` or `cuda:N` (empty: one device, as
    /// `gpuid` says; `--devices` overrides it).
    pub devices: Vec<String>,
    /// EveryDream2's `load_settings_every_epoch`: read train.json again at each epoch's start
    /// and apply what a running run can change.
    pub load_settings_every_epoch: bool,
    /// The run to continue: a run folder (its newest complete save point) or one save point's
    /// `state-step-NNNNNN` folder, from `resume_ckpt`.
    pub resume: Option<PathBuf>,
    /// Save the optimizer state beside each saved model.
    pub save_optimizer: bool,
    /// Log every N steps.
    pub log_step: u64,
    /// Write TensorBoard event files beside the JSON-lines log (`log_with`).
    pub tensorboard: bool,
    pub data: DataPlan,
    pub objective: ObjectivePlan,
    /// `!disable_textenc_training`.
    pub train_text_encoder: bool,
    /// `!disable_unet_training` (EveryDream2): false trains the text encoder(s) alone, through a
    /// frozen UNet (full fine-tunes only).
    pub train_unet: bool,
    /// From optimizer.json `text_encoder_freezing`: which text-encoder layers, and whether the
    /// embeddings and the final layer norm, train (EveryDream2 `_apply_text_encoder_freeze`).
    pub text_encoder_freeze: super::TextEncoderFreeze,
    pub optimizer: OptimizerPlan,
    /// EveryDream2's `clip_grad_norm` (or kohya's `max_grad_norm`): the gradients are clipped
    /// to this L2 norm before the step; `None` does not clip.
    pub clip_grad_norm: Option<f64>,
    /// Over which parameters `clip_grad_norm` is measured: each group's (EveryDream2's
    /// `clip_grad_norm`) or all of them (kohya's `max_grad_norm`).
    pub clip_scope: crate::optim::ClipScope,
    /// `amp`, the fp16 loss scaler and `gradient_checkpointing`.
    pub precision: PrecisionPlan,
    /// The EMA copy of the trained weights; `None` is off.
    pub ema: Option<EmaPlan>,
    /// EveryDream2's `ema_resume_model`: what a new run's EMA starts from (a model, or an
    /// adapter file in lora/locon mode) instead of the starting weights.
    pub ema_resume_model: Option<String>,
    /// Sample images during training; `None` is off.
    pub samples: Option<SamplePlan>,
    /// How a single-file model is read, and the formats a full fine-tune is saved in.
    pub model_file: super::ModelFilePlan,
    /// kohya's `metadata_*` and the ModelSpec fields its settings give the saved files.
    pub modelspec: super::ModelSpecPlan,
    /// kohya's `stop_text_encoder_training`: from this (0-based) step on, the text encoders'
    /// group takes no gradients and no updates.
    pub stop_text_encoder_training: Option<usize>,
    /// OneTrainer's epoch form of it: the text encoders' group trains for this many epochs.
    pub stop_text_encoder_training_epochs: Option<usize>,
    /// kohya's `block_lr`: an SDXL full fine-tune's 23 per-block learning rates
    /// (`block_lr_plan`), which replace the UNet group's `lr`.
    pub block_lr: Option<Vec<f64>>,
}

impl TrainPlan {
    /// The step from which the text encoders' group stops training: kohya's
    /// `stop_text_encoder_training`, or the first step after OneTrainer's
    /// `stop_text_encoder_training_epochs` epochs (`steps_in_epoch` counts each epoch's steps),
    /// whichever comes first.
    pub fn text_encoder_stop(&self, steps_in_epoch: impl Fn(usize) -> usize) -> Option<usize> {
        let by_epochs = self
            .stop_text_encoder_training_epochs
            .map(|n| (0..n).map(&steps_in_epoch).sum::<usize>());
        match (self.stop_text_encoder_training, by_epochs) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// How the model is opened if it is a single file.
    pub fn single_file_options(&self) -> crate::model::single_file::SingleFileOptions {
        crate::model::single_file::SingleFileOptions {
            model_config: self.model_file.model_config.clone(),
            prediction_type: self.model_file.prediction_type,
        }
    }

    /// Reads train.json (and the optimizer config it names), applies the `--set` overrides, and
    /// resolves and validates everything.
    /// A `.toml` is a kohya sd-scripts config file (`super::kohya_config`); a `.json` naming
    /// OneTrainer's `training_method`, `model_type` or `base_model_name` is a OneTrainer config
    /// (`super::onetrainer_config`).
    pub fn resolve(train_path: &Path, overrides: &[String]) -> Result<TrainPlan, ConfigError> {
        let toml = train_path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("toml"));
        if toml {
            return TrainPlan::from_kohya(train_path, overrides);
        }
        let value = read_json(train_path)?;
        if let Value::Object(obj) = &value {
            if super::onetrainer_config::is_onetrainer(obj) {
                return TrainPlan::from_onetrainer(train_path, obj.clone(), overrides);
            }
        }
        TrainPlan::from_value(value, train_path, overrides)
    }

    /// A OneTrainer config, translated into train.json's keys, an optimizer.json and its
    /// concepts as dataset subsets, then resolved as train.json is.
    fn from_onetrainer(
        path: &Path,
        obj: serde_json::Map<String, Value>,
        overrides: &[String],
    ) -> Result<TrainPlan, ConfigError> {
        let imp = super::onetrainer_config::import(path, obj, overrides)?;
        let set_args = imp.set_args.clone();
        let inline = InlineOptimizer {
            object: imp.optimizer,
            warmup_fraction: imp.warmup_fraction,
        };
        TrainFile::from_object(imp.train, path, &set_args)
            .and_then(|mut file| {
                file.kohya_data = Some(imp.data);
                Self::from_file(file, path, overrides, Some(&inline))
            })
            .map_err(|e| e.blame_set(path, &set_args))
    }

    /// A kohya config, translated into train.json's keys, an optimizer.json and kohya's
    /// dataset options, then resolved as train.json is.
    fn from_kohya(path: &Path, overrides: &[String]) -> Result<TrainPlan, ConfigError> {
        let imp = super::kohya_config::import(path, overrides)?;
        let set_args = imp.set_args.clone();
        let inline = InlineOptimizer {
            object: imp.optimizer,
            warmup_fraction: imp.lengths.warmup_fraction,
        };
        TrainFile::from_object(imp.train, path, &set_args)
            .and_then(|mut file| {
                file.kohya_data = Some(imp.data);
                Self::from_file(file, path, overrides, Some(&inline))
            })
            .map_err(|e| e.blame_set(path, &set_args))
    }

    /// As [`TrainPlan::resolve`], with train.json already parsed. `train_path` names the file in
    /// errors and anchors its relative paths; it need not exist.
    pub fn from_value(
        train: Value,
        train_path: &Path,
        overrides: &[String],
    ) -> Result<TrainPlan, ConfigError> {
        let mut obj = into_object(train, train_path)?;
        let set_args = overrides::apply_all(&mut obj, overrides)?;
        Self::from_object(obj, train_path, overrides, &set_args)
            .map_err(|e| e.blame_set(train_path, &set_args))
    }

    /// [`TrainPlan::from_value`] after the overrides are applied; `set_args` maps each
    /// overridden top-level key to its `--set` argument. The sections are resolved in the order
    /// their errors are reported.
    fn from_object(
        obj: serde_json::Map<String, Value>,
        train_path: &Path,
        overrides: &[String],
        set_args: &std::collections::HashMap<String, String>,
    ) -> Result<TrainPlan, ConfigError> {
        let file = TrainFile::from_object(obj, train_path, set_args)?;
        Self::from_file(file, train_path, overrides, None)
    }

    /// The resolution of a parsed train.json (`inline`: the optimizer a kohya config gives,
    /// in place of optimizer.json).
    fn from_file(
        mut file: TrainFile,
        train_path: &Path,
        overrides: &[String],
        inline: Option<&InlineOptimizer>,
    ) -> Result<TrainPlan, ConfigError> {
        let ctx = Ctx::new(train_path);
        let dataset_config = super::dataset_config::apply_dataset_config(&mut file, &ctx)?;
        super::kohya_aliases::apply_kohya_names(&mut file, &ctx)?;
        let (max_epochs, max_steps) = resolve_stop(&file, &ctx)?;
        let train_lr = ctx.opt_positive("lr", file.lr, "greater than 0")?;
        let (optimizer, text_encoder_freeze) = resolve_optimizer(&file, &ctx, train_lr, inline)?;
        let (seed, random_seed) = resolve_seed(file.seed, &ctx)?;
        let mode = resolve_mode(file.mode.as_deref(), &ctx)?;
        let train_text_encoder = !file.disable_textenc_training.unwrap_or(false);
        let train_unet = resolve_train_unet(&file, &ctx, mode, train_text_encoder)?;
        let block_lr = super::block_lr_plan::resolve_block_lr(
            file.block_lr.as_ref(),
            mode,
            train_unet,
            &optimizer.unet,
            &ctx,
        )?;
        let adapter = resolve_adapter(&file, &ctx, mode, train_text_encoder)?.map(|mut a| {
            a.train_unet = train_unet;
            a
        });
        if adapter
            .as_ref()
            .is_some_and(|a| !a.train_unet && !a.train_text_encoder)
        {
            return Err(ctx.invalid(
                "disable_unet_training",
                "is true and the adapter section's train_text_encoder is false: nothing would \
                 train"
                    .into(),
            ));
        }
        let embedding = resolve_embedding(&file, &ctx, mode, train_text_encoder)?;
        // Whether any text-encoder parameter trains: the trainer's text-encoder group is
        // formed exactly when this holds (the encoders' own weights for a full fine-tune, their
        // adapter modules for lora/locon, the new token vectors for textual inversion).
        let text_encoder_trains = embedding.is_some()
            || adapter
                .as_ref()
                .map_or(train_text_encoder, |a| a.train_text_encoder);
        // The optimizer groups: the UNet's, the text encoders' (their weights or adapters), a
        // token's vectors (param_groups).
        let te_group = mode != TrainMode::TextualInversion
            && adapter
                .as_ref()
                .map_or(train_text_encoder, |a| a.train_text_encoder);
        let groups =
            usize::from(train_unet) + usize::from(te_group) + usize::from(embedding.is_some());
        let clip = super::kohya_aliases::max_grad_norm(&file, &ctx, groups)?;
        let resume = resolve_resume(&file, &ctx)?;
        let ema_resume_model = resolve_ema_resume(
            &file,
            &ctx,
            super::ema_plan::resolve_ema(&file, train_path)?.is_some(),
            resume.is_some(),
        )?;
        let ema = super::ema_plan::resolve_ema(&file, train_path)?;
        let saving = super::save_plan::resolve_saves(&file, &ctx)?;
        let input = |field: &str, p: &str| ctx.input_path(field, p);
        let precision = super::precision_plan::resolve_precision(&file, mode, train_path)?;
        check_fused_optimizers(&optimizer, precision.fused_backward_pass, train_path)?;
        check_loraplus(adapter.as_ref(), &optimizer, train_path)?;
        check_block_weights(adapter.as_ref(), &optimizer, train_unet, train_path)?;
        let objective = resolve_objective(&file, &ctx)?;
        check_prior_preservation(&objective, adapter.is_some(), &precision, &ctx)?;
        Ok(TrainPlan {
            train_config: train_path.to_path_buf(),
            overrides: overrides.to_vec(),
            model: resolve_model(&file, &ctx, resume.as_deref())?,
            resume,
            mode,
            adapter,
            embedding,
            output_dir: ctx
                .output_path("output_dir", file.output_dir.as_deref().unwrap_or("output"))?,
            project_name: resolve_project_name(file.project_name.as_deref(), &ctx)?,
            run_name: file
                .run_name
                .as_deref()
                .map(|n| folder_name("run_name", n, &ctx))
                .transpose()?,
            logdir: file
                .logdir
                .as_deref()
                .map(|d| ctx.output_path("logdir", d))
                .transpose()?,
            seed,
            random_seed,
            batch_size: batch_size(&ctx, file.batch_size)?,
            grad_accum: ctx.at_least("grad_accum", file.grad_accum, 1, 1)? as usize,
            max_epochs,
            max_steps,
            saving,
            max_consecutive_skipped_steps: resolve_skip_limit(&file, &ctx)?,
            save_optimizer: file.save_optimizer.unwrap_or(false),
            gpuid: ctx.at_least("gpuid", file.gpuid, 0, 0)? as usize,
            devices: super::devices_plan::resolve_devices(file.devices.as_ref(), &ctx)?,
            load_settings_every_epoch: file.load_settings_every_epoch.unwrap_or(false),
            vram_limit_gb: ctx.opt_positive(
                "vram_limit_gb",
                file.vram_limit_gb,
                "a number of GiB greater than 0",
            )?,
            log_step: ctx.at_least("log_step", file.log_step, DEFAULT_LOG_STEP, 1)?,
            tensorboard: resolve_log_with(&file, &ctx)?,
            data: resolve_data(&file, &ctx, text_encoder_trains, dataset_config)?,
            objective,
            train_text_encoder,
            train_unet,
            text_encoder_freeze,
            optimizer,
            clip_grad_norm: clip.map(|c| c.max),
            clip_scope: clip.map_or(crate::optim::ClipScope::PerGroup, |c| c.scope),
            precision,
            ema,
            ema_resume_model,
            samples: super::sample_plan::resolve_samples(&file, train_path, ema.is_some(), input)?,
            model_file: super::model_plan::resolve_model_file(&file, train_path, mode, input)?,
            modelspec: super::modelspec_plan::resolve_modelspec(&file, &ctx)?,
            stop_text_encoder_training: resolve_te_stop(
                "stop_text_encoder_training",
                file.stop_text_encoder_training,
                &ctx,
                te_group,
                &precision,
            )?,
            stop_text_encoder_training_epochs: resolve_te_stop(
                "stop_text_encoder_training_epochs",
                file.stop_text_encoder_training_epochs,
                &ctx,
                te_group,
                &precision,
            )?,
            block_lr,
        })
    }

    /// Whether the run writes resume save points: `save_every_n_steps`, `save_every_n_epochs`,
    /// `ckpt_every_n_minutes` or `save_optimizer`. The end of such a run writes one too, so a
    /// finished run can be extended with more steps or epochs exactly (kohya's
    /// `--save_state_on_train_end`).
    pub fn writes_save_points(&self) -> bool {
        let s = &self.saving;
        self.save_optimizer
            || s.every_n_steps.is_some()
            || s.every_n_epochs.is_some()
            || s.every_n_minutes.is_some()
    }

    /// What a new run folder's name starts with: `<project_name>` or
    /// `<project_name>-<run_name>`.
    pub fn run_folder_prefix(&self) -> String {
        match &self.run_name {
            Some(run) => format!("{}-{run}", self.project_name),
            None => self.project_name.clone(),
        }
    }

    /// Where the JSON-lines log of the run in `run_dir` goes.
    pub fn log_folder(&self, run_dir: &Path) -> PathBuf {
        match (&self.logdir, run_dir.file_name()) {
            (Some(logdir), Some(name)) => logdir.join(name),
            _ => run_dir.to_path_buf(),
        }
    }
}

/// OneTrainer's masked prior preservation predicts with the model's adapters taken out, so it
/// needs adapters (OneTrainer's LoRA method); its extra forward is not one a fused backward pass
/// can follow.
fn check_prior_preservation(
    objective: &ObjectivePlan,
    adapters: bool,
    precision: &super::PrecisionPlan,
    ctx: &Ctx<'_>,
) -> Result<(), ConfigError> {
    let on = objective
        .loss
        .mask
        .is_some_and(|m| m.weighting.prior_preservation > 0.0);
    let why = match (on, adapters, precision.fused_backward_pass) {
        (false, ..) => return Ok(()),
        (true, false, _) => {
            "needs an adapter mode (lora, locon, loha, lokr, dora): the prior is the model's \
             prediction without its adapters"
        }
        (true, true, true) => {
            "is not implemented beside fused_backward_pass (its prior prediction is a second \
             forward the fused update would count); turn one off"
        }
        (true, true, false) => return Ok(()),
    };
    Err(ctx.invalid("masked_prior_preservation_weight", why.to_string()))
}

/// LoRA+ with an optimizer that has no per-parameter learning rate is refused, naming the key,
/// the group and why (kohya's own code meant to refuse Prodigy and D-Adaptation, in a comment).
fn check_loraplus(
    adapter: Option<&AdapterPlan>,
    optimizer: &OptimizerPlan,
    train_path: &Path,
) -> Result<(), ConfigError> {
    let Some(a) = adapter else {
        return Ok(());
    };
    let groups = [
        (
            a.loraplus.unet,
            "loraplus_unet_lr_ratio",
            "base",
            optimizer.unet.optimizer,
        ),
        (
            a.loraplus.text_encoder.filter(|_| a.train_text_encoder),
            "loraplus_text_encoder_lr_ratio",
            "text_encoder_overrides",
            optimizer.text_encoder.optimizer,
        ),
    ];
    for (ratio, key, section, kind) in groups {
        if ratio.is_some() && !kind.scales_per_parameter() {
            return Err(ConfigError::Invalid {
                file: train_path.to_path_buf(),
                field: format!("adapter.{key}"),
                message: format!(
                    "(or loraplus_lr_ratio) scales the learning rate of the lora_up weights, but \
                     optimizer \"{}\" ({section} in the optimizer config) computes its step size \
                     for the whole group; use adamw, adamw8bit, lion, lion8bit, adafactor or \
                     came with LoRA+",
                    kind.name()
                ),
            });
        }
    }
    Ok(())
}

/// Block-wise settings need a trained UNet, and learning-rate weights that scale (other than 0
/// or 1) need an optimizer with a rate per parameter; refused otherwise, naming the key.
fn check_block_weights(
    adapter: Option<&AdapterPlan>,
    optimizer: &OptimizerPlan,
    train_unet: bool,
    train_path: &Path,
) -> Result<(), ConfigError> {
    let Some(b) = adapter.and_then(|a| a.blocks.as_ref()) else {
        return Ok(());
    };
    let invalid = |field: &str, message: String| ConfigError::Invalid {
        file: train_path.to_path_buf(),
        field: format!("adapter.{field}"),
        message,
    };
    let key = if b.dims.is_some() {
        "block_dims"
    } else if b.down_lr_weight.is_some() {
        "down_lr_weight"
    } else if b.mid_lr_weight.is_some() {
        "mid_lr_weight"
    } else {
        "up_lr_weight"
    };
    if !train_unet {
        return Err(invalid(
            key,
            "shapes the UNet's adapters, but the UNet is not trained (disable_unet_training); \
             remove one of the two"
                .into(),
        ));
    }
    let kind = optimizer.unet.optimizer;
    if b.has_lr_weights() && !b.lr_weights_only_switch() && !kind.scales_per_parameter() {
        return Err(invalid(
            key,
            format!(
                "scales each block's learning rate, but optimizer \"{}\" (base in the optimizer \
                 config) computes its step size for the whole group; use adamw, adamw8bit, lion, \
                 lion8bit, adafactor or came, or weights of 0 and 1 only (which switch blocks \
                 off)",
                kind.name()
            ),
        ));
    }
    Ok(())
}

/// kohya's `stop_text_encoder_training`: at least 1, with a text encoder group to stop, and not
/// inside a fused backward pass (which updates each parameter as its gradient completes).
fn resolve_te_stop(
    key: &str,
    value: Option<i64>,
    ctx: &Ctx<'_>,
    te_group: bool,
    precision: &super::PrecisionPlan,
) -> Result<Option<usize>, ConfigError> {
    let Some(n) = ctx.opt_at_least(key, value, 1)? else {
        return Ok(None);
    };
    let why = match () {
        _ if !te_group => "no text encoder trains in this run",
        _ if precision.fused_backward_pass => {
            "a fused backward pass updates each parameter inside the backward; turn \
             fused_backward_pass off"
        }
        _ => return Ok(Some(n as usize)),
    };
    Err(ctx.invalid(key, format!("is {n}, but {why}")))
}

/// `fused_backward_pass` with an optimizer that must see every gradient of the step before it
/// updates any parameter is refused, naming the group and why.
fn check_fused_optimizers(
    optimizer: &OptimizerPlan,
    fused: bool,
    train_path: &Path,
) -> Result<(), ConfigError> {
    if !fused {
        return Ok(());
    }
    let groups = [
        ("base", optimizer.unet.optimizer),
        ("text_encoder_overrides", optimizer.text_encoder.optimizer),
    ];
    for (section, kind) in groups {
        if let Some(why) = kind.refuses_fused_backward() {
            return Err(ConfigError::Invalid {
                file: train_path.to_path_buf(),
                field: "fused_backward_pass".to_string(),
                message: format!(
                    "is true with optimizer \"{}\" ({section} in the optimizer config): {why}, \
                     and a fused backward pass updates each parameter as soon as its own \
                     gradient is complete; choose another optimizer or turn \
                     fused_backward_pass off",
                    kind.name()
                ),
            });
        }
    }
    Ok(())
}

/// `max_epochs` and `max_steps`: at least one is set (EveryDream2's 300 epochs when neither is).
fn resolve_stop(
    file: &TrainFile,
    ctx: &Ctx<'_>,
) -> Result<(Option<u64>, Option<u64>), ConfigError> {
    Ok(match (file.max_epochs, file.max_steps) {
        (None, None) => (Some(DEFAULT_MAX_EPOCHS), None),
        (epochs, steps) => (
            ctx.opt_at_least("max_epochs", epochs, 1)?,
            ctx.opt_at_least("max_steps", steps, 1)?,
        ),
    })
}

/// EveryDream2: 555 by default; -1 draws a random seed in [0, 2^30]. Returns the seed and
/// whether it was drawn.
fn resolve_seed(v: Option<i64>, ctx: &Ctx<'_>) -> Result<(u64, bool), ConfigError> {
    match v {
        None => Ok((DEFAULT_SEED, false)),
        Some(-1) => Ok((rand::random_range(0..=(1u64 << 30)), true)),
        Some(n) if n < 0 => Err(ctx.invalid(
            "seed",
            format!("must be 0 or more, or -1 for a random seed (got {n})"),
        )),
        Some(n) => Ok((n.unsigned_abs(), false)),
    }
}

fn resolve_project_name(v: Option<&str>, ctx: &Ctx<'_>) -> Result<String, ConfigError> {
    folder_name("project_name", v.unwrap_or("sdtrain"), ctx)
}

/// `name`, checked to be usable in a folder name.
fn folder_name(field: &str, name: &str, ctx: &Ctx<'_>) -> Result<String, ConfigError> {
    if name.is_empty() || name.contains(['/', '\\']) || name == "." || name == ".." {
        return Err(ctx.invalid(
            field,
            format!("must be a non-empty folder name without `/` or `\\` (got {name:?})"),
        ));
    }
    Ok(name.to_string())
}

/// `log_with`: TensorBoard unless `"none"`. kohya's `"wandb"` and `"all"` are refused, not
/// quietly dropped.
fn resolve_log_with(file: &TrainFile, ctx: &Ctx<'_>) -> Result<bool, ConfigError> {
    match file.log_with.as_deref() {
        None | Some("tensorboard") => Ok(true),
        Some("none") => Ok(false),
        Some(w @ ("wandb" | "all")) => Err(ctx.invalid(
            "log_with",
            format!("\"{w}\": wandb logging is not implemented; use \"tensorboard\" or \"none\""),
        )),
        Some(other) => Err(ctx.invalid(
            "log_with",
            format!("must be \"tensorboard\" or \"none\" (got \"{other}\")"),
        )),
    }
}

fn resolve_mode(mode: Option<&str>, ctx: &Ctx<'_>) -> Result<TrainMode, ConfigError> {
    match mode {
        None | Some("full") => Ok(TrainMode::Full),
        Some("lora") => Ok(TrainMode::Lora),
        Some("locon") => Ok(TrainMode::Locon),
        Some("loha") => Ok(TrainMode::Loha),
        Some("lokr") => Ok(TrainMode::Lokr),
        Some("dora") => Ok(TrainMode::Dora),
        Some("textual_inversion") => Ok(TrainMode::TextualInversion),
        Some(m) => Err(ctx.invalid(
            "mode",
            format!(
                "is \"{m}\"; allowed: \"full\", \"lora\", \"locon\", \"loha\", \"lokr\", \
                 \"dora\", \"textual_inversion\""
            ),
        )),
    }
}

/// The `adapter` section: resolved for lora/locon (empty means kohya's defaults), refused for a
/// full fine-tune, where it would go unused.
fn resolve_adapter(
    file: &TrainFile,
    ctx: &Ctx<'_>,
    mode: TrainMode,
    train_text_encoder: bool,
) -> Result<Option<AdapterPlan>, ConfigError> {
    match (mode, &file.adapter) {
        (TrainMode::Full | TrainMode::TextualInversion, None) => Ok(None),
        (TrainMode::Full | TrainMode::TextualInversion, Some(_)) => Err(ctx.invalid(
            "adapter",
            "is only used with an adapter `mode` (lora, locon, loha, lokr, dora); remove the \
             section, or train \
             without it by adding `--set adapter=null`"
                .into(),
        )),
        (
            TrainMode::Lora
            | TrainMode::Locon
            | TrainMode::Loha
            | TrainMode::Lokr
            | TrainMode::Dora,
            section,
        ) => {
            let section = section.clone().unwrap_or_default();
            adapter_file::resolve_adapter(
                &section,
                ctx.file,
                mode,
                train_text_encoder,
                |field, p| ctx.input_path(field, p),
            )
            .map(Some)
        }
    }
}

/// The `embedding` section: required by `mode: "textual_inversion"`, whose vectors live in the
/// text encoders (so `disable_textenc_training` would leave nothing to train), and taken by the
/// adapter modes, which then train the token's vectors beside the adapters (pivotal tuning, as
/// OneTrainer's additional embeddings and diffusers' advanced DreamBooth script do).
fn resolve_embedding(
    file: &TrainFile,
    ctx: &Ctx<'_>,
    mode: TrainMode,
    train_text_encoder: bool,
) -> Result<Option<super::EmbeddingPlan>, ConfigError> {
    match (mode, &file.embedding) {
        (TrainMode::TextualInversion, _) if !train_text_encoder => Err(ctx.invalid(
            "disable_textenc_training",
            "is true with mode \"textual_inversion\", whose vectors are the text encoders' \
             new tokens: nothing would train"
                .into(),
        )),
        (TrainMode::TextualInversion, section) => {
            let section = section.clone().unwrap_or_default();
            super::embedding_plan::resolve_embedding(&section, ctx.file, |field, p| {
                ctx.input_path(field, p)
            })
            .map(Some)
        }
        // Pivotal tuning: the adapters and a new token's vectors train together.
        (m, Some(section)) if m.is_adapter() => {
            super::embedding_plan::resolve_embedding(section, ctx.file, |field, p| {
                ctx.input_path(field, p)
            })
            .map(Some)
        }
        (_, None) => Ok(None),
        (_, Some(_)) => Err(ctx.invalid(
            "embedding",
            "is only used with `mode: \"textual_inversion\"` or an adapter mode (a LoRA with \
             its token's vectors); remove the section, or add `--set embedding=null`"
                .into(),
        )),
    }
}

/// Finds, reads and resolves the optimizer config. `optimizer_config` absent or null means
/// `optimizer.json`, and when none is found the built-in default is used (EveryDream2 also falls
/// back to defaults); a name given explicitly must exist.
/// A kohya config's optimizer: optimizer.json's object, and kohya's warmup as a fraction of
/// the run.
struct InlineOptimizer {
    object: serde_json::Map<String, Value>,
    warmup_fraction: Option<f64>,
}

fn resolve_optimizer(
    file: &TrainFile,
    ctx: &Ctx<'_>,
    train_lr: Option<f64>,
    inline: Option<&InlineOptimizer>,
) -> Result<(OptimizerPlan, super::TextEncoderFreeze), ConfigError> {
    let schedule = super::optimizer_plan::TrainScheduleKeys::check(
        file.lr_scheduler.as_deref(),
        file.lr_warmup_steps,
        file.lr_decay_steps,
        ctx.file,
    )?;
    if let Some(inline) = inline {
        if let Some(w) = &file.optimizer_config {
            return Err(ctx.invalid(
                "optimizer_config",
                format!(
                    "is \"{w}\": a kohya config gives its optimizer with optimizer_type and \
                     optimizer_args"
                ),
            ));
        }
        let label = ctx.file.to_path_buf();
        let config = OptimizerFile::from_object(inline.object.clone(), &label)?;
        let plan =
            OptimizerPlan::resolve(&config, &label, Some(label.clone()), train_lr, schedule)?;
        let freeze = super::TextEncoderFreeze::resolve(None, &label)?;
        return Ok((plan.with_run_lengths(inline.warmup_fraction), freeze));
    }
    let written = file.optimizer_config.as_deref();
    let candidates = ctx.input_candidates(written.unwrap_or("optimizer.json"));
    let found = candidates.iter().find(|p| p.is_file());
    let (config, label, source) = match (found, written) {
        (Some(path), _) => {
            let path = ctx.absolute("optimizer_config", path)?;
            let obj = into_object(read_json(&path)?, &path)?;
            (
                OptimizerFile::from_object(obj, &path)?,
                path.clone(),
                Some(path),
            )
        }
        (None, None) => (
            OptimizerFile::builtin()?,
            PathBuf::from("<built-in optimizer.json>"),
            None,
        ),
        (None, Some(w)) => {
            return Err(ConfigError::OptimizerConfigNotFound {
                file: ctx.file.to_path_buf(),
                written: PathBuf::from(w),
                tried: candidates,
            })
        }
    };
    let plan = OptimizerPlan::resolve(&config, &label, source, train_lr, schedule)?;
    let freeze = super::TextEncoderFreeze::resolve(config.text_encoder_freezing.as_ref(), &label)?;
    Ok((plan, freeze))
}

/// `!disable_unet_training`. EveryDream2 refuses both parts disabled; in an adapter mode it
/// leaves the UNet without adapters (kohya's `network_train_text_encoder_only`).
fn resolve_train_unet(
    file: &TrainFile,
    ctx: &Ctx<'_>,
    mode: TrainMode,
    train_text_encoder: bool,
) -> Result<bool, ConfigError> {
    if mode == TrainMode::TextualInversion {
        // The UNet is frozen; `disable_unet_training` says so already.
        return Ok(false);
    }
    if !file.disable_unet_training.unwrap_or(false) {
        return Ok(true);
    }
    if !train_text_encoder {
        return Err(ctx.invalid(
            "disable_unet_training",
            "and disable_textenc_training are both true: nothing would train".to_string(),
        ));
    }
    Ok(false)
}

/// `ema_resume_model`: a local path (made absolute) or a hub id. EveryDream2's `"findlast"` is the
/// newest EMA model saved under `output_dir` (a `-ema` folder), or in a resumed run the save
/// point's EMA, which it continues anyway.
fn resolve_ema_resume(
    file: &TrainFile,
    ctx: &Ctx<'_>,
    ema_on: bool,
    resuming: bool,
) -> Result<Option<String>, ConfigError> {
    let field = "ema_resume_model";
    let Some(raw) = file.ema_resume_model.as_deref() else {
        return Ok(None);
    };
    if !ema_on {
        return Err(ctx.invalid(
            field,
            "has no effect: EMA is off (set ema_decay_rate or ema_strength_target)".to_string(),
        ));
    }
    if raw.trim().is_empty() {
        return Err(ctx.invalid(field, "is empty".to_string()));
    }
    if raw == "findlast" {
        if resuming {
            return Ok(None);
        }
        let out = ctx.output_path("output_dir", file.output_dir.as_deref().unwrap_or("output"))?;
        return match crate::run_layout::find_last_model(&out, 3, true) {
            Ok(Some(found)) => Ok(Some(ctx.absolute(field, &found)?.display().to_string())),
            Ok(None) => Err(ctx.invalid(
                field,
                format!(
                    "is \"findlast\", but output_dir {} holds no saved EMA model (a `-ema` \
                     folder); name the EMA weights to start from (an adapter's \
                     `-ema.safetensors` file), or resume the run to continue its EMA",
                    out.display()
                ),
            )),
            Err(message) => Err(ctx.invalid(field, message)),
        };
    }
    match ctx.input_candidates(raw).iter().find(|p| p.exists()) {
        Some(local) => Ok(Some(ctx.absolute(field, local)?.display().to_string())),
        None => Ok(Some(raw.to_string())),
    }
}

/// `max_consecutive_skipped_steps`: 5 when unset, 0 for never.
fn resolve_skip_limit(file: &TrainFile, ctx: &Ctx) -> Result<Option<usize>, ConfigError> {
    let n = ctx.opt_at_least(
        "max_consecutive_skipped_steps",
        file.max_consecutive_skipped_steps,
        0,
    )?;
    Ok(match n {
        None => Some(DEFAULT_MAX_CONSECUTIVE_SKIPPED_STEPS),
        Some(0) => None,
        Some(n) => Some(n as usize),
    })
}

/// `batch_size`: 1 to [`MAX_BATCH_SIZE`].
pub(super) fn batch_size(ctx: &Ctx<'_>, v: Option<i64>) -> Result<usize, ConfigError> {
    let n = ctx.at_least("batch_size", v, DEFAULT_BATCH_SIZE, 1)?;
    if n > MAX_BATCH_SIZE {
        return Err(ctx.invalid(
            "batch_size",
            format!(
                "must be at most {MAX_BATCH_SIZE} (got {n}); use grad_accum for a larger \
                 effective batch"
            ),
        ));
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::config::{OptimizerKind, ScheduleKind, StepCount};

    /// A temp folder with `data/` and a train.json path inside it (the file is not written:
    /// `from_value` only needs its location).
    struct Fixture {
        dir: tempfile::TempDir,
    }

    impl Fixture {
        fn new() -> Fixture {
            let dir = tempfile::tempdir().unwrap();
            std::fs::create_dir(dir.path().join("data")).unwrap();
            Fixture { dir }
        }

        fn train_path(&self) -> PathBuf {
            self.dir.path().join("train.json")
        }

        fn write(&self, name: &str, value: &Value) {
            std::fs::write(self.dir.path().join(name), value.to_string()).unwrap();
        }

        /// Resolves `extra` merged over a minimal valid train.json.
        fn plan(&self, extra: Value, overrides: &[&str]) -> Result<TrainPlan, ConfigError> {
            let mut train = json!({"model": "org/model", "data_root": "data"});
            if let (Value::Object(t), Value::Object(e)) = (&mut train, extra) {
                t.extend(e);
            }
            let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
            TrainPlan::from_value(train, &self.train_path(), &overrides)
        }

        fn field_error(&self, extra: Value) -> (String, String) {
            match self.plan(extra, &[]) {
                Err(ConfigError::Invalid { field, message, .. }) => (field, message),
                other => panic!("expected an Invalid error, got {other:?}"),
            }
        }
    }

    #[test]
    fn kohya_caption_keys_resolve_and_wildcards_turn_the_text_cache_off() {
        let fx = Fixture::new();
        let p = fx
            .plan(
                json!({"mode": "lora", "adapter": {"train_text_encoder": false},
                       "keep_tokens_separator": "|||", "secondary_separator": ";;;"}),
                &[],
            )
            .unwrap();
        let k = &p.data.kohya_captions;
        assert_eq!(k.keep_tokens_separator.as_deref(), Some("|||"));
        assert_eq!(k.secondary_separator.as_deref(), Some(";;;"));
        assert!(p.data.text_cache.is_on(), "static captions keep the cache");
        let p = fx
            .plan(
                json!({"mode": "lora", "adapter": {"train_text_encoder": false},
                       "enable_wildcard": true}),
                &[],
            )
            .unwrap();
        assert_eq!(
            p.data.text_cache,
            crate::config::TextCacheDecision::Off(crate::config::TextCacheOff::Wildcard)
        );
        let p = fx
            .plan(
                json!({"mode": "lora", "adapter": {"train_text_encoder": false},
                       "token_warmup_step": 0.25, "caption_dropout_every_n_epochs": 3}),
                &[],
            )
            .unwrap();
        assert_eq!(
            p.data.text_cache,
            crate::config::TextCacheDecision::Off(crate::config::TextCacheOff::TokenWarmup)
        );
        let k = &p.data.kohya_captions;
        assert_eq!(
            (k.dropout_every_n_epochs, k.token_warmup.map(|w| w.min)),
            (3, Some(1))
        );
        for (extra, key) in [
            (json!({"token_warmup_min": 2}), "token_warmup_min"),
            (json!({"token_warmup_step": -1.0}), "token_warmup_step"),
            (
                json!({"caption_dropout_every_n_epochs": -1}),
                "caption_dropout_every_n_epochs",
            ),
            (
                json!({"keep_tokens_separator": ""}),
                "keep_tokens_separator",
            ),
            (json!({"secondary_separator": ","}), "secondary_separator"),
            (
                json!({"keep_tokens_separator": "|", "secondary_separator": "|"}),
                "secondary_separator",
            ),
        ] {
            assert_eq!(fx.field_error(extra).0, key);
        }
    }

    #[test]
    fn defaults_follow_everydream2() {
        let fx = Fixture::new();
        let p = fx.plan(json!({}), &[]).unwrap();
        assert_eq!(p.model, "org/model");
        assert_eq!(p.mode, TrainMode::Full);
        assert_eq!(p.batch_size, 2);
        assert_eq!(p.grad_accum, 1);
        assert_eq!((p.max_epochs, p.max_steps), (Some(300), None));
        assert_eq!((p.seed, p.random_seed), (555, false));
        assert_eq!(p.log_step, 25);
        assert_eq!(p.saving.every_n_epochs, None);
        assert!(!p.save_optimizer);
        assert_eq!(p.project_name, "sdtrain");
        assert!(p.output_dir.is_absolute() && p.output_dir.ends_with("output"));
        assert_eq!(p.logdir, None);
        assert!(p.tensorboard);
        assert!(p.train_text_encoder);
        assert_eq!(
            p.text_encoder_freeze,
            crate::config::TextEncoderFreeze::default()
        );
        assert_eq!(p.data.data_root, fx.dir.path().join("data"));
        assert_eq!(p.data.resolution, None);
        assert_eq!((p.data.flip_p, p.data.cond_dropout), (0.0, 0.04));
        assert!(!p.data.shuffle_tags);
        let o = &p.objective;
        assert_eq!((o.timestep_start, o.timestep_end), (0, 1000));
        assert_eq!(o.zero_frequency_noise_ratio, 0.02);
        assert_eq!(o.min_snr_gamma, None);
        assert_eq!((o.clip_skip, o.clip_skip_layers), (0, 0));
        // No optimizer.json beside train.json: the built-in default (unless the working
        // directory has one, as the repository root does, which is the same file).
        assert_eq!(p.optimizer.unet.optimizer, OptimizerKind::AdamW8bit);
        assert_eq!(p.optimizer.unet.lr, 1e-6);
        assert_eq!(p.optimizer.text_encoder.lr, 1e-6);
        assert_eq!(p.optimizer.unet.schedule.kind, ScheduleKind::Constant);
    }

    #[test]
    fn every_value_is_carried_through() {
        let fx = Fixture::new();
        let p = fx
            .plan(
                json!({
                    "batch_size": 4, "grad_accum": 3, "max_epochs": 10, "max_steps": 50,
                    "resolution": 768, "seed": 7, "save_every_n_epochs": 5, "logdir": "logs",
                    "project_name": "p", "flip_p": 0.5, "cond_dropout": 0.1, "shuffle_tags": true,
                    "clip_skip": 2, "min_snr_gamma": 5.0, "zero_frequency_noise_ratio": 0.1,
                    "timestep_start": 100, "timestep_end": 900, "disable_textenc_training": true,
                    "log_step": 1, "save_optimizer": true, "output_dir": "out", "mode": "full",
                    "log_with": "none"
                }),
                &[],
            )
            .unwrap();
        assert_eq!((p.batch_size, p.grad_accum), (4, 3));
        assert_eq!((p.max_epochs, p.max_steps), (Some(10), Some(50)));
        assert_eq!(p.data.resolution, Some(768));
        assert_eq!(p.seed, 7);
        assert_eq!(p.saving.every_n_epochs, Some(5));
        assert!(p
            .logdir
            .as_ref()
            .is_some_and(|d| d.is_absolute() && d.ends_with("logs")));
        assert_eq!(p.project_name, "p");
        assert_eq!((p.data.flip_p, p.data.cond_dropout), (0.5, 0.1));
        assert!(p.data.shuffle_tags);
        assert_eq!(
            (p.objective.clip_skip, p.objective.clip_skip_layers),
            (2, 1)
        );
        assert_eq!(p.objective.min_snr_gamma, Some(5.0));
        assert_eq!(p.objective.zero_frequency_noise_ratio, 0.1);
        assert_eq!(p.objective.pyramid_noise, None);
        assert_eq!(
            (p.objective.timestep_start, p.objective.timestep_end),
            (100, 900)
        );
        assert!(!p.train_text_encoder);
        assert_eq!(p.log_step, 1);
        assert!(!p.tensorboard);
        assert!(p.save_optimizer);
        assert!(p.output_dir.ends_with("out"));
    }

    /// EveryDream2's key gives its form (10 levels); kohya's keys give theirs, with kohya's
    /// recommended discount when only the iterations are set; 0 is off.
    #[test]
    fn pyramid_noise_from_either_trainers_keys() {
        use crate::diffusion::{PyramidNoise, PyramidStyle};
        let fx = Fixture::new();
        let ed2 = fx
            .plan(json!({"pyramid_noise_discount": 0.03}), &[])
            .unwrap();
        assert_eq!(
            ed2.objective.pyramid_noise,
            Some(PyramidNoise {
                style: PyramidStyle::EveryDream2,
                discount: 0.03,
                iterations: 10
            })
        );
        let kohya = fx
            .plan(json!({"multires_noise_iterations": 6}), &[])
            .unwrap();
        assert_eq!(
            kohya.objective.pyramid_noise,
            Some(PyramidNoise {
                style: PyramidStyle::Kohya,
                discount: 0.3,
                iterations: 6
            })
        );
        let off = fx
            .plan(
                json!({"pyramid_noise_discount": 0, "multires_noise_iterations": 0}),
                &[],
            )
            .unwrap();
        assert_eq!(off.objective.pyramid_noise, None);
    }

    #[test]
    fn clip_skip_layers_follow_ed2() {
        let fx = Fixture::new();
        for (skip, layers) in [(0, 0), (1, 0), (2, 1), (3, 2), (4, 3)] {
            let p = fx.plan(json!({"clip_skip": skip}), &[]).unwrap();
            assert_eq!(p.objective.clip_skip_layers, layers, "clip_skip {skip}");
        }
    }

    #[test]
    fn set_overrides_apply_before_validation() {
        let fx = Fixture::new();
        let p = fx
            .plan(
                json!({"lr": 1e-6}),
                &["lr=1e-5", "seed=7", "project_name=foo", "max_steps=3"],
            )
            .unwrap();
        assert_eq!(p.optimizer.unet.lr, 1e-5);
        assert_eq!(p.seed, 7);
        assert_eq!(p.project_name, "foo");
        assert_eq!(p.max_steps, Some(3));
        assert_eq!(p.overrides.len(), 4);
        let err = fx.plan(json!({}), &["batch_size=0"]).unwrap_err();
        assert!(err.to_string().contains("`batch_size`"), "{err}");
    }

    /// A bad value from `--set` names the argument, not train.json (whose value is fine); a
    /// bad value in the file still names the file.
    #[test]
    fn set_bad_value_is_blamed_on_the_set_argument() {
        let fx = Fixture::new();
        let err = fx.plan(json!({"lr": 0.01}), &["lr=-0.01"]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "`lr` from `--set lr=-0.01` must be greater than 0 (got -0.01)"
        );
        assert!(err.is_usage());
        let err = fx
            .plan(json!({}), &["adapter.rank=x", "mode=lora"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("from `--set adapter.rank=x`"), "{err}");
        let err = fx
            .plan(json!({"lr": -1.0}), &["seed=3"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("train.json") && !err.contains("--set"),
            "{err}"
        );
    }

    #[test]
    fn set_unknown_key_says_it_came_from_set() {
        let fx = Fixture::new();
        let err = fx.plan(json!({}), &["bach_size=4"]).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("unknown key `bach_size`"), "{msg}");
        assert!(msg.contains("(from --set bach_size=4)"), "{msg}");
        assert!(msg.contains("did you mean `batch_size`?"), "{msg}");
    }

    #[test]
    fn train_lr_overrides_both_groups() {
        let fx = Fixture::new();
        fx.write(
            "opt.json",
            &json!({"base": {"lr": 2e-6}, "text_encoder_overrides": {"lr": 5e-7}}),
        );
        let p = fx
            .plan(json!({"optimizer_config": "opt.json"}), &[])
            .unwrap();
        assert_eq!(
            (p.optimizer.unet.lr, p.optimizer.text_encoder.lr),
            (2e-6, 5e-7)
        );
        let p = fx
            .plan(json!({"optimizer_config": "opt.json", "lr": 4e-6}), &[])
            .unwrap();
        assert_eq!(
            (p.optimizer.unet.lr, p.optimizer.text_encoder.lr),
            (4e-6, 4e-6)
        );
    }

    #[test]
    fn optimizer_json_beside_train_json_is_found() {
        let fx = Fixture::new();
        fx.write(
            "optimizer.json",
            &json!({"base": {"lr_scheduler": "cosine"},
                    "text_encoder_freezing": {"unfreeze_last_n_layers": 2}}),
        );
        let p = fx.plan(json!({}), &[]).unwrap();
        assert_eq!(p.optimizer.unet.schedule.kind, ScheduleKind::Cosine);
        assert_eq!(
            p.optimizer.source,
            Some(fx.dir.path().join("optimizer.json"))
        );
        assert_eq!(p.text_encoder_freeze.trained_layers(12), 2);
    }

    #[test]
    fn unfreeze_zero_is_rejected() {
        let fx = Fixture::new();
        fx.write(
            "optimizer.json",
            &json!({"text_encoder_freezing": {"unfreeze_last_n_layers": 0}}),
        );
        let (field, message) = fx.field_error(json!({}));
        assert_eq!(field, "text_encoder_freezing.unfreeze_last_n_layers");
        assert!(message.contains("disable_textenc_training"), "{message}");
    }

    #[test]
    fn explicit_optimizer_config_must_exist() {
        let fx = Fixture::new();
        let err = fx
            .plan(json!({"optimizer_config": "missing.json"}), &[])
            .unwrap_err();
        let ConfigError::OptimizerConfigNotFound { tried, .. } = &err else {
            panic!("{err}")
        };
        assert_eq!(tried.len(), 2);
        assert_eq!(tried[0], fx.dir.path().join("missing.json"));
    }

    #[test]
    fn ranges_are_checked() {
        let fx = Fixture::new();
        for (extra, field) in [
            (json!({"batch_size": 0}), "batch_size"),
            (json!({"batch_size": 1u64 << 40}), "batch_size"),
            (json!({"grad_accum": 0}), "grad_accum"),
            (json!({"max_epochs": 0}), "max_epochs"),
            (json!({"max_steps": 0}), "max_steps"),
            (json!({"lr": 0}), "lr"),
            (json!({"lr": -1e-5}), "lr"),
            (json!({"resolution": 500}), "resolution"),
            (json!({"resolution": 0}), "resolution"),
            (json!({"resolution": 4160}), "resolution"),
            (json!({"flip_p": 1.5}), "flip_p"),
            (json!({"cond_dropout": -0.1}), "cond_dropout"),
            (
                json!({"zero_frequency_noise_ratio": 2}),
                "zero_frequency_noise_ratio",
            ),
            (json!({"min_snr_gamma": 0}), "min_snr_gamma"),
            (
                json!({"pyramid_noise_discount": 1.5}),
                "pyramid_noise_discount",
            ),
            (
                json!({"multires_noise_iterations": -1}),
                "multires_noise_iterations",
            ),
            (
                json!({"multires_noise_iterations": 6, "multires_noise_discount": 0}),
                "multires_noise_discount",
            ),
            (
                json!({"multires_noise_iterations": 6, "pyramid_noise_discount": 0.03}),
                "multires_noise_iterations",
            ),
            (json!({"timestep_start": -1}), "timestep_start"),
            (json!({"timestep_end": 1001}), "timestep_end"),
            (
                json!({"timestep_start": 500, "timestep_end": 500}),
                "timestep_start",
            ),
            (json!({"clip_skip": -1}), "clip_skip"),
            (json!({"clip_skip": 5}), "clip_skip"),
            (json!({"log_step": 0}), "log_step"),
            (json!({"save_every_n_epochs": -1}), "save_every_n_epochs"),
            (json!({"seed": -2}), "seed"),
            (json!({"project_name": "a/b"}), "project_name"),
            (json!({"mode": "dreambooth"}), "mode"),
            (json!({"log_with": "wandb"}), "log_with"),
            (json!({"log_with": "TensorBoard"}), "log_with"),
        ] {
            let (got, message) = fx.field_error(extra.clone());
            assert_eq!(got, field, "{extra}: {message}");
        }
    }

    #[test]
    fn edges_of_ranges_are_allowed() {
        let fx = Fixture::new();
        let p = fx
            .plan(
                json!({"resolution": 64, "flip_p": 1, "cond_dropout": 0, "timestep_start": 999,
                       "timestep_end": 1000, "clip_skip": 4, "save_every_n_epochs": 0}),
                &[],
            )
            .unwrap();
        assert_eq!(p.data.resolution, Some(64));
        assert_eq!(p.saving.every_n_epochs, None);
        assert!(fx.plan(json!({"resolution": 4096}), &[]).is_ok());
    }

    #[test]
    fn max_steps_alone_leaves_epochs_unbounded() {
        let fx = Fixture::new();
        let p = fx.plan(json!({"max_steps": 100}), &[]).unwrap();
        assert_eq!((p.max_epochs, p.max_steps), (None, Some(100)));
        assert_eq!(p.total_steps(|_| 7), 100);
        let p = fx
            .plan(json!({"max_steps": 100, "max_epochs": 2}), &[])
            .unwrap();
        assert_eq!(p.total_steps(|_| 7), 14);
        assert_eq!(p.total_steps(|_| 70), 100);
        // Epochs of different lengths are counted one by one.
        assert_eq!(p.total_steps(|e| [3, 5][e]), 8);
    }

    #[test]
    fn random_seed_is_drawn_and_recorded() {
        let fx = Fixture::new();
        let p = fx.plan(json!({"seed": -1}), &[]).unwrap();
        assert!(p.random_seed);
        assert!(p.seed <= 1 << 30);
    }

    #[test]
    fn model_and_resume_ckpt() {
        let fx = Fixture::new();
        let p = fx
            .plan(json!({"model": null, "resume_ckpt": "org/other@rev"}), &[])
            .unwrap();
        assert_eq!(p.model, "org/other@rev");
        assert!(fx.plan(json!({"resume_ckpt": "org/model"}), &[]).is_ok());
        let err = fx
            .plan(json!({"resume_ckpt": "org/other"}), &[])
            .unwrap_err();
        assert!(matches!(err, ConfigError::ModelConflict { .. }), "{err}");
        let err = fx.plan(json!({"model": null}), &[]).unwrap_err();
        assert!(
            matches!(err, ConfigError::Missing { field: "model", .. }),
            "{err}"
        );
        let (field, _) = fx.field_error(json!({"model": "findlast"}));
        assert_eq!(field, "model");
    }

    #[test]
    fn local_model_path_is_resolved_beside_the_config() {
        let fx = Fixture::new();
        std::fs::create_dir(fx.dir.path().join("base-model")).unwrap();
        let p = fx.plan(json!({"model": "base-model"}), &[]).unwrap();
        assert_eq!(
            p.model,
            fx.dir.path().join("base-model").display().to_string()
        );
    }

    #[test]
    fn adapter_modes_resolve_with_kohya_defaults() {
        let fx = Fixture::new();
        for (mode, want) in [("lora", TrainMode::Lora), ("locon", TrainMode::Locon)] {
            let p = fx
                .plan(json!({"mode": mode, "adapter": {"rank": 8}}), &[])
                .unwrap();
            assert_eq!(p.mode, want);
            let a = p.adapter.unwrap();
            assert_eq!((a.rank, a.alpha, a.conv_rank), (8, 1.0, 8));
        }
        assert!(fx.plan(json!({}), &[]).unwrap().adapter.is_none());
    }

    #[test]
    fn data_root_must_be_an_existing_folder() {
        let fx = Fixture::new();
        let err = fx.plan(json!({"data_root": "nope"}), &[]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("data_root `nope` does not exist"),
            "{err}"
        );
        fx.write("file.txt", &json!(1));
        let err = fx.plan(json!({"data_root": "file.txt"}), &[]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("data_root `file.txt` is not a folder"),
            "{err}"
        );
        let err = fx.plan(json!({"data_root": null}), &[]).unwrap_err();
        assert!(
            matches!(
                err,
                ConfigError::Missing {
                    field: "data_root",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn plan_serializes_and_summarizes() {
        let fx = Fixture::new();
        let p = fx.plan(json!({"max_steps": 10}), &["seed=3"]).unwrap();
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(v["optimizer"]["unet"]["optimizer"], json!("adamw8bit"));
        assert_eq!(
            v["optimizer"]["unet"]["schedule"]["decay_steps"],
            json!("auto")
        );
        assert_eq!(v["optimizer"]["unet"]["betas"], json!([0.9, 0.999]));
        assert_eq!(v["mode"], json!("full"));
        assert_eq!(v["seed"], json!(3));
        let text = p.to_string();
        for needle in [
            "org/model",
            "--set",
            "seed=3",
            "10 steps",
            "adamw8bit lr 1e-6",
            "constant",
        ] {
            assert!(text.contains(needle), "{needle} missing from:\n{text}");
        }
        assert_eq!(serde_json::to_value(StepCount::Steps(2)).unwrap(), json!(2));
    }

    #[test]
    fn ema_keys_reach_the_plan_and_the_summary() {
        let fx = Fixture::new();
        let p = fx.plan(json!({"max_steps": 10}), &[]).unwrap();
        assert_eq!(p.ema, None);
        let p = fx
            .plan(
                json!({"max_steps": 10, "ema_decay_rate": 0.99, "ema_update_interval": 2}),
                &["ema_device=device"],
            )
            .unwrap();
        let ema = p.ema.unwrap();
        assert_eq!(ema.decay, crate::config::EmaDecay::Rate(0.99));
        assert_eq!(ema.update_interval, 2);
        assert_eq!(ema.device, crate::config::EmaDevice::Training);
        let text = p.to_string();
        assert!(text.contains("decay 0.99, every 2 steps"), "{text}");
    }

    #[test]
    fn run_name_and_log_folder() {
        use chrono::TimeZone;
        let fx = Fixture::new();
        let p = fx.plan(json!({"project_name": "cat"}), &[]).unwrap();
        let t = chrono::Local.with_ymd_and_hms(2024, 5, 6, 7, 8, 9).unwrap();
        let stamp = crate::run_layout::run_stamp(t);
        let name = crate::run_layout::run_folder_name(&p.project_name, &stamp, 1);
        assert_eq!(name, "cat-20240506-070809");
        let run = Path::new("/out/cat-20240506-070809");
        assert_eq!(p.log_folder(run), run);
        let p = fx.plan(json!({"logdir": "/logs"}), &[]).unwrap();
        assert_eq!(p.log_folder(run), Path::new("/logs/cat-20240506-070809"));
    }
}
