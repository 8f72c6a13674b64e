//! [`TrainFile`]: the serde mirror of train.json, with EveryDream2's key names, and its strict
//! parse. Every field is optional here; what is required, the defaults and the allowed ranges are
//! decided in one place, [`super::plan::TrainPlan`]. `null` means "not set", as in EveryDream2.
//!
//! Numbers are read as `i64`/`f64` so that a negative or zero count reaches validation and gets a
//! range message, rather than a serde "expected u64".
//!
//! EveryDream2 keys sdtrain does not implement yet are listed in [`UNSUPPORTED`]: they are an
//! error unless their value asks for what sdtrain does anyway (EveryDream2's own train.json has
//! `"wandb": false`, `"ema_decay_rate": null`, …), never silently ignored.

use std::collections::HashMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::adapter_file::{parse_adapter_section, AdapterFile};
use super::embedding_plan::{parse_embedding_section, EmbeddingFile};
use super::error::ConfigError;
use super::strict::{known_keys, Accepts, Section, Unsupported};

/// train.json as written. See docs/config.md for every key.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainFile {
    // kohya's ModelSpec metadata of the saved files (`super::modelspec_plan`).
    #[serde(default)]
    pub metadata_title: Option<String>,
    #[serde(default)]
    pub metadata_author: Option<String>,
    #[serde(default)]
    pub metadata_description: Option<String>,
    #[serde(default)]
    pub metadata_license: Option<String>,
    #[serde(default)]
    pub metadata_tags: Option<String>,
    #[serde(default)]
    pub metadata_usage_hint: Option<String>,
    #[serde(default)]
    pub metadata_thumbnail: Option<String>,
    #[serde(default)]
    pub metadata_merged_from: Option<String>,
    #[serde(default)]
    pub metadata_trigger_phrase: Option<String>,
    #[serde(default)]
    pub metadata_preprocessor: Option<String>,
    #[serde(default)]
    pub metadata_is_negative_embedding: Option<String>,
    /// A kohya config's dataset options (`super::kohya_config`); never in train.json.
    #[serde(skip)]
    pub kohya_data: Option<super::kohya_config::KohyaData>,
    // sdtrain's own keys.
    /// Hub id `org/name[@revision]`, a diffusers folder, or a single .safetensors file.
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub output_dir: Option<String>,
    #[serde(default)]
    pub mode: Option<String>,
    #[serde(default)]
    pub max_steps: Option<i64>,
    /// The `adapter` section (modes lora/locon), checked key by key by `adapter_file`.
    #[serde(default)]
    pub adapter: Option<AdapterFile>,
    /// The `embedding` section (mode textual_inversion), checked key by key by
    /// `embedding_plan`.
    #[serde(default)]
    pub embedding: Option<EmbeddingFile>,
    /// Save the weights and a resume state every N optimizer steps.
    #[serde(default)]
    pub save_every_n_steps: Option<i64>,
    /// kohya's (train_db.py): the text encoders stop training after this many steps.
    #[serde(default)]
    pub stop_text_encoder_training: Option<i64>,
    /// OneTrainer's `text_encoder.stop_training_after` in epochs: the text encoders train for
    /// the first N epochs.
    #[serde(default)]
    pub stop_text_encoder_training_epochs: Option<i64>,
    /// kohya's sdxl_train.py `block_lr`: 23 learning rates, one per SDXL UNet block.
    #[serde(default)]
    pub block_lr: Option<Value>,
    /// kohya's: keep the newest N epoch saves' weights.
    #[serde(default)]
    pub save_last_n_epochs: Option<i64>,
    /// kohya's: keep the step saves' weights of the last N steps.
    #[serde(default)]
    pub save_last_n_steps: Option<i64>,
    /// Keep only the newest N resume states (diffusers' name); older step saves are deleted.
    #[serde(default)]
    pub checkpoints_total_limit: Option<i64>,
    /// Stop the run after this many steps in a row are skipped for a non-finite loss or
    /// gradient (5 when unset; 0 never stops).
    #[serde(default)]
    pub max_consecutive_skipped_steps: Option<i64>,
    /// CUDA: hold back all of the card beyond this many GiB, to rehearse a smaller card.
    #[serde(default)]
    pub vram_limit_gb: Option<f64>,
    /// Images with more pixels are skipped before decoding (Pillow's limit by default).
    #[serde(default)]
    pub max_image_pixels: Option<i64>,
    /// Rescale the noise schedule to zero terminal SNR (arXiv 2305.08891).
    #[serde(default)]
    pub zero_terminal_snr: Option<bool>,
    /// EveryDream2's name for `zero_terminal_snr`.
    #[serde(default)]
    pub enable_zero_terminal_snr: Option<bool>,
    /// Hold out this fraction of the images (seeded) for the validation loss.
    #[serde(default)]
    pub validation_split: Option<f64>,
    /// A folder of validation images instead of a split.
    #[serde(default)]
    pub validation_data_root: Option<String>,
    /// Compute the validation loss every N steps (default: at the end of each epoch).
    #[serde(default)]
    pub validation_every_n_steps: Option<i64>,
    /// EveryDream2's validation file (validation_default.json), instead of the three above.
    #[serde(default)]
    pub validation_config: Option<String>,
    /// With `shuffle_tags`, the tags after the main prompt kept in place.
    #[serde(default)]
    pub keep_tags: Option<i64>,
    /// kohya's `max_token_length`: captions up to 75 (the default), 150 or 225 tokens.
    #[serde(default)]
    pub max_token_length: Option<i64>,
    /// EveryDream2's rated dataset: later epochs train on fewer images, picked by rating.
    #[serde(default)]
    pub rated_dataset: Option<bool>,
    /// The share of the images the last epochs train on (percent, default 50).
    #[serde(default)]
    pub rated_dataset_target_dropout_percent: Option<f64>,
    /// Write each epoch's batch schedule into the run folder.
    #[serde(default)]
    pub write_schedule: Option<bool>,
    /// Aspect-ratio buckets (kohya's name); false trains every image as a centre-cropped square.
    #[serde(default)]
    pub enable_bucket: Option<bool>,
    /// The bucket sizes, `[[width, height], …]`, instead of the generated ones.
    #[serde(default)]
    pub aspects: Option<Vec<Vec<i64>>>,
    /// Leave out buckets wider or taller than this ratio (e.g. 2 keeps 2:1 … 1:2).
    #[serde(default)]
    pub max_aspect_ratio: Option<f64>,
    /// kohya's bucket generation: the shortest and longest side, and the step between sizes.
    #[serde(default)]
    pub min_bucket_reso: Option<i64>,
    #[serde(default)]
    pub max_bucket_reso: Option<i64>,
    #[serde(default)]
    pub bucket_reso_steps: Option<i64>,
    /// kohya's per-image buckets without upscaling (refused: sdtrain's buckets are fixed sizes).
    #[serde(default)]
    pub bucket_no_upscale: Option<bool>,
    /// kohya's dataset config (`--dataset_config`): a TOML of datasets and subsets that names the
    /// images instead of `data_root` (`crate::config::dataset_config`).
    #[serde(default)]
    pub dataset_config: Option<String>,
    /// Encode each image (and its flip) with the VAE once, before training.
    #[serde(default)]
    pub cache_latents: Option<bool>,
    /// Keep the cached latents in safetensors files beside the runs, reused by later runs.
    #[serde(default)]
    pub cache_latents_to_disk: Option<bool>,
    /// Encode each caption once when no text encoder trains and captions never change
    /// (default on); false turns it off.
    #[serde(default)]
    pub cache_text_encoder_outputs: Option<bool>,
    /// A diffusers folder whose configs and tokenizers describe a single-file `model`.
    #[serde(default)]
    pub model_config: Option<String>,
    /// kohya's `--base_weights`: adapter files merged into the frozen model before training.
    #[serde(default)]
    pub base_weights: Option<Vec<String>>,
    /// kohya's `--base_weights_multiplier`: each file's multiplier (1 when not given).
    #[serde(default)]
    pub base_weights_multiplier: Option<Vec<f64>>,
    /// A VAE in place of the model's (kohya's `--vae`): a VAE folder, a pipeline folder, a
    /// `.safetensors` file, or a hub repo id.
    #[serde(default)]
    pub vae: Option<String>,
    /// diffusers' `variant`: read a pipeline's `<base>.<variant>.safetensors` weights (`fp16`,
    /// `bf16`, `non_ema`, …).
    #[serde(default)]
    pub variant: Option<String>,
    /// `"epsilon"` or `"v_prediction"`: what a single-file `model` predicts, when its own
    /// metadata or the detection default is not right.
    #[serde(default)]
    pub prediction_type: Option<String>,
    /// Full fine-tunes: `"diffusers"`, `"safetensors"` (a single LDM-layout file) or `"both"`.
    #[serde(default)]
    pub save_ckpt_format: Option<String>,
    // EveryDream2's keys.
    /// EveryDream2: true writes no single-file checkpoint, false writes one beside the
    /// diffusers folder (`save_ckpt_format: "both"`).
    #[serde(default)]
    pub no_save_ckpt: Option<bool>,
    /// EveryDream2's random crop: up to this fraction of the short side off each edge.
    #[serde(default)]
    pub crop_jitter: Option<f64>,
    /// EveryDream2's name for the base model; a run folder or a saved state resumes that run.
    #[serde(default)]
    pub resume_ckpt: Option<String>,
    #[serde(default)]
    pub data_root: Option<String>,
    /// How `data_root` and `reg_data_root` are laid out: `"everydream"`, `"kohya"` or
    /// `"imagefolder"`.
    #[serde(default)]
    pub data_layout: Option<String>,
    /// kohya's layout: the caption files' extension (kohya's `caption_extension`).
    #[serde(default)]
    pub caption_extension: Option<String>,
    /// diffusers' DreamBooth `instance_prompt`: the caption of every `data_root` image without
    /// one of its own.
    #[serde(default)]
    pub instance_prompt: Option<String>,
    /// The imagefolder layout: the metadata column holding captions (diffusers'
    /// `--caption_column`).
    #[serde(default)]
    pub caption_column: Option<String>,
    /// A folder of regularization (class) images (kohya's `reg_data_dir`).
    #[serde(default)]
    pub reg_data_root: Option<String>,
    /// The regularization samples' loss weight (kohya's and diffusers' `prior_loss_weight`).
    #[serde(default)]
    pub prior_loss_weight: Option<f64>,
    /// diffusers' DreamBooth: the prompt class images are drawn with when `reg_data_root`
    /// holds fewer than `num_class_images`.
    #[serde(default)]
    pub class_prompt: Option<String>,
    /// kohya's `caption_tag_dropout_rate`.
    #[serde(default)]
    pub caption_tag_dropout_rate: Option<f64>,
    /// kohya's `caption_prefix` and `caption_suffix`.
    #[serde(default)]
    pub caption_prefix: Option<String>,
    #[serde(default)]
    pub caption_suffix: Option<String>,
    /// kohya's `keep_tokens_separator`, `secondary_separator` and `enable_wildcard`
    /// (`crate::data::kohya_caption`).
    #[serde(default)]
    pub keep_tokens_separator: Option<String>,
    #[serde(default)]
    pub secondary_separator: Option<String>,
    #[serde(default)]
    pub enable_wildcard: Option<bool>,
    /// kohya's `caption_dropout_every_n_epochs`, `token_warmup_min` and `token_warmup_step`.
    #[serde(default)]
    pub caption_dropout_every_n_epochs: Option<i64>,
    #[serde(default)]
    pub token_warmup_min: Option<i64>,
    #[serde(default)]
    pub token_warmup_step: Option<f64>,
    #[serde(default)]
    pub num_class_images: Option<i64>,
    #[serde(default)]
    pub batch_size: Option<i64>,
    #[serde(default)]
    pub grad_accum: Option<i64>,
    #[serde(default)]
    pub max_epochs: Option<i64>,
    #[serde(default)]
    pub lr: Option<f64>,
    /// EveryDream2's `clip_grad_norm`: clip each group's gradient norm to this; null is off.
    #[serde(default)]
    pub clip_grad_norm: Option<f64>,
    /// kohya's names for EveryDream2's keys ([`super::kohya_aliases`]): `clip_grad_norm`,
    /// `disable_textenc_training`, and one refused.
    #[serde(default)]
    pub max_grad_norm: Option<f64>,
    #[serde(default)]
    pub network_train_unet_only: Option<bool>,
    #[serde(default)]
    pub network_train_text_encoder_only: Option<bool>,
    /// kohya's `output_name` (`project_name`) and `save_model_as` (`save_ckpt_format`).
    #[serde(default)]
    pub output_name: Option<String>,
    #[serde(default)]
    pub save_model_as: Option<String>,
    #[serde(default)]
    pub resolution: Option<i64>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub save_every_n_epochs: Option<i64>,
    #[serde(default)]
    pub optimizer_config: Option<String>,
    /// The schedule the optimizer config's `base` section falls back to when it leaves
    /// `lr_scheduler` null (EveryDream2's `--lr_scheduler`).
    #[serde(default)]
    pub lr_scheduler: Option<String>,
    /// As `lr_scheduler`: `base.lr_warmup_steps`' fallback.
    #[serde(default)]
    pub lr_warmup_steps: Option<i64>,
    /// As `lr_scheduler`: `base.lr_decay_steps`' fallback (0 is automatic).
    #[serde(default)]
    pub lr_decay_steps: Option<i64>,
    #[serde(default)]
    pub logdir: Option<String>,
    #[serde(default)]
    pub project_name: Option<String>,
    #[serde(default)]
    pub flip_p: Option<f64>,
    #[serde(default)]
    pub cond_dropout: Option<f64>,
    #[serde(default)]
    pub shuffle_tags: Option<bool>,
    #[serde(default)]
    pub clip_skip: Option<i64>,
    #[serde(default)]
    pub min_snr_gamma: Option<f64>,
    #[serde(default)]
    pub zero_frequency_noise_ratio: Option<f64>,
    /// kohya's `weighted_captions`: A1111's emphasis in captions weighs their tokens.
    #[serde(default)]
    pub weighted_captions: Option<bool>,
    /// kohya's name for `zero_frequency_noise_ratio` (the same offset noise).
    #[serde(default)]
    pub noise_offset: Option<f64>,
    /// kohya's `noise_offset_random_strength`: the offset's strength is drawn in [0, offset).
    #[serde(default)]
    pub noise_offset_random_strength: Option<bool>,
    /// kohya's `adaptive_noise_scale`: the offset grows with each channel's |mean latent|.
    #[serde(default)]
    pub adaptive_noise_scale: Option<f64>,
    /// kohya's `scale_v_pred_loss_like_noise_pred` (v-prediction models).
    #[serde(default)]
    pub scale_v_pred_loss_like_noise_pred: Option<bool>,
    /// kohya's `v_pred_like_loss` (ε-prediction models).
    #[serde(default)]
    pub v_pred_like_loss: Option<f64>,
    /// EveryDream2's pyramid noise: its discount per level (0 or null is off).
    #[serde(default)]
    pub pyramid_noise_discount: Option<f64>,
    /// kohya's multi-resolution noise: its number of levels (0 or null is off) …
    #[serde(default)]
    pub multires_noise_iterations: Option<i64>,
    /// … and its discount per level (kohya's recommended 0.3 when not set).
    #[serde(default)]
    pub multires_noise_discount: Option<f64>,
    // The loss and noise options (docs/config.md, "Loss and noise"): EveryDream2's names, and
    // kohya's, OneTrainer's or diffusers' where EveryDream2 has none.
    /// EveryDream2's `"mse"`, `"huber"`, `"mse_huber"`, `"huber_mse"`; kohya's `"l2"`, `"l1"`,
    /// `"smooth_l1"`, and kohya's `huber` as `"pseudo_huber"`.
    #[serde(default)]
    pub loss_type: Option<String>,
    /// kohya: `"snr"`, `"constant"` or `"exponential"`, for pseudo_huber/smooth_l1.
    #[serde(default)]
    pub huber_schedule: Option<String>,
    #[serde(default)]
    pub huber_c: Option<f64>,
    #[serde(default)]
    pub huber_scale: Option<f64>,
    /// OneTrainer's weighted sum of losses: the strengths of MSE (1 when left out), MAE, Huber
    /// (with `huber_delta`) and log-cosh.
    #[serde(default)]
    pub mse_strength: Option<f64>,
    #[serde(default)]
    pub mae_strength: Option<f64>,
    #[serde(default)]
    pub huber_strength: Option<f64>,
    #[serde(default)]
    pub huber_delta: Option<f64>,
    #[serde(default)]
    pub log_cosh_strength: Option<f64>,
    /// OneTrainer's P2 loss weighting γ.
    #[serde(default)]
    pub p2_loss_gamma: Option<f64>,
    /// OneTrainer's `loss_scaler`: `"none"`, `"batch"`, `"gradient_accumulation"`, `"both"`.
    #[serde(default)]
    pub loss_scaler: Option<String>,
    /// kohya's debiased estimation loss weighting.
    #[serde(default)]
    pub debiased_estimation_loss: Option<bool>,
    /// Whose debiased weight a v-prediction model takes: `"kohya"` (1/(SNR+1)) or
    /// `"onetrainer"` (1/√(SNR+1)).
    #[serde(default)]
    pub debiased_estimation_style: Option<String>,
    /// Masked loss from `<stem>-masklabel.png` beside each image: kohya's name …
    #[serde(default)]
    pub masked_loss: Option<bool>,
    /// … and OneTrainer's.
    #[serde(default)]
    pub masked_training: Option<bool>,
    /// kohya: masked loss with the images' alpha channels as the masks.
    #[serde(default)]
    pub alpha_mask: Option<bool>,
    /// OneTrainer: the floor of the mask, in [0, 1].
    #[serde(default)]
    pub unmasked_weight: Option<f64>,
    /// OneTrainer: the chance a sample trains on the whole image, in [0, 1].
    #[serde(default)]
    pub unmasked_probability: Option<f64>,
    /// OneTrainer: divide each sample's loss by its mask's mean.
    #[serde(default)]
    pub normalize_masked_area_loss: Option<bool>,
    /// kohya's input perturbation strength …
    #[serde(default)]
    pub ip_noise_gamma: Option<f64>,
    /// … diffusers' name for it …
    #[serde(default)]
    pub input_perturbation: Option<f64>,
    /// … and kohya's random strength in [0, γ).
    #[serde(default)]
    pub ip_noise_gamma_random_strength: Option<bool>,
    /// kohya's names for `timestep_start` and `timestep_end`.
    #[serde(default)]
    pub min_timestep: Option<i64>,
    #[serde(default)]
    pub max_timestep: Option<i64>,
    /// OneTrainer's timestep distributions (`"uniform"`, `"logit_normal"`, `"heavy_tail"`,
    /// `"beta"`, `"cos_map"`, `"sigmoid"`, `"inverted_parabola"`), shaped by its
    /// `noising_weight`/`noising_bias`, and its `timestep_shift`.
    #[serde(default)]
    pub timestep_distribution: Option<String>,
    #[serde(default)]
    pub noising_weight: Option<f64>,
    #[serde(default)]
    pub noising_bias: Option<f64>,
    #[serde(default)]
    pub timestep_shift: Option<f64>,
    /// OneTrainer's masked prior preservation (LoRA-family modes with masked loss).
    #[serde(default)]
    pub masked_prior_preservation_weight: Option<f64>,
    /// OneTrainer's generalized offset noise (the noise offset scaled by ψ_t).
    #[serde(default)]
    pub generalized_offset_noise: Option<bool>,
    /// OneTrainer's perturbation noise, added to the noise itself.
    #[serde(default)]
    pub perturbation_noise_weight: Option<f64>,
    /// EveryDream2: noise of deviation p/√dim added to the text conditioning in training.
    #[serde(default)]
    pub embedding_perturbation: Option<f64>,
    /// EveryDream2: `"ddpm"`, `"ddim"` or `"pndm"`, the training noise scheduler's class.
    #[serde(default)]
    pub train_sampler: Option<String>,
    #[serde(default)]
    pub timestep_start: Option<i64>,
    #[serde(default)]
    pub timestep_end: Option<i64>,
    #[serde(default)]
    pub disable_textenc_training: Option<bool>,
    #[serde(default)]
    pub log_step: Option<i64>,
    /// kohya's `log_with`: `"tensorboard"` (the default: EveryDream2 always writes TensorBoard
    /// files) or `"none"`.
    #[serde(default)]
    pub log_with: Option<String>,
    #[serde(default)]
    pub save_optimizer: Option<bool>,
    /// `"bf16"`, `"fp16"`, `"off"`, or a bool (true: the device's default, false: off).
    #[serde(default)]
    pub amp: Option<Value>,
    /// EveryDream2's switch: true is `amp: "off"`.
    #[serde(default)]
    pub disable_amp: Option<bool>,
    /// A full fine-tune's trained weights: `"f32"`, `"bf16"` or `"fp16"` (stochastic rounding).
    #[serde(default)]
    pub weight_dtype: Option<String>,
    /// An adapter run's frozen base: `"fp8"` (e4m3, a scale per output channel) or `"amp"` (the
    /// compute dtype, the default).
    #[serde(default)]
    pub base_weight_dtype: Option<String>,
    /// Update each parameter as soon as its gradient is complete (kohya's name).
    #[serde(default)]
    pub fused_backward_pass: Option<bool>,
    /// true, false or `"auto"` (the fewest UNet blocks that make the memory plan fit).
    #[serde(default)]
    pub gradient_checkpointing: Option<Value>,
    #[serde(default)]
    pub grad_scaler_init_scale: Option<f64>,
    #[serde(default)]
    pub grad_scaler_growth_factor: Option<f64>,
    #[serde(default)]
    pub grad_scaler_backoff_factor: Option<f64>,
    #[serde(default)]
    pub grad_scaler_growth_interval: Option<i64>,
    /// EveryDream2's EMA decay per update; setting it (or `ema_strength_target`) turns EMA on.
    #[serde(default)]
    pub ema_decay_rate: Option<f64>,
    /// OneTrainer's EMA decay warm-up: `min(k/(9 + k), ema_decay_rate)` after k steps.
    #[serde(default)]
    pub ema_decay_warmup: Option<bool>,
    /// The share of the starting weights left in the EMA at the end of the run; overrides
    /// `ema_decay_rate`.
    #[serde(default)]
    pub ema_strength_target: Option<f64>,
    /// Update the EMA every N optimizer steps (EveryDream2's default 500).
    #[serde(default)]
    pub ema_update_interval: Option<i64>,
    /// `"cpu"` (default) or `"cuda"`/`"device"`: where the EMA copy lives.
    #[serde(default)]
    pub ema_device: Option<String>,
    /// EveryDream2's sample prompts file (.txt or .json); sampling is off without it.
    #[serde(default)]
    pub sample_prompts: Option<String>,
    /// Sample every N steps (EveryDream2's default 250).
    #[serde(default)]
    pub sample_steps: Option<i64>,
    /// kohya's name for `sample_steps`.
    #[serde(default)]
    pub sample_every_n_steps: Option<i64>,
    /// kohya's `sample_every_n_epochs`: sample at the end of every N-th epoch instead.
    #[serde(default)]
    pub sample_every_n_epochs: Option<i64>,
    /// kohya's `sample_at_first`: also sample before the first step.
    #[serde(default)]
    pub sample_at_first: Option<bool>,
    /// kohya's `sample_sampler`: the sampler of prompts that name none.
    #[serde(default)]
    pub sample_sampler: Option<String>,
    /// With EMA on, also sample the trained (non-EMA) weights.
    #[serde(default)]
    pub ema_sample_nonema_model: Option<bool>,
    /// With EMA on, sample the EMA weights.
    #[serde(default)]
    pub ema_sample_ema_model: Option<bool>,
    // EveryDream2's saving keys.
    /// Save every N minutes (0 or null: off).
    #[serde(default)]
    pub ckpt_every_n_minutes: Option<f64>,
    /// Epoch saves start once this many epochs are complete.
    #[serde(default)]
    pub save_ckpts_from_n_epochs: Option<i64>,
    /// Where single-file checkpoints and adapter files go.
    #[serde(default)]
    pub save_ckpt_dir: Option<String>,
    /// Single files in f32 (true) or f16 (false, EveryDream2's default).
    #[serde(default)]
    pub save_full_precision: Option<bool>,
    /// The end-of-run save takes a step save's name instead of `final`.
    #[serde(default)]
    pub no_prepend_last: Option<bool>,
    /// Added to the run folder's name after the project name.
    #[serde(default)]
    pub run_name: Option<String>,
    /// The CUDA card to train on (`--device cuda:N` overrides it).
    #[serde(default)]
    pub gpuid: Option<i64>,
    /// Data parallel: one rank per device (`--devices` overrides it).
    #[serde(default)]
    pub devices: Option<super::devices_plan::DevicesValue>,
    /// Freeze the UNet and train only the text encoder(s) (full fine-tunes).
    #[serde(default)]
    pub disable_unet_training: Option<bool>,
    /// Read train.json again at each epoch's start and apply what a running run can change.
    #[serde(default)]
    pub load_settings_every_epoch: Option<bool>,
    /// What a new run's EMA starts from: a model, or an adapter file in lora/locon mode.
    #[serde(default)]
    pub ema_resume_model: Option<String>,
}

