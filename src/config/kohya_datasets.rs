//! A kohya config's dataset options (`super::kohya_config`): `train_data_dir`, `reg_data_dir`
//! and `in_json` made into datasets as kohya makes them without a `dataset_config`, and the
//! command line's dataset options (`resolution`, `train_batch_size`, `shuffle_caption`, …) as
//! the level under a dataset config's `[general]`, with kohya's defaults where train.json's
//! differ.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::error::ConfigError;
use super::kohya_config::{invalid, toml_of, Translation};
use super::kohya_config_keys::defaults;

/// `train_data_dir` (and `reg_data_dir`, `in_json`) as kohya makes datasets of them when
/// no `dataset_config` is given; the dataset options of the command line go to the level
/// under the dataset config.
pub(super) fn datasets(t: &mut Translation<'_>) -> Result<Vec<(String, toml::Table)>, ConfigError> {
    let train_dir = t.take_str("train_data_dir")?;
    let reg_dir = t.take_str("reg_data_dir")?;
    let in_json = t.take_str("in_json")?;
    // kohya's old spelling wins over the new one (`prepare_dataset_args`).
    if let Some(v) = t.take("caption_extention").as_ref().and_then(toml_of) {
        t.data.insert("caption_extension".into(), v);
    }
    if let Some(n) = t.take("dataset_repeats") {
        if let Some(v) = toml_of(&n) {
            t.data.insert("num_repeats".into(), v);
        }
    }
    if let Some(b) = t.take("train_batch_size") {
        if let Some(v) = toml_of(&b) {
            t.data.insert("batch_size".into(), v);
        }
    }
    if let Some(r) = t.take("resolution") {
        let v = resolution(&r).ok_or_else(|| {
            t.invalid(
                "resolution",
                format!("is {r}: give a size such as \"512\", \"512,512\" or 512"),
            )
        })?;
        t.data.insert("resolution".into(), v);
    }
    data_defaults(t);
    if t.train.contains_key("dataset_config") {
        return Ok(Vec::new());
    }
    let path = t.path;
    let base = path.parent().unwrap_or(Path::new("."));
    let dir = |raw: &str, key: &str| -> Result<PathBuf, ConfigError> {
        super::ctx::Ctx::new(path).input_path(key, raw).map(|p| {
            if p.exists() {
                p
            } else {
                base.join(raw)
            }
        })
    };
    let Some(train_raw) = train_dir else {
        return Err(ConfigError::Missing {
            file: path.to_path_buf(),
            field: "train_data_dir",
            hint: "a kohya config names its images with train_data_dir or dataset_config",
        });
    };
    let train = dir(&train_raw, "train_data_dir")?;
    if let Some(meta) = in_json {
        let mut sub = toml::Table::new();
        sub.insert("image_dir".into(), path_value(&train));
        let meta = dir(&meta, "in_json")?;
        sub.insert("metadata_file".into(), path_value(&meta));
        if reg_dir.is_some() {
            return Err(invalid(
                path,
                "reg_data_dir",
                "is a DreamBooth option; with in_json (fine-tuning) kohya reads no \
                 regularization images"
                    .into(),
            ));
        }
        return Ok(vec![("train_data_dir".into(), sub)]);
    }
    let mut subsets = dreambooth_subsets(&train, "train_data_dir", false, path)?;
    if let Some(reg) = reg_dir {
        let reg = dir(&reg, "reg_data_dir")?;
        subsets.extend(dreambooth_subsets(&reg, "reg_data_dir", true, path)?);
    }
    Ok(subsets)
}

/// kohya's defaults for the dataset options whose train.json counterparts differ.
fn data_defaults(t: &mut Translation<'_>) {
    let d = &mut t.data;
    let put = |d: &mut toml::Table, k: &str, v: toml::Value| {
        d.entry(k.to_string()).or_insert(v);
    };
    put(d, "caption_dropout_rate", toml::Value::Float(0.0));
    put(d, "flip_aug", toml::Value::Boolean(false));
    put(d, "shuffle_caption", toml::Value::Boolean(false));
    put(d, "keep_tokens", toml::Value::Integer(0));
    put(
        d,
        "caption_extension",
        toml::Value::String(defaults::CAPTION_EXTENSION.into()),
    );
    put(d, "enable_bucket", toml::Value::Boolean(false));
    put(d, "batch_size", toml::Value::Integer(1));
    if d.get("enable_bucket").and_then(toml::Value::as_bool) == Some(true) {
        for (k, v) in defaults::BUCKETS {
            put(d, k, toml::Value::Integer(v));
        }
    }
}

fn path_value(p: &Path) -> toml::Value {
    toml::Value::String(p.to_string_lossy().into_owned())
}

/// kohya's `resolution`: `"512"`, `"512,768"`, a number or a pair, as the dataset config's.
fn resolution(v: &Value) -> Option<toml::Value> {
    let ints = |parts: Vec<&str>| -> Option<Vec<i64>> {
        parts.iter().map(|p| p.trim().parse().ok()).collect()
    };
    match v {
        Value::Number(n) => n.as_i64().map(toml::Value::Integer),
        Value::String(s) => match ints(s.split(',').collect())?.as_slice() {
            [r] => Some(toml::Value::Integer(*r)),
            [w, h] => Some(toml::Value::Array(vec![
                toml::Value::Integer(*w),
                toml::Value::Integer(*h),
            ])),
            _ => None,
        },
        Value::Array(a) => {
            let v: Option<Vec<toml::Value>> = a
                .iter()
                .map(|x| x.as_i64().map(toml::Value::Integer))
                .collect();
            v.filter(|v| v.len() == 2).map(toml::Value::Array)
        }
        _ => None,
    }
}

/// kohya's `generate_dreambooth_subsets_config_by_subdirs`: each `<repeats>_<class tokens>`
/// folder directly under `dir` is a subset (in name order; kohya's is the file system's).
fn dreambooth_subsets(
    dir: &Path,
    key: &str,
    is_reg: bool,
    config: &Path,
) -> Result<Vec<(String, toml::Table)>, ConfigError> {
    if !dir.is_dir() {
        return Err(invalid(
            config,
            key,
            format!("{} is not a folder", dir.display()),
        ));
    }
    let entries = std::fs::read_dir(dir).map_err(|source| ConfigError::Read {
        file: dir.to_path_buf(),
        source,
    })?;
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut subsets = Vec::new();
    for name in names {
        let Some((repeats, tokens)) = crate::data::kohya_layout::subset_name(&name) else {
            crate::console::say(format_args!(
                "warning: {}: {name}/ is not read (kohya reads only `<repeats>_<class tokens>` \
                 folders)",
                dir.display()
            ));
            continue;
        };
        if repeats < 1 {
            continue;
        }
        let mut t = toml::Table::new();
        t.insert("image_dir".into(), path_value(&dir.join(&name)));
        t.insert("num_repeats".into(), toml::Value::Integer(repeats as i64));
        t.insert(
            "class_tokens".into(),
            toml::Value::String(tokens.to_string()),
        );
        t.insert("is_reg".into(), toml::Value::Boolean(is_reg));
        subsets.push((format!("{key} {name}/"), t));
    }
    if subsets.is_empty() && !is_reg {
        return Err(invalid(
            config,
            key,
            format!(
                "{} has no `<repeats>_<class tokens>` folder (such as `10_sks dog/`), which is \
                 how kohya reads train_data_dir without a dataset_config",
                dir.display()
            ),
        ));
    }
    Ok(subsets)
}
