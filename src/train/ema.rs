//! [`Ema`]: an exponential moving average of the trainable parameters (EveryDream2's
//! `ema_decay_rate`, `ema_strength_target`, `ema_update_interval`, `ema_device`).
//!
//! Every `interval` optimizer steps each average moves toward its parameter:
//!
//! ```text
//! ema ← d·ema + (1 − d)·param          (train.py: ema.mul_(d).add_(param, alpha=1-d))
//! ```
//!
//! so after k updates with a constant parameter p, from a start e₀, `e_k = dᵏ·e₀ + (1 − dᵏ)·p`.
//! With `ema_strength_target` t the decay is chosen so that the start keeps a share t after the
//! run's `total_steps / interval` updates: `d = t^(interval / total_steps)`, decided by the plan
//! (`EmaPlan::decay_for_run`); this file takes the decay as given.
//!
//! The averages are f32 and live on the CPU by default, so a full fine-tune does not pay a
//! second copy of its weights in VRAM; each update then copies the parameters device→host (one
//! sync per update, every `interval` steps).

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor, Var};

use crate::config::{EmaDevice, EmaPlan};

/// What can go wrong with the EMA copy.
#[derive(Debug, thiserror::Error)]
pub enum EmaError {
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error("EMA of `{name}`")]
    Tensor {
        name: String,
        #[source]
        source: candle_core::Error,
    },
}

pub type Result<T> = std::result::Result<T, EmaError>;

/// An f32 copy of each trainable parameter, by name, on its own device.
pub struct Ema {
    decay: f64,
    /// OneTrainer's warm-up: the decay after k steps is `min(k/(9 + k), decay)`.
    warmup: bool,
    interval: usize,
    device: Device,
    names: Vec<String>,
    values: Vec<Tensor>,
}

impl Ema {
    /// The run's EMA copy when `plan` asks for one, over `params` as they start this run, on
    /// the CPU or the `training` device; a resumed run continues the save point's `resumed`
    /// EMA file, which must then exist. Announced on stderr.
    pub fn start(
        plan: Option<&EmaPlan>,
        params: &[(String, Var)],
        total_steps: usize,
        resumed: Option<&Path>,
        training: &Device,
    ) -> anyhow::Result<Option<Self>> {
        let Some(plan) = plan else {
            if let Some(f) = resumed.filter(|f| f.is_file()) {
                crate::console::say(format_args!(
                    "warning: {} is not continued: this run has no ema_decay_rate",
                    f.display()
                ));
            }
            return Ok(None);
        };
        let device = match plan.device {
            EmaDevice::Cpu => Device::Cpu,
            EmaDevice::Training => training.clone(),
        };
        let decay = plan.decay_for_run(total_steps);
        let mut ema = Self::new(params, decay, plan.update_interval, &device)?;
        ema.warmup = plan.warmup;
        if let Some(f) = resumed {
            if !f.is_file() {
                bail!(
                    "{} is missing: the save point was written without EMA, this run has it on",
                    f.display()
                );
            }
            ema.load(f).context("resuming the EMA")?;
        }
        let place = if device.is_cpu() {
            "the CPU"
        } else {
            "the device"
        };
        crate::console::say(format_args!(
            "ema: decay {decay} every {} steps, on {place}",
            plan.update_interval
        ));
        if total_steps < plan.update_interval {
            crate::console::say(format_args!(
                "warning: ema_update_interval {} is more than the run's {total_steps} steps: the \
                 EMA weights will equal the starting ones",
                plan.update_interval
            ));
        }
        Ok(Some(ema))
    }

    /// Starts the averages as copies of `params` (their values now) on `device`.
    pub fn new(
        params: &[(String, Var)],
        decay: f64,
        interval: usize,
        device: &Device,
    ) -> Result<Self> {
        let values = params
            .iter()
            .map(|(name, v)| to_f32_on(v.as_tensor(), device, name))
            .collect::<Result<_>>()?;
        Ok(Self {
            decay,
            warmup: false,
            interval: interval.max(1),
            device: device.clone(),
            names: params.iter().map(|(n, _)| n.clone()).collect(),
            values,
        })
    }

    pub fn decay(&self) -> f64 {
        self.decay
    }

