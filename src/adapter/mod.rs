//! Trainable adapters on a frozen base model: LoRA (Hu et al., arXiv 2106.09685) and kohya's
//! LoCon, `y = W·x + (alpha/rank)·up(down(x))`, attached where kohya sd-scripts'
//! `networks/lora.py` attaches them.
//!
//! - [`lora`]: one module and its init;
//! - [`attach`]: the target rules and attaching to a UNet or CLIP text encoder.

pub mod attach;
pub mod kohya_file;
pub mod kohya_names;
pub mod lora;
pub mod merge;

pub use attach::{
    attach_text_encoder, attach_unet, AdapterMode, AdapterSpec, AttachError, LayerGeometry,
};
pub use lora::{AdapterComponent, LoraKind, LoraModule, LoraShape};

use std::sync::Arc;

use candle_core::Var;

/// Every trainable Var of `modules`, `down` before `up`, in module order.
pub fn adapter_vars(modules: &[Arc<LoraModule>]) -> Vec<Var> {
    modules
        .iter()
        .flat_map(|m| [m.down.clone(), m.up.clone()])
        .collect()
}

/// Turns dropout on (training) or off for every module.
pub fn set_training(modules: &[Arc<LoraModule>], on: bool) {
    for m in modules {
        m.set_training(on)
    }
}
