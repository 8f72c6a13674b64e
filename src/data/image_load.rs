//! Decoding one training image: EXIF orientation, conversion to 8-bit RGB, resize to cover the
//! target size and centre crop.
//!
//! - Orientation: the decoder's EXIF orientation is applied before anything else, like PIL's
//!   `ImageOps.exif_transpose` in EveryDream2's `ImageTrainItem.load_image`.
//! - Colour: grayscale, 16-bit, palette and alpha images become RGB8. Alpha is dropped, not
//!   composited, as PIL's `.convert("RGB")` (which ED2 uses) does. CMYK and YCCK JPEGs are
//!   converted to RGB by the `image` crate's decoder (zune-jpeg), which treats them as
//!   Adobe-inverted like libjpeg/PIL do: `R = C·K/255` on the stored values.
//! - Resize: the image is scaled by `s = max(tw/w, th/h)` so it covers the target, each side
//!   rounded half up (kohya's `int(x * s + 0.5)`), with the Catmull-Rom cubic filter — PIL's
//!   `BICUBIC` (a = −0.5), the default of `Image.resize` that ED2 calls, and like PIL the filter
//!   widens when downscaling. Then the centre `tw × th` window is cut out.
//! - SDXL conditioning, recorded in the usual (height, width) / (top, left) order:
//!   `original_size` of the decoded, oriented image, `crop_top_left` in the resized image's
//!   coordinates, and the target size `(height, width)`.
//!
//! The crop takes any `(width, height)`, so aspect buckets can reuse [`load_image_to`].

use std::path::{Path, PathBuf};

use image::imageops::FilterType;
use image::{
    DynamicImage, GrayImage, ImageBuffer, ImageDecoder, ImageFormat, ImageReader, Pixel, RgbImage,
};

use super::mask::{read_mask_file, MaskSource};
use super::truncation::{truncated_container, truncated_jpeg};
use super::DataError;

/// Images with more pixels than this are skipped unless `max_image_pixels` raises it: Pillow's
/// decompression-bomb error threshold (2 × `Image.MAX_IMAGE_PIXELS`), which EveryDream2 and
/// kohya run under. A 30000 × 30000 PNG is 900 M pixels, 2.7 GB decoded.
pub const DEFAULT_MAX_PIXELS: u64 = 178_956_970;

/// The resampling filter, see the header.
pub const RESIZE_FILTER: FilterType = FilterType::CatmullRom;

/// A decoded, resized and cropped training image with its caption.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainImage {
    /// RGB8, row-major, `height × width × 3` (HWC).
    pub pixels: Vec<u8>,
    pub width: usize,
    pub height: usize,
    /// `(height, width)` of the decoded image after EXIF orientation.
    pub original_size: (usize, usize),
    /// `(height, width)` after the resize, before the crop.
    pub resized_size: (usize, usize),
    /// `(top, left)` of the crop window in the resized image.
    pub crop_top_left: (usize, usize),
    pub caption: String,
    pub path: PathBuf,
    /// How many times an epoch repeats this image (from `multiply.txt`).
    pub multiplier: f64,
    /// The image's own settings (per-image `flip_p`, `cond_dropout`, tag shuffling).
    pub options: std::sync::Arc<super::ItemOptions>,
    /// The loss mask, `height × width` row-major, 255 full weight, cropped, resized and flipped
    /// with the pixels: when masked loss is on and the image has one ([`super::mask`]).
    pub mask: Option<Vec<u8>>,
}

impl TrainImage {
    /// `(height, width)`, the SDXL "target size" condition.
    pub fn target_size(&self) -> (usize, usize) {
        (self.height, self.width)
    }
}

/// Loads `path` as a `resolution × resolution` square. The caption is empty and the multiplier 1;
/// [`super::load_dataset`] fills them from the scan.
pub fn load_image(path: &Path, resolution: usize) -> Result<TrainImage, DataError> {
    load_image_to(path, (resolution, resolution))
}

/// Loads `path` resized to cover `(width, height)` and centre-cropped to it.
pub fn load_image_to(path: &Path, target: (usize, usize)) -> Result<TrainImage, DataError> {
    load_image_limited(path, target, DEFAULT_MAX_PIXELS)
}

