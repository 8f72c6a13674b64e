//! [`DataPlan`]: the data keys of train.json resolved: the image folder, resolution, buckets,
//! augmentation, the validation set, and the two caches: the latent cache as asked for, and the
//! text-encoder cache as decided ([`TextCacheDecision`]), once, here.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::ctx::Ctx;
use super::dataset_config::DatasetConfigPlan;
use super::error::ConfigError;
use super::layout_plan::resolve_layout;
use super::regularization_plan::{resolve_regularization, RegularizationPlan};
use super::train_file::TrainFile;
use super::validation_plan::{resolve_validation, SplitRule, ValidationPlan};
use crate::data::kohya_layout::DEFAULT_CAPTION_EXTENSION;
use crate::data::rated::RatedSchedule;
use crate::data::DataLayout;

/// EveryDream2's `--cond_dropout` default.
pub const DEFAULT_COND_DROPOUT: f64 = 0.04;
/// EveryDream2's default `crop_jitter`.
pub const DEFAULT_CROP_JITTER: f64 = 0.02;
/// What every model sdtrain trains needs of a bucket's sides, at least; each model needs a
/// multiple of its own alignment too (VAE factor × 2^UNet downsamples: 64 for SD1.x/SD2.x, 32 for
/// SDXL), checked once it loads.
pub const ASPECT_MULTIPLE: i64 = 8;

/// Data loading and augmentation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DataPlan {
    /// Absolute path of an existing folder.
    pub data_root: PathBuf,
    /// How `data_root` (and `reg_data_root`) are read.
    pub layout: DataLayout,
    /// Regularization images trained beside `data_root`'s.
    pub regularization: Option<RegularizationPlan>,
    /// diffusers' DreamBooth `instance_prompt`: the caption of every `data_root` image without
    /// one of its own (EveryDream2's layout), instead of its file name's.
    pub instance_prompt: Option<String>,
    /// kohya's dataset config, which names the images instead of `data_root` (then the config
    /// file's folder) and `reg_data_root`.
    pub dataset_config: Option<DatasetConfigPlan>,
    /// Square training size in pixels, a multiple of 64 in [64, 4096]; `None` uses the model's
    /// native resolution.
    pub resolution: Option<usize>,
    /// Probability of a horizontal flip, in [0, 1].
    pub flip_p: f64,
    /// Probability of training on an empty caption, in [0, 1].
    pub cond_dropout: f64,
    /// Shuffle comma-separated caption tags, keeping the first.
    pub shuffle_tags: bool,
    /// Tags after the main prompt that the shuffle keeps in place (`keep_tags`).
    pub keep_tags: usize,
    /// kohya's `caption_tag_dropout_rate`: each tag after the kept ones is dropped with this
    /// probability, per sample and step.
    pub tag_dropout: f64,
    /// kohya's `caption_prefix` and `caption_suffix`, on every image's caption (training,
    /// regularization and validation images); `None` when absent or empty.
    pub caption_prefix: Option<String>,
    pub caption_suffix: Option<String>,
    /// kohya's `keep_tokens_separator`, `secondary_separator` and `enable_wildcard`.
    pub kohya_captions: crate::data::kohya_caption::KohyaCaptions,
    /// The 75-token chunks a caption is encoded in (kohya's `max_token_length` / 75: 1, 2 or
    /// 3); see `crate::model::long_prompt`.
    pub caption_chunks: usize,
    /// kohya's `weighted_captions`: A1111's emphasis in captions weighs their tokens.
    pub weighted_captions: bool,
    /// EveryDream2's rated dataset: later epochs train on fewer images, picked by rating.
    pub rated: Option<RatedSchedule>,
    /// Write each epoch's batches to `ep{N}_batch_schedule.txt` in the run folder.
    pub write_schedule: bool,
    /// Images with more pixels are skipped, from their header, before decoding.
    pub max_image_pixels: u64,
    /// The validation loss, when `validation_split` or `validation_data_root` is set.
    pub validation: Option<ValidationPlan>,
    /// Aspect-ratio buckets; `None` trains squares (`enable_bucket: false`).
    pub buckets: Option<BucketPlan>,
    /// EveryDream2's `crop_jitter`, in [0, 0.25]; 0 centres every crop.
    pub crop_jitter: f64,
    /// VAE latents computed once per image and flip.
    pub cache_latents: CacheLatents,
    /// Caption encodings computed once before training, or why not.
    pub text_cache: TextCacheDecision,
}

