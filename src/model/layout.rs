//! [`ModelLayout`]: everything sdtrain reads from a model, gathered in one place. A model is a
//! diffusers pipeline folder or a single-file checkpoint ([`LayoutSource`]); either gives the
//! family, the prediction type, the native resolution, and per component where its config and
//! tensors come from ([`ComponentFiles`]).
//!
//! This is the file I/O: a folder's `model_index.json`, component configs and scheduler config
//! are read here and handed to the detection in [`family`]; a single file is
//! opened by [`SingleFile::open`]. The weight files are chosen by the rules in [`files`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use super::family::{self, FamilyError, ModelFamily, PredictionType};
use super::files::{
    self, BuiltinTokenizer, Component, ComponentFiles, ComponentSource, FilesError, TokenizerFiles,
    MODEL_INDEX, SCHEDULER_CONFIG,
};
use super::single_file::{SingleFile, SingleFileOptions, TokenizerSource};

/// What a model was read from.
#[derive(Debug, Clone)]
pub enum LayoutSource {
    /// A diffusers pipeline folder (the layout's `root`): its JSON files are read on demand.
    Folder {
        /// `<root>/model_index.json`.
        model_index: PathBuf,
    },
    /// A single-file checkpoint (the layout's `root`), opened: its configs are in memory and its
    /// components' tensors are views into it.
    SingleFile(Arc<SingleFile>),
}

