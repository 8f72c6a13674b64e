//! A moment of optimizer state where its parameter lives: on the host for a CPU parameter, in
//! device memory for a CUDA one (with the `cuda` feature). Saving and loading go through the
//! host [`Moment`] either way, so the state file is the same whatever device wrote it.

use candle_core::{Result, Tensor, Var};

#[cfg(feature = "cuda")]
use super::cuda::CudaMoment;
use super::quant8::{DynamicMap, Moment};

#[derive(Debug)]
pub enum PlacedMoment {
    Host(Moment),
    #[cfg(feature = "cuda")]
    Cuda(CudaMoment),
}

impl PlacedMoment {
    /// Zeros for a parameter shaped like `var`, on its device (see [`Moment::zeros`]).
    pub fn zeros(var: &Var, eight_bit: bool, map: &DynamicMap) -> Result<Self> {
        let host = Moment::zeros(var.elem_count(), eight_bit, map);
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = var.device() {
            return Ok(Self::Cuda(CudaMoment::upload(&host, dev)?));
        }
        Ok(Self::Host(host))
    }

    /// See [`Moment::save`]; a device moment is copied to the host.
    pub fn save(
        &self,
        names: (&'static str, &'static str),
        shape: &[usize],
    ) -> Result<Vec<(&'static str, Tensor)>> {
        match self {
            Self::Host(m) => m.save(names, shape),
            #[cfg(feature = "cuda")]
            Self::Cuda(m) => m.download()?.save(names, shape),
        }
    }

    /// See [`Moment::load`]; a device moment is replaced by an upload of the loaded values.
    pub fn load(&mut self, tensors: &mut std::vec::IntoIter<Tensor>) -> Result<()> {
        match self {
            Self::Host(m) => m.load(tensors),
            #[cfg(feature = "cuda")]
            Self::Cuda(m) => {
                let mut host = m.host_kind();
                host.load(tensors)?;
                *m = CudaMoment::upload(&host, m.device())?;
                Ok(())
            }
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            Self::Host(m) => m.bytes(),
            #[cfg(feature = "cuda")]
            Self::Cuda(m) => m.bytes(),
        }
    }
}
