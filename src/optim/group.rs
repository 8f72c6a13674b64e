//! [`GroupOptimizer`]: one parameter group under one [`UpdateRule`], with the checks every
//! optimizer shares (burn's optimizer adaptor has this shape): gradient shapes, the non-finite
//! skip, per-parameter step counts, the learning rate, and the state file and its validation.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use super::grad::summarize;
use super::rule::{ParamState, UpdateRule};
use super::state::{self, StateReader, OPTIMIZER_KEY, VERSION_KEY};
use super::stochastic_round;
use super::{Finite, OptimError, Optimizer, Result, StepStats};

/// The state file layout version (tensors `<param>.<suffix>`, steps and hyper-parameters as JSON
/// metadata); unchanged since the first AdamW files, which therefore still load.
const STATE_VERSION: &str = "1";

/// One parameter with its state and update count.
struct Slot {
    name: String,
    var: Var,
    state: Box<dyn ParamState>,
    /// Updates applied to this parameter (torch's per-parameter `state["step"]`).
    step: u64,
}

/// A copy of one parameter's optimizer state, for tests and inspection.
#[derive(Debug, Clone)]
pub struct StateView {
    step: u64,
    tensors: Vec<(&'static str, Tensor)>,
}

impl StateView {
    /// Updates applied to the parameter.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The state tensor with this suffix (`"exp_avg"`, `"state1"`, …).
    pub fn tensor(&self, suffix: &str) -> Option<&Tensor> {
        self.tensors
            .iter()
            .find(|(s, _)| *s == suffix)
            .map(|(_, t)| t)
    }

    /// Every state tensor, in the state's fixed order.
    pub fn tensors(&self) -> &[(&'static str, Tensor)] {
        &self.tensors
    }
}

/// A parameter group optimized by one rule at one learning rate.
pub struct GroupOptimizer {
    rule: Box<dyn UpdateRule>,
    slots: Vec<Slot>,
    lr: f64,
    /// The run seed bf16/f16 parameters are rounded stochastically with; `None` rounds them to
    /// nearest inside the rule.
    stochastic: Option<u64>,
}

impl std::fmt::Debug for GroupOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupOptimizer")
            .field("rule", &self.rule.name())
            .field("params", &self.slots.len())
            .field("lr", &self.lr)
            .finish()
    }
}

impl GroupOptimizer {
    /// Zeroed state for every parameter. Names must be unique: they key the saved state.
    pub fn new(rule: Box<dyn UpdateRule>, params: Vec<(String, Var)>, lr: f64) -> Result<Self> {
        let mut seen = HashSet::new();
        let mut slots = Vec::with_capacity(params.len());
        for (name, var) in params {
            if !seen.insert(name.clone()) {
                return Err(OptimError::DuplicateParam(name));
            }
            let state = rule.init(&var)?;
            slots.push(Slot {
                name,
                var,
                state,
                step: 0,
            });
        }
        Ok(Self {
            rule,
            slots,
            lr,
            stochastic: None,
        })
    }

    /// Writes bf16/f16 parameters back with stochastic rounding ([`stochastic_round`]): each is
    /// upcast to an f32 copy, the rule updates the copy, and the copy is rounded into the
    /// parameter with the seed of `run_seed`, its name and its update count. f32 parameters are
    /// unaffected.
    ///
    /// The states of bf16/f16 parameters are made again for an f32 parameter of their shape, so
    /// the rule keeps them as it does for f32 (the host or CUDA kernels' layout).
    pub fn with_stochastic_rounding(mut self, run_seed: u64) -> Result<Self> {
        self.stochastic = Some(run_seed);
        for i in 0..self.slots.len() {
            if self.slots[i].var.dtype() != DType::F32 {
                self.slots[i].state = self.fresh_state(&self.slots[i].var)?;
            }
        }
        Ok(self)
    }

    /// A zeroed state for `var`: for an f32 parameter of its shape when it is rounded
    /// stochastically (the rule then updates its f32 copy).
    fn fresh_state(&self, var: &Var) -> Result<Box<dyn ParamState>> {
        match self.stochastic {
            Some(_) if var.dtype() != DType::F32 => {
                let template = Var::zeros(var.shape(), DType::F32, var.device())?;
                Ok(self.rule.init(&template)?)
            }
            _ => Ok(self.rule.init(var)?),
        }
    }

