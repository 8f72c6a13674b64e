//! Saving a fine-tuned model as a complete diffusers pipeline folder that both sdtrain and
//! diffusers (`StableDiffusionPipeline.from_pretrained`, `StableDiffusionXLPipeline…`) load.
//!
//! The folder is the base pipeline ([`ModelLayout`]) with the trained components rewritten:
//! - an updated component gets one plain-named safetensors file,
//!   `<component>/diffusion_pytorch_model.safetensors` (UNet, VAE) or `model.safetensors`
//!   (text encoders), holding every tensor of the base checkpoint under its checkpoint name: the
//!   updated values where given, the base values otherwise (buffers the model never reads, such
//!   as an old CLIP `position_ids`, survive). Callers name tensors as the base stores them
//!   (`Weights::checkpoint_params`), so a text encoder keeps its key layout, with or without
//!   `text_model.`, and loads wherever the base did. Float tensors are written in the requested
//!   dtype; integer tensors keep theirs. The base's shards, shard index or `.fp16` variant names
//!   are not carried over for that component;
//! - every other component's weights are copied byte for byte, under the plain names diffusers
//!   loads without a `variant` argument (`<base>.fp16.safetensors` → `<base>.safetensors`, a
//!   variant shard index → `<base>.safetensors.index.json`, shards under their own names);
//! - configs, tokenizer files and other small JSON files of each copied folder come along
//!   unchanged; `model_index.json` is copied with components the new folder lacks (e.g. a
//!   `safety_checker` the base never downloaded) set to `[null, null]`, as diffusers itself
//!   writes absent components.
//!
//! Everything is written into `<out_dir>.tmp-<pid>` and renamed into place at the end
//! ([`StagedDir`]), so `out_dir` is either the previous version or the complete new one. The
//! safetensors writer streams one tensor at a time (a GPU tensor is copied to the host only while
//! it is written); the header carries `{"format": "pt"}`, which transformers checks.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor, Var};
use serde_json::{json, Value};

use super::family::ModelLayout;
use super::files::{self, Component, ComponentFiles, FilesError};
use crate::error_chain::External;
use crate::fsutil::{self, FsError, StagedDir};
use crate::tensor_view::TensorView;

