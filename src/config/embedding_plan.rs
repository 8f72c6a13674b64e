//! train.json's `embedding` section (`mode: "textual_inversion"`): [`EmbeddingFile`], parsed
//! strictly like the rest of the file, and resolved into an [`EmbeddingPlan`]. The keys are kohya
//! sd-scripts' `train_textual_inversion.py` arguments:
//! - `token_string` (required): the token captions and prompts use, one word without spaces;
//! - `init_word` (default `"*"`, A1111's initialization text): the vectors start as its tokens'
//!   embedding rows, repeated or cut to `num_vectors_per_token` (default 1);
//! - `init_from` (kohya's `weights`): an embedding file to continue from, instead;
//! - `template`: kohya's `use_object_template` / `use_style_template` (`"object"`, `"style"`),
//!   which replaces every caption by one of the ImageNet templates naming the token, drawn anew
//!   each time (diffusers' `--learnable_property`);
//! - `save_dtype` (default fp32, as kohya and A1111 save embeddings).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::adapter_file::{save_dtype, SaveDtype};
use super::error::ConfigError;
use super::strict::{known_keys, Section};

/// The most vectors one token may stand for: its tokens must fit a 75-token caption window.
pub const MAX_VECTORS: usize = 75;

/// `embedding: {…}` as written.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingFile {
    #[serde(default)]
    pub token_string: Option<String>,
    #[serde(default)]
    pub init_word: Option<String>,
    #[serde(default)]
    pub num_vectors_per_token: Option<i64>,
    #[serde(default)]
    pub init_from: Option<String>,
    #[serde(default)]
    pub template: Option<String>,
    #[serde(default)]
    pub save_dtype: Option<String>,
}

/// kohya's caption templates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CaptionTemplate {
    Object,
    Style,
}

/// The resolved embedding settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EmbeddingPlan {
    pub token_string: String,
    /// `None` when `init_from` gives the vectors.
    pub init_word: Option<String>,
    pub num_vectors: usize,
    pub init_from: Option<PathBuf>,
    pub template: Option<CaptionTemplate>,
    pub save_dtype: SaveDtype,
}

/// Parses the raw `embedding` value (`file` names it in errors): an object, each key known and
/// of its type.
pub fn parse_embedding_section(
    value: &Value,
    file: &Path,
    set_args: &HashMap<String, String>,
) -> Result<EmbeddingFile, ConfigError> {
    let section = Section {
        file,
        prefix: "embedding",
        set_args,
    };
    let Value::Object(obj) = value else {
        return Err(ConfigError::Invalid {
            file: file.to_path_buf(),
            field: "embedding".into(),
            message: "must be an object such as {\"token_string\": \"mychar\", \"init_word\": \
                      \"woman\"}"
                .into(),
        });
    };
    section.check_unknown(obj, &known_keys::<EmbeddingFile>(), &[], |_| None)?;
    if let Some(err) = section.type_error::<EmbeddingFile>(obj) {
        return Err(err);
    }
    serde_json::from_value(Value::Object(obj.clone())).map_err(|e| ConfigError::Invalid {
        file: file.to_path_buf(),
        field: "embedding".into(),
        message: format!("does not parse: {e}"),
    })
}

