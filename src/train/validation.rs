//! The validation loss: a held-out set scored with fixed draws, so the curve is comparable
//! across steps and across runs with the same seed.
//!
//! - The images: a seeded `validation_split` of `data_root` (taken out of training), or the
//!   images of `validation_data_root`.
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
use crate::config::ValidationPlan;
use crate::data::{load_data_root_limited, load_image_limited, Bucket, ImageMeta, LoadedDataset};
use crate::model::pipeline::StableDiffusion;

/// Mixed into the run's seed for everything validation draws.
const STREAM: u64 = 0x5641_4C49_4441_5445;

/// The held-out images and their fixed seeds.
pub struct Validation {
    pub items: Vec<ImageMeta>,
    buckets: Vec<Bucket>,
    seeds: Vec<u64>,
    max_pixels: u64,
    latents: Option<LatentStore>,
    /// Every N optimizer steps; `None`: at the end of each epoch.
    pub every_n_steps: Option<usize>,
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
    let mut held = vec![false; n];
    for &i in &order[..k] {
        held[i] = true;
    }
    let mut kept = Vec::with_capacity(n - k);
    let mut out = Vec::with_capacity(k);
    for (item, h) in std::mem::take(&mut dataset.items).into_iter().zip(held) {
        if h {
            out.push(item);
        } else {
            kept.push(item);
        }
    }
    dataset.items = kept;
    Ok(out)
}

impl Validation {
    /// The validation set `plan` names, taken out of `dataset` for a split.
    pub fn setup(
        plan: &ValidationPlan,
        dataset: &mut LoadedDataset,
        seed: u64,
        buckets: &[Bucket],
        max_pixels: u64,
    ) -> anyhow::Result<Self> {
        let items = match (&plan.data_root, plan.split) {
            (Some(root), _) => {
                load_data_root_limited(root, false, max_pixels)
                    .with_context(|| format!("validation_data_root {}", root.display()))?
                    .items
            }
            (None, Some(split)) => split_off(dataset, split, seed)?,
            (None, None) => bail!("validation needs validation_split or validation_data_root"),
        };
        let seeds = step_seeds(seed ^ STREAM, 0, items.len());
        Ok(Self {
            buckets: data_feed::assign(&items, buckets),
            items,
            seeds,
            max_pixels,
            latents: None,
            every_n_steps: plan.every_n_steps.map(|n| n as usize),
        })
    }

    /// Whether the validation loss is due after `steps` of the run's `total_steps`: every
    /// `validation_every_n_steps`, or at the end of each epoch, and always after the run's last
    /// step, so a run that ends mid-epoch reports one.
    pub fn due(&self, steps: usize, total_steps: usize, last_of_epoch: bool) -> bool {
        steps >= total_steps
            || match self.every_n_steps {
                Some(n) => steps.is_multiple_of(n),
                None => last_of_epoch,
            }
    }

    /// Encodes the set's latents once (in `dir` for a disk cache), for runs that release the VAE.
    pub fn cache_latents(
        &mut self,
        sd: &StableDiffusion,
        dir: Option<std::path::PathBuf>,
        batch: usize,
        device: &candle_core::Device,
    ) -> anyhow::Result<()> {
        let spec = CacheSpec {
            items: &self.items,
            buckets: &self.buckets,
            with_flip: false,
            dir,
            max_pixels: self.max_pixels,
            batch,
        };
        self.latents = Some(latent_cache::build(sd, &spec, device)?.0);
        Ok(())
    }

    /// Sample `i` as the step takes it: from the cache, or decoded and centre-cropped.
    fn sample(&self, i: usize) -> anyhow::Result<SampleData> {
        if let Some(store) = &self.latents {
            return Ok(SampleData::Latent(store.get(i)?));
        }
        let item = &self.items[i];
        let b = self.buckets[i];
        let mut image = load_image_limited(&item.path, (b.width, b.height), self.max_pixels)
            .with_context(|| format!("validation image {}", item.path.display()))?;
        image.caption = item.caption.clone();
        Ok(SampleData::Pixels(image))
    }

    /// The mean loss over the set, `micro` samples per forward pass. `settings` are the
    /// training step's; augmentation is turned off here.
    pub fn loss(
        &self,
        sd: &StableDiffusion,
        settings: &StepSettings<'_>,
        micro: usize,
    ) -> anyhow::Result<f64> {
        let quiet = settings.objective.without_perturbations();
        let fixed = StepSettings {
            objective: &quiet,
            flip_p: 0.0,
            cond_dropout: 0.0,
            shuffle_tags: false,
            train_text_encoder: false,
            ..*settings
        };
        let mut sum = 0.0;
        // Micro-batches of one bucket each, buckets in order of first appearance.
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
                .map(|&i| self.sample(i))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let seeds: Vec<u64> = ids.iter().map(|&i| self.seeds[i]).collect();
            let refs: Vec<&SampleData> = images.iter().collect();
            let batch = prepare_batch(sd, &refs, &fixed, &mut sample_rngs(&seeds))?;
            let loss = forward_loss(sd, &batch, &fixed)?;
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
