//! A OneTrainer config (the `.json` its UI saves to `training_presets/`, exports, or writes into
//! a run's `workspace/config/`): `sdtrain --config onetrainer.json` trains what OneTrainer's
//! `scripts/train.py --config-path onetrainer.json` would, for SD1.x, SD2.x and SDXL, as nearly
//! as sdtrain can, and refuses with the reason what it cannot do.
//!
//! The file is read as OneTrainer's `BaseConfig.from_dict` reads it: every key it leaves out
//! takes OneTrainer's default (`onetrainer_defaults.json`, written by OneTrainer's own code,
//! tests/fixtures/make_onetrainer_configs.py), not train.json's. Files of config version 11
//! (OneTrainer since 2026-07) and 10 (migrated as OneTrainer migrates them), and the built-in
//! presets (no version, read as the UI reads them) are taken. Paths are relative to the working
//! directory, as OneTrainer opens them (its launch scripts start in its own folder); a path not
//! found there is looked for beside the config.
//!
//! Each key of OneTrainer's config has a rule ([`super::onetrainer_keys`]): translated into
//! train.json's keys, an optimizer.json object (`super::onetrainer_training`) and a dataset of
//! OneTrainer's concepts (`super::onetrainer_concepts`); ignored because it belongs to another
//! model type; listed in one note because it changes only speed, memory layout or logging; or
//! refused, with the reason, when it is not at OneTrainer's default. `--set` overrides apply to
//! the file's keys in OneTrainer's names (`--set unet.learning_rate=1e-5`, as OneTrainer's
//! `--config-value`), or sdtrain's. A train.json key that is not one of OneTrainer's passes
//! through, so a OneTrainer config can use sdtrain's own settings (`vram_limit_gb`, …).
//! Where sdtrain's way differs from OneTrainer's in a way that changes the numbers but not the
//! run's intent (bucket sizes, how a caption is dropped), the run prints the difference.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use super::error::ConfigError;
use super::kohya_config::KohyaData;
use super::onetrainer_keys::{rule, Rule};

/// The config version OneTrainer writes (its `TrainConfig.config_version`).
pub const CURRENT_VERSION: i64 = 11;

/// OneTrainer's defaults, written by its own code.
const DEFAULTS: &str = include_str!("onetrainer_defaults.json");

/// The translated file.
#[derive(Debug, Clone)]
pub(super) struct OneTrainerImport {
    /// train.json's keys.
    pub train: Map<String, Value>,
    /// optimizer.json's object.
    pub optimizer: Map<String, Value>,
    /// The concepts, as dataset subsets.
    pub data: KohyaData,
    /// The warmup as a fraction of the run, when OneTrainer's is one.
    pub warmup_fraction: Option<f64>,
    /// `--set` arguments by the train.json key they set.
    pub set_args: HashMap<String, String>,
}

/// Whether a parsed `.json` config is OneTrainer's: it names OneTrainer's training method,
/// model type or base model, none of which train.json has.
pub(super) fn is_onetrainer(obj: &Map<String, Value>) -> bool {
    ["training_method", "model_type", "base_model_name"]
        .iter()
        .any(|k| obj.contains_key(*k))
}

/// OneTrainer's defaults: `train`, `concept` and `sample`.
pub(super) fn defaults() -> &'static Map<String, Value> {
    static CELL: std::sync::OnceLock<Map<String, Value>> = std::sync::OnceLock::new();
    CELL.get_or_init(|| match serde_json::from_str(DEFAULTS) {
        Ok(Value::Object(m)) => m,
        _ => Map::new(),
    })
}

fn default_section(name: &str) -> &'static Map<String, Value> {
    static EMPTY: std::sync::OnceLock<Map<String, Value>> = std::sync::OnceLock::new();
    match defaults().get(name) {
        Some(Value::Object(m)) => m,
        _ => EMPTY.get_or_init(Map::new),
    }
}