/// Which aspect buckets a run uses.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BucketPlan {
    /// The sizes given by `aspects`, `(width, height)`; `None`: generated for the resolution.
    pub aspects: Option<Vec<(usize, usize)>>,
    /// `max_aspect_ratio`.
    pub max_ratio: Option<f64>,
    /// kohya's `min_bucket_reso`, `max_bucket_reso` and `bucket_reso_steps`: the sizes generated
    /// as kohya's `make_bucket_resolutions` does.
    pub kohya: Option<KohyaBucketRange>,
}

/// What one dataset trains at: its resolution, micro-batch and buckets. A run without a dataset
/// config has one, from train.json; kohya's dataset config has one per `[[datasets]]`, each
/// from its own keys over `[general]` and train.json's, as kohya's `BlueprintGenerator` resolves
/// them. Each micro-batch holds images of one dataset and one bucket, as in kohya's
/// `DatasetGroup`, whose datasets make their batches apart.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DatasetShape {
    /// `datasets[i]`, or `train.json`.
    pub name: String,
    /// As [`DataPlan::resolution`]: `None` is the model's native resolution.
    pub resolution: Option<usize>,
    pub batch_size: usize,
    /// As [`DataPlan::buckets`].
    pub buckets: Option<BucketPlan>,
}

impl DatasetShape {
    /// The resolution on a model whose native one is `native`.
    pub fn resolution_or(&self, native: usize) -> usize {
        self.resolution.unwrap_or(native)
    }
}

/// kohya's bucket keys, each side a multiple of `steps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KohyaBucketRange {
    pub min: usize,
    pub max: usize,
    pub steps: usize,
    /// `bucket_no_upscale`: each image gets its own bucket, never larger than itself
    /// (`crate::data::bucket::kohya_no_upscale_bucket`).
    pub no_upscale: bool,
}

/// Where cached latents live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheLatents {
    Off,
    Memory,
    Disk,
}

/// Whether each distinct caption is encoded once before training, after which the text
/// encoders leave the device. It applies only when nothing can change a caption's encoding
/// during the run: no text-encoder parameter trains, captions are not shuffled and none is
/// dropped. The trainer, the memory plan and the summary all read this one decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TextCacheDecision {
    On,
    Off(TextCacheOff),
}

/// Why the text-encoder cache is off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TextCacheOff {
    /// `cache_text_encoder_outputs: false`.
    Disabled,
    /// A text encoder (or its adapter) trains.
    TextEncoderTrains,
    ShuffleTags,
    /// `caption_tag_dropout_rate` drops tags every step.
    TagDropout,
    /// `enable_wildcard` picks a caption line and choices every step.
    Wildcard,
    /// `token_warmup_step` grows the captions step by step.
    TokenWarmup,
    /// A OneTrainer concept's caption files hold several captions, one drawn each step.
    CaptionLines,
}

impl TextCacheDecision {
    /// The decision, first reason first: `enabled` is `cache_text_encoder_outputs`,
    /// `text_encoder_trains` whether any text-encoder parameter is in an optimizer group,
    /// `tag_dropout` whether `caption_tag_dropout_rate` is above 0. `cond_dropout` does not turn
    /// it off: its empty caption is cached with the others.
    pub fn decide(
        enabled: bool,
        text_encoder_trains: bool,
        shuffle_tags: bool,
        tag_dropout: bool,
    ) -> Self {
        let off = if !enabled {
            TextCacheOff::Disabled
        } else if text_encoder_trains {
            TextCacheOff::TextEncoderTrains
        } else if shuffle_tags {
            TextCacheOff::ShuffleTags
        } else if tag_dropout {
            TextCacheOff::TagDropout
        } else {
            return TextCacheDecision::On;
        };
        TextCacheDecision::Off(off)
    }

