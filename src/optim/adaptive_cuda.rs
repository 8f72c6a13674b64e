//! The CUDA state and step of the rules whose CPU path is written with tensor ops (Prodigy,
//! D-Adaptation, DoWG, AdaCoor, schedule-free AdamW): the state buffers in device memory, each pass one launch of a
//! fused kernel from src/optim/adaptive.cu in the parameter's own storage, with the scalars
//! [`super::adaptive_args`] gives. A first pass's sums come back as one partial sum per block,
//! added here in f64 in block order; that copy is the pass's one host sync.
//!
//! The state file is the CPU path's, name for name: a run resumes on the other device.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchArgs, PushKernelArg};
use candle_core::{bail, CudaDevice, DType, Device, Result, Tensor, Var};
use half::bf16;

use super::adaptive_args::{block_totals, AdaptiveKernel, BufKind, Buffer, Launch};
use super::cuda::{launch_in_place, KernelCall, KernelFile, StateArgs};
use super::launch;
use super::rule::{ParamState, Shares, StepScalars};

const ADAPTIVE: KernelFile = KernelFile {
    ptx: include_str!(concat!(env!("OUT_DIR"), "/optim_adaptive.ptx")),
    module: "sdtrain_adaptive",
};

/// A fused-kernel state for `var` when it lives on a CUDA device; `None` on any other device.
pub fn on_cuda(
    var: &Var,
    kernel: impl AdaptiveKernel + 'static,
) -> Result<Option<Box<dyn ParamState>>> {
    match var.device() {
        Device::Cuda(dev) => Ok(Some(Box::new(FusedState::zeros(
            Box::new(kernel),
            var,
            dev,
        )?))),
        _ => Ok(None),
    }
}

/// One state buffer in device memory.
enum Slot {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<bf16>),
}

impl Slot {
    fn upload(dev: &CudaDevice, kind: BufKind, values: &Tensor) -> Result<Self> {
        let values = values.flatten_all()?;
        Ok(match kind {
            BufKind::F32 => Self::F32(dev.clone_htod(&values.to_vec1::<f32>()?)?),
            BufKind::Bf16 => Self::Bf16(dev.clone_htod(&values.to_vec1::<bf16>()?)?),
        })
    }

    fn download(&self, dev: &CudaDevice, shape: &[usize]) -> Result<Tensor> {
        match self {
            Self::F32(v) => Tensor::from_vec(dev.clone_dtoh(v)?, shape, &Device::Cpu),
            Self::Bf16(v) => Tensor::from_vec(dev.clone_dtoh(v)?, shape, &Device::Cpu),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Self::F32(v) => 4 * v.len(),
            Self::Bf16(v) => 2 * v.len(),
        }
    }
}

/// A parameter's state on the device, stepped by its rule's kernels.
pub struct FusedState {
    kernel: Box<dyn AdaptiveKernel>,
    dev: CudaDevice,
    shape: Vec<usize>,
    buffers: Vec<Buffer>,
    slots: Vec<Slot>,
}

impl FusedState {
    fn zeros(kernel: Box<dyn AdaptiveKernel>, var: &Var, dev: &CudaDevice) -> Result<Self> {
        let buffers = kernel.buffers();
        let shape = var.dims().to_vec();
        let slots = buffers
            .iter()
            .map(|b| {
                let dtype = match b.kind {
                    BufKind::F32 => DType::F32,
                    BufKind::Bf16 => DType::BF16,
                };
                let fill = Tensor::full(b.fill, var.elem_count(), &Device::Cpu)?.to_dtype(dtype)?;
                Slot::upload(dev, b.kind, &fill)
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            kernel,
            dev: dev.clone(),
            shape,
            buffers,
            slots,
        })
    }

