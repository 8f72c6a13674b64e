//! The rebuilt-update op against its composed form, `base(x) + op(x, rebuild(θ))` in plain candle
//! ops, forward and every gradient.
#![cfg(test)]

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};

use super::*;
use crate::nn::test_util::{assert_parity, fill};

/// A LoHa-shaped update for a weight of `dims` (`[out, in, ..]`), from
/// `θ = [a (out×2), b (2×rest), c (out×2), d (2×rest)]`: `0.7 · (a·b) ⊙ (c·d)`.
fn hadamard(dims: &[usize]) -> Rebuild {
    let dims = dims.to_vec();
    Arc::new(move |theta: &Tensor| {
        let out = dims[0];
        let rest: usize = dims[1..].iter().product();
        let mut at = 0;
        let mut take = |r: usize, c: usize| -> Result<Tensor> {
            let t = theta.narrow(0, at, r * c)?.reshape((r, c))?;
            at += r * c;
            Ok(t)
        };
        let (a, b, c, d) = (take(out, 2)?, take(2, rest)?, take(out, 2)?, take(2, rest)?);
        ((a.matmul(&b)? * c.matmul(&d)?)? * 0.7)?.reshape(dims.as_slice())
    })
}

/// A DoRA-shaped update, non-linear in θ and depending on the frozen `w`: the rows of `w + a·b`
/// rescaled to norm `m` per input column, minus `w`, for `θ = [a (out×2), b (2×rest), m (rest)]`.
fn normalised(w: &Tensor) -> Rebuild {
    let w = w.to_dtype(DType::F32).unwrap();
    Arc::new(move |theta: &Tensor| {
        let out = w.dim(0)?;
        let rest = w.elem_count() / out;
        let a = theta.narrow(0, 0, out * 2)?.reshape((out, 2))?;
        let b = theta.narrow(0, out * 2, 2 * rest)?.reshape((2, rest))?;
        let m = theta
            .narrow(0, out * 2 + 2 * rest, rest)?
            .reshape((1, rest))?;
        let merged = (w.reshape((out, rest))? + a.matmul(&b)?)?;
        let norm = (merged.sqr()?.sum_keepdim(0)?.sqrt()? + 1e-6)?;
        let scaled = merged.broadcast_mul(&m.broadcast_div(&norm)?)?;
        (scaled - w.reshape((out, rest))?)?.reshape(w.dims())
    })
}

fn packed_len(dims: &[usize], dora: bool) -> usize {
    let rest: usize = dims[1..].iter().product();
    if dora {
        dims[0] * 2 + 2 * rest + rest
    } else {
        2 * (dims[0] * 2 + 2 * rest)
    }
}

/// `[x, W, b, θ]`; `x` and the base in `dtype`, θ f32.
fn inputs(x_dims: &[usize], w_dims: &[usize], dora: bool, dtype: DType) -> Vec<Tensor> {
    let t = |dims: &[usize], seed, amp, dt: DType| fill(dims, seed, amp).to_dtype(dt).unwrap();
    vec![
        t(x_dims, 1, 1.0, dtype),
        t(w_dims, 2, 1.0, dtype),
        t(&w_dims[..1], 3, 1.0, dtype),
        t(&[packed_len(w_dims, dora)], 4, 0.5, DType::F32),
    ]
}

fn rebuild_for(a: &[Tensor], dora: bool) -> Rebuild {
    if dora {
        normalised(&a[1])
    } else {
        hadamard(a[1].dims())
    }
}

fn fused_linear(a: &[Tensor], dora: bool) -> Result<Tensor> {
    let up = WeightUpdate {
        packed: &a[3],
        rebuild: rebuild_for(a, dora),
    };
    frozen_linear_rebuilt(&a[0], &BaseWeight::plain(&a[1]), Some(&a[2]), up)
}

/// The composed form in f32 (rounded once at the end, as the op does for bf16 on the CPU).
fn composed_linear(a: &[Tensor], dora: bool) -> Result<Tensor> {
    let f = |t: &Tensor| t.to_dtype(DType::F32);
    let x = f(&a[0])?;
    let u = rebuild_for(a, dora)(&a[3])?;
    let y = x
        .broadcast_matmul(&f(&a[1])?.t()?)?
        .broadcast_add(&f(&a[2])?)?;
    (y + x.broadcast_matmul(&u.t()?)?)?.to_dtype(a[0].dtype())
}

