//! Model family and prediction type, detected from a pipeline's configs, and [`ModelLayout`]:
//! everything sdtrain reads from a diffusers pipeline folder, gathered in one place.
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

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use super::files::{
    self, BuiltinTokenizer, Component, ComponentFiles, FilesError, TokenizerFiles, MODEL_INDEX,
    SCHEDULER_CONFIG,
};
use super::single_file::{SingleFile, SingleFileError, SingleFileOptions, TokenizerSource};

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
            | FamilyError::NotAPipeline { .. }
            | FamilyError::Undetectable { .. }
            | FamilyError::UnsupportedPrediction { .. }
            | FamilyError::BadField { .. } => true,
        }
    }

    /// True when files are absent (a partial hub download), as opposed to present but unusable.
    pub fn is_incomplete(&self) -> bool {
        match self {
            FamilyError::Files(e) => e.is_incomplete(),
            FamilyError::NotAPipeline { .. } => true,
            FamilyError::SingleFile(_)
            | FamilyError::SingleFileOption { .. }
            | FamilyError::Undetectable { .. }
            | FamilyError::UnsupportedPrediction { .. }
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
    Ok(sample_size as usize * (1usize << (levels - 1)))
}

/// Everything sdtrain reads from a diffusers pipeline folder: what the model is, and the files.
#[derive(Debug, Clone)]
pub struct ModelLayout {
    pub root: PathBuf,
    pub family: ModelFamily,
    pub prediction_type: PredictionType,
    /// Square side in pixels the model was trained at.
    pub native_resolution: usize,
    pub model_index: PathBuf,
    pub scheduler_config: PathBuf,
    /// The family's components, in [`Component::ALL`] order.
    pub components: Vec<ComponentFiles>,
    /// One entry per text encoder, in the same order.
    pub tokenizers: Vec<TokenizerFiles>,
    /// Set when the model is a single-file checkpoint; `root`, `model_index`,
    /// `scheduler_config` and every component's `config`/`weights` are then the file itself.
    pub single_file: Option<Arc<SingleFile>>,
}

impl ModelLayout {
    /// Reads the pipeline folder `root`, choosing weights by the rules in [`files`] (`variant`,
    /// e.g. `fp16`, prefers those files where present).
    pub fn read(root: &Path, variant: Option<&str>) -> Result<Self, FamilyError> {
        Self::read_with(root, variant, &SingleFileOptions::default())
    }

    /// As [`ModelLayout::read`]; `root` may also be a single-file checkpoint, opened with
    /// `single` (options that are an error for a folder).
    pub fn read_with(
        root: &Path,
        variant: Option<&str>,
        single: &SingleFileOptions,
    ) -> Result<Self, FamilyError> {
        if root.is_file() {
            return Self::from_single_file(SingleFile::open(root, single)?);
        }
        let option = if single.model_config.is_some() {
            Some("model_config")
        } else if single.prediction_type.is_some() {
            Some("prediction_type")
        } else {
            None
        };
        if let Some(option) = option {
            return Err(FamilyError::SingleFileOption {
                dir: root.to_path_buf(),
                option,
            });
        }
        files::check_variant(variant)?;
        let model_index = root.join(MODEL_INDEX);
        if !model_index.is_file() {
            return Err(FamilyError::NotAPipeline {
                dir: root.to_path_buf(),
            });
        }
        let index_json = files::read_json(&model_index)?;
        let unet_file = root.join("unet/config.json");
        let unet = files::read_json(&unet_file)?;
        let te_file = root.join("text_encoder/config.json");
        let text_encoder = if te_file.is_file() {
            Some(files::read_json(&te_file)?)
        } else {
            None
        };
        let family = detect_family(&Configs {
            model_index: &index_json,
            unet: &unet,
            text_encoder: text_encoder.as_ref(),
        })?;
        let vae_file = root.join("vae/config.json");
        let vae = files::read_json(&vae_file)?;
        let native_resolution = native_resolution(&unet, &unet_file, &vae, &vae_file)?;

        let scheduler_config = root.join(SCHEDULER_CONFIG);
        let prediction_type = PredictionType::from_scheduler_config(
            &files::read_json(&scheduler_config)?,
            &scheduler_config,
        )?;

        let mut components = Vec::new();
        let mut tokenizers = Vec::new();
        for &component in family.components() {
            components.push(files::component_files(root, component, variant)?);
            if let Some(tok) = component.tokenizer_folder() {
                tokenizers.push(files::tokenizer_files(root, tok)?);
            }
        }
        Ok(Self {
            root: root.to_path_buf(),
            family,
            prediction_type,
            native_resolution,
            model_index,
            scheduler_config,
            components,
            tokenizers,
            single_file: None,
        })
    }

    /// The layout of an opened single file: configs in memory, weights through its views.
    pub fn from_single_file(sf: SingleFile) -> Result<Self, FamilyError> {
        let path = sf.path.clone();
        let named = |what: &str| path.join(format!("<{what}>"));
        let unet = sf
            .component(Component::Unet)
            .map(|p| p.config.clone())
            .unwrap_or_default();
        let vae = sf
            .component(Component::Vae)
            .map(|p| p.config.clone())
            .unwrap_or_default();
        let native_resolution =
            native_resolution(&unet, &named("unet config"), &vae, &named("vae config"))?;
        let prediction_type =
            PredictionType::from_scheduler_config(&sf.scheduler, &named("scheduler config"))?;
        let components = sf
            .components
            .iter()
            .map(|(c, p)| ComponentFiles {
                component: *c,
                config: path.clone(),
                index: None,
                weights: vec![path.clone()],
                packed: Some(p.clone()),
            })
            .collect();
        let tokenizers = sf
            .tokenizers
            .iter()
            .map(|(folder, src)| match src {
                TokenizerSource::Builtin {
                    vocab_size,
                    pad,
                    max_length,
                } => Ok(TokenizerFiles {
                    folder: folder.clone(),
                    files: Vec::new(),
                    builtin: Some(BuiltinTokenizer {
                        vocab_size: *vocab_size,
                        pad: pad.clone(),
                        max_length: *max_length,
                    }),
                }),
                TokenizerSource::Folder(dir) => {
                    let parent = dir.parent().unwrap_or(Path::new("."));
                    files::tokenizer_files(parent, folder)
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            root: path.clone(),
            family: sf.family,
            prediction_type,
            native_resolution,
            model_index: path.clone(),
            scheduler_config: path,
            components,
            tokenizers,
            single_file: Some(Arc::new(sf)),
        })
    }

    /// The scheduler config.
    pub fn scheduler_json(&self) -> Result<Value, FilesError> {
        match &self.single_file {
            Some(sf) => Ok(sf.scheduler.clone()),
            None => files::read_json(&self.scheduler_config),
        }
    }

    /// `model_index.json`.
    pub fn model_index_json(&self) -> Result<Value, FilesError> {
        match &self.single_file {
            Some(sf) => Ok(sf.model_index.clone()),
            None => files::read_json(&self.model_index),
        }
    }

    pub fn component(&self, component: Component) -> Option<&ComponentFiles> {
        self.components.iter().find(|c| c.component == component)
    }

    /// Every file sdtrain would open, configs first, then weights and tokenizer files.
    pub fn all_files(&self) -> Vec<PathBuf> {
        if self.single_file.is_some() {
            let mut out = vec![self.root.clone()];
            for t in &self.tokenizers {
                out.extend(t.files.iter().cloned());
            }
            return out;
        }
        let mut out = vec![self.model_index.clone(), self.scheduler_config.clone()];
        for c in &self.components {
            out.push(c.config.clone());
            out.extend(c.index.iter().cloned());
            out.extend(c.weights.iter().cloned());
        }
        for t in &self.tokenizers {
            out.extend(t.files.iter().cloned());
        }
        out
    }
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
}
