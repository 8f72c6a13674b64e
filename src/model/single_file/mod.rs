//! Single-file checkpoints in the A1111/ComfyUI (LDM) layout: one `.safetensors` holding the
//! UNet (`model.diffusion_model.*`), the VAE (`first_stage_model.*`) and the text encoders
//! (`cond_stage_model.*` for SD1/SD2, `conditioner.embedders.{0,1}.*` for SDXL).
//!
//! Opening one gives what a diffusers folder gives ([`ModelLayout`](super::layout::ModelLayout)):
//! one config per component and, instead of weight files, a [`TensorView`] per component that
//! shows the file's LDM names under diffusers names ([`names`]). The configs come from, in order:
//! 1. `model_config`, a diffusers folder whose configs and tokenizers describe the file
//!    (diffusers' `from_single_file(config=…)`);
//! 2. the file's `sdtrain.*` metadata, which sdtrain writes into every single file it saves
//!    ([`save_single_file`](super::export::save_single_file)), so sdtrain's own files load
//!    exactly as they were saved;
//! 3. detection from the tensor names and shapes ([`detect`]).
//!
//! Every tensor of the file is accounted for: a component's weight, a known non-weight
//! ([`skip_reason`], reported as skipped) or an error naming the file and the unknown names, so
//! a LoRA or a UNet-only file is refused rather than half-loaded. Tokenizers: a single file has
//! none; each text encoder gets the CLIP BPE built into sdtrain
//! ([`ClipTokenizer::builtin`](super::clip::ClipTokenizer::builtin)) sized to its token
//! embedding, unless `model_config` has tokenizer folders.

pub mod detect;
pub mod names;
pub mod prediction;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::safetensors::MmapedSafetensors;
use serde_json::Value;

use self::detect::Shapes;
use self::names::{Mapped, UnetBlocks, VaeBlocks};
use super::clip::ClipTextConfig;
use super::family::{self, FamilyError, ModelFamily, PredictionType};
use super::files::{self, Component, FilesError, PackedComponent, MODEL_INDEX, SCHEDULER_CONFIG};
use super::unet::{BlockKind, UnetConfig};
use super::vae::VaeConfig;
use crate::error_chain::chain_text;
use crate::tensor_view::{TensorView, ViewError, ViewOp};

/// UNet names start with this.
pub const UNET: &str = "model.diffusion_model.";
/// VAE names start with this.
pub const VAE: &str = "first_stage_model.";
/// The namespace of sdtrain's metadata keys.
pub const META_PREFIX: &str = "sdtrain.";

/// Extensions of pickle checkpoints, refused with a conversion hint.
pub const PICKLE_EXTENSIONS: [&str; 4] = ["ckpt", "pt", "pth", "bin"];

/// How a text encoder is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextEncoderKind {
    /// OpenAI CLIP in transformers' names, `text_model.` included or not.
    Clip { text_model: bool },
    /// OpenCLIP; `projection`: the diffusers model has a `text_projection` (SDXL's second).
    OpenClip { projection: bool },
}

/// Where a text encoder of `family` lives in the file.
pub fn text_encoder_prefix(family: ModelFamily, component: Component) -> Option<&'static str> {
    match (family, component) {
        (ModelFamily::Sd1, Component::TextEncoder) => Some("cond_stage_model.transformer."),
        (ModelFamily::Sd2, Component::TextEncoder) => Some("cond_stage_model.model."),
        (ModelFamily::Sdxl, Component::TextEncoder) => Some("conditioner.embedders.0.transformer."),
        (ModelFamily::Sdxl, Component::TextEncoder2) => Some("conditioner.embedders.1.model."),
        (ModelFamily::Sd1 | ModelFamily::Sd2, Component::TextEncoder2)
        | (_, Component::Unet | Component::Vae) => None,
    }
}