    pub fn is_on(self) -> bool {
        self == TextCacheDecision::On
    }
}

impl fmt::Display for TextCacheOff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TextCacheOff::Disabled => "cache_text_encoder_outputs is false",
            TextCacheOff::TextEncoderTrains => "a text encoder trains",
            TextCacheOff::ShuffleTags => "shuffle_tags changes captions every step",
            TextCacheOff::TagDropout => "caption_tag_dropout_rate changes captions every step",
            TextCacheOff::Wildcard => "enable_wildcard changes captions every step",
            TextCacheOff::TokenWarmup => "token_warmup_step changes captions step by step",
            TextCacheOff::CaptionLines => {
                "caption files of several lines draw one of them every step"
            }
        })
    }
}

/// The data keys. `text_encoder_trains`: whether any text-encoder parameter trains (the text
/// cache depends on it).
pub(super) fn resolve_data(
    file: &TrainFile,
    ctx: &Ctx<'_>,
    text_encoder_trains: bool,
    dataset_config: Option<DatasetConfigPlan>,
) -> Result<DataPlan, ConfigError> {
    let (data_root, layout, regularization) = match &dataset_config {
        Some(config) => (
            config_folders(file, ctx, config)?,
            DataLayout::Kohya {
                caption_extension: DEFAULT_CAPTION_EXTENSION.to_string(),
            },
            None,
        ),
        None => {
            let data_root = resolve_data_root(file, ctx)?;
            let layout = resolve_layout(file, ctx, Some(&data_root))?;
            if data_root.is_file() && layout != DataLayout::Everydream {
                return Err(ctx.invalid(
                    "data_root",
                    "names a JSON dataset, which is EveryDream2's (data_layout \"everydream\"); \
                     the other layouts read folders"
                        .into(),
                ));
            }
            let regularization = resolve_regularization(file, ctx, &data_root, &layout)?;
            (data_root, layout, regularization)
        }
    };
    let instance_prompt = resolve_instance_prompt(file, ctx, &layout, dataset_config.is_some())?;
    let resolution = resolve_resolution(file, ctx)?;
    let cache_latents = match (file.cache_latents, file.cache_latents_to_disk) {
        (_, Some(true)) => CacheLatents::Disk,
        (Some(true), _) => CacheLatents::Memory,
        _ => CacheLatents::Off,
    };
    let crop_jitter = resolve_crop_jitter(file, ctx, cache_latents)?;
    let flip_p = ctx.fraction("flip_p", file.flip_p, 0.0)?;
    let cond_dropout = ctx.fraction("cond_dropout", file.cond_dropout, DEFAULT_COND_DROPOUT)?;
    let shuffle_tags = file.shuffle_tags.unwrap_or(false);
    let tag_dropout = ctx.fraction(
        "caption_tag_dropout_rate",
        file.caption_tag_dropout_rate,
        0.0,
    )?;
    let kohya_captions = resolve_kohya_captions(file, ctx)?;
    let validation = resolve_validation(file, ctx)?.map(|mut v| {
        // A dataset config's split is its subsets' own, as kohya draws it.
        if dataset_config.is_some() && v.split_rule == SplitRule::Sdtrain {
            v.split_rule = SplitRule::Kohya;
        }
        v
    });
    Ok(DataPlan {
        data_root,
        layout,
        regularization,
        instance_prompt,
        resolution,
        flip_p,
        cond_dropout,
        shuffle_tags,
        keep_tags: ctx.at_least("keep_tags", file.keep_tags, 0, 0)? as usize,
        tag_dropout,
        caption_prefix: file.caption_prefix.clone().filter(|p| !p.is_empty()),
        caption_suffix: file.caption_suffix.clone().filter(|s| !s.is_empty()),
        text_cache: match TextCacheDecision::decide(
            file.cache_text_encoder_outputs.unwrap_or(true),
            text_encoder_trains,
            shuffle_tags,
            tag_dropout > 0.0,
        ) {
            TextCacheDecision::On if kohya_captions.wildcard => {
                TextCacheDecision::Off(TextCacheOff::Wildcard)
            }
            TextCacheDecision::On if kohya_captions.token_warmup.is_some() => {
                TextCacheDecision::Off(TextCacheOff::TokenWarmup)
            }
            TextCacheDecision::On => {
                match dataset_config.as_ref().and_then(|c| c.per_step_captions()) {
                    Some(why) => TextCacheDecision::Off(why),
                    None => TextCacheDecision::On,
                }
            }
            d => d,
        },
        dataset_config,
        kohya_captions,
        caption_chunks: match file.max_token_length {
            None | Some(75) => 1,
            Some(150) => 2,
            Some(225) => 3,
            Some(n) => {
                return Err(ctx.invalid(
                    "max_token_length",
                    format!("must be 75, 150 or 225 (kohya's choices; got {n})"),
                ))
            }
        },
        weighted_captions: file.weighted_captions.unwrap_or(false),
        rated: resolve_rated(file, ctx)?,
        write_schedule: file.write_schedule.unwrap_or(false),
        max_image_pixels: ctx.at_least(
            "max_image_pixels",
            file.max_image_pixels,
            crate::data::DEFAULT_MAX_PIXELS,
            1,
        )?,
        validation,
        buckets: resolve_buckets(file, ctx)?,
        crop_jitter,
        cache_latents,
    })
}

