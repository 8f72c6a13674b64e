//! The validation loss: a held-out set scored with fixed draws, so the curve is comparable
//! across steps and across runs with the same seed.
//!
//! - The images: a seeded `validation_split` of `data_root` (taken out of training), or the
//!   images of `validation_data_root`; or the sets of EveryDream2's validation file (its `val`
//!   split or folder, its `stabilize-train` subset of the training images, which stay in
//!   training, and its named `extra_manual_datasets`), each scored and logged under its name
//!   (see `config::ValidationPlan`).
//! - Every sample's noise, timestep and VAE posterior sample come from a seed fixed for the run
//!   (the run's seed and the sample's index), with no flip, caption dropout or tag shuffle, and
//!   LoRA dropout off. Only the weights change between two evaluations.
//! - The loss is the mean over the set of the training loss (its `loss_type`, min-SNR and
//!   debiased weighting, and loss mask included), without the training-only input and embedding
//!   perturbations, in micro-batches of the training micro-batch size (each of one aspect
//!   bucket), forward only. (EveryDream2's validation is always a plain MSE, with no offset
//!   noise, weighting or perturbation.)
//! - Images are centre-cropped to their bucket and decoded at each evaluation, or taken from the
//!   latent cache when the run has one.

use anyhow::{bail, Context};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::data_feed;
use super::latent_cache::{self, CacheSpec, LatentStore};
use super::step::{forward_loss, prepare_batch, sample_rngs, step_seeds, SampleData, StepSettings};
use crate::config::{SplitRule, ValidationPlan, ValidationWhen};
use crate::data::kohya_subsets::KohyaSubset;
use crate::data::mask::MaskSource;
use crate::data::py_random::PyRandom;
use crate::data::{load_data_root_limited, load_with_mask, Bucket, ImageMeta, LoadedDataset};
use crate::model::pipeline::StableDiffusion;

/// Mixed into the run's seed for everything validation draws.
const STREAM: u64 = 0x5641_4C49_4441_5445;

/// The main held-out set's name (EveryDream2's `loss/val`).
pub const VAL: &str = "val";
/// EveryDream2's stabilised training loss set.
pub const STABILIZE: &str = "stabilize-train";

/// One scored set: its images, their buckets and fixed seeds.
pub struct ValSet {
    pub name: String,
    pub items: Vec<ImageMeta>,
    buckets: Vec<Bucket>,
    seeds: Vec<u64>,
    latents: Option<LatentStore>,
}

/// The validation sets and when they are scored.
pub struct Validation {
    pub sets: Vec<ValSet>,
    max_pixels: u64,
    when: ValidationWhen,
    /// Score before the first step too.
    pub before_training: bool,
    relative: bool,
    /// Each set's first loss, for `use_relative_loss`.
    first: Vec<Option<f64>>,
    /// The validation micro-batch, when the plan fixes one.
    pub batch_size: Option<usize>,
    /// Where the loss masks come from, when masked loss is on: validation losses are masked as
    /// training's are.
    pub masks: Option<MaskSource>,
}

/// Where a step is in its epoch, for [`Validation::due`].
#[derive(Debug, Clone, Copy)]
pub struct EpochPoint {
    /// 0-based epoch.
    pub epoch: usize,
    /// Steps of the epoch done, this one included.
    pub done: usize,
    pub steps_in_epoch: usize,
}

/// Takes `split` of `dataset`'s images out for validation (at least one, leaving at least one
/// to train on), chosen by a shuffle seeded from `seed`; the rest keep their order.
pub fn split_off(
    dataset: &mut LoadedDataset,
    split: f64,
    seed: u64,
) -> anyhow::Result<Vec<ImageMeta>> {
    let n = dataset.items.len();
    if n < 2 {
        bail!("validation_split needs at least 2 images in data_root, found {n}");
    }
    let k = ((split * n as f64).round() as usize).clamp(1, n - 1);
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut StdRng::seed_from_u64(seed ^ STREAM));
    Ok(take_out(dataset, &order[..k]))
}

