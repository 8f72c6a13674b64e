//! `dataset_config`: kohya's dataset config (`--dataset_config`, a TOML file of `[general]`,
//! `[[datasets]]` and `[[datasets.subsets]]`), resolved as kohya's `BlueprintGenerator` does:
//! each setting of a subset is its own, else its dataset's, else `[general]`'s, else train.json's
//! (where kohya reads its command line), else kohya's default. Its shape:
//! [`super::dataset_config_schema`]; its images: `crate::data::kohya_subsets`.
//!
//! - Subset settings (repeats, captions, flips, regularization) are per subset: each image trains
//!   with its own subset's.
//! - Dataset settings (`resolution`, `batch_size`, `enable_bucket`, `min_bucket_reso`,
//!   `max_bucket_reso`, `bucket_reso_steps`, `bucket_no_upscale`) take the place of train.json's
//!   for that dataset's images ([`DatasetShape`]): datasets at different resolutions and batch
//!   sizes train in one run, each micro-batch of one dataset and one bucket, as kohya's
//!   `DatasetGroup` makes them. The first dataset's are the run's (its resolution is the one the
//!   samples default to).
//! - `validation_split` and `validation_seed` are each dataset's: its subsets are split as
//!   kohya's `split_train_val` splits them (`crate::data::kohya_split`), regularization subsets
//!   never.
//! - As in kohya, train.json's `data_root` and `reg_data_root` are not read beside a dataset
//!   config (a warning says so); `is_reg` subsets are the regularization images, balanced within
//!   their dataset and weighed by train.json's `prior_loss_weight`.
//! - What sdtrain cannot do is refused with the reason: `color_aug`, `random_crop`,
//!   `face_crop_aug_range`, a `network_multiplier` other than 1 and ControlNet subsets.
//!   `cache_info` (a loading cache) changes nothing; `custom_attributes` and
//!   `resize_interpolation` are not used, with a warning.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;

use super::ctx::Ctx;
use super::data_plan::DatasetShape;
use super::dataset_config_schema::{check, Chain, Checked, TomlCtx};
use super::error::ConfigError;
use super::regularization_plan::caption_extension;
use super::train_file::TrainFile;
use crate::data::kohya_caption::{
    KohyaCaptions, SubsetCaptions, TagDropoutMode, TokenWarmup, CAPTION_SEPARATOR,
};
use crate::data::kohya_layout::DEFAULT_CAPTION_EXTENSION;
use crate::data::kohya_split::SubsetSplit;
use crate::data::kohya_subsets::{KohyaSubset, SubsetSource};

/// kohya's `flip_aug`: half the samples flipped.
const FLIP_AUG_P: f64 = 0.5;

/// The dataset config as resolved.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DatasetConfigPlan {
    /// Absolute path of the TOML file.
    pub file: PathBuf,
    /// Its subsets in file order, without those kohya skips (`num_repeats` below 1).
    pub subsets: Vec<KohyaSubset>,
    /// The `is_reg` subsets' loss weight (train.json's `prior_loss_weight`, kohya's).
    pub prior_loss_weight: f64,
    /// Each `[[datasets]]` entry's resolution, batch size and buckets, by its index
    /// ([`KohyaSubset::dataset`]).
    pub shapes: Vec<DatasetShape>,
}

impl DatasetConfigPlan {
    /// Whether the datasets differ in resolution, batch size or buckets.
    pub fn mixed_shapes(&self) -> bool {
        let key = |s: &DatasetShape| (s.resolution, s.batch_size, s.buckets.clone());
        self.shapes.windows(2).any(|w| key(&w[0]) != key(&w[1]))
    }

    /// Whether some subset's captions change from step to step (the text cache cannot hold
    /// them), and which of its settings does it.
    pub fn per_step_captions(&self) -> Option<super::data_plan::TextCacheOff> {
        use super::data_plan::TextCacheOff;
        self.subsets.iter().find_map(|s| {
            let c = &s.captions;
            match () {
                _ if c.shuffle => Some(TextCacheOff::ShuffleTags),
                _ if c.tag_dropout > 0.0 => Some(TextCacheOff::TagDropout),
                _ if c.keys.wildcard => Some(TextCacheOff::Wildcard),
                _ if c.keys.random_line => Some(TextCacheOff::CaptionLines),
                _ if c.keys.token_warmup.is_some() => Some(TextCacheOff::TokenWarmup),
                _ => None,
            }
        })
    }
}

