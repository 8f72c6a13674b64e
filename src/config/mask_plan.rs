//! [`MaskPlan`]: masked loss resolved from train.json, under kohya's names (`masked_loss`,
//! `alpha_mask`) and OneTrainer's (`masked_training`, `unmasked_weight`,
//! `unmasked_probability`, `normalize_masked_area_loss`). Where the masks come from and how they
//! are read: `crate::data::mask`; how they weigh the loss: `crate::diffusion::loss`.
//!
//! `masked_loss` and `masked_training` mean the same and may both be given only when they agree.
//! `alpha_mask: true` turns masked loss on by itself, with the masks taken from the images' alpha
//! channels (as in kohya). The weighting keys are refused while masked loss is off, where they
//! would do nothing. Defaults are kohya's (the mask as given): `unmasked_weight` 0,
//! `unmasked_probability` 0, no normalisation; OneTrainer's UI starts at 0.1, 0.1 and off.

use serde::Serialize;

use super::ctx::Ctx;
use super::error::ConfigError;
use super::train_file::TrainFile;
use crate::data::mask::MaskSource;
use crate::diffusion::loss::MaskWeighting;

/// Masked loss, when on.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MaskPlan {
    pub source: MaskSource,
    /// The floor of the mask and whether each sample's loss is divided by its mask's mean.
    pub weighting: MaskWeighting,
    /// The chance a training sample ignores its mask (an all-ones mask), drawn per sample.
    pub unmasked_probability: f64,
}

pub(super) fn resolve_mask(
    file: &TrainFile,
    ctx: &Ctx<'_>,
) -> Result<Option<MaskPlan>, ConfigError> {
    let named = match (file.masked_loss, file.masked_training) {
        (Some(a), Some(b)) if a != b => {
            return Err(ctx.invalid(
                "masked_training",
                format!(
                    "is {b} but masked_loss is {a}; they are kohya's and OneTrainer's names for \
                     the same switch: give one, or both alike"
                ),
            ))
        }
        (a, b) => a.or(b).unwrap_or(false),
    };
    let alpha = file.alpha_mask.unwrap_or(false);
    if !named && !alpha {
        let weighting_keys = [
            ("unmasked_weight", file.unmasked_weight.is_some()),
            ("unmasked_probability", file.unmasked_probability.is_some()),
            (
                "normalize_masked_area_loss",
                file.normalize_masked_area_loss.is_some(),
            ),
            (
                "masked_prior_preservation_weight",
                file.masked_prior_preservation_weight.is_some(),
            ),
        ];
        if let Some((key, _)) = weighting_keys.iter().find(|(_, set)| *set) {
            return Err(ctx.invalid(
                key,
                "weighs the loss mask, but masked loss is off; set masked_loss (or \
                 masked_training, or alpha_mask) to true, or leave it out"
                    .to_string(),
            ));
        }
        return Ok(None);
    }
    Ok(Some(MaskPlan {
        source: if alpha {
            MaskSource::Alpha
        } else {
            MaskSource::File
        },
        weighting: MaskWeighting {
            unmasked_weight: ctx.fraction("unmasked_weight", file.unmasked_weight, 0.0)?,
            normalize: file.normalize_masked_area_loss.unwrap_or(false),
            prior_preservation: match file.masked_prior_preservation_weight {
                None => 0.0,
                Some(p) if p.is_finite() && p >= 0.0 => p,
                Some(p) => {
                    return Err(ctx.invalid(
                        "masked_prior_preservation_weight",
                        format!("must be 0 or more (got {p}); 0 is off"),
                    ))
                }
            },
        },
        unmasked_probability: ctx.fraction(
            "unmasked_probability",
            file.unmasked_probability,
            0.0,
        )?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn resolve(json: serde_json::Value) -> Result<Option<MaskPlan>, ConfigError> {
        let file: TrainFile = serde_json::from_value(json).unwrap();
        resolve_mask(&file, &Ctx::new(Path::new("train.json")))
    }

    #[test]
    fn both_peers_names_resolve_and_contradictions_are_refused() {
        use serde_json::json;
        assert_eq!(resolve(json!({})).unwrap(), None);
        let kohya = resolve(json!({"masked_loss": true})).unwrap().unwrap();
        let ot = resolve(json!({"masked_training": true, "masked_loss": true}));
        assert_eq!(ot.unwrap().unwrap(), kohya);
        assert_eq!(kohya.source, MaskSource::File);
        assert_eq!(kohya.weighting.unmasked_weight, 0.0);
        let alpha = resolve(json!({"alpha_mask": true, "unmasked_weight": 0.1}));
        let alpha = alpha.unwrap().unwrap();
        assert_eq!(
            (alpha.source, alpha.weighting.unmasked_weight),
            (MaskSource::Alpha, 0.1)
        );
        for (bad, key) in [
            (
                json!({"masked_loss": true, "masked_training": false}),
                "masked_training",
            ),
            (json!({"unmasked_weight": 0.5}), "unmasked_weight"),
            (
                json!({"normalize_masked_area_loss": true}),
                "normalize_masked_area_loss",
            ),
            (
                json!({"masked_loss": true, "unmasked_probability": 2.0}),
                "unmasked_probability",
            ),
        ] {
            let err = resolve(bad).unwrap_err().to_string();
            assert!(err.contains(key), "{err}");
        }
    }
}