/// [`load_image_to`] refusing images of more than `max_pixels` pixels before decoding them.
pub fn load_image_limited(
    path: &Path,
    target: (usize, usize),
    max_pixels: u64,
) -> Result<TrainImage, DataError> {
    // No jitter: the generator is not drawn from.
    let mut no_draws = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(0);
    load_with_mask(path, target, 0.0, &mut no_draws, max_pixels, None)
}

/// The training image of `path` from its decoded `rgb` and the crop made of it (the pixels, the
/// resized size and the crop's top-left).
fn train_image(
    path: &Path,
    rgb: &RgbImage,
    (cropped, resized_size, crop_top_left): (RgbImage, (usize, usize), (usize, usize)),
) -> TrainImage {
    TrainImage {
        width: cropped.width() as usize,
        height: cropped.height() as usize,
        pixels: cropped.into_raw(),
        original_size: (rgb.height() as usize, rgb.width() as usize),
        resized_size,
        crop_top_left,
        caption: String::new(),
        path: path.to_path_buf(),
        multiplier: 1.0,
        options: Default::default(),
        mask: None,
    }
}

/// [`load_image_limited`] with EveryDream2's crop jitter (`crop_jitter`, see [`jittered_crop`])
/// when `jitter > 0`; the centre crop when it is 0.
pub fn load_image_jittered(
    path: &Path,
    target: (usize, usize),
    jitter: f64,
    rng: &mut impl rand::Rng,
    max_pixels: u64,
) -> Result<TrainImage, DataError> {
    load_with_mask(path, target, jitter, rng, max_pixels, None)
}

/// [`load_image_jittered`] with the image's loss mask from `masks` (none when `None`), which
/// goes through exactly the image's crop and resize.
pub fn load_with_mask(
    path: &Path,
    target: (usize, usize),
    jitter: f64,
    rng: &mut impl rand::Rng,
    max_pixels: u64,
    masks: Option<MaskSource>,
) -> Result<TrainImage, DataError> {
    let (target_w, target_h) = target;
    let (rgb, mask) = decode_with_mask(path, target, max_pixels, masks)?;
    let (crop, mask) = if jitter <= 0.0 {
        let crop = resize_and_crop(&rgb, target_w, target_h);
        let mask = mask.map(|m| resize_and_crop(&m, target_w, target_h).0);
        (crop, mask)
    } else {
        let (w, h) = (rgb.width() as usize, rgb.height() as usize);
        let window = jitter_window((w, h), target, jitter, rng);
        let crop = crop_window(&rgb, window, target);
        let mask = mask.map(|m| crop_window(&m, window, target).0);
        (crop, mask)
    };
    let mut image = train_image(path, &rgb, crop);
    image.mask = mask.map(GrayImage::into_raw);
    Ok(image)
}

/// The image's pixels and, when masks are on, its mask at the same size (`None` for an image with
/// no mask file).
fn decode_with_mask(
    path: &Path,
    target: (usize, usize),
    max_pixels: u64,
    masks: Option<MaskSource>,
) -> Result<(RgbImage, Option<GrayImage>), DataError> {
    if target.0 == 0 || target.1 == 0 {
        return Err(DataError::InvalidSize {
            width: target.0,
            height: target.1,
        });
    }
    match masks {
        None => Ok((decode_rgb_limited(path, max_pixels)?, None)),
        Some(MaskSource::File) => {
            let rgb = decode_rgb_limited(path, max_pixels)?;
            let mask = read_mask_file(path, rgb.dimensions(), max_pixels, RESIZE_FILTER)?;
            Ok((rgb, mask))
        }
        Some(MaskSource::Alpha) => {
            let rgba = decode_oriented(path, max_pixels)?.into_rgba8();
            let (w, h) = rgba.dimensions();
            let rgb = RgbImage::from_fn(w, h, |x, y| {
                let [r, g, b, _] = rgba.get_pixel(x, y).0;
                image::Rgb([r, g, b])
            });
            let alpha = GrayImage::from_fn(w, h, |x, y| image::Luma([rgba.get_pixel(x, y).0[3]]));
            Ok((rgb, Some(alpha)))
        }
    }
}

