//! A kohya sd-scripts config file (`--config_file`, a `.toml` of the training script's options):
//! `sdtrain --config kohya.toml` trains what `train_network.py --config_file kohya.toml` (or
//! `sdxl_train_network.py`, `fine_tune.py`, `train_db.py`, `sdxl_train.py`) would, read as kohya's
//! `read_config_from_file` reads it: every table's keys are lifted to the top level, and an option
//! left out takes kohya's default (`super::kohya_config_keys::defaults`), not train.json's.
//!
//! The file is translated into a train.json object, an optimizer.json object
//! (`super::kohya_optimizer`) and the command-line level of kohya's dataset options
//! ([`KohyaData`]), then resolved as train.json is. `--set` overrides apply to the file's keys
//! before the translation, in kohya's names or sdtrain's. A key that is not one of kohya's options
//! but is a train.json key (`vram_limit_gb`, `ema_decay_rate`, …) is passed through, so a kohya
//! config can use sdtrain's own settings; anything else is an error, as is an option sdtrain
//! cannot honour (with the reason), unless it is off. Options that change only speed or logging
//! are listed in one note.
//!
//! Which script: `network_module` makes an adapter run (`networks.lora`: `lora`, or `locon` with
//! `conv_dim`; `lycoris.kohya`: its `algo`); without it the run is a full fine-tune, whose text
//! encoder trains only with `train_text_encoder` (fine_tune.py's and sdxl_train.py's rule;
//! train_db.py trains it always).

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use super::error::ConfigError;
use super::kohya_config_keys::{defaults, rule, Rule};
use super::train_file::TrainFile;

/// The translated file.
#[derive(Debug, Clone)]
pub(super) struct KohyaImport {
    /// train.json's keys.
    pub train: Map<String, Value>,
    /// optimizer.json's object.
    pub optimizer: Map<String, Value>,
    /// The dataset options.
    pub data: KohyaData,
    /// The warmup and decay, as kohya measures them against the run's length.
    pub lengths: super::kohya_optimizer::RunLengths,
    /// `--set` arguments by the key they set.
    pub set_args: HashMap<String, String>,
}

/// kohya's dataset options from the command line (here: the config file), and the datasets it
/// makes of `train_data_dir`/`reg_data_dir`/`in_json` when no `dataset_config` names them.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KohyaData {
    /// The kohya config, for messages.
    pub file: PathBuf,
    /// Dataset and subset options, under a dataset config's `[general]`.
    pub command_line: toml::Table,
    /// `train_data_dir`'s datasets: one dataset, its subsets with a name for messages.
    pub subsets: Vec<(String, toml::Table)>,
}

/// Reads and translates the kohya config at `path`.
pub(super) fn import(path: &Path, overrides: &[String]) -> Result<KohyaImport, ConfigError> {
    let text = crate::text_file::read_unicode(path).map_err(|e| match e {
        crate::text_file::TextFileError::Io { path, source } => {
            ConfigError::Read { file: path, source }
        }
        crate::text_file::TextFileError::Encoding { path, reason } => {
            ConfigError::Encoding { file: path, reason }
        }
    })?;
    let top: toml::Table = toml::from_str(crate::py_json::without_bom(&text)).map_err(|e| {
        ConfigError::TomlSyntax {
            file: path.to_path_buf(),
            message: e.to_string(),
        }
    })?;
    if top.contains_key("datasets") {
        return Err(invalid(
            path,
            "datasets",
            "makes this a kohya dataset config, not a training config: name it from one with \
             dataset_config = \"<this file>\" (or from train.json's dataset_config)"
                .into(),
        ));
    }
    let mut flat = flatten(top, path)?;
    let set_args = super::overrides::apply_all(&mut flat, overrides)?;
    let mut t = Translation::new(path);
    t.run(&flat)?;
    let set_args = set_args
        .into_iter()
        .flat_map(|(k, arg)| t.renamed(&k).into_iter().map(move |to| (to, arg.clone())))
        .collect();
    t.finish(set_args)
}