/// diffusers' `instance_prompt`: a non-empty prompt, read by EveryDream2's layout alone (kohya's
/// folders name their class tokens, an imagefolder's rows their captions, a dataset config its
/// subsets' `class_tokens`).
fn resolve_instance_prompt(
    file: &TrainFile,
    ctx: &Ctx<'_>,
    layout: &DataLayout,
    dataset_config: bool,
) -> Result<Option<String>, ConfigError> {
    let Some(prompt) = file.instance_prompt.as_deref() else {
        return Ok(None);
    };
    if prompt.trim().is_empty() {
        return Err(ctx.invalid("instance_prompt", "must not be empty".into()));
    }
    let other = match (dataset_config, layout) {
        (true, _) => Some("a dataset_config, whose subsets give `class_tokens`"),
        (false, DataLayout::Everydream) => None,
        (false, DataLayout::Kohya { .. }) => {
            Some("kohya's layout, whose folder names give the class tokens")
        }
        (false, DataLayout::ImageFolder { .. }) => {
            Some("the imagefolder layout, whose metadata rows give the captions")
        }
    };
    match other {
        Some(why) => Err(ctx.invalid(
            "instance_prompt",
            format!("captions EveryDream2's folders; it is not read with {why}"),
        )),
        None => Ok(Some(prompt.to_string())),
    }
}

/// `resolution`: a multiple of 64 in [64, 4096], or `None` for the model's native one.
pub(super) fn resolve_resolution(
    file: &TrainFile,
    ctx: &Ctx<'_>,
) -> Result<Option<usize>, ConfigError> {
    match file.resolution {
        None => Ok(None),
        Some(r) if (64..=4096).contains(&r) && r % 64 == 0 => Ok(Some(r.unsigned_abs() as usize)),
        Some(r) => Err(ctx.invalid(
            "resolution",
            format!("must be a multiple of 64 between 64 and 4096 (got {r})"),
        )),
    }
}

