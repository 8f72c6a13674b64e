//! What a single file says it predicts. Nothing in an LDM checkpoint's tensors tells ε from v,
//! so the tools that write them say it beside the weights:
//! - kohya sd-scripts and OneTrainer write the ModelSpec key `modelspec.prediction_type`
//!   (`"epsilon"` or `"v"`);
//! - ComfyUI's save writes `modelspec.predict_key` (the same values) and, for v, an empty `v_pred`
//!   tensor, which ComfyUI and Forge read;
//! - kohya's training metadata holds `ss_v_parameterization` (`"True"` or `"False"`), which
//!   merges carry into checkpoints.
//!
//! A declaration wins over the family's default (diffusers': SD2 v, SD1 and SDXL ε). Declarations
//! that disagree are an error naming them: training the wrong objective ruins a model without a
//! sign, so sdtrain does not pick one. `prediction_type` in train.json overrides them all.

use std::collections::BTreeMap;
use std::path::Path;

use super::SingleFileError;
use crate::model::family::{ModelFamily, PredictionType};

/// The metadata keys read, in the order they are reported.
const KEYS: [&str; 3] = [
    "modelspec.prediction_type",
    "modelspec.predict_key",
    "ss_v_parameterization",
];

/// The prediction type of a single file and what said so, for the run's and `inspect`'s lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prediction {
    pub prediction: PredictionType,
    pub from: String,
}

/// Reads one declaration: `Ok(None)` for an empty value (written when a tool did not know).
fn read(key: &str, value: &str) -> Result<Option<PredictionType>, String> {
    let v = value.trim().to_ascii_lowercase();
    let by_name = |v: &str| match v {
        "" => Ok(None),
        "epsilon" | "eps" => Ok(Some(PredictionType::Epsilon)),
        "v" | "v_prediction" | "v-prediction" => Ok(Some(PredictionType::VPrediction)),
        _ => Err(format!(
            "is {value:?}: sdtrain trains \"epsilon\" and \"v\" models; if the weights are one \
             of those, say which with `prediction_type` in train.json"
        )),
    };
    match key {
        "ss_v_parameterization" => match v.as_str() {
            "" | "none" => Ok(None),
            "true" | "1" => Ok(Some(PredictionType::VPrediction)),
            "false" | "0" => Ok(Some(PredictionType::Epsilon)),
            _ => Err(format!("is {value:?}, not True or False")),
        },
        _ => by_name(&v),
    }
}

/// The file's declarations: `(what said it, the type)`.
fn declarations(
    path: &Path,
    metadata: &BTreeMap<String, String>,
    v_pred_tensor: bool,
) -> Result<Vec<(String, PredictionType)>, SingleFileError> {
    let mut found = Vec::new();
    for key in KEYS {
        let Some(value) = metadata.get(key) else {
            continue;
        };
        let said = read(key, value).map_err(|message| SingleFileError::Metadata {
            path: path.to_path_buf(),
            key: key.to_string(),
            message,
        })?;
        if let Some(p) = said {
            found.push((format!("the file's metadata `{key}` ({value:?})"), p));
        }
    }
    if v_pred_tensor {
        found.push((
            "ComfyUI's `v_pred` marker tensor".to_string(),
            PredictionType::VPrediction,
        ));
    }
    Ok(found)
}

