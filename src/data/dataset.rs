//! The dataset (what each image is, not its pixels) and its per-epoch order.
//!
//! [`load_dataset`] reads every scanned image's header in parallel (rayon) behind an indicatif
//! bar: its upright size, for the aspect bucket, without decoding it, so a set of 10,000 photos
//! costs a few hundred bytes each in memory. A file that cannot be read (corrupt, truncated by
//! its container, empty, over the pixel limit) is skipped with a warning on stderr naming it and
//! the reason, and listed in [`LoadedDataset::skipped`]; the kept images stay in scan order
//! whatever the thread timing. Pixels are decoded when a batch needs them (see
//! [`super::prefetch`]).
//!
//! An epoch is [`pick_multiplied`] (which images, how often) followed by [`epoch_order`] (in what
//! order). Both are pure functions of `(seed, epoch)`, so a resumed run replays the data order.
//! They use `StdRng` (ChaCha12 in rand 0.9), which the lockfile pins.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use super::image_load::{probe_image, DEFAULT_MAX_PIXELS};
use super::kohya_layout::{scan_kohya_with, DataLayout};
use super::py_random::PyRandom;
use super::rated::{pick_rated, RatedSchedule};
use super::scan::ImageRecord;
use super::tag_shuffle::ItemOptions;
use super::DataError;

/// Stream separators mixed into the seed, so the multiplier draw and the shuffle of one epoch
/// use unrelated random streams.
const ORDER_STREAM: u64 = 0x006f_7264_6572;
const MULTIPLY_STREAM: u64 = 0x6d75_6c74_6970_6c79;
const RATED_STREAM: u64 = 0x0072_6174_6564;

/// One usable training image: where it is, its caption, its repeat count and its upright size.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageMeta {
    pub path: PathBuf,
    pub caption: String,
    /// How many times an epoch repeats this image (from `multiply.txt`).
    pub multiplier: f64,
    /// `(width, height)` after EXIF orientation, from the header.
    pub size: (usize, usize),
    /// The image's own settings, from its files.
    pub options: Arc<ItemOptions>,
}

impl ImageMeta {
    /// kohya's `caption_prefix` and `caption_suffix` on this image's caption
    /// ([`super::caption::with_affixes`]). An image whose main prompt and tags came from its
    /// YAML (which the tag shuffle reads instead of the caption) gets the prefix on its main
    /// prompt and the suffix on its last tag, where kohya's comma split puts them.
    pub fn add_affixes(&mut self, prefix: Option<&str>, suffix: Option<&str>) {
        let (prefix, suffix) = (
            prefix.filter(|p| !p.is_empty()),
            suffix.filter(|s| !s.is_empty()),
        );
        if prefix.is_none() && suffix.is_none() {
            return;
        }
        self.caption = super::caption::with_affixes(&self.caption, prefix, suffix);
        let o = &self.options;
        if o.main.is_empty() && o.tags.is_empty() {
            return;
        }
        let mut options = (**o).clone();
        options.main = super::caption::with_affixes(&options.main, prefix, None);
        match options.tags.last_mut() {
            Some(last) => *last = super::caption::with_affixes(last, None, suffix),
            None => options.main = super::caption::with_affixes(&options.main, None, suffix),
        }
        self.options = Arc::new(options);
    }
}

/// The usable images, in scan order, and the files that were skipped with the reason.
#[derive(Debug, Clone)]
pub struct LoadedDataset {
    pub items: Vec<ImageMeta>,
    pub skipped: Vec<(PathBuf, String)>,
}

impl LoadedDataset {
    /// The item indices of epoch `epoch`: each image repeated by its multiplier (fractions drawn
    /// per epoch, see [`pick_multiplied`]), then shuffled by [`epoch_order`].
    pub fn epoch_indices(&self, seed: u64, epoch: usize) -> Vec<usize> {
        self.epoch_indices_rated(seed, epoch, None)
    }

