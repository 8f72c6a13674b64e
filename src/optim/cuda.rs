//! The optimizers on CUDA: state in device memory, each parameter updated by one launch of a fused
//! kernel from src/optim/kernels.cu (PTX compiled by build.rs, loaded as a candle custom kernel).
//!
//! An 8-bit kernel dequantizes, updates and requantizes in one pass, as bitsandbytes' do; the
//! parameter is updated in place in the Var's own storage (f32, bf16 or f16), so a step makes no
//! parameter-sized copy. The host kernels are the reference: tests/cuda.rs compares the two on
//! every optimizer, and the unit tests run the same kernels under a host emulation.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{DeviceId, WrapErr};
use candle_core::{
    bail, CpuStorage, CudaDevice, CudaStorage, DType, InplaceOp1, InplaceOp2, Layout, Result,
    Tensor, Var,
};

use super::launch;
use super::quant8::{maps, Moment};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/optim_kernels.ptx"));
const MODULE: &str = "sdtrain_optim";

/// One moment of one parameter in device memory: f32 values, or blockwise 8-bit codes and absmax
/// (the layout of [`Moment`]).
pub struct CudaMoment {
    dev: CudaDevice,
    data: Data,
}

enum Data {
    F32(CudaSlice<f32>),
    Q8 {
        codes: CudaSlice<u8>,
        absmax: CudaSlice<f32>,
        maps: Arc<CudaSlice<f32>>,
    },
}

impl std::fmt::Debug for CudaMoment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.is_q8() { "q8" } else { "f32" };
        write!(f, "CudaMoment({kind}, {} bytes)", self.bytes())
    }
}

/// The two dynamic maps (signed, then unsigned) on `dev`, uploaded once per device.
fn device_maps(dev: &CudaDevice) -> Result<Arc<CudaSlice<f32>>> {
    type Cache = Mutex<Vec<(DeviceId, Arc<CudaSlice<f32>>)>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some((_, m)) = cache.iter().find(|(id, _)| *id == dev.id()) {
        return Ok(m.clone());
    }
    let (signed, unsigned) = maps();
    let both: Vec<f32> = signed.code.iter().chain(&unsigned.code).copied().collect();
    let m = Arc::new(dev.clone_htod(both.as_slice())?);
    cache.push((dev.id(), m.clone()));
    Ok(m)
}

impl CudaMoment {
    /// A copy of `m` on `dev`.
    pub fn upload(m: &Moment, dev: &CudaDevice) -> Result<Self> {
        let data = match m {
            Moment::F32(v) => Data::F32(dev.clone_htod(v.as_slice())?),
            Moment::Q8 { codes, absmax } => Data::Q8 {
                codes: dev.clone_htod(codes.as_slice())?,
                absmax: dev.clone_htod(absmax.as_slice())?,
                maps: device_maps(dev)?,
            },
        };
        Ok(Self {
            dev: dev.clone(),
            data,
        })
    }

    /// A host copy.
    pub fn download(&self) -> Result<Moment> {
        Ok(match &self.data {
            Data::F32(v) => Moment::F32(self.dev.clone_dtoh(v)?),
            Data::Q8 { codes, absmax, .. } => Moment::Q8 {
                codes: self.dev.clone_dtoh(codes)?,
                absmax: self.dev.clone_dtoh(absmax)?,
            },
        })
    }

    /// An empty host moment of this kind, for [`Moment::load`] to fill.
    pub fn host_kind(&self) -> Moment {
        match self.data {
            Data::F32(_) => Moment::F32(Vec::new()),
            Data::Q8 { .. } => Moment::Q8 {
                codes: Vec::new(),
                absmax: Vec::new(),
            },
        }
    }

    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    pub fn is_q8(&self) -> bool {
        matches!(self.data, Data::Q8 { .. })
    }

    /// An 8-bit moment's codes and absmax, and the two dynamic maps (signed, then unsigned).
    pub(super) fn q8_parts(&self) -> Option<(&CudaSlice<u8>, &CudaSlice<f32>, &CudaSlice<f32>)> {
        match &self.data {
            Data::Q8 {
                codes,
                absmax,
                maps,
            } => Some((codes, absmax, &**maps)),
            Data::F32(_) => None,
        }
    }

