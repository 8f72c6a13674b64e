//! A torch file converted once to `.safetensors` for the loaders, which map safetensors only.
//!
//! The copy lives in sdtrain's cache (`SDTRAIN_CACHE`, else `$XDG_CACHE_HOME/sdtrain`, else
//! `~/.cache/sdtrain`), as `converted/<key>/<file name>.safetensors` (so a message naming the
//! copy names the user's file too), where the key hashes the source's canonical path, length and
//! modification time: an edited or replaced file is converted again, an unchanged one is
//! reused. The copy is written atomically, so one that exists is whole. Nothing is written
//! beside the user's file.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::to_safetensors::{convert_files, ConvertError, Converted};

/// Changes whenever the conversion's output could change.
const CONVERTER_VERSION: &str = "sdtrain torch_pickle 2";

/// A converted copy of a torch file.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvertedCopy {
    pub path: PathBuf,
    /// `Some` when this call converted it, `None` when an earlier copy was reused.
    pub fresh: Option<Converted>,
}

/// sdtrain's cache folder (module header), or `None` when neither variable nor `HOME` is set.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("SDTRAIN_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("sdtrain")))
        .or_else(|| var("HOME").map(|h| h.join(".cache").join("sdtrain")))
}

fn io(path: &Path, source: std::io::Error) -> ConvertError {
    ConvertError::Write {
        path: path.to_path_buf(),
        source,
    }
}

/// The converted copy of `src` in the cache, made now if there is none (module header).
pub fn converted_copy(src: &Path) -> Result<ConvertedCopy, ConvertError> {
    converted_copy_of(&[src.to_path_buf()])
}

/// As [`converted_copy`], one copy holding the tensors of all of `srcs` (a sharded model's
/// `.bin` shards), keyed by every one of them.
pub fn converted_copy_of(srcs: &[PathBuf]) -> Result<ConvertedCopy, ConvertError> {
    let Some(first) = srcs.first() else {
        return Err(io(
            Path::new("."),
            std::io::Error::other("no torch file to convert"),
        ));
    };
    let mut h = Sha256::new();
    // The reader's version: a copy made by an older reader is made again.
    h.update(CONVERTER_VERSION.as_bytes());
    for src in srcs {
        let read = |source| {
            ConvertError::Read(super::TorchFileError::Io {
                path: src.to_path_buf(),
                source,
            })
        };
        let canonical = src.canonicalize().map_err(read)?;
        let meta = std::fs::metadata(&canonical).map_err(read)?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        h.update(canonical.to_string_lossy().as_bytes());
        h.update(meta.len().to_le_bytes());
        h.update(mtime.to_le_bytes());
    }
    let key: String = h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let name = first
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let dir = cache_dir()
        .ok_or_else(|| {
            io(
                first,
                std::io::Error::other(
                    "no cache folder for the converted copy: set SDTRAIN_CACHE (or HOME)",
                ),
            )
        })?
        .join("converted")
        .join(key);
    // `<name>.safetensors`: every message that names the copy names the user's file too.
    let path = dir.join(format!("{name}.safetensors"));
    // One conversion at a time in this process (the ranks of a `--devices` run resolve the
    // model together); the second finds the first's copy.
    static CONVERTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = CONVERTING.lock().unwrap_or_else(|p| p.into_inner());
    if path.is_file() {
        return Ok(ConvertedCopy { path, fresh: None });
    }
    // Unreadable files are refused before anything is written to the cache.
    for src in srcs {
        super::TorchArchive::open(src)?;
    }
    std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
    let mut metadata = serde_json::Map::new();
    let names: Vec<String> = srcs
        .iter()
        .filter_map(|s| s.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .collect();
    metadata.insert("sdtrain.converted_from".into(), names.join(", ").into());
    let done = convert_files(srcs, &path, metadata)?;
    Ok(ConvertedCopy {
        path,
        fresh: Some(done),
    })
}