/// kohya's `keep_tokens_separator` and `secondary_separator` (not empty, not the tag separator
/// `,`, and not each other) and `enable_wildcard`.
fn resolve_kohya_captions(
    file: &TrainFile,
    ctx: &Ctx<'_>,
) -> Result<crate::data::kohya_caption::KohyaCaptions, ConfigError> {
    let separator = |key: &str, v: &Option<String>| match v.as_deref() {
        None => Ok(None),
        Some(s) if s.trim().is_empty() || s.trim() == "," => Err(ctx.invalid(
            key,
            format!(
                "is {s:?}; it must be a marker such as \"|||\" or \";;;\", not empty or a comma"
            ),
        )),
        Some(s) => Ok(Some(s.to_string())),
    };
    let keep = separator("keep_tokens_separator", &file.keep_tokens_separator)?;
    let secondary = separator("secondary_separator", &file.secondary_separator)?;
    if keep.is_some() && keep == secondary {
        return Err(ctx.invalid(
            "secondary_separator",
            "is the same as keep_tokens_separator; they mark different things".into(),
        ));
    }
    let every = ctx.at_least(
        "caption_dropout_every_n_epochs",
        file.caption_dropout_every_n_epochs,
        0,
        0,
    )? as usize;
    let warmup = match file.token_warmup_step {
        None => None,
        Some(s) if !(s.is_finite() && s >= 0.0) => {
            return Err(ctx.invalid(
                "token_warmup_step",
                format!("must be 0 or more steps, or below 1 a fraction of the run (got {s})"),
            ))
        }
        Some(0.0) => None,
        Some(steps) => Some(crate::data::kohya_caption::TokenWarmup {
            min: ctx.at_least("token_warmup_min", file.token_warmup_min, 1, 0)? as usize,
            steps,
        }),
    };
    if warmup.is_none() && file.token_warmup_min.is_some() {
        return Err(ctx.invalid(
            "token_warmup_min",
            "has no effect without token_warmup_step".into(),
        ));
    }
    Ok(crate::data::kohya_caption::KohyaCaptions {
        keep_tokens_separator: keep,
        secondary_separator: secondary,
        wildcard: file.enable_wildcard.unwrap_or(false),
        random_line: false,
        dropout_every_n_epochs: every,
        token_warmup: warmup,
    })
}

/// `rated_dataset` and `rated_dataset_target_dropout_percent` (EveryDream2's default 50): the
/// schedule spans `max_epochs` (EveryDream2's 300 when neither it nor `max_steps` is set).
fn resolve_rated(file: &TrainFile, ctx: &Ctx<'_>) -> Result<Option<RatedSchedule>, ConfigError> {
    let percent = file.rated_dataset_target_dropout_percent.unwrap_or(50.0);
    if !(0.0..=100.0).contains(&percent) {
        return Err(ctx.invalid(
            "rated_dataset_target_dropout_percent",
            format!("must be a percentage from 0 to 100 (got {percent})"),
        ));
    }
    if !file.rated_dataset.unwrap_or(false) {
        return Ok(None);
    }
    let max_epochs = match (file.max_epochs, file.max_steps) {
        (Some(e), _) => ctx.at_least("max_epochs", Some(e), 1, 1)?,
        (None, None) => super::plan::DEFAULT_MAX_EPOCHS,
        (None, Some(_)) => {
            return Err(ctx.invalid(
                "rated_dataset",
                "needs `max_epochs`: its schedule shrinks the set over the run's epochs".into(),
            ))
        }
    };
    Ok(Some(RatedSchedule {
        target_percent: percent,
        max_epochs,
    }))
}

/// With a dataset config: its folder stands for `data_root` (in messages and the run's
/// metadata). Drawing class images needs `reg_data_root`, which the config replaces, and
/// `rated_dataset` does not combine with its regularization subsets.
fn config_folders(
    file: &TrainFile,
    ctx: &Ctx<'_>,
    config: &DatasetConfigPlan,
) -> Result<PathBuf, ConfigError> {
    for (key, set) in [
        ("class_prompt", file.class_prompt.is_some()),
        ("num_class_images", file.num_class_images.is_some()),
    ] {
        if set {
            return Err(ctx.invalid(
                key,
                "draws class images into reg_data_root, which a dataset_config replaces; draw \
                 them beforehand and add their folder as an `is_reg = true` subset"
                    .into(),
            ));
        }
    }
    if file.rated_dataset == Some(true) && config.subsets.iter().any(|s| s.is_reg) {
        return Err(ctx.invalid(
            "rated_dataset",
            "does not combine with the dataset config's `is_reg` subsets: the regularization \
             set is sized once to the training set (as kohya sizes it), which rated_dataset \
             shrinks epoch by epoch"
                .into(),
        ));
    }
    Ok(config
        .file
        .parent()
        .map_or_else(|| config.file.clone(), Path::to_path_buf))
}

