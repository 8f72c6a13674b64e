//! The flash-attention op on CUDA: a `CustomOp3` on (q, k, v) whose forward launches
//! `flash_fwd_*` of kernels/flash_attention.cu (PTX compiled by build.rs, loaded as a candle custom
//! kernel) and keeps the row log-sum-exp L, and whose backward launches `flash_dot_*`
//! (Dr = rowsum(dO ∘ O)) then `flash_bwd_*` (dQ, dK, dV with P recomputed from L; FlashAttention-2,
//! arXiv 2307.08691, Algorithm 2).
//!
//! Memory beyond the inputs and output: L and Dr (one f32 per query row), and in backward an f32
//! dQ (the kernel adds into it by atomics) besides dK and dV in the input dtype.

use std::sync::Mutex;

use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaView, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{
    bail, CpuStorage, CudaDevice, CudaStorage, CustomOp3, DType, Layout, Result, Shape, Storage,
    Tensor,
};

use super::{Geometry, THREADS};
use crate::nn::merged_heads::HeadsKernel;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels_flash_attention.ptx"));
const MODULE: &str = "sdtrain_flash_attention";
/// The tensor-core kernels (PTX for compute_80), loaded only on cards that have them.
const TC_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels_flash_attention_tc.ptx"));
const TC_MODULE: &str = "sdtrain_flash_attention_tc";

/// The op: its geometry, and L `[BH, Lq]` (f32) once the forward has run.
pub(crate) struct FlashAttention {
    pub geo: Geometry,
    pub scale: f32,
    pub causal: bool,
    pub lse: Mutex<Option<Tensor>>,
}

fn launch_cfg(grid: [u32; 3]) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid[0], grid[1], grid[2]),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The `n` contiguous elements of `s` under layout `l`.
fn view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    n: usize,
    what: &str,
) -> Result<CudaView<'a, T>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("flash attention: {what} is not contiguous")
    };
    if b - a != n {
        bail!(
            "flash attention: {what} has {} elements, expected {n}",
            b - a
        )
    }
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

fn cuda_storage(s: &Storage) -> Result<&CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => bail!("flash attention: a tensor is not on a CUDA device"),
    }
}

/// Entry point `name`, from the tensor-core module when it is one of its (`flash_*_tc_*`).
fn func(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    let (module, ptx) = if name.contains("_tc_") {
        (TC_MODULE, TC_PTX)
    } else {
        (MODULE, PTX)
    };
    Ok(dev
        .get_or_load_custom_func(name, module, ptx)?
        .into_cuda_function())
}

/// A tensor of `shape` over a fresh device buffer.
fn wrap<T: CudaDType>(
    s: candle_core::cuda_backend::cudarc::driver::CudaSlice<T>,
    dev: &CudaDevice,
    shape: &Shape,
) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone()));
    Tensor::from_storage(storage, shape.clone(), BackpropOp::none(), false)
}

