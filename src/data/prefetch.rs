//! Decoding the next steps' images on a background thread while the current step trains.
//!
//! The trainer knows an epoch's batches in advance ([`super::epoch_plan`]), so it hands the
//! whole list of steps to a [`Prefetcher`]. Its thread decodes one step at a time (the step's
//! images in parallel on rayon's pool), crops each to its bucket (centre, or EveryDream2's jitter
//! from the sample's own seed) and queues the result. The queue holds `depth` steps, so at most
//! `depth + 2` steps of pixels exist at once, whatever the size of the dataset. Dropping the
//! prefetcher stops the thread after the image it is on.
//!
//! A file that fails to decode here (its header was fine when the dataset was read) comes back as
//! an error for the trainer to report and leave out; the thread goes on.

use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

use rand::rngs::StdRng;
use rand::SeedableRng;
use rayon::prelude::*;

use super::bucket::Bucket;
use super::dataset::ImageMeta;
use super::image_load::{load_with_mask, TrainImage};
use super::mask::MaskSource;
use super::DataError;
use crate::error_chain::chain_text;

/// Mixed into a sample's seed for its crop draws, apart from the step's other draws.
const CROP_STREAM: u64 = 0x6372_6f70;

/// One image to decode: the dataset item, its bucket and the seed of its crop.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleJob {
    pub item: usize,
    pub bucket: Bucket,
    pub seed: u64,
}

/// How images are turned into training pixels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeSettings {
    /// EveryDream2's `crop_jitter`; 0 centres the crop.
    pub crop_jitter: f64,
    pub max_pixels: u64,
    /// Where the loss masks come from, when masked loss is on.
    pub masks: Option<MaskSource>,
}

/// A decoded sample, or the file and why it failed.
pub type Decoded = Result<TrainImage, (PathBuf, String)>;

/// Decodes `item` for `job` (caption and multiplier from the dataset).
pub fn decode_sample(item: &ImageMeta, job: &SampleJob, settings: &DecodeSettings) -> Decoded {
    let mut rng = StdRng::seed_from_u64(job.seed ^ CROP_STREAM);
    let target = (job.bucket.width, job.bucket.height);
    match load_with_mask(
        &item.path,
        target,
        settings.crop_jitter,
        &mut rng,
        settings.max_pixels,
        settings.masks,
    ) {
        Ok(mut image) => {
            image.caption = item.caption.clone();
            image.multiplier = item.multiplier;
            image.options = item.options.clone();
            Ok(image)
        }
        Err(DataError::Decode { path, reason }) => Err((path, reason)),
        Err(other) => Err((item.path.clone(), chain_text(&other))),
    }
}

/// The background decoder of a list of steps.
pub struct Prefetcher {
    rx: Option<Receiver<Vec<Decoded>>>,
    handle: Option<JoinHandle<()>>,
}

impl Prefetcher {
    /// Starts decoding `steps` (each the jobs of one optimizer step) in order, `depth` steps
    /// ahead of [`Prefetcher::next_step`].
    pub fn spawn(
        items: Arc<[ImageMeta]>,
        steps: Vec<Vec<SampleJob>>,
        settings: DecodeSettings,
        depth: usize,
    ) -> Self {
        let (tx, rx) = sync_channel(depth.max(1));
        let handle = std::thread::Builder::new()
            .name("sdtrain-prefetch".into())
            .spawn(move || {
                for jobs in steps {
                    let decoded: Vec<Decoded> = jobs
                        .par_iter()
                        .map(|job| match items.get(job.item) {
                            Some(item) => decode_sample(item, job, &settings),
                            None => Err((PathBuf::new(), format!("no item {}", job.item))),
                        })
                        .collect();
                    if tx.send(decoded).is_err() {
                        return; // the trainer stopped listening
                    }
                }
            });
        match handle {
            Ok(handle) => Self {
                rx: Some(rx),
                handle: Some(handle),
            },
            // No thread: an empty prefetcher whose `next` says so.
            Err(_) => Self {
                rx: None,
                handle: None,
            },
        }
    }

    /// The next step's samples, in job order; `None` when the steps are used up or the thread
    /// could not start.
    pub fn next_step(&mut self) -> Option<Vec<Decoded>> {
        self.rx.as_ref()?.recv().ok()
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        // Closing the queue makes the thread's next send fail, and it returns.
        drop(self.rx.take());
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(dir: &std::path::Path, n: usize) -> Arc<[ImageMeta]> {
        (0..n)
            .map(|i| {
                let path = dir.join(format!("{i}.png"));
                image::RgbImage::from_fn(40 + i as u32 * 8, 32, |x, _| {
                    image::Rgb([i as u8, x as u8, 0])
                })
                .save(&path)
                .unwrap();
                ImageMeta {
                    path,
                    caption: format!("c{i}"),
                    multiplier: 1.0,
                    options: Default::default(),
                    size: (40 + i * 8, 32),
                }
            })
            .collect()
    }

    #[test]
    fn steps_come_back_in_order_cropped_to_their_buckets() {
        let dir = tempfile::tempdir().unwrap();
        let items = items(dir.path(), 4);
        let b = Bucket::new(24, 16);
        let job = |item| SampleJob {
            item,
            bucket: b,
            seed: item as u64,
        };
        let steps = vec![vec![job(3), job(0)], vec![job(1)], vec![job(2), job(2)]];
        let settings = DecodeSettings {
            crop_jitter: 0.0,
            max_pixels: u64::MAX,
            masks: None,
        };
        let mut p = Prefetcher::spawn(items.clone(), steps.clone(), settings, 1);
        for jobs in &steps {
            let got = p.next_step().unwrap();
            assert_eq!(got.len(), jobs.len());
            for (d, j) in got.iter().zip(jobs) {
                let image = d.as_ref().unwrap();
                assert_eq!((image.width, image.height), (24, 16));
                assert_eq!(image.caption, format!("c{}", j.item));
                assert_eq!(image.pixels[0], j.item as u8);
            }
        }
        assert!(p.next_step().is_none());
    }

    #[test]
    fn a_broken_file_comes_back_as_an_error_and_dropping_stops_early() {
        let dir = tempfile::tempdir().unwrap();
        let items = items(dir.path(), 2);
        std::fs::write(&items[1].path, b"not a png any more").unwrap();
        let job = |item| SampleJob {
            item,
            bucket: Bucket::new(16, 16),
            seed: 0,
        };
        let settings = DecodeSettings {
            crop_jitter: 0.1,
            max_pixels: u64::MAX,
            masks: None,
        };
        let steps = vec![vec![job(0), job(1)]; 50];
        let mut p = Prefetcher::spawn(items.clone(), steps, settings, 2);
        let first = p.next_step().unwrap();
        assert!(first[0].is_ok());
        let (path, why) = first[1].as_ref().unwrap_err();
        assert_eq!(path, &items[1].path);
        assert!(!why.is_empty());
        drop(p); // must not hang with 49 steps left
    }

    #[test]
    fn jittered_crops_replay_from_the_seed() {
        let dir = tempfile::tempdir().unwrap();
        let items = items(dir.path(), 3);
        let settings = DecodeSettings {
            crop_jitter: 0.2,
            max_pixels: u64::MAX,
            masks: None,
        };
        let job = SampleJob {
            item: 2,
            bucket: Bucket::new(16, 16),
            seed: 77,
        };
        let a = decode_sample(&items[2], &job, &settings).unwrap();
        let b = decode_sample(&items[2], &job, &settings).unwrap();
        assert_eq!(a, b);
    }
}
