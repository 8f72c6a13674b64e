//! The carrier every fused op here shares: a forward computed on detached operands with ordinary
//! candle ops (so it runs on every backend, and its intermediates are freed as soon as it
//! returns), handed to a `CustomOp1`/`CustomOp3` through an [`OutputSlot`], and an analytic
//! backward that keeps only what it needs (the op's arguments, its output, and whatever small
//! statistics the op saved, e.g. a norm's per-row mean and 1/σ).
//!
//! Unlike the composed references, the graph then holds no f32 upcast, centred copy or
//! normalised copy of the activation: one output, plus the arguments it already held.
//! [`set_fused_ops_enabled`] switches every model layer back to the composed `*_reference` ops,
//! for before/after benchmarks.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use super::output_slot::OutputSlot;

/// The gradients of a three-argument op; `None` for an argument that is not tracked.
pub(crate) type Grads3 = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

/// The backward of a one-argument fused op: `∂L/∂arg` from the argument, the op's output `res`
/// and the upstream gradient.
pub(crate) trait Backward1: Send + Sync + 'static {
    fn backward(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Tensor>;
}

/// The backward of a three-argument fused op (a norm's `x`, `γ`, `β`).
pub(crate) trait Backward3: Send + Sync + 'static {
    fn backward(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<Grads3>;
}

impl Backward3 for Box<dyn Backward3> {
    fn backward(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<Grads3> {
        self.as_ref().backward(a, b, c, res, grad)
    }
}

/// The backward of a two-argument fused op: the gradients of `a` and `b` (`None` where not
/// tracked).
pub(crate) trait Backward2: Send + Sync + 'static {
    fn backward(
        &self,
        a: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)>;
}

struct Fused<B> {
    name: &'static str,
    out: OutputSlot,
    backward: B,
}

impl<B> Fused<B> {
    fn new(name: &'static str, out: Tensor, backward: B) -> Result<Self> {
        Ok(Self {
            name,
            out: OutputSlot::new(name, out)?,
            backward,
        })
    }
}

impl<B: Backward1> CustomOp1 for Fused<B> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.out.cpu()
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _s: &candle_core::CudaStorage,
        _l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.out.cuda()
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.backward.backward(arg, res, grad)?))
    }
}

impl<B: Backward2> CustomOp2 for Fused<B> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _s1: &CpuStorage,
        _l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.out.cpu()
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _s1: &candle_core::CudaStorage,
        _l1: &Layout,
        _s2: &candle_core::CudaStorage,
        _l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.out.cuda()
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        self.backward.backward(a, b, res, grad)
    }
}

impl<B: Backward3> CustomOp3 for Fused<B> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _s1: &CpuStorage,
        _l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
        _s3: &CpuStorage,
        _l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.out.cpu()
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _s1: &candle_core::CudaStorage,
        _l1: &Layout,
        _s2: &candle_core::CudaStorage,
        _l2: &Layout,
        _s3: &candle_core::CudaStorage,
        _l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.out.cuda()
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<Grads3> {
        self.backward.backward(a, b, c, res, grad)
    }
}

/// Attaches `out` (computed on detached operands) to `arg` with `backward`. When `arg` is not
/// tracked there is nothing to differentiate and `out` is returned as it is.
pub(crate) fn attach1(
    arg: &Tensor,
    name: &'static str,
    out: Tensor,
    backward: impl Backward1,
) -> Result<Tensor> {
    if !arg.track_op() {
        return Ok(out);
    }
    arg.apply_op1(Fused::new(name, out, backward)?)
}

/// Attaches `out` to `(a, b)` with `backward`; `out` as it is when neither is tracked.
pub(crate) fn attach2(
    (a, b): (&Tensor, &Tensor),
    name: &'static str,
    out: Tensor,
    backward: impl Backward2,
) -> Result<Tensor> {
    if !(a.track_op() || b.track_op()) {
        return Ok(out);
    }
    a.apply_op2(b, Fused::new(name, out, backward)?)
}

/// Attaches `out` to `(a, b, c)` with `backward`; `out` as it is when none of them is tracked.
pub(crate) fn attach3(
    (a, b, c): (&Tensor, &Tensor, &Tensor),
    name: &'static str,
    out: Tensor,
    backward: impl Backward3,
) -> Result<Tensor> {
    if !(a.track_op() || b.track_op() || c.track_op()) {
        return Ok(out);
    }
    a.apply_op3(b, c, Fused::new(name, out, backward)?)
}

/// `Some(f(t))` when `t` is tracked, `None` otherwise (candle stores whatever a backward
/// returns, so an untracked argument must get `None`, not a discarded gradient).
pub(crate) fn if_tracked(t: &Tensor, f: impl FnOnce() -> Result<Tensor>) -> Result<Option<Tensor>> {
    if t.track_op() {
        Ok(Some(f()?.to_dtype(t.dtype())?))
    } else {
        Ok(None)
    }
}

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turns the model layers' use of the fused norms, softmax and GEGLU on (the default) or off,
/// process-wide. Off routes them through the composed `*_reference` ops, for benchmarks.
pub fn set_fused_ops_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed)
}

/// Whether layers use the fused ops for `t`: enabled, and on a device our custom ops have
/// forwards for (see `frozen::custom_op_device`).
pub(crate) fn use_fused(t: &Tensor) -> bool {
    ENABLED.load(Ordering::Relaxed) && super::frozen::custom_op_device(t)
}
