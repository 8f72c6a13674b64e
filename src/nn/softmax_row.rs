//! Softmax rows for the CPU attention kernels, written so the compiler vectorises them: a
//! branch-free `exp` and eight-lane max and sum accumulators (a float reduction does not vectorise
//! on its own, since reordering changes the rounding). On x86-64 CPUs with AVX2 and FMA the same
//! code is compiled a second time for them and picked at run time.
//!
//! ```text
//! exp x = 2ⁿ · e^r,   n = round(x·log₂e),   r = x − n·ln 2 (ln 2 split in two, Cody–Waite)
//! e^r  ≈ Σ_{i≤6} rⁱ/i!   on |r| ≤ ln2/2: truncation below 1.3e-7 relative (about 1 ulp)
//! ```
//!
//! Inputs below −87.33 (where 2ⁿ would be subnormal) give 0, inputs are capped at 88 (the
//! softmax and its backward only ever pass x − max ≤ 0 and scaled scores minus a log-sum-exp).

const LANES: usize = 8;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// 1.5·2²³: adding and subtracting it rounds an f32 below 2²² to the nearest integer.
const ROUNDER: f32 = 12_582_912.0;
const MIN_X: f32 = -87.33;

/// `eˣ`, branch-free (see the module header).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let xc = x.clamp(MIN_X, 88.0);
    // t's low mantissa bits hold n (|n| < 2²²): integer math on them vectorises where a float to
    // int cast (saturating in Rust) does not.
    let t = xc * LOG2E + ROUNDER;
    let n = t - ROUNDER;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let scale = f32::from_bits(
        t.to_bits()
            .wrapping_sub(ROUNDER.to_bits())
            .wrapping_add(127)
            << 23,
    );
    if x < MIN_X {
        0.0
    } else {
        p * scale
    }
}

#[inline(always)]
fn row_max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = a.max(v);
        }
    }
    let m = tail.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    acc.iter().fold(m, |a, &b| a.max(b))
}

/// `x ← exp(x·scale − shift)` over the row; returns the row's sum.
#[inline(always)]
fn exp_sum(x: &mut [f32], scale: f32, shift: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = x.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c.iter_mut()) {
            *v = exp(*v * scale - shift);
            *a += *v;
        }
    }
    let mut s = 0f32;
    for v in chunks.into_remainder() {
        *v = exp(*v * scale - shift);
        s += *v;
    }
    acc.iter().sum::<f32>() + s
}

/// Softmax of `scale·x` over the row in place; returns the row's log-sum-exp of `scale·x`.
#[inline(always)]
fn softmax_generic(x: &mut [f32], scale: f32) -> f32 {
    // max(scale·x) = scale·max(x) for scale > 0.
    let m = scale * row_max(x);
    let l = exp_sum(x, scale, m);
    let inv = 1.0 / l;
    x.iter_mut().for_each(|v| *v *= inv);
    m + l.ln()
}

/// `x ← exp(scale·x − lse)` over the row in place (the probabilities, from the saved lse).
#[inline(always)]
fn probs_generic(x: &mut [f32], scale: f32, lse: f32) {
    exp_sum(x, scale, lse);
}

/// `dp ← p ∘ (dp − d)·scale` over the row in place.
#[inline(always)]
fn score_grad_generic(dp: &mut [f32], p: &[f32], d: f32, scale: f32) {
    for (g, &p) in dp.iter_mut().zip(p) {
        *g = p * (*g - d) * scale;
    }
}

