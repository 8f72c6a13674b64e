//! Which files of a diffusers pipeline folder sdtrain reads.
//!
//! A pipeline folder (as written by diffusers' `save_pretrained`, or a snapshot in the Hugging Face
//! cache) holds one sub-folder per component. For each weight-bearing component (`unet`, `vae`,
//! `text_encoder`, `text_encoder_2`) the rules here pick the safetensors to read, in this order:
//!
//! 1. with a variant requested (e.g. `fp16`): `<base>.<variant>.safetensors`, then the sharded
//!    `<base>.safetensors.index.<variant>.json` (or `<base>.safetensors.<variant>.index.json`,
//!    as diffusers up to 0.30 named it);
//! 2. the plain `<base>.safetensors`, then the sharded `<base>.safetensors.index.json`;
//! 3. with no variant requested, the `fp16` variant names as a fallback when no plain file exists.
//!
//! `<base>` is `diffusion_pytorch_model` (diffusers models) or `model` (transformers models).
//!
//! A component without safetensors is read from the weights diffusers and transformers saved
//! before safetensors, by the same three rules: `<base>[.<variant>].bin`, or the sharded
//! `<base>.bin.index[.<variant>].json`, `<base>` being `diffusion_pytorch_model` or
//! `pytorch_model`. Those are `torch.save` files: they are read as data, never run, and converted
//! once into one `.safetensors` copy in sdtrain's cache ([`crate::torch_pickle`]), which is what
//! the component's `weights` then name. Other pickle files (`.ckpt`, `.pt` in a component
//! folder) are an error. The same rules run on a hub repo's file list ([`hub_plan`]) so a
//! download fetches exactly what a local read would open.
//!
//! A component of a single-file checkpoint has no files of its own: its [`ComponentSource`] is
//! the opened file's config and tensor view ([`PackedComponent`]) instead of a folder's files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use crate::tensor_view::TensorView;

/// File names a diffusers model (`diffusion_pytorch_model`) or a transformers model (`model`)
/// uses for its weights, without extension.
const WEIGHT_BASES: [&str; 2] = ["diffusion_pytorch_model", "model"];

/// The variant tried when no plain weight file exists and none was requested.
const FALLBACK_VARIANT: &str = "fp16";

/// The bases of the `.bin` weight names diffusers (`diffusion_pytorch_model`) and transformers
/// (`pytorch_model`) wrote before safetensors.
const TORCH_BASES: [&str; 2] = ["diffusion_pytorch_model", "pytorch_model"];

/// Extensions of pickle-based checkpoints (named in the error for a component that has only
/// pickle files the rules do not pick).
const PICKLE_EXTENSIONS: [&str; 5] = ["bin", "ckpt", "pt", "pth", "pkl"];

/// Tokenizer files copied from a pipeline when present. A CLIP tokenizer needs either
/// `tokenizer.json` or the `vocab.json` + `merges.txt` pair.
pub const TOKENIZER_FILES: [&str; 6] = [
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
];

/// The scheduler config, relative to the pipeline folder.
pub const SCHEDULER_CONFIG: &str = "scheduler/scheduler_config.json";

/// The pipeline index, relative to the pipeline folder.
pub const MODEL_INDEX: &str = "model_index.json";

#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    #[error("component folder {} not found", dir.display())]
    MissingFolder { dir: PathBuf },
    #[error("{} not found", path.display())]
    MissingFile { path: PathBuf },
    #[error(
        "{location} holds only pickle checkpoints ({}), none under the names diffusers and \
         transformers save (`diffusion_pytorch_model.bin`, `pytorch_model.bin`, or their sharded \
         `*.bin.index.json`)",
        found.join(", ")
    )]
    PickleOnly {
        location: String,
        found: Vec<String>,
    },
    #[error(
        "{location} has no safetensors weights (expected {expected}); files found: {}",
        list_or_none(found)
    )]
    NoWeights {
        location: String,
        expected: String,
        found: Vec<String>,
    },
    #[error(
        "{location} has no usable tokenizer: expected tokenizer.json or vocab.json + merges.txt; files found: {}",
        list_or_none(found)
    )]
    NoTokenizer {
        location: String,
        found: Vec<String>,
    },
    #[error("invalid shard index {}: {reason}", path.display())]
    BadIndex { path: PathBuf, reason: String },
    #[error("shard {} listed in {} not found", shard.display(), index.display())]
    MissingShard { index: PathBuf, shard: PathBuf },
    #[error("{}: not a valid safetensors file: {message}{}", path.display(), crate::file_sniff::safetensors_note(path))]
    BadSafetensors { path: PathBuf, message: String },
    #[error("invalid variant `{0}`: use letters, digits, `_` or `-` (e.g. `fp16`)")]
    BadVariant(String),
    #[error("cannot read {}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: cannot convert the torch weights to safetensors", path.display())]
    Convert {
        path: PathBuf,
        source: Box<crate::torch_pickle::ConvertError>,
    },
    #[error("cannot parse {}{}", path.display(), crate::file_sniff::json_note(path))]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{}: holds {kind} where a JSON object is expected", path.display())]
    NotAnObject { path: PathBuf, kind: &'static str },
}

