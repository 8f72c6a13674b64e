//! Hugging Face `datasets`' imagefolder layout, what diffusers' training scripts read from
//! `--train_data_dir` (`load_dataset("imagefolder", data_dir=…)`, then `dataset["train"]`): images
//! with a `metadata.jsonl` or `metadata.csv` whose rows name each image (`file_name`, relative to
//! the metadata file's folder) and give its caption in a column (`caption_column`, diffusers'
//! default `text`).
//!
//! As `datasets`' `FolderBasedBuilder` (5.x) reads it:
//! - every metadata file below the root is read, rows in file order; the images are the rows, so
//!   an image no row names is not trained (it is counted in a note), and a row naming the same
//!   image twice trains it twice;
//! - `file_name` (or `image_file_name`) must be a relative path inside the metadata file's folder;
//! - all metadata files have one extension;
//! - metadata under a folder named for another split (`test`, `validation`, …) belongs to that
//!   split and is not trained, as diffusers trains `dataset["train"]`.
//!
//! Differences: a caption must be a text (diffusers also takes a list and picks one at random
//! each step; sdtrain refuses it, naming the row), `metadata.parquet` is refused (convert it to
//! JSON lines), and the rows are read in path order of their metadata files.

use std::collections::HashSet;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use super::scan::{check_root, is_image, ImageRecord};
use super::tag_shuffle::ItemOptions;
use super::DataError;

/// The metadata file names `datasets` looks for.
pub const METADATA_FILES: [&str; 3] = ["metadata.jsonl", "metadata.csv", "metadata.parquet"];

/// diffusers' `--caption_column` default.
pub const DEFAULT_CAPTION_COLUMN: &str = "text";

/// Folder names `datasets` takes for a split other than `train` (its default split patterns).
const OTHER_SPLITS: [&str; 9] = [
    "test",
    "testing",
    "eval",
    "evaluation",
    "valid",
    "validation",
    "val",
    "dev",
    "development",
];

