//! A OneTrainer concept's images and captions (`crate::config`'s OneTrainer import makes each
//! concept a dataset subset, `super::kohya_subsets`), as OneTrainer's data loader (mgds
//! `CollectPaths`, `LoadMultipleTexts`) reads them:
//!
//! - the image files in the concept's folder, and with `include_subdirectories` in every folder
//!   below it whose name does not start with `.`, sorted by path; loss masks (`-masklabel`) are
//!   not training images;
//! - the caption, by the concept's prompt source: `sample`, the `.txt` beside the image;
//!   `filename`, the image's file name without its extension, as it is; `concept`, the one text
//!   file the concept names. A caption file holds one caption per non-empty line (trimmed), and
//!   each sample trains one of them, drawn anew (the subset's `random_line`); an image without
//!   a caption file, or with an empty one, trains on the empty caption, as in OneTrainer.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::caption::read_caption_file;
use super::DataError;

/// Where a concept's captions come from (OneTrainer's `text.prompt_source`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "from")]
pub enum ConceptPrompts {
    /// `sample`: the `.txt` beside each image.
    Sample,
    /// `filename`: the image's file stem.
    FileName,
    /// `concept`: one file of captions for every image (`text.prompt_path`).
    File { path: PathBuf },
}

/// How many samples of the concept an epoch holds (OneTrainer's `balancing` and its strategy).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "strategy", content = "balancing")]
pub enum ConceptBalancing {
    /// REPEATS: each image `balancing` times (a fraction: that share of the images, drawn each
    /// epoch, as EveryDream2's `multiply.txt`).
    Repeats(f64),
    /// SAMPLES: `balancing` samples of the concept in all, spread evenly over its images.
    Samples(f64),
}

impl ConceptBalancing {
    /// Each image's multiplier in a concept of `images` images.
    pub fn multiplier(self, images: usize) -> f64 {
        match self {
            ConceptBalancing::Repeats(r) => r,
            ConceptBalancing::Samples(n) => n / images.max(1) as f64,
        }
    }
}

/// The concept's images, sorted by path.
pub fn images(dir: &Path, recursive: bool) -> Result<Vec<PathBuf>, DataError> {
    let mut out = super::kohya_layout::subset_images(dir)?;
    if recursive {
        let read_err = |source| DataError::ReadDir {
            path: dir.to_path_buf(),
            source,
        };
        for entry in std::fs::read_dir(dir).map_err(read_err)? {
            let path = entry.map_err(read_err)?.path();
            let hidden = path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'));
            if path.is_dir() && !hidden {
                out.extend(images(&path, true)?);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The captions of a caption file: its non-empty lines, trimmed, one per line; `""` for an
/// empty file.
pub fn caption_lines(path: &Path) -> Result<String, DataError> {
    let text = read_caption_file(path)?;
    let lines: Vec<&str> = text
        .split(['\n', '\r'])
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    Ok(lines.join("\n"))
}

/// The caption (or captions, one per line) of `image`; `concept_file` is the `concept` source's
/// file, read once by the caller. `lowercase` (`caps_randomize_lowercase`) lower-cases it, as
/// OneTrainer's `CapitalizeTags` does before anything else.
pub fn caption(
    image: &Path,
    prompts: &ConceptPrompts,
    concept_file: Option<&str>,
    lowercase: bool,
) -> Result<String, DataError> {
    let text = caption_as_written(image, prompts, concept_file)?;
    Ok(match lowercase {
        true => text.to_lowercase(),
        false => text,
    })
}

fn caption_as_written(
    image: &Path,
    prompts: &ConceptPrompts,
    concept_file: Option<&str>,
) -> Result<String, DataError> {
    match prompts {
        ConceptPrompts::Sample => {
            let txt = image.with_extension("txt");
            match txt.is_file() {
                true => caption_lines(&txt),
                false => Ok(String::new()),
            }
        }
        ConceptPrompts::FileName => Ok(image
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()),
        ConceptPrompts::File { .. } => Ok(concept_file.unwrap_or_default().to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balancing_gives_each_image_its_share() {
        assert_eq!(ConceptBalancing::Repeats(1.5).multiplier(10), 1.5);
        assert_eq!(ConceptBalancing::Samples(25.0).multiplier(10), 2.5);
        assert_eq!(ConceptBalancing::Samples(3.0).multiplier(0), 3.0);
    }

    #[test]
    fn captions_follow_the_prompt_source_and_subfolders_are_read_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("sub")).unwrap();
        std::fs::create_dir_all(root.join(".hidden")).unwrap();
        for p in [
            "a.png",
            "b.jpg",
            "sub/c.png",
            ".hidden/d.png",
            "a-masklabel.png",
        ] {
            std::fs::write(root.join(p), b"x").unwrap();
        }
        std::fs::write(root.join("a.txt"), " first \n\n second\r\n").unwrap();
        std::fs::write(root.join("b.txt"), "").unwrap();
        let flat = images(root, false).unwrap();
        assert_eq!(flat, vec![root.join("a.png"), root.join("b.jpg")]);
        let deep = images(root, true).unwrap();
        assert_eq!(deep.len(), 3, "{deep:?}");
        assert!(deep.contains(&root.join("sub/c.png")));

        let sample = ConceptPrompts::Sample;
        assert_eq!(
            caption(&root.join("a.png"), &sample, None, false).unwrap(),
            "first\nsecond"
        );
        assert_eq!(
            caption(&root.join("b.jpg"), &sample, None, false).unwrap(),
            ""
        );
        assert_eq!(
            caption(&root.join("sub/c.png"), &sample, None, false).unwrap(),
            ""
        );
        let name = ConceptPrompts::FileName;
        assert_eq!(
            caption(&root.join("b.jpg"), &name, None, false).unwrap(),
            "b"
        );
        let file = ConceptPrompts::File {
            path: root.join("p.txt"),
        };
        assert_eq!(
            caption(&root.join("a.png"), &file, Some("x\ny"), false).unwrap(),
            "x\ny"
        );
        assert_eq!(
            caption(&root.join("a.png"), &file, Some("SKS Shape\nÉtÉ"), true).unwrap(),
            "sks shape\nété"
        );
    }
}
