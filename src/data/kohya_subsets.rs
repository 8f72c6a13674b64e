//! The subsets of a kohya dataset config (`dataset_config`, kohya's `--dataset_config` TOML,
//! `crate::config::dataset_config`): which images each `[[datasets.subsets]]` entry holds and
//! their captions, after kohya's `DreamBoothDataset` and `FineTuningDataset`
//! (`library/train_util.py`).
//!
//! - A DreamBooth subset (`image_dir`) holds the image files directly in its folder, sorted by
//!   path. An image's caption is its `<stem><caption_extension>` file (the first line, or every
//!   line with `enable_wildcard`), else the subset's `class_tokens`, else empty (kohya's
//!   "neither caption file nor class tokens" warning; one warning counts them per subset).
//! - A fine-tuning subset (`metadata_file`) holds the images its metadata names: kohya's JSON
//!   (`{"<image>": {"caption": …, "tags": …}}`) or JSONL (one `{"image_path", "caption", "tags"}`
//!   per line). A relative image path is below `image_dir`; a key without its extension (written
//!   by older kohya scripts) finds the image of that stem there. The caption is kohya's:
//!   `caption<caption_separator>tags` (either alone when the other is empty), and with
//!   `enable_wildcard` the tags go on each of the caption's lines.
//!
//! Each image carries its subset's settings ([`ItemOptions`]): its repeats, its flip and
//! caption-dropout probabilities, and its caption settings ([`SubsetCaptions`]), which replace
//! train.json's for it. `caption_prefix` and `caption_suffix` are added here, once.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use serde_json::Value;

use super::caption::{read_caption_file, with_affixes};
use super::kohya_caption::SubsetCaptions;
use super::kohya_layout::{read_caption_lines, subset_images};
use super::scan::{is_image, ImageRecord};
use super::tag_shuffle::ItemOptions;
use super::DataError;

/// Where a subset's images and captions come from.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum SubsetSource {
    /// kohya's DreamBooth subset: the images in `image_dir`.
    DreamBooth {
        image_dir: PathBuf,
        class_tokens: Option<String>,
        /// With its leading dot.
        caption_extension: String,
    },
    /// kohya's fine-tuning subset: the images `metadata_file` names.
    FineTuning {
        metadata_file: PathBuf,
        image_dir: Option<PathBuf>,
    },
    /// A OneTrainer concept: the images in `image_dir` (and below it with `recursive`),
    /// captioned by its prompt source (`super::onetrainer_concept`).
    Concept {
        image_dir: PathBuf,
        recursive: bool,
        prompts: super::onetrainer_concept::ConceptPrompts,
        balancing: super::onetrainer_concept::ConceptBalancing,
        /// `caps_randomize_lowercase`: every caption lower-cased, as OneTrainer's
        /// `CapitalizeTags` does first.
        lowercase: bool,
    },
}

/// One `[[datasets.subsets]]` entry, every setting resolved (subset, then dataset, then
/// `[general]`, then train.json, then kohya's default).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KohyaSubset {
    /// Where it is in the config: `datasets[i].subsets[j]`, for messages.
    pub name: String,
    /// Its place in the plan's list of subsets (which its images carry).
    pub index: usize,
    /// Its `[[datasets]]` entry (regularization images balance within their dataset).
    pub dataset: usize,
    pub source: SubsetSource,
    /// `num_repeats`, at least 1.
    pub num_repeats: u64,
    pub is_reg: bool,
    /// `flip_aug`: 0.5, else 0 (or train.json's `flip_p` when the config leaves it unset).
    pub flip_p: f64,
    /// `caption_dropout_rate`.
    pub caption_dropout: f64,
    pub caption_prefix: Option<String>,
    pub caption_suffix: Option<String>,
    #[serde(serialize_with = "inner")]
    pub captions: Arc<SubsetCaptions>,
    /// kohya's validation split of this subset's images (its dataset's `validation_split` and
    /// `validation_seed`); `None` for a regularization subset or a split of 0.
    pub validation: Option<super::kohya_split::SubsetSplit>,
    /// A OneTrainer concept's `loss_weight` (1 for kohya's subsets).
    pub loss_weight: f64,
}

fn inner<S: serde::Serializer>(c: &Arc<SubsetCaptions>, s: S) -> Result<S::Ok, S::Error> {
    c.as_ref().serialize(s)
}

impl KohyaSubset {
    /// The folder its images are in, or its metadata file, for messages.
    pub fn location(&self) -> &Path {
        match &self.source {
            SubsetSource::DreamBooth { image_dir, .. } => image_dir,
            SubsetSource::FineTuning { metadata_file, .. } => metadata_file,
            SubsetSource::Concept { image_dir, .. } => image_dir,
        }
    }

