//! Helpers for the unit tests of the numeric ops in this module.

use candle_core::{DType, Device, Tensor};

/// A deterministic fill in [−1, 1) on the CPU, times `amplitude`.
pub(crate) fn fill(shape: &[usize], seed: u64, amplitude: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| amplitude * ((((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0) - 1.0))
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Largest absolute difference, in f32.
pub(crate) fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    (f(a) - f(b))
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}
