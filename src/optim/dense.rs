//! Whole-tensor f32 arithmetic for the optimizers written with tensor ops (the step-size
//! estimators: Prodigy, D-Adaptation, DoWG, AdaCoor): the parameter read as f32, written back in
//! its own dtype, and the scalar reductions their estimates take. This is their CPU path and the
//! reference of their fused CUDA kernels (src/optim/adaptive.cu, which a CUDA parameter takes
//! instead); it runs on any device candle has.

use candle_core::{DType, Result, Tensor, Var};

/// The parameter's values in f32, detached (sharing the parameter's storage when it is f32: keep
/// a [`snapshot`] instead). Detached, because a state computed from the tracked parameter would
/// carry an autograd graph from step to step, keeping every earlier state alive.
pub fn value(var: &Var) -> Result<Tensor> {
    var.as_detached_tensor().to_dtype(DType::F32)
}

/// A copy of the parameter's values in f32 that later writes to the parameter leave alone (a
/// starting point: [`value`] of an f32 parameter shares its storage).
pub fn snapshot(var: &Var) -> Result<Tensor> {
    value(var)?.copy()
}

/// The gradient in f32, detached (as [`value`]).
pub fn grad(g: &Tensor) -> Result<Tensor> {
    g.detach().to_dtype(DType::F32)
}

/// Writes f32 `values` into the parameter, in its dtype.
pub fn write(var: &Var, values: &Tensor) -> Result<()> {
    var.set(&values.to_dtype(var.dtype())?)
}

/// A zeroed f32 state tensor shaped like the parameter.
pub fn zeros(var: &Var) -> Result<Tensor> {
    Tensor::zeros(var.shape(), DType::F32, var.device())
}

/// `Σ a·b`, as torch's `torch.dot(a.flatten(), b.flatten()).item()`.
pub fn dot(a: &Tensor, b: &Tensor) -> Result<f64> {
    Ok(f64::from((a * b)?.sum_all()?.to_scalar::<f32>()?))
}

/// `Σ |a|`.
pub fn abs_sum(a: &Tensor) -> Result<f64> {
    Ok(f64::from(a.abs()?.sum_all()?.to_scalar::<f32>()?))
}

/// `Σ a²`.
pub fn sq_sum(a: &Tensor) -> Result<f64> {
    Ok(f64::from(a.sqr()?.sum_all()?.to_scalar::<f32>()?))
}

/// `a·x + b·y` with f64 coefficients (torch's `x.mul_(a).add_(y, alpha=b)`).
pub fn mix(x: &Tensor, a: f64, y: &Tensor, b: f64) -> Result<Tensor> {
    (x * a)? + (y * b)?
}

/// State tensors read from a file (on the CPU) moved to the device of the state they replace.
pub fn place<const N: usize>(
    tensors: Vec<Tensor>,
    like: &Tensor,
    rule: &str,
) -> Result<[Tensor; N]> {
    let n = tensors.len();
    let placed = tensors
        .into_iter()
        .map(|t| t.to_device(like.device()))
        .collect::<Result<Vec<_>>>()?;
    placed
        .try_into()
        .map_err(|_| candle_core::Error::Msg(format!("{rule} state: {n} tensors, {N} wanted")))
}

/// Bytes of `n` f32 tensors shaped like a parameter of `shape`.
pub fn f32_bytes(shape: &[usize], n: usize) -> usize {
    4 * n * shape.iter().product::<usize>()
}
