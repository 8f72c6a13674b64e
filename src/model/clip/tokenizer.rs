//! The CLIP byte-level BPE tokenizer, producing the fixed-length id rows SD pipelines feed the
//! text encoders: `BOS + tokens[..max_length − 2] + EOS + pad…` (exactly `max_length` ids).
//!
//! A folder with `tokenizer.json` is loaded as is. Otherwise the tokenizer is built from
//! `vocab.json` + `merges.txt` the way transformers 5's `CLIPTokenizer` builds it (and as the
//! `tokenizer.json` it writes spells out):
//! - model: BPE, `continuing_subword_prefix ""`, `end_of_word_suffix "</w>"`, unk `<|endoftext|>`;
//! - normalizer: NFC, `\s+` → `" "`, lowercase;
//! - pre-tokenizer: keep the matches of CLIP's regex (special tokens, contractions, letter
//!   runs, single digits, punctuation runs), then byte-level (no prefix space);
//! - the BOS, EOS, pad and unk tokens are registered as special tokens, so they are matched
//!   verbatim in the prompt. With SD2's pad token `!` this splits `"!!!"` into three `!` ids,
//!   as transformers does (checked by tests/tokenizer_parity.rs).
//!
//! BOS/EOS are always added here, never by a `tokenizer.json` post-processor (we encode with
//! `add_special_tokens = false`), so both folder layouts give the same ids.
//!
//! Added tokens (a DreamBooth / textual-inversion `<sks>` with its own embedding row) come, in a
//! `tokenizer.json`, in its `added_tokens`. A slow-tokenizer folder written by transformers < 5
//! lists them instead in `added_tokens.json` (`{"<sks>": 49408}`) and, from transformers 4.34,
//! also in `tokenizer_config.json`'s `added_tokens_decoder` (with their flags). As transformers
//! does, `added_tokens_decoder` wins when present (we also check that `added_tokens.json` agrees
//! with it); otherwise each `added_tokens.json` entry is a non-special token matched after the
//! normalizer, so `<SKS>` and `Sks  Dog` match `<sks>` and `Sks Dog` (transformers 5 and 4.x's
//! `CLIPTokenizerFast`; 4.x's slow `CLIPTokenizer` matched them case-exactly). Added tokens are
//! split off the prompt before the pre-tokenizer, and keep the ids the files give them; an id
//! or text that vocab.json gives another token is an error naming the file. An
//! `added_tokens.json` beside a `tokenizer.json` must agree with it (a token it lacks is added
//! only at the next free id). Whether the text encoder has a row for each id is checked by
//! [`super::ClipTextModel::forward`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde_json::Value;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::normalizers::replace::ReplacePattern;
use tokenizers::normalizers::{Lowercase, Replace, Sequence as NormSequence, NFC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// CLIP's pre-tokenizer regex (transformers 5, with the special tokens kept whole).
const CLIP_PATTERN: &str =
    r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+";
const DEFAULT_MAX_LENGTH: usize = 77;
const DEFAULT_BOS: &str = "<|startoftext|>";
const DEFAULT_EOS: &str = "<|endoftext|>";

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("tokenizer folder {dir}: {message}")]
    Missing { dir: PathBuf, message: String },
    #[error("cannot read {path}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot parse {}{}", path.display(), crate::file_sniff::json_note(path))]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("tokenizer folder {dir}: cannot build the CLIP tokenizer: {message}")]
    Build { dir: PathBuf, message: String },
    #[error("tokenizer folder {dir}: {role} {token:?} is not in the vocabulary")]
    UnknownToken {
        dir: PathBuf,
        role: &'static str,
        token: String,
    },
    #[error("tokenizer folder {dir}: cannot encode {prompt:?}: {message}")]
    Encode {
        dir: PathBuf,
        prompt: String,
        message: String,
    },
    #[error("cannot build the token tensor")]
    Tensor(#[from] candle_core::Error),
}

