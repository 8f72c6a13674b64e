//! A `torch.save` file (the zip format torch has written since 1.6: `.ckpt`, `.pt`, `.pth`,
//! diffusers' `.bin`): its state dict as tensor records, and each tensor's bytes.
//!
//! torch's legacy format (before 1.6) is read too: five pickles then the raw storages
//! ([`TorchArchive::open_legacy`]).
//!
//! The archive holds `<prefix>/data.pkl` (the pickled object, read by [`super::unpickler`]),
//! `<prefix>/data/<key>` (one raw storage per key) and `<prefix>/byteorder`. A tensor in the
//! pickle is a call to one of torch's rebuild functions, which we interpret and never run:
//! - `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, meta])`
//!   with `storage` a persistent id `("storage", torch.<T>Storage, key, location, numel)`,
//!   `numel` in elements (`_rebuild_tensor` is the same without the last arguments);
//! - `torch._utils._rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype,
//!   meta)` with an untyped storage (`numel` in bytes) and the dtype as `torch.<dtype>` (torch
//!   ≥ 2.1 writes this for float8 and the unsigned integers);
//! - `torch._utils._rebuild_parameter(tensor, …)` and `torch._tensor._rebuild_from_type_v2(func,
//!   type, args, state)`, wrappers around the above.
//!
//! `offset`, `size` and `stride` are in elements; a view may be any strided window of its
//! storage, and several tensors may share one storage (tied weights). Which object is the state
//! dict follows diffusers' `load_state_dict`: the top-level mapping, descended while it has a
//! `state_dict` mapping (PyTorch Lightning's `.ckpt`). Nested mappings inside it are flattened
//! with `.` (A1111 embeddings' `string_to_param.*`).

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use super::unpickler::{kind, unpickle, PickleError, Value, MAX_DEPTH};

/// The most `data.pkl` may hold (a state dict's pickle is well under a megabyte per thousand
/// tensors; this bounds memory on a hostile file).
const MAX_PICKLE_BYTES: u64 = 1 << 28;

/// A tensor's element type as stored, with its safetensors name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredDtype {
    F64,
    F32,
    F16,
    BF16,
    F8E4M3,
    F8E5M2,
    I64,
    I32,
    I16,
    I8,
    U8,
    U16,
    U32,
    U64,
    Bool,
}

impl StoredDtype {
    pub fn size(self) -> usize {
        match self {
            StoredDtype::F64 | StoredDtype::I64 | StoredDtype::U64 => 8,
            StoredDtype::F32 | StoredDtype::I32 | StoredDtype::U32 => 4,
            StoredDtype::F16 | StoredDtype::BF16 | StoredDtype::I16 | StoredDtype::U16 => 2,
            StoredDtype::F8E4M3
            | StoredDtype::F8E5M2
            | StoredDtype::I8
            | StoredDtype::U8
            | StoredDtype::Bool => 1,
        }
    }

    /// The dtype's name in a safetensors header.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            StoredDtype::F64 => "F64",
            StoredDtype::F32 => "F32",
            StoredDtype::F16 => "F16",
            StoredDtype::BF16 => "BF16",
            StoredDtype::F8E4M3 => "F8_E4M3",
            StoredDtype::F8E5M2 => "F8_E5M2",
            StoredDtype::I64 => "I64",
            StoredDtype::I32 => "I32",
            StoredDtype::I16 => "I16",
            StoredDtype::I8 => "I8",
            StoredDtype::U8 => "U8",
            StoredDtype::U16 => "U16",
            StoredDtype::U32 => "U32",
            StoredDtype::U64 => "U64",
            StoredDtype::Bool => "BOOL",
        }
    }

    /// From a typed storage class (`torch.FloatStorage`, …).
    fn from_storage(name: &str) -> Option<Self> {
        Some(match name {
            "DoubleStorage" => StoredDtype::F64,
            "FloatStorage" => StoredDtype::F32,
            "HalfStorage" => StoredDtype::F16,
            "BFloat16Storage" => StoredDtype::BF16,
            "LongStorage" => StoredDtype::I64,
            "IntStorage" => StoredDtype::I32,
            "ShortStorage" => StoredDtype::I16,
            "CharStorage" => StoredDtype::I8,
            "ByteStorage" => StoredDtype::U8,
            "BoolStorage" => StoredDtype::Bool,
            _ => return None,
        })
    }

    /// From a dtype global (`torch.float16`, …).
    fn from_torch(name: &str) -> Option<Self> {
        Some(match name {
            "float64" | "double" => StoredDtype::F64,
            "float32" | "float" => StoredDtype::F32,
            "float16" | "half" => StoredDtype::F16,
            "bfloat16" => StoredDtype::BF16,
            "float8_e4m3fn" => StoredDtype::F8E4M3,
            "float8_e5m2" => StoredDtype::F8E5M2,
            "int64" | "long" => StoredDtype::I64,
            "int32" | "int" => StoredDtype::I32,
            "int16" | "short" => StoredDtype::I16,
            "int8" => StoredDtype::I8,
            "uint8" => StoredDtype::U8,
            "uint16" => StoredDtype::U16,
            "uint32" => StoredDtype::U32,
            "uint64" => StoredDtype::U64,
            "bool" => StoredDtype::Bool,
            _ => return None,
        })
    }
}

