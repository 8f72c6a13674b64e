//! The sample keys of train.json (EveryDream2's `sample_prompts`, `sample_steps`,
//! `ema_sample_nonema_model`, `ema_sample_ema_model`) resolved into a [`SamplePlan`].
//!
//! - Sampling is on when `sample_prompts` names a file ([`crate::sample::prompts`]); it is read
//!   here, so a bad file stops the run before anything loads. A `.txt` that lists no prompts is
//!   refused: EveryDream2 would sample four random training captions instead, none of them from
//!   the file. A `.json` of settings alone keeps them (EveryDream2's way to ask for them), and the
//!   summary says where they come from.
//! - Every `sample_steps` steps (EveryDream2's default 250; kohya's `sample_every_n_steps`); the
//!   file's `generate_samples_every_n_steps` wins, as in EveryDream2. kohya's
//!   `sample_every_n_epochs` samples at the end of every N-th epoch instead, `sample_at_first`
//!   before the first step too (the file's `generate_pretrain_samples`), and `sample_sampler`
//!   sets the sampler of the prompts that name none (kohya's names, `k_euler_a`, …).
//! - With EMA on, `ema_sample_ema_model` samples the EMA weights too (files marked `ema`) and
//!   `ema_sample_nonema_model` the trained ones. When neither is set the trained weights are
//!   sampled (EveryDream2 samples nothing then).

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::error::ConfigError;
use super::train_file::TrainFile;
use crate::error_chain::chain_text;
use crate::sample::prompts::SampleSet;

/// EveryDream2's `--sample_steps` default.
pub const DEFAULT_SAMPLE_STEPS: usize = 250;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SamplePlan {
    pub prompts_file: PathBuf,
    pub every_n_steps: usize,
    /// kohya's `sample_every_n_epochs`: samples at the end of every N-th epoch, and none by
    /// steps (as kohya ignores its step count then).
    pub every_n_epochs: Option<usize>,
    /// Sample the trained weights.
    pub trained_model: bool,
    /// Sample the EMA weights.
    pub ema_model: bool,
    #[serde(skip)]
    pub set: SampleSet,
}

fn invalid(file: &Path, field: &str, message: String) -> ConfigError {
    ConfigError::Invalid {
        file: file.to_path_buf(),
        field: field.to_string(),
        message,
    }
}