/// A CLIP tokenizer with its special-token ids and padded length.
#[derive(Clone)]
pub struct ClipTokenizer {
    tokenizer: Tokenizer,
    dir: PathBuf,
    max_length: usize,
    bos_id: u32,
    eos_id: u32,
    pad_id: u32,
    /// Textual inversion's multi-vector tokens: where the first id appears, all of them do
    /// ([`ClipTokenizer::add_embedding_tokens`]).
    expansions: Vec<Vec<u32>>,
}

/// The special tokens and length read from `tokenizer_config.json` / `special_tokens_map.json`.
struct SpecialTokens {
    max_length: usize,
    bos: String,
    eos: String,
    pad: String,
    unk: String,
}

impl ClipTokenizer {
    /// Loads a tokenizer folder (diffusers' `tokenizer/` or `tokenizer_2/`).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let dir = dir.as_ref().to_path_buf();
        if !dir.is_dir() {
            return Err(TokenizerError::Missing {
                dir,
                message: "not a folder".to_string(),
            });
        }
        let special = read_special_tokens(&dir)?;
        let json = dir.join("tokenizer.json");
        let tokenizer = if json.is_file() {
            let invalid = |e: tokenizers::Error| TokenizerError::Invalid {
                path: json.clone(),
                message: e.to_string(),
            };
            let mut t = Tokenizer::from_file(&json).map_err(invalid)?;
            // Truncation and padding are ours (encode); a file that configures either would
            // otherwise pad before BOS/EOS are added.
            t.with_truncation(None).map_err(invalid)?;
            t.with_padding(None);
            merge_added_tokens_json(&mut t, &dir, &special)?;
            t
        } else {
            build_from_vocab(&dir, &special)?
        };
        Self::with_special(tokenizer, dir, &special)
    }

    fn with_special(
        tokenizer: Tokenizer,
        dir: PathBuf,
        special: &SpecialTokens,
    ) -> Result<Self, TokenizerError> {
        let id = |role: &'static str, token: &str| {
            tokenizer
                .token_to_id(token)
                .ok_or_else(|| TokenizerError::UnknownToken {
                    dir: dir.clone(),
                    role,
                    token: token.to_string(),
                })
        };
        let (bos_id, eos_id, pad_id) = (
            id("bos_token", &special.bos)?,
            id("eos_token", &special.eos)?,
            id("pad_token", &special.pad)?,
        );
        Ok(Self {
            tokenizer,
            dir,
            max_length: special.max_length,
            bos_id,
            eos_id,
            pad_id,
            expansions: Vec::new(),
        })
    }

    /// Adds a textual-inversion embedding's tokens (kohya's `tok`, `tok1`, … for one of
    /// `tokens.len()` vectors) at the next free ids, and returns those ids. They are matched as
    /// the folder's own added tokens are (after the normalizer, as transformers 5's `add_tokens`
    /// matches them), and where the first one appears in a prompt all of them follow it, as
    /// kohya replaces `tok` by `tok tok1 …` and diffusers' `maybe_convert_prompt` does. A token
    /// the vocabulary already has is refused: its prompts would not reach the new rows.
    pub fn add_embedding_tokens(&mut self, tokens: &[String]) -> Result<Vec<u32>, TokenizerError> {
        let clash = |token: &str, message: &str| TokenizerError::Invalid {
            path: self.dir.clone(),
            message: format!("token {token:?} {message}; choose another token"),
        };
        for t in tokens {
            if t.trim().is_empty() || t.chars().any(char::is_whitespace) {
                return Err(clash(t, "is empty or holds a space"));
            }
            if self.tokenizer.token_to_id(t).is_some()
                || self.tokenizer.token_to_id(&format!("{t}</w>")).is_some()
            {
                return Err(clash(t, "is already in the vocabulary"));
            }
        }
        let added: Vec<AddedToken> = tokens
            .iter()
            .map(|t| AddedToken::from(t.as_str(), false))
            .collect();
        let n = self.tokenizer.add_tokens(&added);
        let ids: Vec<u32> = tokens
            .iter()
            .filter_map(|t| self.tokenizer.token_to_id(t))
            .collect();
        let consecutive = ids.windows(2).all(|w| w[1] == w[0] + 1);
        if n != tokens.len() || ids.len() != tokens.len() || !consecutive {
            return Err(clash(
                &tokens.join(" "),
                &format!(
                    "did not add as {} new consecutive ids (got {ids:?})",
                    tokens.len()
                ),
            ));
        }
        if ids.len() > 1 {
            self.expansions.push(ids.clone());
        }
        Ok(ids)
    }

    /// The tokenizer of a single-file checkpoint, which carries none: OpenAI CLIP's BPE
    /// ([`super::builtin_bpe`]) with as many merges as a `vocab_size`-row token embedding was
    /// trained with, padding with `pad` (`<|endoftext|>` for OpenAI CLIP, `!` for OpenCLIP) to
    /// `max_length`. `origin` (the checkpoint) names it in errors.
    pub fn builtin(
        vocab_size: usize,
        pad: &str,
        max_length: usize,
        origin: &Path,
    ) -> Result<Self, TokenizerError> {
        use super::builtin_bpe::{self, BYTE_TOKENS, FULL_VOCAB, SPECIAL_TOKENS};
        let dir = origin.to_path_buf();
        if !(BYTE_TOKENS + SPECIAL_TOKENS..=FULL_VOCAB).contains(&vocab_size) || max_length < 2 {
            return Err(TokenizerError::Build {
                dir,
                message: format!(
                    "a token embedding of {vocab_size} rows is not a CLIP vocabulary (514 to \
                     {FULL_VOCAB} rows); give the model's tokenizer with `model_config`"
                ),
            });
        }
        let n = vocab_size - BYTE_TOKENS - SPECIAL_TOKENS;
        let vocab: Vocab = builtin_bpe::vocab(n)
            .into_iter()
            .enumerate()
            .map(|(i, t)| (t, i as u32))
            .collect();
        let special = SpecialTokens {
            max_length,
            bos: DEFAULT_BOS.to_string(),
            eos: DEFAULT_EOS.to_string(),
            pad: pad.to_string(),
            unk: DEFAULT_EOS.to_string(),
        };
        let tokenizer = build_bpe(vocab, builtin_bpe::merges(n), &special, &dir)?;
        Self::with_special(tokenizer, dir, &special)
    }

    /// The padded length of every encoded row (`model_max_length`, 77 for SD).
    pub fn max_length(&self) -> usize {
        self.max_length
    }

    pub fn bos_id(&self) -> u32 {
        self.bos_id
    }

    pub fn eos_id(&self) -> u32 {
        self.eos_id
    }

    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// The folder this tokenizer was read from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The id of `token` (a vocabulary entry or an added token).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// The token with the largest id, added tokens included, and that id.
    pub fn largest_id(&self) -> Option<(String, u32)> {
        self.tokenizer
            .get_vocab(true)
            .into_iter()
            .max_by_key(|&(_, id)| id)
    }

    /// The prompt's BPE ids, without BOS/EOS and untruncated.
    pub fn tokenize(&self, prompt: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .tokenizer
            .encode(prompt, false)
            .map_err(|e| TokenizerError::Encode {
                dir: self.dir.clone(),
                prompt: prompt.to_string(),
                message: e.to_string(),
            })?;
        let ids = enc.get_ids();
        if self.expansions.is_empty() {
            return Ok(ids.to_vec());
        }
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            match self.expansions.iter().find(|e| e[0] == id) {
                Some(all) => out.extend_from_slice(all),
                None => out.push(id),
            }
        }
        Ok(out)
    }

    /// Exactly `max_length` ids: BOS, the tokens truncated to `max_length − 2`, EOS, then pad.
    pub fn encode(&self, prompt: &str) -> Result<Vec<u32>, TokenizerError> {
        let tokens = self.tokenize(prompt)?;
        let keep = tokens.len().min(self.max_length - 2);
        let mut ids = Vec::with_capacity(self.max_length);
        ids.push(self.bos_id);
        ids.extend_from_slice(&tokens[..keep]);
        ids.push(self.eos_id);
        ids.resize(self.max_length, self.pad_id);
        Ok(ids)
    }

    /// `[B, max_length]` u32 ids on `device`.
    pub fn encode_batch(
        &self,
        prompts: &[&str],
        device: &Device,
    ) -> Result<Tensor, TokenizerError> {
        let mut flat = Vec::with_capacity(prompts.len() * self.max_length);
        for p in prompts {
            flat.extend(self.encode(p)?);
        }
        Ok(Tensor::from_vec(
            flat,
            (prompts.len(), self.max_length),
            device,
        )?)
    }
}