/// EveryDream2 train.json keys (train.py's argparser and its sample train.json) that sdtrain
/// does not implement yet, with the values that are accepted because they change nothing.
pub(crate) const UNSUPPORTED: &[Unsupported] = &[
    un(
        "attn_type",
        Accepts::NullOrStr("sdp"),
        "sdtrain has one attention implementation",
    ),
    un(
        "notebook",
        Accepts::NullOrFalse,
        "notebook mode is not implemented",
    ),
    un("plugins", Accepts::Null, "plugins are not implemented"),
    un(
        "wandb",
        Accepts::NullOrFalse,
        "wandb logging is not implemented",
    ),
    // Keys of older EveryDream2 versions that its own chain0-2.json, trainSD21.json and
    // cfgs/train_coco.json still hold; EveryDream2 merges a config into its arguments, so it
    // ignores them.
    un("disable_xformers", Accepts::Obsolete, OBSOLETE),
    un("ed1_mode", Accepts::Obsolete, OBSOLETE),
    un("lowvram", Accepts::Obsolete, OBSOLETE),
    un("scale_lr", Accepts::Obsolete, OBSOLETE),
    un("useadam8bit", Accepts::Obsolete, OBSOLETE),
];

const OBSOLETE: &str = "is a key of older EveryDream2 versions, which EveryDream2 no longer reads \
                        (its optimizer and memory settings live elsewhere now)";

