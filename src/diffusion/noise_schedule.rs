//! The DDPM forward process (Ho et al., arXiv 2006.11239) read from a diffusers
//! `scheduler_config.json`.
//!
//! Every diffusers scheduler used by SD pipelines (DDPM, DDIM, PNDM, Euler, Euler ancestral,
//! DPM-Solver, …) shares the training-time fields read here: `num_train_timesteps` (1000),
//! `beta_start` (0.0001), `beta_end` (0.02), `beta_schedule` ("linear"), `trained_betas`,
//! `prediction_type` and `rescale_betas_zero_snr` (false); defaults in brackets are diffusers'.
//! Betas, as in `DDPMScheduler.__init__` (diffusers 0.42):
//! - `trained_betas`: the list as given (it wins over `beta_schedule`);
//! - `linear`: `linspace(beta_start, beta_end, N)`;
//! - `scaled_linear`: `linspace(√beta_start, √beta_end, N)²` (latent diffusion);
//! - `squaredcos_cap_v2`: `β_i = min(1 − ᾱ(t_{i+1})/ᾱ(t_i), 0.999)` with `t_i = i/N` and
//!   `ᾱ(t) = cos²((t + 0.008)/1.008 · π/2)` (Nichol & Dhariwal, arXiv 2102.09672).
//!
//! With `rescale_betas_zero_snr`, `√ᾱ` is shifted and scaled so that `√ᾱ_0` is unchanged and
//! `√ᾱ_{N−1} = 0` (Lin et al., arXiv 2305.08891, Algorithm 1; diffusers'
//! `rescale_zero_terminal_snr`). Then `ᾱ_t = ∏_{s≤t} (1 − β_s)`.
//!
//! diffusers keeps `ᾱ` in f32; it is computed in f64 here (differences from diffusers ≤ 1e-6,
//! see `tests/objective_parity.rs`). With `x_t = √ᾱ_t·x₀ + √(1−ᾱ_t)·ε`:
//! - `SNR(t) = ᾱ_t / (1 − ᾱ_t)`;
//! - the v target is `v = √ᾱ_t·ε − √(1−ᾱ_t)·x₀` (Salimans & Ho, arXiv 2202.00512).

use std::path::{Path, PathBuf};

use candle_core::{DType, Tensor};
use serde_json::Value;

use crate::model::family::{FamilyError, PredictionType};

