//! [`EventWriter`]: one event file in a log folder, written as TensorBoard's own writer does.
//!
//! - The file is `events.out.tfevents.<unix seconds, 10 digits>.<host>.<pid>.<n>`, the name
//!   TensorBoard's `EventFileWriter` (and so PyTorch's `SummaryWriter`) gives, so a folder of
//!   runs sorts and loads as theirs do.
//! - Its first event is `file_version: "brain.Event:2"`.
//! - Every event is flushed as written (TensorBoard's writer batches for up to two minutes): a
//!   few hundred bytes per logged step, and a killed run keeps every step it logged.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::error::EventFileError;
use super::event::{Event, Image, Value, ValueData, What, FILE_VERSION};
use super::reader::event_files;
use super::record::{frame, parse_records, write_record};

/// Tells apart two files one process opens in the same second.
static FILE_COUNTER: AtomicU64 = AtomicU64::new(0);

/// `SourceMetadata.writer` of the first event.
const WRITER_NAME: &str = "sdtrain";

pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// Starts a new event file in `dir` (which must exist).
    pub fn create(dir: &Path) -> Result<Self, EventFileError> {
        let now = unix_now();
        let name = format!(
            "events.out.tfevents.{:010}.{}.{}.{}",
            now as u64,
            hostname(),
            std::process::id(),
            FILE_COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let file = File::create(&path).map_err(EventFileError::io("create", &path))?;
        let mut writer = Self {
            path,
            out: BufWriter::new(file),
        };
        writer.write_event(&Event {
            wall_time: now,
            step: 0,
            what: What::FileVersion(FILE_VERSION.into()),
            source_writer: Some(WRITER_NAME.into()),
        })?;
        Ok(writer)
    }

    /// For a run resumed after `steps` steps: drops the events of later steps (logged after the
    /// save point, then lost with the run, and about to be trained again) from the event files
    /// already in `dir`, then starts a new file there. TensorBoard reads the folder's files as
    /// one run, so each step appears once. (As [`crate::train::log::JsonlLog::resume`].)
    pub fn resume(dir: &Path, steps: usize) -> Result<Self, EventFileError> {
        for file in event_files(dir)? {
            drop_steps_after(&file, steps as i64)?;
        }
        Self::create(dir)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one event and flushes it to the file.
    pub fn write_event(&mut self, event: &Event) -> Result<(), EventFileError> {
        let path = &self.path;
        write_record(&mut self.out, &event.encode()).map_err(EventFileError::io("write", path))?;
        self.out.flush().map_err(EventFileError::io("write", path))
    }

    /// Writes the scalars of `step`, as one event. Values are stored as f32 (`simple_value`).
    pub fn add_scalars(
        &mut self,
        step: usize,
        scalars: &[(String, f64)],
    ) -> Result<(), EventFileError> {
        let values = scalars
            .iter()
            .map(|(tag, x)| Value {
                tag: tag.clone(),
                data: ValueData::Scalar(*x as f32),
            })
            .collect();
        self.write_summary(step, values)
    }

    /// Writes a PNG image under `tag` at `step`, for TensorBoard's image dashboard. The colour
    /// space comes from the PNG's header (RGB when it cannot be read).
    pub fn add_image_png(
        &mut self,
        tag: &str,
        step: usize,
        png: &[u8],
        width: u32,
        height: u32,
    ) -> Result<(), EventFileError> {
        let image = Image {
            height: i32::try_from(height).unwrap_or(i32::MAX),
            width: i32::try_from(width).unwrap_or(i32::MAX),
            colorspace: png_colorspace(png),
            encoded: png.to_vec(),
        };
        let value = Value {
            tag: tag.into(),
            data: ValueData::Image(image),
        };
        self.write_summary(step, vec![value])
    }

    fn write_summary(&mut self, step: usize, values: Vec<Value>) -> Result<(), EventFileError> {
        self.write_event(&Event {
            wall_time: unix_now(),
            step: step as i64,
            what: What::Summary(values),
            source_writer: None,
        })
    }
}

/// Rewrites `path` without the events of steps after `steps` (the file-version event, step 0,
/// stays). A file with none is left as it is; so is a damaged one, past its first bad record,
/// which TensorBoard reads as far as it can.
fn drop_steps_after(path: &Path, steps: i64) -> Result<(), EventFileError> {
    let bytes = std::fs::read(path).map_err(EventFileError::io("read", path))?;
    let (records, _) = parse_records(&bytes);
    let mut kept = Vec::with_capacity(bytes.len());
    let mut dropped = false;
    for r in &records {
        let event = Event::decode(&r.data).map_err(|e| e.in_file(path))?;
        if event.step > steps {
            dropped = true;
        } else {
            kept.extend(frame(&r.data));
        }
    }
    if dropped {
        crate::fsutil::write_atomic(path, kept).map_err(|e| EventFileError::Io {
            op: "rewrite",
            path: path.to_path_buf(),
            source: std::io::Error::other(e),
        })?;
    }
    Ok(())
}

/// `Summary.Image.colorspace` from a PNG's IHDR colour type (byte 25): gray 1, gray + alpha 2,
/// RGB or palette 3, RGBA 4.
fn png_colorspace(png: &[u8]) -> i32 {
    const SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";
    if !png.starts_with(SIGNATURE) || png.get(12..16) != Some(b"IHDR") {
        return 3;
    }
    match png.get(25) {
        Some(0) => 1,
        Some(4) => 2,
        Some(6) => 4,
        _ => 3,
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The machine's name for the file name, as `socket.gethostname()`; `localhost` where it cannot
/// be read. Only characters safe in a file name are kept.
fn hostname() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .unwrap_or_default();
    let name: String = raw
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensorboard::reader::{read_dir, read_file, scalars, tags};

    /// A tiny 1×1 RGBA PNG header: enough for the colour type.
    fn png_header(color_type: u8) -> Vec<u8> {
        let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR\0\0\0\x01\0\0\0\x01\x08".to_vec();
        png.push(color_type);
        png.extend([0, 0, 0]);
        png
    }

    #[test]
    fn scalars_and_an_image_round_trip() {
        let tmp = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(tmp.path()).unwrap();
        let name = w.path().file_name().unwrap().to_str().unwrap().to_string();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        let parts: Vec<&str> = name
            .trim_start_matches("events.out.tfevents.")
            .split('.')
            .collect();
        assert_eq!(parts[0].len(), 10, "{name}");
        assert_eq!(parts[parts.len() - 2], std::process::id().to_string());
        w.add_scalars(1, &[("loss".into(), 0.5), ("lr/unet".into(), 1e-4)])
            .unwrap();
        w.add_scalars(2, &[("loss".into(), 0.25)]).unwrap();
        let png = png_header(6);
        w.add_image_png("samples/0", 2, &png, 1, 1).unwrap();
        // Flushed as written: read while the writer is still open.
        let events = read_file(w.path()).unwrap();
        assert_eq!(events[0].what, What::FileVersion(FILE_VERSION.into()));
        assert_eq!(events[0].step, 0);
        assert!(events[0].wall_time > 1.6e9);
        assert_eq!(scalars(&events, "loss"), [(1, 0.5), (2, 0.25)]);
        assert_eq!(scalars(&events, "lr/unet"), [(1, 1e-4)]);
        assert_eq!(tags(&events), ["loss", "lr/unet", "samples/0"]);
        let What::Summary(values) = &events[3].what else {
            panic!("{:?}", events[3]);
        };
        assert_eq!(events[3].step, 2);
        assert_eq!(
            values[0].data,
            ValueData::Image(Image {
                height: 1,
                width: 1,
                colorspace: 4,
                encoded: png
            })
        );
    }

    #[test]
    fn colorspace_follows_the_png_header() {
        assert_eq!(png_colorspace(&png_header(0)), 1);
        assert_eq!(png_colorspace(&png_header(2)), 3);
        assert_eq!(png_colorspace(&png_header(4)), 2);
        assert_eq!(png_colorspace(b"not a png"), 3);
    }

    /// A run killed after logging step 3 and resumed from its save point at step 2: step 3 goes
    /// from the old file, so the folder holds each step once, and the new file continues.
    #[test]
    fn resume_drops_the_steps_after_the_save_point() {
        let tmp = tempfile::tempdir().unwrap();
        let mut first = EventWriter::create(tmp.path()).unwrap();
        for step in 1..=3 {
            first
                .add_scalars(step, &[("loss".into(), step as f64)])
                .unwrap();
        }
        let first_path = first.path().to_path_buf();
        drop(first);
        let mut second = EventWriter::resume(tmp.path(), 2).unwrap();
        assert_ne!(second.path(), first_path);
        second.add_scalars(3, &[("loss".into(), 30.0)]).unwrap();
        let old = read_file(&first_path).unwrap();
        assert_eq!(old.len(), 3, "file version and steps 1, 2");
        let all = read_dir(tmp.path()).unwrap();
        assert_eq!(scalars(&all, "loss"), [(1, 1.0), (2, 2.0), (3, 30.0)]);
    }
}
