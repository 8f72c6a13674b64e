//! sdtrain: a Stable Diffusion fine-tuner (SD1.x, SD2.x, SDXL) on Candle.

pub mod cli;
pub mod inspect;
pub mod model;
pub mod nn;
