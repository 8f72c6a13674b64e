//! The hashes kohya sd-scripts writes into an adapter file's header so that A1111 (and its
//! additional-networks extension) need not read the file to index it (`library/train_util.py`:
//! `precalculate_safetensors_hashes`, `addnet_hash_safetensors`, `addnet_hash_legacy`):
//! - `sshs_model_hash`: the SHA-256 of everything after the header, the tensors' bytes. It is
//!   what A1111 computes itself for a file without it, and the same whatever the header holds;
//! - `sshs_legacy_hash`: the first 8 hex digits of the SHA-256 of the 64 KiB at 1 MiB into the
//!   file, as serialized with only its `ss_*` metadata (kohya's rule, so that user metadata
//!   added later does not change it).
//!
//! And a base model file's hashes as A1111 names models by them ([`file_hashes`]), which kohya
//! records as `ss_sd_model_hash` and `ss_new_sd_model_hash`.

use std::path::Path;

use sha2::{Digest, Sha256};

/// `sshs_model_hash` and `sshs_legacy_hash` of a serialized safetensors file.
pub fn addnet_hashes(file: &[u8]) -> (String, String) {
    let header_len = file
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes);
    let data_start = usize::try_from(header_len)
        .ok()
        .and_then(|n| n.checked_add(8))
        .map_or(file.len(), |start| start.min(file.len()));
    let model = hex(&Sha256::digest(&file[data_start..]));
    let window = |at: usize| at.min(file.len());
    let legacy = hex(&Sha256::digest(&file[window(0x10_0000)..window(0x11_0000)]));
    (model, legacy[..8].to_string())
}

/// kohya's `model_hash` and `calculate_sha256` of a file, read once.
pub fn file_hashes(path: &Path) -> std::io::Result<(String, String)> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut full = Sha256::new();
    let mut legacy = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0usize;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        full.update(&buf[..n]);
        // The legacy window: bytes [1 MiB, 1 MiB + 64 KiB).
        let (lo, hi) = (0x10_0000usize, 0x11_0000usize);
        let (start, end) = (at.max(lo), (at + n).min(hi));
        if start < end {
            legacy.update(&buf[start - at..end - at]);
        }
        at += n;
    }
    Ok((
        hex(&legacy.finalize())[..8].to_string(),
        hex(&full.finalize()),
    ))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expected values from kohya's `addnet_hash_safetensors` and `addnet_hash_legacy` run on
    /// the same bytes (tests/fixtures/kohya_metadata_reference.py prints them). Catches the header hashed with
    /// the tensors, the 8-byte length prefix skipped or counted twice, or the legacy window
    /// taken from the start of the file.
    #[test]
    fn hashes_match_kohyas_functions() {
        // An 8-byte length, a 16-byte header and 2 MiB of data (a byte pattern).
        let mut file = 16u64.to_le_bytes().to_vec();
        file.extend_from_slice(br#"{"a":"b"}       "#);
        file.extend((0..2u32 << 20).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8));
        let (model, legacy) = addnet_hashes(&file);
        assert_eq!(model, MODEL_2MIB);
        assert_eq!(legacy, LEGACY_2MIB);
        // A file shorter than 1 MiB: the legacy window is empty, as Python's read there is.
        let (model, legacy) = addnet_hashes(&file[..1000]);
        assert_eq!(model, MODEL_1000);
        assert_eq!(legacy, "e3b0c442");
    }

    /// A base model file's hashes, against kohya's `model_hash` and `calculate_sha256` on the
    /// same file. Catches the legacy window cut at a read boundary or the whole-file hash
    /// skipping the header.
    #[test]
    fn file_hashes_match_kohyas_model_hashes() {
        let mut file = 16u64.to_le_bytes().to_vec();
        file.extend_from_slice(br#"{"a":"b"}       "#);
        file.extend((0..2u32 << 20).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        std::fs::write(&path, &file).unwrap();
        let (legacy, full) = file_hashes(&path).unwrap();
        assert_eq!(legacy, "bb8113ca");
        assert_eq!(
            full,
            "72ddb346f9109ed75129a5cea0d6de7c428f796a33066b9736fdcd149723531c"
        );
    }

    const MODEL_2MIB: &str = "13be75161a6f158aa8708117a980d7b34489b8c855384bc7689905b58d9a3202";
    const LEGACY_2MIB: &str = "bb8113ca";
    const MODEL_1000: &str = "323177fe0bc9a2c42a374cd41925ec47ede978ee89f6f4b5dddc2e9f91fe39f2";
}
