//! A VAE in place of the model's own: kohya's `--vae`, diffusers' training scripts'
//! `--pretrained_vae_model_name_or_path`, OneTrainer's VAE override. SDXL users train with
//! `madebyollin/sdxl-vae-fp16-fix` (the base VAE overflows in fp16), SD1.5 users with
//! `stabilityai/sd-vae-ft-mse`. The VAE is read from, as kohya's `load_vae` reads it:
//!
//! - a folder holding a VAE (`config.json` and its weights: a VAE repo's snapshot, a
//!   pipeline's `vae/` folder), or a pipeline folder (its `vae/`);
//! - one `.safetensors` file: A1111's VAE files (LDM names, `encoder.down.0.block.0.…`), the
//!   same under `first_stage_model.` (a full checkpoint, whose VAE alone is taken), or
//!   diffusers' names (`encoder.down_blocks.0.resnets.0.…`). Such a file has no config: it is
//!   read with the model's VAE config, as kohya reads it with SD's;
//! - a hub repo id (`org/name[@revision]`) holding a VAE at its root or under `vae/`, from the
//!   hub cache (downloaded when not cached, unless offline).
//!
//! A torch file (`.pt`, `.ckpt`, A1111's VAE files) is read as data, never run, through its
//! converted copy ([`crate::torch_pickle`]), as `--model` reads one. The VAE must make latents
//! of the UNet's channel count; a VAE of another architecture is refused naming both counts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::safetensors::MmapedSafetensors;

use super::files::{self, Component, ComponentFiles, ComponentSource, FilesError, PackedComponent};
use super::single_file::names::{Mapped, VaeBlocks};
use super::single_file::{self, skip_reason, SingleFileError};
use super::source::{self, HubEnv, ModelSource, SourceError};
use super::vae::VaeConfig;
use crate::tensor_view::{TensorView, ViewError, ViewOp};

#[derive(Debug, thiserror::Error)]
pub enum VaeSourceError {
    #[error("vae `{spec}`")]
    Source {
        spec: String,
        #[source]
        source: SourceError,
    },
    #[error("vae {}", path.display())]
    Files {
        path: PathBuf,
        #[source]
        source: FilesError,
    },
    #[error("vae {}", path.display())]
    File {
        path: PathBuf,
        #[source]
        source: Box<SingleFileError>,
    },
    #[error("vae {}", path.display())]
    View {
        path: PathBuf,
        #[source]
        source: Box<ViewError>,
    },
    #[error(
        "vae {}: holds neither a VAE (config.json with its weights) nor a pipeline's vae/ folder",
        path.display()
    )]
    NotAVaeFolder { path: PathBuf },
    #[error(
        "vae {}: holds no VAE tensors; expected A1111's names (encoder.down.0.block.0.…, with or \
         without first_stage_model.) or diffusers' (encoder.down_blocks.0.resnets.0.…)",
        path.display()
    )]
    NoVaeTensors { path: PathBuf },
    #[error(
        "vae {}: {count} tensor(s) are not VAE weights of the model's VAE layout: {}",
        path.display(),
        names.join(", ")
    )]
    Unknown {
        path: PathBuf,
        count: usize,
        names: Vec<String>,
    },
    #[error("vae {}: its config does not parse: {message}", path.display())]
    Config { path: PathBuf, message: String },
    #[error(
        "vae {}: makes latents of {found} channels; the model's VAE (and UNet) use {expected}",
        path.display()
    )]
    Latents {
        path: PathBuf,
        found: usize,
        expected: usize,
    },
}

impl VaeSourceError {
    /// True when the `vae` setting or the files it names are at fault (exit code 2).
    pub fn is_usage(&self) -> bool {
        match self {
            VaeSourceError::Source { source, .. } => source.is_usage(),
            VaeSourceError::Files { source, .. } => source.is_usage(),
            VaeSourceError::File { source, .. } => source.is_usage(),
            VaeSourceError::View { .. }
            | VaeSourceError::NotAVaeFolder { .. }
            | VaeSourceError::NoVaeTensors { .. }
            | VaeSourceError::Unknown { .. }
            | VaeSourceError::Config { .. }
            | VaeSourceError::Latents { .. } => true,
        }
    }
}

/// The VAE a run uses in place of the model's.
#[derive(Debug, Clone)]
pub struct VaeOverride {
    pub files: ComponentFiles,
    /// kohya's `ss_vae_name`: a local file's or folder's name, else the repo id.
    pub name: String,
    /// The file, when the VAE is one file (kohya records its hashes).
    pub file: Option<PathBuf>,
    /// What was read, for the console.
    pub described: String,
}

