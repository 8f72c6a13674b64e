//! A OneTrainer config's data (`super::onetrainer_config`): its concepts (inline, or the
//! `concept_file_name` list), the resolution and buckets, the latent cache, the validation
//! concepts, and the samples.
//!
//! Each enabled training concept becomes a subset of one dataset, read as kohya's DreamBooth
//! subsets are (`crate::data::kohya_subsets`): the images in the concept's folder, each
//! captioned by the `.txt` beside it (OneTrainer's prompt source "sample"), repeated `balancing`
//! times, with its flip, tag shuffle and tag dropout. The buckets are OneTrainer's aspect
//! ratios at the resolution, their sides multiples of 64.

use std::path::PathBuf;

use serde_json::{json, Map, Value};

use super::error::ConfigError;
use super::onetrainer_config::{invalid, merged_concept, Translation};
use super::onetrainer_training::{every, is_sdxl, Every};

/// One concept, its settings over OneTrainer's defaults, and where it is for messages.
struct Concept {
    at: String,
    c: Map<String, Value>,
}

impl Concept {
    fn get(&self, path: &str) -> &Value {
        super::onetrainer_config::at_path(&self.c, path).unwrap_or(&Value::Null)
    }

    fn field(&self, path: &str) -> String {
        format!("{}.{path}", self.at)
    }

    fn on(&self, path: &str) -> bool {
        self.get(path).as_bool().unwrap_or(false)
    }

    fn text(&self, path: &str) -> &str {
        self.get(path).as_str().unwrap_or("")
    }

    fn number(&self, path: &str) -> f64 {
        self.get(path).as_f64().unwrap_or(0.0)
    }
}

/// The concepts as dataset subsets, with the data keys of train.json.
pub(super) fn concepts(t: &mut Translation<'_>) -> Result<Vec<(String, toml::Table)>, ConfigError> {
    data_keys(t)?;
    let list = read_concepts(t)?;
    let mut subsets = Vec::new();
    let mut validation = Vec::new();
    for concept in list {
        if !concept.on("enabled") {
            continue;
        }
        match concept.text("type") {
            "STANDARD" => {
                let table = subset(t, &concept)?;
                subsets.push((concept.at.clone(), table));
            }
            "VALIDATION" => validation.push(concept),
            other => {
                return Err(t.invalid(
                    &concept.field("type"),
                    format!(
                        "is \"{other}\": sdtrain trains STANDARD concepts and validates on \
                         VALIDATION ones (OneTrainer's prior prediction is not implemented; \
                         kohya-style regularization images are reg_data_root)"
                    ),
                ))
            }
        }
    }
    if subsets.is_empty() {
        return Err(t.invalid(
            "concepts",
            "hold no enabled STANDARD concept: nothing would train".into(),
        ));
    }
    validation_concept(t, &validation)?;
    Ok(subsets)
}

/// The inline `concepts`, else the list in `concept_file_name`.
fn read_concepts(t: &Translation<'_>) -> Result<Vec<Concept>, ConfigError> {
    let (items, label) = match t.get("concepts") {
        Value::Array(items) => (items.clone(), "concepts".to_string()),
        Value::Null => {
            let raw = t.str("concept_file_name")?.to_string();
            let path = t.input_path("concept_file_name", &raw)?;
            if !path.is_file() {
                return Err(t.invalid(
                    "concept_file_name",
                    format!(
                        "is \"{raw}\", and {} is not a file (OneTrainer opens it from its \
                         working directory; run sdtrain from there, or give the path in full)",
                        path.display()
                    ),
                ));
            }
            let value = super::strict::read_json(&path)?;
            let Value::Array(items) = value else {
                return Err(invalid(
                    &path,
                    "concepts",
                    "must be a JSON list of concepts (OneTrainer's concepts file)".into(),
                ));
            };
            (items, path.display().to_string())
        }
        v => return Err(t.invalid("concepts", format!("must be a list or null (got {v})"))),
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::Object(m) => Ok(Concept {
                at: format!("{label}[{i}]"),
                c: merged_concept(&m),
            }),
            v => Err(t.invalid(
                &format!("{label}[{i}]"),
                format!("must be a concept object (got {v})"),
            )),
        })
        .collect()
}

