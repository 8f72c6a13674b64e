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
use std::path::{Path, PathBuf};

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
    /// would load from it; or an adapter file's type, modules, ranks and training metadata.
    Inspect(InspectArgs),
    /// Draw images from a model (optionally with LoRA/LoCon files merged in), with the samplers
    /// a run's samples use.
    Sample(Box<crate::sample::command::SampleArgs>),
    /// Extract a kohya LoRA (or LoCon) from the difference between a base model and a model
    /// fine-tuned from it, as kohya sd-scripts' extract_lora_from_models.py does.
    ExtractLora(Box<crate::adapter::extract_command::ExtractArgs>),
    /// Resize a LoRA/LoCon file to a lower rank, fixed or chosen per module from its singular
    /// values, as kohya sd-scripts' resize_lora.py does.
    ResizeLora(Box<crate::adapter::resize_command::ResizeArgs>),
    /// Merge LoRA/LyCORIS files into a model and save it as a single file or a diffusers
    /// folder, as kohya sd-scripts' merge_lora.py --sd_model does.
    MergeLora(Box<crate::adapter::merge_command::MergeArgs>),
    /// Convert a model between a diffusers folder and the single file A1111 and ComfyUI load,
    /// optionally in another dtype or with another VAE baked in.
    Convert(Box<crate::model::convert_command::ConvertArgs>),
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
    /// Data parallel: one rank per device, e.g. `0,1,2,3` (cards) or `cpu,cpu`; over
    /// train.json's `devices`. See docs/MULTI_GPU.md.
    #[arg(long, value_name = "LIST", conflicts_with_all = ["device", "cpu"])]
    pub devices: Option<String>,
    /// Data parallel: how long a rank waits for the others at each exchange before the run
    /// ends on every rank (seconds; rank 0 may be sampling or saving meanwhile).
    #[arg(long, value_name = "SECS", default_value_t = 1800)]
    pub dist_timeout: u64,
}

