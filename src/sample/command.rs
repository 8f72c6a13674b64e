//! `sdtrain sample`: one or more images from a model (optionally with kohya LoRA/LoCon files
//! merged in), with the sampler a run uses for its samples.

use std::path::{Path, PathBuf};

use anyhow::Context;
use candle_core::{DType, Device};
use clap::Args;
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::generate::{zero_empty_negative, PromptConds, SampleRequest, UnetRun};
use super::image_out;
use super::jobs::{self, PromptImages};
use super::prompts::{PromptSyntax, PromptText, SampleSet};
use super::sampler::SamplerKind;
use super::scheduler_config::SchedulerConfig;
use crate::adapter::kohya_file::load_kohya;
use crate::adapter::merge::merge_kohya;
use crate::model::family::PredictionType;
use crate::model::layout::ModelLayout;
use crate::model::pipeline::{LoadOptions, StableDiffusion};
use crate::model::single_file::SingleFileOptions;
use crate::model::source::ModelSource;

#[derive(Debug, Clone, Args)]
pub struct SampleArgs {
    /// A diffusers pipeline folder, or a Hugging Face repo id `org/name[@revision]`.
    #[arg(long, value_name = "HUB_ID[@REV]|FOLDER")]
    pub model: String,
    /// Prefer weight files of this variant (e.g. `fp16`) where the model has them.
    #[arg(long, value_name = "NAME")]
    pub variant: Option<String>,
    /// For a single-file `--model`: a diffusers folder whose configs and tokenizers describe it.
    #[arg(long, value_name = "FOLDER")]
    pub model_config: Option<PathBuf>,
    /// A VAE in place of the model's: a VAE or pipeline folder, a `.safetensors` VAE file
    /// (A1111's or diffusers' names), or a hub repo id.
    #[arg(long, value_name = "VAE")]
    pub vae: Option<String>,
    /// For a single-file `--model`: `epsilon` or `v_prediction`, overriding what is detected.
    #[arg(long, value_parser = parse_prediction)]
    pub prediction_type: Option<PredictionType>,
    /// A LoRA .safetensors to merge into the weights: kohya's layout (LoRA, LoCon, LyCORIS's LoHa,
    /// LoKr, DoRA) or diffusers' (`pytorch_lora_weights.safetensors`). Repeatable.
    #[arg(long = "lora", value_name = "FILE")]
    pub loras: Vec<PathBuf>,
    /// A textual-inversion embedding to use in the prompts, as `FILE` or `TOKEN=FILE`: kohya's
    /// and A1111's `emb_params` or SDXL `clip_l`/`clip_g` files, or diffusers'
    /// `learned_embeds.safetensors`. Its token is TOKEN, else the one the file records, else its
    /// file name (A1111's `embedding` name). Repeatable.
    #[arg(long = "embedding", value_name = "[TOKEN=]FILE")]
    pub embeddings: Vec<String>,
    /// The LoRA multiplier (A1111's `<lora:name:m>`), one for all files.
    #[arg(long, default_value_t = 1.0)]
    pub lora_scale: f64,
    /// The prompt, with compel's weighting as EveryDream2's samples read it: `word+`, `word-`,
    /// `(some words)1.3`, `("a", "b").blend(0.7, 0.3)`.
    #[arg(long, required_unless_present = "prompts")]
    pub prompt: Option<String>,
    /// A sample prompts file instead of `--prompt`, read as a run's `sample_prompts` reads it
    /// (EveryDream2's .json or .txt; kohya sd-scripts' .txt with `--n`/`--w`/`--h`/`--d`/`--s`/
    /// `--l`/`--ss` options, its .json list or its .toml, like kohya's `gen_img.py
    /// --from_file`). Each prompt is drawn at its own size, seed, steps, sampler and guidance
    /// scales (the file's defaults where it sets none); the images, their .txt and a grid go to
    /// `--out-dir`.
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with_all = [
            "prompt", "negative_prompt", "prompt_syntax", "steps", "cfg", "sampler", "width",
            "height", "count", "out",
        ]
    )]
    pub prompts: Option<PathBuf>,
    /// With `--prompts`: the folder the images go to.
    #[arg(long, value_name = "DIR", default_value = "samples")]
    pub out_dir: PathBuf,
    /// The negative prompt, read as `--prompt`.
    #[arg(long, default_value = "")]
    pub negative_prompt: String,
    /// How the prompts' weights are written: `compel` (EveryDream2's samples: `word+`,
    /// `(words)1.3`) or `kohya` (A1111's `(words:1.3)` and `[words]`, and prompts beyond 75
    /// tokens, as kohya sd-scripts' samples read them). Default: `kohya` when a prompt holds
    /// A1111's `(words:1.3)`, else `compel`.
    #[arg(long, value_enum)]
    pub prompt_syntax: Option<PromptSyntax>,
    /// The first image's seed; image i uses seed + i.
    #[arg(long, default_value_t = 555)]
    pub seed: u64,
    #[arg(long, default_value_t = 30)]
    pub steps: usize,
    /// Classifier-free guidance scale (≤ 1: none).
    #[arg(long, default_value_t = 7.0)]
    pub cfg: f64,
    /// Guidance rescale φ in [0, 1] (diffusers' `guidance_rescale`, arXiv 2305.08891 §3.4):
    /// pulls the guided output back toward the conditional output's spread, against the
    /// overexposure of zero-terminal-SNR models at high guidance. 0.7 is the paper's and
    /// EveryDream2's value; 0 (the default) is plain guidance.
    #[arg(long, default_value_t = 0.0)]
    pub guidance_rescale: f64,
    /// EveryDream2's sampler names: `ddim`, `ddpm`, `pndm`, `euler`, `euler_a`, `lms`, `kdpm2`,
    /// `dpm++` (`dpm++_2m`), `dpm++_2m_k`, `dpm++_2m_sde(_k)`, `dpm++_2s(_k)`, `dpm++_sde(_k)`.
    #[arg(long, default_value = "ddim", value_parser = parse_sampler)]
    pub sampler: SamplerKind,
    /// Width in pixels (default: the model's native resolution).
    #[arg(long)]
    pub width: Option<usize>,
    /// Height in pixels (default: the model's native resolution).
    #[arg(long)]
    pub height: Option<usize>,
    /// How many images.
    #[arg(long, default_value_t = 1)]
    pub count: usize,
    /// Text-encoder layers skipped from the end (0: the model's default layer).
    #[arg(long, default_value_t = 0)]
    pub clip_skip: usize,
    /// `bf16`, `fp16` or `fp32` (default: bf16 on a GPU, fp32 on the CPU).
    #[arg(long, value_parser = parse_precision)]
    pub precision: Option<DType>,
    /// The PNG to write; with `--count` above 1, `<stem>-<i>.png`.
    #[arg(long, default_value = "sample.png")]
    pub out: PathBuf,
    /// Run on the CPU even when a GPU is available.
    #[arg(long, conflicts_with = "device")]
    pub cpu: bool,
    /// `cpu`, `cuda` or `cuda:N`: the device to draw on (default: the first CUDA card, else the
    /// CPU).
    #[arg(long, value_name = "cpu|cuda:N")]
    pub device: Option<crate::memory::DeviceRequest>,
}

