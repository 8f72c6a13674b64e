//! What a file that should hold weights is instead, told from its first bytes: the note an
//! error about a bad safetensors (or JSON) file ends with, so the user learns the cause rather
//! than a parser's "header too large". The usual causes:
//! - a **Git LFS pointer**: a Hugging Face repository cloned without Git LFS has ~130-byte text
//!   files (`version https://git-lfs.github.com/spec/v1`, `oid sha256:…`, `size …`) in place of
//!   every weights file;
//! - a **web page**: a `…/blob/main/…` link (or a download page that needs a login) saves the
//!   HTML around the file;
//! - a **server's error reply**, such as `{"error":"Access to model … is restricted"}` for a
//!   gated model;
//! - a **PyTorch checkpoint** (a zip archive, or a bare pickle) under a `.safetensors` name;
//! - an **empty** or **truncated** file: a download or copy that stopped part-way (the header
//!   promises more bytes than the file has).
//!
//! Only error paths call this; it reads at most the header.

use std::io::Read;
use std::path::Path;

/// How many bytes are read to tell what a file is.
const SNIFF_BYTES: usize = 512;

/// A safetensors header larger than this is not believed (safetensors' own limit is 100 MB).
const MAX_HEADER: u64 = 100_000_000;

/// `"; it is …"` when the first bytes of `path` show what it is instead of a safetensors file
/// (see the module header), else `""`.
pub fn safetensors_note(path: &Path) -> String {
    let Some((head, len)) = read_head(path) else {
        return String::new();
    };
    if let Some(note) = not_binary(&head, len) {
        return note;
    }
    truncation(path, &head, len).unwrap_or_default()
}

/// `"; it is …"` for a JSON file (a config, a tokenizer file) whose first bytes show it is a Git
/// LFS pointer, a web page or empty, else `""`.
pub fn json_note(path: &Path) -> String {
    match read_head(path) {
        Some((head, len)) => not_binary(&head, len)
            .filter(|n| !n.contains("error reply"))
            .unwrap_or_default(),
        None => String::new(),
    }
}

/// The first bytes of `path` and its length.
fn read_head(path: &Path) -> Option<(Vec<u8>, u64)> {
    let file = std::fs::File::open(path).ok()?;
    let len = file.metadata().ok()?.len();
    let mut head = Vec::with_capacity(SNIFF_BYTES);
    file.take(SNIFF_BYTES as u64).read_to_end(&mut head).ok()?;
    Some((head, len))
}

/// The note for a file that is text or another format where binary weights belong.
fn not_binary(head: &[u8], len: u64) -> Option<String> {
    if len == 0 {
        return Some("; it is empty (0 bytes): a download or copy that never wrote it".into());
    }
    if head.starts_with(b"version https://git-lfs.github.com/spec/") {
        return Some(format!(
            "; it is a Git LFS pointer ({len} bytes), not the weights: the repository was \
             cloned without Git LFS (run `git lfs install` then `git lfs pull` in it, or \
             download it with `huggingface-cli download`)"
        ));
    }
    let text = String::from_utf8_lossy(head);
    let trimmed = text.trim_start_matches('\u{feff}').trim_start();
    let lower = trimmed.to_ascii_lowercase();
    if lower.starts_with("<!doctype html") || lower.starts_with("<html") {
        return Some(
            "; it is a web page (HTML), not the file: the link saved the page around it (on \
             Hugging Face use the `resolve/main/…` link, not `blob/main/…`; a gated or \
             login-only download saves its login page)"
                .into(),
        );
    }
    if lower.starts_with("{\"error\"") {
        let reply: String = trimmed.chars().take(200).collect();
        return Some(format!(
            "; it is a server's error reply, not the file: {}",
            reply.trim_end()
        ));
    }
    if head.starts_with(b"PK\x03\x04") {
        return Some(
            "; it is a zip archive: a PyTorch checkpoint (`.ckpt`, `.pt`, `.bin`) under a \
             `.safetensors` name. sdtrain reads safetensors only: convert it (e.g. with \
             diffusers' conversion scripts) rather than renaming it"
                .into(),
        );
    }
    if head.first() == Some(&0x80) && head.get(1).is_some_and(|p| (2..=5).contains(p)) {
        return Some(
            "; it is a Python pickle (a PyTorch checkpoint) under a `.safetensors` name. \
             sdtrain reads safetensors only: convert it rather than renaming it"
                .into(),
        );
    }
    None
}