impl FilesError {
    /// True when the files say something is wrong with the model the user pointed at (as opposed
    /// to the machine failing to read it).
    pub fn is_usage(&self) -> bool {
        match self {
            FilesError::Io { .. } => false,
            FilesError::Convert { source, .. } => {
                matches!(**source, crate::torch_pickle::ConvertError::Read(_))
            }
            FilesError::MissingFolder { .. }
            | FilesError::MissingFile { .. }
            | FilesError::PickleOnly { .. }
            | FilesError::NoWeights { .. }
            | FilesError::NoTokenizer { .. }
            | FilesError::BadIndex { .. }
            | FilesError::MissingShard { .. }
            | FilesError::BadVariant(_)
            | FilesError::BadSafetensors { .. }
            | FilesError::Json { .. }
            | FilesError::NotAnObject { .. } => true,
        }
    }

    /// True when the error means files are absent (a partial download can be completed), not
    /// that the files present are unusable.
    pub fn is_incomplete(&self) -> bool {
        match self {
            FilesError::MissingFolder { .. }
            | FilesError::MissingFile { .. }
            | FilesError::NoWeights { .. }
            | FilesError::NoTokenizer { .. }
            | FilesError::MissingShard { .. } => true,
            FilesError::PickleOnly { .. }
            | FilesError::Convert { .. }
            | FilesError::BadIndex { .. }
            | FilesError::BadVariant(_)
            | FilesError::BadSafetensors { .. }
            | FilesError::Io { .. }
            | FilesError::Json { .. }
            | FilesError::NotAnObject { .. } => false,
        }
    }

    /// True when a component holds only pickle checkpoints that cannot be read (under other
    /// names, or unreadable `.bin` weights): a hub snapshot that Python's `huggingface_hub` filled
    /// with `.bin` files (diffusers downloads `.bin` for every component when one lacks
    /// safetensors) may still have safetensors to download.
    pub fn is_pickle_only(&self) -> bool {
        matches!(
            self,
            FilesError::PickleOnly { .. } | FilesError::Convert { .. }
        )
    }
}

fn list_or_none(files: &[String]) -> String {
    if files.is_empty() {
        "none".to_string()
    } else {
        files.join(", ")
    }
}

/// A weight-bearing pipeline component, in the order sdtrain reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Component {
    Unet,
    Vae,
    TextEncoder,
    TextEncoder2,
}

impl Component {
    pub const ALL: [Component; 4] = [
        Component::Unet,
        Component::Vae,
        Component::TextEncoder,
        Component::TextEncoder2,
    ];

    /// The component's folder in a pipeline, which is also its key in `model_index.json`.
    pub fn folder(self) -> &'static str {
        match self {
            Component::Unet => "unet",
            Component::Vae => "vae",
            Component::TextEncoder => "text_encoder",
            Component::TextEncoder2 => "text_encoder_2",
        }
    }

    /// The tokenizer folder that feeds this component, if it is a text encoder.
    pub fn tokenizer_folder(self) -> Option<&'static str> {
        match self {
            Component::Unet | Component::Vae => None,
            Component::TextEncoder => Some("tokenizer"),
            Component::TextEncoder2 => Some("tokenizer_2"),
        }
    }
}

impl std::fmt::Display for Component {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.folder())
    }
}

/// What the rules pick inside one component folder, by file name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WeightChoice {
    /// One safetensors file.
    Single(String),
    /// A `*.safetensors.index*.json` whose `weight_map` names the shard files.
    Sharded { index: String },
    /// One `torch.save` file (`diffusion_pytorch_model.bin`, `pytorch_model.bin`).
    Torch(String),
    /// A `*.bin.index*.json` whose `weight_map` names `.bin` shards.
    TorchSharded { index: String },
}

/// One component of a single-file checkpoint: its diffusers config and its tensors under
/// diffusers names.
#[derive(Debug, PartialEq, Eq)]
pub struct PackedComponent {
    pub config: Value,
    pub view: Arc<TensorView>,
}