    /// Whether the update is due after `steps` completed optimizer steps.
    pub fn due(&self, steps: usize) -> bool {
        steps > 0 && steps.is_multiple_of(self.interval)
    }

    /// The decay of the update after `steps` completed optimizer steps: the decay, or with
    /// the warm-up OneTrainer's `min((1 + n)/(10 + n), decay)` with `n = steps − 1`
    /// (`EMAModule.step`).
    pub fn decay_at(&self, steps: usize) -> f64 {
        match self.warmup {
            true => (steps as f64 / (9.0 + steps as f64)).min(self.decay),
            false => self.decay,
        }
    }

    /// `ema ← d·ema + (1 − d)·param` for each parameter, in `params`' order (the order `new`
    /// was given), after `steps` completed optimizer steps ([`Ema::decay_at`]).
    pub fn update(&mut self, params: &[Var], steps: usize) -> Result<()> {
        let d = self.decay_at(steps);
        for ((e, p), name) in self.values.iter_mut().zip(params).zip(&self.names) {
            let p = to_f32_on(p.as_tensor(), &self.device, name)?;
            let wrap = |source| EmaError::Tensor {
                name: name.clone(),
                source,
            };
            *e = ((&*e * d).map_err(wrap)? + (p * (1.0 - d)).map_err(wrap)?).map_err(wrap)?;
        }
        Ok(())
    }

    /// The averages, in the order of `new`'s parameters.
    pub fn values(&self) -> &[Tensor] {
        &self.values
    }

    /// Runs `f` with `params` holding the averages, then puts their own values back, whether
    /// `f` succeeded or not. The live values wait on the EMA's device meanwhile.
    pub fn with_weights<T>(
        &self,
        params: &[Var],
        f: impl FnOnce() -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let mut live = Vec::with_capacity(params.len());
        for (p, name) in params.iter().zip(&self.names) {
            // `copy` so that setting the Var below does not write through into the saved one.
            let t = p
                .as_tensor()
                .to_device(&self.device)
                .and_then(|t| t.copy())
                .map_err(|source| EmaError::Tensor {
                    name: name.clone(),
                    source,
                })?;
            live.push(t);
        }
        let set = |values: &[Tensor]| -> anyhow::Result<()> {
            for ((p, v), name) in params.iter().zip(values).zip(&self.names) {
                p.set(&v.to_dtype(p.dtype())?.to_device(p.device())?)
                    .map_err(|source| EmaError::Tensor {
                        name: name.clone(),
                        source,
                    })?;
            }
            Ok(())
        };
        let result = set(&self.values).and_then(|()| f());
        set(&live)?;
        result
    }

    /// Writes the averages by name to `path` (a save point's `ema.safetensors`).
    pub fn save(&self, path: &Path) -> Result<()> {
        let tensors: HashMap<String, Tensor> = self
            .names
            .iter()
            .cloned()
            .zip(self.values.iter().cloned())
            .collect();
        candle_core::safetensors::save(&tensors, path).map_err(|e| EmaError::File {
            path: path.display().to_string(),
            message: e.to_string(),
        })
    }

    /// Replaces every average with the tensor `lookup` gives for its name, which must exist
    /// with the average's shape (`ema_resume_model`).
    pub fn start_from(&mut self, lookup: impl Fn(&str) -> Option<Tensor>) -> Result<()> {
        let err = |name: &str, message: String| EmaError::File {
            path: name.to_string(),
            message,
        };
        for (name, value) in self.names.iter().zip(self.values.iter_mut()) {
            let Some(t) = lookup(name) else {
                return Err(err(name, "is not in the model".to_string()));
            };
            if t.dims() != value.dims() {
                return Err(err(
                    name,
                    format!("is {:?} there, this run's is {:?}", t.dims(), value.dims()),
                ));
            }
            *value = to_f32_on(&t, &self.device, name)?;
        }
        Ok(())
    }