/// The text-encoder kind of `component` in `family`; `text_model` is for OpenAI CLIP names.
pub fn text_encoder_kind(
    family: ModelFamily,
    component: Component,
    text_model: bool,
) -> TextEncoderKind {
    match (family, component) {
        (ModelFamily::Sd2, _) => TextEncoderKind::OpenClip { projection: false },
        (ModelFamily::Sdxl, Component::TextEncoder2) => {
            TextEncoderKind::OpenClip { projection: true }
        }
        (ModelFamily::Sd1 | ModelFamily::Sdxl, _) => TextEncoderKind::Clip { text_model },
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SingleFileError {
    #[error(
        "{}: a torch pickle, which this reader does not map; give it as `--model` (or `vae`), \
         which reads it as data through a converted copy, or convert it once with `sdtrain \
         convert --model {} --out <file>.safetensors`",
        path.display(),
        path.display()
    )]
    Pickle { path: PathBuf },
    #[error("{}: not a .safetensors file", path.display())]
    NotSafetensors { path: PathBuf },
    #[error("cannot read {}: {message}", path.display())]
    Read { path: PathBuf, message: String },
    #[error("{}: not a valid safetensors file: {message}{}", path.display(), crate::file_sniff::safetensors_note(path))]
    Invalid { path: PathBuf, message: String },
    #[error("{}: not a full Stable Diffusion checkpoint: {message}", path.display())]
    NotACheckpoint { path: PathBuf, message: String },
    #[error("{}: cannot detect the {what} config: {message}; give the configs with `model_config` (a diffusers folder)", path.display())]
    Detect {
        path: PathBuf,
        what: &'static str,
        message: String,
    },
    #[error(
        "{}: {count} tensor(s) belong to no component and are no known non-weight: {}",
        path.display(),
        names.join(", ")
    )]
    Unknown {
        path: PathBuf,
        count: usize,
        names: Vec<String>,
    },
    #[error(
        "{}: {count} weight(s) are stored twice, under two names, and the copies may differ \
         (other tools keep one or the other): {}; keep one copy in the file",
        path.display(),
        pairs.join(", ")
    )]
    Twice {
        path: PathBuf,
        count: usize,
        pairs: Vec<String>,
    },
    #[error("{}: metadata `{key}`: {message}", path.display())]
    Metadata {
        path: PathBuf,
        key: String,
        message: String,
    },
    #[error(
        "{}: the file is {file_family} (by its keys) but model_config {} describes {config_family}",
        path.display(),
        config.display()
    )]
    FamilyMismatch {
        path: PathBuf,
        config: PathBuf,
        file_family: ModelFamily,
        config_family: ModelFamily,
    },
    #[error("{}: the {component} config ({from}): {message}", path.display())]
    Config {
        path: PathBuf,
        component: Component,
        /// Where the config came from: the metadata key, `model_config` or detection.
        from: String,
        message: String,
    },
    #[error(transparent)]
    View(Box<ViewError>),
    #[error(transparent)]
    Family(#[from] Box<FamilyError>),
    #[error(transparent)]
    Files(#[from] FilesError),
}

impl From<ViewError> for SingleFileError {
    fn from(e: ViewError) -> Self {
        SingleFileError::View(Box::new(e))
    }
}

impl SingleFileError {
    /// True when the file (or the options) are at fault, false when reading failed.
    pub fn is_usage(&self) -> bool {
        match self {
            SingleFileError::Read { .. } => false,
            SingleFileError::Family(e) => e.is_usage(),
            SingleFileError::Files(e) => e.is_usage(),
            SingleFileError::Pickle { .. }
            | SingleFileError::NotSafetensors { .. }
            | SingleFileError::Invalid { .. }
            | SingleFileError::NotACheckpoint { .. }
            | SingleFileError::Detect { .. }
            | SingleFileError::Unknown { .. }
            | SingleFileError::Twice { .. }
            | SingleFileError::Metadata { .. }
            | SingleFileError::FamilyMismatch { .. }
            | SingleFileError::Config { .. }
            | SingleFileError::View(_) => true,
        }
    }
}

/// What the user may say about a single file that the file does not.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SingleFileOptions {
    /// A diffusers folder whose configs (and tokenizers) describe the file.
    pub model_config: Option<PathBuf>,
    /// Overrides the prediction type from the metadata, the config folder or detection.
    pub prediction_type: Option<PredictionType>,
}

/// Where the configs of an opened single file came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigOrigin {
    /// `model_config`.
    ModelConfig(PathBuf),
    /// The file's `sdtrain.*` metadata.
    Metadata,
    /// Detected from the names and shapes.
    Detected,
}

