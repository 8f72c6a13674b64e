//! Command-line interface: the clap definitions and [`run`], which `main.rs` calls.
//!
//! Exit codes: 0 on success; 2 for a usage or config error (bad arguments, a `--model` that is
//! neither a folder nor a repo id, a model that is invalid or unsupported); 1 for anything else
//! (I/O, network, a model missing from the cache in offline mode).

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use std::io::IsTerminal;
use std::path::PathBuf;

use candle_core::Device;

use crate::config::{ConfigError, TrainPlan};
use crate::data::DataError;
use crate::inspect::{self, InspectError};
use crate::model::family::FamilyError;
use crate::model::source::{ModelSource, SourceError};
use crate::train::{self, summary, RunOptions};

#[derive(Debug, Parser)]
#[command(
    name = "sdtrain",
    version,
    about = "Stable Diffusion fine-tuner (SD1.x, SD2.x, SDXL) on Candle",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// `sdtrain --config train.json` is the same as `sdtrain train --config train.json`.
    #[command(flatten)]
    pub train: TrainArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train from a train.json (the default command).
    Train(TrainArgs),
    /// Show a model's family, prediction type, resolution, component sizes and the files sdtrain
    /// would load from it.
    Inspect(InspectArgs),
    /// Draw images from a model (optionally with LoRA/LoCon files merged in), with the samplers
    /// a run's samples use.
    Sample(crate::sample::command::SampleArgs),
}

#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// The run's train.json (EveryDream2 key names; see docs/config.md).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Override a train.json key, e.g. `--set lr=1e-5 --set max_epochs=3`. Repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Print the resolved plan and exit without training.
    #[arg(long)]
    pub dry_run: bool,
    /// Train on the CPU even when a GPU is available.
    #[arg(long, conflicts_with = "device")]
    pub cpu: bool,
    /// `cpu`, `cuda` or `cuda:N`: the device to train on, over train.json's `gpuid` (default:
    /// card `gpuid`, else the CPU when the machine has no CUDA card).
    #[arg(long, value_name = "cpu|cuda:N")]
    pub device: Option<crate::memory::DeviceRequest>,
}

#[derive(Debug, Args)]
pub struct InspectArgs {
    /// A diffusers pipeline folder, or a Hugging Face repo id `org/name[@revision]` (read from the
    /// hub cache; set HF_HUB_OFFLINE=1 to never use the network).
    #[arg(long, value_name = "HUB_ID[@REV]|FOLDER")]
    pub model: String,
    /// Prefer weight files of this variant (e.g. `fp16`) where the model has them.
    #[arg(long, value_name = "NAME")]
    pub variant: Option<String>,
    /// For a single-file `--model`: a diffusers folder whose configs and tokenizers describe it.
    #[arg(long, value_name = "FOLDER")]
    pub model_config: Option<PathBuf>,
    /// For a single-file `--model`: `epsilon` or `v_prediction`, overriding what is detected.
    #[arg(long, value_parser = crate::sample::command::parse_prediction)]
    pub prediction_type: Option<crate::model::family::PredictionType>,
}

/// A command line that names no command and no `--config`.
#[derive(Debug, thiserror::Error)]
#[error("nothing to do: give `--config train.json` (or a subcommand; see `sdtrain --help`)")]
pub struct NoCommand;

/// Runs a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Some(Command::Inspect(args)) => {
            let report = ModelSource::parse(&args.model)
                .map_err(InspectError::from)
                .and_then(|source| {
                    let single = crate::model::single_file::SingleFileOptions {
                        model_config: args.model_config.clone(),
                        prediction_type: args.prediction_type,
                    };
                    inspect::inspect_with(&source, args.variant.as_deref(), &single)
                })
                .with_context(|| format!("cannot inspect `{}`", args.model))?;
            print_stdout(&report)?;
            Ok(ExitCode::SUCCESS)
        }
        Some(Command::Sample(args)) => {
            crate::sample::command::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Some(Command::Train(args)) => run_train(&args),
        None => run_train(&cli.train),
    }
}

fn run_train(args: &TrainArgs) -> anyhow::Result<ExitCode> {
    let Some(config) = &args.config else {
        return Err(NoCommand.into());
    };
    let plan = TrainPlan::resolve(config, &args.set)?;
    if args.dry_run {
        print_stdout(&format_args!("{plan}"))?;
        // The state size and the memory plan need the model's headers; a model that is not
        // at hand only costs these lines.
        match train::state_estimate::estimate(&plan) {
            Ok(estimate) => {
                print_stdout(&estimate.state)?;
                match memory_plan(&plan, &estimate, device_request(args, &plan)) {
                    Ok(mem) => print_stdout(&mem)?,
                    Err(e) => print_stdout(&format_args!("{:<15}unknown: {e:#}\n", "memory plan"))?,
                }
            }
            Err(e) => print_stdout(&format_args!("{:<15}unknown: {e:#}\n", "optim. state"))?,
        }
        print_stdout(&"\n")?;
        return Ok(ExitCode::SUCCESS);
    }
    let device = crate::memory::open_device(device_request(args, &plan))?;
    let show_progress = std::io::stderr().is_terminal();
    let outcome = train::train(
        &plan,
        &RunOptions {
            device,
            show_progress,
        },
    )?;
    print_stdout(&summary::Summary(&outcome))?;
    Ok(ExitCode::SUCCESS)
}

