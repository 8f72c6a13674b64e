//! The training loop, checkpoints and outputs.

pub mod accumulate;
mod adapter_blocks;
pub mod adapters;
mod block_lr;
mod cache_share;
mod caches;
pub mod checkpoint_choice;
mod class_images;
mod config_subsets;
pub mod data_feed;
pub mod data_parallel;
#[cfg(test)]
mod data_parallel_tests;
pub mod ema;
mod ema_init;
pub mod embeddings;
mod fused;
mod fused_step;
#[cfg(test)]
mod fused_tests;
pub mod interrupt;
mod kohya_datasets_metadata;
pub mod kohya_run_metadata;
pub mod latent_cache;
mod latent_exchange;
pub mod log;
pub mod loss_stats;
pub mod memory_plan;
pub mod micro_batch;
mod modelspec;
pub mod oom;
mod oom_policy;
mod optimizer_step;
mod outcome;
mod param_groups;
pub mod progress;
pub mod rank_agreement;
pub mod resume;
#[cfg(test)]
mod retry_tests;
pub mod run_dir;
mod sample_cursor;
pub mod samples;
pub mod sampling_memory;
mod save_schedule;
mod saving;
mod settings_reload;
mod setup;
pub mod state_estimate;
pub mod step;
mod step_caption;
pub mod summary;
pub mod te_freeze;
#[cfg(test)]
mod test_runs;
pub mod text_cache;
mod trained_schedule;
pub mod trainer;
pub mod validation;
#[cfg(test)]
mod watch_tests;
pub mod weighted_captions;

pub use outcome::TrainOutcome;
pub use trainer::{train, RunOptions};
