//! The launch shape of src/optim/kernels.cu's entry points, shared by the CUDA path
//! ([`super::cuda`]) and the host emulation the unit tests run the kernels under.
//!
//! Every entry point is `<kernel>_<param dtype>(p, g, state…, [maps], scalars…, n)`:
//! - `p` the parameter (f32, bf16 or f16), `g` its f32 gradient, `n` their element count (u64);
//! - the state in order, per moment: f32 values, or u8 codes then f32 absmax per block;
//! - for 8-bit state, the dynamic maps: the signed map then the unsigned one (512 f32);
//! - the f32 scalars each optimizer's `device_args` lists.

use super::quant8::BLOCK;

/// Threads per CUDA block: one per element of a quantization block.
pub const THREADS: u32 = BLOCK as u32;

/// Blocks of a grid-stride (f32 state) launch at most: a few per SM on any card.
const MAX_F32_GRID: usize = 4096;

/// The grid for `n` elements: one block per quantization block for 8-bit state, else enough
/// grid-stride blocks to cover `n` up to [`MAX_F32_GRID`].
pub fn grid(n: usize, q8: bool) -> u32 {
    let blocks = n.div_ceil(BLOCK);
    if q8 {
        blocks as u32
    } else {
        blocks.min(MAX_F32_GRID) as u32
    }
}

/// The entry point's name without the dtype suffix: `<kernel>_q8` or `<kernel>_f32`.
pub fn entry(kernel: &str, q8: bool) -> String {
    format!("{kernel}_{}", if q8 { "q8" } else { "f32" })
}

/// The 256 entries of the signed (first) or unsigned (second) dynamic map in the two-map buffer
/// the 8-bit kernels take: src/optim/quant8.cu's `map` argument.
pub fn map_range(signed: bool) -> std::ops::Range<usize> {
    if signed {
        0..256
    } else {
        256..512
    }
}

/// src/optim/quant8.cu's dequantization entry point, without its `_f32` suffix.
pub const DEQUANT_ENTRY: &str = "q8_dequant";

/// src/optim/quant8.cu's requantization entry point for the signed or unsigned map, without its
/// `_f32` suffix.
pub fn requant_entry(signed: bool) -> &'static str {
    if signed {
        "q8_requant_signed"
    } else {
        "q8_requant_unsigned"
    }
}
