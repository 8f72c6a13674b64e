//! AdamW with torch.optim.AdamW semantics (amsgrad = false, maximize = false).
//!
//! Decoupled weight decay, Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
//! arXiv 1711.05101, in torch's form. For each parameter `p` with gradient `g`, at its own step
//! count `t` (incremented only on steps where `p` has a gradient, as torch's per-parameter
//! `state["step"]`):
//!
//! ```text
//! p  ← p · (1 − lr·λ)
//! m  ← m + (1 − β1)·(g − m)            (torch: exp_avg.lerp_(g, 1 − β1))
//! v  ← β2·v + (1 − β2)·g²
//! p  ← p − (lr / (1 − β1^t)) · m / (sqrt(v) / sqrt(1 − β2^t) + ε)
//! ```
//!
//! The moments `m`, `v` are f32 whatever the parameter dtype. A bf16/f16 parameter is upcast,
//! updated in f32, and rounded back once per step (there is no f32 master copy: an update smaller
//! than half a bf16 ulp of `p` is lost, as with torch on a bf16 parameter with f32 state).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use super::grad::summarize;
use super::state::{self, StateReader, OPTIMIZER_KEY, VERSION_KEY};
use super::{Finite, OptimError, Optimizer, Result, StepStats};

const NAME: &str = "adamw";
const STATE_VERSION: &str = "1";
const HYPER_KEY: &str = "adamw.hyperparams";
const STEPS_KEY: &str = "adamw.steps";
const EXP_AVG: &str = ".exp_avg";
const EXP_AVG_SQ: &str = ".exp_avg_sq";

/// AdamW hyper-parameters. `Default` is torch's: lr 1e-3, betas (0.9, 0.999), eps 1e-8,
/// weight_decay 1e-2.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWParams {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWParams {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

impl AdamWParams {
    /// The ranges torch.optim.AdamW accepts.
    pub fn validate(&self) -> Result<()> {
        let check = |field, value: f64, ok: bool, allowed| {
            if ok {
                Ok(())
            } else {
                Err(OptimError::InvalidParam {
                    field,
                    value,
                    allowed,
                })
            }
        };
        check("lr", self.lr, self.lr >= 0.0, "must be >= 0")?;
        let beta_ok = |b: f64| (0.0..1.0).contains(&b);
        check(
            "beta1",
            self.beta1,
            beta_ok(self.beta1),
            "must be in [0, 1)",
        )?;
        check(
            "beta2",
            self.beta2,
            beta_ok(self.beta2),
            "must be in [0, 1)",
        )?;
        check("eps", self.eps, self.eps >= 0.0, "must be >= 0")?;
        check(
            "weight_decay",
            self.weight_decay,
            self.weight_decay >= 0.0,
            "must be >= 0",
        )
    }
}

/// One parameter and its optimizer state, kept side by side.
#[derive(Debug)]
pub struct ParamState {
    name: String,
    var: Var,
    /// First moment, f32, same shape and device as `var`.
    exp_avg: Tensor,
    /// Second moment, f32, same shape and device as `var`.
    exp_avg_sq: Tensor,
    /// Steps this parameter has been updated (torch's per-parameter `state["step"]`).
    step: u64,
}

