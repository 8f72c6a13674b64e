//! Resizing a LoRA/LoCon module to a lower rank (`sdtrain resize-lora`), as kohya sd-scripts'
//! `networks/resize_lora.py` resizes it: the module's product `up·down` (a 3×3 conv's flattened to
//! `out × in·k·k`) is decomposed, `U·Σ·Vᵀ`, and the new module keeps its top `k` singular triplets,
//! `up = U_k·Σ_k` and `down = V_kᵀ`, with `alpha = (alpha_old / rank_old)·k` so that the scale
//! `alpha / rank` is unchanged.
//!
//! `k` is the rank asked for, or with a dynamic method the one kohya's `rank_resize` picks from the
//! singular values `S` (padded with zeros to `min(out, in·k·k)` entries, as the full SVD of the
//! product has them), capped at the rank asked for:
//! - `sv_ratio` `t`: one more than the count of `S > S₀/t`;
//! - `sv_fro` `t`: two more than the count of cumulative `Σ S²` fractions below `t²`;
//! - `sv_cumulative` `t`: two more than the count of cumulative `Σ S` fractions below `t`;
//!
//! each count first clamped to `[1, len(S) − 1]`. A module whose largest singular value is at most
//! 1e-6 (never trained) gets rank 1.
//!
//! Two deliberate differences from kohya's script:
//! - the new rank never exceeds the module's own: kohya, asked for more, adds directions whose
//!   singular values are zero (float noise) and scales alpha with them; the product is the same;
//! - 1×1 convs take the Linear modules' rank, 3×3 convs the conv rank, as kohya trains them and as
//!   its `--new_conv_rank` help says ("Conv2d 3x3"); the script gives every conv the conv rank.
//!
//! The decomposition is [`crate::linalg::factored_svd`] in f64 (kohya's is float32 torch), which
//! never forms the product.

use crate::linalg::factored_svd;

/// How the new rank is chosen (kohya's `--dynamic_method` and `--dynamic_param`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RankRule {
    /// The rank asked for.
    Fixed,
    SvRatio(f64),
    SvFro(f64),
    SvCumulative(f64),
}

impl RankRule {
    /// kohya's name of the method and its parameter; `None` for [`RankRule::Fixed`].
    pub fn method(self) -> Option<(&'static str, f64)> {
        match self {
            RankRule::Fixed => None,
            RankRule::SvRatio(t) => Some(("sv_ratio", t)),
            RankRule::SvFro(t) => Some(("sv_fro", t)),
            RankRule::SvCumulative(t) => Some(("sv_cumulative", t)),
        }
    }
}

/// kohya's `MIN_SV`: a module whose largest singular value is at most this is resized to rank 1.
const MIN_SV: f64 = 1e-6;

/// The rank kohya's `rank_resize` picks from the singular values `s` (descending; the SVD's
/// `full` entries are `s` followed by zeros) under `rule`, capped at `max_rank`.
pub fn chosen_rank(s: &[f64], full: usize, rule: RankRule, max_rank: usize) -> usize {
    let clamp = |index: usize| index.min(full.saturating_sub(1)).max(1);
    let below = |fractions: Vec<f64>, target: f64| {
        // torch.searchsorted (left) over the padded list: the padding repeats the last value.
        let last = fractions.last().copied().unwrap_or(0.0);
        let count = fractions.iter().filter(|f| **f < target).count();
        count
            + if last < target {
                full.saturating_sub(fractions.len())
            } else {
                0
            }
    };
    let cumulative = |values: Vec<f64>| {
        let total: f64 = values.iter().sum();
        let mut acc = 0.0;
        values
            .iter()
            .map(|v| {
                acc += v;
                acc / total
            })
            .collect::<Vec<f64>>()
    };
    let s0 = s.first().copied().unwrap_or(0.0);
    let rank = match rule {
        RankRule::Fixed => max_rank,
        RankRule::SvRatio(t) => clamp(s.iter().filter(|v| **v > s0 / t).count()) + 1,
        RankRule::SvFro(t) => {
            clamp(below(cumulative(s.iter().map(|v| v * v).collect()), t * t) + 1) + 1
        }
        RankRule::SvCumulative(t) => clamp(below(cumulative(s.to_vec()), t) + 1) + 1,
    };
    if s0 <= MIN_SV {
        1
    } else {
        rank.min(max_rank)
    }
}

/// One LoRA module's factors as stored: `down` `[r, in(, kh, kw)]` and `up` `[out, r(, 1, 1)]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Factors {
    pub down: Vec<f32>,
    pub down_shape: Vec<usize>,
    pub up: Vec<f32>,
    pub up_shape: Vec<usize>,
}

impl Factors {
    /// The stored rank.
    pub fn rank(&self) -> usize {
        self.down_shape.first().copied().unwrap_or(0)
    }

    /// Whether it adapts a 3×3 (or any non-1×1) conv.
    pub fn is_spatial_conv(&self) -> bool {
        self.down_shape.len() == 4 && self.down_shape[2..] != [1, 1]
    }

    fn in_flat(&self) -> usize {
        self.down_shape[1..].iter().product()
    }
}

/// What resizing one module gives.
#[derive(Debug, Clone, PartialEq)]
pub struct Resized {
    pub factors: Factors,
    /// The new alpha, `(alpha_old / rank_old)·k` in f32 (kohya's float32 arithmetic).
    pub alpha: f32,
    /// How much of the product the new rank keeps: `Σ S_k / Σ S`, `‖S_k‖ / ‖S‖` and `S₀ / S_{k−1}`
    /// (kohya's `--verbose` figures).
    pub sum_retained: f64,
    pub fro_retained: f64,
    pub max_ratio: f64,
}

