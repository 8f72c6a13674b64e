//! A forward result computed outside the graph (on detached operands, so candle records nothing)
//! and handed to a custom op's forward, which returns an owned copy of its storage. The op then
//! carries a hand-written backward; the slot is emptied by the forward, so the graph does not
//! keep a second copy of the output. Shared by the frozen conv, the hand-over ops and the
//! trainable conv.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Result, Shape, Storage, Tensor};

pub(crate) struct OutputSlot {
    name: &'static str,
    out: Mutex<Option<Tensor>>,
}

impl OutputSlot {
    /// Holds `out` (made contiguous) for the op called `name` (named in errors).
    pub(crate) fn new(name: &'static str, out: Tensor) -> Result<Self> {
        Ok(Self {
            name,
            out: Mutex::new(Some(out.contiguous()?)),
        })
    }

    fn take(&self) -> Result<Tensor> {
        let mut slot = self
            .out
            .lock()
            .map_err(|_| candle_core::Error::Msg(format!("{}: poisoned lock", self.name)))?;
        match slot.take() {
            Some(y) => Ok(y),
            None => candle_core::bail!("{}: forward ran twice", self.name),
        }
    }

    /// An owned copy of the held output's storage, as `extract` finds it on its device.
    fn owned<S>(
        &self,
        extract: impl Fn(&Storage, &Layout) -> Option<Result<S>>,
    ) -> Result<(S, Shape)> {
        let y = self.take()?;
        let (storage, layout) = y.storage_and_layout();
        if !layout.is_contiguous() || layout.start_offset() != 0 {
            candle_core::bail!("{}: output is not contiguous from offset 0", self.name);
        }
        match extract(&storage, &Layout::contiguous(y.shape())) {
            Some(s) => Ok((s?, layout.shape().clone())),
            None => candle_core::bail!("{}: output is on another device than the input", self.name),
        }
    }

    /// For `cpu_fwd`.
    pub(crate) fn cpu(&self) -> Result<(CpuStorage, Shape)> {
        self.owned(|s, l| match s {
            Storage::Cpu(c) => Some(c.try_clone(l)),
            _ => None,
        })
    }

    /// For `cuda_fwd`.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda(&self) -> Result<(candle_core::CudaStorage, Shape)> {
        self.owned(|s, l| match s {
            Storage::Cuda(c) => Some(c.try_clone(l)),
            _ => None,
        })
    }
}