impl ParamState {
    fn new(name: String, var: Var) -> Result<Self> {
        let zeros = Tensor::zeros(var.shape(), DType::F32, var.device())?;
        Ok(Self {
            name,
            var,
            exp_avg: zeros.clone(),
            exp_avg_sq: zeros,
            step: 0,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn var(&self) -> &Var {
        &self.var
    }
    pub fn exp_avg(&self) -> &Tensor {
        &self.exp_avg
    }
    pub fn exp_avg_sq(&self) -> &Tensor {
        &self.exp_avg_sq
    }
    pub fn step(&self) -> u64 {
        self.step
    }

    /// One AdamW update of this parameter from `grad`, computed in f32.
    fn update(&mut self, grad: &Tensor, h: &AdamWParams) -> candle_core::Result<()> {
        // A Var's gradient from candle's backward still tracks the ops that made it (only
        // intermediate gradients are detached): keeping it in the moments would chain every
        // step's forward graph into the state, a leak of one activation set per step.
        let g = grad.detach().to_dtype(DType::F32)?;
        let t = self.step + 1;
        let m = (&self.exp_avg + ((&g - &self.exp_avg)? * (1.0 - h.beta1))?)?;
        let v = ((&self.exp_avg_sq * h.beta2)? + (g.sqr()? * (1.0 - h.beta2))?)?;
        // Bias corrections in f64 on the host, as torch computes them from a Python float step
        // (`beta ** step` is C `pow`, hence powf and not powi).
        let bc1 = 1.0 - h.beta1.powf(t as f64);
        let bc2_sqrt = (1.0 - h.beta2.powf(t as f64)).sqrt();
        let step_size = h.lr / bc1;
        let denom = ((v.sqrt()? / bc2_sqrt)? + h.eps)?;
        let p = self.var.as_detached_tensor().to_dtype(DType::F32)?;
        let p = (p * (1.0 - h.lr * h.weight_decay))?;
        let p = (p - ((&m / &denom)? * step_size)?)?;
        // Write back only after every fallible op, so an error leaves this parameter unchanged.
        let p = p.to_dtype(self.var.dtype())?;
        self.var.set(&p)?;
        self.exp_avg = m;
        self.exp_avg_sq = v;
        self.step = t;
        Ok(())
    }
}

/// AdamW over a named parameter list. See the module docs for the update.
#[derive(Debug)]
pub struct AdamW {
    params: Vec<ParamState>,
    hyper: AdamWParams,
}

impl AdamW {
    /// Creates the optimizer with zeroed f32 moments for every parameter. Names must be unique:
    /// they key the saved state.
    pub fn new(params: Vec<(String, Var)>, hyper: AdamWParams) -> Result<Self> {
        hyper.validate()?;
        let mut seen = HashSet::new();
        let mut states = Vec::with_capacity(params.len());
        for (name, var) in params {
            if !seen.insert(name.clone()) {
                return Err(OptimError::DuplicateParam(name));
            }
            states.push(ParamState::new(name, var)?);
        }
        Ok(Self {
            params: states,
            hyper,
        })
    }

    pub fn hyper(&self) -> &AdamWParams {
        &self.hyper
    }

    /// Every parameter with its state, in construction order.
    pub fn params(&self) -> &[ParamState] {
        &self.params
    }

    /// The state of the parameter called `name`.
    pub fn state(&self, name: &str) -> Option<&ParamState> {
        self.params.iter().find(|p| p.name == name)
    }

    /// The parameters, for [`super::grad_norm`] / [`super::clip_grad_norm`].
    pub fn vars(&self) -> impl Iterator<Item = &Var> {
        self.params.iter().map(|p| &p.var)
    }

    fn metadata(&self) -> Result<HashMap<String, String>> {
        let steps: BTreeMap<&str, u64> = self
            .params
            .iter()
            .map(|p| (p.name.as_str(), p.step))
            .collect();
        let json = |e: serde_json::Error| OptimError::Format {
            path: Default::default(),
            msg: e.to_string(),
        };
        Ok(HashMap::from([
            (OPTIMIZER_KEY.to_string(), NAME.to_string()),
            (VERSION_KEY.to_string(), STATE_VERSION.to_string()),
            (
                HYPER_KEY.to_string(),
                serde_json::to_string(&self.hyper).map_err(json)?,
            ),
            (
                STEPS_KEY.to_string(),
                serde_json::to_string(&steps).map_err(json)?,
            ),
        ]))
    }

    /// Reads and checks the whole file before anything is replaced.
    fn read_state(&self, r: &StateReader<'_>) -> Result<Vec<(Tensor, Tensor, u64)>> {
        let path = r.path().to_path_buf();
        let found = r.meta(OPTIMIZER_KEY)?;
        if found != NAME {
            return Err(OptimError::WrongOptimizer {
                path,
                found: found.to_string(),
                want: NAME,
            });
        }
        let version = r.meta(VERSION_KEY)?;
        if version != STATE_VERSION {
            return Err(OptimError::Format {
                path,
                msg: format!("state version {version}, this build reads {STATE_VERSION}"),
            });
        }
        let steps: HashMap<String, u64> =
            serde_json::from_str(r.meta(STEPS_KEY)?).map_err(|e| OptimError::Format {
                path: path.clone(),
                msg: format!("metadata `{STEPS_KEY}`: {e}"),
            })?;

        let known: HashSet<&str> = self.params.iter().map(|p| p.name.as_str()).collect();
        let mut unknown: Vec<String> = r
            .names()
            .into_iter()
            .filter(|t| {
                let base = t
                    .strip_suffix(EXP_AVG_SQ)
                    .or_else(|| t.strip_suffix(EXP_AVG));
                !base.is_some_and(|b| known.contains(b))
            })
            .chain(
                steps
                    .keys()
                    .filter(|k| !known.contains(k.as_str()))
                    .map(|k| format!("{k} (step count)")),
            )
            .collect();
        if !unknown.is_empty() {
            unknown.sort();
            return Err(OptimError::UnknownState {
                path,
                names: unknown,
            });
        }

        let mut missing = Vec::new();
        for p in &self.params {
            let mut lacks = Vec::new();
            for suffix in [EXP_AVG, EXP_AVG_SQ] {
                if r.shape(&format!("{}{suffix}", p.name)).is_none() {
                    lacks.push(&suffix[1..]);
                }
            }
            if !steps.contains_key(&p.name) {
                lacks.push("step");
            }
            if !lacks.is_empty() {
                missing.push(format!("{} ({})", p.name, lacks.join(", ")));
            }
        }
        if !missing.is_empty() {
            return Err(OptimError::MissingState {
                path,
                names: missing,
            });
        }

        // All shapes first, so a mismatch fails before any state is copied to the device.
        for p in &self.params {
            for suffix in [EXP_AVG, EXP_AVG_SQ] {
                let name = format!("{}{suffix}", p.name);
                let file_shape = r.shape(&name).unwrap_or_default();
                if file_shape != p.var.dims() {
                    return Err(OptimError::StateShape {
                        path,
                        name,
                        file_shape,
                        param_shape: p.var.dims().to_vec(),
                    });
                }
            }
        }
        let mut out = Vec::with_capacity(self.params.len());
        for p in &self.params {
            let load = |suffix: &str| r.load_f32(&format!("{}{suffix}", p.name), p.var.device());
            // Presence of every step count was checked above.
            let step = steps.get(&p.name).copied().unwrap_or_default();
            out.push((load(EXP_AVG)?, load(EXP_AVG_SQ)?, step));
        }
        Ok(out)
    }
}

impl AdamW {
    /// The parameters that have a gradient in `grads`, with it; fails on a shape mismatch.
    fn with_grads<'g>(&self, grads: &'g GradStore) -> Result<Vec<(usize, &'g Tensor)>> {
        let with_grad: Vec<(usize, &Tensor)> = self
            .params
            .iter()
            .enumerate()
            .filter_map(|(i, p)| grads.get(p.var.as_tensor()).map(|g| (i, g)))
            .collect();
        for &(i, g) in &with_grad {
            let p = &self.params[i];
            if g.dims() != p.var.dims() {
                return Err(OptimError::GradShape {
                    name: p.name.clone(),
                    grad_shape: g.dims().to_vec(),
                    param_shape: p.var.dims().to_vec(),
                });
            }
        }
        Ok(with_grad)
    }

    fn apply(&mut self, with_grad: Vec<(usize, &Tensor)>) -> Result<()> {
        let hyper = self.hyper;
        for (i, g) in with_grad {
            let p = &mut self.params[i];
            p.update(g, &hyper).map_err(|e| OptimError::Tensor {
                name: p.name.clone(),
                source: Box::new(e),
            })?;
        }
        Ok(())
    }
}

impl Optimizer for AdamW {
    fn step(&mut self, grads: &GradStore) -> Result<StepStats> {
        let with_grad = self.with_grads(grads)?;
        // The finiteness check is a GPU→CPU sync point (one copy of per-parameter sums).
        let gs: Vec<&Tensor> = with_grad.iter().map(|&(_, g)| g).collect();
        let summary = summarize(&gs)?;
        let mut stats = StepStats {
            grad_norm: summary.norm,
            updated: with_grad.len(),
            no_grad: self.params.len() - with_grad.len(),
            ..StepStats::default()
        };
        if !summary.nonfinite.is_empty() {
            stats.skipped_nonfinite = true;
            stats.updated = 0;
            stats.nonfinite_params = summary
                .nonfinite
                .iter()
                .map(|&k| self.params[with_grad[k].0].name.clone())
                .collect();
            return Ok(stats);
        }
        self.apply(with_grad)?;
        Ok(stats)
    }

    fn step_checked(&mut self, grads: &GradStore, _finite: Finite) -> Result<StepStats> {
        let with_grad = self.with_grads(grads)?;
        let stats = StepStats {
            grad_norm: f32::NAN,
            updated: with_grad.len(),
            no_grad: self.params.len() - with_grad.len(),
            ..StepStats::default()
        };
        self.apply(with_grad)?;
        Ok(stats)
    }

    fn learning_rate(&self) -> f64 {
        self.hyper.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.hyper.lr = lr;
    }

    /// The saved hyper-parameters are informational: on load the running configuration stays the
    /// source of truth (torch's `load_state_dict` would restore them; the trainer's config-hash
    /// check is what guards a resume against changed settings).
    fn save_state(&self, path: &Path) -> Result<()> {
        let mut tensors = Vec::with_capacity(2 * self.params.len());
        for p in &self.params {
            tensors.push((format!("{}{EXP_AVG}", p.name), p.exp_avg.clone()));
            tensors.push((format!("{}{EXP_AVG_SQ}", p.name), p.exp_avg_sq.clone()));
        }
        let meta = self.metadata()?;
        state::write_atomic(path, &tensors, meta)
    }

    fn load_state(&mut self, path: &Path) -> Result<()> {
        let loaded = state::read(path, |r| self.read_state(r))?;
        for (p, (m, v, step)) in self.params.iter_mut().zip(loaded) {
            p.exp_avg = m;
            p.exp_avg_sq = v;
            p.step = step;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn var(vals: &[f32]) -> Var {
        Var::from_slice(vals, vals.len(), &Device::Cpu).unwrap()
    }

    #[test]
    fn rejects_out_of_range_hyperparams_naming_the_field() {
        let bad = AdamWParams {
            beta2: 1.0,
            ..AdamWParams::default()
        };
        let err = AdamW::new(vec![], bad).unwrap_err();
        assert!(err.to_string().contains("beta2"), "{err}");
    }

    #[test]
    fn rejects_duplicate_names() {
        let p = vec![
            ("a".to_string(), var(&[1.0])),
            ("a".to_string(), var(&[2.0])),
        ];
        let err = AdamW::new(p, AdamWParams::default()).unwrap_err();
        assert!(
            matches!(err, OptimError::DuplicateParam(ref n) if n == "a"),
            "{err}"
        );
    }

    /// First step from zero state: m̂ = g, v̂ = g², so p ← p(1 − lr·λ) − lr·g/(|g| + ε).
    #[test]
    fn first_step_matches_closed_form() {
        let w = var(&[0.5, -1.0]);
        let mut opt = AdamW::new(vec![("w".into(), w.clone())], AdamWParams::default()).unwrap();
        let mut g = GradStore::default();
        g.insert(&w, Tensor::new(&[2.0f32, -0.25], &Device::Cpu).unwrap());
        let stats = opt.step(&g).unwrap();
        assert!(!stats.skipped_nonfinite);
        assert_eq!(stats.updated, 1);
        let got = w.to_vec1::<f32>().unwrap();
        let want = [
            0.5 * (1.0 - 1e-5) - 1e-3 * 2.0 / (2.0 + 1e-8),
            -(1.0 - 1e-5) + 1e-3 * 0.25 / (0.25 + 1e-8),
        ];
        for (a, b) in got.iter().zip(want) {
            assert!((f64::from(*a) - b).abs() < 1e-7, "{a} vs {b}");
        }
        assert_eq!(opt.state("w").unwrap().step(), 1);
    }

    #[test]
    fn step_checked_updates_exactly_as_step() {
        let (a, b) = (var(&[0.5, -1.0]), var(&[0.5, -1.0]));
        let mut plain = AdamW::new(vec![("w".into(), a.clone())], AdamWParams::default()).unwrap();
        let mut checked =
            AdamW::new(vec![("w".into(), b.clone())], AdamWParams::default()).unwrap();
        for k in 0..3 {
            let grad = |v: &Var| {
                let mut g = GradStore::default();
                let t = Tensor::new(&[2.0f32 - k as f32, 0.25 * k as f32], &Device::Cpu).unwrap();
                g.insert(v, t);
                g
            };
            plain.step(&grad(&a)).unwrap();
            let (ga, loss) = (grad(&b), Tensor::new(1f32, &Device::Cpu).unwrap());
            let g: Vec<&Tensor> = ga.get(&b).into_iter().collect();
            let finite = crate::optim::StepCheck::fetch(&loss, &g)
                .unwrap()
                .finite()
                .unwrap();
            let stats = checked.step_checked(&ga, finite).unwrap();
            assert_eq!(stats.updated, 1);
        }
        assert_eq!(a.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
        assert_eq!(checked.state("w").unwrap().step(), 3);
    }

    #[test]
    fn param_without_grad_is_untouched_and_its_step_does_not_advance() {
        let a = var(&[1.0]);
        let b = var(&[1.0]);
        let mut opt = AdamW::new(
            vec![("a".into(), a.clone()), ("b".into(), b.clone())],
            AdamWParams::default(),
        )
        .unwrap();
        let mut g = GradStore::default();
        g.insert(&a, Tensor::new(&[1.0f32], &Device::Cpu).unwrap());
        let stats = opt.step(&g).unwrap();
        assert_eq!((stats.updated, stats.no_grad), (1, 1));
        assert_eq!(b.to_vec1::<f32>().unwrap(), vec![1.0]);
        assert_eq!(opt.state("a").unwrap().step(), 1);
        assert_eq!(opt.state("b").unwrap().step(), 0);
    }

    #[test]
    fn grad_with_wrong_shape_is_an_error_naming_the_param() {
        let a = var(&[1.0, 2.0]);
        let mut opt = AdamW::new(vec![("a".into(), a.clone())], AdamWParams::default()).unwrap();
        let mut g = GradStore::default();
        g.insert(&a, Tensor::new(&[1.0f32], &Device::Cpu).unwrap());
        let err = opt.step(&g).unwrap_err();
        assert!(err.to_string().contains("a has shape [1]"), "{err}");
    }
}