/// Translates the OneTrainer config at `path` (already parsed into `obj`).
pub(super) fn import(
    path: &Path,
    mut obj: Map<String, Value>,
    overrides: &[String],
) -> Result<OneTrainerImport, ConfigError> {
    migrate(path, &mut obj)?;
    // OneTrainer's `secrets` (a Hugging Face token, cloud keys), which it saves only when asked;
    // nothing of sdtrain's reads them.
    obj.remove("secrets");
    let set_args = super::overrides::apply_all(&mut obj, overrides)?;
    let mut t = Translation::new(path, obj)?;
    t.run()?;
    let set_args = set_args
        .into_iter()
        .flat_map(|(k, arg)| t.renamed(&k).into_iter().map(move |to| (to, arg.clone())))
        .collect();
    t.finish(set_args)
}

/// OneTrainer's migrations: version 11 as it is, 10 migrated as OneTrainer's `__migration_10`
/// does, a preset without a version as the UI loads one (unmigrated). Older files are refused:
/// OneTrainer migrates them when it opens them, and its UI saves them again as version 11.
fn migrate(path: &Path, obj: &mut Map<String, Value>) -> Result<(), ConfigError> {
    let version = match obj.get("__version") {
        None => return Ok(()),
        Some(v) => v
            .as_i64()
            .ok_or_else(|| invalid(path, "__version", format!("must be an integer (got {v})")))?,
    };
    match version {
        CURRENT_VERSION => Ok(()),
        10 => {
            migrate_10(obj);
            Ok(())
        }
        v if v > CURRENT_VERSION => {
            crate::console::say(format_args!(
                "warning: {}: written by a newer OneTrainer (config version {v}; sdtrain knows \
                 version {CURRENT_VERSION}); keys it does not know are refused by name",
                path.display()
            ));
            Ok(())
        }
        v => Err(invalid(
            path,
            "__version",
            format!(
                "is {v}: written by an older OneTrainer; open it in a current OneTrainer and \
                 save it (which migrates it to version {CURRENT_VERSION}), then train from that"
            ),
        )),
    }
}

/// OneTrainer's `__migration_10`: the global checkpointing and offloading settings go to each
/// part, and `SAFETENSORS` outputs become the legacy formats they were.
fn migrate_10(obj: &mut Map<String, Value>) {
    let gc = obj
        .remove("gradient_checkpointing")
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| "ON".into());
    obj.remove("enable_activation_offloading");
    obj.remove("layer_offload_fraction");
    let offload = obj
        .remove("enable_async_offloading")
        .unwrap_or(Value::Bool(true));
    obj.insert("async_offloading".into(), offload);
    for part in ["unet", "text_encoder", "text_encoder_2", "vae"] {
        if let Some(Value::Object(p)) = obj.get_mut(part) {
            p.insert("gradient_checkpointing".into(), json!(gc != "OFF"));
        }
    }
    if obj.get("output_model_format").and_then(Value::as_str) == Some("SAFETENSORS") {
        let format = match obj.get("training_method").and_then(Value::as_str) {
            Some("LORA") => Some("LEGACY_LORA"),
            Some("EMBEDDING") => None,
            _ => Some("LEGACY_SAFETENSORS"),
        };
        if let Some(f) = format {
            obj.insert("output_model_format".into(), json!(f));
        }
    }
    obj.insert("__version".into(), json!(CURRENT_VERSION));
}

pub(super) fn invalid(path: &Path, field: &str, message: String) -> ConfigError {
    ConfigError::Invalid {
        file: path.to_path_buf(),
        field: field.to_string(),
        message,
    }
}

/// Whether two JSON values are equal, numbers by value (OneTrainer writes `1.0` where its
/// defaults hold `1`).
pub(super) fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}

/// The value at a dotted path (`unet.learning_rate`) of a OneTrainer object.
pub(super) fn at_path<'a>(root: &'a Map<String, Value>, path: &str) -> Option<&'a Value> {
    let mut parts = path.split('.');
    let mut v = root.get(parts.next()?)?;
    for part in parts {
        v = v.as_object()?.get(part)?;
    }
    Some(v)
}

