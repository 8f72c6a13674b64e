//! A forward result computed outside the graph (on detached operands, so candle records nothing)
//! and handed to a custom op's forward, which returns its storage (moved, not copied, when nothing
//! else holds it). The op then carries a hand-written backward; the slot is emptied by the
//! forward, so the graph does not keep a second copy of the output. Used by the frozen conv and
//! the chunked attention (the other fused ops attach their result with `Tensor::attach`).

use std::sync::Mutex;

use candle_core::{CpuStorage, Result, Shape, Storage, Tensor};

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

    /// The held output's storage, as `extract` finds it on its device: moved out without a
    /// copy when the slot held the only handle to it (the usual case: a result made for the
    /// op), an owned copy otherwise (a result that also lives elsewhere, e.g. a kept input).
    fn owned<S>(&self, extract: impl Fn(Storage) -> Option<S>) -> Result<(S, Shape)> {
        let y = self.take()?;
        let layout = y.layout().clone();
        if !layout.is_contiguous() || layout.start_offset() != 0 {
            candle_core::bail!("{}: output is not contiguous from offset 0", self.name);
        }
        let storage = match y.into_storage() {
            Ok((storage, _)) => storage,
            Err(shared) => {
                let (storage, _) = shared.storage_and_layout();
                storage.try_clone(&layout)?
            }
        };
        match extract(storage) {
            Some(s) => Ok((s, layout.shape().clone())),
            None => {
                candle_core::bail!("{}: output is on another device than the input", self.name)
            }
        }
    }

    /// For `cpu_fwd`.
    pub(crate) fn cpu(&self) -> Result<(CpuStorage, Shape)> {
        self.owned(|s| match s {
            Storage::Cpu(c) => Some(c),
            _ => None,
        })
    }

    /// For `cuda_fwd`.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda(&self) -> Result<(candle_core::CudaStorage, Shape)> {
        self.owned(|s| match s {
            Storage::Cuda(c) => Some(c),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{CpuStorage, Device, Result, Tensor};

    use super::OutputSlot;

    fn data_ptr(s: &CpuStorage) -> Result<*const f32> {
        Ok(s.as_slice::<f32>()?.as_ptr())
    }

    /// A result nothing else holds is handed over as it is: the op's output is the buffer the
    /// forward computed, not a copy of it (one allocation and one pass over the output fewer
    /// per fused op, a device copy on CUDA).
    #[test]
    fn a_result_held_only_by_the_slot_is_moved() -> Result<()> {
        let y = Tensor::arange(0f32, 6., &Device::Cpu)?.reshape((2, 3))?;
        let before = {
            let (s, _) = y.storage_and_layout();
            match &*s {
                candle_core::Storage::Cpu(c) => data_ptr(c)?,
                _ => candle_core::bail!("not on the CPU"),
            }
        };
        let slot = OutputSlot::new("test", y)?;
        let (storage, shape) = slot.cpu()?;
        assert_eq!(shape.dims(), &[2, 3]);
        assert_eq!(data_ptr(&storage)?, before, "the output was copied");
        assert_eq!(storage.as_slice::<f32>()?, &[0., 1., 2., 3., 4., 5.]);
        Ok(())
    }

    /// A result that is also held elsewhere is copied, and the other holder keeps its values.
    #[test]
    fn a_shared_result_is_copied() -> Result<()> {
        let y = Tensor::arange(0f32, 4., &Device::Cpu)?;
        let kept = y.clone();
        let slot = OutputSlot::new("test", y)?;
        let (storage, _) = slot.cpu()?;
        assert_eq!(storage.as_slice::<f32>()?, &[0., 1., 2., 3.]);
        assert_eq!(kept.to_vec1::<f32>()?, vec![0., 1., 2., 3.]);
        assert!(slot.cpu().is_err(), "a second forward must be refused");
        Ok(())
    }
}
