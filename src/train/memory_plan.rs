//! The memory plan `--dry-run` prints: the expected peak device memory of a run, by term, and
//! whether it fits the card.
//!
//! - weights, gradients and optimizer state are exact, from the model's safetensors headers and
//!   the plan (frozen weights in the compute dtype, trained ones in `weight_dtype` (f32 masters
//!   by default) with gradients of the same dtype, the optimizer's own state formula; a second
//!   gradient buffer while micro-batches accumulate); under AMP without checkpointing, the
//!   compute-dtype copy of each trained weight that the graph keeps for backward, unless the
//!   weights are already in the compute dtype; with bf16/f16 weights, the f32 copy of the largest
//!   tensor and its gradient that the optimizer updates before rounding back;
//! - frozen weights leave out what a cache releases: the VAE with `cache_latents`, the text
//!   encoders when their outputs are cached;
//! - activations are `batch · (largest bucket's pixels / 64) · bytes · κ · width(UNet)` (a
//!   square bucket: `(resolution/8)²`). `width` sums, over the
//!   UNet's levels, channels/4^level × blocks × (1 + 3·transformer depth), so it follows the
//!   architecture (SD1.5: 11300, SDXL: 19600). κ, the elements kept per unit of width, was fitted
//!   on measured peaks of SD1.5 steps (docs/BENCHMARKS.md, "Memory plan"), per mode and
//!   checkpointing; SDXL and other shapes are extrapolated through `width`;
//! - workspace: the CUDA context, cuBLAS' workspace and the allocator's slack;
//! - an EMA kept on the device (`ema_device: "cuda"`) is an f32 copy of the trained weights;
//! - a sampling round (`sample_prompts`) has its own peak between steps
//!   ([`super::sampling_memory`]); the run's peak is the larger of the step's and the round's.

use std::fmt;

use super::checkpoint_choice::CheckpointDecision;
use super::sampling_memory::{decode_bytes, unet_bytes, RoundShape, SamplingRound};
use crate::config::{BaseWeightDtype, TrainMode, TrainPlan};
use crate::model::unet::{block_widths, CheckpointedBlocks, UnetConfig};
use crate::precision::{Amp, WeightDtype};

const GIB: f64 = (1u64 << 30) as f64;

/// Elements kept for backward per unit of UNet width per latent pixel at batch 1, fitted on
/// SD1.5 (f32, batch 1, latents 32² and 64²): LoRA and full, checkpointing off and on. The LoRA
/// values are refitted since the frozen layers and their adapters, attention and the frozen
/// resnets run as single ops (`nn::low_rank`, `nn::merged_heads`, `nn::norm_conv`): the step's
/// heap above the weights at 512 px went from 4,528 to 1,819 MiB without checkpointing and from
/// 725 to 462 MiB with it (`bench_step --heap-census`, docs/BENCHMARKS.md). Refitted again
/// (×0.74 and ×0.93) since the transformer blocks' residual adds, the GEGLU before `ff.net.2`
/// and the LayerNorms before the projections run inside the adapted layers' ops
/// (`nn::low_rank`, `nn::low_rank_input`): 1,845 → 1,359 MiB and 488 → 453 MiB in the same
/// census. Refitted once more (7.8 → 7.4, 2.9 → 2.6) since the backward frees the graph as it
/// walks it and checkpointed up resnets keep their skip once: 1,359 → 1,257 MiB and 453 → 328
/// MiB.
fn kappa(full: bool, checkpointing: bool) -> f64 {
    match (full, checkpointing) {
        (false, false) => 7.4,
        (false, true) => 2.6,
        (true, false) => 16.7,
        (true, true) => 3.4,
    }
}

/// The architecture's activation width (module header): the sum of the blocks' shares.
pub fn unet_width(cfg: &UnetConfig) -> f64 {
    block_widths(cfg).iter().map(|w| w.width).sum()
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
    /// Elements of the largest trained tensor: with bf16/f16 weights, the optimizer updates an
    /// f32 copy of one tensor (and of its gradient) at a time.
    pub largest_trained: u64,
    /// The Linear and Conv2d weights among `unet` and `text_encoders` (what an fp8 base stores
    /// in one byte each), their rows (one f32 scale each), and the largest one's elements.
    pub unet_layers: u64,
    pub unet_layer_rows: u64,
    pub text_encoder_layers: u64,
    pub text_encoder_layer_rows: u64,
    pub largest_layer: u64,
}