/// Reads train.json's `dataset_config`, when set, and writes the dataset settings it gives into
/// `file` (over train.json's own), as kohya's config overrides its command line.
pub(super) fn apply_dataset_config(
    file: &mut TrainFile,
    ctx: &Ctx<'_>,
) -> Result<Option<DatasetConfigPlan>, ConfigError> {
    let kohya = file.kohya_data.clone();
    let (path, checked, names) = match (file.dataset_config.clone(), &kohya) {
        (Some(raw), _) => {
            let (path, checked) = read_config(&raw, ctx)?;
            (path, checked, None)
        }
        (None, Some(k)) if !k.subsets.is_empty() => {
            let checked = Checked {
                general: toml::Table::new(),
                datasets: vec![(
                    toml::Table::new(),
                    k.subsets.iter().map(|(_, t)| t.clone()).collect(),
                )],
            };
            let names: Vec<String> = k.subsets.iter().map(|(n, _)| n.clone()).collect();
            (k.file.clone(), checked, Some(names))
        }
        (None, _) => return Ok(None),
    };
    let cx = TomlCtx { file: &path };
    // A kohya config's own dataset options: the level under `[general]`, named bare.
    let empty = toml::Table::new();
    let command_line = kohya.as_ref().map_or(&empty, |k| &k.command_line);
    let toml_ctx = Ctx::new(&path);
    let mut ignored = BTreeSet::new();
    let mut run: Vec<(RunKeys, String)> = Vec::new();
    let mut subsets = Vec::new();
    let mut alpha: Option<(bool, String)> = None;
    for (i, (dataset, tables)) in checked.datasets.iter().enumerate() {
        let at = format!("datasets[{i}]");
        let chain = Chain {
            levels: vec![
                (dataset, at.clone()),
                (&checked.general, "general".into()),
                (command_line, String::new()),
            ],
        };
        let keys = run_keys(&chain, &cx)?;
        run.push((keys, at.clone()));
        check_kind_mix(tables, &at, &cx)?;
        for (j, table) in tables.iter().enumerate() {
            let name = match &names {
                Some(n) => n[j].clone(),
                None => format!("{at}.subsets[{j}]"),
            };
            let chain = Chain {
                levels: vec![
                    (table, name.clone()),
                    (dataset, at.clone()),
                    (&checked.general, "general".into()),
                    (command_line, String::new()),
                ],
            };
            let mask = table.get("alpha_mask").and_then(|v| v.as_bool());
            let mask = mask.unwrap_or(file.alpha_mask.unwrap_or(false));
            match &alpha {
                Some((first, first_at)) if *first != mask => {
                    return Err(cx.invalid(
                        &format!("{name}.alpha_mask"),
                        format!(
                            "is {mask} but {first_at}'s is {first}: sdtrain takes loss masks \
                             for the whole run, so every subset must agree"
                        ),
                    ))
                }
                Some(_) => {}
                None => alpha = Some((mask, name.clone())),
            }
            let sub = SubsetInput {
                chain: &chain,
                file,
                cx: &cx,
                toml: &toml_ctx,
                train: ctx,
                name,
                dataset: i,
            };
            if let Some(mut s) = resolve_subset(&sub, &mut ignored)? {
                s.index = subsets.len();
                subsets.push(s);
            }
        }
    }
    if !subsets.iter().any(|s| !s.is_reg) {
        return Err(cx.invalid(
            "datasets",
            "has no training subset: every subset is `is_reg` or has `num_repeats` below 1".into(),
        ));
    }
    // The held-out images are each subset's (kohya's split, `crate::data::kohya_split`); the
    // largest split stands for them in train.json's key, which turns the validation loss on.
    let held = subsets.iter().filter_map(|s| s.validation.map(|v| v.split));
    file.validation_split = held.reduce(f64::max);
    let shapes = dataset_shapes(file, &run, &path, ctx)?;
    if let Some((keys, _)) = run.first() {
        keys.write_into(file);
    }
    if alpha.is_some_and(|(a, _)| a) {
        file.alpha_mask = Some(true);
    }
    warn_ignored(&path, file, &ignored);
    let prior_loss_weight = file
        .prior_loss_weight
        .unwrap_or(super::regularization_plan::DEFAULT_PRIOR_LOSS_WEIGHT);
    if !(prior_loss_weight.is_finite() && prior_loss_weight >= 0.0) {
        return Err(ctx.invalid(
            "prior_loss_weight",
            format!("must be a finite number ≥ 0 (got {prior_loss_weight})"),
        ));
    }
    Ok(Some(DatasetConfigPlan {
        file: path,
        subsets,
        prior_loss_weight,
        shapes,
    }))
}

/// Reads and checks the dataset config train.json names.
fn read_config(raw: &str, ctx: &Ctx<'_>) -> Result<(PathBuf, Checked), ConfigError> {
    let path = ctx.input_path("dataset_config", raw)?;
    if !path.is_file() {
        return Err(ctx.invalid(
            "dataset_config",
            format!(
                "{} is not a file (kohya's dataset config, a .toml)",
                path.display()
            ),
        ));
    }
    let text = crate::text_file::read_unicode(&path).map_err(|e| match e {
        crate::text_file::TextFileError::Io { path, source } => {
            ConfigError::Read { file: path, source }
        }
        crate::text_file::TextFileError::Encoding { path, reason } => {
            ConfigError::Encoding { file: path, reason }
        }
    })?;
    let checked = check(&text, &TomlCtx { file: &path })?;
    Ok((path, checked))
}

