//! Full-size SD1.5, SD2.1 and SDXL pipelines without their weights, for `--dry-run`: the real
//! config.json and safetensors headers with sparse data (examples/support/full_size.rs).

use std::path::{Path, PathBuf};

#[path = "../../examples/support/full_size.rs"]
mod imp;

/// Writes the `family` (`sd15`, `sd21`, `sdxl`) pipeline into `dir` and returns it.
pub fn full_size_model(family: &str, dir: &Path) -> PathBuf {
    imp::full_size_model(&super::repo_root(), family, dir, imp::Fill::Sparse).unwrap()
}
