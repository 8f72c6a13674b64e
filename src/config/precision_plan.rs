//! The memory and precision keys of train.json: `amp` (or EveryDream2's `disable_amp`),
//! `weight_dtype`, `gradient_checkpointing` and the fp16 loss scaler's `grad_scaler_*`.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::error::ConfigError;
use super::plan::TrainMode;
use super::train_file::TrainFile;
use crate::precision::{Amp, ScalerSettings, WeightDtype};

/// How `amp` was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AmpChoice {
    /// Not set (or `true`): bf16 on CUDA cards that have it, fp16 on older ones, off on the CPU.
    DeviceDefault,
    Set(Amp),
}

/// `gradient_checkpointing`: off, every block, or the fewest blocks that make the memory plan
/// fit (`"auto"`, decided when the run starts: `train::memory_plan::checkpoint_choice`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Checkpointing {
    Off,
    On,
    Auto,
}

impl Checkpointing {
    pub fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::On => "on",
            Self::Auto => "auto",
        }
    }
}

/// `base_weight_dtype`: how an adapter run stores its frozen UNet and text encoders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BaseWeightDtype {
    /// In the compute dtype (`amp`), the default.
    Amp,
    /// Linear and conv weights as e4m3 codes with an f32 scale per output channel
    /// (`nn::fp8`), dequantised to the compute dtype where a layer uses them; norms, biases and
    /// embeddings stay in the compute dtype.
    Fp8,
    /// The UNet's as [`Self::Fp8`], the text encoders' in the compute dtype (kohya's
    /// `fp8_base_unet`).
    #[serde(rename = "fp8_unet")]
    Fp8Unet,
}

impl BaseWeightDtype {
    pub fn name(self) -> &'static str {
        match self {
            Self::Amp => "amp",
            Self::Fp8 => "fp8",
            Self::Fp8Unet => "fp8_unet",
        }
    }

    /// Whether the frozen UNet is stored in fp8.
    pub fn fp8_unet(self) -> bool {
        self != Self::Amp
    }

    /// Whether the frozen text encoders are stored in fp8.
    pub fn fp8_text_encoders(self) -> bool {
        self == Self::Fp8
    }
}

/// The resolved memory and precision settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PrecisionPlan {
    pub amp: AmpChoice,
    /// Used only when the resolved precision is fp16.
    pub scaler: ScalerSettings,
    /// The dtype a full fine-tune's trained weights are stored in (f32 unless set).
    pub weight_dtype: WeightDtype,
    /// How an adapter run stores its frozen base.
    pub base_weight_dtype: BaseWeightDtype,
    pub gradient_checkpointing: Checkpointing,
    /// `fused_backward_pass`: update each parameter as its gradient completes.
    pub fused_backward_pass: bool,
}

impl Default for PrecisionPlan {
    fn default() -> Self {
        Self {
            amp: AmpChoice::DeviceDefault,
            scaler: ScalerSettings::default(),
            weight_dtype: WeightDtype::F32,
            base_weight_dtype: BaseWeightDtype::Amp,
            gradient_checkpointing: Checkpointing::Off,
            fused_backward_pass: false,
        }
    }
}

fn invalid(file: &Path, field: &str, message: String) -> ConfigError {
    ConfigError::Invalid {
        file: file.to_path_buf(),
        field: field.to_string(),
        message,
    }
}

fn resolve_amp(f: &TrainFile, file: &Path) -> Result<AmpChoice, ConfigError> {
    let asked = match &f.amp {
        None | Some(Value::Null) | Some(Value::Bool(true)) => None,
        Some(Value::Bool(false)) => Some(Amp::Off),
        Some(Value::String(s)) => Some(Amp::parse(s).ok_or_else(|| {
            invalid(
                file,
                "amp",
                format!("is \"{s}\"; use \"bf16\", \"fp16\" or \"off\""),
            )
        })?),
        Some(other) => {
            return Err(invalid(
                file,
                "amp",
                format!("is {other}; use \"bf16\", \"fp16\", \"off\" or a boolean"),
            ))
        }
    };
    match (asked, f.disable_amp) {
        (Some(amp), Some(true)) if amp != Amp::Off => Err(invalid(
            file,
            "disable_amp",
            format!("is true, but amp is \"{}\"; remove one of them", amp.name()),
        )),
        (_, Some(true)) => Ok(AmpChoice::Set(Amp::Off)),
        (Some(amp), _) => Ok(AmpChoice::Set(amp)),
        (None, _) => Ok(AmpChoice::DeviceDefault),
    }
}

