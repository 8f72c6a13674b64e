//! A full-size SD1.5, SD2.1 or SDXL pipeline with random bf16 weights, from the real configs
//! and shapes in tests/fixtures/full-size/ (no torch, no network), to rehearse training on a card
//! (scripts/gpu-vram-rehearsal).
//!
//! ```text
//! cargo run --release --example make_random_model -- sdxl OUT_DIR [--seed 1]
//! ```
//! Run from the repository root. Norm weights are 1, biases 0, other weights `N(0, 1/fan_in)`.

#[path = "support/bench.rs"]
#[allow(dead_code)]
mod bench;
#[path = "support/full_size.rs"]
#[allow(dead_code)]
mod full_size;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(family), Some(out)) = (args.first(), args.get(1)) else {
        eprintln!("usage: make_random_model sd15|sd21|sdxl OUT_DIR [--seed N]");
        return ExitCode::from(2);
    };
    let seed = match bench::arg(&args, "--seed", "1").parse() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("--seed: {e}");
            return ExitCode::from(2);
        }
    };
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let fill = full_size::Fill::RandomBf16(seed);
    match full_size::full_size_model(&root, family, std::path::Path::new(out), fill) {
        Ok(dir) => {
            println!("wrote {}", dir.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("make_random_model {family}: {e}");
            ExitCode::FAILURE
        }
    }
}
