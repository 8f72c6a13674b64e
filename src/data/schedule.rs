//! `write_schedule`: each epoch's batches written to `ep{epoch}_batch_schedule.txt` in the run
//! folder, in EveryDream2's format (`write_batch_schedule`, `train.py`), one line per sample in
//! training order:
//!
//! `step:00003, wh:[512, 512], r:1, path:/abs/path/img.jpg`
//!
//! `step` is the micro-batch's index in the epoch (EveryDream2 counts `i / batch_size`), `wh` the
//! bucket, `r` the runt size (how many distinct images a runt batch was filled from; 0 in a full
//! batch), and the epoch number 0-based, as EveryDream2 writes them.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::dataset::ImageMeta;
use super::epoch_plan::MicroBatch;
use super::DataError;

/// The schedule file of 0-based epoch `epoch` in `dir`.
pub fn schedule_path(dir: &Path, epoch: usize) -> PathBuf {
    dir.join(format!("ep{epoch}_batch_schedule.txt"))
}

/// The runt size of a batch: the `r` of `weight = (r / batch)^1.5`, 0 for a full batch.
fn runt_size(batch: &MicroBatch) -> usize {
    if batch.weight >= 1.0 {
        return 0;
    }
    (batch.weight.powf(2.0 / 3.0) * batch.ids.len() as f64).round() as usize
}

/// The schedule text of `batches` over `items`.
pub fn schedule_text(batches: &[MicroBatch], items: &[ImageMeta]) -> String {
    let mut out = String::new();
    for (step, batch) in batches.iter().enumerate() {
        let r = runt_size(batch);
        for &id in &batch.ids {
            let path = items
                .get(id)
                .map(|item| std::path::absolute(&item.path).unwrap_or_else(|_| item.path.clone()))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "step:{step:05}, wh:[{}, {}], r:{r}, path:{}",
                batch.bucket.width,
                batch.bucket.height,
                path.display()
            );
        }
    }
    out
}

/// Writes the schedule of 0-based epoch `epoch` into `dir`.
pub fn write_schedule(
    dir: &Path,
    epoch: usize,
    batches: &[MicroBatch],
    items: &[ImageMeta],
) -> Result<PathBuf, DataError> {
    let path = schedule_path(dir, epoch);
    std::fs::write(&path, schedule_text(batches, items)).map_err(|source| {
        DataError::WriteFile {
            path: path.clone(),
            source,
        }
    })?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Bucket;

    #[test]
    fn lines_follow_ed2_format_with_runt_sizes() {
        let items: Vec<ImageMeta> = (0..3)
            .map(|i| ImageMeta {
                path: PathBuf::from(format!("/d/{i}.png")),
                caption: String::new(),
                multiplier: 1.0,
                size: (64, 64),
                options: Default::default(),
            })
            .collect();
        let b = Bucket::new(64, 32);
        let batches = [
            MicroBatch {
                ids: vec![0, 1, 2],
                bucket: b,
                weight: 1.0,
            },
            MicroBatch {
                ids: vec![2, 2, 2],
                bucket: b,
                weight: (1.0f64 / 3.0).powf(1.5),
            },
            MicroBatch {
                ids: vec![0, 1, 0],
                bucket: b,
                weight: (2.0f64 / 3.0).powf(1.5),
            },
        ];
        let text = schedule_text(&batches, &items);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 9);
        assert_eq!(lines[0], "step:00000, wh:[64, 32], r:0, path:/d/0.png");
        assert_eq!(lines[3], "step:00001, wh:[64, 32], r:1, path:/d/2.png");
        assert_eq!(lines[8], "step:00002, wh:[64, 32], r:2, path:/d/0.png");
    }
}