fn fused_conv(a: &[Tensor], dora: bool, p: usize, s: usize) -> Result<Tensor> {
    let up = WeightUpdate {
        packed: &a[3],
        rebuild: rebuild_for(a, dora),
    };
    frozen_conv2d_rebuilt(&a[0], &BaseWeight::plain(&a[1]), Some(&a[2]), p, s, up)
}

fn composed_conv(a: &[Tensor], dora: bool, p: usize, s: usize) -> Result<Tensor> {
    let f = |t: &Tensor| t.to_dtype(DType::F32);
    let x = f(&a[0])?;
    let u = rebuild_for(a, dora)(&a[3])?;
    let o = a[1].dim(0)?;
    let y = crate::nn::conv2d_trainable(&x, &f(&a[1])?, p, s)?
        .broadcast_add(&f(&a[2])?.reshape((1, o, 1, 1))?)?;
    (y + crate::nn::conv2d_trainable(&x, &u, p, s)?)?.to_dtype(a[0].dtype())
}

/// Forward and the gradients of `x` and θ equal the composed form's, for a Hadamard update and a
/// normalised one, with `x` tracked or constant. Catches a missing `op(x, U)` term in `∂L/∂x`, a
/// transposed `∂L/∂U`, and a factor gradient taken through the wrong surrogate.
#[test]
fn linear_matches_the_composed_form() {
    for dora in [false, true] {
        for track_x in [true, false] {
            assert_parity(
                &format!("rebuilt linear, dora {dora}, x tracked {track_x}"),
                &inputs(&[2, 5, 6], &[4, 6], dora, DType::F32),
                &[track_x, false, false, true],
                1e-5,
                &|a| fused_linear(a, dora),
                &|a| composed_linear(a, dora),
            );
        }
    }
    assert_parity(
        "rebuilt linear, bf16",
        &inputs(&[7, 6], &[4, 6], false, DType::BF16),
        &[true, false, false, true],
        1e-2,
        &|a| fused_linear(a, false),
        &|a| composed_linear(a, false),
    );
}

/// LoCon's conv shapes: 3×3 at stride 1 and 2 (padding 1, odd and even sides), 1×1.
#[test]
fn conv_matches_the_composed_form() {
    for (k, p, s) in [(3, 1, 1), (3, 1, 2), (1, 0, 1)] {
        for dora in [false, true] {
            assert_parity(
                &format!("rebuilt conv {k}x{k} stride {s}, dora {dora}"),
                &inputs(&[2, 3, 7, 6], &[4, 3, k, k], dora, DType::F32),
                &[true, false, false, true],
                1e-5,
                &|a| fused_conv(a, dora, p, s),
                &|a| composed_conv(a, dora, p, s),
            );
        }
    }
    assert_parity(
        "rebuilt conv, bf16",
        &inputs(&[2, 3, 7, 6], &[4, 3, 3, 3], true, DType::BF16),
        &[true, false, false, true],
        1e-2,
        &|a| fused_conv(a, true, 1, 1),
        &|a| composed_conv(a, true, 1, 1),
    );
}

/// The point of the op: its graph holds the output and its two arguments, none of the update's
/// weight-sized intermediates.
#[test]
fn the_graph_keeps_no_weight_sized_intermediate() {
    let a = inputs(&[7, 6], &[4, 6], false, DType::F32);
    let var = |t: &Tensor| {
        candle_core::Var::from_tensor(t)
            .unwrap()
            .as_tensor()
            .clone()
    };
    let args = [var(&a[0]), a[1].clone(), a[2].clone(), var(&a[3])];
    let fused = fused_linear(&args, false).unwrap();
    assert_eq!(fused.sorted_nodes().len(), 3);
    let composed = composed_linear(&args, false).unwrap();
    assert!(composed.sorted_nodes().len() > 8);
}

#[test]
fn an_update_of_the_wrong_shape_is_an_error() {
    let a = inputs(&[7, 6], &[4, 6], false, DType::F32);
    let up = WeightUpdate {
        packed: &a[3],
        rebuild: hadamard(&[4, 5]),
    };
    let e = frozen_linear_rebuilt(&a[0], &BaseWeight::plain(&a[1]), None, up).unwrap_err();
    assert!(e.to_string().contains("does not fit"), "{e}");
}