/// The concept's folder, subfolders and prompt source for `crate::data::onetrainer_concept`,
/// and whether a caption of it holds several lines (each sample then draws one, which keeps
/// the text-encoder cache off; it stays on when every caption is one line).
fn prompt_source(
    t: &Translation<'_>,
    c: &Concept,
    dir: &std::path::Path,
) -> Result<toml::Table, ConfigError> {
    use crate::data::onetrainer_concept::{caption, caption_lines, images, ConceptPrompts};
    let mut table = toml::Table::new();
    let recursive = c.on("include_subdirectories");
    table.insert(
        "include_subdirectories".into(),
        toml::Value::Boolean(recursive),
    );
    balancing(t, c, &mut table)?;
    let source = c.text("text.prompt_source");
    let field = c.field("text.prompt_source");
    let io = |e: crate::data::DataError| t.invalid(&field, e.to_string());
    let prompts = match source {
        "sample" => ConceptPrompts::Sample,
        "filename" => ConceptPrompts::FileName,
        "concept" => {
            let raw = c.text("text.prompt_path");
            let path = t.input_path(&c.field("text.prompt_path"), raw)?;
            if !path.is_file() {
                return Err(t.invalid(
                    &c.field("text.prompt_path"),
                    format!("is \"{raw}\", and {} is not a file", path.display()),
                ));
            }
            table.insert("prompt_path".into(), toml::Value::String(path.to_string_lossy().into()));
            ConceptPrompts::File { path }
        }
        other => {
            return Err(t.invalid(
                &field,
                format!("is \"{other}\"; OneTrainer's prompt sources are \"sample\", \"filename\" and \"concept\""),
            ))
        }
    };
    table.insert("prompt_source".into(), toml::Value::String(source.into()));
    let lines = match &prompts {
        ConceptPrompts::FileName => false,
        ConceptPrompts::File { path } => caption_lines(path).map_err(io)?.contains('\n'),
        ConceptPrompts::Sample => {
            let mut any = false;
            for image in images(dir, recursive).map_err(io)? {
                if caption(&image, &prompts, None, false)
                    .map_err(io)?
                    .contains('\n')
                {
                    any = true;
                    break;
                }
            }
            any
        }
    };
    table.insert("random_line".into(), toml::Value::Boolean(lines));
    Ok(table)
}

/// The concept's `balancing` and its strategy, and its `loss_weight`.
fn balancing(t: &Translation<'_>, c: &Concept, table: &mut toml::Table) -> Result<(), ConfigError> {
    let strategy = c.text("balancing_strategy");
    let balancing = c.number("balancing");
    if !matches!(strategy, "REPEATS" | "SAMPLES") || balancing.is_nan() || balancing < 0.0 {
        return Err(t.invalid(
            &c.field("balancing"),
            format!(
                "is {balancing} ({strategy}): a number ≥ 0 of repeats (REPEATS) or of samples \
                 (SAMPLES) each epoch"
            ),
        ));
    }
    if balancing.fract() != 0.0 || strategy == "SAMPLES" {
        t.differences_note(
            "a concept's fractional repeats (or SAMPLES balancing) draw that share of its images \
             at random each epoch (EveryDream2's fractional multiply.txt), where OneTrainer takes \
             them in file order"
                .into(),
        );
    }
    let weight = c.number("loss_weight");
    let valid = c.get("loss_weight").is_number() && weight.is_finite() && weight >= 0.0;
    if !valid {
        return Err(t.invalid(
            &c.field("loss_weight"),
            format!("must be a number ≥ 0 (got {})", c.get("loss_weight")),
        ));
    }
    table.insert("loss_weight".into(), toml::Value::Float(weight));
    table.insert(
        "balancing_strategy".into(),
        toml::Value::String(strategy.into()),
    );
    table.insert("balancing".into(), toml::Value::Float(balancing));
    Ok(())
}