impl FlashAttention {
    /// The forward for element type `T` (`dtype`): the output, with L kept in `self.lse`.
    #[allow(clippy::too_many_arguments)]
    fn forward<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
        &self,
        dtype: DType,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let g = &self.geo;
        let dev = q.device.clone();
        let qv = view::<T>(q, ql, g.q_len(), "q")?;
        let kv = view::<T>(k, kl, g.k_len(), "k")?;
        let vv = view::<T>(v, vl, g.k_len(), "v")?;
        let mut o = dev.alloc_zeros::<T>(g.q_len())?;
        let mut lse = dev.alloc_zeros::<f32>(g.bh * g.lq)?;
        let f = func(&dev, &g.entry("flash_fwd", dtype)?)?;
        let stream = dev.cuda_stream();
        let (lq, lk, d, causal) = (g.lq as i32, g.lk as i32, g.d as i32, self.causal as i32);
        let layout = g.layout_args();
        let mut b = stream.launch_builder(&f);
        b.arg(&qv).arg(&kv).arg(&vv).arg(&mut o).arg(&mut lse);
        b.arg(&self.scale).arg(&lq).arg(&lk).arg(&d).arg(&causal);
        if g.tensor_cores() {
            b.arg(&layout[0]).arg(&layout[1]).arg(&layout[2]);
        }
        // SAFETY: the arguments follow flash_fwd's signature (the tensor-core kernels' adds the
        // layout); q holds BH·Lq·D elements, k and v BH·Lk·D, o as q, lse BH·Lq (checked above),
        // in the layout the geometry names, and the grid is `fwd_grid` of the same geometry,
        // which the kernel's indexing assumes.
        unsafe { b.launch(launch_cfg(g.fwd_grid())) }.w()?;
        let lse = wrap(lse, &dev, &Shape::from((g.bh, g.lq)));
        *self
            .lse
            .lock()
            .map_err(|_| candle_core::Error::Msg("flash attention: poisoned lock".into()))? =
            Some(lse);
        Ok((CudaStorage::wrap_cuda_slice(o, dev), ql.shape().clone()))
    }

    /// dQ (f32), dK and dV for element type `T` (`dtype`), upstream gradient `g` of output `o`.
    #[allow(clippy::too_many_arguments)]
    fn backward_typed<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
        &self,
        dtype: DType,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        g: &Tensor,
        lse: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let geo = &self.geo;
        let (qs, ql) = q.storage_and_layout();
        let (ks, kl) = k.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let (os, ol) = o.storage_and_layout();
        let (gs, gl) = g.storage_and_layout();
        let (ls, ll) = lse.storage_and_layout();
        let qs = cuda_storage(&qs)?;
        let dev = qs.device.clone();
        let qv = view::<T>(qs, ql, geo.q_len(), "q")?;
        let kv = view::<T>(cuda_storage(&ks)?, kl, geo.k_len(), "k")?;
        let vv = view::<T>(cuda_storage(&vs)?, vl, geo.k_len(), "v")?;
        let ov = view::<T>(cuda_storage(&os)?, ol, geo.q_len(), "the output")?;
        let gv = view::<T>(cuda_storage(&gs)?, gl, geo.q_len(), "the output gradient")?;
        let lv = view::<f32>(cuda_storage(&ls)?, ll, geo.bh * geo.lq, "L")?;
        let stream = dev.cuda_stream();
        let (rows, d) = ((geo.bh * geo.lq) as i32, geo.d as i32);
        let (bhs, lq) = (geo.bh as i32, geo.lq as i32);
        let layout = geo.layout_args();
        let mut dr = dev.alloc_zeros::<f32>(geo.bh * geo.lq)?;
        let f = func(&dev, &geo.entry("flash_dot", dtype)?)?;
        let mut b = stream.launch_builder(&f);
        b.arg(&ov).arg(&gv).arg(&mut dr);
        if geo.tensor_cores() {
            b.arg(&bhs).arg(&lq).arg(&d).arg(&layout[0]).arg(&layout[1]);
        } else {
            b.arg(&rows).arg(&d);
        }
        // SAFETY: flash_dot's signature; o and g hold `rows` rows of D, dr `rows` values, and the
        // grid has a warp per row (`dot_grid`).
        unsafe { b.launch(launch_cfg(geo.dot_grid())) }.w()?;
        let mut dq = dev.alloc_zeros::<f32>(geo.q_len())?;
        let mut dk = dev.alloc_zeros::<T>(geo.k_len())?;
        let mut dv = dev.alloc_zeros::<T>(geo.k_len())?;
        let (lk, causal) = (geo.lk as i32, self.causal as i32);
        let f = func(&dev, &geo.entry("flash_bwd", dtype)?)?;
        let mut b = stream.launch_builder(&f);
        b.arg(&qv).arg(&kv).arg(&vv).arg(&gv).arg(&lv).arg(&dr);
        b.arg(&mut dq).arg(&mut dk).arg(&mut dv);
        b.arg(&self.scale).arg(&lq).arg(&lk).arg(&d).arg(&causal);
        if geo.tensor_cores() {
            b.arg(&layout[0]).arg(&layout[1]).arg(&layout[2]);
        }
        // SAFETY: flash_bwd's signature; q, g and dq hold BH·Lq·D elements, k, v, dk and dv
        // BH·Lk·D, lse and dr BH·Lq; dq starts at zero (the kernel adds into it), and the grid is
        // `bwd_grid` of the same geometry.
        unsafe { b.launch(launch_cfg(geo.bwd_grid())) }.w()?;
        Ok((
            wrap(dq, &dev, q.shape()),
            wrap(dk, &dev, k.shape()),
            wrap(dv, &dev, v.shape()),
        ))
    }
}

impl CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "flash-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("flash attention runs on CUDA only (the CPU uses chunked attention)")
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        match q.dtype() {
            DType::F32 => self.forward::<f32>(DType::F32, q, ql, k, kl, v, vl),
            DType::BF16 => self.forward::<half::bf16>(DType::BF16, q, ql, k, kl, v, vl),
            DType::F16 => self.forward::<half::f16>(DType::F16, q, ql, k, kl, v, vl),
            other => bail!("flash attention: no kernel for {other:?}"),
        }
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let want = [q.track_op(), k.track_op(), v.track_op()];
        HeadsKernel::backward(self, q, k, v, res, grad, want)
    }
}

impl HeadsKernel for FlashAttention {
    fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        grad: &Tensor,
        want: [bool; 3],
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = self
            .lse
            .lock()
            .map_err(|_| candle_core::Error::Msg("flash attention: poisoned lock".into()))?
            .clone();
        let Some(lse) = lse else {
            bail!("flash attention: backward before forward")
        };
        let dtype = q.dtype();
        let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
        let o = o.detach().contiguous()?;
        let g = grad.detach().to_dtype(dtype)?.contiguous()?;
        let (dq, dk, dv) = match dtype {
            DType::F32 => self.backward_typed::<f32>(dtype, &qd, &kd, &vd, &o, &g, &lse)?,
            DType::BF16 => self.backward_typed::<half::bf16>(dtype, &qd, &kd, &vd, &o, &g, &lse)?,
            DType::F16 => self.backward_typed::<half::f16>(dtype, &qd, &kd, &vd, &o, &g, &lse)?,
            other => bail!("flash attention: no kernel for {other:?}"),
        };
        // candle stores whatever a backward returns: only wanted operands get a gradient.
        Ok((
            want[0].then(|| dq.to_dtype(dtype)).transpose()?,
            want[1].then_some(dk),
            want[2].then_some(dv),
        ))
    }
}