    /// The optimizer's name (`"adamw8bit"`, …).
    pub fn name(&self) -> &'static str {
        self.rule.name()
    }

    /// The parameters, for [`super::grad_norm`] / [`super::clip_grad_norm`].
    pub fn vars(&self) -> impl Iterator<Item = &Var> {
        self.slots.iter().map(|s| &s.var)
    }

    /// Updates of the parameter called `name` so far.
    pub fn param_step(&self, name: &str) -> Option<u64> {
        self.slots.iter().find(|s| s.name == name).map(|s| s.step)
    }

    /// The state of the parameter called `name`: its update count and its tensors by suffix.
    pub fn state(&self, name: &str) -> Option<StateView> {
        let s = self.slots.iter().find(|s| s.name == name)?;
        Some(StateView {
            step: s.step,
            tensors: s.state.save().ok()?,
        })
    }

    /// Every parameter's name, in construction order.
    pub fn param_names(&self) -> impl Iterator<Item = &str> {
        self.slots.iter().map(|s| s.name.as_str())
    }

    /// Bytes of optimizer state held, over every parameter.
    pub fn state_bytes(&self) -> usize {
        self.slots.iter().map(|s| s.state.bytes()).sum()
    }

    /// Updates the one parameter `var` from its own gradient, as a fused backward pass would as
    /// soon as that gradient is ready. The gradient's shape is checked; finiteness is the
    /// caller's (an update with a non-finite gradient is refused, changing nothing).
    pub fn update_one(&mut self, var: &Var, grad: &Tensor) -> Result<()> {
        let i = self.slot_of(var)?;
        self.check_shape(i, grad)?;
        if !summarize(&[grad])?.nonfinite.is_empty() {
            return Err(OptimError::NonFinite(self.slots[i].name.clone()));
        }
        self.apply_one(i, grad)
    }

    /// [`GroupOptimizer::update_one`] for a gradient the caller already checked with
    /// [`super::grad::check_one`] (which also gave it the norm): no second check and sync.
    pub fn update_one_checked(&mut self, var: &Var, grad: &Tensor, _finite: Finite) -> Result<()> {
        let i = self.slot_of(var)?;
        self.check_shape(i, grad)?;
        self.apply_one(i, grad)
    }

    fn slot_of(&self, var: &Var) -> Result<usize> {
        self.slots
            .iter()
            .position(|s| s.var.as_tensor().id() == var.as_tensor().id())
            .ok_or_else(|| OptimError::UnknownParam(format!("{:?}", var.dims())))
    }

    fn check_shape(&self, i: usize, g: &Tensor) -> Result<()> {
        let s = &self.slots[i];
        if g.dims() != s.var.dims() {
            return Err(OptimError::GradShape {
                name: s.name.clone(),
                grad_shape: g.dims().to_vec(),
                param_shape: s.var.dims().to_vec(),
            });
        }
        Ok(())
    }

    /// The parameters that have a gradient in `grads` (their slots, in update order), with it;
    /// fails on a shape mismatch. A caller that updates them one at a time with
    /// [`GroupOptimizer::apply_checked`] can retry one after an out-of-memory error without
    /// updating any other twice.
    pub fn pending<'g>(&self, grads: &'g GradStore) -> Result<Vec<(usize, &'g Tensor)>> {
        let with_grad: Vec<(usize, &Tensor)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| grads.get(s.var.as_tensor()).map(|g| (i, g)))
            .collect();
        for &(i, g) in &with_grad {
            self.check_shape(i, g)?;
        }
        Ok(with_grad)
    }

    /// Updates the parameter in `slot` (from [`GroupOptimizer::pending`]) from its gradient,
    /// which the caller checked finite with [`super::StepCheck::fetch`].
    pub fn apply_checked(&mut self, slot: usize, grad: &Tensor, _finite: Finite) -> Result<()> {
        self.apply_one(slot, grad)
    }

    fn apply_one(&mut self, i: usize, g: &Tensor) -> Result<()> {
        let lr = self.lr;
        let s = &mut self.slots[i];
        let t = s.step + 1;
        let updated = match self.stochastic {
            Some(seed) if s.var.dtype() != DType::F32 => {
                update_rounding_stochastically(s, g, lr, t, seed)
            }
            _ => s.state.update(&s.var, g, lr, t),
        };
        updated.map_err(|e| OptimError::Tensor {
            name: s.name.clone(),
            source: Box::new(e),
        })?;
        s.step = t;
        Ok(())
    }

    fn metadata(&self) -> Result<HashMap<String, String>> {
        let steps: BTreeMap<&str, u64> = self
            .slots
            .iter()
            .map(|s| (s.name.as_str(), s.step))
            .collect();
        let json = |e: serde_json::Error| OptimError::Format {
            path: Default::default(),
            msg: e.to_string(),
        };
        let name = self.rule.name();
        Ok(HashMap::from([
            (OPTIMIZER_KEY.to_string(), name.to_string()),
            (VERSION_KEY.to_string(), STATE_VERSION.to_string()),
            (
                format!("{name}.hyperparams"),
                serde_json::to_string(&self.rule.hyper_json()).map_err(json)?,
            ),
            (
                format!("{name}.steps"),
                serde_json::to_string(&steps).map_err(json)?,
            ),
        ]))
    }

    /// Reads and checks the whole file against fresh states before anything is replaced.
    fn read_state(&self, r: &StateReader<'_>) -> Result<Vec<(Vec<Tensor>, u64)>> {
        let path = r.path().to_path_buf();
        let name = self.rule.name();
        let found = r.meta(OPTIMIZER_KEY)?;
        if found != name {
            return Err(OptimError::WrongOptimizer {
                path,
                found: found.to_string(),
                want: name,
            });
        }
        let version = r.meta(VERSION_KEY)?;
        if version != STATE_VERSION {
            return Err(OptimError::Format {
                path,
                msg: format!("state version {version}, this build reads {STATE_VERSION}"),
            });
        }
        let steps_key = format!("{name}.steps");
        let steps: HashMap<String, u64> =
            serde_json::from_str(r.meta(&steps_key)?).map_err(|e| OptimError::Format {
                path: path.clone(),
                msg: format!("metadata `{steps_key}`: {e}"),
            })?;
        // What each parameter's state must hold: the layout of a fresh state.
        let mut layouts = Vec::with_capacity(self.slots.len());
        for s in &self.slots {
            let fresh = self.fresh_state(&s.var)?.save()?;
            layouts.push(
                fresh
                    .into_iter()
                    .map(|(suffix, t)| {
                        (format!("{}.{suffix}", s.name), t.dims().to_vec(), t.dtype())
                    })
                    .collect::<Vec<_>>(),
            );
        }
        check_names(r, &self.slots, &layouts, &steps)?;
        for layout in &layouts {
            for (tensor, shape, dtype) in layout {
                // Presence was checked by `check_names`.
                let (file_shape, file_dtype) =
                    r.shape_and_dtype(tensor).unwrap_or((Vec::new(), *dtype));
                if &file_shape != shape {
                    return Err(OptimError::StateShape {
                        path,
                        name: tensor.clone(),
                        file_shape,
                        param_shape: shape.clone(),
                    });
                }
                if file_dtype != *dtype {
                    return Err(OptimError::StateDType {
                        path,
                        name: tensor.clone(),
                        found: format!("{file_dtype:?}"),
                        want: format!("{dtype:?}"),
                    });
                }
            }
        }
        let mut out = Vec::with_capacity(self.slots.len());
        for (s, layout) in self.slots.iter().zip(&layouts) {
            let tensors = layout
                .iter()
                .map(|(t, _, _)| r.load(t))
                .collect::<Result<Vec<_>>>()?;
            // Presence of every step count was checked by `check_names`.
            out.push((tensors, steps.get(&s.name).copied().unwrap_or_default()));
        }
        Ok(out)
    }
}

