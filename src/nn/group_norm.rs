//! Group normalisation, alone and fused with the SiLU that follows it in every diffusers resnet
//! (`silu(norm(x))`), with an analytic backward (see [`super::fused_op`]).
//!
//! For `x` `[B, C, ...]` split into `G` groups of `N = C/G · spatial` elements, per group:
//!
//! ```text
//! forward:  μ = mean x;  r = 1/sqrt(var x + eps) (biased var);  x̂ = (x − μ)·r;  y = γ·x̂ + β
//!           fused:  out = silu(y) = y·σ(y)                                (saved: μ, r; f32)
//! backward: g_y = g                    (fused: g_y = g·σ(y)·(1 + y·(1 − σ(y))), y recomputed)
//!           dŷ = g_y·γ;   dx = r·(dŷ − mean dŷ − x̂·mean(dŷ·x̂))   (means over the group)
//!           dγ = Σ_{b, spatial} g_y·x̂;   dβ = Σ_{b, spatial} g_y
//! ```
//!
//! On a CUDA device the forward and backward are the kernels of kernels/norm.cu (see
//! `norm_cuda.rs`), on the CPU those of `cpu_group_norm.rs`; elsewhere they are composed candle
//! ops.
//!
//! Statistics and math are f32 whatever the input dtype (as torch does for half inputs on CUDA);
//! the output is cast back to `x`'s dtype and each gradient to its argument's dtype. The graph
//! keeps `x`, `γ`, `β`, the output and two f32 scalars per (sample, group).

use candle_core::{DType, Result, Tensor};

use super::cpu_group_norm;
use super::frozen::{broadcast_add_const, broadcast_mul_const};
use super::fused_op::{attach3, if_tracked, Backward3, Grads3};

/// `γ·(x − μ)/σ + β` per group of `x` `[B, C, ...]`; `weight`, `bias` `[C]`.
pub fn group_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
) -> Result<Tensor> {
    fused(x, weight, bias, groups, eps, false)
}

/// `silu(group_norm(x))` as one op: the normalised activation is recomputed in backward instead
/// of kept.
pub fn group_norm_silu(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
) -> Result<Tensor> {
    fused(x, weight, bias, groups, eps, true)
}

/// [`group_norm`] from composed candle ops, every intermediate kept for backward.
pub fn group_norm_reference(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
) -> Result<Tensor> {
    let dtype = x.dtype();
    let dims = x.dims().to_vec();
    let b = dims[0];
    let xg = x.to_dtype(DType::F32)?.reshape((b, groups, ()))?;
    let mean = xg.mean_keepdim(2)?;
    let xc = xg.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(2)?;
    let xn = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
    let shape = affine_shape(&dims);
    let w = weight.to_dtype(DType::F32)?.reshape(shape.as_slice())?;
    let bias = bias.to_dtype(DType::F32)?.reshape(shape.as_slice())?;
    xn.reshape(dims.as_slice())?
        .apply(&|t: &Tensor| broadcast_mul_const(t, &w))?
        .apply(&|t: &Tensor| broadcast_add_const(t, &bias))?
        .to_dtype(dtype)
}

/// [`group_norm_silu`] from composed candle ops.
pub fn group_norm_silu_reference(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
) -> Result<Tensor> {
    super::silu(&group_norm_reference(x, weight, bias, groups, eps)?)
}

/// `[1, C, 1, ...]` for an input of `dims` `[B, C, ...]`.
fn affine_shape(dims: &[usize]) -> Vec<usize> {
    let mut shape = vec![1usize; dims.len()];
    shape[1] = dims[1];
    shape
}

