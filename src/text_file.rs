//! Text files as editors and shells save them: UTF-8, UTF-8 with a byte-order mark (Windows
//! Notepad before 2019), and UTF-16 with one (Notepad's "Unicode", and Windows PowerShell 5's
//! `>` and `Out-File`).

use std::path::{Path, PathBuf};

/// Why a text file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TextFileError {
    #[error("cannot read {}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} {reason}", path.display())]
    Encoding { path: PathBuf, reason: String },
}

impl TextFileError {
    /// True when the file is absent (rather than unreadable or badly encoded).
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }
}

/// Reads `path` as UTF-8 or UTF-16 text ([`decode_unicode`]).
pub fn read_unicode(path: &Path) -> Result<String, TextFileError> {
    let bytes = std::fs::read(path).map_err(|source| TextFileError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    decode_unicode(&bytes).map_err(|reason| TextFileError::Encoding {
        path: path.to_path_buf(),
        reason,
    })
}

/// UTF-16 (little- or big-endian) after its byte-order mark, else UTF-8 with any byte-order mark
/// removed. Anything else is an error saying where the first bad byte is.
pub fn decode_unicode(bytes: &[u8]) -> Result<String, String> {
    if let Some(text) = decode_utf16_bom(bytes) {
        return text;
    }
    match std::str::from_utf8(bytes) {
        Ok(text) => Ok(text.strip_prefix('\u{feff}').unwrap_or(text).to_string()),
        Err(e) => {
            let at = e.valid_up_to();
            Err(format!(
                "is not UTF-8 text: byte {at} is {:#04x}; save it as UTF-8",
                bytes[at]
            ))
        }
    }
}

/// The text after a UTF-16 byte-order mark, when `bytes` starts with one.
pub fn decode_utf16_bom(bytes: &[u8]) -> Option<Result<String, String>> {
    match bytes {
        [0xFF, 0xFE, rest @ ..] => Some(decode_utf16(rest, u16::from_le_bytes, "LE")),
        [0xFE, 0xFF, rest @ ..] => Some(decode_utf16(rest, u16::from_be_bytes, "BE")),
        _ => None,
    }
}

fn decode_utf16(body: &[u8], unit: fn([u8; 2]) -> u16, order: &str) -> Result<String, String> {
    if !body.len().is_multiple_of(2) {
        return Err(format!(
            "starts with a UTF-16 {order} byte-order mark but holds an odd number of bytes \
             after it ({}); save it again as UTF-8 or UTF-16",
            body.len()
        ));
    }
    let units = body.chunks_exact(2).map(|pair| unit([pair[0], pair[1]]));
    char::decode_utf16(units)
        .collect::<Result<String, _>>()
        .map_err(|e| {
            format!(
                "starts with a UTF-16 {order} byte-order mark but holds an unpaired surrogate \
                 {:#06x}; save it again as UTF-8 or UTF-16",
                e.unpaired_surrogate()
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each encoding an editor writes decodes to the same text; Latin-1 bytes are an error
    /// naming the offset. Catches a byte order read the wrong way round or a BOM kept.
    #[test]
    fn utf8_and_utf16_with_their_marks_decode_alike() {
        let text = "{\"a\": \"café ☕\"}";
        let mut le = vec![0xFF, 0xFE];
        let mut be = vec![0xFE, 0xFF];
        for unit in text.encode_utf16() {
            le.extend(unit.to_le_bytes());
            be.extend(unit.to_be_bytes());
        }
        let bom8 = [b"\xEF\xBB\xBF".as_slice(), text.as_bytes()].concat();
        for bytes in [text.as_bytes(), &bom8, &le, &be] {
            assert_eq!(decode_unicode(bytes).unwrap(), text);
        }
        let err = decode_unicode(b"{\"a\": \"caf\xe9\"}").unwrap_err();
        assert!(err.contains("byte 10 is 0xe9"), "{err}");
        assert!(decode_unicode(&le[..le.len() - 1])
            .unwrap_err()
            .contains("odd number"));
    }
}