/// `file` over `defaults`, object by object, as OneTrainer's `from_dict` fills a config: a key
/// the file leaves out keeps its default.
fn merged(defaults: &Map<String, Value>, file: &Map<String, Value>) -> Map<String, Value> {
    let mut out = defaults.clone();
    for (k, v) in file {
        let value = match (defaults.get(k), v) {
            (Some(Value::Object(d)), Value::Object(f)) => Value::Object(merged(d, f)),
            _ => v.clone(),
        };
        out.insert(k.clone(), value);
    }
    out
}

/// A concept over OneTrainer's concept defaults, after its migrations: a concept file without
/// a version names its balancing `repeats` (OneTrainer's concept migration 0), and version 1
/// marks validation concepts with `validation_concept` (migration 1).
pub(super) fn merged_concept(c: &Map<String, Value>) -> Map<String, Value> {
    let mut c = c.clone();
    let version = c.get("__version").and_then(Value::as_i64).unwrap_or(0);
    if version == 0 {
        if let Some(r) = c.remove("repeats") {
            c.insert("balancing".into(), r);
        }
    }
    if version <= 1 {
        if let Some(v) = c.remove("validation_concept") {
            let ty = if v.as_bool() == Some(true) {
                "VALIDATION"
            } else {
                "STANDARD"
            };
            c.insert("type".into(), json!(ty));
        }
    }
    merged(default_section("concept"), &c)
}

/// The translation in progress.
pub(super) struct Translation<'a> {
    pub path: &'a Path,
    /// The file's keys over OneTrainer's defaults.
    config: Map<String, Value>,
    /// train.json's keys.
    pub train: Map<String, Value>,
    /// The `adapter` section.
    pub adapter: Map<String, Value>,
    /// The `embedding` section.
    pub embedding: Map<String, Value>,
    /// Where each train.json key came from (the OneTrainer key), for messages.
    origin: HashMap<String, String>,
    /// Keys that change only speed, memory layout or logging, set away from their default.
    no_effect: BTreeSet<String>,
    /// Where sdtrain's numbers differ from OneTrainer's.
    differences: std::cell::RefCell<Vec<String>>,
    /// Other things the run should say about the file.
    remarks: std::cell::RefCell<Vec<String>>,
}

impl<'a> Translation<'a> {
    fn new(path: &'a Path, file: Map<String, Value>) -> Result<Self, ConfigError> {
        let defaults = default_section("train");
        if defaults.is_empty() {
            return Err(invalid(
                path,
                "__version",
                "sdtrain's copy of OneTrainer's defaults did not parse (a build error)".into(),
            ));
        }
        let train_keys = super::strict::known_keys::<super::train_file::TrainFile>();
        let mut t = Self {
            path,
            config: Map::new(),
            train: Map::new(),
            adapter: Map::new(),
            embedding: Map::new(),
            origin: HashMap::new(),
            no_effect: BTreeSet::new(),
            differences: Default::default(),
            remarks: Default::default(),
        };
        let mut own = Map::new();
        for (key, value) in file {
            if defaults.contains_key(&key) || key == "__version" {
                own.insert(key, value);
            } else if train_keys.contains(&key) {
                t.set(&key, value, &key)?;
            } else {
                let candidates = defaults
                    .keys()
                    .map(String::as_str)
                    .chain(train_keys.iter().map(String::as_str));
                return Err(ConfigError::UnknownKey {
                    file: path.to_path_buf(),
                    key: key.clone(),
                    set_arg: None,
                    hint: Some(match super::strict::suggest(&key, candidates) {
                        Some(s) => format!("did you mean `{s}`?"),
                        None => format!(
                            "neither a key of OneTrainer's config (version {CURRENT_VERSION}) \
                             nor a train.json key"
                        ),
                    }),
                });
            }
        }
        t.config = merged(defaults, &own);
        Ok(t)
    }

    pub fn invalid(&self, field: &str, message: String) -> ConfigError {
        invalid(self.path, field, message)
    }