/// kohya's `read_config_from_file`: a table's keys are lifted to the top level. A key given in
/// two places at different values is refused (kohya takes the last one silently); a table in a
/// table is refused (kohya would pass it on as a dict).
fn flatten(top: toml::Table, path: &Path) -> Result<Map<String, Value>, ConfigError> {
    let mut flat = Map::new();
    let mut seen: HashMap<String, String> = HashMap::new();
    for (section, value) in top {
        let entries = match value {
            toml::Value::Table(t) => t
                .into_iter()
                .map(|(k, v)| (k, v, section.clone()))
                .collect(),
            v => vec![(section.clone(), v, String::new())],
        };
        for (key, v, at) in entries {
            if let toml::Value::Table(_) = v {
                return Err(invalid(
                    path,
                    &format!("{at}.{key}"),
                    "is a table inside a table; kohya reads one level of sections".into(),
                ));
            }
            let v = json_of(v);
            if let Some(first) = seen.get(&key) {
                if flat.get(&key) != Some(&v) {
                    let place = |s: &str| match s {
                        "" => "the top level".to_string(),
                        s => format!("[{s}]"),
                    };
                    return Err(invalid(
                        path,
                        &key,
                        format!(
                            "is set in {} and in {} to different values; kohya lifts every \
                             section's keys to one level, so give it once",
                            place(first),
                            place(&at)
                        ),
                    ));
                }
            }
            seen.insert(key.clone(), at);
            flat.insert(key, v);
        }
    }
    Ok(flat)
}

/// A TOML value as JSON (a date as its text).
fn json_of(v: toml::Value) -> Value {
    match v {
        toml::Value::String(s) => Value::String(s),
        toml::Value::Integer(i) => json!(i),
        toml::Value::Float(f) => json!(f),
        toml::Value::Boolean(b) => Value::Bool(b),
        toml::Value::Datetime(d) => Value::String(d.to_string()),
        toml::Value::Array(a) => Value::Array(a.into_iter().map(json_of).collect()),
        toml::Value::Table(t) => {
            Value::Object(t.into_iter().map(|(k, v)| (k, json_of(v))).collect())
        }
    }
}

/// A JSON value as TOML (`None` for `null`).
pub(super) fn toml_of(v: &Value) -> Option<toml::Value> {
    Some(match v {
        Value::Null => return None,
        Value::Bool(b) => toml::Value::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => toml::Value::Integer(i),
            None => toml::Value::Float(n.as_f64()?),
        },
        Value::String(s) => toml::Value::String(s.clone()),
        Value::Array(a) => toml::Value::Array(a.iter().filter_map(toml_of).collect()),
        Value::Object(o) => toml::Value::Table(
            o.iter()
                .filter_map(|(k, v)| Some((k.clone(), toml_of(v)?)))
                .collect(),
        ),
    })
}

pub(super) fn invalid(path: &Path, field: &str, message: String) -> ConfigError {
    ConfigError::Invalid {
        file: path.to_path_buf(),
        field: field.to_string(),
        message,
    }
}

/// Whether kohya treats the value as off: false, 0, an empty text or list, or nothing.
pub(super) fn is_off(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    }
}

/// The translation in progress.
pub(super) struct Translation<'a> {
    pub path: &'a Path,
    pub train: Map<String, Value>,
    pub adapter: Map<String, Value>,
    pub data: toml::Table,
    /// Where each train.json key came from (the kohya option), to refuse two that set one key.
    origin: HashMap<String, String>,
    /// The options that change nothing here, for the note.
    no_effect: BTreeSet<String>,
    /// kohya_ss's own settings, which sd-scripts does not read either.
    gui_only: BTreeSet<String>,
    /// Options read by code, with their values.
    pub code: Map<String, Value>,
}

impl<'a> Translation<'a> {
    fn new(path: &'a Path) -> Self {
        Self {
            path,
            train: Map::new(),
            adapter: Map::new(),
            data: toml::Table::new(),
            origin: HashMap::new(),
            no_effect: BTreeSet::new(),
            gui_only: BTreeSet::new(),
            code: Map::new(),
        }
    }

    pub fn invalid(&self, field: &str, message: String) -> ConfigError {
        invalid(self.path, field, message)
    }

    /// Writes train.json's `key` for kohya's `from`; two options for one key are refused.
    pub fn set(&mut self, key: &str, value: Value, from: &str) -> Result<(), ConfigError> {
        if let Some(first) = self.origin.get(key) {
            if self.train.get(key) != Some(&value) {
                return Err(self.invalid(
                    from,
                    format!(
                        "and `{first}` both set sdtrain's `{key}`, to different values; give one"
                    ),
                ));
            }
        }
        self.origin.insert(key.to_string(), from.to_string());
        self.train.insert(key.to_string(), value);
        Ok(())
    }

