//! [`Ctx`]: the train.json being resolved, as the resolve functions of the plan's sections see
//! it: their error constructor, the common range checks, and where relative paths point.
//!
//! - inputs (`data_root`, `optimizer_config`, a local `model`, …) are looked up beside train.json
//!   first, then in the working directory (EveryDream2 only uses the working directory);
//! - outputs (`output_dir`, `logdir`) are relative to the working directory.

use std::path::{Path, PathBuf};

use super::error::ConfigError;

/// The file being resolved, for error messages and relative paths.
pub(super) struct Ctx<'a> {
    pub file: &'a Path,
    /// train.json's folder ("" when it has none).
    pub dir: PathBuf,
}

impl<'a> Ctx<'a> {
    pub fn new(file: &'a Path) -> Self {
        Ctx {
            file,
            dir: file.parent().unwrap_or(Path::new("")).to_path_buf(),
        }
    }

    pub fn invalid(&self, field: &str, message: String) -> ConfigError {
        ConfigError::Invalid {
            file: self.file.to_path_buf(),
            field: field.to_string(),
            message,
        }
    }

    pub fn opt_at_least(
        &self,
        field: &str,
        v: Option<i64>,
        min: i64,
    ) -> Result<Option<u64>, ConfigError> {
        match v {
            Some(n) if n < min => {
                Err(self.invalid(field, format!("must be at least {min} (got {n})")))
            }
            _ => Ok(v.map(i64::unsigned_abs)),
        }
    }

    pub fn at_least(
        &self,
        field: &str,
        v: Option<i64>,
        default: u64,
        min: i64,
    ) -> Result<u64, ConfigError> {
        Ok(self.opt_at_least(field, v, min)?.unwrap_or(default))
    }

    pub fn fraction(&self, field: &str, v: Option<f64>, default: f64) -> Result<f64, ConfigError> {
        match v {
            Some(x) if !(0.0..=1.0).contains(&x) => {
                Err(self.invalid(field, format!("must be between 0 and 1 (got {x})")))
            }
            _ => Ok(v.unwrap_or(default)),
        }
    }

    /// `v` when it is finite and above 0, else "must be {allowed} (got …)".
    pub fn opt_positive(
        &self,
        field: &str,
        v: Option<f64>,
        allowed: &str,
    ) -> Result<Option<f64>, ConfigError> {
        match v {
            Some(x) if !(x.is_finite() && x > 0.0) => {
                Err(self.invalid(field, format!("must be {allowed} (got {x})")))
            }
            x => Ok(x),
        }
    }

    /// An input path: beside train.json when it exists there, else relative to the working
    /// directory. Returned absolute.
    pub fn input_path(&self, field: &str, raw: &str) -> Result<PathBuf, ConfigError> {
        let candidates = self.input_candidates(raw);
        let found = candidates.iter().find(|p| p.exists()).or(candidates.last());
        self.absolute(field, found.map_or(Path::new(raw), PathBuf::as_path))
    }

    /// Where an input path is looked for, in order (one entry for an absolute path).
    pub fn input_candidates(&self, raw: &str) -> Vec<PathBuf> {
        let path = Path::new(raw);
        if path.is_absolute() || self.dir.as_os_str().is_empty() {
            vec![path.to_path_buf()]
        } else {
            vec![self.dir.join(path), path.to_path_buf()]
        }
    }

    pub fn output_path(&self, field: &str, raw: &str) -> Result<PathBuf, ConfigError> {
        self.absolute(field, Path::new(raw))
    }

    pub fn absolute(&self, field: &str, path: &Path) -> Result<PathBuf, ConfigError> {
        std::path::absolute(path)
            .map_err(|e| self.invalid(field, format!("is not a usable path: {e}")))
    }
}
