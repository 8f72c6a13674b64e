//! Out-of-memory errors: one typed error for every way a device runs out of memory, and the
//! classifier that finds one in any error chain.
//!
//! A CUDA OOM reaches the trainer in many shapes: candle's `Error::Cuda` around cudarc's
//! `DriverError(CUDA_ERROR_OUT_OF_MEMORY)` (allocations, our own kernels' launches), cuBLAS'
//! `CUBLAS_STATUS_ALLOC_FAILED`, cuDNN's `CUDNN_STATUS_ALLOC_FAILED` (wrapped as text), any of
//! them under candle's `Context`/`WithBacktrace`/`WithPath` or anyhow's context, and
//! `Device::synchronize`'s `Error::Wrapped` text. [`find_oom`] walks the chain, matching candle's
//! variants structurally and the CUDA status names in the text of the leaves.

use std::error::Error as StdError;

/// A device ran out of memory. `detail` is the underlying error's first line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("out of device memory ({detail})")]
pub struct OutOfMemory {
    pub detail: String,
}

/// The status names CUDA and its libraries give an allocation failure.
const OOM_CODES: [&str; 3] = [
    "CUDA_ERROR_OUT_OF_MEMORY",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
];

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or_default().to_string()
}

/// Whether `text` names an allocation failure.
fn names_oom(text: &str) -> bool {
    OOM_CODES.iter().any(|c| text.contains(c))
}

/// The OOM inside a candle error, through its wrapping variants.
fn candle_oom(e: &candle_core::Error) -> Option<OutOfMemory> {
    use candle_core::Error as E;
    match e {
        E::Context { inner, .. } | E::WithBacktrace { inner, .. } | E::WithPath { inner, .. } => {
            candle_oom(inner)
        }
        E::Cuda(inner) => dyn_oom(inner.as_ref()),
        E::WrappedContext { wrapped, .. } => dyn_oom(wrapped.as_ref()),
        E::Wrapped(inner) => text_oom(&inner.to_string()),
        E::Msg(text) => text_oom(text),
        _ => None,
    }
}

fn text_oom(text: &str) -> Option<OutOfMemory> {
    names_oom(text).then(|| OutOfMemory {
        detail: first_line(text),
    })
}

