//! A LayerNorm's output for the layers that read it (a transformer block's `to_q`, `to_k`,
//! `to_v` after `norm1`), computed once and in the form each layer wants: as a value for the
//! adapted frozen layers that take the norm inside their op and keep only its input
//! ([`super::Linear::forward_normed`], `nn::low_rank_input`), as a tracked tensor for the others.
//! When every reader takes the norm inside its op, the norm's output is never a tensor of the
//! graph.

use std::cell::OnceCell;

use candle_core::{Result, Tensor};

use super::low_rank_input::DerivedInput;
use super::LayerNorm;

pub struct Normed<'a> {
    /// The norm's input (the block's residual stream).
    pub x: &'a Tensor,
    norm: &'a LayerNorm,
    value: OnceCell<Tensor>,
    tracked: OnceCell<Tensor>,
}

/// The cell's tensor, made by `f` the first time.
fn cached(cell: &OnceCell<Tensor>, f: impl FnOnce() -> Result<Tensor>) -> Result<&Tensor> {
    if let Some(t) = cell.get() {
        return Ok(t);
    }
    let t = f()?;
    Ok(cell.get_or_init(|| t))
}

impl<'a> Normed<'a> {
    pub fn new(x: &'a Tensor, norm: &'a LayerNorm) -> Self {
        Self {
            x,
            norm,
            value: OnceCell::new(),
            tracked: OnceCell::new(),
        }
    }

    /// The norm as an op's derived input, when a layer may take it inside its op: `γ` and `β`
    /// frozen (adapter modes) and the fused ops on (the op recomputes with the fused norm).
    pub fn derived(&self) -> Option<DerivedInput> {
        let frozen = super::frozen::is_frozen(&self.norm.weight)
            && super::frozen::is_frozen(&self.norm.bias)
            && super::fused_op::use_fused(self.x);
        frozen.then(|| DerivedInput::LayerNorm {
            weight: self.norm.weight.clone(),
            bias: self.norm.bias.clone(),
            eps: self.norm.eps,
        })
    }

    /// The norm's output, untracked (the tracked one's value when a layer made it already).
    pub fn value(&self) -> Result<&Tensor> {
        cached(&self.value, || match self.tracked.get() {
            Some(t) => Ok(t.detach()),
            None => self.norm.forward(&self.x.detach()),
        })
    }

    /// The norm's output as a tensor of the graph, for a layer that reads it as its input.
    pub fn tracked(&self) -> Result<&Tensor> {
        cached(&self.tracked, || self.norm.forward(self.x))
    }
}
