//! A OneTrainer config's training method (`super::onetrainer_config`): a fine-tune, a LoRA (or
//! LoHa, LoKr, DoRA) or an embedding, which parts train, for how long and at which learning
//! rate, and how the result is saved.

use serde_json::{json, Value};

use super::error::ConfigError;
use super::onetrainer_config::Translation;
use super::onetrainer_training::text_encoders;

/// `training_method` and the parts: returns the UNet's (or the embedding's) learning rate and
/// the text encoders', after `learning_rate_scaler`.
pub(super) fn method(t: &mut Translation<'_>) -> Result<(f64, f64), ConfigError> {
    let method = t.choice("training_method", &["FINE_TUNE", "LORA", "EMBEDDING"])?;
    let method = method.to_string();
    let scale = lr_scale(t)?;
    let lr = t.f64("learning_rate")?;
    let part_lr = |t: &Translation<'_>, part: &str| -> Result<f64, ConfigError> {
        Ok(t.opt_f64(&format!("{part}.learning_rate"))?.unwrap_or(lr) * scale)
    };
    text_conditioning(t)?;
    if method == "EMBEDDING" {
        embedding(t)?;
        let e = t.opt_f64("embedding_learning_rate")?.unwrap_or(lr) * scale;
        return Ok((e, e));
    }
    t.refuse_unless_default(
        "embedding_learning_rate",
        "trains the vectors of an embedding, which only an EMBEDDING run has here",
    )?;
    if method == "LORA" {
        adapter(t)?;
    } else {
        if !t.str("layer_filter")?.trim().is_empty() {
            return Err(t.invalid(
                "layer_filter",
                format!(
                    "is \"{}\" in a fine-tune, which trains only the layers it names; sdtrain's \
                     fine-tune trains every UNet weight (set layer_filter to \"\")",
                    t.str("layer_filter")?
                ),
            ));
        }
        t.set("mode", json!("full"), "training_method")?;
    }
    let unet = t.bool("unet.train")?;
    t.refuse_unless_default(
        "unet.stop_training_after_unit",
        "sdtrain trains the UNet for the whole run",
    )?;
    if !unet {
        t.set("disable_unet_training", json!(true), "unet.train")?;
    }
    let te = text_encoder_training(t)?;
    let te_lr = match text_encoders(t) {
        [one] => part_lr(t, one)?,
        [one, two, ..] => {
            let (a, b) = (part_lr(t, one)?, part_lr(t, two)?);
            if te && a != b {
                return Err(t.invalid(
                    "text_encoder_2.learning_rate",
                    format!(
                        "is {b} and text_encoder's {a}: sdtrain trains both text encoders at one \
                         rate"
                    ),
                ));
            }
            a
        }
        [] => lr,
    };
    Ok((part_lr(t, "unet")?, te_lr))
}

/// `learning_rate_scaler`: OneTrainer multiplies every rate by the square root of the batch,
/// the accumulation or both.
fn lr_scale(t: &Translation<'_>) -> Result<f64, ConfigError> {
    let bs = t.i64("batch_size")?.max(1) as f64;
    let ga = t.i64("gradient_accumulation_steps")?.max(1) as f64;
    let s = match t.choice(
        "learning_rate_scaler",
        &[
            "NONE",
            "BATCH",
            "GLOBAL_BATCH",
            "GRADIENT_ACCUMULATION",
            "BOTH",
            "GLOBAL_BOTH",
        ],
    )? {
        "NONE" => 1.0,
        "BATCH" | "GLOBAL_BATCH" => bs,
        "GRADIENT_ACCUMULATION" => ga,
        _ => bs * ga,
    };
    Ok(s.sqrt())
}

/// Clip skip and caption dropout, which sdtrain sets for both SDXL text encoders at once.
fn text_conditioning(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    let parts = text_encoders(t);
    same_for_both(t, parts, "dropout_probability")?;
    if parts.len() == 2 && t.get("text_encoder_layer_skip") != t.get("text_encoder_2_layer_skip") {
        return Err(t.invalid(
            "text_encoder_2_layer_skip",
            "differs from text_encoder_layer_skip: sdtrain skips the same layers in both text \
             encoders (clip_skip)"
                .into(),
        ));
    }
    let skip = t.i64("text_encoder_layer_skip")?;
    if skip > 0 {
        // OneTrainer counts the layers skipped; A1111's and sdtrain's clip_skip counts from 1.
        t.set(
            "clip_skip",
            json!(skip.saturating_add(1)),
            "text_encoder_layer_skip",
        )?;
    }
    let dropout = t.f64("text_encoder.dropout_probability")?;
    t.set(
        "cond_dropout",
        json!(dropout),
        "text_encoder.dropout_probability",
    )?;
    if dropout > 0.0 {
        t.differences_note(
            "a dropped caption trains on the empty prompt's encoding (EveryDream2's and kohya's \
             caption dropout), not on zeroed text-encoder outputs"
                .into(),
        );
    }
    Ok(())
}

