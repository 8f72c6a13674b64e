//! The memory plan `--dry-run` prints: the expected peak device memory of a run, by term, and
//! whether it fits the card.
//!
//! - weights, gradients and optimizer state are exact, from the model's safetensors headers and
//!   the plan (frozen weights in the compute dtype, trained ones as f32 masters, f32 gradients,
//!   the optimizer's own state formula; a second gradient buffer while micro-batches accumulate);
//! - frozen weights leave out what a cache releases: the VAE with `cache_latents`, the text
//!   encoders when their outputs are cached;
//! - activations are `batch · (largest bucket's pixels / 64) · bytes · κ · width(UNet)` (a
//!   square bucket: `(resolution/8)²`). `width` sums, over the
//!   UNet's levels, channels/4^level × blocks × (1 + 3·transformer depth), so it follows the
//!   architecture (SD1.5: 11300, SDXL: 19600). κ, the elements kept per unit of width, was fitted
//!   on measured peaks of SD1.5 steps (docs/BENCHMARKS.md, "Memory plan"), per mode and
//!   checkpointing; SDXL and other shapes are extrapolated through `width`;
//! - workspace: the CUDA context, cuBLAS' workspace and the allocator's slack;
//! - an EMA kept on the device (`ema_device: "cuda"`) is an f32 copy of the trained weights.

use std::fmt;

use crate::config::{TrainMode, TrainPlan};
use crate::model::unet::config::BlockKind;
use crate::model::unet::UnetConfig;
use crate::precision::Amp;

const GIB: f64 = (1u64 << 30) as f64;

/// Elements kept for backward per unit of UNet width per latent pixel at batch 1, fitted on
/// SD1.5 (f32, batch 1, latents 32² and 64²): LoRA and full, checkpointing off and on.
fn kappa(mode: TrainMode, checkpointing: bool) -> f64 {
    match (mode == TrainMode::Full, checkpointing) {
        (false, false) => 26.4,
        (false, true) => 4.87,
        (true, false) => 16.7,
        (true, true) => 3.4,
    }
}

/// The architecture's activation width (module header).
pub fn unet_width(cfg: &UnetConfig) -> f64 {
    cfg.block_out_channels
        .iter()
        .zip(&cfg.down_blocks)
        .enumerate()
        .map(|(level, (&c, b))| {
            let depth = match b.kind {
                BlockKind::CrossAttn => b.transformer_layers as f64,
                BlockKind::Plain => 0.0,
            };
            c as f64 / 4f64.powi(level as i32) * (2 * b.layers + 1) as f64 * (1.0 + 3.0 * depth)
        })
        .sum()
}

/// Element counts the plan needs, from the headers.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Census {
    pub unet: u64,
    pub text_encoders: u64,
    pub vae: u64,
    /// Trained parameters (all groups) and their optimizer state in bytes.
    pub trained: u64,
    pub state_bytes: u64,
}

/// The expected peak, by term, in bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    pub weights: f64,
    pub gradients: f64,
    pub optimizer: f64,
    pub activations: f64,
    pub workspace: f64,
    /// The EMA copy on the device (0 on the host or off).
    pub ema: f64,
    /// What the activation term assumed: `batch 1 at 512 px, bf16, checkpointing off`.
    pub assumptions: String,
    /// The card checked against, in bytes, and where that figure came from.
    pub card: Option<(f64, String)>,
    /// The rung to take when it does not fit.
    pub rung: Option<String>,
}

impl MemoryPlan {
    pub fn total(&self) -> f64 {
        self.weights
            + self.gradients
            + self.optimizer
            + self.activations
            + self.workspace
            + self.ema
    }
}

