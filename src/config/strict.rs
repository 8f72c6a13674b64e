//! Strict parsing shared by train.json and optimizer.json, run on the JSON value before the serde
//! mirror structs parse it, so that each mistake gets a specific message:
//!
//! 1. a key that is neither known nor known-but-unsupported is an error with a did-you-mean
//!    suggestion (strsim);
//! 2. a known-but-unsupported EveryDream2 key is an error, unless its value asks for what sdtrain
//!    does anyway (`"gradient_checkpointing": false`), in which case the key is dropped;
//! 3. a wrong type is found by parsing each key alone, so the error names the field (serde_json's
//!    own message on a `Value` names neither field nor line).
//!
//! The known keys come from serializing the mirror struct's `Default`, so the struct is the one
//! list of keys.

use std::collections::HashMap;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{Map, Value};

use super::error::{ConfigError, UnsupportedKey};

/// The values of a known-but-unsupported key that are accepted, because they ask for what sdtrain
/// does anyway.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Accepts {
    Null,
    NullOrFalse,
    NullOrStr(&'static str),
    /// Any value: a key EveryDream2 itself no longer reads (its shipped configs still hold it),
    /// dropped with a warning.
    Obsolete,
}

impl Accepts {
    fn matches(self, value: &Value) -> bool {
        match (self, value) {
            (_, Value::Null) | (Accepts::Obsolete, _) => true,
            (Accepts::NullOrFalse, Value::Bool(b)) => !b,
            (Accepts::NullOrStr(s), Value::String(v)) => v == s,
            _ => false,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Accepts::Null => "null",
            Accepts::NullOrFalse => "false",
            Accepts::NullOrStr(s) => s,
            Accepts::Obsolete => "anything",
        }
    }
}

/// An EveryDream2 key sdtrain knows but does not implement yet.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unsupported {
    pub key: &'static str,
    pub accepts: Accepts,
    pub reason: &'static str,
}

/// The keys of the serde mirror struct `T`: the fields of its serialized `Default`.
pub(crate) fn known_keys<T: Default + Serialize>() -> Vec<String> {
    match serde_json::to_value(T::default()) {
        Ok(Value::Object(map)) => map.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

/// The closest candidate to `key`, if one is close enough to be a likely typo.
pub(crate) fn suggest<'a>(
    key: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<String> {
    let key = key.to_ascii_lowercase();
    candidates
        .into_iter()
        .map(|c| (strsim::jaro_winkler(&key, c), c))
        .filter(|(score, _)| *score >= 0.85)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, c)| c.to_string())
}

/// Where the keys of one JSON object sit: the file, the dotted prefix of the object, and which
/// top-level keys came from `--set` (key → the argument).
pub(crate) struct Section<'a> {
    pub file: &'a Path,
    pub prefix: &'a str,
    pub set_args: &'a HashMap<String, String>,
}

impl Section<'_> {
    pub fn path_of(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.prefix)
        }
    }

    fn set_arg(&self, key: &str) -> Option<String> {
        let top = self.path_of(key);
        let top = top.split('.').next().unwrap_or_default();
        self.set_args.get(top).cloned()
    }

    /// Rejects a key that is neither in `known` nor in `unsupported`. `misplaced` may say where a
    /// key belongs instead (an optimizer key written in train.json).
    pub fn check_unknown(
        &self,
        obj: &Map<String, Value>,
        known: &[String],
        unsupported: &[Unsupported],
        misplaced: impl Fn(&str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        let is_known =
            |k: &str| known.iter().any(|c| c == k) || unsupported.iter().any(|u| u.key == k);
        let Some(key) = obj.keys().find(|k| !is_known(k)) else {
            return Ok(());
        };
        let candidates = known
            .iter()
            .map(String::as_str)
            .chain(unsupported.iter().map(|u| u.key));
        let hint = misplaced(key).or_else(|| {
            suggest(key, candidates).map(|s| format!("did you mean `{}`?", self.path_of(&s)))
        });
        Err(ConfigError::UnknownKey {
            file: self.file.to_path_buf(),
            key: self.path_of(key),
            set_arg: self.set_arg(key),
            hint,
        })
    }

    /// Drops the unsupported keys whose value is accepted, and returns the others.
    pub fn take_unsupported(
        &self,
        obj: &mut Map<String, Value>,
        unsupported: &[Unsupported],
    ) -> Vec<UnsupportedKey> {
        let mut rejected = Vec::new();
        for u in unsupported {
            let Some(value) = obj.remove(u.key) else {
                continue;
            };
            if matches!(u.accepts, Accepts::Obsolete) {
                crate::console::say(format_args!(
                    "warning: {}: `{}` {}; ignored",
                    self.file.display(),
                    self.path_of(u.key),
                    u.reason
                ));
            }
            if !u.accepts.matches(&value) {
                rejected.push(UnsupportedKey {
                    key: self.path_of(u.key),
                    reason: u.reason,
                    accepted: u.accepts.describe(),
                });
            }
        }
        rejected
    }

    /// Finds the field of `obj` that does not parse as its type in `T`, by parsing each key alone
    /// (every field of the mirror structs is optional, so a lone valid key always parses).
    pub fn type_error<T: DeserializeOwned>(&self, obj: &Map<String, Value>) -> Option<ConfigError> {
        obj.iter().find_map(|(key, value)| {
            let single = Map::from_iter([(key.clone(), value.clone())]);
            serde_json::from_value::<T>(Value::Object(single))
                .err()
                .map(|e| self.wrong_type(key, value, &e))
        })
    }

    pub fn wrong_type(&self, key: &str, value: &Value, err: &serde_json::Error) -> ConfigError {
        let mut message = wrong_type_message(&err.to_string(), value);
        if key == "data_root" && (value.is_array() || value.is_object()) {
            // EveryDream2's resolver forms (`data/resolver.py`).
            message.push_str(
                ": EveryDream2's list and `resolver` forms of data_root are not read; give one \
                 folder or one JSON dataset file (for several folders, kohya's dataset_config)",
            );
        }
        ConfigError::WrongType {
            file: self.file.to_path_buf(),
            field: self.path_of(key),
            message,
        }
    }
}