/// One tensor of the state dict: where its elements lie in which storage.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorRecord {
    pub name: String,
    pub dtype: StoredDtype,
    pub shape: Vec<usize>,
    /// The storage's key (`data/<key>` in the archive).
    pub storage: String,
    /// In elements.
    pub offset: usize,
    /// In elements.
    pub stride: Vec<usize>,
}

impl TensorRecord {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn byte_len(&self) -> usize {
        self.numel() * self.dtype.size()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TorchFileError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a torch checkpoint: {message}", path.display())]
    NotTorch { path: PathBuf, message: String },
    #[error("{}: cannot read its pickle `{entry}`: {source}", path.display())]
    Pickle {
        path: PathBuf,
        entry: String,
        source: PickleError,
    },
    #[error("{}: holds no state dict: {message}", path.display())]
    NoStateDict { path: PathBuf, message: String },
    #[error("{}: tensor `{name}`: {message}", path.display())]
    Tensor {
        path: PathBuf,
        name: String,
        message: String,
    },
}

/// What a torch file holds: the tensors of its state dict, and the entries left out (with why).
#[derive(Debug, Clone, PartialEq)]
pub struct Contents {
    pub tensors: Vec<TensorRecord>,
    pub skipped: Vec<(String, String)>,
}

/// An open torch zip archive.
pub struct TorchArchive {
    path: PathBuf,
    backing: Backing,
    big_endian: bool,
}

/// Where the storages are.
enum Backing {
    /// The zip format: `<prefix>data/<key>` entries (`prefix` ends in `/`, or is empty).
    Zip {
        zip: zip::ZipArchive<BufReader<File>>,
        prefix: String,
        /// The file's length, which bounds what any entry can hold.
        file_len: u64,
    },
    /// torch's legacy format: the file mapped, each storage's byte range in it.
    Legacy {
        map: memmap2::Mmap,
        storages: std::collections::HashMap<String, std::ops::Range<usize>>,
    },
}

impl std::fmt::Debug for TorchArchive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchArchive")
            .field("path", &self.path)
            .field("big_endian", &self.big_endian)
            .finish()
    }
}

/// Whether `path` starts as a torch zip archive does (`PK\x03\x04`).
pub fn is_zip(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok_and(|_| &magic == b"PK\x03\x04")
}

/// Whether `path` is a torch file by its first bytes: a zip archive, or torch's legacy format
/// (a protocol-2 pickle of its magic number, a 10-byte long: `80 02 8a 0a`).
pub fn is_torch_file(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok_and(|_| &magic == b"PK\x03\x04" || matches!(magic, [0x80, 0x02 | 0x03, 0x8a, 0x0a]))
}

/// torch's legacy magic number (`0x1950a86a20f9469cfc6c`), little-endian, as its first pickle
/// holds it.
const LEGACY_MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];

impl TorchArchive {
    /// Opens `path` and reads its state dict.
    pub fn open(path: &Path) -> Result<(Self, Contents), TorchFileError> {
        let io = |source| TorchFileError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut head = [0u8; 2];
        let mut file = File::open(path).map_err(io)?;
        let n = file.read(&mut head).map_err(io)?;
        if is_zip(path) {
            Self::open_zip(path)
        } else if n == 2 && head[0] == 0x80 {
            Self::open_legacy(path)
        } else {
            Err(TorchFileError::NotTorch {
                path: path.to_path_buf(),
                message: "it is not a zip archive (torch.save's format) nor torch's legacy format"
                    .into(),
            })
        }
    }