fn resolve_scaler(f: &TrainFile, file: &Path) -> Result<ScalerSettings, ConfigError> {
    let d = ScalerSettings::default();
    let interval = match f.grad_scaler_growth_interval {
        None => d.growth_interval,
        Some(n) => u32::try_from(n).ok().filter(|n| *n >= 1).ok_or_else(|| {
            invalid(
                file,
                "grad_scaler_growth_interval",
                format!("must be a whole number of steps of at least 1 (got {n})"),
            )
        })?,
    };
    let s = ScalerSettings {
        init_scale: f.grad_scaler_init_scale.unwrap_or(d.init_scale),
        growth_factor: f.grad_scaler_growth_factor.unwrap_or(d.growth_factor),
        backoff_factor: f.grad_scaler_backoff_factor.unwrap_or(d.backoff_factor),
        growth_interval: interval,
    };
    s.validate().map_err(|m| {
        let field = m.split_whitespace().next().unwrap_or("grad_scaler");
        invalid(file, field, m.clone())
    })?;
    Ok(s)
}

/// `weight_dtype`: a full fine-tune's choice. Adapter weights stay f32: they are a few MiB
/// (SD1.5 LoRA rank 16: 3 M parameters, 0.3% of the UNet), so two bytes each would save under
/// 6 MiB at the cost of their precision, while the frozen base is already in the compute dtype.
fn resolve_weight_dtype(
    f: &TrainFile,
    mode: TrainMode,
    file: &Path,
) -> Result<WeightDtype, ConfigError> {
    let Some(s) = &f.weight_dtype else {
        return Ok(WeightDtype::F32);
    };
    let w = WeightDtype::parse(s).ok_or_else(|| {
        invalid(
            file,
            "weight_dtype",
            format!("is \"{s}\"; use \"f32\", \"bf16\" or \"fp16\""),
        )
    })?;
    match mode {
        TrainMode::Full => Ok(w),
        TrainMode::Lora
        | TrainMode::Locon
        | TrainMode::Loha
        | TrainMode::Lokr
        | TrainMode::Dora
        | TrainMode::TextualInversion
            if w == WeightDtype::F32 =>
        {
            Ok(w)
        }
        TrainMode::Lora
        | TrainMode::Locon
        | TrainMode::Loha
        | TrainMode::Lokr
        | TrainMode::Dora
        | TrainMode::TextualInversion => Err(invalid(
            file,
            "weight_dtype",
            format!(
                "is \"{s}\", which applies to a full fine-tune (mode \"full\"): adapter and \
                 embedding weights stay f32, as they are a few MiB and the frozen base is already stored in the \
                 compute dtype (amp); remove the key"
            ),
        )),
    }
}

/// `base_weight_dtype`: an adapter run's choice. A full fine-tune trains the base itself (its
/// storage is `weight_dtype`), so "fp8" is refused there.
fn resolve_base_weight_dtype(
    f: &TrainFile,
    mode: TrainMode,
    file: &Path,
) -> Result<BaseWeightDtype, ConfigError> {
    let Some(s) = &f.base_weight_dtype else {
        return Ok(BaseWeightDtype::Amp);
    };
    let b = match s.to_ascii_lowercase().as_str() {
        "fp8" | "float8" | "e4m3" | "fp8_e4m3" | "float8_e4m3fn" => BaseWeightDtype::Fp8,
        "fp8_unet" => BaseWeightDtype::Fp8Unet,
        "amp" | "default" => BaseWeightDtype::Amp,
        _ => {
            return Err(invalid(
                file,
                "base_weight_dtype",
                format!(
                    "is \"{s}\"; use \"fp8\" (e4m3 with a scale per output channel), \
                     \"fp8_unet\" (the UNet in fp8, the text encoders in the compute dtype) or \
                     \"amp\" (the compute dtype, the default)"
                ),
            ))
        }
    };
    match mode {
        TrainMode::Full if b != BaseWeightDtype::Amp => Err(invalid(
            file,
            "base_weight_dtype",
            format!(
                "is \"{s}\", which applies to adapter runs (mode \"lora\" or \"locon\"), \
                 whose base is frozen: a full fine-tune trains the base weights themselves (to \
                 store them in 16 bits, use weight_dtype \"bf16\")"
            ),
        )),
        _ => Ok(b),
    }
}