/// Where a component's config and tensors come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ComponentSource {
    /// A component folder of a diffusers pipeline.
    Folder {
        /// `<component>/config.json`.
        config: PathBuf,
        /// The shard index, for a sharded component.
        index: Option<PathBuf>,
        /// The safetensors files to pass to `Weights::from_files`, in a stable order.
        weights: Vec<PathBuf>,
        /// The `.bin` files `weights` (one converted copy) were made from; empty when the
        /// folder's own safetensors are read.
        torch: Vec<PathBuf>,
    },
    /// A component of a single-file checkpoint `file`: config and tensors come from the opened
    /// file, not from files of their own.
    Packed {
        file: PathBuf,
        packed: Arc<PackedComponent>,
    },
}

/// The files of one component: where its config and its tensors come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComponentFiles {
    pub component: Component,
    pub source: ComponentSource,
}

impl ComponentFiles {
    /// The file the config is read from: `config.json`, or the single file.
    pub fn config_path(&self) -> &Path {
        match &self.source {
            ComponentSource::Folder { config, .. } => config,
            ComponentSource::Packed { file, .. } => file,
        }
    }

    /// The files holding the tensors: the folder's safetensors, or the single file.
    pub fn weights(&self) -> &[PathBuf] {
        match &self.source {
            ComponentSource::Folder { weights, .. } => weights,
            ComponentSource::Packed { file, .. } => std::slice::from_ref(file),
        }
    }

    /// The `.bin` files the weights were converted from (empty: read as they are).
    pub fn torch_files(&self) -> &[PathBuf] {
        match &self.source {
            ComponentSource::Folder { torch, .. } => torch,
            ComponentSource::Packed { .. } => &[],
        }
    }

    /// The shard index of a sharded folder component.
    pub fn index(&self) -> Option<&Path> {
        match &self.source {
            ComponentSource::Folder { index, .. } => index.as_deref(),
            ComponentSource::Packed { .. } => None,
        }
    }

    /// Where errors say the component was loaded from: its folder, or the single file.
    pub fn location(&self) -> PathBuf {
        match &self.source {
            ComponentSource::Folder { config, .. } => {
                config.parent().map(Path::to_path_buf).unwrap_or_default()
            }
            ComponentSource::Packed { file, .. } => file.clone(),
        }
    }

    /// The parsed config.
    pub fn config_json(&self) -> Result<Value, FilesError> {
        match &self.source {
            ComponentSource::Folder { config, .. } => read_json(config),
            ComponentSource::Packed { packed, .. } => Ok(packed.config.clone()),
        }
    }

    /// The config as JSON text and the name of where it came from, for the config parsers.
    pub fn config_text(&self) -> Result<(String, PathBuf), FilesError> {
        match &self.source {
            ComponentSource::Folder { config, .. } => {
                let text = std::fs::read_to_string(config).map_err(|source| FilesError::Io {
                    path: config.clone(),
                    source,
                })?;
                Ok((text, config.clone()))
            }
            ComponentSource::Packed { file, packed } => Ok((
                serde_json::to_string(&packed.config).unwrap_or_default(),
                file.join(format!("<{} config>", self.component)),
            )),
        }
    }

    /// Tensor name → (shape, stored dtype name) over the weights, from the headers only.
    pub fn tensor_shapes(&self) -> Result<BTreeMap<String, (Vec<usize>, String)>, FilesError> {
        match &self.source {
            ComponentSource::Folder { weights, .. } => header_shapes(weights),
            ComponentSource::Packed { packed, .. } => Ok(packed
                .view
                .entries()
                .map(|(n, e)| {
                    (
                        n.clone(),
                        (e.shape.clone(), format!("{:?}", e.dtype).to_uppercase()),
                    )
                })
                .collect()),
        }
    }
}

/// Tensor name → (shape, stored dtype name) over safetensors files, from their headers.
fn header_shapes(files: &[PathBuf]) -> Result<BTreeMap<String, (Vec<usize>, String)>, FilesError> {
    let mut out = BTreeMap::new();
    for path in files {
        let io = |source| FilesError::Io {
            path: path.clone(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: mapped read-only and dropped at the end of the iteration; only the header
        // pages are touched.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&map).map_err(|e| {
            FilesError::BadSafetensors {
                path: path.clone(),
                message: e.to_string(),
            }
        })?;
        for (name, info) in meta.tensors() {
            out.insert(name, (info.shape.clone(), info.dtype.to_string()));
        }
    }
    Ok(out)
}

/// The tokenizer files found in one tokenizer folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerFiles {
    pub folder: String,
    /// Empty for a built-in tokenizer.
    pub files: Vec<PathBuf>,
    /// Set when the tokenizer is sdtrain's built-in CLIP BPE (single-file checkpoints).
    pub builtin: Option<BuiltinTokenizer>,
}