fn parse_sampler(s: &str) -> Result<SamplerKind, String> {
    SamplerKind::parse(s).ok_or_else(|| SamplerKind::unknown(s))
}

/// `--prediction-type`'s values.
pub fn parse_prediction(s: &str) -> Result<PredictionType, String> {
    match s {
        "epsilon" => Ok(PredictionType::Epsilon),
        "v_prediction" | "v" => Ok(PredictionType::VPrediction),
        _ => Err("must be epsilon or v_prediction".into()),
    }
}

fn parse_precision(s: &str) -> Result<DType, String> {
    match s {
        "bf16" => Ok(DType::BF16),
        "fp16" => Ok(DType::F16),
        "fp32" | "f32" | "no" => Ok(DType::F32),
        _ => Err("must be bf16, fp16 or fp32".into()),
    }
}

/// The output path of image `i` of `count`.
fn out_path(out: &Path, i: usize, count: usize) -> PathBuf {
    if count <= 1 {
        return out.to_path_buf();
    }
    let stem = out
        .file_stem()
        .map_or("sample".into(), |s| s.to_string_lossy());
    out.with_file_name(format!("{stem}-{i}.png"))
}

/// Runs the command; returns the written files.
pub fn run(args: &SampleArgs) -> anyhow::Result<Vec<PathBuf>> {
    if args.count == 0 {
        anyhow::bail!("--count must be at least 1");
    }
    if !args.cfg.is_finite() {
        anyhow::bail!("--cfg must be a finite number (got {})", args.cfg);
    }
    if !(0.0..=1.0).contains(&args.guidance_rescale) {
        anyhow::bail!(
            "--guidance-rescale must be between 0 and 1 (got {})",
            args.guidance_rescale
        );
    }
    if !args.lora_scale.is_finite() {
        anyhow::bail!(
            "--lora-scale must be a finite number (got {})",
            args.lora_scale
        );
    }
    let set = match &args.prompts {
        Some(file) => Some(SampleSet::read(file)?),
        None => None,
    };
    let prompt_syntax = match &args.prompt {
        Some(prompt) => prompt_syntax(args, prompt)?,
        None => PromptSyntax::Compel,
    };
    let request = match (args.cpu, args.device) {
        (true, _) => crate::memory::DeviceRequest::Cpu,
        (false, Some(d)) => d,
        (false, None) => crate::memory::DeviceRequest::Auto { gpuid: 0 },
    };
    let device = crate::memory::open_device(request)?;
    let dtype = args.precision.unwrap_or(if device.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    });
    let sd = load_model(args, &device, dtype)?;
    match (&set, &args.prompt) {
        (Some(set), _) => draw_file(args, &sd, dtype, set),
        (None, Some(prompt)) => draw_prompt(args, &sd, dtype, prompt, prompt_syntax),
        (None, None) => anyhow::bail!("give --prompt or --prompts"),
    }
}

