//! The EMA keys of train.json (EveryDream2's `ema_decay_rate`, `ema_strength_target`,
//! `ema_update_interval`, `ema_device`) resolved into an [`EmaPlan`]. EMA is on when
//! `ema_decay_rate` or `ema_strength_target` is set (EveryDream2's `use_ema_dacay_training`);
//! the target, when set, decides the decay from the run's length ([`decay_for`]).

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::ConfigError;
use super::train_file::TrainFile;

/// EveryDream2's `--ema_update_interval` default.
pub const DEFAULT_EMA_UPDATE_INTERVAL: usize = 500;

/// How the decay is given.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EmaDecay {
    /// `ema_decay_rate`: the decay per update.
    Rate(f64),
    /// `ema_strength_target`: the starting weights' share at the end of the run; the decay is
    /// `target^(interval / total_steps)`.
    StrengthTarget(f64),
}

/// Where the EMA copy lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EmaDevice {
    /// Host memory (EveryDream2's default): no VRAM, a device→host copy per update.
    Cpu,
    /// The training device (`"cuda"` or `"device"`).
    Training,
}

/// The resolved EMA settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EmaPlan {
    pub decay: EmaDecay,
    pub update_interval: usize,
    pub device: EmaDevice,
    /// `ema_decay_warmup` (OneTrainer's): the decay after k optimizer steps is
    /// `min(k/(9 + k), decay)`.
    #[serde(default)]
    pub warmup: bool,
}

impl EmaPlan {
    /// The decay per update for a run of `total_steps` steps.
    pub fn decay_for_run(&self, total_steps: usize) -> f64 {
        match self.decay {
            EmaDecay::Rate(d) => d,
            EmaDecay::StrengthTarget(t) => decay_for(t, self.update_interval, total_steps.max(1)),
        }
    }
}

/// The decay that leaves the starting weights a share `strength_target` after `total_steps`
/// steps updated every `interval`: `strength_target^(interval / total_steps)` (EveryDream2
/// computes `t ** (1 / (total_steps / interval))`).
fn decay_for(strength_target: f64, interval: usize, total_steps: usize) -> f64 {
    let updates = total_steps as f64 / interval as f64;
    strength_target.powf(1.0 / updates)
}

fn invalid(file: &Path, field: &str, message: String) -> ConfigError {
    ConfigError::Invalid {
        file: file.to_path_buf(),
        field: field.to_string(),
        message,
    }
}

/// A number strictly between 0 and 1.
fn open_fraction(file: &Path, field: &str, v: Option<f64>) -> Result<Option<f64>, ConfigError> {
    match v {
        Some(x) if !(x > 0.0 && x < 1.0) => Err(invalid(
            file,
            field,
            format!("must be between 0 and 1, both excluded (got {x})"),
        )),
        _ => Ok(v),
    }
}