/// sdtrain's built-in CLIP BPE for a text encoder (see `ClipTokenizer::builtin`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuiltinTokenizer {
    pub vocab_size: usize,
    pub pad: String,
    pub max_length: usize,
}

impl TokenizerFiles {
    /// The folder holding the files, if the tokenizer is not built in.
    pub fn dir(&self) -> Option<&Path> {
        self.files.first().and_then(|f| f.parent())
    }
}

/// Checks a variant name before it is spliced into file names.
pub fn check_variant(variant: Option<&str>) -> Result<(), FilesError> {
    match variant {
        Some(v)
            if v.is_empty()
                || !v
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') =>
        {
            Err(FilesError::BadVariant(v.to_string()))
        }
        _ => Ok(()),
    }
}

/// The candidate file names, best first, for the variant rules in the module header.
fn candidates(variant: Option<&str>) -> Vec<WeightChoice> {
    let variant_names = |v: &str| -> Vec<WeightChoice> {
        WEIGHT_BASES
            .iter()
            .flat_map(|b| {
                [
                    WeightChoice::Single(format!("{b}.{v}.safetensors")),
                    WeightChoice::Sharded {
                        index: format!("{b}.safetensors.index.{v}.json"),
                    },
                    // diffusers up to 0.30 named a sharded variant's index so (its loader
                    // still reads it: `_fetch_index_file_legacy`).
                    WeightChoice::Sharded {
                        index: format!("{b}.safetensors.{v}.index.json"),
                    },
                ]
            })
            .collect()
    };
    let mut out: Vec<WeightChoice> = Vec::new();
    if let Some(v) = variant {
        out.extend(variant_names(v));
    }
    for b in WEIGHT_BASES {
        out.push(WeightChoice::Single(format!("{b}.safetensors")));
        out.push(WeightChoice::Sharded {
            index: format!("{b}.safetensors.index.json"),
        });
    }
    if variant.is_none() {
        out.extend(variant_names(FALLBACK_VARIANT));
    }
    // No safetensors: the `.bin` names, by the same rules.
    let torch_names = |v: Option<&str>| -> Vec<WeightChoice> {
        let dot = v.map_or(String::new(), |v| format!(".{v}"));
        TORCH_BASES
            .iter()
            .flat_map(|b| {
                [
                    WeightChoice::Torch(format!("{b}{dot}.bin")),
                    WeightChoice::TorchSharded {
                        index: format!("{b}.bin.index{dot}.json"),
                    },
                ]
            })
            .collect()
    };
    if let Some(v) = variant {
        out.extend(torch_names(Some(v)));
    }
    out.extend(torch_names(None));
    if variant.is_none() {
        out.extend(torch_names(Some(FALLBACK_VARIANT)));
    }
    out
}

/// Picks the weights among `names` (the file names in one component folder). `location` names
/// the folder in errors.
pub fn choose_weights(
    location: &str,
    names: &[String],
    variant: Option<&str>,
) -> Result<WeightChoice, FilesError> {
    check_variant(variant)?;
    let present: BTreeSet<&str> = names.iter().map(String::as_str).collect();
    let chosen = candidates(variant).into_iter().find(|c| match c {
        WeightChoice::Single(f) | WeightChoice::Torch(f) => present.contains(f.as_str()),
        WeightChoice::Sharded { index } | WeightChoice::TorchSharded { index } => {
            present.contains(index.as_str())
        }
    });
    if let Some(choice) = chosen {
        return Ok(choice);
    }
    let mut found: Vec<String> = names.to_vec();
    found.sort();
    let pickles: Vec<String> = found.iter().filter(|n| is_pickle(n)).cloned().collect();
    if !pickles.is_empty() {
        return Err(FilesError::PickleOnly {
            location: location.to_string(),
            found: pickles,
        });
    }
    Err(FilesError::NoWeights {
        location: location.to_string(),
        expected: "diffusion_pytorch_model.safetensors or model.safetensors, an fp16 variant or a \
                   sharded *.safetensors.index.json"
            .to_string(),
        found,
    })
}

fn is_pickle(name: &str) -> bool {
    Path::new(name)
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| PICKLE_EXTENSIONS.contains(&e))
}

/// The unique shard file names of a `*.safetensors.index*.json`, sorted. Shard names must be
/// plain file names in the index's folder (which also keeps a downloaded index from pointing
/// outside the cache).
pub fn read_index(path: &Path) -> Result<Vec<String>, FilesError> {
    let value = read_json(path)?;
    let bad = |reason: &str| FilesError::BadIndex {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    let map = value
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("no `weight_map` object"))?;
    let mut shards = BTreeSet::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(&format!("`weight_map.{tensor}` is not a file name")))?;
        if file.is_empty() || file.contains(['/', '\\']) || file == "." || file == ".." {
            return Err(bad(&format!(
                "`weight_map.{tensor}` = `{file}` is not a plain file name"
            )));
        }
        shards.insert(file.to_string());
    }
    if shards.is_empty() {
        return Err(bad("`weight_map` is empty"));
    }
    Ok(shards.into_iter().collect())
}

