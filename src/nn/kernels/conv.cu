// im2col and col2im for 2-D convolution on CUDA as cuBLAS GEMMs (src/nn/conv_cuda.rs launches
// them). For x [B, C, H, W], a k_h × k_w kernel, padding p, stride s and output G_h × G_w
// (N = G_h·G_w pixels per image, K = C·k_h·k_w rows):
//
//   cols[(c, u, v), (b, oy, ox)] = x[b, c, oy·s + u − p, ox·s + v − p]   (0 outside)   im2col
//   (for the forward, possibly of a chunk of output rows: columns (b, oy − row0, ox))
//   y = W · cols  ([C_out, K] · [K, B·N]: every image in one GEMM, NCHW out for B = 1)
//   ∂L/∂W = G · colsᵀ  (G: [C_out, B·N])
//   ∂L/∂x = col2im(Wᵀ · G): each x element sums the (at most k_h·k_w) column entries im2col read
//   it into; a gather per output element, so no atomics and a fixed summation order. A large
//   conv's input gradient is built a band of input rows at a time (the columns of the output
//   rows reaching the band; src/nn/conv_windows.rs), its weight gradient a band of output rows
//   at a time (im2col of a chunk of rows).
//
// The rows are ordered (c, u, v) as the weight's [C_out, C, k_h, k_w] layout flattens, the
// columns (b, oy, ox): the layout of src/nn/im2col.rs (the CPU's, per image) with the images
// side by side. Candle's own CUDA im2col writes [B, N, K] and its GEMM gives [B, N, C_out], which
// then needs a transpose copy to NCHW; this layout needs none, and the input gradient needs no
// flipped, padded copy of the kernel either.
//
// One thread per output element, grid-stride. In im2col consecutive threads write consecutive
// columns (coalesced) and read x along a row (coalesced at stride 1); in col2im consecutive
// threads write consecutive x columns and read each column run of `cols` in order. Sums are in
// f32, rounded once to the output dtype. With SDTRAIN_EMULATE defined the file compiles as host
// C++ against tests/kernel_emu/emu.h (src/nn/conv_kernels.rs tests it so).

#ifdef SDTRAIN_EMULATE
#include "emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

typedef unsigned long long u64;
typedef unsigned int u32;

__device__ __forceinline__ float cv_to_f(float x) { return x; }
__device__ __forceinline__ float cv_to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float cv_to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ void cv_from_f(float* p, float x) { *p = x; }
__device__ __forceinline__ void cv_from_f(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void cv_from_f(__half* p, float x) { *p = __float2half_rn(x); }

// The geometry, as the launches pass it (every field a u32).
struct ConvGeo {
  u32 batch, c, h, w, kh, kw, gh, gw, pad, stride;
};

// im2col of output rows [row0, row0 + rows) only: columns (b, oy − row0, ox), so a large conv's
// forward can take its columns in chunks of rows (the whole: row0 0, rows gh).
template <class T>
__device__ void im2col(T* cols, const T* x, ConvGeo g, u32 row0, u32 rows) {
  const u64 n = (u64)rows * g.gw;
  const u64 bn = (u64)g.batch * n;
  const u64 total = (u64)g.c * g.kh * g.kw * bn;
  const u64 step = (u64)gridDim.x * blockDim.x;
  for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += step) {
    const u64 row = e / bn, col = e % bn;
    const u32 b = (u32)(col / n), pix = (u32)(col % n);
    const u32 oy = row0 + pix / g.gw, ox = pix % g.gw;
    const u32 v = (u32)(row % g.kw), u = (u32)((row / g.kw) % g.kh), c = (u32)(row / ((u64)g.kh * g.kw));
    const long long iy = (long long)oy * g.stride + u - g.pad;
    const long long ix = (long long)ox * g.stride + v - g.pad;
    T val;
    cv_from_f(&val, 0.0f);
    if (iy >= 0 && iy < g.h && ix >= 0 && ix < g.w) {
      val = x[(((u64)b * g.c + c) * g.h + (u64)iy) * g.w + (u64)ix];
    }
    cols[e] = val;
  }
}

// col2im of a band (src/nn/conv_windows.rs): input rows [y0, y0 + ys) of every image and
// channel (x: [B, C, ys, W]) from the columns of output rows [oy0, oy0 + oys) (cols: [K,
// B·oys·G_w], columns (b, oy − oy0, ox)). With the output rows reaching the band, each element
// is complete; the whole: y0 0, ys h, oy0 0, oys gh.
template <class T>
__device__ void col2im(T* x, const T* cols, ConvGeo g, u32 y0, u32 ys, u32 oy0, u32 oys) {
  const u64 n = (u64)oys * g.gw;
  const u64 bn = (u64)g.batch * n;
  const u64 total = (u64)g.batch * g.c * ys * g.w;
  const u64 step = (u64)gridDim.x * blockDim.x;
  for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += step) {
    const u32 xx = (u32)(e % g.w), y = y0 + (u32)((e / g.w) % ys);
    const u64 bc = e / ((u64)g.w * ys);
    const u32 c = (u32)(bc % g.c), b = (u32)(bc / g.c);
    float acc = 0.0f;
    for (u32 u = 0; u < g.kh; ++u) {
      const long long ty = (long long)y + g.pad - u;
      if (ty < 0 || ty % g.stride != 0) continue;
      const long long oy = ty / g.stride;
      if (oy < oy0 || oy >= (long long)oy0 + oys) continue;
      for (u32 v = 0; v < g.kw; ++v) {
        const long long tx = (long long)xx + g.pad - v;
        if (tx < 0 || tx % g.stride != 0) continue;
        const long long ox = tx / g.stride;
        if (ox >= g.gw) continue;
        const u64 row = ((u64)c * g.kh + u) * g.kw + v;
        acc += cv_to_f(cols[row * bn + (u64)b * n + (u64)(oy - oy0) * g.gw + (u64)ox]);
      }
    }
    cv_from_f(&x[e], acc);
  }
}

#define CONV_ENTRY_POINTS(SUFFIX, T)                                                              \
  extern "C" __global__ void conv_im2col_##SUFFIX(T* cols, const T* x, u32 batch, u32 c, u32 h,  \
                                                  u32 w, u32 kh, u32 kw, u32 gh, u32 gw,          \
                                                  u32 pad, u32 stride, u32 row0, u32 rows) {      \
    im2col(cols, x, ConvGeo{batch, c, h, w, kh, kw, gh, gw, pad, stride}, row0, rows);            \
  }                                                                                               \
  extern "C" __global__ void conv_col2im_##SUFFIX(T* x, const T* cols, u32 batch, u32 c, u32 h,  \
                                                  u32 w, u32 kh, u32 kw, u32 gh, u32 gw,          \
                                                  u32 pad, u32 stride, u32 y0, u32 ys, u32 oy0,   \
                                                  u32 oys) {                                      \
    col2im(x, cols, ConvGeo{batch, c, h, w, kh, kw, gh, gw, pad, stride}, y0, ys, oy0, oys);      \
  }

CONV_ENTRY_POINTS(f32, float)
CONV_ENTRY_POINTS(bf16, __nv_bfloat16)
CONV_ENTRY_POINTS(f16, __half)
