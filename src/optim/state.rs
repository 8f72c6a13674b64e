//! The on-disk optimizer state: one safetensors file of f32 tensors plus string metadata.
//!
//! Tensors are named as torch names them in `Optimizer.state_dict()`, prefixed by the parameter
//! name (`<param>.exp_avg`, `<param>.exp_avg_sq`). Per-parameter step counts and the
//! hyper-parameters go in the safetensors header metadata as JSON strings. Each optimizer decides
//! its own keys; this file only reads and writes.
//!
//! Writes are atomic: `<path>.tmp` is written, fsynced, renamed over `<path>`, and the directory
//! is fsynced, so a crash leaves either the old file or the new one, never half of one.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use safetensors::tensor::{Dtype, SafeTensors, View};

use super::{OptimError, Result};

/// Metadata key holding the optimizer's name (`"adamw"`, …).
pub const OPTIMIZER_KEY: &str = "sdtrain.optimizer";
/// Metadata key holding the format version of the state file.
pub const VERSION_KEY: &str = "sdtrain.state_version";

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> OptimError + '_ {
    move |source| OptimError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A tensor viewed as f32 little-endian bytes, converted lazily so only one tensor at a time is
/// copied to the host while the file is written. `View::data` cannot fail, so a conversion error
/// is parked in `err` and reported after serialisation.
struct F32View<'a> {
    tensor: &'a Tensor,
    shape: Vec<usize>,
    err: &'a RefCell<Option<candle_core::Error>>,
}

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let values = self
            .tensor
            .to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>());
        match values {
            Ok(v) => Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Err(e) => {
                self.err.borrow_mut().get_or_insert(e);
                Cow::Owned(vec![0u8; self.data_len()])
            }
        }
    }

    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * 4
    }
}

/// Writes `tensors` (stored as f32) and `metadata` to `path` atomically.
pub fn write_atomic(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: HashMap<String, String>,
) -> Result<()> {
    crate::fsutil::write_atomic_to_path(path, |tmp| {
        let err = RefCell::new(None);
        let views = tensors.iter().map(|(name, t)| {
            (
                name.clone(),
                F32View {
                    tensor: t,
                    shape: t.dims().to_vec(),
                    err: &err,
                },
            )
        });
        let written = safetensors::tensor::serialize_to_file(views, Some(metadata), tmp);
        match (written, err.into_inner()) {
            (Err(e), _) => Err(OptimError::Format {
                path: path.to_path_buf(),
                msg: e.to_string(),
            }),
            (Ok(()), Some(e)) => Err(OptimError::Candle(e)),
            (Ok(()), None) => Ok(()),
        }
    })
}

/// A state file opened for reading (memory-mapped).
pub struct StateReader<'a> {
    path: &'a Path,
    st: SafeTensors<'a>,
    metadata: HashMap<String, String>,
}

impl StateReader<'_> {
    pub fn path(&self) -> &Path {
        self.path
    }

    /// A metadata entry, or a format error naming the missing key.
    pub fn meta(&self, key: &str) -> Result<&str> {
        self.metadata
            .get(key)
            .map(String::as_str)
            .ok_or_else(|| OptimError::Format {
                path: self.path.to_path_buf(),
                msg: format!("metadata has no `{key}` entry"),
            })
    }

    /// Every tensor name in the file.
    pub fn names(&self) -> Vec<String> {
        self.st.names().into_iter().map(String::from).collect()
    }

    /// Shape of tensor `name`, if present.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.st.tensor(name).ok().map(|v| v.shape().to_vec())
    }

    /// Loads tensor `name` (which must be f32) onto `device`.
    pub fn load_f32(&self, name: &str, device: &Device) -> Result<Tensor> {
        let view = self.st.tensor(name).map_err(|e| OptimError::Format {
            path: self.path.to_path_buf(),
            msg: format!("{name}: {e}"),
        })?;
        if view.dtype() != Dtype::F32 {
            return Err(OptimError::StateDType {
                path: self.path.to_path_buf(),
                name: name.to_string(),
                dtype: format!("{:?}", view.dtype()),
            });
        }
        Ok(Tensor::from_raw_buffer(
            view.data(),
            DType::F32,
            view.shape(),
            device,
        )?)
    }
}

/// Opens the state file at `path` and hands it to `f`.
pub fn read<T>(path: &Path, f: impl FnOnce(&StateReader<'_>) -> Result<T>) -> Result<T> {
    let file = File::open(path).map_err(io_err(path))?;
    // SAFETY: the file is only read through the map, and sdtrain replaces state files by rename,
    // never by writing into them, so the mapped bytes do not change underneath us.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err(path))?;
    let format_err = |e: safetensors::SafeTensorError| OptimError::Format {
        path: path.to_path_buf(),
        msg: e.to_string(),
    };
    let (_, header) = SafeTensors::read_metadata(&mmap).map_err(format_err)?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let st = SafeTensors::deserialize(&mmap).map_err(format_err)?;
    f(&StateReader { path, st, metadata })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_keeps_values_shapes_and_metadata_and_leaves_no_tmp() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.safetensors");
        let a = Tensor::new(&[[1.5f32, -2.0], [3.25, 0.0]], &Device::Cpu).unwrap();
        let b = Tensor::new(&[7.0f32], &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let meta = HashMap::from([("k".to_string(), "v".to_string())]);
        write_atomic(&path, &[("a".into(), a.clone()), ("b".into(), b)], meta).unwrap();
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("s.safetensors")]);
        read(&path, |r| {
            assert_eq!(r.meta("k").unwrap(), "v");
            assert!(r.meta("nope").is_err());
            let mut names = r.names();
            names.sort();
            assert_eq!(names, vec!["a", "b"]);
            assert_eq!(r.shape("a"), Some(vec![2, 2]));
            let a2 = r.load_f32("a", &Device::Cpu).unwrap();
            assert_eq!(a2.to_vec2::<f32>().unwrap(), a.to_vec2::<f32>().unwrap());
            let b2 = r.load_f32("b", &Device::Cpu).unwrap();
            assert_eq!(b2.to_vec1::<f32>().unwrap(), vec![7.0]);
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn garbage_file_is_a_format_error_naming_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.safetensors");
        std::fs::write(&path, b"not a safetensors file").unwrap();
        let err = read(&path, |_| Ok(())).unwrap_err();
        assert!(matches!(err, OptimError::Format { .. }), "{err}");
        assert!(err.to_string().contains("bad.safetensors"), "{err}");
    }
}
