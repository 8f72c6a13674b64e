//! Stochastic rounding: how an f32 update is written back into a bf16 or f16 trained weight
//! (`weight_dtype`).
//!
//! Rounding to nearest loses every update smaller than half the gap between two bf16 values
//! (2⁻⁹ of the weight): at a learning rate of 1e-5 most of them. Stochastic rounding rounds away
//! from zero with probability equal to the value's distance from the one toward zero, in units
//! of the gap, so the rounding is unbiased (its mean is the f32 value) and small updates survive
//! on average (Gupta et al., "Deep Learning with Limited Numerical Precision", 2015; OneTrainer's
//! `bf16_stochastic_rounding.py` does the bf16 case as [`round_bf16`] does).
//!
//! The random bits come from a counter-based generator: element `i` of a tensor rounds with
//! splitmix64 of `(seed, i)`, and the seed is [`tensor_seed`] of the run's seed, the parameter's
//! name and its update count. A resumed run therefore rounds exactly as the run that never
//! stopped, and a CUDA run draws the same bits as the host ([`round_into`] launches
//! src/optim/rounding.cu, which these functions mirror operation for operation).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Result, Tensor, Var};

/// The random bits of element `i` under `seed`: splitmix64's output at counter `i + 1`.
pub fn random_bits(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_add((i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The seed of the parameter called `name` at its update number `step`, in a run seeded with
/// `run_seed`: a different stream per tensor and per step, the same on every resume.
pub fn tensor_seed(run_seed: u64, name: &str, step: u64) -> u64 {
    // FNV-1a: stable across platforms and versions, unlike std's hasher.
    let name_hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    random_bits(random_bits(run_seed, name_hash), step)
}

/// `x` rounded stochastically to bf16 with random bits `r` (the low 16 are used): bf16 is the
/// top half of an f32, so the low half plus 16 random bits carries into the top half with
/// probability (low half) / 2¹⁶. NaN stays a quiet NaN, infinity stays infinity.
pub fn round_bf16(x: f32, r: u64) -> half::bf16 {
    let u = x.to_bits();
    let magnitude = u & 0x7fff_ffff;
    let bits = if magnitude > 0x7f80_0000 {
        ((u >> 16) | 0x40) as u16
    } else if magnitude == 0x7f80_0000 {
        (u >> 16) as u16
    } else {
        // At most 0x7f7f_ffff + 0xffff: the carry never reaches the sign bit.
        ((u + (r & 0xffff) as u32) >> 16) as u16
    };
    half::bf16::from_bits(bits)
}

/// `x` rounded stochastically to f16 with random bits `r` (the top 24 are used): |x| in units of
/// the f16 gap at |x| (2⁻²⁴ below 2⁻¹⁴, else 2^(e−10)) is a whole part k and a fraction f, and
/// the result is k + 1 gaps with probability f. Past the largest finite f16 (65504) it rounds to
/// nearest as a cast does: 65504 below 65520, infinity from there.
pub fn round_f16(x: f32, r: u64) -> half::f16 {
    let u = x.to_bits();
    let sign = ((u >> 16) & 0x8000) as u16;
    let abits = u & 0x7fff_ffff;
    if abits > 0x7f80_0000 {
        return half::f16::from_bits(sign | 0x7e00);
    }
    let a = f32::from_bits(abits);
    if a > 65504.0 {
        return half::f16::from_bits(sign | if a >= 65520.0 { 0x7c00 } else { 0x7bff });
    }
    let e = (abits >> 23) as i32 - 127;
    let gap = if e < -14 { -24 } else { e - 10 };
    // Exact: a power of two, and a < 2^16.
    let q = a * f32::from_bits(((127 - gap) as u32) << 23);
    let whole = q.floor();
    let frac = q - whole;
    let draw = (r >> 40) as f32 * 5.960_464_5e-8;
    let k = whole as u32 + u32::from(draw < frac);
    let bits = if gap == -24 {
        k
    } else {
        (((e + 15) as u32) << 10) + (k - 1024)
    };
    half::f16::from_bits(sign | bits as u16)
}

/// Writes `master` (f32, the same element count) into `var` (bf16 or f16), each element rounded
/// stochastically with [`random_bits`]`(seed, i)`, in place: the model's views of `var` see the
/// new values. On the host with [`round_bf16`]/[`round_f16`]; on CUDA with src/optim/rounding.cu.
pub fn round_into(var: &Var, master: &Tensor, seed: u64) -> Result<()> {
    if master.dtype() != DType::F32 || master.elem_count() != var.elem_count() {
        candle_core::bail!(
            "stochastic rounding: {:?} source of {} values for a parameter of {}",
            master.dtype(),
            master.elem_count(),
            var.elem_count()
        );
    }
    let master = master.contiguous()?;
    var.inplace_op2(&master, &RoundInto { seed })
}

/// The in-place op behind [`round_into`].
struct RoundInto {
    seed: u64,
}

fn offsets(l: &Layout) -> Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("stochastic rounding: not contiguous".into()))
}

/// Elements per rayon task: the draws depend on the index alone, so any split rounds alike.
const CHUNK: usize = 1 << 16;

fn round_chunks<T: Send>(p: &mut [T], x: &[f32], round: impl Fn(f32, u64) -> T + Sync) {
    use rayon::prelude::*;
    p.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .enumerate()
        .for_each(|(c, (p, x))| {
            let start = (c * CHUNK) as u64;
            for (i, (p, &x)) in p.iter_mut().zip(x).enumerate() {
                *p = round(x, start + i as u64);
            }
        });
}

impl InplaceOp2 for RoundInto {
    fn name(&self) -> &'static str {
        "stochastic-round"
    }

    fn cpu_fwd(&self, p: &mut CpuStorage, pl: &Layout, x: &CpuStorage, xl: &Layout) -> Result<()> {
        let ((p0, p1), (x0, _)) = (offsets(pl)?, offsets(xl)?);
        let CpuStorage::F32(x) = x else {
            candle_core::bail!("stochastic rounding: the source is not f32");
        };
        let x = &x[x0..x0 + (p1 - p0)];
        let seed = self.seed;
        match p {
            CpuStorage::BF16(p) => round_chunks(&mut p[p0..p1], x, |x, i| {
                round_bf16(x, random_bits(seed, i))
            }),
            CpuStorage::F16(p) => {
                round_chunks(&mut p[p0..p1], x, |x, i| round_f16(x, random_bits(seed, i)))
            }
            other => candle_core::bail!(
                "stochastic rounding: a {:?} parameter (bf16 or f16 only)",
                other.dtype()
            ),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        p: &mut candle_core::CudaStorage,
        pl: &Layout,
        x: &candle_core::CudaStorage,
        xl: &Layout,
    ) -> Result<()> {
        super::rounding_cuda::launch(p, offsets(pl)?, x, offsets(xl)?, self.seed)
    }
}

#[cfg(test)]
#[path = "stochastic_round_tests.rs"]
mod tests;