/// The same rows with AVX2 and FMA intrinsics, eight lanes at a time (the compiler does not
/// vectorise the generic loops: measured scalar).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{LN2_HI, LN2_LO, LOG2E, MIN_X, ROUNDER};

    /// [`super::exp`] on eight lanes.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn exp8(x: __m256) -> __m256 {
        let xc = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(MIN_X)),
            _mm256_set1_ps(88.0),
        );
        let t = _mm256_fmadd_ps(xc, _mm256_set1_ps(LOG2E), _mm256_set1_ps(ROUNDER));
        let n = _mm256_sub_ps(t, _mm256_set1_ps(ROUNDER));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), xc);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let bits = _mm256_sub_epi32(
            _mm256_castps_si256(t),
            _mm256_set1_epi32(ROUNDER.to_bits() as i32),
        );
        let scale = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_add_epi32(bits, _mm256_set1_epi32(127)),
            23,
        ));
        let keep = _mm256_cmp_ps(x, _mm256_set1_ps(MIN_X), _CMP_GE_OQ);
        _mm256_and_ps(_mm256_mul_ps(p, scale), keep)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn hsum(v: __m256) -> f32 {
        let mut a = [0f32; 8];
        _mm256_storeu_ps(a.as_mut_ptr(), v);
        a.iter().sum()
    }

    /// `x ← exp(x·scale − shift)`; returns the sum.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp_sum(x: &mut [f32], scale: f32, shift: f32) -> f32 {
        let (vs, vshift) = (_mm256_set1_ps(scale), _mm256_set1_ps(shift));
        let mut acc = _mm256_setzero_ps();
        let mut chunks = x.chunks_exact_mut(8);
        for c in &mut chunks {
            let v = _mm256_loadu_ps(c.as_ptr());
            let e = exp8(_mm256_fmsub_ps(v, vs, vshift));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, e);
        }
        let mut s = hsum(acc);
        for v in chunks.into_remainder() {
            *v = super::exp(*v * scale - shift);
            s += *v;
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn row_max(x: &[f32]) -> f32 {
        let mut acc = _mm256_set1_ps(f32::NEG_INFINITY);
        let chunks = x.chunks_exact(8);
        let tail = chunks.remainder();
        for c in chunks {
            acc = _mm256_max_ps(acc, _mm256_loadu_ps(c.as_ptr()));
        }
        let mut a = [0f32; 8];
        _mm256_storeu_ps(a.as_mut_ptr(), acc);
        a.iter()
            .chain(tail)
            .fold(f32::NEG_INFINITY, |m, &v| m.max(v))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softmax(x: &mut [f32], scale: f32) -> f32 {
        let m = scale * row_max(x);
        let l = exp_sum(x, scale, m);
        let inv = _mm256_set1_ps(1.0 / l);
        let mut chunks = x.chunks_exact_mut(8);
        for c in &mut chunks {
            _mm256_storeu_ps(
                c.as_mut_ptr(),
                _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr()), inv),
            );
        }
        for v in chunks.into_remainder() {
            *v /= l;
        }
        m + l.ln()
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn probs(x: &mut [f32], scale: f32, lse: f32) {
        exp_sum(x, scale, lse);
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn score_grad(dp: &mut [f32], p: &[f32], d: f32, scale: f32) {
        super::score_grad_generic(dp, p, d, scale)
    }
}

fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Softmax of `scale·x` over the row in place (`scale > 0`); returns its log-sum-exp.
pub fn softmax(x: &mut [f32], scale: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time).
        return unsafe { avx2::softmax(x, scale) };
    }
    softmax_generic(x, scale)
}

/// `x ← exp(scale·x − lse)` over the row in place.
pub fn probs(x: &mut [f32], scale: f32, lse: f32) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: as in `softmax`.
        return unsafe { avx2::probs(x, scale, lse) };
    }
    probs_generic(x, scale, lse)
}

/// `dp ← p ∘ (dp − d)·scale` over the row in place.
pub fn score_grad(dp: &mut [f32], p: &[f32], d: f32, scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: as in `softmax`.
        return unsafe { avx2::score_grad(dp, p, d, scale) };
    }
    score_grad_generic(dp, p, d, scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches a wrong polynomial coefficient, a lost low half of ln 2 and a wrong exponent bias:
    /// within 2 ulp-ish (3e-7 relative) of the libm `exp` on [−87, 88], and 0 below the range.
    #[test]
    fn exp_matches_libm_across_the_range() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), x.exp());
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }

    /// The same bound on the row kernels' `exp` (the AVX2 lanes where the CPU has them, and the
    /// scalar tail): `probs` with scale 1 and log-sum-exp 0 is `exp` of each element. Catches a
    /// lost low half of ln 2 or a wrong coefficient in the eight-lane version.
    #[test]
    fn row_exp_matches_libm_across_the_range() {
        let x: Vec<f32> = (0..12_700).map(|i| -87.0 + i as f32 * 0.0137).collect();
        let mut got = x.clone();
        probs(&mut got, 1.0, 0.0);
        let worst = got
            .iter()
            .zip(&x)
            .map(|(g, x)| ((g - x.exp()) / x.exp()).abs())
            .fold(0f32, f32::max);
        assert!(worst < 3e-7, "worst relative error {worst}");
    }

    /// Catches the scale applied after the max (or not at all), a dropped normalisation, and a
    /// wrong log-sum-exp; rows of 1, 7 (all tail) and 19 (lanes plus tail) elements.
    #[test]
    fn softmax_row_matches_the_definition() {
        for len in [1usize, 7, 19] {
            let x: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.7)
                .collect();
            let scale = 0.6f32;
            let mut got = x.clone();
            let lse = softmax(&mut got, scale);
            let want_lse = x.iter().map(|v| (v * scale).exp()).sum::<f32>().ln();
            assert!(
                (lse - want_lse).abs() < 1e-5,
                "len {len}: lse {lse} vs {want_lse}"
            );
            for (g, v) in got.iter().zip(&x) {
                assert!((g - (v * scale - want_lse).exp()).abs() < 1e-6, "len {len}");
            }
            let mut p = x.clone();
            probs(&mut p, scale, want_lse);
            for (a, b) in p.iter().zip(&got) {
                assert!((a - b).abs() < 1e-6);
            }
        }
    }
}
