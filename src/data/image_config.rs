//! EveryDream2's per-image and per-folder settings (`data/dataset.py` `ImageConfig`,
//! `Dataset.from_path`; `doc/DATA.md`, `doc/SHUFFLING_TAGS.md`).
//!
//! Where an image's settings come from, least specific first (each later one wins for a single
//! value; main prompts and tags are unions with the later one's first):
//! 1. `global.yaml` / `global.yml` of the image's folder and of every folder above it up to
//!    `data_root` (a folder's own global file over its parent's);
//! 2. the folder's local files: `multiply.txt`, `cond_dropout.txt`, `flip_p.txt`, `local.yaml`,
//!    `local.yml`, in that order (so `local.yaml`'s `multiply` beats `multiply.txt`), and
//!    `shuffle_tags.txt` (present: shuffle);
//! 3. the image's sidecars: its caption file (`.txt`, else `.caption`, see [`super::caption`]),
//!    then `<stem>.yml`, then `<stem>.yaml`.
//!
//! A YAML file holds `main_prompt` (a string or a list), `caption` (caption text, split like a
//! `.txt`), `tags` (strings, or `{tag, weight}` maps; weight 1 when left out), `rating`,
//! `max_caption_length`, `multiply`, `flip_p`, `cond_dropout` and `shuffle_tags`. As EveryDream2
//! reads them with PyYAML: `shuffle_tags` takes YAML 1.1's booleans (`yes`/`no`, `on`/`off`,
//! `true`/`false`, each in lower, Title or UPPER case); a bare number, boolean or null in `tags`
//! is no tag (dropped, with a warning), and a map's numeric `tag: 2024` is the tag "2024".
//!
//! Deliberate differences from EveryDream2:
//! - a key EveryDream2 does not know (`cond_droput`, the typo in its own DATA.md), a wrong type or
//!   an out-of-range value is an error naming the file; EveryDream2 ignores unknown keys and
//!   logs a warning for a number it cannot read;
//! - `batch_id` (named batches) and `loss_scale` (per-image loss weight), in YAML or as
//!   `batch_id.txt`/`loss_scale.txt`, are refused, not implemented; `image` (only meaningful in
//!   EveryDream2's JSON dataset lists, which sdtrain does not read) is refused too;
//! - `rating: 0` and `multiply: 0` mean 0: EveryDream2 reads them with Python's `or`, turning 0
//!   into the default 1;
//! - `shuffle_tags: true` in a `global.yaml` reaches the subfolders, as DATA.md says a global
//!   setting does; EveryDream2's `merge` drops it at the first subfolder;
//! - `<stem>.json` is not read as a sidecar, as EveryDream2 does not read it either.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::path::Path;

use serde::Deserialize;
use serde_norway::Value;

use super::caption::{read_caption_file, Caption};
use super::DataError;

/// Folder files read as global (inherited) settings, in the order they are applied.
pub const GLOBAL_FILES: [&str; 2] = ["global.yaml", "global.yml"];
/// Sidecar YAML extensions, in the order they are applied.
pub const YAML_EXTENSIONS: [&str; 2] = ["yml", "yaml"];
/// EveryDream2's default `max_caption_length` (`DEFAULT_MAX_CAPTION_LENGTH`).
pub const DEFAULT_MAX_CAPTION_LENGTH: usize = 2048;

/// A tag and its shuffle weight (1 unless given).
#[derive(Debug, Clone, PartialEq)]
pub struct Tag {
    pub value: String,
    pub weight: f64,
}

/// The settings one file (or the fold of several) gives an image. `None`: not set here.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ImageConfig {
    /// In order of precedence; the first is the one used.
    pub main_prompts: Vec<String>,
    pub tags: Vec<Tag>,
    pub rating: Option<f64>,
    pub max_caption_length: Option<usize>,
    pub multiply: Option<f64>,
    pub cond_dropout: Option<f64>,
    pub flip_p: Option<f64>,
    pub shuffle_tags: bool,
}

