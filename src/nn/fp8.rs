//! The fp8 frozen base: a frozen weight stored as e4m3 codes, one byte each, with an f32 scale per
//! output channel, dequantised to the compute dtype where a layer uses it.
//!
//! The format is torch's `float8_e4m3fn`: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits,
//! no infinity, NaN at `0x7f`/`0xff`, largest finite 448, subnormals down to 2⁻⁹. A weight `w`
//! `[out, …]` is quantised per row (output channel) `r`:
//!
//! ```text
//! scale[r] = max_j |w[r, j]| / 448          (1 for an all-zero row)
//! code[r, j] = e4m3(w[r, j] / scale[r])     (f32 division; round to nearest even; past 448 → 448)
//! w'[r, j] = T(decode(code[r, j]) · scale[r])   (f32 product, rounded once to the dtype T)
//! ```
//!
//! which is what `(w.float() / scale).to(torch.float8_e4m3fn)` and `(codes.float() * scale)
//! .to(T)` give (tests/fixtures/fp8_reference.py; the tests compare bit for bit). The per-row
//! scale puts each row's largest weight at 448, so the 3-bit mantissa's relative error (≤ 1/16)
//! applies to every weight within 2⁻¹⁵ of its row's largest; smaller ones fall into the
//! subnormals, where the step is `scale · 2⁻⁹`.
//!
//! Three custom ops, each with a host forward (here) and a CUDA one (src/nn/kernels/fp8.cu via
//! `fp8_cuda`, the same arithmetic): the row scales, the encoding, the decoding. A weight with a
//! NaN or an infinity cannot be scaled; [`quantize`] refuses it with the row it found.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::weights::{Weights, WeightsError};

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// `v` as an e4m3 code: round to nearest even, magnitudes past 448 (infinity included) saturated
/// to 448, NaN to NaN (`0x7f` with `v`'s sign).
pub fn encode(v: f32) -> u8 {
    let u = v.to_bits();
    let sign = ((u >> 24) & 0x80) as u8;
    let a = u & 0x7fff_ffff;
    if a > 0x7f80_0000 {
        return sign | 0x7f;
    }
    if a >= 0x43e0_0000 {
        return sign | 0x7e;
    }
    if a < 0x3c80_0000 {
        // Below 2⁻⁶: units of 2⁻⁹ (an exact product); 8 units is 2⁻⁶, code 8 as well.
        return sign | (f32::from_bits(a) * 512.0).round_ties_even() as u8;
    }
    let r = (a + 0x7ffff + ((a >> 20) & 1)) >> 20;
    let code = r - ((127 - 7) << 3);
    sign | code.min(0x7e) as u8
}

/// The value of e4m3 code `c`.
pub fn decode(c: u8) -> f32 {
    let (e, m) = (u32::from((c >> 3) & 0xf), u32::from(c & 7));
    let a = if c & 0x7f == 0x7f {
        f32::NAN
    } else if e == 0 {
        m as f32 * 0.001_953_125
    } else {
        f32::from_bits(((e + 120) << 23) | (m << 20))
    };
    if c & 0x80 != 0 {
        -a
    } else {
        a
    }
}

/// [`decode`] of every code, for the host's dequantisation (one load instead of the branches).
fn decode_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|c| decode(c as u8)))
}

/// `max |row|` / 448, 1 for a zero row, NaN if the row holds a NaN (a NaN wins every comparison).
fn row_scale(row: &[f32]) -> f32 {
    let m = row.iter().fold(0.0f32, |m, &x| {
        let a = x.abs();
        if a > m || a.is_nan() {
            a
        } else {
            m
        }
    });
    if m == 0.0 {
        1.0
    } else {
        m / E4M3_MAX
    }
}

/// `(rows, cols)` of a weight `[out, …]`: its first dimension and the product of the rest.
fn rows_cols(shape: &Shape) -> Result<(usize, usize)> {
    let dims = shape.dims();
    if dims.len() < 2 {
        candle_core::bail!("fp8 weight: want a weight of rank 2 or more, got {dims:?}");
    }
    Ok((dims[0], dims[1..].iter().product()))
}

/// `w` quantised: its e4m3 codes (`u8`, `w`'s shape) and row scales (`f32` `[out]`), on `w`'s
/// device. `name` (the tensor's) goes into the error for a weight holding a NaN or an infinity.
pub fn quantize(w: &Tensor, name: &str) -> Result<(Tensor, Tensor)> {
    let w = w.detach().contiguous()?;
    let scale = w.apply_op1_no_bwd(&RowScale)?;
    let host: Vec<f32> = scale.to_vec1()?;
    if let Some(r) = host.iter().position(|s| !s.is_finite()) {
        candle_core::bail!(
            "`{name}`: output channel {r} holds a NaN or an infinity, which an fp8 base cannot \
             store (base_weight_dtype \"fp8\" needs finite weights)"
        );
    }
    let codes = w.apply_op2_no_bwd(&scale, &Encode)?;
    Ok((codes, scale))
}