    /// [`Self::epoch_indices`], or with `rated`, once its fraction for `epoch` is under 1, the
    /// images [`pick_rated`] picks by rating (each once), shuffled by [`epoch_order`].
    pub fn epoch_indices_rated(
        &self,
        seed: u64,
        epoch: usize,
        rated: Option<&RatedSchedule>,
    ) -> Vec<usize> {
        if let Some(fraction) = rated.map(|r| r.fraction(epoch)).filter(|&f| f < 1.0) {
            // EveryDream2 sorts by rating (stable) before picking.
            let mut by_rating: Vec<usize> = (0..self.items.len()).collect();
            by_rating.sort_by(|&a, &b| {
                let (ra, rb) = (self.items[a].options.rating, self.items[b].options.rating);
                ra.total_cmp(&rb)
            });
            let ratings: Vec<f64> = by_rating
                .iter()
                .map(|&i| self.items[i].options.rating)
                .collect();
            let mut rng = PyRandom::new(mix_seed(seed, epoch, RATED_STREAM));
            let picked: Vec<usize> = pick_rated(&ratings, fraction, &mut rng)
                .into_iter()
                .map(|p| by_rating[p])
                .collect();
            return epoch_order(picked.len(), seed, epoch)
                .into_iter()
                .map(|i| picked[i])
                .collect();
        }
        let multipliers: Vec<f64> = self.items.iter().map(|item| item.multiplier).collect();
        let mut rng = StdRng::seed_from_u64(mix_seed(seed, epoch, MULTIPLY_STREAM));
        let picked = pick_multiplied(&multipliers, &mut rng);
        epoch_order(picked.len(), seed, epoch)
            .into_iter()
            .map(|i| picked[i])
            .collect()
    }

    /// How many samples an epoch holds: `floor(Σ multipliers)`, as in ED2.
    pub fn epoch_len(&self) -> usize {
        let total: f64 = self.items.iter().map(|item| item.multiplier).sum();
        total.floor() as usize
    }
}

/// [`scan`] then [`load_dataset`], with errors naming `data_root`.
pub fn load_data_root(data_root: &Path, show_progress: bool) -> Result<LoadedDataset, DataError> {
    load_data_root_limited(data_root, show_progress, DEFAULT_MAX_PIXELS)
}

/// [`load_data_root`] skipping images of more than `max_pixels` pixels (`max_image_pixels`).
pub fn load_data_root_limited(
    data_root: &Path,
    show_progress: bool,
    max_pixels: u64,
) -> Result<LoadedDataset, DataError> {
    let source = DataSource {
        key: "data_root",
        root: data_root,
        layout: &DataLayout::Everydream,
        max_pixels,
        all_caption_lines: false,
        default_caption: None,
    };
    load_source(&source, show_progress)
}

/// A folder of training images as train.json names it.
#[derive(Debug, Clone, Copy)]
pub struct DataSource<'a> {
    /// The train.json key that names it, for errors.
    pub key: &'static str,
    pub root: &'a Path,
    pub layout: &'a DataLayout,
    /// Images with more pixels are skipped (`max_image_pixels`).
    pub max_pixels: u64,
    /// kohya's layout: read every line of a caption file (`enable_wildcard`), not the first.
    pub all_caption_lines: bool,
    /// EveryDream2's layout: the caption of an image without its own, instead of its file
    /// name's (diffusers' `instance_prompt` or `class_prompt`; [`super::scan::scan_captioned`]).
    pub default_caption: Option<&'a str>,
}

/// The folder's images, scanned by its layout, then [`load_dataset`]'s header read; errors name
/// the key.
pub fn load_source(
    source: &DataSource<'_>,
    show_progress: bool,
) -> Result<LoadedDataset, DataError> {
    let records = match source.layout {
        DataLayout::Everydream => {
            super::scan::scan_captioned(source.key, source.root, source.default_caption)?
        }
        DataLayout::Kohya { caption_extension } => scan_kohya_with(
            source.key,
            source.root,
            caption_extension,
            source.all_caption_lines,
        )?,
        DataLayout::ImageFolder { caption_column } => {
            super::imagefolder::scan_imagefolder(source.key, source.root, caption_column)?
        }
    };
    load_records(
        &records,
        show_progress,
        source.key,
        source.root,
        source.max_pixels,
    )
}

/// Reads the headers of `records`, skipping (and reporting) files that fail. The progress bar
/// shows when `show_progress` is set and stderr is a terminal.
pub fn load_dataset(
    records: &[ImageRecord],
    show_progress: bool,
) -> Result<LoadedDataset, DataError> {
    let root = common_folder(records.iter().map(|r| r.path.as_path()));
    load_records(
        records,
        show_progress,
        "data_root",
        &root,
        DEFAULT_MAX_PIXELS,
    )
}