/// Opens the VAE `spec` names (see the module header); `base` is the model's own VAE, whose
/// config reads a config-less file and whose latent channels the VAE must match.
pub fn open_vae(
    spec: &str,
    base: &ComponentFiles,
    variant: Option<&str>,
) -> Result<VaeOverride, VaeSourceError> {
    let path = Path::new(spec);
    let local_name = || {
        path.file_name()
            .map_or(spec.to_string(), |n| n.to_string_lossy().into_owned())
    };
    let out = if path.is_dir() {
        let files = vae_folder(path, variant)?;
        VaeOverride {
            described: format!("{} (diffusers folder)", files.location().display()),
            files,
            name: local_name(),
            file: None,
        }
    } else if path.is_file() && crate::torch_pickle::has_torch_extension(path) {
        // A1111's `.pt`/`.ckpt` VAEs: read through a converted copy, as `--model` reads them.
        let source_err = |source| VaeSourceError::Source {
            spec: spec.to_string(),
            source,
        };
        let copy = source::torch_copy(path).map_err(source_err)?;
        let files = vae_file(&copy.path, base)?;
        VaeOverride {
            described: format!(
                "{spec} (torch file read through its copy {}, with the model's VAE config)",
                copy.path.display()
            ),
            files,
            name: local_name(),
            file: Some(path.to_path_buf()),
        }
    } else if path.is_file() {
        let files = vae_file(path, base)?;
        VaeOverride {
            described: format!("{} (single file, read with the model's VAE config)", spec),
            files,
            name: local_name(),
            file: Some(path.to_path_buf()),
        }
    } else {
        let source_err = |source| VaeSourceError::Source {
            spec: spec.to_string(),
            source,
        };
        let ModelSource::Hub { repo_id, revision } =
            ModelSource::parse(spec).map_err(source_err)?
        else {
            return Err(source_err(SourceError::InvalidSpec {
                spec: spec.to_string(),
            }));
        };
        let env = HubEnv::from_env().map_err(source_err)?;
        let ready = |dir: &Path| vae_folder_files(dir, variant).map(|_| ());
        let plan = |repo_files: &[String]| hub_plan(&repo_id, repo_files, variant);
        let dir =
            source::resolve_component_repo(&repo_id, revision.as_deref(), &env, &ready, &plan)
                .map_err(source_err)?;
        let files = vae_folder(&dir.path, variant)?;
        VaeOverride {
            described: format!("{spec} (hub repo, {})", files.location().display()),
            files,
            name: spec.to_string(),
            file: None,
        }
    };
    check_latents(&out.files, base)?;
    Ok(out)
}

/// The VAE of a folder: the folder itself when it has a `config.json`, else its `vae/`.
fn vae_folder_files(dir: &Path, variant: Option<&str>) -> Result<ComponentFiles, FilesError> {
    if dir.join("config.json").is_file() {
        files::folder_files(dir, Component::Vae, variant)
    } else if dir.join(Component::Vae.folder()).is_dir() {
        files::component_files(dir, Component::Vae, variant)
    } else {
        Err(FilesError::MissingFile {
            path: dir.join("config.json"),
        })
    }
}

fn vae_folder(dir: &Path, variant: Option<&str>) -> Result<ComponentFiles, VaeSourceError> {
    if !dir.join("config.json").is_file() && !dir.join(Component::Vae.folder()).is_dir() {
        return Err(VaeSourceError::NotAVaeFolder {
            path: dir.to_path_buf(),
        });
    }
    vae_folder_files(dir, variant).map_err(|source| VaeSourceError::Files {
        path: dir.to_path_buf(),
        source,
    })
}

/// The files to download from a VAE repo: its root's config and weights, else its `vae/`'s.
fn hub_plan(
    repo_id: &str,
    repo_files: &[String],
    variant: Option<&str>,
) -> Result<files::HubPlan, FilesError> {
    let folder = if repo_files.iter().any(|f| f == "config.json") {
        ""
    } else if repo_files.iter().any(|f| f == "vae/config.json") {
        "vae/"
    } else {
        return Err(FilesError::MissingFile {
            path: PathBuf::from(format!("{repo_id}/config.json")),
        });
    };
    let names: Vec<String> = repo_files
        .iter()
        .filter_map(|f| f.strip_prefix(folder))
        .filter(|f| !f.contains('/'))
        .map(str::to_string)
        .collect();
    let location = format!("{repo_id}/{folder}");
    let mut plan = files::HubPlan {
        files: vec![format!("{folder}config.json")],
        indexes: Vec::new(),
    };
    match files::choose_weights(&location, &names, variant)? {
        files::WeightChoice::Single(f) | files::WeightChoice::Torch(f) => {
            plan.files.push(format!("{folder}{f}"))
        }
        files::WeightChoice::Sharded { index } | files::WeightChoice::TorchSharded { index } => {
            plan.files.push(format!("{folder}{index}"));
            plan.indexes.push(format!("{folder}{index}"));
        }
    }
    Ok(plan)
}

