//! The kohya-named adapter safetensors file (LoRA, LoCon, and LyCORIS's LoHa, LoKr and DoRA):
//! saving, loading, and matching a loaded file against the model's adapter modules (for
//! `adapter.init_from`).
//!
//! Layout (kohya sd-scripts `networks/lora.py`, `LoRANetwork.save_weights`; LyCORIS
//! `lycoris/kohya.py` writes the same names), per module `<name>` (see [`super::kohya_names`]):
//! - LoRA/LoCon: `<name>.lora_down.weight` [r, in] or [r, in, kh, kw], `<name>.lora_up.weight`
//!   [out, r] or [out, r, 1, 1];
//! - LoHa: `hada_w1_a`, `hada_w1_b`, `hada_w2_a`, `hada_w2_b`; LoKr: `lokr_w1` (or `lokr_w1_a`,
//!   `lokr_w1_b`) and `lokr_w2` (or `lokr_w2_a`, `lokr_w2_b`); DoRA adds `dora_scale` to any of
//!   them (see [`super::factors`] for the shapes and the update each encodes);
//! - `<name>.alpha`, a 0-d tensor (`torch.tensor(alpha)`). A file without `.alpha` means a scale
//!   of 1 (alpha = r), as kohya and LyCORIS read it.
//!
//! Every tensor, alpha included, is written in the file dtype (fp16 by default, as kohya's
//! `--save_precision fp16`). The header is [`super::kohya_meta`]'s.
//!
//! Loaded tensors are returned as f32 (the adapter keeps f32 masters). Keys with another suffix
//! (LyCORIS's Tucker `lora_mid`/`hada_t1`/`lokr_t2`, full `diff`, OFT, IA3, train_norm's
//! `w_norm`/`b_norm`, …) are an error naming them (the first [`LISTED`] and the count), never
//! dropped; so is a module whose keys mix two types or miss one, and an output-axis DoRA module
//! (LyCORIS `wd_on_output=True`, `dora_scale` `[out, 1]`). The one exception: the
//! textual-inversion embeddings OneTrainer bundles beside the LoRA (`bundle_emb.<placeholder>.…`)
//! are set aside in [`KohyaFile::bundled_embeddings`]: [`super::embedding_file::load_bundled`]
//! reads them, and a caller that does not can warn ([`KohyaFile::bundled_embeddings_warning`]).
//!
//! [`match_to_model`] policy: every module of the file must name a module of the model (else an
//! error lists all that do not), with the model's keys and shapes (else an error lists every
//! mismatch). Model modules absent from the file are allowed and returned in
//! [`MatchReport::missing`]: they keep their fresh initialisation (a no-op), which is what resuming
//! a LoRA file into a LoCon run, or a UNet-only file into a run that also trains the text encoder,
//! needs. The caller should log that count.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView, View};

use super::addnet_hash::addnet_hashes;
use super::diffusers_keys::{diffusers_key, metadata_alphas};
use super::factors::{self, Algo, ALL_SUFFIXES, DOWN, UP};
pub use super::kohya_meta::{py_float, KohyaBase, KohyaMetadata};
use super::kohya_names::{KohyaComponent, KohyaNameError, KohyaNaming, KohyaResolver};
use crate::error_chain::External;
use crate::fsutil::{self, FsError};

const ALPHA: &str = "alpha";

/// How many keys, modules or mismatches an error names before it gives only the count (a real
/// SDXL file has thousands of keys).
pub const LISTED: usize = 8;

/// The first [`LISTED`] of `items` joined by `sep`, then how many more there are.
pub(super) fn listed(items: &[String], sep: &str) -> String {
    let mut s = items
        .iter()
        .take(LISTED)
        .cloned()
        .collect::<Vec<_>>()
        .join(sep);
    if items.len() > LISTED {
        s.push_str(&format!("{sep}… and {} more", items.len() - LISTED));
    }
    s
}

