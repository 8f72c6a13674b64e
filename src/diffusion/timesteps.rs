//! How a training timestep is drawn from the range `[start, end)`, as OneTrainer's
//! `ModelSetupNoiseMixin._get_timestep_discrete` draws it (`TimestepDistribution`, commit
//! 23df3832), with `n = end − start` and `N` the schedule's `num_train_timesteps`:
//!
//! - continuous kinds give a real `t = start + n·x` with `x ∈ [0, 1]`, which the timestep shift
//!   `s` maps to `N·s·t / ((s − 1)·t + N)` and truncation makes a timestep:
//!   - uniform: `x = u`, `u ~ U[0, 1)` (unshifted, one integer draw, `torch.randint(start, end)`
//!     as EveryDream2 and kohya draw it: the same distribution);
//!   - logit-normal: `x = σ(bias + scale·z)`, `z ~ N(0, 1)`, `scale = noising_weight + 1`,
//!     `bias = noising_bias` (Esser et al., arXiv 2403.03206, Section 3.1);
//!   - heavy tail: `x = 1 − u − s_m·(cos²(πu/2) − 1 + u)`, `s_m = noising_weight` (the same
//!     paper's mode sampling with heavy tails, `s_m ∈ [−1, 2/(π − 2)]` keeps it monotone);
//!   - beta: `x ~ Beta(α, β)`, `α = noising_weight`, `β = noising_bias` (B-TTDM), drawn as
//!     `u^(1/α)` when β is 1 and `1 − u^(1/β)` when α is 1, as OneTrainer draws them;
//! - discrete kinds weigh each of the `n` timesteps, at `l = i/(n − 1)` (torch.linspace) moved
//!   by the inverse shift `l' = l / (s − s·l + l)` and multiplied by its derivative
//!   `s / (s + l − s·l)²`, and draw one in proportion (torch.multinomial):
//!   - cos_map: `2 / (π − 2π·l' + 2π·l'²)` (CosMap, arXiv 2405.02311 as OneTrainer takes it);
//!   - sigmoid: `σ(w·(l'' − b − 0.5))`, `w = noising_weight`, `b = noising_bias`, where
//!     OneTrainer applies the inverse shift to `l'` once more (`l''`; the same as `l'` without a
//!     shift);
//!   - inverted parabola: `max(0, 2 − w·(l' − b − 0.5)²)`.
//!
//! The continuous kinds are computed in f32 as OneTrainer computes them. Where `x` is exactly 1
//! (σ rounding to 1 above about 17, or `u = 0` under the heavy tail) OneTrainer's result is `end`
//! (shifted), one past the range; sdtrain keeps the range, the image of `[start, end)` under the
//! shift.

use rand::Rng;
use rand_distr::{Distribution, StandardNormal};
use serde::Serialize;

/// The distribution timesteps are drawn from (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "distribution")]
pub enum TimestepDistribution {
    Uniform,
    LogitNormal { bias: f64, scale: f64 },
    HeavyTail { scale: f64 },
    Beta { alpha: f64, beta: f64 },
    CosMap,
    Sigmoid { weight: f64, bias: f64 },
    InvertedParabola { weight: f64, bias: f64 },
}

/// Where timesteps are drawn: `[start, end)` of a schedule of `num_train` timesteps, moved by
/// the timestep `shift` (1 leaves them in place).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimestepRange {
    pub start: u32,
    pub end: u32,
    pub num_train: u32,
    pub shift: f64,
}

impl TimestepRange {
    /// `[start, end)` of `num_train` timesteps, unshifted.
    pub fn unshifted(start: u32, end: u32, num_train: u32) -> Self {
        Self {
            start,
            end,
            num_train,
            shift: 1.0,
        }
    }

    /// OneTrainer's shift of a real timestep, in f32: `N·s·t / ((s − 1)·t + N)`.
    fn shifted(&self, t: f32) -> f32 {
        let n = self.num_train as f64;
        let num = (n * self.shift) as f32 * t;
        num / (((self.shift - 1.0) as f32) * t + n as f32)
    }

    /// The timesteps a real `t ∈ [start, end]` may become: the truncated image of `start`, to
    /// one below the image of `end`.
    fn bounds(&self) -> (u32, u32) {
        let lo = self.shifted(self.start as f32) as u32;
        let hi = (self.shifted(self.end as f32).ceil() as u32).saturating_sub(1);
        (lo, hi.max(lo))
    }

    /// A real timestep shifted, truncated and kept in range.
    fn finish(&self, t: f32) -> u32 {
        let (lo, hi) = self.bounds();
        (self.shifted(t) as u32).clamp(lo, hi)
    }
}