/// `fused_backward_pass`; refused beside `amp: "fp16"`, whose loss scaler must see every
/// gradient before any update (a device default that resolves to fp16 is refused at the start).
fn resolve_fused(f: &TrainFile, file: &Path) -> Result<bool, ConfigError> {
    let on = f.fused_backward_pass.unwrap_or(false);
    if on && matches!(resolve_amp(f, file)?, AmpChoice::Set(Amp::Fp16)) {
        return Err(invalid(
            file,
            "fused_backward_pass",
            "is true with amp \"fp16\": fp16's loss scaler skips a step whose gradients \
             overflowed, so it must see every gradient before any update, and a fused backward \
             pass updates each parameter as its gradient completes; use amp \"bf16\" (or \
             \"off\"), or turn fused_backward_pass off"
                .to_string(),
        ));
    }
    Ok(on)
}

fn resolve_checkpointing(f: &TrainFile, file: &Path) -> Result<Checkpointing, ConfigError> {
    match &f.gradient_checkpointing {
        None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(Checkpointing::Off),
        Some(Value::Bool(true)) => Ok(Checkpointing::On),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("auto") => Ok(Checkpointing::Auto),
        Some(other) => Err(invalid(
            file,
            "gradient_checkpointing",
            format!("is {other}; use true, false or \"auto\""),
        )),
    }
}

