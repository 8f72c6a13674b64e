//! Several LoRA files merged into one LoRA (`sdtrain merge-lora` without `--model`), as kohya
//! sd-scripts' `networks/svd_merge_lora.py` merges them: for each module, the weight change
//! `ΔW = Σ ratio_f · (alpha_f / rank_f) · up_f · down_f` over the files that have it (a 3×3 conv
//! flattened to `out × in·k·k`), its top `k` singular triplets, `up = U·Σ` and `down = Vᵀ`, both
//! clamped to `±` the 0.99 quantile of their values (torch's linear quantile, over both factors
//! together), and `alpha = k`. `k` is the rank asked for (the conv rank for 3×3 convs), capped at
//! the layer's channels, `min(out, in)`.
//!
//! The sum is never formed: the files' factors are stacked, `[r₁·up₁ … rₙ·upₙ]·[down₁; …; downₙ]`
//! with `rᵢ` each file's ratio times scale, and [`crate::linalg::factored_svd`] decomposes the
//! product. Two differences from kohya's script:
//! - `k` is also capped at the summed ranks of the files and at the number of non-zero singular
//!   values (the sum has no more directions; kohya, asked for more, adds directions of singular
//!   value 0 whose zeros and unit vectors enter its clamp's quantile);
//! - each singular pair's sign follows sdtrain's convention (the largest entry of `U`'s column
//!   positive), where kohya keeps LAPACK's; `up·down` is the same either way, the clamp's quantile
//!   is taken over the signs chosen.

use super::resize::Factors;
use crate::linalg::{factored_svd, quantile};

/// kohya's `CLAMP_QUANTILE`.
pub const CLAMP_QUANTILE: f64 = 0.99;

/// One file's factors of a module and the factor its product is taken at
/// (`ratio · alpha / rank`).
#[derive(Debug, Clone)]
pub struct Part<'a> {
    pub factors: &'a Factors,
    pub scale: f64,
    /// Where it comes from (a file's name), for messages.
    pub source: &'a str,
}

/// The merged module: its factors (shaped as kohya stores them) and alpha (its rank).
#[derive(Debug, Clone, PartialEq)]
pub struct Merged {
    pub factors: Factors,
    pub alpha: f32,
}