impl TimestepDistribution {
    /// The timesteps a draw can give, `[lo, hi]` (both included).
    pub fn bounds(&self, range: &TimestepRange) -> (u32, u32) {
        if self.is_discrete() {
            (range.start, range.end - 1)
        } else {
            range.bounds()
        }
    }

    /// One timestep (`start < end ≤ num_train`, checked by the caller; [`Self::check`] passed):
    /// one integer draw for uniform without a shift, one uniform `u` (f32) for the other
    /// continuous kinds and one standard normal for logit-normal, a Beta draw for beta with
    /// neither parameter at 1, one uniform f64 for the discrete kinds.
    pub fn draw<R: Rng + ?Sized>(&self, rng: &mut R, range: &TimestepRange) -> u32 {
        match *self {
            Self::Uniform if range.shift == 1.0 => rng.random_range(range.start..range.end),
            Self::LogitNormal { .. } => {
                let z: f32 = rng.sample(StandardNormal);
                self.continuous_at(z, range)
            }
            Self::Beta { alpha, beta } if !beta_is_power(alpha, beta) => {
                let x = match rand_distr::Beta::new(alpha, beta) {
                    Ok(d) => d.sample(rng) as f32,
                    // Parameters are checked positive before a run; a uniform fallback keeps
                    // the draw total.
                    Err(_) => rng.random::<f32>(),
                };
                range.finish(range.start as f32 + (range.end - range.start) as f32 * x)
            }
            Self::CosMap | Self::Sigmoid { .. } | Self::InvertedParabola { .. } => {
                let weights = self.weights(range);
                range.start + pick(&weights, rng.random::<f64>()) as u32
            }
            Self::Uniform | Self::HeavyTail { .. } | Self::Beta { .. } => {
                let u: f32 = rng.random();
                self.continuous_at(u, range)
            }
        }
    }

    /// The timestep of a continuous kind for its primitive draw `x`: the standard normal `z`
    /// for logit-normal, the uniform `u` for the others (beta only with α or β at 1). A
    /// discrete kind is read as uniform.
    pub fn continuous_at(&self, x: f32, range: &TimestepRange) -> u32 {
        let unit = match *self {
            Self::LogitNormal { bias, scale } => {
                let y = bias as f32 + scale as f32 * x;
                1.0 / (1.0 + (-y).exp())
            }
            Self::HeavyTail { scale } => {
                let c = ((std::f64::consts::PI / 2.0) as f32 * x).cos();
                1.0 - x - scale as f32 * (c * c - 1.0 + x)
            }
            Self::Beta { alpha, beta } if (beta - 1.0).abs() < 1e-5 => x.powf((1.0 / alpha) as f32),
            Self::Beta { beta, .. } => 1.0 - x.powf((1.0 / beta) as f32),
            _ => x,
        };
        let n = (range.end - range.start) as f32;
        range.finish(unit * n + range.start as f32)
    }

    /// Whether timesteps are drawn in proportion to per-timestep weights.
    pub fn is_discrete(&self) -> bool {
        matches!(
            self,
            Self::CosMap | Self::Sigmoid { .. } | Self::InvertedParabola { .. }
        )
    }

    /// A discrete kind's weight of each timestep of the range, `start` first (module docs);
    /// empty for a continuous kind.
    pub fn weights(&self, range: &TimestepRange) -> Vec<f64> {
        if !self.is_discrete() {
            return Vec::new();
        }
        let n = (range.end - range.start) as usize;
        let s = range.shift;
        let unshift = |l: f64| l / (s - s * l + l);
        (0..n)
            .map(|i| {
                let l = if n > 1 {
                    i as f64 / (n - 1) as f64
                } else {
                    0.0
                };
                let derivative = s / (s + l - l * s).powi(2);
                let l = unshift(l);
                let w = match *self {
                    Self::CosMap => {
                        let pi = std::f64::consts::PI;
                        2.0 / (pi - 2.0 * pi * l + 2.0 * pi * l * l)
                    }
                    Self::Sigmoid { weight, bias } => {
                        1.0 / (1.0 + (-weight * (unshift(l) - bias - 0.5)).exp())
                    }
                    Self::InvertedParabola { weight, bias } => {
                        (2.0 - weight * (l - bias - 0.5).powi(2)).max(0.0)
                    }
                    _ => 1.0,
                };
                w * derivative
            })
            .collect()
    }

    /// Why this distribution cannot draw from `range`, if it cannot: a discrete kind whose
    /// weights are all zero or not finite (an inverted parabola that misses the range).
    pub fn check(&self, range: &TimestepRange) -> Result<(), String> {
        if !self.is_discrete() {
            return Ok(());
        }
        let total: f64 = self.weights(range).iter().sum();
        if total.is_finite() && total > 0.0 {
            Ok(())
        } else {
            Err(format!(
                "gives every timestep of [{}, {}) the weight 0 (their sum is {total})",
                range.start, range.end
            ))
        }
    }
}