/// One concept as a dataset subset (kohya's subset keys).
fn subset(t: &Translation<'_>, c: &Concept) -> Result<toml::Table, ConfigError> {
    let mut table = toml::Table::new();
    let dir = concept_dir(t, c)?;
    table.insert(
        "image_dir".into(),
        toml::Value::String(dir.to_string_lossy().into()),
    );
    table.insert(
        super::dataset_config::ONETRAINER_CONCEPT.into(),
        toml::Value::Table(prompt_source(t, c, &dir)?),
    );
    // A whole number of repeats is kohya's num_repeats (its metadata shows it); the image
    // multipliers come from the balancing itself (`crate::data::onetrainer_concept`).
    let b = c.number("balancing");
    if c.text("balancing_strategy") == "REPEATS" && b.fract() == 0.0 {
        table.insert("num_repeats".into(), toml::Value::Integer(b as i64));
    }
    image_settings(t, c, &mut table)?;
    text_settings(t, c, &mut table)?;
    let dropout = t.f64("text_encoder.dropout_probability")?;
    table.insert("caption_dropout_rate".into(), toml::Value::Float(dropout));
    Ok(table)
}

/// The concept's folder, which must exist (OneTrainer would try a missing one as a Hugging Face
/// dataset id).
fn concept_dir(t: &Translation<'_>, c: &Concept) -> Result<PathBuf, ConfigError> {
    let raw = c.text("path");
    if raw.trim().is_empty() {
        return Err(t.invalid(
            &c.field("path"),
            "is empty: a concept names its folder of images".into(),
        ));
    }
    let dir = t.input_path(&c.field("path"), raw)?;
    if !dir.is_dir() {
        return Err(t.invalid(
            &c.field("path"),
            format!(
                "is \"{raw}\", and {} is not a folder (relative paths start from the working \
                 directory, as in OneTrainer; sdtrain reads folders, not Hugging Face datasets)",
                dir.display()
            ),
        ));
    }
    Ok(dir)
}

/// The concept's `image` settings: the flip is taken, the crop jitter noted, any other
/// augmentation refused.
fn image_settings(
    t: &Translation<'_>,
    c: &Concept,
    table: &mut toml::Table,
) -> Result<(), ConfigError> {
    table.insert(
        "flip_aug".into(),
        toml::Value::Boolean(c.on("image.enable_random_flip")),
    );
    let refused = [
        "enable_fixed_flip",
        "enable_random_rotate",
        "enable_fixed_rotate",
        "enable_random_brightness",
        "enable_fixed_brightness",
        "enable_random_contrast",
        "enable_fixed_contrast",
        "enable_random_saturation",
        "enable_fixed_saturation",
        "enable_random_hue",
        "enable_fixed_hue",
        "enable_resolution_override",
        "enable_random_circular_mask_shrink",
        "enable_random_mask_rotate_crop",
    ];
    if let Some(key) = refused.iter().find(|k| c.on(&format!("image.{k}"))) {
        return Err(t.invalid(
            &c.field(&format!("image.{key}")),
            "is true: sdtrain's image augmentations are the random flip and the crop".into(),
        ));
    }
    if c.on("image.enable_crop_jitter") {
        t.differences_note(
            "crops are centred with the latent cache, else placed EveryDream2's way (crop_jitter), \
             not at a uniformly random offset"
                .into(),
        );
    }
    if c.number("image_variations") != 1.0 || c.number("text_variations") != 1.0 {
        t.differences_note(
            "the latent cache keeps one crop of each image and draws its flip each step \
             (image_variations and text_variations are not needed)"
                .into(),
        );
    }
    Ok(())
}