/// One warning for the keys that are read but change nothing here, and train.json's folders
/// that the config replaces.
fn warn_ignored(path: &Path, file: &TrainFile, ignored: &BTreeSet<String>) {
    let replaced: Vec<&str> = [
        ("data_root", file.data_root.is_some()),
        ("reg_data_root", file.reg_data_root.is_some()),
        ("data_layout", file.data_layout.is_some()),
    ]
    .iter()
    .filter(|(_, set)| *set)
    .map(|(k, _)| *k)
    .collect();
    if !replaced.is_empty() {
        crate::console::say(format_args!(
            "note: train.json's {} not read: the dataset config {} names the images (as kohya \
             ignores train_data_dir and reg_data_dir beside --dataset_config)",
            replaced.join(", "),
            path.display()
        ));
    }
    if !ignored.is_empty() {
        let list: Vec<&str> = ignored.iter().map(String::as_str).collect();
        crate::console::say(format_args!(
            "warning: dataset config {}: not used by sdtrain: {} (custom_attributes serve other \
             models; images are resized with sdtrain's own filter)",
            path.display(),
            list.join(", ")
        ));
    }
}

/// What a dataset sets for the run, each with the field that set it.
#[derive(Debug, Default)]
struct RunKeys {
    values: Vec<(&'static str, RunValue, String)>,
}

#[derive(Debug, Clone, PartialEq)]
enum RunValue {
    Int(i64),
    Bool(bool),
}

impl std::fmt::Display for RunValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunValue::Int(v) => write!(f, "{v}"),
            RunValue::Bool(v) => write!(f, "{v}"),
        }
    }
}

impl RunKeys {
    fn get(&self, key: &str) -> Option<(&RunValue, &str)> {
        self.values
            .iter()
            .find(|(k, ..)| *k == key)
            .map(|(_, v, at)| (v, at.as_str()))
    }

    fn write_into(&self, file: &mut TrainFile) {
        // A dataset without buckets does not read the bucket keys it inherits from train.json
        // (kohya's command line always has them); those it sets itself are refused beside it.
        if let Some((RunValue::Bool(false), _)) = self.get("enable_bucket") {
            let own = |k: &str| self.get(k).is_some();
            if !own("min_bucket_reso") {
                file.min_bucket_reso = None;
            }
            if !own("max_bucket_reso") {
                file.max_bucket_reso = None;
            }
            if !own("bucket_reso_steps") {
                file.bucket_reso_steps = None;
            }
            if !own("bucket_no_upscale") {
                file.bucket_no_upscale = None;
            }
        }
        // kohya's `enable_bucket = true` generates kohya's sizes (`make_bucket_resolutions`),
        // from kohya's command-line defaults where neither the config nor train.json gives the
        // range; EveryDream2's table is train.json's own default, not kohya's.
        if let Some((RunValue::Bool(true), _)) = self.get("enable_bucket") {
            let given = [
                "min_bucket_reso",
                "max_bucket_reso",
                "bucket_reso_steps",
                "bucket_no_upscale",
            ]
            .iter()
            .any(|k| self.get(k).is_some());
            let in_file = file.min_bucket_reso.is_some()
                || file.max_bucket_reso.is_some()
                || file.bucket_reso_steps.is_some()
                || file.bucket_no_upscale.is_some();
            if !given && !in_file && file.aspects.is_none() {
                use super::kohya_config_keys::defaults::BUCKETS;
                for (key, v) in BUCKETS {
                    match key {
                        "min_bucket_reso" => file.min_bucket_reso = Some(v),
                        "max_bucket_reso" => file.max_bucket_reso = Some(v),
                        "bucket_reso_steps" => file.bucket_reso_steps = Some(v),
                        _ => {}
                    }
                }
            }
        }
        for (key, value, _) in &self.values {
            match (*key, value) {
                ("resolution", RunValue::Int(v)) => file.resolution = Some(*v),
                ("batch_size", RunValue::Int(v)) => file.batch_size = Some(*v),
                ("enable_bucket", RunValue::Bool(v)) => file.enable_bucket = Some(*v),
                ("min_bucket_reso", RunValue::Int(v)) => file.min_bucket_reso = Some(*v),
                ("max_bucket_reso", RunValue::Int(v)) => file.max_bucket_reso = Some(*v),
                ("bucket_reso_steps", RunValue::Int(v)) => file.bucket_reso_steps = Some(*v),
                ("bucket_no_upscale", RunValue::Bool(v)) => file.bucket_no_upscale = Some(*v),
                _ => {}
            }
        }
    }
}

