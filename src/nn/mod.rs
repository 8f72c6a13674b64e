//! Trainable building blocks shared by every model: our own Linear, Conv2d, norms, embedding
//! and attention. Every op here has a backward (see ../shared/NOTES.md: candle-nn's fused
//! softmax/layer_norm drop gradients, so they are only ever called on detached operands inside
//! our own fused ops, whose backward is analytic).
//!
//! Layers keep their diffusers module path (`path`) so later work (adapters, checkpointing) can
//! reach them by name through [`VisitLayers`].

mod activation;
mod attention;
mod base_weight;
mod checkpoint;
mod chunked_attention;
mod conv;
#[cfg(feature = "cuda")]
mod conv_cuda;
mod conv_grad;
#[cfg(test)]
mod conv_kernels;
mod conv_windows;
mod cpu_conv;
mod cpu_elem;
mod cpu_flash_attention;
mod cpu_gemm;
mod cpu_group_norm;
mod embedding;
#[cfg(any(test, feature = "cuda"))]
mod flash_attention;
pub mod fp8;
#[cfg(feature = "cuda")]
mod fp8_cuda;
mod frozen;
mod fused_op;
mod geglu;
pub mod grad_sink;
mod group_norm;
mod handover;
mod im2col;
mod layer_norm;
mod linear;
mod low_rank;
mod low_rank_input;
mod merged_heads;
mod norm;
mod norm_conv;
#[cfg(feature = "cuda")]
mod norm_cuda;
#[cfg(test)]
mod norm_kernels;
#[cfg(any(test, feature = "cuda"))]
mod norm_launch;
mod normed;
mod output_slot;
mod rebuilt;
mod softmax;
mod softmax_row;
#[cfg(test)]
pub(crate) mod test_util;
mod upsample;

pub use activation::{gelu_erf, quick_gelu, silu};
pub use attention::{attention, attention_reference, causal_attention, causal_mask, CausalMask};
pub use base_weight::BaseWeight;
pub use checkpoint::{replayable, Checkpointing, Segment};
pub use chunked_attention::chunked_attention;
#[cfg(feature = "cuda")]
pub use flash_attention::{
    flash_attention, flash_attention_simt, tensor_cores_enabled, MAX_HEAD_DIM,
};

/// A trainable addition to a frozen layer's output, `y = base(x) + delta(x)`: LoRA on a Linear or
/// a 1×1 conv, LoCon on a 3×3 conv, and LyCORIS's LoHa, LoKr and DoRA. Implemented in `crate::adapter`.
pub trait LayerAdapter: std::fmt::Debug + Send + Sync {
    /// The adapter's contribution for the layer input `x` (same shape as the layer output).
    fn delta(&self, x: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor>;

    /// [`LayerAdapter::delta`] for a layer whose weight is `base`: what the layers call. An
    /// adapter that depends on the frozen weight (DoRA normalises `W + ΔW`) overrides it.
    fn delta_on(
        &self,
        x: &candle_core::Tensor,
        _base: &BaseWeight,
    ) -> candle_core::Result<candle_core::Tensor> {
        self.delta(x)
    }

    /// The whole adapted output `base(x) + delta(x)` (plus `residual`, when there is one) as one
    /// op on a frozen base, which keeps less for the backward than the sum of the parts (see
    /// [`low_rank`]); `None` where the adapter has no such form, and the layer then adds
    /// [`LayerAdapter::delta`] and the residual to its own output.
    fn forward_frozen(
        &self,
        _x: &candle_core::Tensor,
        _base: FrozenBase<'_>,
        _residual: Option<&candle_core::Tensor>,
    ) -> Option<candle_core::Result<candle_core::Tensor>> {
        None
    }

    /// Whether [`LayerAdapter::forward_frozen_on`] takes derived inputs (so that a layer computes
    /// a shared input's value only for an adapter that will use it).
    fn derives_inputs(&self) -> bool {
        false
    }

    /// Whether the adapter takes part in the forward; a layer whose adapter is off computes its
    /// base alone (a prior prediction of the model without its adapters).
    fn active(&self) -> bool {
        true
    }

    /// [`LayerAdapter::forward_frozen`] on a linear whose input is `input(a)` (GEGLU, a frozen
    /// LayerNorm), given `a` (and the input's `value` where the caller computed it for several
    /// layers): one op that computes the input again in its backward instead of keeping it (see
    /// [`low_rank_input`]); `None` where the adapter has no such form.
    fn forward_frozen_on(
        &self,
        _a: &candle_core::Tensor,
        _input: &DerivedInput,
        _value: Option<&candle_core::Tensor>,
        _base: FrozenBase<'_>,
        _residual: Option<&candle_core::Tensor>,
    ) -> Option<candle_core::Result<candle_core::Tensor>> {
        None
    }
}

/// A frozen layer an adapter is attached to: its weight as stored, its bias (a plain tensor) and
/// its geometry.
#[derive(Clone)]
pub enum FrozenBase<'a> {
    /// `x·Wᵀ + b`, `W` `[out, in]`.
    Linear {
        w: BaseWeight,
        b: Option<&'a candle_core::Tensor>,
    },
    /// `conv2d(x, W) + b`, `W` `[out, in, k, k]`.
    Conv {
        w: BaseWeight,
        b: Option<&'a candle_core::Tensor>,
        padding: usize,
        stride: usize,
    },
}
pub use conv::{Conv2d, Conv2dConfig};
pub use conv_grad::{
    conv2d as conv2d_trainable, conv2d_input_grad, conv2d_input_grad_gemm,
    conv2d_input_grad_reference, conv2d_parity_safe, conv2d_weight_grad,
    conv2d_weight_grad_reference,
};
pub use cpu_conv::{
    conv2d_detached, conv2d_im2col, conv2d_input_grad_col2im, conv2d_weight_grad_im2col,
};
pub use embedding::Embedding;
pub use frozen::{
    broadcast_add_const, broadcast_mul_const, frozen_broadcast_add, frozen_broadcast_mul,
    frozen_conv2d, frozen_conv2d_bias, frozen_conv2d_reference, frozen_linear,
    frozen_linear_reference, frozen_matmul, frozen_matmul_reference, set_frozen_ops_enabled,
};
pub use fused_op::set_fused_ops_enabled;
pub use geglu::{geglu, geglu_layer, geglu_reference};

