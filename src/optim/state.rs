//! The on-disk optimizer state: one safetensors file of f32 and u8 tensors plus string metadata.
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

/// A tensor viewed as little-endian bytes of its own dtype, copied to the host lazily so only one
/// tensor at a time is on the host while the file is written. `View::data` cannot fail, so a
/// conversion error is parked in `err` and reported after serialisation.
struct TensorView<'a> {
    tensor: &'a Tensor,
    dtype: Dtype,
    shape: Vec<usize>,
    err: &'a RefCell<Option<candle_core::Error>>,
}

/// The safetensors dtype a state tensor is stored as: f32 moments, u8 codes, bf16 accumulators.
fn file_dtype(d: DType) -> candle_core::Result<Dtype> {
    match d {
        DType::F32 => Ok(Dtype::F32),
        DType::U8 => Ok(Dtype::U8),
        DType::BF16 => Ok(Dtype::BF16),
        other => candle_core::bail!("optimizer state of dtype {other:?} cannot be saved"),
    }
}

fn host_bytes(t: &Tensor) -> candle_core::Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::U8 => t.to_vec1::<u8>()?,
        DType::BF16 => t
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        _ => t
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
    })
}

impl View for TensorView<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        match host_bytes(self.tensor) {
            Ok(v) => Cow::Owned(v),
            Err(e) => {
                self.err.borrow_mut().get_or_insert(e);
                Cow::Owned(vec![0u8; self.data_len()])
            }
        }
    }

    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

/// Writes `tensors` (f32, bf16 or u8; f16 is stored as f32) and `metadata` to `path`
/// atomically.
pub fn write_atomic(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: HashMap<String, String>,
) -> Result<()> {
    let mut views = Vec::with_capacity(tensors.len());
    let err = RefCell::new(None);
    for (name, t) in tensors {
        let dtype = match t.dtype() {
            DType::F16 => Dtype::F32,
            d => file_dtype(d)?,
        };
        let view = TensorView {
            tensor: t,
            dtype,
            shape: t.dims().to_vec(),
            err: &err,
        };
        views.push((name.clone(), view));
    }
    crate::fsutil::write_atomic_to_path(path, |tmp| {
        let written = safetensors::tensor::serialize_to_file(views, Some(metadata), tmp);
        match (written, err.take()) {
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

    /// Shape and dtype of tensor `name`, if present (a dtype sdtrain never writes reads as
    /// `None` too, so it is reported as missing state).
    pub fn shape_and_dtype(&self, name: &str) -> Option<(Vec<usize>, DType)> {
        let v = self.st.tensor(name).ok()?;
        let dtype = match v.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::U8 => DType::U8,
            Dtype::BF16 => DType::BF16,
            _ => return None,
        };
        Some((v.shape().to_vec(), dtype))
    }

    /// Loads tensor `name` onto the CPU in its stored dtype (f32, bf16 or u8).
    pub fn load(&self, name: &str) -> Result<Tensor> {
        let view = self.st.tensor(name).map_err(|e| OptimError::Format {
            path: self.path.to_path_buf(),
            msg: format!("{name}: {e}"),
        })?;
        let dtype = match view.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::U8 => DType::U8,
            Dtype::BF16 => DType::BF16,
            other => {
                return Err(OptimError::StateDType {
                    path: self.path.to_path_buf(),
                    name: name.to_string(),
                    found: format!("{other:?}"),
                    want: "F32, BF16 or U8".to_string(),
                })
            }
        };
        Ok(Tensor::from_raw_buffer(
            view.data(),
            dtype,
            view.shape(),
            &Device::Cpu,
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
        let c = Tensor::new(&[0u8, 7, 255], &Device::Cpu).unwrap();
        let tensors = [("a".into(), a.clone()), ("b".into(), b), ("c".into(), c)];
        write_atomic(&path, &tensors, meta).unwrap();
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
            assert_eq!(names, vec!["a", "b", "c"]);
            assert_eq!(r.shape_and_dtype("a"), Some((vec![2, 2], DType::F32)));
            let a2 = r.load("a").unwrap();
            assert_eq!(a2.to_vec2::<f32>().unwrap(), a.to_vec2::<f32>().unwrap());
            // bf16 stays bf16 (AdaCoor's accumulator): 2 bytes, loaded as it was.
            assert_eq!(r.shape_and_dtype("b"), Some((vec![1], DType::BF16)));
            let b2 = r.load("b").unwrap();
            assert_eq!(b2.dtype(), DType::BF16);
            assert_eq!(
                b2.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(),
                vec![7.0]
            );
            let c2 = r.load("c").unwrap();
            assert_eq!(
                (c2.dtype(), c2.to_vec1::<u8>().unwrap()),
                (DType::U8, vec![0, 7, 255])
            );
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