fn check(x: &Tensor, weight: &Tensor, bias: &Tensor, groups: usize) -> Result<()> {
    let dims = x.dims();
    if dims.len() < 2 || groups == 0 || !dims[1].is_multiple_of(groups) {
        candle_core::bail!("group norm: input {dims:?} cannot be split into {groups} groups");
    }
    for (what, p) in [("weight", weight), ("bias", bias)] {
        if p.dims() != [dims[1]] {
            candle_core::bail!(
                "group norm: {what} {:?}, want [{}] for input {dims:?}",
                p.dims(),
                dims[1]
            );
        }
    }
    Ok(())
}

fn fused(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
    silu: bool,
) -> Result<Tensor> {
    check(x, weight, bias, groups)?;
    let (out, backward) = parts(x, weight, bias, groups, eps, silu)?;
    let name = if silu {
        "group-norm-silu"
    } else {
        "group-norm"
    };
    attach3((x, weight, bias), name, out, backward)
}

/// The fused op's forward on detached operands (the CUDA kernels or composed ops) and its
/// backward, for ops that carry it themselves (`super::norm_conv`). The backward reads only
/// `x`, `γ`, `β` and the upstream gradient (not the output).
pub(crate) fn parts(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
    silu: bool,
) -> Result<(Tensor, Box<dyn Backward3>)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return super::norm_cuda::group_norm_parts(x, weight, bias, groups, eps, silu);
    }
    if cpu_group_norm::supported(x) {
        let xd = x.detach().contiguous()?;
        let st = cpu_group_norm::stats(&xd, groups, eps)?;
        let out = cpu_group_norm::forward(&xd, &f32s(weight)?, &f32s(bias)?, &st, silu)?;
        return Ok((out, Box::new(CpuBackward { st, silu })));
    }
    composed_parts(x, weight, bias, groups, eps, silu)
}

/// [`parts`] as composed candle ops in f32 (devices with neither kernel; the tests' second
/// reference).
fn composed_parts(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
    silu: bool,
) -> Result<(Tensor, Box<dyn Backward3>)> {
    let stats = Stats::of(&x.detach(), groups, eps)?;
    let y = stats.affine(&x.detach(), &weight.detach(), &bias.detach())?;
    let out = if silu { y.silu()? } else { y }.to_dtype(x.dtype())?;
    Ok((out, Box::new(GroupNormBackward { stats, silu })))
}

/// Per-(sample, group) mean and 1/σ, `[B, G, 1]` f32.
struct Stats {
    groups: usize,
    mean: Tensor,
    rstd: Tensor,
}

impl Stats {
    fn of(x: &Tensor, groups: usize, eps: f64) -> Result<Self> {
        let xg = x.to_dtype(DType::F32)?.reshape((x.dim(0)?, groups, ()))?;
        let mean = xg.mean_keepdim(2)?;
        let var = xg.broadcast_sub(&mean)?.sqr()?.mean_keepdim(2)?;
        let rstd = (var + eps)?.sqrt()?.recip()?;
        Ok(Self { groups, mean, rstd })
    }

    /// `x̂` in the grouped view `[B, G, N]`, f32.
    fn normalised(&self, x: &Tensor) -> Result<Tensor> {
        let xg = x
            .to_dtype(DType::F32)?
            .reshape((x.dim(0)?, self.groups, ()))?;
        xg.broadcast_sub(&self.mean)?.broadcast_mul(&self.rstd)
    }