impl std::fmt::Debug for ClipTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClipTokenizer")
            .field("dir", &self.dir)
            .field("max_length", &self.max_length)
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("pad_id", &self.pad_id)
            .finish()
    }
}

fn read_json(path: &Path) -> Result<Option<Value>, TokenizerError> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let value = serde_json::from_str(&text).map_err(|source| TokenizerError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(Some(value))
}

/// A special token written as `"<|endoftext|>"` or `{"content": "<|endoftext|>", …}`.
fn token_string(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => m.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// `tokenizer_config.json` first, `special_tokens_map.json` as fallback, then CLIPTokenizer's
/// defaults. transformers writes a huge sentinel (`int(1e30)`) for "no limit"; that means 77.
fn read_special_tokens(dir: &Path) -> Result<SpecialTokens, TokenizerError> {
    let cfg_path = dir.join("tokenizer_config.json");
    let map_path = dir.join("special_tokens_map.json");
    let cfg = read_json(&cfg_path)?;
    let map = read_json(&map_path)?;
    for (path, v) in [(&cfg_path, &cfg), (&map_path, &map)] {
        if let Some(v) = v.as_ref().filter(|v| !v.is_object()) {
            return Err(TokenizerError::Invalid {
                path: path.clone(),
                message: format!(
                    "holds {} where a JSON object is expected",
                    crate::py_json::kind(v)
                ),
            });
        }
    }
    // A special token must be a string or `{"content": …}`, as transformers requires.
    let lookup = |key: &str| -> Result<Option<String>, TokenizerError> {
        for (path, v) in [(&cfg_path, &cfg), (&map_path, &map)] {
            match v.as_ref().and_then(|v| v.get(key)) {
                None | Some(Value::Null) => continue,
                Some(t) => {
                    return token_string(t)
                        .map(Some)
                        .ok_or_else(|| TokenizerError::Invalid {
                            path: path.clone(),
                            message: format!(
                                "field `{key}`: {t} is not a token (a string, or an object with \
                             `content`)"
                            ),
                        })
                }
            }
        }
        Ok(None)
    };
    let max_length = match cfg.as_ref().and_then(|c| c.get("model_max_length")) {
        None | Some(Value::Null) => DEFAULT_MAX_LENGTH,
        Some(v) => match v.as_f64() {
            Some(n) if n >= 1e12 => DEFAULT_MAX_LENGTH,
            Some(n) if n >= 2.0 && n.fract() == 0.0 => n as usize,
            _ => {
                return Err(TokenizerError::Invalid {
                    path: cfg_path,
                    message: format!("field `model_max_length`: expected an integer ≥ 2, got {v}"),
                })
            }
        },
    };
    Ok(SpecialTokens {
        max_length,
        bos: lookup("bos_token")?.unwrap_or_else(|| DEFAULT_BOS.to_string()),
        eos: lookup("eos_token")?.unwrap_or_else(|| DEFAULT_EOS.to_string()),
        pad: lookup("pad_token")?.unwrap_or_else(|| DEFAULT_EOS.to_string()),
        unk: lookup("unk_token")?.unwrap_or_else(|| DEFAULT_EOS.to_string()),
    })
}

fn read_vocab(dir: &Path) -> Result<Vocab, TokenizerError> {
    let path = dir.join("vocab.json");
    let Some(value) = read_json(&path)? else {
        return Err(TokenizerError::Missing {
            dir: dir.to_path_buf(),
            message: "neither tokenizer.json nor vocab.json is present".to_string(),
        });
    };
    let map: HashMap<String, u32> =
        serde_json::from_value(value).map_err(|source| TokenizerError::Json {
            path: path.clone(),
            source,
        })?;
    Ok(map.into_iter().collect())
}

/// `merges.txt`: an optional `#version` header, then one `left right` pair per line.
fn read_merges(dir: &Path) -> Result<Merges, TokenizerError> {
    let path = dir.join("merges.txt");
    if !path.is_file() {
        return Err(TokenizerError::Missing {
            dir: dir.to_path_buf(),
            message: "vocab.json is present but merges.txt is missing".to_string(),
        });
    }
    let text = std::fs::read_to_string(&path).map_err(|source| TokenizerError::Io {
        path: path.clone(),
        source,
    })?;
    let mut merges = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if (i == 0 && line.starts_with("#version")) || line.is_empty() {
            continue;
        }
        match line.split(' ').collect::<Vec<_>>()[..] {
            [a, b] => merges.push((a.to_string(), b.to_string())),
            _ => {
                return Err(TokenizerError::Invalid {
                    path,
                    message: format!(
                        "line {}: expected two space-separated symbols, got {line:?}",
                        i + 1
                    ),
                })
            }
        }
    }
    Ok(merges)
}

