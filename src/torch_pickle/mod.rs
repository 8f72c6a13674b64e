//! Reading `torch.save` files (`.ckpt`, `.pt`, `.pth`, `.bin`) without running them.
//!
//! A pickle can name any Python function and have the loader call it, which is why these files
//! can carry code. This reader interprets the pickle as data only (`unpickler.rs`): names stay
//! names and nothing is imported or called. Only torch's tensor-rebuild functions are given a
//! meaning (`archive.rs`), the way `torch.load(weights_only=True)` restricts itself, so a hostile
//! file can at worst fail to load.
//!
//! - `unpickler.rs`: the pickle opcodes into a [`Value`] tree;
//! - `archive.rs`: torch's zip archive, its state dict, each tensor's bytes;
//! - `to_safetensors.rs`: a torch file as one `.safetensors` file, streamed;
//! - `cache.rs`: that conversion done once per file for the loaders, which read safetensors only.

mod archive;
mod cache;
mod to_safetensors;
mod unpickler;

use std::path::Path;

use candle_core::{DType, Device, Tensor};

pub use archive::{
    is_torch_file, is_zip, Contents, StoredDtype, TensorRecord, TorchArchive, TorchFileError,
};
pub use cache::{cache_dir, converted_copy, converted_copy_of, ConvertedCopy};
pub use to_safetensors::{convert, convert_files, to_bytes, ConvertError, Converted};
pub use unpickler::{unpickle, PickleError, Value};

/// The extensions of the files `torch.save` writes, lower case.
pub const EXTENSIONS: [&str; 4] = ["ckpt", "pt", "pth", "bin"];

/// Whether `path` has a torch-file extension.
pub fn has_torch_extension(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
}

/// A torch file's tensors, read one at a time on request.
pub struct TorchTensors {
    path: std::path::PathBuf,
    archive: std::sync::Mutex<TorchArchive>,
    records: std::collections::BTreeMap<String, TensorRecord>,
    skipped: Vec<(String, String)>,
}

impl TorchTensors {
    /// Opens `path` and reads its state dict's records (no tensor data yet).
    pub fn open(path: &Path) -> Result<Self, TorchFileError> {
        let (archive, contents) = TorchArchive::open(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            archive: std::sync::Mutex::new(archive),
            records: contents
                .tensors
                .into_iter()
                .map(|t| (t.name.clone(), t))
                .collect(),
            skipped: contents.skipped,
        })
    }

    /// Every tensor's record, by name.
    pub fn records(&self) -> &std::collections::BTreeMap<String, TensorRecord> {
        &self.records
    }

    /// The state dict's entries that are not tensors, with why.
    pub fn skipped(&self) -> &[(String, String)] {
        &self.skipped
    }

    /// Tensor `name` on the CPU, in its stored dtype where candle has it (else: `int8` as `i16`,
    /// `bool` as `u8` 0/1, `uint16` as `u32`, `uint64` as `i64` (saturating), float8 as `f32`:
    /// candle's own float8 conversions are not used, its CPU `F8E4M3 → F64` cast never returned
    /// in our test); `None` when there is no such tensor.
    pub fn get(&self, name: &str) -> Result<Option<Tensor>, TorchFileError> {
        let Some(t) = self.records.get(name) else {
            return Ok(None);
        };
        let mut archive = self.archive.lock().unwrap_or_else(|p| p.into_inner());
        let storage = archive.storage(&t.storage)?;
        let bytes = archive.tensor_bytes(t, &storage)?;
        to_tensor(t, &bytes)
            .map(Some)
            .map_err(|e| TorchFileError::Tensor {
                path: self.path.clone(),
                name: t.name.clone(),
                message: e.to_string(),
            })
    }
}

/// Every tensor of a (small) torch file in memory, as [`TorchTensors::get`] gives each.
pub fn read_tensors(path: &Path) -> Result<Vec<(String, Tensor)>, TorchFileError> {
    let file = TorchTensors::open(path)?;
    let mut out = Vec::with_capacity(file.records.len());
    for name in file.records.keys() {
        if let Some(t) = file.get(name)? {
            out.push((name.clone(), t));
        }
    }
    Ok(out)
}

fn to_tensor(t: &TensorRecord, bytes: &[u8]) -> candle_core::Result<Tensor> {
    let cpu = &Device::Cpu;
    let shape = t.shape.as_slice();
    let direct = |dtype: DType| Tensor::from_raw_buffer(bytes, dtype, shape, cpu);
    match t.dtype {
        StoredDtype::F64 => direct(DType::F64),
        StoredDtype::F32 => direct(DType::F32),
        StoredDtype::F16 => direct(DType::F16),
        StoredDtype::BF16 => direct(DType::BF16),
        StoredDtype::F8E4M3 => {
            let v: Vec<f32> = bytes.iter().map(|&b| f8e4m3_to_f32(b)).collect();
            Tensor::from_vec(v, shape, cpu)
        }
        StoredDtype::I64 => direct(DType::I64),
        StoredDtype::I32 => direct(DType::I32),
        StoredDtype::I16 => direct(DType::I16),
        StoredDtype::U8 | StoredDtype::Bool => direct(DType::U8),
        StoredDtype::U32 => direct(DType::U32),
        StoredDtype::U16 => {
            let v: Vec<u32> = bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]) as u32)
                .collect();
            Tensor::from_vec(v, shape, cpu)
        }
        StoredDtype::U64 => {
            let v: Vec<i64> = bytes
                .chunks_exact(8)
                .map(|b| {
                    let a: [u8; 8] = b.try_into().unwrap_or_default();
                    i64::try_from(u64::from_le_bytes(a)).unwrap_or(i64::MAX)
                })
                .collect();
            Tensor::from_vec(v, shape, cpu)
        }
        StoredDtype::I8 => {
            let v: Vec<i16> = bytes.iter().map(|&b| b as i8 as i16).collect();
            Tensor::from_vec(v, shape, cpu)
        }
        StoredDtype::F8E5M2 => {
            let v: Vec<f32> = bytes.iter().map(|&b| f8e5m2_to_f32(b)).collect();
            Tensor::from_vec(v, shape, cpu)
        }
    }
}

/// float8 e4m3fn (OCP FP8: bias 7, no infinities, `S.1111.111` is NaN).
fn f8e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0x0f) as i32;
    let m = (b & 0x07) as f32;
    if e == 0x0f && b & 0x07 == 0x07 {
        f32::NAN
    } else if e == 0 {
        sign * m / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

/// float8 e5m2 is the top byte of an f16.
fn f8e5m2_to_f32(b: u8) -> f32 {
    half::f16::from_bits((b as u16) << 8).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float8_decodes_as_torch_does() {
        // torch.tensor(list(range(256)), dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        // at these bytes: 0x01 the smallest subnormal, 0x08 the smallest normal, 0x7e the
        // largest finite, 0xb8 = -1.
        assert_eq!(f8e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(f8e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(f8e4m3_to_f32(0x7e), 448.0);
        assert_eq!(f8e4m3_to_f32(0xb8), -1.0);
        assert!(f8e4m3_to_f32(0x7f).is_nan());
        // e5m2: 0x3c = 1.0, 0x7b = 57344 (largest finite), 0x7c = inf.
        assert_eq!(f8e5m2_to_f32(0x3c), 1.0);
        assert_eq!(f8e5m2_to_f32(0x7b), 57344.0);
        assert!(f8e5m2_to_f32(0x7c).is_infinite());
    }
}