    /// What every image of the subset carries.
    fn options(&self) -> Arc<ItemOptions> {
        Arc::new(ItemOptions {
            flip_p: Some(self.flip_p),
            cond_dropout: Some(self.caption_dropout),
            subset_captions: Some(self.captions.clone()),
            subset: Some(self.index),
            loss_weight: self.loss_weight,
            ..ItemOptions::default()
        })
    }

    fn record(&self, path: PathBuf, caption: &str, options: &Arc<ItemOptions>) -> ImageRecord {
        ImageRecord {
            path,
            caption: with_affixes(
                caption,
                self.caption_prefix.as_deref(),
                self.caption_suffix.as_deref(),
            ),
            multiplier: self.num_repeats as f64,
            options: options.clone(),
        }
    }
}

/// The subset's images, sorted by path; an empty subset is a warning (kohya ignores it).
pub fn scan_subset(subset: &KohyaSubset) -> Result<Vec<ImageRecord>, DataError> {
    let mut records = match &subset.source {
        SubsetSource::DreamBooth {
            image_dir,
            class_tokens,
            caption_extension,
        } => dreambooth(
            subset,
            image_dir,
            class_tokens.as_deref(),
            caption_extension,
        )?,
        SubsetSource::FineTuning {
            metadata_file,
            image_dir,
        } => fine_tuning(subset, metadata_file, image_dir.as_deref())?,
        SubsetSource::Concept {
            image_dir,
            recursive,
            prompts,
            balancing,
            lowercase,
        } => concept(
            subset, image_dir, *recursive, prompts, *balancing, *lowercase,
        )?,
    };
    if records.is_empty() {
        crate::console::say(format_args!(
            "warning: dataset_config {}: no image in {}, not used",
            subset.name,
            subset.location().display()
        ));
    }
    records.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(records)
}

fn dreambooth(
    subset: &KohyaSubset,
    image_dir: &Path,
    class_tokens: Option<&str>,
    ext: &str,
) -> Result<Vec<ImageRecord>, DataError> {
    let options = subset.options();
    let wildcard = subset.captions.keys.wildcard;
    let mut uncaptioned = Vec::new();
    let mut records = Vec::new();
    for image in subset_images(image_dir)? {
        let caption = match read_caption_lines(&image, ext, wildcard)? {
            Some(caption) => caption,
            None => {
                if class_tokens.is_none() {
                    uncaptioned.push(image.clone());
                }
                class_tokens.unwrap_or_default().to_string()
            }
        };
        records.push(subset.record(image, &caption, &options));
    }
    if let Some(first) = uncaptioned.first() {
        crate::console::say(format_args!(
            "warning: dataset_config {}: {} image{} without a `{ext}` caption file and no \
             class_tokens train{} on an empty caption (e.g. {})",
            subset.name,
            uncaptioned.len(),
            if uncaptioned.len() == 1 { "" } else { "s" },
            if uncaptioned.len() == 1 { "s" } else { "" },
            first.display()
        ));
    }
    Ok(records)
}

/// A OneTrainer concept's images, each with its caption lines.
fn concept(
    subset: &KohyaSubset,
    image_dir: &Path,
    recursive: bool,
    prompts: &super::onetrainer_concept::ConceptPrompts,
    balancing: super::onetrainer_concept::ConceptBalancing,
    lowercase: bool,
) -> Result<Vec<ImageRecord>, DataError> {
    use super::onetrainer_concept::{caption, caption_lines, images, ConceptPrompts};
    let options = subset.options();
    let file = match prompts {
        ConceptPrompts::File { path } => Some(caption_lines(path)?),
        _ => None,
    };
    let images = images(image_dir, recursive)?;
    let multiplier = balancing.multiplier(images.len());
    images
        .into_iter()
        .map(|image| {
            let text = caption(&image, prompts, file.as_deref(), lowercase)?;
            let mut record = subset.record(image, &text, &options);
            record.multiplier = multiplier;
            Ok(record)
        })
        .collect()
}

/// One image's entry in a metadata file.
struct MetadataEntry {
    key: String,
    caption: Option<String>,
    tags: Option<String>,
}

fn fine_tuning(
    subset: &KohyaSubset,
    metadata_file: &Path,
    image_dir: Option<&Path>,
) -> Result<Vec<ImageRecord>, DataError> {
    let entries = read_metadata(metadata_file)?;
    let options = subset.options();
    let sep = subset.captions.separator.as_str();
    let wildcard = subset.captions.keys.wildcard;
    let mut records = Vec::with_capacity(entries.len());
    for entry in entries {
        let path = metadata_image(metadata_file, image_dir, &entry.key)?;
        let caption = metadata_caption(
            entry.caption.as_deref(),
            entry.tags.as_deref(),
            sep,
            wildcard,
        );
        records.push(subset.record(path, &caption, &options));
    }
    Ok(records)
}