/// Reads the headers of `records` (images of several folders, such as a dataset config's
/// subsets), skipping (and reporting) files that fail; errors name `key` and `root`.
pub fn load_records(
    records: &[ImageRecord],
    show_progress: bool,
    key: &'static str,
    root: &Path,
    max_pixels: u64,
) -> Result<LoadedDataset, DataError> {
    let bar = progress_bar(records.len(), show_progress);
    // `collect` on an indexed parallel iterator keeps the input order.
    let results: Vec<Result<ImageMeta, DataError>> = records
        .par_iter()
        .map(|record| {
            let meta = probe_image(&record.path, max_pixels).map(|size| ImageMeta {
                path: record.path.clone(),
                caption: record.caption.clone(),
                multiplier: record.multiplier,
                size,
                options: record.options.clone(),
            });
            bar.inc(1);
            meta
        })
        .collect();
    bar.finish_and_clear();

    let mut items = Vec::with_capacity(records.len());
    let mut skipped = Vec::new();
    for (record, result) in records.iter().zip(results) {
        match result {
            Ok(image) => items.push(image),
            Err(DataError::Decode { reason, .. }) => {
                crate::console::say(format_args!(
                    "warning: skipping {}: {reason}",
                    record.path.display()
                ));
                skipped.push((record.path.clone(), reason));
            }
            Err(other) => return Err(other),
        }
    }
    if items.is_empty() {
        return Err(DataError::NoUsableImages {
            key,
            root: root.to_path_buf(),
            found: records.len(),
            skipped,
        });
    }
    Ok(LoadedDataset { items, skipped })
}

fn progress_bar(len: usize, show: bool) -> ProgressBar {
    let target = if show && std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(len as u64), target);
    if let Ok(style) =
        ProgressStyle::with_template("reading images [{bar:30}] {pos}/{len} {per_sec} eta {eta}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// The deepest folder holding every path (the data_root when they came from one scan).
fn common_folder<'a>(paths: impl Iterator<Item = &'a Path>) -> PathBuf {
    let mut common: Option<PathBuf> = None;
    for path in paths {
        let parent = path.parent().unwrap_or(Path::new(""));
        common = Some(match common {
            None => parent.to_path_buf(),
            Some(current) => current
                .components()
                .zip(parent.components())
                .take_while(|(a, b)| a == b)
                .map(|(a, _)| a)
                .collect(),
        });
    }
    common.unwrap_or_default()
}

/// A deterministic permutation of `0..n` for `(seed, epoch)`.
pub fn epoch_order(n: usize, seed: u64, epoch: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = StdRng::seed_from_u64(mix_seed(seed, epoch, ORDER_STREAM));
    order.shuffle(&mut rng);
    order
}

/// Which items an epoch trains on, with repeats, in item order (ED2's
/// `DataLoaderMultiAspect.__pick_multiplied_set`, `data/data_loader.py`): every item appears
/// `floor(m)` times; then, until the epoch holds `floor(Σ m)` samples, passes over the items add
/// each one whose fractional part beats a uniform draw, at most once. Multipliers of 1 draw
/// nothing.
pub fn pick_multiplied(multipliers: &[f64], rng: &mut impl Rng) -> Vec<usize> {
    let total: f64 = multipliers.iter().sum();
    let epoch_len = total.floor() as usize;
    let mut picked = Vec::with_capacity(epoch_len);
    let mut fractions = Vec::with_capacity(multipliers.len());
    for (i, &m) in multipliers.iter().enumerate() {
        let whole = m.floor();
        picked.extend(std::iter::repeat_n(i, whole as usize));
        fractions.push(m - whole);
    }
    let mut remaining = epoch_len.saturating_sub(picked.len());
    // Rounding can leave `remaining` larger than the fractions can fill; stop when none is left.
    while remaining > 0 && fractions.iter().any(|&f| f > 0.0) {
        for (i, fraction) in fractions.iter_mut().enumerate() {
            if rng.random::<f64>() < *fraction {
                picked.push(i);
                *fraction = 0.0;
                remaining -= 1;
                if remaining == 0 {
                    break;
                }
            }
        }
    }
    picked.sort_unstable();
    picked
}