impl ImageConfig {
    /// EveryDream2's `merge`: `over`'s prompts and tags first then this one's (each once),
    /// `over`'s single values where it sets them; shuffling when either shuffles.
    pub fn merge(&self, over: &ImageConfig) -> ImageConfig {
        let mut main_prompts = over.main_prompts.clone();
        for p in &self.main_prompts {
            if !main_prompts.contains(p) {
                main_prompts.push(p.clone());
            }
        }
        let mut tags = over.tags.clone();
        for t in &self.tags {
            if !tags.contains(t) {
                tags.push(t.clone());
            }
        }
        ImageConfig {
            main_prompts,
            tags,
            rating: over.rating.or(self.rating),
            max_caption_length: over.max_caption_length.or(self.max_caption_length),
            multiply: over.multiply.or(self.multiply),
            cond_dropout: over.cond_dropout.or(self.cond_dropout),
            flip_p: over.flip_p.or(self.flip_p),
            shuffle_tags: over.shuffle_tags || self.shuffle_tags,
        }
    }

    /// A caption text (a `.txt` file's): the first comma piece is the main prompt, the rest
    /// tags of weight 1 (empty and repeated pieces dropped, see [`Caption::parse`]).
    pub fn from_caption(text: &str) -> ImageConfig {
        let caption = Caption::parse(text);
        ImageConfig {
            main_prompts: if caption.main.is_empty() {
                Vec::new()
            } else {
                vec![caption.main]
            },
            tags: caption
                .tags
                .into_iter()
                .map(|value| Tag { value, weight: 1.0 })
                .collect(),
            ..ImageConfig::default()
        }
    }

    /// The tags in EveryDream2's caption order: by weight, highest first, ties in file order.
    pub fn tags_by_weight(&self) -> Vec<Tag> {
        let mut tags = self.tags.clone();
        tags.sort_by(|a, b| b.weight.total_cmp(&a.weight));
        tags
    }
}

/// A YAML settings file as written. `main_prompt`, `tags` and `shuffle_tags` are read by hand
/// ([`main_prompts`], [`yaml_tags`], [`yaml_bool`]) for PyYAML's leniency and errors that say
/// what is allowed.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlFile {
    main_prompt: Option<Value>,
    caption: Option<String>,
    tags: Option<Value>,
    rating: Option<f64>,
    max_caption_length: Option<i64>,
    multiply: Option<f64>,
    cond_dropout: Option<f64>,
    flip_p: Option<f64>,
    shuffle_tags: Option<Value>,
    batch_id: Option<Value>,
    loss_scale: Option<Value>,
    image: Option<Value>,
}

/// The forms a `tags` entry may take, for error messages.
const TAG_FORMS: &str = "each entry is a string (`- sitting`) or a map with a `tag` and an \
                         optional numeric `weight` (`- {tag: tuxedo, weight: 1.5}`)";

/// PyYAML's YAML 1.1 booleans (`resolver.py`): `yes`/`no`, `true`/`false`, `on`/`off`, each in
/// lower, Title or UPPER case.
fn pyyaml_bool(text: &str) -> Option<bool> {
    match text {
        "yes" | "Yes" | "YES" | "true" | "True" | "TRUE" | "on" | "On" | "ON" => Some(true),
        "no" | "No" | "NO" | "false" | "False" | "FALSE" | "off" | "Off" | "OFF" => Some(false),
        _ => None,
    }
}

/// What kind of YAML value `v` is, for error messages.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a map",
        Value::Tagged(_) => "a tagged value",
    }
}

/// `v` in YAML's one-line flow style (`{tag: t, weight: '2'}`), shortened, for error messages.
fn shown(v: &Value) -> String {
    let line = flow(v);
    match line.char_indices().nth(60) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line,
    }
}

fn flow(v: &Value) -> String {
    match v {
        Value::Sequence(items) => {
            let items: Vec<String> = items.iter().map(flow).collect();
            format!("[{}]", items.join(", "))
        }
        Value::Mapping(map) => {
            let pairs: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("{}: {}", flow(k), flow(v)))
                .collect();
            format!("{{{}}}", pairs.join(", "))
        }
        scalar => serde_norway::to_string(scalar)
            .unwrap_or_default()
            .trim()
            .replace('\n', " "),
    }
}

