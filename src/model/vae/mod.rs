//! AutoencoderKL: the SD VAE (SD1.x, SD2.x and SDXL share the architecture), written from our own
//! differentiable layers so it can be fine-tuned as well as used to encode training images.
//!
//! - [`config`] reads `vae/config.json`;
//! - [`encoder`], [`decoder`] and [`mid_block`] are diffusers' `Encoder`, `Decoder` and
//!   `UNetMidBlock2D`;
//! - [`autoencoder`] holds `AutoencoderKL`, the posterior and the latent scaling.

pub mod autoencoder;
pub mod config;
pub mod decoder;
pub mod encoder;
pub mod mid_block;

pub use autoencoder::{scale_latents_with, AutoencoderKL, DiagonalGaussian};
pub use config::{SampleSize, VaeConfig, VaeConfigError};
pub use decoder::{Decoder, UpDecoderBlock2D};
pub use encoder::{DownEncoderBlock2D, Encoder};
pub use mid_block::{VaeAttention, VaeMidBlock};
