//! What feeds the training steps: the dataset with each image's aspect bucket, the epoch's
//! micro-batches, and each step's samples, decoded ahead on a background thread
//! ([`crate::data::prefetch`]) or taken from the latent cache.
//!
//! Every sample's draws come from its seed, `step_seeds(seed, step, n)[k]`, which the decode
//! thread uses for the crop and the step for everything else, so the order of decoding never
//! changes what is trained.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::bail;

use super::latent_cache::LatentStore;
use super::step::{step_seeds, SampleData};
use crate::config::{BucketPlan, DataPlan};
use crate::data::epoch_plan::{bucket_counts, epoch_batches_rated, BucketCount};
use crate::data::mask::MaskSource;
use crate::data::prefetch::{DecodeSettings, Prefetcher, SampleJob};
use crate::data::rated::RatedSchedule;
use crate::data::{
    aspect_buckets, nearest_bucket, Bucket, EpochBatches, ImageMeta, LoadedDataset, MicroBatch,
};

/// How many steps the decode thread works ahead.
const PREFETCH_DEPTH: usize = 2;

/// The buckets `plan` allows at `resolution` for a model taking multiples of `step` pixels.
pub fn bucket_list(
    plan: Option<&BucketPlan>,
    resolution: usize,
    step: usize,
) -> anyhow::Result<Vec<Bucket>> {
    let Some(plan) = plan else {
        return Ok(vec![Bucket::new(resolution, resolution)]);
    };
    let mut buckets = match &plan.aspects {
        Some(sizes) => {
            let mut out = Vec::with_capacity(sizes.len());
            for &(w, h) in sizes {
                if w % step != 0 || h % step != 0 {
                    bail!(
                        "aspects: {w}x{h} does not fit this model: both sides must be multiples \
                         of {step}"
                    );
                }
                out.push(Bucket::new(w, h));
            }
            out
        }
        None => aspect_buckets(resolution, step, plan.max_ratio),
    };
    if let Some(r) = plan.max_ratio {
        buckets.retain(|b| b.ratio() <= r + 1e-9);
        if buckets.is_empty() {
            bail!("max_aspect_ratio {r} leaves none of the sizes in aspects");
        }
    }
    Ok(buckets)
}

/// Each item's bucket: the nearest by aspect.
pub fn assign(items: &[ImageMeta], buckets: &[Bucket]) -> Vec<Bucket> {
    items
        .iter()
        .map(|item| {
            let (w, h) = item.size;
            nearest_bucket(buckets, w, h).unwrap_or(buckets[0])
        })
        .collect()
}

/// The decode jobs of `steps`, the first of which is global step `first_step`: each sample's
/// crop seed is the seed [`DataFeed::next`] gives that sample for the step's other draws,
/// `step_seeds(seed, step, n)[k]` of its global step, in every epoch and after a resume.
fn decode_jobs(
    buckets: &[Bucket],
    seed: u64,
    steps: &[Vec<MicroBatch>],
    first_step: usize,
) -> Vec<Vec<SampleJob>> {
    steps
        .iter()
        .enumerate()
        .map(|(k, micro)| {
            let ids: Vec<usize> = micro.iter().flat_map(|m| m.ids.iter().copied()).collect();
            let seeds = step_seeds(seed, first_step + k, ids.len());
            ids.iter()
                .zip(seeds)
                .map(|(&item, seed)| SampleJob {
                    item,
                    bucket: buckets[item],
                    seed,
                })
                .collect()
        })
        .collect()
}

/// One step's micro-batches and their samples (in the order of the micro-batches' ids).
pub struct StepData {
    pub micro: Vec<MicroBatch>,
    pub samples: Vec<SampleData>,
    pub seeds: Vec<u64>,
    /// Files that failed to decode for this step, with the reason; left out of it.
    pub failed: Vec<(PathBuf, String)>,
}

impl StepData {
    /// The step's image pixels (each sample's bucket area), the unit its time is judged in.
    pub fn pixels(&self) -> usize {
        self.micro
            .iter()
            .map(|m| m.ids.len() * m.bucket.width * m.bucket.height)
            .sum()
    }
}