/// JSON files larger than this are not "small" and are not copied beside the listed files.
const SMALL_JSON_BYTES: u64 = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("export dtype {0:?} is not supported: use f32, f16 or bf16")]
    Dtype(DType),
    #[error("the base pipeline {} has no `{component}` component to update", root.display())]
    MissingComponent { root: PathBuf, component: Component },
    #[error("`{0}` is listed twice among the updated components")]
    Duplicate(Component),
    #[error(
        "refusing to export into {}: it would replace the base model {}",
        out.display(),
        base.display()
    )]
    IntoBase { out: PathBuf, base: PathBuf },
    #[error("{component}: updated tensor `{name}` is not in the base checkpoint {files}")]
    UnknownTensor {
        component: Component,
        name: String,
        files: String,
    },
    #[error("{component}: tensor `{name}` is given twice")]
    DuplicateTensor { component: Component, name: String },
    #[error("{component}: tensor `{name}` has shape {got:?}, the base checkpoint has {want:?}")]
    Shape {
        component: Component,
        name: String,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    #[error("{component}: cannot read the base weights {files}")]
    Base {
        component: Component,
        files: String,
        source: Box<External<candle_core::Error>>,
    },
    #[error("{component}: tensor `{name}`")]
    Tensor {
        component: Component,
        name: String,
        source: Box<candle_core::Error>,
    },
    #[error("{component}: tensor `{name}` has dtype {dtype:?}, which the export cannot write")]
    TensorDtype {
        component: Component,
        name: String,
        dtype: DType,
    },
    #[error("writing {}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{folder}: {message}")]
    Tokenizer { folder: String, message: String },
    #[error(transparent)]
    Fs(#[from] FsError),
    #[error(transparent)]
    Files(#[from] FilesError),
}

/// Anything that holds a tensor to export: a plain [`Tensor`] or a trained [`Var`], so
/// `Weights::params()` can be passed as is.
pub trait ExportTensor {
    fn export_tensor(&self) -> &Tensor;
}

impl ExportTensor for Tensor {
    fn export_tensor(&self) -> &Tensor {
        self
    }
}

impl ExportTensor for Var {
    fn export_tensor(&self) -> &Tensor {
        self.as_tensor()
    }
}

/// The weights file name diffusers/transformers load for `component` without a variant.
pub fn weights_file_name(component: Component) -> &'static str {
    match component {
        Component::Unet | Component::Vae => "diffusion_pytorch_model.safetensors",
        Component::TextEncoder | Component::TextEncoder2 => "model.safetensors",
    }
}

/// Writes the diffusers folder `out_dir`: the `base` pipeline with the `updated` components'
/// tensors (by checkpoint name) replaced, float tensors of those components in `dtype`
/// (f32, f16 or bf16). See the module header for what is written and how.
pub fn save_diffusers_folder<T: ExportTensor>(
    base: &ModelLayout,
    out_dir: &Path,
    updated: &[(Component, Vec<(String, T)>)],
    dtype: DType,
) -> Result<(), ExportError> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => {}
        other => return Err(ExportError::Dtype(other)),
    }
    let mut updates: BTreeMap<Component, &[(String, T)]> = BTreeMap::new();
    for (component, tensors) in updated {
        if base.component(*component).is_none() {
            return Err(ExportError::MissingComponent {
                root: base.root.clone(),
                component: *component,
            });
        }
        if updates.insert(*component, tensors.as_slice()).is_some() {
            return Err(ExportError::Duplicate(*component));
        }
    }
    check_not_base(base, out_dir)?;
    if base.single_file.is_some() {
        return save_from_single_file(base, out_dir, &updates, dtype);
    }

    let stage = StagedDir::new(out_dir)?;
    let root = stage.path();
    let mut folders: BTreeSet<String> = BTreeSet::new();

    folders.insert("scheduler".to_string());
    copy_folder_files(
        base,
        root,
        "scheduler",
        std::slice::from_ref(&base.scheduler_config),
    )?;
    for c in &base.components {
        let folder = c.component.folder();
        folders.insert(folder.to_string());
        copy_folder_files(base, root, folder, std::slice::from_ref(&c.config))?;
        let dst = root.join(folder);
        match updates.get(&c.component) {
            Some(tensors) => write_component(c, tensors, Some(dtype), &dst)?,
            None => copy_weights(c, &dst)?,
        }
    }
    for t in &base.tokenizers {
        folders.insert(t.folder.clone());
        copy_folder_files(base, root, &t.folder, &t.files)?;
    }
    let index = files::read_json(&base.model_index)?;
    for extra in extra_config_folders(base, &index, &folders)? {
        copy_folder_files(base, root, &extra, &[])?;
        folders.insert(extra);
    }
    let index = rewrite_model_index(index, &folders);
    let text = serde_json::to_string_pretty(&index).unwrap_or_default() + "\n";
    fsutil::write_atomic(&root.join(files::MODEL_INDEX), text)?;
    stage.commit()?;
    Ok(())
}