/// The expected peak, by term, in bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    pub weights: f64,
    pub gradients: f64,
    pub optimizer: f64,
    pub activations: f64,
    /// What the backward frees before its last gradients exist (subtracted): the smaller of the
    /// graph (activations and cast copies) and the gradients it creates.
    pub freed_in_backward: f64,
    pub workspace: f64,
    /// The EMA copy on the device (0 on the host or off).
    pub ema: f64,
    /// What the activation term assumed: `batch 1 at 512 px, bf16, checkpointing off`.
    pub assumptions: String,
    /// The card checked against, in bytes, and where that figure came from.
    pub card: Option<(f64, String)>,
    /// The rung to take when it does not fit.
    pub rung: Option<String>,
    /// The blocks checkpointed (`gradient_checkpointing`), and why under `"auto"`.
    pub checkpointing: CheckpointDecision,
    /// The sampling round's peak, when the run samples.
    pub sampling: Option<SamplingRound>,
}

impl MemoryPlan {
    /// The allocator's pool at the peak: the total less the workspace (the CUDA context, cuBLAS'
    /// workspace and the allocator's slack, outside the pool). The measure the peers publish
    /// (torch's `max_memory_allocated`) and `scripts/gpu-check` records.
    pub fn pool(&self) -> f64 {
        let step = self.step_total() - self.workspace;
        self.sampling.as_ref().map_or(step, |r| step.max(r.pool()))
    }

    /// The run's peak: the step's, or a sampling round's when that is larger.
    pub fn total(&self) -> f64 {
        let step = self.step_total();
        self.sampling.as_ref().map_or(step, |r| step.max(r.total()))
    }

