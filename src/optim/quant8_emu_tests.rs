#![cfg(test)]
//! src/optim/quant8.cu under the host emulation ([`crate::kernel_emu`]) against the host
//! quantization of [`super::quant8`], launched as the CUDA path ([`super::quant8_cuda`]) launches
//! it: the grid, the entry point and the map from [`super::launch`].
//!
//! `q8_requant_*` must give the codes and absmax of `quant8::requantize` block by block, and
//! `q8_dequant` the values of `Moment::values`, bit for bit: on ragged sizes (a partial last
//! block, a single partial block), with blocks of zeros, of huge and of subnormal magnitudes, of
//! signed zeros, of values exactly on the midpoints between two codes (where bitsandbytes' search
//! and the host's rule part), and of infinities and NaN.

use super::launch;
use super::quant8::{blocks, maps, requantize, DynamicMap, Moment, BLOCK};
use crate::kernel_emu::{self, Arg};

const SOURCE: &str = "src/optim/quant8.cu";

fn map(signed: bool) -> &'static DynamicMap {
    let (s, u) = maps();
    if signed {
        s
    } else {
        u
    }
}

/// The map argument as the CUDA path slices it from the two-map buffer.
fn map_arg(signed: bool) -> Vec<f32> {
    super::kernel_emu::map_buffer()[launch::map_range(signed)].to_vec()
}

/// The emulated `q8_requant_*`: codes and absmax for `vals` (which it must leave as they are).
fn emu_requant(vals: &[f32], signed: bool) -> (Vec<u8>, Vec<f32>) {
    let n = vals.len();
    let (mut x, mut codes, mut absmax) = (vals.to_vec(), vec![0xA5u8; n], vec![-7f32; blocks(n)]);
    let m = map_arg(signed);
    let mut args = [
        Arg::out(&mut x),
        Arg::out(&mut codes),
        Arg::out(&mut absmax),
        Arg::input(&m),
        Arg::Int(n as i64),
    ];
    let entry = format!("{}_f32", launch::requant_entry(signed));
    let grid = [launch::grid(n, true), 1, 1];
    kernel_emu::launch(SOURCE, &entry, grid, [launch::THREADS, 1, 1], &mut args);
    let same: Vec<u32> = vals.iter().map(|v| v.to_bits()).collect();
    assert_eq!(x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), same);
    (codes, absmax)
}

/// The emulated `q8_dequant`.
fn emu_dequant(codes: &[u8], absmax: &[f32], signed: bool) -> Vec<f32> {
    let n = codes.len();
    let mut out = vec![f32::NAN; n];
    let m = map_arg(signed);
    let mut args = [
        Arg::out(&mut out),
        Arg::input(codes),
        Arg::input(absmax),
        Arg::input(&m),
        Arg::Int(n as i64),
    ];
    let entry = format!("{}_f32", launch::DEQUANT_ENTRY);
    let grid = [launch::grid(n, true), 1, 1];
    kernel_emu::launch(SOURCE, &entry, grid, [launch::THREADS, 1, 1], &mut args);
    out
}

/// The host's requantization of a whole moment, block by block.
fn host_requant(vals: &[f32], signed: bool) -> (Vec<u8>, Vec<f32>) {
    let mut codes = vec![0u8; vals.len()];
    let absmax = vals
        .chunks(BLOCK)
        .zip(codes.chunks_mut(BLOCK))
        .map(|(v, c)| requantize(v, map(signed), c))
        .collect();
    (codes, absmax)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Deterministic values in ±1 (only ≥ 0 unsigned), log-spread over eight decades.
fn spread(seed: u64, n: usize, signed: bool) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            let x = 10f32.powf(-8.0 * u);
            if signed && s & (1 << 20) != 0 {
                -x
            } else {
                x
            }
        })
        .collect()
}

/// The map's midpoints `(code[k] + code[k+1]) / 2` in f32, as the host computes them.
fn mids(m: &DynamicMap) -> Vec<f32> {
    m.code.windows(2).map(|w| (w[0] + w[1]) * 0.5).collect()
}

/// Values exactly on every midpoint of the map and one ulp either side of it, in blocks of 255
/// values and a 1.0 (so `x / absmax` is the value itself): three blocks.
fn midpoints(m: &DynamicMap) -> Vec<f32> {
    let around: Vec<f32> = mids(m)
        .iter()
        .flat_map(|&x| [x.next_down(), x, x.next_up()])
        .collect();
    around
        .chunks(BLOCK - 1)
        .flat_map(|c| c.iter().copied().chain([1.0]))
        .collect()
}

