//! sdtrain: a Stable Diffusion fine-tuner (SD1.x, SD2.x, SDXL) on Candle.

// `--features mimalloc`: candle allocates a fresh buffer for every op, and mimalloc reuses freed
// pages where glibc's malloc returns large blocks to the kernel. Set here so the binary, the
// examples and the tests all run with it. Measured both ways in docs/BENCHMARKS.md.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

pub mod adapter;
pub mod cli;
pub mod config;
pub mod console;
pub mod data;
pub mod diffusion;
pub mod dist;
pub mod error_chain;
pub mod file_sniff;
pub mod fsutil;
pub mod inspect;
pub mod inspect_adapter;
#[cfg(test)]
pub(crate) mod kernel_emu;
pub mod linalg;
pub mod memory;
pub mod model;
pub mod nn;
pub mod optim;
pub mod precision;
pub mod py_json;
pub mod run_layout;
pub mod sample;
pub mod tensor_view;
pub mod tensorboard;
pub mod text_file;
pub mod torch_pickle;
pub mod train;
pub mod weights;
