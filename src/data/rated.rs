//! EveryDream2's rated datasets (`rated_dataset`, `rated_dataset_target_dropout_percent`):
//! later epochs train on a shrinking subset of the images, picked by rating.
//!
//! - The subset's size (`EveryDreamBatch.shuffle`, `train.py`): with `t = 1 − percent/100`, the
//!   fraction of the images trained in 0-based epoch `e` is 1 for epochs 0 and 1 (the first is
//!   built before any shuffle, the second from the shuffle after epoch 0) and
//!   `(max_epochs − (e − 1)·t) / max_epochs` after. As in EveryDream2, the last epoch trains on
//!   `1 − (max_epochs − 2)·t/max_epochs` of the set, a little more than `percent`.
//! - Which images (`DataLoaderMultiAspect.__pick_random_subset`, `data/data_loader.py`):
//!   `ceil(n·fraction)` distinct images (multipliers ignored, as in EveryDream2), drawn one at a
//!   time without replacement: `uniform(0, Σ rating)` located with `bisect_left` in the running
//!   sums of the ratings of the images sorted by rating. As in EveryDream2 the running sums are
//!   not recomputed after a pick (only the total is lowered), so later picks lean slightly
//!   toward the images after the picked ones; a fraction of 1 or more trains the multiplied set
//!   as usual.
//!
//! The draws use [`PyRandom`] (Python's generator), so the picks match EveryDream2's function
//! given the same seed and the same order; the seed here is a pure function of the run's seed
//! and the epoch, so a resumed run picks the same images.

use serde::Serialize;

use super::py_random::PyRandom;

/// The rated-dataset schedule of a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RatedSchedule {
    /// `rated_dataset_target_dropout_percent`, clamped to [0, 100] as EveryDream2 does.
    pub target_percent: f64,
    /// The run's `max_epochs`, the span of the schedule.
    pub max_epochs: u64,
}

impl RatedSchedule {
    /// The fraction of the images 0-based epoch `epoch` trains on (1 or more: all, multiplied).
    pub fn fraction(&self, epoch: usize) -> f64 {
        if epoch == 0 {
            return 1.0;
        }
        let target = 1.0 - self.target_percent / 100.0;
        let max = self.max_epochs as f64;
        (max - (epoch - 1) as f64 * target) / max
    }
}

/// EveryDream2's `__pick_random_subset`: positions in `ratings` (the images in rating order) of
/// `ceil(len·fraction)` distinct picks, in pick order.
pub fn pick_rated(ratings: &[f64], fraction: f64, rng: &mut PyRandom) -> Vec<usize> {
    let n = ratings.len();
    let want = ((n as f64 * fraction).ceil().max(0.0) as usize).min(n);
    let mut left: Vec<usize> = (0..n).collect();
    let mut summed: Vec<f64> = Vec::with_capacity(n);
    let mut total = 0.0;
    for &r in ratings {
        total += r;
        summed.push(total);
    }
    let mut picked = Vec::with_capacity(want);
    while picked.len() < want {
        let point = rng.uniform(0.0, total);
        let pos = summed.partition_point(|&s| s < point).min(left.len() - 1);
        let item = left.remove(pos);
        summed.remove(pos);
        total = (total - ratings[item]).max(0.0);
        picked.push(item);
    }
    picked
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_follows_ed2_train_loop() {
        let s = RatedSchedule {
            target_percent: 50.0,
            max_epochs: 10,
        };
        let got: Vec<f64> = (0..10).map(|e| s.fraction(e)).collect();
        let want = [1.0, 1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{got:?}");
        }
        let all = RatedSchedule {
            target_percent: 100.0,
            max_epochs: 10,
        };
        assert!((0..10).all(|e| all.fraction(e) == 1.0));
    }

    #[test]
    fn picks_are_distinct_and_counted_by_ceiling() {
        let ratings = [1.0, 1.0, 2.0, 3.0, 5.0];
        for seed in 0..30 {
            let p = pick_rated(&ratings, 0.5, &mut PyRandom::new(seed));
            assert_eq!(p.len(), 3);
            let mut d = p.clone();
            d.sort_unstable();
            d.dedup();
            assert_eq!(d.len(), 3);
        }
        assert_eq!(pick_rated(&ratings, 2.0, &mut PyRandom::new(0)).len(), 5);
        assert!(pick_rated(&ratings, 0.0, &mut PyRandom::new(0)).is_empty());
        assert!(pick_rated(&[], 0.5, &mut PyRandom::new(0)).is_empty());
    }
}
