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

/// Standard normal draws on the CPU from a generator seeded with `seed`, so a failure reproduces
/// (candle's CPU `Tensor::randn` cannot be seeded).
pub(crate) fn randn(shape: &[usize], seed: u64) -> Tensor {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| rng.sample(rand_distr::StandardNormal))
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

/// Largest absolute difference relative to the largest magnitude of `want`.
pub(crate) fn rel_err(got: &Tensor, want: &Tensor) -> f32 {
    let scale = want
        .to_dtype(DType::F32)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    max_abs(got, want) / scale.max(1e-12)
}

/// The output of `f` on `inputs` and the gradient of every input for `L = Σ f(inputs)·r`, with
/// `r` a fixed fill (a plain sum would hide terms whose gradient sums to zero, such as a norm's
/// mean). Inputs with `track[i]` false are passed as constants; the test fails if one of them
/// gets a gradient-store entry, and their gradient is reported as `None`.
pub(crate) fn output_and_grads(
    inputs: &[Tensor],
    track: &[bool],
    f: &dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>,
) -> (Tensor, Vec<Option<Tensor>>) {
    let args: Vec<Tensor> = inputs
        .iter()
        .zip(track)
        .map(|(t, &tr)| {
            if tr {
                candle_core::Var::from_tensor(t)
                    .unwrap()
                    .as_tensor()
                    .clone()
            } else {
                t.clone()
            }
        })
        .collect();
    let y = f(&args).unwrap();
    let r = fill(y.dims(), 99, 1.0);
    let loss = (y.to_dtype(DType::F32).unwrap() * r).unwrap();
    let grads = loss.sum_all().unwrap().backward().unwrap();
    let gs = args
        .iter()
        .zip(track)
        .map(|(a, &tr)| {
            let g = grads.get(a).cloned();
            assert_eq!(g.is_some(), tr, "gradient presence differs from tracking");
            g
        })
        .collect();
    (y, gs)
}

/// Runs `fused` and `reference` through [`output_and_grads`] and asserts the outputs and every
/// gradient agree to `tol` relative ([`rel_err`]); `what` names the case in failures.
pub(crate) fn assert_parity(
    what: &str,
    inputs: &[Tensor],
    track: &[bool],
    tol: f32,
    fused: &dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    reference: &dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>,
) {
    let (y, g) = output_and_grads(inputs, track, fused);
    let (y_ref, g_ref) = output_and_grads(inputs, track, reference);
    assert_eq!(y.dtype(), y_ref.dtype(), "{what}: output dtype");
    let e = rel_err(&y, &y_ref);
    assert!(e <= tol, "{what}: forward differs by {e:.2e} (relative)");
    for (i, (a, b)) in g.iter().zip(&g_ref).enumerate() {
        if let (Some(a), Some(b)) = (a, b) {
            assert_eq!(a.dtype(), b.dtype(), "{what}: grad {i} dtype");
            assert_eq!(
                a.dtype(),
                inputs[i].dtype(),
                "{what}: grad {i} dtype vs input"
            );
            let e = rel_err(a, b);
            assert!(e <= tol, "{what}: grad {i} differs by {e:.2e} (relative)");
        }
    }
}

/// A fixed inverted-dropout mask (p = 0.5) of `h`'s shape, dtype and device: every third element
/// dropped, the others scaled by 2.
pub(crate) fn half_mask(h: &Tensor) -> candle_core::Result<Option<Tensor>> {
    let v: Vec<f32> = (0..h.elem_count())
        .map(|i| if i % 3 == 0 { 0.0 } else { 2.0 })
        .collect();
    Ok(Some(
        Tensor::from_vec(v, h.shape(), h.device())?.to_dtype(h.dtype())?,
    ))
}

/// `inputs` as a fused op's arguments: each a fresh variable (tracked), but those at the
/// positions in `constants`, passed as they are.
pub(crate) fn tracked_except(
    inputs: &[Tensor],
    constants: &[usize],
) -> candle_core::Result<Vec<Tensor>> {
    inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if constants.contains(&i) {
                Ok(t.clone())
            } else {
                Ok(candle_core::Var::from_tensor(t)?.as_tensor().clone())
            }
        })
        .collect()
}