/// kohya's split of a dataset config's subsets ([`crate::data::kohya_split`]): each subset's
/// images, sorted by path, split at its dataset's `validation_split`, shuffled by its
/// `validation_seed` (else `seed`). The images training does not keep leave `dataset`; the
/// validation images are returned (one may also stay in training, as in kohya).
pub fn kohya_split(
    dataset: &mut LoadedDataset,
    subsets: &[KohyaSubset],
    seed: u64,
) -> anyhow::Result<Vec<ImageMeta>> {
    let mut out = Vec::new();
    let mut dropped = Vec::new();
    for s in subsets {
        let Some(split) = s.validation else {
            continue;
        };
        let mut own: Vec<usize> = (0..dataset.items.len())
            .filter(|&i| dataset.items[i].options.subset == Some(s.index))
            .collect();
        own.sort_by(|&a, &b| dataset.items[a].path.cmp(&dataset.items[b].path));
        let picked = crate::data::kohya_split::split_train_val(
            own.len(),
            split.split,
            split.seed.unwrap_or(seed),
        );
        out.extend(
            picked
                .validation
                .iter()
                .map(|&k| dataset.items[own[k]].clone()),
        );
        let kept: std::collections::HashSet<usize> = picked.train.iter().copied().collect();
        dropped.extend((0..own.len()).filter(|k| !kept.contains(k)).map(|k| own[k]));
    }
    if out.is_empty() {
        bail!(
            "validation_split holds out no image: each subset keeps ceil(n·(1 − split)) images \
             and validates round(n·split), which is 0 here (kohya's split_train_val); raise the \
             split or add images"
        );
    }
    take_out(dataset, &dropped);
    Ok(out)
}

/// EveryDream2's `get_random_split`: the items sorted by path, shuffled by `rng` (Python's
/// generator, continuing from one split to the next as EveryDream2's global `random` does), the
/// first `max(1, ceil(p·n))`. Returns the positions in `items`, and the rest in shuffled order.
pub fn ed2_random_split(
    items: &[ImageMeta],
    proportion: f64,
    rng: &mut PyRandom,
) -> (Vec<usize>, Vec<usize>) {
    let count = ((proportion * items.len() as f64).ceil() as usize).max(1);
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by(|&a, &b| items[a].path.cmp(&items[b].path));
    rng.shuffle(&mut order);
    let rest = order.split_off(count.min(order.len()));
    (order, rest)
}

/// Removes the items at `positions` from `dataset` (the rest keep their order) and returns them.
fn take_out(dataset: &mut LoadedDataset, positions: &[usize]) -> Vec<ImageMeta> {
    let mut held = vec![false; dataset.items.len()];
    for &i in positions {
        held[i] = true;
    }
    let mut kept = Vec::with_capacity(dataset.items.len());
    let mut out = Vec::with_capacity(positions.len());
    for (item, h) in std::mem::take(&mut dataset.items).into_iter().zip(held) {
        if h {
            out.push(item);
        } else {
            kept.push(item);
        }
    }
    dataset.items = kept;
    out
}

/// The sets `plan` asks for: the `val` split (taken out of `dataset`) or folder, the
/// stabilised training subset (left in `dataset`), and the named folders, in that order.
fn build_sets(
    plan: &ValidationPlan,
    dataset: &mut LoadedDataset,
    (seed, subsets): (u64, &[KohyaSubset]),
    max_pixels: u64,
) -> anyhow::Result<Vec<(String, Vec<ImageMeta>)>> {
    let read = |root: &std::path::Path, what: &str| -> anyhow::Result<Vec<ImageMeta>> {
        Ok(load_data_root_limited(root, false, max_pixels)
            .with_context(|| format!("{what} {}", root.display()))?
            .items)
    };
    let mut rng = PyRandom::new(seed);
    let mut sets = Vec::new();
    match (&plan.data_root, plan.split, plan.split_rule) {
        (Some(root), _, _) => sets.push((VAL.to_string(), read(root, "validation folder")?)),
        (None, Some(split), SplitRule::Sdtrain) => {
            sets.push((VAL.to_string(), split_off(dataset, split, seed)?))
        }
        (None, Some(_), SplitRule::Kohya) => {
            sets.push((VAL.to_string(), kohya_split(dataset, subsets, seed)?))
        }
        (None, Some(split), SplitRule::EveryDream2) => {
            let (held, _) = ed2_random_split(&dataset.items, split, &mut rng);
            if held.len() >= dataset.items.len() {
                bail!(
                    "auto_split_proportion {split} would hold out all {} images of data_root",
                    dataset.items.len()
                );
            }
            sets.push((VAL.to_string(), take_out(dataset, &held)));
        }
        (None, None, _) => {}
    }
    if let Some(p) = plan.stabilize_split {
        let (picked, _) = ed2_random_split(&dataset.items, p, &mut rng);
        let items = picked.iter().map(|&i| dataset.items[i].clone()).collect();
        sets.push((STABILIZE.to_string(), items));
    }
    for extra in &plan.extra {
        sets.push((
            extra.name.clone(),
            read(&extra.data_root, "validation set")?,
        ));
    }
    if sets.is_empty() {
        bail!("the validation config asks for no validation set");
    }
    Ok(sets)
}