    /// Runs `launch` on `var`: the sums it gathered, added over the blocks (empty without).
    fn run(&mut self, var: &Var, grad: &Tensor, launch: &Launch) -> Result<Vec<f64>> {
        let n = var.elem_count();
        if n == 0 {
            return Ok(vec![0.0; launch.sums]);
        }
        let grid = launch::grid(n, false);
        let mut sums = match launch.sums {
            0 => None,
            k => Some(self.dev.alloc_zeros::<f32>(grid as usize * k)?),
        };
        let call = KernelCall {
            file: &ADAPTIVE,
            entry: launch.entry,
            grid,
            scalars: &launch.scalars,
        };
        let mut args = SlotArgs {
            slots: &mut self.slots,
            sums: sums.as_mut(),
        };
        launch_in_place(var, grad, &call, &mut args)?;
        let Some(sums) = sums else {
            return Ok(Vec::new());
        };
        Ok(block_totals(&self.dev.clone_dtoh(&sums)?, launch.sums))
    }
}

/// The state buffers in order, then the sums buffer of an accumulate pass.
struct SlotArgs<'s, 'm> {
    slots: &'s mut [Slot],
    sums: Option<&'m mut CudaSlice<f32>>,
}

impl StateArgs for SlotArgs<'_, '_> {
    fn push<'a>(&'a mut self, b: &mut LaunchArgs<'a>) {
        for s in self.slots.iter_mut() {
            match s {
                Slot::F32(v) => {
                    b.arg(v);
                }
                Slot::Bf16(v) => {
                    b.arg(v);
                }
            }
        }
        if let Some(s) = self.sums.as_mut() {
            b.arg(&mut **s);
        }
    }
}

impl ParamState for FusedState {
    fn update(&mut self, var: &Var, grad: &Tensor, lr: f64, t: u64) -> Result<()> {
        match self.kernel.update(lr, t) {
            Some(launch) => self.run(var, grad, &launch).map(|_| ()),
            None => bail!("this optimizer updates in two passes (accumulate, then apply)"),
        }
    }

    fn accumulate(
        &mut self,
        var: &Var,
        grad: &Tensor,
        step: &StepScalars,
        done: u64,
        shares: &mut Shares,
    ) -> Result<()> {
        let Some(launch) = self.kernel.accumulate(step, done) else {
            return Ok(());
        };
        let sums = self.run(var, grad, &launch)?;
        let mine = self.kernel.shares(step, &sums);
        for (s, m) in shares.iter_mut().zip(mine) {
            *s += m;
        }
        Ok(())
    }

    fn apply(&mut self, var: &Var, grad: &Tensor, step: &StepScalars) -> Result<()> {
        match self.kernel.apply(step) {
            Some(launch) => self.run(var, grad, &launch).map(|_| ()),
            None => Ok(()),
        }
    }

    fn eval_weights(&mut self, var: &Var) -> Result<()> {
        let Some(launch) = self.kernel.eval() else {
            return Ok(());
        };
        // The entry point takes a gradient it does not read; the parameter itself cannot stand
        // in (the launch writes it in place).
        let unused = Tensor::zeros(var.shape(), DType::F32, var.device())?;
        self.run(var, &unused, &launch).map(|_| ())
    }

    fn save(&self) -> Result<Vec<(&'static str, Tensor)>> {
        self.buffers
            .iter()
            .zip(&self.slots)
            .map(|(b, s)| Ok((b.name, s.download(&self.dev, &self.shape)?)))
            .collect()
    }

    fn load(&mut self, tensors: Vec<Tensor>) -> Result<()> {
        if tensors.len() != self.buffers.len() {
            bail!(
                "optimizer state: {} tensors, {} wanted",
                tensors.len(),
                self.buffers.len()
            );
        }
        let slots = self
            .buffers
            .iter()
            .zip(&tensors)
            .map(|(b, t)| Slot::upload(&self.dev, b.kind, &t.to_device(&Device::Cpu)?))
            .collect::<Result<Vec<_>>>()?;
        self.slots = slots;
        Ok(())
    }

    fn bytes(&self) -> usize {
        self.slots.iter().map(Slot::bytes).sum()
    }
}
