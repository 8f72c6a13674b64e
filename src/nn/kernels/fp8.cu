// nvcc-flags: --fmad=false
//
// The fp8 frozen base (src/nn/fp8.rs holds the host version of the same functions, bit for bit,
// and the description): weights stored as e4m3 codes (torch.float8_e4m3fn: 1 sign, 4 exponent
// bits with bias 7, 3 mantissa bits, no infinity, 0x7f/0xff NaN, largest finite 448) with an f32
// scale per output channel (row).
//
//   fp8_row_scale_T(scale, w, rows, cols): scale[r] = max_j |w[r, j]| / 448 (1 for a zero row;
//       NaN or infinity when the row holds one, which the host turns into an error). One warp
//       per row.
//   fp8_encode_T(codes, w, scale, n, cols): codes[i] = e4m3(w[i] / scale[i / cols]), rounded to
//       nearest even, magnitudes past 448 (infinity included) saturated to 448, as torch's cast.
//   fp8_decode_T(out, codes, scale, n, cols): out[i] = T(decode(codes[i]) * scale[i / cols]), the
//       product in f32, rounded once to T.
//
// T is the weight's (or the output's) dtype: suffix _f32, _bf16, _f16. With SDTRAIN_EMULATE the
// file compiles as host C++ against tests/kernel_emu/emu.h.

#ifdef SDTRAIN_EMULATE
#include "emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned char u8;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

__device__ __forceinline__ void store(float* p, u64 i, float x) { p[i] = x; }
__device__ __forceinline__ void store(__nv_bfloat16* p, u64 i, float x) {
  p[i] = __float2bfloat16_rn(x);
}
__device__ __forceinline__ void store(__half* p, u64 i, float x) { p[i] = __float2half_rn(x); }

__device__ __forceinline__ u8 e4m3_encode(float v) {
  const unsigned u = __float_as_uint(v);
  const u8 sign = (u8)((u >> 24) & 0x80u);
  const unsigned a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (u8)(sign | 0x7fu);  // NaN
  if (a >= 0x43e00000u) return (u8)(sign | 0x7eu);  // 448 and beyond: saturate
  if (a < 0x3c800000u) {
    // Below 2^-6: the subnormals, in units of 2^-9 (the product is exact); 8 units is 2^-6,
    // whose code is 8 as well.
    const float q = rintf(__uint_as_float(a) * 512.0f);
    return (u8)(sign | (u32)q);
  }
  // A normal: the f32 exponent and top 3 mantissa bits, rounded to nearest even, rebiased.
  const unsigned r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  const unsigned code = r - ((127u - 7u) << 3);
  return (u8)(sign | (code > 0x7eu ? 0x7eu : code));
}

__device__ __forceinline__ float e4m3_decode(u8 c) {
  const unsigned e = (c >> 3) & 0xfu, m = c & 7u;
  float a;
  if ((c & 0x7fu) == 0x7fu) {
    a = __uint_as_float(0x7fc00000u);
  } else if (e == 0) {
    a = (float)m * 0.001953125f;  // m · 2^-9, exact
  } else {
    a = __uint_as_float(((e + 120u) << 23) | (m << 20));
  }
  return (c & 0x80u) ? -a : a;
}

// The larger of a and b where a NaN wins: a NaN anywhere in a row makes its scale NaN.
__device__ __forceinline__ float max_nan(float a, float b) { return (b > a || b != b) ? b : a; }

template <class T>
__device__ void row_scale(float* scale, const T* w, u32 rows, u32 cols) {
  const u32 warps = blockDim.x / 32;
  const u32 lane = threadIdx.x % 32;
  for (u32 row = blockIdx.x * warps + threadIdx.x / 32; row < rows; row += gridDim.x * warps) {
    const u64 base = (u64)row * cols;
    float m = 0.0f;
    for (u32 j = lane; j < cols; j += 32) m = max_nan(m, fabsf(to_f(w[base + j])));
    for (int o = 16; o > 0; o >>= 1) m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) scale[row] = m == 0.0f ? 1.0f : m / 448.0f;
  }
}

template <class T>
__device__ void encode(u8* codes, const T* w, const float* scale, u64 n, u32 cols) {
  const u64 stride = (u64)gridDim.x * blockDim.x;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    codes[i] = e4m3_encode(to_f(w[i]) / scale[i / cols]);
}

template <class T>
__device__ void decode(T* out, const u8* codes, const float* scale, u64 n, u32 cols) {
  const u64 stride = (u64)gridDim.x * blockDim.x;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    store(out, i, e4m3_decode(codes[i]) * scale[i / cols]);
}

#define ENTRY_POINTS(SUFFIX, T)                                                                  \
  extern "C" __global__ void fp8_row_scale_##SUFFIX(float* scale, const T* w, u32 rows,          \
                                                    u32 cols) {                                  \
    row_scale(scale, w, rows, cols);                                                             \
  }                                                                                              \
  extern "C" __global__ void fp8_encode_##SUFFIX(u8* codes, const T* w, const float* scale,      \
                                                 u64 n, u32 cols) {                              \
    encode(codes, w, scale, n, cols);                                                            \
  }                                                                                              \
  extern "C" __global__ void fp8_decode_##SUFFIX(T* out, const u8* codes, const float* scale,     \
                                                 u64 n, u32 cols) {                              \
    decode(out, codes, scale, n, cols);                                                          \
  }

ENTRY_POINTS(f32, float)
ENTRY_POINTS(bf16, __nv_bfloat16)
ENTRY_POINTS(f16, __half)
