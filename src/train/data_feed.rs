//! What feeds the training steps: the dataset with each image's aspect bucket, the epoch's
//! micro-batches, and each step's samples, decoded ahead on a background thread
//! ([`crate::data::prefetch`]) or taken from the latent cache.
//!
//! Every sample's draws come from its seed, `step_seeds(seed, step, n)[k]`, which the decode
//! thread uses for the crop and the step for everything else, so the order of decoding never
//! changes what is trained.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::bail;

use super::latent_cache::LatentStore;
use super::step::{step_seeds, SampleData};
use crate::config::{BucketPlan, DataPlan, KohyaBucketRange, TrainPlan};
use crate::data::epoch_plan::{bucket_counts, epoch_batches_grouped, Batching, BucketCount};
use crate::data::mask::MaskSource;
use crate::data::prefetch::{DecodeSettings, Prefetcher, SampleJob};
use crate::data::rated::RatedSchedule;
use crate::data::regularization::RegularizationSummary;
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
        None => match plan.kohya {
            Some(range) => kohya_bucket_list(range, resolution, step)?,
            None => aspect_buckets(resolution, step, plan.max_ratio),
        },
    };
    if let Some(r) = plan.max_ratio {
        buckets.retain(|b| b.ratio() <= r + 1e-9);
        if buckets.is_empty() {
            bail!("max_aspect_ratio {r} leaves none of the sizes in aspects");
        }
    }
    Ok(buckets)
}

/// kohya's generated sizes ([`crate::data::bucket::kohya_buckets`]), after kohya's check that
/// the resolution lies within the range, each a size the model takes.
fn kohya_bucket_list(
    range: KohyaBucketRange,
    resolution: usize,
    step: usize,
) -> anyhow::Result<Vec<Bucket>> {
    let KohyaBucketRange {
        min, max, steps, ..
    } = range;
    if resolution < min || resolution > max {
        bail!(
            "min_bucket_reso {min} and max_bucket_reso {max} must hold the resolution \
             {resolution} (kohya's rule)"
        );
    }
    if steps % step != 0 {
        bail!(
            "bucket_reso_steps {steps} does not fit this model: its sides must be multiples of \
             {step}"
        );
    }
    Ok(crate::data::bucket::kohya_buckets(
        resolution, min, max, steps,
    ))
}

/// How an image finds its bucket: the nearest of the run's sizes by aspect, or with kohya's
/// `bucket_no_upscale` a bucket of its own.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketRule {
    /// The run's sizes ([`bucket_list`]).
    pub list: Vec<Bucket>,
    /// `bucket_no_upscale`: the resolution and kohya's `bucket_reso_steps`
    /// ([`crate::data::bucket::kohya_no_upscale_bucket`]).
    pub no_upscale: Option<(usize, usize)>,
}

impl BucketRule {
    /// The rule of `plan` for `resolution`, on a model whose sides are multiples of `step`.
    pub fn of(plan: Option<&BucketPlan>, resolution: usize, step: usize) -> anyhow::Result<Self> {
        let list = bucket_list(plan, resolution, step)?;
        let no_upscale = plan
            .and_then(|p| p.kohya)
            .filter(|k| k.no_upscale)
            .map(|k| (resolution, k.steps));
        Ok(Self { list, no_upscale })
    }
}

impl BucketRule {
    /// The bucket of an image of `size`.
    pub fn bucket_of(&self, (w, h): (usize, usize)) -> Bucket {
        match self.no_upscale {
            Some((resolution, steps)) => {
                crate::data::bucket::kohya_no_upscale_bucket(w, h, resolution, steps)
            }
            None => nearest_bucket(&self.list, w, h).unwrap_or(self.list[0]),
        }
    }
}

/// Each item's bucket ([`BucketRule`]).
pub fn assign(items: &[ImageMeta], rule: &BucketRule) -> Vec<Bucket> {
    items.iter().map(|item| rule.bucket_of(item.size)).collect()
}

/// The run's datasets ([`TrainPlan::dataset_shapes`]): each one's bucket rule and batch size,
/// and which dataset an image belongs to (its kohya subset's; every image of a run without a
/// dataset config is in the one dataset).
#[derive(Debug, Clone, PartialEq)]
pub struct DatasetRules {
    /// One per dataset.
    pub rules: Vec<BucketRule>,
    pub batch_sizes: Vec<usize>,
    /// Each resolution, for messages.
    pub resolutions: Vec<usize>,
    /// Each kohya subset's dataset.
    subset_dataset: Vec<usize>,
}

