//! Baseline benchmark: one forward + backward of a UNet with the real SD1.5 config (random
//! weights, f32, batch 1, MSE loss against a random target), every weight trainable.
//!
//! ```text
//! cargo run --release --example bench_unet -- [--latent 32] [--steps 3] [--dtype f32] [--cuda]
//! ```
//! Prints the time of each step, the median, and the process's peak RSS (VmHWM) — on CUDA, the
//! device memory in use after the steps. Figures go to docs/BENCHMARKS.md.

#[path = "support/bench.rs"]
mod bench;

use sdtrain::model::reference_configs::SD15_UNET;
use std::time::Instant;

use anyhow::{Context, Result};
use bench::{arg, peak_memory_gib};
use candle_core::{DType, Device, Tensor};
use sdtrain::model::unet::{UNet2DConditionModel, UnetConfig};
use sdtrain::model::weights::Weights;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let latent: usize = arg(&args, "--latent", "32").parse().context("--latent")?;
    let steps: usize = arg(&args, "--steps", "3").parse().context("--steps")?;
    let dtype = match arg(&args, "--dtype", "f32").as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => anyhow::bail!("--dtype {other}: use f32, bf16 or f16"),
    };
    let device = if args.iter().any(|a| a == "--cuda") {
        Device::new_cuda(0)?
    } else {
        Device::Cpu
    };
    let cfg = UnetConfig::from_json(SD15_UNET, "SD1.5 unet config")?;
    let w = Weights::random(0, "unet", dtype, &device, true);
    let unet = UNet2DConditionModel::new(&w, &cfg)?;
    let params = w.params();
    let n: usize = params.iter().map(|(_, v)| v.elem_count()).sum();
    println!(
        "SD1.5 UNet: {n} parameters ({:.1}M), {dtype:?}, latent {latent}x{latent}, batch 1",
        n as f64 / 1e6
    );

    let x = Tensor::randn(0f32, 1.0, (1, 4, latent, latent), &device)?.to_dtype(dtype)?;
    let target = Tensor::randn(0f32, 1.0, (1, 4, latent, latent), &device)?;
    let ctx = Tensor::randn(0f32, 1.0, (1, 77, 768), &device)?.to_dtype(dtype)?;
    let t = Tensor::new(&[500f32], &device)?;
    let mut times = Vec::new();
    for step in 0..steps {
        let start = Instant::now();
        let out = unet.forward(&x, &t, &ctx, None)?.to_dtype(DType::F32)?;
        let loss = (out - &target)?.sqr()?.mean_all()?;
        let grads = loss.backward()?;
        let got = params
            .iter()
            .filter(|(_, v)| grads.get(v.as_tensor()).is_some())
            .count();
        device.synchronize()?;
        let secs = start.elapsed().as_secs_f64();
        println!(
            "step {step}: {secs:.2} s, loss {:.4}, {got}/{} params with grads",
            loss.to_scalar::<f32>()?,
            params.len()
        );
        times.push(secs);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    println!("median step: {:.2} s", times[times.len() / 2]);
    if let Some(peak) = peak_memory_gib(&device) {
        println!("peak memory: {peak:.2} GiB");
    }
    Ok(())
}