/// The OOM in one error of a chain: ours, candle's, or a leaf whose text names one.
fn dyn_oom(e: &(dyn StdError + 'static)) -> Option<OutOfMemory> {
    if let Some(oom) = e.downcast_ref::<OutOfMemory>() {
        return Some(oom.clone());
    }
    if let Some(c) = e.downcast_ref::<candle_core::Error>() {
        return candle_oom(c);
    }
    // cudarc's errors (DriverError, CublasError, CudnnError) and candle's CudaError print their
    // status names; anything else that does is an allocation failure too.
    text_oom(&e.to_string())
}

/// The out-of-memory error in `err`'s chain, if there is one.
pub fn find_oom(err: &anyhow::Error) -> Option<OutOfMemory> {
    err.chain().find_map(dyn_oom)
}

/// [`find_oom`] for a candle error.
pub fn find_candle_oom(err: &candle_core::Error) -> Option<OutOfMemory> {
    candle_oom(err)
}

/// Whether a test asked for an out-of-memory error at the micro-batch of `ids` in (0-based)
/// `step`; always `false` outside the unit tests.
pub(crate) fn injected(step: usize, ids: &[usize]) -> bool {
    #[cfg(test)]
    {
        inject::fires(step, ids)
    }
    #[cfg(not(test))]
    {
        let _ = (step, ids);
        false
    }
}

/// Failures injected at the typed-error level, for the unit tests of the retry (not a setting).
#[cfg(test)]
pub(crate) mod inject {
    use std::cell::RefCell;

    type Hook = Box<dyn FnMut(usize, &[usize]) -> bool>;

    thread_local! {
        static HOOK: RefCell<Option<Hook>> = RefCell::new(None);
    }

    /// Calls `f(step, ids)` before every micro-batch's result is accepted, on this thread; an
    /// OOM is injected where it returns `true`.
    pub fn set(f: impl FnMut(usize, &[usize]) -> bool + 'static) {
        HOOK.with(|h| *h.borrow_mut() = Some(Box::new(f)));
    }

    pub fn clear() {
        HOOK.with(|h| *h.borrow_mut() = None);
    }

    pub(super) fn fires(step: usize, ids: &[usize]) -> bool {
        HOOK.with(|h| h.borrow_mut().as_mut().is_some_and(|f| f(step, ids)))
    }

    type RankHook = std::sync::Arc<dyn Fn(usize, usize, &[usize]) -> bool + Send + Sync>;

    static RANK_HOOK: std::sync::Mutex<Option<RankHook>> = std::sync::Mutex::new(None);

    /// For data-parallel runs, whose ranks are threads of their own: `f(rank, step, ids)`
    /// decides on every rank thread that [`install_for_rank`] starts (until [`clear_ranks`]).
    pub fn set_for_ranks(f: impl Fn(usize, usize, &[usize]) -> bool + Send + Sync + 'static) {
        *RANK_HOOK.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::sync::Arc::new(f));
    }

    pub fn clear_ranks() {
        *RANK_HOOK.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Called by each rank thread as it starts: installs the ranks' hook on it, if one is set.
    pub fn install_for_rank(rank: usize) {
        let hook = RANK_HOOK.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(f) = hook {
            set(move |step, ids| f(rank, step, ids));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    /// A leaf error printing as cudarc's do (`DriverError(CODE, "text")`).
    #[derive(Debug)]
    struct Leaf(&'static str);

    impl std::fmt::Display for Leaf {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl StdError for Leaf {}

    const DRIVER: &str = "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")";

    #[test]
    fn finds_each_kind_under_every_wrapping() {
        use candle_core::Error as E;
        let cases: Vec<(&str, anyhow::Error)> = vec![
            ("driver", E::Cuda(Box::new(Leaf(DRIVER))).into()),
            (
                "cublas",
                E::Cuda(Box::new(Leaf("CublasError(CUBLAS_STATUS_ALLOC_FAILED)"))).into(),
            ),
            (
                "cudnn as text",
                E::wrap("CudnnError(CUDNN_STATUS_ALLOC_FAILED)").into(),
            ),
            (
                "candle context and backtrace",
                E::Cuda(Box::new(Leaf(DRIVER)))
                    .context("conv2d")
                    .with_path("unet.safetensors")
                    .into(),
            ),
            (
                "synchronize's text",
                E::Msg(format!("sync: {DRIVER}")).into(),
            ),
            (
                "anyhow context over candle",
                Err::<(), _>(E::Cuda(Box::new(Leaf(DRIVER))))
                    .context("forward pass")
                    .context("step 12")
                    .unwrap_err(),
            ),
            (
                "ours",
                anyhow::Error::new(OutOfMemory {
                    detail: "injected".into(),
                })
                .context("micro-batch"),
            ),
            (
                "a plain leaf",
                anyhow::Error::new(Leaf(DRIVER)).context("optimizer step"),
            ),
        ];
        for (what, err) in cases {
            assert!(find_oom(&err).is_some(), "{what}: not found in {err:?}");
        }
        let got = find_oom(&E::Cuda(Box::new(Leaf(DRIVER))).into()).unwrap();
        assert_eq!(got.detail, DRIVER);
    }

    #[test]
    fn other_errors_are_not_oom() {
        use candle_core::Error as E;
        let cases: Vec<anyhow::Error> = vec![
            E::Msg("shape mismatch in matmul".into()).into(),
            E::Cuda(Box::new(Leaf(
                "DriverError(CUDA_ERROR_ILLEGAL_ADDRESS, \"x\")",
            )))
            .into(),
            anyhow::anyhow!("out of disk space").context("saving"),
            E::UnwrapNone.context("memory").into(),
        ];
        for err in cases {
            assert!(find_oom(&err).is_none(), "{err:?}");
        }
    }
}
