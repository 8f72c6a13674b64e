//! `sdtrain extract-lora`: a kohya LoRA (or LoCon) file from the difference between a base model
//! and a model fine-tuned from it ([`super::extract`]), with kohya's
//! `extract_lora_from_models.py` flags and defaults.

use std::path::PathBuf;

use anyhow::Context;
use candle_core::DType;
use clap::Args;

use super::extract::{extract, ExtractOptions};
use super::kohya_file::save_kohya;
use super::kohya_meta::{KohyaBase, KohyaMetadata};
use crate::model::layout::ModelLayout;
use crate::model::source::ModelSource;
use crate::model::unet::UnetConfig;
use crate::precision::parse_save_dtype;

#[derive(Debug, Clone, Args)]
pub struct ExtractArgs {
    /// The model the fine-tune started from: a hub id `org/name[@revision]`, a diffusers folder
    /// or a single-file checkpoint (kohya's `--model_org`).
    #[arg(long, value_name = "HUB_ID[@REV]|FOLDER|FILE")]
    pub base: String,
    /// The fine-tuned model, in any of the same forms (kohya's `--model_tuned`): e.g. a full
    /// fine-tune's `final/` folder or single file.
    #[arg(long, value_name = "HUB_ID[@REV]|FOLDER|FILE")]
    pub tuned: String,
    /// The LoRA file to write (kohya's `--save_to`).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Rank of the Linear and 1×1 conv modules (kohya's `--dim`).
    #[arg(long, default_value_t = 4)]
    pub rank: usize,
    /// Rank of the 3×3 convs, which makes the file a LoCon (kohya's `--conv_dim`; without it the
    /// convs are left out).
    #[arg(long)]
    pub conv_rank: Option<usize>,
    /// Each factor is clamped to this quantile of its values (kohya's `--clamp_quantile`).
    #[arg(long, default_value_t = 0.99)]
    pub clamp_quantile: f64,
    /// The text encoders are extracted only when one of their weights moved by more than this
    /// (kohya's `--min_diff`).
    #[arg(long, default_value_t = 0.01)]
    pub min_diff: f64,
    /// `fp32` (kohya's default), `fp16` or `bf16`.
    #[arg(long, default_value = "fp32", value_parser = parse_save_dtype)]
    pub save_dtype: DType,
}

/// Runs the command; returns the file written.
pub fn run(args: &ExtractArgs) -> anyhow::Result<PathBuf> {
    let opts = check(args)?;
    let base = open(&args.base).with_context(|| format!("--base `{}`", args.base))?;
    let tuned = open(&args.tuned).with_context(|| format!("--tuned `{}`", args.tuned))?;
    let naming = super::kohya_naming_for(base.family, &unet_config(&base)?);
    let started = std::time::Instant::now();
    let mut last_tenth = usize::MAX;
    let mut progress = |name: &str, i: usize, total: usize| {
        let tenth = i * 10 / total.max(1);
        if tenth != last_tenth {
            last_tenth = tenth;
            eprintln!(
                "extract: {i}/{total} modules ({name}), {:.0} s",
                started.elapsed().as_secs_f64()
            );
        }
    };
    let extraction = extract(&base, &tuned, &naming, &opts, &mut progress)?;
    if extraction.modules.is_empty() {
        anyhow::bail!("no module to extract: the models have none of kohya's LoRA targets");
    }
    eprintln!(
        "text encoders: largest change {:.3e} {} --min-diff {}: {}",
        extraction.text_encoder_change,
        if extraction.text_encoders_extracted {
            ">"
        } else {
            "≤"
        },
        opts.min_diff,
        if extraction.text_encoders_extracted {
            "extracted"
        } else {
            "left out (the UNet alone)"
        }
    );
    let metadata = metadata(args, &base)?;
    save_kohya(&args.out, &extraction.modules, &metadata, args.save_dtype)?;
    eprintln!(
        "wrote {} ({} modules, rank {}{}) in {:.0} s",
        args.out.display(),
        extraction.modules.len(),
        opts.rank,
        opts.conv_rank
            .map_or(String::new(), |r| format!(", 3×3 conv rank {r}")),
        started.elapsed().as_secs_f64()
    );
    Ok(args.out.clone())
}

fn check(args: &ExtractArgs) -> anyhow::Result<ExtractOptions> {
    if args.rank == 0 || args.conv_rank == Some(0) {
        anyhow::bail!("--rank and --conv-rank must be at least 1");
    }
    if !(args.clamp_quantile > 0.0 && args.clamp_quantile <= 1.0) {
        anyhow::bail!(
            "--clamp-quantile must be in (0, 1] (got {})",
            args.clamp_quantile
        );
    }
    if !(args.min_diff.is_finite() && args.min_diff >= 0.0) {
        anyhow::bail!("--min-diff must be 0 or more (got {})", args.min_diff);
    }
    Ok(ExtractOptions {
        rank: args.rank,
        conv_rank: args.conv_rank,
        clamp_quantile: args.clamp_quantile,
        min_diff: args.min_diff,
    })
}

fn open(model: &str) -> anyhow::Result<ModelLayout> {
    let dir = ModelSource::parse(model)?.resolve()?;
    dir.noting_copy(ModelLayout::read(&dir.path, None))
}

fn unet_config(layout: &ModelLayout) -> anyhow::Result<UnetConfig> {
    let files = layout
        .component(crate::model::files::Component::Unet)
        .ok_or_else(|| anyhow::anyhow!("{} has no UNet", layout.root.display()))?;
    let (text, origin) = files.config_text()?;
    Ok(UnetConfig::from_json(&text, &origin.display().to_string())?)
}

/// kohya's extraction header: the minimum keys loaders read and ModelSpec's, titled by the
/// file's name.
fn metadata(args: &ExtractArgs, base: &ModelLayout) -> anyhow::Result<KohyaMetadata> {
    let version = base.family.kohya_base_model_version(base.prediction_type);
    let kohya_base = KohyaBase::from_ss_name(version)
        .ok_or_else(|| anyhow::anyhow!("no kohya base model version for {version}"))?;
    let network_args = match args.conv_rank {
        Some(r) => vec![
            ("conv_dim".to_string(), r.to_string()),
            ("conv_alpha".to_string(), crate::py_json::py_float(r as f64)),
        ],
        None => Vec::new(),
    };
    let title = args
        .out
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    let side = base.native_resolution as u32;
    let mut meta =
        KohyaMetadata::tool_written(kohya_base, args.rank, args.rank as f64, title, (side, side));
    meta.network_args = network_args;
    Ok(meta)
}