const fn un(key: &'static str, accepts: Accepts, reason: &'static str) -> Unsupported {
    Unsupported {
        key,
        accepts,
        reason,
    }
}

/// Where a key that belongs to optimizer.json, written in train.json, should go.
fn misplaced(key: &str) -> Option<String> {
    let section = match key {
        "optimizer" | "betas" | "epsilon" | "weight_decay" => "`base` section",
        "unfreeze_last_n_layers" => "`text_encoder_freezing` section",
        "base"
        | "text_encoder_overrides"
        | "text_encoder_freezing"
        | "apply_grad_scaler_step_tweaks" => "top level",
        _ => return None,
    };
    Some(format!(
        "`{key}` belongs in the optimizer config's {section} (the file `optimizer_config` names)"
    ))
}

impl TrainFile {
    /// Checks and parses train.json's top-level object, after `--set` overrides were applied.
    /// `set_args` maps each overridden top-level key to its `--set` argument.
    pub fn from_object(
        mut obj: Map<String, Value>,
        file: &Path,
        set_args: &HashMap<String, String>,
    ) -> Result<TrainFile, ConfigError> {
        let section = Section {
            file,
            prefix: "",
            set_args,
        };
        section.check_unknown(&obj, &known_keys::<TrainFile>(), UNSUPPORTED, misplaced)?;
        let entries = section.take_unsupported(&mut obj, UNSUPPORTED);
        if !entries.is_empty() {
            return Err(ConfigError::Unsupported {
                file: file.to_path_buf(),
                entries,
            });
        }
        // The `adapter` section is checked on its own, after the top level, so its errors name
        // `adapter.<key>`.
        let adapter = obj.remove("adapter");
        let embedding = obj.remove("embedding");
        if let Some(err) = section.type_error::<TrainFile>(&obj) {
            return Err(err);
        }
        let mut parsed: TrainFile =
            serde_json::from_value(Value::Object(obj)).map_err(|e| ConfigError::Invalid {
                file: file.to_path_buf(),
                field: "(top level)".to_string(),
                message: format!("does not parse: {e}"),
            })?;
        parsed.adapter = match adapter {
            None | Some(Value::Null) => None,
            Some(value) => Some(parse_adapter_section(&value, file, set_args)?),
        };
        parsed.embedding = match embedding {
            None | Some(Value::Null) => None,
            Some(value) => Some(parse_embedding_section(&value, file, set_args)?),
        };
        Ok(parsed)
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use serde_json::json;

    use super::*;

    fn parse(v: Value) -> Result<TrainFile, ConfigError> {
        let Value::Object(obj) = v else {
            panic!("test input must be an object")
        };
        TrainFile::from_object(obj, &PathBuf::from("train.json"), &HashMap::new())
    }

    #[test]
    fn every_key_parses_as_null() {
        let obj: Map<String, Value> = known_keys::<TrainFile>()
            .into_iter()
            .map(|k| (k, Value::Null))
            .collect();
        assert!(obj.len() > 25);
        assert_eq!(parse(Value::Object(obj)).unwrap(), TrainFile::default());
    }

    #[test]
    fn unsupported_and_known_keys_do_not_overlap() {
        let known = known_keys::<TrainFile>();
        for u in UNSUPPORTED {
            assert!(!known.iter().any(|k| k == u.key), "{}", u.key);
        }
    }

    #[test]
    fn unknown_key_suggests_the_closest() {
        let err = parse(json!({"bach_size": 4})).unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown key `bach_size` in train.json; did you mean `batch_size`?"
        );
    }