/// The training data of a run.
pub struct DataFeed {
    pub dataset: LoadedDataset,
    items: Arc<[ImageMeta]>,
    /// Each item's bucket.
    pub buckets: Vec<Bucket>,
    batch_size: usize,
    grad_accum: usize,
    decode: DecodeSettings,
    latents: Option<LatentStore>,
    prefetch: Option<Prefetcher>,
    /// `rated_dataset`'s schedule, when on.
    rated: Option<RatedSchedule>,
}

impl DataFeed {
    pub fn new(
        dataset: LoadedDataset,
        buckets: Vec<Bucket>,
        data: &DataPlan,
        batch_size: usize,
        grad_accum: usize,
        masks: Option<MaskSource>,
    ) -> Self {
        let items: Arc<[ImageMeta]> = dataset.items.clone().into();
        Self {
            dataset,
            items,
            buckets,
            batch_size,
            grad_accum,
            decode: DecodeSettings {
                crop_jitter: data.crop_jitter,
                max_pixels: data.max_image_pixels,
                masks,
            },
            latents: None,
            prefetch: None,
            rated: data.rated,
        }
    }

    /// From now on samples come from `store` (one entry per item) instead of being decoded.
    pub fn use_latents(&mut self, store: LatentStore) {
        self.latents = Some(store);
    }

    pub fn bucket_counts(&self) -> Vec<BucketCount> {
        bucket_counts(&self.buckets)
    }

    /// The micro-batches of `epoch`.
    pub fn epoch(&self, seed: u64, epoch: usize) -> EpochBatches {
        let rated = self.rated.as_ref();
        epoch_batches_rated(
            &self.dataset,
            &self.buckets,
            self.batch_size,
            seed,
            epoch,
            rated,
        )
    }

    pub fn steps_in(&self, batches: &EpochBatches) -> usize {
        batches.batches.len().div_ceil(self.grad_accum)
    }

    /// The optimizer steps of `batches` from the `skip`-th, as groups of micro-batches.
    pub fn steps(&self, batches: &EpochBatches, skip: usize) -> Vec<Vec<MicroBatch>> {
        batches
            .batches
            .chunks(self.grad_accum)
            .skip(skip)
            .map(<[MicroBatch]>::to_vec)
            .collect()
    }

    /// Starts decoding `steps` (the first is global step `first_step`) ahead of [`Self::next`].
    pub fn start(&mut self, seed: u64, steps: &[Vec<MicroBatch>], first_step: usize) {
        self.prefetch = None;
        if self.latents.is_some() {
            return;
        }
        self.prefetch = Some(Prefetcher::spawn(
            self.items.clone(),
            decode_jobs(&self.buckets, seed, steps, first_step),
            self.decode,
            PREFETCH_DEPTH,
        ));
    }

