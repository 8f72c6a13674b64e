//! Model family and prediction type, detected from a pipeline's parsed configs. Pure: the
//! configs are read by [`ModelLayout`](super::layout::ModelLayout) (a diffusers folder) or come
//! from a single file's metadata or tensor shapes.
//!
//! Detection reads only what distinguishes the families, never the architecture itself (each
//! model builds from its own `config.json`):
//! - SDXL: `model_index.json` lists `text_encoder_2`, or the UNet config has
//!   `addition_embed_type: "text_time"` (stabilityai/stable-diffusion-xl-base-1.0).
//! - SD2 vs SD1: the text encoder's `hidden_act`: OpenCLIP ViT-H uses `gelu`
//!   (stabilityai/stable-diffusion-2-1), OpenAI CLIP ViT-L uses `quick_gelu`
//!   (runwayml/stable-diffusion-v1-5). When that is missing or unknown, the UNet decides:
//!   `cross_attention_dim` 1024 vs 768, then `use_linear_projection` (true only in SD2).
//! - Prediction type: `scheduler/scheduler_config.json` `prediction_type`, epsilon when absent.
//! - Native resolution: UNet `sample_size` × 2^(len(VAE `block_out_channels`) − 1), the VAE's
//!   downsampling factor (64 × 8 = 512 for SD1.5, 128 × 8 = 1024 for SDXL).
//!
//! [`FamilyError`] is also the error of reading a layout: what the model is cannot be told
//! when its files are missing or unreadable.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::files::{self, Component, FilesError};
use super::single_file::SingleFileError;

#[derive(Debug, thiserror::Error)]
pub enum FamilyError {
    #[error("{} has no model_index.json: not a diffusers pipeline folder", dir.display())]
    NotAPipeline { dir: PathBuf },
    #[error(
        "cannot tell SD1 from SD2: {text_encoder} has no known `hidden_act` (quick_gelu or gelu) \
         and {unet} has neither `cross_attention_dim` 768/1024 nor `use_linear_projection`"
    )]
    Undetectable { text_encoder: String, unet: String },
    #[error(
        "{}: `prediction_type` is \"{value}\"; sdtrain supports \"epsilon\" and \"v_prediction\"",
        file.display()
    )]
    UnsupportedPrediction { file: PathBuf, value: String },
    #[error("{}: `{field}` {problem}", file.display())]
    BadField {
        file: PathBuf,
        field: &'static str,
        problem: &'static str,
    },
    #[error(
        "{}: the UNet takes {unet_in} and gives {unet_out} channels, but the VAE's latents have \
         {latent} (`latent_channels` in {}): an inpainting, depth or other conditioned UNet (extra \
         input channels) is not a model sdtrain trains; use the base text-to-image model",
        unet_file.display(),
        vae_file.display()
    )]
    LatentChannels {
        unet_file: PathBuf,
        vae_file: PathBuf,
        unet_in: u64,
        unet_out: u64,
        latent: u64,
    },
    #[error(transparent)]
    Files(#[from] FilesError),
    #[error(transparent)]
    SingleFile(Box<SingleFileError>),
    #[error(
        "{}: `{option}` applies to single-file checkpoints; a diffusers folder's own configs \
         decide (edit them instead)",
        dir.display()
    )]
    SingleFileOption { dir: PathBuf, option: &'static str },
    #[error(
        "{}: variant `{variant}` names weight files of a diffusers folder; a single file is read \
         as it is (leave `variant` out)",
        file.display()
    )]
    VariantOfSingleFile { file: PathBuf, variant: String },
}

impl From<SingleFileError> for FamilyError {
    fn from(e: SingleFileError) -> Self {
        FamilyError::SingleFile(Box::new(e))
    }
}