/// One `.safetensors` file's VAE tensors under diffusers' names, with the model's VAE config.
fn vae_file(path: &Path, base: &ComponentFiles) -> Result<ComponentFiles, VaeSourceError> {
    let file_err = |source| VaeSourceError::File {
        path: path.to_path_buf(),
        source: Box::new(source),
    };
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .unwrap_or_default();
    if single_file::PICKLE_EXTENSIONS.contains(&ext.as_str()) {
        return Err(file_err(SingleFileError::Pickle {
            path: path.to_path_buf(),
        }));
    }
    if ext != "safetensors" {
        return Err(file_err(SingleFileError::NotSafetensors {
            path: path.to_path_buf(),
        }));
    }
    let (shapes, _) = single_file::read_header(path).map_err(file_err)?;
    let config = base.config_json().map_err(|source| VaeSourceError::Files {
        path: base.location(),
        source,
    })?;
    let blocks = VaeBlocks {
        levels: vae_config(&config, base.config_path())?
            .block_out_channels
            .len(),
    };
    let map = vae_names(path, &shapes, blocks)?;
    // SAFETY: mapped read-only for the life of the view; sdtrain never writes into a file it
    // has loaded.
    let st = unsafe { MmapedSafetensors::new(path) }.map_err(|e| {
        file_err(SingleFileError::Read {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    })?;
    let view = TensorView::new(path, Arc::new(st), map).map_err(|source| VaeSourceError::View {
        path: path.to_path_buf(),
        source: Box::new(source),
    })?;
    Ok(ComponentFiles {
        component: Component::Vae,
        source: ComponentSource::Packed {
            file: path.to_path_buf(),
            packed: Arc::new(PackedComponent {
                config,
                view: Arc::new(view),
            }),
        },
    })
}

/// Diffusers name → (stored name, op) for a VAE file's tensors: a full checkpoint's
/// `first_stage_model.*` (the rest left alone), A1111's LDM names, or diffusers' own.
fn vae_names(
    path: &Path,
    shapes: &BTreeMap<String, Vec<usize>>,
    blocks: VaeBlocks,
) -> Result<BTreeMap<String, (String, ViewOp)>, VaeSourceError> {
    let full = shapes.keys().any(|k| k.starts_with(single_file::VAE));
    let diffusers = !full
        && shapes
            .keys()
            .any(|k| k.starts_with("encoder.down_blocks.") || k.starts_with("decoder.up_blocks."));
    let mut map = BTreeMap::new();
    let mut unknown = Vec::new();
    for (name, shape) in shapes {
        let rest = match (full, name.strip_prefix(single_file::VAE)) {
            (true, Some(rest)) => rest,
            (true, None) => continue,
            (false, _) => name.as_str(),
        };
        if diffusers {
            let vae = ["encoder.", "decoder.", "quant_conv.", "post_quant_conv."];
            match vae.iter().any(|p| name.starts_with(p)) {
                true => {
                    map.insert(name.clone(), (name.clone(), ViewOp::Same));
                }
                false if skip_reason(name).is_some() => {}
                false => unknown.push(name.clone()),
            }
            continue;
        }
        match single_file::vae_tensor(rest, shape, blocks) {
            Mapped::To(list) => {
                for (d, op) in list {
                    map.insert(d, (name.clone(), op));
                }
            }
            _ if skip_reason(name).is_some() => {}
            _ => unknown.push(name.clone()),
        }
    }
    if map.is_empty() {
        return Err(VaeSourceError::NoVaeTensors {
            path: path.to_path_buf(),
        });
    }
    if !unknown.is_empty() {
        let count = unknown.len();
        unknown.truncate(8);
        return Err(VaeSourceError::Unknown {
            path: path.to_path_buf(),
            count,
            names: unknown,
        });
    }
    Ok(map)
}

fn vae_config(config: &serde_json::Value, from: &Path) -> Result<VaeConfig, VaeSourceError> {
    VaeConfig::from_json(&config.to_string(), from).map_err(|e| VaeSourceError::Config {
        path: from.to_path_buf(),
        message: crate::error_chain::chain_text(&e),
    })
}

/// The VAE's latent channels must be the model's.
fn check_latents(files: &ComponentFiles, base: &ComponentFiles) -> Result<(), VaeSourceError> {
    let read = |c: &ComponentFiles| {
        let json = c.config_json().map_err(|source| VaeSourceError::Files {
            path: c.location(),
            source,
        })?;
        vae_config(&json, c.config_path())
    };
    let (found, expected) = (read(files)?.latent_channels, read(base)?.latent_channels);
    if found != expected {
        return Err(VaeSourceError::Latents {
            path: files.location(),
            found,
            expected,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vae_repo_downloads_its_root_or_its_vae_folder() {
        let root = [
            "config.json",
            "diffusion_pytorch_model.safetensors",
            "README.md",
        ]
        .map(String::from);
        let plan = hub_plan("o/vae", &root, None).unwrap();
        assert_eq!(
            plan.files,
            ["config.json", "diffusion_pytorch_model.safetensors"]
        );
        let nested = [
            "model_index.json",
            "vae/config.json",
            "vae/diffusion_pytorch_model.fp16.safetensors",
            "unet/config.json",
        ]
        .map(String::from);
        let plan = hub_plan("o/pipe", &nested, None).unwrap();
        assert_eq!(
            plan.files,
            [
                "vae/config.json",
                "vae/diffusion_pytorch_model.fp16.safetensors"
            ]
        );
        let none = ["README.md".to_string()];
        assert!(hub_plan("o/x", &none, None).is_err());
    }
}
