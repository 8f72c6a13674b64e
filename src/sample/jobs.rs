//! A sample prompts file resolved for one model and run: each prompt's text, size, seed,
//! steps, sampler and guidance scales, and the files its images go to.

use std::path::{Path, PathBuf};

use image::RgbImage;
use rand::Rng;

use super::generate::{PromptConds, SampleRequest, UnetRun};
use super::image_out::{self, file_part, WriteError};
use super::prompts::{PromptSyntax, PromptText, SamplePrompt, SampleSet, SeedChoice, SizeChoice};
use super::sampler::SamplerKind;
use super::scheduler_config::SchedulerConfig;
use crate::data::bucket::{aspect_buckets, nearest_bucket};
use crate::model::pipeline::StableDiffusion;
use crate::model::vae::AutoencoderKL;

/// One prompt of the file, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptJob {
    /// Its place in the file (names its files).
    pub index: usize,
    pub prompt: String,
    pub negative_prompt: String,
    pub seed: SeedChoice,
    pub width: usize,
    pub height: usize,
    pub steps: usize,
    pub sampler: SamplerKind,
    pub cfgs: Vec<f64>,
    /// Guidance rescale φ for every request (0: plain guidance).
    pub guidance_rescale: f64,
    /// How the prompts' weights are written.
    pub syntax: PromptSyntax,
}

impl PromptJob {
    /// The requests for one round of samples, one per guidance scale, all with `seed`.
    pub fn requests(&self, seed: u64) -> Vec<SampleRequest> {
        self.cfgs
            .iter()
            .map(|&cfg| SampleRequest {
                prompt: self.prompt.clone(),
                negative_prompt: self.negative_prompt.clone(),
                seed,
                width: self.width,
                height: self.height,
                steps: self.steps,
                cfg,
                guidance_rescale: self.guidance_rescale,
                sampler: self.sampler,
            })
            .collect()
    }

    /// Its conditioning, with the negative half whenever any of its scales guides.
    pub fn encode(
        &self,
        sd: &StableDiffusion,
        clip_skip: usize,
        zero_negative: bool,
    ) -> candle_core::Result<PromptConds> {
        let guided = self.cfgs.iter().any(|&c| c > 1.0);
        PromptConds::encode(
            sd,
            &self.prompt,
            &self.negative_prompt,
            guided,
            clip_skip,
            zero_negative,
            self.syntax,
        )
    }

    /// Its images with `seed` and its conditioning `conds` ([`Self::encode`]): one per guidance
    /// scale, left to right.
    pub fn draw(
        &self,
        sd: &StableDiffusion,
        vae: &AutoencoderKL,
        run: UnetRun,
        scheduler: &SchedulerConfig,
        conds: &PromptConds,
        seed: u64,
    ) -> anyhow::Result<Vec<RgbImage>> {
        let mut images = Vec::with_capacity(self.cfgs.len());
        for req in self.requests(seed) {
            let sampler = req
                .sampler
                .build(scheduler, req.steps)
                .map_err(anyhow::Error::msg)?;
            let conds = PromptConds {
                cond: conds.cond.clone(),
                uncond: conds.uncond.clone().filter(|_| req.guided()),
            };
            let image = super::generate(sd, vae, run, sampler.as_ref(), &conds, &req)?;
            images.push(image_out::to_rgb(&image)?);
        }
        Ok(images)
    }

    /// The seed of this round: the fixed one, or a fresh draw.
    pub fn seed_for_round<R: Rng>(&self, rng: &mut R) -> u64 {
        match self.seed {
            SeedChoice::Fixed(s) => s,
            SeedChoice::Random => rng.random_range(0..1u64 << 30),
        }
    }

    /// The `.txt` written beside its images.
    pub fn describe(&self, seed: u64) -> String {
        let cfgs: Vec<String> = self.cfgs.iter().map(|c| format!("{c}")).collect();
        let rescale = match self.guidance_rescale > 0.0 {
            true => format!("guidance rescale: {}\n", self.guidance_rescale),
            false => String::new(),
        };
        let weights = match self.syntax {
            PromptSyntax::Compel => "",
            PromptSyntax::Kohya => "prompt weights: A1111's, as kohya sd-scripts reads them\n",
        };
        format!(
            "prompt: {}\nnegative prompt: {}\nseed: {seed}\nsize: {}x{}\nsampler: {}, {} steps\n\
             cfg (left to right): {}\n{rescale}{weights}",
            self.prompt,
            self.negative_prompt,
            self.width,
            self.height,
            self.sampler,
            self.steps,
            cfgs.join(", ")
        )
    }
}

