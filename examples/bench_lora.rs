//! LoRA step benchmark: one forward + backward of the UNet with the real SD1.5 config (random
//! weights, frozen base as plain tensors) and rank-4 LoRA on kohya's targets (192 modules), MSE
//! loss against a random target, batch 1, on the CPU.
//!
//! ```text
//! cargo run --release --example bench_lora -- [--latent 32] [--steps 3] [--dtype f32] [--no-frozen-op]
//! ```
//! `--no-frozen-op` runs the same step with candle's plain matmul/conv2d on the frozen layers
//! (which compute and store weight gradients): the "before" of `nn::frozen`. Prints each step's
//! time, the median, the GradStore size and the process's peak RSS (VmHWM).

#[path = "support/bench.rs"]
mod bench;

use sdtrain::model::reference_configs::SD15_UNET;
use std::time::Instant;

use anyhow::{Context, Result};
use bench::{arg, peak_memory_gib};
use candle_core::{DType, Device, Tensor};
use sdtrain::adapter::{adapter_vars, attach_unet, AdapterMode, AdapterSpec};
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
    let frozen_op = !args.iter().any(|a| a == "--no-frozen-op");
    sdtrain::nn::set_frozen_ops_enabled(frozen_op);
    let device = Device::Cpu;
    let cfg = UnetConfig::from_json(SD15_UNET, "SD1.5 unet config")?;
    let w = Weights::random(0, "unet", dtype, &device, false);
    let mut unet = UNet2DConditionModel::new(&w, &cfg)?;
    let spec = AdapterSpec {
        mode: AdapterMode::Lora,
        rank: 4,
        alpha: 4.0,
        conv_rank: 4,
        conv_alpha: 4.0,
        dropout: 0.0,
        factor: -1,
        seed: 0,
    };
    let modules = attach_unet(&mut unet, &spec)?;
    let vars = adapter_vars(&modules);
    let n: usize = vars.iter().map(|v| v.elem_count()).sum();
    println!(
        "SD1.5 UNet, frozen {dtype:?} base, LoRA rank 4: {} modules, {n} trainable parameters, \
         latent {latent}x{latent}, batch 1, frozen op {}",
        modules.len(),
        if frozen_op { "on" } else { "off" }
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
        let got = vars
            .iter()
            .filter(|v| grads.get(v.as_tensor()).is_some())
            .count();
        let entries = grads.get_ids().count();
        let stored: usize = grads
            .get_ids()
            .filter_map(|id| grads.get_id(*id))
            .map(|g| g.elem_count() * g.dtype().size_in_bytes())
            .sum();
        let secs = start.elapsed().as_secs_f64();
        println!(
            "step {step}: {secs:.2} s, loss {:.4}, {got}/{} adapter Vars with grads, \
             GradStore {entries} entries, {:.1} MiB",
            loss.to_scalar::<f32>()?,
            vars.len(),
            stored as f64 / (1024.0 * 1024.0)
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
