//! What each option of kohya sd-scripts' training scripts becomes in a kohya config file
//! (`super::kohya_config`): every option of `train_network.py`, `sdxl_train_network.py`,
//! `train_db.py`, `fine_tune.py` and `sdxl_train.py` (their parsers, `library/train_util.py` and
//! `library/custom_train_functions.py`) has a [`Rule`], so none is ignored unseen. The list and
//! the defaults are checked against kohya's parsers by tests/kohya_config_parity.rs.

/// How one kohya option is read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Rule {
    /// The train.json key of the same name, meaning the same.
    Same,
    /// A train.json key of another name.
    To(&'static str),
    /// A key of train.json's `adapter` section (adapter runs).
    Adapter(&'static str),
    /// A dataset or subset option: kohya's command line is the level under a dataset config's
    /// `[general]` (its `ConfigSanitizer` argparse schema), which sdtrain reads the same way.
    Data,
    /// Read by code in `kohya_config` or `kohya_optimizer`.
    Code,
    /// Changes only speed, memory layout, logging or uploads, which sdtrain decides its own way;
    /// listed in one note.
    NoEffect,
    /// Not supported: an error with the reason, unless the value is off (false, empty, 0).
    Refused(&'static str),
    /// An option of kohya's scripts for other models (SD3, FLUX.1, Lumina): refused unless off.
    OtherModel,
    /// A kohya_ss GUI setting that it writes into the file and sd-scripts does not read
    /// (`epoch`, `noise_offset_type`); listed in a note.
    GuiOnly,
}

use Rule::*;

/// Every option, by name.
pub(super) const KEYS: &[(&str, Rule)] = &[
    ("adaptive_noise_scale", Same),
    ("ae", OtherModel),
    ("alpha_mask", Same),
    ("apply_lg_attn_mask", OtherModel),
    ("apply_t5_attn_mask", OtherModel),
    ("async_upload", NoEffect),
    ("attn_mode", OtherModel),
    ("base_weights", Same),
    ("base_weights_multiplier", Same),
    ("block_lr", Code),
    ("blocks_to_swap", NoEffect),
    ("bucket_no_upscale", Data),
    ("bucket_reso_steps", Data),
    ("cache_info", NoEffect),
    ("cache_latents", Same),
    ("cache_latents_to_disk", Same),
    ("cache_text_encoder_outputs", Same),
    ("cache_text_encoder_outputs_to_disk", NoEffect),
    ("caption_dropout_every_n_epochs", Data),
    ("caption_dropout_rate", Data),
    ("caption_extension", Data),
    ("caption_extention", Code),
    ("caption_prefix", Data),
    ("caption_separator", Data),
    ("caption_suffix", Data),
    ("caption_tag_dropout_rate", Data),
    ("clip_g", OtherModel),
    ("clip_g_dropout_rate", OtherModel),
    ("clip_l", OtherModel),
    ("clip_l_dropout_rate", OtherModel),
    ("clip_skip", Same),
    ("color_aug", Data),
    (
        "conditioning_data_dir",
        Refused("ControlNet conditioning images are not supported"),
    ),
    ("config_file", NoEffect),
    ("console_log_file", NoEffect),
    ("console_log_level", NoEffect),
    ("console_log_simple", NoEffect),
    ("controlnet_model_name_or_path", OtherModel),
    ("cpu_offload_checkpointing", NoEffect),
    ("cross_attn_lr", OtherModel),
    (
        "dataset_class",
        Refused("a Python dataset class cannot be loaded"),
    ),
    ("dataset_config", Same),
    ("dataset_repeats", Code),
    ("ddp_gradient_as_bucket_view", NoEffect),
    ("ddp_static_graph", NoEffect),
    ("ddp_timeout", NoEffect),
    ("debiased_estimation_loss", Same),
    (
        "debug_dataset",
        Refused("sdtrain has no dataset browser; `--dry-run` shows the data"),
    ),
    (
        "deepspeed",
        Refused("DeepSpeed is not used; sdtrain plans its own memory (`--dry-run`)"),
    ),
    ("diffusers_xformers", NoEffect),
    ("dim_from_weights", Adapter("dim_from_weights")),
    ("disable_mmap_load_safetensors", NoEffect),
    ("discrete_flow_shift", OtherModel),
    ("double_blocks_to_swap", OtherModel),
    ("dynamo_backend", NoEffect),
    ("enable_bucket", Data),
    ("enable_scaled_pos_embed", OtherModel),
    ("enable_wildcard", Data),
    ("epoch", GuiOnly),
    ("face_crop_aug_range", Data),
    ("flip_aug", Data),
    (
        "fp16_master_weights_and_gradients",
        Refused("a DeepSpeed option; see weight_dtype"),
    ),
    ("fp8_base", Code),
    ("fp8_base_unet", Code),
    ("full_bf16", Code),
    ("full_fp16", Code),
    ("fused_backward_pass", Same),
    (
        "fused_optimizer_groups",
        Refused("not supported; fused_backward_pass updates each tensor as its gradient completes"),
    ),
    ("gemma2", OtherModel),
    ("gemma2_max_token_length", OtherModel),
    ("gradient_accumulation_steps", To("grad_accum")),
    ("gradient_checkpointing", Same),
    ("guidance_scale", OtherModel),
    ("highvram", NoEffect),
    ("huber_c", Code),
    ("huber_scale", Code),
    ("huber_schedule", Code),
    ("huggingface_path_in_repo", NoEffect),
    (
        "huggingface_repo_id",
        Refused("uploads to the Hugging Face Hub are not supported"),
    ),
    ("huggingface_repo_type", NoEffect),
    ("huggingface_repo_visibility", NoEffect),
    ("huggingface_token", NoEffect),
    ("in_json", Code),
    (
        "initial_epoch",
        Refused(
            "starting the schedule at a given epoch is not supported; resume a run folder instead",
        ),
    ),
    (
        "initial_step",
        Refused(
            "starting the schedule at a given step is not supported; resume a run folder instead",
        ),
    ),
    ("ip_noise_gamma", Same),
    ("ip_noise_gamma_random_strength", Same),
    ("keep_tokens", Data),
    ("keep_tokens_separator", Data),
    ("learning_rate", Code),
    ("learning_rate_te", Code),
    ("learning_rate_te1", Code),
    ("learning_rate_te2", Code),
    ("llm_adapter_lr", OtherModel),
    ("llm_adapter_path", OtherModel),
    ("log_config", NoEffect),
    ("log_prefix", NoEffect),
    ("log_tracker_config", NoEffect),
    ("log_tracker_name", NoEffect),
    ("log_with", Same),
    ("logging_dir", To("logdir")),
    ("logit_mean", NoEffect),
    ("logit_std", NoEffect),
    ("loss_type", Code),
    ("lowram", NoEffect),
    ("lowvram", GuiOnly),
    ("lr_decay_steps", Code),
    ("lr_scheduler", Code),
    ("lr_scheduler_args", Code),
    ("lr_scheduler_min_lr_ratio", Code),
    ("lr_scheduler_num_cycles", Code),
    ("lr_scheduler_power", Code),
    ("lr_scheduler_timescale", Code),
    (
        "lr_scheduler_type",
        Refused("a Python scheduler class cannot be loaded"),
    ),
    ("lr_warmup_steps", Code),
    ("masked_loss", Same),
    ("max_bucket_reso", Data),
    ("max_data_loader_n_workers", NoEffect),
    ("max_grad_norm", Code),
    ("max_timestep", Same),
    ("max_token_length", Same),
    ("max_train_epochs", Code),
    ("max_train_steps", Code),
    (
        "max_validation_steps",
        Refused("sdtrain validates on every held-out image"),
    ),
    ("mem_eff_attn", NoEffect),
    ("mem_eff_save", OtherModel),
    ("metadata_author", Same),
    ("metadata_description", Same),
    ("metadata_is_negative_embedding", Same),
    ("metadata_license", Same),
    ("metadata_merged_from", Same),
    ("metadata_preprocessor", Same),
    ("metadata_tags", Same),
    ("metadata_thumbnail", Same),
    ("metadata_title", Same),
    ("metadata_trigger_phrase", Same),
    ("metadata_usage_hint", Same),
    ("min_bucket_reso", Data),
    ("min_snr_gamma", Same),
    ("min_timestep", Same),
    ("mixed_precision", Code),
    ("mlp_lr", OtherModel),
    ("mod_lr", OtherModel),
    ("mode_scale", NoEffect),
    ("model_prediction_type", OtherModel),
    ("model_type", OtherModel),
    ("multires_noise_discount", Same),
    ("multires_noise_iterations", Same),
    ("network_alpha", Code),
    ("network_args", Code),
    ("network_dim", Code),
    ("network_dropout", Adapter("dropout")),
    ("network_module", Code),
    ("network_train_text_encoder_only", Same),
    ("network_train_unet_only", Same),
    ("network_weights", Adapter("init_from")),
    ("no_half_vae", NoEffect),
    ("no_metadata", Adapter("no_metadata")),
    (
        "no_token_padding",
        Refused("captions are always padded to the full context, as diffusers pads them"),
    ),
    ("noise_offset", Same),
    ("noise_offset_random_strength", Same),
    ("noise_offset_type", GuiOnly),
    ("offload_optimizer_device", NoEffect),
    ("offload_optimizer_nvme_path", NoEffect),
    ("offload_param_device", NoEffect),
    ("offload_param_nvme_path", NoEffect),
    ("optimizer_args", Code),
    ("optimizer_type", Code),
    (
        "output_config",
        Refused("sdtrain does not write kohya configs; `--dry-run` prints the resolved plan"),
    ),
    ("output_dir", Same),
    ("output_name", Same),
    ("persistent_data_loader_workers", NoEffect),
    ("pos_emb_random_crop_rate", OtherModel),
    ("pretrained_model_name_or_path", To("model")),
    ("prior_loss_weight", Same),
    ("qwen3", OtherModel),
    ("qwen3_max_token_length", OtherModel),
    ("random_crop", Data),
    ("reg_data_dir", Code),
    ("resize_interpolation", Data),
    ("resolution", Code),
    ("resume", Code),
    (
        "resume_from_huggingface",
        Refused("downloads of a state from the Hub are not supported"),
    ),
    ("sample_at_first", Same),
    ("sample_batch_size", OtherModel),
    ("sample_every_n_epochs", Same),
    ("sample_every_n_steps", Same),
    ("sample_prompts", Same),
    ("sample_sampler", Same),
    ("save_clip", OtherModel),
    ("save_every_n_epochs", Same),
    ("save_every_n_steps", Same),
    ("save_last_n_epochs", Same),
    ("save_last_n_epochs_state", Code),
    ("save_last_n_steps", Same),
    ("save_last_n_steps_state", Code),
    ("save_model_as", Same),
    ("save_n_epoch_ratio", Refused("use save_every_n_epochs")),
    ("save_precision", Code),
    ("save_state", To("save_optimizer")),
    ("save_state_on_train_end", To("save_optimizer")),
    (
        "save_state_to_huggingface",
        Refused("uploads to the Hugging Face Hub are not supported"),
    ),
    ("save_t5xxl", OtherModel),
    ("scale_v_pred_loss_like_noise_pred", Same),
    ("scale_weight_norms", Adapter("scale_weight_norms")),
    ("sdpa", NoEffect),
    ("secondary_separator", Data),
    ("seed", Same),
    ("self_attn_lr", OtherModel),
    ("shuffle_caption", Data),
    ("sigmoid_scale", OtherModel),
    ("single_blocks_to_swap", OtherModel),
    ("skip_cache_check", NoEffect),
    (
        "skip_until_initial_step",
        Refused("skipping steps is not supported; resume a run folder instead"),
    ),
    ("split_attn", OtherModel),
    ("split_mode", OtherModel),
    ("stop_text_encoder_training", Code),
    ("system_prompt", OtherModel),
    ("t5_dropout_rate", OtherModel),
    ("t5_max_token_length", OtherModel),
    ("t5_tokenizer_path", OtherModel),
    ("t5xxl", OtherModel),
    ("t5xxl_device", OtherModel),
    ("t5xxl_dtype", OtherModel),
    ("t5xxl_max_token_length", OtherModel),
    ("text_encoder_batch_size", NoEffect),
    ("text_encoder_lr", Code),
    ("timestep_sampling", OtherModel),
    ("token_warmup_min", Data),
    ("token_warmup_step", Data),
    ("tokenizer_cache_dir", NoEffect),
    ("torch_compile", NoEffect),
    ("train_batch_size", Code),
    ("train_data_dir", Code),
    ("train_text_encoder", Code),
    ("training_comment", Adapter("training_comment")),
    ("training_shift", OtherModel),
    ("unet_lr", Code),
    ("use_8bit_adam", Code),
    ("use_flash_attn", OtherModel),
    ("use_lion_optimizer", Code),
    ("use_safetensors", NoEffect),
    ("use_sage_attn", OtherModel),
    ("v2", Code),
    ("v_parameterization", Code),
    ("v_pred_like_loss", Same),
    ("vae", Same),
    ("vae_batch_size", NoEffect),
    ("vae_chunk_size", OtherModel),
    ("vae_disable_cache", OtherModel),
    ("validate_every_n_epochs", Code),
    ("validate_every_n_steps", To("validation_every_n_steps")),
    ("validation_seed", Data),
    ("validation_split", Data),
    ("wandb_api_key", NoEffect),
    ("wandb_run_name", NoEffect),
    ("weighted_captions", Same),
    ("weighting_scheme", NoEffect),
    ("xformers", NoEffect),
    ("zero3_init_flag", NoEffect),
    ("zero3_save_16bit_model", NoEffect),
    ("zero_stage", NoEffect),
    ("zero_terminal_snr", Same),
];

/// Whether `key` is an option of kohya's training scripts that a kohya config may give.
pub fn is_kohya_option(key: &str) -> bool {
    rule(key).is_some()
}

/// The rule of `key`, if it is one of kohya's options.
pub(super) fn rule(key: &str) -> Option<Rule> {
    KEYS.iter().find(|(k, _)| *k == key).map(|(_, r)| *r)
}

/// kohya's defaults where sdtrain's differ, written into the translated config when the file
/// leaves the option out (the parsers' `default=`; a TOML value replaces it, as argparse's).
pub(super) mod defaults {
    /// `--learning_rate`.
    pub const LEARNING_RATE: f64 = 2e-6;
    /// `--max_train_steps`, when `--max_train_epochs` is not given.
    pub const MAX_TRAIN_STEPS: i64 = 1600;
    /// `--max_grad_norm`.
    pub const MAX_GRAD_NORM: f64 = 1.0;
    /// `--network_alpha`.
    pub const NETWORK_ALPHA: f64 = 1.0;
    /// `networks/lora.py`'s rank when `--network_dim` is not given.
    pub const NETWORK_DIM: i64 = 4;
    /// `--caption_extension`.
    pub const CAPTION_EXTENSION: &str = ".caption";
    /// `--min_bucket_reso`, `--max_bucket_reso`, `--bucket_reso_steps`.
    pub const BUCKETS: [(&str, i64); 3] = [
        ("min_bucket_reso", 256),
        ("max_bucket_reso", 1024),
        ("bucket_reso_steps", 64),
    ];
}

#[cfg(test)]
mod tests {
    /// A key listed twice would shadow its second rule.
    #[test]
    fn each_key_is_listed_once_in_order() {
        for pair in super::KEYS.windows(2) {
            assert!(pair[0].0 < pair[1].0, "{} then {}", pair[0].0, pair[1].0);
        }
    }
}
