//! Aspect-ratio buckets: the training sizes of a resolution, and which one each image goes to.
//!
//! EveryDream2 (`data/aspects.py`) keeps a hand-picked table per resolution (256 … 1536 in steps
//! of 64): sizes of about `resolution²` pixels, sides multiples of 64, ratios spread from 1:1 to
//! about 4:1 so that no two buckets are nearly the same shape. [`aspect_buckets`] uses that table
//! whenever the resolution is in it and the model takes multiples of 64. Each landscape size is
//! paired with its transpose; ED2's table has three typos where the pair does not match
//! (`[576, 640]` at 320, `[1408, 1344]` at 1280, `[704, 3072]` at 1408), which are not copied,
//! and one size that is not a multiple of 64 (`1680×576` at 960, whose comment gives the
//! 921600-pixel 2.778:1 size meant: 1600×576, used here).
//!
//! For any other resolution, or a model whose sides must be multiples of a different `step`
//! (the tiny test models take multiples of 8), the buckets are generated the same way kohya's
//! `make_buckets` does: for each width `w` (a multiple of `step`), the tallest `h` (a multiple of
//! `step`) with `w·h ≤ resolution²`, keeping the largest area per shape, within the ratio limit.
//!
//! An image goes to the bucket whose `w/h` is nearest its own (ED2's
//! `min(aspects, key=|w/h − image_w/image_h|)`; ties go to the first bucket in table order).

use serde::Serialize;

/// A training size, `(width, height)` in pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Bucket {
    pub width: usize,
    pub height: usize,
}

impl Bucket {
    pub fn new(width: usize, height: usize) -> Self {
        Self { width, height }
    }

    /// `max(w/h, h/w)`: 1 for a square, 4 for 1024×256.
    pub fn ratio(&self) -> f64 {
        let (w, h) = (self.width as f64, self.height as f64);
        (w / h).max(h / w)
    }

    pub fn aspect(&self) -> f64 {
        self.width as f64 / self.height as f64
    }
}

impl std::fmt::Display for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.width, self.height)
    }
}

/// ED2's landscape sizes per resolution (the square first); the portrait ones are transposes.
const ED2_LANDSCAPE: &[(usize, &[(usize, usize)])] = &[
    (256, &[(256, 256), (384, 192), (512, 128)]),
    (320, &[(320, 320), (384, 256), (448, 192), (576, 128)]),
    (384, &[(384, 384), (448, 320), (512, 256), (704, 192)]),
    (448, &[(448, 448), (512, 384), (640, 320), (768, 256)]),
    (
        512,
        &[
            (512, 512),
            (576, 448),
            (640, 384),
            (768, 320),
            (896, 256),
            (1024, 256),
        ],
    ),
    (
        576,
        &[
            (576, 576),
            (640, 512),
            (704, 448),
            (832, 384),
            (960, 320),
            (1152, 256),
        ],
    ),
    (
        640,
        &[
            (640, 640),
            (704, 576),
            (768, 512),
            (832, 448),
            (896, 448),
            (1024, 384),
            (1152, 320),
            (1280, 320),
        ],
    ),
    (
        704,
        &[
            (704, 704),
            (768, 640),
            (832, 576),
            (960, 512),
            (1088, 448),
            (1152, 384),
            (1280, 384),
            (1280, 320),
        ],
    ),
    (
        768,
        &[
            (768, 768),
            (832, 704),
            (896, 640),
            (960, 576),
            (1024, 576),
            (1152, 512),
            (1280, 448),
            (1408, 384),
            (1472, 320),
        ],
    ),
    (
        832,
        &[
            (832, 832),
            (896, 768),
            (960, 704),
            (1024, 640),
            (1152, 576),
            (1216, 512),
            (1344, 512),
            (1536, 448),
            (1600, 384),
        ],
    ),
    (
        896,
        &[
            (896, 896),
            (1024, 768),
            (1088, 704),
            (1216, 640),
            (1344, 576),
            (1536, 512),
            (1792, 448),
        ],
    ),
    (
        960,
        &[
            (960, 960),
            (1088, 832),
            (1152, 768),
            (1280, 704),
            (1408, 640),
            (1600, 576),
            (1792, 512),
            (2048, 448),
        ],
    ),
    (
        1024,
        &[
            (1024, 1024),
            (1152, 896),
            (1216, 832),
            (1344, 768),
            (1472, 704),
            (1600, 640),
            (1792, 576),
            (2048, 512),
        ],
    ),
    (
        1088,
        &[
            (1088, 1088),
            (1152, 1024),
            (1216, 896),
            (1408, 832),
            (1536, 768),
            (1664, 704),
            (1792, 640),
            (2048, 576),
            (2304, 512),
        ],
    ),
    (
        1152,
        &[
            (1152, 1152),
            (1280, 1024),
            (1344, 960),
            (1472, 896),
            (1536, 832),
            (1728, 768),
            (1856, 704),
            (2048, 640),
            (2304, 576),
        ],
    ),
    (
        1280,
        &[
            (1280, 1280),
            (1408, 1152),
            (1600, 1024),
            (1792, 896),
            (1920, 832),
            (2112, 768),
            (2304, 704),
            (2560, 640),
        ],
    ),
    (
        1408,
        &[
            (1408, 1408),
            (1536, 1280),
            (1664, 1152),
            (1920, 1024),
            (2048, 960),
            (2368, 832),
            (2560, 768),
            (2816, 704),
        ],
    ),
    (
        1536,
        &[
            (1536, 1536),
            (1728, 1344),
            (1792, 1280),
            (2048, 1152),
            (2304, 1024),
            (2432, 960),
            (2624, 896),
            (2816, 832),
            (3072, 768),
        ],
    ),
];

