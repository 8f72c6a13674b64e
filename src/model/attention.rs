//! diffusers' `Attention` module as SD uses it (`to_q`, `to_k`, `to_v`, `to_out.0`): self-attention
//! when no context is given, cross-attention otherwise. Shared by the UNet's transformer blocks and
//! the VAE's mid-block attention.

use candle_core::{Result, Tensor};

use super::weights::{Weights, WeightsError};
use crate::nn::{attention, LayerMut, Linear, Normed, VisitLayers};

#[derive(Debug, Clone)]
pub struct Attention {
    pub to_q: Linear,
    pub to_k: Linear,
    pub to_v: Linear,
    pub to_out: Linear,
    pub heads: usize,
}

impl Attention {
    /// `query_dim` is the input width, `context_dim` the cross-attention width (`None`: self).
    /// `qkv_bias` is false in the UNet and true in the VAE.
    pub fn new(
        w: &Weights,
        query_dim: usize,
        context_dim: Option<usize>,
        heads: usize,
        head_dim: usize,
        qkv_bias: bool,
    ) -> std::result::Result<Self, WeightsError> {
        let inner = heads * head_dim;
        let ctx = context_dim.unwrap_or(query_dim);
        Ok(Self {
            to_q: Linear::new(&w.pp("to_q"), query_dim, inner, qkv_bias)?,
            to_k: Linear::new(&w.pp("to_k"), ctx, inner, qkv_bias)?,
            to_v: Linear::new(&w.pp("to_v"), ctx, inner, qkv_bias)?,
            to_out: Linear::new(&w.pp("to_out").pp(0), inner, query_dim, true)?,
            heads,
        })
    }

    /// `x` `[B, L, C]`, `context` `[B, Lc, Cc]` → `[B, L, C]`.
    pub fn forward(&self, x: &Tensor, context: Option<&Tensor>) -> Result<Tensor> {
        self.to_out.forward(&self.heads_out(x, context)?)
    }

    /// `residual + forward(norm(x), context)` for the norm's output `n`: the projections of the
    /// normed tokens take the norm inside their ops where they can (`Linear::forward_normed`),
    /// and `to_out` the residual (`Linear::forward_add`).
    pub fn forward_normed_add(
        &self,
        n: &Normed<'_>,
        context: Option<&Tensor>,
        residual: &Tensor,
    ) -> Result<Tensor> {
        let q = self.to_q.forward_normed(n)?;
        let (k, v) = match context {
            Some(c) => (self.to_k.forward(c)?, self.to_v.forward(c)?),
            None => (self.to_k.forward_normed(n)?, self.to_v.forward_normed(n)?),
        };
        self.to_out
            .forward_add(&attention(&q, &k, &v, self.heads, None)?, residual)
    }

    /// The attention's output before `to_out`, heads merged.
    fn heads_out(&self, x: &Tensor, context: Option<&Tensor>) -> Result<Tensor> {
        let ctx = context.unwrap_or(x);
        let q = self.to_q.forward(x)?;
        let k = self.to_k.forward(ctx)?;
        let v = self.to_v.forward(ctx)?;
        attention(&q, &k, &v, self.heads, None)
    }
}

impl VisitLayers for Attention {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        self.to_q.visit_layers(f);
        self.to_k.visit_layers(f);
        self.to_v.visit_layers(f);
        self.to_out.visit_layers(f);
    }
}
