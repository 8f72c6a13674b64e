//! The part of an optimizer that differs between optimizers: its per-parameter state and update.
//!
//! [`super::GroupOptimizer`] holds one [`ParamState`] per parameter and does everything shared:
//! gradient shapes, the non-finite skip, step counts, the learning rate, and the state file with
//! its validation. An optimizer is an [`UpdateRule`] that makes fresh states.
//!
//! Most rules update each parameter from its own gradient alone ([`ParamState::update`]). The
//! step-size estimators (Prodigy, D-Adaptation, scalar DoWG) also keep scalars for the whole
//! group, a [`StepEstimate`], and take two passes over the parameters:
//! 1. [`ParamState::accumulate`] with the step's [`StepScalars`] from
//!    [`StepEstimate::begin`]: the parameter's moments are updated and its share of the group's
//!    sums (dot products, L1 norms) is added to [`Shares`];
//! 2. [`StepEstimate::finish`] turns the sums into the new estimate, and
//!    [`ParamState::apply`] updates each parameter with the scalars it returns.

use candle_core::{Result, Tensor, Var};

/// The sums a step-size estimator gathers over its parameters in the first pass (up to three,
/// each rule says which is which).
pub type Shares = [f64; 3];

/// The scalars of one pass of a step-size estimator, the same for every parameter.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepScalars {
    /// The estimate the pass uses: Prodigy's and D-Adaptation's `d`, scalar DoWG's `r²`,
    /// schedule-free AdamW's averaging weight `c`.
    pub d: f64,
    /// The effective step: `d · lr` (times Prodigy's bias correction), scalar DoWG's
    /// denominator `√v + ε`, schedule-free AdamW's lr after its warmup.
    pub dlr: f64,
    /// The group's step count before this step (0 on the first).
    pub k: u64,
}

/// The group-wide part of a step-size estimator: scalars estimated once per step from every
/// parameter's gradient, saved with the optimizer state.
pub trait StepEstimate: Send {
    /// Whether [`StepEstimate::begin`] needs the sum of the squared gradients of this step
    /// (D-Adaptation SGD's first step).
    fn needs_grad_sq(&self) -> bool {
        false
    }
    /// Whether each parameter may be updated in one go with the scalars the step began with,
    /// inside a fused backward pass (the estimate then takes the sums at the step's end).
    fn runs_fused(&self) -> bool {
        true
    }
    /// Begins a step at learning rate `lr`: the scalars of the first pass.
    fn begin(&mut self, lr: f64, grad_sq: Option<f64>) -> StepScalars;
    /// Ends the first pass with the parameters' summed `shares`: the scalars of the second pass,
    /// or `None` when the step stops here, as the reference returns before updating (every
    /// share was zero).
    fn finish(&mut self, shares: &Shares) -> Option<StepScalars>;
    /// The group's scalars by name, for the state file and the log (`d` first, where it has one).
    fn save(&self) -> Vec<(&'static str, f64)>;
    /// Replaces the scalars with `values`, in [`StepEstimate::save`]'s order and names (checked
    /// by the caller).
    fn load(&mut self, values: &[f64]);
}

/// One parameter's optimizer state and its update rule.
pub trait ParamState: Send {
    /// Updates `var` in place from `grad` (same shape, finite: checked by the caller) with
    /// learning rate `lr`, as this parameter's update number `t` (1 on its first). The
    /// two-pass rules (with a [`StepEstimate`]) update through `accumulate` and `apply` instead.
    fn update(&mut self, _var: &Var, _grad: &Tensor, _lr: f64, _t: u64) -> Result<()> {
        Err(candle_core::Error::Msg(
            "this optimizer updates in two passes (accumulate, then apply)".into(),
        ))
    }
    /// A step-size estimator's first pass (see the module doc): the state updated from `grad`,
    /// and this parameter's shares added to `shares`. `done` counts the parameter's completed
    /// updates (0 before its first: where the state takes the starting point). Either all of it
    /// happens or, on an error, none of it, so an out-of-memory retry repeats it exactly.
    fn accumulate(
        &mut self,
        _var: &Var,
        _grad: &Tensor,
        _step: &StepScalars,
        _done: u64,
        _shares: &mut Shares,
    ) -> Result<()> {
        Err(candle_core::Error::Msg(
            "this optimizer updates each parameter in one pass".into(),
        ))
    }
    /// A step-size estimator's second pass: the parameter's update with the scalars
    /// [`StepEstimate::finish`] returned.
    fn apply(&mut self, _var: &Var, _grad: &Tensor, _step: &StepScalars) -> Result<()> {
        Err(candle_core::Error::Msg(
            "this optimizer updates each parameter in one pass".into(),
        ))
    }
    /// Writes the weights the model is evaluated and saved with into `var`, from the training
    /// weights it holds (schedule-free's `x` from `y`). Called only for rules whose
    /// [`UpdateRule::eval_weights_differ`], on parameters with at least one update; the caller
    /// keeps the training weights and puts them back itself.
    fn eval_weights(&mut self, _var: &Var) -> Result<()> {
        Ok(())
    }
    /// The state as named tensors, always in the same order with the same names, shapes and
    /// dtypes for a parameter of a given shape: the caller validates a state file against the
    /// list a fresh state returns.
    fn save(&self) -> Result<Vec<(&'static str, Tensor)>>;
    /// Replaces the state with `tensors`, in [`ParamState::save`]'s order, already checked to
    /// have its names, shapes and dtypes.
    fn load(&mut self, tensors: Vec<Tensor>) -> Result<()>;
    /// Bytes of state held for this parameter.
    fn bytes(&self) -> usize;
}

/// An optimizer: its name, hyper-parameters, and a fresh state per parameter.
pub trait UpdateRule: Send + Sync {
    /// The name in optimizer.json and in the state file (`"adamw8bit"`, …).
    fn name(&self) -> &'static str;
    /// A zeroed state for a parameter shaped like `var`.
    fn init(&self, var: &Var) -> Result<Box<dyn ParamState>>;
    /// The group-wide estimator of a two-pass rule (see the module doc); `None` for rules that
    /// update each parameter from its own gradient alone.
    fn estimate(&self) -> Option<Box<dyn StepEstimate>> {
        None
    }
    /// Whether the weights to evaluate and save differ from those the gradient is taken at
    /// (schedule-free AdamW): the group then swaps them in with [`ParamState::eval_weights`]
    /// around sampling, validation and saving.
    fn eval_weights_differ(&self) -> bool {
        false
    }
    /// The hyper-parameters, for the state file's metadata (informational).
    fn hyper_json(&self) -> serde_json::Value;
    /// Bytes of state a parameter of `shape` takes, without allocating it (for `--dry-run`).
    fn state_bytes(&self, shape: &[usize]) -> usize;
}