impl DatasetRules {
    /// The rules of `plan` on a model of `native` resolution whose sides are multiples of
    /// `step`.
    pub fn of(plan: &TrainPlan, native: usize, step: usize) -> anyhow::Result<Self> {
        let shapes = plan.dataset_shapes();
        let mut rules = Vec::with_capacity(shapes.len());
        for shape in &shapes {
            let resolution = shape.resolution_or(native);
            let rule = BucketRule::of(shape.buckets.as_ref(), resolution, step);
            rules.push(rule.map_err(|e| match shapes.len() {
                1 => e,
                _ => e.context(format!("dataset config {}", shape.name)),
            })?);
        }
        Ok(Self {
            rules,
            batch_sizes: shapes.iter().map(|s| s.batch_size).collect(),
            resolutions: shapes.iter().map(|s| s.resolution_or(native)).collect(),
            subset_dataset: plan
                .data
                .dataset_config
                .as_ref()
                .map_or_else(Vec::new, |c| c.subsets.iter().map(|s| s.dataset).collect()),
        })
    }

    /// The dataset `item` belongs to.
    pub fn dataset_of(&self, item: &ImageMeta) -> usize {
        let d = item.options.subset.and_then(|s| self.subset_dataset.get(s));
        d.copied()
            .unwrap_or(0)
            .min(self.rules.len().saturating_sub(1))
    }

    /// Each item's dataset.
    pub fn datasets(&self, items: &[ImageMeta]) -> Vec<usize> {
        items.iter().map(|i| self.dataset_of(i)).collect()
    }

    /// Each item's bucket, by its dataset's rule.
    pub fn assign(&self, items: &[ImageMeta]) -> Vec<Bucket> {
        items
            .iter()
            .map(|i| self.rules[self.dataset_of(i)].bucket_of(i.size))
            .collect()
    }

    /// Whether the datasets differ in buckets, resolution or batch size.
    pub fn is_mixed(&self) -> bool {
        (1..self.rules.len()).any(|d| {
            self.rules[d] != self.rules[0]
                || self.batch_sizes[d] != self.batch_sizes[0]
                || self.resolutions[d] != self.resolutions[0]
        })
    }
}

/// A data-parallel rank's part of every step: the micro-batches whose index in the step is
/// `rank` modulo `world`, the ones [`super::sample_cursor::SampleCursor::for_rank`] trains there.
/// Only those are decoded (or read from the latent cache) on the rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

impl Shard {
    /// One process: every micro-batch.
    pub const WHOLE: Shard = Shard { rank: 0, world: 1 };

    /// Whether the step's `index`-th micro-batch is this rank's.
    pub fn takes(&self, index: usize) -> bool {
        index % self.world.max(1) == self.rank
    }

    /// The positions in the step (its samples in the order of the micro-batches' ids) of this
    /// rank's samples, in order.
    fn positions(&self, micro: &[MicroBatch]) -> Vec<usize> {
        let mut out = Vec::new();
        let mut start = 0;
        for (i, m) in micro.iter().enumerate() {
            if self.takes(i) {
                out.extend(start..start + m.ids.len());
            }
            start += m.ids.len();
        }
        out
    }
}

/// A sample that failed to decode: its position in the step, its file and why.
pub type Failure = (usize, PathBuf, String);

/// The decode jobs of `steps` on `shard`'s rank, the first of which is global step
/// `first_step`: each sample's crop seed is the seed [`DataFeed::next`] gives that sample for
/// the step's other draws, `step_seeds(seed, step, n)[k]` of its global step and its position
/// `k` in the whole step, in every epoch, after a resume and on every rank.
fn decode_jobs(
    buckets: &[Bucket],
    seed: u64,
    steps: &[Vec<MicroBatch>],
    first_step: usize,
    shard: Shard,
) -> Vec<Vec<SampleJob>> {
    steps
        .iter()
        .enumerate()
        .map(|(k, micro)| {
            let ids: Vec<usize> = micro.iter().flat_map(|m| m.ids.iter().copied()).collect();
            let seeds = step_seeds(seed, first_step + k, ids.len());
            shard
                .positions(micro)
                .into_iter()
                .map(|pos| SampleJob {
                    item: ids[pos],
                    bucket: buckets[ids[pos]],
                    seed: seeds[pos],
                })
                .collect()
        })
        .collect()
}