/// Everything sdtrain reads from a model: what the model is, and where each part comes from.
#[derive(Debug, Clone)]
pub struct ModelLayout {
    /// The pipeline folder, or the single file.
    pub root: PathBuf,
    pub family: ModelFamily,
    pub prediction_type: PredictionType,
    /// Square side in pixels the model was trained at.
    pub native_resolution: usize,
    /// Where the scheduler config comes from, as errors name it:
    /// `<root>/scheduler/scheduler_config.json`, or the single file.
    pub scheduler_config: PathBuf,
    /// The family's components, in [`Component::ALL`] order.
    pub components: Vec<ComponentFiles>,
    /// One entry per text encoder, in the same order.
    pub tokenizers: Vec<TokenizerFiles>,
    pub source: LayoutSource,
    /// The scheduler config in place of the model's own ([`ModelLayout::with_scheduler`]): a
    /// trained model's schedule, which saves and samples follow.
    pub scheduler_override: Option<Arc<Value>>,
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
            if let Some(variant) = variant {
                return Err(FamilyError::VariantOfSingleFile {
                    file: root.to_path_buf(),
                    variant: variant.to_string(),
                });
            }
            return Self::from_single_file(SingleFile::open(root, single)?);
        }
        refuse_single_file_options(root, single)?;
        Self::read_folder(root, variant)
    }

    /// The layout of the pipeline folder `root`.
    fn read_folder(root: &Path, variant: Option<&str>) -> Result<Self, FamilyError> {
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
        let text_encoder = match te_file.is_file() {
            true => Some(files::read_json(&te_file)?),
            false => None,
        };
        let family = family::detect_family(&family::Configs {
            model_index: &index_json,
            unet: &unet,
            text_encoder: text_encoder.as_ref(),
        })?;
        let vae_file = root.join("vae/config.json");
        let vae = files::read_json(&vae_file)?;
        let native_resolution = family::native_resolution(&unet, &unet_file, &vae, &vae_file)?;
        family::check_latent_channels(&unet, &unet_file, &vae, &vae_file)?;
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
            scheduler_config,
            components,
            tokenizers,
            source: LayoutSource::Folder { model_index },
            scheduler_override: None,
        })
    }

    /// The layout of an opened single file: configs in memory, weights through its views.
    pub fn from_single_file(sf: SingleFile) -> Result<Self, FamilyError> {
        let path = sf.path.clone();
        let named = |what: &str| path.join(format!("<{what}>"));
        let config = |c: Component| {
            sf.component(c)
                .map(|p| p.config.clone())
                .unwrap_or_default()
        };
        let (unet, vae) = (config(Component::Unet), config(Component::Vae));
        let (unet_file, vae_file) = (named("unet config"), named("vae config"));
        let native_resolution = family::native_resolution(&unet, &unet_file, &vae, &vae_file)?;
        family::check_latent_channels(&unet, &unet_file, &vae, &vae_file)?;
        let prediction_type =
            PredictionType::from_scheduler_config(&sf.scheduler, &named("scheduler config"))?;
        let components = sf
            .components
            .iter()
            .map(|(c, p)| ComponentFiles {
                component: *c,
                source: ComponentSource::Packed {
                    file: path.clone(),
                    packed: p.clone(),
                },
            })
            .collect();
        let tokenizers = sf
            .tokenizers
            .iter()
            .map(|(folder, src)| single_file_tokenizer(folder, src))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            root: path.clone(),
            family: sf.family,
            prediction_type,
            native_resolution,
            scheduler_config: path,
            components,
            tokenizers,
            source: LayoutSource::SingleFile(Arc::new(sf)),
            scheduler_override: None,
        })
    }

    /// The opened single file, when the model is one.
    pub fn single_file(&self) -> Option<&SingleFile> {
        match &self.source {
            LayoutSource::Folder { .. } => None,
            LayoutSource::SingleFile(sf) => Some(sf),
        }
    }

    /// The scheduler config: the override when there is one, else the model's.
    pub fn scheduler_json(&self) -> Result<Value, FilesError> {
        if let Some(s) = &self.scheduler_override {
            return Ok(Value::clone(s));
        }
        self.base_scheduler_json()
    }

    /// The model's own scheduler config, whatever the override.
    pub fn base_scheduler_json(&self) -> Result<Value, FilesError> {
        match &self.source {
            LayoutSource::Folder { .. } => files::read_json(&self.scheduler_config),
            LayoutSource::SingleFile(sf) => Ok(sf.scheduler.clone()),
        }
    }

    /// This layout with `scheduler` as its scheduler config (for what is sampled and saved; the
    /// prediction type stays the model's).
    pub fn with_scheduler(&self, scheduler: Value) -> Self {
        Self {
            scheduler_override: Some(Arc::new(scheduler)),
            ..self.clone()
        }
    }

    /// `model_index.json`, whose `scheduler` entry names the overriding config's class.
    pub fn model_index_json(&self) -> Result<Value, FilesError> {
        let mut index = match &self.source {
            LayoutSource::Folder { model_index } => files::read_json(model_index)?,
            LayoutSource::SingleFile(sf) => sf.model_index.clone(),
        };
        if let Some(s) = &self.scheduler_override {
            super::zero_snr::name_scheduler_class(&mut index, s);
        }
        Ok(index)
    }

    /// This layout with `vae` in place of the model's VAE ([`super::vae_source`]).
    pub fn with_vae(mut self, vae: ComponentFiles) -> Self {
        for c in &mut self.components {
            if c.component == Component::Vae {
                *c = vae.clone();
            }
        }
        self
    }

    pub fn component(&self, component: Component) -> Option<&ComponentFiles> {
        self.components.iter().find(|c| c.component == component)
    }

    /// Every file sdtrain would open, configs first, then weights and tokenizer files.
    pub fn all_files(&self) -> Vec<PathBuf> {
        let mut out = match &self.source {
            LayoutSource::SingleFile(_) => vec![self.root.clone()],
            LayoutSource::Folder { model_index } => {
                let mut out = vec![model_index.clone(), self.scheduler_config.clone()];
                for c in &self.components {
                    out.push(c.config_path().to_path_buf());
                    out.extend(c.index().map(Path::to_path_buf));
                    // `.bin` weights, then the converted copy read in their place.
                    out.extend(c.torch_files().iter().cloned());
                    out.extend(c.weights().iter().cloned());
                }
                out
            }
        };
        for t in &self.tokenizers {
            out.extend(t.files.iter().cloned());
        }
        out
    }
}

/// Refuses the options that only a single file takes, for the folder `root`.
fn refuse_single_file_options(root: &Path, single: &SingleFileOptions) -> Result<(), FamilyError> {
    let option = if single.model_config.is_some() {
        Some("model_config")
    } else if single.prediction_type.is_some() {
        Some("prediction_type")
    } else {
        None
    };
    match option {
        Some(option) => Err(FamilyError::SingleFileOption {
            dir: root.to_path_buf(),
            option,
        }),
        None => Ok(()),
    }
}

/// The tokenizer of a single file's text encoder: sdtrain's built-in BPE, or a folder of
/// `model_config`.
fn single_file_tokenizer(
    folder: &str,
    src: &TokenizerSource,
) -> Result<TokenizerFiles, FilesError> {
    match src {
        TokenizerSource::Builtin {
            vocab_size,
            pad,
            max_length,
        } => Ok(TokenizerFiles {
            folder: folder.to_string(),
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
    }
}
