//! Memory in use and its peak, read from the device rather than estimated.
//!
//! - CUDA: candle allocates through cudarc's stream-ordered `cuMemAllocAsync`, which draws from
//!   the device's current memory pool. The pool's `USED_MEM_CURRENT` and `USED_MEM_HIGH`
//!   attributes are the bytes handed out to tensors now and at most since the last reset, what
//!   torch calls `memory_allocated` and `max_memory_allocated`. `cuMemGetInfo` adds the card's
//!   free and total memory, which also counts the CUDA context, cuBLAS workspaces and loaded
//!   kernels.
//! - CPU: the process's resident set (`VmRSS`) and its high-water mark (`VmHWM`) from
//!   `/proc/self/status`.
//!
//! None of these reads synchronises the CUDA stream.

use candle_core::Device;
use serde::Serialize;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Where a reading comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemorySource {
    /// The CUDA device's memory pool (bytes held by tensors).
    CudaPool,
    /// The process's resident set on the host.
    ProcessRss,
}

impl MemorySource {
    /// A short label for the progress line and the summary.
    pub fn label(self) -> &'static str {
        match self {
            Self::CudaPool => "device",
            Self::ProcessRss => "RSS",
        }
    }
}

/// One reading of memory in use and its peak.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MemoryUsage {
    pub source: MemorySource,
    pub in_use_bytes: u64,
    pub peak_bytes: u64,
    /// The card's free memory (CUDA only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_free_bytes: Option<u64>,
    /// The card's total memory (CUDA only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_total_bytes: Option<u64>,
}

impl MemoryUsage {
    /// Reads the memory of `device`: the CUDA pool on a CUDA device, the process's RSS otherwise.
    /// `None` where the platform offers no reading (a CPU run off Linux).
    pub fn read(device: &Device) -> candle_core::Result<Option<Self>> {
        match device {
            Device::Cpu | Device::Metal(_) => Ok(read_process_rss()),
            Device::Cuda(dev) => cuda::read(dev).map(Some),
        }
    }

    pub fn peak_gib(&self) -> f64 {
        self.peak_bytes as f64 / GIB
    }

    /// The short form for the progress line: `mem 3.21 GiB/5.10 GiB` (in use / peak).
    pub fn short(&self) -> String {
        format!(
            "mem {}/{}",
            human_bytes(self.in_use_bytes),
            human_bytes(self.peak_bytes)
        )
    }

    /// The summary's line: peak and in-use, plus the card's total and free memory on CUDA.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "peak {} {} (in use {})",
            human_bytes(self.peak_bytes),
            self.source.label(),
            human_bytes(self.in_use_bytes)
        );
        if let (Some(free), Some(total)) = (self.device_free_bytes, self.device_total_bytes) {
            s.push_str(&format!(
                "; card {:.1} GiB, {:.1} GiB free",
                total as f64 / GIB,
                free as f64 / GIB
            ));
        }
        s
    }
}

/// `1.25 GiB`, or `312 MiB` below one GiB (a tiny model's use must not read as 0.00 GiB).
fn human_bytes(bytes: u64) -> String {
    let gib = bytes as f64 / GIB;
    if gib >= 1.0 {
        format!("{gib:.2} GiB")
    } else {
        format!("{:.0} MiB", bytes as f64 / (1024.0 * 1024.0))
    }
}

fn read_process_rss() -> Option<MemoryUsage> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_proc_status(&status)
}