impl Validation {
    /// The validation sets `plan` names; a split is taken out of `dataset`. Draws use the plan's
    /// seed, else the run's `seed`.
    /// `subsets`: a dataset config's, whose own splits [`SplitRule::Kohya`] draws.
    pub fn setup(
        plan: &ValidationPlan,
        dataset: &mut LoadedDataset,
        (seed, subsets): (u64, &[KohyaSubset]),
        buckets: &data_feed::DatasetRules,
        max_pixels: u64,
    ) -> anyhow::Result<Self> {
        let seed = plan.seed.unwrap_or(seed);
        let sets = build_sets(plan, dataset, (seed, subsets), max_pixels)?;
        let sets: Vec<ValSet> = sets
            .into_iter()
            .enumerate()
            .map(|(k, (name, mut items))| {
                // Validation images train with nothing of their own: no flip, no dropout, no
                // shuffle (EveryDream2's `disable_multiplier_and_flip`).
                // A dataset config's image keeps which subset it is from (its caption has the
                // subset's affixes on already).
                for item in &mut items {
                    item.options = std::sync::Arc::new(crate::data::ItemOptions {
                        subset: item.options.subset,
                        ..Default::default()
                    });
                }
                ValSet {
                    name,
                    buckets: buckets.assign(&items),
                    seeds: step_seeds(seed ^ STREAM, k, items.len()),
                    items,
                    latents: None,
                }
            })
            .collect();
        Ok(Self {
            first: vec![None; sets.len()],
            sets,
            max_pixels,
            when: plan.when,
            before_training: plan.before_training,
            relative: plan.relative,
            batch_size: plan.batch_size,
            masks: None,
        })
    }

    /// All images of all sets.
    pub fn items(&self) -> impl Iterator<Item = &ImageMeta> {
        self.sets.iter().flat_map(|s| s.items.iter())
    }

    /// Whether the validation loss is due after `steps` of the run's `total_steps`, the step
    /// being at `at` in its epoch; always after the run's last step, so a run that ends
    /// mid-epoch reports one.
    pub fn due(&self, steps: usize, total_steps: usize, at: EpochPoint) -> bool {
        let end_of_epoch = at.done == at.steps_in_epoch;
        steps >= total_steps
            || match self.when {
                ValidationWhen::EachEpoch => end_of_epoch,
                ValidationWhen::EveryNSteps(n) => steps.is_multiple_of(n as usize),
                ValidationWhen::EveryNEpochs(every) => {
                    ed2_validation_steps(every, at.epoch, at.steps_in_epoch).contains(&at.done)
                }
            }
    }

    /// Encodes the sets' latents once (in `dir` for a disk cache), for runs that release the VAE.
    pub fn cache_latents(
        &mut self,
        sd: &StableDiffusion,
        dir: Option<std::path::PathBuf>,
        batch: usize,
        device: &candle_core::Device,
    ) -> anyhow::Result<()> {
        for set in &mut self.sets {
            let spec = CacheSpec {
                items: &set.items,
                buckets: &set.buckets,
                with_flip: false,
                dir: dir.clone(),
                max_pixels: self.max_pixels,
                batch,
                masks: self.masks,
            };
            set.latents = Some(latent_cache::build(sd, &spec, device, None)?.0);
        }
        Ok(())
    }

    /// Each set's mean loss, `micro` samples per forward pass (the plan's validation batch size
    /// when it has one). `settings` are the training step's; augmentation is turned off here.
    pub fn losses(
        &self,
        sd: &StableDiffusion,
        settings: &StepSettings<'_>,
        micro: usize,
    ) -> anyhow::Result<Vec<(String, f64)>> {
        let quiet = settings.objective.without_perturbations();
        let fixed = StepSettings {
            objective: &quiet,
            flip_p: 0.0,
            cond_dropout: 0.0,
            shuffle_tags: false,
            tag_dropout: 0.0,
            // Outside training: no epoch drops its captions, and the token warmup is over.
            clock: Default::default(),
            train_text_encoder: false,
            // Every validation sample keeps its mask.
            unmasked_probability: settings.unmasked_probability.map(|_| 0.0),
            // OneTrainer's validation loss has no prior term.
            prior_adapters: None,
            ..*settings
        };
        let micro = self.batch_size.unwrap_or(micro);
        self.sets
            .iter()
            .map(|set| {
                Ok((
                    set.name.clone(),
                    set.loss(sd, &fixed, micro, (self.max_pixels, self.masks))?,
                ))
            })
            .collect()
    }