impl FamilyError {
    /// True when the model the user pointed at is invalid or unsupported (exit code 2), false when
    /// reading it failed.
    pub fn is_usage(&self) -> bool {
        match self {
            FamilyError::Files(e) => e.is_usage(),
            FamilyError::SingleFile(e) => e.is_usage(),
            FamilyError::SingleFileOption { .. }
            | FamilyError::VariantOfSingleFile { .. }
            | FamilyError::NotAPipeline { .. }
            | FamilyError::Undetectable { .. }
            | FamilyError::UnsupportedPrediction { .. }
            | FamilyError::LatentChannels { .. }
            | FamilyError::BadField { .. } => true,
        }
    }

    /// True when a component holds only pickle checkpoints ([`FilesError::is_pickle_only`]).
    pub fn is_pickle_only(&self) -> bool {
        matches!(self, FamilyError::Files(e) if e.is_pickle_only())
    }

    /// True when files are absent (a partial hub download), as opposed to present but unusable.
    pub fn is_incomplete(&self) -> bool {
        match self {
            FamilyError::Files(e) => e.is_incomplete(),
            FamilyError::NotAPipeline { .. } => true,
            FamilyError::SingleFile(_)
            | FamilyError::SingleFileOption { .. }
            | FamilyError::VariantOfSingleFile { .. }
            | FamilyError::Undetectable { .. }
            | FamilyError::UnsupportedPrediction { .. }
            | FamilyError::LatentChannels { .. }
            | FamilyError::BadField { .. } => false,
        }
    }
}

/// The Stable Diffusion generation a pipeline belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelFamily {
    /// SD 1.x: OpenAI CLIP ViT-L/14 text encoder, 512 px.
    Sd1,
    /// SD 2.x: OpenCLIP ViT-H/14 text encoder, 512 px (base) or 768 px (v models).
    Sd2,
    /// SDXL: CLIP ViT-L + OpenCLIP ViT-bigG, micro-conditioning on sizes and crops, 1024 px.
    Sdxl,
}

impl ModelFamily {
    pub fn name(self) -> &'static str {
        match self {
            ModelFamily::Sd1 => "SD1",
            ModelFamily::Sd2 => "SD2",
            ModelFamily::Sdxl => "SDXL",
        }
    }

    /// Whether the pipeline has `text_encoder_2` (and `tokenizer_2`).
    pub fn has_second_text_encoder(self) -> bool {
        match self {
            ModelFamily::Sd1 | ModelFamily::Sd2 => false,
            ModelFamily::Sdxl => true,
        }
    }

    /// Whether the UNet takes SDXL's added conditions: the pooled text embedding and the
    /// `time_ids` (original size, crop top-left, target size).
    pub fn uses_added_conditions(self) -> bool {
        match self {
            ModelFamily::Sd1 | ModelFamily::Sd2 => false,
            ModelFamily::Sdxl => true,
        }
    }

    /// The weight-bearing components a pipeline of this family must have.
    pub fn components(self) -> &'static [Component] {
        match self {
            ModelFamily::Sd1 | ModelFamily::Sd2 => {
                &[Component::Unet, Component::Vae, Component::TextEncoder]
            }
            ModelFamily::Sdxl => &Component::ALL,
        }
    }

    /// The `ss_base_model_version` value kohya writes into LoRA metadata.
    pub fn kohya_base_model_version(self, prediction: PredictionType) -> &'static str {
        match (self, prediction) {
            (ModelFamily::Sd1, PredictionType::Epsilon | PredictionType::VPrediction) => "sd_v1",
            (ModelFamily::Sd2, PredictionType::Epsilon) => "sd_v2",
            (ModelFamily::Sd2, PredictionType::VPrediction) => "sd_v2_v",
            (ModelFamily::Sdxl, PredictionType::Epsilon | PredictionType::VPrediction) => {
                "sdxl_base_v1-0"
            }
        }
    }
}

impl std::fmt::Display for ModelFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What the UNet is trained to predict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PredictionType {
    /// The added noise ε.
    Epsilon,
    /// v = α_t·ε − σ_t·x₀ (Salimans & Ho, arXiv 2202.00512).
    VPrediction,
}

