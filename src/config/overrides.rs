//! `--set key.path=value` overrides, applied to train.json's JSON value before the strict parse,
//! so an overridden key goes through exactly the checks a key written in the file does.
//!
//! The value is parsed as JSON when it parses (`lr=1e-5` is a number, `shuffle_tags=true` a
//! boolean, `min_snr_gamma=null` unsets), else taken as a string (`project_name=foo`). To force a
//! string that looks like JSON, quote it: `--set 'project_name="true"'`. A dotted path walks into
//! nested objects, creating them when absent.

use std::collections::HashMap;

use serde_json::{Map, Value};

use super::error::ConfigError;

/// One parsed `--set` argument.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    /// The argument as given, for error messages.
    pub arg: String,
    /// The dotted key, split: `["optimizer_config"]`, `["a", "b"]`.
    pub path: Vec<String>,
    pub value: Value,
}

impl Override {
    /// Parses `key.path=value`.
    pub fn parse(arg: &str) -> Result<Override, ConfigError> {
        let bad = |reason: &str| ConfigError::BadOverride {
            arg: arg.to_string(),
            reason: reason.to_string(),
        };
        let (key, raw) = arg
            .split_once('=')
            .ok_or_else(|| bad("expected KEY=VALUE, e.g. --set lr=1e-5"))?;
        let key = key.trim();
        if key.is_empty() {
            return Err(bad("the key before `=` is empty"));
        }
        let path: Vec<String> = key.split('.').map(str::to_string).collect();
        if path.iter().any(String::is_empty) {
            return Err(bad("the key has an empty part between dots"));
        }
        let value = serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string()));
        Ok(Override {
            arg: arg.to_string(),
            path,
            value,
        })
    }

    /// Sets the value at the path inside `root`, creating missing objects on the way.
    pub fn apply(&self, root: &mut Map<String, Value>) -> Result<(), ConfigError> {
        let Some((last, parents)) = self.path.split_last() else {
            return Ok(());
        };
        let mut node = root;
        for (depth, part) in parents.iter().enumerate() {
            let entry = node
                .entry(part.clone())
                .or_insert_with(|| Value::Object(Map::new()));
            node = match entry {
                Value::Object(map) => map,
                _ => {
                    return Err(ConfigError::BadOverride {
                        arg: self.arg.clone(),
                        reason: format!(
                            "`{}` is not an object, so it has no key `{}`",
                            self.path[..=depth].join("."),
                            self.path[depth + 1]
                        ),
                    })
                }
            };
        }
        node.insert(last.clone(), self.value.clone());
        Ok(())
    }
}

/// Parses and applies every override in order (a later one wins). Returns which top-level key
/// each argument touched, so an unknown-key error can say it came from `--set`.
pub fn apply_all(
    root: &mut Map<String, Value>,
    args: &[String],
) -> Result<HashMap<String, String>, ConfigError> {
    let mut origins = HashMap::new();
    for arg in args {
        let ovr = Override::parse(arg)?;
        ovr.apply(root)?;
        origins.insert(ovr.path[0].clone(), ovr.arg.clone());
    }
    Ok(origins)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn applied(start: Value, args: &[&str]) -> Result<Value, ConfigError> {
        let Value::Object(mut map) = start else {
            panic!("test input must be an object")
        };
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        apply_all(&mut map, &args)?;
        Ok(Value::Object(map))
    }

    #[test]
    fn values_parse_as_json_else_string() {
        let v = applied(
            json!({}),
            &[
                "lr=1e-5",
                "seed=7",
                "project_name=foo",
                "shuffle_tags=true",
                "min_snr_gamma=null",
                "betas=[0.9, 0.99]",
                "data_root=/data/my images",
                "quoted=\"true\"",
                "empty=",
            ],
        )
        .unwrap();
        assert_eq!(
            v,
            json!({
                "lr": 1e-5, "seed": 7, "project_name": "foo", "shuffle_tags": true,
                "min_snr_gamma": null, "betas": [0.9, 0.99], "data_root": "/data/my images",
                "quoted": "true", "empty": ""
            })
        );
    }

    #[test]
    fn later_override_wins_and_replaces_file_value() {
        let v = applied(json!({"lr": 1e-6}), &["lr=2e-6", "lr=3e-6"]).unwrap();
        assert_eq!(v, json!({"lr": 3e-6}));
    }

    #[test]
    fn value_may_contain_equals() {
        let v = applied(json!({}), &["project_name=a=b"]).unwrap();
        assert_eq!(v, json!({"project_name": "a=b"}));
    }

    #[test]
    fn dotted_paths_create_and_walk_objects() {
        let v = applied(json!({"a": {"x": 1}}), &["a.b=2", "c.d.e=3"]).unwrap();
        assert_eq!(v, json!({"a": {"x": 1, "b": 2}, "c": {"d": {"e": 3}}}));
    }

    #[test]
    fn malformed_overrides_are_rejected() {
        for bad in ["lr", "=1", "a..b=1", ".a=1"] {
            let err = applied(json!({}), &[bad]).unwrap_err();
            assert!(
                matches!(err, ConfigError::BadOverride { .. }),
                "{bad}: {err}"
            );
        }
        let err = applied(json!({"lr": 1.0}), &["lr.x=1"]).unwrap_err();
        assert!(err.to_string().contains("`lr` is not an object"), "{err}");
    }

    #[test]
    fn origins_name_the_top_level_key() {
        let mut map = Map::new();
        let origins = apply_all(&mut map, &["a.b=1".to_string()]).unwrap();
        assert_eq!(origins.get("a").map(String::as_str), Some("a.b=1"));
    }
}