#[derive(Debug, Args)]
pub struct InspectArgs {
    /// A diffusers pipeline folder, a Hugging Face repo id `org/name[@revision]` (read from the
    /// hub cache; set HF_HUB_OFFLINE=1 to never use the network), a single-file checkpoint, or
    /// an adapter file (kohya's, LyCORIS's or diffusers' LoRA): its type, modules, ranks and
    /// what its header records of the training.
    #[arg(long, value_name = "HUB_ID[@REV]|FOLDER|FILE")]
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
            let path = Path::new(&args.model);
            if path.is_file() && crate::inspect_adapter::is_adapter_file(path) {
                let report = crate::inspect_adapter::inspect_adapter(path)
                    .with_context(|| format!("cannot inspect `{}`", args.model))?;
                print_stdout(&report)?;
                return Ok(ExitCode::SUCCESS);
            }
            if path.is_file() && crate::inspect_adapter::is_embedding_file(path) {
                let report = crate::inspect_adapter::inspect_embedding(path)
                    .with_context(|| format!("cannot inspect `{}`", args.model))?;
                print_stdout(&report)?;
                return Ok(ExitCode::SUCCESS);
            }
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
        Some(Command::ExtractLora(args)) => {
            crate::adapter::extract_command::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Some(Command::ResizeLora(args)) => {
            crate::adapter::resize_command::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Some(Command::MergeLora(args)) => {
            crate::adapter::merge_command::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Some(Command::Convert(args)) => {
            crate::model::convert_command::run(&args)?;
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
        let devices = devices_requested(args, &plan)?;
        if devices.len() > 1 {
            let names: Vec<String> = devices
                .iter()
                .map(|d| crate::config::devices_plan::device_name(*d))
                .collect();
            print_stdout(&format_args!(
                "{:<15}{} ranks ({}): each holds the whole model and optimizer state, the memory \
                 plan below is per card; each step's {} micro-batches are shared out among them\n",
                "data parallel",
                devices.len(),
                names.join(", "),
                plan.grad_accum
            ))?;
        }
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
    let show_progress = std::io::stderr().is_terminal();
    let timeout = std::time::Duration::from_secs(args.dist_timeout.max(1));
    if let Some(env) = crate::dist::DistEnv::from_env()? {
        return run_rank_process(args, &plan, &env, timeout, show_progress);
    }
    let devices = devices_requested(args, &plan)?;
    let outcome = if devices.len() > 1 {
        let opened = devices
            .into_iter()
            .map(crate::memory::open_device)
            .collect::<Result<Vec<_>, _>>()?;
        train::data_parallel::train_ranks(&plan, &opened, show_progress, timeout)?
    } else {
        let request = devices.first().copied();
        let device = crate::memory::open_device(request.unwrap_or(device_request(args, &plan)))?;
        train::train(
            &plan,
            &RunOptions {
                device,
                show_progress,
            },
        )?
    };
    print_stdout(&summary::Summary(&outcome))?;
    Ok(ExitCode::SUCCESS)
}

/// The data-parallel devices: `--devices`, else train.json's `devices` (empty: one device).
fn devices_requested(
    args: &TrainArgs,
    plan: &TrainPlan,
) -> anyhow::Result<Vec<crate::memory::DeviceRequest>> {
    use crate::config::devices_plan::parse_device_list;
    match &args.devices {
        Some(list) => {
            parse_device_list(list).map_err(|why| anyhow::anyhow!("--devices {list:?}: {why}"))
        }
        None if plan.devices.is_empty() => Ok(Vec::new()),
        None => parse_device_list(&plan.devices.join(","))
            .map_err(|why| anyhow::anyhow!("devices: {why}")),
    }
}

/// One process of a multi-process run (torchrun's environment is set): its device is
/// `--device`/`--cpu`, else entry `LOCAL_RANK` of the devices, else card `LOCAL_RANK`. Rank 0
/// alone prints the summary.
fn run_rank_process(
    args: &TrainArgs,
    plan: &TrainPlan,
    env: &crate::dist::DistEnv,
    timeout: std::time::Duration,
    show_progress: bool,
) -> anyhow::Result<ExitCode> {
    use crate::memory::DeviceRequest;
    let listed = devices_requested(args, plan)?;
    let request = match (args.cpu, args.device) {
        (true, _) => DeviceRequest::Cpu,
        (false, Some(d)) => d,
        (false, None) if listed.is_empty() => DeviceRequest::Cuda(env.local_rank),
        (false, None) => *listed.get(env.local_rank).ok_or_else(|| {
            anyhow::anyhow!(
                "LOCAL_RANK {} but only {} devices are listed",
                env.local_rank,
                listed.len()
            )
        })?,
    };
    let device = crate::memory::open_device(request)?;
    let mut link = crate::dist::Tcp::join(env, timeout)?;
    // Each process read its own train.json: the ranks agree on it (and on a drawn seed) first.
    let plan = train::rank_agreement::agree_plan(plan, &mut link)?;
    if env.rank != 0 {
        // Rank 0 speaks for the run, as with `--devices`: this rank's setup lines would repeat its.
        crate::console::say(format_args!(
            "rank {} of {}: joined the run at {}; rank 0 reports its progress",
            env.rank,
            env.world_size,
            env.master()
        ));
        crate::console::set_quiet(true);
    }
    let opts = RunOptions {
        device,
        show_progress: show_progress && env.rank == 0,
    };
    let outcome = train::data_parallel::train_rank(&plan, &opts, Box::new(link))?;
    if env.rank == 0 {
        print_stdout(&summary::Summary(&outcome))?;
    }
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
    let native = estimate.layout.native_resolution;
    let amp = plan.run_shape(native, card_amp).amp;
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
        native,
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
        | DataError::Text { .. }
        | DataError::EmptyCaption { .. }
        | DataError::NoImages { .. }
        | DataError::NoKohyaImages { .. }
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
            || e.downcast_ref::<crate::model::pipeline::PipelineError>()
                .is_some_and(crate::model::pipeline::PipelineError::is_usage)
            || e.downcast_ref::<DataError>()
                .is_some_and(data_error_is_usage)
            || e.downcast_ref::<crate::model::vae_source::VaeSourceError>()
                .is_some_and(crate::model::vae_source::VaeSourceError::is_usage)
            || e.is::<crate::adapter::block_weights::BlockError>()
            || matches!(
                e.downcast_ref::<crate::adapter::AttachError>(),
                Some(crate::adapter::AttachError::FilterUnmatched { .. })
            )
            || e.is::<crate::train::weighted_captions::CaptionWeightError>()
            || e.downcast_ref::<crate::adapter::merge::MergeError>()
                .is_some_and(|m| !matches!(m, crate::adapter::merge::MergeError::Candle(_)))
            || e.downcast_ref::<crate::diffusion::objective::ObjectiveError>()
                .is_some_and(crate::diffusion::objective::ObjectiveError::is_usage)
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