impl PredictionType {
    /// The name diffusers uses in `scheduler_config.json`.
    pub fn name(self) -> &'static str {
        match self {
            PredictionType::Epsilon => "epsilon",
            PredictionType::VPrediction => "v_prediction",
        }
    }

    /// Reads `prediction_type` from a scheduler config (`file` names it in errors).
    pub fn from_scheduler_config(config: &Value, file: &Path) -> Result<Self, FamilyError> {
        match config.get("prediction_type") {
            None | Some(Value::Null) => Ok(PredictionType::Epsilon),
            Some(Value::String(s)) if s == "epsilon" => Ok(PredictionType::Epsilon),
            Some(Value::String(s)) if s == "v_prediction" => Ok(PredictionType::VPrediction),
            Some(Value::String(s)) => Err(FamilyError::UnsupportedPrediction {
                file: file.to_path_buf(),
                value: s.clone(),
            }),
            Some(_) => Err(FamilyError::BadField {
                file: file.to_path_buf(),
                field: "prediction_type",
                problem: "is not a string",
            }),
        }
    }
}

impl std::fmt::Display for PredictionType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The parsed configs family detection looks at.
pub struct Configs<'a> {
    pub model_index: &'a Value,
    pub unet: &'a Value,
    /// `text_encoder/config.json`, when the pipeline has one.
    pub text_encoder: Option<&'a Value>,
}

/// Detects the family from the configs, by the rules in the module header.
pub fn detect_family(configs: &Configs<'_>) -> Result<ModelFamily, FamilyError> {
    let lists_second_encoder =
        files::listed_components(configs.model_index).contains(Component::TextEncoder2.folder());
    let text_time = configs
        .unet
        .get("addition_embed_type")
        .and_then(Value::as_str)
        == Some("text_time");
    if lists_second_encoder || text_time {
        return Ok(ModelFamily::Sdxl);
    }
    let act = configs
        .text_encoder
        .and_then(|te| te.get("hidden_act"))
        .and_then(Value::as_str);
    match act {
        Some("quick_gelu") => return Ok(ModelFamily::Sd1),
        Some("gelu") => return Ok(ModelFamily::Sd2),
        _ => {}
    }
    match configs
        .unet
        .get("cross_attention_dim")
        .and_then(Value::as_u64)
    {
        Some(1024) => return Ok(ModelFamily::Sd2),
        Some(768) => return Ok(ModelFamily::Sd1),
        _ => {}
    }
    match configs
        .unet
        .get("use_linear_projection")
        .and_then(Value::as_bool)
    {
        Some(true) => Ok(ModelFamily::Sd2),
        Some(false) => Ok(ModelFamily::Sd1),
        None => Err(FamilyError::Undetectable {
            text_encoder: "text_encoder/config.json".to_string(),
            unet: "unet/config.json".to_string(),
        }),
    }
}

/// UNet `sample_size` × the VAE's downsampling factor, in pixels.
pub fn native_resolution(
    unet: &Value,
    unet_file: &Path,
    vae: &Value,
    vae_file: &Path,
) -> Result<usize, FamilyError> {
    let sample_size = match unet.get("sample_size") {
        Some(Value::Number(n)) => n.as_u64(),
        // Some configs store [h, w]; the trainer buckets around a square base resolution.
        Some(Value::Array(a)) => a.first().and_then(Value::as_u64),
        _ => None,
    }
    .filter(|&s| s > 0)
    .ok_or_else(|| FamilyError::BadField {
        file: unet_file.to_path_buf(),
        field: "sample_size",
        problem: "is missing or not a positive integer",
    })?;
    let levels = vae
        .get("block_out_channels")
        .and_then(Value::as_array)
        .map(Vec::len)
        .filter(|&n| (1..=8).contains(&n))
        .ok_or_else(|| FamilyError::BadField {
            file: vae_file.to_path_buf(),
            field: "block_out_channels",
            problem: "is missing or not a list of 1 to 8 entries",
        })?;
    // Bounded as train.json's `resolution` is: the native resolution is the default training
    // and sampling size, and 2^40 pixels aborted the first allocation.
    let pixels = (sample_size as usize).saturating_mul(1usize << (levels - 1));
    if pixels > MAX_NATIVE_RESOLUTION {
        return Err(FamilyError::BadField {
            file: unet_file.to_path_buf(),
            field: "sample_size",
            problem: "times the VAE's downsampling is over 4096 pixels, the largest native \
                      resolution sdtrain accepts",
        });
    }
    Ok(pixels)
}