/// The concept's `text` settings: the tag shuffle and tag dropout.
fn text_settings(
    t: &Translation<'_>,
    c: &Concept,
    table: &mut toml::Table,
) -> Result<(), ConfigError> {
    let delimiter = c.text("text.tag_delimiter");
    if delimiter != "," {
        table.insert(
            "caption_separator".into(),
            toml::Value::String(delimiter.into()),
        );
    }
    let keep = c.number("text.keep_tags_count").max(0.0) as i64;
    let shuffle = c.on("text.enable_tag_shuffling");
    table.insert("shuffle_caption".into(), toml::Value::Boolean(shuffle));
    let dropout = c.on("text.tag_dropout_enable") && c.number("text.tag_dropout_probability") > 0.0;
    if shuffle || dropout {
        table.insert("keep_tokens".into(), toml::Value::Integer(keep));
    }
    if dropout {
        let mode = c.text("text.tag_dropout_mode");
        let special = c.text("text.tag_dropout_special_tags_mode");
        if special != "NONE" {
            return Err(t.invalid(
                &c.field("text.tag_dropout_special_tags_mode"),
                format!("is \"{special}\": sdtrain's tag dropout has no special tags (NONE)"),
            ));
        }
        if !matches!(mode, "FULL" | "RANDOM" | "RANDOM WEIGHTED") {
            return Err(t.invalid(
                &c.field("text.tag_dropout_mode"),
                format!("is \"{mode}\"; OneTrainer's modes are FULL, RANDOM and RANDOM WEIGHTED"),
            ));
        }
        let p = c.number("text.tag_dropout_probability");
        table.insert("caption_tag_dropout_rate".into(), toml::Value::Float(p));
        let key = super::dataset_config::ONETRAINER_CONCEPT;
        if let Some(toml::Value::Table(own)) = table.get_mut(key) {
            own.insert("tag_dropout_mode".into(), toml::Value::String(mode.into()));
        }
    }
    let caps =
        c.on("text.caps_randomize_enable") && c.number("text.caps_randomize_probability") > 0.0;
    if caps {
        return Err(t.invalid(
            &c.field("text.caps_randomize_enable"),
            "is true: sdtrain does not change the case of single tags (caps_randomize_lowercase, \
             the whole caption lower-cased, it does)"
                .into(),
        ));
    }
    if c.on("text.caps_randomize_lowercase") {
        let key = super::dataset_config::ONETRAINER_CONCEPT;
        if let Some(toml::Value::Table(own)) = table.get_mut(key) {
            own.insert("lowercase".into(), toml::Value::Boolean(true));
        }
    }
    Ok(())
}

/// `resolution`, `aspect_ratio_bucketing` and `latent_caching`.
fn data_keys(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    // OneTrainer's `resolution` is a text, which it makes of a number too (`str(value)`).
    let raw = match t.get("resolution") {
        Value::Number(n) => n.to_string(),
        _ => t.str("resolution")?.trim().to_string(),
    };
    let resolution: i64 = raw.parse().map_err(|_| {
        t.invalid(
            "resolution",
            format!(
                "is \"{raw}\": sdtrain trains at one resolution (a number such as \"512\"; \
                 OneTrainer's lists and WxH sizes are not supported)"
            ),
        )
    })?;
    t.set("resolution", json!(resolution), "resolution")?;
    let buckets = t.bool("aspect_ratio_bucketing")?;
    t.set("enable_bucket", json!(buckets), "aspect_ratio_bucketing")?;
    if buckets {
        let aspects: Vec<Value> = bucket_sizes(resolution as f64, 64.0)
            .into_iter()
            .map(|(w, h)| json!([w, h]))
            .collect();
        t.set("aspects", Value::Array(aspects), "aspect_ratio_bucketing")?;
        t.differences_note(format!(
            "images go to the nearest of OneTrainer's aspect ratios with sides in multiples of \
             64{}, and a bucket's last images are repeated to fill a batch rather than dropped",
            if is_sdxl(t) {
                ""
            } else {
                " (OneTrainer's SD buckets take multiples of 8)"
            }
        ));
    }
    let cache = t.bool("latent_caching")?;
    t.set("cache_latents", json!(cache), "latent_caching")?;
    Ok(())
}

/// OneTrainer's buckets (mgds `AspectBucketing`): each aspect ratio `h:w` of 1:1 to 1:4 and its
/// transpose, scaled to the resolution's area and rounded to `quantum` (Python's `round`, half
/// to even), without repeats; as `(width, height)`.
pub(super) fn bucket_sizes(resolution: f64, quantum: f64) -> Vec<(i64, i64)> {
    const RATIOS: [f64; 9] = [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0];
    let round = |x: f64| {
        let q = x / quantum;
        let r = q.round();
        let even = if (q - q.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
            r - q.signum()
        } else {
            r
        };
        (even * quantum) as i64
    };
    let mut out: Vec<(i64, i64)> = Vec::new();
    for r in RATIOS {
        for (h, w) in [(1.0, r), (r, 1.0)] {
            let s = (h * w).sqrt();
            let size = (round(w / s * resolution), round(h / s * resolution));
            // Below a quantum a side rounds to nothing (a resolution under 128 at the widest
            // ratios); such buckets are left out.
            if size.0 >= quantum as i64 && size.1 >= quantum as i64 && !out.contains(&size) {
                out.push(size);
            }
        }
    }
    out
}

