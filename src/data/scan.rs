//! Finding the training images under a `data_root`, with their captions and repeat counts.
//!
//! EveryDream2's rules (`utils/fs_helpers.py` `walk_and_visit`/`is_image`, `data/dataset.py`
//! `Dataset.from_path`/`__local_cfg`):
//! - The walk is recursive; files and folders whose name starts with `.` are skipped.
//! - Images are recognised by extension, case-insensitively: jpg, jpeg, png, webp, bmp, and jfif
//!   (ED2's list; JFIF is JPEG). A `<stem>-masklabel.png` is the loss mask of `<stem>`'s image
//!   (OneTrainer's convention, [`super::mask`]) and never a training image, masked loss on or off.
//! - `multiply.txt` in a folder holds a number (it may be fractional) that applies to the images
//!   directly in that folder only: it is a "local" setting in ED2, not inherited by subfolders.
//!   How a fractional multiplier is honoured each epoch is [`super::pick_multiplied`]'s job.
//! - Captions: see [`super::caption`]; every other per-image and per-folder setting
//!   (`global.yaml`, `local.yaml`, `<stem>.yaml`, `flip_p.txt`, `cond_dropout.txt`, …): see
//!   [`super::image_config`].
//!
//! kohya's DreamBooth folders (`10_sks dog/`: 10 repeats, caption "sks dog" from the name) are
//! read as EveryDream2 reads them (captions from the files, repeats from `multiply.txt`); when a
//! folder so named holds images whose caption comes from their file name, one warning says so.
//!
//! Deliberate differences: the order is sorted by path (ED2 uses the file system's order), a
//! malformed `multiply.txt` is an error naming it (ED2 logs a warning and uses 1), images whose
//! folder multiplier is 0 are dropped here instead of being carried and never picked, and a folder
//! reached twice through symbolic links is walked once.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::caption::{caption_from_file_name, read_caption_file, CAPTION_EXTENSIONS};
use super::image_config::{self, ImageConfig, YAML_EXTENSIONS};
use super::tag_shuffle::ItemOptions;
use super::DataError;

/// Image extensions the scanner picks up, compared case-insensitively: EveryDream2's, kohya's
/// (without its optional Pillow plugins) and OneTrainer's `.tif`/`.tiff`.
pub const IMAGE_EXTENSIONS: [&str; 8] =
    ["jpg", "jpeg", "png", "webp", "bmp", "jfif", "tif", "tiff"];

/// Image formats other trainers may read (OneTrainer's AVIF, kohya's AVIF and JPEG XL through
/// Pillow plugins) or a dataset may hold, which sdtrain does not decode. Such files are left out
/// with one warning naming them, rather than silently.
pub const UNREAD_IMAGE_EXTENSIONS: [&str; 7] = ["avif", "jxl", "heic", "heif", "gif", "tga", "psd"];

/// True when `path` has one of [`UNREAD_IMAGE_EXTENSIONS`], in any case.
pub fn is_unread_image(path: &Path) -> bool {
    path.extension().and_then(OsStr::to_str).is_some_and(|ext| {
        UNREAD_IMAGE_EXTENSIONS
            .iter()
            .any(|known| known.eq_ignore_ascii_case(ext))
    })
}

/// The one warning for the `files` of formats sdtrain does not read, found under `place`
/// (`data_root`, a subset's folder): how many of each extension, and the first file.
pub fn unread_warning(place: &str, files: &[PathBuf]) -> Option<String> {
    let first = files.first()?;
    let mut counts: Vec<(String, usize)> = Vec::new();
    for f in files {
        let ext = f
            .extension()
            .map(|e| e.to_string_lossy().to_ascii_lowercase())
            .unwrap_or_default();
        match counts.iter_mut().find(|(e, _)| *e == ext) {
            Some((_, n)) => *n += 1,
            None => counts.push((ext, 1)),
        }
    }
    let list: Vec<String> = counts.iter().map(|(e, n)| format!(".{e} ×{n}")).collect();
    Some(format!(
        "warning: {place}: {} image{} in a format sdtrain cannot read left out ({}; the first: \
         {}); convert them to PNG, JPEG, WebP, BMP or TIFF to train on them",
        files.len(),
        if files.len() == 1 { "" } else { "s" },
        list.join(", "),
        first.display()
    ))
}

/// The per-folder repeat file.
pub const MULTIPLY_FILE: &str = "multiply.txt";