    /// `γ·x̂ + β` in `x`'s shape, f32.
    fn affine(&self, x: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<Tensor> {
        let shape = affine_shape(x.dims());
        let w = weight.to_dtype(DType::F32)?.reshape(shape.as_slice())?;
        let b = bias.to_dtype(DType::F32)?.reshape(shape.as_slice())?;
        self.normalised(x)?
            .reshape(x.dims())?
            .broadcast_mul(&w)?
            .broadcast_add(&b)
    }
}

struct GroupNormBackward {
    stats: Stats,
    silu: bool,
}

impl GroupNormBackward {
    /// The gradient at the norm's output `y`: `g`, or through the fused SiLU.
    fn grad_y(&self, x: &Tensor, w: &Tensor, b: &Tensor, g: &Tensor) -> Result<Tensor> {
        if !self.silu {
            return Ok(g.clone());
        }
        let y = self.stats.affine(x, w, b)?;
        let s = candle_nn::ops::sigmoid(&y)?;
        // σ'-term of silu: σ(y)·(1 + y·(1 − σ(y))).
        let ds = (&s * ((&y * (1.0 - &s)?)? + 1.0)?)?;
        g * ds
    }
}

impl Backward3 for GroupNormBackward {
    fn backward(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<Grads3> {
        let (xd, w, b) = (x.detach(), weight.detach(), bias.detach());
        let dims = x.dims().to_vec();
        let (n, c) = (dims[0], dims[1]);
        let g = self.grad_y(&xd, &w, &b, &grad.detach().to_dtype(DType::F32)?)?;
        let xhat = self.stats.normalised(&xd)?;
        // Sums over every dim but the channel: `[B, C, rest]` → `[C]`.
        let per_channel = |t: &Tensor| t.reshape((n, c, ()))?.sum(2)?.sum(0);
        let dw = if_tracked(weight, || {
            per_channel(&(&g * xhat.reshape(dims.as_slice())?)?)
        })?;
        let db = if_tracked(bias, || per_channel(&g))?;
        let dx = if_tracked(x, || {
            let shape = affine_shape(&dims);
            let w32 = w.to_dtype(DType::F32)?.reshape(shape.as_slice())?;
            let dy = g.broadcast_mul(&w32)?.reshape((n, self.stats.groups, ()))?;
            let mean_dy = dy.mean_keepdim(2)?;
            let mean_dy_xhat = (&dy * &xhat)?.mean_keepdim(2)?;
            let inner = dy
                .broadcast_sub(&mean_dy)?
                .sub(&xhat.broadcast_mul(&mean_dy_xhat)?)?;
            inner
                .broadcast_mul(&self.stats.rstd)?
                .reshape(dims.as_slice())
        })?;
        Ok((dx, dw, db))
    }
}

/// A `[C]` parameter's values in f32.
fn f32s(t: &Tensor) -> Result<Vec<f32>> {
    t.detach().to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

/// The backward of the CPU kernels (`cpu_group_norm`).
struct CpuBackward {
    st: cpu_group_norm::Stats,
    silu: bool,
}

impl Backward3 for CpuBackward {
    fn backward(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<Grads3> {
        let (gamma, beta) = (f32s(weight)?, f32s(bias)?);
        let xd = x.detach().contiguous()?;
        let (dx, dw, db) = cpu_group_norm::backward(
            &xd,
            &grad.detach(),
            &gamma,
            &beta,
            &self.st,
            self.silu,
            x.track_op(),
        )?;
        let param =
            |t: &Tensor, v: Vec<f32>| if_tracked(t, || Tensor::from_vec(v, t.dims(), t.device()));
        Ok((dx, param(weight, dw)?, param(bias, db)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::test_util::{assert_parity, fill};

    /// `x` `[3, 12, 5, 7]` (batch 3, 4 groups of 3 channels, odd spatial) with a per-group
    /// offset, so that a dropped mean term or a wrong group split changes the result; `γ`, `β`
    /// far from 1 and 0, so that a dropped or misplaced affine term does.
    fn inputs(dtype: DType) -> Vec<Tensor> {
        let offset = Tensor::arange(0f32, 12., &candle_core::Device::Cpu)
            .unwrap()
            .reshape((1, 12, 1, 1))
            .unwrap();
        let x = fill(&[3, 12, 5, 7], 1, 2.0).broadcast_add(&offset).unwrap();
        let w = (fill(&[12], 2, 1.0) + 1.5).unwrap();
        let b = fill(&[12], 3, 0.8);
        vec![x.to_dtype(dtype).unwrap(), w, b]
    }

    type NormFn = fn(&Tensor, &Tensor, &Tensor, usize, f64) -> Result<Tensor>;

    fn check(silu: bool, dtype: DType, track: [bool; 3], tol: f32) {
        let (groups, eps) = (4, 1e-5);
        let (fused, reference): (NormFn, NormFn) = if silu {
            (group_norm_silu, group_norm_silu_reference)
        } else {
            (group_norm, group_norm_reference)
        };
        assert_parity(
            &format!("silu {silu} {dtype:?} track {track:?}"),
            &inputs(dtype),
            &track,
            tol,
            &|a| fused(&a[0], &a[1], &a[2], groups, eps),
            &|a| reference(&a[0], &a[1], &a[2], groups, eps),
        );
    }

    /// Catches a dropped `mean dŷ` or `x̂·mean(dŷ·x̂)` term, a sum where a mean belongs (a missing
    /// 1/N), statistics over channels instead of groups, `γ` left out of `dŷ`, and a `dγ`/`dβ`
    /// summed over the wrong axes.
    #[test]
    fn group_norm_matches_reference_forward_and_backward() {
        for silu in [false, true] {
            check(silu, DType::F32, [true; 3], 1e-5); // full fine-tune
            check(silu, DType::F32, [true, false, false], 1e-5); // LoRA: frozen γ, β
            check(silu, DType::F32, [false, true, true], 1e-5); // constant input
        }
    }

    /// bf16 activations with f32 γ/β (the autocast case): statistics in f32, the output and
    /// `dx` in bf16, `dγ`/`dβ` in f32. Catches math done in bf16 or a gradient left in f32.
    #[test]
    fn group_norm_bf16_matches_reference() {
        for silu in [false, true] {
            check(silu, DType::BF16, [true; 3], 1e-2);
        }
    }

    /// The composed form (for devices with neither kernel) against the reference, now that the
    /// CPU runs its kernels: a wrong term there fails here.
    #[test]
    fn the_composed_form_matches_the_reference() {
        fn composed(a: &[Tensor], silu: bool) -> Result<Tensor> {
            let (out, back) = composed_parts(&a[0], &a[1], &a[2], 4, 1e-5, silu)?;
            attach3((&a[0], &a[1], &a[2]), "group-norm-composed", out, back)
        }
        for silu in [false, true] {
            let reference: NormFn = if silu {
                group_norm_silu_reference
            } else {
                group_norm_reference
            };
            assert_parity(
                &format!("composed silu {silu}"),
                &inputs(DType::F32),
                &[true; 3],
                1e-5,
                &|a| composed(a, silu),
                &|a| reference(&a[0], &a[1], &a[2], 4, 1e-5),
            );
        }
    }

    /// f16 activations through the CPU kernels; and a `[B, C, L]` input and a `[B, C]` one (one
    /// pixel per channel), which the kernels' pixel count covers.
    #[test]
    fn group_norm_takes_f16_and_other_ranks() {
        for silu in [false, true] {
            check(silu, DType::F16, [true; 3], 2e-2);
        }
        let a = inputs(DType::F32);
        for dims in [&[3usize, 12, 35][..], &[3, 12][..]] {
            let x = fill(dims, 4, 2.0);
            assert_parity(
                &format!("rank {}", dims.len()),
                &[x, a[1].clone(), a[2].clone()],
                &[true; 3],
                1e-5,
                &|t| group_norm_silu(&t[0], &t[1], &t[2], 4, 1e-5),
                &|t| group_norm_silu_reference(&t[0], &t[1], &t[2], 4, 1e-5),
            );
        }
    }

    #[test]
    fn group_norm_rejects_a_bad_split() {
        let a = inputs(DType::F32);
        assert!(group_norm(&a[0], &a[1], &a[2], 5, 1e-5).is_err());
        assert!(group_norm(&a[0], &a[1].narrow(0, 0, 6).unwrap(), &a[2], 4, 1e-5).is_err());
    }
}
