//! OpenAI CLIP's BPE merge list, embedded in the binary, and the vocabularies built from it: the
//! tokenizer of a single-file checkpoint, which carries none.
//!
//! CLIP builds its vocabulary as (openai/CLIP `clip/simple_tokenizer.py`, and transformers'
//! `CLIPTokenizer` files match it id for id):
//! `ids = 256 byte symbols (GPT-2's bytes_to_unicode order) + the same with "</w>" + one token
//! per merge (the pair joined) + "<|startoftext|>", "<|endoftext|>"`, using the first
//! `49152 − 256 − 2 = 48894` merges of `bpe_simple_vocab_16e6.txt` (line 0 is a header). A text
//! encoder whose token embedding has `r` rows therefore used the first `r − 514` merges (49408
//! rows: all of them; the tiny test fixtures: 2514 rows, 2000 merges). Provenance and licence:
//! `assets/README.md`.

use std::io::Read;
use std::sync::OnceLock;

const BPE_GZ: &[u8] = include_bytes!("assets/bpe_simple_vocab_16e6.txt.gz");

/// The merges CLIP uses: `49152 − 256 − 2`.
pub const MAX_MERGES: usize = 49152 - 256 - 2;
/// Token ids before the first merge: 256 byte symbols and 256 with `</w>`.
pub const BYTE_TOKENS: usize = 512;
/// `<|startoftext|>` and `<|endoftext|>`, after the merges.
pub const SPECIAL_TOKENS: usize = 2;
/// The vocabulary size with every merge (SD's text encoders: 49408).
pub const FULL_VOCAB: usize = BYTE_TOKENS + MAX_MERGES + SPECIAL_TOKENS;

/// The decompressed merge file, once per process.
fn text() -> &'static str {
    static TEXT: OnceLock<String> = OnceLock::new();
    TEXT.get_or_init(|| {
        let mut out = String::new();
        // The asset is a fixed, checked-in file: failing to inflate it is a build defect, and
        // the unit test below inflates it on every CI run.
        flate2::read::GzDecoder::new(BPE_GZ)
            .read_to_string(&mut out)
            .expect("the embedded CLIP BPE merges are a valid gzip of UTF-8 text");
        out
    })
}

/// The first `n` merges (`n ≤ MAX_MERGES`), as `(left, right)` pairs.
pub fn merges(n: usize) -> Vec<(String, String)> {
    text()
        .lines()
        .skip(1)
        .take(n.min(MAX_MERGES))
        .filter_map(|l| l.split_once(' '))
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

/// GPT-2's byte → printable-character table, in CLIP's vocabulary order: the printable bytes
/// `!`..`~`, `¡`..`¬`, `®`..`ÿ` map to themselves, the other 68 bytes to U+0100 onwards.
pub fn byte_symbols() -> Vec<char> {
    let mut printable: Vec<u32> = (u32::from('!')..=u32::from('~'))
        .chain(u32::from('¡')..=u32::from('¬'))
        .chain(u32::from('®')..=u32::from('ÿ'))
        .collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut extra = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    chars.into_iter().filter_map(char::from_u32).collect()
}

/// The tokens of a vocabulary with the first `n` merges, by id.
pub fn vocab(n: usize) -> Vec<String> {
    let bytes = byte_symbols();
    let mut out: Vec<String> = bytes.iter().map(|c| c.to_string()).collect();
    out.extend(bytes.iter().map(|c| format!("{c}</w>")));
    out.extend(merges(n).into_iter().map(|(a, b)| a + &b));
    out.push("<|startoftext|>".to_string());
    out.push("<|endoftext|>".to_string());
    out
}

/// The files of a transformers `CLIPTokenizer` folder for the vocabulary of `vocab_size` ids
/// (`vocab.json`, `merges.txt` with its `#version: 0.2` header, `tokenizer_config.json`,
/// `special_tokens_map.json`), padding with `pad` to `max_length`: what a diffusers folder
/// written from a single file carries.
pub fn tokenizer_files(
    vocab_size: usize,
    pad: &str,
    max_length: usize,
) -> Result<Vec<(&'static str, String)>, String> {
    if !(BYTE_TOKENS + SPECIAL_TOKENS..=FULL_VOCAB).contains(&vocab_size) {
        return Err(format!(
            "a vocabulary of {vocab_size} ids is not a CLIP vocabulary (514 to {FULL_VOCAB})"
        ));
    }
    let n = vocab_size - BYTE_TOKENS - SPECIAL_TOKENS;
    let vocab: serde_json::Map<String, serde_json::Value> = vocab(n)
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, serde_json::Value::from(i)))
        .collect();
    let mut merges_txt = String::from("#version: 0.2\n");
    for (a, b) in merges(n) {
        merges_txt.push_str(&format!("{a} {b}\n"));
    }
    let special = serde_json::json!({
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": pad,
        "unk_token": "<|endoftext|>",
    });
    let mut config = special.clone();
    for (k, v) in [
        ("add_prefix_space", serde_json::json!(false)),
        ("do_lower_case", serde_json::json!(true)),
        ("errors", serde_json::json!("replace")),
        ("model_max_length", serde_json::json!(max_length)),
        ("tokenizer_class", serde_json::json!("CLIPTokenizer")),
    ] {
        config[k] = v;
    }
    let pretty = |v: &serde_json::Value| serde_json::to_string_pretty(v).unwrap_or_default() + "\n";
    Ok(vec![
        (
            "vocab.json",
            serde_json::to_string(&serde_json::Value::Object(vocab)).unwrap_or_default(),
        ),
        ("merges.txt", merges_txt),
        ("tokenizer_config.json", pretty(&config)),
        ("special_tokens_map.json", pretty(&special)),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_file_has_every_merge() {
        assert_eq!(merges(usize::MAX).len(), MAX_MERGES);
        assert_eq!(merges(2).first().map(|m| m.0.as_str()), Some("i"));
        let v = vocab(MAX_MERGES);
        assert_eq!(v.len(), FULL_VOCAB);
        assert_eq!(FULL_VOCAB, 49408);
        // Ids every SD tokenizer agrees on: `!` is 0, `a</w>` 320, the specials last.
        assert_eq!(v[0], "!");
        assert_eq!(v[320], "a</w>");
        assert_eq!(v[49406], "<|startoftext|>");
        assert_eq!(v[49407], "<|endoftext|>");
    }

    #[test]
    fn byte_symbols_are_a_permutation_of_256_chars() {
        let s = byte_symbols();
        assert_eq!(s.len(), 256);
        let unique: std::collections::BTreeSet<char> = s.iter().copied().collect();
        assert_eq!(unique.len(), 256);
        assert_eq!(s[188], '\u{100}');
    }
}
