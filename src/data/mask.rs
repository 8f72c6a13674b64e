//! Loss masks (masked loss): where an image's mask comes from, how it is read, and how an
//! image-size mask becomes a latent-size one.
//!
//! - Where a mask lives: `<image stem>-masklabel.png` beside the image (OneTrainer's
//!   convention, `modules/dataLoader/mixin/DataLoaderText2ImageMixin.py`), or the image's own
//!   alpha channel (kohya's `alpha_mask`; an image without one is opaque, all ones).
//! - Reading: a mask file is decoded like an image (EXIF orientation applied) and its colour
//!   channels are averaged (kohya takes the red channel of its mask images, OneTrainer converts
//!   to PIL's luminance `L`; all three agree on the gray masks both document). A mask of another
//!   size than its image is resized to the image's size first (the Catmull-Rom filter of the
//!   images). An image with no mask file trains on the whole image (OneTrainer's behaviour). The
//!   mask then goes through the image's own crop, resize and flip
//!   ([`super::image_load::load_with_mask`], [`super::augment::hflip`]).
//! - How an image-size mask becomes a latent-size one: the mean of each `f × f` block, `f` the
//!   VAE's downscale factor (kohya `apply_masked_loss`: `F.interpolate(mode="area")`, which is
//!   that mean when the size divides, as bucket sizes do).

use std::path::{Path, PathBuf};

use image::imageops::FilterType;
use image::{GrayImage, RgbImage};
use serde::Serialize;

use super::DataError;

/// Where the loss masks come from, when masked loss is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MaskSource {
    /// `<stem>-masklabel.png` beside each image.
    File,
    /// The image's alpha channel (kohya's `alpha_mask`).
    Alpha,
}

impl std::fmt::Display for MaskSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::File => "file",
            Self::Alpha => "alpha",
        })
    }
}

/// The mean of each pixel's three channels, rounded.
pub fn rgb_mean(rgb: &RgbImage) -> GrayImage {
    GrayImage::from_fn(rgb.width(), rgb.height(), |x, y| {
        let [r, g, b] = rgb.get_pixel(x, y).0;
        let sum = u32::from(r) + u32::from(g) + u32::from(b);
        image::Luma([((sum + 1) / 3) as u8])
    })
}

/// The mask file of `image` at the image's decoded `(width, height)`, or `None` when there is no
/// such file. An unreadable mask file is an error naming it.
pub fn read_mask_file(
    image: &Path,
    (width, height): (u32, u32),
    max_pixels: u64,
    filter: FilterType,
) -> Result<Option<GrayImage>, DataError> {
    let path = mask_path(image);
    if !path.is_file() {
        return Ok(None);
    }
    let rgb = super::image_load::decode_rgb_limited(&path, max_pixels)?;
    let gray = rgb_mean(&rgb);
    Ok(Some(if gray.dimensions() == (width, height) {
        gray
    } else {
        image::imageops::resize(&gray, width, height, filter)
    }))
}

/// A row-major `u8` mask (255 = full weight) as `f32` in `[0, 1]`.
pub fn to_unit(mask: &[u8]) -> Vec<f32> {
    mask.iter().map(|&v| f32::from(v) / 255.0).collect()
}

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
