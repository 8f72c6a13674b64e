//! Blockwise 8-bit dynamic quantization of optimizer state, as bitsandbytes' blockwise 8-bit
//! optimizers do it (Dettmers et al. 2021, arXiv 2110.02861; bitsandbytes ≥ 0.44 block size).
//!
//! - A state tensor is split, flattened, into blocks of [`BLOCK`] elements; each block stores one
//!   f32 absmax and one u8 code per element: `value = map[code] · absmax`.
//! - The maps are bitsandbytes' `create_dynamic_map(signed=True)` for the first moment (sign,
//!   decimal exponent, linear fraction) and `create_dynamic_map(signed=False)` for the second
//!   (the sign bit reused as a fraction bit). 256 sorted values each, ending at 1.0.
//! - Requantization picks the nearest code by bitsandbytes' binary search (`quantize_2D` in
//!   `csrc/kernels.cu`: a midpoint comparison between the two codes that bracket the value),
//!   and for the signed map moves a code whose sign differs from the value's one step toward it,
//!   so a small negative moment never becomes zero or positive.
//! - A block whose absmax is 0 stores the code of 0 (bitsandbytes stores whatever 0/0 gives;
//!   either way every value reads back as 0).

/// Elements per quantization block (bitsandbytes' `BLOCKSIZE_2STATE` / `BLOCKSIZE_1STATE`).
pub const BLOCK: usize = 256;

/// Tensors with fewer elements keep f32 state (bitsandbytes' `min_8bit_size`).
pub const MIN_8BIT_SIZE: usize = 4096;

/// A 256-entry quantization map, sorted ascending, with its lookup table for quantizing.
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicMap {
    pub signed: bool,
    pub code: [f32; 256],
    /// `(code[k] + code[k+1]) / 2`, in f32 as bitsandbytes computes it; `mid[255]` is +∞.
    mid: [f32; 256],
    /// For the top 16 bits of an f32 (sign, exponent, 7 mantissa bits): the nearest code to the
    /// smallest value with those bits. A value then moves up past at most a few midpoints.
    start: Vec<u8>,
}

/// `torch.linspace(start, end, steps, dtype=float32)` as torch's CPU kernel computes it: the
/// first half from `start`, the second half back from `end`, each element one fused
/// multiply-add (the compiled `start + step * idx`; checked bit for bit against torch 2.15 for
/// every length the maps use).
fn linspace_f32(start: f32, end: f32, steps: usize) -> Vec<f32> {
    let step = (end - start) / (steps - 1) as f32;
    let half = steps / 2;
    (0..steps)
        .map(|i| {
            if i < half {
                step.mul_add(i as f32, start)
            } else {
                (-step).mul_add((steps - 1 - i) as f32, end)
            }
        })
        .collect()
}

impl DynamicMap {
    /// bitsandbytes' `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`, in f32.
    pub fn new(signed: bool) -> Self {
        const MAX_EXPONENT_BITS: i32 = 7;
        const NON_SIGN_BITS: i32 = 7;
        let mut data: Vec<f32> = Vec::with_capacity(256);
        for i in 0..MAX_EXPONENT_BITS {
            let extra = if signed { 0 } else { 1 };
            let items = (1usize << (i + NON_SIGN_BITS - MAX_EXPONENT_BITS + extra)) + 1;
            let b = linspace_f32(0.1, 1.0, items);
            // Python's `10 ** (i − 6)`: 1 / 10^(6 − i), correctly rounded, then an f32 scalar.
            let scale = (1.0 / 10f64.powi(MAX_EXPONENT_BITS - 1 - i)) as f32;
            let means: Vec<f32> = b.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
            data.extend(means.iter().map(|m| scale * m));
            if signed {
                data.extend(means.iter().map(|m| -scale * m));
            }
        }
        data.push(0.0);
        data.push(1.0);
        data.sort_by(f32::total_cmp);
        let mut code = [0f32; 256];
        code.copy_from_slice(&data);
        let mut mid = [f32::INFINITY; 256];
        for k in 0..255 {
            mid[k] = (code[k] + code[k + 1]) * 0.5;
        }
        let mut map = Self {
            signed,
            code,
            mid,
            start: Vec::new(),
        };
        map.start = (0..=u16::MAX)
            .map(|key| {
                let bits = u32::from(key) << 16;
                // The bucket's smallest value: its largest magnitude when negative.
                let lowest = if key & 0x8000 != 0 {
                    bits | 0xFFFF
                } else {
                    bits
                };
                let x = f32::from_bits(lowest);
                if x.is_nan() {
                    0
                } else {
                    map.nearest_from(0, x)
                }
            })
            .collect();
        map
    }

