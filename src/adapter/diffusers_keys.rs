//! LoRA files in diffusers' own layouts, read beside kohya's: what diffusers' training scripts
//! (`train_text_to_image_lora.py`, `train_dreambooth_lora_sdxl.py`, …) and pipelines'
//! `save_lora_weights` write, `pytorch_lora_weights.safetensors`.
//!
//! A key is `<component>.<module path>.<pair key>`, the component `unet`, `text_encoder` or
//! `text_encoder_2` (diffusers' pipeline attribute names) and the module path the diffusers or
//! transformers one (`down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q`,
//! `text_model.encoder.layers.0.self_attn.q_proj`). The pair key is one of:
//! - PEFT's `lora_A.weight` (down) and `lora_B.weight` (up), what diffusers reads natively;
//! - `lora.down.weight` / `lora.up.weight` and, for text encoders,
//!   `lora_linear_layer.down.weight` / `lora_linear_layer.up.weight`: what diffusers'
//!   `convert_state_dict_to_diffusers` turns PEFT's keys into before its scripts save;
//! - the attention processors of diffusers 0.14–0.16: `<attention>.processor.to_q_lora.down.weight`
//!   for `<attention>.to_q` (`to_k`, `to_v`; `to_out_lora` for `to_out.0`).
//!
//! The module keeps the dotted `<component>.<path>` as its name; [`super::kohya_names`] resolves
//! it as an alias of the layer's kohya name. An `<component>.<path>.alpha` key is read as kohya's
//! alpha. Without one the scale is 1 (alpha = rank), which is what diffusers applies to these
//! files unless their header's `lora_adapter_metadata` (diffusers ≥ 0.34 writes PEFT's
//! `LoraConfig` there, under the same component prefixes) gives `lora_alpha`:
//! [`metadata_alphas`] turns that into kohya's alpha per module.

use std::collections::HashMap;

use super::factors::{DOWN, UP};

/// diffusers' pipeline attribute names of the components a LoRA may adapt.
pub const COMPONENT_PREFIXES: [&str; 3] = ["unet", "text_encoder", "text_encoder_2"];

/// diffusers' and PEFT's spellings of a LoRA pair's keys, with the kohya key each stands for.
const PAIR_KEYS: [(&str, &str); 6] = [
    ("lora_A.weight", DOWN),
    ("lora_B.weight", UP),
    ("lora.down.weight", DOWN),
    ("lora.up.weight", UP),
    ("lora_linear_layer.down.weight", DOWN),
    ("lora_linear_layer.up.weight", UP),
];

/// The attention processors' projections (diffusers 0.14–0.16) and the module each adapts.
const PROCESSOR_PROJECTIONS: [(&str, &str); 4] = [
    ("to_q_lora", "to_q"),
    ("to_k_lora", "to_k"),
    ("to_v_lora", "to_v"),
    ("to_out_lora", "to_out.0"),
];

/// The component prefix `key` starts with (`unet.`, …), if any.
fn component_of(key: &str) -> Option<&'static str> {
    COMPONENT_PREFIXES
        .iter()
        .copied()
        .find(|p| key.strip_prefix(p).is_some_and(|r| r.starts_with('.')))
}

/// The module (`<component>.<path>`) and kohya key (`lora_down.weight` or `lora_up.weight`) of
/// a key in one of diffusers' layouts; `None` for any other key.
pub fn diffusers_key(key: &str) -> Option<(String, &'static str)> {
    component_of(key)?;
    for (suffix, kohya) in PAIR_KEYS {
        let Some(module) = key.strip_suffix(suffix).and_then(|m| m.strip_suffix('.')) else {
            continue;
        };
        // `<attention>.processor.to_q_lora` + `.down.weight` matches no pair key above; a
        // module path never holds `processor`.
        if !module.contains(".processor.") {
            return Some((module.to_string(), kohya));
        }
    }
    let (attention, rest) = key.split_once(".processor.")?;
    let (projection, half) = rest.split_once('.')?;
    let module = PROCESSOR_PROJECTIONS
        .iter()
        .find(|(p, _)| *p == projection)
        .map(|(_, m)| format!("{attention}.{m}"))?;
    match half {
        "down.weight" => Some((module, DOWN)),
        "up.weight" => Some((module, UP)),
        _ => None,
    }
}

/// PEFT's `LoraConfig` for one component, as diffusers writes it into `lora_adapter_metadata`.
#[derive(Debug, Default, Clone, PartialEq)]
struct ComponentConfig {
    lora_alpha: Option<f64>,
    alpha_pattern: Vec<(String, f64)>,
    use_rslora: bool,
}

impl ComponentConfig {
    /// The module's `lora_alpha`: the longest `alpha_pattern` key the path ends with (PEFT
    /// matches a pattern against the module name's tail), else the component's.
    fn alpha_of(&self, path: &str) -> Option<f64> {
        self.alpha_pattern
            .iter()
            .filter(|(pat, _)| path == pat || path.ends_with(&format!(".{pat}")))
            .max_by_key(|(pat, _)| pat.len())
            .map(|(_, a)| *a)
            .or(self.lora_alpha)
    }
}

