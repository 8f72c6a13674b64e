//! sdtrain: a Stable Diffusion fine-tuner (SD1.x, SD2.x, SDXL) on Candle.

pub mod adapter;
pub mod cli;
pub mod config;
pub mod data;
pub mod diffusion;
pub mod fsutil;
pub mod inspect;
pub mod memory;
pub mod model;
pub mod nn;
pub mod optim;
pub mod train;
