//! Regularization images (`reg_data_root`, `prior_loss_weight`): kohya sd-scripts'
//! `reg_data_dir` and diffusers' DreamBooth prior preservation (`class_data_dir`). Images of the
//! class the subject belongs to ("a photo of a dog" for "a photo of sks dog") train beside the
//! subject so the model keeps what the class looked like.
//!
//! kohya's `DreamBoothDataset.__init__` (`library/train_util.py`) sizes the regularization set to
//! the training set once, before the first epoch ([`balance`]): with `n` the training samples
//! per epoch (images × repeats), the regularization images are taken in order with their own
//! repeats until they add up to `n`; when all of them add up to less, each gets one more repeat
//! in turn until they do. An epoch therefore holds as many regularization samples as training
//! samples (one more image's repeats at most), and later images of a larger set are not used.
//! The regularization samples are shuffled into the epoch's buckets with the training samples,
//! and each one's loss is multiplied by `prior_loss_weight` (kohya's `loss_weights`, default 1).
//!
//! Deliberate difference: kohya counts repeats in whole numbers; EveryDream2's `multiply.txt` may
//! be fractional, and the same rule runs on the fractional sums (an increment is still one
//! repeat; the last round stops once the sum reaches `n`).

use std::sync::Arc;

use super::dataset::{ImageMeta, LoadedDataset};

/// The regularization set as it joined the training set, for the run's report and metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct RegularizationSummary {
    /// Regularization images read, and how many of them an epoch uses.
    pub images: usize,
    pub used: usize,
    /// The regularization samples per epoch (their folders' repeats), before and after
    /// [`balance`]; kohya's `ss_num_reg_images` is the first.
    pub samples_before: f64,
    pub samples: f64,
    /// The training samples per epoch they were balanced against.
    pub train_samples: f64,
    /// The regularization images as read, with their own repeats (for kohya's
    /// `ss_reg_dataset_dirs`).
    pub own: Vec<ImageMeta>,
}

/// kohya's balancing loop: the repeats of each regularization image (`reg[i]` its own, in
/// order) once the set is sized to `train` training samples per epoch; 0 for an image left out.
pub fn balance(reg: &[f64], train: f64) -> Vec<f64> {
    let mut out = vec![0.0; reg.len()];
    if reg.is_empty() || train.is_nan() || train <= 0.0 {
        return out;
    }
    // First pass: images in order, each with its own repeats, until the sum reaches `train`.
    let mut n = 0.0;
    for (slot, &r) in out.iter_mut().zip(reg) {
        *slot = r;
        n += r;
        if n >= train {
            return out;
        }
    }
    // Then one more repeat per image in turn until it does: `ceil(train − n)` increments, dealt
    // round-robin from the first image (kohya's loop, without its one iteration per increment).
    let increments = (train - n).ceil();
    let len = reg.len() as f64;
    let rounds = (increments / len).floor();
    let rest = (increments - rounds * len) as usize;
    for (i, slot) in out.iter_mut().enumerate() {
        *slot += rounds + if i < rest { 1.0 } else { 0.0 };
    }
    out
}

/// Appends `reg`'s images to `train`, balanced ([`balance`]) against `train`'s samples per epoch
/// and weighed by `prior_loss_weight`; images [`balance`] leaves out are dropped.
pub fn add_regularization(
    train: &mut LoadedDataset,
    reg: LoadedDataset,
    prior_loss_weight: f64,
) -> RegularizationSummary {
    let train_samples: f64 = train.items.iter().map(|i| i.multiplier).sum();
    add_regularization_against(train, reg, prior_loss_weight, train_samples)
}

/// [`add_regularization`] balanced against `train_samples` (a dataset config's dataset: its own
/// training samples, not all of `train`'s).
pub fn add_regularization_against(
    train: &mut LoadedDataset,
    reg: LoadedDataset,
    prior_loss_weight: f64,
    train_samples: f64,
) -> RegularizationSummary {
    let own: Vec<f64> = reg.items.iter().map(|i| i.multiplier).collect();
    let repeats = balance(&own, train_samples);
    let images = reg.items.len();
    let own_items = reg.items.clone();
    let mut used = 0;
    for (mut item, r) in reg.items.into_iter().zip(&repeats) {
        if *r <= 0.0 {
            continue;
        }
        item.multiplier = *r;
        let mut options = (*item.options).clone();
        options.prior_loss_weight = Some(prior_loss_weight);
        item.options = Arc::new(options);
        train.items.push(item);
        used += 1;
    }
    train.skipped.extend(reg.skipped);
    RegularizationSummary {
        images,
        used,
        samples_before: own.iter().sum(),
        samples: repeats.iter().sum(),
        train_samples,
        own: own_items,
    }
}

