//! train.json's `adapter` section (modes "lora", "locon", "loha", "lokr", "dora"): [`AdapterFile`], parsed strictly like
//! the rest of the file (as part of it, [`super::TrainFile`]), and resolved into an
//! [`AdapterPlan`]. Defaults follow kohya sd-scripts' train_network
//! (network_dim 4, network_alpha 1; conv_dim/conv_alpha default to them for LoCon).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::error::ConfigError;
use super::plan::TrainMode;
use super::strict::{known_keys, Section};
use crate::adapter::block_weights::BlockSettings;
use crate::adapter::layer_filter::LayerFilter;

/// `adapter: {…}` as written.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdapterFile {
    #[serde(default)]
    pub rank: Option<i64>,
    #[serde(default)]
    pub alpha: Option<f64>,
    #[serde(default)]
    pub conv_rank: Option<i64>,
    #[serde(default)]
    pub conv_alpha: Option<f64>,
    #[serde(default)]
    pub train_text_encoder: Option<bool>,
    #[serde(default)]
    pub unet_lr: Option<f64>,
    #[serde(default)]
    pub text_encoder_lr: Option<f64>,
    #[serde(default)]
    pub dropout: Option<f64>,
    /// LoKr's factorisation bound (LyCORIS `factor`): -1 (default) splits each dimension as
    /// evenly as it can, `f > 0` takes `f` when it divides the dimension.
    #[serde(default)]
    pub factor: Option<i64>,
    /// An existing LoRA/LoCon file (ours or kohya's) to start from.
    #[serde(default)]
    pub init_from: Option<String>,
    /// Dtype of the saved file: "fp16" (default, as kohya), "bf16" or "fp32".
    #[serde(default)]
    pub save_dtype: Option<String>,
    /// kohya's `--no_metadata`: the file records only what loaders need (the network and the
    /// base model), not the run's settings, dataset folders and caption tags.
    #[serde(default)]
    pub no_metadata: Option<bool>,
    /// kohya's `--training_comment`: free text saved in the file (`ss_training_comment`).
    #[serde(default)]
    pub training_comment: Option<String>,
    /// kohya's `--dim_from_weights`: each module's rank and alpha are `init_from`'s, module by
    /// module, and only the modules the file holds are trained.
    #[serde(default)]
    pub dim_from_weights: Option<bool>,
    /// kohya's LoRA+ (`network_args`): the `lora_up` weights learn at this multiple of their
    /// group's rate, in both groups unless one of the two below sets its own.
    #[serde(default)]
    pub loraplus_lr_ratio: Option<f64>,
    #[serde(default)]
    pub loraplus_unet_lr_ratio: Option<f64>,
    #[serde(default)]
    pub loraplus_text_encoder_lr_ratio: Option<f64>,
    /// kohya's `--scale_weight_norms`: after each step, every LoRA/LoCon update `ΔW` whose
    /// Frobenius norm exceeds this is scaled back to it.
    #[serde(default)]
    pub scale_weight_norms: Option<f64>,
    /// kohya's `network_args` `rank_dropout` and `module_dropout` (LoRA/LoCon).
    #[serde(default)]
    pub rank_dropout: Option<f64>,
    #[serde(default)]
    pub module_dropout: Option<f64>,
    /// kohya's block-wise LoRA (`network_args`; [`crate::adapter::block_weights`]): a rank and
    /// alpha per UNet block (25 for SD1/SD2, 23 for SDXL), for its Linear/1×1 layers and its
    /// 3×3 convs, each a JSON array or kohya's comma-separated string.
    #[serde(default)]
    pub block_dims: Option<Value>,
    #[serde(default)]
    pub block_alphas: Option<Value>,
    #[serde(default)]
    pub conv_block_dims: Option<Value>,
    #[serde(default)]
    pub conv_block_alphas: Option<Value>,
    /// kohya's per-block learning-rate weights: the down and up blocks' as a list or a curve
    /// (`"sine+0.5"`), the mid block's (3 for SDXL) as a list.
    #[serde(default)]
    pub down_lr_weight: Option<Value>,
    #[serde(default)]
    pub mid_lr_weight: Option<Value>,
    #[serde(default)]
    pub up_lr_weight: Option<Value>,
    /// Weights at or below it are 0, and their blocks get no adapters.
    #[serde(default)]
    pub block_lr_zero_threshold: Option<f64>,
    /// OneTrainer's layer filter: the UNet layers to adapt, by path, as a list of patterns or its
    /// comma-separated string, and whether they are regular expressions.
    #[serde(default)]
    pub layer_filter: Option<Value>,
    #[serde(default)]
    pub layer_filter_regex: Option<bool>,
}

