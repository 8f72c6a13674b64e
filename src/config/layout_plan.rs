//! `data_layout`: how `data_root` (and `reg_data_root`) are read, with the keys of each layout:
//! - `"everydream"` (the default): EveryDream2's folders, captions from `.txt`/`.caption` files
//!   or file names;
//! - `"kohya"`: kohya's `<repeats>_<class tokens>` folders, captions in `caption_extension`
//!   files;
//! - `"imagefolder"`: Hugging Face's imagefolder, what diffusers' training scripts read from
//!   `--train_data_dir`: `metadata.jsonl`/`metadata.csv` rows naming each image, the caption in
//!   `caption_column` (diffusers' `--caption_column`, default `text`).
//!
//! With `data_layout` left out, a `data_root` holding a metadata file is read as an imagefolder
//! (a note says so): EveryDream2's reading would caption its images by their file names. Each
//! layout's own key is refused beside another layout.

use std::path::Path;

use super::ctx::Ctx;
use super::error::ConfigError;
use super::regularization_plan::caption_extension;
use super::train_file::TrainFile;
use crate::data::imagefolder::{is_imagefolder, DEFAULT_CAPTION_COLUMN};
use crate::data::kohya_layout::DEFAULT_CAPTION_EXTENSION;
use crate::data::DataLayout;

/// `data_layout` and its keys; `data_root` (when it exists) decides a layout left out.
pub(super) fn resolve_layout(
    file: &TrainFile,
    ctx: &Ctx<'_>,
    data_root: Option<&Path>,
) -> Result<DataLayout, ConfigError> {
    let metadata = data_root.is_some_and(is_imagefolder);
    let name =
        match file.data_layout.as_deref() {
            Some(name) => name,
            None if metadata => {
                crate::console::say(format_args!(
                "note: data_root holds a metadata.jsonl or metadata.csv: read as Hugging Face's \
                 imagefolder (what diffusers' scripts read from --train_data_dir), captions from \
                 its `{}` column; set data_layout to \"everydream\" to read it as EveryDream2 does",
                file.caption_column.as_deref().unwrap_or(DEFAULT_CAPTION_COLUMN)
            ));
                "imagefolder"
            }
            None => "everydream",
        };
    let ext = file.caption_extension.as_deref();
    let refuse_ext = |layout: &str| {
        Err(ctx.invalid(
            "caption_extension",
            format!(
                "applies to `\"data_layout\": \"kohya\"`; {layout} (or leave it out for the caption \
                 files of EveryDream2's layout)"
            ),
        ))
    };
    let refuse_column = || {
        Err(ctx.invalid(
            "caption_column",
            "applies to `\"data_layout\": \"imagefolder\"` (a metadata.jsonl or metadata.csv's \
             column, diffusers' --caption_column)"
                .into(),
        ))
    };
    match name {
        "everydream" => {
            if ext.is_some() {
                return refuse_ext(
                    "EveryDream2's layout reads the .txt or .caption file beside each image",
                );
            }
            if file.caption_column.is_some() {
                return refuse_column();
            }
            if metadata {
                crate::console::say(format_args!(
                    "warning: data_root holds a metadata.jsonl or metadata.csv, which \
                     data_layout \"everydream\" does not read: images without a caption file are \
                     captioned by their file names (data_layout \"imagefolder\" reads it)"
                ));
            }
            Ok(DataLayout::Everydream)
        }
        "kohya" => {
            if file.caption_column.is_some() {
                return refuse_column();
            }
            let ext = ext.unwrap_or(DEFAULT_CAPTION_EXTENSION);
            Ok(DataLayout::Kohya {
                caption_extension: caption_extension(ext)
                    .map_err(|why| ctx.invalid("caption_extension", why))?,
            })
        }
        "imagefolder" => {
            if ext.is_some() {
                return refuse_ext("the imagefolder layout reads captions from its metadata file");
            }
            let column = file
                .caption_column
                .as_deref()
                .unwrap_or(DEFAULT_CAPTION_COLUMN);
            if column.trim().is_empty() {
                return Err(ctx.invalid("caption_column", "must name a column".into()));
            }
            Ok(DataLayout::ImageFolder {
                caption_column: column.to_string(),
            })
        }
        other => Err(ctx.invalid(
            "data_layout",
            format!(
                "must be \"everydream\" (EveryDream2's folders, the default), \"kohya\" (kohya's \
                 `<repeats>_<class tokens>` folders) or \"imagefolder\" (Hugging Face's, with a \
                 metadata.jsonl: diffusers' --train_data_dir); got \"{other}\""
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn file(v: serde_json::Value) -> TrainFile {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn layouts_and_caption_extensions() {
        let ctx = Ctx::new(Path::new("train.json"));
        let layout = |v| resolve_layout(&file(v), &ctx, None);
        assert_eq!(layout(json!({})).unwrap(), DataLayout::Everydream);
        let kohya = |ext: &str| DataLayout::Kohya {
            caption_extension: ext.into(),
        };
        assert_eq!(
            layout(json!({"data_layout": "kohya"})).unwrap(),
            kohya(".caption")
        );
        for given in ["txt", ".txt", " .txt "] {
            let got = layout(json!({"data_layout": "kohya", "caption_extension": given}));
            assert_eq!(got.unwrap(), kohya(".txt"), "{given}");
        }
        for (v, key) in [
            (json!({"data_layout": "onetrainer"}), "data_layout"),
            (json!({"caption_extension": ".txt"}), "caption_extension"),
            (
                json!({"data_layout": "kohya", "caption_extension": "."}),
                "caption_extension",
            ),
            (
                json!({"data_layout": "kohya", "caption_extension": "a/b"}),
                "caption_extension",
            ),
        ] {
            let msg = layout(v.clone()).unwrap_err().to_string();
            assert!(msg.contains(key), "{v}: {msg}");
        }
    }

    /// A data_root with a metadata file is an imagefolder unless data_layout says otherwise; its
    /// caption column defaults to diffusers' `text`; each layout's key is refused beside
    /// another. Catches the metadata ignored (captions from file names) and a column key that
    /// silently does nothing.
    #[test]
    fn a_metadata_file_makes_an_imagefolder() {
        let ctx = Ctx::new(Path::new("train.json"));
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("metadata.jsonl"), "").unwrap();
        let with = |v| resolve_layout(&file(v), &ctx, Some(dir.path()));
        let folder = |c: &str| DataLayout::ImageFolder {
            caption_column: c.into(),
        };
        assert_eq!(with(json!({})).unwrap(), folder("text"));
        assert_eq!(
            with(json!({"caption_column": "prompt"})).unwrap(),
            folder("prompt")
        );
        assert_eq!(
            with(json!({"data_layout": "everydream"})).unwrap(),
            DataLayout::Everydream
        );
        let bare = tempfile::tempdir().unwrap();
        let without = |v| resolve_layout(&file(v), &ctx, Some(bare.path()));
        assert_eq!(without(json!({})).unwrap(), DataLayout::Everydream);
        assert_eq!(
            without(json!({"data_layout": "imagefolder"})).unwrap(),
            folder("text")
        );
        for (v, key) in [
            (json!({"caption_column": "text"}), "caption_column"),
            (
                json!({"data_layout": "kohya", "caption_column": "text"}),
                "caption_column",
            ),
            (
                json!({"data_layout": "imagefolder", "caption_extension": ".txt"}),
                "caption_extension",
            ),
        ] {
            let msg = without(v.clone()).unwrap_err().to_string();
            assert!(msg.contains(key), "{v}: {msg}");
        }
    }
}