/// `shuffle_tags`: a boolean as PyYAML reads one (see [`pyyaml_bool`]); null leaves it unset.
fn yaml_bool(path: &Path, key: &str, v: Option<Value>) -> Result<Option<bool>, DataError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(b)),
        Some(Value::String(s)) if pyyaml_bool(&s).is_some() => Ok(pyyaml_bool(&s)),
        Some(other) => Err(bad(
            path,
            format!(
                "{key} must be a boolean: true/false, yes/no or on/off (lower, Title or UPPER \
                 case), found {} `{}`",
                kind(&other),
                shown(&other)
            ),
        )),
    }
}

/// `main_prompt`: a string or a list of strings (null entries skipped, as EveryDream2's
/// `safe_set` skips `None`).
fn main_prompts(path: &Path, v: Option<Value>) -> Result<Vec<String>, DataError> {
    let wrong = |v: &Value| {
        bad(
            path,
            format!(
                "main_prompt must be a string or a list of strings, found {} `{}`",
                kind(v),
                shown(v)
            ),
        )
    };
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(p)) => Ok(vec![p]),
        Some(Value::Sequence(items)) => items
            .into_iter()
            .filter(|item| !item.is_null())
            .map(|item| match item {
                Value::String(p) => Ok(p),
                other => Err(wrong(&other)),
            })
            .collect(),
        Some(other) => Err(wrong(&other)),
    }
}

/// Python's `str()` of a YAML scalar: EveryDream2 stringifies a map's `tag` (`tag: 2024` is the
/// tag "2024").
fn python_str(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Bool(b) => Some(if *b { "True" } else { "False" }.into()),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => Some(i.to_string()),
            (None, Some(u), _) => Some(u.to_string()),
            (None, None, Some(f)) => Some(crate::py_json::py_float(f)),
            (None, None, None) => None,
        },
        _ => None,
    }
}

/// `tags`: a list whose entries are strings or `{tag, weight}` maps. As in EveryDream2
/// (`Tag.parse` gives `None` for them and `safe_set` drops it), a bare number, boolean or null
/// is no tag; it is dropped with a warning naming the file. A map's `tag` that is a number or a
/// boolean is its Python `str()`.
fn yaml_tags(path: &Path, v: Option<Value>) -> Result<Vec<Tag>, DataError> {
    let entries = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Sequence(entries)) => entries,
        Some(other) => {
            return Err(bad(
                path,
                format!(
                    "tags must be a list, found {} `{}`: {TAG_FORMS}; comma-separated tags go in \
                     `caption`",
                    kind(&other),
                    shown(&other)
                ),
            ))
        }
    };
    let mut tags = Vec::new();
    let mut dropped = Vec::new();
    for (i, entry) in entries.into_iter().enumerate() {
        let wrong = |e: &Value, why: &str| {
            bad(
                path,
                format!("tags: entry {} `{}` {why}: {TAG_FORMS}", i + 1, shown(e)),
            )
        };
        match entry {
            Value::String(value) => tags.push(Tag { value, weight: 1.0 }),
            Value::Null | Value::Bool(_) | Value::Number(_) => dropped.push(shown(&entry)),
            Value::Mapping(ref map) => {
                let mut value = None;
                let mut weight = None;
                for (key, field) in map {
                    match key.as_str() {
                        Some("tag") => value = Some(field),
                        Some("weight") => weight = Some(field),
                        _ => {
                            return Err(wrong(
                                &entry,
                                &format!("has the unknown key `{}`", shown(key)),
                            ))
                        }
                    }
                }
                let Some(value) = value.and_then(python_str) else {
                    return Err(wrong(&entry, "has no text or number `tag`"));
                };
                let weight = match weight {
                    None | Some(Value::Null) => None,
                    Some(w) => match w.as_f64() {
                        Some(w) => Some(w),
                        None => return Err(wrong(&entry, "has a `weight` that is not a number")),
                    },
                };
                let weight = checked(path, "tags: weight", weight, f64::MAX)?.unwrap_or(1.0);
                tags.push(Tag { value, weight });
            }
            Value::Sequence(_) | Value::Tagged(_) => {
                return Err(wrong(&entry, &format!("is {}", kind(&entry))))
            }
        }
    }
    if !dropped.is_empty() {
        crate::console::say(format_args!(
            "warning: {}: {} not text and dropped from tags, as EveryDream2 drops it; quote \
             a number (`- \"1990\"`) or write `- tag: 1990` to keep it",
            path.display(),
            match dropped.as_slice() {
                [one] => format!("`{one}` is"),
                many => format!("`{}` are", many.join("`, `")),
            }
        ));
    }
    Ok(tags)
}