/// The device the command line asks for, else train.json's `gpuid`.
fn device_request(args: &TrainArgs, plan: &TrainPlan) -> crate::memory::DeviceRequest {
    use crate::memory::DeviceRequest;
    match (args.cpu, args.device) {
        (true, _) => DeviceRequest::Cpu,
        (false, Some(d)) => d,
        (false, None) => DeviceRequest::Auto { gpuid: plan.gpuid },
    }
}

/// The memory plan of a `--dry-run`, for a CUDA card: `vram_limit_gb` if set, else the card
/// this machine has, else a 12 GiB card (the product's target).
fn memory_plan(
    plan: &TrainPlan,
    estimate: &train::state_estimate::ModelEstimate,
    request: crate::memory::DeviceRequest,
) -> anyhow::Result<train::memory_plan::MemoryPlan> {
    use crate::model::files::Component;
    const GIB: f64 = (1u64 << 30) as f64;
    let unet = estimate
        .layout
        .components
        .iter()
        .find(|c| c.component == Component::Unet)
        .context("the model has no UNet")?;
    let (text, origin) = unet.config_text()?;
    let cfg = crate::model::unet::UnetConfig::from_json(&text, &origin.display().to_string())?;
    // The card the run would use, else one of compute capability 8.0+ (bf16).
    let device = crate::memory::open_device(request)
        .ok()
        .filter(|d| d.is_cuda());
    let card_amp = device.as_ref().map_or(crate::precision::Amp::Bf16, |d| {
        crate::precision::Amp::default_for(d)
    });
    let crate::config::RunShape { resolution, amp } =
        plan.run_shape(estimate.layout.native_resolution, card_amp);
    let card = match plan.vram_limit_gb {
        Some(gb) => (gb * GIB, "vram_limit_gb".to_string()),
        None => device.as_ref().and_then(detected_card).unwrap_or((
            12.0 * GIB,
            "a 12 GiB card; set vram_limit_gb for another".to_string(),
        )),
    };
    Ok(train::memory_plan::plan_memory(
        plan,
        amp,
        &cfg,
        resolution,
        &estimate.census,
        Some(card),
    ))
}

/// The run's CUDA card's memory.
fn detected_card(device: &Device) -> Option<(f64, String)> {
    let usage = crate::memory::MemoryUsage::read(device).ok()??;
    let total = usage.device_total_bytes? as f64;
    Some((total, "the detected card".to_string()))
}

/// Writes `value` to stdout. A closed pipe (`sdtrain inspect … | head`) is not an error: like
/// ripgrep, stop quietly instead of panicking as `print!` would.
fn print_stdout(value: &impl std::fmt::Display) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match write!(out, "{value}").and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::Error::new(e).context("cannot write to stdout"))
        }
        Ok(()) | Err(_) => Ok(()),
    }
}

/// Whether a data error is the user's input (exit 2) rather than a failure while running (1).
fn data_error_is_usage(e: &DataError) -> bool {
    match e {
        DataError::RootMissing { .. }
        | DataError::RootNotAFolder { .. }
        | DataError::Multiply { .. }
        | DataError::ImageConfig { .. }
        | DataError::EmptyCaption { .. }
        | DataError::NoImages { .. }
        | DataError::NoUsableImages { .. } => true,
        DataError::ReadDir { .. }
        | DataError::ReadFile { .. }
        | DataError::WriteFile { .. }
        | DataError::Decode { .. }
        | DataError::InvalidSize { .. }
        | DataError::EmptyBatch
        | DataError::BatchShape { .. }
        | DataError::PixelBuffer { .. }
        | DataError::Tensor(_) => false,
    }
}

/// The exit code for an error from [`run`]: 2 for usage/config errors, 1 otherwise.
pub fn exit_code(err: &anyhow::Error) -> ExitCode {
    let usage = err.chain().any(|e| {
        e.downcast_ref::<InspectError>()
            .is_some_and(InspectError::is_usage)
            || e.downcast_ref::<ConfigError>()
                .is_some_and(ConfigError::is_usage)
            || e.downcast_ref::<SourceError>()
                .is_some_and(SourceError::is_usage)
            || e.downcast_ref::<FamilyError>()
                .is_some_and(FamilyError::is_usage)
            || e.downcast_ref::<DataError>()
                .is_some_and(data_error_is_usage)
            || e.is::<NoCommand>()
            || e.is::<crate::memory::DeviceError>()
            || e.is::<crate::train::run_dir::OutputDirError>()
    });
    if usage {
        ExitCode::from(2)
    } else {
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_valid() {
        Cli::command().debug_assert();
    }

    #[test]
    fn bad_spec_is_a_usage_error() {
        let cli =
            Cli::try_parse_from(["sdtrain", "inspect", "--model", "./no/such/folder"]).unwrap();
        let err = run(cli).unwrap_err();
        assert_eq!(exit_code(&err), ExitCode::from(2));
        assert!(format!("{err:#}").contains("neither an existing folder"));
    }
}