    fn open_zip(path: &Path) -> Result<(Self, Contents), TorchFileError> {
        let not = |message: String| TorchFileError::NotTorch {
            path: path.to_path_buf(),
            message,
        };
        let file = File::open(path).map_err(|source| TorchFileError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let file_len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let zip = zip::ZipArchive::new(BufReader::new(file))
            .map_err(|e| not(format!("its zip directory is unreadable: {e}")))?;
        let record = (0..zip.len())
            .filter_map(|i| zip.name_for_index(i)?.ok().map(|n| n.into_owned()))
            .filter(|n| n.ends_with("data.pkl") && n.matches('/').count() <= 1)
            .min_by_key(String::len)
            .ok_or_else(|| not("it has no `data.pkl` record".into()))?;
        let prefix = record.trim_end_matches("data.pkl").to_string();
        let mut archive = TorchArchive {
            path: path.to_path_buf(),
            backing: Backing::Zip {
                zip,
                prefix,
                file_len,
            },
            big_endian: false,
        };
        archive.big_endian = archive.read_byteorder()?;
        let pickle = archive.read_entry(&record, MAX_PICKLE_BYTES)?;
        let value = unpickle(&pickle).map_err(|source| TorchFileError::Pickle {
            path: path.to_path_buf(),
            entry: record.clone(),
            source,
        })?;
        let contents = state_dict(path, &value)?;
        Ok((archive, contents))
    }

    /// torch's legacy format (`torch.save` before 1.6, or `_use_new_zipfile_serialization=False`):
    /// five pickles one after another (the magic number, the protocol version 1001, `sys_info`
    /// with the byte order, the object, the list of storage keys), then each storage in that
    /// list's order as an 8-byte element count and its raw elements (`torch/serialization.py`,
    /// `_legacy_save`/`_legacy_load`).
    fn open_legacy(path: &Path) -> Result<(Self, Contents), TorchFileError> {
        let file = File::open(path).map_err(|source| TorchFileError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        // SAFETY: mapped read-only; sdtrain never writes a file it reads, and every read below
        // is bounds-checked against the map's length.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| TorchFileError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let legacy = |message: String| TorchFileError::NotTorch {
            path: path.to_path_buf(),
            message: format!("torch's legacy format: {message}"),
        };
        let mut pos = 0usize;
        let mut next = |what: &str| -> Result<Value, TorchFileError> {
            let rest = map.get(pos..).unwrap_or_default();
            let (v, used) = super::unpickler::unpickle_prefix(rest).map_err(|source| {
                TorchFileError::Pickle {
                    path: path.to_path_buf(),
                    entry: what.to_string(),
                    source,
                }
            })?;
            pos += used;
            Ok(v)
        };
        if next("the magic number")? != Value::BigInt(LEGACY_MAGIC.to_vec()) {
            return Err(legacy("it does not start with torch's magic number".into()));
        }
        if next("the protocol version")? != Value::Int(1001) {
            return Err(legacy("its protocol version is not 1001".into()));
        }
        // `sys_info` records the saving machine's byte order, but torch writes every storage
        // (its count and its elements) little-endian whatever the machine, and `_legacy_load`
        // ignores it.
        next("sys_info")?;
        let value = next("the object")?;
        let keys = next("the storage keys")?;
        let contents = state_dict(path, &value)?;
        let sizes = storage_element_sizes(&value);
        let mut storages = std::collections::HashMap::new();
        for key in keys.as_seq().unwrap_or_default() {
            let key = key
                .as_str()
                .ok_or_else(|| legacy("a storage key is not a string".into()))?;
            let size = *sizes
                .get(key)
                .ok_or_else(|| legacy(format!("storage `{key}` is listed but never used")))?;
            let count = pos
                .checked_add(8)
                .and_then(|e| map.get(pos..e))
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .map(u64::from_le_bytes)
                .ok_or_else(|| legacy(format!("the file ends before storage `{key}`")))?;
            let start = pos + 8;
            let end = usize::try_from(count)
                .ok()
                .and_then(|c| c.checked_mul(size))
                .and_then(|b| b.checked_add(start))
                .filter(|&e| e <= map.len())
                .ok_or_else(|| {
                    legacy(format!(
                        "storage `{key}` ({count} elements) runs past the end of the file"
                    ))
                })?;
            storages.insert(key.to_string(), start..end);
            pos = end;
        }
        let archive = TorchArchive {
            path: path.to_path_buf(),
            backing: Backing::Legacy { map, storages },
            big_endian: false,
        };
        Ok((archive, contents))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn read_byteorder(&mut self) -> Result<bool, TorchFileError> {
        let name = match &self.backing {
            Backing::Zip { zip, prefix, .. } => {
                let name = format!("{prefix}byteorder");
                if zip.index_for_name(&name).is_none() {
                    return Ok(false); // written since torch 1.10; before that, little-endian
                }
                name
            }
            Backing::Legacy { .. } => return Ok(self.big_endian),
        };
        let bytes = self.read_entry(&name, 64)?;
        match bytes.trim_ascii() {
            b"little" => Ok(false),
            b"big" => Ok(true),
            other => Err(TorchFileError::NotTorch {
                path: self.path.clone(),
                message: format!("unknown byte order `{}`", String::from_utf8_lossy(other)),
            }),
        }
    }

    /// The whole of zip entry `name`, refused past `limit` bytes or past what its compressed
    /// data can hold (deflate expands at most 1032:1), so a hostile size cannot size an
    /// allocation.
    fn read_entry(&mut self, name: &str, limit: u64) -> Result<Vec<u8>, TorchFileError> {
        let path = self.path.clone();
        let not = |message: String| TorchFileError::NotTorch {
            path: path.clone(),
            message,
        };
        let Backing::Zip { zip, file_len, .. } = &mut self.backing else {
            return Err(not(format!("no entry `{name}` in a legacy file")));
        };
        let file_len = *file_len;
        let mut entry = zip
            .by_name(name)
            .map_err(|e| not(format!("entry `{name}`: {e}")))?;
        let possible = entry
            .compressed_size()
            .min(file_len)
            .saturating_mul(1100)
            .saturating_add(1 << 16);
        if entry.size() > limit.min(possible) {
            return Err(not(format!(
                "entry `{name}` declares {} bytes, more than its {} stored bytes can hold or \
                 than expected",
                entry.size(),
                entry.compressed_size()
            )));
        }
        // Grown as read, never sized from the header alone.
        let mut out = Vec::with_capacity(entry.size().min(file_len) as usize);
        entry
            .read_to_end(&mut out)
            .map_err(|e| not(format!("entry `{name}`: {e}")))?;
        Ok(out)
    }

    /// The raw bytes of storage `key` (the whole storage, as stored).
    pub fn storage(&mut self, key: &str) -> Result<Vec<u8>, TorchFileError> {
        match &self.backing {
            Backing::Zip { prefix, .. } => {
                let name = format!("{prefix}data/{key}");
                self.read_entry(&name, u64::MAX)
            }
            Backing::Legacy { map, storages } => storages
                .get(key)
                .and_then(|r| map.get(r.clone()))
                .map(<[u8]>::to_vec)
                .ok_or_else(|| TorchFileError::NotTorch {
                    path: self.path.clone(),
                    message: format!("torch's legacy format: no storage `{key}`"),
                }),
        }
    }

    /// `t`'s elements, contiguous and little-endian, cut from `storage` (its storage's bytes).
    pub fn tensor_bytes(
        &self,
        t: &TensorRecord,
        storage: &[u8],
    ) -> Result<Vec<u8>, TorchFileError> {
        let e = t.dtype.size();
        let fail = |message: String| TorchFileError::Tensor {
            path: self.path.clone(),
            name: t.name.clone(),
            message,
        };
        let n = t.numel();
        // The byte just past the last element the view reads (all index math below stays under
        // it, so none of it can overflow).
        let reach = match view_extent(t) {
            Some(None) => Some(0),
            Some(Some(last)) => last.checked_add(1).and_then(|x| x.checked_mul(e)),
            None => None,
        }
        .ok_or_else(|| fail("its view overflows".into()))?;
        if reach > storage.len() {
            return Err(fail(format!(
                "its view (offset {}, shape {:?}, stride {:?}) reaches past its storage `{}` of {} bytes",
                t.offset,
                t.shape,
                t.stride,
                t.storage,
                storage.len()
            )));
        }
        // A view may not read more bytes than its storage holds: a stride-0 view of a short
        // storage would otherwise turn a few bytes of file into any amount of memory.
        let len = n
            .checked_mul(e)
            .filter(|&b| b <= storage.len())
            .ok_or_else(|| {
                fail(format!(
                    "its view (shape {:?}, stride {:?}) repeats elements into more bytes than its \
                     storage `{}` holds ({} bytes)",
                    t.shape,
                    t.stride,
                    t.storage,
                    storage.len()
                ))
            })?;
        let mut out = Vec::with_capacity(len);
        if n > 0 && is_row_major(&t.shape, &t.stride) {
            out.extend_from_slice(&storage[t.offset * e..(t.offset + n) * e]);
        } else if n > 0 {
            let mut index = vec![0usize; t.shape.len()];
            for _ in 0..n {
                let at = t.offset
                    + index
                        .iter()
                        .zip(&t.stride)
                        .map(|(i, s)| i * s)
                        .sum::<usize>();
                out.extend_from_slice(&storage[at * e..(at + 1) * e]);
                for d in (0..index.len()).rev() {
                    index[d] += 1;
                    if index[d] < t.shape[d] {
                        break;
                    }
                    index[d] = 0;
                }
            }
        }
        if self.big_endian && e > 1 {
            out.chunks_exact_mut(e).for_each(<[u8]>::reverse);
        }
        Ok(out)
    }
}

/// The largest element index `t` reads (`None`: it reads nothing), or `None` overall on overflow.
fn view_extent(t: &TensorRecord) -> Option<Option<usize>> {
    if t.shape.contains(&0) {
        return Some(None);
    }
    let mut last = t.offset;
    for (&n, &s) in t.shape.iter().zip(&t.stride) {
        last = last.checked_add((n - 1).checked_mul(s)?)?;
    }
    Some(Some(last))
}

/// Whether `stride` is the row-major stride of `shape` (dims of size 1 may have any stride).
fn is_row_major(shape: &[usize], stride: &[usize]) -> bool {
    let mut expect = 1usize;
    for (&n, &s) in shape.iter().zip(stride).rev() {
        if n != 1 && s != expect {
            return false;
        }
        expect = expect.saturating_mul(n);
    }
    true
}

/// The element size of every storage the pickle references (legacy files list storages by key
/// only, so each one's length in bytes needs its type), by key.
fn storage_element_sizes(v: &Value) -> std::collections::HashMap<String, usize> {
    fn walk(v: &Value, out: &mut std::collections::HashMap<String, usize>, depth: u32) {
        if depth > MAX_DEPTH {
            return;
        }
        if let Value::PersistentId(pid) = v {
            if let Some([tag, class, key, ..]) = pid.as_seq() {
                let size = class
                    .as_global()
                    .and_then(|(_, c)| StoredDtype::from_storage(c))
                    .map(StoredDtype::size);
                if let (Some("storage"), Some(key), Some(size)) = (tag.as_str(), key.as_str(), size)
                {
                    out.insert(key.to_string(), size);
                }
            }
            return;
        }
        for c in v.children() {
            walk(c, out, depth + 1);
        }
    }
    let mut out = std::collections::HashMap::new();
    walk(v, &mut out, 0);
    out
}

fn key_of(v: &Value) -> Option<&str> {
    v.as_str()
}

/// The state dict of the unpickled `top` (see the module header).
fn state_dict(path: &Path, top: &Value) -> Result<Contents, TorchFileError> {
    let no = |message: String| TorchFileError::NoStateDict {
        path: path.to_path_buf(),
        message,
    };
    // `torch.save(model)`: the module's parameters and buffers.
    if let (Some(parts), true) = (
        module_state(top),
        top.as_mapping().is_none_or(<[_]>::is_empty),
    ) {
        let mut contents = Contents {
            tensors: Vec::new(),
            skipped: Vec::new(),
        };
        for part in parts {
            flatten(path, part, "", 0, &mut contents)?;
        }
        if !contents.tensors.is_empty() {
            return Ok(contents);
        }
    }
    let mut map = top.as_mapping().ok_or_else(|| {
        no(match top {
            Value::Object { callable, .. } => match callable.as_global() {
                Some((m, n)) => {
                    format!("it holds a pickled `{m}.{n}` object, not a dict of tensors")
                }
                None => "it holds a pickled object, not a dict of tensors".into(),
            },
            other => format!("it holds a {}, not a dict of tensors", kind(other)),
        })
    })?;
    while let Some(inner) = map
        .iter()
        .find(|(k, _)| key_of(k) == Some("state_dict"))
        .and_then(|(_, v)| v.as_mapping())
    {
        map = inner;
    }
    let mut contents = Contents {
        tensors: Vec::new(),
        skipped: Vec::new(),
    };
    flatten(path, map, "", 0, &mut contents)?;
    let mut seen = BTreeSet::new();
    for t in &contents.tensors {
        if !seen.insert(t.name.as_str()) {
            return Err(TorchFileError::Tensor {
                path: path.to_path_buf(),
                name: t.name.clone(),
                message: "the name is given twice (a nested dict's key joined with `.` equals \
                          another key)"
                    .into(),
            });
        }
    }
    if contents.tensors.is_empty() {
        return Err(no("its top-level dict has no tensors".into()));
    }
    Ok(contents)
}

fn flatten(
    path: &Path,
    map: &[(Value, Value)],
    prefix: &str,
    depth: u32,
    out: &mut Contents,
) -> Result<(), TorchFileError> {
    for (k, v) in map {
        let name = match k {
            Value::Str(s) => format!("{prefix}{s}"),
            Value::Int(i) => format!("{prefix}{i}"),
            other => {
                out.skipped.push((
                    format!("{prefix}<{}>", kind(other)),
                    "a key that is not a string".into(),
                ));
                continue;
            }
        };
        if depth >= MAX_DEPTH {
            out.skipped.push((name, "nested too deep".into()));
            continue;
        }
        match tensor(path, &name, v)? {
            Some(t) => out.tensors.push(t),
            None => match (v.as_mapping(), module_state(v)) {
                (Some(inner), _) if !inner.is_empty() => {
                    flatten(path, inner, &format!("{name}."), depth + 1, out)?
                }
                (_, Some(parts)) => {
                    for part in parts {
                        flatten(path, part, &format!("{name}."), depth + 1, out)?;
                    }
                }
                _ => out
                    .skipped
                    .push((name, format!("a {}, not a tensor", describe(v)))),
            },
        }
    }
    Ok(())
}

/// A pickled `torch.nn.Module` (a `ParameterDict`, as the original textual-inversion code saved
/// its `string_to_param`): its `_parameters`, `_buffers` and `_modules` dicts from the `BUILD`
/// state, whose entries are what `module.state_dict()` names `<key>`.
fn module_state(v: &Value) -> Option<Vec<&[(Value, Value)]>> {
    let Value::Object {
        state: Some(state), ..
    } = v
    else {
        return None;
    };
    let state = state.as_mapping()?;
    let part = |name: &str| {
        state
            .iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .and_then(|(_, v)| v.as_mapping())
    };
    let params = part("_parameters")?;
    Some(
        [Some(params), part("_buffers"), part("_modules")]
            .into_iter()
            .flatten()
            .collect(),
    )
}

fn describe(v: &Value) -> String {
    match v {
        Value::Object { callable, .. } => match callable.as_global() {
            Some((m, n)) => format!("`{m}.{n}` object"),
            None => "object".into(),
        },
        other => kind(other).into(),
    }
}

/// `v` as a tensor record if it is a tensor (`Ok(None)`: not a tensor).
fn tensor(path: &Path, name: &str, v: &Value) -> Result<Option<TensorRecord>, TorchFileError> {
    let fail = |message: String| TorchFileError::Tensor {
        path: path.to_path_buf(),
        name: name.to_string(),
        message,
    };
    let Value::Object { callable, args, .. } = v else {
        return Ok(None);
    };
    let Some((module, function)) = callable.as_global() else {
        return Ok(None);
    };
    let args = args.as_seq().unwrap_or_default();
    match (module, function) {
        ("torch._utils", "_rebuild_parameter" | "_rebuild_parameter_with_state") => {
            let inner = args
                .first()
                .ok_or_else(|| fail(format!("{function} without its tensor")))?;
            tensor(path, name, inner)?
                .map(Some)
                .ok_or_else(|| fail(format!("{function} of something that is not a tensor")))
        }
        ("torch._tensor", "_rebuild_from_type_v2") => {
            let (Some(func), Some(inner)) = (args.first(), args.get(2)) else {
                return Err(fail("_rebuild_from_type_v2 with too few arguments".into()));
            };
            let call = Value::Object {
                callable: Box::new(func.clone()),
                args: Box::new(inner.clone()),
                items: Vec::new(),
                elements: Vec::new(),
                state: None,
            };
            tensor(path, name, &call)?.map(Some).ok_or_else(|| {
                fail("_rebuild_from_type_v2 of something that is not a tensor".into())
            })
        }
        ("torch._utils", "_rebuild_tensor" | "_rebuild_tensor_v2" | "_rebuild_tensor_v3") => {
            rebuild(name, function, args).map(Some).map_err(fail)
        }
        ("torch._utils", other) if other.starts_with("_rebuild_") => Err(fail(format!(
            "stored through `torch._utils.{other}` (a quantized, sparse or device-only tensor), \
             which sdtrain does not read"
        ))),
        _ => Ok(None),
    }
}

/// A tensor from `_rebuild_tensor*`'s arguments (module header).
fn rebuild(name: &str, function: &str, args: &[Value]) -> Result<TensorRecord, String> {
    let [storage, offset, size, stride, ..] = args else {
        return Err(format!(
            "{function} with {} arguments, not at least 4",
            args.len()
        ));
    };
    // Tensor metadata (`_rebuild_tensor_v2`'s 7th argument, `_v3`'s 8th): torch's negative
    // and conjugate bits, which say the values are to be read negated; refused, never misread.
    let metadata = args.get(if function == "_rebuild_tensor_v3" {
        7
    } else {
        6
    });
    if let Some(bits) = metadata.and_then(Value::as_mapping) {
        for (k, v) in bits {
            if matches!(k.as_str(), Some("neg" | "conj")) && v == &Value::Bool(true) {
                return Err(format!(
                    "saved as a view with torch's `{}` bit set; save it again after \
                     `.resolve_neg()`/`.resolve_conj()`",
                    k.as_str().unwrap_or_default()
                ));
            }
        }
    }
    let Value::PersistentId(pid) = storage else {
        return Err(format!(
            "its storage is a {}, not a storage reference",
            kind(storage)
        ));
    };
    let pid = pid.as_seq().unwrap_or_default();
    let [tag, class, key, _location, _numel, rest @ ..] = pid else {
        return Err(
            "its storage reference is not (\"storage\", type, key, location, numel)".into(),
        );
    };
    // The legacy format's view of a root storage: (view key, offset in elements, size).
    let view_offset = match rest.first().and_then(Value::as_seq) {
        Some([_, off, _]) => off
            .as_int()
            .and_then(|i| usize::try_from(i).ok())
            .ok_or("its storage view's offset is not a size")?,
        _ => 0,
    };
    if tag.as_str() != Some("storage") {
        return Err("its storage reference is not a `storage` record".into());
    }
    let key = key.as_str().ok_or("its storage key is not a string")?;
    let (_, class) = class.as_global().ok_or("its storage type is not a name")?;
    let dtype = if function == "_rebuild_tensor_v3" {
        let dt = args
            .get(6)
            .and_then(Value::as_global)
            .ok_or("_rebuild_tensor_v3 without a dtype")?;
        StoredDtype::from_torch(dt.1)
            .ok_or_else(|| format!("dtype `torch.{}` is not supported", dt.1))?
    } else {
        StoredDtype::from_storage(class)
            .ok_or_else(|| format!("storage type `{class}` is not supported"))?
    };
    let dims = |v: &Value, what: &str| -> Result<Vec<usize>, String> {
        v.as_seq()
            .ok_or_else(|| format!("its {what} is not a tuple"))?
            .iter()
            .map(|d| d.as_int().and_then(|i| usize::try_from(i).ok()))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| format!("its {what} holds a value that is not a size"))
    };
    let shape = dims(size, "size")?;
    let stride = dims(stride, "stride")?;
    if shape.len() != stride.len() {
        return Err(format!(
            "size {shape:?} and stride {stride:?} differ in rank"
        ));
    }
    shape
        .iter()
        .try_fold(dtype.size(), |a, &d| a.checked_mul(d))
        .ok_or_else(|| format!("shape {shape:?} overflows"))?;
    let offset = offset
        .as_int()
        .and_then(|i| usize::try_from(i).ok())
        .and_then(|o| o.checked_add(view_offset))
        .ok_or("its storage offset is not a size")?;
    Ok(TensorRecord {
        name: name.to_string(),
        dtype,
        shape,
        storage: key.to_string(),
        offset,
        stride,
    })
}
