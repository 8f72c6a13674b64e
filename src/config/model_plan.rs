//! The keys about the model file itself: how a single-file `model` is read (`model_config`,
//! `prediction_type`), which weight `variant` of a pipeline is read, and in which format a full fine-tune is saved (`save_ckpt_format`,
//! EveryDream2's `no_save_ckpt`).

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::error::ConfigError;
use super::train_file::TrainFile;
use super::TrainMode;
use crate::model::family::PredictionType;

/// The formats a full fine-tune is saved in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SaveFormat {
    /// A diffusers folder (`final/`).
    Diffusers,
    /// A single LDM-layout file (`final.safetensors`) that A1111 and ComfyUI load.
    Safetensors,
    /// Both, side by side (EveryDream2's default).
    Both,
}

impl SaveFormat {
    pub fn diffusers(self) -> bool {
        matches!(self, SaveFormat::Diffusers | SaveFormat::Both)
    }

    pub fn single_file(self) -> bool {
        matches!(self, SaveFormat::Safetensors | SaveFormat::Both)
    }
}

/// The resolved model keys.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelFilePlan {
    /// Absolute path of the diffusers folder describing a single-file model.
    pub model_config: Option<PathBuf>,
    #[serde(serialize_with = "prediction_name")]
    pub prediction_type: Option<PredictionType>,
    /// diffusers' weight variant of a pipeline folder (`fp16`, `bf16`, `non_ema`, …).
    pub variant: Option<String>,
    pub save_ckpt_format: SaveFormat,
    /// A VAE in place of the model's (`crate::model::vae_source`): an absolute local path, or a
    /// hub repo id as given.
    pub vae: Option<String>,
    /// kohya's `base_weights`: adapter files merged into the frozen model before training, each
    /// with its multiplier.
    pub base_weights: Vec<(PathBuf, f64)>,
}

fn prediction_name<S: serde::Serializer>(
    p: &Option<PredictionType>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match p {
        Some(p) => s.serialize_str(p.name()),
        None => s.serialize_none(),
    }
}

fn invalid(file: &Path, field: &str, message: String) -> ConfigError {
    ConfigError::Invalid {
        file: file.to_path_buf(),
        field: field.to_string(),
        message,
    }
}

/// Resolves the keys; `input_path` resolves `model_config` as an input path.
pub fn resolve_model_file(
    file: &TrainFile,
    train_path: &Path,
    mode: TrainMode,
    input_path: impl Fn(&str, &str) -> Result<PathBuf, ConfigError>,
) -> Result<ModelFilePlan, ConfigError> {
    let prediction_type = match file.prediction_type.as_deref() {
        None => None,
        Some("epsilon") => Some(PredictionType::Epsilon),
        Some("v_prediction") => Some(PredictionType::VPrediction),
        Some(other) => {
            return Err(invalid(
                train_path,
                "prediction_type",
                format!("is \"{other}\"; allowed: \"epsilon\", \"v_prediction\""),
            ))
        }
    };
    let model_config = file
        .model_config
        .as_deref()
        .map(|p| input_path("model_config", p))
        .transpose()?;
    if let Some(dir) = &model_config {
        if !dir.join("model_index.json").is_file() {
            return Err(invalid(
                train_path,
                "model_config",
                format!(
                    "{} is not a diffusers pipeline folder (no model_index.json)",
                    dir.display()
                ),
            ));
        }
    }
    let variant = file.variant.clone();
    crate::model::files::check_variant(variant.as_deref())
        .map_err(|e| invalid(train_path, "variant", e.to_string()))?;
    let vae = file
        .vae
        .as_deref()
        .map(|v| resolve_vae(v, train_path, &input_path))
        .transpose()?;
    Ok(ModelFilePlan {
        model_config,
        prediction_type,
        variant,
        save_ckpt_format: resolve_save_format(file, train_path, mode)?,
        vae,
        base_weights: resolve_base_weights(file, train_path, mode, &input_path)?,
    })
}

/// `base_weights` with `base_weights_multiplier` (kohya's: a file without a multiplier merges
/// at 1). Each file must exist; the run must keep the base frozen (an adapter or an embedding).
fn resolve_base_weights(
    file: &TrainFile,
    train_path: &Path,
    mode: TrainMode,
    input_path: impl Fn(&str, &str) -> Result<PathBuf, ConfigError>,
) -> Result<Vec<(PathBuf, f64)>, ConfigError> {
    let files = file.base_weights.clone().unwrap_or_default();
    let multipliers = file.base_weights_multiplier.clone().unwrap_or_default();
    if multipliers.len() > files.len() {
        return Err(invalid(
            train_path,
            "base_weights_multiplier",
            format!(
                "has {} entries for {} base_weights file(s); give one per file",
                multipliers.len(),
                files.len()
            ),
        ));
    }
    if let Some(m) = multipliers.iter().find(|m| !m.is_finite()) {
        return Err(invalid(
            train_path,
            "base_weights_multiplier",
            format!("holds {m}; each must be a number"),
        ));
    }
    if !files.is_empty() && mode == TrainMode::Full {
        return Err(invalid(
            train_path,
            "base_weights",
            "merges adapter files into the frozen model that an adapter or an embedding trains \
             on (kohya's train_network); a full fine-tune trains the model's own weights"
                .into(),
        ));
    }
    files
        .iter()
        .enumerate()
        .map(|(i, raw)| {
            let path = input_path("base_weights", raw)?;
            if !path.is_file() {
                return Err(invalid(
                    train_path,
                    "base_weights",
                    format!("entry {i} is {}, which is not a file", path.display()),
                ));
            }
            Ok((path, multipliers.get(i).copied().unwrap_or(1.0)))
        })
        .collect()
}

