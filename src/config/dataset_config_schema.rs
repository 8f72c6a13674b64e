//! The shape of a kohya dataset config (kohya's `ConfigSanitizer`, `library/config_util.py`):
//! which key may stand at which level, its type, and how a subset finds a value it does not set
//! (its dataset, then `[general]`).
//!
//! - the top level holds `[general]` and `[[datasets]]`;
//! - `[general]` may hold every dataset and subset key except a subset's own;
//! - a `[[datasets]]` entry the same, and its `[[datasets.subsets]]`;
//! - a subset the subset keys and its own: `image_dir`, `metadata_file`, `is_reg`, `alpha_mask`,
//!   `conditioning_data_dir`.
//!
//! Every key is checked where it stands, with a did-you-mean for a misspelt one, so a mistake in
//! a subset that a run never reaches is still an error. As in kohya, an integer key refuses a
//! float; a float key takes an integer too.

use std::path::Path;

use toml::{Table, Value};

use super::error::ConfigError;

/// A key's type.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Kind {
    Bool,
    Int,
    /// An integer or a float.
    Number,
    Text,
    /// `[a, b]` of numbers.
    NumberPair,
    /// An integer, or `[width, height]`.
    IntOrPair,
    Table,
}

use Kind::*;

/// Keys a subset, its dataset and `[general]` may set (kohya's subset, dropout and DreamBooth
/// ascendable schemas).
pub(super) const SUBSET_KEYS: &[(&str, Kind)] = &[
    ("color_aug", Bool),
    ("face_crop_aug_range", NumberPair),
    ("flip_aug", Bool),
    ("num_repeats", Int),
    ("random_crop", Bool),
    ("shuffle_caption", Bool),
    ("keep_tokens", Int),
    ("keep_tokens_separator", Text),
    ("secondary_separator", Text),
    ("caption_separator", Text),
    ("enable_wildcard", Bool),
    ("token_warmup_min", Int),
    ("token_warmup_step", Number),
    ("caption_prefix", Text),
    ("caption_suffix", Text),
    ("custom_attributes", Table),
    ("resize_interpolation", Text),
    ("caption_dropout_every_n_epochs", Int),
    ("caption_dropout_rate", Number),
    ("caption_tag_dropout_rate", Number),
    ("caption_extension", Text),
    ("class_tokens", Text),
    ("cache_info", Bool),
];

/// Keys only a subset sets.
pub(super) const SUBSET_OWN_KEYS: &[(&str, Kind)] = &[
    ("image_dir", Text),
    ("metadata_file", Text),
    ("is_reg", Bool),
    ("alpha_mask", Bool),
    ("conditioning_data_dir", Text),
];

/// Keys a dataset and `[general]` may set.
pub(super) const DATASET_KEYS: &[(&str, Kind)] = &[
    ("batch_size", Int),
    ("bucket_no_upscale", Bool),
    ("bucket_reso_steps", Int),
    ("enable_bucket", Bool),
    ("max_bucket_reso", Int),
    ("min_bucket_reso", Int),
    ("validation_seed", Int),
    ("validation_split", Number),
    ("resolution", IntOrPair),
    ("network_multiplier", Number),
];

/// Which level a table is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Level {
    General,
    Dataset,
    Subset,
}

/// The parsed file and its checked tables.
pub(super) struct Checked {
    pub general: Table,
    /// Each dataset's own table (without `subsets`) and its subsets.
    pub datasets: Vec<(Table, Vec<Table>)>,
}

/// The file's error constructors.
pub(super) struct TomlCtx<'a> {
    pub file: &'a Path,
}

impl TomlCtx<'_> {
    pub fn invalid(&self, field: &str, message: String) -> ConfigError {
        ConfigError::Invalid {
            file: self.file.to_path_buf(),
            field: field.to_string(),
            message,
        }
    }

    fn wrong_type(&self, field: &str, message: String) -> ConfigError {
        ConfigError::WrongType {
            file: self.file.to_path_buf(),
            field: field.to_string(),
            message,
        }
    }

    fn unknown(&self, field: String, hint: Option<String>) -> ConfigError {
        ConfigError::UnknownKey {
            file: self.file.to_path_buf(),
            key: field,
            set_arg: None,
            hint,
        }
    }
}