/// The key prefix of OneTrainer's bundled textual-inversion embeddings
/// (`StableDiffusionLoRASaver`: `bundle_emb.<placeholder>.clip_l`, and `.clip_g` for SDXL; A1111's
/// `extra_networks_lora` reads them).
const BUNDLE_EMB: &str = "bundle_emb.";

#[derive(Debug, thiserror::Error)]
pub enum KohyaError {
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: cannot read it as a torch file", path.display())]
    Torch {
        path: PathBuf,
        source: Box<crate::torch_pickle::ConvertError>,
    },
    #[error("{} is not a valid safetensors file{}", path.display(), crate::file_sniff::safetensors_note(path))]
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
    #[error("{}: tensor `{name}` has dtype {dtype:?}; only F16, BF16, F32 and F64 are read (and integer alphas)", path.display())]
    LoadDtype {
        path: PathBuf,
        name: String,
        dtype: StDtype,
    },
    #[error(
        "{}: {} key(s) are not adapter weights sdtrain reads (`<module>.lora_down.weight`, \
         `.lora_up.weight`, `.hada_w*`, `.lokr_w*`, `.dora_scale`, `.alpha`, or diffusers' \
         `unet.<path>.lora_A.weight`/`.lora_B.weight`, `.lora.down.weight`/`.lora.up.weight`){hint}: {}",
        path.display(), keys.len(), listed(keys, ", ")
    )]
    UnsupportedKeys {
        path: PathBuf,
        keys: Vec<String>,
        hint: String,
    },
    #[error(
        "{}: module `{name}`: `dora_scale` {shape:?}: output-axis DoRA (LyCORIS \
         wd_on_output=True) is not supported; sdtrain reads input-axis DoRA (`dora_scale` \
         [1, in], LyCORIS wd_on_output=False), the form A1111 loads",
        path.display()
    )]
    OutputAxisDora {
        path: PathBuf,
        name: String,
        shape: Vec<usize>,
    },
    #[error(
        "{}: module `{name}` has {present:?}, which is no complete adapter (want {want})",
        path.display()
    )]
    Incomplete {
        path: PathBuf,
        name: String,
        present: Vec<String>,
        want: &'static str,
    },
    #[error("{}: module `{name}`: {problem}", path.display())]
    BadFactors {
        path: PathBuf,
        name: String,
        problem: String,
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
    #[error(
        "{}: tensor `{name}` holds {value} (the file is damaged, or was saved from a run whose \
         weights diverged)",
        path.display()
    )]
    NonFinite {
        path: PathBuf,
        name: String,
        value: f32,
    },
    #[error("{}: the header's `lora_adapter_metadata` {problem}", path.display())]
    BadMetadata { path: PathBuf, problem: String },
    #[error("{}: holds no LoRA modules", path.display())]
    Empty { path: PathBuf },
    #[error("cannot save module `{name}`: {problem}")]
    BadModule { name: String, problem: String },
    #[error(transparent)]
    Name(#[from] KohyaNameError),
    #[error(
        "{}: {} module(s) match no module of the model ({naming}): {}",
        path.display(), names.len(), listed(names, ", ")
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
    #[error(
        "{}: {} module(s) do not fit the model: {}",
        path.display(), mismatches.len(), listed(mismatches, "; ")
    )]
    ShapeMismatch {
        path: PathBuf,
        mismatches: Vec<String>,
    },
}

/// One module to save: its full kohya name (e.g. `lora_unet_down_blocks_0_…_to_q`), its tensors
/// by key suffix (`lora_down.weight`, `hada_w1_a`, …) in any float dtype and on any device, and
/// alpha.
#[derive(Debug, Clone)]
pub struct KohyaTensorSet {
    pub name: String,
    pub tensors: Vec<(String, Tensor)>,
    pub alpha: f32,
}

