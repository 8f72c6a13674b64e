//! The kohya LoRA/LoCon safetensors file: saving, loading, and matching a loaded file against
//! the model's adapter modules (for `adapter.init_from`).
//!
//! Layout (kohya sd-scripts `networks/lora.py`, `LoRANetwork.save_weights`), per module `<name>`
//! (see [`super::kohya_names`]):
//! - `<name>.lora_down.weight` [r, in] or [r, in, kh, kw];
//! - `<name>.lora_up.weight` [out, r] or [out, r, 1, 1];
//! - `<name>.alpha`, a 0-d tensor (`torch.tensor(alpha)`); the update is
//!   `(alpha / r) · up · down`. A file without `.alpha` means alpha = r (scale 1), as kohya reads it.
//!
//! Every tensor, alpha included, is written in the file dtype (fp16 by default, as kohya's
//! `--save_precision fp16`). The header's `__metadata__` holds kohya's `ss_*` strings (values
//! formatted as Python's `str()` formats them, since kohya writes `str(v)`) and the ModelSpec
//! `modelspec.*` keys that kohya's `library/sai_model_spec.py` writes for a LoRA.
//!
//! Loaded tensors are returned as f32 (the adapter keeps f32 masters). Keys that are not one of
//! the three LoRA suffixes (LyCORIS `hada_*`/`lokr_*`, DoRA `dora_scale`, `lora_mid`, …) are an
//! error listing them, never dropped.
//!
//! [`match_to_model`] policy: every module of the file must name a module of the model (else an
//! error lists all that do not), with the model's shapes (else an error lists every mismatch).
//! Model modules absent from the file are allowed and returned in [`MatchReport::missing`]: they
//! keep their fresh initialisation (up = 0, so they start as a no-op), which is what resuming a
//! LoRA file into a LoCon run, or a UNet-only file into a run that also trains the text encoder,
//! needs. The caller should log that count.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView, View};

use super::kohya_names::{KohyaComponent, KohyaNameError, KohyaNaming, KohyaResolver};
use crate::error_chain::External;
use crate::fsutil::{self, FsError};

const DOWN: &str = ".lora_down.weight";
const UP: &str = ".lora_up.weight";
const ALPHA: &str = ".alpha";

#[derive(Debug, thiserror::Error)]
pub enum KohyaError {
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is not a valid safetensors file", path.display())]
    Format {
        path: PathBuf,
        source: External<safetensors::SafeTensorError>,
    },
    #[error("cannot serialize the LoRA for {}", path.display())]
    Serialize {
        path: PathBuf,
        source: External<safetensors::SafeTensorError>,
    },
    #[error(transparent)]
    Write(#[from] FsError),
    #[error("tensor error on `{name}`")]
    Tensor {
        name: String,
        source: candle_core::Error,
    },
    #[error("kohya files are written as f16, bf16 or f32, not {0:?}")]
    SaveDtype(DType),
    #[error("{}: tensor `{name}` has dtype {dtype:?}; only F16, BF16 and F32 are read", path.display())]
    LoadDtype {
        path: PathBuf,
        name: String,
        dtype: StDtype,
    },
    #[error(
        "{}: {} key(s) are not kohya LoRA weights (`<module>.lora_down.weight`, \
         `.lora_up.weight`, `.alpha`){hint}: {}",
        path.display(), keys.len(), keys.join(", ")
    )]
    UnsupportedKeys {
        path: PathBuf,
        keys: Vec<String>,
        hint: &'static str,
    },
    #[error("{}: module `{name}` has {present} but no {absent}", path.display())]
    Incomplete {
        path: PathBuf,
        name: String,
        present: &'static str,
        absent: &'static str,
    },
    #[error(
        "{}: module `{name}`: lora_down {down:?} and lora_up {up:?} are not a LoRA pair \
         (want down [r, in] / up [out, r], or down [r, in, kh, kw] / up [out, r, 1, 1])",
        path.display()
    )]
    BadPair {
        path: PathBuf,
        name: String,
        down: Vec<usize>,
        up: Vec<usize>,
    },
    #[error("{}: `{name}` should be a single number, has shape {shape:?}", path.display())]
    BadAlpha {
        path: PathBuf,
        name: String,
        shape: Vec<usize>,
    },
    #[error("{}: holds no LoRA modules", path.display())]
    Empty { path: PathBuf },
    #[error("cannot save module `{name}`: {problem}")]
    BadModule { name: String, problem: String },
    #[error(transparent)]
    Name(#[from] KohyaNameError),
    #[error(
        "{}: {} module(s) match no module of the model ({naming}): {}",
        path.display(), names.len(), names.join(", ")
    )]
    UnknownModules {
        path: PathBuf,
        naming: &'static str,
        names: Vec<String>,
    },
    #[error("{}: modules `{first}` and `{second}` both name model module #{index}", path.display())]
    DuplicateModule {
        path: PathBuf,
        first: String,
        second: String,
        index: usize,
    },
    #[error("{}: {}", path.display(), mismatches.join("; "))]
    ShapeMismatch {
        path: PathBuf,
        mismatches: Vec<String>,
    },
}