/// splitmix64's finaliser, to spread `(seed, epoch, stream)` over the whole seed space.
pub(crate) fn mix_seed(seed: u64, epoch: usize, stream: u64) -> u64 {
    let mut z = seed ^ (epoch as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ stream;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The caption always; a YAML-tagged image's main prompt and last tag too (the shuffle
    /// reads those). Catches the shuffle losing the prefix, or the suffix added twice.
    #[test]
    fn affixes_reach_the_caption_and_the_parts_the_shuffle_reads() {
        let meta = |options: ItemOptions| ImageMeta {
            path: PathBuf::from("a.png"),
            caption: "sks dog, grass, sky".into(),
            multiplier: 1.0,
            size: (64, 64),
            options: Arc::new(options),
        };
        let mut plain = meta(ItemOptions::default());
        plain.add_affixes(Some("photo of"), Some("8k"));
        assert_eq!(plain.caption, "photo of sks dog, grass, sky 8k");
        assert!(plain.options.main.is_empty() && plain.options.tags.is_empty());
        let mut tagged = meta(ItemOptions {
            main: "sks dog".into(),
            tags: vec!["grass".into(), "sky".into()],
            ..ItemOptions::default()
        });
        tagged.add_affixes(Some("photo of"), Some("8k"));
        assert_eq!(tagged.options.main, "photo of sks dog");
        assert_eq!(tagged.options.tags, ["grass", "sky 8k"]);
        let mut untouched = meta(ItemOptions::default());
        untouched.add_affixes(Some(""), None);
        assert_eq!(untouched.caption, "sks dog, grass, sky");
    }

    #[test]
    fn epoch_order_is_a_deterministic_permutation() {
        for n in [0, 1, 2, 7, 100] {
            let a = epoch_order(n, 42, 3);
            assert_eq!(a, epoch_order(n, 42, 3));
            let mut sorted = a.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..n).collect::<Vec<_>>());
        }
        assert_ne!(epoch_order(100, 42, 3), epoch_order(100, 42, 4));
        assert_ne!(epoch_order(100, 42, 3), epoch_order(100, 43, 3));
    }

    #[test]
    fn whole_multipliers_repeat_exactly() {
        let mut rng = StdRng::seed_from_u64(0);
        assert_eq!(
            pick_multiplied(&[1.0, 3.0, 2.0], &mut rng),
            vec![0, 1, 1, 1, 2, 2]
        );
    }

    #[test]
    fn fractional_multipliers_fill_floor_of_the_sum_once_each() {
        // 4 × 0.5 + 1 → floor(3.0) = 3: item 4 once, and two of the four halves.
        let multipliers = [0.5, 0.5, 0.5, 0.5, 1.0];
        let mut counts = [0usize; 5];
        for epoch in 0..200 {
            let mut rng = StdRng::seed_from_u64(epoch);
            let picked = pick_multiplied(&multipliers, &mut rng);
            assert_eq!(picked.len(), 3);
            let mut dedup = picked.clone();
            dedup.dedup();
            assert_eq!(
                dedup.len(),
                3,
                "a fractional item was picked twice: {picked:?}"
            );
            for i in picked {
                counts[i] += 1;
            }
        }
        assert_eq!(counts[4], 200);
        assert!(counts[..4].iter().all(|&c| c > 40), "{counts:?}");
    }

    #[test]
    fn pick_is_deterministic_and_terminates_on_rounding() {
        let m = [0.1; 10]; // Σ = 0.999… → floor 0
        let mut rng = StdRng::seed_from_u64(1);
        assert!(pick_multiplied(&m, &mut rng).is_empty());
        let m = [1.5, 2.25, 0.75];
        let a = pick_multiplied(&m, &mut StdRng::seed_from_u64(9));
        let b = pick_multiplied(&m, &mut StdRng::seed_from_u64(9));
        assert_eq!(a, b);
        assert_eq!(a.len(), 4);
    }

    #[test]
    fn common_folder_of_scanned_paths() {
        let paths = [
            Path::new("/d/root/a.png"),
            Path::new("/d/root/sub/b.png"),
            Path::new("/d/root/sub2/c.png"),
        ];
        assert_eq!(
            common_folder(paths.iter().copied()),
            PathBuf::from("/d/root")
        );
    }
}