/// Parses `text` and checks every key of every table.
pub(super) fn check(text: &str, cx: &TomlCtx<'_>) -> Result<Checked, ConfigError> {
    let top: Table =
        toml::from_str(crate::py_json::without_bom(text)).map_err(|e| ConfigError::TomlSyntax {
            file: cx.file.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })?;
    for key in top.keys() {
        if key != "general" && key != "datasets" {
            let hint = super::strict::suggest(key, ["general", "datasets"])
                .map(|s| format!("did you mean `{s}`?"))
                .or(Some(
                    "the top level holds `[general]` and `[[datasets]]`".into(),
                ));
            return Err(cx.unknown(key.clone(), hint));
        }
    }
    let general = match top.get("general") {
        None => Table::new(),
        Some(Value::Table(t)) => t.clone(),
        Some(_) => return Err(cx.wrong_type("general", "must be a table, `[general]`".into())),
    };
    check_table(&general, Level::General, "general", cx)?;
    let list = match top.get("datasets") {
        Some(Value::Array(list)) if !list.is_empty() => list,
        Some(Value::Array(_)) | None => {
            return Err(cx.invalid(
                "datasets",
                "is missing: the file needs at least one `[[datasets]]` with its \
                 `[[datasets.subsets]]`"
                    .into(),
            ))
        }
        Some(_) => {
            return Err(cx.wrong_type(
                "datasets",
                "must be an array of tables, `[[datasets]]`".into(),
            ))
        }
    };
    let mut datasets = Vec::with_capacity(list.len());
    for (i, d) in list.iter().enumerate() {
        let at = format!("datasets[{i}]");
        let Value::Table(d) = d else {
            return Err(cx.wrong_type(&at, "must be a table, `[[datasets]]`".into()));
        };
        let mut own = d.clone();
        let subsets =
            match own.remove("subsets") {
                Some(Value::Array(list)) if !list.is_empty() => list,
                Some(Value::Array(_)) | None => return Err(cx.invalid(
                    &format!("{at}.subsets"),
                    "is missing: each dataset needs at least one `[[datasets.subsets]]` with its \
                     `image_dir` (or `metadata_file`)"
                        .into(),
                )),
                Some(_) => {
                    return Err(cx.wrong_type(
                        &format!("{at}.subsets"),
                        "must be an array of tables, `[[datasets.subsets]]`".into(),
                    ))
                }
            };
        check_table(&own, Level::Dataset, &at, cx)?;
        let mut tables = Vec::with_capacity(subsets.len());
        for (j, s) in subsets.into_iter().enumerate() {
            let at = format!("{at}.subsets[{j}]");
            let Value::Table(s) = s else {
                return Err(cx.wrong_type(&at, "must be a table, `[[datasets.subsets]]`".into()));
            };
            check_table(&s, Level::Subset, &at, cx)?;
            tables.push(s);
        }
        datasets.push((own, tables));
    }
    Ok(Checked { general, datasets })
}

/// The keys a level may hold.
fn allowed(level: Level) -> impl Iterator<Item = &'static (&'static str, Kind)> {
    let (dataset, own): (&[_], &[_]) = match level {
        Level::General | Level::Dataset => (DATASET_KEYS, &[]),
        Level::Subset => (&[], SUBSET_OWN_KEYS),
    };
    SUBSET_KEYS.iter().chain(dataset).chain(own)
}

/// Checks a kohya config's dataset options, the level under `[general]` (named bare).
pub(super) fn check_command_line(table: &Table, cx: &TomlCtx<'_>) -> Result<(), ConfigError> {
    check_table(table, Level::General, "", cx)
}

fn check_table(table: &Table, level: Level, at: &str, cx: &TomlCtx<'_>) -> Result<(), ConfigError> {
    for (key, value) in table {
        let field = match at {
            "" => key.clone(),
            at => format!("{at}.{key}"),
        };
        let Some(&(_, kind)) = allowed(level).find(|(k, _)| k == key) else {
            return Err(cx.unknown(field, misplaced(key, level)));
        };
        check_type(value, kind).map_err(|want| cx.wrong_type(&field, want))?;
    }
    Ok(())
}

/// Where a key that may not stand at `level` belongs, or the nearest known key.
fn misplaced(key: &str, level: Level) -> Option<String> {
    let is = |list: &[(&str, Kind)]| list.iter().any(|(k, _)| *k == key);
    if level == Level::Subset && is(DATASET_KEYS) {
        return Some("it is a dataset key: set it in its `[[datasets]]` or in `[general]`".into());
    }
    if level != Level::Subset && is(SUBSET_OWN_KEYS) {
        return Some("it belongs to a subset: set it in a `[[datasets.subsets]]`".into());
    }
    let all = SUBSET_KEYS
        .iter()
        .chain(SUBSET_OWN_KEYS)
        .chain(DATASET_KEYS)
        .map(|(k, _)| *k);
    super::strict::suggest(key, all).map(|s| format!("did you mean `{s}`?"))
}

/// `Err(what it must be)` when `value` is not of `kind`.
fn check_type(value: &Value, kind: Kind) -> Result<(), String> {
    let number = |v: &Value| matches!(v, Value::Integer(_) | Value::Float(_));
    let ok = match kind {
        Bool => value.is_bool(),
        Int => value.is_integer(),
        Number => number(value),
        Text => value.is_str(),
        Table => value.is_table(),
        NumberPair => value
            .as_array()
            .is_some_and(|a| a.len() == 2 && a.iter().all(number)),
        IntOrPair => {
            value.is_integer()
                || value
                    .as_array()
                    .is_some_and(|a| a.len() == 2 && a.iter().all(Value::is_integer))
        }
    };
    let want = match kind {
        Bool => "must be true or false",
        Int => "must be a whole number",
        Number => "must be a number",
        Text => "must be text (a quoted string)",
        Table => "must be a table",
        NumberPair => "must be a pair of numbers, [min, max]",
        IntOrPair => "must be a whole number or [width, height]",
    };
    match ok {
        true => Ok(()),
        false => Err(format!("{want} (got {})", shown(value))),
    }
}