/// The components' configs in a `lora_adapter_metadata` JSON object: keys `<component>.<field>`
/// (diffusers' `_pack_dict_with_prefix`); `Err` names what does not parse.
fn component_configs(json: &str) -> Result<HashMap<&'static str, ComponentConfig>, String> {
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("is not JSON: {e}"))?;
    let obj = v.as_object().ok_or("is not a JSON object")?;
    let mut out: HashMap<&'static str, ComponentConfig> = HashMap::new();
    for (k, val) in obj {
        let Some(component) = component_of(k) else {
            continue;
        };
        let field = &k[component.len() + 1..];
        let c = out.entry(component).or_default();
        match field {
            "lora_alpha" => {
                c.lora_alpha = Some(
                    val.as_f64()
                        .ok_or_else(|| format!("`{k}` is not a number: {val}"))?,
                )
            }
            "alpha_pattern" => {
                for (pat, a) in val.as_object().into_iter().flatten() {
                    let a = a
                        .as_f64()
                        .ok_or_else(|| format!("`{k}.{pat}` is not a number: {a}"))?;
                    c.alpha_pattern.push((pat.clone(), a));
                }
            }
            "use_rslora" => c.use_rslora = val.as_bool().unwrap_or(false),
            _ => {}
        }
    }
    Ok(out)
}

/// Kohya's alpha for each module of `modules` (`(name, rank)`, names `<component>.<path>`) from
/// the header's `lora_adapter_metadata`, where it gives the module's `lora_alpha`: PEFT's scale
/// is `lora_alpha / rank` (`/ √rank` with `use_rslora`), and kohya's `alpha / rank`, so the
/// alpha is `lora_alpha` (`lora_alpha · √rank`). `Err` when the metadata does not parse.
pub fn metadata_alphas(
    metadata: &HashMap<String, String>,
    modules: &[(&str, usize)],
) -> Result<HashMap<String, f32>, String> {
    let Some(json) = metadata.get("lora_adapter_metadata") else {
        return Ok(HashMap::new());
    };
    let configs = component_configs(json)?;
    let mut out = HashMap::new();
    for &(name, rank) in modules {
        let Some(component) = component_of(name) else {
            continue;
        };
        let Some(c) = configs.get(component) else {
            continue;
        };
        let path = &name[component.len() + 1..];
        if let Some(a) = c.alpha_of(path) {
            let alpha = if c.use_rslora {
                a * (rank as f64).sqrt()
            } else {
                a
            };
            out.insert(name.to_string(), alpha as f32);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every layout's key names the module and half; other keys (kohya's, a base weight's, a
    /// PEFT DoRA magnitude) are left to the kohya reader. Catches a down/up swap and a suffix
    /// stripped without its dot.
    #[test]
    fn each_layout_names_its_module_and_half() {
        let unet = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1";
        let te = "text_encoder.text_model.encoder.layers.0.self_attn.q_proj";
        let cases = [
            (
                format!("{unet}.to_q.lora_A.weight"),
                Some((format!("{unet}.to_q"), DOWN)),
            ),
            (
                format!("{unet}.to_q.lora_B.weight"),
                Some((format!("{unet}.to_q"), UP)),
            ),
            (
                format!("{unet}.to_out.0.lora.down.weight"),
                Some((format!("{unet}.to_out.0"), DOWN)),
            ),
            (
                format!("{unet}.to_k.lora.up.weight"),
                Some((format!("{unet}.to_k"), UP)),
            ),
            (
                format!("{te}.lora_linear_layer.down.weight"),
                Some((te.to_string(), DOWN)),
            ),
            (
                format!("text_encoder_2.{}.lora_linear_layer.up.weight", &te[13..]),
                Some((format!("text_encoder_2.{}", &te[13..]), UP)),
            ),
            (
                format!("{unet}.processor.to_out_lora.down.weight"),
                Some((format!("{unet}.to_out.0"), DOWN)),
            ),
            (
                format!("{unet}.processor.to_v_lora.up.weight"),
                Some((format!("{unet}.to_v"), UP)),
            ),
            (format!("{unet}.processor.to_x_lora.up.weight"), None),
            (format!("{unet}.to_q.lora_magnitude_vector"), None),
            ("lora_unet_x.lora_down.weight".to_string(), None),
            ("transformer.x.lora_A.weight".to_string(), None),
            ("unetx.a.lora_A.weight".to_string(), None),
        ];
        for (key, want) in cases {
            assert_eq!(diffusers_key(&key), want, "{key}");
        }
    }

    /// PEFT's alpha per module from diffusers' metadata: the component's, an `alpha_pattern`
    /// entry over it (the longest matching tail), √rank with rsLoRA, nothing for a component
    /// the metadata leaves out. Catches the pattern ignored and rsLoRA's √rank dropped.
    #[test]
    fn metadata_gives_each_module_its_lora_alpha() {
        let meta: HashMap<String, String> = [(
            "lora_adapter_metadata".to_string(),
            r#"{"unet.r": 4, "unet.lora_alpha": 8, "unet.alpha_pattern": {"attn1.to_q": 2,
                "to_q": 3}, "text_encoder.lora_alpha": 4, "text_encoder.use_rslora": true,
                "unet.target_modules": ["to_q", "to_k"]}"#
                .to_string(),
        )]
        .into();
        let modules = [
            ("unet.a.attn1.to_q", 4),
            ("unet.a.attn2.to_q", 4),
            ("unet.a.attn1.to_k", 4),
            ("text_encoder.text_model.q_proj", 16),
            ("text_encoder_2.text_model.q_proj", 4),
        ];
        let got = metadata_alphas(&meta, &modules).unwrap();
        assert_eq!(got["unet.a.attn1.to_q"], 2.0);
        assert_eq!(got["unet.a.attn2.to_q"], 3.0);
        assert_eq!(got["unet.a.attn1.to_k"], 8.0);
        assert_eq!(got["text_encoder.text_model.q_proj"], 16.0);
        assert!(!got.contains_key("text_encoder_2.text_model.q_proj"));
        assert!(metadata_alphas(&HashMap::new(), &modules)
            .unwrap()
            .is_empty());
        let bad: HashMap<String, String> =
            [("lora_adapter_metadata".to_string(), "{".to_string())].into();
        assert!(metadata_alphas(&bad, &modules).is_err());
    }
}
