//! A scheduler config that declares the zero-terminal-SNR schedule (arXiv 2305.08891) a model
//! was trained on, so the saved model samples on it in diffusers, ComfyUI and sdtrain.
//!
//! - `rescale_betas_zero_snr: true` is diffusers' own key. The classes that read it (see
//!   [`READS_ZERO_SNR`]) rescale the betas, and the σ-based ones set the last `ᾱ` to 2⁻²⁴ so
//!   `σ` stays finite.
//! - A class that ignores the key (SD1.x's `PNDMScheduler`, LMS, Heun, KDPM2, DEIS, …) would
//!   draw on the unrescaled schedule, with only a warning in diffusers' log. Such a config
//!   becomes a `DDIMScheduler` one, as EveryDream2's saves replace the class with the one it
//!   trained with. DDIM's defaults that differ from what the old class did are written out:
//!   `clip_sample: false` (the old class never clipped x̂₀) and `set_alpha_to_one: false`
//!   unless the config gives it (PNDM's default, and every Stable Diffusion DDIM config's).
//!   `model_index.json` names the new class too (see `ModelLayout::model_index_json`).
//!
//! EveryDream2 writes the rescaled `trained_betas` instead. Those make an Euler class divide by
//! an `ᾱ` of exactly 0 (σ = ∞), so sdtrain writes the key.

use serde_json::Value;

/// The diffusers scheduler classes whose constructors read `rescale_betas_zero_snr`
/// (diffusers 0.42: every `scheduling_*.py` that takes the argument).
pub const READS_ZERO_SNR: &[&str] = &[
    "DDIMScheduler",
    "DDIMParallelScheduler",
    "DDPMScheduler",
    "DDPMParallelScheduler",
    "EulerDiscreteScheduler",
    "EulerAncestralDiscreteScheduler",
    "DPMSolverMultistepScheduler",
    "UniPCMultistepScheduler",
    "LCMScheduler",
    "TCDScheduler",
];

/// The class a config that cannot declare zero terminal SNR becomes.
const FALLBACK_CLASS: &str = "DDIMScheduler";

/// `config` declaring zero terminal SNR: the key set, and the class replaced by DDIM's where it
/// does not read the key (module header). Unchanged when it already declares it.
pub fn declare_zero_terminal_snr(config: &Value) -> Value {
    let mut out = config.clone();
    let Some(map) = out.as_object_mut() else {
        return out;
    };
    map.insert("rescale_betas_zero_snr".into(), Value::Bool(true));
    let class = map.get("_class_name").and_then(Value::as_str);
    if class.is_some_and(|c| READS_ZERO_SNR.contains(&c)) {
        return out;
    }
    let was_pndm = class == Some("PNDMScheduler");
    map.insert("_class_name".into(), Value::from(FALLBACK_CLASS));
    map.insert("clip_sample".into(), Value::Bool(false));
    let alpha_given = was_pndm && map.get("set_alpha_to_one").is_some_and(Value::is_boolean);
    if !alpha_given {
        map.insert("set_alpha_to_one".into(), Value::Bool(false));
    }
    out
}

/// `model_index.json`'s `scheduler` entry naming `scheduler`'s `_class_name` (diffusers builds
/// the pipeline's scheduler from the index's class, not the config's).
pub fn name_scheduler_class(model_index: &mut Value, scheduler: &Value) {
    let Some(class) = scheduler.get("_class_name").and_then(Value::as_str) else {
        return;
    };
    if let Some(entry) = model_index
        .get_mut("scheduler")
        .and_then(Value::as_array_mut)
        .filter(|e| e.len() == 2)
    {
        entry[1] = Value::from(class);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// SD1.5's PNDM config becomes DDIM with what PNDM did written out; SDXL's Euler and
    /// SD2.1's DDIM only gain the key. Catches the class left as PNDM (diffusers ignores the key
    /// there), DDIM's default `clip_sample: true` let through, or a given `set_alpha_to_one`
    /// overwritten.
    #[test]
    fn classes_that_ignore_the_key_become_ddim() {
        let sd15 = json!({"_class_name": "PNDMScheduler", "skip_prk_steps": true,
            "set_alpha_to_one": false, "steps_offset": 1, "beta_schedule": "scaled_linear"});
        let out = declare_zero_terminal_snr(&sd15);
        assert_eq!(out["_class_name"], "DDIMScheduler");
        assert_eq!(out["rescale_betas_zero_snr"], true);
        assert_eq!(out["clip_sample"], false);
        assert_eq!(out["set_alpha_to_one"], false);
        assert_eq!(out["steps_offset"], 1);
        let given = json!({"_class_name": "PNDMScheduler", "set_alpha_to_one": true});
        assert_eq!(declare_zero_terminal_snr(&given)["set_alpha_to_one"], true);
        let lms = json!({"_class_name": "LMSDiscreteScheduler", "set_alpha_to_one": true});
        assert_eq!(declare_zero_terminal_snr(&lms)["set_alpha_to_one"], false);
        for class in ["EulerDiscreteScheduler", "DDIMScheduler"] {
            let c = json!({"_class_name": class, "clip_sample": true});
            let out = declare_zero_terminal_snr(&c);
            assert_eq!(out["_class_name"], class);
            assert_eq!(out["rescale_betas_zero_snr"], true);
            assert_eq!(out["clip_sample"], true, "{class}: left as given");
            assert_eq!(declare_zero_terminal_snr(&out), out, "{class}: idempotent");
        }
    }

    #[test]
    fn the_model_index_names_the_new_class() {
        let mut index = json!({"scheduler": ["diffusers", "PNDMScheduler"], "unet": ["diffusers", "UNet2DConditionModel"]});
        name_scheduler_class(&mut index, &json!({"_class_name": "DDIMScheduler"}));
        assert_eq!(index["scheduler"], json!(["diffusers", "DDIMScheduler"]));
        assert_eq!(index["unet"][1], "UNet2DConditionModel");
    }
}