/// Whether EveryDream2 has a table for `resolution` (used for models taking multiples of 64).
pub fn has_ed2_table(resolution: usize) -> bool {
    ED2_LANDSCAPE.iter().any(|(r, _)| *r == resolution)
}

/// The ratio limit of generated buckets when none is set: ED2's tables reach about 4:1.
pub const DEFAULT_MAX_RATIO: f64 = 4.0;

/// kohya's `bucket_no_upscale` (`BucketManager.select_bucket`): an image's own bucket, never
/// larger than the image. An image of more than `resolution²` pixels is first scaled to that
/// area, its width or height rounded to `steps` (whichever keeps the aspect ratio closer) and the
/// other side following the ratio; then both sides are rounded down to `steps`. A side shorter
/// than `steps` gets `steps` (kohya would make a bucket of side 0).
pub fn kohya_no_upscale_bucket(
    width: usize,
    height: usize,
    resolution: usize,
    steps: usize,
) -> Bucket {
    let steps = steps.max(1);
    let (w, h) = (width.max(1) as f64, height.max(1) as f64);
    let aspect = w / h;
    let area = (resolution * resolution) as f64;
    // kohya's `round_to_steps`: `int(x + 0.5)` less its remainder.
    let round = |x: f64| {
        let x = (x + 0.5) as usize;
        x - x % steps
    };
    let (rw, rh) = if w * h > area {
        let resized_w = (area * aspect).sqrt();
        let resized_h = area / resized_w;
        let by_w = round(resized_w);
        let ar_by_w = by_w as f64 / round(by_w as f64 / aspect) as f64;
        let by_h = round(resized_h);
        let ar_by_h = round(by_h as f64 * aspect) as f64 / by_h as f64;
        if (ar_by_w - aspect).abs() < (ar_by_h - aspect).abs() {
            (by_w, (by_w as f64 / aspect + 0.5) as usize)
        } else {
            ((by_h as f64 * aspect + 0.5) as usize, by_h)
        }
    } else {
        (width, height)
    };
    Bucket::new((rw - rw % steps).max(steps), (rh - rh % steps).max(steps))
}

/// kohya's `make_bucket_resolutions` (`library/model_util.py`) for `min_bucket_reso`,
/// `max_bucket_reso` and `bucket_reso_steps`: the square of side `⌊resolution / steps⌋·steps`,
/// and for each width `w` from `min` to `max` in `steps`, the height
/// `min(max, ⌊resolution² / w / steps⌋·steps)` when it is at least `min`, with its transpose;
/// sorted by `(width, height)`, without repeats.
pub fn kohya_buckets(resolution: usize, min: usize, max: usize, steps: usize) -> Vec<Bucket> {
    let area = resolution * resolution;
    let mut sizes = std::collections::BTreeSet::new();
    let side = (area as f64).sqrt() as usize / steps * steps;
    sizes.insert((side, side));
    let mut width = min;
    while width <= max && steps > 0 {
        let height = max.min(area / width / steps * steps);
        if height >= min {
            sizes.insert((width, height));
            sizes.insert((height, width));
        }
        width += steps;
    }
    sizes.into_iter().map(|(w, h)| Bucket::new(w, h)).collect()
}

/// The buckets for `resolution` on a model whose sides must be multiples of `step`: ED2's table
/// when it has one (and `step` divides 64), else generated (see the module header). Buckets wider
/// or taller than `max_ratio`:1 are left out; the square always stays. In ED2's order: the square,
/// then each landscape size followed by its transpose.
pub fn aspect_buckets(resolution: usize, step: usize, max_ratio: Option<f64>) -> Vec<Bucket> {
    let step = step.max(1);
    let table = ED2_LANDSCAPE
        .iter()
        .find(|(r, _)| *r == resolution && 64 % step == 0)
        .map(|(_, sizes)| sizes.to_vec());
    let landscape = table.unwrap_or_else(|| generated_landscape(resolution, step));
    let limit = max_ratio.unwrap_or(f64::INFINITY);
    let mut out = Vec::with_capacity(landscape.len() * 2);
    for (w, h) in landscape {
        let bucket = Bucket::new(w, h);
        if w != h && bucket.ratio() > limit + 1e-9 {
            continue;
        }
        out.push(bucket);
        if w != h {
            out.push(Bucket::new(h, w));
        }
    }
    out
}

