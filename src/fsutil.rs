//! Crash-safe file and directory writes.
//!
//! - A file is written to a temporary sibling (`.<name>.tmp-<pid>-<n>` in the same directory, so
//!   the final `rename` never crosses a filesystem), flushed, `fsync`ed, then renamed over the
//!   destination, and the directory is `fsync`ed. A reader sees the old file or the whole new
//!   one, never a torn write. On error the temporary file is removed. (The same scheme as burn's
//!   file checkpointer and every database's "write-ahead then rename".)
//! - A directory is built in `<dir>.tmp-<pid>` beside its destination ([`StagedDir`]) and renamed
//!   into place only when complete. An existing destination is first renamed to
//!   `<dir>.old-<pid>`, then the new directory takes its name and the old one is deleted. Linux
//!   cannot swap two non-empty directories atomically without `renameat2(RENAME_EXCHANGE)`, so
//!   there is a window of two renames in which the destination name is absent; its old contents
//!   are never modified, and a failed second rename puts them back.

use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("cannot {op} {}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{} has no file name to stage beside it", path.display())]
    NoFileName { path: PathBuf },
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> FsError {
    let path = path.to_path_buf();
    move |source| FsError::Io { op, path, source }
}

/// Distinguishes temporary names within one process (two writers to one directory).
static COUNTER: AtomicU64 = AtomicU64::new(0);

/// `dir/.<name>.tmp-<pid>-<n>` for the destination `path`.
fn temp_sibling(path: &Path) -> Result<PathBuf, FsError> {
    let name = path.file_name().ok_or_else(|| FsError::NoFileName {
        path: path.to_path_buf(),
    })?;
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut tmp = std::ffi::OsString::from(".");
    tmp.push(name);
    tmp.push(format!(".tmp-{}-{n}", std::process::id()));
    Ok(path.with_file_name(tmp))
}