impl RegularizationSummary {
    /// One line for the run's start: what joined the training set, and how.
    pub fn describe(&self, weight: f64) -> String {
        let unused = match self.images - self.used {
            0 => String::new(),
            n => format!(
                " ({n} not used: the epoch needs only the first {})",
                self.used
            ),
        };
        format!(
            "regularization: {} image{}{unused}, {} sample{} per epoch (balanced to data_root's \
             {}; their own repeats give {}), loss × {weight}",
            self.images,
            if self.images == 1 { "" } else { "s" },
            fmt_count(self.samples),
            if self.samples == 1.0 { "" } else { "s" },
            fmt_count(self.train_samples),
            fmt_count(self.samples_before),
        )
    }
}

/// A sample count: whole numbers without a fraction.
fn fmt_count(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::ItemOptions;
    use std::path::PathBuf;

    /// kohya's loop as written, one increment per iteration: the closed form must agree.
    fn kohya_loop(reg: &[f64], train: f64) -> Vec<f64> {
        let mut out = vec![0.0; reg.len()];
        let (mut n, mut first) = (0.0, true);
        while n < train {
            for i in 0..reg.len() {
                if first {
                    out[i] = reg[i];
                    n += reg[i];
                } else {
                    out[i] += 1.0;
                    n += 1.0;
                }
                if n >= train {
                    break;
                }
            }
            first = false;
        }
        out
    }

    #[test]
    fn the_closed_form_is_kohyas_loop() {
        let sets: [&[f64]; 6] = [
            &[1.0],
            &[1.0, 1.0, 1.0],
            &[2.0, 5.0],
            &[10.0, 1.0, 3.0],
            &[0.5, 1.5],
            &[1.0; 7],
        ];
        for reg in sets {
            for train in [1.0, 2.0, 3.0, 7.0, 10.0, 11.0, 40.0, 41.5, 100.0] {
                assert_eq!(
                    balance(reg, train),
                    kohya_loop(reg, train),
                    "{reg:?} {train}"
                );
            }
        }
        assert_eq!(balance(&[], 5.0), Vec::<f64>::new());
        assert_eq!(balance(&[3.0, 3.0], 0.0), [0.0, 0.0]);
        // a huge count is arithmetic, not a loop
        assert_eq!(balance(&[1.0, 1.0], 1e15), [5e14, 5e14]);
    }

    fn meta(name: &str, multiplier: f64) -> ImageMeta {
        ImageMeta {
            path: PathBuf::from(name),
            caption: name.into(),
            multiplier,
            size: (64, 64),
            options: Arc::new(ItemOptions::default()),
        }
    }

    #[test]
    fn regularization_joins_balanced_and_weighed() {
        let mut train = LoadedDataset {
            items: vec![meta("a", 10.0), meta("b", 10.0)],
            skipped: Vec::new(),
        };
        let reg = LoadedDataset {
            items: (0..30).map(|i| meta(&format!("r{i}"), 1.0)).collect(),
            skipped: vec![(PathBuf::from("bad.png"), "corrupt".into())],
        };
        let summary = add_regularization(&mut train, reg, 0.5);
        assert_eq!(summary.used, 20);
        assert_eq!(
            (
                summary.samples,
                summary.train_samples,
                summary.samples_before
            ),
            (20.0, 20.0, 30.0)
        );
        assert_eq!(train.items.len(), 22);
        assert_eq!(train.epoch_len(), 40);
        assert!(train.items[..2]
            .iter()
            .all(|i| i.options.prior_loss_weight.is_none()));
        assert!(train.items[2..]
            .iter()
            .all(|i| i.options.prior_loss_weight == Some(0.5)));
        assert_eq!(train.items[21].path, PathBuf::from("r19"));
        assert_eq!(train.skipped.len(), 1);
        assert!(
            summary.describe(0.5).contains("10 not used"),
            "{}",
            summary.describe(0.5)
        );
    }
}