/// The VALIDATION concept, when `validation` is on: sdtrain validates on one folder.
fn validation_concept(t: &mut Translation<'_>, list: &[Concept]) -> Result<(), ConfigError> {
    if !t.bool("validation")? {
        return Ok(());
    }
    let c = match list {
        [one] => one,
        [] => {
            return Err(t.invalid(
                "validation",
                "is true, but no enabled concept is of type VALIDATION".into(),
            ))
        }
        [_, second, ..] => {
            return Err(t.invalid(
                &second.field("type"),
                "is a second VALIDATION concept: sdtrain validates on one folder".into(),
            ))
        }
    };
    let dir = concept_dir(t, c)?;
    t.set(
        "validation_data_root",
        json!(dir.to_string_lossy()),
        "validation",
    )?;
    t.differences_note(
        "a validation image without a .txt caption validates on its file name (EveryDream2's \
         rule), not on an empty caption"
            .into(),
    );
    Ok(())
}

/// The samples: the inline `samples`, else `sample_definition_file_name` when it exists, and
/// `sample_after` with its unit.
pub(super) fn samples(t: &mut Translation<'_>) -> Result<(), ConfigError> {
    let file = match t.get("samples") {
        Value::Array(list) if has_enabled(list) => t.path.to_path_buf(),
        Value::Array(_) => return Ok(()),
        _ => {
            let raw = t.str("sample_definition_file_name")?.to_string();
            let path = t.input_path("sample_definition_file_name", &raw)?;
            match super::strict::read_json(&path) {
                Ok(Value::Array(list)) if has_enabled(&list) => path,
                // OneTrainer samples nothing when the file is missing, unreadable or empty.
                _ => return Ok(()),
            }
        }
    };
    let when = every(t, "sample_after", "sample_after_unit")?;
    if matches!(when, Every::Never) {
        return Ok(());
    }
    t.set(
        "sample_prompts",
        json!(file.to_string_lossy()),
        "sample_definition_file_name",
    )?;
    // OneTrainer's samples start at step 0, before any training.
    t.set("sample_at_first", json!(true), "sample_after")?;
    if t.str("ema")? != "OFF" {
        // OneTrainer samples the EMA weights, and the trained ones too with non_ema_sampling.
        t.set("ema_sample_ema_model", json!(true), "ema")?;
        let both = t.bool("non_ema_sampling")?;
        t.set("ema_sample_nonema_model", json!(both), "non_ema_sampling")?;
    }
    match when {
        Every::Epochs(n) => t.set("sample_every_n_epochs", json!(n), "sample_after")?,
        Every::Steps(n) => t.set("sample_every_n_steps", json!(n), "sample_after")?,
        Every::Minutes(m) => {
            t.differences_note(format!(
                "samples are drawn at the end of every epoch, not every {m} minutes (sdtrain \
                 samples by epochs or steps: sample_after_unit EPOCH or STEP)"
            ));
            t.set("sample_every_n_epochs", json!(1), "sample_after")?;
        }
        Every::Never => {}
    }
    if t.i64("sample_skip_first")? != 0 {
        t.differences_note("sample_skip_first is left alone: every round is drawn".into());
    }
    Ok(())
}

fn has_enabled(list: &[Value]) -> bool {
    list.iter()
        .any(|s| s.get("enabled").and_then(Value::as_bool).unwrap_or(true))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// OneTrainer's buckets from mgds' own `AspectBucketing` (tests/fixtures/
    /// onetrainer_buckets_reference.py): a wrong ratio, a missing transpose or round-half-up in
    /// place of Python's half-to-even fails it.
    #[test]
    fn bucket_sizes_are_onetrainers() {
        let text = include_str!("../../tests/fixtures/onetrainer_buckets_reference.json");
        let reference: serde_json::Map<String, Value> = serde_json::from_str(text).unwrap();
        assert_eq!(reference.len(), 10);
        for (key, sizes) in reference {
            let (r, q) = key.split_once('/').unwrap();
            let mut ours = bucket_sizes(r.parse().unwrap(), q.parse().unwrap());
            ours.sort();
            let theirs: Vec<(i64, i64)> = sizes
                .as_array()
                .unwrap()
                .iter()
                .map(|s| (s[0].as_i64().unwrap(), s[1].as_i64().unwrap()))
                .collect();
            assert_eq!(ours, theirs, "{key}");
        }
    }
}