/// Whether the text encoders train, and for how long (`train`, `stop_training_after` and its
/// unit).
fn text_encoder_training(t: &mut Translation<'_>) -> Result<bool, ConfigError> {
    let parts = text_encoders(t);
    for key in ["train", "stop_training_after", "stop_training_after_unit"] {
        same_for_both(t, parts, key)?;
    }
    let mut train = t.bool("text_encoder.train")?;
    let n = t.opt_f64("text_encoder.stop_training_after")?;
    let epochs = t.i64("epochs")?;
    match (t.str("text_encoder.stop_training_after_unit")?, n) {
        ("NEVER", _) => {}
        ("ALWAYS", _) => train = false,
        ("EPOCH" | "STEP", Some(n)) if n < 1.0 => train = false,
        ("EPOCH", Some(n)) if n as i64 >= epochs => {}
        ("EPOCH", Some(n)) if train => t.set(
            "stop_text_encoder_training_epochs",
            json!(n as i64),
            "text_encoder.stop_training_after",
        )?,
        ("STEP", Some(n)) if train => {
            // Checked after each update against the micro-batch count: the text encoders
            // take floor(n / accumulation) + 1 updates.
            let ga = t.i64("gradient_accumulation_steps")?.max(1);
            t.set(
                "stop_text_encoder_training",
                json!((n as i64 / ga).saturating_add(1)),
                "text_encoder.stop_training_after",
            )?;
        }
        (unit @ ("SECOND" | "MINUTE" | "HOUR"), _) if train => {
            return Err(t.invalid(
                "text_encoder.stop_training_after_unit",
                format!(
                    "is \"{unit}\": sdtrain stops the text encoders after a number of epochs or \
                     steps"
                ),
            ))
        }
        _ => {}
    }
    if !train {
        t.set(
            "disable_textenc_training",
            json!(true),
            "text_encoder.train",
        )?;
    }
    Ok(train)
}

/// SDXL: sdtrain sets the two text encoders together, so their settings must agree.
fn same_for_both(t: &Translation<'_>, parts: &[&str], key: &str) -> Result<(), ConfigError> {
    if let [one, two] = parts {
        let (a, b) = (
            t.get(&format!("{one}.{key}")),
            t.get(&format!("{two}.{key}")),
        );
        if !super::onetrainer_config::same(a, b) {
            return Err(t.invalid(
                &format!("{two}.{key}"),
                format!(
                    "is {b} and {one}.{key} is {a}: sdtrain sets both SDXL text encoders alike"
                ),
            ));
        }
    }
    Ok(())
}