/// Resolves `set`: sizes against `resolution` (the file's own, else this) and the model's
/// `align`ment, random captions from `captions` (the i-th random prompt takes caption
/// `i·n/k` of the k random ones, so they spread over the set), the default seed `run_seed`.
pub fn resolve(
    set: &SampleSet,
    run_seed: u64,
    resolution: usize,
    align: usize,
    captions: &[String],
) -> Result<Vec<PromptJob>, String> {
    let resolution = set.resolution.unwrap_or(resolution);
    let random_total = set
        .prompts
        .iter()
        .filter(|p| p.prompt == PromptText::RandomCaption)
        .count();
    let mut random_seen = 0;
    let mut jobs = Vec::with_capacity(set.prompts.len());
    for (index, p) in set.prompts.iter().enumerate() {
        let where_ = || format!("{}: samples[{index}]", set.path.display());
        let prompt = match &p.prompt {
            PromptText::Text(t) => t.clone(),
            PromptText::RandomCaption => {
                if captions.is_empty() {
                    return Err(format!("{}: random_caption, but no captions", where_()));
                }
                let k = random_seen * captions.len() / random_total.max(1);
                random_seen += 1;
                captions[k].clone()
            }
        };
        let (width, height) =
            image_size(p, resolution, align).map_err(|e| format!("{}: {e}", where_()))?;
        jobs.push(PromptJob {
            index,
            prompt,
            negative_prompt: p.negative_prompt.clone(),
            seed: p.seed.or(set.seed).unwrap_or(SeedChoice::Fixed(run_seed)),
            width,
            height,
            steps: p.steps.unwrap_or(set.steps),
            sampler: p.sampler.unwrap_or(set.sampler),
            cfgs: p.cfgs.clone().unwrap_or_else(|| set.cfgs.clone()),
            guidance_rescale: 0.0,
            syntax: p.syntax,
        });
    }
    Ok(jobs)
}

/// The image size of prompt `p` against `resolution` (the file's own, else the run's) and the
/// model's `align`ment.
fn image_size(p: &SamplePrompt, resolution: usize, align: usize) -> Result<(usize, usize), String> {
    let (width, height) = match p.size {
        SizeChoice::Default => (resolution, resolution),
        SizeChoice::Exact(w, h) => (w, h),
        SizeChoice::Sides(w, h) => (w.unwrap_or(resolution), h.unwrap_or(resolution)),
        SizeChoice::Aspect(r) => {
            let buckets = aspect_buckets(resolution, align, None);
            let b = nearest_bucket(&buckets, (r * 1e6) as usize, 1_000_000)
                .ok_or_else(|| format!("no size for aspect_ratio {r}"))?;
            (b.width, b.height)
        }
    };
    if width % align != 0 || height % align != 0 || width == 0 || height == 0 {
        return Err(format!(
            "size {width}x{height} must be a positive multiple of {align} for this model"
        ));
    }
    super::generate::check_side_limit(width, height)?;
    Ok((width, height))
}

/// What a round of `set` draws at its largest, for the memory plan: the largest image's
/// `(width, height)` by pixels, and whether any prompt guides (a scale above 1, which runs the
/// UNet on a negative half too). `None` when no size resolves (the run refuses the file then).
pub fn largest_image(
    set: &SampleSet,
    resolution: usize,
    align: usize,
) -> Option<((usize, usize), bool)> {
    let resolution = set.resolution.unwrap_or(resolution);
    let mut largest: Option<(usize, usize)> = None;
    let mut guided = false;
    for p in &set.prompts {
        let (w, h) = image_size(p, resolution, align).ok()?;
        if largest.is_none_or(|(lw, lh)| w * h > lw * lh) {
            largest = Some((w, h));
        }
        guided |= p
            .cfgs
            .as_ref()
            .unwrap_or(&set.cfgs)
            .iter()
            .any(|&c| c > 1.0);
    }
    largest.map(|size| (size, guided))
}

/// One prompt's images of a round, one per guidance scale.
pub struct PromptImages<'a> {
    pub job: &'a PromptJob,
    pub seed: u64,
    pub images: Vec<RgbImage>,
}

/// One prompt's strip of a round, for the log.
pub struct Strip {
    /// `samples/<index>_<prompt>` (with `_ema` for the EMA model's).
    pub tag: String,
    pub image: RgbImage,
    /// The PNG written to disk.
    pub png: Vec<u8>,
}

/// What a round wrote: the files, and each prompt's strip.
pub struct RoundFiles {
    pub paths: Vec<PathBuf>,
    pub strips: Vec<Strip>,
}

