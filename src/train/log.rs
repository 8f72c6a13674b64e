//! The run's JSON-lines log (`train_log.jsonl`): one object per logged optimizer step with step,
//! epoch, loss, lr, grad norm, wall time and memory. Each line is flushed as written, so a killed run
//! keeps its log. [`tensorboard_scalars`] names the same numbers for TensorBoard. [`RunLog`]
//! holds both for a run, with the record of a step `log_step` skipped until a save needs it.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Serialize;

use crate::memory::{MemoryUsage, WatchEvent};
use crate::tensorboard::EventWriter;

#[derive(Debug, Clone, Serialize)]
pub struct LogRecord {
    pub step: usize,
    pub epoch: usize,
    pub loss: f64,
    /// Absent when the UNet does not train (`disable_unet_training`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr_unet: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr_text_encoder: Option<f64>,
    /// The step's gradient norm; absent when optimizer.json's `log_grad_norm` is false.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// Images seen in the run so far.
    pub images: usize,
    /// This step's images over its wall time.
    pub images_per_s: f64,
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
    /// The other validation sets' losses by name (EveryDream2's `extra_manual_datasets`,
    /// `stabilize-train`, and `_all_val_combined`), on steps where they were computed.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub val_sets: std::collections::BTreeMap<String, f64>,
    /// The learning-rate-free optimizers' estimates after the step, `<group>/<name>` (Prodigy's
    /// and D-Adaptation's `unet/d`, …).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub estimates: std::collections::BTreeMap<String, f64>,
    /// Memory in use and the run's peak so far: the CUDA pool (plus the card's free/total) on
    /// CUDA, the process's RSS on the CPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryUsage>,
    /// A memory creep or a slow step seen at this step (`memory::watch`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<WatchEvent>,
    /// `scale_weight_norms`' pass after this step's update (kohya's three numbers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_norm: Option<crate::adapter::max_norm::MaxNormStats>,
}

const MIB: f64 = 1024.0 * 1024.0;

