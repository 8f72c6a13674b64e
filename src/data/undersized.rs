//! Images smaller than their training size, which are upscaled: EveryDream2 warns once and lists
//! them in `undersized_images.txt` (`train.py` `report_image_train_item_problems`;
//! `data/image_train_item.py` `__compute_target_width_height` for the criterion). sdtrain does the
//! same, with one warning line that names a few of them and the list in the run folder.

use std::path::{Path, PathBuf};

use super::bucket::Bucket;
use super::dataset::ImageMeta;
use super::DataError;

/// EveryDream2's name for the list.
pub const UNDERSIZED_FILE: &str = "undersized_images.txt";

/// How many images the warning line names.
const NAMED: usize = 3;

/// One image smaller than its bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct Undersized {
    pub path: PathBuf,
    /// Upright `(width, height)`.
    pub size: (usize, usize),
    pub bucket: Bucket,
}

/// EveryDream2's test, on the upright size: neither side equals the bucket's, and the area is
/// under the bucket's grown by 2% per side (`w·h < tw·1.02 · th·1.02`). So a 580×580 image for
/// 512×512 is not undersized, a 30×30 one is, and a 512×300 one is not (its width fits).
pub fn is_undersized(size: (usize, usize), bucket: Bucket) -> bool {
    let (w, h) = size;
    let area = (w * h) as f64;
    let target = bucket.width as f64 * 1.02 * bucket.height as f64 * 1.02;
    w != bucket.width && h != bucket.height && area < target
}

/// The items (with `buckets[i]` the bucket of `items[i]`) that are undersized, in item order.
pub fn find_undersized(items: &[ImageMeta], buckets: &[Bucket]) -> Vec<Undersized> {
    items
        .iter()
        .zip(buckets)
        .filter(|(item, &bucket)| is_undersized(item.size, bucket))
        .map(|(item, &bucket)| Undersized {
            path: item.path.clone(),
            size: item.size,
            bucket,
        })
        .collect()
}

/// The one warning line for `list` (non-empty), naming the first few images relative to
/// `data_root` and where the whole list is.
pub fn warning_line(list: &[Undersized], data_root: &Path, written_to: &Path) -> String {
    let mut named: Vec<String> = list
        .iter()
        .take(NAMED)
        .map(|u| {
            let shown = u.path.strip_prefix(data_root).unwrap_or(&u.path);
            format!(
                "{} {}x{} for {}",
                shown.display(),
                u.size.0,
                u.size.1,
                u.bucket
            )
        })
        .collect();
    if list.len() > NAMED {
        named.push(format!("and {} more", list.len() - NAMED));
    }
    format!(
        "warning: {} image{} smaller than the target size and upscaled ({}); consider larger \
         images; the list is in {}",
        list.len(),
        if list.len() == 1 { " is" } else { "s are" },
        named.join(", "),
        written_to.display()
    )
}

/// Writes `list` into `dir/undersized_images.txt`, one line per image as EveryDream2 writes it,
/// and returns the file's path.
pub fn write_list(dir: &Path, list: &[Undersized]) -> Result<PathBuf, DataError> {
    let path = dir.join(UNDERSIZED_FILE);
    let mut text = String::from(
        "The following images are smaller than the target size, consider removing or sourcing \
         a larger copy:\n",
    );
    for u in list {
        text.push_str(&format!(
            " *** {} with size: ({}, {}) is smaller than target size: [{}, {}]\n",
            u.path.display(),
            u.size.0,
            u.size.1,
            u.bucket.width,
            u.bucket.height
        ));
    }
    std::fs::write(&path, text).map_err(|source| DataError::WriteFile {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::bucket::{aspect_buckets, nearest_bucket};

    /// EveryDream2's `test/test_image_train_item.py` `test_target_size_computation`, with its
    /// 512 buckets.
    #[test]
    fn the_criterion_matches_everydream2s_tests() {
        let buckets = aspect_buckets(512, 64, None);
        for (size, target, undersized) in [
            ((30, 30), (512, 512), true),
            ((512, 512), (512, 512), false),
            ((580, 580), (512, 512), false),
            ((64, 38), (640, 384), true),
            ((640, 384), (640, 384), false),
            ((704, 422), (640, 384), false),
            ((38, 64), (384, 640), true),
            ((384, 640), (384, 640), false),
            ((422, 704), (384, 640), false),
        ] {
            let bucket = nearest_bucket(&buckets, size.0, size.1).unwrap();
            assert_eq!((bucket.width, bucket.height), target, "{size:?}");
            assert_eq!(is_undersized(size, bucket), undersized, "{size:?}");
        }
        // One side equal to the bucket's: not undersized, as in EveryDream2.
        assert!(!is_undersized((512, 300), Bucket::new(512, 512)));
    }

    #[test]
    fn the_warning_is_one_line_naming_a_few() {
        let list: Vec<Undersized> = (0..5)
            .map(|i| Undersized {
                path: PathBuf::from(format!("/d/sub/img{i}.png")),
                size: (30, 20),
                bucket: Bucket::new(64, 48),
            })
            .collect();
        let line = warning_line(
            &list,
            Path::new("/d"),
            Path::new("/run/undersized_images.txt"),
        );
        assert!(!line.contains('\n'), "{line}");
        assert!(line.starts_with("warning: 5 images are smaller"), "{line}");
        assert!(line.contains("sub/img0.png 30x20 for 64x48"), "{line}");
        assert!(
            line.contains("and 2 more") && !line.contains("img3"),
            "{line}"
        );
        let dir = tempfile::tempdir().unwrap();
        let written = write_list(dir.path(), &list).unwrap();
        let text = std::fs::read_to_string(written).unwrap();
        assert_eq!(text.lines().count(), 6, "{text}");
        assert!(
            text.contains(
                " *** /d/sub/img4.png with size: (30, 20) is smaller than target size: [64, 48]"
            ),
            "{text}"
        );
    }
}
