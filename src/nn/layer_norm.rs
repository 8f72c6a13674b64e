//! Layer normalisation over the last dimension with an analytic backward (see
//! [`super::fused_op`]). For each row of `D` elements:
//!
//! ```text
//! forward:  μ = mean x;  r = 1/sqrt(var x + eps) (biased var);  x̂ = (x − μ)·r;  y = γ·x̂ + β
//!                                                                     (saved: μ, r; f32)
//! backward: dŷ = g·γ;   dx = r·(dŷ − mean dŷ − x̂·mean(dŷ·x̂))   (means over the row)
//!           dγ = Σ_rows g·x̂;   dβ = Σ_rows g
//! ```
//!
//! On a CUDA device the forward and backward are the kernels of kernels/norm.cu (see
//! `norm_cuda.rs`); elsewhere they are composed candle ops.
//!
//! Statistics and math are f32 whatever the input dtype; the output is cast back to `x`'s dtype
//! and each gradient to its argument's dtype. The graph keeps `x`, `γ`, `β`, the output and two
//! f32 scalars per row.

use candle_core::{DType, Result, Tensor, D};

use super::frozen::{broadcast_add_const, broadcast_mul_const};
use super::fused_op::{attach3, if_tracked, Backward3, Grads3};

/// `γ·(x − μ)/σ + β` over the last dimension of `x`; `weight`, `bias` `[D]`.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    for (what, p) in [("weight", weight), ("bias", bias)] {
        if p.dims() != [d] {
            candle_core::bail!(
                "layer norm: {what} {:?}, want [{d}] for input {:?}",
                p.dims(),
                x.dims()
            );
        }
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return super::norm_cuda::layer_norm(x, weight, bias, eps);
    }
    let (out, stats) = forward(&x.detach(), weight, bias, eps)?;
    attach3((x, weight, bias), "layer-norm", out, stats)
}

/// The norm of the detached `x` in `x`'s dtype, and its row statistics.
fn forward(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<(Tensor, Stats)> {
    let stats = Stats::of(x, eps)?;
    let out = stats
        .affine(x, &weight.detach(), &bias.detach())?
        .to_dtype(x.dtype())?;
    Ok((out, stats))
}

/// `∂L/∂x` of a norm for an upstream gradient, in the norm input's dtype.
pub(crate) type InputGrad = Box<dyn Fn(&Tensor) -> Result<Tensor>>;

/// [`layer_norm`]'s value (untracked) and its `∂L/∂x` from the same row statistics, one pass
/// over `x`: for an op that recomputes the norm inside its own backward (`nn::low_rank_input`)
/// instead of keeping the norm's output. The value is [`layer_norm`]'s bit for bit.
pub(crate) fn layer_norm_recomputed(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<(Tensor, InputGrad)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return super::norm_cuda::layer_norm_recomputed(x, weight, bias, eps);
    }
    let xd = x.detach();
    let (value, stats) = forward(&xd, weight, bias, eps)?;
    let (w, dtype) = (weight.detach(), x.dtype());
    let dx = move |g: &Tensor| stats.dx(&xd, &w, g)?.to_dtype(dtype);
    Ok((value, Box::new(dx)))
}

/// [`layer_norm`] from composed candle ops, every intermediate kept for backward.
pub fn layer_norm_reference(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let dtype = x.dtype();
    let x32 = x.to_dtype(DType::F32)?;
    let mean = x32.mean_keepdim(D::Minus1)?;
    let xc = x32.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let xn = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
    let w = weight.to_dtype(DType::F32)?;
    let b = bias.to_dtype(DType::F32)?;
    broadcast_add_const(&broadcast_mul_const(&xn, &w)?, &b)?.to_dtype(dtype)
}

/// Per-row mean and 1/σ, `[..., 1]` f32.
struct Stats {
    mean: Tensor,
    rstd: Tensor,
}

impl Stats {
    fn of(x: &Tensor, eps: f64) -> Result<Self> {
        let x32 = x.to_dtype(DType::F32)?;
        let mean = x32.mean_keepdim(D::Minus1)?;
        let var = x32.broadcast_sub(&mean)?.sqr()?.mean_keepdim(D::Minus1)?;
        let rstd = (var + eps)?.sqrt()?.recip()?;
        Ok(Self { mean, rstd })
    }

