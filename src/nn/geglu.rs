//! GEGLU, diffusers' gated feed-forward activation, with an analytic backward (see
//! [`super::fused_op`]). For the projection output `p = [a, z]` split in two along the last
//! dimension:
//!
//! ```text
//! forward:  out = a · gelu(z),   gelu(z) = z·Φ(z)   (exact erf GELU, as diffusers' F.gelu)
//! backward: da = g · gelu(z);    dz = g · a · gelu'(z),   gelu'(z) = Φ(z) + z·φ(z)
//! ```
//!
//! with `Φ` the standard normal CDF, `½(1 + erf(z/√2))`, and `φ` its density. The graph keeps only
//! the projection output `p`; the composed reference keeps `gelu(z)` besides (half of `p`'s
//! size). Math is f32 whatever the input dtype; the output and `dp` are cast back. On a CUDA
//! device forward and backward are the kernels of kernels/norm.cu (see `norm_cuda.rs`), on the
//! CPU the row kernels below, elsewhere composed candle ops.

use std::f64::consts::FRAC_1_SQRT_2;

use candle_core::{DType, Result, Tensor, D};

use super::fused_op::{attach1, Backward1};

/// `a · gelu_erf(z)` for `p = [a, z]` `[..., 2·I]` → `[..., I]`.
pub fn geglu(p: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if p.device().is_cuda() {
        return super::norm_cuda::geglu(p);
    }
    let out = if super::cpu_elem::supported(p) {
        cpu::run(p, None)?
    } else {
        let (a, z) = halves(&p.detach().to_dtype(DType::F32)?)?;
        (a * z.gelu_erf()?)?.to_dtype(p.dtype())?
    };
    attach1(p, "geglu", out, GegluBackward)
}

/// [`geglu`]'s value, untracked: what an op that takes `geglu(p)` as its input computes, and
/// computes again in its backward rather than keep it (`nn::geglu_low_rank`).
pub(crate) fn geglu_detached(p: &Tensor) -> Result<Tensor> {
    geglu(&p.detach())
}

/// `∂L/∂p` for the upstream gradient `grad` of `geglu(p)`, in `p`'s dtype: [`geglu`]'s
/// backward, for an op that recomputes `geglu(p)` inside its own.
pub(crate) fn geglu_grad(p: &Tensor, grad: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if p.device().is_cuda() {
        return super::norm_cuda::geglu_grad(p, grad);
    }
    GegluBackward.backward(p, p, grad)
}

/// [`geglu`] from composed candle ops in `p`'s dtype, every intermediate kept for backward.
pub fn geglu_reference(p: &Tensor) -> Result<Tensor> {
    let (a, z) = halves(p)?;
    a * super::gelu_erf(&z)?
}

/// [`geglu`], or [`geglu_reference`] where custom ops have no forward or the fused ops are off.
pub fn geglu_layer(p: &Tensor) -> Result<Tensor> {
    if super::fused_op::use_fused(p) {
        geglu(p)
    } else {
        geglu_reference(p)
    }
}

/// The two halves of the last dimension, `(a, z)`.
fn halves(p: &Tensor) -> Result<(Tensor, Tensor)> {
    let two_i = p.dim(D::Minus1)?;
    if two_i % 2 != 0 {
        candle_core::bail!("geglu: last dimension of {:?} is odd", p.dims());
    }
    let i = two_i / 2;
    Ok((p.narrow(D::Minus1, 0, i)?, p.narrow(D::Minus1, i, i)?))
}

/// `1/√(2π)`, the standard normal density's normalisation.
const INV_SQRT_2PI: f64 = 0.5 * std::f64::consts::FRAC_2_SQRT_PI * FRAC_1_SQRT_2;

struct GegluBackward;

impl Backward1 for GegluBackward {
    fn backward(&self, p: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Tensor> {
        if super::cpu_elem::supported(p) {
            return cpu::run(p, Some(grad));
        }
        let (a, z) = halves(&p.detach().to_dtype(DType::F32)?)?;
        let g = grad.detach().to_dtype(DType::F32)?;
        let cdf = (((&z * FRAC_1_SQRT_2)?.erf()? + 1.0)? * 0.5)?;
        let pdf = ((z.sqr()? * -0.5)?.exp()? * INV_SQRT_2PI)?;
        let dgelu = (cdf + (&z * pdf)?)?;
        let da = (&g * z.gelu_erf()?)?;
        let dz = ((g * a)? * dgelu)?;
        Tensor::cat(&[da, dz], D::Minus1)?.to_dtype(p.dtype())
    }
}

/// The CPU kernels: one pass over each row of `p`, each element in f32, reading and writing
/// `p`'s own dtype (no f32 copy of `p`, the gradient or the result).
mod cpu {
    use candle_core::{Result, Tensor, D};
    use rayon::prelude::*;