impl std::fmt::Display for ConfigOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigOrigin::ModelConfig(p) => write!(f, "model_config {}", p.display()),
            ConfigOrigin::Metadata => f.write_str("the file's sdtrain metadata"),
            ConfigOrigin::Detected => f.write_str("detected from the tensor shapes"),
        }
    }
}

/// Where a text encoder's tokenizer comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerSource {
    /// sdtrain's built-in CLIP BPE for a `vocab_size`-row embedding.
    Builtin {
        vocab_size: usize,
        pad: String,
        max_length: usize,
    },
    /// A tokenizer folder (of `model_config`).
    Folder(PathBuf),
}

/// An opened single-file checkpoint.
#[derive(Debug, PartialEq, Eq)]
pub struct SingleFile {
    pub path: PathBuf,
    pub family: ModelFamily,
    pub origin: ConfigOrigin,
    pub model_index: Value,
    pub scheduler: Value,
    /// In [`ModelFamily::components`] order.
    pub components: Vec<(Component, Arc<PackedComponent>)>,
    /// One per text encoder, in order.
    pub tokenizers: Vec<(String, TokenizerSource)>,
    /// Tensors of the file that are deliberately not loaded, with the reason.
    pub skipped: Vec<(String, &'static str)>,
    /// What decided the prediction type ([`prediction`]).
    pub prediction_from: String,
}

/// Why a tensor outside every component may be left out, or `None` if it may not.
pub fn skip_reason(name: &str) -> Option<&'static str> {
    const SCHEDULE: [&str; 13] = [
        "betas",
        "alphas_cumprod",
        "alphas_cumprod_prev",
        "sqrt_alphas_cumprod",
        "sqrt_one_minus_alphas_cumprod",
        "log_one_minus_alphas_cumprod",
        "sqrt_recip_alphas_cumprod",
        "sqrt_recipm1_alphas_cumprod",
        "posterior_variance",
        "posterior_log_variance_clipped",
        "posterior_mean_coef1",
        "posterior_mean_coef2",
        "logvar",
    ];
    if SCHEDULE.contains(&name) {
        return Some(
            "a noise-schedule buffer of the LDM code (the scheduler config holds the schedule)",
        );
    }
    if name.starts_with("model_ema.") {
        return Some("the LDM trainer's EMA copy of the UNet");
    }
    if name.starts_with("loss.") {
        return Some("the autoencoder trainer's loss networks (LPIPS, discriminator)");
    }
    match name {
        "v_pred" => Some("ComfyUI's v-prediction marker (read: the model predicts v)"),
        "ztsnr" => Some("ComfyUI's zero-terminal-SNR marker (read: the schedule is rescaled)"),
        _ => None,
    }
}

