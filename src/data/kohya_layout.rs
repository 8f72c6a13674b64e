//! kohya sd-scripts' DreamBooth folders (`data_layout: "kohya"`): how `train_data_dir` and
//! `reg_data_dir` are read without a dataset config, after `library/config_util.py`
//! (`generate_dreambooth_subsets_config_by_subdirs`) and `library/train_util.py`
//! (`DreamBoothDataset`: `read_caption`, `glob_images`).
//!
//! - Only the root's direct subfolders are read. A subfolder whose name is
//!   `<repeats>_<class tokens>` is a subset: `10_sks dog` repeats each image 10 times and captions
//!   it "sks dog" when it has no caption file (the name is split on `_`; everything after the
//!   first piece, joined back with `_`, is the class tokens, which may be empty). Other
//!   subfolders, and images directly in the root, are not read (one warning lists them, as
//!   kohya's "ignore directory without repeats"); a repeat count of 0 skips the folder silently.
//! - A subset's images are its own files (not its subfolders') with an image extension, sorted
//!   by path.
//! - An image's caption is the first line, stripped, of `<stem><caption_extension>` beside it
//!   (kohya's default extension is `.caption`), or the class tokens without one (one warning
//!   counts those images). A caption file with no line is an error naming it (kohya asserts).
//!
//! Deliberate differences: subsets are read in name order (kohya lists them in file-system
//! order, which decides which regularization images an epoch uses when there are more than it
//! needs, [`super::regularization`]); extensions are EveryDream2's list, in any case (kohya's
//! also lacks `.jfif`); `<stem>-masklabel.png` is a loss mask, never an image, as in the
//! EveryDream2 layout; hidden files and folders are skipped; caption files are decoded as
//! EveryDream2's (UTF-16 by its mark, UTF-8 without its mark, else Latin-1; kohya accepts UTF-8
//! only, and keeps a byte-order mark in the caption); kohya's second caption name for
//! face-cropped images (the path up to its fifth `_` from the end) is not tried.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;

use super::scan::{check_root, is_image, ImageRecord};
use super::tag_shuffle::ItemOptions;
use super::DataError;

/// kohya sd-scripts' `--caption_extension` default.
pub const DEFAULT_CAPTION_EXTENSION: &str = ".caption";

/// How a data folder is laid out: which images it holds, their captions and repeats.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "layout")]
pub enum DataLayout {
    /// EveryDream2's: a recursive walk, captions from `.txt`/`.caption` files or file names,
    /// repeats from `multiply.txt` ([`super::scan`]).
    Everydream,
    /// kohya's DreamBooth folders (this module), caption files ending in `caption_extension`
    /// (with its leading dot).
    Kohya { caption_extension: String },
    /// Hugging Face's imagefolder ([`super::imagefolder`]): metadata rows naming the images,
    /// captions in `caption_column`.
    ImageFolder { caption_column: String },
}

/// A kohya subset: one `<repeats>_<class tokens>` folder.
struct Subset {
    dir: PathBuf,
    repeats: u64,
    class_tokens: String,
}

/// What the read saw besides the images, for its warnings.
#[derive(Default)]
struct Seen {
    /// Subfolder names that are not `<repeats>_<class tokens>`.
    ignored: Vec<String>,
    /// Images directly in the root.
    loose_images: usize,
    /// Subset folders without an image.
    empty: Vec<String>,
    /// Images captioned by their folder's class tokens, and one of them.
    by_class: usize,
    by_class_example: Option<PathBuf>,
    /// Images without a caption file that have a `.txt` or `.caption` file of the other kind.
    other_extension: Option<String>,
}

/// The images of the kohya-layout folder `root` (train.json's `key`), sorted by path.
pub fn scan_kohya(
    key: &'static str,
    root: &Path,
    caption_extension: &str,
) -> Result<Vec<ImageRecord>, DataError> {
    scan_kohya_with(key, root, caption_extension, false)
}

