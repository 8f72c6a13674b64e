//! diffusers' `Transformer2DModel` (continuous input) and `BasicTransformerBlock` as SD uses them.
//!
//! - Transformer2D: `x + proj_out(blocks(proj_in(norm(x))))`, with `proj_in/out` 1×1 convs (SD1)
//!   or linears applied after flattening to tokens (SD2, SDXL: `use_linear_projection`).
//! - Block: self-attention, cross-attention and a GEGLU feed-forward, each pre-LayerNorm with a
//!   residual. GEGLU: `h, g = proj(x).chunk(2); h · gelu_erf(g)` (exact GELU, as diffusers).

use candle_core::{Result, Tensor};

use crate::model::attention::Attention;
use crate::model::weights::{Weights, WeightsError};
use crate::nn::{
    add_maybe_const, Checkpointing, Conv2d, Conv2dConfig, GroupNorm, LayerMut, LayerNorm, Linear,
    Normed, VisitLayers,
};

#[derive(Debug, Clone)]
pub struct FeedForward {
    /// `ff.net.0.proj`: `[dim] → [2 · 4·dim]`.
    pub proj: Linear,
    /// `ff.net.2`: `[4·dim] → [dim]`.
    pub out: Linear,
}

impl FeedForward {
    pub fn new(w: &Weights, dim: usize) -> std::result::Result<Self, WeightsError> {
        let inner = dim * 4;
        Ok(Self {
            proj: Linear::new(&w.pp("net").pp(0).pp("proj"), dim, inner * 2, true)?,
            out: Linear::new(&w.pp("net").pp(2), inner, dim, true)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.out
            .forward(&crate::nn::geglu_layer(&self.proj.forward(x)?)?)
    }

    /// `residual + forward(norm(x))` for the norm's output `n`: the norm inside the projection's
    /// op, the GEGLU and the residual inside `ff.net.2`'s, where they can take them
    /// (`Linear::forward_normed`, `Linear::forward_geglu_add`).
    pub fn forward_normed_add(&self, n: &Normed<'_>, residual: &Tensor) -> Result<Tensor> {
        self.out
            .forward_geglu_add(&self.proj.forward_normed(n)?, residual)
    }
}

#[derive(Debug, Clone)]
pub struct BasicTransformerBlock {
    pub norm1: LayerNorm,
    pub attn1: Attention,
    pub norm2: LayerNorm,
    pub attn2: Attention,
    pub norm3: LayerNorm,
    pub ff: FeedForward,
}

impl BasicTransformerBlock {
    pub fn new(
        w: &Weights,
        dim: usize,
        heads: usize,
        context_dim: usize,
    ) -> std::result::Result<Self, WeightsError> {
        let head_dim = dim / heads;
        Ok(Self {
            norm1: LayerNorm::new(&w.pp("norm1"), dim, 1e-5)?,
            attn1: Attention::new(&w.pp("attn1"), dim, None, heads, head_dim, false)?,
            norm2: LayerNorm::new(&w.pp("norm2"), dim, 1e-5)?,
            attn2: Attention::new(
                &w.pp("attn2"),
                dim,
                Some(context_dim),
                heads,
                head_dim,
                false,
            )?,
            norm3: LayerNorm::new(&w.pp("norm3"), dim, 1e-5)?,
            ff: FeedForward::new(&w.pp("ff"), dim)?,
        })
    }

    /// `x` `[B, L, dim]`, `context` `[B, Lc, context_dim]`.
    pub fn forward(&self, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        // The norms run inside the adapted frozen layers after them and the residuals inside the
        // output layers' ops (`Linear::forward_normed`, `Linear::forward_add`), where they can;
        // the residuals through `add_maybe_const` otherwise: below the first adapter they are
        // constants.
        let x = self
            .attn1
            .forward_normed_add(&Normed::new(x, &self.norm1), None, x)?;
        let x = self
            .attn2
            .forward_normed_add(&Normed::new(&x, &self.norm2), Some(context), &x)?;
        self.ff
            .forward_normed_add(&Normed::new(&x, &self.norm3), &x)
    }
}

impl VisitLayers for BasicTransformerBlock {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        self.attn1.visit_layers(f);
        self.attn2.visit_layers(f);
        self.ff.proj.visit_layers(f);
        self.ff.out.visit_layers(f);
    }
}

/// `proj_in`/`proj_out`: a 1×1 conv on `[B, C, H, W]` or a linear on `[B, HW, C]`.
#[derive(Debug, Clone)]
pub enum Projection {
    Conv(Conv2d),
    Linear(Linear),
}

impl Projection {
    fn new(
        w: &Weights,
        in_dim: usize,
        out_dim: usize,
        linear: bool,
    ) -> std::result::Result<Self, WeightsError> {
        Ok(if linear {
            Self::Linear(Linear::new(w, in_dim, out_dim, true)?)
        } else {
            Self::Conv(Conv2d::new(w, in_dim, out_dim, Conv2dConfig::same(1))?)
        })
    }
}

impl VisitLayers for Projection {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        match self {
            Self::Conv(c) => c.visit_layers(f),
            Self::Linear(l) => l.visit_layers(f),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Transformer2DModel {
    pub norm: GroupNorm,
    pub proj_in: Projection,
    pub transformer_blocks: Vec<BasicTransformerBlock>,
    pub proj_out: Projection,
}

/// What a `Transformer2DModel` needs beyond its weights.
#[derive(Debug, Clone, Copy)]
pub struct TransformerSpec {
    pub channels: usize,
    pub heads: usize,
    pub layers: usize,
    pub context_dim: usize,
    pub groups: usize,
    pub linear_projection: bool,
}

impl Transformer2DModel {
    pub fn new(w: &Weights, s: TransformerSpec) -> std::result::Result<Self, WeightsError> {
        let c = s.channels;
        let blocks = (0..s.layers)
            .map(|i| {
                BasicTransformerBlock::new(
                    &w.pp("transformer_blocks").pp(i),
                    c,
                    s.heads,
                    s.context_dim,
                )
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Self {
            norm: GroupNorm::new(&w.pp("norm"), s.groups, c, 1e-6)?,
            proj_in: Projection::new(&w.pp("proj_in"), c, c, s.linear_projection)?,
            transformer_blocks: blocks,
            proj_out: Projection::new(&w.pp("proj_out"), c, c, s.linear_projection)?,
        })
    }

    /// `x` `[B, C, H, W]`, `context` `[B, Lc, context_dim]`.
    pub fn forward(&self, x: &Tensor, context: &Tensor) -> Result<Tensor> {
        self.forward_layers(x, context, None)
    }

    /// [`Self::forward`] with each transformer block a checkpointed segment of its own under
    /// `ck`, as diffusers checkpoints them. Run inside the whole model's own segment (see
    /// `blocks::run_attention`), a recomputation then holds one block's activations at a time,
    /// not all of them: SDXL's ten-block transformers.
    pub fn forward_layers(
        &self,
        x: &Tensor,
        context: &Tensor,
        ck: Option<&Checkpointing>,
    ) -> Result<Tensor> {
        let (b, c, h, w) = x.dims4()?;
        let to_tokens = |t: &Tensor| t.permute((0, 2, 3, 1))?.reshape((b, h * w, c));
        let to_image = |t: &Tensor| t.reshape((b, h, w, c))?.permute((0, 3, 1, 2))?.contiguous();
        let normed = self.norm.forward(x)?;
        let mut tokens = match &self.proj_in {
            Projection::Conv(conv) => to_tokens(&conv.forward(&normed)?)?,
            Projection::Linear(lin) => lin.forward(&to_tokens(&normed)?)?,
        };
        for block in &self.transformer_blocks {
            tokens = match ck {
                None => block.forward(&tokens, context)?,
                Some(ck) => {
                    let block = block.clone();
                    ck.run(
                        &tokens,
                        Some(context),
                        std::sync::Arc::new(move |x: &Tensor, c: Option<&Tensor>| match c {
                            Some(c) => block.forward(x, c),
                            None => candle_core::bail!("checkpointed block lost its context"),
                        }),
                    )?
                }
            };
        }
        // `x + proj_out(…)`, the residual added inside a conv proj_out's op where it can be. A
        // linear one's output goes back to the image layout first (a copy; `x` as tokens would
        // be a copy too).
        match &self.proj_out {
            Projection::Conv(conv) => conv.forward_add(&to_image(&tokens)?, x),
            Projection::Linear(lin) => add_maybe_const(&to_image(&lin.forward(&tokens)?)?, x),
        }
    }
}

impl VisitLayers for Transformer2DModel {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        self.proj_in.visit_layers(f);
        self.transformer_blocks.visit_layers(f);
        self.proj_out.visit_layers(f);
    }
}
