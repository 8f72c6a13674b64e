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
/// (see the module header), else the note on the first entry of its header that disagrees with
/// its dtype, shape, offsets or the file's length, naming the tensor ([`header_problem`]), else
/// `""`.
pub fn safetensors_note(path: &Path) -> String {
    let Some((head, len)) = read_head(path) else {
        return String::new();
    };
    if let Some(note) = not_binary(&head, len) {
        return note;
    }
    header_note(path, &head, len).unwrap_or_default()
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
             `.safetensors` name. Give it its `.ckpt`/`.pt` name back (a model, VAE or LoRA is \
             then read as data, nothing in it run), or convert it: `sdtrain convert --model \
             <file>.ckpt --out <file>.safetensors`"
                .into(),
        );
    }
    if head.first() == Some(&0x80) && head.get(1).is_some_and(|p| (2..=5).contains(p)) {
        return Some(
            "; it is a Python pickle (a PyTorch checkpoint in torch's legacy format, before \
             1.6) under a `.safetensors` name. Give it its `.ckpt`/`.pt` name back (it is then \
             read as data, nothing in it run), or convert it: `sdtrain convert --model \
             <file>.ckpt --out <file>.safetensors`"
                .into(),
        );
    }
    None
}

/// The note for a safetensors file shorter than its header says (the header's declared length,
/// then the largest tensor end it lists, against the file's length), or whose header's entries
/// are inconsistent ([`header_problem`]).
fn header_note(path: &Path, head: &[u8], len: u64) -> Option<String> {
    let n = u64::from_le_bytes(head.get(..8)?.try_into().ok()?);
    if n == 0 || n > MAX_HEADER {
        return None;
    }
    let stopped = |need: u64, tensor: &str| {
        format!(
            "; it is truncated: {len} bytes where its header needs {need}{tensor} (a download or \
             copy that stopped part-way; fetch it again)"
        )
    };
    if 8 + n > len {
        return Some(stopped(8 + n, ""));
    }
    let mut header = vec![0u8; n as usize];
    let mut file = std::fs::File::open(path).ok()?;
    let mut skip = [0u8; 8];
    file.read_exact(&mut skip).ok()?;
    file.read_exact(&mut header).ok()?;
    let value: serde_json::Value = serde_json::from_slice(&header).ok()?;
    let last = value
        .as_object()?
        .iter()
        .filter(|(k, _)| k.as_str() != METADATA)
        .filter_map(|(k, t)| Some((t.get("data_offsets")?.get(1)?.as_u64()?, k)))
        .max();
    if let Some((end, name)) = last {
        if end.checked_add(8 + n).is_none_or(|need| need > len) {
            let need = end.saturating_add(8 + n);
            return Some(stopped(need, &format!(" for tensor `{name}`")));
        }
    }
    header_problem(&value, len - 8 - n).map(|p| format!("; {p}"))
}

/// The header's metadata entry.
const METADATA: &str = "__metadata__";

/// The size in bits of an element of safetensors dtype `name`, if it is one.
fn dtype_bits(name: &str) -> Option<u64> {
    Some(match name {
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" | "C64" => 64,
        _ => return None,
    })
}

/// The problem with one tensor entry of a safetensors header, if any: its dtype, its shape, its
/// offsets, or a byte count its shape and dtype do not give. Returns its offsets when sound.
fn entry_problem(name: &str, e: &serde_json::Value) -> Result<(u64, u64), String> {
    let dtype = e.get("dtype").and_then(|d| d.as_str());
    let bits = dtype
        .and_then(dtype_bits)
        .ok_or_else(|| format!("tensor `{name}` has no known dtype (found {})", e["dtype"]))?;
    let shape: Option<Vec<u64>> = e
        .get("shape")
        .and_then(|s| s.as_array())
        .and_then(|s| s.iter().map(|d| d.as_u64()).collect());
    let shape = shape.ok_or_else(|| {
        format!(
            "tensor `{name}` has shape {}, not a list of sizes",
            e["shape"]
        )
    })?;
    let offsets: Option<Vec<u64>> = e
        .get("data_offsets")
        .and_then(|s| s.as_array())
        .and_then(|s| s.iter().map(|d| d.as_u64()).collect());
    let (start, end) = match offsets.as_deref() {
        Some(&[start, end]) if start <= end => (start, end),
        _ => {
            return Err(format!(
                "tensor `{name}` has data_offsets {}, not [start, end] with start ≤ end",
                e["data_offsets"]
            ))
        }
    };
    let need = shape
        .iter()
        .try_fold(bits, |acc, &d| acc.checked_mul(d))
        .map(|b| b.div_ceil(8));
    match need {
        Some(need) if need == end - start => Ok((start, end)),
        Some(need) => Err(format!(
            "tensor `{name}` of shape {shape:?} and dtype {} needs {need} bytes, but its \
             data_offsets [{start}, {end}] hold {}",
            dtype.unwrap_or_default(),
            end - start
        )),
        None => Err(format!(
            "tensor `{name}` has shape {shape:?}, too large to be stored"
        )),
    }
}