/// `data_root`: required, and an existing folder.
fn resolve_data_root(file: &TrainFile, ctx: &Ctx<'_>) -> Result<PathBuf, ConfigError> {
    let Some(raw) = file.data_root.as_deref() else {
        return Err(ConfigError::Missing {
            file: ctx.file.to_path_buf(),
            field: "data_root",
            hint: "the folder of training images",
        });
    };
    let data_root = ctx.input_path("data_root", raw)?;
    let problem = if !data_root.exists() {
        Some("does not exist")
    } else if !data_root.is_dir() && !crate::data::scan::is_json_dataset(&data_root) {
        Some("is not a folder (nor EveryDream2's JSON dataset, a .json file)")
    } else {
        None
    };
    if let Some(problem) = problem {
        let looked = match ctx.input_candidates(raw).as_slice() {
            [_, _] => " (relative paths are looked up beside the config file, then in the working directory)",
            _ => "",
        };
        return Err(ConfigError::DataRoot {
            file: ctx.file.to_path_buf(),
            path: PathBuf::from(raw),
            problem: format!("{problem}{looked}"),
        });
    }
    Ok(data_root)
}

/// `crop_jitter`: a cache holds one crop per image, so it is 0 with one.
fn resolve_crop_jitter(
    file: &TrainFile,
    ctx: &Ctx<'_>,
    cache_latents: CacheLatents,
) -> Result<f64, ConfigError> {
    Ok(match (file.crop_jitter, cache_latents) {
        (Some(j), _) if !(0.0..=0.25).contains(&j) => {
            return Err(ctx.invalid(
                "crop_jitter",
                format!("must be between 0 and 0.25 (got {j})"),
            ))
        }
        (Some(j), CacheLatents::Memory | CacheLatents::Disk) if j > 0.0 => {
            return Err(ctx.invalid(
                "crop_jitter",
                format!(
                    "is {j}, but cached latents hold one crop per image; set crop_jitter to 0 or \
                     turn cache_latents off"
                ),
            ))
        }
        (Some(j), _) => j,
        // A cache holds the centre crop; without one, EveryDream2's default.
        (None, CacheLatents::Off) => DEFAULT_CROP_JITTER,
        (None, _) => 0.0,
    })
}