/// A value as the TOML file writes it, for messages.
pub(super) fn shown(value: &Value) -> String {
    match value {
        Value::String(s) => format!("{s:?}"),
        Value::Integer(i) => i.to_string(),
        Value::Float(f) => f.to_string(),
        Value::Boolean(b) => b.to_string(),
        Value::Datetime(d) => d.to_string(),
        Value::Array(a) => format!("[{}]", a.iter().map(shown).collect::<Vec<_>>().join(", ")),
        Value::Table(_) => "a table".to_string(),
    }
}

/// A subset's tables, nearest first (the subset, its dataset, `[general]`), each with its path.
pub(super) struct Chain<'a> {
    pub levels: Vec<(&'a Table, String)>,
}

impl<'a> Chain<'a> {
    /// The value of `key` where it is first set, and its field path.
    pub fn get(&self, key: &str) -> Option<(&'a Value, String)> {
        self.levels.iter().find_map(|(t, at)| {
            let field = match at.as_str() {
                "" => key.to_string(),
                at => format!("{at}.{key}"),
            };
            t.get(key).map(|v| (v, field))
        })
    }

    pub fn bool(&self, key: &str) -> Option<(bool, String)> {
        self.get(key).and_then(|(v, at)| Some((v.as_bool()?, at)))
    }

    pub fn int(&self, key: &str) -> Option<(i64, String)> {
        self.get(key)
            .and_then(|(v, at)| Some((v.as_integer()?, at)))
    }

    pub fn number(&self, key: &str) -> Option<(f64, String)> {
        self.get(key).and_then(|(v, at)| {
            let x = match v {
                Value::Integer(i) => *i as f64,
                Value::Float(f) => *f,
                _ => return None,
            };
            Some((x, at))
        })
    }

    pub fn text(&self, key: &str) -> Option<(&'a str, String)> {
        self.get(key).and_then(|(v, at)| Some((v.as_str()?, at)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        let cx = TomlCtx {
            file: Path::new("d.toml"),
        };
        check(text, &cx)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    }

    /// Catches a key accepted at the wrong level, a type not checked, and a misspelt key let
    /// through.
    #[test]
    fn every_key_is_checked_where_it_stands() {
        let ok = "[general]\nshuffle_caption = true\nresolution = [512, 512]\n\
                  [[datasets]]\nbatch_size = 2\n[[datasets.subsets]]\nimage_dir = 'a'\nis_reg = false\n";
        assert_eq!(err(ok), "");
        let e = err("[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\nbatch_size = 2\n");
        assert!(
            e.contains("datasets[0].subsets[0].batch_size") && e.contains("dataset key"),
            "{e}"
        );
        let e = err(
            "[general]\nimage_dir = 'a'\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\n",
        );
        assert!(
            e.contains("general.image_dir") && e.contains("subset"),
            "{e}"
        );
        let e = err("[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\nnum_repeat = 2\n");
        assert!(e.contains("num_repeats"), "{e}");
        let e = err("[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\nnum_repeats = 2.5\n");
        assert!(e.contains("whole number"), "{e}");
        let e =
            err("[[datasets]]\nresolution = [512, 'x']\n[[datasets.subsets]]\nimage_dir = 'a'\n");
        assert!(e.contains("datasets[0].resolution"), "{e}");
        assert!(err("[[datasets]]\n").contains("datasets[0].subsets"));
        assert!(err("[general]\n").contains("`datasets`"));
        assert!(err("[[datasets]\n").contains("not valid TOML"));
        assert!(err("[genral]\n").contains("`general`"));
    }

    #[test]
    fn a_subset_finds_its_dataset_then_general() {
        let cx = TomlCtx {
            file: Path::new("d.toml"),
        };
        let c = check(
            "[general]\nkeep_tokens = 1\nflip_aug = true\n[[datasets]]\nkeep_tokens = 2\n\
             [[datasets.subsets]]\nimage_dir = 'a'\n[[datasets.subsets]]\nimage_dir = 'b'\nkeep_tokens = 3\n",
            &cx,
        )
        .unwrap();
        let (d, subsets) = &c.datasets[0];
        fn chain<'a>(s: &'a Table, d: &'a Table, g: &'a Table) -> Chain<'a> {
            Chain {
                levels: vec![
                    (s, "s".into()),
                    (d, "datasets[0]".into()),
                    (g, "general".into()),
                ],
            }
        }
        let chain = |s| chain(s, d, &c.general);
        assert_eq!(chain(&subsets[0]).int("keep_tokens").unwrap().0, 2);
        assert_eq!(chain(&subsets[1]).int("keep_tokens").unwrap().0, 3);
        assert_eq!(
            chain(&subsets[0]).bool("flip_aug"),
            Some((true, "general.flip_aug".into()))
        );
        assert!(chain(&subsets[0]).get("caption_prefix").is_none());
    }
}
