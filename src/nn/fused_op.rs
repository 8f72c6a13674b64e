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

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use candle_core::{Device, Result, Tensor, Var};

    use super::{attach1, Backward1};

    /// `2·x`, whose backward and drop are written to a shared log.
    struct Logged {
        name: &'static str,
        log: Arc<Mutex<Vec<String>>>,
    }

    impl Logged {
        fn note(&self, what: &str) {
            if let Ok(mut log) = self.log.lock() {
                log.push(format!("{what} {}", self.name));
            }
        }
    }

    impl Backward1 for Logged {
        fn backward(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Tensor> {
            self.note("backward");
            grad * 2.0
        }
    }

    impl Drop for Logged {
        fn drop(&mut self) {
            self.note("drop");
        }
    }

    fn chain(log: &Arc<Mutex<Vec<String>>>) -> Result<(Var, Tensor)> {
        let x = Var::from_tensor(&Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?)?;
        let mut y = x.as_tensor().clone();
        for name in ["a", "b", "c"] {
            let out = (y.detach() * 2.0)?;
            let op = Logged {
                name,
                log: log.clone(),
            };
            y = attach1(&y, name, out, op)?;
        }
        Ok((x, y.sum_all()?))
    }

    /// A graph given up to the backward (`Tensor::into_backward`, the vendored candle-core) frees
    /// each node once its rule has run: the last op is dropped before the one below it runs its
    /// backward, so what each node kept is not held to the end. `backward()` on a graph the
    /// caller keeps drops nothing, and both give the same gradient. Catches a walk that still
    /// holds the root, or borrowed nodes that keep the whole graph.
    #[test]
    fn a_graph_given_up_to_the_backward_frees_each_node_after_its_rule() -> Result<()> {
        let log = Arc::new(Mutex::new(Vec::new()));
        let (x, loss) = chain(&log)?;
        let kept = loss.backward()?;
        let taken = |log: &Arc<Mutex<Vec<String>>>| -> Vec<String> {
            log.lock()
                .map(|mut l| std::mem::take(&mut *l))
                .unwrap_or_default()
        };
        assert_eq!(taken(&log), ["backward c", "backward b", "backward a"]);
        drop(loss);
        let mut dropped = taken(&log);
        dropped.sort();
        assert_eq!(dropped, ["drop a", "drop b", "drop c"]);

        let (x2, loss) = chain(&log)?;
        let given = loss.into_backward()?;
        assert_eq!(
            taken(&log),
            [
                "backward c",
                "drop c",
                "backward b",
                "drop b",
                "backward a",
                "drop a"
            ]
        );
        let (Some(g1), Some(g2)) = (kept.get(x.as_tensor()), given.get(x2.as_tensor())) else {
            candle_core::bail!("a gradient is missing");
        };
        assert_eq!(g1.to_vec1::<f32>()?, [8., 8., 8.]);
        assert_eq!(g2.to_vec1::<f32>()?, [8., 8., 8.]);
        Ok(())
    }
}