    /// The train.json keys a kohya option was written to, for `--set` blame.
    fn renamed(&self, kohya: &str) -> Vec<String> {
        let mut keys: Vec<String> = self
            .origin
            .iter()
            .filter(|(_, from)| from.as_str() == kohya)
            .map(|(k, _)| k.clone())
            .collect();
        if keys.is_empty() {
            keys.push(kohya.to_string());
        }
        keys
    }

    fn run(&mut self, flat: &Map<String, Value>) -> Result<(), ConfigError> {
        let train_keys = super::strict::known_keys::<TrainFile>();
        for (key, value) in flat {
            match rule(key) {
                Some(r) => self.apply(key, value, r)?,
                None if train_keys.iter().any(|k| k == key) => {
                    self.set(key, value.clone(), key)?;
                }
                None => {
                    let kohya = super::kohya_config_keys::KEYS.iter().map(|(k, _)| *k);
                    let candidates: Vec<&str> =
                        kohya.chain(train_keys.iter().map(String::as_str)).collect();
                    return Err(ConfigError::UnknownKey {
                        file: self.path.to_path_buf(),
                        key: key.clone(),
                        set_arg: None,
                        hint: Some(match super::strict::suggest(key, candidates) {
                            Some(s) => format!("did you mean `{s}`?"),
                            None => "neither an option of kohya's training scripts nor a \
                                     train.json key"
                                .to_string(),
                        }),
                    });
                }
            }
        }
        Ok(())
    }

    fn apply(&mut self, key: &str, value: &Value, r: Rule) -> Result<(), ConfigError> {
        match r {
            Rule::Same => self.set(key, value.clone(), key),
            Rule::To(to) => self.set(to, value.clone(), key),
            Rule::Adapter(to) => {
                self.adapter.insert(to.to_string(), value.clone());
                Ok(())
            }
            Rule::Data => {
                if let Some(v) = toml_of(value) {
                    self.data.insert(key.to_string(), v);
                }
                Ok(())
            }
            Rule::Code => {
                self.code.insert(key.to_string(), value.clone());
                Ok(())
            }
            Rule::NoEffect => {
                if !is_off(value) {
                    self.no_effect.insert(key.to_string());
                }
                Ok(())
            }
            Rule::Refused(why) if !is_off(value) => Err(self.invalid(key, why.to_string())),
            Rule::OtherModel if !is_off(value) => Err(self.invalid(
                key,
                "is an option of kohya's scripts for SD3, FLUX.1 or Lumina; sdtrain trains \
                 SD1.x, SD2.x and SDXL"
                    .into(),
            )),
            Rule::Refused(_) | Rule::OtherModel => Ok(()),
            Rule::GuiOnly => {
                self.gui_only.insert(key.to_string());
                Ok(())
            }
        }
    }

    /// The option read by code, if the file gives it (`null` counts as absent).
    pub fn take(&mut self, key: &str) -> Option<Value> {
        self.code.remove(key).filter(|v| !v.is_null())
    }