    /// The nearest code at or above `from` for `x`: the first code whose upper midpoint `x`
    /// does not pass (ties to the lower code).
    fn nearest_from(&self, from: u8, x: f32) -> u8 {
        let mut k = from as usize;
        while k < 255 && x > self.mid[k] {
            k += 1;
        }
        k as u8
    }

    /// The code of 0.
    pub fn zero_code(&self) -> u8 {
        if self.signed {
            127
        } else {
            0
        }
    }

    /// The nearest code to `x` (|x| ≤ 1) through the lookup table, with the signed map's sign
    /// fix: bitsandbytes' result but at exact midpoints, where either neighbour is nearest.
    pub fn quantize(&self, x: f32) -> u8 {
        let start = self.start[(x.to_bits() >> 16) as usize];
        self.sign_fix(self.nearest_from(start, x), x)
    }

    /// bitsandbytes' fix: a code whose sign differs from the value's moves one step toward it,
    /// so a small moment never flips sign or becomes 0 (signed map only).
    fn sign_fix(&self, q: u8, x: f32) -> u8 {
        if self.signed && self.code[q as usize].is_sign_negative() != x.is_sign_negative() {
            if x > 0.0 {
                q.wrapping_add(1)
            } else {
                q.wrapping_sub(1)
            }
        } else {
            q
        }
    }

    /// The nearest code to `x` by bitsandbytes' `quantize_2D` binary search (`csrc/kernels.cu`),
    /// with the sign fix: [`DynamicMap::quantize`] is tested against it.
    pub fn quantize_search(&self, x: f32) -> u8 {
        let c = &self.code;
        let (mut pivot, mut upper_pivot, mut lower_pivot) = (127usize, 255usize, 0usize);
        let (mut lower, mut upper) = (if self.signed { -1.0f32 } else { 0.0 }, 1.0f32);
        let mut val = c[127];
        for i in [64usize, 32, 16, 8, 4, 2, 1] {
            if x > val {
                lower_pivot = pivot;
                lower = val;
                pivot += i;
            } else {
                upper_pivot = pivot;
                upper = val;
                pivot -= i;
            }
            val = c[pivot];
        }
        let q = if x > val {
            if x > (upper + val) * 0.5 {
                upper_pivot
            } else {
                pivot
            }
        } else if x < (lower + val) * 0.5 {
            lower_pivot
        } else {
            pivot
        };
        self.sign_fix(q as u8, x)
    }

    /// The nearest code by exhaustive search (ties to the lower index), with the sign fix: the
    /// reference [`DynamicMap::quantize`] is tested against.
    pub fn quantize_reference(&self, x: f32) -> u8 {
        let mut best = 0usize;
        for (i, &v) in self.code.iter().enumerate() {
            if (v - x).abs() < (self.code[best] - x).abs() {
                best = i;
            }
        }
        self.sign_fix(best as u8, x)
    }
}

/// One block's state: the values are dequantized into `vals`, updated by the caller, then
/// requantized with [`requantize`].
pub fn dequantize(codes: &[u8], absmax: f32, map: &DynamicMap, vals: &mut [f32]) {
    for (v, &c) in vals.iter_mut().zip(codes) {
        *v = map.code[c as usize] * absmax;
    }
}

/// Requantizes one block's updated values: returns the new absmax and writes the codes.
pub fn requantize(vals: &[f32], map: &DynamicMap, codes: &mut [u8]) -> f32 {
    let absmax = vals.iter().fold(0f32, |a, v| a.max(v.abs()));
    if absmax == 0.0 {
        codes.fill(map.zero_code());
        return 0.0;
    }
    for (c, &v) in codes.iter_mut().zip(vals) {
        *c = map.quantize(v / absmax);
    }
    absmax
}