/// One image found by [`scan`]: where it is, its caption and how many times an epoch repeats it.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageRecord {
    pub path: PathBuf,
    pub caption: String,
    /// From the folder's `multiply.txt` or a YAML `multiply`, else 1. Always finite and
    /// positive.
    pub multiplier: f64,
    /// The image's own settings and caption parts.
    pub options: Arc<ItemOptions>,
}

/// Scans `data_root` recursively and returns its images sorted by path.
pub fn scan(data_root: &Path) -> Result<Vec<ImageRecord>, DataError> {
    scan_as("data_root", data_root)
}

/// [`scan`] of the folder train.json's `key` names (errors name the key).
pub fn scan_as(key: &'static str, root: &Path) -> Result<Vec<ImageRecord>, DataError> {
    scan_captioned(key, root, None)
}

/// [`scan_as`] where an image with no caption of its own (no caption file, no YAML main prompt)
/// takes `default_caption` instead of its file name's: diffusers' DreamBooth `instance_prompt`
/// and `class_prompt`, the one prompt its script trains every image of the folder with.
pub fn scan_captioned(
    key: &'static str,
    root: &Path,
    default_caption: Option<&str>,
) -> Result<Vec<ImageRecord>, DataError> {
    if is_json_dataset(root) {
        return scan_json(root, default_caption);
    }
    check_root(key, root)?;
    let walk = walk(key, root, default_caption)?;
    if let Some(line) = unread_warning(key, &walk.unread) {
        crate::console::say(format_args!("{line}"));
    }
    if let Some(first) = walk.kohya.first() {
        crate::console::say(format_args!("{}", kohya_warning(first, walk.kohya.len())));
    }
    Ok(walk.records)
}

/// Whether `path` is EveryDream2's JSON dataset: an existing file ending in `.json`
/// (`data/resolver.py`'s rule).
pub fn is_json_dataset(path: &Path) -> bool {
    path.is_file() && path.extension().is_some_and(|e| e == "json")
}

/// EveryDream2's JSON dataset at `path` (`JSONResolver`, `Dataset.from_json`): one image per
/// entry, in list order, with the entry's settings and its caption as EveryDream2 makes it (the
/// file name's when it gives none, or `default_caption`). A relative `image` is looked up beside
/// the JSON file, then in the working directory (EveryDream2 opens it from the working
/// directory); an image that is not there is reported with the other unreadable files.
fn scan_json(path: &Path, default_caption: Option<&str>) -> Result<Vec<ImageRecord>, DataError> {
    let dir = path.parent().unwrap_or(Path::new(""));
    let mut records = Vec::new();
    for (raw, cfg) in image_config::read_json_dataset(path)? {
        let given = Path::new(&raw);
        let image = match (given.is_absolute(), dir.join(given)) {
            (false, beside) if beside.exists() => beside,
            _ => given.to_path_buf(),
        };
        let cfg = match (default_caption, cfg.main_prompts.is_empty()) {
            (Some(prompt), true) => cfg.merge(&ImageConfig::from_caption(prompt)),
            _ => cfg,
        };
        let multiplier = cfg.multiply.unwrap_or(1.0);
        if multiplier == 0.0 {
            continue;
        }
        let (caption, options) = resolve_item(&image, cfg)?;
        records.push(ImageRecord {
            path: image,
            caption,
            multiplier,
            options: Arc::new(options),
        });
    }
    if records.is_empty() {
        return Err(DataError::Text {
            path: path.to_path_buf(),
            reason: "lists no image to train (EveryDream2's JSON dataset)".into(),
        });
    }
    Ok(records)
}

/// That `root` (train.json's `key`) is an existing folder.
pub fn check_root(key: &'static str, root: &Path) -> Result<(), DataError> {
    let root_buf = || root.to_path_buf();
    match std::fs::metadata(root) {
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Err(DataError::RootMissing {
            key,
            root: root_buf(),
        }),
        Err(source) => Err(DataError::ReadDir {
            path: root_buf(),
            source,
        }),
        Ok(meta) if !meta.is_dir() => Err(DataError::RootNotAFolder {
            key,
            root: root_buf(),
        }),
        Ok(_) => Ok(()),
    }
}

