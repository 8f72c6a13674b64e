//! The training loop, checkpoints and outputs.

pub mod accumulate;
pub mod adapters;
pub mod data_feed;
pub mod ema;
pub mod interrupt;
pub mod latent_cache;
pub mod log;
pub mod loss_stats;
pub mod memory_plan;
pub mod micro_batch;
pub mod oom;
pub mod progress;
pub mod resume;
#[cfg(test)]
mod retry_tests;
pub mod run_dir;
pub mod samples;
pub mod state_estimate;
pub mod step;
pub mod summary;
pub mod te_freeze;
pub mod text_cache;
pub mod trainer;
pub mod validation;

pub use trainer::{train, RunOptions, TrainOutcome};
