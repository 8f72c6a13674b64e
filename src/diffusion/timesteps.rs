//! How a training timestep is drawn from the range `[start, end)`:
//! - uniform: `t ~ U{start, …, end − 1}` (EveryDream2 `get_timesteps` and kohya
//!   `get_timesteps`, both `torch.randint(start, end)`);
//! - logit-normal: `t = ⌊start + (end − start) · σ(bias + scale · z)⌋` with `z ~ N(0, 1)` and
//!   σ the logistic function (OneTrainer `ModelSetupNoiseMixin._get_timestep_discrete`,
//!   `TimestepDistribution.LOGIT_NORMAL`, with `scale = noising_weight + 1`,
//!   `bias = noising_bias` and no timestep shift; Esser et al., arXiv 2403.03206, Section 3.1).
//!   Computed in f32 as OneTrainer does. Where σ rounds to 1 in f32 (`bias + scale·z` above
//!   about 17) the result would be `end`, out of range; it is clamped to `end − 1`.

use rand::Rng;
use rand_distr::StandardNormal;
use serde::Serialize;

/// The distribution timesteps are drawn from.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "distribution")]
pub enum TimestepDistribution {
    Uniform,
    LogitNormal { bias: f64, scale: f64 },
}

impl TimestepDistribution {
    /// One timestep in `[start, end)` (`start < end`, checked by the caller): one integer draw
    /// for uniform, one standard normal for logit-normal.
    pub fn draw<R: Rng + ?Sized>(&self, rng: &mut R, start: u32, end: u32) -> u32 {
        match self {
            Self::Uniform => rng.random_range(start..end),
            Self::LogitNormal { .. } => {
                let z: f32 = rng.sample(StandardNormal);
                self.logit_normal_at(z, start, end)
            }
        }
    }

    /// The logit-normal timestep for the standard normal draw `z` (module header).
    pub fn logit_normal_at(&self, z: f32, start: u32, end: u32) -> u32 {
        let (bias, scale) = match self {
            Self::Uniform => (0.0, 1.0),
            Self::LogitNormal { bias, scale } => (*bias as f32, *scale as f32),
        };
        let x = bias + scale * z;
        let s = 1.0 / (1.0 + (-x).exp());
        let t = s * (end - start) as f32 + start as f32;
        (t as u32).clamp(start, end.saturating_sub(1).max(start))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, SeedableRng};

    #[test]
    fn logit_normal_centres_on_the_middle_and_stays_in_range() {
        let d = TimestepDistribution::LogitNormal {
            bias: 0.0,
            scale: 1.0,
        };
        assert_eq!(d.logit_normal_at(0.0, 0, 1000), 500);
        assert_eq!(d.logit_normal_at(0.0, 200, 400), 300);
        assert_eq!(d.logit_normal_at(40.0, 0, 1000), 999);
        assert_eq!(d.logit_normal_at(-40.0, 10, 1000), 10);
        let mut rng = StdRng::seed_from_u64(1);
        let ts: Vec<u32> = (0..4000).map(|_| d.draw(&mut rng, 100, 900)).collect();
        assert!(ts.iter().all(|t| (100..900).contains(t)));
        let mid = ts.iter().filter(|&&t| (400..600).contains(&t)).count();
        // σ(z) puts about 38% of the draws in the middle quarter of the range, uniform 25%.
        assert!(mid > 1300, "{mid}");
    }

    /// Uniform draws cover `[start, end)`, `end` excluded, as torch.randint does: a one-wide
    /// range always gives `start`, and `end` never comes (an inclusive range fails both).
    #[test]
    fn uniform_draws_exclude_the_end() {
        let mut rng = StdRng::seed_from_u64(2);
        let u = TimestepDistribution::Uniform;
        assert!((0..2000).all(|_| u.draw(&mut rng, 7, 8) == 7));
        let ts: Vec<u32> = (0..4000).map(|_| u.draw(&mut rng, 0, 4)).collect();
        assert!(ts.iter().all(|&t| t < 4));
        for v in 0..4 {
            let n = ts.iter().filter(|&&t| t == v).count();
            assert!((850..1150).contains(&n), "{v}: {n} of 4000");
        }
    }
}
