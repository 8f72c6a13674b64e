//! One-time settings for a CUDA device before training.
//!
//! - **Pool caching.** cudarc allocates with `cuMemAllocAsync` from the device's memory pool,
//!   whose release threshold defaults to 0: at every stream synchronisation, freed blocks go back
//!   to the driver, and the next step maps them in again. A threshold of `u64::MAX` keeps them in
//!   the pool, as torch's caching allocator does. The pool still hands memory to any allocation
//!   that needs it, so this costs no headroom inside the process; `cuMemPoolTrimTo` gives it back
//!   when asked (the OOM path).
//! - **Event tracking.** candle records a CUDA event on every tensor use so tensors can be shared
//!   across streams safely. sdtrain runs everything on the device's one stream, where stream
//!   order already guarantees it, so the events are pure overhead. It applies to tensors created
//!   after this call: call it before loading the model.
//!
//! On the CPU both are no-ops. gpu-check measures each against the defaults.

use candle_core::Device;

/// How the device's allocator and candle's stream bookkeeping are set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSettings {
    /// Keep freed device memory in the pool between steps (release threshold `u64::MAX`).
    pub pool_cache: bool,
    /// Keep candle's per-tensor CUDA events (only needed with several streams).
    pub event_tracking: bool,
}

impl Default for DeviceSettings {
    fn default() -> Self {
        Self {
            pool_cache: true,
            event_tracking: false,
        }
    }
}

/// Applies `settings` to `device` (CUDA only; a no-op on the CPU).
pub fn prepare_device(device: &Device, settings: DeviceSettings) -> candle_core::Result<()> {
    match device {
        Device::Cpu | Device::Metal(_) => Ok(()),
        Device::Cuda(dev) => cuda::prepare(dev, settings),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::CudaDevice;

    use super::DeviceSettings;
    use crate::memory::usage::{cuda_pool, set_cuda_pool_attribute};

    pub(super) fn prepare(dev: &CudaDevice, settings: DeviceSettings) -> candle_core::Result<()> {
        let threshold = if settings.pool_cache { u64::MAX } else { 0 };
        set_cuda_pool_attribute(
            cuda_pool(dev)?,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            threshold,
        )?;
        if !settings.event_tracking && dev.is_event_tracking() {
            // Safety: sdtrain issues all work on this device's single stream (candle's default
            // stream for the device); no tensor is shared with another stream.
            unsafe { dev.disable_event_tracking() };
        }
        Ok(())
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use candle_core::CudaDevice;

    use super::DeviceSettings;

    pub(super) fn prepare(_dev: &CudaDevice, _settings: DeviceSettings) -> candle_core::Result<()> {
        Err(candle_core::Error::NotCompiledWithCudaSupport)
    }
}