fn bad(path: &Path, reason: impl Into<String>) -> DataError {
    DataError::ImageConfig {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Reads a YAML settings file (`global.yaml`, `local.yaml`, `<stem>.yaml`). An empty file sets
/// nothing.
pub fn read_yaml(path: &Path) -> Result<ImageConfig, DataError> {
    let text = read_caption_file(path)?;
    if text.trim().is_empty() {
        return Ok(ImageConfig::default());
    }
    let file: YamlFile = serde_norway::from_str(&text).map_err(|e| bad(path, e.to_string()))?;
    if file.image.is_some() {
        return Err(bad(path, refused_reason("image")));
    }
    config_of(path, file)
}

/// EveryDream2's JSON dataset (`Dataset.from_json`, a `data_root` naming a `.json` file): a list
/// of objects, each an image's settings in the YAML files' keys with its path in `image`. Returns
/// each entry's `image` as written and its settings; an entry without `image` is an error naming
/// it (EveryDream2 skips it with a warning).
pub fn read_json_dataset(path: &Path) -> Result<Vec<(String, ImageConfig)>, DataError> {
    let text = read_caption_file(path)?;
    let entries: Vec<serde_json::Value> = serde_json::from_str(crate::py_json::without_bom(&text))
        .map_err(|e| {
            bad(
                path,
                format!("is not a JSON list of image entries (EveryDream2's JSON dataset): {e}"),
            )
        })?;
    entries
        .into_iter()
        .enumerate()
        .map(|(i, entry)| {
            let at = |why: String| bad(path, format!("entry {}: {why}", i + 1));
            let value = serde_norway::to_value(&entry).map_err(|e| at(e.to_string()))?;
            let file: YamlFile = serde_norway::from_value(value).map_err(|e| at(e.to_string()))?;
            let image = match &file.image {
                Some(Value::String(s)) if !s.is_empty() => s.clone(),
                _ => return Err(at("has no `image` path".into())),
            };
            Ok((image, config_of(path, file)?))
        })
        .collect()
}

/// The settings a YAML file (or a JSON dataset entry) gives.
fn config_of(path: &Path, file: YamlFile) -> Result<ImageConfig, DataError> {
    for (key, set) in [
        ("batch_id", file.batch_id.is_some()),
        ("loss_scale", file.loss_scale.is_some()),
    ] {
        if set {
            return Err(bad(path, refused_reason(key)));
        }
    }
    let mut cfg = ImageConfig {
        main_prompts: main_prompts(path, file.main_prompt)?,
        rating: checked(path, "rating", file.rating, f64::MAX)?,
        multiply: checked(path, "multiply", file.multiply, f64::MAX)?,
        flip_p: checked(path, "flip_p", file.flip_p, 1.0)?,
        cond_dropout: checked(path, "cond_dropout", file.cond_dropout, 1.0)?,
        shuffle_tags: yaml_bool(path, "shuffle_tags", file.shuffle_tags)?.unwrap_or(false),
        ..ImageConfig::default()
    };
    cfg.main_prompts.retain(|p| !p.is_empty());
    cfg.max_caption_length = match file.max_caption_length {
        None => None,
        Some(n) if n >= 1 => Some(n as usize),
        Some(n) => {
            return Err(bad(
                path,
                format!("max_caption_length must be ≥ 1, found {n}"),
            ))
        }
    };
    for tag in yaml_tags(path, file.tags)? {
        if !tag.value.is_empty() && !cfg.tags.contains(&tag) {
            cfg.tags.push(tag);
        }
    }
    if let Some(text) = file.caption {
        cfg = cfg.merge(&ImageConfig::from_caption(&text));
    }
    Ok(cfg)
}

/// Why a key is refused.
pub fn refused_reason(key: &str) -> String {
    match key {
        "batch_id" => "batch_id (EveryDream2's named batches) is not implemented".into(),
        "loss_scale" => "loss_scale (a per-image loss weight) is not implemented".into(),
        _ => format!(
            "{key} is only meaningful in EveryDream2's JSON dataset list (a data_root naming a \
             .json file), not in a YAML file beside an image"
        ),
    }
}

/// `value` when it is finite and in `[0, max]`.
fn checked(path: &Path, key: &str, value: Option<f64>, max: f64) -> Result<Option<f64>, DataError> {
    match value {
        Some(v) if !(v.is_finite() && (0.0..=max).contains(&v)) => {
            let range = if max == 1.0 { "0 to 1" } else { "≥ 0" };
            Err(bad(
                path,
                format!("{key} must be a number {range}, found {v}"),
            ))
        }
        other => Ok(other),
    }
}

/// A one-number folder file (`flip_p.txt`, `cond_dropout.txt`): a finite number in `[0, 1]`.
pub fn read_fraction_file(path: &Path) -> Result<f64, DataError> {
    let text = read_caption_file(path)?;
    match text.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(bad(
            path,
            format!(
                "must hold one number from 0 to 1, found `{}`",
                text.trim().chars().take(40).collect::<String>()
            ),
        )),
    }
}

/// The global settings of a folder (`global.yaml`, `global.yml`) over its parent's.
pub fn folder_global(
    dir: &Path,
    names: &HashSet<&OsStr>,
    parent: &ImageConfig,
) -> Result<ImageConfig, DataError> {
    let mut cfg = parent.clone();
    for name in GLOBAL_FILES {
        if names.contains(OsStr::new(name)) {
            cfg = cfg.merge(&read_yaml(&dir.join(name))?);
        }
    }
    Ok(cfg)
}

/// The local settings of a folder, which its subfolders do not inherit.
pub fn folder_local(dir: &Path, names: &HashSet<&OsStr>) -> Result<ImageConfig, DataError> {
    let has = |name: &str| names.contains(OsStr::new(name));
    for refused in ["batch_id.txt", "loss_scale.txt"] {
        if has(refused) {
            let key = refused.trim_end_matches(".txt");
            return Err(bad(&dir.join(refused), refused_reason(key)));
        }
    }
    let mut cfg = ImageConfig::default();
    if has(super::scan::MULTIPLY_FILE) {
        let multiply = super::scan::read_multiply(&dir.join(super::scan::MULTIPLY_FILE))?;
        cfg.multiply = Some(multiply);
    }
    if has("cond_dropout.txt") {
        cfg.cond_dropout = Some(read_fraction_file(&dir.join("cond_dropout.txt"))?);
    }
    if has("flip_p.txt") {
        cfg.flip_p = Some(read_fraction_file(&dir.join("flip_p.txt"))?);
    }
    for name in ["local.yaml", "local.yml"] {
        if has(name) {
            cfg = cfg.merge(&read_yaml(&dir.join(name))?);
        }
    }
    cfg.shuffle_tags |= has("shuffle_tags.txt");
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yaml(text: &str) -> Result<ImageConfig, DataError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.yaml");
        std::fs::write(&path, text).unwrap();
        read_yaml(&path)
    }

    #[test]
    fn yaml_reads_every_key_ed2_documents() {
        let cfg = yaml(
            "main_prompt: a photo of ted\ntags:\n  - sitting\n  - tag: tuxedo\n    weight: 1.5\n\
             rating: 2\nmax_caption_length: 30\nmultiply: 3\nflip_p: 0.5\ncond_dropout: 0.1\n\
             shuffle_tags: true\n",
        )
        .unwrap();
        assert_eq!(cfg.main_prompts, ["a photo of ted"]);
        assert_eq!(
            cfg.tags,
            [
                Tag {
                    value: "sitting".into(),
                    weight: 1.0
                },
                Tag {
                    value: "tuxedo".into(),
                    weight: 1.5
                }
            ]
        );
        assert_eq!(cfg.rating, Some(2.0));
        assert_eq!(cfg.max_caption_length, Some(30));
        assert_eq!((cfg.multiply, cfg.flip_p), (Some(3.0), Some(0.5)));
        assert_eq!(cfg.cond_dropout, Some(0.1));
        assert!(cfg.shuffle_tags);
        let by_weight: Vec<String> = cfg.tags_by_weight().into_iter().map(|t| t.value).collect();
        assert_eq!(by_weight, ["tuxedo", "sitting"]);
        assert_eq!(yaml("").unwrap(), ImageConfig::default());
    }

    #[test]
    fn caption_key_is_parsed_like_a_txt_and_merged_over() {
        let cfg = yaml("main_prompt: m\ncaption: c, t1, t2\n").unwrap();
        assert_eq!(cfg.main_prompts, ["c", "m"]);
        let tags: Vec<&str> = cfg.tags.iter().map(|t| t.value.as_str()).collect();
        assert_eq!(tags, ["t1", "t2"]);
    }

    #[test]
    fn bad_yaml_names_the_file_and_the_key() {
        for (text, want) in [
            ("cond_droput: 0.05\n", "cond_droput"),
            ("flip_p: 2\n", "flip_p"),
            ("rating: -1\n", "rating"),
            ("batch_id: x\n", "batch_id"),
            ("loss_scale: 2\n", "loss_scale"),
            ("max_caption_length: 0\n", "max_caption_length"),
            ("tags: [ {tag: a, wieght: 2} ]\n", "tags"),
            ("main_prompt: [\n", "a.yaml"),
        ] {
            let err = yaml(text).unwrap_err().to_string();
            assert!(err.contains("a.yaml"), "{text}: {err}");
            assert!(err.contains(want), "{text}: {err}");
        }
    }

    /// EveryDream2's `merge`: the more specific config's prompts and tags come first and its
    /// single values win; unset values inherit.
    #[test]
    fn merge_puts_the_more_specific_first() {
        let global = ImageConfig {
            main_prompts: vec!["g".into()],
            tags: vec![Tag {
                value: "style".into(),
                weight: 1.0,
            }],
            rating: Some(3.0),
            flip_p: Some(0.5),
            ..ImageConfig::default()
        };
        let image = ImageConfig {
            main_prompts: vec!["i".into()],
            tags: vec![Tag {
                value: "pose".into(),
                weight: 1.0,
            }],
            flip_p: Some(0.0),
            ..ImageConfig::default()
        };
        let m = global.merge(&image);
        assert_eq!(m.main_prompts, ["i", "g"]);
        let tags: Vec<&str> = m.tags.iter().map(|t| t.value.as_str()).collect();
        assert_eq!(tags, ["pose", "style"]);
        assert_eq!((m.rating, m.flip_p), (Some(3.0), Some(0.0)));
    }

    #[test]
    fn fraction_files_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("flip_p.txt");
        std::fs::write(&path, " 0.25\n").unwrap();
        assert_eq!(read_fraction_file(&path).unwrap(), 0.25);
        for text in ["", "1.5", "x", "-0.1"] {
            std::fs::write(&path, text).unwrap();
            let err = read_fraction_file(&path).unwrap_err().to_string();
            assert!(err.contains("flip_p.txt"), "{err}");
        }
    }

    /// Regression: PyYAML reads `on`/`yes`/`off`/`no` (any of lower, Title, UPPER case) as
    /// booleans; serde's YAML 1.2 refused them.
    #[test]
    fn shuffle_tags_reads_pyyaml_booleans() {
        for word in [
            "on", "On", "ON", "yes", "Yes", "YES", "true", "True", "TRUE",
        ] {
            let cfg = yaml(&format!("shuffle_tags: {word}\n")).unwrap();
            assert!(cfg.shuffle_tags, "{word}");
        }
        for word in [
            "off", "Off", "OFF", "no", "No", "NO", "false", "False", "FALSE", "~",
        ] {
            let cfg = yaml(&format!("shuffle_tags: {word}\n")).unwrap();
            assert!(!cfg.shuffle_tags, "{word}");
        }
        for word in ["y", "maybe", "2"] {
            let err = yaml(&format!("shuffle_tags: {word}\n"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("a.yaml") && err.contains("shuffle_tags") && err.contains("yes/no"),
                "{word}: {err}"
            );
        }
    }

    /// Regression: EveryDream2 trains `tags: [1990, {tag: 2024, weight: 2}]` as the one tag
    /// "2024" (a bare number is no tag, a map's `tag` is stringified); sdtrain refused the file.
    #[test]
    fn numeric_tags_read_as_everydream2_reads_them() {
        let cfg = yaml("main_prompt: m\ntags:\n  - 1990\n  - tag: 2024\n    weight: 2\n").unwrap();
        assert_eq!(
            cfg.tags,
            [Tag {
                value: "2024".into(),
                weight: 2.0
            }]
        );
        let cfg =
            yaml("tags: [null, true, {tag: 1.5}, {tag: true}, {tag: x, weight: ~}]\n").unwrap();
        let tags: Vec<(&str, f64)> = cfg
            .tags
            .iter()
            .map(|t| (t.value.as_str(), t.weight))
            .collect();
        assert_eq!(tags, [("1.5", 1.0), ("True", 1.0), ("x", 1.0)]);
    }

    /// Regression: a wrong `tags` or `main_prompt` gave serde's "data did not match any variant
    /// of untagged enum TagEntry"; the message names the file, the field and the accepted forms.
    #[test]
    fn wrong_tags_and_main_prompt_say_what_is_allowed() {
        for (text, want) in [
            ("tags: a, b, c\n", "tags must be a list"),
            ("tags: [[a, b]]\n", "tags: entry 1 `[a, b]` is a list"),
            (
                "tags: [x, {tag: t, weight: '2'}]\n",
                "entry 2 `{tag: t, weight: '2'}`",
            ),
            ("tags: [{weight: 2}]\n", "no text or number `tag`"),
            (
                "tags: [{tag: a, weight: \"2\"}]\n",
                "`weight` that is not a number",
            ),
            ("tags: [{tag: a, wieght: 2}]\n", "unknown key `wieght`"),
            (
                "main_prompt: 5\n",
                "main_prompt must be a string or a list of strings",
            ),
            (
                "main_prompt: [a, {b: c}]\n",
                "main_prompt must be a string or a list of strings",
            ),
        ] {
            let err = yaml(text).unwrap_err().to_string();
            assert!(
                err.contains("a.yaml") && err.contains(want),
                "{text}: {err}"
            );
            assert!(!err.contains("untagged"), "{text}: {err}");
            if want.starts_with("tags") || text.starts_with("tags") {
                assert!(err.contains("{tag: tuxedo, weight: 1.5}"), "{text}: {err}");
            }
        }
    }

    #[test]
    fn utf16_yaml_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.yaml");
        let mut bytes = vec![0xFF, 0xFE];
        for unit in "main_prompt: café\nshuffle_tags: yes\n".encode_utf16() {
            bytes.extend(unit.to_le_bytes());
        }
        std::fs::write(&path, bytes).unwrap();
        let cfg = read_yaml(&path).unwrap();
        assert_eq!(cfg.main_prompts, ["café"]);
        assert!(cfg.shuffle_tags);
    }
}
