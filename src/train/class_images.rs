//! diffusers' DreamBooth class images (`class_prompt`, `num_class_images`): before training,
//! when `reg_data_root` holds fewer than `num_class_images` images, the base model draws the
//! rest, as `train_dreambooth.py --with_prior_preservation` does (`DiffusionPipeline(class_prompt)`
//! with the pipeline's defaults: the model's own scheduler, 50 steps, guidance 7.5, the model's
//! native size, no negative prompt). They then train as regularization images
//! ([`crate::data::regularization`]) captioned with `class_prompt`.
//!
//! Where they go: EveryDream2's layout, `class-NNNNN.png` in `reg_data_root` with
//! `class_prompt` in `class-NNNNN.txt` beside it; kohya's, the subfolder `1_<class_prompt>`
//! (captioned by its class tokens, the prompt itself). The images are drawn from the base model
//! before any adapter attaches (an `init_from` file too), each from a seed of the run's seed and
//! its number, so a stopped run that draws the rest draws what an unstopped one would have.
//!
//! Differences from diffusers, on purpose: images are counted as the layout reads them (diffusers
//! counts every file in the folder, caption files too); PNG rather than JPEG, named by number
//! rather than by hash; the prompt is read as EveryDream2's samples read theirs (compel's weights,
//! which plain text does not use); a scheduler sdtrain has no sampler for draws with DDIM, with a
//! note. A data-parallel run does not draw them (its ranks would race for the folder).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;

use super::interrupt::Interrupt;
use crate::config::RegularizationPlan;
use crate::data::kohya_layout::scan_kohya;
use crate::data::scan::scan_as;
use crate::data::{DataError, DataLayout};
use crate::model::pipeline::StableDiffusion;
use crate::precision::Amp;
use crate::sample::generate::{zero_empty_negative, UnetRun};
use crate::sample::jobs::PromptJob;
use crate::sample::prompts::{PromptSyntax, SeedChoice};
use crate::sample::sampler::SamplerKind;
use crate::sample::scheduler_config::SchedulerConfig;

/// diffusers' pipeline defaults, which `train_dreambooth.py` draws class images with.
pub const CLASS_STEPS: usize = 50;
pub const CLASS_GUIDANCE: f64 = 7.5;

/// What drawing class images needs of the run.
pub(super) struct DrawContext<'a> {
    /// The base model, before its adapters attach.
    pub sd: &'a StableDiffusion,
    pub amp: Amp,
    /// The model's native resolution (the pipeline's default size).
    pub resolution: usize,
    /// The run's seed and its rank count.
    pub seed: u64,
    pub world: usize,
    pub interrupt: &'a Interrupt,
}

