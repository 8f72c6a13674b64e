//! Training-only perturbations of the UNet's inputs; the target is left alone.
//!
//! - **Input perturbation** (Ning et al., arXiv 2301.11706; diffusers
//!   `examples/text_to_image/train_text_to_image.py` `--input_perturbation`, kohya
//!   `--ip_noise_gamma`): the UNet sees `x_t = √ᾱ_t·x₀ + √(1−ᾱ_t)·(ε + γ·ξ)` with a second
//!   `ξ ~ N(0, I)`, while the target stays built from `ε`. kohya's
//!   `--ip_noise_gamma_random_strength` draws the strength `U[0, 1)·γ` each step; sdtrain draws
//!   it per sample (kohya: one per batch), so that a sample's draws do not depend on which
//!   micro-batch it is in.
//! - **Embedding perturbation** (EveryDream2 `train.py`, after arXiv 2405.20494): the text
//!   conditioning `c` `[B, L, D]` becomes `c + (p/√D)·ζ` with `ζ ~ N(0, I)`. Each sample's `ζ`
//!   comes from a seed drawn from its own generator, as the conditioning's shape is known only
//!   once the captions are encoded.

use candle_core::Tensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;
use serde::Serialize;

/// kohya's `ip_noise_gamma` (diffusers' `input_perturbation`) and
/// `ip_noise_gamma_random_strength`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct InputPerturbation {
    pub gamma: f64,
    pub random_strength: bool,
}

impl InputPerturbation {
    /// The strength for one sample: `γ`, or `U[0, 1)·γ` (one draw).
    pub fn strength<R: Rng + ?Sized>(&self, rng: &mut R) -> f64 {
        if self.random_strength {
            rng.random::<f64>() * self.gamma
        } else {
            self.gamma
        }
    }
}

/// The UNet's noise with input perturbation: `ε + s·ξ` (f32 arithmetic, in `noise`'s dtype).
pub fn perturbed_noise(noise: &Tensor, xi: &Tensor, strength: f64) -> candle_core::Result<Tensor> {
    let f32 = candle_core::DType::F32;
    (noise.to_dtype(f32)? + (xi.to_dtype(f32)? * strength)?)?.to_dtype(noise.dtype())
}

/// `context + (p/√D)·ζ` for a given `ζ` of the context's shape (EveryDream2's three lines).
pub fn perturb_embeddings_with(
    context: &Tensor,
    p: f64,
    zeta: &Tensor,
) -> candle_core::Result<Tensor> {
    let d = context.dim(candle_core::D::Minus1)?;
    let delta = (zeta.to_dtype(candle_core::DType::F32)? * (p / (d as f64).sqrt()))?;
    context.add(&delta.to_dtype(context.dtype())?)
}

/// `context + (p/√D)·ζ_i` for each sample `i` of `context` `[B, L, D]`, `ζ_i` drawn from
/// `seeds[i]`, in the context's dtype. The noise is a constant: the gradient flows through the
/// context unchanged.
pub fn perturb_embeddings(context: &Tensor, p: f64, seeds: &[u64]) -> candle_core::Result<Tensor> {
    let (b, l, d) = context.dims3()?;
    if seeds.len() != b {
        candle_core::bail!(
            "embedding perturbation: {} seeds for a batch of {b}",
            seeds.len()
        );
    }
    let mut data = Vec::with_capacity(b * l * d);
    for &seed in seeds {
        let mut rng = StdRng::seed_from_u64(seed);
        data.extend((0..l * d).map(|_| rng.sample::<f32, _>(StandardNormal)));
    }
    let zeta = Tensor::from_vec(data, (b, l, d), context.device())?;
    perturb_embeddings_with(context, p, &zeta)
}

/// A sample's embedding-noise seed: one draw from its generator.
pub fn embedding_seed<R: Rng + ?Sized>(rng: &mut R) -> u64 {
    rng.random()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// kohya's random strength is one `U[0, 1)` draw times γ (a sum instead, or a draw
    /// ignored, fails); without it the strength is γ and draws nothing.
    #[test]
    fn the_random_strength_is_a_uniform_fraction_of_gamma() {
        let ip = InputPerturbation {
            gamma: 0.3,
            random_strength: true,
        };
        let mut rng = StdRng::seed_from_u64(4);
        let mut copy = rng.clone();
        let s: Vec<f64> = (0..4000).map(|_| ip.strength(&mut rng)).collect();
        for (x, want) in s.iter().zip((0..4000).map(|_| copy.random::<f64>() * 0.3)) {
            assert_eq!(*x, want);
        }
        assert!(s.iter().all(|x| (0.0..0.3).contains(x)));
        let mean = s.iter().sum::<f64>() / s.len() as f64;
        assert!((mean - 0.15).abs() < 0.01, "{mean}");
        let fixed = InputPerturbation {
            gamma: 0.3,
            random_strength: false,
        };
        let before = rng.clone().random::<u64>();
        assert_eq!(fixed.strength(&mut rng), 0.3);
        assert_eq!(rng.random::<u64>(), before);
    }

    /// `ε + s·ξ`: the perturbation scales the second draw, not the noise the target is built
    /// from (swapping the two fails).
    #[test]
    fn perturbed_noise_scales_the_second_draw() {
        let n = Tensor::new(&[1.0f32, -2.0], &Device::Cpu).unwrap();
        let xi = Tensor::new(&[10.0f32, 20.0], &Device::Cpu).unwrap();
        let got = perturbed_noise(&n, &xi, 0.1)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(got, [2.0, 0.0]);
    }

    #[test]
    fn embedding_noise_has_the_scaled_deviation_and_repeats_by_seed() {
        let ctx = Tensor::zeros((2, 77, 64), DType::F32, &Device::Cpu).unwrap();
        let a = perturb_embeddings(&ctx, 0.8, &[1, 2]).unwrap();
        let b = perturb_embeddings(&ctx, 0.8, &[1, 2]).unwrap();
        let va = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(va, b.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        let var = va.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / va.len() as f64;
        let want = 0.8f64.powi(2) / 64.0;
        assert!((var / want - 1.0).abs() < 0.05, "{var} {want}");
        let first = perturb_embeddings(&ctx.narrow(0, 0, 1).unwrap(), 0.8, &[1]).unwrap();
        assert_eq!(
            first.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            va[..77 * 64].to_vec()
        );
        assert!(perturb_embeddings(&ctx, 0.8, &[1]).is_err());
    }
}
