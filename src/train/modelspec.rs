//! The ModelSpec keys of a run's embedding files and full single-file checkpoints, as kohya's
//! `get_sai_model_spec` writes them (`library/sai_model_spec.py`): with `textual_inversion`
//! for an embedding (`<architecture>/textual-inversion`), with `is_stable_diffusion_ckpt` for a
//! checkpoint; both name Stability AI's implementation. Adapter files get theirs from
//! `crate::adapter::kohya_meta`, and the `metadata_*` fields from the plan as these do.

use crate::config::TrainPlan;
use crate::model::family::{ModelFamily, PredictionType};

/// What the file holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Saved {
    TextualInversion,
    Checkpoint,
}

/// kohya's `IMPL_STABILITY_AI`.
const STABILITY_AI: &str = "https://github.com/Stability-AI/generative-models";

/// The header entries: ModelSpec 1.0.1's required keys, the date, the prediction type, and the
/// plan's fields (`metadata_*`, `encoder_layer`, `timestep_range`); `title` unless
/// `metadata_title` says otherwise.
pub(super) fn modelspec(
    saved: Saved,
    (family, prediction): (ModelFamily, PredictionType),
    plan: &TrainPlan,
    title: &str,
    resolution: usize,
) -> Vec<(String, String)> {
    let v = prediction == PredictionType::VPrediction;
    let base = match family {
        ModelFamily::Sdxl => "stable-diffusion-xl-v1-base",
        ModelFamily::Sd2 if v => "stable-diffusion-v2-768-v",
        ModelFamily::Sd2 => "stable-diffusion-v2-512",
        ModelFamily::Sd1 => "stable-diffusion-v1",
    };
    let architecture = match saved {
        Saved::TextualInversion => format!("{base}/textual-inversion"),
        Saved::Checkpoint => base.to_string(),
    };
    let now = crate::adapter::kohya_meta::unix_now();
    let date = chrono::DateTime::from_timestamp(now.floor() as i64, 0)
        .map(|d| d.format("%Y-%m-%dT%H:%M:%S").to_string())
        .unwrap_or_default();
    let mut keys: Vec<(String, String)> = [
        ("modelspec.sai_model_spec", "1.0.1".to_string()),
        ("modelspec.architecture", architecture),
        ("modelspec.implementation", STABILITY_AI.to_string()),
        ("modelspec.title", title.to_string()),
        ("modelspec.resolution", format!("{resolution}x{resolution}")),
        ("modelspec.date", date),
        (
            "modelspec.prediction_type",
            if v { "v" } else { "epsilon" }.to_string(),
        ),
        (
            "modelspec.implementation_version",
            format!("sdtrain/{}", env!("CARGO_PKG_VERSION")),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    for (k, val) in &plan.modelspec.fields {
        match keys.iter_mut().find(|(key, _)| key == k) {
            Some(entry) => entry.1 = val.clone(),
            None => keys.push((k.clone(), val.clone())),
        }
    }
    keys
}