/// The metadata files below `root` (hidden folders skipped), sorted by path.
pub fn metadata_files(root: &Path) -> Result<Vec<PathBuf>, DataError> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    let mut seen = HashSet::new();
    while let Some(dir) = stack.pop() {
        let canonical = std::fs::canonicalize(&dir).map_err(|source| DataError::ReadDir {
            path: dir.clone(),
            source,
        })?;
        if !seen.insert(canonical) {
            continue;
        }
        let entries = std::fs::read_dir(&dir).map_err(|source| DataError::ReadDir {
            path: dir.clone(),
            source,
        })?;
        for entry in entries {
            let path = entry
                .map_err(|source| DataError::ReadDir {
                    path: dir.clone(),
                    source,
                })?
                .path();
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            let name = name.unwrap_or_default();
            if name.starts_with('.') {
                continue;
            }
            if path.is_dir() {
                stack.push(path);
            } else if METADATA_FILES.contains(&name.as_str()) {
                out.push(path);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Whether `root` looks like an imagefolder: a metadata file in it or in its `train` folder
/// (one deeper in an EveryDream2 tree does not make the whole tree one).
pub fn is_imagefolder(root: &Path) -> bool {
    [root.to_path_buf(), root.join("train")]
        .iter()
        .any(|dir| METADATA_FILES.iter().any(|f| dir.join(f).is_file()))
}

/// The images and captions of the imagefolder at `root` (train.json's `key`), captions from
/// `caption_column`.
pub fn scan_imagefolder(
    key: &'static str,
    root: &Path,
    caption_column: &str,
) -> Result<Vec<ImageRecord>, DataError> {
    check_root(key, root)?;
    let all = metadata_files(root)?;
    let (train, other): (Vec<PathBuf>, Vec<PathBuf>) =
        all.into_iter().partition(|f| !in_other_split(root, f));
    if train.is_empty() {
        return Err(DataError::Text {
            path: root.to_path_buf(),
            reason: format!(
                "{key} holds no metadata.jsonl or metadata.csv for the train split (Hugging Face's \
                 imagefolder layout{})",
                match other.first() {
                    Some(f) => format!(", only {}", f.display()),
                    None => String::new(),
                }
            ),
        });
    }
    let exts: HashSet<_> = train.iter().filter_map(|f| f.extension()).collect();
    if exts.len() > 1 {
        return Err(DataError::Text {
            path: root.to_path_buf(),
            reason:
                "holds metadata files of different formats (.jsonl and .csv); datasets refuses \
                     the mix too: keep one"
                    .into(),
        });
    }
    let mut records = Vec::new();
    for file in &train {
        for row in read_rows(file, caption_column)? {
            records.push(ImageRecord {
                path: row.0,
                caption: row.1,
                multiplier: 1.0,
                options: Arc::new(ItemOptions::default()),
            });
        }
    }
    if records.is_empty() {
        return Err(DataError::Text {
            path: train[0].clone(),
            reason: "has no rows: no image to train".into(),
        });
    }
    note_unlisted(key, root, &train, &records);
    if !other.is_empty() {
        crate::console::say(format_args!(
            "note: {key}: {} belong{} to another split than train and {} not read, as diffusers \
             trains dataset[\"train\"]",
            other
                .iter()
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            if other.len() == 1 { "s" } else { "" },
            if other.len() == 1 { "is" } else { "are" },
        ));
    }
    Ok(records)
}

/// Whether metadata file `f` lies under a folder named for a split other than train: a folder
/// name holding the split's keyword between `datasets`' separators (`-`, `.`, `_`, a space or a
/// digit, or the name's ends), as its default split patterns (`**/*[-._ 0-9]val[-._ 0-9]*/**`)
/// match it: `val`, `val2017`, `test-images`, not `interval`.
fn in_other_split(root: &Path, f: &Path) -> bool {
    let rel = f.strip_prefix(root).unwrap_or(f);
    let named = |name: &str| {
        name.split(|c: char| "-._ ".contains(c) || c.is_ascii_digit())
            .any(|word| OTHER_SPLITS.contains(&word))
    };
    rel.parent().is_some_and(|dir| {
        dir.components().any(|c| match c {
            Component::Normal(n) => named(&n.to_string_lossy()),
            _ => false,
        })
    })
}

/// One note for the images no metadata row names (they are not trained, as in `datasets`).
fn note_unlisted(key: &str, root: &Path, metadata: &[PathBuf], records: &[ImageRecord]) {
    let listed: HashSet<&Path> = records.iter().map(|r| r.path.as_path()).collect();
    let mut unlisted = 0usize;
    let mut first: Option<PathBuf> = None;
    for dir in metadata.iter().filter_map(|m| m.parent()) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for p in entries.flatten().map(|e| e.path()) {
            if p.is_file() && is_image(&p) && !listed.contains(p.as_path()) {
                unlisted += 1;
                first.get_or_insert(p);
            }
        }
    }
    if let Some(first) = first {
        crate::console::say(format_args!(
            "note: {key} {}: {unlisted} image{} beside the metadata no row names (the first: {}); \
             they are not trained, as Hugging Face's imagefolder trains the rows",
            root.display(),
            if unlisted == 1 { "" } else { "s" },
            first.display()
        ));
    }
}

/// A metadata file's rows: each image's path and caption.
fn read_rows(file: &Path, caption_column: &str) -> Result<Vec<(PathBuf, String)>, DataError> {
    let fail = |reason: String| DataError::Text {
        path: file.to_path_buf(),
        reason,
    };
    let dir = file.parent().unwrap_or(Path::new("."));
    let rows: Vec<serde_json::Map<String, serde_json::Value>> =
        match file.extension().and_then(|e| e.to_str()) {
            Some("jsonl") => jsonl_rows(file)?,
            Some("csv") => csv_rows(file)?,
            _ => {
                return Err(fail(
                    "is a Parquet file, which sdtrain does not read; write the same rows as \
                     metadata.jsonl (one JSON object per line: file_name and the caption column)"
                        .into(),
                ))
            }
        };
    rows.iter()
        .enumerate()
        .map(|(i, row)| {
            let at = format!("row {}", i + 1);
            let name = match row.get("file_name").or_else(|| row.get("image_file_name")) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(other) => return Err(fail(format!("{at}: file_name is {other}, not a path"))),
                None => {
                    return Err(fail(format!(
                        "{at} has no file_name (Hugging Face's imagefolder names each image in it)"
                    )))
                }
            };
            let path = image_path(dir, &name).map_err(|why| fail(format!("{at}: {why}")))?;
            let caption = match row.get(caption_column) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(serde_json::Value::Array(_)) => {
                    return Err(fail(format!(
                        "{at}: caption column `{caption_column}` holds a list; sdtrain trains one \
                         caption per image (diffusers picks one of the list at random each step): \
                         keep one, or give each its own row"
                    )))
                }
                Some(other) => {
                    return Err(fail(format!(
                        "{at}: caption column `{caption_column}` is {other}; it must be a text, as \
                         diffusers requires"
                    )))
                }
                None => {
                    let mut columns: Vec<&str> = row.keys().map(String::as_str).collect();
                    columns.sort();
                    return Err(fail(format!(
                        "{at} has no column `{caption_column}` (caption_column, diffusers' \
                         --caption_column); its columns: {}",
                        columns.join(", ")
                    )));
                }
            };
            Ok((path, caption))
        })
        .collect()
}

