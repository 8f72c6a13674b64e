//! Helpers shared by the benchmark examples: `--name value` arguments and peak memory.

/// The value after `name` in `args`, or `default`.
pub fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

/// The peak memory in GiB: the process's peak RSS on the CPU, the CUDA pool's high-water mark on
/// a CUDA device (see `sdtrain::memory`).
pub fn peak_memory_gib(device: &candle_core::Device) -> Option<f64> {
    sdtrain::memory::MemoryUsage::read(device)
        .ok()
        .flatten()
        .map(|m| m.peak_gib())
}
