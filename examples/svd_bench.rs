//! Times `linalg::truncated_svd` at the shapes LoRA extraction meets: SD1.5's and SDXL's largest
//! Linear (1280 × 5120) and 3×3 conv (1280 × 11520) deltas, rank 32.
//!
//! `cargo run --release --example svd_bench`

use candle_core::{Device, Tensor};

fn main() -> candle_core::Result<()> {
    for (m, n) in [
        (320, 320),
        (640, 2560),
        (1280, 5120),
        (1280, 11520),
        (10240, 1280),
    ] {
        let a = Tensor::randn(0f32, 1.0, (m, n), &Device::Cpu)?;
        let t = std::time::Instant::now();
        let (_, s, _) = sdtrain::linalg::truncated_svd(&a, 32)?;
        println!(
            "{m}×{n}: {:.2} s (σ₁ {:.1})",
            t.elapsed().as_secs_f64(),
            s[0]
        );
    }
    Ok(())
}