/// `VmRSS` and `VmHWM` (in kB) from the text of `/proc/<pid>/status`.
fn parse_proc_status(status: &str) -> Option<MemoryUsage> {
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = line[name.len()..].split_whitespace().next()?.parse().ok()?;
        Some(kib * 1024)
    };
    let in_use = field("VmRSS:")?;
    let peak = field("VmHWM:").unwrap_or(in_use).max(in_use);
    Some(MemoryUsage {
        source: MemorySource::ProcessRss,
        in_use_bytes: in_use,
        peak_bytes: peak,
        device_free_bytes: None,
        device_total_bytes: None,
    })
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::{result, sys, DriverError};
    use candle_core::CudaDevice;

    use super::{MemorySource, MemoryUsage};

    fn err(e: DriverError) -> candle_core::Error {
        candle_core::Error::Cuda(Box::new(e))
    }

    /// The pool `cuMemAllocAsync` draws from on this device, with its context bound.
    pub(crate) fn pool(dev: &CudaDevice) -> candle_core::Result<sys::CUmemoryPool> {
        let stream = dev.cuda_stream();
        let ctx = stream.context();
        ctx.bind_to_thread().map_err(err)?;
        // Safety: cu_device() comes from the live context above.
        unsafe { result::device::get_mem_pool(ctx.cu_device()) }.map_err(err)
    }

    fn attribute(
        pool: sys::CUmemoryPool,
        attr: sys::CUmemPool_attribute,
    ) -> candle_core::Result<u64> {
        let mut value: u64 = 0;
        // Safety: the USED/RESERVED attributes and RELEASE_THRESHOLD are cuuint64_t.
        unsafe { result::mem_pool::get_attribute(pool, attr, &mut value as *mut u64 as *mut _) }
            .map_err(err)?;
        Ok(value)
    }

    pub(crate) fn set_attribute(
        pool: sys::CUmemoryPool,
        attr: sys::CUmemPool_attribute,
        mut value: u64,
    ) -> candle_core::Result<()> {
        // Safety: as in `attribute`; the driver copies the value.
        unsafe { result::mem_pool::set_attribute(pool, attr, &mut value as *mut u64 as *mut _) }
            .map_err(err)
    }

    pub(super) fn read(dev: &CudaDevice) -> candle_core::Result<MemoryUsage> {
        let pool = pool(dev)?;
        let in_use = attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
        )?;
        let peak = attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        )?;
        let (free, total) = dev.cuda_stream().context().mem_get_info().map_err(err)?;
        Ok(MemoryUsage {
            source: MemorySource::CudaPool,
            in_use_bytes: in_use,
            peak_bytes: peak.max(in_use),
            device_free_bytes: Some(free as u64),
            device_total_bytes: Some(total as u64),
        })
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use candle_core::CudaDevice;

    use super::MemoryUsage;

    pub(super) fn read(_dev: &CudaDevice) -> candle_core::Result<MemoryUsage> {
        Err(candle_core::Error::NotCompiledWithCudaSupport)
    }
}

#[cfg(feature = "cuda")]
pub(crate) use cuda::{pool as cuda_pool, set_attribute as set_cuda_pool_attribute};

#[cfg(test)]
mod tests {
    use super::*;

    const STATUS: &str =
        "Name:\tsdtrain\nVmPeak:\t 9000 kB\nVmHWM:\t    5120 kB\nVmRSS:\t    2048 kB\n";

    #[test]
    fn rss_fields_are_read_in_kib() {
        let m = parse_proc_status(STATUS).unwrap();
        assert_eq!(m.source, MemorySource::ProcessRss);
        assert_eq!(m.in_use_bytes, 2048 * 1024);
        assert_eq!(m.peak_bytes, 5120 * 1024);
        assert_eq!(m.short(), "mem 2 MiB/5 MiB");
    }

    #[test]
    fn peak_is_never_below_in_use() {
        let m = parse_proc_status("VmHWM:\t 10 kB\nVmRSS:\t 20 kB\n").unwrap();
        assert_eq!(m.peak_bytes, 20 * 1024);
        assert!(parse_proc_status("Name: x\n").is_none());
    }

    #[test]
    fn cpu_reading_reports_this_process() {
        let Some(m) = MemoryUsage::read(&Device::Cpu).unwrap() else {
            return; // not Linux
        };
        assert!(m.in_use_bytes > 1024 * 1024, "{m:?}");
        assert!(m.peak_bytes >= m.in_use_bytes);
    }

    #[test]
    fn describe_names_card_memory_on_cuda_readings() {
        let m = MemoryUsage {
            source: MemorySource::CudaPool,
            in_use_bytes: 3 << 30,
            peak_bytes: 5 << 30,
            device_free_bytes: Some(70 << 30),
            device_total_bytes: Some(80 << 30),
        };
        assert_eq!(m.short(), "mem 3.00 GiB/5.00 GiB");
        assert_eq!(
            m.describe(),
            "peak 5.00 GiB device (in use 3.00 GiB); card 80.0 GiB, 70.0 GiB free"
        );
    }
}