/// EveryDream2's random crop (`ImageTrainItem.hydrate`): up to `jitter · min(w, h)` pixels, each
/// drawn uniformly and rounded, come off each of the four sides (no more than the image exceeds
/// the target by); then the window of the target's aspect is placed along the long side at a
/// triangular draw over `[0, overhang]` with its mode in the middle (`random.triangular`), and
/// resized to the target. The SDXL conditions are expressed as if the whole image had been
/// resized by the same scale: `resized_size` and the window's `crop_top_left` in it.
pub fn jittered_crop(
    image: &RgbImage,
    target_w: usize,
    target_h: usize,
    jitter: f64,
    rng: &mut impl rand::Rng,
) -> (RgbImage, (usize, usize), (usize, usize)) {
    let size = (image.width() as usize, image.height() as usize);
    let window = jitter_window(size, (target_w, target_h), jitter, rng);
    crop_window(image, window, (target_w, target_h))
}

/// A crop: the pixels, the resized `(height, width)` and the crop's `(top, left)` in it.
pub type Cropped<P> = (ImageBuffer<P, Vec<u8>>, (usize, usize), (usize, usize));

/// A crop window `(left, top, width, height)` in an image's pixels.
type Window = (usize, usize, usize, usize);

/// The window [`jittered_crop`] cuts from a `(w, h)` image for `target` (all the draws).
fn jitter_window(
    (w, h): (usize, usize),
    (target_w, target_h): (usize, usize),
    jitter: f64,
    rng: &mut impl rand::Rng,
) -> Window {
    let excess = ((w as f64 - target_w as f64) / target_w as f64)
        .min((h as f64 - target_h as f64) / target_h as f64);
    // At most a quarter of the short side per edge, so a window is always left.
    let jitter = jitter.min(excess).clamp(0.0, 0.25);
    let max_crop = (w.min(h) as f64 * jitter) as usize;
    let mut side = || (rng.random::<f64>() * max_crop as f64).round() as usize;
    let (l, r, t, b) = (side(), side(), side(), side());
    let (mut left, mut top) = (l, t);
    let (mut bw, mut bh) = (w - l - r, h - t - b);
    let target_aspect = target_w as f64 / target_h as f64;
    let aspect = bw as f64 / bh as f64;
    if aspect > target_aspect {
        let keep = ((bh as f64 * target_aspect) as usize).clamp(1, bw);
        left += triangular_offset(bw - keep, rng);
        bw = keep;
    } else if aspect < target_aspect {
        let keep = ((bw as f64 / target_aspect) as usize).clamp(1, bh);
        top += triangular_offset(bh - keep, rng);
        bh = keep;
    }
    (left, top, bw, bh)
}

/// `window` of `image` resized to `target`, with the SDXL resized size and crop corner.
fn crop_window<P: Pixel<Subpixel = u8> + 'static>(
    image: &ImageBuffer<P, Vec<u8>>,
    (left, top, bw, bh): Window,
    (target_w, target_h): (usize, usize),
) -> Cropped<P> {
    let (w, h) = (image.width() as usize, image.height() as usize);
    let window =
        image::imageops::crop_imm(image, left as u32, top as u32, bw as u32, bh as u32).to_image();
    let out = image::imageops::resize(&window, target_w as u32, target_h as u32, RESIZE_FILTER);
    let scale = target_w as f64 / bw as f64;
    let round = |v: usize| (v as f64 * scale).round() as usize;
    let resized = (round(h).max(target_h), round(w).max(target_w));
    (out, resized, (round(top), round(left)))
}

/// `int(random.triangular(0, over))`: a triangular draw over `[0, over]` with its mode at `over/2`.
fn triangular_offset(over: usize, rng: &mut impl rand::Rng) -> usize {
    let u: f64 = rng.random();
    let x = if u < 0.5 {
        (u / 2.0).sqrt()
    } else {
        1.0 - ((1.0 - u) / 2.0).sqrt()
    };
    ((x * over as f64) as usize).min(over)
}

/// Decodes `path` (format guessed from its bytes, falling back to the extension), applies its EXIF
/// orientation and converts it to RGB8.
pub fn decode_rgb(path: &Path) -> Result<RgbImage, DataError> {
    decode_rgb_limited(path, DEFAULT_MAX_PIXELS)
}

/// [`decode_rgb`], refusing a truncated JPEG (which the decoder would fill with grey) and, from
/// its header alone, an image of more than `max_pixels` pixels.
pub fn decode_rgb_limited(path: &Path, max_pixels: u64) -> Result<RgbImage, DataError> {
    Ok(match decode_oriented(path, max_pixels)? {
        DynamicImage::ImageRgb8(rgb) => rgb,
        other => other.to_rgb8(),
    })
}