/// One module to save: its full kohya name (e.g. `lora_unet_down_blocks_0_…_to_q`), the two
/// factors in any float dtype and on any device, and alpha.
#[derive(Debug, Clone)]
pub struct KohyaTensorSet {
    pub name: String,
    pub down: Tensor,
    pub up: Tensor,
    pub alpha: f32,
}

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
    /// Further header entries, written last (they may override the ones above).
    pub extra: BTreeMap<String, String>,
}

impl KohyaMetadata {
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
            ("modelspec.sai_model_spec", "1.0.0".to_string()),
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
        m
    }
}

/// Python's `str(bool)`.
fn py_bool(b: bool) -> String {
    if b { "True" } else { "False" }.to_string()
}

/// Python's `str(float)`: shortest round-trip digits; scientific (`1e-05`) when the decimal
/// exponent is < -4 or >= 16; otherwise positional with at least one decimal (`1.0`).
pub fn py_float(v: f64) -> String {
    if v.is_nan() {
        return "nan".to_string();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf" } else { "-inf" }.to_string();
    }
    if v == 0.0 {
        return if v.is_sign_negative() { "-0.0" } else { "0.0" }.to_string();
    }
    // `{:e}` gives the shortest round-trip mantissa, e.g. "1.5e-5".
    let sci = format!("{v:e}");
    let Some((mantissa, exp)) = sci.split_once('e') else {
        return sci;
    };
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{v}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

/// A JSON string literal (as Python's `json.dumps` writes it, ASCII-escaped).
fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A tensor already encoded for the file.
struct Encoded {
    dtype: StDtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &Encoded {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn encode_values(values: &[f32], shape: Vec<usize>, dtype: DType) -> Result<Encoded, KohyaError> {
    let (st, bytes): (StDtype, Vec<u8>) = match dtype {
        DType::F16 => (
            StDtype::F16,
            values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
        ),
        DType::BF16 => (
            StDtype::BF16,
            values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
        ),
        DType::F32 => (
            StDtype::F32,
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        other => return Err(KohyaError::SaveDtype(other)),
    };
    Ok(Encoded {
        dtype: st,
        shape,
        bytes,
    })
}

fn encode_tensor(name: &str, t: &Tensor, dtype: DType) -> Result<Encoded, KohyaError> {
    let values = t
        .to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|source| KohyaError::Tensor {
            name: name.to_string(),
            source,
        })?;
    encode_values(&values, t.dims().to_vec(), dtype)
}

/// Checks that `down`/`up` form a LoRA pair; returns the rank.
fn pair_rank(down: &[usize], up: &[usize]) -> Option<usize> {
    match (down, up) {
        ([r, _], [_, r2]) if r == r2 && *r > 0 => Some(*r),
        ([r, _, _, _], [_, r2, 1, 1]) if r == r2 && *r > 0 => Some(*r),
        _ => None,
    }
}

/// Writes `modules` to `path` atomically in kohya's layout, every tensor in `dtype` (F16, BF16
/// or F32).
pub fn save_kohya(
    path: &Path,
    modules: &[KohyaTensorSet],
    metadata: &KohyaMetadata,
    dtype: DType,
) -> Result<(), KohyaError> {
    if !matches!(dtype, DType::F16 | DType::BF16 | DType::F32) {
        return Err(KohyaError::SaveDtype(dtype));
    }
    let mut tensors: Vec<(String, Encoded)> = Vec::with_capacity(3 * modules.len());
    let mut seen = std::collections::HashSet::new();
    for m in modules {
        if !seen.insert(m.name.as_str()) {
            return Err(KohyaError::BadModule {
                name: m.name.clone(),
                problem: "the name appears twice".to_string(),
            });
        }
        if pair_rank(m.down.dims(), m.up.dims()).is_none() {
            return Err(KohyaError::BadModule {
                name: m.name.clone(),
                problem: format!(
                    "lora_down {:?} and lora_up {:?} are not a LoRA pair",
                    m.down.dims(),
                    m.up.dims()
                ),
            });
        }
        let down = format!("{}{DOWN}", m.name);
        let up = format!("{}{UP}", m.name);
        tensors.push((down.clone(), encode_tensor(&down, &m.down, dtype)?));
        tensors.push((up.clone(), encode_tensor(&up, &m.up, dtype)?));
        // 0-d, like kohya's `torch.tensor(alpha)`.
        tensors.push((
            format!("{}{ALPHA}", m.name),
            encode_values(&[m.alpha], Vec::new(), dtype)?,
        ));
    }
    let bytes = safetensors::tensor::serialize(
        tensors.iter().map(|(n, e)| (n.as_str(), e)),
        Some(metadata.to_header()),
    )
    .map_err(|source| KohyaError::Serialize {
        path: path.to_path_buf(),
        source: External(source),
    })?;
    fsutil::write_atomic(path, bytes)?;
    Ok(())
}

/// One module read from a file; tensors are f32.
#[derive(Debug, Clone)]
pub struct KohyaModule {
    pub name: String,
    pub down: Tensor,
    pub up: Tensor,
    /// The file's alpha, or the rank when the file has none (kohya's convention).
    pub alpha: f32,
    /// Whether the file held `<name>.alpha`.
    pub alpha_in_file: bool,
}

impl KohyaModule {
    pub fn rank(&self) -> usize {
        self.down.dims().first().copied().unwrap_or(0)
    }
}

/// A loaded kohya LoRA file.
#[derive(Debug, Clone)]
pub struct KohyaFile {
    pub path: PathBuf,
    /// Sorted by name.
    pub modules: Vec<KohyaModule>,
    /// The header's `__metadata__` (empty when absent).
    pub metadata: HashMap<String, String>,
}

fn decode(
    path: &Path,
    name: &str,
    view: &TensorView<'_>,
    device: &Device,
) -> Result<Tensor, KohyaError> {
    let data = view.data();
    let values: Vec<f32> = match view.dtype() {
        StDtype::F16 => data
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        StDtype::BF16 => data
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        StDtype::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        dtype => {
            return Err(KohyaError::LoadDtype {
                path: path.to_path_buf(),
                name: name.to_string(),
                dtype,
            })
        }
    };
    Tensor::from_vec(values, view.shape(), device).map_err(|source| KohyaError::Tensor {
        name: name.to_string(),
        source,
    })
}

/// A hint for keys of adapter formats we do not read.
fn unsupported_hint(keys: &[String]) -> &'static str {
    let lycoris = [
        "hada_",
        "lokr_",
        "dora_scale",
        "lora_mid",
        ".diff",
        ".on_input",
        "oft_",
        "boft_",
    ];
    if keys.iter().any(|k| lycoris.iter().any(|p| k.contains(p))) {
        " (this looks like a LyCORIS file: LoHa, LoKr, DoRA, Tucker LoCon, full diff and OFT \
         modules are not supported; use a plain LoRA/LoCon)"
    } else {
        ""
    }
}

/// Reads a kohya LoRA/LoCon file. Tensors are decoded to f32 on `device`.
pub fn load_kohya(path: &Path, device: &Device) -> Result<KohyaFile, KohyaError> {
    let bytes = std::fs::read(path).map_err(|source| KohyaError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let format_err = |source| KohyaError::Format {
        path: path.to_path_buf(),
        source: External(source),
    };
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(format_err)?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let st = SafeTensors::deserialize(&bytes).map_err(format_err)?;

    let tensors = st.tensors();
    let by_module = group_by_module(path, &tensors)?;
    let mut modules = Vec::with_capacity(by_module.len());
    for (name, parts) in by_module {
        modules.push(load_module(path, name, parts, device)?);
    }
    Ok(KohyaFile {
        path: path.to_path_buf(),
        modules,
        metadata,
    })
}

/// One module's tensors in the file, each with its key.
#[derive(Default)]
struct Parts<'a> {
    down: Option<(&'a str, TensorView<'a>)>,
    up: Option<(&'a str, TensorView<'a>)>,
    alpha: Option<(&'a str, TensorView<'a>)>,
}

/// Groups the file's tensors by module name; a key with none of the three suffixes is an error.
fn group_by_module<'a>(
    path: &Path,
    tensors: &'a [(String, TensorView<'a>)],
) -> Result<BTreeMap<&'a str, Parts<'a>>, KohyaError> {
    let mut by_module: BTreeMap<&str, Parts<'_>> = BTreeMap::new();
    let mut unsupported = Vec::new();
    for (key, view) in tensors {
        let key = key.as_str();
        let entry = if let Some(m) = key.strip_suffix(DOWN) {
            &mut by_module.entry(m).or_default().down
        } else if let Some(m) = key.strip_suffix(UP) {
            &mut by_module.entry(m).or_default().up
        } else if let Some(m) = key.strip_suffix(ALPHA) {
            &mut by_module.entry(m).or_default().alpha
        } else {
            unsupported.push(key.to_string());
            continue;
        };
        *entry = Some((key, view.clone()));
    }
    if !unsupported.is_empty() {
        unsupported.sort();
        let hint = unsupported_hint(&unsupported);
        return Err(KohyaError::UnsupportedKeys {
            path: path.to_path_buf(),
            keys: unsupported,
            hint,
        });
    }
    Ok(by_module)
}

