//! The run folder `output_dir/<project_name>-<timestamp>/` and what lives in it:
//! `plan.json` (the resolved plan), `train_log.jsonl`, and the saved model folders
//! (`epoch-0001/`, `final/`, `interrupted-step-000123/`).

use std::path::{Path, PathBuf};

use anyhow::Context;

#[derive(Debug, Clone)]
pub struct RunDir {
    pub path: PathBuf,
}

impl RunDir {
    /// Creates `output_dir/<project>-<YYYYmmdd-HHMMSS>`, adding `-2`, `-3`, … when two runs start
    /// in the same second.
    pub fn create(output_dir: &Path, project: &str) -> anyhow::Result<Self> {
        let stamp = chrono::Local::now().format("%Y%m%d-%H%M%S");
        std::fs::create_dir_all(output_dir)
            .with_context(|| format!("cannot create output_dir {}", output_dir.display()))?;
        for n in 1.. {
            let name = if n == 1 {
                format!("{project}-{stamp}")
            } else {
                format!("{project}-{stamp}-{n}")
            };
            let path = output_dir.join(name);
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
        self.path.join(format!("epoch-{epoch:04}"))
    }

    pub fn final_dir(&self) -> PathBuf {
        self.path.join("final")
    }

    pub fn interrupted_dir(&self, step: usize) -> PathBuf {
        self.path.join(format!("interrupted-step-{step:06}"))
    }
}