/// The run keys `[[datasets]]` entry (with `[general]` under it) sets, checked.
fn run_keys(chain: &Chain<'_>, cx: &TomlCtx<'_>) -> Result<RunKeys, ConfigError> {
    let mut keys = RunKeys::default();
    if let Some((v, at)) = chain.get("resolution") {
        let square = match (v.as_integer(), v.as_array().map(Vec::as_slice)) {
            (Some(r), _) => Some(r),
            (None, Some([w, h])) => w.as_integer().filter(|&w| h.as_integer() == Some(w)),
            _ => None,
        };
        let Some(side) = square else {
            return Err(cx.invalid(
                &at,
                format!(
                    "is {}: sdtrain's buckets hold about resolution² pixels, so give a square \
                     size (one number, such as 512)",
                    super::dataset_config_schema::shown(v)
                ),
            ));
        };
        if !((64..=4096).contains(&side) && side % 64 == 0) {
            return Err(cx.invalid(
                &at,
                format!("must be a multiple of 64 between 64 and 4096 (got {side})"),
            ));
        }
        keys.values.push(("resolution", RunValue::Int(side), at));
    }
    for key in [
        "batch_size",
        "min_bucket_reso",
        "max_bucket_reso",
        "bucket_reso_steps",
    ] {
        if let Some((v, at)) = chain.int(key) {
            if v < 1 {
                return Err(cx.invalid(&at, format!("must be at least 1 (got {v})")));
            }
            keys.values.push((key, RunValue::Int(v), at));
        }
    }
    if let Some((v, at)) = chain.bool("enable_bucket") {
        keys.values.push(("enable_bucket", RunValue::Bool(v), at));
    }
    if let Some((v, at)) = chain.bool("bucket_no_upscale") {
        keys.values
            .push(("bucket_no_upscale", RunValue::Bool(v), at));
    }
    if let Some((m, at)) = chain.number("network_multiplier") {
        if m != 1.0 {
            return Err(cx.invalid(
                &at,
                format!(
                    "is {m}: sdtrain trains every dataset at the adapter's full strength; a \
                     multiplier other than 1 is not supported"
                ),
            ));
        }
    }
    Ok(keys)
}

/// Each dataset's resolution, batch size and buckets: train.json's (`base`, which kohya's
/// command line is) under the dataset's own keys, resolved as train.json's are. An error about a
/// key the dataset config gives names that file and the key's place in it.
fn dataset_shapes(
    base: &TrainFile,
    run: &[(RunKeys, String)],
    path: &Path,
    ctx: &Ctx<'_>,
) -> Result<Vec<DatasetShape>, ConfigError> {
    run.iter()
        .map(|(keys, at)| {
            let mut file = base.clone();
            keys.write_into(&mut file);
            let named = |e: ConfigError| match e {
                ConfigError::Invalid {
                    field,
                    message,
                    file,
                } => match keys.get(&field) {
                    Some((_, place)) => ConfigError::Invalid {
                        file: path.to_path_buf(),
                        field: place.to_string(),
                        message,
                    },
                    None => ConfigError::Invalid {
                        file,
                        field,
                        message,
                    },
                },
                other => other,
            };
            Ok(DatasetShape {
                name: at.clone(),
                resolution: super::data_plan::resolve_resolution(&file, ctx).map_err(named)?,
                batch_size: super::plan::batch_size(ctx, file.batch_size).map_err(named)?,
                buckets: super::data_plan::resolve_buckets(&file, ctx).map_err(named)?,
            })
        })
        .collect()
}

/// kohya does not mix DreamBooth and fine-tuning subsets in one dataset.
fn check_kind_mix(tables: &[toml::Table], at: &str, cx: &TomlCtx<'_>) -> Result<(), ConfigError> {
    let ft = tables
        .iter()
        .filter(|t| t.contains_key("metadata_file"))
        .count();
    if ft > 0 && ft < tables.len() {
        return Err(cx.invalid(
            &format!("{at}.subsets"),
            "mixes DreamBooth subsets (image_dir) with fine-tuning ones (metadata_file); kohya \
             keeps them in separate datasets, so split them into two `[[datasets]]`"
                .into(),
        ));
    }
    Ok(())
}

/// What one subset is resolved from.
struct SubsetInput<'a> {
    chain: &'a Chain<'a>,
    file: &'a TrainFile,
    cx: &'a TomlCtx<'a>,
    /// The TOML file, whose folder relative paths are looked up in first.
    toml: &'a Ctx<'a>,
    /// train.json, for its fallbacks' errors.
    train: &'a Ctx<'a>,
    name: String,
    dataset: usize,
}

impl SubsetInput<'_> {
    /// A path the config gives at `key`: beside the TOML when it exists there, else as written
    /// (from the working directory, kohya's rule), absolute.
    fn path(&self, key: &str, raw: &str) -> Result<PathBuf, ConfigError> {
        self.toml.input_path(&format!("{}.{key}", self.name), raw)
    }

    fn fraction(&self, key: &str, fallback: Option<f64>) -> Result<f64, ConfigError> {
        match self.chain.number(key) {
            Some((v, at)) if !(0.0..=1.0).contains(&v) => Err(self
                .cx
                .invalid(&at, format!("must be between 0 and 1 (got {v})"))),
            Some((v, _)) => Ok(v),
            None => Ok(fallback.unwrap_or(0.0)),
        }
    }

    fn count(&self, key: &str, fallback: Option<i64>, default: i64) -> Result<usize, ConfigError> {
        match self.chain.int(key) {
            Some((v, at)) if v < 0 => {
                Err(self.cx.invalid(&at, format!("must be 0 or more (got {v})")))
            }
            Some((v, _)) => Ok(v as usize),
            None => Ok(fallback.unwrap_or(default).max(0) as usize),
        }
    }
}

