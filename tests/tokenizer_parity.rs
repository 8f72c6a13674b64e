//! Parity of `ClipTokenizer` with transformers' `CLIPTokenizer` on the tiny fixtures.
//!
//! Expected ids come from `tests/fixtures/make_fixtures.py` (transformers 5; rerun with the
//! command in its docstring): `reference/<name>.tokens.json` holds ≥ 24 awkward prompts
//! (unicode, whitespace, truncation, special-token text, SD2's `!` pad) with `ids` for
//! `tokenizer/` and, for SDXL, `ids_2` for `tokenizer_2/` (the folder with a `tokenizer.json`).
//!
//! Added tokens: `added-tokens/tokenizer-4.33` and `-4.44` are slow-tokenizer folders with an
//! `added_tokens.json` (`<sks>` 2514, `Sks Dog` 2515); `added_tokens_reference.json` holds
//! transformers 5's ids for them, from `tests/fixtures/added_tokens_reference.py` (rerun commands
//! in its docstring).

mod common;

use std::path::Path;

use candle_core::{DType, Device};
use common::{fixture, get, reference};
use sdtrain::model::clip::{ClipTextConfig, ClipTextModel, ClipTokenizer};
use sdtrain::model::weights::Weights;
use serde_json::Value;

/// The prompts make_fixtures.py encodes into `te.input_ids` / `te2.input_ids`.
const TE_PROMPTS: [&str; 3] = [
    "a photo of a cat",
    "An astronaut riding a horse, highly detailed, 4k",
    "",
];

fn token_rows(name: &str) -> Vec<Value> {
    let path = fixture("reference").join(format!("{name}.tokens.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let rows: Vec<Value> = serde_json::from_str(&text).unwrap();
    assert!(
        rows.len() >= 24,
        "{}: only {} prompts",
        path.display(),
        rows.len()
    );
    rows
}

/// Asserts that `tok` reproduces column `key` of `<name>.tokens.json` for every prompt.
fn check_rows(name: &str, key: &str, tok: &ClipTokenizer) {
    let rows = token_rows(name);
    for row in &rows {
        let prompt = row["prompt"].as_str().unwrap();
        let want: Vec<u32> = row[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = tok.encode(prompt).unwrap();
        assert_eq!(got, want, "{name} {key}: prompt {prompt:?}");
    }
}

fn check_input_ids(name: &str, key: &str, tok: &ClipTokenizer) {
    let want = get(&reference(name), key)
        .to_dtype(DType::U32)
        .unwrap()
        .to_vec2::<u32>()
        .unwrap();
    let got = tok.encode_batch(&TE_PROMPTS, &Device::Cpu).unwrap();
    assert_eq!(got.dims(), &[3, 77]);
    assert_eq!(got.to_vec2::<u32>().unwrap(), want, "{name} {key}");
}

#[test]
fn sd15_tokenizer_matches_transformers() {
    let tok = ClipTokenizer::from_dir(fixture("tiny-sd15").join("tokenizer")).unwrap();
    assert_eq!((tok.max_length(), tok.pad_id()), (77, tok.eos_id()));
    check_rows("tiny-sd15", "ids", &tok);
    check_input_ids("tiny-sd15", "te.input_ids", &tok);
}

/// SD2's pad token is `!`, and transformers registers it as a special token: `"!!!"` becomes
/// three `!` ids rather than one merged token.
#[test]
fn sd21_tokenizer_with_bang_pad_matches_transformers() {
    let tok = ClipTokenizer::from_dir(fixture("tiny-sd21").join("tokenizer")).unwrap();
    assert_ne!(tok.pad_id(), tok.eos_id());
    check_rows("tiny-sd21", "ids", &tok);
    check_input_ids("tiny-sd21", "te.input_ids", &tok);
}

#[test]
fn sdxl_tokenizers_match_transformers() {
    let dir = fixture("tiny-sdxl");
    let tok = ClipTokenizer::from_dir(dir.join("tokenizer")).unwrap();
    check_rows("tiny-sdxl", "ids", &tok);
    check_input_ids("tiny-sdxl", "te.input_ids", &tok);
    assert!(dir.join("tokenizer_2/tokenizer.json").is_file());
    let tok2 = ClipTokenizer::from_dir(dir.join("tokenizer_2")).unwrap();
    check_rows("tiny-sdxl", "ids_2", &tok2);
    check_input_ids("tiny-sdxl", "te2.input_ids", &tok2);
}

fn copy_dir(from: &Path, to: &Path, skip: &[&str]) {
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if !skip.iter().any(|s| name == *s) {
            std::fs::copy(entry.path(), to.join(&name)).unwrap();
        }
    }
}

/// tokenizer_2 without its tokenizer.json: our vocab/merges build must give the same ids.
#[test]
fn vocab_merges_build_matches_tokenizer_json() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(
        &fixture("tiny-sdxl").join("tokenizer_2"),
        tmp.path(),
        &["tokenizer.json"],
    );
    let tok = ClipTokenizer::from_dir(tmp.path()).unwrap();
    check_rows("tiny-sdxl", "ids_2", &tok);
}

/// transformers' "no limit" sentinel for model_max_length, and `{"content": …}` token objects.
#[test]
fn sentinel_max_length_and_token_objects() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(
        &fixture("tiny-sd21").join("tokenizer"),
        tmp.path(),
        &["tokenizer_config.json"],
    );
    let cfg = r#"{"model_max_length": 1000000000000000019884624838656,
        "bos_token": {"content": "<|startoftext|>", "lstrip": false},
        "eos_token": {"content": "<|endoftext|>"}, "pad_token": "!"}"#;
    std::fs::write(tmp.path().join("tokenizer_config.json"), cfg).unwrap();
    let tok = ClipTokenizer::from_dir(tmp.path()).unwrap();
    assert_eq!(tok.max_length(), 77);
    check_rows("tiny-sd21", "ids", &tok);
}

