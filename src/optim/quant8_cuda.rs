//! An 8-bit moment in device memory ([`CudaMoment`]) read and written as a whole f32 tensor, for
//! the optimizers whose step is tensor ops (CAME, [`super::came`]): `q8_dequant` and
//! `q8_requant_{signed,unsigned}` from src/optim/quant8.cu, launched through
//! [`super::cuda::launch_on`]. Both compute what [`super::quant8`] computes on the host, bit for
//! bit (src/optim/quant8_emu_tests.rs runs them under the host emulation; tests/cuda/optim.rs on
//! a GPU), so a step makes no host copy of the moment and a state file resumes on either device.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchArgs, PushKernelArg};
use candle_core::{bail, DType, Device, Result, Tensor};

use super::cuda::{launch_on, CudaMoment, KernelCall, KernelFile, StateArgs};
use super::launch;

const QUANT8: KernelFile = KernelFile {
    ptx: include_str!(concat!(env!("OUT_DIR"), "/optim_quant8.ptx")),
    module: "sdtrain_quant8",
};

/// The signed or unsigned map of the two-map buffer.
fn map_of(maps: &CudaSlice<f32>, signed: bool) -> CudaView<'_, f32> {
    maps.slice(launch::map_range(signed))
}

/// `q8_dequant`'s buffers after its output: codes, absmax, map.
struct ReadArgs<'m> {
    codes: &'m CudaSlice<u8>,
    absmax: &'m CudaSlice<f32>,
    map: CudaView<'m, f32>,
}

impl StateArgs for ReadArgs<'_> {
    fn push<'a>(&'a mut self, b: &mut LaunchArgs<'a>) {
        b.arg(self.codes);
        b.arg(self.absmax);
        b.arg(&self.map);
    }
}

/// `q8_requant_*`'s buffers after its input: codes and absmax (written), map.
struct WriteArgs<'m> {
    codes: &'m mut CudaSlice<u8>,
    absmax: &'m mut CudaSlice<f32>,
    map: CudaView<'m, f32>,
}

impl StateArgs for WriteArgs<'_> {
    fn push<'a>(&'a mut self, b: &mut LaunchArgs<'a>) {
        b.arg(&mut *self.codes);
        b.arg(&mut *self.absmax);
        b.arg(&self.map);
    }
}

impl CudaMoment {
    /// An 8-bit moment's values as an f32 tensor of `shape` on its device (`Moment::values`),
    /// through the signed or unsigned map.
    pub fn dequantize(&self, shape: &[usize], signed: bool) -> Result<Tensor> {
        let Some((codes, absmax, maps)) = self.q8_parts() else {
            bail!("q8_dequant: the moment is not 8-bit");
        };
        let n = codes.len();
        if shape.iter().product::<usize>() != n {
            bail!("q8_dequant: {n} codes for shape {shape:?}");
        }
        let out = Tensor::zeros(shape, DType::F32, &Device::Cuda(self.device().clone()))?;
        let call = KernelCall {
            file: &QUANT8,
            entry: launch::DEQUANT_ENTRY,
            grid: launch::grid(n, true),
            scalars: &[],
        };
        let mut args = ReadArgs {
            codes,
            absmax,
            map: map_of(maps, signed),
        };
        launch_on(&out, &call, &mut args)?;
        Ok(out)
    }

    /// Stores `values` (f32, on the moment's device, as many as its codes), requantized block by
    /// block as `quant8::requantize` does, through the signed or unsigned map.
    pub fn requantize(&mut self, values: &Tensor, signed: bool) -> Result<()> {
        let Some((codes, absmax, maps)) = self.q8_parts_mut() else {
            bail!("q8_requant: the moment is not 8-bit");
        };
        let n = codes.len();
        if values.elem_count() != n || values.dtype() != DType::F32 {
            bail!(
                "q8_requant: {:?} {:?} values for {n} codes",
                values.dtype(),
                values.dims()
            );
        }
        let values = values.contiguous()?;
        let call = KernelCall {
            file: &QUANT8,
            entry: launch::requant_entry(signed),
            grid: launch::grid(n, true),
            scalars: &[],
        };
        let mut args = WriteArgs {
            codes,
            absmax,
            map: map_of(maps, signed),
        };
        launch_on(&values, &call, &mut args)
    }
}