/// One subset, or `None` for one kohya skips (`num_repeats` below 1, with a warning).
fn resolve_subset(
    s: &SubsetInput<'_>,
    ignored: &mut BTreeSet<String>,
) -> Result<Option<KohyaSubset>, ConfigError> {
    refuse_unsupported(s)?;
    for key in ["custom_attributes", "resize_interpolation"] {
        if let Some((_, at)) = s.chain.get(key) {
            ignored.insert(at);
        }
    }
    let repeats = s.chain.int("num_repeats").map_or(1, |(v, _)| v);
    if repeats < 1 {
        crate::console::say(format_args!(
            "warning: dataset config {}: {} has num_repeats {repeats}, not used (as kohya)",
            s.cx.file.display(),
            s.name
        ));
        return Ok(None);
    }
    let source = subset_source(s)?;
    let is_reg = s.chain.levels[0].0.get("is_reg").and_then(|v| v.as_bool()) == Some(true);
    if is_reg && matches!(source, SubsetSource::FineTuning { .. }) {
        return Err(s.cx.invalid(
            &format!("{}.is_reg", s.name),
            "applies to DreamBooth subsets (image_dir); a fine-tuning subset (metadata_file) \
             holds no regularization images in kohya"
                .into(),
        ));
    }
    let f = s.file;
    let flip_p = match s.chain.bool("flip_aug") {
        Some((on, _)) => {
            if on {
                FLIP_AUG_P
            } else {
                0.0
            }
        }
        None => s.file.flip_p.unwrap_or(0.0),
    };
    let text = |key: &str, fallback: &Option<String>| {
        s.chain
            .text(key)
            .map(|(t, _)| t.to_string())
            .or_else(|| fallback.clone())
            .filter(|t| !t.is_empty())
    };
    Ok(Some(KohyaSubset {
        name: s.name.clone(),
        index: 0,
        dataset: s.dataset,
        source,
        num_repeats: repeats as u64,
        is_reg,
        flip_p,
        caption_dropout: s.fraction("caption_dropout_rate", f.cond_dropout)?,
        caption_prefix: text("caption_prefix", &f.caption_prefix),
        caption_suffix: text("caption_suffix", &f.caption_suffix),
        captions: Arc::new(subset_captions(s)?),
        validation: match is_reg {
            // kohya never splits regularization images.
            true => None,
            false => subset_split(s)?,
        },
        loss_weight: onetrainer_concept(s)
            .and_then(|c| c.get("loss_weight"))
            .and_then(|v| v.as_float())
            .unwrap_or(1.0),
    }))
}

/// The subset's dataset's `validation_split` and `validation_seed` (each its dataset's, else
/// `[general]`'s, else train.json's or the kohya config's), when the split is above 0.
fn subset_split(s: &SubsetInput<'_>) -> Result<Option<SubsetSplit>, ConfigError> {
    let split = match s.chain.number("validation_split") {
        Some((v, at)) if !(0.0..1.0).contains(&v) => {
            return Err(s
                .cx
                .invalid(&at, format!("must be at least 0 and below 1 (got {v})")))
        }
        Some((v, _)) => v,
        None => s.file.validation_split.unwrap_or(0.0),
    };
    if split <= 0.0 {
        return Ok(None);
    }
    Ok(Some(SubsetSplit {
        split,
        // Python's `random.seed` takes an integer's absolute value.
        seed: s
            .chain
            .int("validation_seed")
            .map(|(v, _)| v.unsigned_abs()),
    }))
}

/// What sdtrain cannot train, refused with the reason.
fn refuse_unsupported(s: &SubsetInput<'_>) -> Result<(), ConfigError> {
    let refuse = |at: String, why: &str| Err(s.cx.invalid(&at, why.to_string()));
    if let Some((true, at)) = s.chain.bool("color_aug") {
        return refuse(
            at,
            "is not supported: sdtrain has no colour augmentation (kohya's random hue shift, \
             which also rules out its latent cache); set it to false",
        );
    }
    if let Some((true, at)) = s.chain.bool("random_crop") {
        return refuse(
            at,
            "is not supported as kohya's random crop; sdtrain's is EveryDream2's `crop_jitter` \
             in train.json. Set it to false",
        );
    }
    if let Some((_, at)) = s.chain.get("face_crop_aug_range") {
        return refuse(
            at,
            "is not supported: sdtrain does not crop around faces; remove it",
        );
    }
    if let Some((_, at)) = s.chain.get("conditioning_data_dir") {
        return refuse(
            at,
            "makes this a ControlNet subset, and sdtrain does not train ControlNet",
        );
    }
    Ok(())
}

