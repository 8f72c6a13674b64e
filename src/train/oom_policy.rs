//! What the trainer does when the device runs out of memory, in one place:
//! - inside a step's forward and backward, [`halve_after_oom`]: free the pool, halve the
//!   micro-batch and retry the same samples (the update and the data order are unchanged);
//! - outside it (the optimizer update of one parameter, a save), [`retry_once_on_oom`]: there is
//!   nothing to halve, so free the pool and try once more.
//!
//! Either way, running out again where nothing is left to halve is [`OomExhausted`], which the
//! trainer turns into a save of the last completed step and a list of rungs to try.

use anyhow::Context;
use candle_core::Device;

use super::micro_batch::MicroBatching;
use super::oom::{find_oom, OutOfMemory};
use crate::memory::trim_pool;

/// The run ran out of memory where halving cannot help: the trainer saves and stops.
#[derive(Debug, thiserror::Error)]
#[error("out of device memory {place}: {oom}")]
pub struct OomExhausted {
    pub place: String,
    pub oom: OutOfMemory,
}

/// The policy for an error `e` from the forward and backward of (0-based) `step`'s samples: an
/// out-of-memory error frees the pool and halves `micro`, returning the line to log, so the
/// caller retries the same samples; at a micro-batch of 1 it is [`OomExhausted`]. Any other
/// error is returned as it is.
pub(super) fn halve_after_oom(
    e: anyhow::Error,
    micro: &mut MicroBatching,
    device: &Device,
    step: usize,
    effective: usize,
) -> anyhow::Result<String> {
    let Some(oom) = find_oom(&e) else {
        return Err(e);
    };
    // The failed micro-batch's graph is gone with `e`'s stack frame.
    drop(e);
    trim_pool(device).context("freeing memory after an OOM")?;
    let old = micro.size;
    if !micro.halve() {
        return Err(OomExhausted {
            place: format!("at step {} with batch 1", step + 1),
            oom,
        }
        .into());
    }
    Ok(micro.retry_line(step + 1, old, effective))
}

/// `f`, retried once after an out-of-memory error with the device's pool trimmed; a second
/// out-of-memory error becomes [`OomExhausted`] at `place`. Outside the micro-batches (the
/// optimizer update, saves) there is nothing to halve, so this is the whole policy there.
pub(super) fn retry_once_on_oom<T>(
    device: &Device,
    place: impl FnOnce() -> String,
    mut f: impl FnMut() -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    match f() {
        Err(e) if find_oom(&e).is_some() => {
            drop(e);
            trim_pool(device).context("freeing memory after an OOM")?;
            f().map_err(|e| match find_oom(&e) {
                Some(oom) => OomExhausted {
                    place: place(),
                    oom,
                }
                .into(),
                None => e,
            })
        }
        result => result,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oom() -> anyhow::Error {
        anyhow::Error::new(OutOfMemory {
            detail: "test".into(),
        })
    }

    /// Halving goes 4 → 2 → 1 and then gives up naming the step; the log line names the new
    /// accumulation (a wrong rounding or a missing retry count fails here).
    #[test]
    fn halving_goes_down_to_one_then_gives_up() {
        let mut micro = MicroBatching::new(4);
        let line = halve_after_oom(oom(), &mut micro, &Device::Cpu, 2, 4).unwrap();
        assert_eq!(micro.size, 2);
        assert!(line.contains("batch 2 × accumulation 2"), "{line}");
        halve_after_oom(oom(), &mut micro, &Device::Cpu, 2, 4).unwrap();
        assert_eq!((micro.size, micro.oom_retries), (1, 2));
        let err = halve_after_oom(oom(), &mut micro, &Device::Cpu, 2, 4).unwrap_err();
        let exhausted = err.downcast_ref::<OomExhausted>().expect("OomExhausted");
        assert_eq!(exhausted.place, "at step 3 with batch 1");
    }

    /// Any other error passes through untouched and leaves the micro-batch alone.
    #[test]
    fn other_errors_do_not_halve() {
        let mut micro = MicroBatching::new(4);
        let err = halve_after_oom(anyhow::anyhow!("disk full"), &mut micro, &Device::Cpu, 0, 4)
            .unwrap_err();
        assert_eq!(err.to_string(), "disk full");
        assert_eq!(micro, MicroBatching::new(4));
    }
}
