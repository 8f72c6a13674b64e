//! kohya sd-scripts' names for keys train.json already has under EveryDream2's, read into them
//! before anything is resolved, so a setting copied from a kohya config means what it meant
//! there:
//! - `max_grad_norm` ([`max_grad_norm`]) clips the global norm of every trained parameter, as
//!   kohya does; EveryDream2's `clip_grad_norm` clips each group's. kohya clips at 1 when the
//!   key is absent; a train.json keeps EveryDream2's default (no clipping), a kohya config
//!   (`super::kohya_config`) kohya's;
//! - `network_train_unet_only` is `disable_textenc_training` (the adapters stay on the UNet);
//! - `network_train_text_encoder_only` is `disable_unet_training` (only the text encoders'
//!   adapters are attached and trained);
//! - `output_name` is `project_name` (the saved files' and the run folder's name);
//! - `save_model_as` is `save_ckpt_format` for a full fine-tune ([`save_model_as`]).
//!
//! Both names at different values are refused, naming the kohya key.

use super::ctx::Ctx;
use super::error::ConfigError;
use super::train_file::TrainFile;
use crate::optim::{ClipScope, GradClip};

pub(super) fn apply_kohya_names(file: &mut TrainFile, ctx: &Ctx<'_>) -> Result<(), ConfigError> {
    if file.network_train_unet_only == Some(true) {
        if file.disable_textenc_training == Some(false) {
            return Err(ctx.invalid(
                "network_train_unet_only",
                "is true but disable_textenc_training is false: kohya's network_train_unet_only \
                 is EveryDream2's disable_textenc_training; give one"
                    .to_string(),
            ));
        }
        file.disable_textenc_training = Some(true);
    }
    if let Some(name) = file.output_name.clone() {
        match &file.project_name {
            Some(p) if *p != name => {
                return Err(ctx.invalid(
                    "output_name",
                    format!(
                        "is \"{name}\" but project_name is \"{p}\": kohya's output_name is \
                         EveryDream2's project_name (the saved files' and run folder's name); \
                         give one"
                    ),
                ))
            }
            _ => file.project_name = Some(name),
        }
    }
    if let Some(format) = file.save_model_as.clone() {
        save_model_as(file, ctx, &format)?;
    }
    if file.network_train_text_encoder_only == Some(true) {
        if file.disable_unet_training == Some(false) {
            return Err(ctx.invalid(
                "network_train_text_encoder_only",
                "is true but disable_unet_training is false: kohya's \
                 network_train_text_encoder_only is disable_unet_training; give one"
                    .to_string(),
            ));
        }
        file.disable_unet_training = Some(true);
    }
    Ok(())
}

/// kohya's `save_model_as`: `safetensors` (an adapter's file; a full fine-tune's single file),
/// `diffusers` or `diffusers_safetensors` (a full fine-tune's folder) as `save_ckpt_format`;
/// `ckpt` and `pt` (pickles) are refused. An adapter run's `safetensors` is what it saves
/// anyway.
fn save_model_as(file: &mut TrainFile, ctx: &Ctx<'_>, format: &str) -> Result<(), ConfigError> {
    let full = file.mode.as_deref().is_none_or(|m| m == "full");
    let ours = match (format, full) {
        ("safetensors", false) => return Ok(()),
        ("safetensors", true) => "safetensors",
        ("diffusers" | "diffusers_safetensors", true) => "diffusers",
        ("ckpt" | "pt", _) => {
            return Err(ctx.invalid(
                "save_model_as",
                format!(
                    "is \"{format}\", a pickle format, which sdtrain never writes; use \
                     \"safetensors\""
                ),
            ))
        }
        (other, _) => {
            return Err(ctx.invalid(
                "save_model_as",
                format!(
                    "is \"{other}\"; kohya's choices are \"safetensors\" and, for a full \
                     fine-tune, \"diffusers\" or \"diffusers_safetensors\""
                ),
            ))
        }
    };
    match file.save_ckpt_format.as_deref() {
        Some(f) if f != ours => Err(ctx.invalid(
            "save_model_as",
            format!(
                "is \"{format}\" but save_ckpt_format is \"{f}\": kohya's save_model_as \
                 \"{format}\" is save_ckpt_format \"{ours}\"; give one"
            ),
        )),
        _ => {
            file.save_ckpt_format = Some(ours.to_string());
            Ok(())
        }
    }
}

