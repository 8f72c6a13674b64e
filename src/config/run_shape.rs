//! The run's shape: what the plan leaves to the model, the device and the data, decided here
//! once for `train` and `--dry-run` alike:
//! - the resolution: `resolution`, or the model's native one;
//! - the precision: `amp`, or the device's default ([`Amp::default_for`]);
//! - the length in optimizer steps: `max_steps`, or the steps of `max_epochs` epochs, whichever
//!   is fewer.

use serde::Serialize;

use super::{DatasetShape, TrainPlan};
use crate::precision::Amp;

/// The resolution and precision a run computes at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RunShape {
    pub resolution: usize,
    pub amp: Amp,
}

impl TrainPlan {
    /// The shape of this run on a model of `native_resolution`, on a device whose default
    /// precision is `device_amp`.
    pub fn run_shape(&self, native_resolution: usize, device_amp: Amp) -> RunShape {
        RunShape {
            resolution: self.data.resolution.unwrap_or(native_resolution),
            amp: match self.precision.amp {
                super::AmpChoice::DeviceDefault => device_amp,
                super::AmpChoice::Set(amp) => amp,
            },
        }
    }

    /// What each dataset trains at: a dataset config's `[[datasets]]` entries, else one shape
    /// from train.json. The first is the run's own (`resolution`, `batch_size`, `buckets`).
    pub fn dataset_shapes(&self) -> Vec<DatasetShape> {
        match &self.data.dataset_config {
            Some(c) if !c.shapes.is_empty() => c.shapes.clone(),
            _ => vec![DatasetShape {
                name: "train.json".into(),
                resolution: self.data.resolution,
                batch_size: self.batch_size,
                buckets: self.data.buckets.clone(),
            }],
        }
    }

    /// The largest micro-batch of any dataset: what a forward pass takes at most.
    pub fn largest_batch(&self) -> usize {
        self.dataset_shapes()
            .iter()
            .map(|s| s.batch_size)
            .max()
            .unwrap_or(self.batch_size)
    }

    /// The run's length in optimizer steps: `max_steps`, or the steps of `max_epochs` epochs,
    /// whichever is fewer, where `epoch_steps(e)` counts (0-based) epoch `e`'s steps. Epochs are
    /// counted one by one, since runt batches and fractional multipliers make their lengths
    /// differ. The automatic LR warmup and decay are computed from this length
    /// ([`super::ScheduleSpec::resolve`]).
    pub fn total_steps(&self, mut epoch_steps: impl FnMut(usize) -> usize) -> usize {
        let by_steps = self.max_steps.map_or(usize::MAX, |s| s as usize);
        let Some(epochs) = self.max_epochs else {
            return by_steps;
        };
        let mut total = 0usize;
        for epoch in 0..epochs as usize {
            total += epoch_steps(epoch);
            if total >= by_steps {
                return by_steps;
            }
        }
        total
    }
}