/// OneTrainer draws beta by inverting its distribution function where β or α is 1.
fn beta_is_power(alpha: f64, beta: f64) -> bool {
    (beta - 1.0).abs() < 1e-5 || (alpha - 1.0).abs() < 1e-5
}

/// The index whose cumulative weight first passes `u` (in `[0, 1)`) of the total.
fn pick(weights: &[f64], u: f64) -> usize {
    let total: f64 = weights.iter().sum();
    let target = u * total;
    let mut acc = 0.0;
    for (i, w) in weights.iter().enumerate() {
        acc += w;
        if acc > target {
            return i;
        }
    }
    // Rounding can leave the sum a hair below the target: the last positive weight.
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, SeedableRng};

    fn range(start: u32, end: u32) -> TimestepRange {
        TimestepRange::unshifted(start, end, 1000)
    }

    #[test]
    fn logit_normal_centres_on_the_middle_and_stays_in_range() {
        let d = TimestepDistribution::LogitNormal {
            bias: 0.0,
            scale: 1.0,
        };
        assert_eq!(d.continuous_at(0.0, &range(0, 1000)), 500);
        assert_eq!(d.continuous_at(0.0, &range(200, 400)), 300);
        assert_eq!(d.continuous_at(40.0, &range(0, 1000)), 999);
        assert_eq!(d.continuous_at(-40.0, &range(10, 1000)), 10);
        let mut rng = StdRng::seed_from_u64(1);
        let ts: Vec<u32> = (0..4000)
            .map(|_| d.draw(&mut rng, &range(100, 900)))
            .collect();
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
        assert!((0..2000).all(|_| u.draw(&mut rng, &range(7, 8)) == 7));
        let ts: Vec<u32> = (0..4000).map(|_| u.draw(&mut rng, &range(0, 4))).collect();
        assert!(ts.iter().all(|&t| t < 4));
        for v in 0..4 {
            let n = ts.iter().filter(|&&t| t == v).count();
            assert!((850..1150).contains(&n), "{v}: {n} of 4000");
        }
    }

    /// A discrete draw lands on each timestep in proportion to its weight: the inverse of the
    /// cumulative weights, not the weights' order or a uniform pick.
    #[test]
    fn discrete_draws_follow_their_weights() {
        assert_eq!(pick(&[1.0, 0.0, 3.0], 0.0), 0);
        assert_eq!(pick(&[1.0, 0.0, 3.0], 0.2499), 0);
        assert_eq!(pick(&[1.0, 0.0, 3.0], 0.25), 2);
        assert_eq!(pick(&[0.0, 2.0, 0.0], 0.999_999_999_999), 1);
        let d = TimestepDistribution::InvertedParabola {
            weight: 8.0,
            bias: 0.0,
        };
        let r = range(0, 10);
        let w = d.weights(&r);
        let total: f64 = w.iter().sum();
        let mut rng = StdRng::seed_from_u64(3);
        let mut counts = [0usize; 10];
        let draws = 40_000;
        for _ in 0..draws {
            counts[d.draw(&mut rng, &r) as usize] += 1;
        }
        for (i, &c) in counts.iter().enumerate() {
            let want = w[i] / total * draws as f64;
            // Five binomial deviations.
            let tol = 5.0 * want.max(1.0).sqrt();
            assert!((c as f64 - want).abs() <= tol, "{i}: {c} vs {want:.0}");
        }
    }

    /// Beta with neither parameter at 1 is drawn from the Beta distribution: its mean α/(α+β)
    /// and variance αβ/((α+β)²(α+β+1)).
    #[test]
    fn beta_draws_have_the_beta_moments() {
        let (a, b) = (2.0, 5.0);
        let d = TimestepDistribution::Beta { alpha: a, beta: b };
        let mut rng = StdRng::seed_from_u64(4);
        let n = 40_000;
        let xs: Vec<f64> = (0..n)
            .map(|_| (d.draw(&mut rng, &range(0, 1000)) as f64 + 0.5) / 1000.0)
            .collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        let (m, v) = (a / (a + b), a * b / ((a + b).powi(2) * (a + b + 1.0)));
        assert!((mean - m).abs() < 0.003, "{mean} vs {m}");
        assert!((var / v - 1.0).abs() < 0.03, "{var} vs {v}");
    }

    #[test]
    fn an_inverted_parabola_that_misses_the_range_is_refused() {
        let d = TimestepDistribution::InvertedParabola {
            weight: 100.0,
            bias: 2.0,
        };
        assert!(d.check(&range(0, 1000)).unwrap_err().contains("weight 0"));
        assert!(TimestepDistribution::CosMap.check(&range(0, 1)).is_ok());
    }
}