/// The subset's images: `image_dir` (DreamBooth) or `metadata_file` (fine-tuning).
fn subset_source(s: &SubsetInput<'_>) -> Result<SubsetSource, ConfigError> {
    let own = s.chain.levels[0].0;
    let own_text = |key: &str| own.get(key).and_then(|v| v.as_str());
    let field = |key: &str| format!("{}.{key}", s.name);
    let image_dir = match own_text("image_dir") {
        Some(raw) => {
            let dir = s.path("image_dir", raw)?;
            if !dir.is_dir() {
                let problem = if dir.exists() {
                    "is not a folder"
                } else {
                    "does not exist"
                };
                return Err(s
                    .cx
                    .invalid(&field("image_dir"), format!("{} {problem}", dir.display())));
            }
            Some(dir)
        }
        None => None,
    };
    if let Some(raw) = own_text("metadata_file") {
        for key in ["class_tokens", "caption_extension"] {
            if let Some((_, at)) = s.chain.levels[..2]
                .iter()
                .find_map(|(t, at)| t.get(key).map(|v| (v, format!("{at}.{key}"))))
            {
                return Err(s.cx.invalid(
                    &at,
                    "applies to DreamBooth subsets (image_dir); a fine-tuning subset's captions \
                     come from its metadata_file"
                        .into(),
                ));
            }
        }
        let metadata_file = s.path("metadata_file", raw)?;
        if !metadata_file.is_file() {
            return Err(s.cx.invalid(
                &field("metadata_file"),
                format!(
                    "{} is not a file (kohya's metadata .json or .jsonl)",
                    metadata_file.display()
                ),
            ));
        }
        return Ok(SubsetSource::FineTuning {
            metadata_file,
            image_dir,
        });
    }
    let Some(image_dir) = image_dir else {
        return Err(s.cx.invalid(
            &field("image_dir"),
            "is missing: a subset names its folder of images (or a metadata_file)".into(),
        ));
    };
    if let Some(c) = onetrainer_concept(s) {
        return Ok(concept_source(image_dir, c));
    }
    let ext = match s.chain.text("caption_extension") {
        Some((e, at)) => caption_extension(e).map_err(|why| s.cx.invalid(&at, why))?,
        None => match s.file.caption_extension.as_deref() {
            Some(e) => {
                caption_extension(e).map_err(|why| s.train.invalid("caption_extension", why))?
            }
            None => DEFAULT_CAPTION_EXTENSION.to_string(),
        },
    };
    Ok(SubsetSource::DreamBooth {
        image_dir,
        class_tokens: s.chain.text("class_tokens").map(|(t, _)| t.to_string()),
        caption_extension: ext,
    })
}

/// The subset's caption settings.
fn subset_captions(s: &SubsetInput<'_>) -> Result<SubsetCaptions, ConfigError> {
    let f = s.file;
    let separator = match s.chain.text("caption_separator") {
        Some(("", at)) => return Err(s.cx.invalid(&at, "must not be empty".into())),
        Some((sep, _)) => sep.to_string(),
        None => CAPTION_SEPARATOR.to_string(),
    };
    let marker = |key: &str, fallback: &Option<String>| -> Result<Option<String>, ConfigError> {
        let (value, at) = match s.chain.text(key) {
            Some((v, at)) => (Some(v.to_string()), at),
            None => (fallback.clone(), key.to_string()),
        };
        match value.filter(|v| !v.is_empty()) {
            Some(v) if v == separator => Err(s.cx.invalid(
                &at,
                format!("is the caption separator {v:?}; it must be a marker of its own"),
            )),
            v => Ok(v),
        }
    };
    let keep_sep = marker("keep_tokens_separator", &f.keep_tokens_separator)?;
    let secondary = marker("secondary_separator", &f.secondary_separator)?;
    if keep_sep.is_some() && keep_sep == secondary {
        return Err(s.cx.invalid(
            &format!("{}.secondary_separator", s.name),
            "is the same as keep_tokens_separator; they mark different things".into(),
        ));
    }
    let warmup_step = match s.chain.number("token_warmup_step") {
        Some((v, at)) if !(v.is_finite() && v >= 0.0) => {
            return Err(s.cx.invalid(
                &at,
                format!("must be 0 or more steps, or below 1 a fraction of the run (got {v})"),
            ))
        }
        Some((v, _)) => v,
        None => f.token_warmup_step.unwrap_or(0.0),
    };
    let token_warmup = (warmup_step > 0.0)
        .then(|| -> Result<TokenWarmup, ConfigError> {
            Ok(TokenWarmup {
                min: s.count("token_warmup_min", f.token_warmup_min, 1)?,
                steps: warmup_step,
            })
        })
        .transpose()?;
    Ok(SubsetCaptions {
        shuffle: s
            .chain
            .bool("shuffle_caption")
            .map_or(f.shuffle_tags.unwrap_or(false), |(v, _)| v),
        // train.json's `keep_tags` counts after the main prompt, kohya's `keep_tokens` from it.
        keep_tokens: s.count("keep_tokens", f.keep_tags.map(|k| k + 1), 0)?,
        separator,
        tag_dropout: s.fraction("caption_tag_dropout_rate", f.caption_tag_dropout_rate)?,
        tag_dropout_mode: match onetrainer_concept(s)
            .and_then(|c| c.get("tag_dropout_mode"))
            .and_then(toml::Value::as_str)
        {
            Some("FULL") => TagDropoutMode::Whole,
            Some("RANDOM WEIGHTED") => TagDropoutMode::Weighted,
            _ => TagDropoutMode::PerTag,
        },
        keys: KohyaCaptions {
            keep_tokens_separator: keep_sep,
            secondary_separator: secondary,
            wildcard: s
                .chain
                .bool("enable_wildcard")
                .map_or(f.enable_wildcard.unwrap_or(false), |(v, _)| v),
            dropout_every_n_epochs: s.count(
                "caption_dropout_every_n_epochs",
                f.caption_dropout_every_n_epochs,
                0,
            )?,
            token_warmup,
            random_line: onetrainer_concept(s)
                .and_then(|c| c.get("random_line"))
                .and_then(toml::Value::as_bool)
                .unwrap_or(false),
        },
    })
}