/// `--prompt`: `--count` images with seeds `--seed`, `--seed` + 1, ….
fn draw_prompt(
    args: &SampleArgs,
    sd: &StableDiffusion,
    dtype: DType,
    prompt: &str,
    prompt_syntax: PromptSyntax,
) -> anyhow::Result<Vec<PathBuf>> {
    let native = sd.layout.native_resolution;
    let req0 = SampleRequest {
        prompt: prompt.to_string(),
        negative_prompt: args.negative_prompt.clone(),
        seed: args.seed,
        width: args.width.unwrap_or(native),
        height: args.height.unwrap_or(native),
        steps: args.steps,
        cfg: args.cfg,
        guidance_rescale: args.guidance_rescale,
        sampler: args.sampler,
    };
    super::generate::check_size(sd, &req0).map_err(anyhow::Error::msg)?;
    let scheduler = SchedulerConfig::from_layout(&sd.layout)?;
    let sampler = args
        .sampler
        .build(&scheduler, args.steps)
        .map_err(anyhow::Error::msg)?;
    let conds = PromptConds::encode(
        sd,
        &req0.prompt,
        &req0.negative_prompt,
        req0.guided(),
        args.clip_skip,
        zero_empty_negative(sd),
        prompt_syntax,
    )?;
    let run = UnetRun {
        dtype,
        batch_halves: true,
    };
    let vae = sd.vae()?;
    let mut written = Vec::new();
    for i in 0..args.count {
        let started = std::time::Instant::now();
        let req = SampleRequest {
            seed: args.seed + i as u64,
            ..req0.clone()
        };
        let image = super::generate(sd, vae, run, sampler.as_ref(), &conds, &req)
            .map_err(|e| explain_nonfinite(e, sd, args))?;
        let path = out_path(&args.out, i, args.count);
        image_out::write_png(&path, &image_out::to_rgb(&image)?)?;
        eprintln!(
            "{} (seed {}, {}x{}, {} {} steps, cfg {}): {:.2}s",
            path.display(),
            req.seed,
            req.width,
            req.height,
            req.sampler,
            req.steps,
            req.cfg,
            started.elapsed().as_secs_f64()
        );
        written.push(path);
    }
    Ok(written)
}

