//! Which text-encoder parameters train, from optimizer.json's
//! `text_encoder_freezing.unfreeze_last_n_layers`, as EveryDream2 applies it
//! (optimizer/optimizers.py `_apply_text_encoder_freeze`): the last n encoder layers and the final
//! layer norm train; the earlier layers freeze; the embeddings freeze unless all layers train.
//! Also the text projection (SDXL's second encoder) trains.

/// Whether the text-encoder parameter `name` (a transformers checkpoint name) trains.
/// `unfreeze_last_n` of `None` trains everything.
pub fn text_encoder_param_trains(
    name: &str,
    num_layers: usize,
    unfreeze_last_n: Option<usize>,
) -> bool {
    let Some(n) = unfreeze_last_n else {
        return true;
    };
    let n = n.min(num_layers);
    if let Some(rest) = name.strip_prefix("text_model.encoder.layers.") {
        let index: Option<usize> = rest.split('.').next().and_then(|s| s.parse().ok());
        return index.is_some_and(|i| i >= num_layers - n);
    }
    if name.starts_with("text_model.embeddings.") {
        return n == num_layers;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unfreeze_last_two_of_twelve() {
        let f = |n: &str| text_encoder_param_trains(n, 12, Some(2));
        assert!(!f("text_model.encoder.layers.9.mlp.fc1.weight"));
        assert!(f("text_model.encoder.layers.10.mlp.fc1.weight"));
        assert!(f("text_model.encoder.layers.11.self_attn.q_proj.bias"));
        assert!(!f("text_model.embeddings.token_embedding.weight"));
        assert!(f("text_model.final_layer_norm.weight"));
        assert!(f("text_projection.weight"));
    }

    #[test]
    fn all_layers_or_none_set_trains_everything() {
        assert!(text_encoder_param_trains(
            "text_model.embeddings.position_embedding.weight",
            12,
            None
        ));
        assert!(text_encoder_param_trains(
            "text_model.embeddings.position_embedding.weight",
            12,
            Some(12)
        ));
        assert!(text_encoder_param_trains(
            "text_model.encoder.layers.0.mlp.fc1.weight",
            12,
            Some(40)
        ));
        assert!(!text_encoder_param_trains(
            "text_model.encoder.layers.0.mlp.fc1.weight",
            12,
            Some(0)
        ));
    }
}