/// A record's TensorBoard scalars: `loss`, `lr/<group>` for each optimizer group (`lr/unet`,
/// `lr/text_encoder`), `grad_norm`, `images_per_s`, `memory/in_use_mib` and `memory/peak_mib`
/// (the CUDA pool, or the process's RSS on the CPU) and `memory/device_free_mib` (CUDA), and,
/// when the step has them, `loss_scale` (fp16), `val_loss`, and each warning's
/// `warnings/memory_creep_mib_per_step` or `warnings/slow_step_s`.
pub fn tensorboard_scalars(r: &LogRecord) -> Vec<(String, f64)> {
    let mut s = vec![("loss".to_string(), r.loss)];
    if let Some(lr) = r.lr_unet {
        s.push(("lr/unet".into(), lr));
    }
    if let Some(lr) = r.lr_text_encoder {
        s.push(("lr/text_encoder".into(), lr));
    }
    if let Some(norm) = r.grad_norm {
        s.push(("grad_norm".into(), norm));
    }
    s.push(("images_per_s".into(), r.images_per_s));
    if let Some(scale) = r.loss_scale {
        s.push(("loss_scale".into(), scale));
    }
    if let Some(v) = r.val_loss {
        s.push(("val_loss".into(), v));
    }
    for (name, v) in &r.val_sets {
        s.push((format!("val_loss/{name}"), *v));
    }
    for (name, v) in &r.estimates {
        s.push((format!("estimate/{name}"), *v));
    }
    if let Some(m) = &r.max_norm {
        s.push(("max_norm/keys_scaled".into(), m.keys_scaled as f64));
        s.push(("max_norm/average_key_norm".into(), m.average_key_norm));
        s.push(("max_norm/max_key_norm".into(), m.max_key_norm));
    }
    for w in &r.warnings {
        let (tag, v) = w.scalar();
        s.push((tag.to_string(), v));
    }
    if let Some(m) = &r.memory {
        s.push(("memory/in_use_mib".into(), m.in_use_bytes as f64 / MIB));
        s.push(("memory/peak_mib".into(), m.peak_bytes as f64 / MIB));
        if let Some(free) = m.device_free_bytes {
            s.push(("memory/device_free_mib".into(), free as f64 / MIB));
        }
    }
    s
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

/// A run's logs: the JSON-lines file, TensorBoard events when on, and the last step's record
/// while `log_step` holds it back.
pub struct RunLog {
    jsonl: JsonlLog,
    /// TensorBoard event files beside the log (`log_with`); `None` when off. Anything may add to
    /// them, e.g. sample images with [`EventWriter::add_image_png`].
    pub tensorboard: Option<EventWriter>,
    /// The last step's record when `log_step` skipped it, until a save writes it.
    held: Option<LogRecord>,
}

impl RunLog {
    /// The logs in `dir`: new, or continued after `resumed_steps` (later records dropped).
    pub fn open(
        dir: &Path,
        tensorboard: bool,
        resumed_steps: Option<usize>,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let path = dir.join("train_log.jsonl");
        let jsonl = match resumed_steps {
            Some(steps) => JsonlLog::resume(&path, steps)?,
            None => JsonlLog::create(&path)?,
        };
        let tensorboard = match (tensorboard, resumed_steps) {
            (false, _) => None,
            (true, Some(steps)) => Some(EventWriter::resume(dir, steps)?),
            (true, None) => Some(EventWriter::create(dir)?),
        };
        Ok(Self {
            jsonl,
            tensorboard,
            held: None,
        })
    }

    /// Writes `record` now, dropping any held one (an earlier step's).
    pub fn write(&mut self, record: &LogRecord) -> anyhow::Result<()> {
        self.held = None;
        self.jsonl
            .write(record)
            .with_context(|| format!("writing {}", self.jsonl.path().display()))?;
        if let Some(tb) = &mut self.tensorboard {
            tb.add_scalars(record.step, &tensorboard_scalars(record))?;
        }
        Ok(())
    }

    /// Holds `record` back: written if a save comes before the next logged step, so the log
    /// then holds every step a save holds.
    pub fn hold(&mut self, record: LogRecord) {
        self.held = Some(record);
    }

    /// Writes the held record, if any.
    pub fn write_held(&mut self) -> anyhow::Result<()> {
        match self.held.take() {
            Some(record) => self.write(&record),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemorySource;

    fn record() -> LogRecord {
        LogRecord {
            step: 3,
            epoch: 1,
            loss: 0.5,
            lr_unet: Some(1e-4),
            lr_text_encoder: None,
            grad_norm: Some(2.0),
            images: 6,
            images_per_s: 4.0,
            time_s: 1.0,
            skipped_nonfinite: false,
            loss_scale: None,
            micro_batch: None,
            oom_retries: 0,
            val_loss: None,
            val_sets: Default::default(),
            estimates: Default::default(),
            memory: None,
            warnings: Vec::new(),
            max_norm: None,
        }
    }

    fn tags(r: &LogRecord) -> Vec<String> {
        tensorboard_scalars(r).into_iter().map(|(t, _)| t).collect()
    }

    #[test]
    fn estimates_are_logged_under_their_group() {
        let mut r = record();
        r.estimates.insert("unet/d".into(), 2e-6);
        assert!(tensorboard_scalars(&r).contains(&("estimate/unet/d".to_string(), 2e-6)));
        let line = serde_json::to_string(&r).unwrap();
        assert!(line.contains("\"estimates\":{\"unet/d\":2e-6}"), "{line}");
        assert!(!serde_json::to_string(&record())
            .unwrap()
            .contains("estimates"));
    }

    /// kohya's max-norm tags, on steps that have them only.
    #[test]
    fn max_norm_numbers_get_kohyas_tags() {
        assert!(!tags(&record()).iter().any(|t| t.starts_with("max_norm/")));
        let r = LogRecord {
            max_norm: Some(crate::adapter::max_norm::MaxNormStats {
                keys_scaled: 3,
                average_key_norm: 0.5,
                max_key_norm: 1.0,
            }),
            ..record()
        };
        let s = tensorboard_scalars(&r);
        for (tag, v) in [
            ("max_norm/keys_scaled", 3.0),
            ("max_norm/average_key_norm", 0.5),
            ("max_norm/max_key_norm", 1.0),
        ] {
            assert!(s.contains(&(tag.to_string(), v)), "{s:?}");
        }
        let line = serde_json::to_string(&r).unwrap();
        assert!(line.contains(r#""max_norm":{"keys_scaled":3"#), "{line}");
    }

    #[test]
    fn log_grad_norm_false_leaves_the_norm_out() {
        let r = LogRecord {
            grad_norm: None,
            ..record()
        };
        assert!(!tags(&r).contains(&"grad_norm".to_string()));
        let line = serde_json::to_string(&r).unwrap();
        assert!(!line.contains("grad_norm"), "{line}");
        assert!(serde_json::to_string(&record())
            .unwrap()
            .contains("\"grad_norm\":2.0"));
    }

    #[test]
    fn tensorboard_scalars_of_a_plain_step() {
        assert_eq!(
            tensorboard_scalars(&record()),
            [
                ("loss".to_string(), 0.5),
                ("lr/unet".to_string(), 1e-4),
                ("grad_norm".to_string(), 2.0),
                ("images_per_s".to_string(), 4.0),
            ]
        );
    }

    /// The optional numbers appear exactly when the record has them, memory in MiB.
    #[test]
    fn tensorboard_scalars_with_everything() {
        let mut r = record();
        r.lr_text_encoder = Some(5e-5);
        r.loss_scale = Some(65536.0);
        r.val_loss = Some(0.25);
        r.memory = Some(MemoryUsage {
            source: MemorySource::CudaPool,
            in_use_bytes: 3 << 20,
            peak_bytes: 5 << 20,
            device_free_bytes: Some(7 << 20),
            device_total_bytes: Some(8 << 20),
        });
        r.warnings = vec![WatchEvent::SlowStep {
            step: 3,
            secs: 2.5,
            expected_secs: 0.5,
            in_use_mib: Some(3.0),
            last_warning: false,
        }];
        let s = tensorboard_scalars(&r);
        assert_eq!(
            tags(&r),
            [
                "loss",
                "lr/unet",
                "lr/text_encoder",
                "grad_norm",
                "images_per_s",
                "loss_scale",
                "val_loss",
                "warnings/slow_step_s",
                "memory/in_use_mib",
                "memory/peak_mib",
                "memory/device_free_mib"
            ]
        );
        let values: Vec<f64> = s.iter().map(|(_, v)| *v).collect();
        assert_eq!(
            values,
            [0.5, 1e-4, 5e-5, 2.0, 4.0, 65536.0, 0.25, 2.5, 3.0, 5.0, 7.0]
        );
    }

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
