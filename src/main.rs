//! The `sdtrain` binary: parses the command line and hands it to [`sdtrain::cli::run`]; all logic
//! lives in the library so tests can reach it.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // Usage errors exit with code 2 from clap itself.
    let cli = sdtrain::cli::Cli::parse();
    match sdtrain::cli::run(cli) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {}", sdtrain::cli::error_text(&err));
            sdtrain::cli::exit_code(&err)
        }
    }
}