#[test]
fn missing_vocab_is_an_error_naming_the_folder() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(
        &fixture("tiny-sd15").join("tokenizer"),
        tmp.path(),
        &["vocab.json", "merges.txt"],
    );
    let err = ClipTokenizer::from_dir(tmp.path()).unwrap_err().to_string();
    assert!(
        err.contains(&tmp.path().display().to_string()) && err.contains("vocab.json"),
        "{err}"
    );

    let err = ClipTokenizer::from_dir(tmp.path().join("absent"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("absent"), "{err}");
}

#[test]
fn special_token_missing_from_vocab_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(
        &fixture("tiny-sd15").join("tokenizer"),
        tmp.path(),
        &["tokenizer_config.json", "special_tokens_map.json"],
    );
    std::fs::write(
        tmp.path().join("tokenizer_config.json"),
        r#"{"pad_token": "<pad>"}"#,
    )
    .unwrap();
    let err = ClipTokenizer::from_dir(tmp.path()).unwrap_err().to_string();
    assert!(err.contains("pad_token") && err.contains("<pad>"), "{err}");
}

/// The tokenizer built from the embedded CLIP merges (for single-file checkpoints) with the
/// fixtures' 2514-row vocabulary gives transformers' ids, with either pad token.
#[test]
fn builtin_bpe_tokenizer_matches_transformers() {
    let origin = Path::new("model.safetensors");
    let eot = ClipTokenizer::builtin(2514, "<|endoftext|>", 77, origin).unwrap();
    check_rows("tiny-sd15", "ids", &eot);
    check_rows("tiny-sdxl", "ids", &eot);
    let bang = ClipTokenizer::builtin(2514, "!", 77, origin).unwrap();
    assert_eq!(bang.pad_id(), 0);
    check_rows("tiny-sd21", "ids", &bang);
    check_rows("tiny-sdxl", "ids_2", &bang);
    let err = ClipTokenizer::builtin(60000, "!", 77, origin).unwrap_err();
    assert!(err.to_string().contains("model_config"), "{err}");
}

