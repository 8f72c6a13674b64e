//! The validation loss: a held-out set scored with fixed draws, so the curve is comparable
//! across steps and across runs with the same seed.
//!
//! - The images: a seeded `validation_split` of `data_root` (taken out of training), or the
//!   images of `validation_data_root`.
//! - Every sample's noise, timestep and VAE posterior sample come from a seed fixed for the run
//!   (the run's seed and the sample's index), with no flip, caption dropout or tag shuffle, and
//!   LoRA dropout off. Only the weights change between two evaluations.
//! - The loss is the mean over the set of the training loss (min-SNR weighting included), in
//!   micro-batches of the training micro-batch size, forward only.

use anyhow::{bail, Context};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::step::{forward_loss, prepare_batch, sample_rngs, step_seeds, StepSettings};
use crate::config::ValidationPlan;
use crate::data::{load_data_root_limited, LoadedDataset, TrainImage};
use crate::model::pipeline::StableDiffusion;

/// Mixed into the run's seed for everything validation draws.
const STREAM: u64 = 0x5641_4C49_4441_5445;

/// The held-out images and their fixed seeds.
pub struct Validation {
    pub images: Vec<TrainImage>,
    seeds: Vec<u64>,
    /// Every N optimizer steps; `None`: at the end of each epoch.
    pub every_n_steps: Option<usize>,
}

/// Takes `split` of `dataset`'s images out for validation (at least one, leaving at least one
/// to train on), chosen by a shuffle seeded from `seed`; the rest keep their order.
pub fn split_off(
    dataset: &mut LoadedDataset,
    split: f64,
    seed: u64,
) -> anyhow::Result<Vec<TrainImage>> {
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
        resolution: usize,
        max_pixels: u64,
    ) -> anyhow::Result<Self> {
        let images = match (&plan.data_root, plan.split) {
            (Some(root), _) => {
                load_data_root_limited(root, resolution, false, max_pixels)
                    .with_context(|| format!("validation_data_root {}", root.display()))?
                    .items
            }
            (None, Some(split)) => split_off(dataset, split, seed)?,
            (None, None) => bail!("validation needs validation_split or validation_data_root"),
        };
        let seeds = step_seeds(seed ^ STREAM, 0, images.len());
        Ok(Self {
            images,
            seeds,
            every_n_steps: plan.every_n_steps.map(|n| n as usize),
        })
    }

    /// The mean loss over the set, `micro` samples per forward pass. `settings` are the
    /// training step's; augmentation is turned off here.
    pub fn loss(
        &self,
        sd: &StableDiffusion,
        settings: &StepSettings<'_>,
        micro: usize,
    ) -> anyhow::Result<f64> {
        let fixed = StepSettings {
            flip_p: 0.0,
            cond_dropout: 0.0,
            shuffle_tags: false,
            train_text_encoder: false,
            ..*settings
        };
        let mut sum = 0.0;
        for (images, seeds) in self
            .images
            .chunks(micro.max(1))
            .zip(self.seeds.chunks(micro.max(1)))
        {
            let refs: Vec<&TrainImage> = images.iter().collect();
            let batch = prepare_batch(sd, &refs, &fixed, &mut sample_rngs(seeds))?;
            let loss = forward_loss(sd, &batch, &fixed)?;
            let value = f64::from(
                loss.detach()
                    .to_dtype(candle_core::DType::F32)?
                    .to_scalar::<f32>()?,
            );
            sum += value * images.len() as f64;
        }
        Ok(sum / self.images.len().max(1) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(i: usize) -> TrainImage {
        TrainImage {
            pixels: vec![i as u8; 3],
            width: 1,
            height: 1,
            original_size: (1, 1),
            resized_size: (1, 1),
            crop_top_left: (0, 0),
            caption: format!("c{i}"),
            path: format!("{i}.png").into(),
            multiplier: 1.0,
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
