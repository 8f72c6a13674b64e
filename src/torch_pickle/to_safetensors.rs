//! A torch file's state dict written as one `.safetensors` file: every tensor, under its own
//! name, in its own dtype, bytes unchanged (the conversion A1111's and kohya's users run on a
//! `.ckpt`). It streams: the header is built from the pickle, then each storage is read once
//! and every tensor viewing it is cut out and written, so memory holds one storage at a time.
//! The file is written atomically (temp, fsync, rename).

use std::io::Write;
use std::path::Path;

use serde_json::{json, Value};

use super::archive::{TensorRecord, TorchArchive, TorchFileError};
use crate::fsutil::{self, FsError};

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error(transparent)]
    Read(#[from] TorchFileError),
    #[error("writing {}", path.display())]
    Write {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Fs(#[from] FsError),
}

/// What a conversion wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Converted {
    pub tensors: usize,
    pub bytes: u64,
    /// State-dict entries that are not tensors, with why (never written).
    pub skipped: Vec<(String, String)>,
}

/// Writes the state dict of the torch file `src` to `dst` (module header), with `metadata`
/// (plus `format: pt`) in the header.
pub fn convert(
    src: &Path,
    dst: &Path,
    metadata: serde_json::Map<String, Value>,
) -> Result<Converted, ConvertError> {
    convert_files(&[src.to_path_buf()], dst, metadata)
}

/// As [`convert`], the state dicts of several torch files (the shards of one model, as
/// `pytorch_model-00001-of-00002.bin` …) into one `.safetensors`; a tensor name in two of them
/// is an error naming both.
pub fn convert_files(
    srcs: &[std::path::PathBuf],
    dst: &Path,
    metadata: serde_json::Map<String, Value>,
) -> Result<Converted, ConvertError> {
    let mut plan = Plan::open(srcs)?;
    let mut bytes = 0u64;
    fsutil::write_atomic_with(dst, |w| {
        bytes = plan.write(w, metadata, dst)?;
        Ok::<_, ConvertError>(())
    })?;
    Ok(plan.done(bytes))
}

/// The state dict of the torch file `src` as the bytes of a `.safetensors` file, in memory (for
/// small files: a LoRA saved as `.pt`).
pub fn to_bytes(
    src: &Path,
    metadata: serde_json::Map<String, Value>,
) -> Result<Vec<u8>, ConvertError> {
    let mut plan = Plan::open(&[src.to_path_buf()])?;
    let mut out = Vec::new();
    plan.write(&mut out, metadata, src)?;
    Ok(out)
}

/// The open archives and their tensors, in write order.
struct Plan {
    archives: Vec<TorchArchive>,
    tensors: Vec<(usize, TensorRecord)>,
    skipped: Vec<(String, String)>,
}

impl Plan {
    fn open(srcs: &[std::path::PathBuf]) -> Result<Self, ConvertError> {
        let mut archives = Vec::with_capacity(srcs.len());
        let mut tensors: Vec<(usize, TensorRecord)> = Vec::new();
        let mut skipped = Vec::new();
        let mut owner: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
        for (i, src) in srcs.iter().enumerate() {
            let (archive, contents) = TorchArchive::open(src)?;
            for t in contents.tensors {
                if let Some(&j) = owner.get(&t.name) {
                    return Err(ConvertError::Read(TorchFileError::Tensor {
                        path: src.clone(),
                        name: t.name,
                        message: format!("also in {}", srcs[j].display()),
                    }));
                }
                owner.insert(t.name.clone(), i);
                tensors.push((i, t));
            }
            skipped.extend(contents.skipped);
            archives.push(archive);
        }
        // File by file and storage by storage, so each storage is read once.
        tensors.sort_by(|(i, a), (j, b)| {
            (i, &a.storage, a.offset, &a.name).cmp(&(j, &b.storage, b.offset, &b.name))
        });
        Ok(Self {
            archives,
            tensors,
            skipped,
        })
    }

    /// Writes the header and every tensor to `w` (`dst` names it in errors); the bytes of data.
    fn write(
        &mut self,
        w: &mut impl Write,
        metadata: serde_json::Map<String, Value>,
        dst: &Path,
    ) -> Result<u64, ConvertError> {
        let records: Vec<&TensorRecord> = self.tensors.iter().map(|(_, t)| t).collect();
        let src = self
            .archives
            .first()
            .map(|a| a.path().to_path_buf())
            .unwrap_or_default();
        let header = header(metadata, &records, &src)?;
        let write_err = |source| ConvertError::Write {
            path: dst.to_path_buf(),
            source,
        };
        w.write_all(&(header.len() as u64).to_le_bytes())
            .map_err(write_err)?;
        w.write_all(&header).map_err(write_err)?;
        let mut bytes = 0u64;
        let mut current: Option<(usize, String, Vec<u8>)> = None;
        for (i, t) in &self.tensors {
            let archive = &mut self.archives[*i];
            if current
                .as_ref()
                .is_none_or(|(j, k, _)| j != i || *k != t.storage)
            {
                drop(current.take()); // free the last storage before reading the next
                current = Some((*i, t.storage.clone(), archive.storage(&t.storage)?));
            }
            let storage = current
                .as_ref()
                .map(|(_, _, s)| s.as_slice())
                .unwrap_or_default();
            let data = archive.tensor_bytes(t, storage)?;
            w.write_all(&data).map_err(write_err)?;
            bytes += data.len() as u64;
        }
        Ok(bytes)
    }

    fn done(self, bytes: u64) -> Converted {
        Converted {
            tensors: self.tensors.len(),
            bytes,
            skipped: self.skipped,
        }
    }
}

/// The safetensors JSON header for `tensors` in this order, padded to a multiple of 8 bytes.
fn header(
    metadata: serde_json::Map<String, Value>,
    tensors: &[&TensorRecord],
    src: &Path,
) -> Result<Vec<u8>, ConvertError> {
    let mut map = serde_json::Map::new();
    let mut metadata: serde_json::Map<String, Value> = metadata
        .into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => (k, Value::String(s)),
            other => (k, Value::String(other.to_string())),
        })
        .collect();
    metadata.insert("format".into(), json!("pt"));
    map.insert("__metadata__".into(), Value::Object(metadata));
    let mut offset = 0usize;
    for t in tensors {
        let end = offset.checked_add(t.byte_len()).ok_or_else(|| {
            ConvertError::Read(TorchFileError::Tensor {
                path: src.to_path_buf(),
                name: t.name.clone(),
                message: "the tensors' sizes add up past what a file can hold".into(),
            })
        })?;
        map.insert(
            t.name.clone(),
            json!({
                "dtype": t.dtype.safetensors_name(),
                "shape": t.shape,
                "data_offsets": [offset, end],
            }),
        );
        offset = end;
    }
    let mut header = serde_json::to_vec(&Value::Object(map)).unwrap_or_default();
    header.resize(header.len().next_multiple_of(8), b' ');
    Ok(header)
}
