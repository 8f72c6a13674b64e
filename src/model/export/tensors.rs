//! The tensors an export writes and the writer: a component's base tensors (its safetensors
//! files, or a single file's view), merged with the trained ones, streamed into one safetensors
//! file one tensor at a time (a GPU tensor is copied to the host only while it is written). The
//! header carries `{"format": "pt"}`, which transformers checks.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use super::{ExportError, ExportTensor};
use crate::error_chain::External;
use crate::fsutil;
use crate::model::files::{Component, ComponentFiles, ComponentSource};
use crate::tensor_view::TensorView;

/// The base tensors of a component: its safetensors files, or a single file's view.
pub(super) enum BaseTensors {
    Files {
        st: Box<MmapedSafetensors>,
        files: String,
    },
    View(Arc<TensorView>),
}

impl BaseTensors {
    pub(super) fn open(c: &ComponentFiles) -> Result<Self, ExportError> {
        let weights = match &c.source {
            ComponentSource::Folder { weights, .. } => weights,
            ComponentSource::Packed { packed, .. } => {
                return Ok(BaseTensors::View(packed.view.clone()))
            }
        };
        let files = weights
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        // SAFETY: the base files are memory-mapped read-only and only read here; sdtrain never
        // writes to a base model file (the export goes to a new path, checked not to be the
        // base).
        let st = unsafe { MmapedSafetensors::multi(weights) }.map_err(|e| ExportError::Base {
            component: c.component,
            files: files.clone(),
            source: Box::new(External(e)),
        })?;
        Ok(BaseTensors::Files {
            st: Box::new(st),
            files,
        })
    }

    pub(super) fn describe(&self) -> String {
        match self {
            BaseTensors::Files { files, .. } => files.clone(),
            BaseTensors::View(v) => v.file().display().to_string(),
        }
    }

    /// Every tensor: name, shape, stored dtype.
    pub(super) fn list(&self) -> candle_core::Result<Vec<(String, Vec<usize>, DType)>> {
        match self {
            BaseTensors::Files { st, .. } => st
                .tensors()
                .into_iter()
                .map(|(n, v)| Ok((n, v.shape().to_vec(), DType::try_from(v.dtype())?)))
                .collect(),
            BaseTensors::View(v) => Ok(v
                .entries()
                .map(|(n, e)| (n.clone(), e.shape.clone(), e.dtype))
                .collect()),
        }
    }

    /// Loads `name` on the host.
    pub(super) fn load(&self, name: &str) -> candle_core::Result<Tensor> {
        match self {
            BaseTensors::Files { st, .. } => st.load(name, &Device::Cpu),
            BaseTensors::View(v) => v.load(name, &Device::Cpu),
        }
    }
}

/// One tensor to write: where it comes from and what it is written as.
pub(super) struct OutTensor<'a> {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub component: Component,
    pub load: Box<dyn Fn() -> candle_core::Result<Tensor> + 'a>,
}