/// Resolves and checks the keys for a run in `mode`; errors name train.json and the key.
pub fn resolve_precision(
    f: &TrainFile,
    mode: TrainMode,
    file: &Path,
) -> Result<PrecisionPlan, ConfigError> {
    Ok(PrecisionPlan {
        amp: resolve_amp(f, file)?,
        scaler: resolve_scaler(f, file)?,
        weight_dtype: resolve_weight_dtype(f, mode, file)?,
        base_weight_dtype: resolve_base_weight_dtype(f, mode, file)?,
        gradient_checkpointing: resolve_checkpointing(f, file)?,
        fused_backward_pass: resolve_fused(f, file)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn plan(v: Value) -> Result<PrecisionPlan, ConfigError> {
        plan_for(v, TrainMode::Full)
    }

    fn plan_for(v: Value, mode: TrainMode) -> Result<PrecisionPlan, ConfigError> {
        let f: TrainFile = serde_json::from_value(v).unwrap();
        resolve_precision(&f, mode, Path::new("train.json"))
    }

    /// Catches a name mapped to the wrong dtype, or the adapter-mode refusal lost or applied to
    /// the default.
    #[test]
    fn weight_dtype_names_and_modes() {
        assert_eq!(plan(json!({})).unwrap().weight_dtype, WeightDtype::F32);
        for (name, want) in [
            ("bf16", WeightDtype::Bf16),
            ("bfloat16", WeightDtype::Bf16),
            ("fp16", WeightDtype::Fp16),
            ("float16", WeightDtype::Fp16),
            ("float32", WeightDtype::F32),
        ] {
            let p = plan(json!({ "weight_dtype": name })).unwrap();
            assert_eq!(p.weight_dtype, want, "{name}");
        }
        let err = plan(json!({"weight_dtype": "fp8"}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("weight_dtype") && err.contains("fp8"), "{err}");
        let err = plan_for(json!({"weight_dtype": "bf16"}), TrainMode::Lora)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("weight_dtype") && err.contains("full"),
            "{err}"
        );
        let p = plan_for(json!({"weight_dtype": "f32"}), TrainMode::Locon).unwrap();
        assert_eq!(p.weight_dtype, WeightDtype::F32);
    }

    /// Catches an alias mapped wrong, the default lost, or fp8 let through on a full fine-tune.
    #[test]
    fn base_weight_dtype_names_and_modes() {
        let lora = |v| plan_for(v, TrainMode::Lora);
        assert_eq!(
            lora(json!({})).unwrap().base_weight_dtype,
            BaseWeightDtype::Amp
        );
        for (name, want) in [
            ("fp8", BaseWeightDtype::Fp8),
            ("FP8", BaseWeightDtype::Fp8),
            ("float8_e4m3fn", BaseWeightDtype::Fp8),
            ("amp", BaseWeightDtype::Amp),
        ] {
            let p = lora(json!({ "base_weight_dtype": name })).unwrap();
            assert_eq!(p.base_weight_dtype, want, "{name}");
        }
        let p = plan_for(json!({"base_weight_dtype": "fp8"}), TrainMode::Locon).unwrap();
        assert_eq!(p.base_weight_dtype, BaseWeightDtype::Fp8);
        let err = lora(json!({"base_weight_dtype": "int8"}))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("base_weight_dtype") && err.contains("int8"),
            "{err}"
        );
        let err = plan(json!({"base_weight_dtype": "fp8"}))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("base_weight_dtype") && err.contains("full"),
            "{err}"
        );
        assert_eq!(
            plan(json!({"base_weight_dtype": "amp"}))
                .unwrap()
                .base_weight_dtype,
            BaseWeightDtype::Amp
        );
    }

    #[test]
    fn amp_names_booleans_and_disable_amp() {
        assert_eq!(plan(json!({})).unwrap().amp, AmpChoice::DeviceDefault);
        assert_eq!(
            plan(json!({"amp": true})).unwrap().amp,
            AmpChoice::DeviceDefault
        );
        assert_eq!(
            plan(json!({"amp": false})).unwrap().amp,
            AmpChoice::Set(Amp::Off)
        );
        assert_eq!(
            plan(json!({"amp": "fp16"})).unwrap().amp,
            AmpChoice::Set(Amp::Fp16)
        );
        assert_eq!(
            plan(json!({"disable_amp": true})).unwrap().amp,
            AmpChoice::Set(Amp::Off)
        );
        assert_eq!(
            plan(json!({"disable_amp": false, "amp": "bf16"}))
                .unwrap()
                .amp,
            AmpChoice::Set(Amp::Bf16)
        );
        let err = plan(json!({"amp": "bf16", "disable_amp": true})).unwrap_err();
        assert!(err.to_string().contains("disable_amp"), "{err}");
        let err = plan(json!({"amp": "fp8"})).unwrap_err();
        assert!(
            err.to_string().contains("amp") && err.to_string().contains("fp8"),
            "{err}"
        );
        assert!(plan(json!({"amp": 3})).is_err());
    }

    #[test]
    fn scaler_keys_are_checked_and_named() {
        let p = plan(json!({"grad_scaler_init_scale": 1024.0, "grad_scaler_growth_interval": 10}))
            .unwrap();
        assert_eq!(p.scaler.init_scale, 1024.0);
        assert_eq!(p.scaler.growth_interval, 10);
        for (v, key) in [
            (
                json!({"grad_scaler_growth_interval": 0}),
                "grad_scaler_growth_interval",
            ),
            (
                json!({"grad_scaler_backoff_factor": 2.0}),
                "grad_scaler_backoff_factor",
            ),
            (
                json!({"grad_scaler_growth_factor": 0.5}),
                "grad_scaler_growth_factor",
            ),
            (
                json!({"grad_scaler_init_scale": -1.0}),
                "grad_scaler_init_scale",
            ),
        ] {
            let err = plan(v).unwrap_err().to_string();
            assert!(err.contains(key), "{err}");
        }
    }

    #[test]
    fn checkpointing_defaults_off() {
        let ck = |v: Value| plan(v).map(|p| p.gradient_checkpointing);
        assert_eq!(ck(json!({})).unwrap(), Checkpointing::Off);
        assert_eq!(
            ck(json!({"gradient_checkpointing": true})).unwrap(),
            Checkpointing::On
        );
        assert_eq!(
            ck(json!({"gradient_checkpointing": false})).unwrap(),
            Checkpointing::Off
        );
        assert_eq!(
            ck(json!({"gradient_checkpointing": "auto"})).unwrap(),
            Checkpointing::Auto
        );
        for bad in [json!("sometimes"), json!(1)] {
            let err = ck(json!({ "gradient_checkpointing": bad })).unwrap_err();
            assert!(err.to_string().contains("gradient_checkpointing"), "{err}");
        }
    }
}