/// `clip_grad_norm` (each group's norm), or kohya's `max_grad_norm` (0: no clipping), which
/// clips the global norm of every trained parameter. Both at once are refused unless they
/// agree: the same value where one group trains.
pub(super) fn max_grad_norm(
    file: &TrainFile,
    ctx: &Ctx<'_>,
    groups: usize,
) -> Result<Option<GradClip>, ConfigError> {
    let clip = ctx.opt_positive(
        "clip_grad_norm",
        file.clip_grad_norm,
        "greater than 0, or null for no clipping",
    )?;
    let per_group = clip.map(|max| GradClip {
        max,
        scope: ClipScope::PerGroup,
    });
    let Some(norm) = file.max_grad_norm else {
        return Ok(per_group);
    };
    if !(norm.is_finite() && norm >= 0.0) {
        return Err(ctx.invalid(
            "max_grad_norm",
            format!("must be 0 (no clipping) or more (got {norm})"),
        ));
    }
    let kohya = (norm > 0.0).then_some(norm);
    match clip {
        Some(c) if Some(c) != kohya || groups > 1 => Err(ctx.invalid(
            "max_grad_norm",
            format!(
                "is {norm} but clip_grad_norm is {c}: kohya's max_grad_norm clips the global \
                 norm of every trained parameter, EveryDream2's clip_grad_norm each group's \
                 ({groups} here); give one"
            ),
        )),
        _ => Ok(kohya.map(|max| GradClip {
            max,
            scope: ClipScope::Global,
        })),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::config::TrainPlan;

    fn plan(extra: serde_json::Value) -> Result<TrainPlan, String> {
        let root = env!("CARGO_MANIFEST_DIR");
        let mut v = json!({
            "model": format!("{root}/tests/fixtures/tiny-sd15"),
            "data_root": format!("{root}/data/demo"),
            "mode": "lora",
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        TrainPlan::from_value(v, std::path::Path::new("train.json"), &[]).map_err(|e| e.to_string())
    }

    #[test]
    fn kohyas_names_mean_what_they_meant_there() {
        let unet_only = json!({"max_grad_norm": 1.0, "adapter": {"train_text_encoder": false}});
        assert_eq!(plan(unet_only).unwrap().clip_grad_norm, Some(1.0));
        let unet_only = json!({"max_grad_norm": 1.0, "network_train_unet_only": true});
        assert_eq!(plan(unet_only).unwrap().clip_grad_norm, Some(1.0));
        assert_eq!(
            plan(json!({"max_grad_norm": 0.0})).unwrap().clip_grad_norm,
            None
        );
        let p = plan(json!({"network_train_unet_only": true})).unwrap();
        assert!(!p.adapter.unwrap().train_text_encoder);
        let p = plan(json!({"network_train_unet_only": false})).unwrap();
        assert!(p.adapter.unwrap().train_text_encoder);
        let e = plan(json!({"max_grad_norm": 1.0, "clip_grad_norm": 2.0})).unwrap_err();
        assert!(e.contains("max_grad_norm") && e.contains("give one"), "{e}");
        let both =
            plan(json!({"max_grad_norm": 1.0, "adapter": {"train_text_encoder": true}})).unwrap();
        assert_eq!(both.clip_grad_norm, Some(1.0));
        assert_eq!(both.clip_scope, crate::optim::ClipScope::Global);
        let e = plan(json!({"max_grad_norm": 1.0, "clip_grad_norm": 1.0})).unwrap_err();
        assert!(e.contains("global") && e.contains("(2 here)"), "{e}");
        let p = plan(json!({"clip_grad_norm": 1.0})).unwrap();
        assert_eq!(p.clip_scope, crate::optim::ClipScope::PerGroup);
        assert_eq!(
            plan(json!({"output_name": "cat"})).unwrap().project_name,
            "cat"
        );
        let e = plan(json!({"output_name": "cat", "project_name": "dog"})).unwrap_err();
        assert!(e.contains("output_name"), "{e}");
        assert!(plan(json!({"save_model_as": "safetensors"})).is_ok());
        let full = |f: &str| json!({"mode": "full", "save_model_as": f});
        let p = plan(full("diffusers_safetensors")).unwrap();
        assert_eq!(
            p.model_file.save_ckpt_format,
            crate::config::SaveFormat::Diffusers
        );
        let p = plan(full("safetensors")).unwrap();
        assert_eq!(
            p.model_file.save_ckpt_format,
            crate::config::SaveFormat::Safetensors
        );
        let e = plan(json!({"save_model_as": "ckpt"})).unwrap_err();
        assert!(e.contains("pickle"), "{e}");
        let e = plan(full("diffusers_fp16")).unwrap_err();
        assert!(e.contains("kohya's choices"), "{e}");
        let p = plan(json!({"network_train_text_encoder_only": true})).unwrap();
        assert!(!p.train_unet && !p.adapter.as_ref().unwrap().train_unet);
        let e = plan(json!({"network_train_text_encoder_only": true,
                            "network_train_unet_only": true}))
        .unwrap_err();
        assert!(e.contains("nothing would train"), "{e}");
        let e = plan(json!({"max_grad_norm": -1.0})).unwrap_err();
        assert!(e.contains("max_grad_norm"), "{e}");
    }
}
