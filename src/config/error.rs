//! [`ConfigError`]: everything that can be wrong with train.json, optimizer.json or a `--set`
//! override. Every variant names the file (or the `--set` argument) and the field, so the message
//! alone tells the user what to edit. The CLI maps all of them to exit code 2.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// An error in the training configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {}", file.display())]
    Read {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Neither UTF-8 nor UTF-16 with a byte-order mark ([`crate::text_file`]).
    #[error("{} {reason}", file.display())]
    Encoding { file: PathBuf, reason: String },
    #[error("{} is not valid JSON: {message} (line {line}, column {column})", file.display())]
    Syntax {
        file: PathBuf,
        message: String,
        line: usize,
        column: usize,
    },
    #[error("{} is not valid TOML: {message}", file.display())]
    TomlSyntax { file: PathBuf, message: String },
    #[error("{}: the top level must be a JSON object, found {found}", file.display())]
    NotAnObject { file: PathBuf, found: String },
    #[error(
        "unknown key `{key}` in {}{}{}",
        file.display(),
        set_arg.as_ref().map(|a| format!(" (from --set {a})")).unwrap_or_default(),
        hint.as_ref().map(|h| format!("; {h}")).unwrap_or_default()
    )]
    UnknownKey {
        file: PathBuf,
        /// Dotted path of the key, e.g. `base.lr_sheduler`.
        key: String,
        /// The `--set` argument that introduced the key, when it came from the command line.
        set_arg: Option<String>,
        /// "did you mean `batch_size`?" or where the key belongs instead.
        hint: Option<String>,
    },
    #[error("{}:{}", file.display(), render_unsupported(entries))]
    Unsupported {
        file: PathBuf,
        entries: Vec<UnsupportedKey>,
    },
    #[error("`{field}` in {} has the wrong type: {message}", file.display())]
    WrongType {
        file: PathBuf,
        field: String,
        message: String,
    },
    /// A value of the right type that is out of range or not one of the allowed names.
    #[error("`{field}` in {} {message}", file.display())]
    Invalid {
        file: PathBuf,
        field: String,
        message: String,
    },
    #[error("`{field}` is missing from {}: {hint}", file.display())]
    Missing {
        file: PathBuf,
        field: &'static str,
        hint: &'static str,
    },
    #[error("{}", render_model_conflict(file, model, resume_ckpt, missing_at))]
    ModelConflict {
        file: PathBuf,
        model: String,
        resume_ckpt: String,
        /// Where `resume_ckpt` was looked for as a path when nothing is there; empty when it
        /// exists (then it can only mean a base model).
        missing_at: Vec<PathBuf>,
    },
    #[error("data_root `{}` {problem} (`data_root` in {})", path.display(), file.display())]
    DataRoot {
        file: PathBuf,
        path: PathBuf,
        problem: String,
    },
    #[error(
        "optimizer_config `{}` (in {}) was not found; looked for {}",
        written.display(),
        file.display(),
        tried.iter().map(|p| format!("`{}`", p.display())).collect::<Vec<_>>().join(" and ")
    )]
    OptimizerConfigNotFound {
        file: PathBuf,
        written: PathBuf,
        tried: Vec<PathBuf>,
    },
    #[error("--set `{arg}`: {reason}")]
    BadOverride { arg: String, reason: String },
    /// An [`ConfigError::Invalid`] or [`ConfigError::WrongType`] value given by `--set`.
    #[error("{}", render_from_set(arg, inner))]
    FromSet {
        arg: String,
        inner: Box<ConfigError>,
    },
}

fn render_from_set(arg: &str, inner: &ConfigError) -> String {
    match inner {
        ConfigError::Invalid { field, message, .. } => {
            format!("`{field}` from `--set {arg}` {message}")
        }
        ConfigError::WrongType { field, message, .. } => {
            format!("`{field}` from `--set {arg}` has the wrong type: {message}")
        }
        other => format!("{other} (after `--set {arg}`)"),
    }
}

/// `model` and `resume_ckpt` both set, `resume_ckpt` naming no run. When no such path exists
/// the user most likely meant a run folder and mistyped it, so that comes first.
fn render_model_conflict(
    file: &Path,
    model: &str,
    resume_ckpt: &str,
    missing_at: &[PathBuf],
) -> String {
    if missing_at.is_empty() {
        return format!(
            "{}: `model` is \"{model}\" but `resume_ckpt` (EveryDream2's name for the base model) \
             is \"{resume_ckpt}\"; give one of them",
            file.display()
        );
    }
    let looked: Vec<String> = missing_at
        .iter()
        .map(|p| format!("`{}`", p.display()))
        .collect();
    format!(
        "{}: `resume_ckpt` is \"{resume_ckpt}\", which does not exist (looked for {}). To resume \
         a run, give its run folder or one of its `state-step-NNNNNN` folders; as EveryDream2's \
         name for the base model it conflicts with `model` \"{model}\": give one of them",
        file.display(),
        looked.join(" and ")
    )
}

/// One EveryDream2 key that sdtrain knows but does not implement yet, with a value that would
/// change what training does.
#[derive(Debug, Clone, PartialEq)]
pub struct UnsupportedKey {
    /// Dotted path, e.g. `gradient_checkpointing` or `base.d0`.
    pub key: String,
    /// Why, and when it arrives.
    pub reason: &'static str,
    /// The values that are accepted because they ask for what sdtrain does anyway.
    pub accepted: &'static str,
}

fn render_unsupported(entries: &[UnsupportedKey]) -> String {
    let lines: Vec<String> = entries
        .iter()
        .map(|e| {
            format!(
                "`{}` is not supported yet: {}; remove it or set it to {}",
                e.key, e.reason, e.accepted
            )
        })
        .collect();
    match lines.as_slice() {
        [one] => format!(" {one}"),
        _ => format!("\n  {}", lines.join("\n  ")),
    }
}

impl ConfigError {
    /// A bad value that a `--set` argument gave is blamed on that argument, not on train.json
    /// (which may hold a good value): `` `lr` from `--set lr=-0.01` must be … ``.
    pub fn blame_set(self, train_path: &Path, set_args: &HashMap<String, String>) -> Self {
        let (file, field) = match &self {
            ConfigError::Invalid { file, field, .. }
            | ConfigError::WrongType { file, field, .. } => (file, field),
            _ => return self,
        };
        let top = field.split('.').next().unwrap_or_default();
        match set_args.get(top) {
            Some(arg) if file == train_path => ConfigError::FromSet {
                arg: arg.clone(),
                inner: Box::new(self),
            },
            _ => self,
        }
    }

    /// True when the user's configuration is at fault (exit code 2); false for an I/O failure
    /// other than a missing file.
    pub fn is_usage(&self) -> bool {
        match self {
            ConfigError::Read { source, .. } => source.kind() == std::io::ErrorKind::NotFound,
            ConfigError::Syntax { .. }
            | ConfigError::TomlSyntax { .. }
            | ConfigError::Encoding { .. }
            | ConfigError::NotAnObject { .. }
            | ConfigError::UnknownKey { .. }
            | ConfigError::Unsupported { .. }
            | ConfigError::WrongType { .. }
            | ConfigError::Invalid { .. }
            | ConfigError::Missing { .. }
            | ConfigError::ModelConflict { .. }
            | ConfigError::DataRoot { .. }
            | ConfigError::OptimizerConfigNotFound { .. }
            | ConfigError::BadOverride { .. }
            | ConfigError::FromSet { .. } => true,
        }
    }
}
