//! Per-sample augmentations and the batch tensor.
//!
//! Each augmentation is a pure function of its input and a caller-supplied RNG, so a seeded run
//! replays exactly. [`flip_p`] and [`cond_dropout`] draw exactly one value per call whatever the
//! probability, so the number of draws does not depend on the config.
//!
//! - [`flip_p`]: horizontal flip with probability `p` (ED2's `RandomHorizontalFlip(p)`), of the
//!   pixels and the loss mask alike. For SDXL
//!   the crop's left edge is mirrored in the resized image: `left' = resized_w − left − width`
//!   (kohya's `resized_w − crop_right`).
//! - [`cond_dropout`]: with probability `p` the caption becomes `""`; ED2 tokenizes `" "`, which
//!   the CLIP tokenizer turns into the same BOS/EOS-only sequence.
//! - [`shuffle_tags`]: split on `,`, trim, keep the first piece (ED2's main prompt) in place and
//!   shuffle the rest. ED2 seeds this shuffle with the epoch's seed, so every caption with the
//!   same tag count gets the same permutation in an epoch; here the caller's RNG decides.
//! - [`to_tensor`]: `[B, 3, H, W]` f32 in `[-1, 1]`, `x / 127.5 − 1` (ED2's `ToTensor` +
//!   `Normalize(0.5, 0.5)`).

use std::borrow::Cow;

use candle_core::{DType, Device, Tensor};
use rand::seq::SliceRandom;
use rand::Rng;

use super::image_load::TrainImage;
use super::DataError;

/// Flips `image` horizontally with probability `p`; the unflipped image is borrowed, not copied.
pub fn flip_p<'a>(image: &'a TrainImage, p: f64, rng: &mut impl Rng) -> Cow<'a, TrainImage> {
    if rng.random::<f64>() < p {
        Cow::Owned(hflip(image))
    } else {
        Cow::Borrowed(image)
    }
}

/// The mirror image of `image`, with the SDXL crop coordinate mirrored to match.
pub fn hflip(image: &TrainImage) -> TrainImage {
    let row_len = image.width * 3;
    let mut pixels = Vec::with_capacity(image.pixels.len());
    for row in image.pixels.chunks_exact(row_len.max(1)) {
        for px in row.chunks_exact(3).rev() {
            pixels.extend_from_slice(px);
        }
    }
    let mask = image.mask.as_ref().map(|m| {
        m.chunks_exact(image.width.max(1))
            .flat_map(|row| row.iter().rev().copied())
            .collect()
    });
    let (top, left) = image.crop_top_left;
    let resized_w = image.resized_size.1;
    let mirrored_left = resized_w.saturating_sub(left + image.width);
    TrainImage {
        pixels,
        width: image.width,
        height: image.height,
        original_size: image.original_size,
        resized_size: image.resized_size,
        crop_top_left: (top, mirrored_left),
        caption: image.caption.clone(),
        path: image.path.clone(),
        multiplier: image.multiplier,
        options: image.options.clone(),
        mask,
    }
}

/// Returns `""` with probability `p`, else `caption` unchanged.
pub fn cond_dropout<'a>(caption: &'a str, p: f64, rng: &mut impl Rng) -> &'a str {
    if rng.random::<f64>() < p {
        ""
    } else {
        caption
    }
}

/// Shuffles the comma-separated tags of `caption`, keeping the first in place. Pieces are
/// trimmed, empty ones dropped, and the result joined with `", "`.
pub fn shuffle_tags(caption: &str, rng: &mut impl Rng) -> String {
    let mut pieces = caption.split(',').map(str::trim);
    let first = pieces.next().unwrap_or_default();
    let mut rest: Vec<&str> = pieces.filter(|t| !t.is_empty()).collect();
    rest.shuffle(rng);
    let mut out = first.to_string();
    for tag in rest {
        if !out.is_empty() {
            out.push_str(", ");
        }
        out.push_str(tag);
    }
    out
}