/// Writes `path` atomically: the safetensors header (with `metadata`, `format: pt` added) and
/// each tensor in turn, streamed (a device tensor is copied to the host only while written).
pub(super) fn write_safetensors(
    path: &Path,
    mut metadata: serde_json::Map<String, Value>,
    tensors: &[OutTensor<'_>],
) -> Result<(), ExportError> {
    metadata.insert("format".into(), json!("pt"));
    let header = safetensors_header(metadata, tensors)?;
    let write_err = |source| ExportError::Write {
        path: path.to_path_buf(),
        source,
    };
    fsutil::write_atomic_with(path, |w| {
        w.write_all(&(header.len() as u64).to_le_bytes())
            .map_err(write_err)?;
        w.write_all(&header).map_err(write_err)?;
        for t in tensors {
            let tensor_err = |err: candle_core::Error| ExportError::Tensor {
                component: t.component,
                name: t.name.clone(),
                source: Box::new(err),
            };
            let tensor = (t.load)().map_err(tensor_err)?;
            if tensor.dims() != t.shape.as_slice() {
                return Err(ExportError::Shape {
                    component: t.component,
                    name: t.name.clone(),
                    got: tensor.dims().to_vec(),
                    want: t.shape.clone(),
                });
            }
            let bytes = tensor_bytes(&tensor, t.dtype).map_err(tensor_err)?;
            w.write_all(&bytes).map_err(write_err)?;
        }
        Ok(())
    })
}

/// The diffusers-named tensors of component `c` with `tensors` replacing those of the same name,
/// float tensors in `dtype` (`None`: as stored), sorted by name.
pub(super) fn merged_tensors<'a, T: ExportTensor>(
    c: &ComponentFiles,
    base: &'a BaseTensors,
    tensors: &'a [(String, T)],
    dtype: Option<DType>,
) -> Result<Vec<OutTensor<'a>>, ExportError> {
    let component = c.component;
    let base_err = |e: candle_core::Error| ExportError::Base {
        component,
        files: base.describe(),
        source: Box::new(External(e)),
    };
    let mut updates: HashMap<&str, &Tensor> = HashMap::new();
    for (name, t) in tensors {
        if updates.insert(name, t.export_tensor()).is_some() {
            return Err(ExportError::DuplicateTensor {
                component,
                name: name.clone(),
            });
        }
    }
    let mut out = Vec::new();
    for (name, shape, base_dtype) in base.list().map_err(base_err)? {
        let load: Box<dyn Fn() -> candle_core::Result<Tensor> + 'a> =
            match updates.remove(name.as_str()) {
                Some(t) => {
                    if t.dims() != shape.as_slice() {
                        return Err(ExportError::Shape {
                            component,
                            name,
                            got: t.dims().to_vec(),
                            want: shape,
                        });
                    }
                    Box::new(move || Ok(t.clone()))
                }
                None => {
                    let n = name.clone();
                    Box::new(move || base.load(&n))
                }
            };
        let out_dtype = export_dtype(base_dtype, dtype);
        out.push(OutTensor {
            name,
            shape,
            dtype: out_dtype,
            component,
            load,
        });
    }
    if let Some(name) = updates.keys().min() {
        return Err(ExportError::UnknownTensor {
            component,
            name: name.to_string(),
            files: base.describe(),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// What a base tensor stored as `base` is written as: floats in `dtype` when one is given, else as
/// stored, except the 8/6/4-bit floats of fp8 checkpoints, which the writer has no encoding for:
/// those are widened to F32, which holds each of their values exactly (a frozen fp8 VAE made a
/// run fail at its first save, after training).
fn export_dtype(base: DType, dtype: Option<DType>) -> DType {
    match dtype {
        Some(d) if base.is_float() => d,
        _ if st_dtype(base).is_none() => DType::F32,
        _ => base,
    }
}

/// The safetensors name of a dtype the export writes.
fn st_dtype(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::U8 => "U8",
        DType::U32 => "U32",
        DType::I16 => "I16",
        DType::I32 => "I32",
        DType::I64 => "I64",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        DType::F32 => "F32",
        DType::F64 => "F64",
        // DType is non-exhaustive: 8/6/4-bit floats and whatever candle adds next.
        _ => return None,
    })
}

/// The JSON header (safetensors format: `{name: {dtype, shape, data_offsets}}` with offsets
/// into the data section, plus `__metadata__`), padded with spaces to a multiple of 8 bytes.
fn safetensors_header(
    metadata: serde_json::Map<String, Value>,
    entries: &[OutTensor<'_>],
) -> Result<Vec<u8>, ExportError> {
    let mut map = serde_json::Map::new();
    let metadata: serde_json::Map<String, Value> = metadata
        .into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => (k, Value::String(s)),
            other => (k, Value::String(other.to_string())),
        })
        .collect();
    map.insert("__metadata__".into(), Value::Object(metadata));
    let mut offset = 0usize;
    for e in entries {
        let name = st_dtype(e.dtype).ok_or_else(|| ExportError::TensorDtype {
            component: e.component,
            name: e.name.clone(),
            dtype: e.dtype,
        })?;
        let len = e.shape.iter().product::<usize>() * e.dtype.size_in_bytes();
        map.insert(
            e.name.clone(),
            json!({"dtype": name, "shape": e.shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let mut header = serde_json::to_vec(&Value::Object(map)).unwrap_or_default();
    header.resize(header.len().next_multiple_of(8), b' ');
    Ok(header)
}

/// The little-endian bytes of `t` cast to `dtype` (cast on its device, then copied to the host).
fn tensor_bytes(t: &Tensor, dtype: DType) -> candle_core::Result<Vec<u8>> {
    let t = t.to_dtype(dtype)?.flatten_all()?.to_device(&Device::Cpu)?;
    fn le<T: Copy, const N: usize>(v: Vec<T>, f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
        let mut out = Vec::with_capacity(v.len() * N);
        for x in v {
            out.extend_from_slice(&f(x));
        }
        out
    }
    Ok(match dtype {
        DType::U8 => t.to_vec1::<u8>()?,
        DType::U32 => le(t.to_vec1::<u32>()?, u32::to_le_bytes),
        DType::I16 => le(t.to_vec1::<i16>()?, i16::to_le_bytes),
        DType::I32 => le(t.to_vec1::<i32>()?, i32::to_le_bytes),
        DType::I64 => le(t.to_vec1::<i64>()?, i64::to_le_bytes),
        DType::F16 => le(t.to_vec1::<half::f16>()?, half::f16::to_le_bytes),
        DType::BF16 => le(t.to_vec1::<half::bf16>()?, half::bf16::to_le_bytes),
        DType::F32 => le(t.to_vec1::<f32>()?, f32::to_le_bytes),
        DType::F64 => le(t.to_vec1::<f64>()?, f64::to_le_bytes),
        _ => candle_core::bail!("dtype {dtype:?} cannot be exported"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_offsets_are_contiguous_and_padded() {
        let entry = |name: &str, shape: Vec<usize>, dtype| OutTensor {
            name: name.into(),
            shape,
            dtype,
            component: Component::Unet,
            load: Box::new(|| candle_core::bail!("not loaded")),
        };
        let entries = [
            entry("a", vec![2, 3], DType::F16),
            entry("b", vec![1], DType::I64),
        ];
        let h = safetensors_header(serde_json::Map::new(), &entries).unwrap();
        assert_eq!(h.len() % 8, 0);
        let v: Value = serde_json::from_slice(&h).unwrap();
        assert_eq!(v["a"]["data_offsets"], json!([0, 12]));
        assert_eq!(v["b"]["data_offsets"], json!([12, 20]));
        assert_eq!(v["b"]["dtype"], "I64");
        assert_eq!(v["__metadata__"], json!({}));
    }

    /// An fp8 base tensor copied as stored is written as F32, value for value; it was an error
    /// ("has dtype F8E4M3, which the export cannot write") at a run's first save.
    #[test]
    fn fp8_base_tensors_are_widened_to_f32() {
        assert_eq!(export_dtype(DType::F8E4M3, None), DType::F32);
        assert_eq!(export_dtype(DType::F8E4M3, Some(DType::F16)), DType::F16);
        assert_eq!(export_dtype(DType::F16, None), DType::F16);
        assert_eq!(export_dtype(DType::I64, Some(DType::F16)), DType::I64);
        let t = Tensor::new(&[1.5f32, -0.25, 448.0], &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F8E4M3)
            .unwrap();
        let bytes = tensor_bytes(&t, export_dtype(t.dtype(), None)).unwrap();
        let back: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(back, [1.5, -0.25, 448.0]);
    }

    #[test]
    fn bytes_are_little_endian_in_the_export_dtype() {
        let t = Tensor::new(&[1f32, -2.0], &Device::Cpu).unwrap();
        assert_eq!(
            tensor_bytes(&t, DType::F16).unwrap(),
            [0x00, 0x3c, 0x00, 0xc0]
        );
        assert_eq!(
            tensor_bytes(&t, DType::F32).unwrap()[4..],
            (-2f32).to_le_bytes()
        );
    }
}