/// `peft_type`, the rank and alpha, the layer filter and the starting file.
fn adapter(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    let peft = t
        .choice("peft_type", &["LORA", "LOHA", "LOKR"])?
        .to_string();
    let filter = t.str("layer_filter")?.trim().to_string();
    let regex = t.bool("layer_filter_regex")?;
    let dora = adapter_refusals(t, &peft, &filter)?;
    // Every pattern empty is OneTrainer's "full" preset; "attentions" alone ("attn-mlp") is
    // kohya's plain LoRA; any other filter narrows the LoCon targets (sdtrain's layer_filter).
    let every = filter.split(',').all(|p| p.trim().is_empty());
    let mode = match (peft.as_str(), dora) {
        ("LORA", false) if filter == "attentions" && !regex => "lora",
        ("LORA", false) => "locon",
        ("LORA", true) => "dora",
        ("LOHA", _) => "loha",
        _ => "lokr",
    };
    if !every && mode != "lora" {
        t.adapter.insert("layer_filter".into(), json!(filter));
        if regex {
            t.adapter.insert("layer_filter_regex".into(), json!(true));
        }
    }
    if mode != "lora" {
        t.differences_note(format!(
            "the {mode} adapters leave out conv_in, conv_out and the time embedding's linear \
             layers{} (sdtrain's {mode} covers the transformer blocks and resnets, as kohya's \
             and LyCORIS's)",
            if every {
                ""
            } else {
                " even where layer_filter matches them"
            }
        ));
    }
    t.set("mode", json!(mode), "peft_type")?;
    let rank = match peft.as_str() {
        "LOKR" => t.i64("lokr_dim")?,
        _ => t.i64("lora_rank")?,
    };
    let alpha = t.f64("lora_alpha")?;
    t.adapter.insert("rank".into(), json!(rank));
    t.adapter.insert("alpha".into(), json!(alpha));
    if mode != "lora" {
        t.adapter.insert("conv_rank".into(), json!(rank));
        t.adapter.insert("conv_alpha".into(), json!(alpha));
    }
    if peft == "LOKR" {
        let f = t.i64("lokr_decompose_factor")?;
        t.adapter.insert("factor".into(), json!(f));
    } else {
        t.refuse_unless_default("lokr_dim", "is LoKr's; this run's peft_type is not LOKR")?;
    }
    let dropout = t.f64("dropout_probability")?;
    if dropout != 0.0 {
        t.adapter.insert("dropout".into(), json!(dropout));
    }
    let init = t.str("lora_model_name")?.to_string();
    if !init.is_empty() {
        let p = t.input_path("lora_model_name", &init)?;
        t.adapter
            .insert("init_from".into(), json!(p.to_string_lossy()));
    }
    Ok(())
}

/// What a LoRA's settings ask that sdtrain cannot do, refused; whether it is DoRA
/// (`lora_decompose`).
fn adapter_refusals(t: &Translation<'_>, peft: &str, filter: &str) -> Result<bool, ConfigError> {
    t.refuse_unless_default("lora_weight_dtype", "sdtrain's adapter weights are f32")?;
    preset_label(t, filter)?;
    let dora = t.bool("lora_decompose")?;
    if dora {
        t.refuse_unless_default(
            "lora_decompose_output_axis",
            "sdtrain's DoRA normalizes per input channel, the form A1111 and ComfyUI load",
        )?;
    }
    if peft == "LOKR" {
        for (key, why) in [
            (
                "lokr_decompose_both",
                "sdtrain's LoKr decomposes the second factor only",
            ),
            ("lokr_use_tucker", "Tucker decomposition is not implemented"),
            ("lokr_weight_decompose", "LoKr with DoRA is not implemented"),
            (
                "lokr_full_matrix",
                "sdtrain's LoKr decomposes the second factor",
            ),
        ] {
            t.refuse_unless_default(key, why)?;
        }
    }
    Ok(dora)
}

/// OneTrainer's `layer_filter_preset` is its UI's label: picking a preset writes its patterns
/// into `layer_filter`, which alone its training reads. A label that disagrees with the filter
/// (a built-in preset's "attn-mlp" beside an empty filter) is said, since the run follows the
/// filter as OneTrainer's does.
fn preset_label(t: &Translation<'_>, filter: &str) -> Result<(), ConfigError> {
    let label = t.str("layer_filter_preset")?;
    let expected = match label {
        "full" => "",
        "attn-mlp" => "attentions",
        "attn-only" => "attn",
        _ => return Ok(()),
    };
    if filter != expected {
        t.remark(format!(
            "layer_filter_preset \"{label}\" is OneTrainer's UI label, and its \
             training, like sdtrain's, adapts the layers layer_filter names (\"{filter}\"{}); \
             set layer_filter to \"{expected}\" for what the label says",
            if filter.is_empty() {
                ": every layer"
            } else {
                ""
            }
        ));
    }
    Ok(())
}

