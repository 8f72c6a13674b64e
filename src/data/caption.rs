//! Captions, with EveryDream2's rules (`data/dataset.py`, `utils/fs_helpers.py`,
//! `data/image_train_item.py` in victorchall/EveryDream2trainer):
//!
//! - The caption of `dir/<stem>.<ext>` is the sibling `dir/<stem>.txt`, else `dir/<stem>.caption`
//!   (exact file-name match), else the file name: the stem (extension stripped, like Python's
//!   `os.path.splitext`) up to its first `_`, so `a photo_1.jpg` → `a photo`.
//! - The whole caption file is read, not just its first line. It is split on `,` and every piece
//!   is trimmed: the first piece is the main prompt, the rest are tags, deduplicated in order of
//!   first appearance (ED2 keeps them in a dict), then rejoined with `", "`.
//! - A caption file that is empty or whitespace gives no main prompt, so the file name's caption is
//!   used instead (ED2's `__ensure_caption`); tags from the file are kept after it.
//! - Text is UTF-8; a file that is not valid UTF-8 is read as Latin-1 (ED2 tries utf-8, then
//!   iso-8859-1). A file that starts with a UTF-16 byte-order mark (`FF FE` or `FE FF`, what
//!   Windows Notepad saves as "Unicode") is read as UTF-16.
//!
//! Deliberate differences: when both `.txt` and `.caption` exist, `.txt` wins (ED2 merges both and
//! ends up preferring `.caption`'s main prompt), empty tags (`a,,b`) are dropped rather than kept
//! as `""`, a UTF-8 byte-order mark is stripped, UTF-16 is decoded (ED2 reads it as Latin-1,
//! a caption of NUL-separated letters), and an image left with no caption at all is an
//! error naming it (ED2 fails with an unhelpful StopIteration).

use std::path::Path;

use super::DataError;

/// Sidecar caption extensions, in the order they are tried.
pub const CAPTION_EXTENSIONS: [&str; 2] = ["txt", "caption"];

/// A caption split into its main prompt (the first comma piece) and its tags.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Caption {
    pub main: String,
    pub tags: Vec<String>,
}

impl Caption {
    /// Splits on `,`, trims every piece, drops empty and repeated tags.
    pub fn parse(text: &str) -> Self {
        let mut pieces = text.split(',').map(str::trim);
        let main = pieces.next().unwrap_or_default().to_string();
        let mut tags: Vec<String> = Vec::new();
        for piece in pieces {
            if !piece.is_empty() && !tags.iter().any(|t| t == piece) {
                tags.push(piece.to_string());
            }
        }
        Caption { main, tags }
    }

    /// The caption as the text encoder sees it: `main, tag1, tag2`.
    pub fn render(&self) -> String {
        let mut out = self.main.clone();
        for tag in &self.tags {
            if !out.is_empty() {
                out.push_str(", ");
            }
            out.push_str(tag);
        }
        out
    }
}

/// kohya's `caption_prefix` and `caption_suffix` (`process_caption`): `prefix + " " + caption`
/// and `caption + " " + suffix`, each only when given and not empty.
pub fn with_affixes(caption: &str, prefix: Option<&str>, suffix: Option<&str>) -> String {
    let mut out = caption.to_string();
    if let Some(p) = prefix.filter(|p| !p.is_empty()) {
        out = format!("{p} {out}");
    }
    if let Some(s) = suffix.filter(|s| !s.is_empty()) {
        out = format!("{out} {s}");
    }
    out
}

/// The caption EveryDream2 derives from a file name: the stem's text before the first `_`.
pub fn caption_from_file_name(image: &Path) -> Caption {
    let stem = image
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let before_underscore = stem.split('_').next().unwrap_or_default();
    Caption::parse(before_underscore)
}

/// Reads a caption file (also a YAML sidecar, `multiply.txt`, …) as text: see [`decode_text`].
pub fn read_caption_file(path: &Path) -> Result<String, DataError> {
    let bytes = std::fs::read(path).map_err(|source| DataError::ReadFile {
        path: path.to_path_buf(),
        source,
    })?;
    decode_text(&bytes).map_err(|reason| DataError::Text {
        path: path.to_path_buf(),
        reason,
    })
}

/// Decodes a text file: UTF-16 (little- or big-endian) when it starts with that byte-order mark,
/// else UTF-8 (its byte-order mark stripped), else Latin-1. Only UTF-16 can fail: an odd number
/// of bytes or an unpaired surrogate.
pub fn decode_text(bytes: &[u8]) -> Result<String, String> {
    if let Some(text) = crate::text_file::decode_utf16_bom(bytes) {
        return text;
    }
    let text = match String::from_utf8(bytes.to_vec()) {
        Ok(text) => text,
        // Latin-1 maps every byte to the code point of the same value.
        Err(_) => bytes.iter().map(|&b| char::from(b)).collect(),
    };
    Ok(text.strip_prefix('\u{feff}').unwrap_or(&text).to_string())
}

