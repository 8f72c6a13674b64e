//! Optimizers and learning-rate schedules.
//!
//! - [`Optimizer`]: the narrow trait every optimizer implements. It mirrors candle-nn's
//!   `Optimizer` (`step(&GradStore)`, `learning_rate`, `set_learning_rate`) and adds state
//!   save/load. Constructors are inherent (`AdamW::rule`, `GroupOptimizer::new`) rather than a trait method, so the trait
//!   stays object-safe and the trainer can hold a `Box<dyn Optimizer>` chosen from optimizer.json.
//! - [`GroupOptimizer`]: one parameter group under one [`UpdateRule`], with every check the
//!   optimizers share (shapes, the non-finite skip, step counts, the state file).
//! - The rules: [`AdamW`] (torch.optim.AdamW), [`AdamW8bit`] (bitsandbytes' blockwise 8-bit
//!   AdamW, [`quant8`]), [`Lion`] (f32 or 8-bit momentum) and [`Adafactor`] (transformers'). Each
//!   updates one tensor from its own gradient, through a fused host kernel ([`host`]) or, for a
//!   CUDA parameter, a fused CUDA kernel (`cuda`, src/optim/kernels.cu), with a plain reference
//!   beside it.
//! - The step-size estimators, learning-rate free: [`Prodigy`] (prodigyopt), D-Adaptation
//!   ([`DAdaptAdam`], [`DAdaptAdan`], [`DAdaptLion`], [`DAdaptSgd`]: the dadaptation package),
//!   DoWG ([`CoordinateDowg`], [`ScalarDowg`]: the dowg package) and EveryDream2's [`AdaCoor`],
//!   written with tensor ops ([`dense`]). The estimators that need every gradient before any
//!   update take two passes ([`StepEstimate`]).
//! - [`AdamWScheduleFree`] (the schedulefree package's; a two-pass rule for its group scalars,
//!   whose evaluation weights the group swaps in with [`GroupOptimizer::eval_weights`]), and
//!   [`Came`] (came-pytorch's CAME, f32 or 8-bit, in candle ops).
//! - [`LrSchedule`]: constant/linear/cosine/polynomial with warmup, a pure function of the step,
//!   matching diffusers' `get_scheduler`.
//! - [`grad_norm`] / [`clip_grad_norm`]: global L2 norm of the gradients, as the trainer logs it.
//! - [`state`]: the atomic safetensors file the optimizer state is saved to.
//! - [`stochastic_round`]: the write-back of bf16/f16 trained weights (`weight_dtype`), when the
//!   group rounds stochastically ([`GroupOptimizer::with_stochastic_rounding`]).

pub mod adacoor;
pub mod adafactor;
pub mod adafactor_device;
pub mod adamw;
pub mod adamw8bit;
pub mod adaptive_args;
#[cfg(feature = "cuda")]
mod adaptive_cuda;
#[cfg(test)]
mod adaptive_emu_tests;
pub mod came;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dadapt_adam;
pub mod dadapt_adan;
pub mod dadapt_lion;
pub mod dadapt_sgd;
pub mod dense;
pub mod dowg;
pub mod grad;
pub mod group;
pub mod host;
mod hyper;
#[cfg(test)]
mod kernel_emu;
pub mod launch;
pub mod lion;
pub mod placed;
pub mod prodigy;
pub mod quant8;
#[cfg(feature = "cuda")]
mod quant8_cuda;
#[cfg(test)]
mod quant8_emu_tests;
#[cfg(feature = "cuda")]
mod rounding_cuda;
pub mod rule;
pub mod schedule;
pub mod schedulefree;
pub mod state;
pub mod stochastic_round;
#[cfg(feature = "cuda")]
mod sumsq_cuda;
#[cfg(test)]
mod sumsq_emu_tests;

use std::path::{Path, PathBuf};

use candle_core::backprop::GradStore;

pub use adacoor::{AdaCoor, AdaCoorParams};
pub use adafactor::{Adafactor, AdafactorParams};
pub use adamw::{AdamW, AdamWParams};
pub use adamw8bit::AdamW8bit;
pub use came::{Came, CameParams};
pub use dadapt_adam::{DAdaptAdam, DAdaptAdamParams};
pub use dadapt_adan::{DAdaptAdan, DAdaptAdanParams};
pub use dadapt_lion::{DAdaptLion, DAdaptLionParams};
pub use dadapt_sgd::{DAdaptSgd, DAdaptSgdParams};
pub use dowg::{CoordinateDowg, DowgParams, ScalarDowg};
pub use grad::{clip_grad_norm, grad_norm, ClipScope, Finite, GradClip, StepCheck};
pub use group::{GroupOptimizer, Pass, StateView};
pub use lion::{Lion, LionParams};
pub use prodigy::{Prodigy, ProdigyParams};
pub use rule::{ParamState, Shares, StepEstimate, StepScalars, UpdateRule};
pub use schedule::{LrSchedule, Ramp, ScheduleError, ScheduleKind, ScheduleShape};
pub use schedulefree::{AdamWScheduleFree, ScheduleFreeParams};