/// The saved adapter file's dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SaveDtype {
    Fp16,
    Bf16,
    Fp32,
}

/// The resolved adapter settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AdapterPlan {
    pub rank: usize,
    pub alpha: f64,
    /// Rank and alpha of the 3×3 convs (LoCon only).
    pub conv_rank: usize,
    pub conv_alpha: f64,
    pub train_text_encoder: bool,
    /// The UNet's adapters train (kohya's `network_train_text_encoder_only` and
    /// `disable_unet_training` turn them off: the run trains the text encoders' alone).
    pub train_unet: bool,
    /// Overrides of the optimizer groups' lr; `None` keeps optimizer.json's (and train.json's `lr`).
    pub unet_lr: Option<f64>,
    pub text_encoder_lr: Option<f64>,
    pub dropout: f64,
    /// LoKr's `factor` (-1 = most balanced; unused by the other modes).
    pub factor: i64,
    pub init_from: Option<PathBuf>,
    pub save_dtype: SaveDtype,
    /// The run's settings, dataset and tags in the saved file (kohya's metadata; off with
    /// `no_metadata`).
    pub training_metadata: bool,
    pub training_comment: Option<String>,
    /// Ranks and alphas from `init_from`, module by module (kohya's `--dim_from_weights`).
    pub dim_from_weights: bool,
    /// LoRA+'s ratio for the `lora_up` weights of the UNet's and the text encoders' modules.
    pub loraplus: LoraPlus,
    /// kohya's max-norm regularization's cap (`crate::adapter::max_norm`).
    pub scale_weight_norms: Option<f64>,
    /// kohya's `rank_dropout` and `module_dropout` (0: off; `crate::adapter::lora::ExtraDropout`).
    pub rank_dropout: f64,
    pub module_dropout: f64,
    /// kohya's block-wise ranks and learning-rate weights (`None`: every block alike).
    pub blocks: Option<BlockSettings>,
    /// OneTrainer's layer filter over the UNet's adapted layers (`None`: all of them).
    pub layer_filter: Option<LayerFilter>,
}

/// kohya's LoRA+ ratios as resolved: each group's is its own key, else `loraplus_lr_ratio`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LoraPlus {
    pub unet: Option<f64>,
    pub text_encoder: Option<f64>,
}

/// Parses the raw `adapter` value of train.json (`file` names it in errors): an object, each key
/// known and of its type.
pub fn parse_adapter_section(
    value: &Value,
    file: &Path,
    set_args: &HashMap<String, String>,
) -> Result<AdapterFile, ConfigError> {
    let section = Section {
        file,
        prefix: "adapter",
        set_args,
    };
    let Value::Object(obj) = value else {
        return Err(ConfigError::Invalid {
            file: file.to_path_buf(),
            field: "adapter".into(),
            message: "must be an object such as {\"rank\": 16, \"alpha\": 8}".into(),
        });
    };
    section.check_unknown(obj, &known_keys::<AdapterFile>(), &[], |_| None)?;
    if let Some(err) = section.type_error::<AdapterFile>(obj) {
        return Err(err);
    }
    serde_json::from_value(Value::Object(obj.clone())).map_err(|e| ConfigError::Invalid {
        file: file.to_path_buf(),
        field: "adapter".into(),
        message: format!("does not parse: {e}"),
    })
}