/// The first inconsistency of a parsed safetensors header against itself and the `data_len`
/// bytes after it, naming the tensor or metadata key: an entry's dtype, shape or offsets
/// ([`entry_problem`]), two tensors that overlap or leave a gap, bytes no tensor covers, a
/// `__metadata__` that is not strings.
pub fn header_problem(header: &serde_json::Value, data_len: u64) -> Option<String> {
    let Some(map) = header.as_object() else {
        return Some("its header is not a JSON object".into());
    };
    if let Some(meta) = map.get(METADATA) {
        let Some(meta) = meta.as_object() else {
            return Some(format!("its `{METADATA}` is {meta}, not an object"));
        };
        if let Some((k, v)) = meta.iter().find(|(_, v)| !v.is_string()) {
            return Some(format!(
                "its `{METADATA}` value `{k}` is {v}; metadata values must be strings"
            ));
        }
    }
    let mut spans = Vec::new();
    for (name, e) in map.iter().filter(|(k, _)| k.as_str() != METADATA) {
        match entry_problem(name, e) {
            Ok((start, end)) => spans.push((start, end, name)),
            Err(problem) => return Some(problem),
        }
    }
    spans.sort();
    let mut at = (0, String::new());
    for (start, end, name) in spans {
        if at.1.is_empty() && start != 0 {
            return Some(format!(
                "tensor `{name}` (data_offsets [{start}, {end}]) comes first but does not start \
                 at 0"
            ));
        }
        if start != at.0 {
            let how = if start < at.0 {
                "overlaps"
            } else {
                "leaves a gap after"
            };
            return Some(format!(
                "tensor `{name}` (data_offsets [{start}, {end}]) {how} {} (ending at {})",
                at.1, at.0
            ));
        }
        at = (end, format!("tensor `{name}`"));
    }
    (at.0 != data_len).then(|| {
        format!(
            "its tensors cover {} bytes, but {data_len} follow the header (bytes no tensor \
             names)",
            at.0
        )
    })
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

    /// Each way a header's entries can disagree is named with the tensor (or metadata key): the
    /// safetensors crate's own messages for these name none ("invalid shape, data type, or
    /// offset for tensor", "overflow computing buffer size"), which is what scripts/fuzz-files
    /// found for a LoRA with a rank of 2^31 in its header.
    #[test]
    fn header_problems_name_the_tensor() {
        let entry = |dtype: &str, shape: serde_json::Value, a: u64, b: u64| serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [a, b]});
        let header = |x: serde_json::Value| serde_json::json!({"__metadata__": {"k": "v"}, "a.alpha": entry("F32", serde_json::json!([]), 0, 4), "b.down": x});
        let ok = header(entry("F16", serde_json::json!([2, 3]), 4, 16));
        assert_eq!(header_problem(&ok, 16), None, "a sound header");
        for (x, data_len, want) in [
            (entry("F16", serde_json::json!([2147483648u64, 3]), 4, 16), 16, "`b.down` of shape [2147483648, 3] and dtype F16 needs 12884901888 bytes, but its data_offsets [4, 16] hold 12"),
            (entry("F16", serde_json::json!([1u64 << 62, 1u64 << 62]), 4, 16), 16, "`b.down` has shape [4611686018427387904, 4611686018427387904], too large"),
            (entry("F16", serde_json::json!([-1, 3]), 4, 16), 16, "`b.down` has shape [-1,3], not a list of sizes"),
            (entry("F16", serde_json::json!([1.5]), 4, 16), 16, "`b.down` has shape [1.5]"),
            (entry("F128", serde_json::json!([2, 3]), 4, 16), 16, "`b.down` has no known dtype (found \"F128\")"),
            (entry("F16", serde_json::json!([2, 3]), 16, 4), 16, "`b.down` has data_offsets [16,4], not [start, end]"),
            (entry("F16", serde_json::json!([2, 3]), 0, 12), 12, "`b.down` (data_offsets [0, 12]) overlaps tensor `a.alpha`"),
            (entry("F16", serde_json::json!([2, 3]), 8, 20), 20, "`b.down` (data_offsets [8, 20]) leaves a gap after tensor `a.alpha`"),
            (entry("F16", serde_json::json!([2, 3]), 4, 16), 17, "cover 16 bytes, but 17 follow"),
        ] {
            let got = header_problem(&header(x), data_len).unwrap_or_default();
            assert!(got.contains(want), "want `{want}` in `{got}`");
        }
        let meta = serde_json::json!({"__metadata__": {"ss_network_dim": 4}});
        let got = header_problem(&meta, 0).unwrap_or_default();
        assert!(got.contains("`ss_network_dim` is 4"), "{got}");

        // Through the note, with the file: a LoRA header claiming a rank of 2^31.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lora.safetensors");
        // A safetensors file of `header` and 8 bytes of data.
        let write = |header: serde_json::Value| {
            let text = header.to_string();
            let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(text.as_bytes());
            bytes.extend_from_slice(&[0; 8]);
            std::fs::write(&path, &bytes).unwrap();
        };
        write(
            serde_json::json!({"m.lora_down.weight": entry("F32", serde_json::json!([2147483648u64, 2]), 0, 8)}),
        );
        let note = safetensors_note(&path);
        assert!(
            note.starts_with("; tensor `m.lora_down.weight` of shape [2147483648, 2]"),
            "{note}"
        );
        // Offsets past the end name the tensor that ends there.
        write(
            serde_json::json!({"m.alpha": entry("F32", serde_json::json!([]), 0, 4), "m.lora_up.weight": entry("F32", serde_json::json!([2, 2]), 4, 20)}),
        );
        let note = safetensors_note(&path);
        assert!(
            note.contains("truncated") && note.contains("for tensor `m.lora_up.weight`"),
            "{note}"
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