/// The image a row's `file_name` names, inside `dir` (`datasets` refuses absolute paths, `..`
/// and URLs there too), an existing file with an image extension.
fn image_path(dir: &Path, name: &str) -> Result<PathBuf, String> {
    let rel = Path::new(name);
    let escapes = rel.is_absolute()
        || name.contains("://")
        || rel
            .components()
            .any(|c| matches!(c, Component::ParentDir | Component::Prefix(_)));
    if escapes {
        return Err(format!(
            "file_name \"{name}\" must be a relative path inside the metadata file's folder"
        ));
    }
    let path = dir.join(rel);
    if !path.is_file() {
        return Err(format!(
            "file_name \"{name}\": no such file ({})",
            path.display()
        ));
    }
    if !is_image(&path) {
        return Err(format!(
            "file_name \"{name}\" is not an image sdtrain reads ({})",
            super::scan::IMAGE_EXTENSIONS.join(", ")
        ));
    }
    Ok(path)
}

/// JSON lines: one object per non-empty line.
fn jsonl_rows(file: &Path) -> Result<Vec<serde_json::Map<String, serde_json::Value>>, DataError> {
    let text = super::caption::read_caption_file(file)?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| match serde_json::from_str(line) {
            Ok(serde_json::Value::Object(o)) => Ok(o),
            Ok(other) => Err(DataError::Text {
                path: file.to_path_buf(),
                reason: format!("line {} is {other}, not a JSON object", i + 1),
            }),
            Err(e) => Err(DataError::Text {
                path: file.to_path_buf(),
                reason: format!("line {}: {e}", i + 1),
            }),
        })
        .collect()
}