    /// A note about the file that is not a difference.
    pub fn remark(&self, text: String) {
        let mut r = self.remarks.borrow_mut();
        if !r.contains(&text) {
            r.push(text);
        }
    }

    /// Notes where sdtrain's numbers will differ from OneTrainer's ("unlike OneTrainer, …").
    pub fn differences_note(&self, text: String) {
        let mut d = self.differences.borrow_mut();
        if !d.contains(&text) {
            d.push(text);
        }
    }

    /// Writes train.json's `key` for OneTrainer's `from`.
    pub fn set(&mut self, key: &str, value: Value, from: &str) -> Result<(), ConfigError> {
        if let Some(first) = self.origin.get(key) {
            if self.train.get(key).is_some_and(|v| !same(v, &value)) {
                return Err(self.invalid(
                    from,
                    format!("and `{first}` both set sdtrain's `{key}`, to different values"),
                ));
            }
        }
        self.origin.insert(key.to_string(), from.to_string());
        self.train.insert(key.to_string(), value);
        Ok(())
    }

    /// The train.json keys a OneTrainer key was written to, for `--set` blame.
    fn renamed(&self, key: &str) -> Vec<String> {
        let top = key.split('.').next().unwrap_or(key);
        let mut keys: Vec<String> = self
            .origin
            .iter()
            .filter(|(_, from)| from.split('.').next() == Some(top))
            .map(|(k, _)| k.clone())
            .collect();
        if keys.is_empty() {
            keys.push(key.to_string());
        }
        keys
    }

    /// The value at a dotted path (`unet.learning_rate`); `Null` when absent.
    pub fn get(&self, path: &str) -> &Value {
        at_path(&self.config, path).unwrap_or(&Value::Null)
    }

