//! Running an optimizer's host kernel on a parameter in place.
//!
//! Every optimizer here has its update as a kernel over flat f32 slices (`p` mutable, `g` read).
//! For a contiguous f32 parameter on the CPU the kernel runs directly in the Var's storage, shared
//! with the model, so the step makes no parameter-sized copy. A bf16/f16 CPU parameter goes
//! through an f32 copy written back with `Var::set` (so would a parameter on any device without
//! kernels of its own; CUDA parameters take the CUDA kernels of `optim::cuda` instead).

use std::cell::RefCell;

use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Result, Tensor, Var};

/// Runs `f(p, g)` on `var`'s values and `grad`'s (same element count), both as flat f32.
pub fn update_in_place(var: &Var, grad: &Tensor, f: impl FnOnce(&mut [f32], &[f32])) -> Result<()> {
    if grad.elem_count() != var.elem_count() {
        candle_core::bail!(
            "optimizer: gradient {:?} does not match parameter {:?}",
            grad.dims(),
            var.dims()
        );
    }
    let grad = grad.detach().to_dtype(DType::F32)?;
    if var.device().is_cpu() && var.dtype() == DType::F32 && var.is_contiguous() {
        let grad = grad.to_device(var.device())?.contiguous()?;
        return var.inplace_op2(&grad, &InPlace(RefCell::new(Some(f))));
    }
    let mut p = host_f32(var.as_tensor())?;
    let g = host_f32(&grad)?;
    f(&mut p, &g);
    let p = Tensor::from_vec(p, var.shape(), &candle_core::Device::Cpu)?
        .to_dtype(var.dtype())?
        .to_device(var.device())?;
    var.set(&p)
}

/// A tensor's values as a flat host `Vec<f32>`.
pub fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    t.detach().to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

/// A host f32 state buffer as a CPU tensor of `shape`, for saving.
pub fn tensor_f32(v: &[f32], shape: &[usize]) -> Result<Tensor> {
    Tensor::from_slice(v, shape, &candle_core::Device::Cpu)
}

/// A host u8 state buffer as a CPU tensor of `shape`, for saving.
pub fn tensor_u8(v: &[u8], shape: &[usize]) -> Result<Tensor> {
    Tensor::from_slice(v, shape, &candle_core::Device::Cpu)
}

/// A loaded u8 state tensor's values.
pub fn host_u8(t: &Tensor) -> Result<Vec<u8>> {
    if t.dtype() != DType::U8 {
        candle_core::bail!("optimizer state: expected u8, found {:?}", t.dtype());
    }
    t.flatten_all()?.to_vec1()
}

/// The in-place op: `f` runs once, in `cpu_fwd`.
struct InPlace<F>(RefCell<Option<F>>);

impl<F: FnOnce(&mut [f32], &[f32])> InplaceOp2 for InPlace<F> {
    fn name(&self) -> &'static str {
        "optimizer-update"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let (CpuStorage::F32(p), CpuStorage::F32(g)) = (s1, s2) else {
            candle_core::bail!("optimizer-update: expected f32 storages");
        };
        let (Some((p0, p1)), Some((g0, g1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("optimizer-update: expected contiguous tensors");
        };
        let Some(f) = self.0.borrow_mut().take() else {
            candle_core::bail!("optimizer-update: ran twice");
        };
        f(&mut p[p0..p1], &g[g0..g1]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn updates_f32_in_place_and_bf16_through_the_host() {
        let g = Tensor::new(&[1f32, 2., 3.], &Device::Cpu).unwrap();
        let v = Var::new(&[10f32, 20., 30.], &Device::Cpu).unwrap();
        let view = v.as_tensor().clone();
        update_in_place(&v, &g, |p, g| {
            p.iter_mut().zip(g).for_each(|(p, g)| *p -= g)
        })
        .unwrap();
        // The model's view of the same storage sees the update.
        assert_eq!(view.to_vec1::<f32>().unwrap(), vec![9., 18., 27.]);
        let b = Var::from_tensor(&view.to_dtype(DType::BF16).unwrap()).unwrap();
        update_in_place(&b, &g, |p, g| {
            p.iter_mut().zip(g).for_each(|(p, g)| *p += g)
        })
        .unwrap();
        let got = b.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!((b.dtype(), got), (DType::BF16, vec![10., 20., 30.]));
        let short = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        assert!(update_in_place(&v, &short, |_, _| {}).is_err());
    }
}