/// One step's micro-batches and their samples (in the order of the micro-batches' ids). On a
/// data-parallel rank, only the rank's own samples are here (`None` for the others'); the
/// micro-batches, seeds and failures are the whole step's, the same on every rank.
pub struct StepData {
    /// The step's micro-batches without the samples that failed to decode; one left empty by
    /// its failures stays in place, so that each rank keeps its micro-batches' indices.
    pub micro: Vec<MicroBatch>,
    pub samples: Vec<Option<SampleData>>,
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

    /// Whether no sample of the step is left to train (every file failed to decode).
    pub fn is_empty(&self) -> bool {
        self.micro.iter().all(|m| m.ids.is_empty())
    }

    /// The samples at `range` (positions in the step), which must be this rank's.
    pub fn chunk_samples(&self, range: Range<usize>) -> anyhow::Result<Vec<&SampleData>> {
        let Some(samples) = self.samples.get(range.clone()) else {
            bail!(
                "samples {range:?} of a step of {} samples",
                self.samples.len()
            );
        };
        samples
            .iter()
            .zip(range)
            .map(|(s, pos)| {
                s.as_ref().ok_or_else(|| {
                    anyhow::anyhow!("sample {} of the step is another rank's", pos + 1)
                })
            })
            .collect()
    }
}

/// The step made of `micro` from its samples by position (`got`, `None` where another rank
/// holds one) and seeds, without the samples of `failed` (every rank's, in the step's order).
fn assemble(
    micro: &[MicroBatch],
    mut got: Vec<Option<SampleData>>,
    seeds: Vec<u64>,
    failed: Vec<Failure>,
) -> StepData {
    let left_out: std::collections::HashSet<usize> = failed.iter().map(|f| f.0).collect();
    let n = got.len();
    let mut out = StepData {
        micro: Vec::with_capacity(micro.len()),
        samples: Vec::with_capacity(n),
        seeds: Vec::with_capacity(n),
        failed: failed
            .into_iter()
            .map(|(_, path, why)| (path, why))
            .collect(),
    };
    let mut pos = 0;
    for m in micro {
        let mut kept = m.clone();
        kept.ids.clear();
        for &id in &m.ids {
            if !left_out.contains(&pos) {
                kept.ids.push(id);
                out.samples.push(got.get_mut(pos).and_then(Option::take));
                out.seeds.push(seeds.get(pos).copied().unwrap_or_default());
            }
            pos += 1;
        }
        out.micro.push(kept);
    }
    out
}

/// The training data of a run.
pub struct DataFeed {
    pub dataset: LoadedDataset,
    items: Arc<[ImageMeta]>,
    /// Each item's bucket.
    pub buckets: Vec<Bucket>,
    /// Each item's dataset ([`DatasetRules`]), and each dataset's batch size.
    datasets: Vec<usize>,
    batch_sizes: Vec<usize>,
    grad_accum: usize,
    decode: DecodeSettings,
    latents: Option<LatentStore>,
    prefetch: Option<Prefetcher>,
    /// `rated_dataset`'s schedule, when on.
    rated: Option<RatedSchedule>,
    /// The part of each step this process trains, from [`Self::start`].
    shard: Shard,
    /// How the regularization images (`reg_data_root`, already in `dataset`) joined.
    pub regularization: Option<RegularizationSummary>,
}

impl DataFeed {
    pub fn new(
        dataset: LoadedDataset,
        rules: &DatasetRules,
        data: &DataPlan,
        grad_accum: usize,
        masks: Option<MaskSource>,
    ) -> Self {
        let items: Arc<[ImageMeta]> = dataset.items.clone().into();
        Self {
            buckets: rules.assign(&dataset.items),
            datasets: rules.datasets(&dataset.items),
            batch_sizes: rules.batch_sizes.clone(),
            dataset,
            items,
            grad_accum,
            decode: DecodeSettings {
                crop_jitter: data.crop_jitter,
                max_pixels: data.max_image_pixels,
                masks,
            },
            latents: None,
            prefetch: None,
            rated: data.rated,
            shard: Shard::WHOLE,
            regularization: None,
        }
    }

