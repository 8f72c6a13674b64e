//! Nearest-neighbour upsampling by integer factors, as a broadcast and one copy.
//!
//! Candle's `upsample_nearest2d` computes its backward as a grouped `conv2d` with one group per
//! channel, which candle runs as a loop: an im2col and a GEMV launch per channel (3,200 pairs of
//! launches in one SD1.5 backward on an H100, 2026-11-24). Written as reshape → broadcast →
//! reshape, the backward is candle's broadcast rule: one sum over the two repeated axes.

use candle_core::{Result, Tensor};

/// `x` `[B, C, H, W]` → `[B, C, H·fh, W·fw]`, every value repeated over an `fh × fw` block
/// (torch's `interpolate(mode="nearest")` at an integer scale).
pub fn upsample_nearest(x: &Tensor, fh: usize, fw: usize) -> Result<Tensor> {
    let (b, c, h, w) = x.dims4()?;
    x.reshape((b, c, h, 1, w, 1))?
        .broadcast_as((b, c, h, fh, w, fw))?
        .reshape((b, c, h * fh, w * fw))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::test_util::{max_abs, randn};
    use candle_core::{DType, Var};

    /// Plain loops: `y[b, c, i, j] = x[b, c, i / fh, j / fw]`, and the input gradient summing
    /// `r` over each `fh × fw` block.
    fn reference(x: &Tensor, r: &Tensor, fh: usize, fw: usize) -> (Vec<f32>, Vec<f32>) {
        let (b, c, h, w) = x.dims4().unwrap();
        let xv: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        let rv: Vec<f32> = r.flatten_all().unwrap().to_vec1().unwrap();
        let (oh, ow) = (h * fh, w * fw);
        let mut y = vec![0f32; b * c * oh * ow];
        let mut gx = vec![0f32; xv.len()];
        for p in 0..b * c {
            for i in 0..oh {
                for j in 0..ow {
                    let src = p * h * w + (i / fh) * w + j / fw;
                    let dst = p * oh * ow + i * ow + j;
                    y[dst] = xv[src];
                    gx[src] += rv[dst];
                }
            }
        }
        (y, gx)
    }

    /// Forward and input gradient under a random upstream gradient against plain loops, at equal
    /// and unequal factors on a non-square input, and against candle's own `upsample_nearest2d`
    /// at 2×2 (its backward takes equal factors only). Catches swapped factors, a repeat over the
    /// wrong axis, or a gradient that takes one value of the block instead of summing it.
    #[test]
    fn matches_reference_forward_and_backward() {
        let flat = |t: &Tensor| -> Vec<f32> { t.flatten_all().unwrap().to_vec1().unwrap() };
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| (p - q).abs() < 1e-5);
        for (fh, fw) in [(2, 2), (3, 2), (1, 2)] {
            let x = Var::from_tensor(&randn(&[2, 3, 4, 5], 1)).unwrap();
            let r = randn(&[2, 3, 4 * fh, 5 * fw], 2);
            let y = upsample_nearest(x.as_tensor(), fh, fw).unwrap();
            let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let gx = grads.get(x.as_tensor()).unwrap();
            let (want_y, want_gx) = reference(x.as_tensor(), &r, fh, fw);
            assert_eq!(flat(&y), want_y, "forward ({fh}, {fw})");
            assert!(close(&flat(gx), &want_gx), "input gradient ({fh}, {fw})");
        }
        let x = randn(&[1, 2, 3, 4], 3);
        let want = x.upsample_nearest2d(6, 8).unwrap();
        assert_eq!(max_abs(&upsample_nearest(&x, 2, 2).unwrap(), &want), 0.0);
    }

    /// bf16 works on the CPU too (candle's grouped conv has no CPU bf16 kernel).
    #[test]
    fn runs_in_bf16_on_the_cpu() {
        let x = randn(&[1, 2, 3, 3], 3).to_dtype(DType::BF16).unwrap();
        let y = upsample_nearest(&x, 2, 2).unwrap();
        let want = x
            .to_dtype(DType::F32)
            .unwrap()
            .upsample_nearest2d(6, 6)
            .unwrap();
        assert_eq!(max_abs(&y, &want), 0.0);
    }
}
