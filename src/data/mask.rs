//! Loss masks: the building blocks of masked loss, before its hook into the scan and the latent
//! cache.
//!
//! - Where a mask lives: `<image stem>-masklabel.png` beside the image (OneTrainer's
//!   convention, `modules/dataLoader/mixin/DataLoaderText2ImageMixin.py`).
//! - How an image-size mask becomes a latent-size one: the mean of each `f × f` block, `f` the
//!   VAE's downscale factor (kohya `apply_masked_loss`: `F.interpolate(mode="area")`, which is
//!   that mean when the size divides, as bucket sizes do).

use std::path::{Path, PathBuf};

/// OneTrainer's mask file name suffix.
pub const MASK_SUFFIX: &str = "-masklabel.png";

/// The mask file beside `image`: `photo.jpg` → `photo-masklabel.png`.
pub fn mask_path(image: &Path) -> PathBuf {
    let stem = image.file_stem().unwrap_or_default().to_string_lossy();
    image.with_file_name(format!("{stem}{MASK_SUFFIX}"))
}

/// Whether `path` is a mask file (and so not a training image).
pub fn is_mask_file(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|n| n.to_string_lossy().ends_with(MASK_SUFFIX))
}

/// The `(h/f) × (w/f)` block means of a row-major `h × w` mask, or `None` when `f` does not
/// divide both sides.
pub fn area_downsample(mask: &[f32], (h, w): (usize, usize), f: usize) -> Option<Vec<f32>> {
    if f == 0 || h % f != 0 || w % f != 0 || mask.len() != h * w {
        return None;
    }
    let (oh, ow) = (h / f, w / f);
    let norm = 1.0 / (f * f) as f32;
    let mut out = vec![0f32; oh * ow];
    for y in 0..h {
        for x in 0..w {
            out[(y / f) * ow + x / f] += mask[y * w + x];
        }
    }
    out.iter_mut().for_each(|v| *v *= norm);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_files_sit_beside_their_images() {
        assert_eq!(
            mask_path(Path::new("/d/a.b.jpg")),
            PathBuf::from("/d/a.b-masklabel.png")
        );
        assert!(is_mask_file(Path::new("/d/a-masklabel.png")));
        assert!(!is_mask_file(Path::new("/d/a.png")));
    }

    #[test]
    fn area_downsampling_averages_blocks() {
        let m = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0];
        assert_eq!(area_downsample(&m, (2, 4), 2), Some(vec![0.75, 0.0]));
        assert_eq!(area_downsample(&m, (2, 4), 3), None);
    }
}
