//! The run folder `output_dir/<project_name>-<timestamp>/` and what lives in it:
//! `plan.json` (the resolved plan), `train_log.jsonl`, and the saved model folders
//! (`epoch-0001/`, `final/`, `interrupted-step-000123/`, `errored-step-000123/`). The names are
//! the run layout's ([`crate::run_layout`]); this file creates the folder and hands out paths.

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::run_layout;

/// `output_dir` cannot be created or written: checked before the model and the data load.
#[derive(Debug, thiserror::Error)]
#[error("output_dir {} cannot be used", path.display())]
pub struct OutputDirError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Creates `output_dir` (with its parents) and checks a file can be written in it.
pub fn ensure_output_dir(output_dir: &Path) -> Result<(), OutputDirError> {
    let err = |source| OutputDirError {
        path: output_dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(output_dir).map_err(err)?;
    let probe = output_dir.join(format!(".sdtrain-write-check-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(err)?;
    std::fs::remove_file(&probe).map_err(err)
}

#[derive(Debug, Clone)]
pub struct RunDir {
    pub path: PathBuf,
}

impl RunDir {
    /// Creates `output_dir/<project>-<YYYYmmdd-HHMMSS>`, adding `-2`, `-3`, … when two runs start
    /// in the same second.
    pub fn create(output_dir: &Path, project: &str) -> anyhow::Result<Self> {
        let stamp = run_layout::run_stamp(chrono::Local::now());
        std::fs::create_dir_all(output_dir)
            .with_context(|| format!("cannot create output_dir {}", output_dir.display()))?;
        for n in 1.. {
            let path = output_dir.join(run_layout::run_folder_name(project, &stamp, n));
            match std::fs::create_dir(&path) {
                Ok(()) => return Ok(Self { path }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("cannot create run folder {}", path.display()))
                }
            }
        }
        unreachable!("the loop above only ends by returning")
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    pub fn epoch_dir(&self, epoch: usize) -> PathBuf {
        run_layout::epoch_dir(&self.path, epoch)
    }

    pub fn final_dir(&self) -> PathBuf {
        run_layout::final_dir(&self.path)
    }

    pub fn interrupted_dir(&self, step: usize) -> PathBuf {
        run_layout::interrupted_dir(&self.path, step)
    }

    /// A step save (`save_every_n_steps`).
    pub fn step_dir(&self, step: usize) -> PathBuf {
        run_layout::step_dir(&self.path, step)
    }

    /// The last completed step of a run that stopped on an out-of-memory error.
    pub fn errored_dir(&self, step: usize) -> PathBuf {
        run_layout::errored_dir(&self.path, step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unusable_output_dir_is_reported() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("a-file");
        std::fs::write(&file, b"x").unwrap();
        for bad in [file.clone(), file.join("below")] {
            let err = ensure_output_dir(&bad).unwrap_err();
            assert!(err.to_string().contains("a-file"), "{err}");
        }
        let good = tmp.path().join("new/out");
        ensure_output_dir(&good).unwrap();
        assert_eq!(std::fs::read_dir(&good).unwrap().count(), 0);
    }
}
