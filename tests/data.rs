//! Data pipeline tests: scanning and captions, multiply.txt, decoding (EXIF orientation, colour
//! conversions), resize and crop geometry, bad files, augmentation and the epoch order. Every test
//! builds its own images with the `image` crate in its own temp dir.

use std::io::Cursor;
use std::path::{Path, PathBuf};

use candle_core::Device;
use image::codecs::jpeg::JpegEncoder;
use image::{ExtendedColorType, ImageBuffer, ImageEncoder, Luma, LumaA, Rgb, RgbImage, Rgba};
use rand::rngs::StdRng;
use rand::SeedableRng;
use sdtrain::data::{
    self, epoch_order, flip_p, hflip, load_data_root, load_dataset, load_image, scan, shuffle_tags,
    to_tensor, DataError,
};

fn write_rgb(path: &Path, w: u32, h: u32, f: impl Fn(u32, u32) -> [u8; 3]) {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).unwrap();
    }
    RgbImage::from_fn(w, h, |x, y| Rgb(f(x, y)))
        .save(path)
        .unwrap();
}

fn solid(path: &Path) {
    write_rgb(path, 8, 8, |_, _| [10, 20, 30]);
}

fn rel(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap()
        .to_string_lossy()
        .replace('\\', "/")
}

fn px(image: &data::TrainImage, x: usize, y: usize) -> [u8; 3] {
    let i = (y * image.width + x) * 3;
    [image.pixels[i], image.pixels[i + 1], image.pixels[i + 2]]
}

fn close(a: [u8; 3], b: [u8; 3], tol: i32) -> bool {
    a.iter()
        .zip(b)
        .all(|(&x, y)| (i32::from(x) - i32::from(y)).abs() <= tol)
}

#[test]
fn captions_come_from_txt_then_caption_then_file_name() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    solid(&root.join("a photo_1.png"));
    solid(&root.join("b_2.png"));
    std::fs::write(root.join("b_2.txt"), "  a blue ball ,shiny,  shiny \n").unwrap();
    solid(&root.join("c_3.JPG"));
    std::fs::write(root.join("c_3.caption"), "a cat").unwrap();
    solid(&root.join("d_4.png"));
    std::fs::write(root.join("d_4.txt"), "from txt").unwrap();
    std::fs::write(root.join("d_4.caption"), "from caption").unwrap();
    solid(&root.join("e_5.png"));
    std::fs::write(root.join("e_5.txt"), "   \n").unwrap();

    let records = scan(root).unwrap();
    let got: Vec<(String, String)> = records
        .iter()
        .map(|r| (rel(root, &r.path), r.caption.clone()))
        .collect();
    let want = [
        ("a photo_1.png", "a photo"),
        ("b_2.png", "a blue ball, shiny"),
        ("c_3.JPG", "a cat"),
        ("d_4.png", "from txt"),
        ("e_5.png", "e"),
    ];
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    assert_eq!(got, want);
}

#[test]
fn nested_folders_are_scanned_in_sorted_order() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    for name in [
        "z.png",
        "a.jpeg",
        "sub/deeper/q.webp",
        "sub/m.bmp",
        "other/k.png",
        "notes.txt",
    ] {
        let path = root.join(name);
        if name.ends_with(".txt") {
            std::fs::write(path, "x").unwrap();
        } else {
            solid(&path);
        }
    }
    let records = scan(root).unwrap();
    let got: Vec<String> = records.iter().map(|r| rel(root, &r.path)).collect();
    assert_eq!(
        got,
        [
            "a.jpeg",
            "other/k.png",
            "sub/deeper/q.webp",
            "sub/m.bmp",
            "z.png"
        ]
    );
    assert_eq!(scan(root).unwrap(), records);
}