/// The header of a safetensors file: shapes and `__metadata__`.
pub fn read_header(path: &Path) -> Result<(Shapes, BTreeMap<String, String>), SingleFileError> {
    let read = |message: String| SingleFileError::Read {
        path: path.to_path_buf(),
        message,
    };
    let file = std::fs::File::open(path).map_err(|e| read(e.to_string()))?;
    // SAFETY: mapped read-only and dropped before returning; only the header is read.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| read(e.to_string()))?;
    let (_, meta) =
        safetensors::SafeTensors::read_metadata(&mmap).map_err(|e| SingleFileError::Invalid {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    let shapes = meta
        .tensors()
        .into_iter()
        .map(|(n, info)| (n, info.shape.clone()))
        .collect();
    let metadata = meta
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    Ok((shapes, metadata))
}

/// The family by which text-encoder keys the file has.
fn family_of(path: &Path, h: &Shapes) -> Result<ModelFamily, SingleFileError> {
    let has = |p: &str| {
        h.range(p.to_string()..)
            .next()
            .is_some_and(|(k, _)| k.starts_with(p))
    };
    let not = |message: String| SingleFileError::NotACheckpoint {
        path: path.to_path_buf(),
        message,
    };
    // `lycoris_`: SimpleTuner's LyCORIS files keep LyCORIS's default module prefix.
    if h.keys()
        .any(|k| k.starts_with("lora_") || k.starts_with("lycoris_") || k.contains(".lora_"))
    {
        return Err(not(
            "it holds LoRA tensors (`lora_*`, `lycoris_*`): an adapter file, not a model; load \
             it with `adapter.init_from` or `sdtrain sample --lora`"
                .into(),
        ));
    }
    let mut missing = Vec::new();
    if !has(UNET) {
        missing.push(format!("no UNet (`{UNET}*`)"));
    }
    if !has(VAE) {
        missing.push(format!("no VAE (`{VAE}*`)"));
    }
    let family = if has("conditioner.embedders.") {
        Some(ModelFamily::Sdxl)
    } else if has("cond_stage_model.model.") {
        Some(ModelFamily::Sd2)
    } else if has("cond_stage_model.transformer.") {
        Some(ModelFamily::Sd1)
    } else {
        missing.push(
            "no text encoder (`cond_stage_model.*` or `conditioner.embedders.*`)".to_string(),
        );
        None
    };
    match family {
        Some(f) if missing.is_empty() => Ok(f),
        _ => Err(not(missing.join(", "))),
    }
}

impl SingleFile {
    /// Opens `path` (see the module header).
    pub fn open(path: &Path, opts: &SingleFileOptions) -> Result<Self, SingleFileError> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .unwrap_or_default();
        if PICKLE_EXTENSIONS.contains(&ext.as_str()) {
            return Err(SingleFileError::Pickle {
                path: path.to_path_buf(),
            });
        }
        if ext != "safetensors" {
            return Err(SingleFileError::NotSafetensors {
                path: path.to_path_buf(),
            });
        }
        let (shapes, metadata) = read_header(path)?;
        let family = family_of(path, &shapes)?;
        let (mut configs, mut prediction_from) = match &opts.model_config {
            Some(dir) => (
                Configs::from_folder(path, dir, family)?,
                "model_config's scheduler config".to_string(),
            ),
            None if metadata.contains_key(&meta_key("unet_config")) => (
                Configs::from_metadata(path, &metadata, family)?,
                "the file's sdtrain metadata".to_string(),
            ),
            None => {
                let v_pred = shapes.contains_key("v_pred");
                let p = prediction::resolve(path, family, &metadata, v_pred, opts.prediction_type)?;
                (
                    Configs::detect(path, &shapes, family, p.prediction)?,
                    p.from,
                )
            }
        };
        if let Some(p) = opts.prediction_type {
            configs.scheduler["prediction_type"] = Value::String(p.name().to_string());
            prediction_from = "`prediction_type`".to_string();
        }
        // SAFETY: mapped read-only for the life of the views; sdtrain never writes into a model
        // file it has loaded (saves go to a temp file and are renamed).
        let st = Arc::new(unsafe { MmapedSafetensors::new(path) }.map_err(|e| {
            SingleFileError::Read {
                path: path.to_path_buf(),
                message: e.to_string(),
            }
        })?);
        let (maps, skipped) = map_tensors(path, &shapes, family, &configs)?;
        let rules = Arc::new(NameRules::new(path, family, &configs)?);
        let mut components = Vec::new();
        for (&component, config) in family.components().iter().zip(&configs.components) {
            let map = maps.get(&component).cloned().unwrap_or_default();
            let rules = rules.clone();
            let view = TensorView::new(path, st.clone(), map)?
                .with_stored_names(Arc::new(move |name| rules.ldm_name(component, name)));
            components.push((
                component,
                Arc::new(PackedComponent {
                    config: config.clone(),
                    view: Arc::new(view),
                }),
            ));
        }
        Ok(Self {
            path: path.to_path_buf(),
            family,
            origin: configs.origin,
            model_index: configs.model_index,
            scheduler: configs.scheduler,
            components,
            tokenizers: configs.tokenizers,
            skipped,
            prediction_from,
        })
    }

    pub fn component(&self, c: Component) -> Option<&Arc<PackedComponent>> {
        self.components
            .iter()
            .find(|(k, _)| *k == c)
            .map(|(_, p)| p)
    }
}

/// `sdtrain.<name>`.
pub fn meta_key(name: &str) -> String {
    format!("{META_PREFIX}{name}")
}

/// The metadata key of a component's config.
pub fn config_key(component: Component) -> String {
    meta_key(&format!("{}_config", component.folder()))
}

/// The configs of a single file, from wherever they came.
struct Configs {
    origin: ConfigOrigin,
    model_index: Value,
    scheduler: Value,
    /// In [`ModelFamily::components`] order.
    components: Vec<Value>,
    tokenizers: Vec<(String, TokenizerSource)>,
}

impl Configs {
    fn from_folder(path: &Path, dir: &Path, family: ModelFamily) -> Result<Self, SingleFileError> {
        let model_index = files::read_json(&dir.join(MODEL_INDEX))?;
        let unet = files::read_json(&dir.join("unet/config.json"))?;
        let te_file = dir.join("text_encoder/config.json");
        let te = files::read_json(&te_file)?;
        let config_family = family::detect_family(&family::Configs {
            model_index: &model_index,
            unet: &unet,
            text_encoder: Some(&te),
        })
        .map_err(Box::new)?;
        if config_family != family {
            return Err(SingleFileError::FamilyMismatch {
                path: path.to_path_buf(),
                config: dir.to_path_buf(),
                file_family: family,
                config_family,
            });
        }
        let mut components = Vec::new();
        let mut tokenizers = Vec::new();
        for &c in family.components() {
            components.push(files::read_json(&dir.join(c.folder()).join("config.json"))?);
            if let Some(tok) = c.tokenizer_folder() {
                files::tokenizer_files(dir, tok)?;
                tokenizers.push((tok.to_string(), TokenizerSource::Folder(dir.join(tok))));
            }
        }
        Ok(Self {
            origin: ConfigOrigin::ModelConfig(dir.to_path_buf()),
            model_index,
            scheduler: files::read_json(&dir.join(SCHEDULER_CONFIG))?,
            components,
            tokenizers,
        })
    }

    fn from_metadata(
        path: &Path,
        meta: &BTreeMap<String, String>,
        family: ModelFamily,
    ) -> Result<Self, SingleFileError> {
        let get = |key: String| -> Result<Value, SingleFileError> {
            let bad = |message: String| SingleFileError::Metadata {
                path: path.to_path_buf(),
                key: key.clone(),
                message,
            };
            let text = meta.get(&key).ok_or_else(|| bad("missing".into()))?;
            let value: Value = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
            match value.is_object() {
                true => Ok(value),
                false => Err(bad(format!(
                    "is {} where a JSON object is expected",
                    crate::py_json::kind(&value)
                ))),
            }
        };
        let mut components = Vec::new();
        let mut tokenizers = Vec::new();
        for &c in family.components() {
            let config = get(config_key(c))?;
            if let Some(tok) = c.tokenizer_folder() {
                let t = get(meta_key(tok))?;
                let vocab_size = config
                    .get("vocab_size")
                    .and_then(Value::as_u64)
                    .unwrap_or(49408) as usize;
                tokenizers.push((
                    tok.to_string(),
                    TokenizerSource::Builtin {
                        vocab_size,
                        pad: t
                            .get("pad_token")
                            .and_then(Value::as_str)
                            .unwrap_or("<|endoftext|>")
                            .to_string(),
                        max_length: t
                            .get("model_max_length")
                            .and_then(Value::as_u64)
                            .unwrap_or(77) as usize,
                    },
                ));
            }
            components.push(config);
        }
        Ok(Self {
            origin: ConfigOrigin::Metadata,
            model_index: get(meta_key("model_index"))?,
            scheduler: get(meta_key("scheduler_config"))?,
            components,
            tokenizers,
        })
    }

    fn detect(
        path: &Path,
        h: &Shapes,
        family: ModelFamily,
        prediction: PredictionType,
    ) -> Result<Self, SingleFileError> {
        let fail = |what: &'static str| {
            move |message: String| SingleFileError::Detect {
                path: path.to_path_buf(),
                what,
                message,
            }
        };
        let mut tes = Vec::new();
        let mut positions = Vec::new();
        let mut pooled = None;
        for c in [Component::TextEncoder, Component::TextEncoder2] {
            let Some(prefix) = text_encoder_prefix(family, c) else {
                continue;
            };
            let text_model = h.contains_key(&format!(
                "{prefix}text_model.embeddings.token_embedding.weight"
            ));
            let kind = text_encoder_kind(family, c, text_model);
            let (cfg, proj) =
                detect::text_encoder(h, prefix, kind).map_err(fail("text encoder"))?;
            pooled = proj.or(pooled);
            positions.push(detect::position_key(prefix, kind));
            tes.push((c, cfg, detect::pad_token(kind)));
        }
        check_positions(h, &positions).map_err(fail("text encoder"))?;
        let unet = detect::unet(h, family, prediction, pooled).map_err(fail("UNet"))?;
        let resolution = unet["sample_size"].as_u64().unwrap_or(64) as usize * 8;
        let vae = detect::vae(h, family, resolution).map_err(fail("VAE"))?;
        let mut scheduler = detect::scheduler(family, prediction);
        if h.contains_key("ztsnr") {
            scheduler["rescale_betas_zero_snr"] = Value::Bool(true);
        }
        let mut components = vec![unet, vae];
        let mut tokenizers = Vec::new();
        for (c, cfg, pad) in tes {
            let vocab_size = cfg["vocab_size"].as_u64().unwrap_or(0) as usize;
            let max_length = cfg["max_position_embeddings"].as_u64().unwrap_or(77) as usize;
            tokenizers.push((
                c.tokenizer_folder().unwrap_or("tokenizer").to_string(),
                TokenizerSource::Builtin {
                    vocab_size,
                    pad: pad.to_string(),
                    max_length,
                },
            ));
            components.push(cfg);
        }
        Ok(Self {
            origin: ConfigOrigin::Detected,
            model_index: detect::model_index(family),
            scheduler,
            components,
            tokenizers,
        })
    }
}

