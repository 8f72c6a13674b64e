//! The part of an optimizer that differs between optimizers: its per-parameter state and update.
//!
//! [`super::GroupOptimizer`] holds one [`ParamState`] per parameter and does everything shared:
//! gradient shapes, the non-finite skip, step counts, the learning rate, and the state file with
//! its validation. An optimizer is an [`UpdateRule`] that makes fresh states.

use candle_core::{Result, Tensor, Var};

/// One parameter's optimizer state and its update rule.
pub trait ParamState: Send {
    /// Updates `var` in place from `grad` (same shape, finite: checked by the caller) with
    /// learning rate `lr`, as this parameter's update number `t` (1 on its first).
    fn update(&mut self, var: &Var, grad: &Tensor, lr: f64, t: u64) -> Result<()>;
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
    /// The hyper-parameters, for the state file's metadata (informational).
    fn hyper_json(&self) -> serde_json::Value;
    /// Bytes of state a parameter of `shape` takes, without allocating it (for `--dry-run`).
    fn state_bytes(&self, shape: &[usize]) -> usize;
}