impl KohyaTensorSet {
    /// A LoRA/LoCon module: `down` and `up`.
    pub fn lora(name: &str, down: Tensor, up: Tensor, alpha: f32) -> Self {
        Self {
            name: name.to_string(),
            tensors: vec![(DOWN.to_string(), down), (UP.to_string(), up)],
            alpha,
        }
    }
}

/// A tensor already encoded for the file.
pub(super) struct Encoded {
    dtype: StDtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl Encoded {
    /// A tensor's bytes as they are (a dtype sdtrain does not convert).
    pub(super) fn raw(dtype: StDtype, shape: Vec<usize>, bytes: Vec<u8>) -> Self {
        Self {
            dtype,
            shape,
            bytes,
        }
    }
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

pub(super) fn encode_values(
    values: &[f32],
    shape: Vec<usize>,
    dtype: DType,
) -> Result<Encoded, KohyaError> {
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

pub(super) fn encode_tensor(name: &str, t: &Tensor, dtype: DType) -> Result<Encoded, KohyaError> {
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

/// Checks that a module's tensors (by suffix) form one complete adapter whose factors agree on
/// their inner dimensions; returns its type.
fn check_factors(dims: &BTreeMap<&str, &[usize]>) -> Result<Algo, String> {
    let suffixes: Vec<&str> = dims.keys().copied().collect();
    let algo =
        Algo::detect(&suffixes).ok_or_else(|| format!("{suffixes:?} are no complete adapter"))?;
    let d = |s: &str| dims.get(s).copied().unwrap_or(&[]);
    let pairs: &[(&str, &str)] = match algo {
        Algo::LowRank => {
            return pair_rank(d(DOWN), d(UP)).map(|_| algo).ok_or_else(|| {
                format!(
                    "lora_down {:?} and lora_up {:?} are not a LoRA pair (want down [r, in] / \
                     up [out, r], or down [r, in, kh, kw] / up [out, r, 1, 1])",
                    d(DOWN),
                    d(UP)
                )
            })
        }
        Algo::Hadamard => &[
            (factors::HADA_W1_A, factors::HADA_W1_B),
            (factors::HADA_W2_A, factors::HADA_W2_B),
        ],
        Algo::Kron => &[
            (factors::LOKR_W1_A, factors::LOKR_W1_B),
            (factors::LOKR_W2_A, factors::LOKR_W2_B),
        ],
    };
    for (a, b) in pairs {
        let (da, db) = (d(a), d(b));
        if da.is_empty() && db.is_empty() {
            continue;
        }
        if da.len() != 2 || db.len() < 2 || da[1] != db[0] || da[1] == 0 {
            return Err(format!(
                "`{a}` {da:?} and `{b}` {db:?} are not a low-rank pair"
            ));
        }
    }
    Ok(algo)
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
    save_kohya_with(path, modules, &[], metadata, dtype)
}

/// [`save_kohya`] with `extra` tensors under their own keys beside the modules (embeddings
/// bundled as `bundle_emb.<token>.…`), in the same dtype.
pub fn save_kohya_with(
    path: &Path,
    modules: &[KohyaTensorSet],
    extra: &[(String, Tensor)],
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
        let dims: BTreeMap<&str, &[usize]> = m
            .tensors
            .iter()
            .map(|(k, t)| (k.as_str(), t.dims()))
            .collect();
        if let Err(problem) = check_factors(&dims) {
            return Err(KohyaError::BadModule {
                name: m.name.clone(),
                problem,
            });
        }
        for (suffix, t) in &m.tensors {
            let key = format!("{}.{suffix}", m.name);
            tensors.push((key.clone(), encode_tensor(&key, t, dtype)?));
        }
        // 0-d, like kohya's `torch.tensor(alpha)`.
        tensors.push((
            format!("{}.{ALPHA}", m.name),
            encode_values(&[m.alpha], Vec::new(), dtype)?,
        ));
    }
    for (key, t) in extra {
        tensors.push((key.clone(), encode_tensor(key, t, dtype)?));
    }
    write_hashed(path, &tensors, metadata.to_header())
}

/// Writes `tensors` to `path` atomically with `header` and kohya's `sshs_model_hash` and
/// `sshs_legacy_hash` (`save_weights`: the hashes of the file as written with its `ss_*` keys
/// alone).
pub(super) fn write_hashed(
    path: &Path,
    tensors: &[(String, Encoded)],
    mut header: HashMap<String, String>,
) -> Result<(), KohyaError> {
    let serialize = |header: HashMap<String, String>| {
        safetensors::tensor::serialize(tensors.iter().map(|(n, e)| (n.as_str(), e)), Some(header))
            .map_err(|source| KohyaError::Serialize {
                path: path.to_path_buf(),
                source: External(source),
            })
    };
    let training: HashMap<String, String> = header
        .iter()
        .filter(|(k, _)| k.starts_with("ss_"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let (model_hash, legacy_hash) = addnet_hashes(&serialize(training)?);
    header.insert("sshs_model_hash".to_string(), model_hash);
    header.insert("sshs_legacy_hash".to_string(), legacy_hash);
    fsutil::write_atomic(path, serialize(header)?)?;
    Ok(())
}

/// One module read from a file; tensors are f32.
#[derive(Debug, Clone)]
pub struct KohyaModule {
    pub name: String,
    pub algo: Algo,
    /// By key suffix (`lora_down.weight`, `hada_w1_a`, `dora_scale`, …).
    pub tensors: BTreeMap<String, Tensor>,
    /// The file's alpha, or the one that makes the scale 1 when the file has none (kohya's and
    /// LyCORIS's convention).
    pub alpha: f32,
    /// Whether the file held `<name>.alpha`.
    pub alpha_in_file: bool,
}

impl KohyaModule {
    pub fn get(&self, suffix: &str) -> Option<&Tensor> {
        self.tensors.get(suffix)
    }

    /// Whether the module adapts a 3×3 (or larger) conv: LoCon's extra targets, at `conv_dim`.
    pub fn is_conv3x3(&self) -> bool {
        self.tensors
            .values()
            .any(|t| t.dims().len() == 4 && t.dims()[2..].iter().any(|&k| k > 1))
    }

    /// LoRA's `lora_down.weight`.
    pub fn down(&self) -> Option<&Tensor> {
        self.get(DOWN)
    }

    /// LoRA's `lora_up.weight`.
    pub fn up(&self) -> Option<&Tensor> {
        self.get(UP)
    }

    /// The rank the scale divides alpha by (see [`factors::scale`]); 0 for a LoKr of two full
    /// halves, whose scale is 1.
    pub fn rank(&self) -> usize {
        let dim = |s: &str, i: usize| self.get(s).and_then(|t| t.dims().get(i).copied());
        match self.algo {
            Algo::LowRank => dim(DOWN, 0),
            Algo::Hadamard => dim(factors::HADA_W1_B, 0),
            Algo::Kron => dim(factors::LOKR_W2_A, 1).or_else(|| dim(factors::LOKR_W1_A, 1)),
        }
        .unwrap_or(0)
    }

    /// The update this module encodes for a weight of shape `w`, f32: `ΔW`, or DoRA's `W' − W`
    /// when the module has a `dora_scale` (then `weight` must be given).
    pub fn weight_update(
        &self,
        w: &[usize],
        weight: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let get = |s: &str| self.get(s).cloned();
        let delta = factors::delta_weight(self.algo, &get, f64::from(self.alpha), w)?;
        match (self.get(factors::DORA_SCALE), weight) {
            (None, _) => Ok(delta),
            (Some(m), Some(weight)) => {
                factors::dora_update(&weight.to_dtype(DType::F32)?, &delta, m)
            }
            (Some(_), None) => candle_core::bail!("a DoRA module needs the layer's weight"),
        }
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
    /// The placeholders of the textual-inversion embeddings bundled in the file (OneTrainer's
    /// `bundle_emb.<placeholder>.clip_l`), sorted; not loaded here.
    pub bundled_embeddings: Vec<String>,
}

impl KohyaFile {
    /// The warning line to print when the file bundles textual-inversion embeddings, which
    /// sdtrain does not load (its LoRA part is used all the same).
    pub fn bundled_embeddings_warning(&self) -> Option<String> {
        if self.bundled_embeddings.is_empty() {
            return None;
        }
        let names: Vec<String> = self
            .bundled_embeddings
            .iter()
            .map(|p| format!("`{p}`"))
            .collect();
        Some(format!(
            "warning: {}: the bundled textual-inversion embedding(s) {} are not loaded with the \
             LoRA here (`embedding.init_from` continues one; `sdtrain sample --lora` loads them); \
             its LoRA part is used",
            self.path.display(),
            listed(&names, ", ")
        ))
    }
}

pub(super) fn decode(
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
        // Some merge tools keep f64 (a scale, or weights computed in double).
        StDtype::F64 => data
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f32)
            .collect(),
        dtype => {
            return Err(KohyaError::LoadDtype {
                path: path.to_path_buf(),
                name: name.to_string(),
                dtype,
            })
        }
    };
    if let Some(bad) = values.iter().find(|v| !v.is_finite()) {
        return Err(KohyaError::NonFinite {
            path: path.to_path_buf(),
            name: name.to_string(),
            value: *bad,
        });
    }
    Tensor::from_vec(values, view.shape(), device).map_err(|source| KohyaError::Tensor {
        name: name.to_string(),
        source,
    })
}

/// A hint for keys of adapter formats we do not read, naming what each kind of key found is.
fn unsupported_hint(keys: &[String]) -> String {
    let any = |f: &dyn Fn(&str) -> bool| keys.iter().any(|k| f(k));
    let lycoris: [(bool, &str); 5] = [
        (
            any(&|k| k.ends_with(".w_norm") || k.ends_with(".b_norm")),
            "LyCORIS norm weights (train_norm) are not supported (`w_norm`, `b_norm`)",
        ),
        (
            any(&|k| k.contains("lora_mid") || k.contains("hada_t") || k.contains("lokr_t")),
            "LyCORIS Tucker decompositions (`lora_mid`, `hada_t*`, `lokr_t2`) are not supported",
        ),
        (
            any(&|k| k.ends_with(".on_input")),
            "LyCORIS IA3 (`weight`, `on_input`) is not supported",
        ),
        (
            any(&|k| k.contains(".diff")),
            "LyCORIS full (`diff`) is not supported",
        ),
        (
            any(&|k| k.contains("oft_")),
            "LyCORIS OFT/BOFT is not supported",
        ),
    ];
    let found: Vec<&str> = lycoris
        .iter()
        .filter(|(f, _)| *f)
        .map(|(_, t)| *t)
        .collect();
    if !found.is_empty() {
        format!(
            " ({}; LoRA, LoCon, LoHa, LoKr and DoRA are read)",
            found.join("; ")
        )
    } else if any(&|k| k.contains("lora_magnitude_vector")) {
        " (PEFT's DoRA keeps its magnitude per output channel, where the kohya/LyCORIS DoRA \
         sdtrain reads keeps it per input channel; save the LoRA without DoRA, or as a \
         LyCORIS DoRA)"
            .to_string()
    } else if any(&|k| k.starts_with("base_model.model.")) {
        " (a PEFT `save_pretrained` adapter: load it into the pipeline with diffusers and save \
         it with `save_lora_weights`, which writes the unet./text_encoder. keys sdtrain reads)"
            .to_string()
    } else {
        String::new()
    }
}

/// The bytes of an adapter file as safetensors: the file itself, or for a file `torch.save` wrote
/// (kohya's `save_model_as = "pt"`), its safetensors image, read as data ([`crate::torch_pickle`]).
pub fn adapter_bytes(path: &Path) -> Result<Vec<u8>, KohyaError> {
    if crate::torch_pickle::is_torch_file(path) {
        crate::torch_pickle::to_bytes(path, Default::default()).map_err(|source| {
            KohyaError::Torch {
                path: path.to_path_buf(),
                source: Box::new(source),
            }
        })
    } else {
        std::fs::read(path).map_err(|source| KohyaError::Read {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// Reads a kohya LoRA/LoCon file. Tensors are decoded to f32 on `device`. A LoRA saved by
/// `torch.save` (kohya's `save_model_as = "pt"`/`"ckpt"`) is read as data, never run
/// ([`crate::torch_pickle`]), through a safetensors image of it in memory.
pub fn load_kohya(path: &Path, device: &Device) -> Result<KohyaFile, KohyaError> {
    let bytes = adapter_bytes(path)?;
    let format_err = |source| KohyaError::Format {
        path: path.to_path_buf(),
        source: External(source),
    };
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(format_err)?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let st = SafeTensors::deserialize(&bytes).map_err(format_err)?;

    let tensors = st.tensors();
    let (by_module, bundled_embeddings) = group_by_module(path, &tensors)?;
    let mut modules = Vec::with_capacity(by_module.len());
    for (name, parts) in by_module {
        modules.push(load_module(path, &name, parts, device)?);
    }
    set_metadata_alphas(path, &metadata, &mut modules)?;
    Ok(KohyaFile {
        path: path.to_path_buf(),
        modules,
        metadata,
        bundled_embeddings,
    })
}

/// One module's tensors in the file by suffix, each with its key.
type Parts<'a> = BTreeMap<&'static str, (&'a str, TensorView<'a>)>;

/// Groups the file's tensors by module name; a key with no known suffix is an error. Keys in
/// diffusers' layouts ([`super::diffusers_keys`]) group under their dotted module name. Also
/// returns the placeholders of bundled embeddings (`bundle_emb.<placeholder>.<vector>`, split as
/// A1111 splits them), sorted, which are set aside.
fn group_by_module<'a>(
    path: &Path,
    tensors: &'a [(String, TensorView<'a>)],
) -> Result<(BTreeMap<String, Parts<'a>>, Vec<String>), KohyaError> {
    let mut by_module: BTreeMap<String, Parts<'_>> = BTreeMap::new();
    let mut unsupported = Vec::new();
    let mut embeddings = std::collections::BTreeSet::new();
    for (key, view) in tensors {
        let key = key.as_str();
        if let Some((placeholder, _vector)) = key
            .strip_prefix(BUNDLE_EMB)
            .and_then(|rest| rest.split_once('.'))
        {
            embeddings.insert(placeholder.to_string());
            continue;
        }
        let hit = diffusers_key(key).or_else(|| {
            ALL_SUFFIXES.iter().chain(&[ALPHA]).find_map(|suffix| {
                let module = key.strip_suffix(suffix)?.strip_suffix('.')?;
                Some((module.to_string(), *suffix))
            })
        });
        match hit {
            Some((module, suffix)) => {
                let parts = by_module.entry(module).or_default();
                if let Some((first, _)) = parts.insert(suffix, (key, view.clone())) {
                    return Err(KohyaError::BadFactors {
                        path: path.to_path_buf(),
                        name: key.to_string(),
                        problem: format!("holds the same factor as `{first}`"),
                    });
                }
            }
            None => unsupported.push(key.to_string()),
        }
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
    Ok((by_module, embeddings.into_iter().collect()))
}

/// The alphas a diffusers file's `lora_adapter_metadata` gives, for modules without an `.alpha`
/// key ([`super::diffusers_keys::metadata_alphas`]).
fn set_metadata_alphas(
    path: &Path,
    metadata: &HashMap<String, String>,
    modules: &mut [KohyaModule],
) -> Result<(), KohyaError> {
    let ranks: Vec<(&str, usize)> = modules
        .iter()
        .filter(|m| !m.alpha_in_file)
        .map(|m| (m.name.as_str(), m.rank()))
        .collect();
    let alphas = metadata_alphas(metadata, &ranks).map_err(|problem| KohyaError::BadMetadata {
        path: path.to_path_buf(),
        problem,
    })?;
    for m in modules.iter_mut() {
        if let Some(&a) = alphas.get(&m.name) {
            m.alpha = a;
        }
    }
    Ok(())
}

/// Checks module `name`'s tensors (one complete adapter, agreeing factors) and decodes them onto
/// `device`.
fn load_module(
    path: &Path,
    name: &str,
    mut parts: Parts<'_>,
    device: &Device,
) -> Result<KohyaModule, KohyaError> {
    let alpha_part = parts.remove(ALPHA);
    let dims: BTreeMap<&str, &[usize]> = parts.iter().map(|(s, (_, v))| (*s, v.shape())).collect();
    let suffixes: Vec<&str> = dims.keys().copied().collect();
    let Some(algo) = Algo::detect(&suffixes) else {
        let want = if suffixes.iter().any(|s| s.starts_with("hada_")) {
            Algo::Hadamard.describe()
        } else if suffixes.iter().any(|s| s.starts_with("lokr_")) {
            Algo::Kron.describe()
        } else {
            Algo::LowRank.describe()
        };
        let mut present: Vec<String> = suffixes.iter().map(|s| s.to_string()).collect();
        if alpha_part.is_some() {
            present.push(ALPHA.to_string());
        }
        return Err(KohyaError::Incomplete {
            path: path.to_path_buf(),
            name: name.to_string(),
            present,
            want,
        });
    };
    if algo == Algo::LowRank {
        if let (Some(d), Some(u)) = (dims.get(DOWN), dims.get(UP)) {
            if pair_rank(d, u).is_none() {
                return Err(KohyaError::BadPair {
                    path: path.to_path_buf(),
                    name: name.to_string(),
                    down: d.to_vec(),
                    up: u.to_vec(),
                });
            }
        }
    }
    check_factors(&dims).map_err(|problem| KohyaError::BadFactors {
        path: path.to_path_buf(),
        name: name.to_string(),
        problem,
    })?;
    // Input-axis DoRA keeps one magnitude per input channel, `[1, in(, 1, 1)]`; LyCORIS's
    // `wd_on_output=True` keeps one per output channel, `[out, 1(, 1, 1)]`.
    if let Some(&shape) = dims.get(factors::DORA_SCALE) {
        if shape.first().is_some_and(|&d| d != 1) {
            return Err(KohyaError::OutputAxisDora {
                path: path.to_path_buf(),
                name: name.to_string(),
                shape: shape.to_vec(),
            });
        }
    }
    let mut tensors = BTreeMap::new();
    for (suffix, (key, view)) in &parts {
        tensors.insert(suffix.to_string(), decode(path, key, view, device)?);
    }
    let mut module = KohyaModule {
        name: name.to_string(),
        algo,
        tensors,
        alpha: 1.0,
        alpha_in_file: alpha_part.is_some(),
    };
    module.alpha = match &alpha_part {
        Some((key, view)) => read_alpha(path, key, view)?,
        None => module.rank().max(1) as f32,
    };
    Ok(module)
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
    // kohya's svd_merge_lora.py stores the new rank as an int64 alpha; kohya, A1111 and
    // ComfyUI read any number (`alpha.item()`).
    let d = view.data();
    let int = |n: usize| -> Option<f32> {
        let b = d.get(..n)?;
        let mut w = [0u8; 8];
        w[..n].copy_from_slice(b);
        // Sign-extend from the top byte of the stored width.
        if b[n - 1] & 0x80 != 0 {
            w[n..].fill(0xff);
        }
        Some(i64::from_le_bytes(w) as f32)
    };
    let uint = |n: usize| -> Option<f32> {
        let mut w = [0u8; 8];
        w[..n].copy_from_slice(d.get(..n)?);
        Some(u64::from_le_bytes(w) as f32)
    };
    let integer = match view.dtype() {
        StDtype::I64 => int(8),
        StDtype::I32 => int(4),
        StDtype::I16 => int(2),
        StDtype::I8 => int(1),
        StDtype::U64 => uint(8),
        StDtype::U32 => uint(4),
        StDtype::U16 => uint(2),
        StDtype::U8 => uint(1),
        _ => None,
    };
    if let Some(alpha) = integer {
        return Ok(alpha);
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
    /// The module's tensors by key suffix, with their shapes.
    pub shapes: Vec<(String, Vec<usize>)>,
}

impl ExpectedModule {
    /// A LoRA/LoCon module's `down` and `up` shapes.
    pub fn lora(component: KohyaComponent, path: &str, down: &[usize], up: &[usize]) -> Self {
        Self {
            component,
            module_path: path.to_string(),
            shapes: vec![
                (DOWN.to_string(), down.to_vec()),
                (UP.to_string(), up.to_vec()),
            ],
        }
    }
}

/// A file module resolved to a model module; tensors are f32.
#[derive(Debug, Clone)]
pub struct MatchedModule {
    /// Index into the `expected` slice given to [`match_to_model`].
    pub expected_index: usize,
    pub module: KohyaModule,
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
        mismatches.extend(module_mismatches(m, &expected[index]));
        matched.push(MatchedModule {
            expected_index: index,
            module: m.clone(),
        });
    }
    if !unknown.is_empty() {
        let naming = if naming.is_sdxl() {
            "SDXL naming: lora_unet_ with LDM block names (or diffusers names under lora_unet_ \
             or lycoris_), lora_te1_, lora_te2_, or diffusers' unet., text_encoder., \
             text_encoder_2."
        } else {
            "SD1/SD2 naming: lora_unet_ (or lycoris_) with diffusers names, lora_te_, or \
             diffusers' unet., text_encoder."
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

/// How a file module differs from the model's: other keys (another adapter type), or other
/// shapes.
fn module_mismatches(m: &KohyaModule, want: &ExpectedModule) -> Vec<String> {
    let have: Vec<&str> = m.tensors.keys().map(String::as_str).collect();
    let wanted: Vec<&str> = want.shapes.iter().map(|(s, _)| s.as_str()).collect();
    let (mut h, mut w) = (have.clone(), wanted.clone());
    h.sort_unstable();
    w.sort_unstable();
    if h != w {
        return vec![format!(
            "{} holds {have:?}, the model's module has {wanted:?} (another adapter type or \
             LoKr layout; set `mode` and `adapter` to match the file)",
            m.name
        )];
    }
    want.shapes
        .iter()
        .filter_map(|(suffix, wanted)| {
            let have = m.tensors.get(suffix)?.dims();
            (have != wanted.as_slice()).then(|| {
                format!(
                    "shape mismatch for {}.{suffix}: file has {have:?}, model wants {wanted:?}",
                    m.name
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pair_rank_accepts_linear_and_conv() {
        assert_eq!(pair_rank(&[4, 320], &[640, 4]), Some(4));
        assert_eq!(pair_rank(&[4, 320, 3, 3], &[640, 4, 1, 1]), Some(4));
        assert_eq!(pair_rank(&[4, 320], &[640, 8]), None);
        assert_eq!(pair_rank(&[4, 320, 3, 3], &[640, 4, 3, 3]), None);
        assert_eq!(pair_rank(&[0, 320], &[640, 0]), None);
    }
}
