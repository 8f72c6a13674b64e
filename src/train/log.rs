//! The run's JSON-lines log (`train_log.jsonl`): one object per logged optimizer step with step,
//! epoch, loss, lr, grad norm, wall time and memory. Each line is flushed as written, so a killed run
//! keeps its log.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::memory::MemoryUsage;

#[derive(Debug, Clone, Serialize)]
pub struct LogRecord {
    pub step: usize,
    pub epoch: usize,
    pub loss: f64,
    pub lr_unet: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr_text_encoder: Option<f64>,
    pub grad_norm: f64,
    pub images: usize,
    pub time_s: f64,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub skipped_nonfinite: bool,
    /// fp16's loss scale after this step (absent in bf16 and f32, which do not scale).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// The micro-batch size in force, once an out-of-memory retry has changed it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub micro_batch: Option<usize>,
    /// Out-of-memory retries in the run so far.
    #[serde(skip_serializing_if = "is_zero")]
    pub oom_retries: usize,
    /// The validation loss, on steps where it was computed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// Memory in use and the run's peak so far: the CUDA pool (plus the card's free/total) on
    /// CUDA, the process's RSS on the CPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryUsage>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

pub struct JsonlLog {
    path: PathBuf,
    out: BufWriter<File>,
}

impl JsonlLog {
    pub fn create(path: &Path) -> std::io::Result<Self> {
        let file = File::create(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            out: BufWriter::new(file),
        })
    }

    /// Opens the log of a run resumed after `steps` steps: records of later steps (made after
    /// the save point, then lost with the run) are dropped, and new records are appended.
    pub fn resume(path: &Path, steps: usize) -> std::io::Result<Self> {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let kept: String = text
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["step"].as_u64())
                    .is_some_and(|s| s as usize <= steps)
            })
            .map(|l| format!("{l}\n"))
            .collect();
        crate::fsutil::write_atomic(path, kept).map_err(std::io::Error::other)?;
        let file = std::fs::OpenOptions::new().append(true).open(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            out: BufWriter::new(file),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn write(&mut self, record: &LogRecord) -> std::io::Result<()> {
        serde_json::to_writer(&mut self.out, record)?;
        self.out.write_all(b"\n")?;
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_log_drops_the_steps_after_the_save_point() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("train_log.jsonl");
        let lines: String = (1..=5).map(|s| format!("{{\"step\":{s}}}\n")).collect();
        std::fs::write(&path, lines).unwrap();
        let mut log = JsonlLog::resume(&path, 3).unwrap();
        log.out.write_all(b"{\"step\":4}\n").unwrap();
        log.out.flush().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            "{\"step\":1}\n{\"step\":2}\n{\"step\":3}\n{\"step\":4}\n"
        );
    }
}