/// Draws the class images `reg_data_root` lacks, if any.
pub(super) fn fill(
    reg: &RegularizationPlan,
    layout: &DataLayout,
    cx: &DrawContext<'_>,
) -> anyhow::Result<()> {
    let Some(class) = &reg.class_images else {
        return Ok(());
    };
    let dir = class_folder(&reg.data_root, layout, &class.prompt);
    let have = present(&reg.data_root, layout)?;
    if have >= class.count {
        crate::console::say(format_args!(
            "class images: {have} in reg_data_root (num_class_images {}), none to draw",
            class.count
        ));
        return Ok(());
    }
    if cx.world > 1 {
        anyhow::bail!(
            "reg_data_root {} holds {have} of num_class_images {} class images, and a \
             data-parallel run does not draw them (its ranks would race for the folder): run this \
             config once on one device first; it draws them before training starts",
            reg.data_root.display(),
            class.count
        );
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let scheduler = SchedulerConfig::from_layout(&cx.sd.layout)?;
    let sampler = model_sampler(&cx.sd.layout.scheduler_config);
    let resolution = cx.resolution;
    let job = PromptJob {
        index: 0,
        prompt: class.prompt.clone(),
        negative_prompt: String::new(),
        seed: SeedChoice::Random,
        width: resolution,
        height: resolution,
        steps: CLASS_STEPS,
        sampler,
        cfgs: vec![CLASS_GUIDANCE],
        guidance_rescale: 0.0,
        syntax: PromptSyntax::Compel,
    };
    let missing = class.count - have;
    crate::console::say(format_args!(
        "class images: reg_data_root holds {have} of {}; drawing {missing} of \"{}\" into {} \
         ({sampler}, {CLASS_STEPS} steps, cfg {CLASS_GUIDANCE}, {resolution}×{resolution})",
        class.count,
        class.prompt,
        dir.display(),
    ));
    draw(cx, &job, &scheduler, &dir, (have, missing), layout)
}

/// Draws images `have..have + missing` into `dir`, each with its caption file (EveryDream2's
/// layout) written first.
fn draw(
    cx: &DrawContext<'_>,
    job: &PromptJob,
    scheduler: &SchedulerConfig,
    dir: &Path,
    (have, missing): (usize, usize),
    layout: &DataLayout,
) -> anyhow::Result<()> {
    let sd = cx.sd;
    let vae = sd
        .vae
        .as_ref()
        .context("the model has no VAE to draw class images with")?;
    let conds = job.encode(sd, 0, zero_empty_negative(sd))?;
    let run = UnetRun {
        dtype: cx.amp.compute_dtype(),
        batch_halves: false,
    };
    let started = Instant::now();
    for k in 0..missing {
        if cx.interrupt.requested() {
            anyhow::bail!(
                "interrupted while drawing class images: {k} of {missing} drawn into {}; run \
                 again to draw the rest",
                dir.display()
            );
        }
        let number = have + k;
        let stem = free_stem(dir, number);
        if matches!(layout, DataLayout::Everydream) {
            let caption = dir.join(format!("{stem}.txt"));
            crate::fsutil::write_atomic(&caption, job.prompt.as_bytes())?;
        }
        let image_seed = class_seed(cx.seed, number);
        let images = job
            .draw(sd, vae, run, scheduler, &conds, image_seed)
            .with_context(|| format!("drawing class image {}", k + 1))?;
        for image in &images {
            crate::sample::image_out::write_png(&dir.join(format!("{stem}.png")), image)?;
        }
        crate::console::say(format_args!(
            "class image {}/{missing} ({:.1} s so far)",
            k + 1,
            started.elapsed().as_secs_f64()
        ));
    }
    Ok(())
}

/// `class-NNNNN`, numbered from `number` on to the first name without an image or caption.
fn free_stem(dir: &Path, number: usize) -> String {
    (number..)
        .map(|n| format!("class-{n:05}"))
        .find(|stem| {
            ["png", "txt"]
                .iter()
                .all(|ext| !dir.join(format!("{stem}.{ext}")).exists())
        })
        .unwrap_or_default()
}

/// The seed of class image `number`: the run's seed and the number, mixed.
pub fn class_seed(seed: u64, number: usize) -> u64 {
    let mut z = seed ^ (number as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x0063_6c61_7373;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) & ((1 << 30) - 1)
}

/// The folder class images are drawn into.
pub fn class_folder(root: &Path, layout: &DataLayout, prompt: &str) -> PathBuf {
    match layout {
        // The imagefolder layout has no class images (its reg_data_root is refused).
        DataLayout::Everydream | DataLayout::ImageFolder { .. } => root.to_path_buf(),
        DataLayout::Kohya { .. } => root.join(format!("1_{prompt}")),
    }
}

/// The images `root` holds as its layout reads them (0 for a missing or empty folder), counted
/// without the scan's warnings (the load after says them once).
fn present(root: &Path, layout: &DataLayout) -> anyhow::Result<usize> {
    if !root.exists() {
        return Ok(0);
    }
    let was_quiet = crate::console::quiet();
    crate::console::set_quiet(true);
    let records = match layout {
        DataLayout::Everydream => scan_as("reg_data_root", root),
        DataLayout::Kohya { caption_extension } => {
            scan_kohya("reg_data_root", root, caption_extension)
        }
        DataLayout::ImageFolder { caption_column } => {
            crate::data::imagefolder::scan_imagefolder("reg_data_root", root, caption_column)
        }
    };
    crate::console::set_quiet(was_quiet);
    match records {
        Ok(r) => Ok(r.len()),
        Err(DataError::NoImages { .. } | DataError::NoKohyaImages { .. }) => Ok(0),
        Err(e) => Err(e.into()),
    }
}

/// The sampler of the model's own scheduler class (`_class_name` of its scheduler config), as
/// diffusers' pipeline draws with it; DDIM (with a note) for a class sdtrain has none for.
fn model_sampler(config: &Path) -> SamplerKind {
    let class = std::fs::read_to_string(config)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v.get("_class_name")?.as_str().map(str::to_string))
        .unwrap_or_default();
    let name = match class.as_str() {
        "DDIMScheduler" => "ddim",
        "DDPMScheduler" => "ddpm",
        "PNDMScheduler" => "pndm",
        "EulerDiscreteScheduler" => "euler",
        "EulerAncestralDiscreteScheduler" => "euler_a",
        "LMSDiscreteScheduler" => "lms",
        "KDPM2AncestralDiscreteScheduler" => "kdpm2",
        "DPMSolverMultistepScheduler" => "dpm++_2m",
        "DPMSolverSinglestepScheduler" => "dpm++_2s",
        other => {
            crate::console::say(format_args!(
                "note: class images are drawn with DDIM: the model's scheduler {} has no sdtrain \
                 sampler",
                if other.is_empty() { "(unnamed)" } else { other }
            ));
            "ddim"
        }
    };
    SamplerKind::parse(name).unwrap_or(SamplerKind::Ddim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_differ_by_image_and_run_and_stay_put() {
        let a: Vec<u64> = (0..50).map(|n| class_seed(7, n)).collect();
        let mut dedup = a.clone();
        dedup.sort();
        dedup.dedup();
        assert_eq!(dedup.len(), 50);
        assert_ne!(class_seed(7, 3), class_seed(8, 3));
        assert_eq!(class_seed(7, 3), a[3]);
        assert!(a.iter().all(|&s| s < 1 << 30));
    }

    #[test]
    fn names_skip_taken_numbers() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("class-00002.txt"), "x").unwrap();
        std::fs::write(dir.path().join("class-00003.png"), "x").unwrap();
        assert_eq!(free_stem(dir.path(), 1), "class-00001");
        assert_eq!(free_stem(dir.path(), 2), "class-00004");
    }

    #[test]
    fn schedulers_map_to_their_samplers() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("scheduler_config.json");
        for (class, want) in [
            ("PNDMScheduler", SamplerKind::Pndm),
            ("EulerDiscreteScheduler", SamplerKind::Euler),
            ("DDIMScheduler", SamplerKind::Ddim),
            ("FlowMatchEulerDiscreteScheduler", SamplerKind::Ddim),
        ] {
            std::fs::write(&cfg, format!(r#"{{"_class_name": "{class}"}}"#)).unwrap();
            assert_eq!(model_sampler(&cfg), want, "{class}");
        }
        assert_eq!(
            model_sampler(&dir.path().join("none.json")),
            SamplerKind::Ddim
        );
    }
}
