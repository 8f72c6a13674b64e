//! Activations used by the SD models, all differentiable in candle.
//! - `silu(x) = x·σ(x)`
//! - `gelu_erf(x) = x·Φ(x)`, the exact GELU that torch's `F.gelu` and diffusers' GEGLU use
//! - `quick_gelu(x) = x·σ(1.702·x)`, OpenAI CLIP's approximation

use candle_core::{DType, Result, Tensor};

/// On the CPU, bf16 is computed in f32 and rounded once, as torch does; candle's CPU bf16 silu
/// rounds after each of its elementary steps.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    if super::cpu_bf16(x) {
        x.to_dtype(DType::F32)?.silu()?.to_dtype(DType::BF16)
    } else {
        x.silu()
    }
}

pub fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    x.gelu_erf()
}

pub fn quick_gelu(x: &Tensor) -> Result<Tensor> {
    x * candle_nn::ops::sigmoid(&(x * 1.702)?)?
}