/// Checks module `name`'s tensors (both weights, agreeing ranks) and decodes them onto `device`.
fn load_module(
    path: &Path,
    name: &str,
    parts: Parts<'_>,
    device: &Device,
) -> Result<KohyaModule, KohyaError> {
    let incomplete = |present, absent| KohyaError::Incomplete {
        path: path.to_path_buf(),
        name: name.to_string(),
        present,
        absent,
    };
    let (down, up) = match (parts.down, parts.up) {
        (Some(d), Some(u)) => (d, u),
        (Some(_), None) => return Err(incomplete("lora_down.weight", "lora_up.weight")),
        (None, Some(_)) => return Err(incomplete("lora_up.weight", "lora_down.weight")),
        (None, None) => return Err(incomplete("alpha", "lora_down/lora_up weights")),
    };
    let rank = pair_rank(down.1.shape(), up.1.shape()).ok_or_else(|| KohyaError::BadPair {
        path: path.to_path_buf(),
        name: name.to_string(),
        down: down.1.shape().to_vec(),
        up: up.1.shape().to_vec(),
    })?;
    let alpha = match &parts.alpha {
        Some((key, view)) => read_alpha(path, key, view)?,
        None => rank as f32,
    };
    Ok(KohyaModule {
        name: name.to_string(),
        down: decode(path, down.0, &down.1, device)?,
        up: decode(path, up.0, &up.1, device)?,
        alpha,
        alpha_in_file: parts.alpha.is_some(),
    })
}