/// `--prompts`: every prompt of `set` at its own settings, written as a run writes a round of
/// samples (per prompt its guidance scales side by side and a `.txt`, then a grid). A prompt
/// without a seed takes `--seed`; a random seed is drawn from `--seed`.
fn draw_file(
    args: &SampleArgs,
    sd: &StableDiffusion,
    dtype: DType,
    set: &SampleSet,
) -> anyhow::Result<Vec<PathBuf>> {
    let file = set.path.display();
    if set.filled_in {
        anyhow::bail!(
            "{file} lists no prompts (a run draws random training captions then; `sdtrain \
             sample` has no training set)"
        );
    }
    if let Some(i) = set
        .prompts
        .iter()
        .position(|p| p.prompt == PromptText::RandomCaption)
    {
        anyhow::bail!(
            "{file}: samples[{i}] asks for a random training caption; `sdtrain sample` has no \
             training set: give it a prompt"
        );
    }
    let align = sd.vae_scale << sd.unet.config.num_downsamples();
    let native = sd.layout.native_resolution;
    let mut jobs = jobs::resolve(set, args.seed, native, align, &[]).map_err(anyhow::Error::msg)?;
    for job in &mut jobs {
        job.guidance_rescale = args.guidance_rescale;
    }
    let scheduler = SchedulerConfig::from_layout(&sd.layout)?;
    let zero_negative = zero_empty_negative(sd);
    let run = UnetRun {
        dtype,
        batch_halves: true,
    };
    let vae = sd.vae()?;
    let mut rng = StdRng::seed_from_u64(args.seed);
    let mut round = Vec::with_capacity(jobs.len());
    for job in &jobs {
        let started = std::time::Instant::now();
        let seed = job.seed_for_round(&mut rng);
        let conds = job.encode(sd, args.clip_skip, zero_negative)?;
        let images = job
            .draw(sd, vae, run, &scheduler, &conds, seed)
            .map_err(|e| explain_nonfinite(e, sd, args))
            .with_context(|| format!("{file}: prompt {} `{}`", job.index, job.prompt))?;
        eprintln!(
            "prompt {} (seed {seed}, {}x{}, {} {} steps, cfg {}): {:.2}s",
            job.index,
            job.width,
            job.height,
            job.sampler,
            job.steps,
            job.cfgs
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            started.elapsed().as_secs_f64()
        );
        round.push(PromptImages { job, seed, images });
    }
    let files = jobs::write_round(&args.out_dir, 0, "", &round)?;
    if let Some(grid) = files.paths.last() {
        eprintln!("{} prompts drawn into {}", jobs.len(), grid.display());
    }
    Ok(files.paths)
}

/// A sample that came out NaN or Inf, with its likely cause: a tensor of the model's own files
/// that holds one, else the merged `--lora` files, else the precision.
fn explain_nonfinite(e: anyhow::Error, sd: &StableDiffusion, args: &SampleArgs) -> anyhow::Error {
    if e.downcast_ref::<super::generate::NonFiniteSample>()
        .is_none()
    {
        return e;
    }
    let cause = match crate::model::nonfinite_weights::first_nonfinite(&sd.layout) {
        Some(bad) => format!(
            "tensor `{}` in {} holds {} (the model's weights are broken)",
            bad.tensor,
            bad.file.display(),
            bad.value
        ),
        None if !args.loras.is_empty() => format!(
            "the model's files are finite; the merged --lora files (at --lora-scale {}) are the \
             likely cause: a weight or `alpha` too large for the dtype",
            args.lora_scale
        ),
        None => "the model's files are finite; try --precision fp32 or another --sampler".into(),
    };
    e.context(cause)
}

/// Loads `--model` on `device` in `dtype`, with the `--lora` files merged into it.
fn load_model(args: &SampleArgs, device: &Device, dtype: DType) -> anyhow::Result<StableDiffusion> {
    let source =
        ModelSource::parse(&args.model).with_context(|| format!("model `{}`", args.model))?;
    let dir = source
        .resolve()
        .with_context(|| format!("model `{}`", args.model))?;
    let single = SingleFileOptions {
        model_config: args.model_config.clone(),
        prediction_type: args.prediction_type,
    };
    let mut layout = dir.noting_copy(ModelLayout::read_with(
        &dir.path,
        args.variant.as_deref(),
        &single,
    ))?;
    if let Some(spec) = &args.vae {
        let base = layout
            .component(crate::model::files::Component::Vae)
            .context("the model has no VAE to replace")?;
        let vae = crate::model::vae_source::open_vae(spec, base, args.variant.as_deref())?;
        crate::console::say(format_args!(
            "vae: {}, in place of the model's",
            vae.described
        ));
        layout = layout.with_vae(vae.files);
    }
    let opts = LoadOptions {
        dtype,
        // SD's VAE overflows in f16 (diffusers' `force_upcast`).
        vae_dtype: (dtype == DType::F16).then_some(DType::F32),
        device: device.clone(),
        train_unet: false,
        train_text_encoders: false,
        fp8_unet: false,
        fp8_text_encoders: false,
        trained_dtype: candle_core::DType::F32,
    };
    let mut sd = StableDiffusion::load(layout, &opts)?;
    merge_loras(&mut sd, args, device)?;
    add_embeddings(&mut sd, &args.embeddings, device)?;
    Ok(sd)
}

/// `--embedding [TOKEN=]FILE`: the token (when given, a word before `=` with no path
/// separator) and the file.
fn embedding_arg(raw: &str) -> (Option<&str>, &Path) {
    match raw.split_once('=') {
        Some((token, file)) if !token.is_empty() && !token.contains(['/', '\\']) => {
            (Some(token), Path::new(file))
        }
        _ => (None, Path::new(raw)),
    }
}