/// Walks `root` (known to be a folder): its images sorted by path, and what else was seen.
fn walk(key: &'static str, root: &Path, default_caption: Option<&str>) -> Result<Walk, DataError> {
    let mut walk = Walk {
        root: root.to_path_buf(),
        default_caption: default_caption.map(str::to_string),
        ..Walk::default()
    };
    walk.visit(root, &ImageConfig::default())?;
    if walk.records.is_empty() {
        return Err(DataError::NoImages {
            key,
            root: root.to_path_buf(),
            excluded: walk.excluded,
        });
    }
    walk.records.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(walk)
}

/// kohya's DreamBooth folder name (`^\d+_.+`, `train_util.py`): the repeat count and the caption
/// kohya reads from it (`10_sks dog` → `("10", "sks dog")`).
pub fn kohya_folder_name(name: &str) -> Option<(&str, &str)> {
    let (repeats, caption) = name.split_once('_')?;
    let is_count = !repeats.is_empty() && repeats.bytes().all(|b| b.is_ascii_digit());
    (is_count && !caption.is_empty()).then_some((repeats, caption))
}

/// A kohya-named folder whose images take their captions from their file names.
#[derive(Debug, Clone, PartialEq)]
struct KohyaFolder {
    folder: PathBuf,
    /// The caption one of its images got (from its file name).
    example: String,
}

/// The one warning for `first` of `count` kohya-named folders.
fn kohya_warning(first: &KohyaFolder, count: usize) -> String {
    let name = first
        .folder
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let (repeats, caption) = kohya_folder_name(&name).unwrap_or_default();
    let more = match count {
        0 | 1 => String::new(),
        n => format!(
            " (and {} more such folder{})",
            n - 1,
            if n == 2 { "" } else { "s" }
        ),
    };
    format!(
        "warning: folder {}{more} is named like a kohya DreamBooth folder (`<repeats>_<caption>`) \
         and holds images without caption files; sdtrain reads captions and repeats as \
         EveryDream2 does, so they train with captions from their file names (e.g. \"{}\") and \
         the repeats of a multiply.txt (1 without one), not kohya's \"{caption}\" ×{repeats}. \
         Set `\"data_layout\": \"kohya\"` to read the folders as kohya does, or write captions in \
         .txt files beside the images and the repeat count in the folder's multiply.txt \
         (docs/config.md, \"EveryDream2's data keys and files\")",
        first.folder.display(),
        first.example,
    )
}

/// True when `path` has one of [`IMAGE_EXTENSIONS`], in any case.
pub fn is_image(path: &Path) -> bool {
    path.extension().and_then(OsStr::to_str).is_some_and(|ext| {
        IMAGE_EXTENSIONS
            .iter()
            .any(|known| known.eq_ignore_ascii_case(ext))
    })
}

/// Parses a `multiply.txt`: one finite, non-negative number, surrounding whitespace allowed
/// (Python's `float()` accepts the same).
pub fn read_multiply(path: &Path) -> Result<f64, DataError> {
    let text = super::caption::read_caption_file(path)?;
    let trimmed = text.trim();
    match trimmed.parse::<f64>() {
        Ok(value) if value.is_finite() && value >= 0.0 => Ok(value),
        _ => Err(DataError::Multiply {
            path: path.to_path_buf(),
            text: trimmed.chars().take(40).collect(),
        }),
    }
}

#[derive(Default)]
struct Walk {
    /// The data_root, whose own name is not checked against kohya's convention.
    root: PathBuf,
    records: Vec<ImageRecord>,
    /// kohya-named folders holding images captioned by their file names, in walk order.
    kohya: Vec<KohyaFolder>,
    /// Images dropped because their folder's multiplier is 0.
    excluded: usize,
    /// Files in image formats sdtrain does not read ([`UNREAD_IMAGE_EXTENSIONS`]).
    unread: Vec<PathBuf>,
    /// The caption of an image without one of its own, instead of its file name's.
    default_caption: Option<String>,
    /// Canonical folders already walked, so a symbolic-link loop ends.
    seen: HashSet<PathBuf>,
}