/// The value of the one-element `.alpha` tensor `key`.
fn read_alpha(path: &Path, key: &str, view: &TensorView<'_>) -> Result<f32, KohyaError> {
    if view.shape().iter().product::<usize>() != 1 {
        return Err(KohyaError::BadAlpha {
            path: path.to_path_buf(),
            name: key.to_string(),
            shape: view.shape().to_vec(),
        });
    }
    let t = decode(path, key, view, &Device::Cpu)?;
    Ok(t.flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|source| KohyaError::Tensor {
            name: key.to_string(),
            source,
        })?[0])
}

/// A model module an adapter file may fill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedModule {
    pub component: KohyaComponent,
    /// diffusers/transformers module path, e.g. `down_blocks.1.attentions.0.proj_in`.
    pub module_path: String,
    pub down_shape: Vec<usize>,
    pub up_shape: Vec<usize>,
}

/// A file module resolved to a model module; tensors are f32.
#[derive(Debug, Clone)]
pub struct MatchedModule {
    /// Index into the `expected` slice given to [`match_to_model`].
    pub expected_index: usize,
    pub down: Tensor,
    pub up: Tensor,
    pub alpha: f32,
}

#[derive(Debug, Clone)]
pub struct MatchReport {
    /// In file (name) order.
    pub matched: Vec<MatchedModule>,
    /// Indices of expected modules the file does not hold (they keep their fresh init).
    pub missing: Vec<usize>,
}