    #[test]
    fn optimizer_key_in_train_json_points_to_optimizer_config() {
        let err = parse(json!({"betas": [0.9, 0.99]})).unwrap_err();
        assert!(
            err.to_string()
                .contains("belongs in the optimizer config's `base` section"),
            "{err}"
        );
    }

    #[test]
    fn unsupported_keys_error_unless_inert() {
        let err = parse(json!({"wandb": true})).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("`wandb` is not supported yet"), "{msg}");
        let ok = parse(json!({
            "wandb": false,
            "ema_decay_rate": null, "attn_type": "sdp", "loss_type": "mse", "gpuid": 0,
            "embedding_perturbation": 0.0, "batch_size": 3
        }))
        .unwrap();
        assert_eq!(ok.batch_size, Some(3));
    }

    #[test]
    fn all_unsupported_keys_are_reported_together() {
        let err = parse(json!({"wandb": true, "notebook": true})).unwrap_err();
        let ConfigError::Unsupported { entries, .. } = &err else {
            panic!("{err}")
        };
        assert_eq!(entries.len(), 2);
    }

    #[test]
    fn wrong_type_names_the_field() {
        let err = parse(json!({"batch_size": "4"})).unwrap_err();
        assert_eq!(
            err.to_string(),
            "`batch_size` in train.json has the wrong type: expected an integer, found the string \"4\""
        );
        let err = parse(json!({"shuffle_tags": 1})).unwrap_err();
        assert!(err.to_string().contains("`shuffle_tags`"), "{err}");
        let err = parse(json!({"lr": "fast"})).unwrap_err();
        assert!(err.to_string().contains("expected a number"), "{err}");
    }

    #[test]
    fn integers_are_accepted_for_floats() {
        assert_eq!(parse(json!({"flip_p": 1})).unwrap().flip_p, Some(1.0));
    }
}
