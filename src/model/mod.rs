//! Stable Diffusion models written for training, and their loading.

pub mod attention;
pub mod clip;
pub mod component_fit;
pub mod convert_command;
pub mod export;
pub mod family;
pub mod files;
pub mod layout;
pub mod long_prompt;
pub mod nonfinite_weights;
pub mod pipeline;
pub mod reference_configs;
pub mod resnet;
pub mod sampling;
pub mod single_file;
pub mod size_limits;
pub mod source;
pub mod textual_inversion;
pub mod unet;
pub mod vae;
pub mod vae_source;
pub mod zero_snr;
// Weight loading lives at the crate root so `nn` does not depend on `model`; re-exported here
// for the model-facing path `model::weights`.
pub use crate::weights;
