//! kohya's adapter-file header: the base model ([`KohyaBase`]) and the `__metadata__` strings
//! ([`KohyaMetadata`]): kohya's `ss_*` keys (values formatted as Python's `str()` formats them,
//! since kohya writes `str(v)`) and the ModelSpec `modelspec.*` keys that kohya's
//! `library/sai_model_spec.py` writes for a LoRA. LyCORIS's kohya network writes the same keys,
//! with `ss_network_module = "lycoris.kohya"` and its `algo` in `ss_network_args`.

pub use crate::py_json::py_float;
use crate::py_json::{json_str, py_bool};
use std::collections::{BTreeMap, HashMap};

/// The base model a LoRA was trained on, as kohya records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KohyaBase {
    SdV1,
    SdV2,
    /// SD2 768-v (v-prediction).
    SdV2V,
    SdxlBase,
}

impl KohyaBase {
    /// `ss_base_model_version`.
    pub fn ss_name(self) -> &'static str {
        match self {
            KohyaBase::SdV1 => "sd_v1",
            KohyaBase::SdV2 => "sd_v2",
            KohyaBase::SdV2V => "sd_v2_v",
            KohyaBase::SdxlBase => "sdxl_base_v1-0",
        }
    }

    /// Parses an `ss_base_model_version` value (e.g. from `ModelFamily::kohya_base_model_version`).
    pub fn from_ss_name(name: &str) -> Option<Self> {
        [Self::SdV1, Self::SdV2, Self::SdV2V, Self::SdxlBase]
            .into_iter()
            .find(|b| b.ss_name() == name)
    }

    /// `modelspec.architecture` (kohya `sai_model_spec.determine_architecture`, lora=True).
    pub fn modelspec_architecture(self) -> &'static str {
        match self {
            KohyaBase::SdV1 => "stable-diffusion-v1/lora",
            KohyaBase::SdV2 => "stable-diffusion-v2-512/lora",
            KohyaBase::SdV2V => "stable-diffusion-v2-768-v/lora",
            KohyaBase::SdxlBase => "stable-diffusion-xl-v1-base/lora",
        }
    }

    /// `modelspec.implementation` (kohya `determine_implementation`: sgm for SDXL LoRAs).
    fn modelspec_implementation(self) -> &'static str {
        match self {
            KohyaBase::SdV1 | KohyaBase::SdV2 | KohyaBase::SdV2V => "diffusers",
            KohyaBase::SdxlBase => "https://github.com/Stability-AI/generative-models",
        }
    }

    fn is_v2(self) -> bool {
        match self {
            KohyaBase::SdV2 | KohyaBase::SdV2V => true,
            KohyaBase::SdV1 | KohyaBase::SdxlBase => false,
        }
    }

    fn is_v_prediction(self) -> bool {
        match self {
            KohyaBase::SdV2V => true,
            KohyaBase::SdV1 | KohyaBase::SdV2 | KohyaBase::SdxlBase => false,
        }
    }
}

/// What the header records about the training run.
#[derive(Debug, Clone, PartialEq)]
pub struct KohyaMetadata {
    pub base: KohyaBase,
    /// `ss_network_module`, "networks.lora" for LoRA and kohya-style LoCon.
    pub network_module: String,
    /// Rank (`ss_network_dim`).
    pub network_dim: usize,
    pub network_alpha: f64,
    /// `ss_network_args`, in order, e.g. `[("conv_dim", "4"), ("conv_alpha", "1")]` for LoCon;
    /// written as a JSON object (`{}` when empty).
    pub network_args: Vec<(String, String)>,
    pub learning_rate: f64,
    pub unet_lr: Option<f64>,
    pub text_encoder_lr: Option<f64>,
    pub steps: u64,
    pub epoch: u64,
    pub num_train_images: u64,
    /// (width, height), written `(512, 512)`.
    pub resolution: (u32, u32),
    pub seed: u64,
    /// e.g. `torch.optim.adamw.AdamW(weight_decay=0.01)` in kohya's files; free text.
    pub optimizer: String,
    pub output_name: String,
    /// Unix time in seconds (kohya: `time.time()`).
    pub training_started_at: f64,
    /// kohya's `--no_metadata`: only the keys loaders need ([`MINIMUM_KEYS`]) and ModelSpec's.
    pub minimal: bool,
    /// Further header entries, written last (they may override the ones above).
    pub extra: BTreeMap<String, String>,
}

/// kohya's `SS_METADATA_MINIMUM_KEYS`: what `--no_metadata` keeps.
pub const MINIMUM_KEYS: [&str; 6] = [
    "ss_v2",
    "ss_base_model_version",
    "ss_network_module",
    "ss_network_dim",
    "ss_network_alpha",
    "ss_network_args",
];

impl KohyaMetadata {
    /// The minimum header of a file a tool wrote rather than a run trained (kohya's
    /// `build_minimum_network_metadata` with ModelSpec's keys, as its extract and merge scripts
    /// write): the network's module, rank, alpha and arguments, titled `output_name`, stamped now.
    pub fn tool_written(
        base: KohyaBase,
        network_dim: usize,
        network_alpha: f64,
        output_name: String,
        resolution: (u32, u32),
    ) -> Self {
        Self {
            base,
            network_module: "networks.lora".to_string(),
            network_dim,
            network_alpha,
            network_args: Vec::new(),
            learning_rate: 0.0,
            unet_lr: None,
            text_encoder_lr: None,
            steps: 0,
            epoch: 0,
            num_train_images: 0,
            resolution,
            seed: 0,
            optimizer: String::new(),
            output_name,
            training_started_at: unix_now(),
            minimal: true,
            extra: Default::default(),
        }
    }

