//! A whole Stable Diffusion pipeline loaded from a diffusers folder ([`ModelLayout`]): the UNet,
//! the VAE, and one or two text encoders with their tokenizers. Every architecture comes from the
//! component's own `config.json`.
//!
//! Prompt conditioning follows the diffusers pipelines:
//! - SD1/SD2: `context = final_layer_norm(hidden_states[-(1 + clip_skip)])`
//!   (with `clip_skip = 0` that is `last_hidden_state`);
//! - SDXL: `context = cat(te1.hidden_states[-(2 + clip_skip)], te2.hidden_states[-(2 + clip_skip)])`
//!   without the final norm, and `pooled = te2`'s projected pooled output.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use super::clip::{ClipConfigError, ClipTextConfig, ClipTextModel, ClipTokenizer, TokenizerError};
use super::component_fit::{check_text_fit, check_vocab_fit, MisfitError};
use super::family::ModelFamily;
use super::files::{Component, ComponentFiles, ComponentSource, FilesError, TokenizerFiles};
use super::layout::ModelLayout;
use super::unet::{UNet2DConditionModel, UnetConfig, UnetConfigError};
use super::vae::{AutoencoderKL, VaeConfig, VaeConfigError};
use super::weights::{Weights, WeightsError};
use crate::error_chain::Chain;

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("{} lists no `{component}` component", root.display())]
    MissingComponent { root: PathBuf, component: Component },
    #[error(transparent)]
    UnetConfig(#[from] UnetConfigError),
    #[error(transparent)]
    VaeConfig(#[from] VaeConfigError),
    #[error(transparent)]
    ClipConfig(#[from] ClipConfigError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Files(#[from] FilesError),
    #[error(transparent)]
    Misfit(#[from] MisfitError),
    #[error("loading {component} from {}", dir.display())]
    Weights {
        component: Component,
        dir: PathBuf,
        source: Box<WeightsError>,
    },
}

impl PipelineError {
    /// True when the model is invalid (its configs, tokenizer or weights), which exits 2 as
    /// docs/models.md says, rather than the machine failing to read it.
    pub fn is_usage(&self) -> bool {
        match self {
            PipelineError::MissingComponent { .. }
            | PipelineError::UnetConfig(_)
            | PipelineError::VaeConfig(_)
            | PipelineError::ClipConfig(_)
            | PipelineError::Misfit(_) => true,
            PipelineError::Tokenizer(e) => !matches!(e, TokenizerError::Io { .. }),
            PipelineError::Files(e) => e.is_usage(),
            PipelineError::Weights { source, .. } => source.is_usage(),
        }
    }
}

/// How to load: the dtype weights are held in, the device, and which components are trainable
/// (their weights become `Var`s).
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// The dtype frozen weights are held in.
    pub dtype: DType,
    /// The dtype trainable components are held in: f32 masters, or bf16/f16 weights that the
    /// optimizer rounds stochastically (`weight_dtype`); cast to the input's dtype in the
    /// forward.
    pub trained_dtype: DType,
    /// The VAE's dtype when it differs from `dtype` (fp16 training keeps it in f32, as
    /// diffusers' scripts and kohya's `--no_half_vae` do: SD's VAE overflows in f16).
    pub vae_dtype: Option<DType>,
    pub device: Device,
    pub train_unet: bool,
    pub train_text_encoders: bool,
    /// Store the frozen UNet's Linear and Conv2d weights in fp8 (e4m3 with a scale per output
    /// channel, `nn::fp8`); the VAE and trainable components are never stored so.
    pub fp8_unet: bool,
    /// The same for the frozen text encoders.
    pub fp8_text_encoders: bool,
}

/// One text encoder and the tokenizer that feeds it.
pub struct TextEncoder {
    pub model: ClipTextModel,
    pub tokenizer: ClipTokenizer,
    pub weights: Weights,
}

/// What the UNet is conditioned on for a batch of prompts.
#[derive(Debug, Clone)]
pub struct TextConditioning {
    /// `[B, 77, cross_attention_dim]`.
    pub context: Tensor,
    /// SDXL's pooled text embedding `[B, projection_dim]`.
    pub pooled: Option<Tensor>,
}

pub struct StableDiffusion {
    pub layout: ModelLayout,
    pub unet: UNet2DConditionModel,
    pub unet_weights: Weights,
    /// `None` once released ([`StableDiffusion::release_vae`]).
    pub vae: Option<AutoencoderKL>,
    /// Empty once released ([`StableDiffusion::release_text_encoders`]).
    pub text_encoders: Vec<TextEncoder>,
    /// The VAE's pixels per latent, kept when the VAE is released.
    pub vae_scale: usize,
    /// The VAE's config (latent scaling), kept when the VAE is released.
    pub vae_config: VaeConfig,
}

impl StableDiffusion {
    /// The VAE, or an error saying it was released.
    pub fn vae(&self) -> candle_core::Result<&AutoencoderKL> {
        self.vae.as_ref().ok_or_else(|| {
            candle_core::Error::Msg(
                "the VAE was released after the latents were cached; this image was not cached"
                    .into(),
            )
        })
    }

    /// Frees the VAE's weights (device memory included) once every latent is cached.
    pub fn release_vae(&mut self) {
        self.vae = None;
    }

    /// Frees the text encoders once every caption's encoding is cached.
    pub fn release_text_encoders(&mut self) {
        self.text_encoders.clear();
    }

    pub fn load(layout: ModelLayout, opts: &LoadOptions) -> Result<Self, PipelineError> {
        let files = |c: Component| {
            layout
                .component(c)
                .ok_or_else(|| PipelineError::MissingComponent {
                    root: layout.root.clone(),
                    component: c,
                })
        };
        let unet_files = files(Component::Unet)?;
        let (text, origin) = unet_files.config_text()?;
        let unet_cfg = UnetConfig::from_json(&text, &origin.display().to_string())?;
        check_fit(&layout, &unet_cfg, &origin)?;
        let unet_weights = weights(unet_files, opts, opts.train_unet)?;
        let unet =
            UNet2DConditionModel::new(&unet_weights, &unet_cfg).map_err(|e| wrap(unet_files, e))?;

        let vae = load_vae(files(Component::Vae)?, opts)?;
        let vae_cfg = vae.config.clone();

        let mut text_encoders = Vec::new();
        for (i, c) in [Component::TextEncoder, Component::TextEncoder2]
            .into_iter()
            .enumerate()
        {
            let Some(te_files) = layout.component(c) else {
                continue;
            };
            let (model, w) = load_text_encoder(te_files, opts)?;
            let tokenizer = match layout.tokenizers.get(i) {
                Some(TokenizerFiles {
                    builtin: Some(b), ..
                }) => ClipTokenizer::builtin(b.vocab_size, &b.pad, b.max_length, &layout.root)?,
                Some(t) => match t.dir() {
                    Some(dir) => ClipTokenizer::from_dir(dir)?,
                    None => ClipTokenizer::from_dir(tokenizer_dir(&layout.root, c))?,
                },
                None => ClipTokenizer::from_dir(tokenizer_dir(&layout.root, c))?,
            };
            check_vocab_fit(&tokenizer, model.config.vocab_size, te_files.config_path())?;
            text_encoders.push(TextEncoder {
                model,
                tokenizer,
                weights: w,
            });
        }
        Ok(Self {
            layout,
            unet,
            unet_weights,
            vae_scale: vae.downscale_factor(),
            vae_config: vae_cfg.clone(),
            vae: Some(vae),
            text_encoders,
        })
    }

    pub fn family(&self) -> ModelFamily {
        self.layout.family
    }

    /// The text encoders the family conditions on (one for SD1/SD2, two for SDXL); an error when
    /// they were released because their outputs are cached.
    pub fn require_text_encoders(&self) -> candle_core::Result<()> {
        let needed = match self.family() {
            ModelFamily::Sd1 | ModelFamily::Sd2 => 1,
            ModelFamily::Sdxl => 2,
        };
        if self.text_encoders.len() < needed {
            candle_core::bail!(
                "the text encoders were released (their outputs are cached); this caption was \
                 not in the cache"
            );
        }
        Ok(())
    }

    /// Tokenises and encodes `prompts`. `clip_skip` counts the final text-encoder layers skipped
    /// beyond the family's default (0: SD1/SD2 use the last layer, SDXL the penultimate).
    pub fn encode_prompts(
        &self,
        prompts: &[&str],
        clip_skip: usize,
    ) -> candle_core::Result<TextConditioning> {
        self.require_text_encoders()?;
        // Ids stay on the host: the text model reads its pooled positions from them without a
        // device sync, then uploads them.
        let ids = |te: &TextEncoder| {
            te.tokenizer
                .encode_batch(prompts, &Device::Cpu)
                .map_err(|e| candle_core::Error::Msg(format!("tokenizing prompts: {}", Chain(&e))))
        };
        match self.family() {
            ModelFamily::Sd1 | ModelFamily::Sd2 => {
                let te = &self.text_encoders[0];
                let out = te.model.forward(&ids(te)?, clip_skip)?;
                let context = if clip_skip == 0 {
                    out.last_hidden_state
                } else {
                    te.model.final_layer_norm.forward(&out.hidden)?
                };
                Ok(TextConditioning {
                    context,
                    pooled: None,
                })
            }
            ModelFamily::Sdxl => {
                let (te1, te2) = (&self.text_encoders[0], &self.text_encoders[1]);
                let o1 = te1.model.forward(&ids(te1)?, 1 + clip_skip)?;
                let o2 = te2.model.forward(&ids(te2)?, 1 + clip_skip)?;
                let context =
                    Tensor::cat(&[&o1.hidden, &o2.hidden.to_dtype(o1.hidden.dtype())?], 2)?;
                Ok(TextConditioning {
                    context,
                    pooled: o2.text_embeds,
                })
            }
        }
    }
}

impl StableDiffusion {
    /// What text encoder `index` contributes to the context for `ids` `[B, L]` (on the host), as
    /// [`Self::encode_prompts`] takes it: SD1/SD2's last hidden state (`final_layer_norm` of an
    /// earlier layer under `clip_skip`), SDXL's un-normed hidden state before the last layer.
    /// `keep` masks keys out of the self-attention ([`ClipTextModel::forward_masked`]).
    pub fn encoder_context(
        &self,
        index: usize,
        ids: &Tensor,
        keep: Option<&[Vec<bool>]>,
        clip_skip: usize,
    ) -> candle_core::Result<Tensor> {
        let Some(te) = self.text_encoders.get(index) else {
            candle_core::bail!(
                "text encoder {index} is not loaded (released, or not in the model)"
            );
        };
        match self.family() {
            ModelFamily::Sd1 | ModelFamily::Sd2 => {
                let out = te.model.forward_masked(ids, clip_skip, keep)?;
                match clip_skip {
                    0 => Ok(out.last_hidden_state),
                    _ => te.model.final_layer_norm.forward(&out.hidden),
                }
            }
            ModelFamily::Sdxl => Ok(te.model.forward_masked(ids, 1 + clip_skip, keep)?.hidden),
        }
    }
}

/// The text encoders' configs checked against the UNet's ([`check_text_fit`]), before any
/// weights are read.
fn check_fit(
    layout: &ModelLayout,
    unet: &UnetConfig,
    unet_file: &Path,
) -> Result<(), PipelineError> {
    let mut encoders = Vec::new();
    for c in [Component::TextEncoder, Component::TextEncoder2] {
        if let Some(files) = layout.component(c) {
            let (text, origin) = files.config_text()?;
            encoders.push((ClipTextConfig::from_json(&text, &origin)?, origin));
        }
    }
    Ok(check_text_fit(unet, unet_file, &encoders)?)
}

/// Loads one text encoder from its component files, in either key layout
/// ([`ClipTextModel::new`]). SDXL's `text_encoder_2` is a `CLIPTextModelWithProjection` (its
/// pooled output is projected); `text_encoder` is a `CLIPTextModel`, and a `text_projection` its
/// file may carry is not read, as diffusers does not read it.
pub fn load_text_encoder(
    files: &ComponentFiles,
    opts: &LoadOptions,
) -> Result<(ClipTextModel, Weights), PipelineError> {
    let projection = match files.component {
        Component::TextEncoder2 => true,
        Component::TextEncoder | Component::Unet | Component::Vae => false,
    };
    let (text, origin) = files.config_text()?;
    let cfg = ClipTextConfig::from_json(&text, &origin)?;
    let w = weights(files, opts, opts.train_text_encoders)?;
    let mut model = ClipTextModel::new(&w, &cfg, projection).map_err(|e| wrap(files, e))?;
    // Trainable weights are in `trained_dtype`; activations run in the requested dtype.
    model.compute_dtype = opts.dtype;
    Ok((model, w))
}

/// Loads the (always frozen) VAE in `opts.vae_dtype`, else `opts.dtype`. Also how a run that
/// released its VAE gets it back for samples.
pub fn load_vae(
    files: &ComponentFiles,
    opts: &LoadOptions,
) -> Result<AutoencoderKL, PipelineError> {
    let (text, origin) = files.config_text()?;
    let cfg = VaeConfig::from_json(&text, &origin)?;
    let vae_opts = LoadOptions {
        dtype: opts.vae_dtype.unwrap_or(opts.dtype),
        ..opts.clone()
    };
    let w = weights(files, &vae_opts, false)?;
    AutoencoderKL::new(&w, &cfg).map_err(|e| wrap(files, e))
}

/// A component's frozen weights, read lazily (memory-mapped) in `dtype` on `device`: for code
/// that reads tensors by name without building the model.
pub fn component_weights(
    files: &ComponentFiles,
    dtype: DType,
    device: &Device,
) -> Result<Weights, PipelineError> {
    let opts = LoadOptions {
        dtype,
        vae_dtype: None,
        device: device.clone(),
        train_unet: false,
        train_text_encoders: false,
        fp8_unet: false,
        fp8_text_encoders: false,
        trained_dtype: dtype,
    };
    weights(files, &opts, false)
}

fn weights(
    files: &ComponentFiles,
    opts: &LoadOptions,
    trainable: bool,
) -> Result<Weights, PipelineError> {
    let dtype = if trainable {
        opts.trained_dtype
    } else {
        opts.dtype
    };
    let w = match &files.source {
        ComponentSource::Folder { weights, .. } => Weights::from_files(
            weights,
            files.component.folder(),
            dtype,
            &opts.device,
            trainable,
        )
        .map_err(|e| wrap(files, e))?,
        ComponentSource::Packed { packed, .. } => Weights::from_view(
            packed.view.clone(),
            files.component.folder(),
            dtype,
            &opts.device,
            trainable,
        ),
    };
    let fp8 = match files.component {
        Component::Unet => opts.fp8_unet,
        Component::Vae => false,
        _ => opts.fp8_text_encoders,
    };
    w.set_fp8_base(fp8 && !trainable);
    Ok(w)
}

fn wrap(files: &ComponentFiles, source: WeightsError) -> PipelineError {
    PipelineError::Weights {
        component: files.component,
        dir: files.location(),
        source: Box::new(source),
    }
}

fn tokenizer_dir(root: &Path, c: Component) -> PathBuf {
    root.join(c.tokenizer_folder().unwrap_or("tokenizer"))
}