/// Validates `a`. `resolve_input` turns a relative `init_from` into an existing file's path.
pub fn resolve_adapter(
    a: &AdapterFile,
    file: &Path,
    mode: TrainMode,
    default_train_te: bool,
    resolve_input: impl Fn(&str, &str) -> Result<PathBuf, ConfigError>,
) -> Result<AdapterPlan, ConfigError> {
    let invalid = |field: &str, message: String| ConfigError::Invalid {
        file: file.to_path_buf(),
        field: format!("adapter.{field}"),
        message,
    };
    let rank = |field: &str, v: Option<i64>, default: i64| -> Result<usize, ConfigError> {
        let v = v.unwrap_or(default);
        if !(1..=4096).contains(&v) {
            return Err(invalid(field, format!("must be in 1..=4096 (got {v})")));
        }
        Ok(v as usize)
    };
    let positive = |field: &str, v: Option<f64>, default: f64| -> Result<f64, ConfigError> {
        let v = v.unwrap_or(default);
        if !(v.is_finite() && v > 0.0) {
            return Err(invalid(field, format!("must be greater than 0 (got {v})")));
        }
        Ok(v)
    };
    let lr = |field: &str, v: Option<f64>| -> Result<Option<f64>, ConfigError> {
        match v {
            Some(x) if !(x.is_finite() && x > 0.0) => {
                Err(invalid(field, format!("must be greater than 0 (got {x})")))
            }
            v => Ok(v),
        }
    };
    let r = rank("rank", a.rank, 4)?;
    let alpha = positive("alpha", a.alpha, 1.0)?;
    let dropout = a.dropout.unwrap_or(0.0);
    if !(0.0..1.0).contains(&dropout) {
        return Err(invalid(
            "dropout",
            format!("must be in [0, 1) (got {dropout})"),
        ));
    }
    let low_rank = match mode {
        TrainMode::Lora | TrainMode::Locon => true,
        TrainMode::Full
        | TrainMode::TextualInversion
        | TrainMode::Loha
        | TrainMode::Lokr
        | TrainMode::Dora => false,
    };
    if dropout > 0.0 && !low_rank {
        return Err(invalid(
            "dropout",
            format!(
                "is {dropout}, but only \"lora\" and \"locon\" have dropout (LyCORIS's LoHa, \
                 LoKr and DoRA ignore it); remove it"
            ),
        ));
    }
    let factor = match (a.factor, mode) {
        (None, _) => -1,
        (Some(f), TrainMode::Lokr) if f == -1 || (1..=4096).contains(&f) => f,
        (Some(f), TrainMode::Lokr) => {
            return Err(invalid(
                "factor",
                format!("must be -1 or in 1..=4096 (got {f})"),
            ))
        }
        (Some(_), _) => {
            return Err(invalid(
                "factor",
                "is LoKr's factorisation; it is only used with \"mode\": \"lokr\"".into(),
            ))
        }
    };
    let save_dtype =
        save_dtype(a.save_dtype.as_deref()).map_err(|message| invalid("save_dtype", message))?;
    let init_from = a
        .init_from
        .as_deref()
        .map(|p| resolve_input("adapter.init_from", p))
        .transpose()?;
    if let Some(p) = init_from.as_ref().filter(|p| !p.is_file()) {
        let why = if p.exists() {
            "is not a file"
        } else {
            "does not exist"
        };
        return Err(invalid(
            "init_from",
            format!("is {}, which {why}", p.display()),
        ));
    }
    let dim_from_weights = a.dim_from_weights.unwrap_or(false);
    if dim_from_weights {
        if init_from.is_none() {
            return Err(invalid(
                "dim_from_weights",
                "takes the ranks from `adapter.init_from`'s file; set init_from".into(),
            ));
        }
        if !low_rank {
            return Err(invalid(
                "dim_from_weights",
                "reads LoRA/LoCon files (kohya's `lora_down`/`lora_up`); use \"mode\": \"lora\" \
                 or \"locon\""
                    .into(),
            ));
        }
        let set = [
            ("rank", a.rank.is_some()),
            ("alpha", a.alpha.is_some()),
            ("conv_rank", a.conv_rank.is_some()),
            ("conv_alpha", a.conv_alpha.is_some()),
        ];
        if let Some((key, _)) = set.iter().find(|(_, on)| *on) {
            return Err(invalid(
                key,
                "is taken from init_from's file with dim_from_weights; remove one of the two"
                    .into(),
            ));
        }
    }
    // LyCORIS's kohya network scales the `lora_up` weights as kohya's does: DoRA has them.
    let has_lora_up = low_rank || mode == TrainMode::Dora;
    let loraplus = resolve_loraplus(a, has_lora_up).map_err(|(k, m)| invalid(k, m))?;
    let scale_weight_norms =
        match a.scale_weight_norms {
            Some(x) if !(x.is_finite() && x > 0.0) => {
                return Err(invalid(
                    "scale_weight_norms",
                    format!("must be greater than 0 (got {x}); kohya suggests 1"),
                ))
            }
            Some(_) if !low_rank => return Err(invalid(
                "scale_weight_norms",
                "caps the norm of kohya's `lora_up`·`lora_down` updates; use \"mode\": \"lora\" \
                 or \"locon\""
                    .into(),
            )),
            v => v,
        };
    let extra = |key: &str, v: Option<f64>| match v.unwrap_or(0.0) {
        p if !(0.0..1.0).contains(&p) => Err(invalid(key, format!("must be in [0, 1) (got {p})"))),
        p if p > 0.0 && !low_rank => Err(invalid(
            key,
            format!(
                "is {p}, but kohya's rank and module dropout are LoRA/LoCon's (`networks.lora`); \
                 use \"mode\": \"lora\" or \"locon\", or remove it"
            ),
        )),
        p => Ok(p),
    };
    let locon = mode == TrainMode::Locon;
    let blocks = super::adapter_blocks::block_settings(a, low_rank, locon, dim_from_weights)
        .map_err(|(k, m)| invalid(k, m))?;
    let rank_dropout = extra("rank_dropout", a.rank_dropout)?;
    let module_dropout = extra("module_dropout", a.module_dropout)?;
    Ok(AdapterPlan {
        rank: r,
        alpha,
        conv_rank: rank("conv_rank", a.conv_rank, r as i64)?,
        conv_alpha: positive("conv_alpha", a.conv_alpha, alpha)?,
        train_text_encoder: a.train_text_encoder.unwrap_or(default_train_te),
        train_unet: true,
        unet_lr: lr("unet_lr", a.unet_lr)?,
        text_encoder_lr: lr("text_encoder_lr", a.text_encoder_lr)?,
        dropout,
        factor,
        init_from,
        save_dtype,
        training_metadata: !a.no_metadata.unwrap_or(false),
        training_comment: a.training_comment.clone(),
        dim_from_weights,
        loraplus,
        scale_weight_norms,
        rank_dropout,
        module_dropout,
        blocks,
        layer_filter: resolve_layer_filter(a).map_err(|(k, m)| invalid(k, m))?,
    })
}