    pub fn take_f64(&mut self, key: &str) -> Result<Option<f64>, ConfigError> {
        match self.take(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.invalid(key, format!("must be a number (got {v})"))),
        }
    }

    pub fn take_i64(&mut self, key: &str) -> Result<Option<i64>, ConfigError> {
        match self.take(key) {
            None => Ok(None),
            Some(v) => v
                .as_i64()
                .map(Some)
                .ok_or_else(|| self.invalid(key, format!("must be an integer (got {v})"))),
        }
    }

    pub fn take_bool(&mut self, key: &str) -> Result<bool, ConfigError> {
        match self.take(key) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(b),
            Some(v) => Err(self.invalid(key, format!("must be true or false (got {v})"))),
        }
    }

    pub fn take_str(&mut self, key: &str) -> Result<Option<String>, ConfigError> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.invalid(key, format!("must be a text (got {v})"))),
        }
    }

    /// kohya's `network_args`/`optimizer_args`: a list of `key=value` texts (or one text of
    /// them split at spaces, kohya_ss's field), each split at its first `=` as kohya splits it.
    pub fn take_key_values(&mut self, key: &str) -> Result<Vec<(String, String)>, ConfigError> {
        let items: Vec<String> = match self.take(key) {
            None => return Ok(Vec::new()),
            Some(Value::String(s)) => s.split_whitespace().map(str::to_string).collect(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(self.invalid(
                        key,
                        format!("holds {other}; each entry is a `key=value` text"),
                    )),
                })
                .collect::<Result<_, _>>()?,
            Some(v) => {
                return Err(self.invalid(
                    key,
                    format!("must be a list of `key=value` texts (got {v})"),
                ))
            }
        };
        items
            .iter()
            .map(|item| match item.split_once('=') {
                Some((k, v)) => Ok((k.trim().to_string(), v.trim().to_string())),
                None => Err(self.invalid(
                    key,
                    format!("holds \"{item}\"; each entry is `key=value`, as kohya splits it"),
                )),
            })
            .collect()
    }

    fn finish(mut self, set_args: HashMap<String, String>) -> Result<KohyaImport, ConfigError> {
        let mode = super::kohya_network::network(&mut self)?;
        self.stop_and_precision(mode.as_deref())?;
        let subsets = super::kohya_datasets::datasets(&mut self)?;
        let cx = super::dataset_config_schema::TomlCtx { file: self.path };
        super::dataset_config_schema::check_command_line(&self.data, &cx)?;
        let (optimizer, lengths) = super::kohya_optimizer::optimizer(&mut self, mode.as_deref())?;
        if mode.is_some() && self.take("stop_text_encoder_training").is_some() {
            // kohya_ss writes it for LoRA too; only train_db.py reads it.
            self.gui_only.insert("stop_text_encoder_training".into());
        }
        if let Some(mode) = mode {
            self.set("mode", Value::String(mode), "network_module")?;
            let adapter = std::mem::take(&mut self.adapter);
            self.set("adapter", Value::Object(adapter), "network_module")?;
        } else {
            self.set("mode", json!("full"), "network_module")?;
            if let Some(key) = self.adapter.keys().next() {
                return Err(self.invalid(
                    key,
                    "is an option of the network scripts; this config has no network_module \
                     (a full fine-tune)"
                        .into(),
                ));
            }
        }
        if let Some((key, _)) = self.code.iter().next() {
            return Err(self.invalid(
                key,
                "is not read in this kind of run (an option of another of kohya's scripts)".into(),
            ));
        }
        if !self.no_effect.is_empty() {
            let list: Vec<&str> = self.no_effect.iter().map(String::as_str).collect();
            crate::console::say(format_args!(
                "note: {}: {} change only speed, memory layout, logging or uploads in kohya's \
                 scripts; sdtrain decides those its own way and leaves them alone (`--dry-run` \
                 prints the memory plan)",
                self.path.display(),
                list.join(", ")
            ));
        }
        if !self.gui_only.is_empty() {
            let list: Vec<&str> = self.gui_only.iter().map(String::as_str).collect();
            crate::console::say(format_args!(
                "note: {}: {} are kohya_ss's own settings, which sd-scripts does not read \
                 either; left alone",
                self.path.display(),
                list.join(", ")
            ));
        }
        Ok(KohyaImport {
            train: self.train,
            optimizer,
            data: KohyaData {
                file: self.path.to_path_buf(),
                command_line: self.data,
                subsets,
            },
            lengths,
            set_args,
        })
    }

    /// The run's length, its precision and what it saves.
    fn stop_and_precision(&mut self, mode: Option<&str>) -> Result<(), ConfigError> {
        let steps = self.take_i64("max_train_steps")?;
        match self.take_i64("max_train_epochs")? {
            // kohya: the epochs decide the steps when both are given.
            Some(e) => self.set("max_epochs", json!(e), "max_train_epochs")?,
            None => {
                let s = steps.unwrap_or(defaults::MAX_TRAIN_STEPS);
                self.set("max_steps", json!(s), "max_train_steps")?;
            }
        }
        let norm = self.take_f64("max_grad_norm")?;
        let norm = norm.unwrap_or(defaults::MAX_GRAD_NORM);
        self.set("max_grad_norm", json!(norm), "max_grad_norm")?;
        let amp = match self.take_str("mixed_precision")?.as_deref() {
            None | Some("no") => json!(false),
            Some(p @ ("fp16" | "bf16")) => json!(p),
            Some(other) => {
                return Err(self.invalid(
                    "mixed_precision",
                    format!("is \"{other}\"; kohya's choices are \"no\", \"fp16\" and \"bf16\""),
                ))
            }
        };
        self.set("amp", amp, "mixed_precision")?;
        match (self.take_bool("full_bf16")?, self.take_bool("full_fp16")?) {
            (true, true) => {
                return Err(
                    self.invalid("full_bf16", "and full_fp16 are both true; give one".into())
                )
            }
            (true, false) => self.set("weight_dtype", json!("bf16"), "full_bf16")?,
            (false, true) => self.set("weight_dtype", json!("fp16"), "full_fp16")?,
            (false, false) => {}
        }
        // sdxl_train.py's per-block rates: train.json's key checks them.
        if let Some(rates) = self.take("block_lr").filter(|v| !is_off(v)) {
            self.set("block_lr", rates, "block_lr")?;
        }
        // fp8_base_unet wins: kohya keeps the text encoders in the compute dtype with it.
        match (
            self.take_bool("fp8_base")?,
            self.take_bool("fp8_base_unet")?,
        ) {
            (_, true) => self.set("base_weight_dtype", json!("fp8_unet"), "fp8_base_unet")?,
            (true, false) => self.set("base_weight_dtype", json!("fp8"), "fp8_base")?,
            (false, false) => {}
        }
        self.resume()?;
        self.states_kept()?;
        self.kohya_defaults()?;
        self.loss_type()?;
        self.save_precision(mode)?;
        self.prediction()?;
        match self.take_i64("validate_every_n_epochs")? {
            None | Some(1) => {}
            Some(n) => {
                return Err(self.invalid(
                    "validate_every_n_epochs",
                    format!(
                        "is {n}: sdtrain validates at the end of every epoch, or every \
                         validate_every_n_steps steps"
                    ),
                ))
            }
        }
        Ok(())
    }

    /// kohya's defaults where train.json's (EveryDream2's) differ and the file is silent: the
    /// name `last`, no noise offset (EveryDream2: 0.02), no caption dropout (0.04), a random
    /// seed (555), no checkpointing.
    fn kohya_defaults(&mut self) -> Result<(), ConfigError> {
        let dropout = self
            .data
            .get("caption_dropout_rate")
            .and_then(|v| v.as_float().or(v.as_integer().map(|i| i as f64)))
            .unwrap_or(0.0);
        for (key, value) in [
            // kohya names an unnamed run's final file `last.safetensors`.
            ("output_name", json!("last")),
            ("noise_offset", json!(0.0)),
            ("cond_dropout", json!(dropout)),
            ("seed", json!(-1)),
            ("gradient_checkpointing", json!(false)),
        ] {
            let named = key == "output_name" && self.train.contains_key("project_name");
            if !self.train.contains_key(key) && !named {
                self.set(key, value, key)?;
            }
        }
        Ok(())
    }

    /// `resume`: sdtrain's `resume_ckpt` (a run folder or save point). A state folder that
    /// kohya's accelerate wrote is refused by name: its pickled states are not read.
    fn resume(&mut self) -> Result<(), ConfigError> {
        let Some(raw) = self.take_str("resume")? else {
            return Ok(());
        };
        let dir = Path::new(&raw);
        let accelerate = ["optimizer.bin", "random_states_0.pkl", "scheduler.bin"]
            .iter()
            .any(|f| dir.join(f).is_file());
        if accelerate {
            return Err(self.invalid(
                "resume",
                format!(
                    "{raw} is a training state that kohya's scripts saved (accelerate's pickles), \
                     which sdtrain cannot read; start from its weights with network_weights (an \
                     adapter) or pretrained_model_name_or_path, or resume an sdtrain run folder"
                ),
            ));
        }
        self.set("resume_ckpt", json!(raw), "resume")
    }

    /// `save_last_n_epochs_state` / `save_last_n_steps_state`: kohya keeps the states of the
    /// newest N epoch saves, or of the step saves in the last N steps. Where the run saves by
    /// one of the two alone, that is a count of save points, `checkpoints_total_limit`: N, or
    /// `N / save_every_n_steps + 1` (kohya's `get_remove_step_no` keeps the save N steps back
    /// too). Beside saves of the other kind the count differs, and it is refused.
    fn states_kept(&mut self) -> Result<(), ConfigError> {
        let every = |t: &Self, k: &str| t.train.get(k).and_then(Value::as_i64).filter(|n| *n > 0);
        let (by_epochs, by_steps) = (
            every(self, "save_every_n_epochs"),
            every(self, "save_every_n_steps"),
        );
        for (key, mine, other) in [
            ("save_last_n_epochs_state", by_epochs, by_steps),
            ("save_last_n_steps_state", by_steps, by_epochs),
        ] {
            let Some(n) = self.take_i64(key)? else {
                continue;
            };
            let (Some(every), None, true) = (mine, other, n >= 1) else {
                return Err(self.invalid(
                    key,
                    format!(
                        "is {n}: sdtrain keeps the newest save points by count \
                         (checkpoints_total_limit), which matches kohya's rule only when the \
                         run saves by {} alone (save_every_n_epochs or save_every_n_steps)",
                        if key.contains("epochs") {
                            "epochs"
                        } else {
                            "steps"
                        }
                    ),
                ));
            };
            let limit = if key.contains("epochs") {
                n
            } else {
                n / every + 1
            };
            self.set("checkpoints_total_limit", json!(limit), key)?;
        }
        Ok(())
    }

    /// kohya's `loss_type` names: `l2` is sdtrain's `mse`, `huber` its `pseudo_huber`.
    fn loss_type(&mut self) -> Result<(), ConfigError> {
        let ours = match self.take_str("loss_type")?.as_deref() {
            None | Some("l2") => "mse",
            Some("l1") => "l1",
            Some("huber") => "pseudo_huber",
            Some("smooth_l1") => "smooth_l1",
            Some(other) => {
                return Err(self.invalid(
                    "loss_type",
                    format!(
                        "is \"{other}\"; kohya's choices are \"l2\", \"l1\", \"huber\" and \
                         \"smooth_l1\""
                    ),
                ))
            }
        };
        self.set("loss_type", json!(ours), "loss_type")?;
        // kohya's parser always has the Huber settings; only its Huber losses read them.
        for key in ["huber_c", "huber_scale", "huber_schedule"] {
            match self.take(key) {
                Some(v) if matches!(ours, "pseudo_huber" | "smooth_l1") => self.set(key, v, key)?,
                _ => {}
            }
        }
        Ok(())
    }

    /// `save_precision`: an adapter file's dtype (kohya saves f32 without it); a full
    /// fine-tune's single file in f16 or f32.
    fn save_precision(&mut self, mode: Option<&str>) -> Result<(), ConfigError> {
        let p = self.take_str("save_precision")?;
        let bad = |t: &Self, p: &str| {
            t.invalid(
                "save_precision",
                format!("is \"{p}\"; kohya's choices are \"float\", \"fp16\" and \"bf16\""),
            )
        };
        if mode.is_some() {
            let dtype = match p.as_deref() {
                None | Some("float") => "fp32",
                Some(d @ ("fp16" | "bf16")) => d,
                Some(other) => return Err(bad(self, other)),
            };
            self.adapter.insert("save_dtype".into(), json!(dtype));
            return Ok(());
        }
        let full = match p.as_deref() {
            None | Some("float") => true,
            Some("fp16") => false,
            Some("bf16") => {
                return Err(self.invalid(
                    "save_precision",
                    "is \"bf16\": a full fine-tune's single file is saved in f16 or f32 \
                     (\"fp16\" or \"float\"), and its diffusers folder in f32"
                        .into(),
                ))
            }
            Some(other) => return Err(bad(self, other)),
        };
        self.set("save_full_precision", json!(full), "save_precision")
    }

    /// `v_parameterization` names a single file's prediction type; a diffusers folder's
    /// scheduler config says it (and a single file's, when the flag is off, is detected).
    fn prediction(&mut self) -> Result<(), ConfigError> {
        // SD2's architecture is read from the model's files.
        self.take_bool("v2")?;
        if !self.take_bool("v_parameterization")? {
            return Ok(());
        }
        let single = self
            .train
            .get("model")
            .and_then(Value::as_str)
            .is_some_and(|m| {
                let ext = Path::new(m).extension().and_then(|e| e.to_str());
                matches!(
                    ext.map(str::to_ascii_lowercase).as_deref(),
                    Some("safetensors" | "ckpt")
                )
            });
        if single {
            return self.set(
                "prediction_type",
                json!("v_prediction"),
                "v_parameterization",
            );
        }
        crate::console::say(format_args!(
            "note: {}: v_parameterization: a diffusers model's scheduler config says what it \
             predicts, and sdtrain follows it (the run's `model:` line shows it)",
            self.path.display()
        ));
        Ok(())
    }
}

#[cfg(test)]
#[path = "kohya_config_tests.rs"]
mod tests;