#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot parse {}", path.display())]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{}: `{field}` {problem}", file.display())]
    BadField {
        file: PathBuf,
        field: &'static str,
        problem: String,
    },
    #[error(
        "{}: `beta_schedule` is \"{value}\"; sdtrain supports \"linear\", \"scaled_linear\", \
         \"squaredcos_cap_v2\" or a `trained_betas` list",
        file.display()
    )]
    UnsupportedBetaSchedule { file: PathBuf, value: String },
    #[error("timestep {t} is outside the schedule's 0..{n}")]
    Timestep { t: u32, n: usize },
    #[error("{what}: {got} timesteps for a batch of {batch}")]
    BatchMismatch {
        what: &'static str,
        got: usize,
        batch: usize,
    },
    #[error(transparent)]
    Prediction(#[from] FamilyError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// How the betas are built, as named in the config.
#[derive(Debug, Clone, PartialEq)]
pub enum BetaSchedule {
    Linear { start: f64, end: f64 },
    ScaledLinear { start: f64, end: f64 },
    SquaredCosCapV2,
    Trained(Vec<f64>),
}

impl BetaSchedule {
    /// The `n` betas of this schedule.
    pub fn betas(&self, n: usize) -> Vec<f64> {
        match self {
            BetaSchedule::Linear { start, end } => linspace(*start, *end, n),
            BetaSchedule::ScaledLinear { start, end } => linspace(start.sqrt(), end.sqrt(), n)
                .into_iter()
                .map(|b| b * b)
                .collect(),
            BetaSchedule::SquaredCosCapV2 => {
                let alpha_bar = |t: f64| {
                    ((t + 0.008) / 1.008 * std::f64::consts::FRAC_PI_2)
                        .cos()
                        .powi(2)
                };
                (0..n)
                    .map(|i| {
                        let (t1, t2) = (i as f64 / n as f64, (i + 1) as f64 / n as f64);
                        (1.0 - alpha_bar(t2) / alpha_bar(t1)).min(0.999)
                    })
                    .collect()
            }
            BetaSchedule::Trained(b) => b.clone(),
        }
    }
}

/// `n` evenly spaced values from `a` to `b` inclusive (numpy/torch `linspace`).
fn linspace(a: f64, b: f64, n: usize) -> Vec<f64> {
    match n {
        0 => Vec::new(),
        1 => vec![a],
        _ => {
            let step = (b - a) / (n - 1) as f64;
            (0..n)
                .map(|i| if i == n - 1 { b } else { a + step * i as f64 })
                .collect()
        }
    }
}

/// diffusers' `rescale_zero_terminal_snr`: betas whose `√ᾱ` runs from the original `√ᾱ_0` to 0.
pub fn rescale_zero_terminal_snr(betas: &[f64]) -> Vec<f64> {
    let sqrt_ab: Vec<f64> = cumprod(betas).into_iter().map(f64::sqrt).collect();
    let (Some(&s0), Some(&s_t)) = (sqrt_ab.first(), sqrt_ab.last()) else {
        return Vec::new();
    };
    if s0 == s_t {
        // One step, or all betas zero: there is no range to rescale.
        return betas.to_vec();
    }
    let ab: Vec<f64> = sqrt_ab
        .iter()
        .map(|s| ((s - s_t) * s0 / (s0 - s_t)).powi(2))
        .collect();
    let mut out = Vec::with_capacity(ab.len());
    out.push(1.0 - ab[0]);
    out.extend(ab.windows(2).map(|w| 1.0 - w[1] / w[0]));
    out
}

/// `ᾱ_t = ∏_{s≤t} (1 − β_s)`.
fn cumprod(betas: &[f64]) -> Vec<f64> {
    betas
        .iter()
        .scan(1.0, |acc, b| {
            *acc *= 1.0 - b;
            Some(*acc)
        })
        .collect()
}

/// The discrete forward process `q(x_t | x₀)` of a model, `t ∈ 0..num_train_timesteps`.
#[derive(Debug, Clone)]
pub struct NoiseSchedule {
    alphas_cumprod: Vec<f64>,
    prediction_type: PredictionType,
}

impl NoiseSchedule {
    /// Reads a diffusers `scheduler_config.json`.
    pub fn from_file(path: &Path) -> Result<Self, ScheduleError> {
        let text = std::fs::read_to_string(path).map_err(|source| ScheduleError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let config: Value =
            crate::py_json::from_str(&text).map_err(|source| ScheduleError::Json {
                path: path.to_path_buf(),
                source,
            })?;
        Self::from_config(&config, path)
    }

    /// Builds the schedule from a parsed scheduler config (`file` names it in errors).
    pub fn from_config(config: &Value, file: &Path) -> Result<Self, ScheduleError> {
        let n = Self::read_num_train_timesteps(config, file)?;
        let schedule = match Self::field(config, "trained_betas") {
            Some(tb) => Self::read_trained_betas(config, file, tb, n)?,
            None => Self::read_named_schedule(config, file)?,
        };
        let rescale = match Self::field(config, "rescale_betas_zero_snr") {
            None => false,
            Some(v) => v.as_bool().ok_or_else(|| {
                Self::bad_field(file, "rescale_betas_zero_snr", "is not true or false")
            })?,
        };
        let prediction_type = PredictionType::from_scheduler_config(config, file)?;
        let n = match &schedule {
            BetaSchedule::Trained(b) => b.len(),
            _ => n,
        };
        let mut betas = schedule.betas(n);
        if betas.iter().any(|b| !(0.0..1.0).contains(b)) {
            return Err(Self::bad_field(
                file,
                "beta_start",
                "and `beta_end` (or `trained_betas`) give betas outside [0, 1)",
            ));
        }
        if rescale {
            betas = rescale_zero_terminal_snr(&betas);
        }
        Ok(Self::from_betas(&betas, prediction_type))
    }

    /// The config's field `name`, `None` when it is absent or null.
    fn field<'a>(config: &'a Value, name: &str) -> Option<&'a Value> {
        config.get(name).filter(|v| !v.is_null())
    }

    /// The error for a config field of `file` with the wrong kind of value.
    fn bad_field(file: &Path, field: &'static str, problem: &str) -> ScheduleError {
        ScheduleError::BadField {
            file: file.to_path_buf(),
            field,
            problem: problem.to_string(),
        }
    }

    /// `num_train_timesteps`, 1000 when absent.
    fn read_num_train_timesteps(config: &Value, file: &Path) -> Result<usize, ScheduleError> {
        Ok(match Self::field(config, "num_train_timesteps") {
            None => 1000,
            Some(v) => v
                .as_u64()
                .filter(|&n| (1..=100_000).contains(&n))
                .ok_or_else(|| {
                    Self::bad_field(
                        file,
                        "num_train_timesteps",
                        "is not an integer in 1..=100000",
                    )
                })? as usize,
        })
    }

    /// The `trained_betas` list `tb`, whose length must be `n` when `num_train_timesteps` is set.
    fn read_trained_betas(
        config: &Value,
        file: &Path,
        tb: &Value,
        n: usize,
    ) -> Result<BetaSchedule, ScheduleError> {
        let bad = |field: &'static str, problem: &str| Self::bad_field(file, field, problem);
        let list = tb
            .as_array()
            .ok_or_else(|| bad("trained_betas", "is not a list of numbers"))?;
        let betas = list
            .iter()
            .map(|v| v.as_f64().filter(|b| b.is_finite()))
            .collect::<Option<Vec<f64>>>()
            .ok_or_else(|| bad("trained_betas", "is not a list of numbers"))?;
        if Self::field(config, "num_train_timesteps").is_some() && betas.len() != n {
            return Err(bad(
                "trained_betas",
                &format!(
                    "has {} entries but `num_train_timesteps` is {n}",
                    betas.len()
                ),
            ));
        }
        Ok(BetaSchedule::Trained(betas))
    }

    /// The schedule `beta_schedule` names (linear when absent), from `beta_start` and `beta_end`.
    fn read_named_schedule(config: &Value, file: &Path) -> Result<BetaSchedule, ScheduleError> {
        let bad = |field: &'static str, problem: &str| Self::bad_field(file, field, problem);
        let number = |name: &'static str, default: f64| -> Result<f64, ScheduleError> {
            match Self::field(config, name) {
                None => Ok(default),
                Some(v) => v
                    .as_f64()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| bad(name, "is not a finite number")),
            }
        };
        let start = number("beta_start", 0.0001)?;
        let end = number("beta_end", 0.02)?;
        Ok(match Self::field(config, "beta_schedule") {
            None => BetaSchedule::Linear { start, end },
            Some(Value::String(s)) => match s.as_str() {
                "linear" => BetaSchedule::Linear { start, end },
                "scaled_linear" => {
                    if start < 0.0 || end < 0.0 {
                        return Err(bad(
                            "beta_start",
                            "and `beta_end` must be ≥ 0 for scaled_linear",
                        ));
                    }
                    BetaSchedule::ScaledLinear { start, end }
                }
                "squaredcos_cap_v2" => BetaSchedule::SquaredCosCapV2,
                other => {
                    return Err(ScheduleError::UnsupportedBetaSchedule {
                        file: file.to_path_buf(),
                        value: other.to_string(),
                    })
                }
            },
            Some(_) => return Err(bad("beta_schedule", "is not a string")),
        })
    }

    /// This schedule with zero terminal SNR (Lin et al. 2023, arXiv 2305.08891, Algorithm 1):
    /// the betas recovered from `ᾱ`, rescaled by [`rescale_zero_terminal_snr`] (diffusers'
    /// function, tested against it), so `ᾱ` ends at exactly 0. A schedule already at zero
    /// terminal SNR is unchanged.
    pub fn with_zero_terminal_snr(&self) -> Self {
        let mut prev = 1.0;
        let betas: Vec<f64> = self
            .alphas_cumprod
            .iter()
            .map(|&ab| {
                let beta = if prev > 0.0 { 1.0 - ab / prev } else { 1.0 };
                prev = ab;
                beta
            })
            .collect();
        Self::from_betas(&rescale_zero_terminal_snr(&betas), self.prediction_type)
    }

    /// A schedule from explicit betas (each in `[0, 1]`).
    /// Stable Diffusion's schedule (scaled_linear, β from 0.00085 to 0.012 over 1000 steps), for
    /// tests.
    #[cfg(test)]
    pub(crate) fn sd_for_tests(prediction_type: PredictionType) -> Self {
        let (a, b) = (0.00085f64.sqrt(), 0.012f64.sqrt());
        let betas: Vec<f64> = (0..1000)
            .map(|i| (a + (b - a) * i as f64 / 999.0).powi(2))
            .collect();
        Self::from_betas(&betas, prediction_type)
    }

    pub fn from_betas(betas: &[f64], prediction_type: PredictionType) -> Self {
        Self {
            alphas_cumprod: cumprod(betas),
            prediction_type,
        }
    }

    pub fn num_train_timesteps(&self) -> usize {
        self.alphas_cumprod.len()
    }

    /// `ᾱ_t` for every `t`.
    pub fn alphas_cumprod(&self) -> &[f64] {
        &self.alphas_cumprod
    }

    /// The config's `prediction_type` (epsilon when absent).
    pub fn prediction_type(&self) -> PredictionType {
        self.prediction_type
    }

    fn alpha_bar(&self, t: u32) -> Result<f64, ScheduleError> {
        self.alphas_cumprod
            .get(t as usize)
            .copied()
            .ok_or(ScheduleError::Timestep {
                t,
                n: self.alphas_cumprod.len(),
            })
    }

    /// `SNR(t) = ᾱ_t / (1 − ᾱ_t)`: 0 at a zero-terminal-SNR last step, +∞ when `β_0 = 0`.
    pub fn snr(&self, t: u32) -> Result<f64, ScheduleError> {
        let ab = self.alpha_bar(t)?;
        Ok(ab / (1.0 - ab))
    }

    /// `x_t = √ᾱ_t·x₀ + √(1−ᾱ_t)·ε`, per sample (`x0`, `noise`: `[B, …]`, `timesteps`: B).
    pub fn add_noise(
        &self,
        x0: &Tensor,
        noise: &Tensor,
        timesteps: &[u32],
    ) -> Result<Tensor, ScheduleError> {
        self.combine(x0, noise, timesteps, "add_noise", |ab| {
            (ab.sqrt(), (1.0 - ab).sqrt())
        })
    }

    /// `v = √ᾱ_t·ε − √(1−ᾱ_t)·x₀`, per sample (diffusers' `get_velocity`).
    pub fn velocity(
        &self,
        x0: &Tensor,
        noise: &Tensor,
        timesteps: &[u32],
    ) -> Result<Tensor, ScheduleError> {
        // Written as a·x₀ + b·ε with a = −√(1−ᾱ), b = √ᾱ.
        self.combine(x0, noise, timesteps, "velocity", |ab| {
            (-(1.0 - ab).sqrt(), ab.sqrt())
        })
    }

    /// What the UNet learns to predict: ε, or v.
    pub fn target(
        &self,
        prediction_type: PredictionType,
        x0: &Tensor,
        noise: &Tensor,
        timesteps: &[u32],
    ) -> Result<Tensor, ScheduleError> {
        match prediction_type {
            PredictionType::Epsilon => Ok(noise.clone()),
            PredictionType::VPrediction => self.velocity(x0, noise, timesteps),
        }
    }

    /// `a_t·x0 + b_t·noise` with per-sample `(a_t, b_t) = coeffs(ᾱ_t)`, in x0's dtype. The
    /// arithmetic runs in f32 for f16/bf16 inputs (diffusers runs it in the input dtype; f32
    /// keeps the bf16 result within one rounding of the exact value).
    fn combine(
        &self,
        x0: &Tensor,
        noise: &Tensor,
        timesteps: &[u32],
        what: &'static str,
        coeffs: impl Fn(f64) -> (f64, f64),
    ) -> Result<Tensor, ScheduleError> {
        let dims = x0.dims();
        let batch = dims.first().copied().unwrap_or(0);
        if timesteps.len() != batch || dims.is_empty() {
            return Err(ScheduleError::BatchMismatch {
                what,
                got: timesteps.len(),
                batch,
            });
        }
        if noise.dims() != dims {
            return Err(candle_core::Error::ShapeMismatchBinaryOp {
                lhs: x0.shape().clone(),
                rhs: noise.shape().clone(),
                op: what,
            }
            .into());
        }
        let mut a = Vec::with_capacity(batch);
        let mut b = Vec::with_capacity(batch);
        for &t in timesteps {
            let (ca, cb) = coeffs(self.alpha_bar(t)?);
            a.push(ca);
            b.push(cb);
        }
        let work = match x0.dtype() {
            DType::F64 => DType::F64,
            _ => DType::F32,
        };
        let mut coeff_shape = vec![1usize; dims.len()];
        coeff_shape[0] = batch;
        let device = x0.device();
        let a = Tensor::new(a, device)?
            .to_dtype(work)?
            .reshape(coeff_shape.as_slice())?;
        let b = Tensor::new(b, device)?
            .to_dtype(work)?
            .reshape(coeff_shape.as_slice())?;
        let x = x0.to_dtype(work)?.broadcast_mul(&a)?;
        let n = noise.to_dtype(work)?.broadcast_mul(&b)?;
        Ok((x + n)?.to_dtype(x0.dtype())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use serde_json::json;

    fn schedule(config: Value) -> Result<NoiseSchedule, ScheduleError> {
        NoiseSchedule::from_config(&config, Path::new("scheduler/scheduler_config.json"))
    }

    #[test]
    fn sd_scaled_linear_endpoints() {
        let s = schedule(json!({
            "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012
        }))
        .unwrap();
        assert_eq!(s.num_train_timesteps(), 1000);
        let ac = s.alphas_cumprod();
        assert!((ac[0] - (1.0 - 0.00085)).abs() < 1e-15);
        // Known value of SD's schedule: ᾱ_999 ≈ 0.0046601.
        assert!((ac[999] - 0.004_660_1).abs() < 1e-6, "{}", ac[999]);
        assert_eq!(s.prediction_type(), PredictionType::Epsilon);
    }

    #[test]
    fn defaults_are_diffusers_linear() {
        let s = schedule(json!({"_class_name": "DDPMScheduler"})).unwrap();
        let b = BetaSchedule::Linear {
            start: 0.0001,
            end: 0.02,
        }
        .betas(1000);
        assert_eq!(s.alphas_cumprod()[0], 1.0 - b[0]);
        assert!((b[999] - 0.02).abs() < 1e-18);
    }

    #[test]
    fn zero_snr_rescale_ends_at_zero_and_keeps_the_start() {
        let plain = schedule(
            json!({"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012}),
        )
        .unwrap();
        let s = schedule(json!({
            "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012,
            "rescale_betas_zero_snr": true
        }))
        .unwrap();
        assert_eq!(s.alphas_cumprod()[999], 0.0);
        assert_eq!(s.snr(999).unwrap(), 0.0);
        assert!((s.alphas_cumprod()[0] - plain.alphas_cumprod()[0]).abs() < 1e-12);
    }

    #[test]
    fn trained_betas_win_and_set_the_length() {
        let s = schedule(json!({"trained_betas": [0.1, 0.2, 0.5], "beta_schedule": "nonsense"}))
            .unwrap();
        assert_eq!(s.num_train_timesteps(), 3);
        assert!((s.alphas_cumprod()[2] - 0.9 * 0.8 * 0.5).abs() < 1e-15);
        let err = schedule(json!({"trained_betas": [0.1], "num_train_timesteps": 1000}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("trained_betas"), "{err}");
    }

    #[test]
    fn unknown_schedule_names_file_and_field() {
        let err = schedule(json!({"beta_schedule": "sigmoid"}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("scheduler/scheduler_config.json"), "{err}");
        assert!(err.contains("beta_schedule"), "{err}");
        assert!(err.contains("sigmoid"), "{err}");
        let err = schedule(json!({"beta_end": "x"})).unwrap_err().to_string();
        assert!(err.contains("`beta_end`"), "{err}");
        let err = schedule(json!({"prediction_type": "sample"}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("sample"), "{err}");
    }

    #[test]
    fn add_noise_and_velocity_per_sample() {
        let s = NoiseSchedule::from_betas(&[0.5, 0.5], PredictionType::VPrediction);
        let dev = Device::Cpu;
        let x0 = Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &dev).unwrap();
        let eps = Tensor::new(&[[1f32, 1.0], [-1.0, 0.0]], &dev).unwrap();
        let xt = s
            .add_noise(&x0, &eps, &[0, 1])
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let (a0, a1) = (0.5f64, 0.25f64);
        let want0 = [
            a0.sqrt() + (1.0 - a0).sqrt(),
            2.0 * a0.sqrt() + (1.0 - a0).sqrt(),
        ];
        let want1 = [3.0 * a1.sqrt() - (1.0 - a1).sqrt(), 4.0 * a1.sqrt()];
        for (g, w) in xt[0].iter().zip(want0).chain(xt[1].iter().zip(want1)) {
            assert!((*g as f64 - w).abs() < 1e-6, "{g} vs {w}");
        }
        let v = s
            .velocity(&x0, &eps, &[1, 1])
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let w = a1.sqrt() * 1.0 - (1.0 - a1).sqrt() * 1.0;
        assert!((v[0][0] as f64 - w).abs() < 1e-6);
        assert!(matches!(
            s.add_noise(&x0, &eps, &[0, 2]),
            Err(ScheduleError::Timestep { t: 2, n: 2 })
        ));
        assert!(matches!(
            s.add_noise(&x0, &eps, &[0]),
            Err(ScheduleError::BatchMismatch { .. })
        ));
        let t = s
            .target(PredictionType::Epsilon, &x0, &eps, &[0, 1])
            .unwrap();
        assert_eq!(t.to_vec2::<f32>().unwrap(), eps.to_vec2::<f32>().unwrap());
    }

    #[test]
    fn bf16_inputs_keep_their_dtype() {
        let s = NoiseSchedule::from_betas(&[0.1; 4], PredictionType::Epsilon);
        let x = Tensor::ones((2, 3), DType::BF16, &Device::Cpu).unwrap();
        let out = s.add_noise(&x, &x, &[0, 3]).unwrap();
        assert_eq!(out.dtype(), DType::BF16);
    }
}