fn build_from_vocab(dir: &Path, special: &SpecialTokens) -> Result<Tokenizer, TokenizerError> {
    let mut vocab = read_vocab(dir)?;
    let merges = read_merges(dir)?;
    let added = read_added_tokens(dir, special)?;
    let registered = [&special.bos, &special.eos, &special.pad, &special.unk];
    let mut extra = Vec::new();
    for (token, id, origin) in added {
        let clash = |message: String| TokenizerError::Invalid {
            path: origin.clone(),
            message,
        };
        match vocab.get(&token.content) {
            Some(&v) if v != id => {
                return Err(clash(format!(
                    "added token {:?} has id {id}, but vocab.json gives it {v}",
                    token.content
                )))
            }
            // The BOS/EOS/pad/unk tokens are already registered (build_bpe).
            Some(_) if registered.contains(&&token.content) => continue,
            Some(_) => {}
            None => {
                if let Some((other, _)) = vocab.iter().find(|(_, &v)| v == id) {
                    return Err(clash(format!(
                        "added token {:?} has id {id}, which vocab.json gives to {other:?}",
                        token.content
                    )));
                }
                // In the model's vocabulary the token keeps the id the file gives it (the
                // tokenizers crate would number it itself); no merge produces it, so BPE never
                // emits it: only the added-token match does.
                vocab.insert(token.content.clone(), id);
            }
        }
        extra.push(token);
    }
    let mut tokenizer = build_bpe(vocab, merges, special, dir)?;
    tokenizer.add_tokens(&extra);
    Ok(tokenizer)
}