/// The plan for `plan` on a CUDA card computing in `amp`, with the UNet `cfg` and the model's
/// `census`; `card` is the memory to fit (`vram_limit_gb` or the card's) and its source.
pub fn plan_memory(
    plan: &TrainPlan,
    amp: Amp,
    cfg: &UnetConfig,
    resolution: usize,
    census: &Census,
    card: Option<(f64, String)>,
) -> MemoryPlan {
    let compute = if amp == Amp::Off { 4.0 } else { 2.0 };
    let vae_bytes = if amp == Amp::Bf16 { 2.0 } else { 4.0 };
    let frozen_unet = if plan.mode == TrainMode::Full {
        0
    } else {
        census.unet
    };
    let trained_te = plan.mode == TrainMode::Full && plan.train_text_encoder;
    let d = &plan.data;
    let te_cached = d.text_cache.is_on();
    let frozen_te = if trained_te || te_cached {
        0
    } else {
        census.text_encoders
    };
    let vae = if d.cache_latents == crate::config::CacheLatents::Off {
        census.vae
    } else {
        0
    };
    let weights = compute * (frozen_unet + frozen_te) as f64
        + vae_bytes * vae as f64
        + 4.0 * census.trained as f64;
    // While micro-batches accumulate, the sum and the new micro-batch's gradients coexist.
    let grad_buffers = if plan.grad_accum > 1 { 2.0 } else { 1.0 };
    let gradients = grad_buffers * 4.0 * census.trained as f64;
    let latent_px = largest_bucket_pixels(plan, resolution) as f64 / 64.0;
    let ck = plan.precision.gradient_checkpointing;
    let activations =
        plan.batch_size as f64 * latent_px * compute * kappa(plan.mode, ck) * unet_width(cfg);
    let workspace = 0.6 * GIB + 0.05 * activations;
    let mut out = MemoryPlan {
        weights,
        gradients,
        optimizer: census.state_bytes as f64,
        activations,
        workspace,
        ema: match plan.ema {
            Some(e) if e.device == crate::config::EmaDevice::Training => {
                4.0 * census.trained as f64
            }
            _ => 0.0,
        },
        assumptions: format!(
            "batch {} at {resolution} px, {}, checkpointing {}",
            plan.batch_size,
            if amp == Amp::Off { "f32" } else { amp.name() },
            if ck { "on" } else { "off" }
        ),
        card: card.clone(),
        rung: None,
    };
    if let Some((bytes, _)) = card {
        if out.total() > bytes {
            out.rung = super::micro_batch::next_rungs(plan, amp, resolution)
                .into_iter()
                .next();
        }
    }
    out
}

/// The pixels of the largest bucket the plan can produce at `resolution` (SD/SDXL take
/// multiples of 64); `resolution²` without buckets.
fn largest_bucket_pixels(plan: &TrainPlan, resolution: usize) -> usize {
    let buckets = super::data_feed::bucket_list(plan.data.buckets.as_ref(), resolution, 64)
        .unwrap_or_else(|_| vec![crate::data::Bucket::new(resolution, resolution)]);
    buckets
        .iter()
        .map(|b| b.width * b.height)
        .max()
        .unwrap_or(resolution * resolution)
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = |b: f64| {
            if b >= GIB {
                format!("{:.2} GiB", b / GIB)
            } else {
                format!("{:.0} MiB", b / (1u64 << 20) as f64)
            }
        };
        writeln!(
            f,
            "{:<15}weights {}, gradients {}, optimizer state {}, activations {} ({}), \
             workspace {}",
            "memory plan",
            g(self.weights),
            g(self.gradients),
            g(self.optimizer),
            g(self.activations),
            self.assumptions,
            g(self.workspace)
        )?;
        if self.ema > 0.0 {
            writeln!(f, "{:<15}EMA on the device {}", "", g(self.ema))?;
        }
        let verdict = match &self.card {
            Some((bytes, source)) if self.total() <= *bytes => {
                format!("fits {} ({source})", g(*bytes))
            }
            Some((bytes, source)) => format!(
                "does NOT fit {} ({source}){}",
                g(*bytes),
                self.rung
                    .as_ref()
                    .map_or(String::new(), |r| format!("; first rung to take: {r}"))
            ),
            None => "no card to check against".to_string(),
        };
        writeln!(f, "{:<15}expected peak {}: {verdict}", "", g(self.total()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::reference_configs::{SD15_UNET, SDXL_UNET};

    fn cfg(json: &str) -> UnetConfig {
        UnetConfig::from_json(json, "test").unwrap()
    }

    #[test]
    fn widths_follow_the_architecture() {
        assert_eq!(unet_width(&cfg(SD15_UNET)), 11300.0);
        assert_eq!(unet_width(&cfg(SDXL_UNET)), 19600.0);
    }

    /// The fitted activation term reproduces the SD1.5 measurement it came from: LoRA f32 at
    /// 512 px (latent 64²), checkpointing off, 4.56 GiB of activations above the weights.
    #[test]
    fn sd15_lora_activations_match_the_calibration() {
        let a = 64.0 * 64.0 * 4.0 * kappa(TrainMode::Lora, false) * 11300.0 / GIB;
        assert!((a - 4.56).abs() < 0.05, "{a}");
    }
}