/// The rule's update of a bf16/f16 parameter in f32 (on an f32 copy, from an f32 gradient), then
/// the copy rounded stochastically into the parameter with the seed of this update. The copy
/// lives for this one parameter's update.
fn update_rounding_stochastically(
    s: &mut Slot,
    g: &Tensor,
    lr: f64,
    t: u64,
    run_seed: u64,
) -> candle_core::Result<()> {
    let master = Var::from_tensor(&s.var.as_tensor().to_dtype(DType::F32)?)?;
    let g = g.to_dtype(DType::F32)?;
    s.state.update(&master, &g, lr, t)?;
    let seed = stochastic_round::tensor_seed(run_seed, &s.name, t);
    stochastic_round::round_into(&s.var, master.as_tensor(), seed)
}

/// Fails on state for unknown parameters and on parameters without their full state.
fn check_names(
    r: &StateReader<'_>,
    slots: &[Slot],
    layouts: &[Vec<(String, Vec<usize>, candle_core::DType)>],
    steps: &HashMap<String, u64>,
) -> Result<()> {
    let path = r.path().to_path_buf();
    let expected: HashSet<&str> = layouts
        .iter()
        .flatten()
        .map(|(t, _, _)| t.as_str())
        .collect();
    let known: HashSet<&str> = slots.iter().map(|s| s.name.as_str()).collect();
    let mut unknown: Vec<String> = r
        .names()
        .into_iter()
        .filter(|t| !expected.contains(t.as_str()))
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
    for (s, layout) in slots.iter().zip(layouts) {
        let mut lacks: Vec<&str> = layout
            .iter()
            .filter(|(t, _, _)| r.shape_and_dtype(t).is_none())
            .map(|(t, _, _)| &t[s.name.len() + 1..])
            .collect();
        if !steps.contains_key(&s.name) {
            lacks.push("step");
        }
        if !lacks.is_empty() {
            missing.push(format!("{} ({})", s.name, lacks.join(", ")));
        }
    }
    if !missing.is_empty() {
        return Err(OptimError::MissingState {
            path,
            names: missing,
        });
    }
    Ok(())
}