/// Merges one module's `parts` at rank `max_rank` (see the module header). The parts must agree
/// on the layer's shape: `out`, `in` and the kernel.
pub fn svd_merge(parts: &[Part<'_>], max_rank: usize) -> Result<Merged, String> {
    let head = parts.first().ok_or("no part to merge")?;
    let first = head.factors;
    for p in parts {
        let f = p.factors;
        if f.down_shape.len() < 2 || f.up_shape.is_empty() {
            return Err(format!(
                "{}: down {:?} / up {:?} is no LoRA pair",
                p.source, f.down_shape, f.up_shape
            ));
        }
        if f.down_shape.contains(&0) || f.up_shape.contains(&0) {
            return Err(format!(
                "{}: down {:?} / up {:?} has an empty dimension",
                p.source, f.down_shape, f.up_shape
            ));
        }
    }
    let (out, in_tail) = (first.up_shape[0], first.down_shape[1..].to_vec());
    for p in parts {
        if p.factors.up_shape[0] != out || p.factors.down_shape[1..] != in_tail[..] {
            return Err(format!(
                "the files adapt it with different shapes: {} down {:?} / up {:?}, {} down {:?} \
                 / up {:?}",
                head.source,
                first.down_shape,
                first.up_shape,
                p.source,
                p.factors.down_shape,
                p.factors.up_shape
            ));
        }
    }
    let inn: usize = in_tail.iter().product();
    let total: usize = parts.iter().map(|p| p.factors.rank()).sum();
    // [s₁·up₁ … sₙ·upₙ] (out × total) and [down₁; …; downₙ] (total × inn).
    let mut up = vec![0.0f64; out * total];
    let mut down = Vec::with_capacity(total * inn);
    let mut col = 0;
    for p in parts {
        let r = p.factors.rank();
        for i in 0..out {
            for c in 0..r {
                up[i * total + col + c] = f64::from(p.factors.up[i * r + c]) * p.scale;
            }
        }
        down.extend(p.factors.down.iter().map(|&x| f64::from(x)));
        col += r;
    }
    let svd = factored_svd(&up, &down, out, total, inn);
    // Directions of singular value 0 (files that repeat one another) carry nothing; kept, they
    // would be dead rows of `down` and zeros in the clamp's quantile.
    let live = svd.s.iter().filter(|&&x| x > 1e-10 * svd.s[0]).count();
    let k = max_rank
        .min(out)
        .min(in_tail[0])
        .min(total)
        .min(live)
        .max(1);
    let mut new_up = Vec::with_capacity(out * k);
    for i in 0..out {
        new_up.extend((0..k).map(|c| svd.u[i * total + c] * svd.s[c]));
    }
    let new_down = svd.vt[..k * inn].to_vec();
    let mut dist = new_up.clone();
    dist.extend_from_slice(&new_down);
    let hi = quantile(&dist, CLAMP_QUANTILE);
    // torch's `clamp(-hi, hi)`: with a negative `hi` (min above max) every value becomes `hi`.
    let clamp =
        |v: Vec<f64>| -> Vec<f32> { v.into_iter().map(|x| x.max(-hi).min(hi) as f32).collect() };
    let mut up_shape = first.up_shape.clone();
    up_shape[1] = k;
    let mut down_shape = first.down_shape.clone();
    down_shape[0] = k;
    Ok(Merged {
        factors: Factors {
            down: clamp(new_down),
            down_shape,
            up: clamp(new_up),
            up_shape,
        },
        alpha: k as f32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn factors(
        up: Vec<f32>,
        up_shape: Vec<usize>,
        down: Vec<f32>,
        down_shape: Vec<usize>,
    ) -> Factors {
        Factors {
            down,
            down_shape,
            up,
            up_shape,
        }
    }

    /// Two rank-1 modules on orthogonal directions merge into their weighted sum: the larger
    /// (2·3 = 6) first, the negative ratio's (−1·2 = −2) second with its sign on `down`, and a
    /// rank cap of 1 keeps the larger alone. The clamp at the 0.99 quantile of 8 values bounds
    /// the largest by interpolation. Catches the scale dropped, the parts overwritten instead of
    /// summed, or the rank not capped.
    #[test]
    fn the_merge_is_the_weighted_sum() {
        let a = factors(vec![1.0, 0.0], vec![2, 1], vec![1.0, 0.0], vec![1, 2]);
        let b = factors(vec![0.0, 1.0], vec![2, 1], vec![0.0, 1.0], vec![1, 2]);
        let parts = [
            Part {
                factors: &a,
                scale: 6.0,
                source: "a",
            },
            Part {
                factors: &b,
                scale: -2.0,
                source: "b",
            },
        ];
        let two = svd_merge(&parts, 8).unwrap();
        assert_eq!(two.alpha, 2.0);
        // Values [6, 0, 0, 2 | 1, 0, 0, -1] (up = U·Σ with U's largest entries positive): the
        // 0.99 quantile is 2 + 0.93·(6 − 2) = 5.72.
        assert!(
            (two.factors.up[0] - 5.72).abs() < 1e-6,
            "{:?}",
            two.factors.up
        );
        assert_eq!(two.factors.up[1..], [0.0, 0.0, 2.0]);
        assert_eq!(two.factors.down, [1.0, 0.0, 0.0, -1.0]);
        let one = svd_merge(&parts, 1).unwrap();
        assert_eq!(one.factors.up_shape, [2, 1]);
        assert_eq!(one.factors.down, [1.0, 0.0]);
        let c = factors(vec![1.0; 3], vec![3, 1], vec![1.0, 0.0], vec![1, 2]);
        let bad = [
            parts[0].clone(),
            Part {
                factors: &c,
                scale: 1.0,
                source: "c.safetensors",
            },
        ];
        let err = svd_merge(&bad, 2).unwrap_err();
        assert!(
            err.contains("different shapes") && err.contains("c.safetensors"),
            "{err}"
        );
    }
}