/// [`save_diffusers_folder`] for a single-file base: the configs it was opened with become the
/// folder's JSON files, the built-in tokenizer is written out as `vocab.json` + `merges.txt`,
/// and every component is written from the file's views (updated ones in `dtype`, the others
/// as stored).
fn save_from_single_file<T: ExportTensor>(
    base: &ModelLayout,
    out_dir: &Path,
    updates: &BTreeMap<Component, &[(String, T)]>,
    dtype: DType,
) -> Result<(), ExportError> {
    let stage = StagedDir::new(out_dir)?;
    let root = stage.path();
    let write_json = |rel: &str, v: &Value| -> Result<(), ExportError> {
        let path = root.join(rel);
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(|source| ExportError::Write {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        let text = serde_json::to_string_pretty(v).unwrap_or_default() + "\n";
        Ok(fsutil::write_atomic(&path, text)?)
    };
    write_json(files::MODEL_INDEX, &base.model_index_json()?)?;
    write_json(files::SCHEDULER_CONFIG, &base.scheduler_json()?)?;
    for c in &base.components {
        let folder = c.component.folder();
        write_json(&format!("{folder}/config.json"), &c.config_json()?)?;
        let none: &[(String, T)] = &[];
        match updates.get(&c.component) {
            Some(tensors) => write_component(c, tensors, Some(dtype), &root.join(folder))?,
            None => write_component(c, none, None, &root.join(folder))?,
        }
    }
    for t in &base.tokenizers {
        let dst = root.join(&t.folder);
        fs::create_dir_all(&dst).map_err(|source| ExportError::Write {
            path: dst.clone(),
            source,
        })?;
        match &t.builtin {
            Some(b) => {
                let files =
                    super::clip::builtin_bpe::tokenizer_files(b.vocab_size, &b.pad, b.max_length)
                        .map_err(|m| ExportError::Tokenizer {
                        folder: t.folder.clone(),
                        message: m,
                    })?;
                for (name, text) in files {
                    fsutil::write_atomic(&dst.join(name), text)?;
                }
            }
            None => {
                for f in &t.files {
                    if let Some(name) = f.file_name() {
                        fsutil::copy_atomic(f, &dst.join(name))?;
                    }
                }
            }
        }
    }
    stage.commit()?;
    Ok(())
}

/// Refuses an `out_dir` that is, or contains, the base folder: the commit would delete it.
fn check_not_base(base: &ModelLayout, out_dir: &Path) -> Result<(), ExportError> {
    let (Ok(out), Ok(root)) = (out_dir.canonicalize(), base.root.canonicalize()) else {
        // A missing out_dir cannot contain the base.
        return Ok(());
    };
    if root.starts_with(&out) {
        return Err(ExportError::IntoBase {
            out: out_dir.to_path_buf(),
            base: base.root.clone(),
        });
    }
    Ok(())
}

/// Copies `listed` (files of `base.root/folder`) and the folder's other small JSON files into
/// `out/folder`. Shard indexes are left to the weight writers.
fn copy_folder_files(
    base: &ModelLayout,
    out: &Path,
    folder: &str,
    listed: &[PathBuf],
) -> Result<(), ExportError> {
    let src = base.root.join(folder);
    let dst = out.join(folder);
    fs::create_dir_all(&dst).map_err(|source| ExportError::Write {
        path: dst.clone(),
        source,
    })?;
    let mut names: BTreeSet<String> = listed
        .iter()
        .filter_map(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .collect();
    names.extend(small_json_files(&src)?);
    for name in names {
        fsutil::copy_atomic(&src.join(&name), &dst.join(&name))?;
    }
    Ok(())
}

/// The small `*.json` files directly in `dir`, shard indexes excluded.
fn small_json_files(dir: &Path) -> Result<Vec<String>, ExportError> {
    let read_err = |source| ExportError::Read {
        path: dir.to_path_buf(),
        source,
    };
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).map_err(read_err)? {
        let entry = entry.map_err(read_err)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.ends_with(".json") || name.contains(".safetensors.index") {
            continue;
        }
        // `metadata` follows symlinks (hub cache snapshots link into `blobs/`).
        let path = entry.path();
        let meta = fs::metadata(&path).map_err(|source| ExportError::Read { path, source })?;
        if meta.is_file() && meta.len() <= SMALL_JSON_BYTES {
            out.push(name);
        }
    }
    Ok(out)
}

/// Components listed in `model_index.json` beyond `present` whose folder holds only small JSON
/// files (e.g. `feature_extractor/preprocessor_config.json`): cheap to carry along.
fn extra_config_folders(
    base: &ModelLayout,
    index: &Value,
    present: &BTreeSet<String>,
) -> Result<Vec<String>, ExportError> {
    let mut out = Vec::new();
    for folder in files::listed_components(index) {
        let dir = base.root.join(&folder);
        if present.contains(&folder) || folder.contains(['/', '\\', '.']) || !dir.is_dir() {
            continue;
        }
        let all = fs::read_dir(&dir)
            .map_err(|source| ExportError::Read {
                path: dir.clone(),
                source,
            })?
            .filter_map(Result::ok)
            .filter(|e| e.path().is_file())
            .count();
        let json = small_json_files(&dir)?.len();
        if all > 0 && all == json {
            out.push(folder);
        }
    }
    Ok(out)
}

/// `index` with every listed component outside `present` set to `[null, null]`.
fn rewrite_model_index(mut index: Value, present: &BTreeSet<String>) -> Value {
    let listed = files::listed_components(&index);
    if let Some(map) = index.as_object_mut() {
        for key in listed {
            if !present.contains(&key) {
                map.insert(key, json!([null, null]));
            }
        }
    }
    index
}

/// Copies a component's weights under the plain names (module header).
fn copy_weights(c: &ComponentFiles, dst: &Path) -> Result<(), ExportError> {
    let plain = weights_file_name(c.component);
    match &c.index {
        None => {
            for w in &c.weights {
                fsutil::copy_atomic(w, &dst.join(plain))?;
            }
        }
        Some(index) => {
            fsutil::copy_atomic(index, &dst.join(format!("{plain}.index.json")))?;
            for shard in &c.weights {
                let name = shard.file_name().ok_or_else(|| FilesError::MissingFile {
                    path: shard.clone(),
                })?;
                fsutil::copy_atomic(shard, &dst.join(name))?;
            }
        }
    }
    Ok(())
}

/// The base tensors of a component: its safetensors files, or a single file's view.
pub(crate) enum BaseTensors {
    Files {
        st: Box<MmapedSafetensors>,
        files: String,
    },
    View(Arc<TensorView>),
}

impl BaseTensors {
    pub(crate) fn open(c: &ComponentFiles) -> Result<Self, ExportError> {
        if let Some(p) = &c.packed {
            return Ok(BaseTensors::View(p.view.clone()));
        }
        let files = c
            .weights
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        // SAFETY: the base files are memory-mapped read-only and only read here; sdtrain never
        // writes to a base model file (the export goes to a new path, checked not to be the
        // base).
        let st =
            unsafe { MmapedSafetensors::multi(&c.weights) }.map_err(|e| ExportError::Base {
                component: c.component,
                files: files.clone(),
                source: Box::new(External(e)),
            })?;
        Ok(BaseTensors::Files {
            st: Box::new(st),
            files,
        })
    }

    pub(crate) fn describe(&self) -> String {
        match self {
            BaseTensors::Files { files, .. } => files.clone(),
            BaseTensors::View(v) => v.file().display().to_string(),
        }
    }

    /// Every tensor: name, shape, stored dtype.
    pub(crate) fn list(&self) -> candle_core::Result<Vec<(String, Vec<usize>, DType)>> {
        match self {
            BaseTensors::Files { st, .. } => st
                .tensors()
                .into_iter()
                .map(|(n, v)| Ok((n, v.shape().to_vec(), DType::try_from(v.dtype())?)))
                .collect(),
            BaseTensors::View(v) => Ok(v
                .entries()
                .map(|(n, e)| (n.clone(), e.shape.clone(), e.dtype))
                .collect()),
        }
    }

    /// Loads `name` on the host.
    pub(crate) fn load(&self, name: &str) -> candle_core::Result<Tensor> {
        match self {
            BaseTensors::Files { st, .. } => st.load(name, &Device::Cpu),
            BaseTensors::View(v) => v.load(name, &Device::Cpu),
        }
    }
}

/// One tensor to write: where it comes from and what it is written as.
pub(crate) struct OutTensor<'a> {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub component: Component,
    pub load: Box<dyn Fn() -> candle_core::Result<Tensor> + 'a>,
}

/// Writes `path` atomically: the safetensors header (with `metadata`, `format: pt` added) and
/// each tensor in turn, streamed (a device tensor is copied to the host only while written).
pub(crate) fn write_safetensors(
    path: &Path,
    mut metadata: serde_json::Map<String, Value>,
    tensors: &[OutTensor<'_>],
) -> Result<(), ExportError> {
    metadata.insert("format".into(), json!("pt"));
    let header = safetensors_header(metadata, tensors)?;
    let write_err = |source| ExportError::Write {
        path: path.to_path_buf(),
        source,
    };
    fsutil::write_atomic_with(path, |w| {
        w.write_all(&(header.len() as u64).to_le_bytes())
            .map_err(write_err)?;
        w.write_all(&header).map_err(write_err)?;
        for t in tensors {
            let tensor_err = |err: candle_core::Error| ExportError::Tensor {
                component: t.component,
                name: t.name.clone(),
                source: Box::new(err),
            };
            let tensor = (t.load)().map_err(tensor_err)?;
            if tensor.dims() != t.shape.as_slice() {
                return Err(ExportError::Shape {
                    component: t.component,
                    name: t.name.clone(),
                    got: tensor.dims().to_vec(),
                    want: t.shape.clone(),
                });
            }
            let bytes = tensor_bytes(&tensor, t.dtype).map_err(tensor_err)?;
            w.write_all(&bytes).map_err(write_err)?;
        }
        Ok(())
    })
}

/// The diffusers-named tensors of component `c` with `tensors` replacing those of the same name,
/// float tensors in `dtype` (`None`: as stored), sorted by name.
pub(crate) fn merged_tensors<'a, T: ExportTensor>(
    c: &ComponentFiles,
    base: &'a BaseTensors,
    tensors: &'a [(String, T)],
    dtype: Option<DType>,
) -> Result<Vec<OutTensor<'a>>, ExportError> {
    let component = c.component;
    let base_err = |e: candle_core::Error| ExportError::Base {
        component,
        files: base.describe(),
        source: Box::new(External(e)),
    };
    let mut updates: HashMap<&str, &Tensor> = HashMap::new();
    for (name, t) in tensors {
        if updates.insert(name, t.export_tensor()).is_some() {
            return Err(ExportError::DuplicateTensor {
                component,
                name: name.clone(),
            });
        }
    }
    let mut out = Vec::new();
    for (name, shape, base_dtype) in base.list().map_err(base_err)? {
        let load: Box<dyn Fn() -> candle_core::Result<Tensor> + 'a> =
            match updates.remove(name.as_str()) {
                Some(t) => {
                    if t.dims() != shape.as_slice() {
                        return Err(ExportError::Shape {
                            component,
                            name,
                            got: t.dims().to_vec(),
                            want: shape,
                        });
                    }
                    Box::new(move || Ok(t.clone()))
                }
                None => {
                    let n = name.clone();
                    Box::new(move || base.load(&n))
                }
            };
        let out_dtype = match dtype {
            Some(d) if base_dtype.is_float() => d,
            _ => base_dtype,
        };
        out.push(OutTensor {
            name,
            shape,
            dtype: out_dtype,
            component,
            load,
        });
    }
    if let Some(name) = updates.keys().min() {
        return Err(ExportError::UnknownTensor {
            component,
            name: name.to_string(),
            files: base.describe(),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Writes `dst/<plain weights name>` for a component: the base tensors with `tensors`
/// replacing those of the same name, floats in `dtype` (`None`: as stored).
fn write_component<T: ExportTensor>(
    c: &ComponentFiles,
    tensors: &[(String, T)],
    dtype: Option<DType>,
    dst: &Path,
) -> Result<(), ExportError> {
    let base = BaseTensors::open(c)?;
    let entries = merged_tensors(c, &base, tensors, dtype)?;
    write_safetensors(
        &dst.join(weights_file_name(c.component)),
        serde_json::Map::new(),
        &entries,
    )
}

/// The safetensors name of a dtype the export writes.
fn st_dtype(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::U8 => "U8",
        DType::U32 => "U32",
        DType::I16 => "I16",
        DType::I32 => "I32",
        DType::I64 => "I64",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        DType::F32 => "F32",
        DType::F64 => "F64",
        // DType is non-exhaustive: 8/6/4-bit floats and whatever candle adds next.
        _ => return None,
    })
}

/// The JSON header (safetensors format: `{name: {dtype, shape, data_offsets}}` with offsets
/// into the data section, plus `__metadata__`), padded with spaces to a multiple of 8 bytes.
fn safetensors_header(
    metadata: serde_json::Map<String, Value>,
    entries: &[OutTensor<'_>],
) -> Result<Vec<u8>, ExportError> {
    let mut map = serde_json::Map::new();
    let metadata: serde_json::Map<String, Value> = metadata
        .into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => (k, Value::String(s)),
            other => (k, Value::String(other.to_string())),
        })
        .collect();
    map.insert("__metadata__".into(), Value::Object(metadata));
    let mut offset = 0usize;
    for e in entries {
        let name = st_dtype(e.dtype).ok_or_else(|| ExportError::TensorDtype {
            component: e.component,
            name: e.name.clone(),
            dtype: e.dtype,
        })?;
        let len = e.shape.iter().product::<usize>() * e.dtype.size_in_bytes();
        map.insert(
            e.name.clone(),
            json!({"dtype": name, "shape": e.shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let mut header = serde_json::to_vec(&Value::Object(map)).unwrap_or_default();
    header.resize(header.len().next_multiple_of(8), b' ');
    Ok(header)
}

/// The little-endian bytes of `t` cast to `dtype` (cast on its device, then copied to the host).
fn tensor_bytes(t: &Tensor, dtype: DType) -> candle_core::Result<Vec<u8>> {
    let t = t.to_dtype(dtype)?.flatten_all()?.to_device(&Device::Cpu)?;
    fn le<T: Copy, const N: usize>(v: Vec<T>, f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
        let mut out = Vec::with_capacity(v.len() * N);
        for x in v {
            out.extend_from_slice(&f(x));
        }
        out
    }
    Ok(match dtype {
        DType::U8 => t.to_vec1::<u8>()?,
        DType::U32 => le(t.to_vec1::<u32>()?, u32::to_le_bytes),
        DType::I16 => le(t.to_vec1::<i16>()?, i16::to_le_bytes),
        DType::I32 => le(t.to_vec1::<i32>()?, i32::to_le_bytes),
        DType::I64 => le(t.to_vec1::<i64>()?, i64::to_le_bytes),
        DType::F16 => le(t.to_vec1::<half::f16>()?, half::f16::to_le_bytes),
        DType::BF16 => le(t.to_vec1::<half::bf16>()?, half::bf16::to_le_bytes),
        DType::F32 => le(t.to_vec1::<f32>()?, f32::to_le_bytes),
        DType::F64 => le(t.to_vec1::<f64>()?, f64::to_le_bytes),
        _ => candle_core::bail!("dtype {dtype:?} cannot be exported"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_offsets_are_contiguous_and_padded() {
        let entry = |name: &str, shape: Vec<usize>, dtype| OutTensor {
            name: name.into(),
            shape,
            dtype,
            component: Component::Unet,
            load: Box::new(|| candle_core::bail!("not loaded")),
        };
        let entries = [
            entry("a", vec![2, 3], DType::F16),
            entry("b", vec![1], DType::I64),
        ];
        let h = safetensors_header(serde_json::Map::new(), &entries).unwrap();
        assert_eq!(h.len() % 8, 0);
        let v: Value = serde_json::from_slice(&h).unwrap();
        assert_eq!(v["a"]["data_offsets"], json!([0, 12]));
        assert_eq!(v["b"]["data_offsets"], json!([12, 20]));
        assert_eq!(v["b"]["dtype"], "I64");
        assert_eq!(v["__metadata__"], json!({}));
    }

    #[test]
    fn model_index_nulls_absent_components() {
        let idx = json!({
            "_class_name": "StableDiffusionPipeline",
            "unet": ["diffusers", "UNet2DConditionModel"],
            "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
            "feature_extractor": [null, null],
            "requires_safety_checker": true
        });
        let present = BTreeSet::from(["unet".to_string()]);
        let out = rewrite_model_index(idx, &present);
        assert_eq!(out["unet"], json!(["diffusers", "UNet2DConditionModel"]));
        assert_eq!(out["safety_checker"], json!([null, null]));
        assert_eq!(out["requires_safety_checker"], json!(true));
    }

    #[test]
    fn bytes_are_little_endian_in_the_export_dtype() {
        let t = Tensor::new(&[1f32, -2.0], &Device::Cpu).unwrap();
        assert_eq!(
            tensor_bytes(&t, DType::F16).unwrap(),
            [0x00, 0x3c, 0x00, 0xc0]
        );
        assert_eq!(
            tensor_bytes(&t, DType::F32).unwrap()[4..],
            (-2f32).to_le_bytes()
        );
    }
}
