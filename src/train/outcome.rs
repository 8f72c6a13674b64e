//! [`TrainOutcome`]: what a finished (or interrupted) run did, for the summary and the tests.

use std::path::PathBuf;

use super::loss_stats::first_last_means;
use super::micro_batch::MicroBatching;
use crate::data::epoch_plan::BucketCount;
use crate::memory::MemoryUsage;

/// What a finished (or interrupted) run did.
#[derive(Debug, Clone)]
pub struct TrainOutcome {
    pub run_dir: PathBuf,
    pub steps: usize,
    pub epochs_completed: usize,
    pub images_seen: usize,
    pub losses: Vec<f64>,
    pub skipped_steps: usize,
    pub skipped_images: usize,
    pub saved: Vec<PathBuf>,
    pub interrupted: bool,
    pub wall_secs: f64,
    /// Memory at the end of the run, with the run's peak (device pool on CUDA, RSS on the CPU).
    pub memory: Option<MemoryUsage>,
    /// The micro-batch size at the end and the out-of-memory retries that set it.
    pub micro: MicroBatching,
    /// `vram_limit_gb` in force, described (`12.0 GiB of a 79.6 GiB card …`).
    pub vram_cap: Option<String>,
    /// `(step, loss)` of each validation, and the validation set's size.
    pub val_losses: Vec<(usize, f64)>,
    pub val_images: usize,
    /// Images per aspect bucket.
    pub buckets: Vec<BucketCount>,
    /// Samples repeated to fill runt batches, over the run's epochs.
    pub repeated_samples: usize,
    /// Samples left out of a step because their file failed to decode.
    pub failed_samples: usize,
    /// What the latent and text-encoder caches did, in words.
    pub caches: Vec<String>,
}

impl TrainOutcome {
    /// Mean loss of the first and last 20% of steps.
    pub fn first_last_loss(&self) -> Option<(f64, f64)> {
        first_last_means(&self.losses, 0.2)
    }
}