/// The number of blocks for `n` elements.
pub fn blocks(n: usize) -> usize {
    n.div_ceil(BLOCK)
}

/// The two maps, built once.
pub fn maps() -> &'static (DynamicMap, DynamicMap) {
    static MAPS: std::sync::OnceLock<(DynamicMap, DynamicMap)> = std::sync::OnceLock::new();
    MAPS.get_or_init(|| (DynamicMap::new(true), DynamicMap::new(false)))
}

/// One moment of one parameter: f32 for small tensors, blockwise 8-bit otherwise.
#[derive(Debug, Clone, PartialEq)]
pub enum Moment {
    F32(Vec<f32>),
    Q8 { codes: Vec<u8>, absmax: Vec<f32> },
}

impl Moment {
    /// Zeros for `n` elements: 8-bit when `eight_bit` and `n ≥ MIN_8BIT_SIZE`.
    pub fn zeros(n: usize, eight_bit: bool, map: &DynamicMap) -> Self {
        if eight_bit && n >= MIN_8BIT_SIZE {
            Moment::Q8 {
                codes: vec![map.zero_code(); n],
                absmax: vec![0.0; blocks(n)],
            }
        } else {
            Moment::F32(vec![0.0; n])
        }
    }

    /// Bytes of state for `n` elements, as [`Moment::zeros`] would hold.
    pub fn bytes_for(n: usize, eight_bit: bool) -> usize {
        if eight_bit && n >= MIN_8BIT_SIZE {
            n + 4 * blocks(n)
        } else {
            4 * n
        }
    }

    /// Every value as f32: the whole-tensor view the references update.
    pub fn values(&self, map: &DynamicMap) -> Vec<f32> {
        match self {
            Moment::F32(x) => x.clone(),
            Moment::Q8 { codes, absmax } => codes
                .iter()
                .enumerate()
                .map(|(i, &c)| map.code[c as usize] * absmax[i / BLOCK])
                .collect(),
        }
    }

    /// Stores `vals`, requantizing block by block with the exhaustive nearest-code search (the
    /// references' requantization; the kernels use [`requantize`]).
    pub fn store_reference(&mut self, vals: Vec<f32>, map: &DynamicMap) {
        match self {
            Moment::F32(x) => *x = vals,
            Moment::Q8 { codes, absmax } => {
                for (b, block) in vals.chunks(BLOCK).enumerate() {
                    let a = block.iter().fold(0f32, |a, x| a.max(x.abs()));
                    absmax[b] = a;
                    for (j, &x) in block.iter().enumerate() {
                        codes[b * BLOCK + j] = if a == 0.0 {
                            map.zero_code()
                        } else {
                            map.quantize_reference(x / a)
                        };
                    }
                }
            }
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            Moment::F32(v) => 4 * v.len(),
            Moment::Q8 { codes, absmax } => codes.len() + 4 * absmax.len(),
        }
    }

    /// The tensors to save: `state{k}` (f32 or u8, the parameter's shape) and, for 8-bit,
    /// `absmax{k}` (f32 per block); bitsandbytes' names.
    pub fn save(
        &self,
        names: (&'static str, &'static str),
        shape: &[usize],
    ) -> candle_core::Result<Vec<(&'static str, candle_core::Tensor)>> {
        use super::host::{tensor_f32, tensor_u8};
        Ok(match self {
            Moment::F32(v) => vec![(names.0, tensor_f32(v, shape)?)],
            Moment::Q8 { codes, absmax } => vec![
                (names.0, tensor_u8(codes, shape)?),
                (names.1, tensor_f32(absmax, &[absmax.len()])?),
            ],
        })
    }