/// Resolves the caption of `image`. `sidecar` is the caption file found for it, if any (the
/// scanner decides which, see [`CAPTION_EXTENSIONS`]).
pub fn resolve_caption(image: &Path, sidecar: Option<&Path>) -> Result<String, DataError> {
    let mut caption = match sidecar {
        Some(file) => Caption::parse(&read_caption_file(file)?),
        None => Caption::default(),
    };
    if caption.main.is_empty() {
        let from_name = caption_from_file_name(image);
        caption.main = from_name.render();
    }
    let text = caption.render();
    if text.is_empty() {
        return Err(DataError::EmptyCaption {
            path: image.to_path_buf(),
        });
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kohya's `prefix + " " + caption + " " + suffix`; empty ones add nothing.
    #[test]
    fn affixes_join_with_a_space_as_kohya() {
        let both = with_affixes("a cat", Some("masterpiece,"), Some("4k"));
        assert_eq!(both, "masterpiece, a cat 4k");
        assert_eq!(with_affixes("a cat", Some(""), None), "a cat");
        assert_eq!(with_affixes("a cat", None, Some("sks")), "a cat sks");
    }

    #[test]
    fn file_name_rule_takes_text_before_first_underscore_without_extension() {
        let cases = [
            ("a photo_1.jpg", "a photo"),
            ("a photo.jpg", "a photo"),
            ("dog_cat_3.png", "dog"),
            ("x/y/a red car_001.webp", "a red car"),
            ("name.with.dots_2.png", "name.with.dots"),
            ("_0001.png", ""),
            ("cat, sitting_1.png", "cat, sitting"),
        ];
        for (name, want) in cases {
            assert_eq!(
                caption_from_file_name(Path::new(name)).render(),
                want,
                "{name}"
            );
        }
    }

    #[test]
    fn parse_trims_pieces_dedups_and_drops_empty_tags() {
        let c = Caption::parse("  a cat ,sitting,  sitting, , on a mat \n");
        assert_eq!(c.main, "a cat");
        assert_eq!(c.tags, vec!["sitting", "on a mat"]);
        assert_eq!(c.render(), "a cat, sitting, on a mat");
    }

    #[test]
    fn whole_file_is_the_caption_not_the_first_line() {
        assert_eq!(
            Caption::parse("line one\nline two\n").render(),
            "line one\nline two"
        );
    }

    #[test]
    fn empty_main_prompt_falls_back_to_file_name() {
        let dir = tempfile::tempdir().unwrap();
        let txt = dir.path().join("a dog_3.txt");
        std::fs::write(&txt, "  \n").unwrap();
        let image = dir.path().join("a dog_3.png");
        assert_eq!(resolve_caption(&image, Some(&txt)).unwrap(), "a dog");
        std::fs::write(&txt, ", running, grass").unwrap();
        assert_eq!(
            resolve_caption(&image, Some(&txt)).unwrap(),
            "a dog, running, grass"
        );
    }

    #[test]
    fn no_caption_anywhere_is_an_error_naming_the_image() {
        let err = resolve_caption(Path::new("/d/_0001.png"), None).unwrap_err();
        assert!(matches!(err, DataError::EmptyCaption { .. }));
        assert!(err.to_string().contains("_0001.png"), "{err}");
    }

    #[test]
    fn latin1_and_bom_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let latin = dir.path().join("l.txt");
        std::fs::write(&latin, b"caf\xe9").unwrap();
        assert_eq!(read_caption_file(&latin).unwrap(), "café");
        let bom = dir.path().join("b.txt");
        std::fs::write(&bom, "\u{feff}hello").unwrap();
        assert_eq!(read_caption_file(&bom).unwrap(), "hello");
    }

    /// Regression: Notepad's "Unicode" (UTF-16 with a byte-order mark) was read as Latin-1, a
    /// caption of letters separated by NUL characters.
    #[test]
    fn utf16_with_a_bom_is_decoded() {
        let text = "a café, tag";
        let mut le = vec![0xFF, 0xFE];
        let mut be = vec![0xFE, 0xFF];
        for unit in text.encode_utf16() {
            le.extend(unit.to_le_bytes());
            be.extend(unit.to_be_bytes());
        }
        assert_eq!(decode_text(&le).unwrap(), text);
        assert_eq!(decode_text(&be).unwrap(), text);
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a cat_1.txt");
        std::fs::write(&file, &le).unwrap();
        let image = dir.path().join("a cat_1.png");
        assert_eq!(resolve_caption(&image, Some(&file)).unwrap(), text);
        // Latin-1 without a mark is read as before.
        assert_eq!(decode_text(b"\xffcaf\xe9").unwrap(), "\u{ff}café");
    }

    #[test]
    fn broken_utf16_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("odd.txt");
        std::fs::write(&file, [0xFF, 0xFE, b'a', 0, b'b']).unwrap();
        let err = read_caption_file(&file).unwrap_err().to_string();
        assert!(
            err.contains("odd.txt") && err.contains("odd number"),
            "{err}"
        );
        std::fs::write(&file, [0xFF, 0xFE, 0x00, 0xD8, b'a', 0]).unwrap();
        let err = read_caption_file(&file).unwrap_err().to_string();
        assert!(err.contains("unpaired surrogate 0xd800"), "{err}");
    }
}
