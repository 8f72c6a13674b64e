//! An epoch's micro-batches: every micro-batch holds images of one aspect bucket.
//!
//! EveryDream2's `DataLoaderMultiAspect.get_shuffled_image_buckets` (`data/data_loader.py`):
//! 1. the epoch's samples: each image repeated by its multiplier, shuffled
//!    ([`LoadedDataset::epoch_indices`]);
//! 2. split by bucket, each keeping that order;
//! 3. a bucket whose count is not a multiple of the batch size ends in a "runt": its last
//!    `count % batch` samples, filled up to a whole batch with random picks among themselves. ED2
//!    scales the loss of a runt batch by `(runt / batch)^1.5` (`train.py`); so do we, through
//!    [`MicroBatch::weight`]. Nothing is dropped;
//! 4. the micro-batches, shuffled as whole batches.
//!
//! Everything is a pure function of `(seed, epoch)`, so a resumed run sees the same batches.

use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::SeedableRng;
use serde::Serialize;

use super::bucket::Bucket;
use super::dataset::{mix_seed, LoadedDataset};
use super::rated::RatedSchedule;

const RUNT_STREAM: u64 = 0x7275_6e74;
const BATCH_STREAM: u64 = 0x0062_6174_6368_6573;

/// One micro-batch: dataset item indices, all of one bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct MicroBatch {
    pub ids: Vec<usize>,
    pub bucket: Bucket,
    /// The loss weight of each sample: 1, or `(runt / batch)^1.5` in a runt batch.
    pub weight: f64,
}

/// An epoch's micro-batches in training order, and how many samples were repeats added to
/// fill runt batches.
#[derive(Debug, Clone, PartialEq)]
pub struct EpochBatches {
    pub batches: Vec<MicroBatch>,
    pub repeated: usize,
}

/// How many images each bucket holds, for the run's report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BucketCount {
    pub bucket: Bucket,
    pub images: usize,
}

/// The micro-batches of epoch `epoch` for items whose buckets are `buckets[i]`.
pub fn epoch_batches(
    dataset: &LoadedDataset,
    buckets: &[Bucket],
    batch_size: usize,
    seed: u64,
    epoch: usize,
) -> EpochBatches {
    epoch_batches_rated(dataset, buckets, batch_size, seed, epoch, None)
}

/// [`epoch_batches`] of a rated dataset ([`super::rated`]) when `rated` is set.
pub fn epoch_batches_rated(
    dataset: &LoadedDataset,
    buckets: &[Bucket],
    batch_size: usize,
    seed: u64,
    epoch: usize,
    rated: Option<&RatedSchedule>,
) -> EpochBatches {
    let sizes = Batching {
        group_of: &[],
        batch_sizes: &[batch_size],
    };
    epoch_batches_grouped(dataset, buckets, &sizes, seed, epoch, rated)
}

/// Which group (a kohya dataset) each item belongs to, and each group's micro-batch size.
#[derive(Debug, Clone, Copy)]
pub struct Batching<'a> {
    /// Each item's group; empty: every item is in group 0.
    pub group_of: &'a [usize],
    /// Each group's batch size.
    pub batch_sizes: &'a [usize],
}

impl Batching<'_> {
    fn group(&self, item: usize) -> usize {
        self.group_of.get(item).copied().unwrap_or(0)
    }

    fn size(&self, group: usize) -> usize {
        self.batch_sizes.get(group).copied().unwrap_or(1).max(1)
    }
}

