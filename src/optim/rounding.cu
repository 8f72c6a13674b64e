// nvcc-flags: --fmad=false
//
// Stochastic rounding of f32 values into bf16 or f16 storage: the write-back of bf16/f16 trained
// weights (src/optim/stochastic_round.rs holds the host version of the same functions, bit for bit,
// and the description). Each element rounds away from zero with probability equal to its distance
// from the value toward zero, in units of the gap between the two, so the rounding's mean is the
// f32 value. The random bits of element i are splitmix64 of (seed, i): no RNG state, the same bits
// on any grid.
//
// One thread per element, grid-stride. Entry points `stochastic_round_{bf16,f16}(out, x, seed, n)`:
// `out` the parameter's 16-bit storage (written), `x` its n f32 values, `seed` the tensor's seed for
// this step. With SDTRAIN_EMULATE defined, the file compiles as host C++ against
// tests/kernel_emu/emu.h, where the unit tests run it against the host functions.

#ifdef SDTRAIN_EMULATE
#include "emu.h"
#endif

typedef unsigned long long u64;
typedef unsigned short u16;

// splitmix64's output function at counter i + 1 of stream `seed`.
__device__ __forceinline__ u64 sr_random_bits(u64 seed, u64 i) {
  u64 z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// bf16 is f32's top half: add 16 random bits below the cut, then cut. The carry happens with
// probability (low half) / 2^16. NaN stays a quiet NaN; infinity stays infinity.
__device__ __forceinline__ u16 sr_bf16(float x, u64 r) {
  unsigned u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);
  if ((u & 0x7fffffffu) == 0x7f800000u) return (u16)(u >> 16);
  u += (unsigned)(r & 0xffffu);
  return (u16)(u >> 16);
}

// f16: |x| in units of the f16 gap at |x| (2^-24 below 2^-14, else 2^(e-10)), split into its
// whole part k and fraction f; k + 1 with probability f (24 random bits). Magnitudes past the
// largest finite f16 (65504) round to nearest, as a cast does: 65504 below 65520, else infinity.
__device__ __forceinline__ u16 sr_f16(float x, u64 r) {
  const unsigned u = __float_as_uint(x);
  const u16 s = (u16)((u >> 16) & 0x8000u);
  const unsigned abits = u & 0x7fffffffu;
  if (abits > 0x7f800000u) return (u16)(s | 0x7e00u);
  const float a = __uint_as_float(abits);
  if (a > 65504.0f) return (u16)(s | (a >= 65520.0f ? 0x7c00u : 0x7bffu));
  const int e = (int)(abits >> 23) - 127;
  const int gap = e < -14 ? -24 : e - 10;
  const float q = a * __uint_as_float((unsigned)(127 - gap) << 23);  // exact: a power of two
  const float whole = floorf(q);
  const float frac = q - whole;  // exact
  const float draw = (float)(r >> 40) * 5.9604644775390625e-08f;  // 24 bits / 2^24
  const unsigned k = (unsigned)whole + (draw < frac ? 1u : 0u);
  if (gap == -24) return (u16)(s | k);  // subnormal, or 2^-14 ≤ |x| < 2^-13 (k ≥ 1024)
  return (u16)(s | (((unsigned)(e + 15) << 10) + (k - 1024u)));
}

#define SR_KERNEL(SUFFIX, ROUND)                                                                \
  extern "C" __global__ void stochastic_round_##SUFFIX(u16* out, const float* x, u64 seed,      \
                                                       u64 n) {                                 \
    const u64 stride = (u64)gridDim.x * blockDim.x;                                             \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)                \
      out[i] = ROUND(x[i], sr_random_bits(seed, i));                                            \
  }

SR_KERNEL(bf16, sr_bf16)
SR_KERNEL(f16, sr_f16)
