//! Sample images to files: 8-bit RGB (`round(x·255)`, as diffusers' `numpy_to_pil`), PNG
//! encoding, side-by-side strips (one image per guidance scale, as EveryDream2 lays them out)
//! and a grid of strips per sampling step.

use std::path::Path;

use candle_core::{DType, Tensor};
use image::{ImageEncoder, RgbImage};

use crate::error_chain::External;
use crate::fsutil::{self, FsError};

/// `[3, H, W]` in `[0, 1]` → RGB.
pub fn to_rgb(image: &Tensor) -> candle_core::Result<RgbImage> {
    let (c, h, w) = image.dims3()?;
    if c != 3 {
        candle_core::bail!("a sample image has 3 channels, got {c}");
    }
    let bytes: Vec<u8> = (image.to_dtype(DType::F32)?.clamp(0f32, 1f32)? * 255.0)?
        .round()?
        .permute((1, 2, 0))?
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(|v| v as u8)
        .collect();
    RgbImage::from_raw(w as u32, h as u32, bytes)
        .ok_or_else(|| candle_core::Error::Msg("sample image buffer size".into()))
}

/// The images left to right, top-aligned, on black.
pub fn side_by_side(images: &[RgbImage]) -> RgbImage {
    let w = images.iter().map(RgbImage::width).sum();
    let h = images.iter().map(RgbImage::height).max().unwrap_or(0);
    let mut out = RgbImage::new(w, h);
    let mut x = 0;
    for im in images {
        image::imageops::replace(&mut out, im, i64::from(x), 0);
        x += im.width();
    }
    out
}

/// The images top to bottom, left-aligned, on black.
pub fn stacked(images: &[RgbImage]) -> RgbImage {
    let w = images.iter().map(RgbImage::width).max().unwrap_or(0);
    let h = images.iter().map(RgbImage::height).sum();
    let mut out = RgbImage::new(w, h);
    let mut y = 0;
    for im in images {
        image::imageops::replace(&mut out, im, 0, i64::from(y));
        y += im.height();
    }
    out
}

pub fn encode_png(image: &RgbImage) -> Result<Vec<u8>, image::ImageError> {
    let mut out = Vec::new();
    image::codecs::png::PngEncoder::new(&mut out).write_image(
        image.as_raw(),
        image.width(),
        image.height(),
        image::ExtendedColorType::Rgb8,
    )?;
    Ok(out)
}

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("encoding {}", path.display())]
    Encode {
        path: std::path::PathBuf,
        source: External<image::ImageError>,
    },
    #[error(transparent)]
    Fs(#[from] FsError),
}

/// Writes `image` as a PNG at `path` (atomically: a partial file never has the name); returns
/// the bytes written.
pub fn write_png(path: &Path, image: &RgbImage) -> Result<Vec<u8>, WriteError> {
    let bytes = encode_png(image).map_err(|source| WriteError::Encode {
        path: path.to_path_buf(),
        source: External(source),
    })?;
    fsutil::write_atomic(path, &bytes)?;
    Ok(bytes)
}

/// A prompt as a file-name part: letters, digits and spaces kept (spaces as `_`), at most 100
/// characters (EveryDream2's `clean_filename`, then `[:100]`).
pub fn file_part(prompt: &str) -> String {
    prompt
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ')
        .collect::<String>()
        .trim()
        .chars()
        .take(100)
        .map(|c| if c == ' ' { '_' } else { c })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn pixels_round_like_diffusers() {
        // 0.5·255 = 127.5 rounds to 128; 1/255·0.4 rounds to 0; out of range clamps.
        let t = Tensor::from_vec(
            vec![0.5f32, 0.4 / 255.0, 1.2, -0.1, 1.0, 0.0],
            (3, 1, 2),
            &Device::Cpu,
        )
        .unwrap();
        let im = to_rgb(&t).unwrap();
        assert_eq!(im.get_pixel(0, 0).0, [128, 255, 255]);
        assert_eq!(im.get_pixel(1, 0).0, [0, 0, 0]);
    }

    #[test]
    fn strips_and_grids_place_images_in_order() {
        let a = RgbImage::from_pixel(2, 3, image::Rgb([1, 1, 1]));
        let b = RgbImage::from_pixel(4, 2, image::Rgb([2, 2, 2]));
        let s = side_by_side(&[a.clone(), b.clone()]);
        assert_eq!(s.dimensions(), (6, 3));
        assert_eq!(s.get_pixel(1, 2).0, [1, 1, 1]);
        assert_eq!(s.get_pixel(5, 1).0, [2, 2, 2]);
        assert_eq!(s.get_pixel(5, 2).0, [0, 0, 0]);
        let g = stacked(&[a, b]);
        assert_eq!(g.dimensions(), (4, 5));
        assert_eq!(g.get_pixel(3, 4).0, [2, 2, 2]);
        assert_eq!(g.get_pixel(3, 0).0, [0, 0, 0]);
    }

    #[test]
    fn file_parts_keep_letters_digits_and_spaces() {
        assert_eq!(file_part("a (red) cat, 4k! "), "a_red_cat_4k");
        assert_eq!(file_part(&"x".repeat(300)).len(), 100);
    }
}