/// kohya-style generated landscape sizes (square first), up to [`DEFAULT_MAX_RATIO`].
fn generated_landscape(resolution: usize, step: usize) -> Vec<(usize, usize)> {
    let area = resolution * resolution;
    let square = (resolution / step * step).max(step);
    let mut sizes = vec![(square, square)];
    let mut w = square + step;
    loop {
        let h = area / w / step * step;
        if h < step || w as f64 / h as f64 > DEFAULT_MAX_RATIO + 1e-9 {
            break;
        }
        match sizes.last_mut() {
            // Same height as the previous width: keep the wider one (larger area).
            Some(last) if last.1 == h && last.0 != last.1 => *last = (w, h),
            _ => sizes.push((w, h)),
        }
        w += step;
    }
    sizes
}

/// The bucket whose aspect is nearest `width / height` (ties: the first). `None` for no buckets.
pub fn nearest_bucket(buckets: &[Bucket], width: usize, height: usize) -> Option<Bucket> {
    let aspect = width as f64 / height.max(1) as f64;
    let mut best: Option<(f64, Bucket)> = None;
    for &b in buckets {
        let d = (b.aspect() - aspect).abs();
        if best.is_none_or(|(bd, _)| d < bd) {
            best = Some((d, b));
        }
    }
    best.map(|(_, b)| b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ed2_table_at_512_in_ed2_order() {
        let b = aspect_buckets(512, 64, None);
        let sizes: Vec<(usize, usize)> = b.iter().map(|b| (b.width, b.height)).collect();
        assert_eq!(
            sizes,
            [
                (512, 512),
                (576, 448),
                (448, 576),
                (640, 384),
                (384, 640),
                (768, 320),
                (320, 768),
                (896, 256),
                (256, 896),
                (1024, 256),
                (256, 1024)
            ]
        );
    }

    #[test]
    fn every_table_is_paired_aligned_and_near_the_area() {
        for (res, _) in ED2_LANDSCAPE {
            let buckets = aspect_buckets(*res, 64, None);
            let area = (res * res) as f64;
            for b in &buckets {
                assert!(b.width % 64 == 0 && b.height % 64 == 0, "{res}: {b}");
                assert!(
                    buckets.contains(&Bucket::new(b.height, b.width)),
                    "{res}: {b}"
                );
                let a = (b.width * b.height) as f64;
                // ED2 picked sizes by hand: 384×192 at 256 is 12.5% over, 576×128 at 320 28% under.
                assert!(a <= area * 1.13 && a >= area * 0.7, "{res}: {b} area {a}");
                assert!(b.ratio() <= 4.6, "{res}: {b}");
            }
        }
    }

    #[test]
    fn max_ratio_filters_but_keeps_the_square() {
        let b = aspect_buckets(512, 64, Some(2.0));
        assert!(b.iter().all(|b| b.ratio() <= 2.0));
        assert_eq!(b.len(), 5); // 512², 576×448 and 640×384 with transposes
        assert_eq!(aspect_buckets(512, 64, Some(1.0)), [Bucket::new(512, 512)]);
    }

    #[test]
    fn generated_buckets_for_a_small_step() {
        let b = aspect_buckets(64, 8, None);
        assert_eq!(b[0], Bucket::new(64, 64));
        for bucket in &b {
            assert!(bucket.width % 8 == 0 && bucket.height % 8 == 0, "{bucket}");
            assert!(bucket.width * bucket.height <= 64 * 64, "{bucket}");
            assert!(bucket.ratio() <= DEFAULT_MAX_RATIO, "{bucket}");
        }
        assert!(b.contains(&Bucket::new(72, 56)) && b.contains(&Bucket::new(56, 72)));
        // one bucket per height: 128×32 (ratio 4) is kept, not 120×32
        assert!(b.contains(&Bucket::new(128, 32)) && !b.contains(&Bucket::new(120, 32)));
        // a resolution ED2 has no table for, at step 64
        let odd = aspect_buckets(1216, 64, None);
        assert_eq!(odd[0], Bucket::new(1216, 1216));
        assert!(odd.len() > 5);
    }

    #[test]
    fn nearest_bucket_by_aspect() {
        let b = aspect_buckets(512, 64, None);
        assert_eq!(nearest_bucket(&b, 1000, 1000), Some(Bucket::new(512, 512)));
        assert_eq!(nearest_bucket(&b, 1920, 1080), Some(Bucket::new(640, 384)));
        assert_eq!(nearest_bucket(&b, 1080, 1920), Some(Bucket::new(384, 640)));
        assert_eq!(nearest_bucket(&b, 4000, 500), Some(Bucket::new(1024, 256)));
        assert_eq!(nearest_bucket(&b, 1300, 1000), Some(Bucket::new(576, 448)));
        assert_eq!(nearest_bucket(&[], 10, 10), None);
    }
}
