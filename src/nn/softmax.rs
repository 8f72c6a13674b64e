//! Softmax over the last dimension with an analytic backward (see [`super::fused_op`]):
//!
//! ```text
//! forward:  y = exp(x − max x) / Σ exp(x − max x)       (candle-nn's fused kernel, in f32)
//! backward: dx = y·(g − Σ g·y)                           (sums over the row; y is the output)
//! ```
//!
//! The graph keeps only the output `y` (the op's result); the composed reference keeps the
//! shifted input, its exponential and the row sums besides. Math is f32 whatever the input dtype;
//! the output and `dx` are cast back to `x`'s dtype.

use candle_core::{DType, Result, Tensor, D};

use super::fused_op::{attach1, Backward1};

/// `softmax(x)` over the last dimension.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    // candle-nn's kernel has no backward, so it only ever sees a detached operand.
    let x32 = x.detach().to_dtype(DType::F32)?.contiguous()?;
    let out = candle_nn::ops::softmax_last_dim(&x32)?.to_dtype(x.dtype())?;
    attach1(x, "softmax-last-dim", out, SoftmaxBackward)
}

/// [`softmax_last_dim`] from composed candle ops, every intermediate kept for backward.
pub fn softmax_last_dim_reference(x: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    candle_nn::ops::softmax(&x.to_dtype(DType::F32)?, D::Minus1)?.to_dtype(dtype)
}

struct SoftmaxBackward;

impl Backward1 for SoftmaxBackward {
    fn backward(&self, x: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let y = res.detach().to_dtype(DType::F32)?;
        let g = grad.detach().to_dtype(DType::F32)?;
        let dot = (&g * &y)?.sum_keepdim(D::Minus1)?;
        (y * g.broadcast_sub(&dot)?)?.to_dtype(x.dtype())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::test_util::{assert_parity, fill};

    /// Scores `[2, 3, 5, 11]` (batch 2, 3 heads, odd row length) with a causal-style mask: the
    /// most negative f32 above the diagonal, as CLIP adds it.
    fn scores() -> Tensor {
        let x = fill(&[2, 3, 5, 11], 7, 4.0);
        let mask: Vec<f32> = (0..5)
            .flat_map(|i| (0..11).map(move |j| if j > i + 3 { f32::MIN } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (1, 1, 5, 11), &candle_core::Device::Cpu).unwrap();
        x.broadcast_add(&mask).unwrap()
    }

    /// Catches a dropped `Σ g·y` term, the sum taken over the wrong axis, and `g·y` where
    /// `y·(g − Σ g·y)` belongs; the mask checks that fully suppressed entries stay finite.
    #[test]
    fn softmax_matches_reference_forward_and_backward() {
        assert_parity(
            "softmax f32",
            &[scores()],
            &[true],
            1e-5,
            &|a| softmax_last_dim(&a[0]),
            &|a| softmax_last_dim_reference(&a[0]),
        );
    }

    /// bf16 scores: the math in f32, the output and gradient back in bf16.
    #[test]
    fn softmax_bf16_matches_reference() {
        let x = fill(&[2, 3, 5, 11], 8, 4.0).to_dtype(DType::BF16).unwrap();
        assert_parity(
            "softmax bf16",
            &[x],
            &[true],
            1e-2,
            &|a| softmax_last_dim(&a[0]),
            &|a| softmax_last_dim_reference(&a[0]),
        );
    }
}