/// `layer_filter` (a list of patterns, or OneTrainer's comma-separated string; empty patterns
/// match every layer, so a filter of only those is no filter) and `layer_filter_regex`.
fn resolve_layer_filter(a: &AdapterFile) -> Result<Option<LayerFilter>, (&'static str, String)> {
    let regex = a.layer_filter_regex.unwrap_or(false);
    let patterns: Vec<String> = match &a.layer_filter {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => s.split(',').map(str::to_string).collect(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                other => Err((
                    "layer_filter",
                    format!("must hold strings (patterns of layer paths); found {other}"),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err((
                "layer_filter",
                format!("must be a list of patterns or a comma-separated string (got {other})"),
            ))
        }
    };
    if patterns.iter().all(|p| p.trim().is_empty()) {
        if a.layer_filter_regex == Some(true) {
            return Err((
                "layer_filter_regex",
                "is true but layer_filter gives no pattern".to_string(),
            ));
        }
        return Ok(None);
    }
    LayerFilter::new(&patterns, regex)
        .map(Some)
        .map_err(|e| ("layer_filter", e))
}

/// The LoRA+ keys (kohya's `networks/lora.py`, and LyCORIS's kohya network alike:
/// `loraplus_unet_lr_ratio or loraplus_lr_ratio`, likewise for the text encoder); `has_lora_up`:
/// the mode is `lora`, `locon` or `dora`, whose `lora_up` weights they scale. An error names the
/// key.
fn resolve_loraplus(
    a: &AdapterFile,
    has_lora_up: bool,
) -> Result<LoraPlus, (&'static str, String)> {
    let keys = [
        ("loraplus_lr_ratio", a.loraplus_lr_ratio),
        ("loraplus_unet_lr_ratio", a.loraplus_unet_lr_ratio),
        (
            "loraplus_text_encoder_lr_ratio",
            a.loraplus_text_encoder_lr_ratio,
        ),
    ];
    for (key, v) in keys {
        match v {
            Some(x) if !(x.is_finite() && x > 0.0) => {
                return Err((key, format!("must be greater than 0 (got {x})")))
            }
            Some(_) if !has_lora_up => {
                return Err((
                    key,
                    "scales the learning rate of the `lora_up` weights, which LoHa and LoKr do \
                     not have (LyCORIS's kohya network would leave every rate as it is); use \
                     \"mode\": \"lora\", \"locon\" or \"dora\""
                        .into(),
                ))
            }
            _ => {}
        }
    }
    Ok(LoraPlus {
        unet: a.loraplus_unet_lr_ratio.or(a.loraplus_lr_ratio),
        text_encoder: a.loraplus_text_encoder_lr_ratio.or(a.loraplus_lr_ratio),
    })
}

/// `save_dtype`: fp16 unless set; the error completes "`adapter.save_dtype` …".
pub(super) fn save_dtype(v: Option<&str>) -> Result<SaveDtype, String> {
    match v {
        None | Some("fp16") | Some("float16") => Ok(SaveDtype::Fp16),
        Some("bf16") | Some("bfloat16") => Ok(SaveDtype::Bf16),
        Some("fp32") | Some("float32") | Some("float") => Ok(SaveDtype::Fp32),
        Some(other) => Err(format!(
            "is \"{other}\"; allowed: \"fp16\", \"bf16\", \"fp32\""
        )),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Map;

    use super::*;

    /// An empty object.
    fn empty_section() -> Value {
        Value::Object(Map::new())
    }

    fn plan(v: Value) -> Result<AdapterPlan, ConfigError> {
        let f = Path::new("train.json");
        let a = parse_adapter_section(&v, f, &HashMap::new())?;
        plan_mode(v_mode(&a), a, f)
    }

    fn v_mode(_: &AdapterFile) -> TrainMode {
        TrainMode::Locon
    }

    fn plan_mode(mode: TrainMode, a: AdapterFile, f: &Path) -> Result<AdapterPlan, ConfigError> {
        resolve_adapter(&a, f, mode, true, |_, p| Ok(PathBuf::from(p)))
    }

    #[test]
    fn defaults_follow_kohya() {
        let p = plan(empty_section()).unwrap();
        assert_eq!(
            (p.rank, p.alpha, p.conv_rank, p.conv_alpha),
            (4, 1.0, 4, 1.0)
        );
        assert_eq!(p.save_dtype, SaveDtype::Fp16);
        assert!(p.train_text_encoder);
        let p = plan(serde_json::json!({"rank": 16, "alpha": 8, "conv_rank": 4})).unwrap();
        assert_eq!(
            (p.rank, p.alpha, p.conv_rank, p.conv_alpha),
            (16, 8.0, 4, 8.0)
        );
    }

    #[test]
    fn bad_values_name_the_field() {
        for (v, field) in [
            (serde_json::json!({"rank": 0}), "adapter.rank"),
            (serde_json::json!({"alpha": -1}), "adapter.alpha"),
            (serde_json::json!({"dropout": 1.0}), "adapter.dropout"),
            (serde_json::json!({"unet_lr": 0}), "adapter.unet_lr"),
            (
                serde_json::json!({"save_dtype": "int8"}),
                "adapter.save_dtype",
            ),
            (serde_json::json!({"rank": "16"}), "adapter.rank"),
        ] {
            let e = plan(v).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
        let lokr = |v| {
            let f = Path::new("train.json");
            let a = parse_adapter_section(&v, f, &HashMap::new()).unwrap();
            plan_mode(TrainMode::Lokr, a, f)
        };
        assert_eq!(lokr(serde_json::json!({})).unwrap().factor, -1);
        assert_eq!(lokr(serde_json::json!({"factor": 8})).unwrap().factor, 8);
        let e = lokr(serde_json::json!({"factor": 0}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("adapter.factor"), "{e}");
        let e = plan(serde_json::json!({"factor": 4}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("only used with \"mode\": \"lokr\""), "{e}");
        let e = lokr(serde_json::json!({"dropout": 0.1}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("adapter.dropout"), "{e}");
        let e = plan(serde_json::json!({"rnak": 4}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("adapter.rank"), "{e}");
    }

    /// `dim_from_weights` needs the file and takes every rank from it.
    #[test]
    fn dim_from_weights_needs_init_from_and_no_ranks() {
        let file = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/kohya_tiny_sd15.safetensors"
        );
        let err = plan(serde_json::json!({"dim_from_weights": true})).unwrap_err();
        assert!(err.to_string().contains("set init_from"), "{err}");
        let with_rank = serde_json::json!({"dim_from_weights": true, "init_from": file, "rank": 8});
        let err = plan(with_rank).unwrap_err();
        assert!(err.to_string().contains("adapter.rank"), "{err}");
        let a = plan(serde_json::json!({"dim_from_weights": true, "init_from": file}));
        assert!(a.unwrap().dim_from_weights);
    }
}
