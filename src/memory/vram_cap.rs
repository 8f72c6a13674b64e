//! `vram_limit_gb`: making a big card behave like a small one, so a config can be proven to fit a
//! 12 GB card before it ships.
//!
//! At the start of a run, everything on the card beyond the limit is allocated and held (one
//! `cuMemAlloc`, outside the memory pool, so the pool's peak counters see only the run). The run
//! then has at most `limit` bytes of the card, the CUDA context included, as on a card of that
//! size: an allocation past it fails with a real out-of-memory error, and the OOM retry takes
//! over. On the CPU the limit does not apply.

use candle_core::Device;

const GIB: f64 = (1u64 << 30) as f64;

/// The memory held back to cap the run at `limit_bytes`; released when dropped.
pub struct VramCap {
    pub limit_bytes: u64,
    pub reserved_bytes: u64,
    /// The card's total memory.
    pub total_bytes: u64,
    #[cfg(feature = "cuda")]
    _hold: Option<cuda::Hold>,
}

impl std::fmt::Debug for VramCap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VramCap({})", self.describe())
    }
}

impl VramCap {
    /// `12.0 GiB of an 79.6 GiB card (67.6 GiB held back)`.
    pub fn describe(&self) -> String {
        format!(
            "{:.1} GiB of a {:.1} GiB card ({:.1} GiB held back)",
            self.limit_bytes as f64 / GIB,
            self.total_bytes as f64 / GIB,
            self.reserved_bytes as f64 / GIB
        )
    }
}

/// Bytes to hold back on a card of `total` bytes with `free` free so the run sees `limit`:
/// everything beyond `limit`, of which only what is free can be taken.
pub fn reservation(free: u64, total: u64, limit: u64) -> Result<u64, String> {
    if limit >= total {
        return Err(format!(
            "vram_limit_gb {:.1} is not below the card's {:.1} GiB",
            limit as f64 / GIB,
            total as f64 / GIB
        ));
    }
    let used = total - free;
    if used >= limit {
        return Err(format!(
            "vram_limit_gb {:.1}: {:.1} GiB of the card is already in use (other processes?)",
            limit as f64 / GIB,
            used as f64 / GIB
        ));
    }
    Ok(total - limit)
}

/// Caps the run at `limit_gb` of `device` (CUDA); `None` on the CPU, where it does not apply.
pub fn cap(device: &Device, limit_gb: f64) -> anyhow::Result<Option<VramCap>> {
    let limit = (limit_gb * GIB) as u64;
    match device {
        Device::Cpu | Device::Metal(_) => Ok(None),
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => cuda::cap(dev, limit).map(Some),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => {
            let _ = limit;
            Err(candle_core::Error::NotCompiledWithCudaSupport.into())
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    use candle_core::CudaDevice;

    use super::{reservation, VramCap};

    /// A device allocation held until dropped.
    pub(super) struct Hold {
        ptr: sys::CUdeviceptr,
        dev: CudaDevice,
    }

    impl Drop for Hold {
        fn drop(&mut self) {
            let ctx = self.dev.cuda_stream().context().clone();
            if ctx.bind_to_thread().is_ok() {
                // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once.
                unsafe { result::free_sync(self.ptr) }.ok();
            }
        }
    }

    pub(super) fn cap(dev: &CudaDevice, limit: u64) -> anyhow::Result<VramCap> {
        let stream = dev.cuda_stream();
        let ctx = stream.context();
        ctx.bind_to_thread()?;
        let (free, total) = ctx.mem_get_info()?;
        let reserve = reservation(free as u64, total as u64, limit).map_err(anyhow::Error::msg)?;
        // SAFETY: a plain device allocation in the bound context, freed by `Hold`.
        let ptr = unsafe { result::malloc_sync(reserve as usize) }?;
        Ok(VramCap {
            limit_bytes: limit,
            reserved_bytes: reserve,
            total_bytes: total as u64,
            _hold: Some(Hold {
                ptr,
                dev: dev.clone(),
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 30;

    #[test]
    fn holds_back_everything_beyond_the_limit() {
        assert_eq!(reservation(78 * G, 80 * G, 12 * G), Ok(68 * G));
        assert!(reservation(78 * G, 80 * G, 80 * G)
            .unwrap_err()
            .contains("not below"));
        assert!(reservation(10 * G, 80 * G, 12 * G)
            .unwrap_err()
            .contains("already in use"));
        assert!(cap(&Device::Cpu, 12.0).unwrap().is_none());
    }
}