/// An added token and where it was read from: `(token, id, file)`.
type Added = (AddedToken, u32, PathBuf);

/// The added tokens of a slow-tokenizer folder (module header): `added_tokens_decoder` when
/// `tokenizer_config.json` has one (and `added_tokens.json` must agree with it), otherwise
/// `added_tokens.json`, whose tokens are special only if they are the BOS/EOS/pad/unk token
/// (transformers' `from_pretrained`).
fn read_added_tokens(dir: &Path, special: &SpecialTokens) -> Result<Vec<Added>, TokenizerError> {
    let json_path = dir.join("added_tokens.json");
    let from_json = read_added_tokens_json(&json_path)?;
    let cfg_path = dir.join("tokenizer_config.json");
    let decoder = match read_json(&cfg_path)? {
        Some(cfg) => match cfg.get("added_tokens_decoder") {
            None | Some(Value::Null) => None,
            Some(v) => Some(parse_added_tokens_decoder(v, &cfg_path)?),
        },
        None => None,
    };
    let Some(decoder) = decoder else {
        let roles = [&special.bos, &special.eos, &special.pad, &special.unk];
        return Ok(from_json
            .into_iter()
            .map(|(content, id)| {
                let is_special = roles.contains(&&content);
                (AddedToken::from(content, is_special), id, json_path.clone())
            })
            .collect());
    };
    // Both files list the same tokens (transformers ≥ 4.34 writes both); transformers reads only
    // added_tokens_decoder, so a disagreement would silently change ids: refuse it.
    for (content, id) in &from_json {
        let listed = decoder.iter().find(|(t, _, _)| &t.content == content);
        if listed.map(|(_, i, _)| i) != Some(id) {
            let there = match (listed, decoder.iter().find(|(_, i, _)| i == id)) {
                (Some((_, i, _)), _) => format!("gives it id {i}"),
                (None, Some((t, _, _))) => format!("gives id {id} to {:?}", t.content),
                (None, None) => "does not list it".to_string(),
            };
            return Err(TokenizerError::Invalid {
                path: json_path,
                message: format!(
                    "added token {content:?} has id {id}, but the added_tokens_decoder of {} \
                     {there}",
                    cfg_path.display()
                ),
            });
        }
    }
    Ok(decoder)
}

