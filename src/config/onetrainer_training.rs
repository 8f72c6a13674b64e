//! A OneTrainer config's model, training method, precision, objective and saves
//! (`super::onetrainer_config`), as train.json's keys. The optimizer is
//! `super::onetrainer_optimizer`'s, the data `super::onetrainer_concepts`'.

use serde_json::{json, Map, Value};

use super::error::ConfigError;
use super::onetrainer_config::Translation;

/// The model types sdtrain trains, and whether each predicts v.
const MODEL_TYPES: &[(&str, bool)] = &[
    ("STABLE_DIFFUSION_15", false),
    ("STABLE_DIFFUSION_20", true),
    ("STABLE_DIFFUSION_20_BASE", false),
    ("STABLE_DIFFUSION_21", true),
    ("STABLE_DIFFUSION_21_BASE", false),
    ("STABLE_DIFFUSION_XL_10_BASE", false),
];

/// Whether the model type is SDXL (two text encoders).
pub(super) fn is_sdxl(t: &Translation<'_>) -> bool {
    t.get("model_type").as_str() == Some("STABLE_DIFFUSION_XL_10_BASE")
}

/// The text-encoder parts of the model type.
pub(super) fn text_encoders(t: &Translation<'_>) -> &'static [&'static str] {
    match is_sdxl(t) {
        true => &["text_encoder", "text_encoder_2"],
        false => &["text_encoder"],
    }
}

/// `model_type`, `base_model_name` and the parts' own model files.
pub(super) fn model(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    let ty = t.str("model_type")?.to_string();
    if !MODEL_TYPES.iter().any(|(m, _)| *m == ty) {
        let why = match () {
            _ if ty.contains("INPAINTING") || ty.contains("DEPTH") => {
                "sdtrain trains text-to-image models, not inpainting or depth models"
            }
            _ => "sdtrain trains SD1.x, SD2.x and SDXL",
        };
        return Err(t.invalid("model_type", format!("is \"{ty}\": {why}")));
    }
    let base = t.str("base_model_name")?.to_string();
    let model = local_or_hub(t, "base_model_name", &base)?;
    t.set("model", model, "base_model_name")?;
    let vae = t.str("vae.model_name")?.to_string();
    if !vae.is_empty() {
        let v = local_or_hub(t, "vae.model_name", &vae)?;
        t.set("vae", v, "vae.model_name")?;
    }
    for part in ["unet"].iter().chain(text_encoders(t)) {
        let at = format!("{part}.model_name");
        if !t.str(&at)?.is_empty() {
            return Err(t.invalid(
                &at,
                "names a separate file for one part; sdtrain loads every part but the VAE from \
                 base_model_name"
                    .into(),
            ));
        }
    }
    Ok(())
}

/// A model named by a path that exists (made absolute, as OneTrainer opens it from its working
/// directory) or else a hub id, as written.
fn local_or_hub(t: &Translation<'_>, field: &str, raw: &str) -> Result<Value, ConfigError> {
    let path = t.input_path(field, raw)?;
    Ok(match path.exists() {
        true => json!(path.to_string_lossy()),
        false => json!(raw),
    })
}

/// Whether the run predicts v: the model type's own, or forced by OneTrainer.
pub(super) fn predicts_v(t: &Translation<'_>) -> Result<bool, ConfigError> {
    let ty = t.str("model_type")?;
    let own = MODEL_TYPES.iter().any(|(m, v)| *m == ty && *v);
    let fine_tune = t.str("training_method")? == "FINE_TUNE";
    let forced_v = t.bool("rescale_noise_scheduler_to_zero_terminal_snr")?
        || (fine_tune && t.bool("force_v_prediction")?);
    let forced_eps = fine_tune && t.bool("force_epsilon_prediction")?;
    Ok(forced_v || (own && !forced_eps))
}

/// Everything but the model and the data: the method, precision, objective, length, optimizer
/// and saves. Returns the optimizer.json object and the warmup as a fraction of the run.
pub(super) fn translate(
    t: &mut Translation<'_>,
) -> Result<(Map<String, Value>, Option<f64>), ConfigError> {
    let lrs = super::onetrainer_method::method(t)?;
    precision(t)?;
    objective(t)?;
    length(t)?;
    saves(t)?;
    validation(t)?;
    ema(t)?;
    if t.bool("cloud.enabled")? {
        return Err(t.invalid(
            "cloud.enabled",
            "is true: sdtrain trains on this machine (copy the binary and the data to the \
             cloud machine and run it there)"
                .into(),
        ));
    }
    super::onetrainer_optimizer::optimizer(t, lrs)
}

/// `ema`, `ema_decay` and `ema_update_step_interval`: sdtrain's EMA with OneTrainer's decay
/// warm-up, on the training device (GPU) or the host (CPU).
fn ema(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    let device = match t.choice("ema", &["OFF", "GPU", "CPU"])? {
        "OFF" => return Ok(()),
        "GPU" => "device",
        _ => "cpu",
    };
    let decay = t.f64("ema_decay")?;
    let interval = t.i64("ema_update_step_interval")?;
    t.set("ema_decay_rate", json!(decay), "ema_decay")?;
    t.set(
        "ema_update_interval",
        json!(interval),
        "ema_update_step_interval",
    )?;
    t.set("ema_device", json!(device), "ema")?;
    t.set("ema_decay_warmup", json!(true), "ema")?;
    t.differences_note(
        "the EMA weights are saved beside the trained ones (`-ema` files and folders), where \
         OneTrainer saves them in their place"
            .into(),
    );
    Ok(())
}

/// `train_dtype`, the parts' `weight_dtype`, checkpointing and offloading.
fn precision(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    let amp = match t.choice(
        "train_dtype",
        &["FLOAT_16", "BFLOAT_16", "FLOAT_32", "TFLOAT_32"],
    )? {
        "FLOAT_16" => json!("fp16"),
        "BFLOAT_16" => json!("bf16"),
        _ => json!(false),
    };
    t.set("amp", amp, "train_dtype")?;
    let full = t.str("training_method")? == "FINE_TUNE";
    let dtype_of = |t: &Translation<'_>, part: &str| -> Result<&'static str, ConfigError> {
        let at = format!("{part}.weight_dtype");
        Ok(match t.str(&at)? {
            "FLOAT_32" | "TFLOAT_32" => "f32",
            "BFLOAT_16" => "bf16",
            "FLOAT_16" => "fp16",
            "FLOAT_8" if !full => "fp8",
            other => {
                return Err(t.invalid(
                    &at,
                    format!(
                        "is \"{other}\": sdtrain stores weights in FLOAT_32, BFLOAT_16 or \
                         FLOAT_16{}",
                        if full {
                            ""
                        } else {
                            ", or a frozen base in FLOAT_8"
                        }
                    ),
                ))
            }
        })
    };
    let unet = dtype_of(t, "unet")?;
    if full {
        let trained_te = text_encoders(t)
            .iter()
            .filter(|p| t.bool(&format!("{p}.train")).unwrap_or(false))
            .map(|p| (p, dtype_of(t, p)))
            .collect::<Vec<_>>();
        for (part, dtype) in trained_te {
            if dtype? != unet {
                return Err(t.invalid(
                    &format!("{part}.weight_dtype"),
                    "differs from unet.weight_dtype: sdtrain stores the trained weights in one \
                     dtype (weight_dtype)"
                        .into(),
                ));
            }
        }
        if unet != "f32" {
            t.set("weight_dtype", json!(unet), "unet.weight_dtype")?;
        }
    } else if unet == "fp8" {
        // The text encoders in fp8 too, or (kohya's fp8_base_unet) in the compute dtype.
        let encoders = text_encoders(t);
        let all = encoders.iter().all(|p| matches!(dtype_of(t, p), Ok("fp8")));
        let base = if all { "fp8" } else { "fp8_unet" };
        t.set("base_weight_dtype", json!(base), "unet.weight_dtype")?;
        let some = encoders.iter().any(|p| matches!(dtype_of(t, p), Ok("fp8")));
        if some && !all {
            t.differences_note(
                "the text encoders are held in the compute dtype, not FLOAT_8: sdtrain stores \
                 them in fp8 only all together (text_encoder.weight_dtype)"
                    .into(),
            );
        }
    } else if text_encoders(t)
        .iter()
        .any(|p| matches!(dtype_of(t, p), Ok("fp8")))
    {
        t.differences_note(
            "the text encoders are held in the compute dtype, not FLOAT_8: sdtrain stores a \
             frozen text encoder in fp8 only beside an fp8 UNet (text_encoder.weight_dtype)"
                .into(),
        );
    } else if t.str("train_dtype")? != "FLOAT_32" && unet == "f32" {
        t.differences_note(
            "the frozen weights are held in the compute dtype (train_dtype), not FLOAT_32 \
             (unet.weight_dtype)"
                .into(),
        );
    }
    let checkpointing = t.bool("unet.gradient_checkpointing")?;
    t.set(
        "gradient_checkpointing",
        json!(checkpointing),
        "unet.gradient_checkpointing",
    )?;
    Ok(())
}

/// The loss, its weighting, the noise and the timesteps.
fn objective(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    loss_type(t)?;
    match t.choice(
        "loss_weight_fn",
        &["CONSTANT", "MIN_SNR_GAMMA", "DEBIASED_ESTIMATION", "P2"],
    )? {
        "MIN_SNR_GAMMA" => {
            let g = t.f64("loss_weight_strength")?;
            t.set("min_snr_gamma", json!(g), "loss_weight_fn")?;
        }
        "P2" => {
            let g = t.f64("loss_weight_strength")?;
            t.set("p2_loss_gamma", json!(g), "loss_weight_fn")?;
        }
        "DEBIASED_ESTIMATION" => {
            t.set("debiased_estimation_loss", json!(true), "loss_weight_fn")?;
            // OneTrainer's weight for a v target is 1/√(SNR+1), kohya's 1/(SNR+1).
            let v = json!("onetrainer");
            t.set("debiased_estimation_style", v, "loss_weight_fn")?
        }
        _ => {}
    }
    loss_scaler(t)?;
    // Always written: sdtrain's own default offset (EveryDream2's 0.02) is not OneTrainer's 0.
    let offset = t.f64("offset_noise_weight")?;
    t.set("noise_offset", json!(offset), "offset_noise_weight")?;
    // OneTrainer scales an offset of 0 by ψ to no effect.
    if t.bool("generalized_offset_noise")? && offset > 0.0 {
        let v = json!(true);
        t.set("generalized_offset_noise", v, "generalized_offset_noise")?;
    }
    let perturbation = t.f64("perturbation_noise_weight")?;
    if perturbation > 0.0 {
        let v = json!(perturbation);
        t.set("perturbation_noise_weight", v, "perturbation_noise_weight")?;
    }
    if t.bool("rescale_noise_scheduler_to_zero_terminal_snr")? {
        t.set(
            "zero_terminal_snr",
            json!(true),
            "rescale_noise_scheduler_to_zero_terminal_snr",
        )?;
    }
    prediction(t)?;
    timesteps(t)?;
    if t.bool("masked_training")? {
        t.set("masked_training", json!(true), "masked_training")?;
        let w = t.f64("unmasked_weight")?;
        t.set("unmasked_weight", json!(w), "unmasked_weight")?;
        if t.bool("normalize_masked_area_loss")? {
            let v = json!(true);
            t.set(
                "normalize_masked_area_loss",
                v,
                "normalize_masked_area_loss",
            )?;
        }
        // OneTrainer's prior model is its LoRA method's alone; it ignores the weight elsewhere.
        let prior = t.f64("masked_prior_preservation_weight")?;
        if prior > 0.0 && t.str("training_method")? == "LORA" {
            let v = json!(prior);
            t.set(
                "masked_prior_preservation_weight",
                v,
                "masked_prior_preservation_weight",
            )?;
        }
        // OneTrainer applies `unmasked_probability` to inpainting models only.
    }
    Ok(())
}

/// The strengths of OneTrainer's four losses and its Huber δ, as train.json takes them (a
/// single loss at strength 1 reads as that loss: src/config/loss_mix_plan.rs).
fn loss_type(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    let mut huber = false;
    for key in [
        "mse_strength",
        "mae_strength",
        "huber_strength",
        "log_cosh_strength",
    ] {
        let s = t.f64(key)?;
        huber |= key == "huber_strength" && s != 0.0;
        t.set(key, json!(s), key)?;
    }
    if huber {
        let d = t.f64("huber_delta")?;
        t.set("huber_delta", json!(d), "huber_delta")?;
    }
    Ok(())
}

/// OneTrainer's `loss_scaler`; its `GLOBAL_` forms are the plain ones on one card (OneTrainer's
/// `multi_gpu` is refused), and sdtrain's `batch_size` counts every rank's samples.
fn loss_scaler(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    let ours = match t.choice(
        "loss_scaler",
        &[
            "NONE",
            "BATCH",
            "GLOBAL_BATCH",
            "GRADIENT_ACCUMULATION",
            "BOTH",
            "GLOBAL_BOTH",
        ],
    )? {
        "BATCH" | "GLOBAL_BATCH" => "batch",
        "GRADIENT_ACCUMULATION" => "gradient_accumulation",
        "BOTH" | "GLOBAL_BOTH" => "both",
        _ => return Ok(()),
    };
    t.set("loss_scaler", json!(ours), "loss_scaler")
}

/// `force_v_prediction`, `force_epsilon_prediction` (OneTrainer's fine-tunes only) and the
/// v-prediction that the zero-terminal-SNR rescale forces.
fn prediction(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    let ty = t.str("model_type")?;
    let own_v = MODEL_TYPES.iter().any(|(m, v)| *m == ty && *v);
    let v = predicts_v(t)?;
    if v != own_v {
        let from = match v {
            true if t.bool("rescale_noise_scheduler_to_zero_terminal_snr")? => {
                "rescale_noise_scheduler_to_zero_terminal_snr"
            }
            true => "force_v_prediction",
            false => "force_epsilon_prediction",
        };
        let p = if v { "v_prediction" } else { "epsilon" };
        t.set("prediction_type", json!(p), from)?;
    } else if t.str("training_method")? != "FINE_TUNE"
        && (t.bool("force_v_prediction")? || t.bool("force_epsilon_prediction")?)
    {
        t.remark(
            "force_v_prediction and force_epsilon_prediction are left alone, as OneTrainer \
             leaves them outside fine-tunes"
                .into(),
        );
    }
    Ok(())
}

/// The noising strengths as a timestep range, and the timestep distribution.
fn timesteps(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    // OneTrainer: `int(N · strength)` with N = 1000 for every SD model.
    let start = (1000.0 * t.f64("min_noising_strength")?).trunc() as i64;
    let end = (1000.0 * t.f64("max_noising_strength")?).trunc() as i64;
    if start != 0 {
        t.set("timestep_start", json!(start), "min_noising_strength")?;
    }
    if end != 1000 {
        t.set("timestep_end", json!(end), "max_noising_strength")?;
    }
    let weight = t.f64("noising_weight")?;
    let bias = t.f64("noising_bias")?;
    let shift = t.opt_f64("timestep_shift")?.unwrap_or(1.0);
    let mut kind = t.str("timestep_distribution")?.to_string();
    if kind == "SIGMOID" && weight == 0.0 && shift == 1.0 {
        // Every weight 0.5: uniform (the default of OneTrainer's configs before version 3).
        kind = "UNIFORM".to_string();
    }
    // Each distribution with the keys OneTrainer reads for it (src/config/timestep_plan.rs).
    let (name, weight, bias) = match kind.as_str() {
        "UNIFORM" => (None, None, None),
        "COS_MAP" => (Some("cos_map"), None, None),
        "HEAVY_TAIL" => (Some("heavy_tail"), Some(weight), None),
        "LOGIT_NORMAL" => (Some("logit_normal"), Some(weight), Some(bias)),
        "SIGMOID" => (Some("sigmoid"), Some(weight), Some(bias)),
        "INVERTED_PARABOLA" => (Some("inverted_parabola"), Some(weight), Some(bias)),
        // OneTrainer raises both parameters to at least 1e-4.
        "BETA" => (Some("beta"), Some(weight.max(1e-4)), Some(bias.max(1e-4))),
        other => {
            return Err(t.invalid(
                "timestep_distribution",
                format!(
                    "is \"{other}\": OneTrainer's distributions are UNIFORM, LOGIT_NORMAL, \
                     HEAVY_TAIL, BETA, COS_MAP, SIGMOID and INVERTED_PARABOLA"
                ),
            ))
        }
    };
    if let Some(name) = name {
        t.set(
            "timestep_distribution",
            json!(name),
            "timestep_distribution",
        )?;
    }
    if let Some(w) = weight {
        t.set("noising_weight", json!(w), "noising_weight")?;
    }
    if let Some(b) = bias {
        t.set("noising_bias", json!(b), "noising_bias")?;
    }
    if shift != 1.0 {
        t.set("timestep_shift", json!(shift), "timestep_shift")?;
    }
    Ok(())
}

/// `epochs`, `batch_size`, `gradient_accumulation_steps` and `clip_grad_norm`.
fn length(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    for (key, ours) in [
        ("epochs", "max_epochs"),
        ("batch_size", "batch_size"),
        ("gradient_accumulation_steps", "grad_accum"),
    ] {
        let v = t.i64(key)?;
        t.set(ours, json!(v), key)?;
    }
    // OneTrainer clips the norm of every trained parameter together: kohya's max_grad_norm.
    if let Some(n) = t.opt_f64("clip_grad_norm")? {
        t.set("max_grad_norm", json!(n), "clip_grad_norm")?;
    }
    Ok(())
}

/// OneTrainer's `TimeUnit` interval as sdtrain's: whole epochs, optimizer steps (OneTrainer
/// counts micro-batches), or minutes.
pub(super) enum Every {
    Never,
    Epochs(i64),
    Steps(i64),
    Minutes(f64),
}

pub(super) fn every(
    t: &Translation<'_>,
    n_key: &str,
    unit_key: &str,
) -> Result<Every, ConfigError> {
    let n = t.f64(n_key)?;
    let unit = t.choice(
        unit_key,
        &[
            "EPOCH", "STEP", "SECOND", "MINUTE", "HOUR", "NEVER", "ALWAYS",
        ],
    )?;
    let accumulation = t.i64("gradient_accumulation_steps")?.max(1) as f64;
    Ok(match unit {
        _ if n <= 0.0 && unit != "ALWAYS" => Every::Never,
        "NEVER" => Every::Never,
        "EPOCH" => Every::Epochs(n as i64),
        "STEP" => Every::Steps(((n / accumulation).trunc() as i64).max(1)),
        "ALWAYS" => Every::Steps(1),
        "SECOND" => Every::Minutes(n / 60.0),
        "MINUTE" => Every::Minutes(n),
        _ => Every::Minutes(n * 60.0),
    })
}

/// `output_model_destination`, `output_model_format`, `output_dtype`, `workspace_dir` and the
/// periodic saves.
fn saves(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    let dest = t.str("output_model_destination")?.to_string();
    let dest_path = t.input_path("output_model_destination", &dest)?;
    // OneTrainer writes into an existing folder as `<folder>/<timestamp>.safetensors`.
    let into_folder = dest_path.is_dir();
    let stem = dest_path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .filter(|s| !s.is_empty() && !into_folder)
        .unwrap_or_else(|| "model".into());
    t.set("project_name", json!(stem), "output_model_destination")?;
    let folder = match into_folder {
        true => Some(dest_path.as_path()),
        false => dest_path.parent(),
    };
    if let Some(dir) = folder {
        t.set(
            "save_ckpt_dir",
            json!(dir.to_string_lossy()),
            "output_model_destination",
        )?;
    }
    let workspace = t.str("workspace_dir")?.to_string();
    let workspace = t.input_path("workspace_dir", &workspace)?;
    t.set(
        "output_dir",
        json!(workspace.to_string_lossy()),
        "workspace_dir",
    )?;
    super::onetrainer_method::output_format(t)?;
    match every(t, "save_every", "save_every_unit")? {
        Every::Never => {}
        Every::Epochs(n) => t.set("save_every_n_epochs", json!(n), "save_every")?,
        Every::Steps(n) => t.set("save_every_n_steps", json!(n), "save_every")?,
        Every::Minutes(m) => t.set("ckpt_every_n_minutes", json!(m), "save_every")?,
    }
    let skip = t.i64("save_skip_first")?;
    if skip != 0 {
        match t.str("save_every_unit")? {
            "EPOCH" => t.set("save_ckpts_from_n_epochs", json!(skip), "save_skip_first")?,
            unit => {
                return Err(t.invalid(
                    "save_skip_first",
                    format!(
                        "is {skip} with save_every_unit \"{unit}\": sdtrain delays epoch saves \
                         only (save_ckpts_from_n_epochs)"
                    ),
                ))
            }
        }
    }
    Ok(())
}

/// `validation`, `validate_after` and its unit: how often the validation concepts'
/// (`super::onetrainer_concepts`) loss is measured.
fn validation(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    if !t.bool("validation")? {
        return Ok(());
    }
    match every(t, "validate_after", "validate_after_unit")? {
        Every::Epochs(1) => {}
        Every::Steps(n) => t.set("validation_every_n_steps", json!(n), "validate_after")?,
        _ => {
            return Err(t.invalid(
                "validate_after",
                "sdtrain validates at the end of every epoch (validate_after 1 EPOCH) or every \
                 N steps (unit STEP)"
                    .into(),
            ))
        }
    }
    Ok(())
}