    /// Samples per epoch without the regularization ones (kohya's `num_train_images`).
    pub fn train_samples(&self) -> usize {
        let total: f64 = self
            .dataset
            .items
            .iter()
            .filter(|i| i.options.prior_loss_weight.is_none())
            .map(|i| i.multiplier)
            .sum();
        total.floor() as usize
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
        let batching = Batching {
            group_of: &self.datasets,
            batch_sizes: &self.batch_sizes,
        };
        epoch_batches_grouped(&self.dataset, &self.buckets, &batching, seed, epoch, rated)
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

    /// Starts decoding `steps` (the first is global step `first_step`) ahead of [`Self::next`],
    /// `shard`'s part of each.
    pub fn start(&mut self, seed: u64, steps: &[Vec<MicroBatch>], first_step: usize, shard: Shard) {
        self.prefetch = None;
        self.shard = shard;
        if self.latents.is_some() {
            return;
        }
        self.prefetch = Some(Prefetcher::spawn(
            self.items.clone(),
            decode_jobs(&self.buckets, seed, steps, first_step, shard),
            self.decode,
            PREFETCH_DEPTH,
        ));
    }

    /// The samples of global step `step` made of `micro`, which must be the next of the steps
    /// given to [`Self::start`]. A file that fails to decode is left out of its micro-batch.
    /// `agree` turns this rank's failures into every rank's (the identity in one process), so
    /// that the ranks leave out the same samples and weigh the others alike.
    pub fn next(
        &mut self,
        seed: u64,
        step: usize,
        micro: &[MicroBatch],
        agree: impl FnOnce(Vec<Failure>) -> anyhow::Result<Vec<Failure>>,
    ) -> anyhow::Result<StepData> {
        let ids: Vec<usize> = micro.iter().flat_map(|m| m.ids.iter().copied()).collect();
        let seeds = step_seeds(seed, step, ids.len());
        let mine = self.shard.positions(micro);
        let mut got: Vec<Option<SampleData>> = vec![None; ids.len()];
        let mut failed = Vec::new();
        if let Some(store) = &self.latents {
            for &pos in &mine {
                got[pos] = Some(SampleData::Latent(store.get(ids[pos])?));
            }
        } else {
            let Some(decoded) = self.prefetch.as_mut().and_then(Prefetcher::next_step) else {
                bail!("the image decoding thread stopped before step {}", step + 1);
            };
            if decoded.len() != mine.len() {
                bail!(
                    "the image decoding thread returned {} images for step {} of {}",
                    decoded.len(),
                    step + 1,
                    mine.len()
                );
            }
            for (pos, image) in mine.into_iter().zip(decoded) {
                match image {
                    Ok(image) => got[pos] = Some(SampleData::Pixels(image)),
                    Err((path, why)) => failed.push((pos, path, why)),
                }
            }
        }
        let failed = agree(failed)?;
        Ok(assemble(micro, got, seeds, failed))
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
            kohya: None,
        };
        assert_eq!(bucket_list(Some(&ed2), 512, 64).unwrap().len(), 11);
        let given = BucketPlan {
            aspects: Some(vec![(64, 64), (128, 32)]),
            max_ratio: Some(2.0),
            kohya: None,
        };
        assert_eq!(
            bucket_list(Some(&given), 64, 8).unwrap(),
            [Bucket::new(64, 64)]
        );
        let misaligned = BucketPlan {
            aspects: Some(vec![(60, 64)]),
            max_ratio: None,
            kohya: None,
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
        let whole = decode_jobs(&buckets, seed, &steps, 0, Shard::WHOLE);
        for first in [1, 3, 5] {
            let later = decode_jobs(&buckets, seed, &steps[first..], first, Shard::WHOLE);
            assert_eq!(later, whole[first..], "started at step {first}");
        }
        for (step, jobs) in whole.iter().enumerate() {
            let seeds: Vec<u64> = jobs.iter().map(|j| j.seed).collect();
            assert_eq!(seeds, step_seeds(seed, step, 2), "step {step}");
            let items: Vec<usize> = jobs.iter().map(|j| j.item).collect();
            assert_eq!(items, steps[step][0].ids);
        }
    }

    fn micro(sizes: &[usize]) -> Vec<MicroBatch> {
        let mut next = 0;
        sizes
            .iter()
            .map(|&n| {
                let ids = (next..next + n).collect();
                next += n;
                MicroBatch {
                    ids,
                    bucket: Bucket::new(64, 64),
                    weight: 1.0,
                }
            })
            .collect()
    }

    /// A rank decodes the micro-batches whose index is its rank modulo the world, each sample
    /// with the seed of its position in the whole step: the ranks' jobs together are one
    /// process's, once each. Catches a seed counted from the rank's own first sample, and a
    /// rank decoding micro-batches another rank trains.
    #[test]
    fn each_rank_decodes_its_own_micro_batches_with_the_steps_seeds() {
        let steps = vec![micro(&[2, 1, 3]), micro(&[1, 1, 1, 2, 1])];
        let buckets = vec![Bucket::new(64, 64); 8];
        let whole = decode_jobs(&buckets, 7, &steps, 3, Shard::WHOLE);
        for world in [2, 3, 4] {
            for (k, step) in steps.iter().enumerate() {
                let mut union = Vec::new();
                for rank in 0..world {
                    let shard = Shard { rank, world };
                    let jobs = &decode_jobs(&buckets, 7, &steps, 3, shard)[k];
                    let want: Vec<usize> = step
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| i % world == rank)
                        .flat_map(|(_, m)| m.ids.iter().copied())
                        .collect();
                    let items: Vec<usize> = jobs.iter().map(|j| j.item).collect();
                    assert_eq!(items, want, "world {world}, rank {rank}, step {k}");
                    union.extend(jobs.iter().copied());
                }
                union.sort_by_key(|j| j.item);
                assert_eq!(union, whole[k], "world {world}, step {k}");
            }
        }
    }