    /// Replaces the values from tensors laid out as [`Moment::save`] writes them, taken from the
    /// front of `tensors`.
    pub fn load(
        &mut self,
        tensors: &mut std::vec::IntoIter<candle_core::Tensor>,
    ) -> candle_core::Result<()> {
        use super::host::{host_f32, host_u8};
        let mut next = || {
            tensors
                .next()
                .ok_or_else(|| candle_core::Error::Msg("optimizer state: too few tensors".into()))
        };
        *self = match self {
            Moment::F32(_) => Moment::F32(host_f32(&next()?)?),
            Moment::Q8 { .. } => Moment::Q8 {
                codes: host_u8(&next()?)?,
                absmax: host_f32(&next()?)?,
            },
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_are_sorted_256_values_ending_at_one() {
        for signed in [true, false] {
            let m = DynamicMap::new(signed);
            assert!(m.code.windows(2).all(|w| w[0] <= w[1]), "signed={signed}");
            assert_eq!(m.code[255], 1.0);
            assert_eq!(m.code[m.zero_code() as usize], 0.0);
        }
        let s = DynamicMap::new(true);
        // No −1.0 in the signed map: it is symmetric but for the extra 1.0.
        for k in 0..=126 {
            assert_eq!(s.code[k], -s.code[254 - k], "k={k}");
        }
    }

    /// The lookup table and bitsandbytes' search both equal the exhaustive nearest code
    /// everywhere but at exact midpoints, and the sign fix keeps the sign of every nonzero value.
    #[test]
    fn search_finds_the_nearest_code() {
        for signed in [true, false] {
            let m = DynamicMap::new(signed);
            let lo = if signed { -1.0 } else { 0.0 };
            let mut state = 12345u64;
            for i in 0..200_000 {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = (state >> 40) as f32 / (1u64 << 24) as f32;
                // Uniform, and log-uniform down to 1e-8 to reach the small codes.
                let x = if i % 2 == 0 {
                    lo + (1.0 - lo) * u
                } else {
                    let mag = 10f32.powf(-8.0 * u);
                    if signed && state & 1 == 1 {
                        -mag
                    } else {
                        mag
                    }
                };
                let (a, b) = (m.quantize(x), m.quantize_reference(x));
                let s = m.quantize_search(x);
                if s != b {
                    let (ds, db) = (
                        (m.code[s as usize] - x).abs(),
                        (m.code[b as usize] - x).abs(),
                    );
                    assert_eq!(ds, db, "x={x} signed={signed}: bnb search {s}, nearest {b}");
                }
                if a != b {
                    let (da, db) = (
                        (m.code[a as usize] - x).abs(),
                        (m.code[b as usize] - x).abs(),
                    );
                    assert_eq!(da, db, "x={x} signed={signed}: search {a}, nearest {b}");
                }
                if signed && x != 0.0 {
                    let q = m.code[a as usize];
                    assert!(q != 0.0 && (q > 0.0) == (x > 0.0), "x={x} → {q}");
                }
            }
        }
    }

    /// Round trip of a block: every value comes back within half the gap between the two codes
    /// around it (times absmax).
    #[test]
    fn blockwise_round_trip_is_within_half_a_map_step() {
        for signed in [true, false] {
            let m = DynamicMap::new(signed);
            let vals: Vec<f32> = (0..BLOCK)
                .map(|i| {
                    let x =
                        ((i * 7919) % 1000) as f32 / 1000.0 * 3.0 - if signed { 1.5 } else { 0.0 };
                    x * 1e-3
                })
                .collect();
            let mut codes = vec![0u8; BLOCK];
            let absmax = requantize(&vals, &m, &mut codes);
            let mut back = vec![0f32; BLOCK];
            dequantize(&codes, absmax, &m, &mut back);
            for (v, b) in vals.iter().zip(&back) {
                let x = v / absmax;
                let k = m.code.partition_point(|&c| c < x).clamp(1, 255);
                let gap = (m.code[k] - m.code[k - 1]) * absmax;
                assert!(
                    (v - b).abs() <= 0.5 * gap * 1.0001 + 1e-12,
                    "{v} → {b} (gap {gap})"
                );
            }
        }
    }

    #[test]
    fn all_zero_block_round_trips_to_zero() {
        let m = DynamicMap::new(true);
        let mut codes = vec![9u8; 4];
        assert_eq!(requantize(&[0.0; 4], &m, &mut codes), 0.0);
        let mut back = vec![1f32; 4];
        dequantize(&codes, 0.0, &m, &mut back);
        assert_eq!(back, vec![0.0; 4]);
    }
}
