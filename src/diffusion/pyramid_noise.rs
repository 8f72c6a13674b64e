//! Pyramid ("multi-resolution") noise: Gaussian noise at a series of lower resolutions,
//! upsampled bilinearly and added to the training noise with a discount per level, then scaled
//! back to unit variance (Wasserman's "multi-resolution noise" post; EveryDream2's and kohya
//! sd-scripts' `pyramid_noise_like`). Low-frequency noise teaches the model to change an image's
//! overall brightness and colour.
//!
//! Two forms, as the two trainers write them, for a sample `[C, H, W]`:
//!
//! ```text
//! level i = 0, 1, …:  r_i ~ U[2, 4);  n += upsample(N(0, I) at [C, h_i, w_i]) · discount^i
//!   EveryDream2 (`pyramid_noise_discount`): up to 10 levels; h_i = max(1, ⌊h_{i−1} / r_i^i⌋),
//!     from h_{−1} = H (each level divides the previous level's size again);
//!   kohya (`multires_noise_iterations`, `multires_noise_discount`): the given number of levels;
//!     h_i = max(1, ⌊H / r_i^i⌋).
//! stop after a level whose h_i or w_i is 1;  n ← n / std(n)
//! ```
//!
//! Level 0 has `r^0 = 1`: a second full-resolution draw. EveryDream2 starts from a fresh draw in
//! place of the training noise it was given; the base noise here is that draw (the same
//! distribution, one draw fewer). The upsampling is torch's `Upsample(mode="bilinear")`
//! (`align_corners=False`), and `std` is torch's unbiased one. Both trainers normalise by the
//! whole batch's std; sdtrain normalises each sample by its own, so a sample's noise does not
//! depend on the batch it was drawn in (the out-of-memory retry's halved micro-batches train the
//! same samples exactly).

use rand::Rng;
use rand_distr::StandardNormal;

/// Which trainer's pyramid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PyramidStyle {
    /// EveryDream2: 10 levels at most, each dividing the previous level's size.
    EveryDream2,
    /// kohya sd-scripts: `iterations` levels, each dividing the full size.
    Kohya,
}

/// Pyramid noise settings.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct PyramidNoise {
    pub style: PyramidStyle,
    pub discount: f64,
    /// Levels at most (EveryDream2's is fixed at 10).
    pub iterations: usize,
}

/// EveryDream2's number of levels.
pub const EVERYDREAM2_LEVELS: usize = 10;

/// More levels than any size reaches: the 64th divides it by at least 2^63.
const MAX_LEVELS: usize = 64;

impl PyramidNoise {
    /// Adds the pyramid to one sample's noise `[c, h, w]` and rescales it, drawing the level
    /// ratios and the low-resolution noise from `rng`.
    pub fn apply<R: Rng + ?Sized>(
        &self,
        noise: &mut [f32],
        c: usize,
        h: usize,
        w: usize,
        rng: &mut R,
    ) {
        let mut ratio = || rng.random::<f64>() * 2.0 + 2.0;
        // Level i divides the size by at least 2^i, so no level past the 64th is ever reached
        // (`multires_noise_iterations` may be any count, as in kohya).
        let levels = self.iterations.min(MAX_LEVELS);
        let ratios: Vec<f64> = (0..levels).map(|_| ratio()).collect();
        let mut draws = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| rng.sample::<f32, _>(StandardNormal))
                .collect()
        };
        self.apply_with(noise, (c, h, w), &ratios, &mut draws);
    }

    /// [`PyramidNoise::apply`] with the level ratios given and the low-resolution noise from
    /// `draw(n)` (n values, row-major `[c, h_i, w_i]`), for the reference tests. Stops early as
    /// the trainers do; ratios past the last level are unused.
    pub fn apply_with(
        &self,
        noise: &mut [f32],
        (c, h, w): (usize, usize, usize),
        ratios: &[f64],
        draw: &mut dyn FnMut(usize) -> Vec<f32>,
    ) {
        let (mut lh, mut lw) = (h, w);
        for (i, r) in ratios.iter().enumerate().take(self.iterations) {
            let scale = r.powi(i as i32);
            let (from_h, from_w) = match self.style {
                PyramidStyle::EveryDream2 => (lh, lw),
                PyramidStyle::Kohya => (h, w),
            };
            lh = ((from_h as f64 / scale) as usize).max(1);
            lw = ((from_w as f64 / scale) as usize).max(1);
            let level = draw(c * lh * lw);
            let up = upsample_bilinear(&level, c, (lh, lw), (h, w));
            let weight = self.discount.powi(i as i32) as f32;
            for (n, u) in noise.iter_mut().zip(&up) {
                *n += u * weight;
            }
            if lh == 1 || lw == 1 {
                break;
            }
        }
        let std = unbiased_std(noise);
        if std > 0.0 {
            let inv = (1.0 / std) as f32;
            noise.iter_mut().for_each(|x| *x *= inv);
        }
    }
}