    /// The training step's peak.
    pub fn step_total(&self) -> f64 {
        self.weights + self.gradients + self.optimizer + self.activations - self.freed_in_backward
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
    native: usize,
    census: &Census,
    card: Option<(f64, String)>,
) -> MemoryPlan {
    let d = &plan.data;
    let widths = block_widths(cfg);
    let resolution = plan.data.resolution.unwrap_or(native);
    let largest = largest_dataset(plan, native);
    let ema_on_device =
        matches!(plan.ema, Some(e) if e.device == crate::config::EmaDevice::Training);
    let base = RunTerms {
        full: plan.mode == TrainMode::Full && plan.train_unet,
        amp,
        weights: plan.precision.weight_dtype,
        checkpointed_width: 0.0,
        all_checkpointed: false,
        fused: plan.precision.fused_backward_pass,
        fp8_base: match plan.mode {
            TrainMode::Full => BaseWeightDtype::Amp,
            _ => plan.precision.base_weight_dtype,
        },
        batch: largest.batch,
        latent_px: largest.pixels as f64 / 64.0,
        accumulating: plan.grad_accum > 1,
        trained_te: plan.mode == TrainMode::Full && plan.train_text_encoder,
        te_cached: d.text_cache.is_on(),
        latents_cached: d.cache_latents != crate::config::CacheLatents::Off,
        ema_on_device,
        width: unet_width(cfg),
        round: plan.samples.as_ref().and_then(|s| {
            let align = 8 << cfg.num_downsamples();
            RoundShape::of(s, resolution, align, plan.batch_size, ema_on_device)
        }),
    };
    let with = |blocks: Option<&CheckpointedBlocks>| match blocks {
        None => base,
        Some(b) => RunTerms {
            checkpointed_width: widths
                .iter()
                .filter(|w| b.contains(w.block))
                .map(|w| w.width)
                .sum(),
            all_checkpointed: b.is_all(),
            ..base
        },
    };
    let decision = super::checkpoint_choice::decide(
        plan.precision.gradient_checkpointing,
        cfg,
        card.as_ref(),
        |blocks| with(Some(blocks)).plan(census).step_total(),
    );
    let shape = with(decision.blocks.as_ref());
    let mut out = shape.plan(census);
    out.assumptions = format!(
        "batch {} at {} px{}, {}, checkpointing {}{}",
        largest.batch,
        largest.resolution,
        largest.name,
        if amp == Amp::Off { "f32" } else { amp.name() },
        decision.summary(),
        match plan.precision.weight_dtype {
            WeightDtype::F32 => String::new(),
            w if shape.full => format!(", trained weights {}", w.name()),
            _ => String::new(),
        } + match shape.fp8_base {
            BaseWeightDtype::Amp => "",
            BaseWeightDtype::Fp8 => ", fp8 base",
            BaseWeightDtype::Fp8Unet => ", fp8 UNet",
        }
    );
    out.checkpointing = decision;
    out.card = card.clone();
    if let Some((bytes, _)) = card {
        if out.step_total() <= bytes && out.total() > bytes {
            out.rung = Some(
                "draw samples at a smaller size (sample_prompts' size or resolution); a round \
                 that runs out of memory is skipped with a warning"
                    .to_string(),
            );
        } else if out.total() > bytes {
            let every_block = out
                .checkpointing
                .blocks
                .as_ref()
                .is_some_and(|b| b.is_all());
            out.rung = super::micro_batch::next_rungs(plan, amp, resolution, every_block)
                .into_iter()
                .next();
        }
    }
    out
}

/// What the plan's terms depend on, read off the [`TrainPlan`] by [`plan_memory`].
#[derive(Debug, Clone, Copy)]
struct RunTerms {
    full: bool,
    amp: Amp,
    /// The trained weights' dtype (adapters are always f32).
    weights: WeightDtype,
    /// The activation width of the checkpointed blocks (0: none; `width`: all).
    checkpointed_width: f64,
    /// Every block checkpointed, the mid block and text encoders too (`true`).
    all_checkpointed: bool,
    /// `fused_backward_pass`: each gradient dropped once its parameter is updated.
    fused: bool,
    /// `base_weight_dtype`: frozen layer weights in one byte each ("fp8" the UNet's and text
    /// encoders', "fp8_unet" the UNet's).
    fp8_base: BaseWeightDtype,
    batch: usize,
    /// Latent pixels of the largest bucket.
    latent_px: f64,
    accumulating: bool,
    trained_te: bool,
    te_cached: bool,
    latents_cached: bool,
    ema_on_device: bool,
    width: f64,
    /// The sampling round's shape, when the run samples.
    round: Option<RoundShape>,
}

impl RunTerms {
    /// Every term but the card check (module header).
    fn plan(&self, census: &Census) -> MemoryPlan {
        let compute = if self.amp == Amp::Off { 4.0 } else { 2.0 };
        let vae_bytes = if self.amp == Amp::Bf16 { 2.0 } else { 4.0 };
        let frozen_unet = if self.full { 0 } else { census.unet };
        let frozen_te = if self.trained_te || self.te_cached {
            0
        } else {
            census.text_encoders
        };
        let vae = if self.latents_cached { 0 } else { census.vae };
        let trained = census.trained as f64;
        let weight_dtype = if self.full {
            self.weights
        } else {
            WeightDtype::F32
        };
        let trained_bytes = weight_dtype.bytes() as f64;
        // A trained weight not in the compute dtype (f32 under AMP, bf16 without it) is cast
        // where a layer uses it, and the graph keeps the cast until backward; checkpointed
        // segments recompute theirs.
        let casts = weight_dtype.dtype() != self.amp.compute_dtype();
        let amp_copies = if casts && !self.all_checkpointed {
            compute * trained
        } else {
            0.0
        };
        let resident_weights = self.frozen_bytes(census, compute, frozen_unet > 0, frozen_te > 0)
            + vae_bytes * vae as f64
            + trained_bytes * trained;
        let weights = resident_weights + amp_copies;
        // While micro-batches accumulate, the sum and the new micro-batch's gradients coexist.
        let grad_buffers = if self.accumulating { 2.0 } else { 1.0 };
        // bf16/f16 weights: one tensor's f32 copy and f32 gradient during its update.
        let rounding_copy = if weight_dtype == WeightDtype::F32 {
            0.0
        } else {
            8.0 * census.largest_trained as f64
        };
        // Checkpointed blocks keep κ(on) per unit of their width, the others κ(off).
        let kept = kappa(self.full, false) * (self.width - self.checkpointed_width)
            + kappa(self.full, true) * self.checkpointed_width;
        let activations = self.batch as f64 * self.latent_px * compute * kept;
        let ema = if self.ema_on_device {
            4.0 * trained
        } else {
            0.0
        };
        let sampling = self.round.map(|shape| {
            let unet = unet_bytes(shape.unet_batch, shape.pixels(), compute, self.width);
            let decode = decode_bytes(shape.pixels(), vae_bytes);
            SamplingRound {
                shape,
                resident: resident_weights + census.state_bytes as f64 + ema,
                vae: if self.latents_cached {
                    vae_bytes * census.vae as f64
                } else {
                    0.0
                },
                ema_copy: if shape.ema_copy {
                    trained_bytes * trained
                } else {
                    0.0
                },
                unet,
                decode,
                workspace: 0.6 * GIB + 0.05 * unet.max(decode),
            }
        });
        // The step gives its graph up to the backward (`Tensor::into_backward`): the activations
        // and cast copies are freed as the walk passes them while this micro-batch's gradients
        // build up, so the two do not peak at their sum ([`FREED_SHARE`]).
        let freed_in_backward =
            FREED_SHARE * (amp_copies + activations).min(self.new_gradients(census, trained_bytes));
        MemoryPlan {
            weights,
            gradients: self.gradients(census, trained_bytes, grad_buffers),
            optimizer: census.state_bytes as f64 + rounding_copy,
            activations,
            freed_in_backward,
            workspace: 0.6 * GIB + 0.05 * activations,
            ema,
            assumptions: String::new(),
            card: None,
            rung: None,
            checkpointing: CheckpointDecision::default(),
            sampling,
        }
    }
}

impl RunTerms {
    /// The frozen UNet and text encoders (each when it is held): in the compute dtype; with an
    /// fp8 base, their layer weights at one byte plus an f32 scale per row, and a dequantised
    /// copy of the largest layer weight (the one the op running uses; it is freed when the op
    /// ends). On the CPU, SD1.5 LoRA at 256 px in f32: plan 1.53 GiB + the process's 0.15
    /// against a measured peak of 1.55 GiB (docs/BENCHMARKS.md).
    fn frozen_bytes(&self, census: &Census, compute: f64, unet: bool, te: bool) -> f64 {
        let component = |on: bool, fp8: bool, all: u64, layers: u64, rows: u64| match (on, fp8) {
            (false, _) => (0.0, 0),
            (true, false) => (compute * all as f64, 0),
            (true, true) => (
                compute * (all - layers) as f64 + layers as f64 + 4.0 * rows as f64,
                layers,
            ),
        };
        let (unet_bytes, unet_fp8) = component(
            unet,
            self.fp8_base.fp8_unet(),
            census.unet,
            census.unet_layers,
            census.unet_layer_rows,
        );
        let (te_bytes, te_fp8) = component(
            te,
            self.fp8_base.fp8_text_encoders(),
            census.text_encoders,
            census.text_encoder_layers,
            census.text_encoder_layer_rows,
        );
        // The dequantised copy of the largest fp8 layer the op running uses.
        let copy = match unet_fp8 + te_fp8 {
            0 => 0.0,
            _ => compute * census.largest_layer as f64,
        };
        unet_bytes + te_bytes + copy
    }