/// [`scan_kohya`], with every non-empty line of each caption file (joined by `\n`) when
/// `all_lines` (kohya's `enable_wildcard`), else the first.
pub fn scan_kohya_with(
    key: &'static str,
    root: &Path,
    caption_extension: &str,
    all_lines: bool,
) -> Result<Vec<ImageRecord>, DataError> {
    check_root(key, root)?;
    let mut seen = Seen::default();
    let subsets = subsets(root, &mut seen)?;
    let mut records = Vec::new();
    for subset in &subsets {
        let images = subset_images(&subset.dir)?;
        if images.is_empty() {
            seen.empty.push(folder_name(&subset.dir));
        }
        for image in images {
            let caption = match read_caption_lines(&image, caption_extension, all_lines)? {
                Some(caption) => caption,
                None => {
                    note_class_caption(&image, caption_extension, &mut seen);
                    subset.class_tokens.clone()
                }
            };
            records.push(ImageRecord {
                path: image,
                caption,
                multiplier: subset.repeats as f64,
                options: Arc::new(ItemOptions::default()),
            });
        }
    }
    warn(key, root, &seen, caption_extension);
    if records.is_empty() {
        return Err(DataError::NoKohyaImages {
            key,
            root: root.to_path_buf(),
            subsets: subsets.len(),
        });
    }
    records.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(records)
}

/// The root's subset folders in name order; what else it holds goes to `seen`.
fn subsets(root: &Path, seen: &mut Seen) -> Result<Vec<Subset>, DataError> {
    let mut subsets = Vec::new();
    for entry in sorted_entries(root)? {
        let name = folder_name(&entry);
        if entry.is_dir() {
            match subset_name(&name) {
                Some((repeats, tokens)) => {
                    if repeats >= 1 {
                        subsets.push(Subset {
                            dir: entry,
                            repeats,
                            class_tokens: tokens.to_string(),
                        });
                    }
                }
                None => seen.ignored.push(name),
            }
        } else if is_image(&entry) && !super::mask::is_mask_file(&entry) {
            seen.loose_images += 1;
        }
    }
    Ok(subsets)
}

/// kohya's `extract_dreambooth_params`: the name split on `_`, the first piece the repeat count
/// and the rest, joined back, the class tokens (`10_sks_dog` → 10, `sks_dog`; `10` → 10, ``).
/// `None` when the first piece is not a count (kohya's `int()` failing).
pub fn subset_name(name: &str) -> Option<(u64, &str)> {
    let (count, tokens) = name.split_once('_').unwrap_or((name, ""));
    let is_count = !count.is_empty() && count.bytes().all(|b| b.is_ascii_digit());
    // A count past u64 is no folder kohya could train either.
    Some((count.parse().ok().filter(|_| is_count)?, tokens))
}

/// The image files directly in `dir` (not hidden, not loss masks), sorted. Files in formats
/// sdtrain does not read are left out with a warning.
pub(super) fn subset_images(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let entries = sorted_entries(dir)?;
    let unread: Vec<PathBuf> = entries
        .iter()
        .filter(|p| p.is_file() && super::scan::is_unread_image(p))
        .cloned()
        .collect();
    if let Some(line) = super::scan::unread_warning(&dir.display().to_string(), &unread) {
        crate::console::say(format_args!("{line}"));
    }
    Ok(entries
        .into_iter()
        .filter(|p| p.is_file() && is_image(p) && !super::mask::is_mask_file(p))
        .collect())
}