/// Rewrites serde's "invalid type: string \"4\", expected i64" as "expected an integer, found the
/// string \"4\"". Other messages (a wrong array length) pass through.
fn wrong_type_message(serde_msg: &str, value: &Value) -> String {
    let Some((_, expected)) = serde_msg
        .strip_prefix("invalid type: ")
        .and_then(|rest| rest.split_once(", expected "))
    else {
        return serde_msg.to_string();
    };
    let expected = match expected {
        "i64" | "u64" | "i32" | "u32" | "usize" => "an integer",
        "f64" | "f32" => "a number",
        "a boolean" => "true or false",
        "a sequence" => "an array",
        other if other.starts_with("struct ") || other == "a map" => "an object",
        other => other,
    };
    format!("expected {expected}, found {}", describe_value(value))
}

/// "the string \"4\"", "the number 4.5", "an array", … for error messages.
pub(crate) fn describe_value(value: &Value) -> String {
    match value {
        Value::Null => "null".to_string(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {s:?}"),
        Value::Array(_) => "an array".to_string(),
        Value::Object(_) => "an object".to_string(),
    }
}

/// Reads and parses a JSON file (UTF-8, or UTF-16 with a byte-order mark), with line and column
/// on a syntax error.
pub(crate) fn read_json(file: &Path) -> Result<Value, ConfigError> {
    use crate::text_file::{read_unicode, TextFileError};
    let text = read_unicode(file).map_err(|e| match e {
        TextFileError::Io { path, source } => ConfigError::Read { file: path, source },
        TextFileError::Encoding { path, reason } => ConfigError::Encoding { file: path, reason },
    })?;
    parse_json(&text, file)
}

/// Parses `text` (`file` names it in errors). A leading UTF-8 byte order mark, which Windows
/// editors write, is skipped.
pub(crate) fn parse_json(text: &str, file: &Path) -> Result<Value, ConfigError> {
    serde_json::from_str(crate::py_json::without_bom(text)).map_err(|e| ConfigError::Syntax {
        file: file.to_path_buf(),
        message: e
            .to_string()
            .split(" at line ")
            .next()
            .unwrap_or_default()
            .to_string(),
        line: e.line(),
        column: e.column(),
    })
}

/// The top-level object of a config file.
pub(crate) fn into_object(value: Value, file: &Path) -> Result<Map<String, Value>, ConfigError> {
    match value {
        Value::Object(map) => Ok(map),
        other => Err(ConfigError::NotAnObject {
            file: file.to_path_buf(),
            found: describe_value(&other),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggest_finds_typos() {
        let keys = ["batch_size", "grad_accum", "max_epochs", "data_root"];
        assert_eq!(suggest("bach_size", keys).as_deref(), Some("batch_size"));
        assert_eq!(suggest("max_epoch", keys).as_deref(), Some("max_epochs"));
        assert_eq!(suggest("Data_Root", keys).as_deref(), Some("data_root"));
        assert_eq!(suggest("colour", keys), None);
    }

    #[test]
    fn accepts_only_inert_values() {
        assert!(Accepts::NullOrFalse.matches(&Value::Bool(false)));
        assert!(!Accepts::NullOrFalse.matches(&Value::Bool(true)));
        assert!(Accepts::NullOrStr("sdp").matches(&serde_json::json!("sdp")));
        assert!(!Accepts::NullOrStr("sdp").matches(&serde_json::json!("xformers")));
        assert!(!Accepts::Null.matches(&serde_json::json!("sample_prompts.txt")));
    }

    #[test]
    fn wrong_type_message_is_plain() {
        let msg = wrong_type_message("invalid type: string \"4\", expected i64", &"4".into());
        assert_eq!(msg, "expected an integer, found the string \"4\"");
        let msg = wrong_type_message(
            "invalid type: integer `5`, expected struct GroupFile",
            &serde_json::json!(5),
        );
        assert_eq!(msg, "expected an object, found the number 5");
    }
}
