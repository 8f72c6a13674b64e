//! Mixed precision: which dtype the models compute in, and the loss scaler that goes with it.
//!
//! - `bf16`: frozen weights stored in bf16, trainable weights f32 masters cast in the forward;
//!   no loss scaling (bf16 has f32's range).
//! - `fp16`: the same with f16, plus a dynamic loss scaler (torch's `GradScaler`): the loss is
//!   multiplied by the scale before backward and the gradients divided by it after; a step with
//!   inf/NaN gradients is skipped and the scale backs off; after `growth_interval` clean steps
//!   it grows.
//! - `off`: f32 everywhere.
//!
//! Both cases go through one [`LossScaler`] trait, so the training loop never branches on the
//! precision (nanoGPT's shape): bf16 and f32 use [`NoScaler`].

use candle_core::{DType, Device};
use serde::{Deserialize, Serialize};

/// The `amp` setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Amp {
    Bf16,
    Fp16,
    Off,
}

impl Amp {
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Some(Self::Bf16),
            "fp16" | "f16" | "float16" | "half" => Some(Self::Fp16),
            "off" | "no" | "fp32" | "f32" | "none" => Some(Self::Off),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::Fp16 => "fp16",
            Self::Off => "off",
        }
    }

    /// The default for `device`: bf16 on CUDA cards that have it (compute capability 8.0+),
    /// fp16 on older cards, off (f32) on the CPU.
    pub fn default_for(device: &Device) -> Self {
        match compute_capability(device) {
            Some((major, _)) if major >= 8 => Self::Bf16,
            Some(_) => Self::Fp16,
            None => Self::Off,
        }
    }

    /// The dtype activations and frozen weights use.
    pub fn compute_dtype(self) -> DType {
        match self {
            Self::Bf16 => DType::BF16,
            Self::Fp16 => DType::F16,
            Self::Off => DType::F32,
        }
    }
}

/// The `weight_dtype` setting: the dtype a full fine-tune's trained weights are stored in.
///
/// `f32` keeps f32 weights (the masters AMP casts from). `bf16` and `fp16` store them at two bytes
/// each, with no f32 copy: the optimizer updates each one in f32 and writes it back with
/// stochastic rounding ([`crate::optim::stochastic_round`]), so updates smaller than half a gap
/// survive on average. Gradients are then in the same dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtype {
    F32,
    Bf16,
    Fp16,
}

impl WeightDtype {
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" | "float" => Some(Self::F32),
            "bf16" | "bfloat16" => Some(Self::Bf16),
            "fp16" | "f16" | "float16" | "half" => Some(Self::Fp16),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Fp16 => "fp16",
        }
    }

    pub fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
            Self::Fp16 => DType::F16,
        }
    }

    /// Bytes per weight (and per gradient).
    pub fn bytes(self) -> usize {
        self.dtype().size_in_bytes()
    }
}

/// The CUDA compute capability of `device`, or none on other devices.
fn compute_capability(device: &Device) -> Option<(i32, i32)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        return dev.cuda_stream().context().compute_capability().ok();
    }
    let _ = device;
    None
}

/// Scales the loss before backward and learns from each step whether its gradients were finite.
pub trait LossScaler {
    /// The factor the loss is multiplied by (1 for no scaling).
    fn scale(&self) -> f64;
    /// Records the outcome of a step: `finite` is false when a gradient held inf or NaN (the
    /// step is then skipped). Returns what changed.
    fn update(&mut self, finite: bool) -> ScaleChange;
    /// Called before optimizer step `step` (0-based) runs; EveryDream2's step tweaks hook here.
    fn begin_step(&mut self, _step: usize) {}
    /// Everything that changes during a run, for a save point (`None` when nothing does).
    fn state(&self) -> Option<ScalerState> {
        None
    }
    /// Restores what [`LossScaler::state`] saved.
    fn restore(&mut self, _state: &ScalerState) {}
}

/// The dynamic scaler's running state: its scale, the clean steps since the last change, and
/// the growth settings (EveryDream2's step tweaks change them during a run).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScalerState {
    pub scale: f64,
    pub clean_steps: u32,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: u32,
}

/// What [`LossScaler::update`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScaleChange {
    Unchanged,
    Grew(f64),
    BackedOff(f64),
}

/// bf16 and f32: a scale of 1 that never changes.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoScaler;

