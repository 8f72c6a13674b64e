//! [`GroupOptimizer`]: one parameter group under one [`UpdateRule`], with the checks every
//! optimizer shares (burn's optimizer adaptor has this shape): gradient shapes, the non-finite
//! skip, per-parameter step counts, the learning rate, and the state file and its validation.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use super::grad::summarize;
use super::rule::{ParamState, Shares, StepEstimate, StepScalars, UpdateRule};
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
    /// Its learning rate over the group's (LoRA+'s ratio for `lora_up` weights, else 1).
    lr_scale: f64,
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
    /// A two-pass rule's group-wide estimator ([`StepEstimate`]).
    estimate: Option<Box<dyn StepEstimate>>,
    /// The two-pass step under way.
    open: Option<OpenStep>,
    /// While the parameters hold their evaluation weights ([`GroupOptimizer::eval_weights`]):
    /// the training weights of each swapped slot, on the host.
    stash: Option<Vec<(usize, Tensor)>>,
}

/// A two-pass step between its begin and its last update.
#[derive(Debug, Clone, Copy)]
struct OpenStep {
    /// The first pass's scalars, and the second's once the first pass ended.
    first: StepScalars,
    second: Option<StepScalars>,
    shares: Shares,
}

/// Which pass of a step: every rule has the first; two-pass rules ([`StepEstimate`]) the second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    First,
    Second,
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
                lr_scale: 1.0,
            });
        }
        let estimate = rule.estimate();
        Ok(Self {
            rule,
            slots,
            lr,
            stochastic: None,
            estimate,
            open: None,
            stash: None,
        })
    }

    /// Multiplies the learning rate of each parameter by `scale(name)`: the same updates as its
    /// own group at the scaled rate (kohya's LoRA+ puts `lora_up` weights in such a group).
    /// Refused for a two-pass rule (the learning-rate-free ones, schedule-free AdamW), whose
    /// group-wide step scalars have no per-parameter rate.
    pub fn scale_lr(mut self, scale: impl Fn(&str) -> f64) -> Result<Self> {
        if self.estimate.is_some() {
            return Err(OptimError::Pass(
                "this optimizer computes its step size (or its average's weights) for the whole \
                 group; it has no per-parameter learning rate to scale",
            ));
        }
        for slot in &mut self.slots {
            slot.lr_scale = scale(&slot.name);
        }
        Ok(self)
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

    /// Puts the weights to evaluate and save into the parameters (schedule-free AdamW's `x`),
    /// keeping a host copy of the training weights for [`GroupOptimizer::train_weights`]. Nothing
    /// for the other rules, for parameters not updated yet, or when already done. On an error
    /// every parameter is put back.
    ///
    /// The copy costs host memory the size of the trained parameters (in their dtype), for as long
    /// as the evaluation lasts; device memory is untouched.
    pub fn eval_weights(&mut self) -> Result<()> {
        if self.stash.is_some() || !self.rule.eval_weights_differ() {
            return Ok(());
        }
        let mut stash = Vec::new();
        for i in 0..self.slots.len() {
            let s = &mut self.slots[i];
            if s.step == 0 {
                continue;
            }
            let swapped = (|| {
                let y = s
                    .var
                    .as_detached_tensor()
                    .to_device(&candle_core::Device::Cpu)?;
                // On the CPU that is the parameter's own storage, which the swap overwrites.
                let y = if s.var.device().is_cpu() {
                    y.copy()?
                } else {
                    y
                };
                s.state.eval_weights(&s.var)?;
                Ok::<_, candle_core::Error>(y)
            })();
            match swapped {
                Ok(y) => stash.push((i, y)),
                Err(e) => {
                    let name = s.name.clone();
                    self.stash = Some(stash);
                    self.train_weights()?;
                    return Err(OptimError::Tensor {
                        name,
                        source: Box::new(e),
                    });
                }
            }
        }
        self.stash = Some(stash);
        Ok(())
    }

    /// Puts back the training weights [`GroupOptimizer::eval_weights`] kept, exactly as they
    /// were. Nothing when the parameters hold them already.
    pub fn train_weights(&mut self) -> Result<()> {
        let Some(stash) = self.stash.take() else {
            return Ok(());
        };
        for (i, y) in stash {
            let s = &self.slots[i];
            s.var
                .set(&y.to_device(s.var.device())?)
                .map_err(|e| OptimError::Tensor {
                    name: s.name.clone(),
                    source: Box::new(e),
                })?;
        }
        Ok(())
    }

    /// Whether the parameters hold their evaluation weights.
    pub fn in_eval(&self) -> bool {
        self.stash.is_some()
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

    /// The passes a step takes over the parameters: one, or two for a rule with a
    /// [`StepEstimate`].
    pub fn passes(&self) -> &'static [Pass] {
        match self.estimate {
            Some(_) => &[Pass::First, Pass::Second],
            None => &[Pass::First],
        }
    }

    /// Begins a step over `pending` (from [`GroupOptimizer::pending`]): a two-pass rule's
    /// scalars for the first pass. Nothing for the others.
    pub fn begin_step(&mut self, pending: &[(usize, &Tensor)]) -> Result<()> {
        let lr = self.lr;
        let Some(estimate) = self.estimate.as_mut() else {
            return Ok(());
        };
        let grad_sq = if estimate.needs_grad_sq() {
            let mut sq = 0f64;
            for &(_, g) in pending {
                let s = g
                    .to_dtype(DType::F32)?
                    .sqr()?
                    .sum_all()?
                    .to_scalar::<f32>()?;
                sq += f64::from(s);
            }
            Some(sq)
        } else {
            None
        };
        self.open = Some(OpenStep {
            first: estimate.begin(lr, grad_sq),
            second: None,
            shares: [0.0; 3],
        });
        Ok(())
    }

    /// Starts `pass` of the step begun by [`GroupOptimizer::begin_step`]. The second pass
    /// starts with the estimator's new scalars; `false` means the step ends before it (the
    /// reference's early return).
    pub fn start_pass(&mut self, pass: Pass) -> Result<bool> {
        if pass == Pass::First {
            return Ok(true);
        }
        let (Some(estimate), Some(open)) = (self.estimate.as_mut(), self.open.as_mut()) else {
            return Err(OptimError::Pass("a second pass without a first"));
        };
        open.second = estimate.finish(&open.shares);
        if open.second.is_none() {
            self.open = None;
            return Ok(false);
        }
        Ok(true)
    }

    /// The parameter in `slot` (from [`GroupOptimizer::pending`]) in `pass`, from its gradient,
    /// which the caller checked finite with [`super::StepCheck::fetch`]. A rule without an
    /// estimator is updated in its first pass.
    pub fn apply_pass(
        &mut self,
        pass: Pass,
        slot: usize,
        grad: &Tensor,
        _finite: Finite,
    ) -> Result<()> {
        if self.estimate.is_none() {
            return self.apply_one(slot, grad);
        }
        let open = self
            .open
            .ok_or(OptimError::Pass("an update outside a step"))?;
        match pass {
            Pass::First => {
                let mut shares = open.shares;
                let done = self.slots[slot].step;
                self.run_slot(slot, grad, |state, var, g| {
                    state.accumulate(var, g, &open.first, done, &mut shares)
                })?;
                if let Some(o) = self.open.as_mut() {
                    o.shares = shares;
                }
                Ok(())
            }
            Pass::Second => {
                let second = open
                    .second
                    .ok_or(OptimError::Pass("a second pass before the first ended"))?;
                self.run_slot(slot, grad, |state, var, g| state.apply(var, g, &second))?;
                self.slots[slot].step += 1;
                Ok(())
            }
        }
    }

    /// Ends a fused step of a two-pass rule: each parameter was updated in one go with the
    /// scalars the step began with, and the estimator now takes the sums. Nothing for the
    /// others, or when no parameter was updated.
    pub fn end_fused_step(&mut self) -> Result<()> {
        if let (Some(estimate), Some(open)) = (self.estimate.as_mut(), self.open.take()) {
            estimate.finish(&open.shares);
        }
        Ok(())
    }

    /// The estimator's scalars (`d` first, where it has one); empty for rules without one.
    pub fn estimate_values(&self) -> Vec<(&'static str, f64)> {
        self.estimate.as_ref().map(|e| e.save()).unwrap_or_default()
    }

    /// A fused update of a two-pass rule: both passes at once with the step's first scalars
    /// (the step begins at its first parameter; [`GroupOptimizer::end_fused_step`] ends it).
    fn apply_fused(&mut self, i: usize, g: &Tensor) -> Result<()> {
        if self.open.is_none() {
            let lr = self.lr;
            let Some(estimate) = self.estimate.as_mut() else {
                return Err(OptimError::Pass("a fused step without an estimator"));
            };
            if estimate.needs_grad_sq() || !estimate.runs_fused() {
                return Err(OptimError::Pass(
                    "this optimizer needs every gradient before it updates any parameter, which \
                     a fused backward pass never holds",
                ));
            }
            self.open = Some(OpenStep {
                first: estimate.begin(lr, None),
                second: None,
                shares: [0.0; 3],
            });
        }
        let open = self
            .open
            .ok_or(OptimError::Pass("an update outside a step"))?;
        let mut shares = open.shares;
        let done = self.slots[i].step;
        self.run_slot(i, g, |state, var, g| {
            state.accumulate(var, g, &open.first, done, &mut shares)?;
            state.apply(var, g, &open.first)
        })?;
        if let Some(o) = self.open.as_mut() {
            o.shares = shares;
        }
        self.slots[i].step += 1;
        Ok(())
    }

    /// Runs `f` on the parameter in slot `i`, naming the parameter in an error. When the group
    /// rounds stochastically, a bf16/f16 parameter is updated as an f32 copy (with an f32
    /// gradient) that is then rounded into it with the seed of its next update; the copy lives
    /// for this one call.
    fn run_slot(
        &mut self,
        i: usize,
        g: &Tensor,
        f: impl FnOnce(&mut dyn ParamState, &Var, &Tensor) -> candle_core::Result<()>,
    ) -> Result<()> {
        if self.stash.is_some() {
            return Err(OptimError::Pass(
                "the parameters hold their evaluation weights; training weights must be put back \
                 (train_weights) before a step",
            ));
        }
        let s = &mut self.slots[i];
        let done = match self.stochastic {
            Some(seed) if s.var.dtype() != DType::F32 => (|| {
                let master = Var::from_tensor(&s.var.as_tensor().to_dtype(DType::F32)?)?;
                let g = g.to_dtype(DType::F32)?;
                f(s.state.as_mut(), &master, &g)?;
                let seed = stochastic_round::tensor_seed(seed, &s.name, s.step + 1);
                stochastic_round::round_into(&s.var, master.as_tensor(), seed)
            })(),
            _ => f(s.state.as_mut(), &s.var, g),
        };
        done.map_err(|e| OptimError::Tensor {
            name: s.name.clone(),
            source: Box::new(e),
        })
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

    fn apply_one(&mut self, i: usize, g: &Tensor) -> Result<()> {
        if self.estimate.is_some() {
            return self.apply_fused(i, g);
        }
        let lr = self.lr * self.slots[i].lr_scale;
        let t = self.slots[i].step + 1;
        self.run_slot(i, g, |state, var, g| state.update(var, g, lr, t))?;
        self.slots[i].step = t;
        Ok(())
    }

    /// Every pass of a step over `pending`, for a caller that does not retry single updates.
    fn run_passes(&mut self, pending: &[(usize, &Tensor)], finite: Finite) -> Result<()> {
        self.begin_step(pending)?;
        for &pass in self.passes() {
            if !self.start_pass(pass)? {
                break;
            }
            for &(slot, g) in pending {
                self.apply_pass(pass, slot, g, finite)?;
            }
        }
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
        let mut meta = HashMap::from([
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
        ]);
        if let Some(e) = &self.estimate {
            let values: BTreeMap<&str, f64> = e.save().into_iter().collect();
            meta.insert(
                format!("{name}.estimate"),
                serde_json::to_string(&values).map_err(json)?,
            );
        }
        Ok(meta)
    }

    /// The estimator's scalars in the file, in [`StepEstimate::save`]'s order.
    fn read_estimate(&self, r: &StateReader<'_>) -> Result<Option<Vec<f64>>> {
        let Some(estimate) = &self.estimate else {
            return Ok(None);
        };
        let key = format!("{}.estimate", self.rule.name());
        let format = |msg: String| OptimError::Format {
            path: r.path().to_path_buf(),
            msg,
        };
        let values: HashMap<String, f64> = serde_json::from_str(r.meta(&key)?)
            .map_err(|e| format(format!("metadata `{key}`: {e}")))?;
        let wanted = estimate.save();
        let mut out = Vec::with_capacity(wanted.len());
        for (name, _) in &wanted {
            match values.get(*name) {
                Some(v) => out.push(*v),
                None => return Err(format(format!("metadata `{key}` has no `{name}`"))),
            }
        }
        if values.len() != wanted.len() {
            return Err(format(format!(
                "metadata `{key}` holds {} values, this optimizer keeps {}",
                values.len(),
                wanted.len()
            )));
        }
        Ok(Some(out))
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
        self.run_passes(&with_grad, Finite::CHECKED)?;
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
        self.run_passes(&pending, finite)?;
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
        let (loaded, estimate) =
            state::read(path, |r| Ok((self.read_state(r)?, self.read_estimate(r)?)))?;
        // Every check passed; a failure from here on is a device error, reported by name.
        for (s, (tensors, step)) in self.slots.iter_mut().zip(loaded) {
            s.state.load(tensors).map_err(|e| OptimError::Tensor {
                name: s.name.clone(),
                source: Box::new(e),
            })?;
            s.step = step;
        }
        if let (Some(e), Some(values)) = (self.estimate.as_mut(), estimate) {
            e.load(&values);
        }
        self.open = None;
        Ok(())
    }

    fn state_bytes(&self) -> usize {
        GroupOptimizer::state_bytes(self)
    }
}
