//! Reading event files back: every record's CRCs are checked and each event decoded. The tests
//! use it, and a resumed run uses it to drop the events of steps it will train again.

use std::path::{Path, PathBuf};

use super::error::EventFileError;
use super::event::{Event, ValueData, What};
use super::record::parse_records;

/// The events of one file. Any bad record, a torn last one included, is an error.
pub fn read_file(path: &Path) -> Result<Vec<Event>, EventFileError> {
    let bytes = std::fs::read(path).map_err(EventFileError::io("read", path))?;
    let (records, err) = parse_records(&bytes);
    if let Some(e) = err {
        return Err(e.in_file(path));
    }
    records
        .iter()
        .map(|r| Event::decode(&r.data).map_err(|e| e.in_file(path)))
        .collect()
}

/// Whether `name` is an event file's name (`events.out.tfevents.…`, what TensorBoard loads).
pub fn is_event_file(name: &str) -> bool {
    name.starts_with("events.out.tfevents.")
}

/// The event files directly in `dir`, in name order, which is TensorBoard's reading order (the
/// name starts with a zero-padded time, so it is also the order they were written).
pub fn event_files(dir: &Path) -> Result<Vec<PathBuf>, EventFileError> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(EventFileError::io("list", dir))? {
        let entry = entry.map_err(EventFileError::io("list", dir))?;
        let name = entry.file_name();
        if name.to_str().is_some_and(is_event_file) && entry.path().is_file() {
            files.push(entry.path());
        }
    }
    files.sort();
    Ok(files)
}

/// The events of every event file in `dir`, file after file in name order.
pub fn read_dir(dir: &Path) -> Result<Vec<Event>, EventFileError> {
    let mut events = Vec::new();
    for file in event_files(dir)? {
        events.extend(read_file(&file)?);
    }
    Ok(events)
}

/// The `(step, value)` points of scalar `tag`, in file order.
pub fn scalars(events: &[Event], tag: &str) -> Vec<(i64, f32)> {
    events
        .iter()
        .filter_map(|e| match &e.what {
            What::Summary(values) => Some((e.step, values)),
            _ => None,
        })
        .flat_map(|(step, values)| {
            values.iter().filter_map(move |v| match v.data {
                ValueData::Scalar(x) if v.tag == tag => Some((step, x)),
                _ => None,
            })
        })
        .collect()
}

/// Every tag with a value in `events`, sorted, each once.
pub fn tags(events: &[Event]) -> Vec<String> {
    let mut tags: Vec<String> = events
        .iter()
        .filter_map(|e| match &e.what {
            What::Summary(values) => Some(values),
            _ => None,
        })
        .flatten()
        .map(|v| v.tag.clone())
        .collect();
    tags.sort();
    tags.dedup();
    tags
}