/// Validates `e`. `resolve_input` turns a relative `init_from` into an existing file's path.
pub fn resolve_embedding(
    e: &EmbeddingFile,
    file: &Path,
    resolve_input: impl Fn(&str, &str) -> Result<PathBuf, ConfigError>,
) -> Result<EmbeddingPlan, ConfigError> {
    let invalid = |field: &str, message: String| ConfigError::Invalid {
        file: file.to_path_buf(),
        field: format!("embedding.{field}"),
        message,
    };
    let token_string = match e.token_string.as_deref() {
        None => {
            return Err(invalid(
                "token_string",
                "is required: the token your captions and prompts use for the new concept, \
                 such as \"mychar\""
                    .into(),
            ))
        }
        Some(t) if t.trim().is_empty() || t.chars().any(char::is_whitespace) => {
            return Err(invalid(
                "token_string",
                format!("is {t:?}; it must be one word without spaces"),
            ))
        }
        Some(t) => t.to_string(),
    };
    let num_vectors = match e.num_vectors_per_token {
        None => 1,
        Some(n) if (1..=MAX_VECTORS as i64).contains(&n) => n as usize,
        Some(n) => {
            return Err(invalid(
                "num_vectors_per_token",
                format!("is {n}; it must be 1 to {MAX_VECTORS}"),
            ))
        }
    };
    let init_from = e
        .init_from
        .as_deref()
        .map(|p| resolve_input("embedding.init_from", p))
        .transpose()?;
    if let Some(p) = init_from.as_ref().filter(|p| !p.is_file()) {
        return Err(invalid(
            "init_from",
            format!("{} is not a file", p.display()),
        ));
    }
    let init_word = match (&init_from, e.init_word.as_deref()) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "init_word",
                "and init_from are both set; the vectors start from one of them".into(),
            ))
        }
        (Some(_), None) => None,
        (None, Some(w)) if w.trim().is_empty() => {
            return Err(invalid("init_word", "is empty".into()))
        }
        (None, w) => Some(w.unwrap_or("*").to_string()),
    };
    let template = match e.template.as_deref() {
        None => None,
        Some("object") => Some(CaptionTemplate::Object),
        Some("style") => Some(CaptionTemplate::Style),
        Some(other) => {
            return Err(invalid(
                "template",
                format!("is \"{other}\"; allowed: \"object\", \"style\", or null for captions"),
            ))
        }
    };
    let save_dtype = match e.save_dtype.as_deref() {
        None => SaveDtype::Fp32,
        v => save_dtype(v).map_err(|m| invalid("save_dtype", m))?,
    };
    Ok(EmbeddingPlan {
        token_string,
        init_word,
        num_vectors,
        init_from,
        template,
        save_dtype,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn resolve(v: Value) -> Result<EmbeddingPlan, String> {
        let file = Path::new("train.json");
        let e = parse_embedding_section(&v, file, &HashMap::new()).map_err(|e| e.to_string())?;
        resolve_embedding(&e, file, |_, p| Ok(PathBuf::from(p))).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_follow_kohya_and_a1111() {
        let p = resolve(json!({"token_string": "mychar"})).unwrap();
        assert_eq!(p.token_string, "mychar");
        assert_eq!(p.init_word.as_deref(), Some("*"));
        assert_eq!(p.num_vectors, 1);
        assert_eq!(p.save_dtype, SaveDtype::Fp32);
        assert_eq!(p.template, None);
        let p = resolve(json!({"token_string": "t", "num_vectors_per_token": 4,
            "init_word": "cat", "template": "style", "save_dtype": "fp16"}))
        .unwrap();
        assert_eq!(
            (p.num_vectors, p.template),
            (4, Some(CaptionTemplate::Style))
        );
        assert_eq!(p.save_dtype, SaveDtype::Fp16);
    }

    #[test]
    fn bad_values_name_their_key() {
        for (v, key) in [
            (json!({}), "embedding.token_string"),
            (
                json!({"token_string": "two words"}),
                "embedding.token_string",
            ),
            (
                json!({"token_string": "t", "num_vectors_per_token": 0}),
                "num_vectors_per_token",
            ),
            (
                json!({"token_string": "t", "num_vectors_per_token": 76}),
                "num_vectors_per_token",
            ),
            (
                json!({"token_string": "t", "template": "scene"}),
                "embedding.template",
            ),
            (
                json!({"token_string": "t", "init_word": " "}),
                "embedding.init_word",
            ),
            (
                json!({"token_string": "t", "init_from": "missing.safetensors"}),
                "init_from",
            ),
            (
                json!({"token_string": "t", "tokenstring": "x"}),
                "tokenstring",
            ),
            (json!({"token_string": 3}), "token_string"),
            (json!([1]), "embedding"),
        ] {
            let err = resolve(v.clone()).unwrap_err();
            assert!(err.contains(key), "{v}: {err}");
        }
    }
}