/// CSV with a header row; every field is a text (as pandas reads `file_name`; captions too).
fn csv_rows(file: &Path) -> Result<Vec<serde_json::Map<String, serde_json::Value>>, DataError> {
    let text = super::caption::read_caption_file(file)?;
    let fail = |reason: String| DataError::Text {
        path: file.to_path_buf(),
        reason,
    };
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(true)
        .from_reader(text.as_bytes());
    let headers = reader
        .headers()
        .map_err(|e| fail(format!("header row: {e}")))?
        .clone();
    reader
        .records()
        .enumerate()
        .map(|(i, record)| {
            let record = record.map_err(|e| fail(format!("row {}: {e}", i + 1)))?;
            Ok(headers
                .iter()
                .zip(record.iter())
                .map(|(h, v)| (h.to_string(), serde_json::Value::String(v.to_string())))
                .collect())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        image::RgbImage::new(8, 8).save(path).unwrap();
    }

    /// The rows are the images: a nested `file_name`, a row's caption, an image no row names left
    /// out, the test split's metadata not read, CSV read as JSON lines are. Catches captions
    /// taken from the wrong column, paths resolved from the root instead of the metadata file's
    /// folder, and another split's rows trained.
    #[test]
    fn rows_name_the_images_and_their_captions() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        image(&root.join("train/a.png"));
        image(&root.join("train/sub/b.png"));
        image(&root.join("train/unlisted.png"));
        image(&root.join("test/c.png"));
        std::fs::write(
            root.join("train/metadata.jsonl"),
            "{\"file_name\": \"a.png\", \"text\": \"a cat\", \"other\": 1}\n\n\
             {\"file_name\": \"sub/b.png\", \"text\": \"a dog\"}\n",
        )
        .unwrap();
        std::fs::write(
            root.join("test/metadata.jsonl"),
            "{\"file_name\": \"c.png\", \"text\": \"held out\"}\n",
        )
        .unwrap();
        let records = scan_imagefolder("data_root", root, "text").unwrap();
        let got: Vec<(PathBuf, &str)> = records
            .iter()
            .map(|r| {
                (
                    r.path.strip_prefix(root).unwrap().to_path_buf(),
                    r.caption.as_str(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (PathBuf::from("train/a.png"), "a cat"),
                (PathBuf::from("train/sub/b.png"), "a dog")
            ]
        );

        let csv = tempfile::tempdir().unwrap();
        image(&csv.path().join("x.png"));
        std::fs::write(
            csv.path().join("metadata.csv"),
            "file_name,caption\nx.png,\"red, round\"\n",
        )
        .unwrap();
        let records = scan_imagefolder("data_root", csv.path(), "caption").unwrap();
        assert_eq!(records[0].caption, "red, round");
        let err = scan_imagefolder("data_root", csv.path(), "text").unwrap_err();
        assert!(err.to_string().contains("caption, file_name"), "{err}");
    }

    /// Folder names `datasets` takes for another split: the keyword between separators or
    /// digits, case as written. Catches COCO's `val2017` read as training data and `interval`
    /// (no separator) taken for a split.
    #[test]
    fn other_splits_are_named_as_datasets_names_them() {
        let root = Path::new("/d");
        let other = |rel: &str| in_other_split(root, &root.join(rel).join("metadata.jsonl"));
        for rel in ["test", "val2017", "test-images", "a/eval_set", "x/2val"] {
            assert!(other(rel), "{rel}");
        }
        for rel in ["", "train", "train2017", "interval", "contest", "Test"] {
            assert!(!other(rel), "{rel}");
        }
    }

    /// Rows that `datasets` or diffusers refuse are refused naming the file and the row.
    #[test]
    fn bad_rows_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        image(&dir.path().join("a.png"));
        let meta = dir.path().join("metadata.jsonl");
        for (row, why) in [
            (r#"{"file_name": "../a.png", "text": "x"}"#, "relative path"),
            (
                r#"{"file_name": "/etc/a.png", "text": "x"}"#,
                "relative path",
            ),
            (r#"{"file_name": "gone.png", "text": "x"}"#, "no such file"),
            (r#"{"text": "x"}"#, "no file_name"),
            (
                r#"{"file_name": "a.png", "text": ["x", "y"]}"#,
                "holds a list",
            ),
            (r#"{"file_name": "a.png", "text": 3}"#, "must be a text"),
            ("not json", "line 1"),
        ] {
            std::fs::write(&meta, row).unwrap();
            let err = scan_imagefolder("data_root", dir.path(), "text").unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains("metadata.jsonl") && msg.contains(why),
                "{row}: {msg}"
            );
        }
    }
}
