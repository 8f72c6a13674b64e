//! Training data: scanning a `data_root`, captions, image decoding, augmentation and the
//! per-epoch order.
//!
//! The flow is [`scan`] (file names, captions and `multiply.txt`, no pixels) →
//! [`load_dataset`] (each header read in parallel for the upright size; bad files skipped and
//! counted) → [`bucket`] (each image's aspect bucket) → per epoch [`epoch_plan`] (micro-batches
//! of one bucket each) → [`prefetch`] (decode, crop and resize of the next step's images on a
//! background thread while the current step runs) → the augmentations in [`augment`] and
//! [`to_tensor`]. Scanning and captions follow EveryDream2's conventions
//! (`data/dataset.py`, `utils/fs_helpers.py`); every place that differs on purpose says so.

pub mod augment;
pub mod bucket;
pub mod caption;
pub mod caption_templates;
pub mod dataset;
pub mod epoch_plan;
pub mod image_config;
pub mod image_load;
pub mod imagefolder;
pub mod kohya_caption;
pub mod kohya_layout;
pub mod kohya_split;
pub mod kohya_subsets;
pub mod mask;
pub mod onetrainer_concept;
pub mod prefetch;
pub mod py_random;
pub mod rated;
pub mod regularization;
pub mod scan;
pub mod schedule;
pub mod tag_shuffle;
pub mod truncation;
pub mod undersized;

use std::path::PathBuf;

pub use augment::{cond_dropout, flip_p, hflip, shuffle_tags, to_tensor};
pub use bucket::{aspect_buckets, nearest_bucket, Bucket};
pub use dataset::{
    epoch_order, load_data_root, load_data_root_limited, load_dataset, load_source,
    pick_multiplied, DataSource, ImageMeta, LoadedDataset,
};
pub use epoch_plan::{epoch_batches, EpochBatches, MicroBatch};
pub use image_load::{
    cover_size, jittered_crop, load_image, load_image_jittered, load_image_limited, load_image_to,
    load_with_mask, probe_image, resize_and_crop, TrainImage, DEFAULT_MAX_PIXELS,
};
pub use kohya_layout::DataLayout;
pub use scan::{scan, ImageRecord, IMAGE_EXTENSIONS};
pub use tag_shuffle::ItemOptions;

/// How many skipped files a "no usable image" error lists before it says "and N more".
const LISTED_SKIPS: usize = 3;

/// Everything that can go wrong between a `data_root` and a batch tensor.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{key} {} does not exist", root.display())]
    RootMissing { key: &'static str, root: PathBuf },
    #[error("{key} {} is a file, not a folder of images", root.display())]
    RootNotAFolder { key: &'static str, root: PathBuf },
    #[error("cannot read folder {}", path.display())]
    ReadDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {}", path.display())]
    WriteFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read {}", path.display())]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{}: multiply.txt must hold one finite, non-negative number such as `2` or `0.5`, \
         found `{text}`",
        path.display()
    )]
    Multiply { path: PathBuf, text: String },
    #[error("{}: {reason}", path.display())]
    ImageConfig { path: PathBuf, reason: String },
    #[error("{}: {reason}", path.display())]
    Text { path: PathBuf, reason: String },
    #[error(
        "{}: no caption: there is no sibling .txt or .caption file (or it is empty) and the file \
         name gives none (the caption is the file name's text before the first `_`)",
        path.display()
    )]
    EmptyCaption { path: PathBuf },
    #[error(
        "no images ({}) under {key} {}{}",
        IMAGE_EXTENSIONS.join(", "),
        root.display(),
        if *excluded > 0 {
            format!(" ({excluded} excluded by a multiply.txt of 0)")
        } else {
            String::new()
        }
    )]
    NoImages {
        key: &'static str,
        root: PathBuf,
        excluded: usize,
    },
    #[error(
        "no images ({}) in the `<repeats>_<class tokens>` subfolders of {key} {} (kohya's \
         layout, `data_layout: \"kohya\"`; {subsets} such folder{} found)",
        IMAGE_EXTENSIONS.join(", "),
        root.display(),
        if *subsets == 1 { "" } else { "s" }
    )]
    NoKohyaImages {
        key: &'static str,
        root: PathBuf,
        subsets: usize,
    },
    #[error("{}: {reason}", path.display())]
    Decode { path: PathBuf, reason: String },
    #[error(
        "no usable image under {key} {}: {found} found, all {} skipped ({})",
        root.display(),
        skipped.len(),
        list_skipped(skipped)
    )]
    NoUsableImages {
        key: &'static str,
        root: PathBuf,
        found: usize,
        skipped: Vec<(PathBuf, String)>,
    },
    #[error("target size {width}x{height} is invalid: both sides must be at least 1 pixel")]
    InvalidSize { width: usize, height: usize },
    #[error("cannot batch zero images")]
    EmptyBatch,
    #[error(
        "cannot batch {}: it is {width}x{height} but the batch is {batch_width}x{batch_height}",
        path.display()
    )]
    BatchShape {
        path: PathBuf,
        width: usize,
        height: usize,
        batch_width: usize,
        batch_height: usize,
    },
    #[error("{}: pixel buffer holds {len} bytes, expected {expected} for {width}x{height} RGB", path.display())]
    PixelBuffer {
        path: PathBuf,
        len: usize,
        expected: usize,
        width: usize,
        height: usize,
    },
    #[error("building the image batch tensor")]
    Tensor(#[from] candle_core::Error),
}

fn list_skipped(skipped: &[(PathBuf, String)]) -> String {
    let mut parts: Vec<String> = skipped
        .iter()
        .take(LISTED_SKIPS)
        .map(|(path, reason)| format!("{}: {reason}", path.display()))
        .collect();
    if skipped.len() > LISTED_SKIPS {
        parts.push(format!("and {} more", skipped.len() - LISTED_SKIPS));
    }
    parts.join("; ")
}