/// The prediction type of a file whose configs are detected: `option` (train.json's
/// `prediction_type`) if given, else what the file declares, else the family's default.
pub fn resolve(
    path: &Path,
    family: ModelFamily,
    metadata: &BTreeMap<String, String>,
    v_pred_tensor: bool,
    option: Option<PredictionType>,
) -> Result<Prediction, SingleFileError> {
    if let Some(p) = option {
        return Ok(Prediction {
            prediction: p,
            from: "`prediction_type`".into(),
        });
    }
    let found = declarations(path, metadata, v_pred_tensor)?;
    if let Some((first, p)) = found.first() {
        if let Some((other, q)) = found.iter().find(|(_, q)| q != p) {
            return Err(SingleFileError::Metadata {
                path: path.to_path_buf(),
                key: "prediction type".into(),
                message: format!(
                    "{first} says {}, but {other} says {}; say which the weights are with \
                     `prediction_type` in train.json (or `--prediction-type`)",
                    p.name(),
                    q.name()
                ),
            });
        }
        return Ok(Prediction {
            prediction: *p,
            from: first.clone(),
        });
    }
    Ok(match family {
        ModelFamily::Sd2 => Prediction {
            prediction: PredictionType::VPrediction,
            from: "the SD2 default, as diffusers; an SD2-base file is epsilon: set \
                   `prediction_type`"
                .into(),
        },
        ModelFamily::Sd1 | ModelFamily::Sdxl => Prediction {
            prediction: PredictionType::Epsilon,
            from: format!("the {} default", family.name()),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn of(
        family: ModelFamily,
        pairs: &[(&str, &str)],
        v_pred: bool,
    ) -> Result<Prediction, SingleFileError> {
        resolve(
            Path::new("m.safetensors"),
            family,
            &meta(pairs),
            v_pred,
            None,
        )
    }

    /// Each key as the tool that writes it spells it, against the family default it overrides.
    /// Catches a key not read (SD2 stays v, SD1 stays ε) or a value read the wrong way round.
    #[test]
    fn each_tool_s_declaration_overrides_the_family_default() {
        use PredictionType::{Epsilon, VPrediction};
        for (family, pairs, v_pred, want) in [
            (ModelFamily::Sd2, &[][..], false, VPrediction),
            (ModelFamily::Sd1, &[][..], false, Epsilon),
            (ModelFamily::Sdxl, &[][..], false, Epsilon),
            (ModelFamily::Sdxl, &[][..], true, VPrediction),
            (
                ModelFamily::Sd2,
                &[("modelspec.prediction_type", "epsilon")][..],
                false,
                Epsilon,
            ),
            (
                ModelFamily::Sd1,
                &[("modelspec.prediction_type", "v")][..],
                false,
                VPrediction,
            ),
            (
                ModelFamily::Sd2,
                &[("modelspec.predict_key", "epsilon")][..],
                false,
                Epsilon,
            ),
            (
                ModelFamily::Sdxl,
                &[("modelspec.predict_key", "v")][..],
                true,
                VPrediction,
            ),
            (
                ModelFamily::Sd2,
                &[("ss_v_parameterization", "False")][..],
                false,
                Epsilon,
            ),
            (
                ModelFamily::Sd1,
                &[("ss_v_parameterization", "True")][..],
                false,
                VPrediction,
            ),
            // An empty value says nothing.
            (
                ModelFamily::Sd2,
                &[("modelspec.prediction_type", "")][..],
                false,
                VPrediction,
            ),
        ] {
            let got = of(family, pairs, v_pred).unwrap();
            assert_eq!(got.prediction, want, "{family:?} {pairs:?} v_pred {v_pred}");
            match pairs.first() {
                Some((k, v)) if !v.is_empty() => assert!(got.from.contains(k), "{}", got.from),
                _ => {}
            }
        }
    }

    /// Declarations that disagree, or a value sdtrain cannot train, stop with the keys named;
    /// train.json's `prediction_type` settles either.
    #[test]
    fn disagreeing_or_unknown_declarations_are_errors_the_option_settles() {
        let both = [
            ("modelspec.prediction_type", "epsilon"),
            ("ss_v_parameterization", "True"),
        ];
        let err = of(ModelFamily::Sd1, &both, false).unwrap_err().to_string();
        assert!(
            err.contains("modelspec.prediction_type")
                && err.contains("ss_v_parameterization")
                && err.contains("prediction_type` in train.json"),
            "{err}"
        );
        let err = of(
            ModelFamily::Sdxl,
            &[("modelspec.predict_key", "epsilon")],
            true,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("v_pred"), "{err}");
        let err = of(
            ModelFamily::Sd1,
            &[("modelspec.prediction_type", "flow")],
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("\"flow\""), "{err}");
        let p = resolve(
            Path::new("m"),
            ModelFamily::Sd1,
            &meta(&both),
            false,
            Some(PredictionType::Epsilon),
        )
        .unwrap();
        assert_eq!(p.prediction, PredictionType::Epsilon);
    }
}
