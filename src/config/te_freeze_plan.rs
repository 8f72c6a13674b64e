//! [`TextEncoderFreeze`]: optimizer.json's `text_encoder_freezing` resolved, as EveryDream2's
//! `_apply_text_encoder_freeze` (optimizer/optimizers.py) reads it:
//! - `unfreeze_last_n_layers: N` trains the last N encoder layers; `freeze_front_n_layers` (its
//!   older form) freezes the first N (N > 0) or trains the last −N (N < 0).
//!   `unfreeze_last_n_layers` wins when both are set; neither trains every layer.
//! - The embeddings freeze when fewer than all layers train, unless `freeze_embeddings` says
//!   otherwise (either way).
//! - The final layer norm trains unless `freeze_final_layer_norm` is true.
//!
//! The layer count is the model's, so the rules that need it are methods taking it.

use std::path::Path;

use serde::Serialize;

use super::error::ConfigError;
use super::optimizer_file::FreezingFile;

/// Which encoder layers train.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TrainedLayers {
    All,
    /// The last N (`unfreeze_last_n_layers`, or a negative `freeze_front_n_layers`).
    Last(usize),
    /// All but the first N (a positive `freeze_front_n_layers`).
    AllButFirst(usize),
}

/// The text-encoder parts that train in a full fine-tune.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TextEncoderFreeze {
    pub layers: TrainedLayers,
    /// `Some` when written; `None` freezes them exactly when fewer than all layers train.
    pub freeze_embeddings: Option<bool>,
    pub freeze_final_layer_norm: bool,
}

impl Default for TextEncoderFreeze {
    fn default() -> Self {
        Self {
            layers: TrainedLayers::All,
            freeze_embeddings: None,
            freeze_final_layer_norm: false,
        }
    }
}

impl TextEncoderFreeze {
    /// Reads the section (`None`: every part trains). `file` names the optimizer config.
    pub fn resolve(section: Option<&FreezingFile>, file: &Path) -> Result<Self, ConfigError> {
        let Some(s) = section else {
            return Ok(Self::default());
        };
        let invalid = |field: &str, message: String| ConfigError::Invalid {
            file: file.to_path_buf(),
            field: format!("text_encoder_freezing.{field}"),
            message,
        };
        let layers = match (s.unfreeze_last_n_layers, s.freeze_front_n_layers) {
            (Some(n), _) if n < 1 => {
                return Err(invalid(
                    "unfreeze_last_n_layers",
                    format!(
                        "must be 1 or more, or null to train every layer (got {n}); to freeze \
                         the whole text encoder set `disable_textenc_training` in train.json"
                    ),
                ))
            }
            (Some(n), _) => TrainedLayers::Last(n.unsigned_abs() as usize),
            (None, Some(n)) if n < 0 => TrainedLayers::Last(n.unsigned_abs() as usize),
            (None, Some(n)) => TrainedLayers::AllButFirst(n.unsigned_abs() as usize),
            (None, None) => TrainedLayers::All,
        };
        Ok(Self {
            layers,
            freeze_embeddings: s.freeze_embeddings,
            freeze_final_layer_norm: s.freeze_final_layer_norm.unwrap_or(false),
        })
    }

    /// How many of the encoder's `num_layers` layers train (the last ones).
    pub fn trained_layers(&self, num_layers: usize) -> usize {
        match self.layers {
            TrainedLayers::All => num_layers,
            TrainedLayers::Last(n) => n.min(num_layers),
            TrainedLayers::AllButFirst(n) => num_layers.saturating_sub(n),
        }
    }

    /// Whether the embeddings train, for an encoder of `num_layers` layers.
    pub fn embeddings_train(&self, num_layers: usize) -> bool {
        match self.freeze_embeddings {
            Some(freeze) => !freeze,
            None => self.trained_layers(num_layers) >= num_layers,
        }
    }

    /// Whether every part trains, whatever the layer count.
    pub fn trains_everything(&self) -> bool {
        self.layers == TrainedLayers::All
            && self.freeze_embeddings != Some(true)
            && !self.freeze_final_layer_norm
    }

    /// An encoder of `num_layers` layers in which nothing trains is refused, as EveryDream2
    /// asserts; `None` when something trains.
    pub fn check(&self, num_layers: usize) -> Option<String> {
        (self.trained_layers(num_layers) == 0 && num_layers > 0).then(|| {
            format!(
                "text_encoder_freezing freezes all {num_layers} layers of the text encoder \
                 (freeze_front_n_layers {:?}); to freeze the whole text encoder set \
                 `disable_textenc_training` in train.json",
                match self.layers {
                    TrainedLayers::AllButFirst(n) => n,
                    TrainedLayers::Last(n) => n,
                    TrainedLayers::All => num_layers,
                }
            )
        })
    }
}

impl std::fmt::Display for TextEncoderFreeze {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.layers {
            TrainedLayers::All => write!(f, "every layer")?,
            TrainedLayers::Last(n) => write!(f, "the last {n} layers")?,
            TrainedLayers::AllButFirst(n) => write!(f, "all layers but the first {n}")?,
        }
        match self.freeze_embeddings {
            Some(true) => write!(f, ", embeddings frozen")?,
            Some(false) => write!(f, ", embeddings trained")?,
            None => {}
        }
        if self.freeze_final_layer_norm {
            write!(f, ", final layer norm frozen")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(s: FreezingFile) -> Result<TextEncoderFreeze, ConfigError> {
        TextEncoderFreeze::resolve(Some(&s), Path::new("optimizer.json"))
    }

    #[test]
    fn ed2_layer_rules() {
        // EveryDream2: unfreeze_last_n_layers wins over freeze_front_n_layers; −N trains the
        // last N; +N freezes the first N.
        let f = resolve(FreezingFile {
            unfreeze_last_n_layers: Some(2),
            freeze_front_n_layers: Some(3),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(f.trained_layers(12), 2);
        assert!(!f.embeddings_train(12));
        let f = resolve(FreezingFile {
            freeze_front_n_layers: Some(-3),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(f.trained_layers(12), 3);
        let f = resolve(FreezingFile {
            freeze_front_n_layers: Some(4),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(f.trained_layers(12), 8);
        assert_eq!(f.check(12), None);
        assert!(f.check(4).unwrap().contains("all 4 layers"));
        // freeze_front_n_layers 0 trains everything, embeddings included.
        let f = resolve(FreezingFile {
            freeze_front_n_layers: Some(0),
            ..Default::default()
        })
        .unwrap();
        assert!(f.embeddings_train(12));
    }

    #[test]
    fn explicit_embedding_and_norm_choices_win() {
        let f = resolve(FreezingFile {
            unfreeze_last_n_layers: Some(2),
            freeze_embeddings: Some(false),
            freeze_final_layer_norm: Some(true),
            ..Default::default()
        })
        .unwrap();
        assert!(f.embeddings_train(12));
        assert!(f.freeze_final_layer_norm);
        assert!(!f.trains_everything());
        let f = resolve(FreezingFile {
            freeze_embeddings: Some(true),
            ..Default::default()
        })
        .unwrap();
        assert!(!f.embeddings_train(12));
        assert_eq!(f.trained_layers(12), 12);
    }

    #[test]
    fn unfreeze_zero_is_refused() {
        let err = resolve(FreezingFile {
            unfreeze_last_n_layers: Some(0),
            ..Default::default()
        })
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("text_encoder_freezing.unfreeze_last_n_layers"),
            "{err}"
        );
    }
}