impl Walk {
    fn visit(&mut self, dir: &Path, parent_global: &ImageConfig) -> Result<(), DataError> {
        let canonical = std::fs::canonicalize(dir).map_err(|source| DataError::ReadDir {
            path: dir.to_path_buf(),
            source,
        })?;
        if !self.seen.insert(canonical) {
            return Ok(());
        }
        let read_dir_err = |source| DataError::ReadDir {
            path: dir.to_path_buf(),
            source,
        };
        let mut names: Vec<OsString> = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(read_dir_err)? {
            let name = entry.map_err(read_dir_err)?.file_name();
            if !name.as_encoded_bytes().starts_with(b".") {
                names.push(name);
            }
        }
        names.sort();
        let (dirs, files): (Vec<PathBuf>, Vec<PathBuf>) = names
            .iter()
            .map(|name| dir.join(name))
            .partition(|path| path.is_dir());
        let file_names: HashSet<&OsStr> = names.iter().map(OsString::as_os_str).collect();

        let global = image_config::folder_global(dir, &file_names, parent_global)?;
        let local = image_config::folder_local(dir, &file_names)?;
        let folder = global.merge(&local);
        self.unread
            .extend(files.iter().filter(|p| is_unread_image(p)).cloned());
        // A `-masklabel.png` is the loss mask of the image beside it, never a training image.
        let images = files
            .iter()
            .filter(|path| is_image(path) && !super::mask::is_mask_file(path));
        let kohya_named = dir != self.root
            && dir
                .file_name()
                .and_then(OsStr::to_str)
                .and_then(kohya_folder_name)
                .is_some();
        let mut kohya_example = None;
        for image in images {
            let cfg = folder.merge(&image_sidecars(dir, image, &file_names)?);
            let multiplier = cfg.multiply.unwrap_or(1.0);
            if multiplier == 0.0 {
                self.excluded += 1;
                continue;
            }
            let named_by_file = cfg.main_prompts.is_empty() && self.default_caption.is_none();
            let cfg = match (&self.default_caption, cfg.main_prompts.is_empty()) {
                (Some(prompt), true) => cfg.merge(&ImageConfig::from_caption(prompt)),
                _ => cfg,
            };
            let (caption, options) = resolve_item(image, cfg)?;
            if kohya_named && named_by_file && kohya_example.is_none() {
                kohya_example = Some(caption.clone());
            }
            self.records.push(ImageRecord {
                path: image.clone(),
                caption,
                multiplier,
                options: Arc::new(options),
            });
        }
        if let Some(example) = kohya_example {
            self.kohya.push(KohyaFolder {
                folder: dir.to_path_buf(),
                example,
            });
        }
        for sub in &dirs {
            self.visit(sub, &global)?;
        }
        Ok(())
    }
}

/// The image's own files folded: its caption file, then `<stem>.yml`, then `<stem>.yaml`.
fn image_sidecars(
    dir: &Path,
    image: &Path,
    file_names: &HashSet<&OsStr>,
) -> Result<ImageConfig, DataError> {
    let mut cfg = match sidecar_for(dir, image, file_names, &CAPTION_EXTENSIONS) {
        Some(file) => ImageConfig::from_caption(&read_caption_file(&file)?),
        None => ImageConfig::default(),
    };
    for ext in YAML_EXTENSIONS {
        if let Some(file) = sidecar_for(dir, image, file_names, &[ext]) {
            cfg = cfg.merge(&image_config::read_yaml(&file)?);
        }
    }
    Ok(cfg)
}

/// The caption text and settings of `image` from its folded settings (EveryDream2's
/// `__ensure_caption` and `image_train_items`): with no main prompt, the file name's caption
/// comes first; tags are ordered by weight; unset values keep their defaults.
fn resolve_item(image: &Path, mut cfg: ImageConfig) -> Result<(String, ItemOptions), DataError> {
    if cfg.main_prompts.is_empty() {
        let from_name = caption_from_file_name(image).render();
        cfg = cfg.merge(&ImageConfig::from_caption(&from_name));
    }
    let tags = cfg.tags_by_weight();
    let main = cfg.main_prompts.first().cloned().unwrap_or_default();
    let weights: Vec<f64> = tags.iter().map(|t| t.weight).collect();
    let weighted = weights.iter().any(|&w| w != weights[0]);
    let tags: Vec<String> = tags.into_iter().map(|t| t.value).collect();
    let mut caption = main.clone();
    for tag in &tags {
        if !caption.is_empty() {
            caption.push_str(", ");
        }
        caption.push_str(tag);
    }
    if caption.is_empty() {
        return Err(DataError::EmptyCaption {
            path: image.to_path_buf(),
        });
    }
    let options = ItemOptions {
        rating: cfg.rating.unwrap_or(1.0),
        flip_p: cfg.flip_p,
        cond_dropout: cfg.cond_dropout,
        shuffle_tags: cfg.shuffle_tags,
        main,
        tags,
        tag_weights: weighted.then_some(weights),
        max_caption_length: cfg
            .max_caption_length
            .unwrap_or(image_config::DEFAULT_MAX_CAPTION_LENGTH),
        prior_loss_weight: None,
        subset_captions: None,
        subset: None,
        loss_weight: 1.0,
    };
    Ok((caption, options))
}