/// The largest native resolution, in pixels per side: train.json's largest `resolution`.
pub const MAX_NATIVE_RESOLUTION: usize = 4096;

/// Refuses a UNet whose input or output channels are not the VAE's latent channels (diffusers'
/// defaults: 4 each): an inpainting UNet takes 9 (latents, mask, masked image), a depth UNet 5.
/// sdtrain feeds the UNet noisy latents alone, so such a model would fail at its first step.
pub fn check_latent_channels(
    unet: &Value,
    unet_file: &Path,
    vae: &Value,
    vae_file: &Path,
) -> Result<(), FamilyError> {
    let channels = |config: &Value, file: &Path, field: &'static str| match config.get(field) {
        None | Some(Value::Null) => Ok(4),
        Some(v) => v.as_u64().filter(|&n| n > 0).ok_or(FamilyError::BadField {
            file: file.to_path_buf(),
            field,
            problem: "is not a positive integer",
        }),
    };
    let unet_in = channels(unet, unet_file, "in_channels")?;
    let unet_out = channels(unet, unet_file, "out_channels")?;
    let latent = channels(vae, vae_file, "latent_channels")?;
    if unet_in == latent && unet_out == latent {
        return Ok(());
    }
    Err(FamilyError::LatentChannels {
        unet_file: unet_file.to_path_buf(),
        vae_file: vae_file.to_path_buf(),
        unet_in,
        unet_out,
        latent,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    // Trimmed from runwayml/stable-diffusion-v1-5 (model_index.json, unet/config.json,
    // text_encoder/config.json, scheduler/scheduler_config.json).
    fn sd15() -> (Value, Value, Value, Value) {
        (
            json!({
                "_class_name": "StableDiffusionPipeline",
                "feature_extractor": ["transformers", "CLIPImageProcessor"],
                "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
                "scheduler": ["diffusers", "PNDMScheduler"],
                "text_encoder": ["transformers", "CLIPTextModel"],
                "tokenizer": ["transformers", "CLIPTokenizer"],
                "unet": ["diffusers", "UNet2DConditionModel"],
                "vae": ["diffusers", "AutoencoderKL"]
            }),
            json!({
                "_class_name": "UNet2DConditionModel",
                "attention_head_dim": 8,
                "block_out_channels": [320, 640, 1280, 1280],
                "cross_attention_dim": 768,
                "sample_size": 64
            }),
            json!({
                "architectures": ["CLIPTextModel"],
                "hidden_act": "quick_gelu",
                "hidden_size": 768,
                "num_hidden_layers": 12
            }),
            json!({
                "_class_name": "PNDMScheduler",
                "beta_schedule": "scaled_linear",
                "num_train_timesteps": 1000,
                "skip_prk_steps": true
            }),
        )
    }

    // Trimmed from stabilityai/stable-diffusion-2-1 (768 px, v-prediction).
    fn sd21v() -> (Value, Value, Value, Value) {
        (
            json!({
                "_class_name": "StableDiffusionPipeline",
                "feature_extractor": ["transformers", "CLIPImageProcessor"],
                "requires_safety_checker": false,
                "safety_checker": [null, null],
                "scheduler": ["diffusers", "DDIMScheduler"],
                "text_encoder": ["transformers", "CLIPTextModel"],
                "tokenizer": ["transformers", "CLIPTokenizer"],
                "unet": ["diffusers", "UNet2DConditionModel"],
                "vae": ["diffusers", "AutoencoderKL"]
            }),
            json!({
                "_class_name": "UNet2DConditionModel",
                "attention_head_dim": [5, 10, 20, 20],
                "cross_attention_dim": 1024,
                "sample_size": 96,
                "upcast_attention": true,
                "use_linear_projection": true
            }),
            json!({
                "architectures": ["CLIPTextModel"],
                "hidden_act": "gelu",
                "hidden_size": 1024,
                "num_hidden_layers": 23
            }),
            json!({
                "_class_name": "DDIMScheduler",
                "prediction_type": "v_prediction",
                "num_train_timesteps": 1000
            }),
        )
    }

    // Trimmed from stabilityai/stable-diffusion-xl-base-1.0.
    fn sdxl() -> (Value, Value, Value, Value) {
        (
            json!({
                "_class_name": "StableDiffusionXLPipeline",
                "force_zeros_for_empty_prompt": true,
                "scheduler": ["diffusers", "EulerDiscreteScheduler"],
                "text_encoder": ["transformers", "CLIPTextModel"],
                "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
                "tokenizer": ["transformers", "CLIPTokenizer"],
                "tokenizer_2": ["transformers", "CLIPTokenizer"],
                "unet": ["diffusers", "UNet2DConditionModel"],
                "vae": ["diffusers", "AutoencoderKL"]
            }),
            json!({
                "_class_name": "UNet2DConditionModel",
                "addition_embed_type": "text_time",
                "addition_time_embed_dim": 256,
                "cross_attention_dim": 2048,
                "projection_class_embeddings_input_dim": 2816,
                "sample_size": 128,
                "use_linear_projection": true
            }),
            json!({
                "architectures": ["CLIPTextModel"],
                "hidden_act": "quick_gelu",
                "hidden_size": 768
            }),
            json!({
                "_class_name": "EulerDiscreteScheduler",
                "prediction_type": "epsilon",
                "num_train_timesteps": 1000
            }),
        )
    }

    fn detect(m: &(Value, Value, Value, Value)) -> ModelFamily {
        detect_family(&Configs {
            model_index: &m.0,
            unet: &m.1,
            text_encoder: Some(&m.2),
        })
        .unwrap()
    }

    fn prediction(m: &(Value, Value, Value, Value)) -> PredictionType {
        PredictionType::from_scheduler_config(&m.3, Path::new("s.json")).unwrap()
    }

    #[test]
    fn detects_sd15_epsilon() {
        let m = sd15();
        assert_eq!(detect(&m), ModelFamily::Sd1);
        assert_eq!(prediction(&m), PredictionType::Epsilon);
    }

    #[test]
    fn detects_sd21_v_prediction() {
        let m = sd21v();
        assert_eq!(detect(&m), ModelFamily::Sd2);
        assert_eq!(prediction(&m), PredictionType::VPrediction);
    }

    #[test]
    fn detects_sdxl_from_the_index_or_the_unet() {
        let m = sdxl();
        assert_eq!(detect(&m), ModelFamily::Sdxl);
        assert_eq!(prediction(&m), PredictionType::Epsilon);
        // A refiner-like index without text_encoder_2 is still SDXL through the UNet.
        let unet_only = detect_family(&Configs {
            model_index: &json!({}),
            unet: &m.1,
            text_encoder: None,
        });
        assert_eq!(unet_only.unwrap(), ModelFamily::Sdxl);
    }

    #[test]
    fn falls_back_on_the_unet_without_a_known_activation() {
        let (idx, unet, _, _) = sd21v();
        let te = json!({"hidden_act": "silu"});
        let family = detect_family(&Configs {
            model_index: &idx,
            unet: &unet,
            text_encoder: Some(&te),
        });
        assert_eq!(family.unwrap(), ModelFamily::Sd2);
        let (idx, unet, _, _) = sd15();
        let family = detect_family(&Configs {
            model_index: &idx,
            unet: &unet,
            text_encoder: None,
        });
        assert_eq!(family.unwrap(), ModelFamily::Sd1);
        let unet = json!({"use_linear_projection": true, "cross_attention_dim": 32});
        let family = detect_family(&Configs {
            model_index: &idx,
            unet: &unet,
            text_encoder: None,
        });
        assert_eq!(family.unwrap(), ModelFamily::Sd2);
        let unet = json!({"cross_attention_dim": 32});
        let err = detect_family(&Configs {
            model_index: &idx,
            unet: &unet,
            text_encoder: None,
        });
        assert!(matches!(err, Err(FamilyError::Undetectable { .. })));
    }

    #[test]
    fn sample_prediction_is_refused() {
        let err = PredictionType::from_scheduler_config(
            &json!({"prediction_type": "sample"}),
            Path::new("scheduler/scheduler_config.json"),
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("scheduler/scheduler_config.json"), "{msg}");
        assert!(msg.contains("\"sample\""), "{msg}");
    }

    #[test]
    fn missing_prediction_type_means_epsilon() {
        assert_eq!(prediction(&sd15()), PredictionType::Epsilon);
    }

    #[test]
    fn native_resolution_is_sample_size_times_vae_factor() {
        let vae = json!({"block_out_channels": [128, 256, 512, 512]});
        let p = Path::new("c.json");
        assert_eq!(native_resolution(&sd15().1, p, &vae, p).unwrap(), 512);
        assert_eq!(native_resolution(&sd21v().1, p, &vae, p).unwrap(), 768);
        assert_eq!(native_resolution(&sdxl().1, p, &vae, p).unwrap(), 1024);
        assert!(native_resolution(&json!({}), p, &vae, p).is_err());
    }

    #[test]
    fn kohya_versions() {
        assert_eq!(
            ModelFamily::Sd2.kohya_base_model_version(PredictionType::VPrediction),
            "sd_v2_v"
        );
        assert_eq!(
            ModelFamily::Sdxl.kohya_base_model_version(PredictionType::Epsilon),
            "sdxl_base_v1-0"
        );
    }

    /// A VAE whose `latent_channels` differ from the UNet's channels names both files: the
    /// error named only the UNet's config when the VAE's was the one changed.
    #[test]
    fn latent_channel_mismatch_names_both_configs() {
        let unet = json!({"in_channels": 4, "out_channels": 4});
        let vae = json!({"latent_channels": 16});
        let e = check_latent_channels(
            &unet,
            Path::new("m/unet/config.json"),
            &vae,
            Path::new("m/vae/config.json"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("m/unet/config.json")
                && e.contains("`latent_channels` in m/vae/config.json"),
            "{e}"
        );
    }

    /// A UNet `sample_size` of 65536 made a 131072-pixel native resolution, the default
    /// training size, and the first step aborted allocating 51 GB. It is refused naming the
    /// file and key; SDXL's 128 × 8 passes.
    #[test]
    fn a_native_resolution_past_4096_names_sample_size() {
        let vae = json!({"block_out_channels": [128, 256, 512, 512]});
        let (u, v) = (
            Path::new("m/unet/config.json"),
            Path::new("m/vae/config.json"),
        );
        assert_eq!(
            native_resolution(&json!({"sample_size": 128}), u, &vae, v).unwrap(),
            1024
        );
        for big in [json!(65536), json!(u64::MAX)] {
            let e = native_resolution(&json!({"sample_size": big}), u, &vae, v)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("m/unet/config.json") && e.contains("`sample_size`"),
                "{e}"
            );
        }
    }
}
