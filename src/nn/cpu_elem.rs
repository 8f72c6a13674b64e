//! What the CPU kernels that read a tensor's storage at its own dtype share (`cpu_group_norm`,
//! `geglu`): the element types (f32, bf16, f16, each computed in f32), a borrow of a contiguous
//! CPU tensor's elements, and a dispatch on the dtype. Reading bf16 in place spares the f32 copy
//! of every operand that `to_dtype(F32)` would make.

use candle_core::{bail, DType, Result, Storage, Tensor, WithDType};
use half::{bf16, f16};

/// Runs `$body` on `$t`'s elements (contiguous, on the CPU) as `$xs: &[T]` at `$t`'s own dtype;
/// `$what` names the op in the error for another dtype.
macro_rules! dispatch {
    ($what:expr, $t:expr, |$xs:ident| $body:expr) => {{
        let t: &candle_core::Tensor = $t;
        match t.dtype() {
            candle_core::DType::F32 => $crate::nn::cpu_elem::with_slice::<f32, _>(t, |$xs| $body),
            candle_core::DType::BF16 => {
                $crate::nn::cpu_elem::with_slice::<half::bf16, _>(t, |$xs| $body)
            }
            candle_core::DType::F16 => {
                $crate::nn::cpu_elem::with_slice::<half::f16, _>(t, |$xs| $body)
            }
            other => candle_core::bail!("{}: no CPU kernel for {other:?}", $what),
        }
    }};
}
pub(crate) use dispatch;

/// An element type the kernels read and write.
pub(crate) trait Elem: WithDType + Copy + Default + Send + Sync {
    fn f(self) -> f32;
    fn of(v: f32) -> Self;
}

impl Elem for f32 {
    fn f(self) -> f32 {
        self
    }
    fn of(v: f32) -> Self {
        v
    }
}

impl Elem for bf16 {
    fn f(self) -> f32 {
        self.to_f32()
    }
    fn of(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl Elem for f16 {
    fn f(self) -> f32 {
        self.to_f32()
    }
    fn of(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// Whether the kernels take `x`: a CPU tensor of a dtype they read.
pub(crate) fn supported(x: &Tensor) -> bool {
    x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
}

/// `f` on `t`'s elements as `&[T]` (a contiguous CPU tensor of dtype `T`).
pub(crate) fn with_slice<T: Elem, R>(t: &Tensor, f: impl FnOnce(&[T]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Some((a, b)) = layout.contiguous_offsets() else {
        bail!("CPU kernel: the input {:?} is not contiguous", t.dims());
    };
    match &*storage {
        Storage::Cpu(cpu) => Ok(f(&cpu.as_slice::<T>()?[a..b])),
        _ => bail!("CPU kernel: the input is not on the CPU"),
    }
}