/// The files of `component` under the pipeline folder `dir`: its config and chosen weights, with
/// every shard checked to exist.
pub fn component_files(
    dir: &Path,
    component: Component,
    variant: Option<&str>,
) -> Result<ComponentFiles, FilesError> {
    let folder = dir.join(component.folder());
    if !folder.is_dir() {
        return Err(FilesError::MissingFolder { dir: folder });
    }
    folder_files(&folder, component, variant)
}

/// The files of `component` in `folder` itself (a component folder, or a repo holding one
/// component at its root, as VAE repos do): its config and chosen weights, every shard checked.
pub fn folder_files(
    folder: &Path,
    component: Component,
    variant: Option<&str>,
) -> Result<ComponentFiles, FilesError> {
    let config = folder.join("config.json");
    if !config.is_file() {
        return Err(FilesError::MissingFile { path: config });
    }
    let names = list_files(folder)?;
    match choose_weights(&folder.display().to_string(), &names, variant)? {
        WeightChoice::Single(file) => Ok(ComponentFiles {
            component,
            source: ComponentSource::Folder {
                config,
                index: None,
                weights: vec![folder.join(file)],
                torch: Vec::new(),
            },
        }),
        WeightChoice::Torch(file) => torch_component(component, config, vec![folder.join(file)]),
        WeightChoice::TorchSharded { index } => {
            let index = folder.join(index);
            let shards = existing_shards(folder, &index)?;
            torch_component(component, config, shards)
        }
        WeightChoice::Sharded { index } => {
            let index = folder.join(index);
            let weights = existing_shards(folder, &index)?;
            Ok(ComponentFiles {
                component,
                source: ComponentSource::Folder {
                    config,
                    index: Some(index),
                    weights,
                    torch: Vec::new(),
                },
            })
        }
    }
}

/// The shards `index` lists, each checked to exist in `folder`.
fn existing_shards(folder: &Path, index: &Path) -> Result<Vec<PathBuf>, FilesError> {
    let mut shards = Vec::new();
    for shard in read_index(index)? {
        let shard = folder.join(shard);
        if !shard.is_file() {
            return Err(FilesError::MissingShard {
                index: index.to_path_buf(),
                shard,
            });
        }
        shards.push(shard);
    }
    Ok(shards)
}

/// A component whose weights are `torch.save` files: read through one converted `.safetensors`
/// copy of them all (module header), made now unless an earlier read made it.
fn torch_component(
    component: Component,
    config: PathBuf,
    torch: Vec<PathBuf>,
) -> Result<ComponentFiles, FilesError> {
    let first = torch.first().cloned().unwrap_or_default();
    let copy = crate::torch_pickle::converted_copy_of(&torch).map_err(|e| FilesError::Convert {
        path: first.clone(),
        source: Box::new(e),
    })?;
    if let Some(done) = &copy.fresh {
        crate::console::say(format_args!(
            "{component}: {} read as data (torch files; nothing in them runs) and converted to {} \
             ({} tensors, {:.1} MB); later runs reuse the copy",
            torch
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            copy.path.display(),
            done.tensors,
            done.bytes as f64 / 1e6
        ));
    }
    Ok(ComponentFiles {
        component,
        source: ComponentSource::Folder {
            config,
            index: None,
            weights: vec![copy.path],
            torch,
        },
    })
}

/// The safetensors files to read for the component folder `component` (e.g. `"unet"`) of the
/// pipeline folder `dir`.
pub fn component_weights(
    dir: &Path,
    component: &str,
    variant: Option<&str>,
) -> Result<Vec<PathBuf>, FilesError> {
    let component = Component::ALL
        .into_iter()
        .find(|c| c.folder() == component)
        .ok_or_else(|| FilesError::MissingFolder {
            dir: dir.join(component),
        })?;
    Ok(component_files(dir, component, variant)?.weights().to_vec())
}

/// The tokenizer files present in `dir/<folder>`.
pub fn tokenizer_files(dir: &Path, folder: &str) -> Result<TokenizerFiles, FilesError> {
    let path = dir.join(folder);
    if !path.is_dir() {
        return Err(FilesError::MissingFolder { dir: path });
    }
    let names = list_files(&path)?;
    let files = pick_tokenizer_files(&path.display().to_string(), &names)?;
    Ok(TokenizerFiles {
        folder: folder.to_string(),
        files: files.into_iter().map(|f| path.join(f)).collect(),
        builtin: None,
    })
}