#[test]
fn multiply_txt_repeats_its_folder_only() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    solid(&root.join("top.png"));
    solid(&root.join("rep/a.png"));
    solid(&root.join("rep/b.png"));
    std::fs::write(root.join("rep/multiply.txt"), "3\n").unwrap();
    solid(&root.join("rep/child/c.png"));
    solid(&root.join("half/d.png"));
    solid(&root.join("half/e.png"));
    std::fs::write(root.join("half/multiply.txt"), "0.5").unwrap();

    let records = scan(root).unwrap();
    let mult: Vec<(String, f64)> = records
        .iter()
        .map(|r| (rel(root, &r.path), r.multiplier))
        .collect();
    assert_eq!(
        mult,
        [
            ("half/d.png".to_string(), 0.5),
            ("half/e.png".to_string(), 0.5),
            ("rep/a.png".to_string(), 3.0),
            ("rep/b.png".to_string(), 3.0),
            ("rep/child/c.png".to_string(), 1.0),
            ("top.png".to_string(), 1.0),
        ]
    );

    let loaded = load_dataset(&records, false).unwrap();
    // floor(0.5 + 0.5 + 3 + 3 + 1 + 1) = 9: a and b three times, c and top once, one of d/e.
    assert_eq!(loaded.epoch_len(), 9);
    for epoch in 0..5 {
        let indices = loaded.epoch_indices(7, epoch);
        assert_eq!(indices, loaded.epoch_indices(7, epoch));
        assert_eq!(indices.len(), 9);
        let count = |i: usize| indices.iter().filter(|&&j| j == i).count();
        assert_eq!((count(2), count(3), count(4), count(5)), (3, 3, 1, 1));
        assert_eq!(count(0) + count(1), 1);
    }
}

#[test]
fn malformed_multiply_txt_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    solid(&dir.path().join("set/a.png"));
    let bad = dir.path().join("set/multiply.txt");
    std::fs::write(&bad, "twice").unwrap();
    let err = scan(dir.path()).unwrap_err();
    assert!(matches!(err, DataError::Multiply { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&bad.display().to_string()), "{msg}");
    assert!(msg.contains("twice"), "{msg}");
}

/// A big-endian TIFF chunk holding one IFD entry: Orientation (0x0112) = `orientation`.
fn exif_orientation(orientation: u8) -> Vec<u8> {
    let mut chunk = b"MM\0\x2a".to_vec();
    chunk.extend(8u32.to_be_bytes());
    chunk.extend(1u16.to_be_bytes());
    chunk.extend([0x01, 0x12, 0x00, 0x03, 0, 0, 0, 1, 0, orientation, 0, 0]);
    chunk.extend(0u32.to_be_bytes());
    chunk
}