    /// [`CudaMoment::q8_parts`], the codes and absmax to be written.
    pub(super) fn q8_parts_mut(
        &mut self,
    ) -> Option<(&mut CudaSlice<u8>, &mut CudaSlice<f32>, &CudaSlice<f32>)> {
        match &mut self.data {
            Data::Q8 {
                codes,
                absmax,
                maps,
            } => Some((codes, absmax, &**maps)),
            Data::F32(_) => None,
        }
    }

    pub fn bytes(&self) -> usize {
        match &self.data {
            Data::F32(v) => 4 * v.len(),
            Data::Q8 { codes, absmax, .. } => codes.len() + 4 * absmax.len(),
        }
    }
}

/// A compiled kernel file: its PTX (from build.rs) and the module name candle caches it under.
pub struct KernelFile {
    pub ptx: &'static str,
    pub module: &'static str,
}

/// src/optim/kernels.cu.
pub const OPTIM_KERNELS: KernelFile = KernelFile {
    ptx: PTX,
    module: MODULE,
};

/// The buffers a launch passes after the parameter and its gradient, in the entry point's order.
pub trait StateArgs {
    fn push<'a>(&'a mut self, b: &mut LaunchArgs<'a>);
}

/// A launch's shape and arguments other than the parameter, its gradient and the state.
pub struct KernelCall<'a> {
    pub file: &'a KernelFile,
    /// The entry point without its dtype suffix.
    pub entry: &'a str,
    pub grid: u32,
    pub scalars: &'a [f32],
}

/// Updates `var` in place from `grad` with entry point `kernel` (without its `_q8`/`_f32` and
/// dtype suffixes) over `moments` (all of one kind) and the f32 `scalars`, in kernels.cu's
/// argument order.
pub fn update(
    var: &Var,
    grad: &Tensor,
    kernel: &str,
    moments: &mut [&mut CudaMoment],
    scalars: &[f32],
) -> Result<()> {
    let q8 = moments.first().is_some_and(|m| m.is_q8());
    if moments.iter().any(|m| m.is_q8() != q8) {
        bail!("{kernel}: moments of different kinds");
    }
    let entry = launch::entry(kernel, q8);
    let call = KernelCall {
        file: &OPTIM_KERNELS,
        entry: &entry,
        grid: launch::grid(var.elem_count(), q8),
        scalars,
    };
    let maps = moments.iter().find_map(|m| match &m.data {
        Data::Q8 { maps, .. } => Some(maps.clone()),
        Data::F32(_) => None,
    });
    launch_in_place(var, grad, &call, &mut MomentArgs { moments, maps })
}

/// Launches `call` on `var`'s own storage (f32, bf16 or f16; the entry point's dtype suffix is
/// the parameter's), with `grad` as f32 and `state` after it, `THREADS` threads per block.
pub fn launch_in_place(
    var: &Var,
    grad: &Tensor,
    call: &KernelCall,
    state: &mut dyn StateArgs,
) -> Result<()> {
    let grad = grad.detach().to_dtype(DType::F32)?.contiguous()?;
    let op = Launch {
        call,
        state: RefCell::new(state),
    };
    var.inplace_op2(&grad, &op)
}

/// Launches `call` on `target`'s own storage (f32, bf16 or f16; the entry point's dtype suffix is
/// the target's) with `state` after it and no gradient: entry points `(target, state…, scalars…,
/// n)`, `THREADS` threads per block.
pub fn launch_on(target: &Tensor, call: &KernelCall, state: &mut dyn StateArgs) -> Result<()> {
    let op = Launch {
        call,
        state: RefCell::new(state),
    };
    target.inplace_op1(&op)
}

/// The moments of kernels.cu's entry points, then the dynamic maps for 8-bit ones.
struct MomentArgs<'m, 'n> {
    moments: &'m mut [&'n mut CudaMoment],
    maps: Option<Arc<CudaSlice<f32>>>,
}

impl StateArgs for MomentArgs<'_, '_> {
    fn push<'a>(&'a mut self, b: &mut LaunchArgs<'a>) {
        for m in self.moments.iter_mut() {
            match &mut m.data {
                Data::F32(v) => {
                    b.arg(v);
                }
                Data::Q8 { codes, absmax, .. } => {
                    b.arg(codes);
                    b.arg(absmax);
                }
            }
        }
        if let Some(m) = &self.maps {
            b.arg(m.as_ref());
        }
    }
}