    fn image(tag: usize) -> SampleData {
        SampleData::Pixels(crate::data::TrainImage {
            pixels: Vec::new(),
            width: 0,
            height: 0,
            original_size: (0, 0),
            resized_size: (0, 0),
            crop_top_left: (0, 0),
            caption: tag.to_string(),
            path: PathBuf::new(),
            multiplier: 1.0,
            options: Default::default(),
            mask: None,
        })
    }

    fn tag(s: &Option<SampleData>) -> Option<String> {
        match s {
            Some(SampleData::Pixels(im)) => Some(im.caption.clone()),
            _ => None,
        }
    }

    /// Every rank's failures leave the step, its own and the others'; the samples, seeds and
    /// micro-batches stay aligned, and a micro-batch emptied by its failures keeps its place,
    /// so each rank's micro-batches keep their indices (dropping it would hand rank 0's next
    /// micro-batch to rank 1, which never decoded it).
    #[test]
    fn failures_leave_the_step_on_every_rank_and_keep_the_micro_batches_in_place() {
        let step = micro(&[1, 2, 2]);
        // Rank 1 of 2 holds positions 1 and 2 (micro-batch 1); rank 0 the others.
        let got: Vec<Option<SampleData>> = (0..5)
            .map(|pos| [0, 3, 4].contains(&pos).then(|| image(pos)))
            .collect();
        let seeds: Vec<u64> = (100..105).collect();
        let failed = vec![
            (0, PathBuf::from("a.png"), "bad".to_string()),
            (2, PathBuf::from("c.png"), "worse".to_string()),
        ];
        let data = assemble(&step, got, seeds, failed);
        let ids: Vec<Vec<usize>> = data.micro.iter().map(|m| m.ids.clone()).collect();
        assert_eq!(ids, [vec![], vec![1], vec![3, 4]]);
        assert_eq!(data.seeds, [101, 103, 104]);
        let tags: Vec<Option<String>> = data.samples.iter().map(tag).collect();
        assert_eq!(tags, [None, Some("3".into()), Some("4".into())]);
        assert_eq!(data.failed.len(), 2);
        assert!(!data.is_empty());
        let mine = data.chunk_samples(1..3).unwrap();
        assert_eq!(mine.len(), 2);
        let err = data.chunk_samples(0..1).unwrap_err().to_string();
        assert!(err.contains("another rank"), "{err}");
        assert!(data.chunk_samples(2..4).is_err());
        let all_failed = vec![
            (0, PathBuf::from("a.png"), String::new()),
            (1, PathBuf::from("b.png"), String::new()),
        ];
        assert!(assemble(&micro(&[2]), vec![None, None], vec![1, 2], all_failed).is_empty());
    }

    #[test]
    fn items_go_to_the_nearest_bucket() {
        let mut rule = BucketRule {
            list: aspect_buckets(512, 64, None),
            no_upscale: None,
        };
        let items = [meta(4000, 3000), meta(1080, 1920), meta(10, 10)];
        assert_eq!(
            assign(&items, &rule),
            [
                Bucket::new(576, 448),
                Bucket::new(384, 640),
                Bucket::new(512, 512)
            ]
        );
        // kohya's bucket_no_upscale: each image its own bucket, the small one not scaled up.
        rule.no_upscale = Some((512, 64));
        let own = assign(&items, &rule);
        assert_eq!(own[2], Bucket::new(64, 64));
        assert!(own[..2].iter().all(|b| b.width * b.height <= 512 * 512));
    }
}