/// Resizes one module. `alpha` is the module's (its rank when the file has none); `max_rank` the
/// rank asked for its kind (Linear/1×1 or 3×3 conv); `fold` multiplies the new `up` (a scale the
/// file's format cannot keep in an alpha).
pub fn resize_module(
    old: &Factors,
    alpha: f32,
    rule: RankRule,
    max_rank: usize,
    fold: f64,
) -> Resized {
    let (r, out, inn) = (old.rank(), old.up_shape[0], old.in_flat());
    let up: Vec<f64> = old.up.iter().map(|&x| f64::from(x)).collect();
    let down: Vec<f64> = old.down.iter().map(|&x| f64::from(x)).collect();
    let svd = factored_svd(&up, &down, out, r, inn);
    let full = out.min(inn);
    let k = chosen_rank(&svd.s, full, rule, max_rank).min(r).max(1);
    let mut new_up = Vec::with_capacity(out * k);
    for i in 0..out {
        new_up.extend((0..k).map(|c| (svd.u[i * r + c] * svd.s[c] * fold) as f32));
    }
    let new_down: Vec<f32> = svd.vt[..k * inn].iter().map(|&x| x as f32).collect();
    let mut up_shape = old.up_shape.clone();
    up_shape[1] = k;
    let mut down_shape = old.down_shape.clone();
    down_shape[0] = k;
    let total: f64 = svd.s.iter().map(|x| x.abs()).sum();
    let kept: f64 = svd.s[..k].iter().map(|x| x.abs()).sum();
    let fro = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    Resized {
        factors: Factors {
            down: new_down,
            down_shape,
            up: new_up,
            up_shape,
        },
        alpha: alpha / r as f32 * k as f32,
        sum_retained: kept / total,
        fro_retained: fro(&svd.s[..k]) / fro(&svd.s),
        max_ratio: svd.s[0] / svd.s[k - 1],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kohya's `rank_resize` on hand-worked spectra: the counts, kohya's "+1"s, the clamp to
    /// `len(S) − 1`, the cap, and the rank-1 rule for a zero module. Catches a missing "+1", a
    /// searchsorted counting `≤` instead of `<`, the Frobenius target not squared, or the padding
    /// left out of the clamp.
    #[test]
    fn rank_rules_follow_kohya() {
        let s = [1.0, 0.5, 0.2, 0.1];
        // S > 1/4: 1, 0.5 → 2, +1.
        assert_eq!(chosen_rank(&s, 10, RankRule::SvRatio(4.0), 8), 3);
        // cumulative [.556, .833, .944, 1]: below 0.9 → 2, +1, +1.
        assert_eq!(chosen_rank(&s, 10, RankRule::SvCumulative(0.9), 8), 4);
        // squares [1, .25, .04, .01] / 1.3: [.769, .962, .992, 1]; below .9² = .81 → 1, +2.
        assert_eq!(chosen_rank(&s, 10, RankRule::SvFro(0.9), 8), 3);
        assert_eq!(chosen_rank(&s, 10, RankRule::SvFro(0.9), 2), 2);
        assert_eq!(chosen_rank(&s, 10, RankRule::Fixed, 6), 6);
        // A target above every fraction counts the padding too, clamped to len − 1 = 9, +1.
        assert_eq!(chosen_rank(&s, 10, RankRule::SvCumulative(1.5), 16), 10);
        assert_eq!(chosen_rank(&s, 10, RankRule::SvRatio(1e9), 16), 5);
        assert_eq!(chosen_rank(&[0.0; 4], 10, RankRule::Fixed, 6), 1);
        assert_eq!(chosen_rank(&[1e-7, 0.0], 10, RankRule::SvRatio(2.0), 6), 1);
    }

    /// Resizing keeps the top directions and the scale: a module of known spectrum
    /// (`up = diag(s)`-like) resized to 2 keeps `s₀, s₁` in `up`, orthonormal `down` rows, and
    /// alpha scaled by `2/4`. Catches Σ put on `down`, alpha not rescaled, or the wrong columns.
    #[test]
    fn resizing_keeps_the_top_directions_and_the_scale() {
        // up = [e0·3, e1·2, e2·1, e3·0.5] (4×4), down = I (4×5 padded).
        let mut up = vec![0.0f32; 16];
        for (c, v) in [3.0, 2.0, 1.0, 0.5].iter().enumerate() {
            up[c * 4 + c] = *v;
        }
        let mut down = vec![0.0f32; 20];
        (0..4).for_each(|c| down[c * 5 + c] = 1.0);
        let old = Factors {
            down,
            down_shape: vec![4, 5],
            up,
            up_shape: vec![4, 4],
        };
        let got = resize_module(&old, 8.0, RankRule::Fixed, 2, 1.0);
        assert_eq!(got.factors.up_shape, [4, 2]);
        assert_eq!(got.factors.down_shape, [2, 5]);
        assert_eq!(got.alpha, 4.0);
        assert_eq!(got.factors.up, [3.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0]);
        assert_eq!(
            got.factors.down,
            [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
        );
        assert!((got.sum_retained - 5.0 / 6.5).abs() < 1e-12);
        assert!((got.max_ratio - 1.5).abs() < 1e-12);
        let folded = resize_module(&old, 8.0, RankRule::Fixed, 2, 0.5);
        assert_eq!(folded.factors.up[0], 1.5);
    }
}
