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

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn write(&mut self, record: &LogRecord) -> std::io::Result<()> {
        serde_json::to_writer(&mut self.out, record)?;
        self.out.write_all(b"\n")?;
        self.out.flush()
    }
}
