//! The `sdtrain` binary: parses the command line and hands it to [`sdtrain::cli::run`]; all logic
//! lives in the library so tests can reach it.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    pin_thread_count();
    // Usage errors exit with code 2 from clap itself.
    let cli = sdtrain::cli::Cli::parse();
    match sdtrain::cli::run(cli) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            sdtrain::cli::exit_code(&err)
        }
    }
}

/// Sets `RAYON_NUM_THREADS` to the count candle would pick, where the user has not set it. Unset,
/// candle's CPU matmul asks for the physical core count on every call, which reads and parses
/// /proc/cpuinfo each time (thousands of reads in a short sampling run, measured with strace).
/// Called first thing, while the process has one thread.
fn pin_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}