/// `added_tokens.json`: `{"<sks>": 49408, …}`, in id order; empty when the file is absent.
fn read_added_tokens_json(path: &Path) -> Result<Vec<(String, u32)>, TokenizerError> {
    let Some(value) = read_json(path)? else {
        return Ok(Vec::new());
    };
    let map: HashMap<String, u32> =
        serde_json::from_value(value).map_err(|source| TokenizerError::Json {
            path: path.to_path_buf(),
            source,
        })?;
    let mut tokens: Vec<(String, u32)> = map.into_iter().collect();
    tokens.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
    if let Some(w) = tokens.windows(2).find(|w| w[0].1 == w[1].1) {
        return Err(TokenizerError::Invalid {
            path: path.to_path_buf(),
            message: format!("{:?} and {:?} both have id {}", w[0].0, w[1].0, w[0].1),
        });
    }
    Ok(tokens)
}

/// `added_tokens_decoder`: `{"49408": {"content": "<sks>", "normalized": true, …}, …}`, in id
/// order. Flags missing from an entry take transformers' `AddedToken` defaults.
fn parse_added_tokens_decoder(v: &Value, path: &Path) -> Result<Vec<Added>, TokenizerError> {
    let invalid = |message: String| TokenizerError::Invalid {
        path: path.to_path_buf(),
        message: format!("field `added_tokens_decoder`: {message}"),
    };
    let Some(map) = v.as_object() else {
        return Err(invalid(format!("expected an object, got {v}")));
    };
    let mut tokens = Vec::with_capacity(map.len());
    for (key, entry) in map {
        let id: u32 = key
            .parse()
            .map_err(|_| invalid(format!("key {key:?} is not a token id")))?;
        let Some(content) = entry.get("content").and_then(Value::as_str) else {
            return Err(invalid(format!("entry {key} has no string `content`")));
        };
        let flag = |name: &str, default: bool| match entry.get(name) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(invalid(format!(
                "entry {key}: `{name}` should be true or false, got {other}"
            ))),
        };
        let is_special = flag("special", false)?;
        let token = AddedToken::from(content, is_special)
            .normalized(flag("normalized", !is_special)?)
            .lstrip(flag("lstrip", false)?)
            .rstrip(flag("rstrip", false)?)
            .single_word(flag("single_word", false)?);
        tokens.push((token, id, path.to_path_buf()));
    }
    tokens.sort_by_key(|t| t.1);
    let mut seen: HashMap<&str, u32> = HashMap::new();
    for (token, id, _) in &tokens {
        if let Some(first) = seen.insert(&token.content, *id) {
            return Err(invalid(format!(
                "{:?} is listed with ids {first} and {id}",
                token.content
            )));
        }
    }
    Ok(tokens)
}

