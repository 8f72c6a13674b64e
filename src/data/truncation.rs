//! Truncated files the decoders accept. The `image` crate's JPEG decoder (zune-jpeg) fills the
//! missing part of a truncated JPEG with grey and reports success; Pillow (EveryDream2,
//! kohya) refuses such a file ("image file is truncated"). A JPEG is complete when its end of
//! image marker (`FF D9`) follows the start of its scan data.
//!
//! The segments before the first start-of-scan (`FF DA`) are walked by their lengths, so an
//! EXIF thumbnail's own end marker (inside an APP1 segment) does not count. In the scan data a
//! literal `FF` byte is always followed by `00` (byte stuffing) or a restart marker, so `FF D9`
//! there is the end marker.

/// `Some(reason)` when `bytes` is a truncated PNG or WebP: checks from the container alone, so the
/// loader can refuse a cut file without decoding it. A PNG must walk chunk by chunk (length +
/// type + data + CRC) to its `IEND` chunk; a WebP's RIFF header gives its length.
pub fn truncated_container(bytes: &[u8]) -> Option<String> {
    const PNG: &[u8] = b"\x89PNG\r\n\x1a\n";
    if bytes.starts_with(PNG) {
        let mut pos = PNG.len();
        while pos + 8 <= bytes.len() {
            let len =
                u32::from_be_bytes([bytes[pos], bytes[pos + 1], bytes[pos + 2], bytes[pos + 3]]);
            let kind = &bytes[pos + 4..pos + 8];
            let next = pos + 12 + len as usize;
            if next > bytes.len() {
                break;
            }
            if kind == b"IEND" {
                return None;
            }
            pos = next;
        }
        return Some(format!(
            "truncated PNG: the file ends at byte {} before its IEND chunk",
            bytes.len()
        ));
    }
    if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        let declared = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]) as usize + 8;
        if bytes.len() < declared {
            return Some(format!(
                "truncated WebP: {} of the {declared} bytes its header declares",
                bytes.len()
            ));
        }
    }
    None
}

/// `Some(reason)` when `bytes` is a JPEG (starts with `FF D8`) whose end is missing.
pub fn truncated_jpeg(bytes: &[u8]) -> Option<String> {
    if bytes.len() < 4 || bytes[0] != 0xFF || bytes[1] != 0xD8 {
        return None;
    }
    let mut pos = 2;
    let scan_start = loop {
        // Markers may be preceded by fill bytes (FF).
        while pos < bytes.len() && bytes[pos] == 0xFF && bytes.get(pos + 1) == Some(&0xFF) {
            pos += 1;
        }
        if pos + 4 > bytes.len() {
            return Some(format!(
                "truncated JPEG: the file ends at byte {} inside its headers",
                bytes.len()
            ));
        }
        if bytes[pos] != 0xFF {
            // Not a marker where one must be: leave the verdict to the decoder.
            return None;
        }
        let marker = bytes[pos + 1];
        let len = u16::from_be_bytes([bytes[pos + 2], bytes[pos + 3]]) as usize;
        let next = pos + 2 + len;
        if marker == 0xDA {
            break next;
        }
        if marker == 0xD9 {
            return Some("JPEG with no image data (end marker before any scan)".into());
        }
        pos = next;
    };
    if scan_start > bytes.len() {
        return Some(format!(
            "truncated JPEG: the file ends at byte {} inside its scan header",
            bytes.len()
        ));
    }
    let has_end = bytes[scan_start..].windows(2).any(|w| w == [0xFF, 0xD9]);
    (!has_end).then(|| {
        format!(
            "truncated JPEG: no end-of-image marker after its image data ({} bytes; Pillow \
             refuses it as truncated)",
            bytes.len()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small real JPEG, encoded here.
    fn jpeg() -> Vec<u8> {
        let img =
            image::RgbImage::from_fn(48, 32, |x, y| image::Rgb([x as u8 * 5, y as u8 * 7, 90]));
        let mut out = std::io::Cursor::new(Vec::new());
        image::DynamicImage::ImageRgb8(img)
            .write_to(&mut out, image::ImageFormat::Jpeg)
            .unwrap();
        out.into_inner()
    }

    #[test]
    fn a_complete_jpeg_passes_and_a_truncated_one_is_caught() {
        let full = jpeg();
        assert_eq!(truncated_jpeg(&full), None);
        // Trailing bytes after the end marker are allowed, as by Pillow.
        let mut trailing = full.clone();
        trailing.extend_from_slice(b"\0\0padding");
        assert_eq!(truncated_jpeg(&trailing), None);
        for keep in [0.45, 0.9, 0.99] {
            let cut = &full[..(full.len() as f64 * keep) as usize];
            assert!(truncated_jpeg(cut).is_some(), "kept {keep}");
        }
        assert!(truncated_jpeg(&full[..20]).is_some());
        // Not a JPEG: no verdict.
        assert_eq!(truncated_jpeg(b"\x89PNG\r\n\x1a\n...."), None);
    }

    /// An end marker inside an APP1 segment (an EXIF thumbnail's) does not make a truncated
    /// image complete.
    #[test]
    fn a_thumbnail_end_marker_in_a_header_segment_does_not_count() {
        let full = jpeg();
        let thumb = [0xFF, 0xD8, 0x00, 0x01, 0xFF, 0xD9];
        let mut app1 = vec![0xFF, 0xE1];
        app1.extend_from_slice(&((thumb.len() + 2) as u16).to_be_bytes());
        app1.extend_from_slice(&thumb);
        let mut with_thumb = full[..2].to_vec();
        with_thumb.extend_from_slice(&app1);
        with_thumb.extend_from_slice(&full[2..]);
        assert_eq!(truncated_jpeg(&with_thumb), None);
        let cut = &with_thumb[..with_thumb.len() / 2];
        assert!(truncated_jpeg(cut).is_some());
    }

    #[test]
    fn truncated_png_and_webp_are_recognised() {
        let mut png = Vec::new();
        image::RgbImage::from_fn(16, 16, |x, y| image::Rgb([x as u8, y as u8, 3]))
            .write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
            .unwrap();
        assert_eq!(truncated_container(&png), None);
        for cut in [png.len() - 1, png.len() - 12, png.len() / 2, 20] {
            let why = truncated_container(&png[..cut]).unwrap();
            assert!(why.contains("truncated PNG"), "{why}");
        }
        let mut webp = b"RIFF".to_vec();
        webp.extend_from_slice(&100u32.to_le_bytes());
        webp.extend_from_slice(b"WEBP");
        webp.resize(108, 0);
        assert_eq!(truncated_container(&webp), None);
        assert!(truncated_container(&webp[..60]).unwrap().contains("WebP"));
        assert_eq!(truncated_container(b"not an image"), None);
    }
}