/// Resolves every module of `file` to one of `expected` by kohya name and checks its shapes.
/// See the module header for the policy on unknown, mismatched and missing modules.
pub fn match_to_model(
    file: &KohyaFile,
    naming: &KohyaNaming,
    expected: &[ExpectedModule],
) -> Result<MatchReport, KohyaError> {
    if file.modules.is_empty() {
        return Err(KohyaError::Empty {
            path: file.path.clone(),
        });
    }
    let resolver = KohyaResolver::new(
        naming,
        expected
            .iter()
            .map(|e| (e.component, e.module_path.as_str())),
    )?;
    let mut unknown = Vec::new();
    let mut mismatches = Vec::new();
    let mut taken: HashMap<usize, &str> = HashMap::new();
    let mut matched = Vec::new();
    for m in &file.modules {
        let Some(index) = resolver.resolve(&m.name) else {
            unknown.push(m.name.clone());
            continue;
        };
        if let Some(first) = taken.insert(index, &m.name) {
            return Err(KohyaError::DuplicateModule {
                path: file.path.clone(),
                first: first.to_string(),
                second: m.name.clone(),
                index,
            });
        }
        let want = &expected[index];
        for (suffix, have, wanted) in [
            (DOWN, m.down.dims(), &want.down_shape),
            (UP, m.up.dims(), &want.up_shape),
        ] {
            if have != wanted.as_slice() {
                mismatches.push(format!(
                    "shape mismatch for {}{suffix}: file has {have:?}, model wants {wanted:?}",
                    m.name
                ));
            }
        }
        matched.push(MatchedModule {
            expected_index: index,
            down: m.down.clone(),
            up: m.up.clone(),
            alpha: m.alpha,
        });
    }
    if !unknown.is_empty() {
        let naming = if naming.is_sdxl() {
            "SDXL naming: lora_unet_ with LDM block names, lora_te1_, lora_te2_"
        } else {
            "SD1/SD2 naming: lora_unet_ with diffusers names, lora_te_"
        };
        return Err(KohyaError::UnknownModules {
            path: file.path.clone(),
            naming,
            names: unknown,
        });
    }
    if !mismatches.is_empty() {
        return Err(KohyaError::ShapeMismatch {
            path: file.path.clone(),
            mismatches,
        });
    }
    let missing = (0..expected.len())
        .filter(|i| !taken.contains_key(i))
        .collect();
    Ok(MatchReport { matched, missing })
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
    fn pair_rank_accepts_linear_and_conv() {
        assert_eq!(pair_rank(&[4, 320], &[640, 4]), Some(4));
        assert_eq!(pair_rank(&[4, 320, 3, 3], &[640, 4, 1, 1]), Some(4));
        assert_eq!(pair_rank(&[4, 320], &[640, 8]), None);
        assert_eq!(pair_rank(&[4, 320, 3, 3], &[640, 4, 3, 3]), None);
        assert_eq!(pair_rank(&[0, 320], &[640, 0]), None);
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