/// `path` decoded with [`decode_rgb_limited`]'s checks and its EXIF orientation applied, in its
/// own colour type.
fn decode_oriented(path: &Path, max_pixels: u64) -> Result<DynamicImage, DataError> {
    let fail = |reason: String| DataError::Decode {
        path: path.to_path_buf(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|e| fail(format!("cannot read: {e}")))?;
    let mut decoder = header_decoder(path, &bytes, max_pixels)?;
    // A broken EXIF block only loses the rotation, as in ED2's `_try_transpose`.
    let orientation = decoder
        .orientation()
        .unwrap_or(image::metadata::Orientation::NoTransforms);
    let mut image = DynamicImage::from_decoder(decoder)
        .map_err(|e| fail(format!("corrupt or truncated image: {e}")))?;
    image.apply_orientation(orientation);
    Ok(image)
}

/// The upright `(width, height)` of `path` from its header alone (EXIF rotations by 90° swap the
/// sides), refusing what [`decode_rgb_limited`] would refuse without decoding: an unreadable or
/// empty file, a truncated JPEG, an unknown format, or more than `max_pixels` pixels.
pub fn probe_image(path: &Path, max_pixels: u64) -> Result<(usize, usize), DataError> {
    let fail = |reason: String| DataError::Decode {
        path: path.to_path_buf(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|e| fail(format!("cannot read: {e}")))?;
    let mut decoder = header_decoder(path, &bytes, max_pixels)?;
    let (w, h) = decoder.dimensions();
    let orientation = decoder
        .orientation()
        .unwrap_or(image::metadata::Orientation::NoTransforms);
    use image::metadata::Orientation::*;
    let upright = match orientation {
        Rotate90 | Rotate270 | Rotate90FlipH | Rotate270FlipH => (h as usize, w as usize),
        _ => (w as usize, h as usize),
    };
    if upright.0 == 0 || upright.1 == 0 {
        return Err(fail(format!("{w}×{h} has no pixels")));
    }
    Ok(upright)
}

/// A decoder positioned after the header of `bytes`, once the checks that need no pixels pass.
fn header_decoder<'a>(
    path: &Path,
    bytes: &'a [u8],
    max_pixels: u64,
) -> Result<Box<dyn ImageDecoder + 'a>, DataError> {
    let fail = |reason: String| DataError::Decode {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.is_empty() {
        return Err(fail("empty file (0 bytes)".into()));
    }
    let mut reader = ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| fail(format!("cannot read: {e}")))?;
    if reader.format().is_none() {
        if let Ok(format) = ImageFormat::from_path(path) {
            reader.set_format(format);
        }
    }
    if reader.format() == Some(ImageFormat::Jpeg) {
        if let Some(why) = truncated_jpeg(bytes) {
            return Err(fail(why));
        }
    }
    if let Some(why) = truncated_container(bytes) {
        return Err(fail(why));
    }
    let decoder = reader
        .into_decoder()
        .map_err(|e| fail(format!("not a readable image: {e}")))?;
    let (w, h) = decoder.dimensions();
    let pixels = u64::from(w) * u64::from(h);
    if pixels > max_pixels {
        return Err(fail(format!(
            "{w}×{h} is {pixels} pixels, over the limit of {max_pixels} (max_image_pixels; \
             Pillow's default); raise max_image_pixels to train on it"
        )));
    }
    Ok(Box::new(decoder))
}

/// The size an image of `src` pixels is resized to so that it covers `target` (both `(w, h)`):
/// scale by `max(tw/w, th/h)`, round half up, never below the target.
pub fn cover_size(src: (usize, usize), target: (usize, usize)) -> (usize, usize) {
    let (sw, sh) = (src.0.max(1) as f64, src.1.max(1) as f64);
    let scale = (target.0 as f64 / sw).max(target.1 as f64 / sh);
    let w = ((sw * scale + 0.5).floor() as usize).max(target.0);
    let h = ((sh * scale + 0.5).floor() as usize).max(target.1);
    (w, h)
}