/// The `embedding` object: the placeholder, its vector count and how they start.
fn embedding(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    t.set("mode", json!("textual_inversion"), "training_method")?;
    if !t.bool("embedding.train")? {
        return Err(t.invalid(
            "embedding.train",
            "is false in an EMBEDDING run: nothing would train".into(),
        ));
    }
    t.refuse_unless_default(
        "embedding.is_output_embedding",
        "output embeddings are not implemented",
    )?;
    t.refuse_unless_default(
        "preserve_embedding_norm",
        "sdtrain does not rescale trained embedding vectors",
    )?;
    t.refuse_unless_default(
        "embedding_weight_dtype",
        "sdtrain's embedding vectors are f32",
    )?;
    t.refuse_unless_default(
        "embedding.stop_training_after_unit",
        "sdtrain trains the embedding for the whole run",
    )?;
    for part in text_encoders(t) {
        t.refuse_unless_default(
            &format!("{part}.train_embedding"),
            "sdtrain trains the vectors of every text encoder",
        )?;
    }
    let token = t.str("embedding.placeholder")?.to_string();
    let count = t.opt_f64("embedding.token_count")?.unwrap_or(1.0) as i64;
    t.embedding.insert("token_string".into(), json!(token));
    t.embedding
        .insert("num_vectors_per_token".into(), json!(count));
    let file = t.str("embedding.model_name")?.to_string();
    if file.is_empty() {
        let init = t.str("embedding.initial_embedding_text")?.to_string();
        t.embedding.insert("init_word".into(), json!(init));
        if count > 1 {
            t.differences_note(
                "an initial_embedding_text of fewer tokens than token_count is repeated to fill \
                 the vectors (kohya's rule), not padded with `*`"
                    .into(),
            );
        }
    } else {
        let p = t.input_path("embedding.model_name", &file)?;
        t.embedding
            .insert("init_from".into(), json!(p.to_string_lossy()));
    }
    Ok(())
}

/// `output_model_format` and `output_dtype`.
pub(super) fn output_format(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    let method = t.str("training_method")?.to_string();
    let format = t.str("output_model_format")?.to_string();
    let dtype = t
        .choice("output_dtype", &["FLOAT_32", "FLOAT_16", "BFLOAT_16"])?
        .to_string();
    let ours = match dtype.as_str() {
        "FLOAT_32" => "fp32",
        "FLOAT_16" => "fp16",
        _ => "bf16",
    };
    match method.as_str() {
        "LORA" => {
            t.adapter.insert("save_dtype".into(), json!(ours));
            // For SD1/SD2 OneTrainer's LEGACY_LORA is KOHYA_LORA's bytes; for SDXL it keeps
            // diffusers' UNet names.
            let kohya = format == "KOHYA_LORA" || (format == "LEGACY_LORA" && !is_sdxl_t(t));
            if !kohya {
                t.differences_note(format!(
                    "the LoRA is saved in kohya's format (what OneTrainer's KOHYA_LORA writes, \
                     which A1111, ComfyUI and diffusers load), not {format}"
                ));
            }
        }
        "EMBEDDING" => {
            t.embedding.insert("save_dtype".into(), json!(ours));
            t.differences_note(
                "the embedding file holds its vectors as `emb_params` (SDXL `clip_l`, `clip_g`), \
                 A1111's and kohya's key, where OneTrainer writes `emp_params`"
                    .into(),
            );
        }
        _ => full_format(t, &format, &dtype)?,
    }
    Ok(())
}

fn is_sdxl_t(t: &Translation<'_>) -> bool {
    super::onetrainer_training::is_sdxl(t)
}

/// A fine-tune's files: a diffusers folder or an original single file, in f32 or f16.
fn full_format(t: &mut Translation<'_>, format: &str, dtype: &str) -> Result<(), ConfigError> {
    let single = match format {
        "DIFFUSERS" => false,
        "ORIGINAL_SINGLE_FILE" | "LEGACY_SAFETENSORS" => true,
        other => {
            return Err(t.invalid(
                "output_model_format",
                format!(
                    "is \"{other}\" for a fine-tune: sdtrain saves DIFFUSERS or \
                     ORIGINAL_SINGLE_FILE (LEGACY_SAFETENSORS)"
                ),
            ))
        }
    };
    let v: Value = json!(if single { "safetensors" } else { "diffusers" });
    t.set("save_ckpt_format", v, "output_model_format")?;
    if !single {
        t.remark(
            "the DIFFUSERS model is saved in the run folder (`final/` under workspace_dir's run), \
             not at output_model_destination"
                .into(),
        );
    }
    match (single, dtype) {
        (true, "BFLOAT_16") => {
            return Err(t.invalid(
                "output_dtype",
                "is \"BFLOAT_16\": sdtrain writes single files in FLOAT_32 or FLOAT_16".into(),
            ))
        }
        (true, d) => t.set(
            "save_full_precision",
            json!(d == "FLOAT_32"),
            "output_dtype",
        )?,
        (false, "FLOAT_32") => {}
        (false, _) => t.differences_note(
            "the diffusers folder is saved in FLOAT_32 (output_dtype applies to single files)"
                .into(),
        ),
    }
    Ok(())
}
