//! Where a fused backward pass sends each parameter's gradient: a sink installed on this thread
//! for the duration of one backward pass (`train::fused`), which the outer backward's hook
//! (`Tensor::backward_with`) and the checkpointed segments' inner backward passes
//! ([`super::Checkpointing`]) both deliver to. Ownership moves in and out ([`install`],
//! [`take`]), so the sink may own what it updates.

use std::cell::RefCell;

use candle_core::{Result, Tensor};

/// Receives parameter gradients, each possibly in parts (one per checkpointed segment that uses
/// the parameter, one from the outer graph); the sink sums the parts and acts when a gradient is
/// complete.
pub trait GradSink {
    /// One part of `param`'s gradient.
    fn deliver(&mut self, param: &Tensor, grad: Tensor) -> Result<()>;
}

thread_local! {
    static SINK: RefCell<Option<Box<dyn GradSink>>> = const { RefCell::new(None) };
}

/// Installs `sink` on this thread, replacing any other.
pub fn install(sink: Box<dyn GradSink>) {
    SINK.with(|s| *s.borrow_mut() = Some(sink));
}

/// Removes and returns this thread's sink.
pub fn take() -> Option<Box<dyn GradSink>> {
    SINK.with(|s| s.borrow_mut().take())
}

/// Whether a sink is installed on this thread.
pub fn active() -> bool {
    SINK.with(|s| s.borrow().is_some())
}

/// Delivers a part of `param`'s gradient to this thread's sink; an error when none is installed.
pub fn deliver(param: &Tensor, grad: Tensor) -> Result<()> {
    SINK.with(|s| match s.borrow_mut().as_mut() {
        Some(sink) => sink.deliver(param, grad),
        None => candle_core::bail!("fused backward: a gradient arrived with no sink installed"),
    })
}
