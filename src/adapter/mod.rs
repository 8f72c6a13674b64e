//! Trainable adapters on a frozen base model: LoRA (Hu et al., arXiv 2106.09685) and kohya's
//! LoCon, `y = W·x + (alpha/rank)·up(down(x))`, attached where kohya sd-scripts'
//! `networks/lora.py` attaches them, and LyCORIS's LoHa, LoKr and DoRA on LoCon's targets.
//!
//! - [`factors`]: the weight update each type encodes, as LyCORIS rebuilds it;
//! - [`lora`]: one module and its init;
//! - [`attach`]: the target rules and attaching to a UNet or CLIP text encoder;
//! - [`kohya_names`], [`kohya_file`]: kohya's module names and file format, and
//!   [`kohya_naming`], which names a loaded model's modules;
//! - [`merge`]: folding a kohya file into a model's weights;
//! - the commands on files: [`extract_command`] (a LoRA from two models), [`resize_command`]
//!   (a LoRA at a lower rank, [`resize`]) and [`merge_command`] (LoRAs folded into a saved model,
//!   or merged into one LoRA: [`svd_merge_command`], [`svd_merge`]).

pub mod addnet_hash;
pub mod attach;
pub mod block_weights;
pub mod diffusers_keys;
pub mod embedding_file;
pub mod extract;
pub mod extract_command;
pub mod factors;
pub mod kohya_file;
pub mod kohya_meta;
pub mod kohya_names;
pub mod layer_filter;
pub mod lora;
pub mod max_norm;
pub mod merge;
pub mod merge_command;
pub mod resize;
pub mod resize_command;
pub mod svd_merge;
pub mod svd_merge_command;

pub use attach::{
    attach_text_encoder, attach_unet, AdapterMode, AdapterSpec, AttachError, LayerGeometry,
};
pub use factors::Algo;
pub use lora::{AdapterComponent, LoraKind, LoraModule, LoraShape, ModuleAlgo};

use std::sync::Arc;

use candle_core::Var;

use crate::model::family::ModelFamily;
use crate::model::pipeline::StableDiffusion;
use crate::model::unet::config::BlockKind;
use kohya_names::{KohyaNaming, UnetLayout};

/// Every trainable Var of `modules`, in module order and, within a module, in init order (`down`
/// before `up`).
pub fn adapter_vars(modules: &[Arc<LoraModule>]) -> Vec<Var> {
    modules
        .iter()
        .flat_map(|m| m.params.iter().map(|(_, v)| v.clone()))
        .collect()
}

/// Turns dropout on (training) or off for every module.
pub fn set_training(modules: &[Arc<LoraModule>], on: bool) {
    for m in modules {
        m.set_training(on)
    }
}

/// The modules taken out of their layers' forwards while it lives (a prior prediction: the
/// model without its adapters); they are put back when it drops, on an error too.
pub struct Bypassed<'a>(&'a [Arc<LoraModule>]);

impl<'a> Bypassed<'a> {
    pub fn new(modules: &'a [Arc<LoraModule>]) -> Self {
        for m in modules {
            m.set_bypassed(true)
        }
        Self(modules)
    }
}

impl Drop for Bypassed<'_> {
    fn drop(&mut self) {
        for m in self.0 {
            m.set_bypassed(false)
        }
    }
}

/// How kohya files name this model's modules: diffusers paths for SD1/SD2, LDM block names laid
/// out from the UNet's own config for SDXL.
pub fn kohya_naming(sd: &StableDiffusion) -> KohyaNaming {
    kohya_naming_for(sd.family(), &sd.unet.config)
}

/// [`kohya_naming`] for a model not loaded: its family and UNet config.
pub fn kohya_naming_for(family: ModelFamily, cfg: &crate::model::unet::UnetConfig) -> KohyaNaming {
    match family {
        ModelFamily::Sdxl => {
            let layers = cfg.down_blocks.first().map_or(2, |b| b.layers);
            let attention: Vec<bool> = cfg
                .down_blocks
                .iter()
                .map(|b| b.kind == BlockKind::CrossAttn)
                .collect();
            KohyaNaming::Ldm(UnetLayout::mirrored(layers, &attention))
        }
        ModelFamily::Sd1 | ModelFamily::Sd2 => KohyaNaming::Diffusers,
    }
}
