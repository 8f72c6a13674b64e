//! Which text-encoder parameters train, from optimizer.json's `text_encoder_freezing`
//! ([`TextEncoderFreeze`]), as EveryDream2 applies it (optimizer/optimizers.py
//! `_apply_text_encoder_freeze`): the last n encoder layers train and the earlier ones freeze;
//! the embeddings and the final layer norm follow their own rules. Anything else (SDXL's second
//! encoder's text projection) trains.

use crate::config::TextEncoderFreeze;

/// Whether the text-encoder parameter `name` (a transformers checkpoint name) trains.
pub fn text_encoder_param_trains(
    name: &str,
    num_layers: usize,
    freeze: &TextEncoderFreeze,
) -> bool {
    if let Some(rest) = name.strip_prefix("text_model.encoder.layers.") {
        let n = freeze.trained_layers(num_layers);
        let index: Option<usize> = rest.split('.').next().and_then(|s| s.parse().ok());
        return index.is_some_and(|i| i >= num_layers - n);
    }
    if name.starts_with("text_model.embeddings.") {
        return freeze.embeddings_train(num_layers);
    }
    if name.starts_with("text_model.final_layer_norm.") {
        return !freeze.freeze_final_layer_norm;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TrainedLayers;

    fn last(n: usize) -> TextEncoderFreeze {
        TextEncoderFreeze {
            layers: TrainedLayers::Last(n),
            ..Default::default()
        }
    }

    #[test]
    fn unfreeze_last_two_of_twelve() {
        let f = |n: &str| text_encoder_param_trains(n, 12, &last(2));
        assert!(!f("text_model.encoder.layers.9.mlp.fc1.weight"));
        assert!(f("text_model.encoder.layers.10.mlp.fc1.weight"));
        assert!(f("text_model.encoder.layers.11.self_attn.q_proj.bias"));
        assert!(!f("text_model.embeddings.token_embedding.weight"));
        assert!(f("text_model.final_layer_norm.weight"));
        assert!(f("text_projection.weight"));
    }

    #[test]
    fn all_layers_or_none_set_trains_everything() {
        let all = TextEncoderFreeze::default();
        let f = |n: &str, freeze: &TextEncoderFreeze| text_encoder_param_trains(n, 12, freeze);
        assert!(f("text_model.embeddings.position_embedding.weight", &all));
        assert!(f(
            "text_model.embeddings.position_embedding.weight",
            &last(12)
        ));
        assert!(f("text_model.encoder.layers.0.mlp.fc1.weight", &last(40)));
        assert!(!f("text_model.encoder.layers.0.mlp.fc1.weight", &last(0)));
    }

    #[test]
    fn embeddings_and_final_norm_follow_their_keys() {
        let f = TextEncoderFreeze {
            layers: TrainedLayers::Last(2),
            freeze_embeddings: Some(false),
            freeze_final_layer_norm: true,
        };
        let trains = |n: &str| text_encoder_param_trains(n, 12, &f);
        assert!(trains("text_model.embeddings.token_embedding.weight"));
        assert!(!trains("text_model.final_layer_norm.bias"));
        assert!(!trains("text_model.encoder.layers.3.mlp.fc1.weight"));
        let front = TextEncoderFreeze {
            layers: TrainedLayers::AllButFirst(10),
            ..Default::default()
        };
        assert!(text_encoder_param_trains(
            "text_model.encoder.layers.10.mlp.fc1.weight",
            12,
            &front
        ));
        assert!(!text_encoder_param_trains(
            "text_model.encoder.layers.9.mlp.fc1.weight",
            12,
            &front
        ));
    }
}