pub(super) fn resolve_buckets(
    file: &TrainFile,
    ctx: &Ctx<'_>,
) -> Result<Option<BucketPlan>, ConfigError> {
    let max_ratio = match file.max_aspect_ratio {
        Some(r) if !(r >= 1.0 && r.is_finite()) => {
            return Err(ctx.invalid(
                "max_aspect_ratio",
                format!("must be a ratio of at least 1, such as 2 for 2:1 (got {r})"),
            ))
        }
        r => r,
    };
    let aspects = match &file.aspects {
        None => None,
        Some(list) if list.is_empty() => {
            return Err(ctx.invalid("aspects", "must list at least one [width, height]".into()))
        }
        Some(list) => Some(
            list.iter()
                .enumerate()
                .map(|(i, pair)| aspect(ctx, i, pair))
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    let kohya = resolve_kohya_buckets(file, ctx)?;
    if let (Some(_), Some(_)) = (&kohya, &aspects) {
        return Err(ctx.invalid(
            "aspects",
            "lists the bucket sizes, so min_bucket_reso, max_bucket_reso and bucket_reso_steps \
             (which generate them) would have no effect; keep one or the other"
                .into(),
        ));
    }
    if file.enable_bucket == Some(false) {
        if kohya.is_some() {
            return Err(ctx.invalid(
                "enable_bucket",
                "is false, so min_bucket_reso, max_bucket_reso, bucket_reso_steps and \
                 bucket_no_upscale would have no effect; remove them or turn buckets on"
                    .into(),
            ));
        }
        if aspects.is_some() || max_ratio.is_some() {
            return Err(ctx.invalid(
                "enable_bucket",
                "is false, so aspects and max_aspect_ratio would have no effect; remove them or \
                 turn buckets on"
                    .into(),
            ));
        }
        return Ok(None);
    }
    Ok(Some(BucketPlan {
        aspects,
        max_ratio,
        kohya,
    }))
}

/// kohya's bucket keys, when any is set (kohya's defaults for the others: 256, 1024, 64), each
/// rounded to `bucket_reso_steps` as kohya's `adjust_min_max_bucket_reso_by_steps` does (the
/// shortest side down, the longest up), and `bucket_no_upscale`.
fn resolve_kohya_buckets(
    file: &TrainFile,
    ctx: &Ctx<'_>,
) -> Result<Option<KohyaBucketRange>, ConfigError> {
    let no_upscale = file.bucket_no_upscale == Some(true);
    let (min, max, steps) = (
        file.min_bucket_reso,
        file.max_bucket_reso,
        file.bucket_reso_steps,
    );
    if min.is_none() && max.is_none() && steps.is_none() && !no_upscale {
        return Ok(None);
    }
    let steps = ctx.at_least("bucket_reso_steps", steps, 64, 8)? as usize;
    if !steps.is_multiple_of(ASPECT_MULTIPLE as usize) {
        return Err(ctx.invalid(
            "bucket_reso_steps",
            format!("must be a multiple of {ASPECT_MULTIPLE} (got {steps})"),
        ));
    }
    let min = ctx.at_least("min_bucket_reso", min, 256, 1)? as usize;
    let max = ctx.at_least("max_bucket_reso", max, 1024, 1)? as usize;
    let min = min - min % steps;
    let max = max.div_ceil(steps) * steps;
    if min == 0 || min > max || max > 8192 {
        return Err(ctx.invalid(
            "min_bucket_reso",
            format!(
                "and max_bucket_reso must give 0 < shortest ≤ longest ≤ 8192 once rounded to \
                 bucket_reso_steps {steps} (got {min} and {max})"
            ),
        ));
    }
    Ok(Some(KohyaBucketRange {
        min,
        max,
        steps,
        no_upscale,
    }))
}

/// Entry `i` of `aspects`: `[width, height]`, each side 8 to 8192 pixels and a multiple of
/// [`ASPECT_MULTIPLE`]. The model's own alignment is checked when it loads.
fn aspect(ctx: &Ctx<'_>, i: usize, pair: &[i64]) -> Result<(usize, usize), ConfigError> {
    let (w, h) = match pair {
        [w, h] if (8..=8192).contains(w) && (8..=8192).contains(h) => (*w, *h),
        _ => {
            return Err(ctx.invalid(
                "aspects",
                format!(
                    "entry {i} must be [width, height] in pixels, each 8 to 8192 (got {pair:?})"
                ),
            ))
        }
    };
    if w % ASPECT_MULTIPLE != 0 || h % ASPECT_MULTIPLE != 0 {
        return Err(ctx.invalid(
            "aspects",
            format!(
                "entry {i} is {w}x{h}: both sides must be multiples of {ASPECT_MULTIPLE} (and of \
                 the model's alignment: 64 for SD1.x/SD2.x, 32 for SDXL)"
            ),
        ));
    }
    Ok((w as usize, h as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first reason that applies is the one given.
    #[test]
    fn text_cache_off_reasons_in_order() {
        let decide = |e, te, shuffle| TextCacheDecision::decide(e, te, shuffle, false);
        assert_eq!(decide(true, false, false), TextCacheDecision::On);
        let off = |d: TextCacheDecision| match d {
            TextCacheDecision::Off(why) => why.to_string(),
            TextCacheDecision::On => panic!("on"),
        };
        assert!(off(decide(false, true, true)).contains("false"));
        assert!(off(decide(true, true, true)).contains("text encoder"));
        assert!(off(decide(true, false, true)).contains("shuffle_tags"));
        let tags = TextCacheDecision::decide(true, false, false, true);
        assert!(off(tags).contains("caption_tag_dropout_rate"));
    }
}
