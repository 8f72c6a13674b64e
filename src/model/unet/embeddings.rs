//! Timestep conditioning: diffusers' `Timesteps` (sinusoidal projection) and
//! `TimestepEmbedding` (linear → SiLU → linear).
//!
//! For timesteps `t` `[B]` and `half = dim / 2`:
//! `freq_i = exp(−ln(10000) · i / (half − shift))`, `emb = [sin(t·freq), cos(t·freq)]`,
//! with the halves swapped when `flip_sin_to_cos` (SD sets it).

use candle_core::{DType, Result, Tensor};

use crate::model::weights::{Weights, WeightsError};
use crate::nn::{silu, LayerMut, Linear, VisitLayers};

/// Sinusoidal embedding of per-sample timesteps `t` `[N]` → `[N, dim]`, in f32.
pub fn timestep_embedding(
    t: &Tensor,
    dim: usize,
    flip_sin_to_cos: bool,
    shift: f64,
) -> Result<Tensor> {
    let half = dim / 2;
    let denom = half as f64 - shift;
    let freqs: Vec<f32> = (0..half)
        .map(|i| (-(10000f64.ln()) * i as f64 / denom).exp() as f32)
        .collect();
    let freqs = Tensor::from_vec(freqs, (1, half), t.device())?;
    let args = t
        .to_dtype(DType::F32)?
        .unsqueeze(1)?
        .broadcast_mul(&freqs)?;
    let (sin, cos) = (args.sin()?, args.cos()?);
    let emb = if flip_sin_to_cos {
        Tensor::cat(&[cos, sin], 1)?
    } else {
        Tensor::cat(&[sin, cos], 1)?
    };
    if dim % 2 == 1 {
        emb.pad_with_zeros(1, 0, 1)
    } else {
        Ok(emb)
    }
}

/// `linear_2(silu(linear_1(x)))`.
#[derive(Debug, Clone)]
pub struct TimestepEmbedding {
    pub linear_1: Linear,
    pub linear_2: Linear,
}

impl TimestepEmbedding {
    pub fn new(
        w: &Weights,
        in_dim: usize,
        out_dim: usize,
    ) -> std::result::Result<Self, WeightsError> {
        Ok(Self {
            linear_1: Linear::new(&w.pp("linear_1"), in_dim, out_dim, true)?,
            linear_2: Linear::new(&w.pp("linear_2"), out_dim, out_dim, true)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.linear_2.forward(&silu(&self.linear_1.forward(x)?)?)
    }
}

impl VisitLayers for TimestepEmbedding {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        self.linear_1.visit_layers(f);
        self.linear_2.visit_layers(f);
    }
}