    /// Replaces the averages with those saved in `path`, which must hold exactly this EMA's
    /// names with its shapes.
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let err = |message: String| EmaError::File {
            path: path.display().to_string(),
            message,
        };
        let saved = candle_core::safetensors::load(path, &self.device)
            .map_err(|e| err(format!("cannot be read: {e}")))?;
        if saved.len() != self.names.len() {
            return Err(err(format!(
                "holds {} tensors, this run's EMA has {}",
                saved.len(),
                self.names.len()
            )));
        }
        for (name, value) in self.names.iter().zip(self.values.iter_mut()) {
            let Some(t) = saved.get(name) else {
                return Err(err(format!("has no `{name}`")));
            };
            if t.dims() != value.dims() {
                return Err(err(format!(
                    "`{name}` is {:?}, this run's is {:?}",
                    t.dims(),
                    value.dims()
                )));
            }
            *value = to_f32_on(t, &self.device, name)?;
        }
        Ok(())
    }
}

fn to_f32_on(t: &Tensor, device: &Device, name: &str) -> Result<Tensor> {
    // `copy`: the average must own its storage, not alias a Var the optimizer updates in place.
    t.to_dtype(DType::F32)
        .and_then(|t| t.to_device(device))
        .and_then(|t| t.copy())
        .map_err(|source| EmaError::Tensor {
            name: name.to_string(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn var(values: &[f32]) -> Var {
        Var::from_tensor(&Tensor::new(values, &Device::Cpu).unwrap()).unwrap()
    }

    fn vals(t: &Tensor) -> Vec<f32> {
        t.to_vec1().unwrap()
    }

    fn close(got: &[f32], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!(
                (f64::from(*g) - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{got:?} vs {want:?}"
            );
        }
    }

    fn ema_of(v: &Var, decay: f64, interval: usize) -> Ema {
        Ema::new(&[("p".into(), v.clone())], decay, interval, &Device::Cpu).unwrap()
    }

    /// OneTrainer's warm-up (`EMAModule.step`: `min((1 + n)/(10 + n), decay)` with
    /// `n = global_step // accumulation`, 0 at the first update): 0.1 at the first step, 5/14
    /// at the fifth, then the decay itself. Catches `n` counted from 1 (2/11 first) or the cap
    /// missing.
    #[test]
    fn warmup_follows_onetrainers_decay() {
        let v = var(&[2.0f32]);
        let mut ema = ema_of(&v, 0.999, 1);
        assert_eq!(ema.decay_at(1), 0.999, "off without the warm-up");
        ema.warmup = true;
        assert!((ema.decay_at(1) - 0.1).abs() < 1e-15);
        assert!((ema.decay_at(5) - 5.0 / 14.0).abs() < 1e-15);
        assert!((ema.decay_at(1000) - 1000.0 / 1009.0).abs() < 1e-15);
        assert_eq!(ema.decay_at(100_000), 0.999);
        v.set(&Tensor::new(&[0.5f32], &Device::Cpu).unwrap())
            .unwrap();
        ema.update(std::slice::from_ref(&v), 1).unwrap();
        ema.update(std::slice::from_ref(&v), 2).unwrap();
        let first = 0.1 * 2.0 + 0.9 * 0.5;
        close(
            &vals(&ema.values()[0]),
            &[2.0 / 11.0 * first + 9.0 / 11.0 * 0.5],
        );
    }

    /// Catches a swapped `d` and `1 − d`, a missing `(1 − d)·param` term, or a start that is not
    /// the parameter's value at creation.
    #[test]
    fn constant_param_follows_the_closed_form() {
        let (e0, p, d) = ([2.0f32, -1.0, 0.5], [0.5f32, 3.0, 0.5], 0.9f64);
        let v = var(&e0);
        let mut ema = ema_of(&v, d, 1);
        v.set(&Tensor::new(&p, &Device::Cpu).unwrap()).unwrap();
        for k in 1..=5 {
            ema.update(std::slice::from_ref(&v), 1).unwrap();
            let dk = d.powi(k);
            let want: Vec<f64> = e0
                .iter()
                .zip(&p)
                .map(|(e, p)| dk * f64::from(*e) + (1.0 - dk) * f64::from(*p))
                .collect();
            close(&vals(&ema.values()[0]), &want);
        }
    }

    /// Hand-computed with d = 0.5 from e₀ = 0: params 4, 8, 2 give 2, 5, 3.5. Catches an update
    /// that reads the previous parameter, or one that compounds from e₀ instead of the last
    /// average.
    #[test]
    fn changing_params_by_hand() {
        let v = var(&[0.0]);
        let mut ema = ema_of(&v, 0.5, 1);
        for (p, want) in [(4.0f32, 2.0), (8.0, 5.0), (2.0, 3.5)] {
            v.set(&Tensor::new(&[p], &Device::Cpu).unwrap()).unwrap();
            ema.update(std::slice::from_ref(&v), 1).unwrap();
            close(&vals(&ema.values()[0]), &[want]);
        }
    }

    /// The averages are copies: an in-place change of the Var does not reach them. Catches a
    /// start that aliases the Var's storage (no `copy`).
    #[test]
    fn the_start_is_a_copy() {
        let v = var(&[1.0, 2.0]);
        let ema = ema_of(&v, 0.9, 1);
        v.set(&Tensor::new(&[7.0f32, 7.0], &Device::Cpu).unwrap())
            .unwrap();
        close(&vals(&ema.values()[0]), &[1.0, 2.0]);
    }

    /// Every 3rd step only. Catches an off-by-one (`steps + 1`) or an update at step 0.
    #[test]
    fn due_every_interval() {
        let ema = ema_of(&var(&[0.0]), 0.9, 3);
        let due: Vec<usize> = (0..10).filter(|s| ema.due(*s)).collect();
        assert_eq!(due, [3, 6, 9]);
    }

    /// The Vars hold the averages inside `f` and their own values after it, also when `f`
    /// fails. Catches a restore skipped by `?` on `f`'s error.
    #[test]
    fn with_weights_restores_on_error() {
        let v = var(&[4.0]);
        let mut ema = ema_of(&v, 0.5, 1);
        v.set(&Tensor::new(&[8.0f32], &Device::Cpu).unwrap())
            .unwrap();
        ema.update(std::slice::from_ref(&v), 1).unwrap(); // 6
        let seen = ema
            .with_weights(std::slice::from_ref(&v), || Ok(vals(v.as_tensor())))
            .unwrap();
        assert_eq!(seen, [6.0]);
        assert_eq!(vals(v.as_tensor()), [8.0]);
        let err = ema.with_weights(std::slice::from_ref(&v), || -> anyhow::Result<()> {
            anyhow::bail!("disk full")
        });
        assert!(err.is_err());
        assert_eq!(vals(v.as_tensor()), [8.0]);
    }

    /// A save and load round-trips bit for bit; a file of other names is refused by name.
    #[test]
    fn start_from_takes_each_tensor_by_name_and_checks_shapes() {
        let v = var(&[1.0, 2.0]);
        let mut ema = ema_of(&v, 0.5, 1);
        let other = Tensor::new(&[5.0f32, 7.0], &Device::Cpu).unwrap();
        ema.start_from(|n| (n == "p").then(|| other.clone()))
            .unwrap();
        close(&vals(&ema.values()[0]), &[5.0, 7.0]);
        // The next update moves from the loaded start: 0.5·5 + 0.5·1.
        ema.update(std::slice::from_ref(&v), 1).unwrap();
        close(&vals(&ema.values()[0]), &[3.0, 4.5]);
        let err = ema.start_from(|_| None).unwrap_err();
        assert_eq!(err.to_string(), "p: is not in the model");
        let wrong = Tensor::new(&[1.0f32, 2.0, 3.0], &Device::Cpu).unwrap();
        let err = ema.start_from(|_| Some(wrong.clone())).unwrap_err();
        assert!(err.to_string().contains("[3]"), "{err}");
    }

    #[test]
    fn save_and_load() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("ema.safetensors");
        let v = var(&[0.1, 0.2]);
        let mut ema = ema_of(&v, 0.3, 1);
        v.set(&Tensor::new(&[0.7f32, -0.9], &Device::Cpu).unwrap())
            .unwrap();
        ema.update(std::slice::from_ref(&v), 1).unwrap();
        ema.save(&path).unwrap();
        let mut other = ema_of(&var(&[0.0, 0.0]), 0.3, 1);
        other.load(&path).unwrap();
        assert_eq!(vals(&other.values()[0]), vals(&ema.values()[0]));
        let mut renamed =
            Ema::new(&[("q".into(), var(&[0.0, 0.0]))], 0.3, 1, &Device::Cpu).unwrap();
        let err = renamed.load(&path).unwrap_err();
        assert!(err.to_string().contains("has no `q`"), "{err}");
    }
}