    /// OneTrainer's default at a dotted path.
    pub fn default_of(&self, path: &str) -> &'static Value {
        at_path(default_section("train"), path).unwrap_or(&Value::Null)
    }

    /// Whether the key holds OneTrainer's default.
    pub fn is_default(&self, path: &str) -> bool {
        same(self.get(path), self.default_of(path))
    }

    /// An error unless the key holds OneTrainer's default.
    pub fn refuse_unless_default(&self, path: &str, why: &str) -> Result<(), ConfigError> {
        if self.is_default(path) {
            return Ok(());
        }
        Err(self.invalid(
            path,
            format!(
                "is {} (OneTrainer's default is {}): {why}",
                self.get(path),
                self.default_of(path)
            ),
        ))
    }

    pub fn f64(&self, path: &str) -> Result<f64, ConfigError> {
        self.opt_f64(path)?
            .ok_or_else(|| self.invalid(path, "must be a number (got null)".into()))
    }

    /// A number, or `None` for null. OneTrainer reads `"inf"` as infinity.
    pub fn opt_f64(&self, path: &str) -> Result<Option<f64>, ConfigError> {
        match self.get(path) {
            Value::Null => Ok(None),
            Value::Number(n) => Ok(n.as_f64()),
            Value::String(s) if s == "inf" => Ok(Some(f64::INFINITY)),
            v => Err(self.invalid(path, format!("must be a number (got {v})"))),
        }
    }

    pub fn i64(&self, path: &str) -> Result<i64, ConfigError> {
        match self.get(path) {
            // Python's `int()` of a whole float, within the range a float holds exactly.
            Value::Number(n) => n
                .as_i64()
                .or_else(|| {
                    n.as_f64()
                        .filter(|f| f.fract() == 0.0 && f.abs() <= 9_007_199_254_740_992.0)
                        .map(|f| f as i64)
                })
                .filter(|i| i.unsigned_abs() <= 1 << 53)
                .ok_or_else(|| self.invalid(path, format!("must be an integer (got {n})"))),
            v => Err(self.invalid(path, format!("must be an integer (got {v})"))),
        }
    }

    pub fn bool(&self, path: &str) -> Result<bool, ConfigError> {
        match self.get(path) {
            Value::Bool(b) => Ok(*b),
            v => Err(self.invalid(path, format!("must be true or false (got {v})"))),
        }
    }

    pub fn str(&self, path: &str) -> Result<&str, ConfigError> {
        match self.get(path) {
            Value::String(s) => Ok(s),
            v => Err(self.invalid(path, format!("must be a text (got {v})"))),
        }
    }

    /// An enum's name, one of `allowed`.
    pub fn choice(&self, path: &str, allowed: &[&str]) -> Result<&str, ConfigError> {
        let s = self.str(path)?;
        if allowed.contains(&s) {
            return Ok(s);
        }
        Err(self.invalid(
            path,
            format!("is \"{s}\"; sdtrain takes {}", quoted_list(allowed)),
        ))
    }

    /// An input path as OneTrainer opens it: relative to the working directory, else beside
    /// the config. Absolute in the result.
    pub fn input_path(&self, field: &str, raw: &str) -> Result<PathBuf, ConfigError> {
        let p = Path::new(raw);
        let found = if p.is_absolute() || p.exists() {
            p.to_path_buf()
        } else {
            let beside = self.path.parent().map(|d| d.join(p));
            beside
                .filter(|b| b.exists())
                .unwrap_or_else(|| p.to_path_buf())
        };
        std::path::absolute(&found)
            .map_err(|e| self.invalid(field, format!("is not a usable path: {e}")))
    }

    /// Every key by its rule.
    fn run(&mut self) -> Result<(), ConfigError> {
        let keys: Vec<String> = self.config.keys().cloned().collect();
        for key in keys {
            match rule(&key) {
                Rule::Code | Rule::OtherModel => {}
                Rule::NoEffect => {
                    if !self.is_default(&key) {
                        self.no_effect.insert(key);
                    }
                }
                Rule::Refused(why) => self.refuse_unless_default(&key, why)?,
            }
        }
        Ok(())
    }

    fn finish(
        mut self,
        set_args: HashMap<String, String>,
    ) -> Result<OneTrainerImport, ConfigError> {
        super::onetrainer_training::model(&mut self)?;
        let (optimizer, warmup_fraction) = super::onetrainer_training::translate(&mut self)?;
        let subsets = super::onetrainer_concepts::concepts(&mut self)?;
        super::onetrainer_concepts::samples(&mut self)?;
        if !self.adapter.is_empty() {
            let adapter = Value::Object(std::mem::take(&mut self.adapter));
            self.set("adapter", adapter, "training_method")?;
        }
        if !self.embedding.is_empty() {
            let embedding = Value::Object(std::mem::take(&mut self.embedding));
            self.set("embedding", embedding, "embedding")?;
        }
        self.notes();
        Ok(OneTrainerImport {
            train: self.train,
            optimizer,
            data: KohyaData {
                file: self.path.to_path_buf(),
                command_line: toml::Table::new(),
                subsets,
            },
            warmup_fraction,
            set_args,
        })
    }

    fn notes(&self) {
        if !self.no_effect.is_empty() {
            let list: Vec<&str> = self.no_effect.iter().map(String::as_str).collect();
            crate::console::say(format_args!(
                "note: {}: {} {} only speed, memory layout, logging or OneTrainer's own \
                 files; sdtrain decides those its own way and leaves them alone (`--dry-run` \
                 prints the memory plan)",
                self.path.display(),
                list.join(", "),
                if list.len() == 1 { "changes" } else { "change" }
            ));
        }
        for r in self.remarks.borrow().iter() {
            crate::console::say(format_args!("note: {}: {r}", self.path.display()));
        }
        for d in self.differences.borrow().iter() {
            crate::console::say(format_args!(
                "note: {}: unlike OneTrainer, {d}",
                self.path.display()
            ));
        }
    }
}

pub(super) fn quoted_list(items: &[&str]) -> String {
    let quoted: Vec<String> = items.iter().map(|s| format!("\"{s}\"")).collect();
    match quoted.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}
