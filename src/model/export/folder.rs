//! Writing a fine-tuned model as a complete diffusers pipeline folder that both sdtrain and
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
//! - a component read from elsewhere than the base folder (a `vae` in place of the model's)
//!   gets its own config and weights;
//! - every other component's weights are copied byte for byte, under the plain names diffusers
//!   loads without a `variant` argument (`<base>.fp16.safetensors` → `<base>.safetensors`, a
//!   variant shard index → `<base>.safetensors.index.json`, shards under their own names);
//! - configs, tokenizer files and other small JSON files of each copied folder come along
//!   unchanged; `model_index.json` is copied with components the new folder lacks (e.g. a
//!   `safety_checker` the base never downloaded) set to `[null, null]`, as diffusers itself
//!   writes absent components;
//! - a layout with a scheduler override (a run trained on another schedule than the base's, see
//!   [`crate::model::zero_snr`]) writes that config, and `model_index.json` names its class.
//!
//! Everything is written into `<out_dir>.tmp-<pid>` and renamed into place at the end
//! ([`StagedDir`]), so `out_dir` is either the previous version or the complete new one. The
//! safetensors writer ([`super::tensors`]) streams one tensor at a time.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::DType;
use serde_json::{json, Value};

use super::tensors::{merged_tensors, write_safetensors, BaseTensors};
use super::{ExportError, ExportTensor};
use crate::fsutil::{self, StagedDir};
use crate::model::files::{self, Component, ComponentFiles, ComponentSource, FilesError};
use crate::model::layout::{LayoutSource, ModelLayout};

/// JSON files larger than this are not "small" and are not copied beside the listed files.
const SMALL_JSON_BYTES: u64 = 16 << 20;

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
    match &base.source {
        LayoutSource::Folder { .. } => save_from_folder(base, out_dir, &updates, dtype),
        LayoutSource::SingleFile(_) => save_from_single_file(base, out_dir, &updates, dtype),
    }
}

/// [`save_diffusers_folder`] for a folder base: configs, tokenizers and the weights of the
/// components not updated are copied (module header), `model_index.json` is rewritten.
fn save_from_folder<T: ExportTensor>(
    base: &ModelLayout,
    out_dir: &Path,
    updates: &BTreeMap<Component, &[(String, T)]>,
    dtype: DType,
) -> Result<(), ExportError> {
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
    if base.scheduler_override.is_some() {
        let text = serde_json::to_string_pretty(&base.scheduler_json()?).unwrap_or_default();
        fsutil::write_atomic(&root.join(files::SCHEDULER_CONFIG), text + "\n")?;
    }
    for c in &base.components {
        let folder = c.component.folder();
        folders.insert(folder.to_string());
        let dst = root.join(folder);
        let own = match &c.source {
            ComponentSource::Folder { config, .. } => {
                config.parent() == Some(&base.root.join(folder))
            }
            ComponentSource::Packed { .. } => false,
        };
        if own {
            copy_folder_files(base, root, folder, &[c.config_path().to_path_buf()])?;
        } else {
            // A component from elsewhere (a `vae` in place of the model's): its own config.
            fs::create_dir_all(&dst).map_err(|source| ExportError::Write {
                path: dst.clone(),
                source,
            })?;
            let text = serde_json::to_string_pretty(&c.config_json()?).unwrap_or_default() + "\n";
            fsutil::write_atomic(&dst.join("config.json"), text)?;
        }
        match updates.get(&c.component) {
            Some(tensors) => write_component(c, tensors, Some(dtype), &dst)?,
            None => copy_weights(c, &dst)?,
        }
    }
    for t in &base.tokenizers {
        folders.insert(t.folder.clone());
        copy_folder_files(base, root, &t.folder, &t.files)?;
    }
    let index = base.model_index_json()?;
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
                let files = crate::model::clip::builtin_bpe::tokenizer_files(
                    b.vocab_size,
                    &b.pad,
                    b.max_length,
                )
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

/// Copies a component's weights under the plain names (module header); a packed component has
/// no files of its own and is written from its view as stored.
fn copy_weights(c: &ComponentFiles, dst: &Path) -> Result<(), ExportError> {
    let plain = weights_file_name(c.component);
    match &c.source {
        ComponentSource::Folder {
            index: None,
            weights,
            ..
        } => {
            for w in weights {
                fsutil::copy_atomic(w, &dst.join(plain))?;
            }
        }
        ComponentSource::Folder {
            index: Some(index),
            weights,
            ..
        } => {
            fsutil::copy_atomic(index, &dst.join(format!("{plain}.index.json")))?;
            for shard in weights {
                let name = shard.file_name().ok_or_else(|| FilesError::MissingFile {
                    path: shard.clone(),
                })?;
                fsutil::copy_atomic(shard, &dst.join(name))?;
            }
        }
        ComponentSource::Packed { .. } => {
            let none: &[(String, candle_core::Tensor)] = &[];
            write_component(c, none, None, dst)?;
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