impl LossScaler for NoScaler {
    fn scale(&self) -> f64 {
        1.0
    }

    fn update(&mut self, _finite: bool) -> ScaleChange {
        ScaleChange::Unchanged
    }
}

/// The dynamic scaler's settings (train.json `grad_scaler_*`), torch's `GradScaler` defaults.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerSettings {
    pub init_scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: u32,
}

impl Default for ScalerSettings {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

impl ScalerSettings {
    /// Checks the ranges torch's `GradScaler` accepts; the error names the key.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.init_scale.is_finite() && self.init_scale > 0.0) {
            return Err(format!(
                "grad_scaler_init_scale must be a positive number, got {}",
                self.init_scale
            ));
        }
        if !(self.growth_factor > 1.0 && self.growth_factor.is_finite()) {
            return Err(format!(
                "grad_scaler_growth_factor must be above 1, got {}",
                self.growth_factor
            ));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return Err(format!(
                "grad_scaler_backoff_factor must be in (0, 1), got {}",
                self.backoff_factor
            ));
        }
        if self.growth_interval == 0 {
            return Err("grad_scaler_growth_interval must be at least 1".into());
        }
        Ok(())
    }
}

/// EveryDream2's `apply_grad_scaler_step_tweaks` (optimizer.json): at global steps 500, 1000,
/// 2000 and 4000 the growth factor becomes 1.8, 1.6, 1.3, 1.15, the backoff its inverse, and the
/// growth interval 100, 200, 500, 2000 (EveryDream2 `optimizer/optimizers.py`).
pub fn ed2_step_tweak(step: usize) -> Option<(f64, u32)> {
    match step {
        500 => Some((1.8, 100)),
        1000 => Some((1.6, 200)),
        2000 => Some((1.3, 500)),
        4000 => Some((1.15, 2000)),
        _ => None,
    }
}

/// fp16's dynamic loss scaler.
#[derive(Debug, Clone)]
pub struct DynamicScaler {
    settings: ScalerSettings,
    scale: f64,
    clean_steps: u32,
    step_tweaks: bool,
}

impl DynamicScaler {
    pub fn new(settings: ScalerSettings) -> Self {
        Self {
            settings,
            scale: settings.init_scale,
            clean_steps: 0,
            step_tweaks: false,
        }
    }

    /// With EveryDream2's step tweaks ([`ed2_step_tweak`]).
    pub fn with_step_tweaks(mut self, on: bool) -> Self {
        self.step_tweaks = on;
        self
    }
}

impl LossScaler for DynamicScaler {
    fn scale(&self) -> f64 {
        self.scale
    }

    fn update(&mut self, finite: bool) -> ScaleChange {
        if !finite {
            self.scale *= self.settings.backoff_factor;
            self.clean_steps = 0;
            return ScaleChange::BackedOff(self.scale);
        }
        self.clean_steps += 1;
        if self.clean_steps >= self.settings.growth_interval {
            self.clean_steps = 0;
            self.scale *= self.settings.growth_factor;
            return ScaleChange::Grew(self.scale);
        }
        ScaleChange::Unchanged
    }

    fn state(&self) -> Option<ScalerState> {
        Some(ScalerState {
            scale: self.scale,
            clean_steps: self.clean_steps,
            growth_factor: self.settings.growth_factor,
            backoff_factor: self.settings.backoff_factor,
            growth_interval: self.settings.growth_interval,
        })
    }

    fn restore(&mut self, s: &ScalerState) {
        self.scale = s.scale;
        self.clean_steps = s.clean_steps;
        self.settings.growth_factor = s.growth_factor;
        self.settings.backoff_factor = s.backoff_factor;
        self.settings.growth_interval = s.growth_interval;
    }

    fn begin_step(&mut self, step: usize) {
        if !self.step_tweaks {
            return;
        }
        if let Some((factor, interval)) = ed2_step_tweak(step) {
            self.settings.growth_factor = factor;
            self.settings.backoff_factor = 1.0 / factor;
            self.settings.growth_interval = interval;
        }
    }
}

/// The scaler `amp` calls for.
pub fn scaler_for(amp: Amp, settings: ScalerSettings, step_tweaks: bool) -> Box<dyn LossScaler> {
    match amp {
        Amp::Fp16 => Box::new(DynamicScaler::new(settings).with_step_tweaks(step_tweaks)),
        Amp::Bf16 | Amp::Off => Box::new(NoScaler),
    }
}