/// Writes a 32×16 JPEG, left half red and right half blue, with an EXIF orientation tag.
fn write_oriented_jpeg(path: &Path, orientation: u8) {
    let img = RgbImage::from_fn(32, 16, |x, _| {
        if x < 16 {
            Rgb([255, 0, 0])
        } else {
            Rgb([0, 0, 255])
        }
    });
    let mut bytes = Vec::new();
    let mut encoder = JpegEncoder::new_with_quality(&mut bytes, 100);
    encoder
        .set_exif_metadata(exif_orientation(orientation))
        .unwrap();
    encoder
        .write_image(img.as_raw(), 32, 16, ExtendedColorType::Rgb8)
        .unwrap();
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn exif_orientation_is_applied() {
    const RED: [u8; 3] = [255, 0, 0];
    const BLUE: [u8; 3] = [0, 0, 255];
    let dir = tempfile::tempdir().unwrap();
    // (orientation, colour at the top of the displayed image, colour at the bottom)
    for (orientation, top, bottom) in [(6u8, RED, BLUE), (8, BLUE, RED)] {
        let path = dir.path().join(format!("o{orientation}.jpg"));
        write_oriented_jpeg(&path, orientation);
        let rgb = data::image_load::decode_rgb(&path).unwrap();
        assert_eq!(
            (rgb.width(), rgb.height()),
            (16, 32),
            "orientation {orientation}"
        );
        assert!(
            close(rgb.get_pixel(8, 4).0, top, 8),
            "o{orientation} top {:?}",
            rgb.get_pixel(8, 4)
        );
        assert!(
            close(rgb.get_pixel(8, 27).0, bottom, 8),
            "o{orientation} bottom"
        );

        // Loaded at 16: no resize, the centre 16×16 of the 16×32 portrait (rows 8..24).
        let image = load_image(&path, 16).unwrap();
        assert_eq!(image.original_size, (32, 16));
        assert_eq!(image.resized_size, (32, 16));
        assert_eq!(image.crop_top_left, (8, 0));
        assert!(close(px(&image, 8, 2), top, 8));
        assert!(close(px(&image, 8, 13), bottom, 8));
    }
    // Orientation 1 leaves the landscape image as it is.
    let path = dir.path().join("o1.jpg");
    write_oriented_jpeg(&path, 1);
    let rgb = data::image_load::decode_rgb(&path).unwrap();
    assert_eq!((rgb.width(), rgb.height()), (32, 16));
    assert!(close(rgb.get_pixel(4, 8).0, RED, 8));
}

#[test]
fn grayscale_rgba_and_16_bit_png_become_rgb() {
    let dir = tempfile::tempdir().unwrap();
    let gray = dir.path().join("gray.png");
    ImageBuffer::from_fn(8, 8, |_, _| Luma([77u8]))
        .save(&gray)
        .unwrap();
    let gray_alpha = dir.path().join("gray_alpha.png");
    ImageBuffer::from_fn(8, 8, |_, _| LumaA([200u8, 0]))
        .save(&gray_alpha)
        .unwrap();
    // Alpha is dropped, not composited (PIL's convert("RGB")): a fully transparent pixel keeps
    // its colour.
    let rgba = dir.path().join("rgba.png");
    ImageBuffer::from_fn(8, 8, |x, _| {
        Rgba(if x < 4 {
            [10u8, 20, 30, 0]
        } else {
            [40, 50, 60, 128]
        })
    })
    .save(&rgba)
    .unwrap();
    let rgb16 = dir.path().join("rgb16.png");
    ImageBuffer::from_fn(8, 8, |_, _| Rgb([65535u16, 32896, 0]))
        .save(&rgb16)
        .unwrap();
    let gray16 = dir.path().join("gray16.png");
    ImageBuffer::from_fn(8, 8, |_, _| Luma([257u16 * 99]))
        .save(&gray16)
        .unwrap();

    let cases: [(&Path, [u8; 3], [u8; 3]); 5] = [
        (&gray, [77, 77, 77], [77, 77, 77]),
        (&gray_alpha, [200, 200, 200], [200, 200, 200]),
        (&rgba, [10, 20, 30], [40, 50, 60]),
        (&rgb16, [255, 128, 0], [255, 128, 0]),
        (&gray16, [99, 99, 99], [99, 99, 99]),
    ];
    for (path, left, right) in cases {
        let image = load_image(path, 8).unwrap();
        assert_eq!(image.pixels.len(), 8 * 8 * 3, "{}", path.display());
        assert_eq!(px(&image, 0, 3), left, "{}", path.display());
        assert_eq!(px(&image, 7, 3), right, "{}", path.display());
    }
}

/// A hand-assembled baseline JPEG with four components (CMYK, Adobe APP14 transform 0), every
/// component a flat value. Quantisation is 1 and every block is DC-only, so the DC coefficient of
/// a flat 8×8 block of value `v` is `8 (v − 128)`; the AC table holds only end-of-block.
fn cmyk_jpeg(width: u16, height: u16, cmyk: [u8; 4]) -> Vec<u8> {
    fn segment(out: &mut Vec<u8>, marker: u8, payload: &[u8]) {
        out.extend([0xFF, marker]);
        out.extend(((payload.len() + 2) as u16).to_be_bytes());
        out.extend(payload);
    }
    struct Bits {
        out: Vec<u8>,
        acc: u32,
        n: u32,
    }
    impl Bits {
        fn put(&mut self, value: u32, len: u32) {
            for i in (0..len).rev() {
                self.acc = (self.acc << 1) | ((value >> i) & 1);
                self.n += 1;
                if self.n == 8 {
                    let byte = self.acc as u8;
                    self.out.push(byte);
                    if byte == 0xFF {
                        self.out.push(0); // byte stuffing
                    }
                    self.acc = 0;
                    self.n = 0;
                }
            }
        }
    }

    let mut out = vec![0xFF, 0xD8];
    segment(&mut out, 0xEE, b"Adobe\x00\x64\x00\x00\x00\x00\x00");
    let mut dqt = vec![0u8];
    dqt.extend([1u8; 64]);
    segment(&mut out, 0xDB, &dqt);
    let mut sof = vec![8];
    sof.extend(height.to_be_bytes());
    sof.extend(width.to_be_bytes());
    sof.push(4);
    for id in 1..=4u8 {
        sof.extend([id, 0x11, 0]);
    }
    segment(&mut out, 0xC0, &sof);
    // DC table 0: the twelve categories 0..=11, each a 4-bit code equal to the category.
    let mut dht = vec![0x00, 0, 0, 0, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    dht.extend(0u8..12);
    // AC table 0: end-of-block only, code `0`.
    dht.extend([0x10, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x00]);
    segment(&mut out, 0xC4, &dht);
    let mut sos = vec![4];
    for id in 1..=4u8 {
        sos.extend([id, 0x00]);
    }
    sos.extend([0, 63, 0]);
    segment(&mut out, 0xDA, &sos);

    let mut bits = Bits {
        out: Vec::new(),
        acc: 0,
        n: 0,
    };
    let blocks = usize::from(width / 8) * usize::from(height / 8);
    for block in 0..blocks {
        for value in cmyk {
            // The DC predictor makes every block after the first a difference of 0.
            let diff = if block == 0 {
                8 * (i32::from(value) - 128)
            } else {
                0
            };
            let category = 32 - diff.unsigned_abs().leading_zeros();
            bits.put(category, 4);
            if category > 0 {
                let v = if diff > 0 {
                    diff
                } else {
                    diff + (1 << category) - 1
                };
                bits.put(v as u32, category);
            }
            bits.put(0, 1); // end of block
        }
    }
    if bits.n > 0 {
        let pad = 8 - bits.n;
        bits.put((1 << pad) - 1, pad);
    }
    out.extend(bits.out);
    out.extend([0xFF, 0xD9]);
    out
}

#[test]
fn cmyk_jpeg_becomes_rgb() {
    // Stored Adobe CMYK is inverted (255 = no ink); libjpeg/PIL and zune-jpeg both give
    // R = C·K/255, G = M·K/255, B = Y·K/255 on the stored values.
    let dir = tempfile::tempdir().unwrap();
    for (cmyk, want) in [
        ([255u8, 0, 255, 255], [255u8, 0, 255]),
        ([255, 255, 255, 128], [128, 128, 128]),
        ([0, 255, 255, 255], [0, 255, 255]),
    ] {
        let path = dir.path().join("cmyk.jpg");
        std::fs::write(&path, cmyk_jpeg(16, 8, cmyk)).unwrap();
        let image = load_image(&path, 8).unwrap();
        assert_eq!(image.original_size, (8, 16));
        for (x, y) in [(0, 0), (7, 7), (3, 4)] {
            assert!(
                close(px(&image, x, y), want, 2),
                "{cmyk:?}: {:?}",
                px(&image, x, y)
            );
        }
    }
}

#[test]
fn resize_and_centre_crop_geometry() {
    let dir = tempfile::tempdir().unwrap();
    // 200×100 landscape in four vertical bands of 50 px: red, green, blue, white.
    let bands = [[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 255]];
    let wide = dir.path().join("wide.png");
    write_rgb(&wide, 200, 100, |x, _| bands[(x / 50) as usize]);
    let image = load_image(&wide, 64).unwrap();
    assert_eq!((image.width, image.height), (64, 64));
    assert_eq!(image.original_size, (100, 200));
    assert_eq!(image.resized_size, (64, 128));
    assert_eq!(image.crop_top_left, (0, 32));
    assert_eq!(image.target_size(), (64, 64));
    // Resized bands are 32 px wide; the window x ∈ [32, 96) holds green then blue.
    assert!(close(px(&image, 10, 32), [0, 255, 0], 2));
    assert!(close(px(&image, 53, 32), [0, 0, 255], 2));

    // 60×150 portrait in horizontal bands of 50 px: upscaled to 64×160, crop top 48.
    let tall = dir.path().join("tall.png");
    write_rgb(&tall, 60, 150, |_, y| bands[(y / 50) as usize]);
    let image = load_image(&tall, 64).unwrap();
    assert_eq!(image.original_size, (150, 60));
    assert_eq!(image.resized_size, (160, 64));
    assert_eq!(image.crop_top_left, (48, 0));
    // Resized bands are 53.3 px tall: rows 48..112 cover green (to 106.7), then blue.
    assert!(close(px(&image, 32, 20), [0, 255, 0], 2));
    assert!(close(px(&image, 32, 63), [0, 0, 255], 2));

    // A non-square target, as aspect buckets will ask for.
    let image = data::load_image_to(&wide, (128, 32)).unwrap();
    assert_eq!((image.width, image.height), (128, 32));
    assert_eq!(image.resized_size, (64, 128));
    assert_eq!(image.crop_top_left, (16, 0));
}

#[test]
fn corrupt_truncated_and_empty_files_are_skipped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    solid(&root.join("good_1.png"));
    solid(&root.join("sub/good_2.jpg"));
    let corrupt = root.join("corrupt.png");
    let noise: Vec<u8> = (0..512u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(&corrupt, noise).unwrap();
    let truncated = root.join("truncated.png");
    let mut png = Vec::new();
    RgbImage::from_fn(64, 64, |x, y| Rgb([x as u8 * 4, y as u8 * 4, 7]))
        .write_to(&mut Cursor::new(&mut png), image::ImageFormat::Png)
        .unwrap();
    std::fs::write(&truncated, &png[..png.len() / 2]).unwrap();
    let empty = root.join("empty.webp");
    std::fs::write(&empty, b"").unwrap();

    let records = scan(root).unwrap();
    assert_eq!(records.len(), 5);
    let loaded = load_dataset(&records, false).unwrap();
    let kept: Vec<String> = loaded.items.iter().map(|i| rel(root, &i.path)).collect();
    assert_eq!(kept, ["good_1.png", "sub/good_2.jpg"]);
    assert_eq!(loaded.items[0].caption, "good");
    let skipped: Vec<PathBuf> = loaded.skipped.iter().map(|(p, _)| p.clone()).collect();
    assert_eq!(skipped, [corrupt, empty, truncated]);
    for (path, reason) in &loaded.skipped {
        assert!(!reason.is_empty(), "{}", path.display());
    }
    assert!(
        loaded.skipped[1].1.contains("0 bytes"),
        "{}",
        loaded.skipped[1].1
    );
}

/// A JPEG cut to 45% of its bytes: the `image` crate's decoder can fill the missing part with
/// grey and succeed (it did on a user's photo); Pillow refuses it, and so do we, from the missing
/// end marker, with a warning.
#[test]
fn a_truncated_jpeg_is_skipped_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    solid(&root.join("good.png"));
    let mut jpeg = Vec::new();
    RgbImage::from_fn(96, 64, |x, y| Rgb([x as u8 * 2, y as u8 * 3, 40]))
        .write_to(&mut Cursor::new(&mut jpeg), image::ImageFormat::Jpeg)
        .unwrap();
    let cut = root.join("cut.jpg");
    std::fs::write(&cut, &jpeg[..jpeg.len() * 45 / 100]).unwrap();
    let loaded = load_data_root(root, false).unwrap();
    assert_eq!(loaded.items.len(), 1);
    assert_eq!(loaded.skipped.len(), 1);
    assert_eq!(loaded.skipped[0].0, cut);
    assert!(
        loaded.skipped[0].1.contains("truncated JPEG"),
        "{}",
        loaded.skipped[0].1
    );
}

/// CRC-32 (PNG's), for patching a chunk.
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for &b in bytes {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// An image over `max_image_pixels` is refused from its header, before any decoding: a PNG
/// whose header says 30000×30000 (its data is a few bytes), and a real 16×16 under a limit of
/// 100 pixels, which a raised limit then accepts.
#[test]
fn images_over_the_pixel_limit_are_skipped_before_decoding() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let mut png = Vec::new();
    RgbImage::from_pixel(1, 1, Rgb([1, 2, 3]))
        .write_to(&mut Cursor::new(&mut png), image::ImageFormat::Png)
        .unwrap();
    // IHDR is the first chunk: length (4) "IHDR" width height … CRC, from byte 8.
    png[16..20].copy_from_slice(&30000u32.to_be_bytes());
    png[20..24].copy_from_slice(&30000u32.to_be_bytes());
    let crc = crc32(&png[12..29]);
    png[29..33].copy_from_slice(&crc.to_be_bytes());
    let bomb = root.join("bomb.png");
    std::fs::write(&bomb, &png).unwrap();
    write_rgb(&root.join("small.png"), 16, 16, |_, _| [9, 9, 9]);
    let loaded = load_data_root(root, false).unwrap();
    assert_eq!(loaded.skipped.len(), 1);
    let (path, reason) = &loaded.skipped[0];
    assert_eq!(path, &bomb);
    assert!(
        reason.contains("30000×30000") && reason.contains("max_image_pixels"),
        "{reason}"
    );
    let err = data::load_data_root_limited(root, false, 100).unwrap_err();
    assert!(err.to_string().contains("all 2 skipped"), "{err}");
    let raised = data::load_data_root_limited(root, false, 256).unwrap();
    assert_eq!(raised.items.len(), 1);
}

#[test]
fn folder_with_only_bad_images_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("my data");
    std::fs::create_dir_all(root.join("sub")).unwrap();
    std::fs::write(root.join("a.png"), b"not a png at all").unwrap();
    std::fs::write(root.join("sub/b.jpg"), b"").unwrap();
    let err = load_data_root(&root, false).unwrap_err();
    match &err {
        DataError::NoUsableImages { found, skipped, .. } => {
            assert_eq!(*found, 2);
            assert_eq!(skipped.len(), 2);
        }
        other => panic!("wrong error: {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains(&root.display().to_string()), "{msg}");
    assert!(msg.contains("2 found, all 2 skipped"), "{msg}");
    assert!(msg.contains("a.png"), "{msg}");

    // The same through load_dataset, which names the records' common folder.
    let err = load_dataset(&scan(&root).unwrap(), false).unwrap_err();
    assert!(
        err.to_string().contains(&root.display().to_string()),
        "{err}"
    );

    // And a folder with no image files at all.
    let empty = dir.path().join("nothing");
    std::fs::create_dir(&empty).unwrap();
    std::fs::write(empty.join("readme.txt"), "x").unwrap();
    let err = scan(&empty).unwrap_err();
    assert!(matches!(err, DataError::NoImages { .. }));
    assert!(err.to_string().contains("nothing"), "{err}");
}

#[test]
fn load_keeps_scan_order_under_parallel_decode() {
    let dir = tempfile::tempdir().unwrap();
    for i in 0..40u32 {
        // Varying sizes so that decode times differ between threads.
        let size = 8 + (i * 37 % 11) * 16;
        write_rgb(
            &dir.path().join(format!("img{i:02}_x.png")),
            size,
            size,
            |_, _| [i as u8, 0, 0],
        );
    }
    let loaded = load_data_root(dir.path(), false).unwrap();
    assert!(loaded.skipped.is_empty());
    for (i, item) in loaded.items.iter().enumerate() {
        assert_eq!(item.caption, format!("img{i:02}"));
        let size = 8 + (i as u32 * 37 % 11) * 16;
        assert_eq!(item.size, (size as usize, size as usize));
        assert_eq!(px(&load_image(&item.path, 8).unwrap(), 4, 4)[0], i as u8);
    }
}

#[test]
fn flip_mirrors_pixels_and_sdxl_crop() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gradient.png");
    write_rgb(&path, 24, 8, |x, y| [x as u8 * 10, y as u8 * 30, 5]);
    let image = load_image(&path, 8).unwrap();
    assert_eq!(image.crop_top_left, (0, 8));
    let flipped = hflip(&image);
    for y in 0..8 {
        for x in 0..8 {
            assert_eq!(px(&flipped, x, y), px(&image, 7 - x, y));
        }
    }
    // resized width 24 − left 8 − width 8 = 8: a centred crop mirrors onto itself...
    assert_eq!(flipped.crop_top_left, (0, 8));
    // ...an off-centre one does not.
    let mut off = image.clone();
    off.crop_top_left = (0, 2);
    assert_eq!(hflip(&off).crop_top_left, (0, 14));

    let mut rng = StdRng::seed_from_u64(0);
    assert_eq!(*flip_p(&image, 1.0, &mut rng), flipped);
    assert_eq!(*flip_p(&image, 0.0, &mut rng), image);
}

#[test]
fn shuffle_tags_keeps_the_first_tag() {
    let mut rng = StdRng::seed_from_u64(11);
    let caption = "portrait of a woman, red hair, smiling, outdoors, bokeh, 35mm";
    let mut orders = std::collections::HashSet::new();
    for _ in 0..30 {
        let out = shuffle_tags(caption, &mut rng);
        assert!(out.starts_with("portrait of a woman, "), "{out}");
        let mut tags: Vec<&str> = out.split(", ").skip(1).collect();
        orders.insert(tags.join("|"));
        tags.sort();
        assert_eq!(tags, ["35mm", "bokeh", "outdoors", "red hair", "smiling"]);
    }
    assert!(orders.len() > 5, "tags were hardly shuffled: {orders:?}");
}

#[test]
fn epoch_order_is_deterministic_and_a_permutation() {
    let a = epoch_order(50, 1234, 0);
    assert_eq!(a, epoch_order(50, 1234, 0));
    let mut sorted = a.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..50).collect::<Vec<_>>());
    assert_ne!(a, epoch_order(50, 1234, 1));
    assert_ne!(a, (0..50).collect::<Vec<_>>());
}

