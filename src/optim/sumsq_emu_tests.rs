//! src/optim/sumsq.cu under the host emulation: each entry point's sum of squares against an f64
//! sum on the host, over a ragged length with several blocks, into one slot of a shared buffer
//! whose other slots stay as they were.
#![cfg(test)]

use crate::kernel_emu::{self, Arg, Elem};

const SOURCE: &str = "src/optim/sumsq.cu";
const THREADS: u32 = 256;

/// `out` after adding Σ x² of `x` into `slot` with `blocks` blocks.
fn run<T: Elem>(entry: &str, x: &[T], blocks: u32, mut out: Vec<f32>, slot: usize) -> Vec<f32> {
    kernel_emu::launch(
        SOURCE,
        entry,
        [blocks, 1, 1],
        [THREADS, 1, 1],
        &mut [
            Arg::input(x),
            Arg::Int(x.len() as i64),
            Arg::out(&mut out),
            Arg::Int(slot as i64),
        ],
    );
    out
}

fn values(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7919) % 1000) as f32 / 250.0 - 2.0) * if i % 3 == 0 { 0.1 } else { 1.0 })
        .collect()
}

fn host_sum(x: impl Iterator<Item = f32>) -> f64 {
    x.map(|v| f64::from(v) * f64::from(v)).sum()
}

/// f32, 10,007 values over 3 blocks (each a grid-stride share, a ragged tail), into slot 2 of
/// [1, 2, 0.5, 4]: slot 2 gains Σ x², the others keep their values. Catches a block's share not
/// striding over the whole tensor (`stride` of one block), a warp's partial dropped in the block
/// reduction, an overwrite of the slot instead of an add, and the wrong slot.
#[test]
fn f32_sum_of_squares_adds_into_its_slot() {
    let x = values(10_007);
    let out = run("sumsq_into_f32", &x, 3, vec![1.0, 2.0, 0.5, 4.0], 2);
    let want = 0.5 + host_sum(x.iter().copied());
    assert_eq!([out[0], out[1], out[3]], [1.0, 2.0, 4.0]);
    let err = (f64::from(out[2]) - want).abs() / want;
    assert!(err < 1e-6, "{} vs {want}: {err:.2e}", out[2]);
}

/// bf16 and f16 gradients read as their dtypes (a value read as the wrong type is off by far
/// more), one block over fewer values than threads.
#[test]
fn bf16_and_f16_gradients_are_read_as_their_dtype() {
    let x = values(200);
    let bf: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let want = host_sum(bf.iter().map(|v| v.to_f32()));
    let out = run("sumsq_into_bf16", &bf, 1, vec![0.0], 0);
    assert!(
        (f64::from(out[0]) - want).abs() / want < 1e-6,
        "{out:?} vs {want}"
    );
    let h: Vec<half::f16> = x.iter().map(|&v| half::f16::from_f32(v)).collect();
    let want = host_sum(h.iter().map(|v| v.to_f32()));
    let out = run("sumsq_into_f16", &h, 2, vec![0.0], 0);
    assert!(
        (f64::from(out[0]) - want).abs() / want < 1e-6,
        "{out:?} vs {want}"
    );
}
