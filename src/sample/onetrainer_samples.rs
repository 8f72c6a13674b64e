//! OneTrainer's sample definitions: the JSON list of its `training_samples/samples.json`, or
//! the `samples` inline in an exported OneTrainer config, each entry a `SampleConfig` (prompt,
//! negative prompt, size, seed, steps, CFG scale and noise scheduler). Disabled entries are
//! left out, as OneTrainer leaves them.

use serde_json::{Map, Value};

use super::prompts::{PromptSyntax, PromptText, SamplePrompt, SeedChoice, SizeChoice};
use super::sampler::SamplerKind;

/// Whether a JSON list is OneTrainer's samples rather than kohya's prompts: its entries have
/// OneTrainer's keys.
pub fn is_onetrainer_list(items: &[Value]) -> bool {
    items.iter().any(|item| {
        item.as_object().is_some_and(|o| {
            [
                "cfg_scale",
                "diffusion_steps",
                "noise_scheduler",
                "__version",
            ]
            .iter()
            .any(|k| o.contains_key(*k))
        })
    })
}

/// Whether a JSON object is a OneTrainer config (its inline `samples` are read).
pub fn is_onetrainer_config(obj: &Map<String, Value>) -> bool {
    ["training_method", "model_type", "base_model_name"]
        .iter()
        .any(|k| obj.contains_key(*k))
}

/// The enabled entries as sample prompts.
pub fn parse_list(items: &[Value]) -> Result<Vec<SamplePrompt>, String> {
    let mut out = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let o = item
            .as_object()
            .ok_or_else(|| format!("entry {i} is not an object"))?;
        if o.get("enabled").and_then(Value::as_bool) == Some(false) {
            continue;
        }
        out.push(entry(o).map_err(|e| format!("entry {i}: {e}"))?);
    }
    Ok(out)
}

fn entry(o: &Map<String, Value>) -> Result<SamplePrompt, String> {
    let text = |k: &str| -> Result<String, String> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(String::new()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(v) => Err(format!("`{k}` must be text (got {v})")),
        }
    };
    let count = |k: &str| -> Result<Option<usize>, String> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 => Ok(Some(n as usize)),
                _ => Err(format!("`{k}` must be a whole number above 0 (got {v})")),
            },
        }
    };
    let seed = match o.get("random_seed").and_then(Value::as_bool) {
        Some(true) => Some(SeedChoice::Random),
        _ => match o.get("seed") {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_i64() {
                Some(s) if s >= 0 => Some(SeedChoice::Fixed(s as u64)),
                _ => return Err(format!("`seed` must be a whole number ≥ 0 (got {v})")),
            },
        },
    };
    let size = match (count("width")?, count("height")?) {
        (Some(w), Some(h)) => SizeChoice::Exact(w, h),
        (w, h) if w.is_some() || h.is_some() => SizeChoice::Sides(w, h),
        _ => SizeChoice::Default,
    };
    let cfgs = match o.get("cfg_scale") {
        None | Some(Value::Null) => None,
        Some(v) => Some(vec![v
            .as_f64()
            .ok_or_else(|| format!("`cfg_scale` must be a number (got {v})"))?]),
    };
    let sampler = match o.get("noise_scheduler").and_then(Value::as_str) {
        None => None,
        Some(name) => Some(sampler(name)?),
    };
    Ok(SamplePrompt {
        prompt: PromptText::Text(text("prompt")?),
        negative_prompt: text("negative_prompt")?,
        seed,
        size,
        cfgs,
        steps: count("diffusion_steps")?,
        sampler,
        syntax: PromptSyntax::Kohya,
    })
}

/// OneTrainer's `NoiseScheduler` as sdtrain's sampler (OneTrainer's `create_noise_scheduler`:
/// DPMPP is diffusers' DPM-Solver++ multistep, DPMPP_SDE its SDE form, `_KARRAS` with Karras
/// sigmas).
fn sampler(name: &str) -> Result<SamplerKind, String> {
    let ours = match name {
        "DDIM" => "ddim",
        "EULER" => "euler",
        "EULER_A" => "euler_a",
        "DPMPP" => "dpm++_2m",
        "DPMPP_KARRAS" => "dpm++_2m_k",
        "DPMPP_SDE" => "dpm++_2m_sde",
        "DPMPP_SDE_KARRAS" => "dpm++_2m_sde_k",
        other => {
            return Err(format!(
                "`noise_scheduler` is \"{other}\": sdtrain samples with DDIM, EULER, EULER_A, \
                 DPMPP, DPMPP_KARRAS, DPMPP_SDE and DPMPP_SDE_KARRAS"
            ))
        }
    };
    SamplerKind::parse(ours).ok_or_else(|| format!("`noise_scheduler` \"{name}\" is unknown"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn entries_take_their_settings_and_disabled_ones_are_left_out() {
        let items = vec![
            json!({"enabled": true, "prompt": "a cat", "negative_prompt": "blur", "height": 64,
                   "width": 96, "seed": 7, "random_seed": false, "diffusion_steps": 3,
                   "cfg_scale": 5.5, "noise_scheduler": "DPMPP_KARRAS"}),
            json!({"enabled": false, "prompt": "off"}),
            json!({"prompt": "b", "random_seed": true, "noise_scheduler": "EULER_A"}),
        ];
        assert!(is_onetrainer_list(&items));
        let p = parse_list(&items).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].prompt, PromptText::Text("a cat".into()));
        assert_eq!(p[0].negative_prompt, "blur");
        assert_eq!(p[0].size, SizeChoice::Exact(96, 64));
        assert_eq!(p[0].seed, Some(SeedChoice::Fixed(7)));
        assert_eq!(p[0].steps, Some(3));
        assert_eq!(p[0].cfgs, Some(vec![5.5]));
        assert_eq!(p[0].sampler, SamplerKind::parse("dpm++_2m_k"));
        assert_eq!(p[1].seed, Some(SeedChoice::Random));
        assert_eq!(p[1].size, SizeChoice::Default);
        assert_eq!(p[1].sampler, Some(SamplerKind::EulerAncestral));
        let bad = parse_list(&[json!({"prompt": "x", "noise_scheduler": "UNIPC"})]);
        assert!(bad.unwrap_err().contains("UNIPC"));
        assert!(!is_onetrainer_list(&[json!({"prompt": "x", "scale": 7})]));
    }
}
