//! The inference-time fields of a diffusers `scheduler_config.json` and the timestep spacings
//! both samplers share.
//!
//! A model's config is usually saved by another scheduler class (SD1.5's by PNDM, SDXL's by
//! Euler), so fields the file lacks take the defaults of the class being built, as diffusers'
//! `SchedulerClass.from_config(config)` does:
//!
//! | field | DDIM | Euler ancestral |
//! |---|---|---|
//! | `timestep_spacing` | `leading` | `linspace` |
//! | `steps_offset` | 0 | 0 |
//! | `set_alpha_to_one` | true | — |
//! | `clip_sample` (`clip_sample_range`) | true (1.0) | — |

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::diffusion::{NoiseSchedule, ScheduleError};
use crate::error_chain::Chain;

/// How inference timesteps are spread over the training ones (diffusers' `timestep_spacing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spacing {
    /// `round(linspace(0, N − 1, n))`, descending.
    Linspace,
    /// `k·(N // n) + steps_offset` for `k = n − 1 … 0`.
    Leading,
    /// `round(arange(N, 0, −N/n)) − 1`.
    Trailing,
}

impl Spacing {
    pub(crate) fn parse(s: &str) -> Option<Self> {
        match s {
            "linspace" => Some(Self::Linspace),
            "leading" => Some(Self::Leading),
            "trailing" => Some(Self::Trailing),
            _ => None,
        }
    }

    /// The `n` inference timesteps (descending, as f64) of a schedule with `train` steps.
    /// `integer` rounds the linspace values as DDIM does; Euler keeps them fractional.
    pub fn timesteps(self, train: usize, n: usize, offset: usize, integer: bool) -> Vec<f64> {
        let nf = train as f64;
        let mut t: Vec<f64> = match self {
            Spacing::Linspace => (0..n)
                .map(|k| {
                    let v = if n == 1 {
                        0.0
                    } else {
                        (nf - 1.0) * k as f64 / (n - 1) as f64
                    };
                    if integer {
                        round_half_even(v)
                    } else {
                        f64::from(v as f32)
                    }
                })
                .collect(),
            Spacing::Leading => {
                let ratio = train / n;
                (0..n).map(|k| (k * ratio + offset) as f64).collect()
            }
            Spacing::Trailing => {
                let ratio = nf / n as f64;
                // numpy's `arange(N, 0, −ratio)`: `N − i·ratio` while positive.
                let mut v: Vec<f64> = (0..)
                    .map(|i| nf - i as f64 * ratio)
                    .take_while(|&x| x > 0.0)
                    .map(|x| round_half_even(x) - 1.0)
                    .collect();
                v.reverse();
                v
            }
        };
        t.reverse();
        t
    }
}

/// numpy's `round` (half to even).
pub(crate) fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - x.signum()
    } else {
        r
    }
}

/// The scheduler config's fields a sampler reads, with the noise schedule they describe.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub file: PathBuf,
    pub schedule: NoiseSchedule,
    /// `rescale_betas_zero_snr`.
    pub zero_terminal_snr: bool,
    pub spacing: Option<Spacing>,
    pub steps_offset: usize,
    pub set_alpha_to_one: Option<bool>,
    pub clip_sample: Option<bool>,
    pub clip_sample_range: f64,
    /// DPM-Solver's fields (diffusers' `DPMSolverMultistepScheduler`), when the file has them.
    pub dpm: DpmFields,
    /// `use_karras_sigmas`, which Euler, LMS and KDPM2 ancestral read from the file (DPM++
    /// takes it from its name).
    pub use_karras_sigmas: Option<bool>,
    /// PNDM's `skip_prk_steps` (false when absent: Runge–Kutta warm-up steps first).
    pub skip_prk_steps: Option<bool>,
    /// `variance_type` (DDPM's; one of `fixed_small`, `fixed_large`, `learned`,
    /// `learned_range`).
    pub variance_type: Option<String>,
    /// Euler's `interpolation_type` is `"log_linear"` (not supported; Euler refuses it).
    pub log_linear_interpolation: bool,
    /// Euler's `timestep_type` is `"continuous"` (Euler refuses it under v-prediction).
    pub continuous_timesteps: bool,
    /// DPM-Solver single-step's `algorithm_type`, when the file names one.
    pub algorithm_type: Option<String>,
}

impl SchedulerConfig {
    /// Why this config cannot build a sampler: `field` of the file and its `problem`.
    pub fn refuse(&self, field: &'static str, problem: &str) -> String {
        ScheduleError::BadField {
            file: self.file.clone(),
            field,
            problem: problem.to_string(),
        }
        .to_string()
    }

