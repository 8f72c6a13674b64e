//! The CLIP text-encoder config, read from a transformers `CLIPTextConfig` `config.json`
//! (`text_encoder/config.json` in a diffusers folder).
//!
//! Two stages: [`RawClipTextConfig`] mirrors the file (every field optional, unknown keys
//! ignored because real files carry many transformers-only keys), and [`ClipTextConfig`] is the
//! validated result with transformers' defaults decided in [`ClipTextConfig::from_raw`].
//! A full `CLIPConfig` (with a nested `text_config`) is accepted too.

use std::path::{Path, PathBuf};

use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum ClipConfigError {
    #[error("cannot read CLIP text config {path}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot parse CLIP text config {path}{field}")]
    Parse {
        path: PathBuf,
        /// `: field `key``, where the error names one ([`crate::py_json::field_at`]).
        field: String,
        source: serde_json::Error,
    },
    #[error("invalid CLIP text config {path}: field `{field}`: {message}")]
    Invalid {
        path: PathBuf,
        field: &'static str,
        message: String,
    },
}

/// The MLP activation (`hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClipActivation {
    /// `x·σ(1.702·x)`: OpenAI CLIP (SD1.x `text_encoder`).
    QuickGelu,
    /// Exact erf GELU, transformers' `"gelu"`: OpenCLIP (SD2.x, SDXL `text_encoder_2`).
    Gelu,
    /// The tanh approximation, transformers' `"gelu_new"` / `"gelu_pytorch_tanh"`.
    GeluTanh,
}

impl ClipActivation {
    /// The transformers `hidden_act` name, or `None` if we do not implement it.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "quick_gelu" => Some(Self::QuickGelu),
            "gelu" => Some(Self::Gelu),
            "gelu_new" | "gelu_pytorch_tanh" => Some(Self::GeluTanh),
            _ => None,
        }
    }
}

/// The file as written; `None` means "absent", resolved to transformers' default.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RawClipTextConfig {
    pub vocab_size: Option<usize>,
    pub hidden_size: Option<usize>,
    pub intermediate_size: Option<usize>,
    pub projection_dim: Option<usize>,
    pub num_hidden_layers: Option<usize>,
    pub num_attention_heads: Option<usize>,
    pub max_position_embeddings: Option<usize>,
    pub hidden_act: Option<String>,
    pub layer_norm_eps: Option<f64>,
    pub bos_token_id: Option<i64>,
    pub eos_token_id: Option<i64>,
    pub pad_token_id: Option<i64>,
    /// Dropout while training, in transformers; sdtrain's CLIP has none, so only 0 (every SD
    /// text encoder's value) or null is accepted. Kept as written to name any other value.
    #[serde(default)]
    pub attention_dropout: serde_json::Value,
    #[serde(default)]
    pub dropout: serde_json::Value,
    /// Present when the file is a full `CLIPConfig` rather than a `CLIPTextConfig`.
    pub text_config: Option<Box<RawClipTextConfig>>,
}

/// A validated CLIP text-transformer config.
#[derive(Debug, Clone, PartialEq)]
pub struct ClipTextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub projection_dim: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub max_position_embeddings: usize,
    pub hidden_act: ClipActivation,
    pub layer_norm_eps: f64,
    pub bos_token_id: i64,
    /// With the legacy value 2 the pooled token is `argmax(ids)` (see `text_model.rs`).
    pub eos_token_id: i64,
    pub pad_token_id: i64,
}