/// Resizes `image` to [`cover_size`] and cuts out the centred `target_w × target_h` window.
/// Returns the crop, the resized `(height, width)` and the crop's `(top, left)`.
pub fn resize_and_crop<P: Pixel<Subpixel = u8> + 'static>(
    image: &ImageBuffer<P, Vec<u8>>,
    target_w: usize,
    target_h: usize,
) -> Cropped<P> {
    let src = (image.width() as usize, image.height() as usize);
    let (rw, rh) = cover_size(src, (target_w, target_h));
    let resized = if (rw, rh) == src {
        image.clone()
    } else {
        image::imageops::resize(image, rw as u32, rh as u32, RESIZE_FILTER)
    };
    let left = (rw - target_w) / 2;
    let top = (rh - target_h) / 2;
    let cropped = image::imageops::crop_imm(
        &resized,
        left as u32,
        top as u32,
        target_w as u32,
        target_h as u32,
    )
    .to_image();
    (cropped, (rh, rw), (top, left))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cover_size_scales_the_short_side_to_the_target() {
        assert_eq!(cover_size((100, 50), (64, 64)), (128, 64));
        assert_eq!(cover_size((50, 100), (64, 64)), (64, 128));
        assert_eq!(cover_size((64, 64), (64, 64)), (64, 64));
        assert_eq!(cover_size((30, 20), (64, 64)), (96, 64));
        // 333 * 64/200 = 106.56 → 107
        assert_eq!(cover_size((333, 200), (64, 64)), (107, 64));
        // a non-square target: the side that needs more scaling decides
        assert_eq!(cover_size((200, 200), (128, 64)), (128, 128));
        assert_eq!(cover_size((400, 100), (128, 64)), (256, 64));
    }

    #[test]
    fn crop_is_centred_and_recorded() {
        // 10×4 image whose pixel value is its x coordinate, cropped to 4×4 (no resize needed).
        let img = RgbImage::from_fn(10, 4, |x, _| image::Rgb([x as u8, 0, 0]));
        let (crop, resized, top_left) = resize_and_crop(&img, 4, 4);
        assert_eq!(resized, (4, 10));
        assert_eq!(top_left, (0, 3));
        assert_eq!(crop.get_pixel(0, 0).0[0], 3);
        assert_eq!(crop.get_pixel(3, 3).0[0], 6);
    }

    #[test]
    fn jittered_crop_stays_inside_and_keeps_the_aspect() {
        use rand::SeedableRng;
        // pixel value = x coordinate, so the crop's left edge shows in the first column
        let img = RgbImage::from_fn(400, 200, |x, _| image::Rgb([(x / 2) as u8, 0, 0]));
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut lefts = Vec::new();
        for _ in 0..200 {
            let (crop, resized, (top, left)) = jittered_crop(&img, 64, 64, 0.1, &mut rng);
            assert_eq!((crop.width(), crop.height()), (64, 64));
            assert!(resized.0 >= 64 && resized.1 >= 64, "{resized:?}");
            assert!(left + 64 <= resized.1 + 1 && top + 64 <= resized.0 + 1);
            lefts.push(left);
        }
        // a 2:1 image in a square: the window slides along x, mostly near the middle
        let mean = lefts.iter().sum::<usize>() as f64 / lefts.len() as f64;
        let (lo, hi) = (*lefts.iter().min().unwrap(), *lefts.iter().max().unwrap());
        assert!(hi > lo + 20, "{lo}..{hi}");
        assert!((mean - 32.0).abs() < 8.0, "{mean}");
        // no jitter room (the image is the target's size): no side comes off
        let exact = RgbImage::from_fn(64, 64, |x, y| image::Rgb([x as u8, y as u8, 0]));
        let (crop, _, tl) = jittered_crop(&exact, 64, 64, 0.1, &mut rng);
        assert_eq!(tl, (0, 0));
        assert_eq!(crop, exact);
    }

    #[test]
    fn the_largest_jitter_always_leaves_a_window() {
        use rand::SeedableRng;
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for (w, h) in [(200, 200), (9, 300), (300, 9), (65, 64)] {
            let img = RgbImage::new(w, h);
            for _ in 0..300 {
                let (crop, _, _) = jittered_crop(&img, 8, 8, 1.0, &mut rng);
                assert_eq!((crop.width(), crop.height()), (8, 8));
            }
        }
    }

    #[test]
    fn triangular_offset_spans_and_centres() {
        use rand::SeedableRng;
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let draws: Vec<usize> = (0..4000)
            .map(|_| triangular_offset(100, &mut rng))
            .collect();
        assert!(draws.iter().all(|&d| d <= 100));
        let mean = draws.iter().sum::<usize>() as f64 / draws.len() as f64;
        assert!((mean - 49.5).abs() < 2.0, "{mean}");
        let central = draws.iter().filter(|&&d| (25..75).contains(&d)).count();
        assert!(central > 2800, "{central}"); // 75% of a triangle's mass lies in its middle half
        assert_eq!(triangular_offset(0, &mut rng), 0);
    }

    /// An image whose red channel is a pattern, and a mask equal to that channel (as a mask file, or as
    /// the alpha channel): after any crop, resize and flip the mask still
    /// equals the red channel (and so moves with the image).
    #[test]
    fn the_mask_is_cropped_resized_and_flipped_with_its_image() {
        use rand::SeedableRng;
        let dir = tempfile::tempdir().unwrap();
        let red = |x: u32, y: u32| ((x * 7 + y * 13) % 256) as u8;
        let (w, h) = (96u32, 64u32);
        let rgb = RgbImage::from_fn(w, h, |x, y| image::Rgb([red(x, y), 40, 200]));
        let img = dir.path().join("a.png");
        rgb.save(&img).unwrap();
        GrayImage::from_fn(w, h, |x, y| image::Luma([red(x, y)]))
            .save(dir.path().join("a-masklabel.png"))
            .unwrap();
        let rgba =
            image::RgbaImage::from_fn(w, h, |x, y| image::Rgba([red(x, y), 40, 200, red(x, y)]));
        let alpha_img = dir.path().join("b.png");
        rgba.save(&alpha_img).unwrap();
        let check = |im: &TrainImage| {
            let mask = im.mask.as_ref().expect("a mask");
            let reds: Vec<u8> = im.pixels.chunks_exact(3).map(|p| p[0]).collect();
            assert_eq!(mask, &reds, "{}", im.path.display());
            let flipped = crate::data::augment::hflip(im);
            let reds: Vec<u8> = flipped.pixels.chunks_exact(3).map(|p| p[0]).collect();
            assert_eq!(flipped.mask.as_ref().unwrap(), &reds);
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for (path, source) in [(&img, MaskSource::File), (&alpha_img, MaskSource::Alpha)] {
            for (target, jitter) in [
                ((32, 32), 0.0),
                ((40, 24), 0.0),
                ((32, 32), 0.2),
                ((24, 40), 0.1),
            ] {
                let im = load_with_mask(path, target, jitter, &mut rng, u64::MAX, Some(source));
                check(&im.unwrap());
            }
        }
        // No mask file, masks on: no mask (the whole image trains); masks off: none read.
        std::fs::copy(&img, dir.path().join("c.png")).unwrap();
        let im = load_with_mask(
            &dir.path().join("c.png"),
            (32, 32),
            0.0,
            &mut rng,
            u64::MAX,
            Some(MaskSource::File),
        );
        assert_eq!(im.unwrap().mask, None);
        assert_eq!(
            load_image_limited(&img, (32, 32), u64::MAX).unwrap().mask,
            None
        );
    }

    /// A mask of another size is resized to its image's; an unreadable one is an error naming it.
    #[test]
    fn a_mask_file_is_resized_or_refused_by_name() {
        use rand::SeedableRng;
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("a.png");
        RgbImage::from_pixel(64, 64, image::Rgb([1, 2, 3]))
            .save(&img)
            .unwrap();
        let mask = dir.path().join("a-masklabel.png");
        // an RGB mask: the channels are averaged (30 + 60 + 91 = 181 → 60.33 → 60)
        RgbImage::from_pixel(16, 16, image::Rgb([30, 60, 91]))
            .save(&mask)
            .unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let im = load_with_mask(
            &img,
            (32, 32),
            0.0,
            &mut rng,
            u64::MAX,
            Some(MaskSource::File),
        )
        .unwrap();
        assert_eq!(im.mask.unwrap(), vec![60u8; 32 * 32]);
        std::fs::write(&mask, b"not a png").unwrap();
        let err = load_with_mask(
            &img,
            (32, 32),
            0.0,
            &mut rng,
            u64::MAX,
            Some(MaskSource::File),
        )
        .unwrap_err();
        assert!(err.to_string().contains("a-masklabel.png"), "{err}");
    }

    #[test]
    fn zero_target_is_rejected() {
        let err = load_image_to(Path::new("x.png"), (0, 64)).unwrap_err();
        assert!(matches!(err, DataError::InvalidSize { .. }));
    }
}