/// A layer's weight `weight`, just read from `w` at `name`, as the layer stores it: itself, or its
/// e4m3 codes and row scales when `w` asks for an fp8 base ([`Weights::fp8_base`]); quantised as
/// soon as it is read, so loading never holds more than one tensor at full width.
pub fn layer_weight(
    w: &Weights,
    name: &str,
    weight: Tensor,
) -> std::result::Result<(Tensor, Option<Tensor>), WeightsError> {
    if !w.fp8_base() {
        return Ok((weight, None));
    }
    let stored = w.stored_path(name);
    let (codes, scale) = quantize(&weight, &stored).map_err(|e| WeightsError::Load {
        component: w.component().to_string(),
        name: stored.clone(),
        source: Box::new(e),
    })?;
    Ok((codes, Some(scale)))
}

/// The weight that `codes` and `scale` encode, in `dtype` (f32, bf16 or f16), detached.
pub fn dequantize(codes: &Tensor, scale: &Tensor, dtype: DType) -> Result<Tensor> {
    codes
        .contiguous()?
        .apply_op2_no_bwd(&scale.contiguous()?, &Decode(dtype))
}

/// The weight's elements as f32 (a copy for bf16/f16), from contiguous host storage.
fn host_f32(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("fp8: a non-contiguous weight");
    };
    Ok(match s {
        CpuStorage::F32(v) => v[a..b].to_vec(),
        CpuStorage::BF16(v) => v[a..b].iter().map(|x| x.to_f32()).collect(),
        CpuStorage::F16(v) => v[a..b].iter().map(|x| x.to_f32()).collect(),
        other => {
            use candle_core::backend::BackendStorage;
            candle_core::bail!("fp8: a {:?} weight (f32, bf16 or f16 only)", other.dtype())
        }
    })
}

fn contiguous<'a, T>(v: &'a [T], l: &Layout, what: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("fp8: non-contiguous {what}"),
    }
}

/// `w` → the row scales.
struct RowScale;

impl CustomOp1 for RowScale {
    fn name(&self) -> &'static str {
        "fp8-row-scale"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, cols) = rows_cols(l.shape())?;
        let w = host_f32(s, l)?;
        let scale: Vec<f32> = w.par_chunks(cols.max(1)).map(row_scale).collect();
        Ok((CpuStorage::F32(scale), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, cols) = rows_cols(l.shape())?;
        Ok((
            super::fp8_cuda::row_scale(s, l, rows, cols)?,
            Shape::from(rows),
        ))
    }
}

/// `(w, scale)` → the codes.
struct Encode;

impl CustomOp2 for Encode {
    fn name(&self) -> &'static str {
        "fp8-encode"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        sc: &CpuStorage,
        scl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = rows_cols(l.shape())?;
        let w = host_f32(s, l)?;
        let CpuStorage::F32(sc) = sc else {
            candle_core::bail!("fp8 encode: f32 scales wanted");
        };
        let sc = contiguous(sc, scl, "scales")?;
        let mut codes = vec![0u8; w.len()];
        codes
            .par_chunks_mut(cols.max(1))
            .zip(w.par_chunks(cols.max(1)))
            .zip(sc.par_iter())
            .for_each(|((c, w), &s)| {
                for (c, &x) in c.iter_mut().zip(w) {
                    *c = encode(x / s);
                }
            });
        Ok((CpuStorage::U8(codes), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        sc: &candle_core::CudaStorage,
        scl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (_, cols) = rows_cols(l.shape())?;
        let codes = super::fp8_cuda::encode(s, l, sc, scl, cols)?;
        Ok((codes, l.shape().clone()))
    }
}

/// `(codes, scale)` → the weight in the dtype.
struct Decode(DType);

impl Decode {
    fn host<T: Send + Copy + Default>(
        codes: &[u8],
        scale: &[f32],
        cols: usize,
        f: fn(f32) -> T,
    ) -> Vec<T> {
        let table = decode_table();
        let mut out = vec![T::default(); codes.len()];
        out.par_chunks_mut(cols.max(1))
            .zip(codes.par_chunks(cols.max(1)))
            .zip(scale.par_iter())
            .for_each(|((o, c), &s)| {
                for (o, &c) in o.iter_mut().zip(c) {
                    *o = f(table[usize::from(c)] * s);
                }
            });
        out
    }
}

impl CustomOp2 for Decode {
    fn name(&self) -> &'static str {
        "fp8-decode"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        sc: &CpuStorage,
        scl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = rows_cols(l.shape())?;
        let (CpuStorage::U8(codes), CpuStorage::F32(sc)) = (s, sc) else {
            candle_core::bail!("fp8 decode: u8 codes and f32 scales wanted");
        };
        let codes = contiguous(codes, l, "codes")?;
        let sc = contiguous(sc, scl, "scales")?;
        let out = match self.0 {
            DType::F32 => CpuStorage::F32(Self::host(codes, sc, cols, |x| x)),
            DType::BF16 => CpuStorage::BF16(Self::host(codes, sc, cols, half::bf16::from_f32)),
            DType::F16 => CpuStorage::F16(Self::host(codes, sc, cols, half::f16::from_f32)),
            other => candle_core::bail!("fp8 decode: no {other:?} output (f32, bf16 or f16)"),
        };
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        sc: &candle_core::CudaStorage,
        scl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (_, cols) = rows_cols(l.shape())?;
        let out = super::fp8_cuda::decode(s, l, sc, scl, cols, self.0)?;
        Ok((out, l.shape().clone()))
    }
}

#[cfg(test)]
#[path = "fp8_tests.rs"]
mod tests;