/// Adds each `--embedding` to the text encoders, in the model's dtype.
pub(crate) fn add_embeddings(
    sd: &mut StableDiffusion,
    embeddings: &[String],
    device: &Device,
) -> anyhow::Result<()> {
    for raw in embeddings {
        let (token, path) = embedding_arg(raw);
        let file = crate::adapter::embedding_file::load_embedding(path, device)
            .with_context(|| format!("--embedding {raw}"))?;
        let token = token.map_or_else(|| file.default_token(), str::to_string);
        add_embedding_file(sd, &file, &token, &format!("--embedding {raw}"))?;
    }
    Ok(())
}

/// Adds `file`'s vectors under `token`, in the model's dtype (`label` names the argument).
fn add_embedding_file(
    sd: &mut StableDiffusion,
    file: &crate::adapter::embedding_file::EmbeddingFile,
    token: &str,
    label: &str,
) -> anyhow::Result<()> {
    let encoders: Vec<(usize, DType)> = sd
        .text_encoders
        .iter()
        .map(|te| {
            let e = &te.model.token_embedding;
            (e.dim(), e.weight.dtype())
        })
        .collect();
    let widths: Vec<usize> = encoders.iter().map(|(w, _)| *w).collect();
    let vectors = file
        .for_encoders(&widths)
        .with_context(|| label.to_string())?
        .into_iter()
        .zip(&encoders)
        .map(|(v, (_, dtype))| v.to_dtype(*dtype))
        .collect::<candle_core::Result<Vec<_>>>()?;
    crate::model::textual_inversion::add_embedding(sd, token, &vectors)
        .with_context(|| format!("{label}: token `{token}`"))?;
    eprintln!(
        "embedding: `{token}` stands for {} vector(s) from {}",
        file.vectors_per_token(),
        file.path.display()
    );
    Ok(())
}

/// Merges each `--lora` file into `sd` at `--lora-scale`, saying how many modules it changed.
fn merge_loras(sd: &mut StableDiffusion, args: &SampleArgs, device: &Device) -> anyhow::Result<()> {
    let naming = crate::adapter::kohya_naming(sd);
    for path in &args.loras {
        let file = load_kohya(path, device)?;
        let n = merge_kohya(sd, &naming, &file, args.lora_scale)?;
        eprintln!(
            "lora: merged {n} modules of {} (×{})",
            path.display(),
            args.lora_scale
        );
        // The embeddings it bundles, under their placeholders (as A1111 loads them with it).
        let label = format!("--lora {}", path.display());
        for e in crate::adapter::embedding_file::load_bundled(path, device)
            .with_context(|| label.clone())?
        {
            let token = e.default_token();
            add_embedding_file(sd, &e, &token, &label)?;
        }
    }
    Ok(())
}

/// The syntax `--prompt` and `--negative-prompt` are read in (`--prompt-syntax`, else kohya's
/// when one holds A1111's `(words:weight)`), checked against both.
fn prompt_syntax(args: &SampleArgs, prompt: &str) -> anyhow::Result<PromptSyntax> {
    let a1111 = [prompt, args.negative_prompt.as_str()]
        .iter()
        .any(|t| super::a1111_syntax::has_explicit_weight(t));
    let prompt_syntax = match (args.prompt_syntax, a1111) {
        (Some(s), _) => s,
        (None, true) => {
            eprintln!(
                "prompt weights: A1111's, as kohya sd-scripts reads them (the prompt holds \
                 `(words:weight)`; --prompt-syntax compel reads it as EveryDream2's compel)"
            );
            PromptSyntax::Kohya
        }
        (None, false) => PromptSyntax::Compel,
    };
    for (flag, text) in [
        ("--prompt", prompt),
        ("--negative-prompt", args.negative_prompt.as_str()),
    ] {
        super::prompts::check_syntax(prompt_syntax, text).map_err(|e| {
            let syntax = match prompt_syntax {
                PromptSyntax::Compel => "compel's weighting syntax, as EveryDream2",
                PromptSyntax::Kohya => "A1111's weighting syntax, as kohya sd-scripts",
            };
            anyhow::anyhow!("{flag} `{text}`: {e} ({syntax})")
        })?;
    }
    Ok(prompt_syntax)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbered_outputs_only_for_several_images() {
        assert_eq!(out_path(Path::new("d/x.png"), 0, 1), Path::new("d/x.png"));
        assert_eq!(out_path(Path::new("d/x.png"), 2, 3), Path::new("d/x-2.png"));
    }
}
