//! The sampling round's share of the memory plan (`sample_prompts`). Kohya users hit out of
//! memory while sampling after the step itself fit (sd-scripts #1014): the VAE decode at full
//! image size is the largest single transient of a run that caches its latents.
//!
//! A round runs between optimizer steps ([`super::samples`]), when no gradient or activation of
//! training is alive. Its peak is:
//! - what stays: the weights (less the compute-dtype copies of trained weights that only the
//!   step's graph keeps), the optimizer state and an EMA kept on the device;
//! - the VAE loaded again for the round when `cache_latents` released it, in its dtype;
//! - the trained weights' copy held while the EMA weights are drawn (`ema_sample_ema_model`,
//!   EMA on the device: [`super::ema::Ema::with_weights`]);
//! - the larger of the UNet's forward at the largest sample size and the VAE decode of that
//!   image, which come one after the other. The UNet runs under checkpointing in a round (the
//!   run's own, or one made for it), at batch 2 when the guidance halves run together (training
//!   micro-batch 2 or more): [`unet_bytes`]. The decode is [`decode_bytes`];
//! - the workspace, as the step's.

use crate::config::SamplePlan;
use crate::sample::jobs::largest_image;

const GIB: f64 = (1u64 << 30) as f64;

/// Elements the VAE decode holds at its peak per output pixel: four 256-channel maps at full
/// resolution (the last up block's input, its norm and activation, and the upsampled map).
/// Measured on the CPU with `examples/bench_vae_decode` (SD's VAE, shared by SD1.5, SD2.1 and
/// SDXL; f32, the heap's peak above the weights): 1,031 / 1,028 / 1,026 elements per pixel at
/// 384 / 512 / 768 px (docs/BENCHMARKS.md); at 256 px a fixed 64 MiB more (the conv's column
/// chunk), which the workspace term covers.
pub const DECODE_ELEMENTS_PER_PIXEL: f64 = 1024.0;

/// Elements the UNet's forward in a round holds per unit of its activation width
/// ([`super::memory_plan::unet_width`]) per latent pixel per image, under checkpointing: fitted
/// on the two rounds measured where the UNet, not the decode, held the peak (SD1.5 LoRA, f32,
/// guidance halves at batch 2, 512 and 768 px: 1.50 and 2.82 GiB above what stays; the fit gives
/// 1.29 and 2.91). Above the checkpointed step's 3.1: no backward frees a segment's output early.
pub const ROUND_UNET_KAPPA: f64 = 3.75;

/// The UNet's forward in a round at `batch` images of `pixels` (image pixels) in `bytes` per
/// element, for a UNet of activation `width`.
pub fn unet_bytes(batch: usize, pixels: f64, bytes: f64, width: f64) -> f64 {
    batch as f64 * pixels / 64.0 * bytes * ROUND_UNET_KAPPA * width
}

/// The VAE decode's peak above its weights for an image of `pixels` in a VAE of `bytes` per
/// element.
pub fn decode_bytes(pixels: f64, bytes: f64) -> f64 {
    DECODE_ELEMENTS_PER_PIXEL * pixels * bytes
}

/// What a round draws at its largest.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoundShape {
    /// The largest image.
    pub width: usize,
    pub height: usize,
    /// The UNet's batch: 2 when a prompt guides and the halves run together.
    pub unet_batch: usize,
    /// The EMA weights are drawn too, while the trained ones wait on the device.
    pub ema_copy: bool,
}

impl RoundShape {
    /// The round of `samples` for a run at `resolution` with training micro-batch `micro`, on a
    /// model whose image sizes align to `align`; `ema_on_device` when the EMA lives on the
    /// training device. `None` when no prompt's size resolves (the run refuses the file then).
    pub fn of(
        samples: &SamplePlan,
        resolution: usize,
        align: usize,
        micro: usize,
        ema_on_device: bool,
    ) -> Option<Self> {
        let ((width, height), guided) = largest_image(&samples.set, resolution, align)?;
        Some(Self {
            width,
            height,
            unet_batch: if guided && micro >= 2 { 2 } else { 1 },
            ema_copy: samples.ema_model && ema_on_device,
        })
    }

    pub fn pixels(&self) -> f64 {
        (self.width * self.height) as f64
    }
}

/// A round's peak, by term, in bytes (module header).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingRound {
    pub shape: RoundShape,
    /// Weights, optimizer state and a device EMA, which stay through the round.
    pub resident: f64,
    /// The VAE loaded again for the round (0 when the run holds it).
    pub vae: f64,
    /// The trained weights' copy while the EMA weights are drawn.
    pub ema_copy: f64,
    /// The UNet's forward at the largest size.
    pub unet: f64,
    /// The VAE decode of the largest image.
    pub decode: f64,
    pub workspace: f64,
}

impl SamplingRound {
    pub fn total(&self) -> f64 {
        self.resident + self.vae + self.ema_copy + self.unet.max(self.decode) + self.workspace
    }

