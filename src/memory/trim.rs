//! Giving freed device memory back after an out-of-memory error, before the retry.
//!
//! The failed micro-batch's tensors are dropped by then, but with pool caching on (the default,
//! [`super::device_setup`]) their memory stays in the CUDA pool, and memory another allocation
//! path needs (cuBLAS and cuDNN workspaces, the driver) cannot use it. A stream synchronisation
//! makes every free final, then `cuMemPoolTrimTo(pool, 0)` releases all unused pool memory.
//! On the CPU it does nothing.

use candle_core::Device;

/// Synchronises `device` and trims its memory pool to what is in use (CUDA only).
pub fn trim_pool(device: &Device) -> candle_core::Result<()> {
    match device {
        Device::Cpu | Device::Metal(_) => Ok(()),
        Device::Cuda(dev) => cuda::trim(dev),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::result;
    use candle_core::CudaDevice;

    use crate::memory::usage::cuda_pool;

    pub(super) fn trim(dev: &CudaDevice) -> candle_core::Result<()> {
        dev.cuda_stream()
            .synchronize()
            .map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
        let pool = cuda_pool(dev)?;
        // Safety: `pool` is this device's live default pool; trimming to 0 releases only memory
        // no allocation holds.
        unsafe { result::mem_pool::trim_to(pool, 0) }
            .map_err(|e| candle_core::Error::Cuda(Box::new(e)))
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use candle_core::CudaDevice;

    pub(super) fn trim(_dev: &CudaDevice) -> candle_core::Result<()> {
        Err(candle_core::Error::NotCompiledWithCudaSupport)
    }
}