/// A command's `--save-dtype` (and kohya's `--save_precision`): `fp32` (kohya's `float`), `fp16`
/// or `bf16`.
pub fn parse_save_dtype(s: &str) -> Result<DType, String> {
    match s {
        "fp32" | "float" | "f32" => Ok(DType::F32),
        "fp16" | "f16" => Ok(DType::F16),
        "bf16" => Ok(DType::BF16),
        _ => Err("must be fp32, fp16 or bf16".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_scaler_backs_off_on_overflow_and_grows_after_the_interval() {
        let mut s = DynamicScaler::new(ScalerSettings {
            growth_interval: 3,
            ..Default::default()
        });
        assert_eq!(s.scale(), 65536.0);
        assert_eq!(s.update(false), ScaleChange::BackedOff(32768.0));
        assert_eq!(s.update(true), ScaleChange::Unchanged);
        assert_eq!(s.update(true), ScaleChange::Unchanged);
        assert_eq!(s.update(true), ScaleChange::Grew(65536.0));
        // An overflow resets the count of clean steps.
        s.update(true);
        s.update(true);
        s.update(false);
        assert_eq!(s.update(true), ScaleChange::Unchanged);
        assert_eq!(s.scale(), 32768.0);
    }

    #[test]
    fn dynamic_scaler_state_round_trips() {
        let mut a = DynamicScaler::new(ScalerSettings {
            growth_interval: 3,
            ..Default::default()
        })
        .with_step_tweaks(true);
        a.begin_step(500);
        a.update(false);
        a.update(true);
        let mut b = DynamicScaler::new(ScalerSettings::default());
        b.restore(&a.state().unwrap());
        assert_eq!(b.state(), a.state());
        for finite in [true, true, false, true] {
            assert_eq!(a.update(finite), b.update(finite));
        }
        assert!(NoScaler.state().is_none());
    }

    #[test]
    fn ed2_step_tweaks_retune_growth_at_step_500() {
        let mut s = DynamicScaler::new(ScalerSettings::default()).with_step_tweaks(true);
        s.begin_step(499);
        assert_eq!(s.settings.growth_interval, 2000);
        s.begin_step(500);
        assert_eq!(s.settings.growth_interval, 100);
        assert_eq!(s.update(false), ScaleChange::BackedOff(65536.0 / 1.8));
        let mut plain = DynamicScaler::new(ScalerSettings::default());
        plain.begin_step(500);
        assert_eq!(plain.settings.growth_interval, 2000);
    }

    #[test]
    fn bf16_and_f32_never_scale() {
        for amp in [Amp::Bf16, Amp::Off] {
            let mut s = scaler_for(amp, ScalerSettings::default(), true);
            assert_eq!(s.scale(), 1.0);
            assert_eq!(s.update(false), ScaleChange::Unchanged);
            assert_eq!(s.scale(), 1.0);
        }
        assert_eq!(
            scaler_for(Amp::Fp16, ScalerSettings::default(), false).scale(),
            65536.0
        );
    }

    #[test]
    fn parses_names_and_defaults_to_f32_on_the_cpu() {
        assert_eq!(Amp::parse("BF16"), Some(Amp::Bf16));
        assert_eq!(Amp::parse("fp16"), Some(Amp::Fp16));
        assert_eq!(Amp::parse("off"), Some(Amp::Off));
        assert_eq!(Amp::parse("fp8"), None);
        assert_eq!(Amp::default_for(&Device::Cpu), Amp::Off);
        assert_eq!(Amp::Fp16.compute_dtype(), DType::F16);
    }

    #[test]
    fn rejects_settings_torch_rejects() {
        let bad = [
            ScalerSettings {
                init_scale: 0.0,
                ..Default::default()
            },
            ScalerSettings {
                growth_factor: 1.0,
                ..Default::default()
            },
            ScalerSettings {
                backoff_factor: 1.0,
                ..Default::default()
            },
            ScalerSettings {
                growth_interval: 0,
                ..Default::default()
            },
        ];
        for s in bad {
            assert!(s.validate().is_err(), "{s:?}");
        }
        assert!(ScalerSettings::default().validate().is_ok());
    }
}