/// kohya's caption of a metadata entry: the tags after the caption, joined by the caption
/// separator; with wildcards, the tags (made one line) after each non-empty caption line.
pub fn metadata_caption(
    caption: Option<&str>,
    tags: Option<&str>,
    sep: &str,
    wildcard: bool,
) -> String {
    let caption = caption.unwrap_or_default();
    match (tags, wildcard) {
        (Some(tags), true) => {
            let tags = tags.replace('\n', sep);
            caption
                .split('\n')
                .filter(|line| !line.trim().is_empty())
                .map(|line| format!("{line}{sep}{tags}"))
                .collect::<Vec<_>>()
                .join("\n")
        }
        (Some(tags), false) if !tags.is_empty() => match caption.is_empty() {
            true => tags.to_string(),
            false => format!("{caption}{sep}{tags}"),
        },
        _ => caption.to_string(),
    }
}

/// The entries of kohya's metadata JSON (an object keyed by image) or JSONL (one object per
/// line with `image_path`), in file order.
fn read_metadata(path: &Path) -> Result<Vec<MetadataEntry>, DataError> {
    let bad = |reason: String| DataError::Text {
        path: path.to_path_buf(),
        reason,
    };
    let text = read_caption_file(path)?;
    let jsonl = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("jsonl"));
    let text_of = |v: &Value, what: &str, key: &str| -> Result<Option<String>, DataError> {
        match v.get(what) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(bad(format!("`{key}`: `{what}` must be text (got {other})"))),
        }
    };
    let mut out = Vec::new();
    if jsonl {
        for (i, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let v: Value = serde_json::from_str(line)
                .map_err(|e| bad(format!("line {} is not JSON: {e}", i + 1)))?;
            let Some(key) = v.get("image_path").and_then(Value::as_str) else {
                return Err(bad(format!("line {} has no `image_path`", i + 1)));
            };
            out.push(MetadataEntry {
                key: key.to_string(),
                // kohya's JSONL reader takes a missing caption as empty.
                caption: text_of(&v, "caption", key)?,
                tags: text_of(&v, "tags", key)?,
            });
        }
        return Ok(out);
    }
    let v: Value = serde_json::from_str(&text).map_err(|e| bad(format!("is not JSON: {e}")))?;
    let Value::Object(map) = v else {
        return Err(bad(
            "must be a JSON object of `\"<image>\": {\"caption\": …, \"tags\": …}` entries \
             (kohya's metadata)"
                .into(),
        ));
    };
    for (key, md) in &map {
        if !md.is_object() {
            return Err(bad(format!(
                "`{key}` must be an object with `caption` and/or `tags`"
            )));
        }
        out.push(MetadataEntry {
            key: key.clone(),
            caption: text_of(md, "caption", key)?,
            tags: text_of(md, "tags", key)?,
        });
    }
    Ok(out)
}

/// The image a metadata key names: the path itself (absolute, or below `image_dir`), else the
/// image of that stem in its folder (older kohya metadata keys images by stem).
fn metadata_image(
    metadata: &Path,
    image_dir: Option<&Path>,
    key: &str,
) -> Result<PathBuf, DataError> {
    let missing = |reason: String| DataError::Text {
        path: metadata.to_path_buf(),
        reason,
    };
    let raw = Path::new(key);
    let path = match (raw.is_absolute(), image_dir) {
        (true, _) => raw.to_path_buf(),
        (false, Some(dir)) => dir.join(raw),
        (false, None) => {
            return Err(missing(format!(
                "`{key}` is a relative path, so the subset needs `image_dir` (kohya's rule)"
            )))
        }
    };
    if path.is_file() && is_image(&path) {
        return Ok(path);
    }
    let stem_match = path.parent().and_then(|dir| {
        let name = path.file_name()?.to_string_lossy().into_owned();
        super::scan::IMAGE_EXTENSIONS
            .iter()
            .map(|ext| dir.join(format!("{name}.{ext}")))
            .find(|p| p.is_file())
    });
    stem_match.ok_or_else(|| {
        missing(format!(
            "`{key}`: no image at {} (nor an image of that name with an image extension)",
            path.display()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_captions_join_tags_as_kohya() {
        assert_eq!(
            metadata_caption(Some("a cat"), Some("x, y"), ",", false),
            "a cat,x, y"
        );
        assert_eq!(metadata_caption(None, Some("x"), ",", false), "x");
        assert_eq!(metadata_caption(Some("a"), Some(""), ",", false), "a");
        assert_eq!(metadata_caption(Some("a"), None, ",", false), "a");
        assert_eq!(
            metadata_caption(Some("one\n\ntwo"), Some("t\nu"), ";", true),
            "one;t;u\ntwo;t;u"
        );
    }
}