#[test]
fn loaded_images_batch_into_a_tensor() {
    let dir = tempfile::tempdir().unwrap();
    write_rgb(&dir.path().join("black.png"), 16, 16, |_, _| [0, 0, 0]);
    write_rgb(&dir.path().join("white.png"), 16, 16, |_, _| {
        [255, 255, 255]
    });
    let loaded = load_data_root(dir.path(), false).unwrap();
    let images: Vec<data::TrainImage> = loaded
        .items
        .iter()
        .map(|i| load_image(&i.path, 16).unwrap())
        .collect();
    let refs: Vec<&data::TrainImage> = images.iter().collect();
    let batch = to_tensor(&refs, &Device::Cpu).unwrap();
    assert_eq!(batch.dims(), &[2, 3, 16, 16]);
    let means: Vec<f32> = batch
        .mean_keepdim((1, 2, 3))
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(means, [-1.0, 1.0]);
}

#[test]
fn shipped_demo_dataset_scans_and_loads() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/demo");
    let records = scan(&root).unwrap();
    assert!((6..=8).contains(&records.len()), "{}", records.len());
    for record in &records {
        assert!(record.caption.len() > 5, "{}", record.path.display());
    }
    let loaded = load_dataset(&records, false).unwrap();
    assert!(loaded.skipped.is_empty(), "{:?}", loaded.skipped);
    assert_eq!(loaded.items.len(), records.len());
}