/// The entries of `dir` not starting with `.`, sorted by path.
fn sorted_entries(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let read_err = |source| DataError::ReadDir {
        path: dir.to_path_buf(),
        source,
    };
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(read_err)? {
        let path = entry.map_err(read_err)?.path();
        if !folder_name(&path).starts_with('.') {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

fn folder_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// `<image without its extension><ext>`, as kohya's `os.path.splitext(path)[0] + ext`.
fn caption_path(image: &Path, ext: &str) -> PathBuf {
    let mut name = image.with_extension("").into_os_string();
    name.push(ext);
    PathBuf::from(name)
}

/// kohya's `read_caption`: the caption file's first line, stripped, or `None` without a file.
pub fn read_caption(image: &Path, ext: &str) -> Result<Option<String>, DataError> {
    read_caption_lines(image, ext, false)
}

/// [`read_caption`]; with `all_lines` (kohya's `enable_wildcard`), every non-empty line,
/// stripped, joined by `\n`.
pub fn read_caption_lines(
    image: &Path,
    ext: &str,
    all_lines: bool,
) -> Result<Option<String>, DataError> {
    let path = caption_path(image, ext);
    if !path.is_file() {
        return Ok(None);
    }
    let text = super::caption::read_caption_file(&path)?;
    // Python's text mode reads `\r\n` and `\r` as line ends too.
    let first = text.split(['\n', '\r']).next().unwrap_or("");
    if text.is_empty() {
        return Err(DataError::Text {
            path,
            reason: "the caption file is empty (kohya stops on an empty caption file; write the \
                     caption, or delete the file to use the folder's class tokens)"
                .into(),
        });
    }
    if all_lines {
        let lines: Vec<&str> = text
            .split(['\n', '\r'])
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        return Ok(Some(lines.join("\n")));
    }
    Ok(Some(first.trim().to_string()))
}

/// Counts an image captioned by its folder's class tokens, and notes a caption file of the
/// other common extension beside it.
fn note_class_caption(image: &Path, ext: &str, seen: &mut Seen) {
    seen.by_class += 1;
    if seen.by_class_example.is_none() {
        seen.by_class_example = Some(image.to_path_buf());
    }
    if seen.other_extension.is_none() {
        seen.other_extension = [".txt", ".caption"]
            .into_iter()
            .find(|other| !other.eq_ignore_ascii_case(ext) && caption_path(image, other).is_file())
            .map(str::to_string);
    }
}

/// One warning per kind of thing the layout does not read.
fn warn(key: &str, root: &Path, seen: &Seen, ext: &str) {
    let say = |text: String| crate::console::say(format_args!("warning: {text}"));
    if !seen.ignored.is_empty() {
        say(format!(
            "{key} {} (kohya layout): folder{} {} not named `<repeats>_<class tokens>`, not read",
            root.display(),
            plural(seen.ignored.len()),
            list(&seen.ignored),
        ));
    }
    if seen.loose_images > 0 {
        say(format!(
            "{key} {} (kohya layout): {} image{} directly in the folder, not read (kohya reads \
             only its `<repeats>_<class tokens>` subfolders)",
            root.display(),
            seen.loose_images,
            plural(seen.loose_images),
        ));
    }
    if !seen.empty.is_empty() {
        say(format!(
            "{key} {} (kohya layout): no image in {}",
            root.display(),
            list(&seen.empty),
        ));
    }
    if let Some(example) = &seen.by_class_example {
        let hint = match &seen.other_extension {
            Some(other) => format!(
                "; caption files ending in `{other}` are there: set `\"caption_extension\": \
                 \"{other}\"` to read them"
            ),
            None => String::new(),
        };
        say(format!(
            "{key} {} (kohya layout): {} image{} without a `{ext}` caption file train{} on \
             {} folder's class tokens (e.g. {}){hint}",
            root.display(),
            seen.by_class,
            plural(seen.by_class),
            if seen.by_class == 1 { "s" } else { "" },
            if seen.by_class == 1 { "its" } else { "their" },
            example.display(),
        ));
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// The first few names, quoted, and how many more.
fn list(names: &[String]) -> String {
    const SHOWN: usize = 4;
    let mut out: Vec<String> = names.iter().take(SHOWN).map(|n| format!("`{n}`")).collect();
    if names.len() > SHOWN {
        out.push(format!("and {} more", names.len() - SHOWN));
    }
    out.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    #[test]
    fn all_caption_lines_for_wildcards_else_the_first() {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("a.png");
        std::fs::write(dir.path().join("a.txt"), "one {x|y}\r\n\n  two  \nthree\n").unwrap();
        let first = read_caption(&image, ".txt").unwrap();
        assert_eq!(first.as_deref(), Some("one {x|y}"));
        let all = read_caption_lines(&image, ".txt", true).unwrap();
        assert_eq!(all.as_deref(), Some("one {x|y}\ntwo\nthree"));
    }

    #[test]
    fn subsets_give_repeats_and_class_tokens_and_caption_files_win() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        touch(&r.join("10_sks dog/a.png"), "");
        touch(
            &r.join("10_sks dog/a.caption"),
            "  a photo of sks dog \nsecond line\n",
        );
        touch(&r.join("10_sks dog/b.JPG"), "");
        touch(
            &r.join("10_sks dog/b.txt"),
            "ignored: not the caption extension",
        );
        touch(&r.join("10_sks dog/deeper/c.png"), "");
        touch(&r.join("2_my_style/x.webp"), "");
        touch(&r.join("0_off/y.png"), "");
        touch(&r.join("style/z.png"), "");
        touch(&r.join("loose.png"), "");
        touch(&r.join("10_sks dog/a-masklabel.png"), "");
        let records = scan_kohya("data_root", r, DEFAULT_CAPTION_EXTENSION).unwrap();
        let got: Vec<(String, &str, f64)> = records
            .iter()
            .map(|rec| {
                let rel = rec.path.strip_prefix(r).unwrap().display().to_string();
                (rel, rec.caption.as_str(), rec.multiplier)
            })
            .collect();
        assert_eq!(
            got,
            [
                ("10_sks dog/a.png".to_string(), "a photo of sks dog", 10.0),
                ("10_sks dog/b.JPG".to_string(), "sks dog", 10.0),
                ("2_my_style/x.webp".to_string(), "my_style", 2.0),
            ]
        );
        // `.txt` read when asked for, with or without CRLF
        touch(&r.join("10_sks dog/b.txt"), "crlf caption\r\nnext");
        let records = scan_kohya("data_root", r, ".txt").unwrap();
        assert_eq!(records[1].caption, "crlf caption");
        assert_eq!(records[0].caption, "sks dog");
    }

    #[test]
    fn folder_names_split_as_kohyas_extract_dreambooth_params() {
        assert_eq!(subset_name("10_sks dog"), Some((10, "sks dog")));
        assert_eq!(subset_name("10_sks_dog"), Some((10, "sks_dog")));
        assert_eq!(subset_name("007_x"), Some((7, "x")));
        assert_eq!(subset_name("3"), Some((3, "")));
        assert_eq!(subset_name("0_x"), Some((0, "x")));
        for name in ["x_10", "_10", "-1_x", "1.5_x", "", "99999999999999999999_x"] {
            assert_eq!(subset_name(name), None, "{name}");
        }
    }

    #[test]
    fn empty_class_tokens_and_empty_first_lines_are_kohyas_empty_caption() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        touch(&r.join("3_/a.png"), "");
        touch(&r.join("3_/b.png"), "");
        touch(&r.join("3_/b.caption"), "\nsecond");
        let records = scan_kohya("data_root", r, ".caption").unwrap();
        assert_eq!(records.len(), 2);
        assert!(records
            .iter()
            .all(|r| r.caption.is_empty() && r.multiplier == 3.0));
    }

    #[test]
    fn bad_folders_are_errors_naming_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        touch(&r.join("images/a.png"), "");
        let err = scan_kohya("reg_data_root", r, ".caption").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("reg_data_root") && msg.contains("<repeats>_"),
            "{msg}"
        );
        touch(&r.join("5_cat/readme.md"), "");
        let msg = scan_kohya("data_root", r, ".caption")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("1 such folder found"), "{msg}");
        touch(&r.join("5_cat/a.png"), "");
        touch(&r.join("5_cat/a.caption"), "");
        let msg = scan_kohya("data_root", r, ".caption")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("a.caption") && msg.contains("empty"), "{msg}");
        let missing = r.join("nope");
        let msg = scan_kohya("data_root", &missing, ".caption")
            .unwrap_err()
            .to_string();
        assert!(
            msg.starts_with("data_root") && msg.contains("does not exist"),
            "{msg}"
        );
    }
}