/// [`epoch_batches_rated`] where items fall into groups with micro-batches of their own size:
/// each micro-batch holds one group's images of one bucket (kohya's `DatasetGroup`, whose
/// datasets batch apart), and all micro-batches are shuffled together. With one group this is
/// [`epoch_batches_rated`] exactly.
pub fn epoch_batches_grouped(
    dataset: &LoadedDataset,
    buckets: &[Bucket],
    batching: &Batching<'_>,
    seed: u64,
    epoch: usize,
    rated: Option<&RatedSchedule>,
) -> EpochBatches {
    let order = dataset.epoch_indices_rated(seed, epoch, rated);
    // (group, bucket) in order of first appearance (ED2's dict insertion order).
    let mut grouped: Vec<((usize, Bucket), Vec<usize>)> = Vec::new();
    for i in order {
        let key = (batching.group(i), buckets[i]);
        match grouped.iter_mut().find(|(k, _)| *k == key) {
            Some((_, ids)) => ids.push(i),
            None => grouped.push((key, vec![i])),
        }
    }
    let mut rng = StdRng::seed_from_u64(mix_seed(seed, epoch, RUNT_STREAM));
    let mut batches = Vec::new();
    let mut repeated = 0;
    for ((group, bucket), ids) in grouped {
        let batch_size = batching.size(group);
        let full = ids.len() / batch_size * batch_size;
        for chunk in ids[..full].chunks(batch_size) {
            batches.push(MicroBatch {
                ids: chunk.to_vec(),
                bucket,
                weight: 1.0,
            });
        }
        let runt = &ids[full..];
        if !runt.is_empty() {
            let mut filled = runt.to_vec();
            while filled.len() < batch_size {
                filled.push(*runt.choose(&mut rng).unwrap_or(&runt[0]));
            }
            repeated += batch_size - runt.len();
            batches.push(MicroBatch {
                ids: filled,
                bucket,
                weight: (runt.len() as f64 / batch_size as f64).powf(1.5),
            });
        }
    }
    batches.shuffle(&mut StdRng::seed_from_u64(mix_seed(
        seed,
        epoch,
        BATCH_STREAM,
    )));
    EpochBatches { batches, repeated }
}