pub use group_norm::{
    group_norm, group_norm_reference, group_norm_silu, group_norm_silu_reference,
};
pub use handover::{
    add_maybe_const, cat_with_const, conv2d_const_input, frozen_conv2d_stored,
    frozen_linear_stored, matmul_const_lhs, sub_const,
};
pub use layer_norm::{layer_norm, layer_norm_reference};
pub use linear::Linear;
pub use low_rank::{frozen_conv2d_low_rank, frozen_linear_low_rank, DropoutMask, LowRank};
pub use low_rank_input::{frozen_linear_low_rank_on, DerivedInput};
pub use norm::{GroupNorm, LayerNorm};
pub use norm_conv::{group_norm_silu_conv, group_norm_silu_conv_applies, Extra};
pub use normed::Normed;
pub use rebuilt::{frozen_conv2d_rebuilt, frozen_linear_rebuilt, Rebuild, WeightUpdate};
pub use softmax::{softmax_last_dim, softmax_last_dim_reference};
pub use upsample::upsample_nearest;

/// A mutable view of one leaf layer that adapters may wrap.
pub enum LayerMut<'a> {
    Linear(&'a mut Linear),
    Conv2d(&'a mut Conv2d),
}

/// Walks every Linear and Conv2d leaf of a module, in construction order.
pub trait VisitLayers {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>));
}

impl VisitLayers for Linear {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        f(LayerMut::Linear(self))
    }
}

impl VisitLayers for Conv2d {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        f(LayerMut::Conv2d(self))
    }
}

impl<T: VisitLayers> VisitLayers for Vec<T> {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        for m in self.iter_mut() {
            m.visit_layers(f)
        }
    }
}

impl<T: VisitLayers> VisitLayers for Option<T> {
    fn visit_layers(&mut self, f: &mut dyn FnMut(LayerMut<'_>)) {
        if let Some(m) = self {
            m.visit_layers(f)
        }
    }
}

/// Casts a parameter to the compute dtype of the activation it meets. A no-op when they agree;
/// otherwise the cast's backward brings the gradient back to the parameter's (master) dtype.
pub(crate) fn cast_like(
    param: &candle_core::Tensor,
    x: &candle_core::Tensor,
) -> candle_core::Result<candle_core::Tensor> {
    if param.dtype() == candle_core::DType::U8 {
        // An fp8 base weight's codes: only `BaseWeight::get` knows their scale.
        candle_core::bail!("an fp8 base weight reached an op that does not dequantise it");
    }
    if param.dtype() == x.dtype() {
        Ok(param.clone())
    } else {
        param.to_dtype(x.dtype())
    }
}

/// Whether `x` is bf16 on the CPU, where candle has no bf16 gemm/conv kernels. Layers then
/// compute in f32 and round once at the end: the f32 accumulation cuBLAS/cuDNN use for bf16.
pub(crate) fn cpu_bf16(x: &candle_core::Tensor) -> bool {
    x.dtype() == candle_core::DType::BF16 && x.device().is_cpu()
}

/// Calls `f` on a contiguous f32 CPU tensor's elements, borrowed from its storage (the CPU
/// kernels' input; an error for any other tensor).
pub(crate) fn with_cpu_f32<R>(
    t: &candle_core::Tensor,
    f: impl FnOnce(&[f32]) -> R,
) -> candle_core::Result<R> {
    use candle_core::{CpuStorage, Storage};
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((start, end))) => Ok(f(&v[start..end])),
        _ => candle_core::bail!("CPU kernel: expected a contiguous f32 CPU tensor"),
    }
}

/// `a.matmul(b)`, computed in f32 and rounded back for bf16 on the CPU (see [`cpu_bf16`]).
pub(crate) fn matmul(
    a: &candle_core::Tensor,
    b: &candle_core::Tensor,
) -> candle_core::Result<candle_core::Tensor> {
    use candle_core::DType;
    if cpu_bf16(a) {
        a.to_dtype(DType::F32)?
            .matmul(&b.to_dtype(DType::F32)?)?
            .to_dtype(DType::BF16)
    } else {
        a.matmul(b)
    }
}