fn pick_tokenizer_files<'a>(
    location: &str,
    names: &'a [String],
) -> Result<Vec<&'a str>, FilesError> {
    let has = |n: &str| names.iter().any(|x| x == n);
    let usable = has("tokenizer.json") || (has("vocab.json") && has("merges.txt"));
    if !usable {
        let mut found = names.to_vec();
        found.sort();
        return Err(FilesError::NoTokenizer {
            location: location.to_string(),
            found,
        });
    }
    Ok(TOKENIZER_FILES
        .iter()
        .filter_map(|t| names.iter().find(|n| n == t).map(String::as_str))
        .collect())
}

/// The components a `model_index.json` lists with a class (entries like `[null, null]` mean the
/// pipeline has no such component).
pub fn listed_components(model_index: &Value) -> BTreeSet<String> {
    let Some(map) = model_index.as_object() else {
        return BTreeSet::new();
    };
    map.iter()
        .filter(|(k, v)| {
            !k.starts_with('_')
                && v.as_array()
                    .is_some_and(|a| a.len() == 2 && a.iter().all(|x| x.is_string()))
        })
        .map(|(k, _)| k.clone())
        .collect()
}

/// The files to fetch from a hub repo, as repo-relative paths.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HubPlan {
    /// Every file to download, indexes included, shards excluded.
    pub files: Vec<String>,
    /// Shard indexes (repo-relative): download each, then its shards (see [`read_index`]),
    /// which live in the same folder.
    pub indexes: Vec<String>,
}

/// Picks the files a pipeline needs from a hub repo's file list (`repo_files`, the `rfilename`s
/// of its siblings), by the same rules as a local read. `repo` names the repo in errors.
pub fn hub_plan(
    repo: &str,
    model_index: &Value,
    repo_files: &[String],
    variant: Option<&str>,
) -> Result<HubPlan, FilesError> {
    let listed = listed_components(model_index);
    let mut by_folder: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for f in repo_files {
        if let Some((folder, name)) = f.split_once('/') {
            if !name.contains('/') {
                by_folder.entry(folder).or_default().push(name.to_string());
            }
        }
    }
    let empty = Vec::new();
    let mut plan = HubPlan {
        files: vec![MODEL_INDEX.to_string()],
        indexes: Vec::new(),
    };
    for component in Component::ALL {
        let folder = component.folder();
        if !listed.contains(folder) {
            continue;
        }
        let names = by_folder.get(folder).unwrap_or(&empty);
        let location = format!("{repo}/{folder}");
        if !names.iter().any(|n| n == "config.json") {
            return Err(FilesError::MissingFile {
                path: PathBuf::from(format!("{location}/config.json")),
            });
        }
        plan.files.push(format!("{folder}/config.json"));
        match choose_weights(&location, names, variant)? {
            WeightChoice::Single(f) | WeightChoice::Torch(f) => {
                plan.files.push(format!("{folder}/{f}"))
            }
            WeightChoice::Sharded { index } | WeightChoice::TorchSharded { index } => {
                plan.files.push(format!("{folder}/{index}"));
                plan.indexes.push(format!("{folder}/{index}"));
            }
        }
        if let Some(tok) = component.tokenizer_folder() {
            if listed.contains(tok) {
                let names = by_folder.get(tok).unwrap_or(&empty);
                for f in pick_tokenizer_files(&format!("{repo}/{tok}"), names)? {
                    plan.files.push(format!("{tok}/{f}"));
                }
            }
        }
    }
    if repo_files.iter().any(|f| f == SCHEDULER_CONFIG) {
        plan.files.push(SCHEDULER_CONFIG.to_string());
    }
    Ok(plan)
}

/// Reads and parses a JSON file.
pub fn read_json(path: &Path) -> Result<Value, FilesError> {
    let text = std::fs::read_to_string(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            FilesError::MissingFile {
                path: path.to_path_buf(),
            }
        } else {
            FilesError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })?;
    let value: Value = crate::py_json::from_str(&text).map_err(|source| FilesError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    match value {
        Value::Object(_) => Ok(value),
        other => Err(FilesError::NotAnObject {
            path: path.to_path_buf(),
            kind: crate::py_json::kind(&other),
        }),
    }
}