/// The sample settings, or `None` when `sample_prompts` is unset. `input` resolves the file's
/// path as train.json's other inputs are.
pub fn resolve_samples(
    f: &TrainFile,
    file: &Path,
    ema_on: bool,
    input: impl Fn(&str, &str) -> Result<PathBuf, ConfigError>,
) -> Result<Option<SamplePlan>, ConfigError> {
    let nonema = f.ema_sample_nonema_model.unwrap_or(false);
    let ema = f.ema_sample_ema_model.unwrap_or(false);
    let Some(raw) = f.sample_prompts.as_deref() else {
        for (field, set) in [
            ("sample_steps", f.sample_steps.is_some()),
            ("sample_every_n_steps", f.sample_every_n_steps.is_some()),
            ("sample_every_n_epochs", f.sample_every_n_epochs.is_some()),
            ("sample_at_first", f.sample_at_first == Some(true)),
            ("sample_sampler", f.sample_sampler.is_some()),
            ("ema_sample_ema_model", ema),
            ("ema_sample_nonema_model", nonema),
        ] {
            if set {
                return Err(invalid(
                    file,
                    field,
                    "has no effect: sampling is off (set sample_prompts)".into(),
                ));
            }
        }
        return Ok(None);
    };
    if ema && !ema_on {
        return Err(invalid(
            file,
            "ema_sample_ema_model",
            "needs EMA on (set ema_decay_rate or ema_strength_target)".into(),
        ));
    }
    let (steps_key, steps) = match (f.sample_steps, f.sample_every_n_steps) {
        (Some(a), Some(b)) if a != b => {
            return Err(invalid(
                file,
                "sample_every_n_steps",
                format!(
                    "is {b} but sample_steps is {a}: kohya's sample_every_n_steps is \
                     EveryDream2's sample_steps; give one"
                ),
            ))
        }
        (Some(a), _) => ("sample_steps", Some(a)),
        (None, b) => ("sample_every_n_steps", b),
    };
    let every = match steps {
        Some(n) if n < 1 => {
            return Err(invalid(
                file,
                steps_key,
                format!("must be at least 1 (got {n})"),
            ))
        }
        Some(n) => n.unsigned_abs() as usize,
        None => DEFAULT_SAMPLE_STEPS,
    };
    let every_n_epochs = match f.sample_every_n_epochs {
        Some(n) if n < 1 => {
            return Err(invalid(
                file,
                "sample_every_n_epochs",
                format!("must be at least 1 (got {n})"),
            ))
        }
        Some(_) if steps.is_some() => {
            return Err(invalid(
                file,
                "sample_every_n_epochs",
                format!(
                    "is set beside {steps_key}: kohya samples by epochs then and ignores the \
                     step count; give one"
                ),
            ))
        }
        n => n.map(|n| n.unsigned_abs() as usize),
    };
    let path = input("sample_prompts", raw)?;
    let mut set =
        SampleSet::read(&path).map_err(|e| invalid(file, "sample_prompts", chain_text(&e)))?;
    if f.sample_at_first == Some(true) {
        set.at_start = true;
    }
    if let Some(name) = &f.sample_sampler {
        // The default of the prompts that name no sampler (kohya's `--ss` wins, as in kohya).
        set.sampler = crate::sample::kohya_prompts::sampler(name)
            .map_err(|m| invalid(file, "sample_sampler", m))?;
    }
    // A .txt is nothing but its prompts, so one without any is a mistake; a .json of settings
    // alone asks for EveryDream2's random captions, and the summary says so.
    let txt = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("txt"));
    if set.filled_in && txt {
        return Err(invalid(
            file,
            "sample_prompts",
            format!(
                "names {}, which holds no prompts; write one prompt per line (or use a .json \
                 file whose `samples` hold {{\"random_caption\": true}} to sample training \
                 captions)",
                path.display()
            ),
        ));
    }
    Ok(Some(SamplePlan {
        prompts_file: path,
        every_n_steps: set.every_n_steps.unwrap_or(every),
        every_n_epochs,
        trained_model: !ema || nonema,
        ema_model: ema,
        set,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(f: TrainFile, ema_on: bool) -> Result<Option<SamplePlan>, ConfigError> {
        resolve_samples(&f, Path::new("train.json"), ema_on, |_, p| {
            Ok(PathBuf::from(p))
        })
    }

    fn prompts_file(text: &str, ext: &str) -> (tempfile::TempDir, String) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(format!("p.{ext}"));
        std::fs::write(&p, text).unwrap();
        (dir, p.display().to_string())
    }

    #[test]
    fn off_without_a_file_and_keys_without_one_are_refused() {
        assert_eq!(resolve(TrainFile::default(), false).unwrap(), None);
        let f = TrainFile {
            sample_steps: Some(5),
            ..TrainFile::default()
        };
        let e = resolve(f, false).unwrap_err().to_string();
        assert!(
            e.contains("sample_steps") && e.contains("sampling is off"),
            "{e}"
        );
    }

    #[test]
    fn steps_default_and_the_file_wins() {
        let (_d, p) = prompts_file("a cat\n", "txt");
        let f = TrainFile {
            sample_prompts: Some(p),
            ..TrainFile::default()
        };
        let plan = resolve(f, false).unwrap().unwrap();
        assert_eq!(plan.every_n_steps, DEFAULT_SAMPLE_STEPS);
        assert!(plan.trained_model && !plan.ema_model);
        let (_d, p) = prompts_file(r#"{"generate_samples_every_n_steps": 3}"#, "json");
        let f = TrainFile {
            sample_prompts: Some(p),
            sample_steps: Some(10),
            ..TrainFile::default()
        };
        assert_eq!(resolve(f, false).unwrap().unwrap().every_n_steps, 3);
    }

    #[test]
    fn ema_choices() {
        let (_d, p) = prompts_file("a cat\n", "txt");
        let f = |ema, nonema| TrainFile {
            sample_prompts: Some(p.clone()),
            ema_sample_ema_model: Some(ema),
            ema_sample_nonema_model: Some(nonema),
            ..TrainFile::default()
        };
        let plan = resolve(f(true, false), true).unwrap().unwrap();
        assert!(plan.ema_model && !plan.trained_model);
        let plan = resolve(f(true, true), true).unwrap().unwrap();
        assert!(plan.ema_model && plan.trained_model);
        let e = resolve(f(true, false), false).unwrap_err().to_string();
        assert!(e.contains("needs EMA on"), "{e}");
    }

    /// EveryDream2 stands in four random captions for a file without prompts. A .txt without
    /// any is refused; a .json of settings alone keeps them, marked as such.
    #[test]
    fn a_txt_without_prompts_is_refused() {
        let (_d, p) = prompts_file("\n  \n", "txt");
        let f = TrainFile {
            sample_prompts: Some(p.clone()),
            ..TrainFile::default()
        };
        let e = resolve(f, false).unwrap_err().to_string();
        assert!(e.contains(&p) && e.contains("holds no prompts"), "{e}");
        let (_d, p) = prompts_file(r#"{"cfgs": [7]}"#, "json");
        let f = TrainFile {
            sample_prompts: Some(p),
            ..TrainFile::default()
        };
        assert!(resolve(f, false).unwrap().unwrap().set.filled_in);
    }

    #[test]
    fn a_bad_file_names_itself_and_the_key() {
        let (_d, p) = prompts_file(r#"{"cfgs": "x"}"#, "json");
        let f = TrainFile {
            sample_prompts: Some(p),
            ..TrainFile::default()
        };
        let e = resolve(f, false).unwrap_err().to_string();
        assert!(
            e.contains("sample_prompts") && e.contains("p.json") && e.contains("`cfgs`"),
            "{e}"
        );
    }
}