impl Optimizer for GroupOptimizer {
    fn step(&mut self, grads: &GradStore) -> Result<StepStats> {
        let with_grad = self.pending(grads)?;
        // The finiteness check is a GPU→CPU sync point (one copy of per-parameter sums).
        let gs: Vec<&Tensor> = with_grad.iter().map(|&(_, g)| g).collect();
        let summary = summarize(&gs)?;
        let mut stats = StepStats {
            grad_norm: summary.norm,
            updated: with_grad.len(),
            no_grad: self.slots.len() - with_grad.len(),
            ..StepStats::default()
        };
        if !summary.nonfinite.is_empty() {
            stats.skipped_nonfinite = true;
            stats.updated = 0;
            stats.nonfinite_params = summary
                .nonfinite
                .iter()
                .map(|&k| self.slots[with_grad[k].0].name.clone())
                .collect();
            return Ok(stats);
        }
        for (i, g) in with_grad {
            self.apply_one(i, g)?;
        }
        Ok(stats)
    }

    fn step_checked(&mut self, grads: &GradStore, finite: Finite) -> Result<StepStats> {
        let pending = self.pending(grads)?;
        let stats = StepStats {
            grad_norm: f32::NAN,
            updated: pending.len(),
            no_grad: self.slots.len() - pending.len(),
            ..StepStats::default()
        };
        for (slot, g) in pending {
            self.apply_checked(slot, g, finite)?;
        }
        Ok(stats)
    }

    fn learning_rate(&self) -> f64 {
        self.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.lr = lr;
    }

    /// The saved hyper-parameters are informational: on load the running configuration stays the
    /// source of truth (the trainer's config-hash check guards a resume against changed
    /// settings).
    fn save_state(&self, path: &Path) -> Result<()> {
        let mut tensors = Vec::new();
        for s in &self.slots {
            for (suffix, t) in s.state.save()? {
                tensors.push((format!("{}.{suffix}", s.name), t));
            }
        }
        state::write_atomic(path, &tensors, self.metadata()?)
    }

    fn load_state(&mut self, path: &Path) -> Result<()> {
        let loaded = state::read(path, |r| self.read_state(r))?;
        // Every check passed; a failure from here on is a device error, reported by name.
        for (s, (tensors, step)) in self.slots.iter_mut().zip(loaded) {
            s.state.load(tensors).map_err(|e| OptimError::Tensor {
                name: s.name.clone(),
                source: Box::new(e),
            })?;
            s.step = step;
        }
        Ok(())
    }

    fn state_bytes(&self) -> usize {
        GroupOptimizer::state_bytes(self)
    }
}
