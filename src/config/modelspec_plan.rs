//! kohya's `metadata_*` keys (`library/sai_model_spec.py`'s `add_model_spec_arguments`): what
//! the saved files' ModelSpec metadata says beyond what the run decides, and the ModelSpec
//! fields kohya derives from its settings (`get_sai_model_spec`):
//! - `metadata_title` (else the file's output name), `metadata_author`, `metadata_description`,
//!   `metadata_license`, `metadata_tags`, `metadata_usage_hint`, `metadata_merged_from`,
//!   `metadata_trigger_phrase`, `metadata_preprocessor`, `metadata_is_negative_embedding`: each
//!   written as `modelspec.<name>`, as given;
//! - `metadata_thumbnail`: an image file, embedded as a `data:` URL (kohya's
//!   `file_to_data_url`); a file that cannot be read is an error naming it (kohya skips it with
//!   a warning);
//! - `modelspec.encoder_layer`: `clip_skip` when the config gives it;
//! - `modelspec.timestep_range`: `start,end` when the config gives either end (kohya's
//!   `min_timestep`/`max_timestep`, 0 and 1000 for the one left out).

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use super::ctx::Ctx;
use super::error::ConfigError;
use super::train_file::TrainFile;

/// The ModelSpec fields a run's adapter files carry beyond the model's own.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ModelSpecPlan {
    /// `modelspec.<field>` → value, the title included when `metadata_title` is set.
    pub fields: BTreeMap<String, String>,
}

/// The text fields, by their key's suffix.
const TEXT_FIELDS: [&str; 10] = [
    "title",
    "author",
    "description",
    "license",
    "tags",
    "usage_hint",
    "merged_from",
    "trigger_phrase",
    "preprocessor",
    "is_negative_embedding",
];

pub(super) fn resolve_modelspec(
    file: &TrainFile,
    ctx: &Ctx<'_>,
) -> Result<ModelSpecPlan, ConfigError> {
    let given = [
        &file.metadata_title,
        &file.metadata_author,
        &file.metadata_description,
        &file.metadata_license,
        &file.metadata_tags,
        &file.metadata_usage_hint,
        &file.metadata_merged_from,
        &file.metadata_trigger_phrase,
        &file.metadata_preprocessor,
        &file.metadata_is_negative_embedding,
    ];
    let mut fields = BTreeMap::new();
    for (name, value) in TEXT_FIELDS.iter().zip(given) {
        if let Some(v) = value {
            fields.insert(format!("modelspec.{name}"), v.clone());
        }
    }
    if let Some(raw) = &file.metadata_thumbnail {
        let path = ctx.input_path("metadata_thumbnail", raw)?;
        fields.insert("modelspec.thumbnail".into(), data_url(&path, ctx)?);
    }
    if let Some(skip) = file.clip_skip {
        fields.insert("modelspec.encoder_layer".into(), skip.to_string());
    }
    let start = file.timestep_start.or(file.min_timestep);
    let end = file.timestep_end.or(file.max_timestep);
    if start.is_some() || end.is_some() {
        let range = format!("{},{}", start.unwrap_or(0), end.unwrap_or(1000));
        fields.insert("modelspec.timestep_range".into(), range);
    }
    Ok(ModelSpecPlan { fields })
}

/// kohya's `file_to_data_url`: `data:<mime>;base64,<bytes>`, the type from the extension.
fn data_url(path: &Path, ctx: &Ctx<'_>) -> Result<String, ConfigError> {
    use base64::Engine;
    let bytes = std::fs::read(path).map_err(|e| {
        ctx.invalid(
            "metadata_thumbnail",
            format!("cannot read {}: {e}", path.display()),
        )
    })?;
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let mime = match ext.as_deref() {
        Some("png") => "image/png",
        Some("jpg" | "jpeg") => "image/jpeg",
        Some("webp") => "image/webp",
        Some("gif") => "image/gif",
        Some("bmp") => "image/bmp",
        _ => "application/octet-stream",
    };
    let encoded = base64::engine::general_purpose::STANDARD.encode(bytes);
    Ok(format!("data:{mime};base64,{encoded}"))
}