/// `vae`: an existing file or folder (beside train.json first), else a hub repo id.
fn resolve_vae(
    raw: &str,
    train_path: &Path,
    input_path: impl Fn(&str, &str) -> Result<PathBuf, ConfigError>,
) -> Result<String, ConfigError> {
    let local = input_path("vae", raw)?;
    if local.exists() {
        return Ok(local.display().to_string());
    }
    match crate::model::source::ModelSource::parse(raw) {
        Ok(crate::model::source::ModelSource::Hub { .. }) => Ok(raw.to_string()),
        _ => Err(invalid(
            train_path,
            "vae",
            format!(
                "is \"{raw}\": neither an existing file or folder ({} not found) nor a hub repo \
                 id (`org/name`, such as \"madebyollin/sdxl-vae-fp16-fix\")",
                local.display()
            ),
        )),
    }
}

/// `save_ckpt_format` and `no_save_ckpt`, which apply to full fine-tunes and must agree.
fn resolve_save_format(
    file: &TrainFile,
    train_path: &Path,
    mode: TrainMode,
) -> Result<SaveFormat, ConfigError> {
    let asked = match file.save_ckpt_format.as_deref() {
        None => None,
        Some("diffusers") => Some(SaveFormat::Diffusers),
        Some("safetensors") => Some(SaveFormat::Safetensors),
        Some("both") => Some(SaveFormat::Both),
        Some(other) => {
            return Err(invalid(
                train_path,
                "save_ckpt_format",
                format!("is \"{other}\"; allowed: \"diffusers\", \"safetensors\", \"both\""),
            ))
        }
    };
    let adapters = match mode {
        TrainMode::Full => false,
        TrainMode::Lora
        | TrainMode::Locon
        | TrainMode::Loha
        | TrainMode::Lokr
        | TrainMode::Dora
        | TrainMode::TextualInversion => true,
    };
    if adapters && (asked.is_some() || file.no_save_ckpt == Some(false)) {
        let field = if asked.is_some() {
            "save_ckpt_format"
        } else {
            "no_save_ckpt"
        };
        return Err(invalid(
            train_path,
            field,
            "applies to full fine-tunes (\"mode\": \"full\"); adapter runs always save \
             kohya-format .safetensors files, and textual inversion embedding files"
                .into(),
        ));
    }
    match (asked, file.no_save_ckpt) {
        (None, Some(false)) => Ok(SaveFormat::Both),
        (None, _) => Ok(SaveFormat::Diffusers),
        (Some(f), Some(true)) if f.single_file() => Err(invalid(
            train_path,
            "no_save_ckpt",
            format!(
                "is true, but save_ckpt_format \"{}\" asks for a single file",
                serde_json::to_value(f)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default()
            ),
        )),
        (Some(SaveFormat::Diffusers), Some(false)) => Err(invalid(
            train_path,
            "no_save_ckpt",
            "is false (save a single file), but save_ckpt_format is \"diffusers\"".into(),
        )),
        (Some(f), _) => Ok(f),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(json: serde_json::Value, mode: TrainMode) -> Result<ModelFilePlan, ConfigError> {
        let file: TrainFile = serde_json::from_value(json).unwrap();
        resolve_model_file(&file, Path::new("train.json"), mode, |_, p| {
            Ok(PathBuf::from(p))
        })
    }

    #[test]
    fn save_format_follows_no_save_ckpt_like_everydream2() {
        let f = |j| resolve(j, TrainMode::Full).map(|p| p.save_ckpt_format);
        use serde_json::json;
        assert_eq!(f(json!({})).unwrap(), SaveFormat::Diffusers);
        assert_eq!(
            f(json!({"no_save_ckpt": true})).unwrap(),
            SaveFormat::Diffusers
        );
        assert_eq!(f(json!({"no_save_ckpt": false})).unwrap(), SaveFormat::Both);
        assert_eq!(
            f(json!({"save_ckpt_format": "safetensors"})).unwrap(),
            SaveFormat::Safetensors
        );
        let err = f(json!({"save_ckpt_format": "both", "no_save_ckpt": true})).unwrap_err();
        assert!(err.to_string().contains("no_save_ckpt"), "{err}");
        let err = f(json!({"save_ckpt_format": "ckpt"})).unwrap_err();
        assert!(err.to_string().contains("\"safetensors\""), "{err}");
        let err = resolve(json!({"save_ckpt_format": "both"}), TrainMode::Lora).unwrap_err();
        assert!(err.to_string().contains("full fine-tunes"), "{err}");
    }

    #[test]
    fn prediction_type_names() {
        use serde_json::json;
        let p = resolve(json!({"prediction_type": "v_prediction"}), TrainMode::Full).unwrap();
        assert_eq!(p.prediction_type, Some(PredictionType::VPrediction));
        assert!(resolve(json!({"prediction_type": "v"}), TrainMode::Full).is_err());
    }
}