/// A `tokenizer.json` holds its own added tokens; an `added_tokens.json` beside it (transformers
/// 4.x saves both for a fast tokenizer) must give them the same ids. A token it lists that
/// `tokenizer.json` lacks is added, as transformers does, if its id is the next free one.
fn merge_added_tokens_json(
    tokenizer: &mut Tokenizer,
    dir: &Path,
    special: &SpecialTokens,
) -> Result<(), TokenizerError> {
    let path = dir.join("added_tokens.json");
    let roles = [&special.bos, &special.eos, &special.pad, &special.unk];
    for (content, id) in read_added_tokens_json(&path)? {
        let have = tokenizer.token_to_id(&content);
        if have.is_none() && id as usize == tokenizer.get_vocab_size(true) {
            let is_special = roles.contains(&&content);
            tokenizer.add_tokens(&[AddedToken::from(content.clone(), is_special)]);
            continue;
        }
        if have != Some(id) {
            let there = match have {
                Some(h) => format!("gives it id {h}"),
                None => format!(
                    "does not have it (and its next free id is {})",
                    tokenizer.get_vocab_size(true)
                ),
            };
            return Err(TokenizerError::Invalid {
                path,
                message: format!(
                    "added token {content:?} has id {id}, but {} {there}",
                    dir.join("tokenizer.json").display()
                ),
            });
        }
    }
    Ok(())
}

/// The CLIP tokenizer of `vocab` and `merges` (module header); `dir` names the origin in errors.
fn build_bpe(
    vocab: Vocab,
    merges: Merges,
    special: &SpecialTokens,
    dir: &Path,
) -> Result<Tokenizer, TokenizerError> {
    let roles = [
        ("bos_token", &special.bos),
        ("eos_token", &special.eos),
        ("pad_token", &special.pad),
        ("unk_token", &special.unk),
    ];
    // Registering a special token that is not in vocab.json would silently give it a new id.
    for (role, token) in roles {
        if !vocab.contains_key(token.as_str()) {
            return Err(TokenizerError::UnknownToken {
                dir: dir.to_path_buf(),
                role,
                token: token.clone(),
            });
        }
    }
    let build_err = |e: tokenizers::Error| TokenizerError::Build {
        dir: dir.to_path_buf(),
        message: e.to_string(),
    };
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .continuing_subword_prefix(String::new())
        .end_of_word_suffix("</w>".to_string())
        .unk_token(special.unk.clone())
        .fuse_unk(false)
        .build()
        .map_err(build_err)?;
    let mut tokenizer = Tokenizer::new(bpe);
    let normalizer = NormSequence::new(vec![
        NFC.into(),
        Replace::new(ReplacePattern::Regex(r"\s+".to_string()), " ")
            .map_err(build_err)?
            .into(),
        Lowercase.into(),
    ]);
    let split = Split::new(
        SplitPattern::Regex(CLIP_PATTERN.to_string()),
        SplitDelimiterBehavior::Removed,
        true,
    )
    .map_err(build_err)?;
    let pre = PreSequence::new(vec![split.into(), ByteLevel::new(false, true, true).into()]);
    tokenizer
        .with_normalizer(Some(normalizer))
        .with_pre_tokenizer(Some(pre))
        .with_decoder(Some(ByteLevel::default()));
    let mut specials: Vec<&str> = Vec::new();
    for t in [&special.pad, &special.bos, &special.eos, &special.unk] {
        if !specials.contains(&t.as_str()) {
            specials.push(t);
        }
    }
    let added: Vec<AddedToken> = specials
        .iter()
        .map(|t| AddedToken::from(t.to_string(), true))
        .collect();
    tokenizer.add_special_tokens(&added);
    Ok(tokenizer)
}
