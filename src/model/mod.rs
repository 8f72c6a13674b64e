//! Stable Diffusion models written for training, and their loading.

pub mod attention;
pub mod clip;
pub mod export;
pub mod family;
pub mod files;
pub mod pipeline;
pub mod reference_configs;
pub mod resnet;
pub mod sampling;
pub mod source;
pub mod unet;
pub mod vae;
pub mod weights;
