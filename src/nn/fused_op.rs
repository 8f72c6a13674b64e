//! The carrier every fused op here shares: a forward computed on detached operands with ordinary
//! candle ops (so it runs on every backend, and its intermediates are freed as soon as it
//! returns), attached to its arguments as one node of candle's graph (`Tensor::attach`, the
//! vendored candle-core's: the node shares the result's storage, nothing is copied), and an
//! analytic backward that keeps only what it needs (the op's arguments, its output, and whatever
//! small statistics the op saved, e.g. a norm's per-row mean and 1/σ).
//!
//! Unlike the composed references, the graph then holds no f32 upcast, centred copy or
//! normalised copy of the activation: one output, plus the arguments it already held.
//! [`set_fused_ops_enabled`] switches every model layer back to the composed `*_reference` ops,
//! for before/after benchmarks.

use std::sync::atomic::{AtomicBool, Ordering};

use std::sync::Arc;

use candle_core::{AttachedBackward, Result, Tensor};

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

/// The backward of a fused op of any number of arguments: one gradient per argument, in order
/// (`None` where the argument is not tracked), from the arguments, the op's output `res` and
/// the upstream gradient.
pub(crate) trait BackwardN: Send + Sync + 'static {
    fn backward(&self, args: &[Tensor], res: &Tensor, grad: &Tensor)
        -> Result<Vec<Option<Tensor>>>;
}

/// A fused op's node in candle's graph: its name and backward.
struct Fused<B> {
    name: &'static str,
    backward: B,
}

impl<B: BackwardN> AttachedBackward for Fused<B> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn bwd(&self, args: &[Tensor], res: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        self.backward.backward(args, res, grad)
    }
}

/// The arguments of a fused op of fixed arity, for its backward.
fn arg<'a, const N: usize>(args: &'a [Tensor], name: &'static str) -> Result<&'a [Tensor; N]> {
    args.try_into()
        .map_err(|_| candle_core::Error::Msg(format!("{name}: {} arguments, not {N}", args.len())))
}

struct One<B>(&'static str, B);

impl<B: Backward1> BackwardN for One<B> {
    fn backward(
        &self,
        args: &[Tensor],
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let [a] = arg::<1>(args, self.0)?;
        Ok(vec![Some(self.1.backward(a, res, grad)?)])
    }
}

struct Two<B>(&'static str, B);

impl<B: Backward2> BackwardN for Two<B> {
    fn backward(
        &self,
        args: &[Tensor],
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let [a, b] = arg::<2>(args, self.0)?;
        let (da, db) = self.1.backward(a, b, res, grad)?;
        Ok(vec![da, db])
    }
}

struct Three<B>(&'static str, B);

impl<B: Backward3> BackwardN for Three<B> {
    fn backward(
        &self,
        args: &[Tensor],
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let [a, b, c] = arg::<3>(args, self.0)?;
        let (da, db, dc) = self.1.backward(a, b, c, res, grad)?;
        Ok(vec![da, db, dc])
    }
}

/// Attaches `out` (computed on detached operands) to `args` with `backward`: the op's output
/// is `out` itself, its storage shared, not copied. When no argument is tracked there is nothing
/// to differentiate and `out` is returned as it is.
pub(crate) fn attach_n(
    args: &[&Tensor],
    name: &'static str,
    out: Tensor,
    backward: impl BackwardN,
) -> Result<Tensor> {
    if !args.iter().any(|a| a.track_op()) {
        return Ok(out);
    }
    Ok(Tensor::attach(
        &out,
        args,
        Arc::new(Fused { name, backward }),
    ))
}

/// [`attach_n`] for one argument.
pub(crate) fn attach1(
    arg: &Tensor,
    name: &'static str,
    out: Tensor,
    backward: impl Backward1,
) -> Result<Tensor> {
    attach_n(&[arg], name, out, One(name, backward))
}

/// [`attach_n`] for two arguments.
pub(crate) fn attach2(
    (a, b): (&Tensor, &Tensor),
    name: &'static str,
    out: Tensor,
    backward: impl Backward2,
) -> Result<Tensor> {
    attach_n(&[a, b], name, out, Two(name, backward))
}

/// [`attach_n`] for three arguments.
pub(crate) fn attach3(
    (a, b, c): (&Tensor, &Tensor, &Tensor),
    name: &'static str,
    out: Tensor,
    backward: impl Backward3,
) -> Result<Tensor> {
    attach_n(&[a, b, c], name, out, Three(name, backward))
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