/// `[{"prompt", "ids"}]` from added_tokens_reference.json (transformers 5.23.0).
fn added_token_rows() -> Vec<(String, Vec<u32>)> {
    let path = fixture("added_tokens_reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let rows: Vec<Value> = serde_json::from_str(&text).unwrap();
    rows.iter()
        .map(|row| {
            let ids = row["ids"].as_array().unwrap();
            let ids = ids.iter().map(|v| v.as_u64().unwrap() as u32).collect();
            (row["prompt"].as_str().unwrap().to_string(), ids)
        })
        .collect()
}

fn added_tokens_dir(version: &str) -> std::path::PathBuf {
    fixture("added-tokens").join(format!("tokenizer-{version}"))
}

/// Regression: a slow-tokenizer folder's `added_tokens.json` was never read, so `<sks>` was
/// BPE-split into `<`, `s`, `ks`, `>` instead of its own id. Both the transformers 4.33 layout
/// (added_tokens.json only) and the 4.44 one (also `added_tokens_decoder`) must give
/// transformers' ids: at the start, middle and end, next to punctuation, twice, in other case
/// and spacing, past truncation.
#[test]
fn added_tokens_json_matches_transformers() {
    let rows = added_token_rows();
    assert!(rows.len() >= 20);
    let sks = rows.iter().filter(|(_, ids)| ids.contains(&2514)).count();
    assert!(sks >= 12, "only {sks} prompts use <sks>");
    for version in ["4.33", "4.44"] {
        let dir = added_tokens_dir(version);
        assert!(dir.join("added_tokens.json").is_file() && !dir.join("tokenizer.json").exists());
        let tok = ClipTokenizer::from_dir(&dir).unwrap();
        assert_eq!(tok.tokenize("<sks>").unwrap(), [2514], "{version}");
        assert_eq!(tok.tokenize("Sks Dog").unwrap(), [2515], "{version}");
        for (prompt, want) in &rows {
            let got = tok.encode(prompt).unwrap();
            assert_eq!(&got, want, "{version}: prompt {prompt:?}");
        }
    }
}

/// transformers ≥ 4.34 lists added tokens in both files; they are registered once, and a
/// disagreement between the two is an error naming added_tokens.json.
#[test]
fn added_tokens_json_disagreeing_with_decoder_is_an_error() {
    let cases = [
        (r#"{"<sks>": 2515, "Sks Dog": 2514}"#, "gives it id 2515"),
        (r#"{"<sks>": 2514, "<new>": 2516}"#, "does not list it"),
        (
            r#"{"<sks>": 2514, "<new>": 2515}"#,
            "gives id 2515 to \"Sks Dog\"",
        ),
    ];
    for (json, says) in cases {
        let tmp = tempfile::tempdir().unwrap();
        copy_dir(&added_tokens_dir("4.44"), tmp.path(), &[]);
        std::fs::write(tmp.path().join("added_tokens.json"), json).unwrap();
        let err = ClipTokenizer::from_dir(tmp.path()).unwrap_err().to_string();
        let file = tmp.path().join("added_tokens.json").display().to_string();
        assert!(err.contains(&file) && err.contains(says), "{json}: {err}");
    }
}

/// An added token whose id (or text) vocab.json already gives to another token.
#[test]
fn added_token_clashing_with_vocab_is_an_error() {
    let cases = [
        (r#"{"<sks>": 5}"#, "which vocab.json gives to"),
        (r#"{"cat</w>": 2514}"#, "but vocab.json gives it"),
        (r#"{"<a>": 2514, "<b>": 2514}"#, "both have id 2514"),
    ];
    for (json, says) in cases {
        let tmp = tempfile::tempdir().unwrap();
        copy_dir(&added_tokens_dir("4.33"), tmp.path(), &[]);
        std::fs::write(tmp.path().join("added_tokens.json"), json).unwrap();
        let err = ClipTokenizer::from_dir(tmp.path()).unwrap_err().to_string();
        assert!(
            err.contains("added_tokens.json") && err.contains(says),
            "{json}: {err}"
        );
    }
}

/// A `tokenizer.json` folder with an added_tokens.json beside it (transformers 4.x saves both
/// for a fast tokenizer): a token tokenizer.json lacks is added at the next id, as
/// transformers does; one at another id is an error.
#[test]
fn added_tokens_json_beside_tokenizer_json() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&fixture("tiny-sdxl").join("tokenizer_2"), tmp.path(), &[]);
    let json = tmp.path().join("added_tokens.json");
    std::fs::write(&json, r#"{"<sks>": 2514, "Sks Dog": 2515}"#).unwrap();
    let tok = ClipTokenizer::from_dir(tmp.path()).unwrap();
    assert_eq!(
        tok.tokenize("a <SKS>, Sks Dog").unwrap(),
        [320, 2514, 267, 2515]
    );
    std::fs::write(&json, r#"{"<sks>": 2600}"#).unwrap();
    let err = ClipTokenizer::from_dir(tmp.path()).unwrap_err().to_string();
    assert!(
        err.contains("added_tokens.json") && err.contains("2600"),
        "{err}"
    );
}

/// The tiny text encoder has 2514 embedding rows; `<sks>` (2514) needs a 2515th. Encoding a
/// prompt with it must be a clear error, not an out-of-range gather (unchecked on CUDA).
#[test]
fn added_token_past_the_text_encoder_embedding_is_an_error() {
    let dir = fixture("tiny-sd15").join("text_encoder");
    let cfg = ClipTextConfig::from_file(dir.join("config.json")).unwrap();
    let w = Weights::from_files(
        &[dir.join("model.safetensors")],
        "text_encoder",
        DType::F32,
        &Device::Cpu,
        false,
    )
    .unwrap();
    let model = ClipTextModel::new(&w, &cfg, false).unwrap();
    let tok = ClipTokenizer::from_dir(added_tokens_dir("4.33")).unwrap();
    let ok = tok
        .encode_batch(&["a photo of a dog"], &Device::Cpu)
        .unwrap();
    model.forward(&ok, 0).unwrap();
    let ids = tok
        .encode_batch(&["a photo of <sks> dog"], &Device::Cpu)
        .unwrap();
    let err = model.forward(&ids, 0).unwrap_err().to_string();
    assert!(
        err.contains("token id 2514") && err.contains("2514-row token embedding"),
        "{err}"
    );
}