/// Errors from the optimizers and their state files.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    #[error("invalid optimizer hyper-parameter {field} = {value}: {allowed}")]
    InvalidParam {
        field: &'static str,
        value: f64,
        allowed: &'static str,
    },
    #[error("parameter name `{0}` appears twice in the optimizer's parameter list")]
    DuplicateParam(String),
    #[error("gradient for {name} has shape {grad_shape:?}, the parameter has {param_shape:?}")]
    GradShape {
        name: String,
        grad_shape: Vec<usize>,
        param_shape: Vec<usize>,
    },
    #[error("optimizer step for {name}")]
    Tensor {
        name: String,
        source: Box<candle_core::Error>,
    },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("optimizer state")]
    File(#[from] crate::fsutil::FsError),
    #[error("optimizer state {}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("optimizer state {}: not a valid safetensors file: {msg}", path.display())]
    Format { path: PathBuf, msg: String },
    #[error("optimizer state {}: written by optimizer `{found}`, this run uses `{want}`", path.display())]
    WrongOptimizer {
        path: PathBuf,
        found: String,
        want: &'static str,
    },
    #[error("optimizer state {}: shape mismatch for {name}: file has {file_shape:?}, model wants {param_shape:?}", path.display())]
    StateShape {
        path: PathBuf,
        name: String,
        file_shape: Vec<usize>,
        param_shape: Vec<usize>,
    },
    #[error("optimizer state {}: {name} is stored as {found}, expected {want}", path.display())]
    StateDType {
        path: PathBuf,
        name: String,
        found: String,
        want: String,
    },
    #[error("the optimizer holds no parameter of shape {0}")]
    UnknownParam(String),
    #[error("optimizer step: {0}")]
    Pass(&'static str),
    #[error("gradient for {0} holds NaN or infinity; the update was refused")]
    NonFinite(String),
    #[error("optimizer state {}: no state for {} parameter(s): {}", path.display(), names.len(), names.join(", "))]
    MissingState { path: PathBuf, names: Vec<String> },
    #[error("optimizer state {}: state for {} unknown parameter(s): {}", path.display(), names.len(), names.join(", "))]
    UnknownState { path: PathBuf, names: Vec<String> },
}

pub type Result<T> = std::result::Result<T, OptimError>;

/// What one call to [`Optimizer::step`] did.
///
/// A non-finite gradient is reported here as a flag, not as an `Err`: it is an expected training
/// event (the loop skips the step, says so, and goes on), whereas `Err` means something is broken.
/// When `skipped_nonfinite` is true nothing was changed: no parameter, moment or step count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepStats {
    /// True when some gradient held NaN or ±inf and the whole step was skipped.
    pub skipped_nonfinite: bool,
    /// The parameters whose gradients were non-finite (empty unless skipped).
    pub nonfinite_params: Vec<String>,
    /// Global L2 norm over every gradient the step saw, computed in f32 (non-finite when skipped;
    /// NaN from `step_checked`, whose caller holds the norm in its [`StepCheck`]).
    pub grad_norm: f32,
    /// Parameters updated (those with a gradient in the store).
    pub updated: usize,
    /// Parameters without a gradient in the store, left untouched as torch does.
    pub no_grad: usize,
}

/// The optimizer interface, mirroring candle-nn's `Optimizer` plus state persistence.
pub trait Optimizer {
    /// Applies one update from `grads`. Parameters missing from the store are skipped.
    fn step(&mut self, grads: &GradStore) -> Result<StepStats>;
    /// [`Optimizer::step`] for gradients the caller already checked finite with
    /// [`StepCheck::fetch`], which fetched them with the loss in one device→host copy: this skips
    /// the optimizer's own check and its sync point. Shapes are still checked.
    fn step_checked(&mut self, grads: &GradStore, finite: Finite) -> Result<StepStats>;
    /// The learning rate the next step will use.
    fn learning_rate(&self) -> f64;
    /// Sets the learning rate, e.g. from [`LrSchedule::lr_at`] before each step.
    fn set_learning_rate(&mut self, lr: f64);
    /// Writes moments, per-parameter step counts and hyper-parameters atomically to `path`.
    fn save_state(&self, path: &Path) -> Result<()>;
    /// Replaces the state with the one in `path`. Fails, changing nothing, unless every parameter
    /// has state of the right shape and the file holds no state for unknown parameters.
    fn load_state(&mut self, path: &Path) -> Result<()>;
    /// Bytes of optimizer state held.
    fn state_bytes(&self) -> usize;
}

/// Deterministic values in `[−scale, scale)` from a seed, for the optimizers' tests.
#[cfg(test)]
pub(crate) fn test_values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}