/// Checks that SDXL's two text encoders (the tensors `keys` of their position embeddings) take
/// as many tokens: their hidden states are joined token by token, so a mismatch failed only when
/// a prompt was encoded, as candle's "shape mismatch in cat", naming no file.
fn check_positions(h: &Shapes, keys: &[String]) -> Result<(), String> {
    let rows = |k: &String| h.get(k).and_then(|s| s.first().copied());
    if let [a, b] = keys {
        if let (Some(ra), Some(rb)) = (rows(a), rows(b)) {
            if ra != rb {
                return Err(format!(
                    "`{a}` has {ra} positions but `{b}` {rb}: SDXL's two text encoders read \
                     the same tokens and need as many"
                ));
            }
        }
    }
    Ok(())
}

/// Per component: diffusers name → (stored name, op). A [`BTreeMap`] so views list in order.
type ComponentMaps = BTreeMap<Component, BTreeMap<String, (String, ViewOp)>>;

/// Tensors left out, with the reason.
type Skipped = Vec<(String, &'static str)>;

/// What the LDM names of a file map to, from its configs: the UNet's blocks, the VAE's levels
/// and, per text encoder, its prefix, kind and layer count.
struct NameRules {
    unet: UnetBlocks,
    vae: VaeBlocks,
    text: Vec<(Component, &'static str, TextEncoderKind, usize)>,
}

impl NameRules {
    fn new(path: &Path, family: ModelFamily, configs: &Configs) -> Result<Self, SingleFileError> {
        let config_err = |component: Component, message: String| SingleFileError::Config {
            path: path.to_path_buf(),
            component,
            from: match &configs.origin {
                ConfigOrigin::Metadata => format!("metadata `{}`", config_key(component)),
                other => other.to_string(),
            },
            message,
        };
        let cfg = |c: Component| {
            family
                .components()
                .iter()
                .position(|&k| k == c)
                .and_then(|i| configs.components.get(i))
                .ok_or_else(|| config_err(c, "missing".into()))
        };
        let unet_cfg = UnetConfig::from_json(&cfg(Component::Unet)?.to_string(), "unet config")
            .map_err(|e| config_err(Component::Unet, chain_text(&e)))?;
        let unet = unet_blocks(&unet_cfg).map_err(|m| config_err(Component::Unet, m))?;
        let vae_cfg =
            VaeConfig::from_json(&cfg(Component::Vae)?.to_string(), Path::new("vae config"))
                .map_err(|e| config_err(Component::Vae, chain_text(&e)))?;
        let vae = VaeBlocks {
            levels: vae_cfg.block_out_channels.len(),
        };
        let mut text = Vec::new();
        for c in [Component::TextEncoder, Component::TextEncoder2] {
            let Some(prefix) = text_encoder_prefix(family, c) else {
                continue;
            };
            let te =
                ClipTextConfig::from_json(&cfg(c)?.to_string(), Path::new("text encoder config"))
                    .map_err(|e| config_err(c, chain_text(&e)))?;
            let kind = text_encoder_kind(family, c, true);
            text.push((c, prefix, kind, te.num_hidden_layers));
        }
        Ok(Self { unet, vae, text })
    }

    /// The name a file of this layout stores `component`'s diffusers tensor `name` under (for a
    /// fused q/k/v, the fused tensor).
    fn ldm_name(&self, component: Component, name: &str) -> Option<String> {
        match component {
            Component::Unet => names::unet_to_ldm(name, &self.unet).map(|n| format!("{UNET}{n}")),
            Component::Vae => names::vae_to_ldm(name, self.vae).map(|(n, _)| format!("{VAE}{n}")),
            Component::TextEncoder | Component::TextEncoder2 => {
                let (_, prefix, kind, _) = self.text.iter().find(|t| t.0 == component)?;
                let name = match name.starts_with("text_model.") || name == "text_projection.weight"
                {
                    true => name.to_string(),
                    false => format!("text_model.{name}"),
                };
                match kind {
                    TextEncoderKind::Clip { .. } => Some(format!("{prefix}{name}")),
                    TextEncoderKind::OpenClip { .. } => match names::openclip_to_ldm(&name)? {
                        names::OpenClipPart::Whole(l)
                        | names::OpenClipPart::Transposed(l)
                        | names::OpenClipPart::Fused(l, _) => Some(format!("{prefix}{l}")),
                    },
                }
            }
        }
    }

    /// The component a stored tensor belongs to (none for a non-weight) and its diffusers names.
    fn map(&self, name: &str, shape: &[usize]) -> (Option<Component>, Mapped) {
        if let Some(rest) = name.strip_prefix(UNET) {
            let m = names::unet_to_diffusers(rest, &self.unet)
                .map_or(Mapped::Unknown, |d| Mapped::To(vec![(d, ViewOp::Same)]));
            (Some(Component::Unet), m)
        } else if let Some(rest) = name.strip_prefix(VAE) {
            (Some(Component::Vae), vae_tensor(rest, shape, self.vae))
        } else if let Some((c, rest, kind, layers)) = self
            .text
            .iter()
            .find_map(|(c, p, k, l)| name.strip_prefix(p).map(|r| (*c, r, *k, *l)))
        {
            let m = match kind {
                TextEncoderKind::Clip { .. } => names::clip_to_diffusers(rest),
                TextEncoderKind::OpenClip { projection } => {
                    names::openclip_to_diffusers(rest, shape, layers, projection)
                }
            };
            (Some(c), m)
        } else {
            match skip_reason(name) {
                Some(r) => (None, Mapped::Skip(r)),
                None => (None, Mapped::Unknown),
            }
        }
    }
}

/// What a VAE tensor of LDM name `rest` (without `first_stage_model.`) and stored `shape`
/// becomes under diffusers' names: the mid-block attention's 1×1 convs as linear weights.
pub fn vae_tensor(rest: &str, shape: &[usize], blocks: VaeBlocks) -> Mapped {
    match names::vae_to_diffusers(rest, blocks) {
        Some((d, true)) if shape.len() == 4 => {
            Mapped::To(vec![(d, ViewOp::Reshape(shape[..2].to_vec()))])
        }
        // diffusers' conversion script of early 2024 (fixed by its #6933) wrote the
        // mid-block attention's biases with the 1×1 conv's unit dims, `[c, 1, 1]`.
        Some((d, false))
            if d.contains(".attentions.")
                && shape.len() > 1
                && shape[1..].iter().all(|&n| n == 1) =>
        {
            Mapped::To(vec![(d, ViewOp::Reshape(vec![shape[0]]))])
        }
        Some((d, _)) => Mapped::To(vec![(d, ViewOp::Same)]),
        None => Mapped::Unknown,
    }
}

/// Assigns every tensor of the file to a component (or a skip reason) using the configs.
fn map_tensors(
    path: &Path,
    h: &Shapes,
    family: ModelFamily,
    configs: &Configs,
) -> Result<(ComponentMaps, Skipped), SingleFileError> {
    let rules = NameRules::new(path, family, configs)?;
    let mut maps: ComponentMaps = BTreeMap::new();
    let mut skipped = Vec::new();
    let mut unknown = Vec::new();
    let mut twice = Vec::new();
    for (name, shape) in h {
        match rules.map(name, shape) {
            (Some(c), Mapped::To(list)) => {
                let map = maps.entry(c).or_default();
                for (d, op) in list {
                    if let Some((first, _)) = map.insert(d.clone(), (name.clone(), op)) {
                        twice.push(format!("`{first}` and `{name}` (both {c} `{d}`)"));
                    }
                }
            }
            (_, Mapped::Skip(reason)) => skipped.push((name.clone(), reason)),
            (_, Mapped::Unknown) | (None, Mapped::To(_)) => unknown.push(name.clone()),
        }
    }
    if !unknown.is_empty() {
        let count = unknown.len();
        unknown.truncate(8);
        return Err(SingleFileError::Unknown {
            path: path.to_path_buf(),
            count,
            names: unknown,
        });
    }
    if !twice.is_empty() {
        let count = twice.len();
        twice.truncate(4);
        return Err(SingleFileError::Twice {
            path: path.to_path_buf(),
            count,
            pairs: twice,
        });
    }
    Ok((maps, skipped))
}

/// The UNet's block structure for [`names`]: every down block must have the same layer count
/// (the LDM numbering assumes it).
pub fn unet_blocks(cfg: &UnetConfig) -> Result<UnetBlocks, String> {
    let layers: BTreeSet<usize> = cfg.down_blocks.iter().map(|b| b.layers).collect();
    let [layers] = layers.into_iter().collect::<Vec<_>>()[..] else {
        return Err("down blocks with different layer counts have no LDM names".into());
    };
    Ok(UnetBlocks {
        layers,
        down_attn: cfg
            .down_blocks
            .iter()
            .map(|b| b.kind == BlockKind::CrossAttn)
            .collect(),
        up_attn: cfg
            .up_kinds
            .iter()
            .map(|k| *k == BlockKind::CrossAttn)
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_non_weights_have_reasons_and_nothing_else_does() {
        assert!(skip_reason("alphas_cumprod").is_some());
        assert!(skip_reason("model_ema.diffusion_modelinput_blocks00weight").is_some());
        assert!(skip_reason("v_pred").is_some());
        assert!(skip_reason("model.diffusion_model.x").is_none());
        assert!(skip_reason("lora_unet_x.alpha").is_none());
        assert!(skip_reason("betas2").is_none());
    }

    /// SDXL's encoders with 77 and 78 positions are refused naming both tensors; it failed as
    /// candle's "shape mismatch in cat" at the first prompt (scripts/fuzz-files).
    #[test]
    fn sdxl_encoders_need_as_many_positions() {
        let a =
            "conditioner.embedders.0.transformer.text_model.embeddings.position_embedding.weight";
        let b = "conditioner.embedders.1.model.positional_embedding";
        let keys = [a.to_string(), b.to_string()];
        let h = |rb: usize| -> Shapes {
            [(a.to_string(), vec![77, 32]), (b.to_string(), vec![rb, 32])]
                .into_iter()
                .collect()
        };
        assert!(check_positions(&h(77), &keys).is_ok());
        let e = check_positions(&h(78), &keys).unwrap_err();
        assert!(
            e.contains(&format!("`{a}` has 77 positions but `{b}` 78")),
            "{e}"
        );
    }

    #[test]
    fn family_needs_unet_vae_and_a_text_encoder() {
        let h =
            |names: &[&str]| -> Shapes { names.iter().map(|n| (n.to_string(), vec![1])).collect() };
        let p = Path::new("m.safetensors");
        let err = family_of(p, &h(&["model.diffusion_model.out.2.weight"]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no VAE") && err.contains("no text encoder"),
            "{err}"
        );
        for lora in [
            "lora_unet_down_blocks_0.alpha",
            "lycoris_down_blocks_0.lokr_w1",
        ] {
            let err = family_of(p, &h(&[lora])).unwrap_err().to_string();
            assert!(err.contains("LoRA"), "{err}");
        }
        let sd2 = h(&[
            "model.diffusion_model.out.2.weight",
            "first_stage_model.x",
            "cond_stage_model.model.ln_final.weight",
        ]);
        assert_eq!(family_of(p, &sd2).unwrap(), ModelFamily::Sd2);
    }
}