/// The note for a safetensors file shorter than its header says: the header's declared length,
/// then the largest tensor end it lists, against the file's length.
fn truncation(path: &Path, head: &[u8], len: u64) -> Option<String> {
    let n = u64::from_le_bytes(head.get(..8)?.try_into().ok()?);
    if n == 0 || n > MAX_HEADER {
        return None;
    }
    let stopped = |need: u64| {
        format!(
            "; it is truncated: {len} bytes where its header needs {need} (a download or copy \
             that stopped part-way; fetch it again)"
        )
    };
    if 8 + n > len {
        return Some(stopped(8 + n));
    }
    let mut header = vec![0u8; n as usize];
    let mut file = std::fs::File::open(path).ok()?;
    let mut skip = [0u8; 8];
    file.read_exact(&mut skip).ok()?;
    file.read_exact(&mut header).ok()?;
    let value: serde_json::Value = serde_json::from_slice(&header).ok()?;
    let end = value
        .as_object()?
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .filter_map(|(_, t)| t.get("data_offsets")?.get(1)?.as_u64())
        .max()?;
    (8 + n + end > len).then(|| stopped(8 + n + end))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note_of(bytes: &[u8]) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        std::fs::write(&path, bytes).unwrap();
        safetensors_note(&path)
    }

    /// Each cause is told from its first bytes; a sound file gets no note. Catches a rule that
    /// never fires or one that fires on real weights.
    #[test]
    fn each_cause_is_told_apart() {
        let lfs = b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 3438167536\n";
        assert!(note_of(lfs).contains("Git LFS pointer (73 bytes)"));
        assert!(note_of(b"\n  <!DOCTYPE html>\n<html>").contains("web page"));
        assert!(note_of(b"<HTML><head>").contains("web page"));
        let reply = br#"{"error":"Access to model x/y is restricted."}"#;
        assert!(note_of(reply).contains("error reply, not the file: {\"error\":\"Access"));
        assert!(note_of(b"PK\x03\x04archive/data.pkl").contains("zip archive"));
        assert!(note_of(b"\x80\x02\x8a\x0alz").contains("pickle"));
        assert!(note_of(b"").contains("empty"));

        let mut t = std::collections::HashMap::new();
        t.insert(
            "w".to_string(),
            candle_core::Tensor::zeros(64, candle_core::DType::F32, &candle_core::Device::Cpu)
                .unwrap(),
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        candle_core::safetensors::save(&t, &path).unwrap();
        let whole = std::fs::read(&path).unwrap();
        assert_eq!(safetensors_note(&path), "", "a sound file");
        let cut = &whole[..whole.len() - 10];
        let note = note_of(cut);
        assert!(
            note.contains(&format!(
                "truncated: {} bytes where its header needs {}",
                cut.len(),
                whole.len()
            )),
            "{note}"
        );
        assert!(
            note_of(&whole[..20]).contains("truncated"),
            "inside the header"
        );
    }

    #[test]
    fn json_files_get_the_text_notes_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vocab.json");
        std::fs::write(&path, "version https://git-lfs.github.com/spec/v1\n").unwrap();
        assert!(json_note(&path).contains("Git LFS pointer"));
        std::fs::write(&path, r#"{"error": 1}"#).unwrap();
        assert_eq!(json_note(&path), "", "a JSON object is JSON");
    }
}