    /// The allocator's pool at the round's peak (the total less the workspace).
    pub fn pool(&self) -> f64 {
        self.total() - self.workspace
    }

    /// One line for `--dry-run`; `step_total` is the step's peak, to say which is the run's.
    pub fn describe(&self, step_total: f64) -> String {
        let g = |b: f64| {
            if b >= GIB {
                format!("{:.2} GiB", b / GIB)
            } else {
                format!("{:.0} MiB", b / (1u64 << 20) as f64)
            }
        };
        let s = &self.shape;
        let mut parts = Vec::new();
        if self.vae > 0.0 {
            parts.push(format!("VAE loaded again {}", g(self.vae)));
        }
        if self.ema_copy > 0.0 {
            parts.push(format!(
                "trained weights beside the EMA's {}",
                g(self.ema_copy)
            ));
        }
        parts.push(format!(
            "UNet at {}x{} batch {} {}",
            s.width,
            s.height,
            s.unet_batch,
            g(self.unet)
        ));
        parts.push(format!("VAE decode {}", g(self.decode)));
        let verdict = if self.total() > step_total {
            "the run's peak"
        } else {
            "below the step's"
        };
        format!("{}: peak {} ({verdict})", parts.join(", "), g(self.total()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::prompts::SampleSet;

    fn plan(json: &str, ema_model: bool) -> SamplePlan {
        let path = std::path::Path::new("samples.json");
        SamplePlan {
            prompts_file: path.to_path_buf(),
            every_n_steps: 1,
            every_n_epochs: None,
            trained_model: true,
            ema_model,
            set: SampleSet::from_json(path, json).unwrap(),
        }
    }

    /// The round's shape: the largest prompt by pixels (an explicit size, the file's resolution
    /// or the run's), batch 2 only when a prompt guides and the training micro-batch is 2 or
    /// more, the EMA copy only when the EMA weights are drawn and the EMA is on the device.
    /// Catches the first prompt's size taken for the largest, the file's resolution ignored, and
    /// batch 2 for unguided prompts.
    #[test]
    fn the_round_takes_the_largest_prompt() {
        let two = r#"{"cfgs": [1], "samples": [{"prompt": "a"},
            {"prompt": "b", "size": [768, 512]}, {"prompt": "c", "cfgs": [7]}]}"#;
        let s = RoundShape::of(&plan(two, false), 512, 64, 2, true).unwrap();
        assert_eq!(
            (s.width, s.height, s.unet_batch, s.ema_copy),
            (768, 512, 2, false)
        );
        let s = RoundShape::of(&plan(two, true), 512, 64, 1, true).unwrap();
        assert_eq!((s.unet_batch, s.ema_copy), (1, true));
        assert!(
            !RoundShape::of(&plan(two, true), 512, 64, 1, false)
                .unwrap()
                .ema_copy
        );
        let unguided = r#"{"cfgs": [1], "resolution": 1024, "samples": [{"prompt": "a"}]}"#;
        let s = RoundShape::of(&plan(unguided, false), 512, 64, 4, false).unwrap();
        assert_eq!((s.width, s.height, s.unet_batch), (1024, 1024, 1));
    }

    fn round(vae: f64, unet: f64, decode: f64) -> SamplingRound {
        SamplingRound {
            shape: RoundShape {
                width: 512,
                height: 512,
                unet_batch: 1,
                ema_copy: false,
            },
            resident: 100.0,
            vae,
            ema_copy: 5.0,
            unet,
            decode,
            workspace: 20.0,
        }
    }

    /// The UNet's forward and the decode come one after the other: the larger counts, not the
    /// sum; the VAE reload and the EMA copy add to either. Catches a sum in place of the max and
    /// a term left out.
    #[test]
    fn the_larger_of_unet_and_decode_counts() {
        assert_eq!(
            round(10.0, 30.0, 50.0).total(),
            100.0 + 10.0 + 5.0 + 50.0 + 20.0
        );
        assert_eq!(
            round(10.0, 70.0, 50.0).total(),
            100.0 + 10.0 + 5.0 + 70.0 + 20.0
        );
        assert_eq!(round(10.0, 70.0, 50.0).pool(), 185.0);
    }

    /// The decode's fitted term: SD's VAE at 512 px in f32 held 1,028 MiB above its weights
    /// (examples/bench_vae_decode); at 1024 px in bf16 the same elements at two bytes. Catches
    /// a term in latent pixels (64× smaller) or without the dtype.
    #[test]
    fn decode_matches_the_measurement() {
        let mib = decode_bytes(512.0 * 512.0, 4.0) / (1u64 << 20) as f64;
        assert!((mib / 1028.1 - 1.0).abs() < 0.01, "{mib}");
        assert_eq!(
            decode_bytes(1024.0 * 1024.0, 2.0),
            2.0 * decode_bytes(512.0 * 512.0, 4.0)
        );
    }
}