/// The images per bucket, largest first (ties by size).
pub fn bucket_counts(buckets: &[Bucket]) -> Vec<BucketCount> {
    let mut counts: Vec<BucketCount> = Vec::new();
    for &b in buckets {
        match counts.iter_mut().find(|c| c.bucket == b) {
            Some(c) => c.images += 1,
            None => counts.push(BucketCount {
                bucket: b,
                images: 1,
            }),
        }
    }
    counts.sort_by(|a, b| b.images.cmp(&a.images).then(a.bucket.cmp(&b.bucket)));
    counts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::dataset::ImageMeta;
    use std::path::PathBuf;

    fn dataset(n: usize, multiplier: f64) -> LoadedDataset {
        LoadedDataset {
            items: (0..n)
                .map(|i| ImageMeta {
                    path: PathBuf::from(format!("{i}.png")),
                    caption: format!("c{i}"),
                    multiplier,
                    options: Default::default(),
                    size: (64, 64),
                })
                .collect(),
            skipped: Vec::new(),
        }
    }

    #[test]
    fn batches_hold_one_bucket_and_runts_are_filled_from_themselves() {
        let data = dataset(11, 1.0);
        let (a, b) = (Bucket::new(64, 64), Bucket::new(72, 56));
        // items 0..7 in a (7 = 2 batches of 3 + runt 1), 7..11 in b (4 = 1 batch + runt 1)
        let buckets: Vec<Bucket> = (0..11).map(|i| if i < 7 { a } else { b }).collect();
        let e = epoch_batches(&data, &buckets, 3, 9, 0);
        assert_eq!(e.batches.len(), 5);
        assert_eq!(e.repeated, 4);
        let mut seen = vec![0usize; 11];
        for batch in &e.batches {
            assert_eq!(batch.ids.len(), 3);
            assert!(batch.ids.iter().all(|&i| buckets[i] == batch.bucket));
            let distinct: std::collections::BTreeSet<_> = batch.ids.iter().collect();
            if batch.weight < 1.0 {
                // a runt of 1: the one image three times, loss scaled by (1/3)^1.5
                assert_eq!(distinct.len(), 1);
                assert!((batch.weight - (1.0f64 / 3.0).powf(1.5)).abs() < 1e-12);
            } else {
                assert_eq!(distinct.len(), 3);
            }
            for &i in distinct {
                seen[i] += 1;
            }
        }
        assert!(seen.iter().all(|&s| s == 1), "every image once: {seen:?}");
    }

    /// kohya's `DatasetGroup`: each micro-batch holds one dataset's images of one bucket at that
    /// dataset's batch size, its runt weighted against that size. Catches the two datasets
    /// batched together (a shared bucket would mix them), the first dataset's size used for
    /// both, and a runt weighed against the wrong size.
    #[test]
    fn groups_batch_apart_at_their_own_sizes() {
        let data = dataset(9, 1.0);
        let a = Bucket::new(64, 64);
        // items 0..5 in group 0 (batch 2: 2 batches + a runt of 1), 5..9 in group 1 (batch 3:
        // 1 batch + a runt of 1), all in one bucket.
        let buckets = vec![a; 9];
        let group_of: Vec<usize> = (0..9).map(|i| usize::from(i >= 5)).collect();
        let batching = Batching {
            group_of: &group_of,
            batch_sizes: &[2, 3],
        };
        let e = epoch_batches_grouped(&data, &buckets, &batching, 4, 0, None);
        assert_eq!(e.batches.len(), 5);
        assert_eq!(e.repeated, 1 + 2);
        let mut seen = [0usize; 9];
        for batch in &e.batches {
            let g = group_of[batch.ids[0]];
            assert!(batch.ids.iter().all(|&i| group_of[i] == g), "{batch:?}");
            let size = [2, 3][g];
            assert_eq!(batch.ids.len(), size);
            let distinct: std::collections::BTreeSet<_> = batch.ids.iter().collect();
            if batch.weight < 1.0 {
                assert_eq!(distinct.len(), 1);
                assert!((batch.weight - (1.0 / size as f64).powf(1.5)).abs() < 1e-12);
            }
            for &i in distinct {
                seen[i] += 1;
            }
        }
        assert!(seen.iter().all(|&s| s == 1), "{seen:?}");
    }

    #[test]
    fn deterministic_per_seed_and_epoch() {
        let data = dataset(20, 1.5);
        let buckets: Vec<Bucket> = (0..20).map(|i| Bucket::new(64 + 8 * (i % 3), 64)).collect();
        let a = epoch_batches(&data, &buckets, 2, 1, 3);
        assert_eq!(a, epoch_batches(&data, &buckets, 2, 1, 3));
        assert_ne!(a, epoch_batches(&data, &buckets, 2, 1, 4));
        assert_ne!(a, epoch_batches(&data, &buckets, 2, 2, 3));
        // 20 × 1.5 = 30 samples in 3 buckets of 10: batches of 2, no runts
        let samples: usize = a.batches.iter().map(|b| b.ids.len()).sum();
        assert_eq!((samples, a.repeated), (30, 0));
    }

    #[test]
    fn bucket_order_is_shuffled_not_grouped() {
        let data = dataset(40, 1.0);
        let buckets: Vec<Bucket> = (0..40).map(|i| Bucket::new(64, 32 + 8 * (i % 2))).collect();
        let e = epoch_batches(&data, &buckets, 2, 0, 0);
        let changes = e
            .batches
            .windows(2)
            .filter(|w| w[0].bucket != w[1].bucket)
            .count();
        assert!(changes > 3, "batches of a bucket all together: {changes}");
    }

    #[test]
    fn counts_per_bucket() {
        let (a, b) = (Bucket::new(64, 64), Bucket::new(72, 56));
        let counts = bucket_counts(&[b, a, a, b, a]);
        assert_eq!(
            counts,
            [
                BucketCount {
                    bucket: a,
                    images: 3
                },
                BucketCount {
                    bucket: b,
                    images: 2
                }
            ]
        );
    }
}