/// The directory holding `path` (`.` for a bare file name).
fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// `fsync`s a directory, so a rename or create inside it survives a crash.
pub fn sync_dir(dir: &Path) -> Result<(), FsError> {
    // Opening a directory read-only and calling fsync is the POSIX way; Windows cannot open
    // directories as files, and its renames are durable without it.
    #[cfg(unix)]
    {
        File::open(dir)
            .and_then(|f| f.sync_all())
            .map_err(io_err("sync directory", dir))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Writes `path` atomically through a buffered writer: `write` fills the temporary file, which
/// is then flushed, `fsync`ed and renamed over `path`. `write`'s own error type passes through.
pub fn write_atomic_with<E, F>(path: &Path, write: F) -> Result<(), E>
where
    E: From<FsError>,
    F: FnOnce(&mut BufWriter<File>) -> Result<(), E>,
{
    write_atomic_to_path(path, |tmp| {
        let file = File::create(tmp).map_err(io_err("create", tmp))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        write(&mut w)?;
        w.into_inner()
            .map_err(|e| io_err("write", tmp)(e.into_error()))?;
        Ok(())
    })
}

/// Writes `path` atomically where the writer needs a file path (e.g. safetensors'
/// `serialize_to_file`): `write` creates the temporary file it is given, which is then
/// `fsync`ed and renamed over `path`. On error the temporary file is removed.
pub fn write_atomic_to_path<E, F>(path: &Path, write: F) -> Result<(), E>
where
    E: From<FsError>,
    F: FnOnce(&Path) -> Result<(), E>,
{
    let tmp = temp_sibling(path)?;
    let result = (|| {
        write(&tmp)?;
        File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(io_err("sync", &tmp))?;
        fs::rename(&tmp, path).map_err(io_err("rename into place", path))?;
        sync_dir(parent_of(path))?;
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Writes `contents` to `path` atomically.
pub fn write_atomic(path: &Path, contents: impl AsRef<[u8]>) -> Result<(), FsError> {
    write_atomic_with(path, |w| {
        w.write_all(contents.as_ref())
            .map_err(io_err("write", path))
    })
}

/// Copies `src` to `dst` atomically (symlinks in `src` are followed: hub cache snapshots are
/// links into `blobs/`).
pub fn copy_atomic(src: &Path, dst: &Path) -> Result<(), FsError> {
    let mut input = File::open(src).map_err(io_err("open", src))?;
    write_atomic_with(dst, |w| {
        io::copy(&mut input, w).map_err(io_err("copy into", dst))?;
        Ok(())
    })
}

/// A directory under construction beside its destination. Fill [`path`](Self::path), then
/// [`commit`](Self::commit); dropping it uncommitted deletes the staging directory.
#[derive(Debug)]
pub struct StagedDir {
    target: PathBuf,
    staging: PathBuf,
    committed: bool,
}

impl StagedDir {
    /// Creates `<target>.tmp-<pid>` (replacing a stale one from an earlier crashed run of this
    /// process id) and the parent directories it needs.
    pub fn new(target: &Path) -> Result<Self, FsError> {
        let staging = Self::sibling(target, "tmp")?;
        fs::create_dir_all(parent_of(target)).map_err(io_err("create", parent_of(target)))?;
        if staging.exists() {
            fs::remove_dir_all(&staging).map_err(io_err("remove stale", &staging))?;
        }
        fs::create_dir(&staging).map_err(io_err("create", &staging))?;
        Ok(Self {
            target: target.to_path_buf(),
            staging,
            committed: false,
        })
    }

    /// `<target>.<tag>-<pid>`.
    fn sibling(target: &Path, tag: &str) -> Result<PathBuf, FsError> {
        let name = target.file_name().ok_or_else(|| FsError::NoFileName {
            path: target.to_path_buf(),
        })?;
        let mut s = name.to_os_string();
        s.push(format!(".{tag}-{}", std::process::id()));
        Ok(target.with_file_name(s))
    }

    /// The staging directory to build in.
    pub fn path(&self) -> &Path {
        &self.staging
    }

    /// The destination.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Syncs the staged tree and renames it into place, replacing an existing destination.
    pub fn commit(mut self) -> Result<(), FsError> {
        sync_tree_dirs(&self.staging)?;
        let parent = parent_of(&self.target).to_path_buf();
        if fs::symlink_metadata(&self.target).is_ok() {
            let old = Self::sibling(&self.target, "old")?;
            if fs::symlink_metadata(&old).is_ok() {
                remove_any(&old)?;
            }
            fs::rename(&self.target, &old).map_err(io_err("move aside", &self.target))?;
            if let Err(source) = fs::rename(&self.staging, &self.target) {
                // Put the previous version back; the staging dir is cleaned up by Drop.
                let _ = fs::rename(&old, &self.target);
                return Err(FsError::Io {
                    op: "rename into place",
                    path: self.target.clone(),
                    source,
                });
            }
            self.committed = true;
            sync_dir(&parent)?;
            remove_any(&old)?;
        } else {
            fs::rename(&self.staging, &self.target)
                .map_err(io_err("rename into place", &self.target))?;
            self.committed = true;
        }
        sync_dir(&parent)
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort cleanup of an abandoned build; nothing else refers to it.
            let _ = fs::remove_dir_all(&self.staging);
        }
    }
}

fn remove_any(path: &Path) -> Result<(), FsError> {
    let meta = fs::symlink_metadata(path).map_err(io_err("inspect", path))?;
    if meta.is_dir() {
        fs::remove_dir_all(path).map_err(io_err("remove", path))
    } else {
        fs::remove_file(path).map_err(io_err("remove", path))
    }
}

/// `fsync`s `dir` and every directory below it (files are synced by their writers).
fn sync_tree_dirs(dir: &Path) -> Result<(), FsError> {
    for entry in fs::read_dir(dir).map_err(io_err("read", dir))? {
        let entry = entry.map_err(io_err("read", dir))?;
        let ty = entry
            .file_type()
            .map_err(io_err("inspect", &entry.path()))?;
        if ty.is_dir() {
            sync_tree_dirs(&entry.path())?;
        }
    }
    sync_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.json");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        assert_eq!(names(dir.path()), ["a.json"]);
    }

    #[test]
    fn failed_write_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.bin");
        write_atomic(&p, b"old").unwrap();
        let err: Result<(), FsError> = write_atomic_with(&p, |w| {
            w.write_all(b"partial").unwrap();
            Err(FsError::NoFileName { path: p.clone() })
        });
        assert!(err.is_err());
        assert_eq!(fs::read(&p).unwrap(), b"old");
        assert_eq!(names(dir.path()), ["state.bin"]);
    }

    #[test]
    fn copy_atomic_copies() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        fs::write(&a, b"data").unwrap();
        copy_atomic(&a, &b).unwrap();
        assert_eq!(fs::read(&b).unwrap(), b"data");
    }

    #[test]
    fn staged_dir_publishes_and_replaces() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out");
        let s = StagedDir::new(&target).unwrap();
        write_atomic(&s.path().join("f"), b"v1").unwrap();
        assert!(!target.exists());
        s.commit().unwrap();
        assert_eq!(fs::read(target.join("f")).unwrap(), b"v1");

        let s = StagedDir::new(&target).unwrap();
        fs::create_dir(s.path().join("sub")).unwrap();
        write_atomic(&s.path().join("sub/g"), b"v2").unwrap();
        // The old version is untouched until commit.
        assert_eq!(fs::read(target.join("f")).unwrap(), b"v1");
        s.commit().unwrap();
        assert!(!target.join("f").exists());
        assert_eq!(fs::read(target.join("sub/g")).unwrap(), b"v2");
        assert_eq!(names(dir.path()), ["out"]);
    }

    #[test]
    fn dropped_stage_is_removed_and_target_kept() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out");
        fs::create_dir(&target).unwrap();
        fs::write(target.join("keep"), b"k").unwrap();
        {
            let s = StagedDir::new(&target).unwrap();
            write_atomic(&s.path().join("f"), b"x").unwrap();
        }
        assert_eq!(names(dir.path()), ["out"]);
        assert_eq!(fs::read(target.join("keep")).unwrap(), b"k");
    }
}