/// The first `<stem>.<ext>` of `extensions` that exists next to `image` (exact name match, as
/// ED2 looks names up in the folder listing).
fn sidecar_for(
    dir: &Path,
    image: &Path,
    file_names: &HashSet<&OsStr>,
    extensions: &[&str],
) -> Option<PathBuf> {
    let stem = image.file_stem()?;
    extensions.iter().find_map(|ext| {
        let mut name = stem.to_os_string();
        name.push(".");
        name.push(ext);
        let path = dir.join(&name);
        (file_names.contains(name.as_os_str()) && path.is_file()).then_some(path)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extensions_match_case_insensitively() {
        for name in [
            "a.jpg", "a.JPG", "a.Jpeg", "a.png", "a.WEBP", "a.bmp", "a.jfif", "a.tif", "a.TIFF",
        ] {
            assert!(is_image(Path::new(name)), "{name}");
        }
        for name in ["a.txt", "a.gif", "a", "a.png.txt", "a.caption", "a.avif"] {
            assert!(!is_image(Path::new(name)), "{name}");
        }
    }

    /// EveryDream2's JSON dataset: an entry without `image`, or one with a key only folders
    /// take, is refused naming the file and the entry. (Its captions and settings are checked
    /// against EveryDream2's `from_json` in tests/data_parity.rs.)
    #[test]
    fn json_dataset_entries_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("set.json");
        for (text, why) in [
            (
                r#"[{"image": "a.png"}, {"main_prompt": "x"}]"#,
                "entry 2: has no `image`",
            ),
            (r#"[{"image": "a.png", "batch_id": "b"}]"#, "batch_id"),
            (r#"{"image": "a.png"}"#, "not a JSON list"),
            ("[]", "lists no image"),
        ] {
            std::fs::write(&path, text).unwrap();
            let err = scan(&path).unwrap_err().to_string();
            assert!(
                err.contains("set.json") && err.contains(why),
                "{text}: {err}"
            );
        }
    }

    /// diffusers' DreamBooth prompt captions the images without a caption of their own; an
    /// image with a caption file keeps it. Catches the prompt put over a caption file, and the
    /// file name's caption kept.
    #[test]
    fn a_default_caption_replaces_the_file_names_only() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["a_b.png", "c.png"] {
            std::fs::write(dir.path().join(name), b"").unwrap();
        }
        std::fs::write(dir.path().join("c.txt"), "own caption").unwrap();
        let records = scan_captioned("data_root", dir.path(), Some("sks dog, smiling")).unwrap();
        let captions: Vec<&str> = records.iter().map(|r| r.caption.as_str()).collect();
        assert_eq!(captions, ["sks dog, smiling", "own caption"]);
        let records = scan_captioned("data_root", dir.path(), None).unwrap();
        assert_eq!(records[0].caption, "a");
    }

    /// A TIFF trains as OneTrainer reads it; an AVIF or JPEG XL file, which sdtrain cannot
    /// decode, is left out and counted rather than dropped silently. Catches `.tif` missing from
    /// the scan (or the decoder), and an unreadable file listed as an image (the run would fail
    /// on it) or not reported.
    #[test]
    fn tiffs_are_read_and_unreadable_formats_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let tif = dir.path().join("cat.tif");
        image::RgbImage::from_pixel(6, 4, image::Rgb([10, 200, 30]))
            .save(&tif)
            .unwrap();
        for name in ["dog.avif", "sub/eel.AVIF", "fox.jxl"] {
            let path = dir.path().join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, b"not decoded").unwrap();
        }
        let walk = walk("data_root", dir.path(), None).unwrap();
        let paths: Vec<&Path> = walk.records.iter().map(|r| r.path.as_path()).collect();
        assert_eq!(paths, [tif.as_path()]);
        assert_eq!(walk.unread.len(), 3);
        let line = unread_warning("data_root", &walk.unread).unwrap();
        assert!(
            line.contains("3 images") && line.contains(".avif ×2") && line.contains(".jxl ×1"),
            "{line}"
        );
        let image = super::super::image_load::decode_rgb(&tif).unwrap();
        assert_eq!((image.width(), image.height()), (6, 4));
        assert_eq!(image.get_pixel(5, 3).0, [10, 200, 30]);
        assert_eq!(unread_warning("data_root", &[]), None);
    }

    #[test]
    fn multiply_accepts_numbers_and_rejects_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(MULTIPLY_FILE);
        for (text, want) in [("2", 2.0), (" 1.5\n", 1.5), ("0", 0.0), ("3e0", 3.0)] {
            std::fs::write(&path, text).unwrap();
            assert_eq!(read_multiply(&path).unwrap(), want, "{text:?}");
        }
        for text in ["", "two", "-1", "inf", "NaN", "1 2"] {
            std::fs::write(&path, text).unwrap();
            let err = read_multiply(&path).unwrap_err();
            assert!(err.to_string().contains("multiply.txt"), "{err}");
        }
    }

    #[test]
    fn missing_root_and_file_root_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        assert!(matches!(
            scan(&missing).unwrap_err(),
            DataError::RootMissing { .. }
        ));
        let file = dir.path().join("f.txt");
        std::fs::write(&file, "x").unwrap();
        assert!(matches!(
            scan(&file).unwrap_err(),
            DataError::RootNotAFolder { .. }
        ));
        assert!(matches!(
            scan(dir.path()).unwrap_err(),
            DataError::NoImages { excluded: 0, .. }
        ));
    }

    #[test]
    fn hidden_files_and_folders_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(".cache")).unwrap();
        std::fs::write(dir.path().join(".cache/x.png"), b"").unwrap();
        std::fs::write(dir.path().join(".y.png"), b"").unwrap();
        std::fs::write(dir.path().join("cat.png"), b"").unwrap();
        let records = scan(dir.path()).unwrap();
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].caption, "cat");
    }

    #[test]
    fn zero_multiplier_excludes_and_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("cat.png"), b"").unwrap();
        std::fs::write(dir.path().join(MULTIPLY_FILE), "0").unwrap();
        let err = scan(dir.path()).unwrap_err();
        assert!(matches!(err, DataError::NoImages { excluded: 1, .. }));
        assert!(err.to_string().contains("multiply.txt of 0"), "{err}");
    }

    #[test]
    fn kohya_folder_names_are_recognised() {
        assert_eq!(kohya_folder_name("10_sks dog"), Some(("10", "sks dog")));
        assert_eq!(kohya_folder_name("1_a_b"), Some(("1", "a_b")));
        for name in ["sks dog", "10_", "_dog", "x10_dog", "10 dog", "1.5_dog"] {
            assert_eq!(kohya_folder_name(name), None, "{name}");
        }
    }

    /// Regression: kohya's `10_sks dog/IMG_0001.png` trained as "IMG" once with no word.
    #[test]
    fn kohya_folders_without_captions_are_noted_once() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("10_root");
        for sub in ["10_sks dog", "3_cat", "5_captioned", "plain"] {
            std::fs::create_dir_all(root.join(sub)).unwrap();
        }
        std::fs::write(root.join("10_sks dog/IMG_0001.png"), b"").unwrap();
        std::fs::write(root.join("3_cat/c_1.png"), b"").unwrap();
        std::fs::write(root.join("5_captioned/d.png"), b"").unwrap();
        std::fs::write(root.join("5_captioned/d.txt"), "a dog").unwrap();
        std::fs::write(root.join("plain/e.png"), b"").unwrap();
        // The data_root's own name is not a kohya subset folder.
        std::fs::write(root.join("f.png"), b"").unwrap();
        let walk = walk("data_root", &root, None).unwrap();
        let folders: Vec<&Path> = walk.kohya.iter().map(|k| k.folder.as_path()).collect();
        assert_eq!(folders, [root.join("10_sks dog"), root.join("3_cat")]);
        let line = kohya_warning(&walk.kohya[0], walk.kohya.len());
        assert!(!line.contains('\n'), "{line}");
        for want in [
            "10_sks dog (and 1 more such folder)",
            "\"IMG\"",
            "not kohya's \"sks dog\" ×10",
            "multiply.txt",
            "docs/config.md",
        ] {
            assert!(line.contains(want), "{want}: {line}");
        }
        // ED2's reading is kept: caption from the file name, 1 repeat.
        let r = walk
            .records
            .iter()
            .find(|r| r.path.ends_with("IMG_0001.png"))
            .unwrap();
        assert_eq!((r.caption.as_str(), r.multiplier), ("IMG", 1.0));
    }
}