    /// Refuses zero terminal SNR for a sampler whose diffusers class (`class`) ignores
    /// `rescale_betas_zero_snr`: it would draw on another schedule than the model was trained on.
    pub fn refuse_zero_snr(&self, class: &str) -> Result<(), String> {
        match self.zero_terminal_snr {
            false => Ok(()),
            true => Err(self.refuse(
                "rescale_betas_zero_snr",
                &format!(
                    "is true; diffusers' {class} ignores it and would sample on the unrescaled \
                     schedule, so sdtrain refuses; use ddim, ddpm, euler, euler_a or a dpm++_2m \
                     sampler"
                ),
            )),
        }
    }
}

/// The `DPMSolverMultistepScheduler` fields of a scheduler config; `None` takes the class's
/// default (order 2, midpoint, lower order final, no Euler at final, a final sigma of zero,
/// no λ clipping).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DpmFields {
    pub solver_order: Option<usize>,
    /// `solver_type`: `"heun"` (true) or `"midpoint"`.
    pub heun: Option<bool>,
    pub lower_order_final: Option<bool>,
    pub euler_at_final: Option<bool>,
    /// `final_sigmas_type`: `"sigma_min"` (true) or `"zero"`.
    pub final_sigma_min: Option<bool>,
    pub lambda_min_clipped: Option<f64>,
}

impl SchedulerConfig {
    /// The scheduler config of a loaded model: its `scheduler_config.json`, or the one a
    /// single-file checkpoint carries or was given.
    pub fn from_layout(layout: &crate::model::layout::ModelLayout) -> Result<Self, ScheduleError> {
        let config = layout
            .scheduler_json()
            .map_err(|e| ScheduleError::BadField {
                file: layout.scheduler_config.clone(),
                field: "scheduler",
                problem: format!("cannot be read: {}", Chain(&e)),
            })?;
        Self::from_config(&config, &layout.scheduler_config)
    }