/// Writes a round's images into `dir`: per prompt `gsSSSSS-III[-label]-<prompt>.png` (the
/// guidance scales side by side, EveryDream2's layout) and a `.txt` describing it, and the
/// round's grid `gsSSSSS[-label]-grid.png` (one row per prompt).
pub fn write_round(
    dir: &Path,
    step: usize,
    label: &str,
    round: &[PromptImages<'_>],
) -> Result<RoundFiles, WriteError> {
    std::fs::create_dir_all(dir).map_err(|source| {
        WriteError::Fs(crate::fsutil::FsError::Io {
            op: "create",
            path: dir.to_path_buf(),
            source,
        })
    })?;
    let tagged = if label.is_empty() {
        String::new()
    } else {
        format!("-{label}")
    };
    let mut paths = Vec::new();
    let mut strips = Vec::new();
    for r in round {
        let strip = image_out::side_by_side(&r.images);
        let stem = format!(
            "gs{step:05}-{:03}{tagged}-{}",
            r.job.index,
            file_part(&r.job.prompt)
        );
        let png = dir.join(format!("{stem}.png"));
        let bytes = image_out::write_png(&png, &strip)?;
        let txt = dir.join(format!("{stem}.txt"));
        crate::fsutil::write_atomic(&txt, r.job.describe(r.seed))?;
        paths.push(png);
        let tag_label = if label.is_empty() {
            String::new()
        } else {
            format!("_{label}")
        };
        strips.push(Strip {
            tag: format!(
                "samples/{:03}{tag_label}_{}",
                r.job.index,
                file_part(&r.job.prompt)
            ),
            image: strip,
            png: bytes,
        });
    }
    let rows: Vec<RgbImage> = strips.iter().map(|s| s.image.clone()).collect();
    let grid = dir.join(format!("gs{step:05}{tagged}-grid.png"));
    image_out::write_png(&grid, &image_out::stacked(&rows))?;
    paths.push(grid);
    Ok(RoundFiles { paths, strips })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::prompts::SampleSet;

    fn set(text: &str) -> SampleSet {
        SampleSet::from_json(Path::new("s.json"), text).unwrap()
    }

    #[test]
    fn jobs_take_sizes_seeds_and_captions() {
        let s = set(r#"{"seed": 9, "cfgs": [5], "samples": [
            {"prompt": "a", "size": [64, 32]},
            {"random_caption": true, "aspect_ratio": 2.0, "seed": 3},
            {"random_caption": true}]}"#);
        let caps = vec!["c0".to_string(), "c1".into(), "c2".into(), "c3".into()];
        let jobs = resolve(&s, 1, 32, 8, &caps).unwrap();
        assert_eq!((jobs[0].width, jobs[0].height), (64, 32));
        assert_eq!(jobs[0].seed, SeedChoice::Fixed(9));
        assert_eq!(jobs[1].seed, SeedChoice::Fixed(3));
        assert_eq!(
            (jobs[1].prompt.as_str(), jobs[2].prompt.as_str()),
            ("c0", "c2")
        );
        assert!(jobs[1].width > jobs[1].height, "{jobs:?}");
        assert_eq!((jobs[2].width, jobs[2].height), (32, 32));
        assert_eq!(jobs[2].requests(4)[0].cfg, 5.0);
    }

    #[test]
    fn unaligned_sizes_are_refused() {
        let s = set(r#"{"samples": [{"prompt": "a", "size": [60, 32]}]}"#);
        let e = resolve(&s, 1, 32, 8, &[]).unwrap_err();
        assert!(
            e.contains("s.json: samples[0]") && e.contains("multiple of 8"),
            "{e}"
        );
    }

    #[test]
    fn a_round_writes_strips_txt_and_grid() {
        let dir = tempfile::tempdir().unwrap();
        let s = set(r#"{"cfgs": [7, 4], "samples": [{"prompt": "a cat"}, {"prompt": "b"}]}"#);
        let jobs = resolve(&s, 1, 8, 8, &[]).unwrap();
        let im = |v| RgbImage::from_pixel(8, 8, image::Rgb([v, v, v]));
        let round: Vec<PromptImages<'_>> = jobs
            .iter()
            .map(|j| PromptImages {
                job: j,
                seed: 5,
                images: vec![im(10), im(200)],
            })
            .collect();
        let files = write_round(dir.path(), 7, "ema", &round).unwrap();
        let names: Vec<String> = files
            .paths
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [
                "gs00007-000-ema-a_cat.png",
                "gs00007-001-ema-b.png",
                "gs00007-ema-grid.png"
            ]
        );
        let strip = image::open(&files.paths[0]).unwrap().to_rgb8();
        assert_eq!(strip.dimensions(), (16, 8));
        assert_eq!(strip.get_pixel(12, 3).0, [200, 200, 200]);
        let grid = image::open(&files.paths[2]).unwrap().to_rgb8();
        assert_eq!(grid.dimensions(), (16, 16));
        let txt = std::fs::read_to_string(dir.path().join("gs00007-000-ema-a_cat.txt")).unwrap();
        assert!(
            txt.contains("seed: 5") && txt.contains("cfg (left to right): 7, 4"),
            "{txt}"
        );
        assert_eq!(files.strips[1].tag, "samples/001_ema_b");
        assert_eq!(files.strips[0].png, std::fs::read(&files.paths[0]).unwrap());
    }
}
