//! Command-line interface: the clap definitions and [`run`], which `main.rs` calls.
//!
//! Exit codes: 0 on success; 2 for a usage or config error (bad arguments, a `--model` that is
//! neither a folder nor a repo id, a model that is invalid or unsupported); 1 for anything else
//! (I/O, network, a model missing from the cache in offline mode).

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use crate::inspect::{self, InspectError};
use crate::model::source::ModelSource;

#[derive(Debug, Parser)]
#[command(
    name = "sdtrain",
    version,
    about = "Stable Diffusion fine-tuner (SD1.x, SD2.x, SDXL) on Candle"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show a model's family, prediction type, resolution, component sizes and the files sdtrain
    /// would load from it.
    Inspect(InspectArgs),
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
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Inspect(args) => {
            let report = ModelSource::parse(&args.model)
                .map_err(InspectError::from)
                .and_then(|source| inspect::inspect(&source, args.variant.as_deref()))
                .with_context(|| format!("cannot inspect `{}`", args.model))?;
            print_stdout(&report)?;
            Ok(ExitCode::SUCCESS)
        }
    }
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

/// The exit code for an error from [`run`]: 2 for usage/config errors, 1 otherwise.
pub fn exit_code(err: &anyhow::Error) -> ExitCode {
    let usage = err
        .chain()
        .find_map(|e| e.downcast_ref::<InspectError>())
        .is_some_and(InspectError::is_usage);
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