    /// Reads `config` (`file` names it in errors).
    pub fn from_config(config: &Value, file: &Path) -> Result<Self, ScheduleError> {
        let bad = |field: &'static str, problem: &str| ScheduleError::BadField {
            file: file.to_path_buf(),
            field,
            problem: problem.to_string(),
        };
        let field = |name: &str| config.get(name).filter(|v| !v.is_null());
        let flag = |name: &'static str| -> Result<Option<bool>, ScheduleError> {
            field(name)
                .map(|v| v.as_bool().ok_or_else(|| bad(name, "is not true or false")))
                .transpose()
        };
        let spacing = field("timestep_spacing")
            .map(|v| {
                v.as_str().and_then(Spacing::parse).ok_or_else(|| {
                    bad(
                        "timestep_spacing",
                        "is not \"linspace\", \"leading\" or \"trailing\"",
                    )
                })
            })
            .transpose()?;
        let steps_offset = match field("steps_offset") {
            None => 0,
            Some(v) => v
                .as_u64()
                .filter(|&n| n < 1000)
                .ok_or_else(|| bad("steps_offset", "is not a small non-negative integer"))?
                as usize,
        };
        let clip_sample_range = match field("clip_sample_range") {
            None => 1.0,
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| bad("clip_sample_range", "is not a positive number"))?,
        };
        let choice =
            |name: &'static str, yes: &str, no: &str| -> Result<Option<bool>, ScheduleError> {
                field(name)
                    .map(|v| match v.as_str() {
                        Some(x) if x == yes => Ok(true),
                        Some(x) if x == no => Ok(false),
                        _ => Err(bad(name, &format!("is not \"{yes}\" or \"{no}\""))),
                    })
                    .transpose()
            };
        let dpm = DpmFields {
            solver_order: field("solver_order")
                .map(|v| {
                    v.as_u64()
                        .filter(|n| (1..=3).contains(n))
                        .map(|n| n as usize)
                        .ok_or_else(|| bad("solver_order", "is not 1, 2 or 3"))
                })
                .transpose()?,
            // UniPC's `bh1`/`bh2` and DEIS's `logrho` are what diffusers' DPM-Solver classes
            // turn into `midpoint` when built from those classes' configs.
            heun: match field("solver_type").and_then(Value::as_str) {
                Some("bh1" | "bh2" | "logrho") => Some(false),
                _ => choice("solver_type", "heun", "midpoint")?,
            },
            lower_order_final: flag("lower_order_final")?,
            euler_at_final: flag("euler_at_final")?,
            final_sigma_min: choice("final_sigmas_type", "sigma_min", "zero")?,
            lambda_min_clipped: field("lambda_min_clipped")
                .map(|v| {
                    v.as_f64()
                        .filter(|x| !x.is_nan())
                        .ok_or_else(|| bad("lambda_min_clipped", "is not a number"))
                })
                .transpose()?,
        };
        for (name, unsupported) in [
            ("use_exponential_sigmas", "exponential sigmas"),
            ("use_beta_sigmas", "beta sigmas"),
            ("use_lu_lambdas", "uniform-λ steps"),
            ("use_flow_sigmas", "flow-matching sigmas"),
        ] {
            if flag(name)? == Some(true) {
                return Err(bad(
                    name,
                    &format!("is true; {unsupported} are not supported (Stable Diffusion's schedulers do not use them)"),
                ));
            }
        }
        for name in ["sigma_min", "sigma_max"] {
            if field(name).is_some() {
                return Err(bad(
                    name,
                    "is set; Karras sigmas between given bounds are not supported (Stable \
                     Diffusion's schedulers leave it null)",
                ));
            }
        }
        if let Some(v) = field("variance_type") {
            // Read by DDPM only; DPM-Solver's `learned` types drop extra output channels the
            // Stable Diffusion UNets do not have.
            if !matches!(
                v.as_str(),
                Some("fixed_small" | "fixed_large" | "learned" | "learned_range")
            ) {
                return Err(bad(
                    "variance_type",
                    "is not \"fixed_small\", \"fixed_large\", \"learned\" or \"learned_range\"",
                ));
            }
        }
        if flag("thresholding")? == Some(true) {
            return Err(bad(
                "thresholding",
                "is true; dynamic thresholding (for pixel-space models) is not supported",
            ));
        }
        Ok(Self {
            file: file.to_path_buf(),
            schedule: NoiseSchedule::from_config(config, file)?,
            zero_terminal_snr: flag("rescale_betas_zero_snr")?.unwrap_or(false),
            spacing,
            steps_offset,
            set_alpha_to_one: flag("set_alpha_to_one")?,
            clip_sample: flag("clip_sample")?,
            clip_sample_range,
            dpm,
            use_karras_sigmas: flag("use_karras_sigmas")?,
            skip_prk_steps: flag("skip_prk_steps")?,
            variance_type: field("variance_type")
                .and_then(|v| v.as_str())
                .map(str::to_string),
            log_linear_interpolation: choice("interpolation_type", "log_linear", "linear")?
                .unwrap_or(false),
            continuous_timesteps: choice("timestep_type", "continuous", "discrete")?
                .unwrap_or(false),
            algorithm_type: field("algorithm_type")
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| bad("algorithm_type", "is not a string"))
                })
                .transpose()?,
        })
    }
}

/// An SD1.5-like config (`m/scheduler_config.json`) with `extra`'s fields, for the samplers' unit
/// tests.
#[cfg(test)]
pub(crate) fn test_config(extra: serde_json::Value) -> SchedulerConfig {
    let mut cfg = serde_json::json!({
        "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
        "num_train_timesteps": 1000, "steps_offset": 1,
    });
    if let (Some(c), Some(e)) = (cfg.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    SchedulerConfig::from_config(&cfg, Path::new("m/scheduler_config.json")).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spacings_match_diffusers_for_ten_steps() {
        // DDIMScheduler.set_timesteps(10) with N = 1000.
        assert_eq!(
            Spacing::Leading.timesteps(1000, 10, 1, true),
            [901., 801., 701., 601., 501., 401., 301., 201., 101., 1.]
        );
        assert_eq!(
            Spacing::Trailing.timesteps(1000, 10, 0, true),
            [999., 899., 799., 699., 599., 499., 399., 299., 199., 99.]
        );
        assert_eq!(
            Spacing::Linspace.timesteps(1000, 10, 0, true),
            [999., 888., 777., 666., 555., 444., 333., 222., 111., 0.]
        );
        // Euler keeps linspace's fractions (as f32).
        let t = Spacing::Linspace.timesteps(1000, 4, 0, false);
        assert_eq!(t, [999.0, 666.0, 333.0, 0.0]);
        let t = Spacing::Linspace.timesteps(1000, 7, 0, false);
        assert!((t[1] - 832.5).abs() < 1e-9, "{t:?}");
    }

    #[test]
    fn rounding_is_half_to_even_as_numpy() {
        assert_eq!(round_half_even(832.5), 832.0);
        assert_eq!(round_half_even(833.5), 834.0);
        assert_eq!(round_half_even(2.4), 2.0);
    }
}
