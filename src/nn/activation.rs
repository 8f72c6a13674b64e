//! Activations used by the SD models, all differentiable in candle.
//! - `silu(x) = x·σ(x)`
//! - `gelu_erf(x) = x·Φ(x)`, the exact GELU that torch's `F.gelu` and diffusers' GEGLU use
//! - `quick_gelu(x) = x·σ(1.702·x)`, OpenAI CLIP's approximation

use candle_core::{Result, Tensor};

pub fn silu(x: &Tensor) -> Result<Tensor> {
    x.silu()
}

pub fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    x.gelu_erf()
}

pub fn quick_gelu(x: &Tensor) -> Result<Tensor> {
    x * candle_nn::ops::sigmoid(&(x * 1.702)?)?
}