    /// The gradient term: every trained parameter's gradient (two buffers while micro-batches
    /// accumulate); with the fused backward pass, the largest live set instead of the sum, a few
    /// of the largest tensors' gradients at once (each is dropped when its parameter is
    /// updated), plus the earlier micro-batches' sum when accumulating.
    fn gradients(&self, census: &Census, bytes: f64, buffers: f64) -> f64 {
        let all = bytes * census.trained as f64;
        if !self.fused {
            return buffers * all;
        }
        let earlier = if self.accumulating { all } else { 0.0 };
        earlier + self.new_gradients(census, bytes)
    }

    /// The gradients one micro-batch's backward creates: every trained parameter's, or with the
    /// fused backward pass the largest live set (the earlier micro-batches' sum is not new).
    fn new_gradients(&self, census: &Census, bytes: f64) -> f64 {
        let all = bytes * census.trained as f64;
        if self.fused {
            (FUSED_LIVE_TENSORS * census.largest_trained as f64 * bytes).min(all)
        } else {
            all
        }
    }
}

/// The share of the smaller of the graph and the new gradients that the freeing walk keeps from
/// coexisting with the other. If the graph shrank and the gradients grew at the same pace, all
/// of it (the peak would be the larger of the two); they do not (the up blocks' gradients come
/// early, the high-resolution activations go late), and transients ride on top. Fitted on the
/// heap census of SD1.5 full fine-tunes at 512 px against the 5d1dba7 H100 peaks less what the
/// walk released (docs/BENCHMARKS.md): bf16 +0.9%, f32 −1.7%, bf16 with checkpointing −0.8%.
const FREED_SHARE: f64 = 0.75;

/// Gradients of the largest trained tensor's size the fused backward pass holds at once, in
/// the plan: the walk reaches a weight right after the op that uses it, so a layer's weight
/// and bias, and the part a checkpointed segment is summing, are what coexist.
const FUSED_LIVE_TENSORS: f64 = 4.0;

/// The pixels of the largest bucket the plan can produce at `resolution` (SD/SDXL take
/// multiples of 64); `resolution²` without buckets.
fn largest_bucket_pixels(buckets: Option<&crate::config::BucketPlan>, resolution: usize) -> usize {
    let buckets = super::data_feed::bucket_list(buckets, resolution, 64)
        .unwrap_or_else(|_| vec![crate::data::Bucket::new(resolution, resolution)]);
    buckets
        .iter()
        .map(|b| b.width * b.height)
        .max()
        .unwrap_or(resolution * resolution)
}

/// The dataset whose micro-batch holds the most pixels (batch × its largest bucket), which sets
/// the activations' peak; `name` is `""` for a run of one dataset shape, else `(datasets[i])`.
struct LargestDataset {
    batch: usize,
    pixels: usize,
    resolution: usize,
    name: String,
}

fn largest_dataset(plan: &TrainPlan, native: usize) -> LargestDataset {
    let shapes = plan.dataset_shapes();
    let mut best: Option<LargestDataset> = None;
    for shape in &shapes {
        let resolution = shape.resolution_or(native);
        let pixels = largest_bucket_pixels(shape.buckets.as_ref(), resolution);
        let load = shape.batch_size * pixels;
        if best.as_ref().is_none_or(|b| load > b.batch * b.pixels) {
            best = Some(LargestDataset {
                batch: shape.batch_size,
                pixels,
                resolution,
                name: match shapes.len() {
                    1 => String::new(),
                    _ => format!(" ({})", shape.name),
                },
            });
        }
    }
    best.unwrap_or_else(|| {
        let resolution = plan.data.resolution.unwrap_or(native);
        LargestDataset {
            batch: plan.batch_size,
            pixels: resolution * resolution,
            resolution,
            name: String::new(),
        }
    })
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
        if self.freed_in_backward > 0.0 {
            writeln!(
                f,
                "{:<15}less {} the backward frees as its gradients build up (the smaller of \
                 the graph and the new gradients)",
                "",
                g(self.freed_in_backward)
            )?;
        }
        if self.ema > 0.0 {
            writeln!(f, "{:<15}EMA on the device {}", "", g(self.ema))?;
        }
        if let Some(note) = &self.checkpointing.note {
            writeln!(f, "{:<15}gradient checkpointing {note}", "")?;
        }
        if let Some(round) = &self.sampling {
            writeln!(
                f,
                "{:<15}sampling round: {}",
                "",
                round.describe(self.step_total())
            )?;
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
        writeln!(f, "{:<15}expected peak {}: {verdict}", "", g(self.total()))?;
        writeln!(
            f,
            "{:<15}allocator pool peak {} (the peak less the workspace: what \
             torch.cuda.max_memory_allocated reports, as the peers' published figures do)",
            "",
            g(self.pool())
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::reference_configs::{SD15_UNET, SDXL_UNET};

    /// The plan against an H100's measured peaks (`scripts/gpu-check` at 5d1dba7, 2026-11-24,
    /// docs/BENCHMARKS.md): examples/bench_step's CUDA pool high-water mark, which holds the
    /// UNet, the trained parameters, their gradients and AdamW state and the activations (no VAE
    /// or text encoder: the inputs stand in for cached latents and text), and not the context
    /// and cuBLAS workspace the plan's `workspace` term covers. Census from the same runs:
    /// SD1.5's UNet 859,520,964 elements, SDXL's 2,567,463,684; LoRA rank 16 on kohya's
    /// targets 6,782,976 (SD1.5) and 42,557,440 (SDXL) trained; AdamW 8 bytes per trained
    /// element. Every row within 7%; before the AMP weight-copy term, the SD1.5 full fine-tune
    /// in bf16 was 11% under.
    ///
    /// The SD1.5 LoRA rows are those peaks less what the single-op frozen layers released, as the
    /// heap census measured it on the CPU at 512 px f32 (4,528 → 1,819 MiB without
    /// checkpointing, 725 → 462 MiB with it; halved for bf16, times the batch), and less what the
    /// residuals, the GEGLU and the norms inside the adapted layers' ops released since (1,845 →
    /// 1,359 MiB, 488 → 453 MiB), and what the freeing backward walk and the checkpointed up
    /// resnets' skips released (1,359 → 1,257 MiB, 453 → 328 MiB). The full fine-tune rows are
    /// the peaks less what the freeing walk released there (census in the row's precision at
    /// 512 px). The census
    /// reproduced the H100 peaks of 5d1dba7 within 1% (weights + LoRA terms + census). The SDXL
    /// LoRA rows wait for the next H100 run: no SDXL census in f32 fits this machine.
    #[test]
    fn plan_matches_the_h100_peaks() {
        let released = |bf16: bool, batch: f64, ck: bool| {
            let mib = if ck {
                (725.0 - 462.0) + (488.0 - 453.0) + (453.0 - 328.0)
            } else {
                (4528.0 - 1819.0) + (1845.0 - 1359.0) + (1359.0 - 1257.0)
            };
            mib / 1024.0 * batch / if bf16 { 2.0 } else { 1.0 }
        };
        // What the freeing walk released in the full fine-tunes (the census in each row's own
        // precision at 512 px: 6,778 → 4,221 MiB in bf16, 3,876 → 3,633 with checkpointing,
        // 6,032 → 3,990 in f32).
        let full_released = |mib_before: f64, mib_after: f64| (mib_before - mib_after) / 1024.0;
        // (sdxl, full, res, batch, bf16, checkpointing, measured GiB)
        let rows: [(bool, bool, usize, usize, bool, bool, f64); 8] = [
            (
                false,
                false,
                512,
                1,
                true,
                false,
                3.94 - released(true, 1.0, false),
            ),
            (
                false,
                false,
                512,
                4,
                true,
                false,
                10.69 - released(true, 4.0, false),
            ),
            (
                false,
                true,
                512,
                1,
                true,
                false,
                15.94 - full_released(6778.0, 4221.0),
            ),
            (
                false,
                false,
                512,
                1,
                false,
                false,
                7.78 - released(false, 1.0, false),
            ),
            (
                false,
                false,
                512,
                4,
                false,
                false,
                21.26 - released(false, 4.0, false),
            ),
            (
                false,
                true,
                512,
                1,
                false,
                false,
                15.76 - full_released(6032.0, 3990.0),
            ),
            (
                false,
                false,
                512,
                1,
                true,
                true,
                2.11 - released(true, 1.0, true),
            ),
            (
                false,
                true,
                512,
                1,
                true,
                true,
                13.22 - full_released(3876.0, 3633.0),
            ),
        ];
        for (sdxl, full, res, batch, bf16, ck, measured) in rows {
            let (unet, lora, cfg_json) = if sdxl {
                (2_567_463_684u64, 42_557_440u64, SDXL_UNET)
            } else {
                (859_520_964, 6_782_976, SD15_UNET)
            };
            let trained = if full { unet } else { lora };
            let census = Census {
                unet,
                text_encoders: 0,
                vae: 0,
                trained,
                state_bytes: 8 * trained,
                ..Census::default()
            };
            let terms = RunTerms {
                full,
                amp: if bf16 { Amp::Bf16 } else { Amp::Off },
                checkpointed_width: if ck { unet_width(&cfg(cfg_json)) } else { 0.0 },
                all_checkpointed: ck,
                batch,
                latent_px: (res * res) as f64 / 64.0,
                width: unet_width(&cfg(cfg_json)),
                ..base_terms()
            };
            let p = terms.plan(&census);
            let pool = (p.total() - p.workspace) / GIB;
            let off = pool / measured - 1.0;
            assert!(
                off.abs() < 0.07,
                "{terms:?}: plan {pool:.2} GiB against {measured} GiB measured ({:+.1}%)",
                off * 100.0
            );
        }
    }

    /// bf16 trained weights (`weight_dtype`) in a full fine-tune: weights and gradients at two
    /// bytes, no cast copies when they match the compute dtype (f32 copies kept when they do not),
    /// and one f32 copy of the largest tensor and its gradient in the optimizer term. Adapter
    /// runs ignore the setting. Catches gradients priced at four bytes, a cast copy counted for
    /// weights already in the compute dtype, and the optimizer's f32 copy left out.
    #[test]
    fn bf16_weights_halve_weights_and_gradients() {
        let census = Census {
            unet: 1000,
            text_encoders: 0,
            vae: 0,
            trained: 1000,
            state_bytes: 8000,
            largest_trained: 100,
            ..Census::default()
        };
        let terms_fused = |full: bool, amp: Amp, weights: WeightDtype, fused: bool| {
            RunTerms {
                full,
                amp,
                weights,
                fused,
                ..base_terms()
            }
            .plan(&census)
        };
        let terms = |full, amp, weights| terms_fused(full, amp, weights, false);
        let f32_amp = terms(true, Amp::Bf16, WeightDtype::F32);
        assert_eq!((f32_amp.weights, f32_amp.gradients), (6000.0, 4000.0));
        let bf16 = terms(true, Amp::Bf16, WeightDtype::Bf16);
        assert_eq!((bf16.weights, bf16.gradients), (2000.0, 2000.0));
        assert_eq!(bf16.optimizer, 8000.0 + 800.0);
        let bf16_f32_compute = terms(true, Amp::Off, WeightDtype::Bf16);
        assert_eq!(bf16_f32_compute.weights, 2000.0 + 4000.0);
        let lora = terms(false, Amp::Bf16, WeightDtype::Bf16);
        assert_eq!(lora.gradients, 4000.0);
        assert_eq!(lora.optimizer, 8000.0);
        // Fused: the largest live set (4 of the largest tensor's gradients), not the sum.
        let fused = terms_fused(true, Amp::Bf16, WeightDtype::Bf16, true);
        assert_eq!(fused.gradients, 4.0 * 100.0 * 2.0);
    }

    /// An fp8 base: the layer weights of each held component at one byte plus an f32 scale per
    /// row, the rest in the compute dtype, and a compute-dtype copy of the largest layer.
    /// Catches the layers priced at two bytes, the scales or the dequantised copies left out, a
    /// cached (released) text encoder counted, and a full fine-tune priced as fp8.
    #[test]
    fn an_fp8_base_stores_layer_weights_in_one_byte() {
        let census = Census {
            unet: 1000,
            unet_layers: 900,
            unet_layer_rows: 30,
            text_encoders: 500,
            text_encoder_layers: 400,
            text_encoder_layer_rows: 20,
            largest_layer: 50,
            trained: 10,
            ..Census::default()
        };
        let weights = |fp8_base: BaseWeightDtype, te_cached: bool, full: bool| {
            RunTerms {
                full,
                fp8_base,
                te_cached,
                ..base_terms()
            }
            .plan(&census)
            .weights
        };
        let adapters = 4.0 * 10.0 + 2.0 * 10.0; // f32 adapters and their bf16 casts
        use BaseWeightDtype::{Amp as Off, Fp8, Fp8Unet};
        assert_eq!(weights(Off, false, false), 2.0 * 1500.0 + adapters);
        let fp8 = 2.0 * 200.0 + 1300.0 + 4.0 * 50.0 + 2.0 * 50.0;
        assert_eq!(weights(Fp8, false, false), fp8 + adapters);
        let fp8_cached = 2.0 * 100.0 + 900.0 + 4.0 * 30.0 + 2.0 * 50.0;
        assert_eq!(weights(Fp8, true, false), fp8_cached + adapters);
        assert_eq!(weights(Fp8, true, true), weights(Off, true, true));
        // kohya's fp8_base_unet: the text encoders stay in the compute dtype.
        let fp8_unet = 2.0 * 100.0 + 900.0 + 4.0 * 30.0 + 2.0 * 500.0 + 2.0 * 50.0;
        assert_eq!(weights(Fp8Unet, false, false), fp8_unet + adapters);
        assert_eq!(weights(Fp8Unet, true, false), fp8_cached + adapters);
    }

    /// A sampling round: what stays (weights without the step's AMP copies, the optimizer
    /// state), the VAE again only when the latent cache released it, the trained weights' copy
    /// beside the EMA's, the larger of UNet and decode; the run's peak is the larger of step and
    /// round, and the checkpointing decision looks at the step alone. Catches the AMP copies
    /// counted in the round, the VAE priced twice when it is held, and a round that never wins.
    #[test]
    fn a_sampling_round_prices_its_own_peak() {
        let census = Census {
            unet: 1000,
            vae: 300,
            trained: 100,
            state_bytes: 800,
            ..Census::default()
        };
        let round = |latents_cached: bool, ema_copy: bool, pixels: usize| {
            RunTerms {
                full: true,
                latents_cached,
                ema_on_device: ema_copy,
                width: 10.0,
                round: Some(RoundShape {
                    width: pixels,
                    height: 1,
                    unet_batch: 1,
                    ema_copy,
                }),
                ..base_terms()
            }
            .plan(&census)
        };
        let p = round(true, false, 64);
        let r = p.sampling.as_ref().unwrap();
        // f32 masters (400) + the VAE held in bf16 but released by the cache; AMP copies (200)
        // stay out of the round.
        assert_eq!(p.weights, 4.0 * 100.0 + 2.0 * 100.0);
        assert_eq!(r.resident, 400.0 + 800.0);
        assert_eq!(r.vae, 2.0 * 300.0);
        assert_eq!(r.decode, decode_bytes(64.0, 2.0));
        assert_eq!(r.unet, unet_bytes(1, 64.0, 2.0, 10.0));
        assert_eq!(r.ema_copy, 0.0);
        let held = round(false, false, 64);
        assert_eq!(held.sampling.as_ref().unwrap().vae, 0.0);
        assert_eq!(held.weights, 600.0 + 2.0 * 300.0);
        let ema = round(true, true, 64);
        assert_eq!(ema.sampling.as_ref().unwrap().ema_copy, 400.0);
        assert_eq!(ema.sampling.as_ref().unwrap().resident, 1200.0 + 400.0);
        // A round at many pixels is the run's peak; the step's own total stays apart.
        let big = round(true, false, 1 << 20);
        let r = big.sampling.as_ref().unwrap();
        assert!(r.total() > big.step_total());
        assert_eq!(big.total(), r.total());
        assert_eq!(big.pool(), r.total() - r.workspace);
        assert_eq!(
            p.total(),
            p.step_total().max(p.sampling.as_ref().unwrap().total())
        );
    }

    /// Terms for the unit tests: a LoRA step under bf16 AMP with nothing cached but latents and
    /// text, no checkpointing, no samples; each test sets what it varies.
    fn base_terms() -> RunTerms {
        RunTerms {
            full: false,
            amp: Amp::Bf16,
            weights: WeightDtype::F32,
            checkpointed_width: 0.0,
            all_checkpointed: false,
            fused: false,
            fp8_base: BaseWeightDtype::Amp,
            batch: 1,
            latent_px: 0.0,
            accumulating: false,
            trained_te: false,
            te_cached: true,
            latents_cached: true,
            ema_on_device: false,
            width: 0.0,
            round: None,
        }
    }

    fn cfg(json: &str) -> UnetConfig {
        UnetConfig::from_json(json, "test").unwrap()
    }

    /// The freeing walk: three quarters of the smaller of the graph (here the bf16 cast copies,
    /// 2 bytes per trained element) and the gradients this micro-batch creates are subtracted
    /// once from the step's total. Catches the sum kept (nothing freed), the larger of the two
    /// taken, the earlier micro-batches' sum counted as new, and the fused pass's live set
    /// ignored.
    #[test]
    fn the_backward_frees_the_smaller_of_graph_and_new_gradients() {
        let census = Census {
            unet: 1000,
            trained: 1000,
            state_bytes: 8000,
            largest_trained: 100,
            ..Census::default()
        };
        let plan = |fused: bool, accumulating: bool| {
            RunTerms {
                full: true,
                fused,
                accumulating,
                ..base_terms()
            }
            .plan(&census)
        };
        let p = plan(false, false);
        assert_eq!((p.weights, p.gradients), (6000.0, 4000.0));
        assert_eq!(p.freed_in_backward, 0.75 * 2000.0);
        let sum = p.weights + p.gradients + p.optimizer + p.activations + p.workspace;
        assert_eq!(p.step_total(), sum - 1500.0);
        // Accumulating: the earlier sum (a second buffer) is not freed by this walk.
        let acc = plan(false, true);
        assert_eq!((acc.gradients, acc.freed_in_backward), (8000.0, 1500.0));
        // Fused: 4 live tensors of 100 elements at 4 bytes are what the walk creates.
        assert_eq!(plan(true, false).freed_in_backward, 0.75 * 1600.0);
    }

    #[test]
    fn widths_follow_the_architecture() {
        assert_eq!(unet_width(&cfg(SD15_UNET)), 11300.0);
        assert_eq!(unet_width(&cfg(SDXL_UNET)), 19600.0);
    }

    /// The fitted activation term reproduces the SD1.5 measurement it came from: LoRA f32 at
    /// 512 px (latent 64²), checkpointing off, 1.82 GiB of activations above the weights (peak
    /// RSS 5.15 GiB less the 3.33 GiB of weights and process; the heap census: 1,819 MiB), less
    /// the 26% the residuals, the GEGLU and the norms inside the adapted layers' ops released
    /// (heap census 1,845 → 1,359 MiB), less the 7.5% the freeing backward walk released since
    /// (1,359 → 1,257 MiB): 1.24 GiB.
    #[test]
    fn sd15_lora_activations_match_the_calibration() {
        let a = 64.0 * 64.0 * 4.0 * kappa(false, false) * 11300.0 / GIB;
        assert!((a - 1.82 * 1257.0 / 1845.0).abs() < 0.05, "{a}");
    }
}