    /// The samples of global step `step` made of `micro`, which must be the next of the steps
    /// given to [`Self::start`]. A file that fails to decode is left out of its micro-batch.
    pub fn next(
        &mut self,
        seed: u64,
        step: usize,
        micro: &[MicroBatch],
    ) -> anyhow::Result<StepData> {
        let n: usize = micro.iter().map(|m| m.ids.len()).sum();
        let seeds = step_seeds(seed, step, n);
        let ids = micro.iter().flat_map(|m| m.ids.iter().copied());
        if let Some(store) = &self.latents {
            let samples = ids
                .map(|i| store.get(i).map(SampleData::Latent))
                .collect::<anyhow::Result<Vec<_>>>()?;
            return Ok(StepData {
                micro: micro.to_vec(),
                samples,
                seeds,
                failed: Vec::new(),
            });
        }
        let Some(decoded) = self.prefetch.as_mut().and_then(Prefetcher::next_step) else {
            bail!("the image decoding thread stopped before step {}", step + 1);
        };
        if decoded.len() != n {
            bail!(
                "the image decoding thread returned {} images for step {} of {n}",
                decoded.len(),
                step + 1
            );
        }
        let mut out = StepData {
            micro: Vec::with_capacity(micro.len()),
            samples: Vec::with_capacity(n),
            seeds: Vec::with_capacity(n),
            failed: Vec::new(),
        };
        let mut decoded = decoded.into_iter().zip(seeds);
        for m in micro {
            let mut kept = m.clone();
            kept.ids.clear();
            for (&id, (image, seed)) in m.ids.iter().zip(decoded.by_ref()) {
                match image {
                    Ok(image) => {
                        kept.ids.push(id);
                        out.samples.push(SampleData::Pixels(image));
                        out.seeds.push(seed);
                    }
                    Err(failure) => out.failed.push(failure),
                }
            }
            if !kept.ids.is_empty() {
                out.micro.push(kept);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(w: usize, h: usize) -> ImageMeta {
        ImageMeta {
            path: PathBuf::from(format!("{w}x{h}.png")),
            caption: String::new(),
            multiplier: 1.0,
            options: Default::default(),
            size: (w, h),
        }
    }

    #[test]
    fn bucket_lists_from_the_plan() {
        assert_eq!(bucket_list(None, 512, 64).unwrap(), [Bucket::new(512, 512)]);
        let ed2 = BucketPlan {
            aspects: None,
            max_ratio: None,
        };
        assert_eq!(bucket_list(Some(&ed2), 512, 64).unwrap().len(), 11);
        let given = BucketPlan {
            aspects: Some(vec![(64, 64), (128, 32)]),
            max_ratio: Some(2.0),
        };
        assert_eq!(
            bucket_list(Some(&given), 64, 8).unwrap(),
            [Bucket::new(64, 64)]
        );
        let misaligned = BucketPlan {
            aspects: Some(vec![(60, 64)]),
            max_ratio: None,
        };
        let err = bucket_list(Some(&misaligned), 64, 8)
            .unwrap_err()
            .to_string();
        assert!(err.contains("aspects") && err.contains("60x64"), "{err}");
    }

    /// A sample's crop seed is the seed of its global step, wherever the decoding started:
    /// the first step of a later epoch, or a resumed run's first step. Catches the jobs' seeds
    /// counted from the start of each call (`k` for `first_step + k`), which restarts every
    /// epoch's crops, and a resumed run's, at step 0's while the noise seeds stay right.
    #[test]
    fn decode_seeds_follow_the_global_step_across_epochs_and_resumes() {
        let b = Bucket::new(64, 64);
        let mb = |ids: &[usize]| MicroBatch {
            ids: ids.to_vec(),
            bucket: b,
            weight: 1.0,
        };
        let buckets = vec![b; 4];
        // Six steps of one micro-batch of two samples each (two epochs of three steps).
        let steps: Vec<Vec<MicroBatch>> = [[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]]
            .iter()
            .map(|ids| vec![mb(ids)])
            .collect();
        let seed = 42;
        let whole = decode_jobs(&buckets, seed, &steps, 0);
        for first in [1, 3, 5] {
            let later = decode_jobs(&buckets, seed, &steps[first..], first);
            assert_eq!(later, whole[first..], "started at step {first}");
        }
        for (step, jobs) in whole.iter().enumerate() {
            let seeds: Vec<u64> = jobs.iter().map(|j| j.seed).collect();
            assert_eq!(seeds, step_seeds(seed, step, 2), "step {step}");
            let items: Vec<usize> = jobs.iter().map(|j| j.item).collect();
            assert_eq!(items, steps[step][0].ids);
        }
    }

    #[test]
    fn items_go_to_the_nearest_bucket() {
        let buckets = aspect_buckets(512, 64, None);
        let got = assign(
            &[meta(4000, 3000), meta(1080, 1920), meta(10, 10)],
            &buckets,
        );
        assert_eq!(
            got,
            [
                Bucket::new(576, 448),
                Bucket::new(384, 640),
                Bucket::new(512, 512)
            ]
        );
    }
}