    /// `x̂`, f32.
    fn normalised(&self, x: &Tensor) -> Result<Tensor> {
        x.to_dtype(DType::F32)?
            .broadcast_sub(&self.mean)?
            .broadcast_mul(&self.rstd)
    }

    /// `γ·x̂ + β`, f32.
    fn affine(&self, x: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<Tensor> {
        self.normalised(x)?
            .broadcast_mul(&weight.to_dtype(DType::F32)?)?
            .broadcast_add(&bias.to_dtype(DType::F32)?)
    }
}

impl Backward3 for Stats {
    fn backward(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<Grads3> {
        let d = x.dim(D::Minus1)?;
        let g = grad.detach().to_dtype(DType::F32)?;
        let xhat = self.normalised(&x.detach())?;
        let per_feature = |t: &Tensor| t.reshape(((), d))?.sum(0);
        let dw = if_tracked(weight, || per_feature(&(&g * &xhat)?))?;
        let db = if_tracked(bias, || per_feature(&g))?;
        let dx = if_tracked(x, || self.dx_from(&xhat, weight, &g))?;
        Ok((dx, dw, db))
    }
}

impl Stats {
    /// `∂L/∂x` (f32) for the upstream gradient `grad`.
    fn dx(&self, x: &Tensor, weight: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let g = grad.detach().to_dtype(DType::F32)?;
        self.dx_from(&self.normalised(&x.detach())?, weight, &g)
    }

    /// `r·(dŷ − mean dŷ − x̂·mean(dŷ·x̂))`, `dŷ = g·γ`, from `x̂` and an f32 `g`.
    fn dx_from(&self, xhat: &Tensor, weight: &Tensor, g: &Tensor) -> Result<Tensor> {
        let dy = g.broadcast_mul(&weight.detach().to_dtype(DType::F32)?)?;
        let mean_dy = dy.mean_keepdim(D::Minus1)?;
        let mean_dy_xhat = (&dy * xhat)?.mean_keepdim(D::Minus1)?;
        dy.broadcast_sub(&mean_dy)?
            .sub(&xhat.broadcast_mul(&mean_dy_xhat)?)?
            .broadcast_mul(&self.rstd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::test_util::{assert_parity, fill};

    /// `x` `[2, 5, 13]` (batch 2, 5 tokens, odd width) with a per-row offset; `γ`, `β` far from
    /// 1 and 0.
    fn inputs(dtype: DType) -> Vec<Tensor> {
        let offset = Tensor::arange(0f32, 10., &candle_core::Device::Cpu)
            .unwrap()
            .reshape((2, 5, 1))
            .unwrap();
        let x = fill(&[2, 5, 13], 4, 2.0).broadcast_add(&offset).unwrap();
        let w = (fill(&[13], 5, 1.0) + 1.5).unwrap();
        let b = fill(&[13], 6, 0.8);
        vec![x.to_dtype(dtype).unwrap(), w, b]
    }

    fn check(dtype: DType, track: [bool; 3], tol: f32) {
        assert_parity(
            &format!("{dtype:?} track {track:?}"),
            &inputs(dtype),
            &track,
            tol,
            &|a| layer_norm(&a[0], &a[1], &a[2], 1e-5),
            &|a| layer_norm_reference(&a[0], &a[1], &a[2], 1e-5),
        );
    }

    /// Catches a dropped `mean dŷ` or `x̂·mean(dŷ·x̂)` term, a missing 1/D, `γ` left out of `dŷ`,
    /// and `dγ`/`dβ` summed over the wrong axis.
    #[test]
    fn layer_norm_matches_reference_forward_and_backward() {
        check(DType::F32, [true; 3], 1e-5);
        check(DType::F32, [true, false, false], 1e-5);
        check(DType::F32, [false, true, true], 1e-5);
    }

    /// bf16 activations with f32 γ/β; catches math in bf16 or a gradient in the wrong dtype.
    #[test]
    fn layer_norm_bf16_matches_reference() {
        check(DType::BF16, [true; 3], 1e-2);
    }
}
