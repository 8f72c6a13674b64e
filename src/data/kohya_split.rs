//! kohya's validation split of a dataset config's subsets (`split_train_val`,
//! `library/train_util.py`): kohya's `DreamBoothDataset` runs it on each subset's images (sorted
//! by path, as `glob_images` lists them) twice, once for the training dataset and once for the
//! validation one, each time shuffling with Python's generator seeded by `validation_seed`:
//!
//! - training keeps the first `ceil(n·(1 − p))` of the shuffled list;
//! - validation takes the last `round(n·p)` (Python's round half to even).
//!
//! The two counts can add up to more than `n` (10 images at 0.35: 7 and 4), and then the image
//! where they meet is in both sets, as in kohya. Regularization subsets are never split. Without a
//! `validation_seed` kohya shuffles with its global generator, differently for the two calls;
//! sdtrain seeds with the run's seed instead, so the two halves always agree.

use serde::Serialize;

use super::py_random::PyRandom;

/// A subset's `validation_split` (in (0, 1)) and `validation_seed`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SubsetSplit {
    pub split: f64,
    pub seed: Option<u64>,
}

/// Which of `n` images (indices into the subset's path-sorted list) train and which validate,
/// each in kohya's shuffled order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitIndices {
    pub train: Vec<usize>,
    pub validation: Vec<usize>,
}

/// kohya's `split_train_val` of `n` images with `split` `p`, its generator seeded with `seed`.
pub fn split_train_val(n: usize, p: f64, seed: u64) -> SplitIndices {
    let mut order: Vec<usize> = (0..n).collect();
    PyRandom::new(seed).shuffle(&mut order);
    let train = ((n as f64 * (1.0 - p)).ceil() as usize).min(n);
    let validation = ((n as f64 * p).round_ties_even() as usize).min(n);
    SplitIndices {
        train: order[..train].to_vec(),
        validation: order[n - validation..].to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The counts at kohya's edges, without the generator: 10 × 0.25 keeps 8 and holds out 2
    /// (round half to even of 2.5); 10 × 0.35 keeps 7 and holds out 4 (one image in both); one
    /// image at 0.5 holds out none. Catches Rust's `round` (half away from zero: 10 × 0.25 would
    /// hold out 3) and a floor for the ceiling (10 × 0.35 would keep 6).
    #[test]
    fn counts_follow_pythons_rounding() {
        let counts = |n: usize, p: f64| {
            let s = split_train_val(n, p, 1);
            (s.train.len(), s.validation.len())
        };
        assert_eq!(counts(10, 0.25), (8, 2));
        assert_eq!(counts(10, 0.35), (7, 4));
        assert_eq!(counts(1, 0.5), (1, 0));
        assert_eq!(counts(7, 0.5), (4, 4));
        let s = split_train_val(10, 0.35, 0);
        let both = s.train.iter().filter(|i| s.validation.contains(i)).count();
        assert_eq!(both, 1);
    }
}