impl ClipTextConfig {
    /// Reads and validates a `config.json`; errors name the file (and the field).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ClipConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ClipConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json(&text, path)
    }

    /// Parses `json`; `origin` is the file name used in errors.
    pub fn from_json(json: &str, origin: &Path) -> Result<Self, ClipConfigError> {
        let raw: RawClipTextConfig =
            crate::py_json::from_str(json).map_err(|source| ClipConfigError::Parse {
                path: origin.to_path_buf(),
                field: crate::py_json::field_at(json, &source),
                source,
            })?;
        Self::from_raw(raw, origin)
    }

    /// Resolves defaults (those of transformers' `CLIPTextConfig.__init__`) and validates.
    pub fn from_raw(raw: RawClipTextConfig, origin: &Path) -> Result<Self, ClipConfigError> {
        let raw = match raw.text_config {
            Some(text) => *text,
            None => raw,
        };
        check_no_dropout(&raw, origin)?;
        let invalid = |field: &'static str, message: String| ClipConfigError::Invalid {
            path: origin.to_path_buf(),
            field,
            message,
        };
        let act_name = raw.hidden_act.unwrap_or_else(|| "quick_gelu".to_string());
        let hidden_act = ClipActivation::from_name(&act_name).ok_or_else(|| {
            invalid(
                "hidden_act",
                format!(
                    "unsupported activation {act_name:?} (supported: \"quick_gelu\", \"gelu\", \
                     \"gelu_new\", \"gelu_pytorch_tanh\")"
                ),
            )
        })?;
        let cfg = Self {
            vocab_size: raw.vocab_size.unwrap_or(49408),
            hidden_size: raw.hidden_size.unwrap_or(512),
            intermediate_size: raw.intermediate_size.unwrap_or(2048),
            projection_dim: raw.projection_dim.unwrap_or(512),
            num_hidden_layers: raw.num_hidden_layers.unwrap_or(12),
            num_attention_heads: raw.num_attention_heads.unwrap_or(8),
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(77),
            hidden_act,
            layer_norm_eps: raw.layer_norm_eps.unwrap_or(1e-5),
            bos_token_id: raw.bos_token_id.unwrap_or(49406),
            eos_token_id: raw.eos_token_id.unwrap_or(49407),
            pad_token_id: raw.pad_token_id.unwrap_or(1),
        };
        let positive = [
            ("vocab_size", cfg.vocab_size),
            ("hidden_size", cfg.hidden_size),
            ("intermediate_size", cfg.intermediate_size),
            ("projection_dim", cfg.projection_dim),
            ("num_hidden_layers", cfg.num_hidden_layers),
            ("num_attention_heads", cfg.num_attention_heads),
            ("max_position_embeddings", cfg.max_position_embeddings),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(invalid(field, "must be positive".to_string()));
            }
            // Refused before anything is allocated for them: no CLIP comes near.
            use crate::model::size_limits::{
                check, MAX_DEPTH, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH,
            };
            let max = match field {
                "vocab_size" => MAX_VOCAB,
                "num_hidden_layers" => MAX_DEPTH,
                "max_position_embeddings" => MAX_POSITIONS,
                _ => MAX_WIDTH,
            };
            check(value, 1, max).map_err(|m| invalid(field, m))?;
        }
        if !cfg.hidden_size.is_multiple_of(cfg.num_attention_heads) {
            return Err(invalid(
                "num_attention_heads",
                format!(
                    "{} heads do not divide hidden_size {}",
                    cfg.num_attention_heads, cfg.hidden_size
                ),
            ));
        }
        if !(cfg.layer_norm_eps.is_finite() && cfg.layer_norm_eps > 0.0) {
            return Err(invalid(
                "layer_norm_eps",
                format!("must be positive, got {}", cfg.layer_norm_eps),
            ));
        }
        Ok(cfg)
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }
}

/// Dropout while training, in transformers; sdtrain's CLIP has none, so only 0 (every SD text
/// encoder's value) or null is accepted.
fn check_no_dropout(raw: &RawClipTextConfig, origin: &Path) -> Result<(), ClipConfigError> {
    for (field, v) in [
        ("attention_dropout", &raw.attention_dropout),
        ("dropout", &raw.dropout),
    ] {
        if !(v.is_null() || v.as_f64() == Some(0.0)) {
            return Err(ClipConfigError::Invalid {
                path: origin.to_path_buf(),
                field,
                message: format!(
                    "is {v}; sdtrain trains the text encoder without dropout, so only 0.0"
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<ClipTextConfig, ClipConfigError> {
        ClipTextConfig::from_json(json, Path::new("te/config.json"))
    }

    #[test]
    fn sd15_style_config_with_extra_keys() {
        let cfg = parse(
            r#"{"architectures": ["CLIPTextModel"], "hidden_act": "quick_gelu", "hidden_size": 768,
                "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 12,
                "projection_dim": 768, "torch_dtype": "float32", "eos_token_id": 2}"#,
        )
        .unwrap();
        assert_eq!(cfg.hidden_act, ClipActivation::QuickGelu);
        assert_eq!(cfg.head_dim(), 64);
        assert_eq!(cfg.eos_token_id, 2);
        assert_eq!(cfg.vocab_size, 49408);
    }

    #[test]
    fn nested_text_config() {
        let cfg = parse(
            r#"{"model_type": "clip", "text_config": {"hidden_act": "gelu", "hidden_size": 64}}"#,
        )
        .unwrap();
        assert_eq!(cfg.hidden_act, ClipActivation::Gelu);
        assert_eq!(cfg.hidden_size, 64);
    }

    /// Dropout was ignored whatever its value (`"attention_dropout": 0.1` trained without it,
    /// `"abc"` passed); only 0 or null is accepted.
    #[test]
    fn dropout_other_than_zero_names_the_field() {
        parse(r#"{"attention_dropout": 0.0, "dropout": null}"#).unwrap();
        for bad in [r#"{"attention_dropout": 0.1}"#, r#"{"dropout": "abc"}"#] {
            let err = parse(bad).unwrap_err().to_string();
            assert!(
                err.contains("dropout`") && err.contains("te/config.json"),
                "{err}"
            );
        }
    }

    /// Sizes no CLIP has are refused before anything is allocated, naming file and field.
    #[test]
    fn absurd_sizes_name_the_field() {
        for field in [
            "vocab_size",
            "num_hidden_layers",
            "max_position_embeddings",
            "hidden_size",
        ] {
            let err = parse(&format!(r#"{{"{field}": 1099511627776}}"#))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(field) && err.contains("te/config.json") && err.contains("accepts"),
                "{err}"
            );
        }
    }

    #[test]
    fn bad_heads_names_field() {
        let err = parse(r#"{"hidden_size": 30, "num_attention_heads": 4}"#)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("num_attention_heads") && err.contains("te/config.json"),
            "{err}"
        );
    }
}
