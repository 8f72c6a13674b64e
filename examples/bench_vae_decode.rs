//! The VAE decode's memory at a given image size: what a sampling round adds to a run once its
//! UNet loop ends (`sample_prompts`), and what the memory plan's decode term is fitted on.
//!
//! ```text
//! cargo run --release --example bench_vae_decode -- --model DIR --res 512 [--dtype f32|bf16|f16] \
//!     [--device cpu|cuda] [--repeat 1]
//! ```
//! `DIR` is a diffusers pipeline folder; its VAE is loaded as a sampling round loads it
//! (`model::pipeline::load_vae`). The weights' values do not change the memory, so the sparse
//! full-size models of `tests/common/full_size.rs` (zeros) serve. A batch-1 latent of the image
//! size is decoded `--repeat` times.
//!
//! Prints ONE JSON line: the VAE's weights, the decode's peak above what was held before it (on
//! the CPU the host heap, by a counting allocator; on CUDA the pool's high-water mark less the
//! memory in use before), that peak per output pixel per byte of the dtype (the plan's ν), and
//! the median decode time.

#[path = "support/bench.rs"]
#[allow(dead_code)]
mod bench;
#[path = "support/counting_alloc.rs"]
#[allow(dead_code)] // the peak tracing is bench_step's
mod counting_alloc;

#[global_allocator]
static ALLOC: counting_alloc::CountingAlloc = counting_alloc::CountingAlloc;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use bench::arg;
use candle_core::{DType, Device, Tensor};
use sdtrain::memory::MemoryUsage;
use sdtrain::model::files::Component;
use sdtrain::model::layout::ModelLayout;
use sdtrain::model::pipeline::{load_vae, LoadOptions};
use serde_json::json;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let model = PathBuf::from(arg(&args, "--model", ""));
    if model.as_os_str().is_empty() {
        bail!("--model DIR: a diffusers pipeline folder");
    }
    let res: usize = arg(&args, "--res", "512").parse().context("--res")?;
    let repeat: usize = arg(&args, "--repeat", "1").parse().context("--repeat")?;
    let dtype = match arg(&args, "--dtype", "f32").as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => bail!("--dtype {other}: use f32, bf16 or f16"),
    };
    let device = match arg(&args, "--device", "cpu").as_str() {
        "cpu" => Device::Cpu,
        "cuda" => Device::new_cuda(0)?,
        other => bail!("--device {other}: use cpu or cuda"),
    };
    let layout = ModelLayout::read(&model, None)?;
    let files = layout
        .component(Component::Vae)
        .context("the model has no VAE")?;
    let opts = LoadOptions {
        dtype,
        trained_dtype: DType::F32,
        vae_dtype: None,
        device: device.clone(),
        train_unet: false,
        train_text_encoders: false,
        fp8_unet: false,
        fp8_text_encoders: false,
    };
    let heap_before_load = counting_alloc::live_bytes();
    let vae = load_vae(files, &opts)?;
    let weights = vae_weight_bytes(&device, heap_before_load)?;
    let latent = res / 8;
    let z = Tensor::randn(0f32, 1f32, (1, 4, latent, latent), &device)?.to_dtype(dtype)?;
    device.synchronize()?;
    let before = held(&device)?;
    counting_alloc::reset_peak();
    let mut times = Vec::with_capacity(repeat);
    for _ in 0..repeat.max(1) {
        let start = Instant::now();
        let image = vae.image_from_latents(&z)?;
        device.synchronize()?;
        times.push(start.elapsed().as_secs_f64());
        drop(image);
    }
    let peak = peak_since(&device)?.saturating_sub(before);
    times.sort_by(f64::total_cmp);
    let bytes = dtype.size_in_bytes() as f64;
    let pixels = (res * res) as f64;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "{}",
        json!({
            "res": res,
            "dtype": format!("{dtype:?}").to_lowercase(),
            "device": if device.is_cuda() { "cuda" } else { "cpu" },
            "vae_weights_mib": mib(weights),
            "decode_peak_mib": mib(peak),
            "nu": peak as f64 / (pixels * bytes),
            "median_s": times[times.len() / 2],
        })
    );
    Ok(())
}

/// The VAE's weight bytes: the heap it took on the CPU, the pool in use on CUDA.
fn vae_weight_bytes(device: &Device, heap_before: usize) -> Result<u64> {
    match device {
        Device::Cpu => Ok((counting_alloc::live_bytes() - heap_before) as u64),
        _ => held(device),
    }
}

/// Bytes held now: the host heap on the CPU, the CUDA pool's in-use memory.
fn held(device: &Device) -> Result<u64> {
    match device {
        Device::Cpu => Ok(counting_alloc::live_bytes() as u64),
        _ => Ok(MemoryUsage::read(device)?.map_or(0, |m| m.in_use_bytes)),
    }
}

/// The high-water mark since `reset_peak` on the CPU; since the process started on CUDA.
fn peak_since(device: &Device) -> Result<u64> {
    match device {
        Device::Cpu => Ok(counting_alloc::peak_bytes() as u64),
        _ => Ok(MemoryUsage::read(device)?.map_or(0, |m| m.peak_bytes)),
    }
}