/// The table a OneTrainer config's concept carries (`super::onetrainer_concepts`), which no
/// dataset config can hold (its schema refuses the key).
fn onetrainer_concept<'a>(s: &SubsetInput<'a>) -> Option<&'a toml::Table> {
    s.chain.levels[0]
        .0
        .get(ONETRAINER_CONCEPT)
        .and_then(toml::Value::as_table)
}

/// A OneTrainer concept's own subset key (set by `super::onetrainer_concepts` only).
pub(super) const ONETRAINER_CONCEPT: &str = "onetrainer_concept";

/// A OneTrainer concept's images: its folder, subfolders and prompt source.
fn concept_source(image_dir: PathBuf, c: &toml::Table) -> SubsetSource {
    use crate::data::onetrainer_concept::{ConceptBalancing, ConceptPrompts};
    let text = |k: &str| c.get(k).and_then(toml::Value::as_str).unwrap_or_default();
    let prompts = match text("prompt_source") {
        "filename" => ConceptPrompts::FileName,
        "concept" => ConceptPrompts::File {
            path: PathBuf::from(text("prompt_path")),
        },
        _ => ConceptPrompts::Sample,
    };
    let balancing = c
        .get("balancing")
        .and_then(|v| v.as_float().or_else(|| v.as_integer().map(|i| i as f64)))
        .unwrap_or(1.0);
    SubsetSource::Concept {
        image_dir,
        recursive: c
            .get("include_subdirectories")
            .and_then(toml::Value::as_bool)
            .unwrap_or(false),
        prompts,
        lowercase: c
            .get("lowercase")
            .and_then(toml::Value::as_bool)
            .unwrap_or(false),
        balancing: match text("balancing_strategy") {
            "SAMPLES" => ConceptBalancing::Samples(balancing),
            _ => ConceptBalancing::Repeats(balancing),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn apply(toml: &str, file: &mut TrainFile) -> Result<DatasetConfigPlan, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("a")).unwrap();
        std::fs::write(dir.path().join("d.toml"), toml).unwrap();
        file.dataset_config = Some("d.toml".into());
        let train = dir.path().join("train.json");
        let plan = apply_dataset_config(file, &Ctx::new(&train))?;
        Ok(plan.unwrap())
    }

    /// kohya's fallbacks: the subset, its dataset, `[general]`, then train.json (where kohya
    /// reads its command line), then kohya's default; dataset keys replace train.json's. Catches
    /// a level skipped or read in the wrong order, train.json's `keep_tags` taken as kohya's
    /// `keep_tokens` (one fewer kept), EveryDream2's `cond_dropout` default (0.04) where kohya's
    /// is 0, and the config's resolution or batch size lost.
    #[test]
    fn settings_fall_back_as_kohyas_and_dataset_keys_replace_train_json() {
        let toml = "[general]\nkeep_tokens = 2\nresolution = 768\n\
                    [[datasets]]\nbatch_size = 3\ncaption_dropout_rate = 0.2\n\
                    [[datasets.subsets]]\nimage_dir = 'a'\n\
                    [[datasets.subsets]]\nimage_dir = 'a'\nshuffle_caption = false\nflip_aug = false\nkeep_tokens = 0\n";
        let mut file = TrainFile {
            shuffle_tags: Some(true),
            keep_tags: Some(4),
            flip_p: Some(0.3),
            resolution: Some(512),
            ..TrainFile::default()
        };
        let plan = apply(toml, &mut file).unwrap();
        let (a, b) = (&plan.subsets[0], &plan.subsets[1]);
        assert_eq!((a.captions.shuffle, a.captions.keep_tokens), (true, 2));
        assert_eq!((b.captions.shuffle, b.captions.keep_tokens), (false, 0));
        assert_eq!((a.flip_p, b.flip_p), (0.3, 0.0));
        assert_eq!((a.caption_dropout, b.caption_dropout), (0.2, 0.2));
        assert_eq!((file.resolution, file.batch_size), (Some(768), Some(3)));

        let mut bare = TrainFile {
            keep_tags: Some(1),
            ..TrainFile::default()
        };
        let plan = apply(
            "[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\n",
            &mut bare,
        )
        .unwrap();
        let s = &plan.subsets[0];
        assert_eq!(
            s.captions.keep_tokens, 2,
            "keep_tags 1 keeps the main prompt and one tag"
        );
        assert_eq!((s.caption_dropout, s.flip_p, s.num_repeats), (0.0, 0.0, 1));
        assert!(!s.captions.shuffle);
        assert_eq!(plan.prior_loss_weight, 1.0);
    }

    /// Each dataset's shape falls back as its subsets' settings do: its own key, `[general]`'s,
    /// then train.json's (kohya's command line). The run's own keys are the first dataset's.
    /// Catches a later dataset given the first one's keys, `[general]` skipped, train.json's
    /// bucket keys lost for a dataset that leaves them out, and a dataset without buckets refused
    /// for the bucket keys it inherits.
    #[test]
    fn each_dataset_has_its_own_resolution_batch_and_buckets() {
        let toml = "[general]
batch_size = 2
                    [[datasets]]
resolution = 768
[[datasets.subsets]]
image_dir = 'a'
                    [[datasets]]
batch_size = 5
enable_bucket = false
                    [[datasets.subsets]]
image_dir = 'a'
                    [[datasets]]
min_bucket_reso = 320
[[datasets.subsets]]
image_dir = 'a'
";
        let mut file = TrainFile {
            resolution: Some(512),
            bucket_reso_steps: Some(32),
            ..TrainFile::default()
        };
        let plan = apply(toml, &mut file).unwrap();
        let shape = |i: usize| {
            let s = &plan.shapes[i];
            let kohya = s.buckets.as_ref().and_then(|b| b.kohya);
            (
                s.name.as_str(),
                s.resolution,
                s.batch_size,
                s.buckets.is_some(),
                kohya.map(|k| (k.min, k.steps)),
            )
        };
        assert_eq!(
            shape(0),
            ("datasets[0]", Some(768), 2, true, Some((256, 32)))
        );
        assert_eq!(shape(1), ("datasets[1]", Some(512), 5, false, None));
        assert_eq!(
            shape(2),
            ("datasets[2]", Some(512), 2, true, Some((320, 32)))
        );
        assert!(plan.mixed_shapes());
        assert_eq!((file.resolution, file.batch_size), (Some(768), Some(2)));
        // The subsets know their datasets.
        let datasets: Vec<usize> = plan.subsets.iter().map(|s| s.dataset).collect();
        assert_eq!(datasets, [0, 1, 2]);
    }

    /// `enable_bucket = true` in a dataset config generates kohya's sizes, with kohya's
    /// command-line range (256 to 1024 in steps of 64) where neither the config nor train.json
    /// gives one; a dataset that leaves buckets to train.json keeps train.json's (EveryDream2's
    /// table). Catches EveryDream2's table given to kohya's switch, and kohya's range forced over
    /// train.json's own.
    #[test]
    fn kohyas_enable_bucket_makes_kohyas_sizes() {
        let toml = "[[datasets]]\nenable_bucket = true\n[[datasets.subsets]]\nimage_dir = 'a'\n\
                    [[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\n";
        let plan = apply(toml, &mut TrainFile::default()).unwrap();
        let kohya = |i: usize| {
            let b = plan.shapes[i].buckets.as_ref().unwrap();
            b.kohya.map(|k| (k.min, k.max, k.steps))
        };
        assert_eq!((kohya(0), kohya(1)), (Some((256, 1024, 64)), None));
        let mut file = TrainFile {
            max_bucket_reso: Some(2048),
            ..TrainFile::default()
        };
        let plan = apply(toml, &mut file).unwrap();
        let b = plan.shapes[0].buckets.as_ref().unwrap().kohya.unwrap();
        assert_eq!((b.min, b.max, b.steps), (256, 2048, 64));
    }

    #[test]
    fn a_subset_with_no_repeats_is_left_out_and_unsupported_keys_are_refused() {
        let toml = "[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\n\
                    [[datasets.subsets]]\nimage_dir = 'a'\nnum_repeats = 0\n";
        let plan = apply(toml, &mut TrainFile::default()).unwrap();
        assert_eq!(plan.subsets.len(), 1);
        for (key, value) in [
            ("random_crop", "true"),
            ("face_crop_aug_range", "[2.0, 4.0]"),
            ("conditioning_data_dir", "'a'"),
            ("network_multiplier", "0.5"),
            ("resolution", "[512, 768]"),
        ] {
            let at = if key == "network_multiplier" || key == "resolution" {
                "[[datasets]]\n"
            } else {
                ""
            };
            let toml = match at {
                "" => format!(
                    "[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\n{key} = {value}\n"
                ),
                _ => format!(
                    "[[datasets]]\n{key} = {value}\n[[datasets.subsets]]\nimage_dir = 'a'\n"
                ),
            };
            let err = apply(&toml, &mut TrainFile::default())
                .unwrap_err()
                .to_string();
            assert!(err.contains(key) && err.contains("d.toml"), "{err}");
        }
    }
}