    /// `losses` as logged: minus each set's first loss with `use_relative_loss`.
    pub fn logged(&mut self, losses: Vec<(String, f64)>) -> Vec<(String, f64)> {
        if !self.relative {
            return losses;
        }
        losses
            .into_iter()
            .zip(self.first.iter_mut())
            .map(|((name, loss), first)| (name, loss - *first.get_or_insert(loss)))
            .collect()
    }
}

/// EveryDream2's `get_validation_step_indices`, as counts of steps done in the epoch: with
/// `every ≥ 1`, the epoch's last step when `(epoch + 1) mod every = 0`; below 1, the epoch cut
/// into `round(1/every)` even parts (at most one per step), after each part.
pub fn ed2_validation_steps(every: f64, epoch: usize, steps_in_epoch: usize) -> Vec<usize> {
    if every >= 1.0 {
        return match ((epoch + 1) as f64 % every) == 0.0 {
            true => vec![steps_in_epoch],
            false => Vec::new(),
        };
    }
    let divisions = ((1.0 / every).round_ties_even() as usize)
        .min(steps_in_epoch)
        .max(1);
    let per = steps_in_epoch as f64 / divisions as f64;
    (0..divisions)
        .map(|i| ((i + 1) as f64 * per).ceil() as usize)
        .collect()
}

impl ValSet {
    /// Sample `i` as the step takes it: from the cache, or decoded and centre-cropped.
    fn sample(
        &self,
        i: usize,
        (max_pixels, masks): (u64, Option<MaskSource>),
    ) -> anyhow::Result<SampleData> {
        if let Some(store) = &self.latents {
            return Ok(SampleData::Latent(store.get(i)?));
        }
        let item = &self.items[i];
        let b = self.buckets[i];
        // A centre crop: no draws.
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(0);
        let target = (b.width, b.height);
        let mut image = load_with_mask(&item.path, target, 0.0, &mut rng, max_pixels, masks)
            .with_context(|| format!("validation image {}", item.path.display()))?;
        image.caption = item.caption.clone();
        Ok(SampleData::Pixels(image))
    }

    /// The mean loss over the set: micro-batches of one bucket each, buckets in order of first
    /// appearance.
    fn loss(
        &self,
        sd: &StableDiffusion,
        fixed: &StepSettings<'_>,
        micro: usize,
        decode: (u64, Option<MaskSource>),
    ) -> anyhow::Result<f64> {
        let mut sum = 0.0;
        let mut by_bucket: Vec<(Bucket, Vec<usize>)> = Vec::new();
        for (i, &b) in self.buckets.iter().enumerate() {
            match by_bucket.iter_mut().find(|(k, _)| *k == b) {
                Some((_, ids)) => ids.push(i),
                None => by_bucket.push((b, vec![i])),
            }
        }
        let chunks = by_bucket
            .iter()
            .flat_map(|(_, ids)| ids.chunks(micro.max(1)));
        for ids in chunks {
            let images = ids
                .iter()
                .map(|&i| self.sample(i, decode))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let seeds: Vec<u64> = ids.iter().map(|&i| self.seeds[i]).collect();
            let refs: Vec<&SampleData> = images.iter().collect();
            let batch = prepare_batch(sd, &refs, fixed, &mut sample_rngs(&seeds))?;
            let loss = forward_loss(sd, &batch, fixed)?;
            let value = f64::from(
                loss.detach()
                    .to_dtype(candle_core::DType::F32)?
                    .to_scalar::<f32>()?,
            );
            sum += value * images.len() as f64;
        }
        Ok(sum / self.items.len().max(1) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(i: usize) -> ImageMeta {
        ImageMeta {
            path: format!("{i}.png").into(),
            caption: format!("c{i}"),
            multiplier: 1.0,
            options: Default::default(),
            size: (1, 1),
        }
    }

    #[test]
    fn a_split_is_seeded_disjoint_and_keeps_one_of_each() {
        let data = || LoadedDataset {
            items: (0..10).map(image).collect(),
            skipped: Vec::new(),
        };
        let (mut a, mut b) = (data(), data());
        let va = split_off(&mut a, 0.25, 7).unwrap();
        let vb = split_off(&mut b, 0.25, 7).unwrap();
        assert_eq!(va, vb);
        assert_eq!((va.len(), a.items.len()), (3, 7));
        assert!(va.iter().all(|v| !a.items.contains(v)));
        let mut c = data();
        assert_ne!(split_off(&mut c, 0.25, 8).unwrap(), va);
        let mut tiny = LoadedDataset {
            items: vec![image(0), image(1)],
            skipped: Vec::new(),
        };
        assert_eq!(split_off(&mut tiny, 0.99, 1).unwrap().len(), 1);
        assert_eq!(tiny.items.len(), 1);
        assert!(split_off(&mut tiny, 0.5, 1).is_err());
    }
}