/// The in-place op that launches one kernel on the parameter's storage.
struct Launch<'a, 's> {
    call: &'a KernelCall<'a>,
    state: RefCell<&'a mut (dyn StateArgs + 's)>,
}

impl InplaceOp1 for Launch<'_, '_> {
    fn name(&self) -> &'static str {
        "optimizer-cuda-kernel"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        bail!("{}: the CUDA kernel got a CPU tensor", self.call.entry)
    }

    fn cuda_fwd(&self, p: &mut CudaStorage, pl: &Layout) -> Result<()> {
        self.run(p, pl, None)
    }
}

impl InplaceOp2 for Launch<'_, '_> {
    fn name(&self) -> &'static str {
        "optimizer-cuda-kernel"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        bail!("{}: the CUDA kernel got a CPU tensor", self.call.entry)
    }

    fn cuda_fwd(
        &self,
        p: &mut CudaStorage,
        pl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        self.run(p, pl, Some((g, gl)))
    }
}

impl Launch<'_, '_> {
    /// The launch on `p` (in place), with the f32 gradient `g` after it where there is one.
    fn run(
        &self,
        p: &mut CudaStorage,
        pl: &Layout,
        g: Option<(&CudaStorage, &Layout)>,
    ) -> Result<()> {
        let entry = self.call.entry;
        let Some((p0, p1)) = pl.contiguous_offsets() else {
            bail!("{entry}: the parameter is not contiguous");
        };
        let n = p1 - p0;
        let g = match g {
            Some((g, gl)) => {
                let Some((g0, g1)) = gl.contiguous_offsets() else {
                    bail!("{entry}: the gradient is not contiguous");
                };
                if g1 - g0 != n {
                    bail!("{entry}: gradient of {} values for {n}", g1 - g0);
                }
                Some(g.as_cuda_slice::<f32>()?.slice(g0..g1))
            }
            None => None,
        };
        let mut state = self.state.borrow_mut();
        if n == 0 {
            return Ok(());
        }
        let dev = p.device.clone();
        let suffix = match p.dtype() {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            other => bail!("{entry}: no kernel for {other:?} parameters"),
        };
        let file = self.call.file;
        let func = dev
            .get_or_load_custom_func(&format!("{entry}_{suffix}"), file.module, file.ptx)?
            .into_cuda_function();
        let stream = dev.cuda_stream();
        let cfg = LaunchConfig {
            grid_dim: (self.call.grid, 1, 1),
            block_dim: (launch::THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = Args {
            stream: &stream,
            func: &func,
            g: g.as_ref(),
            n: n as u64,
            scalars: self.call.scalars,
            cfg,
        };
        match p.dtype() {
            DType::F32 => args.launch(p.as_cuda_slice_mut::<f32>()?, p0..p1, &mut **state),
            DType::BF16 => args.launch(p.as_cuda_slice_mut::<half::bf16>()?, p0..p1, &mut **state),
            _ => args.launch(p.as_cuda_slice_mut::<half::f16>()?, p0..p1, &mut **state),
        }
    }
}

/// Everything but the parameter and the state, for [`Args::launch`].
struct Args<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    g: Option<&'a CudaView<'a, f32>>,
    n: u64,
    scalars: &'a [f32],
    cfg: LaunchConfig,
}

impl Args<'_> {
    fn launch<P>(
        &self,
        p: &mut CudaSlice<P>,
        range: std::ops::Range<usize>,
        state: &mut dyn StateArgs,
    ) -> Result<()> {
        let mut p = p.slice_mut(range);
        let mut b = self.stream.launch_builder(self.func);
        b.arg(&mut p);
        if let Some(g) = self.g {
            b.arg(g);
        }
        state.push(&mut b);
        for s in self.scalars {
            b.arg(s);
        }
        b.arg(&self.n);
        // SAFETY: the arguments match the entry point's signature in its .cu file (launch.rs and
        // adaptive_args.rs give the order), every state buffer holds `n` values (or a block count
        // of absmax or sums) on this device, and the grid-stride loops stop at `n`.
        unsafe { b.launch(self.cfg) }.w()?;
        Ok(())
    }
}
