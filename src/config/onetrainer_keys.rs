//! What each key of a OneTrainer config (`super::onetrainer_config`) becomes: every key of
//! OneTrainer's `TrainConfig` (version 11) has a [`Rule`], so none is passed over unseen
//! (tests/onetrainer_config_cli.rs checks the table against OneTrainer's own defaults).

/// How one key is read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Rule {
    /// Translated by code in `onetrainer_training` or `onetrainer_concepts`.
    Code,
    /// A setting of another model type (Stable Cascade, FLUX, video, …), or of OneTrainer's
    /// UI and machine, which an SD1.x/SD2.x/SDXL run of OneTrainer does not read either.
    OtherModel,
    /// Changes only speed, memory layout, logging or OneTrainer's own files; listed in a note
    /// when it is away from OneTrainer's default.
    NoEffect,
    /// Not supported: an error with the reason, unless it holds OneTrainer's default.
    Refused(&'static str),
}

use Rule::*;

/// Every key of OneTrainer's `TrainConfig`, by name.
pub(super) const KEYS: &[(&str, Rule)] = &[
    ("__version", Code),
    ("training_method", Code),
    ("model_type", Code),
    ("debug_mode", NoEffect),
    ("debug_dir", NoEffect),
    ("workspace_dir", Code),
    ("cache_dir", NoEffect),
    ("huggingface_cache_dir", Refused("sdtrain reads the standard Hugging Face cache ($HF_HOME, $HF_HUB_CACHE); set those instead")),
    ("offline_mode", NoEffect),
    ("tensorboard", NoEffect),
    ("tensorboard_expose", NoEffect),
    ("tensorboard_always_on", NoEffect),
    ("tensorboard_port", NoEffect),
    ("validation", Code),
    ("validate_after", Code),
    ("validate_after_unit", Code),
    ("continue_last_backup", Refused("sdtrain resumes from its own save points: give the run folder as resume_ckpt (--set resume_ckpt=<run folder>)")),
    ("prevent_overwrites", NoEffect),
    ("include_train_config", NoEffect),
    ("multi_gpu", Refused("train on several cards with sdtrain's own --devices 0,1 (docs/MULTI_GPU.md)")),
    ("device_indexes", OtherModel),
    ("gradient_reduce_precision", OtherModel),
    ("fused_gradient_reduce", OtherModel),
    ("async_gradient_reduce", OtherModel),
    ("async_gradient_reduce_buffer", OtherModel),
    ("base_model_name", Code),
    ("output_dtype", Code),
    ("output_model_format", Code),
    ("output_model_destination", Code),
    ("async_offloading", NoEffect),
    ("force_circular_padding", Refused("sdtrain's convolutions pad with zeros")),
    ("compile", NoEffect),
    ("concept_file_name", Code),
    ("concepts", Code),
    ("aspect_ratio_bucketing", Code),
    ("latent_caching", Code),
    ("clear_cache_before_training", NoEffect),
    ("learning_rate_scheduler", Code),
    ("custom_learning_rate_scheduler", Refused("a custom scheduler is Python code, which sdtrain does not run")),
    ("scheduler_params", Refused("a custom scheduler is Python code, which sdtrain does not run")),
    ("learning_rate", Code),
    ("learning_rate_warmup_steps", Code),
    ("learning_rate_cycles", Code),
    ("learning_rate_min_factor", Code),
    ("epochs", Code),
    ("batch_size", Code),
    ("gradient_accumulation_steps", Code),
    ("ema", Code),
    ("ema_decay", Code),
    ("ema_update_step_interval", Code),
    ("dataloader_threads", NoEffect),
    ("train_device", OtherModel),
    ("temp_device", NoEffect),
    ("train_dtype", Code),
    ("fallback_train_dtype", NoEffect),
    ("enable_autocast_cache", NoEffect),
    ("only_cache", Refused("sdtrain caches as part of a run; there is no cache-only run")),
    ("resolution", Code),
    ("frames", OtherModel),
    ("attention_mechanism", NoEffect),
    ("mse_strength", Code),
    ("mae_strength", Code),
    ("log_cosh_strength", Code),
    ("huber_strength", Code),
    ("huber_delta", Code),
    ("vb_loss_strength", OtherModel),
    ("loss_weight_fn", Code),
    ("loss_weight_strength", Code),
    ("dropout_probability", Code),
    ("loss_scaler", Code),
    ("learning_rate_scaler", Code),
    ("clip_grad_norm", Code),
    ("offset_noise_weight", Code),
    ("generalized_offset_noise", Code),
    ("perturbation_noise_weight", Code),
    ("rescale_noise_scheduler_to_zero_terminal_snr", Code),
    ("force_v_prediction", Code),
    ("force_epsilon_prediction", Code),
    ("min_noising_strength", Code),
    ("max_noising_strength", Code),
    ("timestep_distribution", Code),
    ("noising_weight", Code),
    ("noising_bias", Code),
    ("timestep_shift", Code),
    ("dynamic_timestep_shifting", OtherModel),
    ("unet", Code),
    ("prior", OtherModel),
    ("transformer", OtherModel),
    ("unconditional_transformer", OtherModel),
    ("quantization", OtherModel),
    ("text_encoder", Code),
    ("text_encoder_layer_skip", Code),
    ("text_encoder_sequence_length", OtherModel),
    ("text_encoder_2", Code),
    ("text_encoder_2_layer_skip", Code),
    ("text_encoder_2_sequence_length", OtherModel),
    ("text_encoder_3", OtherModel),
    ("text_encoder_3_layer_skip", OtherModel),
    ("text_encoder_4", OtherModel),
    ("text_encoder_4_layer_skip", OtherModel),
    ("vae", Code),
    ("effnet_encoder", OtherModel),
    ("decoder", OtherModel),
    ("decoder_text_encoder", OtherModel),
    ("decoder_vqgan", OtherModel),
    ("masked_training", Code),
    ("unmasked_probability", Code),
    ("unmasked_weight", Code),
    ("normalize_masked_area_loss", Code),
    ("masked_prior_preservation_weight", Code),
    ("custom_conditioning_image", Refused("conditioning images are for inpainting models, which sdtrain does not train")),
    ("layer_filter", Code),
    ("layer_filter_preset", OtherModel),
    ("layer_filter_regex", Code),
    ("embedding_learning_rate", Code),
    ("preserve_embedding_norm", Code),
    ("embedding", Code),
    ("additional_embeddings", Refused("sdtrain trains one embedding per run (pivotal tuning trains one beside a LoRA)")),
    ("embedding_weight_dtype", Code),
    ("cloud", Code),
    ("peft_type", Code),
    ("lora_model_name", Code),
    ("lora_rank", Code),
    ("lora_alpha", Code),
    ("lora_decompose", Code),
    ("lora_decompose_norm_epsilon", Code),
    ("lora_decompose_output_axis", Code),
    ("lora_weight_dtype", Code),
    ("bundle_additional_embeddings", OtherModel),
    ("oft_block_size", OtherModel),
    ("oft_block_share", OtherModel),
    ("oft_scaled", OtherModel),
    ("lokr_dim", Code),
    ("lokr_decompose_both", Code),
    ("lokr_decompose_factor", Code),
    ("lokr_use_tucker", Code),
    ("lokr_weight_decompose", Code),
    ("lokr_dora_on_output", OtherModel),
    ("lokr_full_matrix", Code),
    ("lokr_vec_trick", NoEffect),
    ("optimizer", Code),
    ("optimizer_defaults", OtherModel),
    ("sample_definition_file_name", Code),
    ("samples", Code),
    ("sample_after", Code),
    ("sample_after_unit", Code),
    ("sample_skip_first", Code),
    ("sample_image_format", NoEffect),
    ("sample_video_format", OtherModel),
    ("sample_audio_format", OtherModel),
    ("samples_to_tensorboard", NoEffect),
    ("non_ema_sampling", Code),
    ("backup_after", NoEffect),
    ("backup_after_unit", NoEffect),
    ("rolling_backup", NoEffect),
    ("rolling_backup_count", NoEffect),
    ("backup_before_save", NoEffect),
    ("save_every", Code),
    ("save_every_unit", Code),
    ("save_skip_first", Code),
    ("save_filename_prefix", NoEffect),
];

/// The rule of `key`; a key the table does not hold is read by code.
pub(super) fn rule(key: &str) -> Rule {
    KEYS.iter()
        .find(|(k, _)| *k == key)
        .map_or(Code, |(_, r)| *r)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every key of OneTrainer's config (its defaults, written by its own code) has a rule, and
    /// the table names no key OneTrainer does not have.
    #[test]
    fn every_onetrainer_key_has_a_rule() {
        let defaults = super::super::onetrainer_config::defaults();
        let train = defaults["train"].as_object().unwrap();
        assert!(train.len() > 150, "{}", train.len());
        for key in train.keys() {
            assert!(KEYS.iter().any(|(k, _)| k == key), "no rule for `{key}`");
        }
        for (key, _) in KEYS {
            assert!(train.contains_key(*key), "`{key}` is not OneTrainer's");
        }
    }
}