/// Stacks `images` (all the same size) into a `[B, 3, H, W]` f32 tensor in `[-1, 1]` on `device`.
/// The bytes travel to the device as u8 and are converted there, a quarter of the f32 transfer.
pub fn to_tensor(images: &[&TrainImage], device: &Device) -> Result<Tensor, DataError> {
    let first = images.first().ok_or(DataError::EmptyBatch)?;
    let (width, height) = (first.width, first.height);
    let expected = width * height * 3;
    let mut bytes = Vec::with_capacity(expected * images.len());
    for image in images {
        if (image.width, image.height) != (width, height) {
            return Err(DataError::BatchShape {
                path: image.path.clone(),
                width: image.width,
                height: image.height,
                batch_width: width,
                batch_height: height,
            });
        }
        if image.pixels.len() != expected {
            return Err(DataError::PixelBuffer {
                path: image.path.clone(),
                len: image.pixels.len(),
                expected,
                width,
                height,
            });
        }
        bytes.extend_from_slice(&image.pixels);
    }
    let batch = Tensor::from_vec(bytes, (images.len(), height, width, 3), device)?
        .permute((0, 3, 1, 2))?
        .to_dtype(DType::F32)?
        .affine(1.0 / 127.5, -1.0)?
        .contiguous()?;
    Ok(batch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;
    use std::path::PathBuf;

    fn image(width: usize, height: usize) -> TrainImage {
        let pixels = (0..width * height * 3).map(|i| (i % 251) as u8).collect();
        TrainImage {
            pixels,
            width,
            height,
            original_size: (height * 2, width * 3),
            resized_size: (height, width + 10),
            crop_top_left: (0, 3),
            caption: "c".into(),
            path: PathBuf::from("i.png"),
            multiplier: 1.0,
            options: Default::default(),
            mask: None,
        }
    }

    #[test]
    fn hflip_mirrors_rows_and_crop_left() {
        let img = image(4, 2);
        let flipped = hflip(&img);
        for y in 0..2 {
            for x in 0..4 {
                let a = &img.pixels[(y * 4 + x) * 3..][..3];
                let b = &flipped.pixels[(y * 4 + (3 - x)) * 3..][..3];
                assert_eq!(a, b);
            }
        }
        // resized width 14, crop left 3, width 4 → 14 − 3 − 4 = 7
        assert_eq!(flipped.crop_top_left, (0, 7));
        assert_eq!(hflip(&flipped), img);
    }

    #[test]
    fn flip_p_extremes() {
        let img = image(3, 3);
        let mut rng = StdRng::seed_from_u64(1);
        for _ in 0..20 {
            assert!(matches!(flip_p(&img, 0.0, &mut rng), Cow::Borrowed(_)));
            assert!(matches!(flip_p(&img, 1.0, &mut rng), Cow::Owned(_)));
        }
    }

    #[test]
    fn cond_dropout_extremes_and_rate() {
        let mut rng = StdRng::seed_from_u64(2);
        assert_eq!(cond_dropout("cap", 0.0, &mut rng), "cap");
        assert_eq!(cond_dropout("cap", 1.0, &mut rng), "");
        let dropped = (0..10_000)
            .filter(|_| cond_dropout("cap", 0.25, &mut rng).is_empty())
            .count();
        assert!((2200..2800).contains(&dropped), "{dropped}");
    }

    #[test]
    fn shuffle_tags_keeps_first_and_permutes_rest() {
        let mut rng = StdRng::seed_from_u64(3);
        let caption = "a cat, one,two , three, four, five";
        let mut seen_other_order = false;
        for _ in 0..20 {
            let out = shuffle_tags(caption, &mut rng);
            let parts: Vec<&str> = out.split(", ").collect();
            assert_eq!(parts[0], "a cat");
            let mut rest = parts[1..].to_vec();
            seen_other_order |= rest != ["one", "two", "three", "four", "five"];
            rest.sort();
            assert_eq!(rest, ["five", "four", "one", "three", "two"]);
        }
        assert!(seen_other_order);
        assert_eq!(shuffle_tags("solo", &mut rng), "solo");
        assert_eq!(shuffle_tags("", &mut rng), "");
    }

    #[test]
    fn to_tensor_layout_and_range() {
        let mut a = image(2, 1);
        a.pixels = vec![0, 255, 51, 102, 153, 204];
        let b = image(2, 1);
        let t = to_tensor(&[&a, &b], &Device::Cpu).unwrap();
        assert_eq!(t.dims(), &[2, 3, 1, 2]);
        let v: Vec<f32> = t.get(0).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let want: Vec<f32> = [0u8, 102, 255, 153, 51, 204]
            .iter()
            .map(|&x| x as f32 / 127.5 - 1.0)
            .collect();
        for (got, want) in v.iter().zip(&want) {
            assert!((got - want).abs() < 1e-6, "{v:?} vs {want:?}");
        }
    }

    #[test]
    fn to_tensor_rejects_mixed_sizes_and_empty() {
        let a = image(2, 2);
        let b = image(3, 2);
        let err = to_tensor(&[&a, &b], &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("i.png"), "{err}");
        assert!(matches!(
            to_tensor(&[], &Device::Cpu).unwrap_err(),
            DataError::EmptyBatch
        ));
    }
}