/// The names of the regular files (or links to them) directly in `dir`, sorted.
fn list_files(dir: &Path) -> Result<Vec<String>, FilesError> {
    let io = |source| FilesError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        // `is_file` follows symlinks: hub cache snapshots are links into `blobs/`.
        if entry.path().is_file() {
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    names.sort();
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_legacy_sharded_variant_index_is_found() {
        // diffusers 0.30's save_pretrained(variant="fp16", max_shard_size=…).
        let n: Vec<String> = [
            "diffusion_pytorch_model.safetensors.fp16.index.json",
            "diffusion_pytorch_model-00001-of-00002.fp16.safetensors",
        ]
        .map(String::from)
        .to_vec();
        let want = WeightChoice::Sharded {
            index: "diffusion_pytorch_model.safetensors.fp16.index.json".into(),
        };
        assert_eq!(choose_weights("unet", &n, Some("fp16")).unwrap(), want);
        assert_eq!(choose_weights("unet", &n, None).unwrap(), want);
    }

    #[test]
    fn plain_file_wins_over_fp16() {
        let n = names(&[
            "config.json",
            "diffusion_pytorch_model.safetensors",
            "diffusion_pytorch_model.fp16.safetensors",
        ]);
        assert_eq!(
            choose_weights("unet", &n, None).unwrap(),
            WeightChoice::Single("diffusion_pytorch_model.safetensors".into())
        );
        assert_eq!(
            choose_weights("unet", &n, Some("fp16")).unwrap(),
            WeightChoice::Single("diffusion_pytorch_model.fp16.safetensors".into())
        );
    }

    #[test]
    fn fp16_is_the_fallback_when_plain_is_absent() {
        let n = names(&["config.json", "model.fp16.safetensors"]);
        assert_eq!(
            choose_weights("te", &n, None).unwrap(),
            WeightChoice::Single("model.fp16.safetensors".into())
        );
    }

    #[test]
    fn requested_variant_falls_back_to_plain() {
        let n = names(&["config.json", "model.safetensors"]);
        assert_eq!(
            choose_weights("te", &n, Some("fp16")).unwrap(),
            WeightChoice::Single("model.safetensors".into())
        );
    }

    #[test]
    fn sharded_indexes_are_found() {
        let n = names(&[
            "diffusion_pytorch_model-00001-of-00002.safetensors",
            "diffusion_pytorch_model-00002-of-00002.safetensors",
            "diffusion_pytorch_model.safetensors.index.json",
            "diffusion_pytorch_model.safetensors.index.fp16.json",
        ]);
        assert_eq!(
            choose_weights("unet", &n, None).unwrap(),
            WeightChoice::Sharded {
                index: "diffusion_pytorch_model.safetensors.index.json".into()
            }
        );
        assert_eq!(
            choose_weights("unet", &n, Some("fp16")).unwrap(),
            WeightChoice::Sharded {
                index: "diffusion_pytorch_model.safetensors.index.fp16.json".into()
            }
        );
    }

    #[test]
    fn bin_weights_are_read_when_there_are_no_safetensors() {
        let n = names(&["config.json", "pytorch_model.bin", "model.ckpt"]);
        assert_eq!(
            choose_weights("te", &n, None).unwrap(),
            WeightChoice::Torch("pytorch_model.bin".into())
        );
        // Safetensors first, whatever the variant rules pick among the `.bin` names.
        let n = names(&[
            "diffusion_pytorch_model.bin",
            "diffusion_pytorch_model.fp16.safetensors",
        ]);
        assert_eq!(
            choose_weights("unet", &n, None).unwrap(),
            WeightChoice::Single("diffusion_pytorch_model.fp16.safetensors".into())
        );
        let n = names(&[
            "diffusion_pytorch_model.bin",
            "diffusion_pytorch_model.fp16.bin",
            "diffusion_pytorch_model.bin.index.json",
        ]);
        assert_eq!(
            choose_weights("unet", &n, Some("fp16")).unwrap(),
            WeightChoice::Torch("diffusion_pytorch_model.fp16.bin".into())
        );
        assert_eq!(
            choose_weights("unet", &n, None).unwrap(),
            WeightChoice::Torch("diffusion_pytorch_model.bin".into())
        );
        let n = names(&[
            "pytorch_model.bin.index.json",
            "pytorch_model-00001-of-00002.bin",
        ]);
        assert_eq!(
            choose_weights("te", &n, None).unwrap(),
            WeightChoice::TorchSharded {
                index: "pytorch_model.bin.index.json".into()
            }
        );
    }

    #[test]
    fn pickles_under_other_names_are_refused_naming_them() {
        let n = names(&["config.json", "model.ckpt"]);
        let err = choose_weights("/m/text_encoder", &n, None).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, FilesError::PickleOnly { .. }));
        assert!(msg.contains("/m/text_encoder"), "{msg}");
        assert!(msg.contains("model.ckpt"), "{msg}");
        assert!(msg.contains("pytorch_model.bin"), "{msg}");
    }

    #[test]
    fn bad_variant_is_refused() {
        assert!(matches!(
            choose_weights("u", &[], Some("../x")),
            Err(FilesError::BadVariant(_))
        ));
    }

    #[test]
    fn listed_components_skip_nulls_and_metadata() {
        let idx = json!({
            "_class_name": "StableDiffusionPipeline",
            "unet": ["diffusers", "UNet2DConditionModel"],
            "safety_checker": [null, null],
            "requires_safety_checker": false,
        });
        assert_eq!(
            listed_components(&idx),
            BTreeSet::from(["unet".to_string()])
        );
    }

    #[test]
    fn hub_plan_picks_the_same_files_as_a_local_read() {
        let idx = json!({
            "unet": ["diffusers", "UNet2DConditionModel"],
            "vae": ["diffusers", "AutoencoderKL"],
            "text_encoder": ["transformers", "CLIPTextModel"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "scheduler": ["diffusers", "PNDMScheduler"],
            "safety_checker": [null, null],
        });
        let files = names(&[
            ".gitattributes",
            "README.md",
            "model_index.json",
            "v1-5-pruned.ckpt",
            "v1-5-pruned.safetensors",
            "scheduler/scheduler_config.json",
            "safety_checker/model.safetensors",
            "text_encoder/config.json",
            "text_encoder/model.safetensors",
            "text_encoder/model.fp16.safetensors",
            "text_encoder/pytorch_model.bin",
            "tokenizer/merges.txt",
            "tokenizer/special_tokens_map.json",
            "tokenizer/tokenizer_config.json",
            "tokenizer/vocab.json",
            "unet/config.json",
            "unet/diffusion_pytorch_model.safetensors.index.json",
            "unet/diffusion_pytorch_model-00001-of-00002.safetensors",
            "unet/diffusion_pytorch_model-00002-of-00002.safetensors",
            "unet/diffusion_pytorch_model.bin",
            "vae/config.json",
            "vae/diffusion_pytorch_model.fp16.safetensors",
            "vae/diffusion_pytorch_model.safetensors",
        ]);
        let plan = hub_plan("org/sd", &idx, &files, None).unwrap();
        assert_eq!(
            plan.files,
            names(&[
                "model_index.json",
                "unet/config.json",
                "unet/diffusion_pytorch_model.safetensors.index.json",
                "vae/config.json",
                "vae/diffusion_pytorch_model.safetensors",
                "text_encoder/config.json",
                "text_encoder/model.safetensors",
                "tokenizer/vocab.json",
                "tokenizer/merges.txt",
                "tokenizer/tokenizer_config.json",
                "tokenizer/special_tokens_map.json",
                "scheduler/scheduler_config.json",
            ])
        );
        assert_eq!(
            plan.indexes,
            names(&["unet/diffusion_pytorch_model.safetensors.index.json"])
        );
        let fp16 = hub_plan("org/sd", &idx, &files, Some("fp16")).unwrap();
        assert!(fp16
            .files
            .contains(&"vae/diffusion_pytorch_model.fp16.safetensors".to_string()));
        assert!(fp16
            .files
            .contains(&"text_encoder/model.fp16.safetensors".to_string()));
    }

    #[test]
    fn hub_plan_downloads_bin_weights_only_without_safetensors() {
        let idx = json!({ "unet": ["diffusers", "UNet2DConditionModel"] });
        let mut files = names(&[
            "model_index.json",
            "unet/config.json",
            "unet/diffusion_pytorch_model.bin",
        ]);
        let plan = hub_plan("org/old", &idx, &files, None).unwrap();
        assert!(plan
            .files
            .contains(&"unet/diffusion_pytorch_model.bin".to_string()));
        files.push("unet/diffusion_pytorch_model.safetensors".into());
        let plan = hub_plan("org/old", &idx, &files, None).unwrap();
        assert!(!plan.files.iter().any(|f| f.ends_with(".bin")), "{plan:?}");
        let files = names(&["model_index.json", "unet/config.json", "unet/unet.ckpt"]);
        let err = hub_plan("org/old", &idx, &files, None).unwrap_err();
        assert!(err.to_string().contains("org/old/unet"), "{err}");
        assert!(matches!(err, FilesError::PickleOnly { .. }));
    }

    #[test]
    fn index_shards_must_be_plain_names() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("i.json");
        std::fs::write(
            &path,
            r#"{"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors", "c": "s1.safetensors"}}"#,
        )
        .unwrap();
        assert_eq!(
            read_index(&path).unwrap(),
            names(&["s1.safetensors", "s2.safetensors"])
        );
        std::fs::write(&path, r#"{"weight_map": {"a": "../../etc/passwd"}}"#).unwrap();
        assert!(matches!(
            read_index(&path),
            Err(FilesError::BadIndex { .. })
        ));
    }
}