/// torch's unbiased standard deviation, accumulated in f64.
fn unbiased_std(x: &[f32]) -> f64 {
    let n = x.len();
    if n < 2 {
        return 0.0;
    }
    let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
    let var = x
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / (n - 1) as f64;
    var.sqrt()
}

/// torch's `Upsample(size, mode="bilinear")` (`align_corners=False`) of `[c, sh, sw]` to
/// `[c, h, w]`: source coordinate `(o + 0.5)·in/out − 0.5`, clamped at 0, in f32.
fn upsample_bilinear(
    src: &[f32],
    c: usize,
    (sh, sw): (usize, usize),
    (h, w): (usize, usize),
) -> Vec<f32> {
    let axis = |out: usize, input: usize| -> Vec<(usize, usize, f32)> {
        let scale = input as f32 / out as f32;
        (0..out)
            .map(|o| {
                let s = ((o as f32 + 0.5) * scale - 0.5).max(0.0);
                let i0 = (s as usize).min(input - 1);
                let i1 = (i0 + 1).min(input - 1);
                (i0, i1, s - i0 as f32)
            })
            .collect()
    };
    let (ys, xs) = (axis(h, sh), axis(w, sw));
    let mut out = Vec::with_capacity(c * h * w);
    for plane in src.chunks(sh * sw) {
        for &(y0, y1, ly) in &ys {
            for &(x0, x1, lx) in &xs {
                let at = |y: usize, x: usize| plane[y * sw + x];
                let top = (1.0 - lx) * at(y0, x0) + lx * at(y0, x1);
                let bottom = (1.0 - lx) * at(y1, x0) + lx * at(y1, x1);
                out.push((1.0 - ly) * top + ly * bottom);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upsampling_to_the_same_size_is_the_identity_and_constants_stay_constant() {
        let x: Vec<f32> = (0..12).map(|v| v as f32).collect();
        assert_eq!(upsample_bilinear(&x, 1, (3, 4), (3, 4)), x);
        let up = upsample_bilinear(&[2.5; 2], 2, (1, 1), (3, 5));
        assert!(up.iter().all(|&v| v == 2.5));
    }

    #[test]
    fn the_result_has_unit_variance() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut noise: Vec<f32> = (0..4 * 32 * 32)
            .map(|_| rng.sample(StandardNormal))
            .collect();
        let p = PyramidNoise {
            style: PyramidStyle::Kohya,
            discount: 0.3,
            iterations: 6,
        };
        p.apply(&mut noise, 4, 32, 32, &mut rng);
        assert!((unbiased_std(&noise) - 1.0).abs() < 1e-5);
    }

    /// `apply` draws each level's ratio as kohya and EveryDream2 do, `r = 2 + 2·U[0, 1)` (all
    /// of them first), then the levels' normals: the same noise as [`PyramidNoise::apply_with`]
    /// given those draws. The reference test goes through `apply_with`, so a wrong mapping in
    /// `apply` (`U·2 + 1`) fails only here.
    #[test]
    fn apply_draws_the_ratios_kohya_draws() {
        for style in [PyramidStyle::Kohya, PyramidStyle::EveryDream2] {
            let p = PyramidNoise {
                style,
                discount: 0.8,
                iterations: 6,
            };
            let base: Vec<f32> = (0..2 * 32 * 32).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut rng = rand::rngs::StdRng::seed_from_u64(9);
            let mut got = base.clone();
            p.apply(&mut got, 2, 32, 32, &mut rng);
            let mut rng = rand::rngs::StdRng::seed_from_u64(9);
            let ratios: Vec<f64> = (0..6).map(|_| rng.random::<f64>() * 2.0 + 2.0).collect();
            let mut draws = |n: usize| -> Vec<f32> {
                (0..n)
                    .map(|_| rng.sample::<f32, _>(StandardNormal))
                    .collect()
            };
            let mut want = base.clone();
            p.apply_with(&mut want, (2, 32, 32), &ratios, &mut draws);
            assert_eq!(got, want, "{style:?}");
        }
    }

    /// Any level count is taken, as in kohya: the levels stop at 1×1 (a config fuzz found
    /// 2^62 levels drawing 2^62 ratios up front: a capacity-overflow panic). Up to 64 levels the
    /// draws are the same as before, so the noise is too.
    #[test]
    fn a_huge_level_count_stops_at_one_pixel() {
        let run = |iterations: usize| {
            let mut rng = rand::rngs::StdRng::seed_from_u64(5);
            let mut noise = vec![0.5f32; 4 * 16 * 16];
            noise[7] = -1.0;
            let p = PyramidNoise {
                style: PyramidStyle::Kohya,
                discount: 0.5,
                iterations,
            };
            p.apply(&mut noise, 4, 16, 16, &mut rng);
            noise
        };
        assert_eq!(run(1 << 62), run(64));
        assert!((unbiased_std(&run(usize::MAX)) - 1.0).abs() < 1e-5);
    }

    /// EveryDream2's and kohya's own functions on recorded draws
    /// (tests/fixtures/pyramid_reference.py). Catches a level size taken from the full size
    /// instead of the previous level's (or the reverse), a wrong discount power, a biased std,
    /// or torch's half-pixel bilinear offset dropped.
    #[test]
    fn matches_everydream2_and_kohya_on_recorded_draws() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/pyramid_reference.json"
        );
        let cases: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let floats = |v: &serde_json::Value| -> Vec<f32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        };
        for (name, case) in cases.as_object().unwrap() {
            let shape: Vec<usize> = case["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect();
            let style = match case["style"].as_str().unwrap() {
                "everydream2" => PyramidStyle::EveryDream2,
                _ => PyramidStyle::Kohya,
            };
            let p = PyramidNoise {
                style,
                discount: case["discount"].as_f64().unwrap(),
                iterations: case["iterations"].as_u64().unwrap() as usize,
            };
            let mut draws: Vec<Vec<f32>> = case["draws"]
                .as_array()
                .unwrap()
                .iter()
                .map(floats)
                .collect();
            // EveryDream2 starts from a fresh draw of its own: its first.
            let mut noise = match style {
                PyramidStyle::EveryDream2 => draws.remove(0),
                PyramidStyle::Kohya => floats(&case["base"]),
            };
            let ratios: Vec<f64> = case["ratios"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r.as_f64().unwrap() * 2.0 + 2.0)
                .collect();
            let mut levels = draws.into_iter();
            let mut draw = |n: usize| {
                let d = levels.next().unwrap();
                assert_eq!(d.len(), n, "{name}: level size");
                d
            };
            p.apply_with(
                &mut noise,
                (shape[1], shape[2], shape[3]),
                &ratios,
                &mut draw,
            );
            assert!(levels.next().is_none(), "{name}: levels left undrawn");
            let want = floats(&case["out"]);
            let worst = noise
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst < 2e-5, "{name}: {worst}");
        }
    }

    use rand::SeedableRng;
}