    /// The `__metadata__` map written to the file.
    pub fn to_header(&self) -> HashMap<String, String> {
        let py_opt = |v: Option<f64>| v.map_or_else(|| "None".to_string(), py_float);
        let args = self
            .network_args
            .iter()
            .map(|(k, v)| format!("{}: {}", json_str(k), json_str(v)))
            .collect::<Vec<_>>()
            .join(", ");
        let (w, h) = self.resolution;
        let started = self.training_started_at;
        let date = chrono::DateTime::from_timestamp(started.floor() as i64, 0)
            .map(|d| d.format("%Y-%m-%dT%H:%M:%S").to_string())
            .unwrap_or_default();
        let prediction = if self.base.is_v_prediction() {
            "v"
        } else {
            "epsilon"
        };
        let mut m: HashMap<String, String> = [
            ("ss_network_module", self.network_module.clone()),
            ("ss_network_dim", self.network_dim.to_string()),
            ("ss_network_alpha", py_float(self.network_alpha)),
            ("ss_network_args", format!("{{{args}}}")),
            ("ss_base_model_version", self.base.ss_name().to_string()),
            ("ss_v2", py_bool(self.base.is_v2())),
            ("ss_learning_rate", py_float(self.learning_rate)),
            ("ss_unet_lr", py_opt(self.unet_lr)),
            ("ss_text_encoder_lr", py_opt(self.text_encoder_lr)),
            ("ss_steps", self.steps.to_string()),
            ("ss_epoch", self.epoch.to_string()),
            ("ss_num_train_images", self.num_train_images.to_string()),
            ("ss_resolution", format!("({w}, {h})")),
            ("ss_seed", self.seed.to_string()),
            ("ss_optimizer", self.optimizer.clone()),
            ("ss_output_name", self.output_name.clone()),
            ("ss_training_started_at", py_float(started)),
            ("modelspec.sai_model_spec", "1.0.1".to_string()),
            (
                "modelspec.architecture",
                self.base.modelspec_architecture().to_string(),
            ),
            (
                "modelspec.implementation",
                self.base.modelspec_implementation().to_string(),
            ),
            ("modelspec.title", self.output_name.clone()),
            ("modelspec.resolution", format!("{w}x{h}")),
            ("modelspec.prediction_type", prediction.to_string()),
            ("modelspec.date", date),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        m.extend(self.extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        if self.minimal {
            m.retain(|k, _| !k.starts_with("ss_") || MINIMUM_KEYS.contains(&k.as_str()));
        }
        m
    }
}

/// Seconds since the Unix epoch, as kohya's `time.time()` stamps its files.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float_formatting() {
        for (v, want) in [
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (5e-6, "5e-06"),
            (1.0, "1.0"),
            (4.0, "4.0"),
            (0.5, "0.5"),
            (1.5e-5, "1.5e-05"),
            (1700000000.25, "1700000000.25"),
            (1e16, "1e+16"),
            (123.0, "123.0"),
            (0.0, "0.0"),
        ] {
            assert_eq!(py_float(v), want, "{v}");
        }
    }

    #[test]
    fn json_args_match_python_json_dumps() {
        assert_eq!(json_str("conv_dim"), "\"conv_dim\"");
        assert_eq!(json_str("a\"b\\é"), "\"a\\\"b\\\\\\u00e9\"");
    }

    #[test]
    fn metadata_header_has_kohya_keys() {
        let m = KohyaMetadata {
            base: KohyaBase::SdV2V,
            network_module: "networks.lora".into(),
            network_dim: 8,
            network_alpha: 4.0,
            network_args: vec![
                ("conv_dim".into(), "4".into()),
                ("conv_alpha".into(), "1".into()),
            ],
            learning_rate: 1e-4,
            unet_lr: Some(1e-4),
            text_encoder_lr: None,
            steps: 100,
            epoch: 2,
            num_train_images: 10,
            resolution: (768, 768),
            seed: 42,
            optimizer: "torch.optim.adamw.AdamW".into(),
            output_name: "my_lora".into(),
            training_started_at: 1700000000.5,
            minimal: false,
            extra: BTreeMap::new(),
        };
        let h = m.to_header();
        assert_eq!(
            h["ss_network_args"],
            r#"{"conv_dim": "4", "conv_alpha": "1"}"#
        );
        assert_eq!(h["ss_network_alpha"], "4.0");
        assert_eq!(h["ss_v2"], "True");
        assert_eq!(h["ss_base_model_version"], "sd_v2_v");
        assert_eq!(h["ss_resolution"], "(768, 768)");
        assert_eq!(h["ss_text_encoder_lr"], "None");
        assert_eq!(h["ss_training_started_at"], "1700000000.5");
        assert_eq!(
            h["modelspec.architecture"],
            "stable-diffusion-v2-768-v/lora"
        );
        assert_eq!(h["modelspec.prediction_type"], "v");
        assert_eq!(h["modelspec.date"], "2023-11-14T22:13:20");
        let parsed: serde_json::Value = serde_json::from_str(&h["ss_network_args"]).unwrap();
        assert_eq!(parsed["conv_dim"], "4");
        assert_eq!(
            KohyaBase::from_ss_name("sdxl_base_v1-0"),
            Some(KohyaBase::SdxlBase)
        );
    }
}