/// Ten blocks of hard cases, then a ragged tail of `tail` values.
fn hard_cases(signed: bool, tail: usize) -> Vec<f32> {
    let s = if signed { -1.0 } else { 1.0 };
    let mut v = Vec::new();
    v.extend(spread(1, BLOCK, signed).iter().map(|x| x * 1e-3));
    v.extend([0.0; BLOCK]);
    v.extend(spread(2, BLOCK, signed).iter().map(|x| x * 3e30));
    v.extend(spread(3, BLOCK, signed).iter().map(|x| x * 1e-37)); // down to subnormals
    v.extend(midpoints(map(signed)));
    let zeros = (0..BLOCK).map(|i| match i % 4 {
        0 => -0.0,
        1 => 0.0,
        2 => s * 1e-9,
        _ => 2e-3,
    });
    v.extend(zeros);
    let wild = (0..BLOCK).map(|i| match i % 5 {
        0 => f32::INFINITY,
        1 => f32::NAN,
        2 => s * f32::INFINITY,
        _ => s * 0.5,
    });
    v.extend(wild);
    v.extend([f32::NAN; BLOCK]);
    v.extend(spread(4, tail, signed).iter().map(|x| x * 0.25));
    v
}

/// Both kernels against the host on every hard case, the moment's size ragged or not.
#[test]
fn q8_kernels_match_host_quantization_bit_for_bit() {
    for signed in [true, false] {
        for tail in [0, 1, 77, BLOCK - 1] {
            let vals = hard_cases(signed, tail);
            let (codes, absmax) = emu_requant(&vals, signed);
            let (hc, ha) = host_requant(&vals, signed);
            let what = format!("signed={signed} n={}", vals.len());
            let diff: Vec<usize> = (0..codes.len()).filter(|&i| codes[i] != hc[i]).collect();
            assert!(diff.is_empty(), "{what}: codes differ at {diff:?}");
            assert_eq!(bits(&absmax), bits(&ha), "{what}: absmax");
            let moment = Moment::Q8 {
                codes: hc,
                absmax: ha,
            };
            let host = moment.values(map(signed));
            let emu = emu_dequant(&codes, &absmax, signed);
            assert_eq!(bits(&emu), bits(&host), "{what}: dequantized values");
        }
    }
}

/// The midpoint block is a real test of the tie rule: there bitsandbytes' search (which the
/// fused 8-bit kernels use) takes another code than the host's rule for some values.
#[test]
fn midpoints_part_the_two_searches() {
    for signed in [true, false] {
        let m = map(signed);
        let parted = mids(m)
            .iter()
            .filter(|&&x| m.quantize(x) != m.quantize_search(x))
            .count();
        assert!(parted > 0, "signed={signed}");
    }
}

/// Sizes with no hard case: a single partial block, exactly one block, and a moment of many
/// blocks whose scale changes from block to block; dequantized from arbitrary codes too.
#[test]
fn q8_kernels_match_host_on_plain_sizes() {
    for signed in [true, false] {
        for n in [1, 100, BLOCK, BLOCK + 1, 17 * BLOCK + 131] {
            let vals: Vec<f32> = spread(n as u64, n, signed)
                .iter()
                .enumerate()
                .map(|(i, x)| x * 10f32.powi((i / BLOCK) as i32 % 9 - 4))
                .collect();
            let (codes, absmax) = emu_requant(&vals, signed);
            assert_eq!(
                (codes.clone(), bits(&absmax)),
                {
                    let (c, a) = host_requant(&vals, signed);
                    (c, bits(&a))
                },
                "signed={signed} n={n}"
            );
            // Every code, under absmax of every kind but NaN and infinity.
            let codes: Vec<u8> = (0..n).map(|i| (i * 37 % 256) as u8).collect();
            let absmax: Vec<f32> = (0..blocks(n))
                .map(|b| [0.0, 1.0, 3.5e-3, 1e-40, 2.5e37][b % 5])
                .collect();
            let host = Moment::Q8 {
                codes: codes.clone(),
                absmax: absmax.clone(),
            }
            .values(map(signed));
            let emu = emu_dequant(&codes, &absmax, signed);
            assert_eq!(bits(&emu), bits(&host), "signed={signed} n={n}");
        }
    }
}