/// The EMA settings, or `None` when EMA is off. `ema_update_interval` or `ema_device` without
/// a decay would do nothing, and is refused rather than ignored.
pub fn resolve_ema(f: &TrainFile, file: &Path) -> Result<Option<EmaPlan>, ConfigError> {
    let rate = open_fraction(file, "ema_decay_rate", f.ema_decay_rate)?;
    let target = open_fraction(file, "ema_strength_target", f.ema_strength_target)?;
    let update_interval = match f.ema_update_interval {
        Some(n) if n < 1 => {
            return Err(invalid(
                file,
                "ema_update_interval",
                format!("must be at least 1 (got {n})"),
            ))
        }
        Some(n) => n.unsigned_abs() as usize,
        None => DEFAULT_EMA_UPDATE_INTERVAL,
    };
    let device = match f.ema_device.as_deref() {
        None | Some("cpu") => EmaDevice::Cpu,
        Some("cuda" | "device") => EmaDevice::Training,
        Some(other) => {
            return Err(invalid(
                file,
                "ema_device",
                format!("must be \"cpu\", \"cuda\" or \"device\" (got {other:?})"),
            ))
        }
    };
    let decay = match (target, rate) {
        (Some(t), _) => EmaDecay::StrengthTarget(t),
        (None, Some(d)) => EmaDecay::Rate(d),
        (None, None) => {
            for (field, set) in [
                ("ema_update_interval", f.ema_update_interval.is_some()),
                ("ema_device", f.ema_device.is_some()),
                ("ema_decay_warmup", f.ema_decay_warmup == Some(true)),
            ] {
                if set {
                    return Err(invalid(
                        file,
                        field,
                        "has no effect: EMA is off (set ema_decay_rate or ema_strength_target)"
                            .into(),
                    ));
                }
            }
            return Ok(None);
        }
    };
    Ok(Some(EmaPlan {
        decay,
        update_interval,
        device,
        warmup: f.ema_decay_warmup.unwrap_or(false),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(f: TrainFile) -> Result<Option<EmaPlan>, ConfigError> {
        resolve_ema(&f, Path::new("train.json"))
    }

    fn field_of(e: ConfigError) -> String {
        match e {
            ConfigError::Invalid { field, .. } => field,
            other => panic!("{other}"),
        }
    }

    #[test]
    fn off_unless_a_decay_is_set() {
        assert_eq!(resolve(TrainFile::default()).unwrap(), None);
        let plan = resolve(TrainFile {
            ema_decay_rate: Some(0.999),
            ..Default::default()
        })
        .unwrap()
        .unwrap();
        assert_eq!(plan.decay, EmaDecay::Rate(0.999));
        assert_eq!(plan.update_interval, DEFAULT_EMA_UPDATE_INTERVAL);
        assert_eq!(plan.device, EmaDevice::Cpu);
    }

    /// EveryDream2: the target overrides the rate; the decay comes from the run's length.
    #[test]
    fn strength_target_overrides_the_rate() {
        let plan = resolve(TrainFile {
            ema_decay_rate: Some(0.9),
            ema_strength_target: Some(0.5),
            ema_update_interval: Some(10),
            ema_device: Some("cuda".into()),
            ..Default::default()
        })
        .unwrap()
        .unwrap();
        assert_eq!(plan.decay, EmaDecay::StrengthTarget(0.5));
        assert_eq!(plan.device, EmaDevice::Training);
        assert!((plan.decay_for_run(1000) - 0.5f64.powf(0.01)).abs() < 1e-15);
    }

    /// 0.5^(10/1000) and 0.25^(1/2): catches an inverted exponent (`updates` instead of
    /// `1 / updates`) or the interval ignored.
    #[test]
    fn strength_target_decay() {
        let d = decay_for(0.5, 10, 1000);
        assert!((d - 0.993_092_495_437_035_9).abs() < 1e-15, "{d}");
        assert!((decay_for(0.25, 1, 2) - 0.5).abs() < 1e-15);
        // The start's share after the run's updates is the target.
        assert!((d.powi(100) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn ranges_are_checked() {
        for (f, field) in [
            (
                TrainFile {
                    ema_decay_rate: Some(1.0),
                    ..Default::default()
                },
                "ema_decay_rate",
            ),
            (
                TrainFile {
                    ema_strength_target: Some(0.0),
                    ..Default::default()
                },
                "ema_strength_target",
            ),
            (
                TrainFile {
                    ema_decay_rate: Some(0.9),
                    ema_update_interval: Some(0),
                    ..Default::default()
                },
                "ema_update_interval",
            ),
            (
                TrainFile {
                    ema_decay_rate: Some(0.9),
                    ema_device: Some("gpu".into()),
                    ..Default::default()
                },
                "ema_device",
            ),
            (
                TrainFile {
                    ema_update_interval: Some(5),
                    ..Default::default()
                },
                "ema_update_interval",
            ),
        ] {
            assert_eq!(field_of(resolve(f).unwrap_err()), field);
        }
    }
}