    use super::INV_SQRT_2PI;
    use crate::nn::cpu_elem::{dispatch, with_slice, Elem};

    /// The forward (`grad` None, `[..., I]`) or the backward (`[..., 2·I]`), in `p`'s dtype.
    pub(super) fn run(p: &Tensor, grad: Option<&Tensor>) -> Result<Tensor> {
        let p = p.detach().contiguous()?;
        let two_i = p.dim(D::Minus1)?;
        if two_i % 2 != 0 {
            candle_core::bail!("geglu: last dimension of {:?} is odd", p.dims());
        }
        let i = two_i / 2;
        let mut dims = p.dims().to_vec();
        match grad {
            None => {
                if let Some(last) = dims.last_mut() {
                    *last = i;
                }
                dispatch!("geglu", &p, |ps| {
                    Tensor::from_vec(forward(ps, i), dims.as_slice(), p.device())
                })?
            }
            Some(g) => {
                let g = g.detach().to_dtype(p.dtype())?.contiguous()?;
                dispatch!("geglu", &p, |ps| {
                    with_slice(&g, |gs| {
                        Tensor::from_vec(backward(ps, gs, i), dims.as_slice(), p.device())
                    })
                })??
            }
        }
    }

    /// `Φ(z)` and `φ(z)`.
    fn cdf_pdf(z: f32) -> (f32, f32) {
        let cdf = 0.5 * (1.0 + libm::erff(z * std::f32::consts::FRAC_1_SQRT_2));
        let pdf = (-0.5 * z * z).exp() * INV_SQRT_2PI as f32;
        (cdf, pdf)
    }

    fn forward<T: Elem>(p: &[T], i: usize) -> Vec<T> {
        let mut out = vec![T::default(); p.len() / 2];
        out.par_chunks_mut(i.max(1))
            .zip(p.par_chunks(2 * i.max(1)))
            .for_each(|(o, row)| {
                let (a, z) = row.split_at(i);
                for ((o, a), z) in o.iter_mut().zip(a).zip(z) {
                    let z = z.f();
                    *o = T::of(a.f() * z * cdf_pdf(z).0);
                }
            });
        out
    }

    fn backward<T: Elem>(p: &[T], g: &[T], i: usize) -> Vec<T> {
        let mut out = vec![T::default(); p.len()];
        out.par_chunks_mut(2 * i.max(1))
            .zip(p.par_chunks(2 * i.max(1)))
            .zip(g.par_chunks(i.max(1)))
            .for_each(|((o, row), g)| {
                let (a, z) = row.split_at(i);
                let (da, dz) = o.split_at_mut(i);
                for j in 0..i {
                    let (zj, gj) = (z[j].f(), g[j].f());
                    let (cdf, pdf) = cdf_pdf(zj);
                    da[j] = T::of(gj * zj * cdf);
                    dz[j] = T::of(gj * a[j].f() * (cdf + zj * pdf));
                }
            });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::test_util::{assert_parity, fill};

    /// Catches `Φ(z)` where `gelu'(z) = Φ(z) + z·φ(z)` belongs (a dropped density term), a wrong
    /// `φ` normalisation, the halves swapped in backward, and `da`/`dz` concatenated in the wrong
    /// order. `[2, 3, 14]`: batch 2, 3 tokens, 7 features per half; `z` spans [−3, 3).
    #[test]
    fn geglu_matches_reference_forward_and_backward() {
        assert_parity(
            "geglu f32",
            &[fill(&[2, 3, 14], 9, 3.0)],
            &[true],
            1e-5,
            &|a| geglu(&a[0]),
            &|a| geglu_reference(&a[0]),
        );
    }

    /// bf16: the fused op computes in f32 and rounds once, so it is compared with the f32
    /// reference on the same bf16 values; catches a gradient left in f32.
    #[test]
    fn geglu_bf16_matches_reference() {
        let p = fill(&[2, 3, 14], 10, 3.0).to_dtype(DType::BF16).unwrap();
        let to32 = |t: &Tensor| t.to_dtype(DType::F32);
        assert_parity("geglu bf16", &[p], &[true], 1e-2, &|a| geglu(&a[0]), &|a| {
            geglu_reference(&to32(&a[0])?)?.to_dtype(DType::BF16)
        });
    }
}
