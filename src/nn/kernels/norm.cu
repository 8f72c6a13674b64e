// The fused norm and GEGLU kernels (src/nn/norm_cuda.rs launches them; the geometry is
// src/nn/norm_launch.rs). Every kernel reads its activations in their own dtype (entry-point
// suffix _f32, _bf16, _f16), computes in f32 and writes its activation-shaped output in that
// dtype, so no cast kernel runs beside it. γ, β, statistics and parameter gradients are f32.
//
// Group norm, x [B, C, HW] contiguous, G groups of N = C/G·HW consecutive elements:
//   forward:  μ = mean x;  r = 1/sqrt(var x + eps) (biased);  x̂ = (x − μ)·r;  y = γ·x̂ + β
//             fused SiLU: out = y·σ(y)
//   backward: g_y = g (fused: g·σ(y)·(1 + y·(1 − σ(y))), y recomputed);  dŷ = g_y·γ
//             dx = r·(dŷ − mean dŷ − x̂·mean(dŷ·x̂));  dγ = Σ_{b,hw} g_y·x̂;  dβ = Σ_{b,hw} g_y
//   A group is cut into chunks of `chunk` elements, one block each, grid (chunks, B·G):
//   gn_stats writes each chunk's (count, mean, centred sum of squares); gn_fwd merges them
//   (Chan et al.: M2 = Σ M2_c + n_c·(μ_c − μ)²) and normalises its chunk. Backward likewise:
//   gn_bwd_sums writes each chunk's (Σ dŷ, Σ dŷ·x̂), gn_bwd_dx merges them and writes dx;
//   gn_bwd_params (one block per channel) writes dγ, dβ, only when they are wanted.
//
// Layer norm over the last dim d of `rows` rows: the same formulas with means over a row;
// one warp per row (ln_fwd, ln_bwd_dx); dγ, dβ by a deterministic two-pass reduction
// (ln_bwd_params_part: a column tile × a chunk of rows per block; ln_bwd_params_finish).
//
// GEGLU, p = [a, z] rows of 2I → out rows of I (exact erf GELU):
//   out = a·gelu(z), gelu(z) = z·Φ(z);  da = g·gelu(z);  dz = g·a·(Φ(z) + z·φ(z))
//
// Every reduction sums in a fixed order (warp shuffles, then the warps' partials in warp order,
// then chunks in chunk order), so results do not depend on scheduling. Blocks are whole warps
// (blockDim.x·blockDim.y a multiple of 32, at most 1024). With SDTRAIN_EMULATE defined the file
// compiles as host C++ against tests/kernel_emu/emu.h (src/nn/norm_kernels.rs tests it so).

#ifdef SDTRAIN_EMULATE
#include "emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

typedef unsigned long long u64;
typedef unsigned int u32;

// ---------------------------------------------------------------- dtype loads and stores

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

__device__ __forceinline__ void store(float* p, u64 i, float x) { p[i] = x; }
__device__ __forceinline__ void store(__nv_bfloat16* p, u64 i, float x) {
  p[i] = __float2bfloat16_rn(x);
}
__device__ __forceinline__ void store(__half* p, u64 i, float x) { p[i] = __float2half_rn(x); }

// ---------------------------------------------------------------- reductions

__device__ __forceinline__ u32 umin(u32 a, u32 b) { return a < b ? a : b; }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sums a and b over the block; every thread gets the totals. Every thread of the block must call
// it (it holds two barriers).
__device__ __forceinline__ void block_sum2(float& a, float& b) {
  __shared__ float red[2][32];
  const u32 tid = threadIdx.x + blockDim.x * threadIdx.y;
  const u32 warps = blockDim.x * blockDim.y / 32;
  a = warp_sum(a);
  b = warp_sum(b);
  if (tid % 32 == 0) {
    red[0][tid / 32] = a;
    red[1][tid / 32] = b;
  }
  __syncthreads();
  a = 0.0f;
  b = 0.0f;
  for (u32 w = 0; w < warps; ++w) {
    a += red[0][w];
    b += red[1][w];
  }
  // The next call may overwrite `red` only once everyone has read it.
  __syncthreads();
}

__device__ __forceinline__ float block_sum(float a) {
  float unused = 0.0f;
  block_sum2(a, unused);
  return a;
}

// ---------------------------------------------------------------- group norm

// The shape of a group norm launch: G groups of cpg channels of hw elements; blocks of `chunk`
// elements of a group, grid (chunks, B·G).
struct GnShape {
  u32 groups, cpg, hw, chunk;
  __device__ u32 n() const { return cpg * hw; }
  __device__ u32 bg() const { return blockIdx.y; }
  __device__ u64 base() const { return (u64)bg() * n(); }
  __device__ u32 begin() const { return blockIdx.x * chunk; }
  __device__ u32 end() const { return umin(begin() + chunk, n()); }
  // The channel of element i of the block's group.
  __device__ u32 channel(u32 i) const { return bg() % groups * cpg + i / hw; }
};

template <class T>
__device__ void gn_stats(float* part, const T* x, GnShape s) {
  const u64 base = s.base();
  const u32 lo = s.begin(), hi = s.end();
  float sum = 0.0f;
  for (u32 i = lo + threadIdx.x; i < hi; i += blockDim.x) sum += to_f(x[base + i]);
  sum = block_sum(sum);
  const float count = hi > lo ? (float)(hi - lo) : 0.0f;
  const float mean = hi > lo ? sum / count : 0.0f;
  float m2 = 0.0f;
  for (u32 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const float d = to_f(x[base + i]) - mean;
    m2 += d * d;
  }
  m2 = block_sum(m2);
  if (threadIdx.x == 0) {
    float* p = part + ((u64)s.bg() * gridDim.x + blockIdx.x) * 3;
    p[0] = count;
    p[1] = mean;
    p[2] = m2;
  }
}

// The mean and 1/σ of the block's group from its chunks' partials (the same in every block of
// the group: same order of summation).
__device__ void gn_merge(const float* part, GnShape s, float eps, float& mean, float& rstd) {
  const u32 chunks = gridDim.x;
  const float* p = part + (u64)s.bg() * chunks * 3;
  const float n = (float)s.n();
  float sum = 0.0f;
  for (u32 c = threadIdx.x; c < chunks; c += blockDim.x) sum += p[3 * c] * p[3 * c + 1];
  mean = block_sum(sum) / n;
  float m2 = 0.0f;
  for (u32 c = threadIdx.x; c < chunks; c += blockDim.x) {
    const float d = p[3 * c + 1] - mean;
    m2 += p[3 * c + 2] + p[3 * c] * d * d;
  }
  rstd = 1.0f / sqrtf(block_sum(m2) / n + eps);
}

__device__ __forceinline__ float sigmoid(float y) { return 1.0f / (1.0f + expf(-y)); }

template <class T>
__device__ void gn_fwd(T* y, float* mean_out, float* rstd_out, const T* x, const float* gamma,
                       const float* beta, const float* part, GnShape s, float eps, u32 silu) {
  float mean, rstd;
  gn_merge(part, s, eps, mean, rstd);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    mean_out[s.bg()] = mean;
    rstd_out[s.bg()] = rstd;
  }
  const u64 base = s.base();
  for (u32 i = s.begin() + threadIdx.x; i < s.end(); i += blockDim.x) {
    const u32 ch = s.channel(i);
    float v = (to_f(x[base + i]) - mean) * rstd * gamma[ch] + beta[ch];
    if (silu) v = v * sigmoid(v);
    store(y, base + i, v);
  }
}

// The gradient at the norm's output y = γ·x̂ + β: g, or through the fused SiLU.
__device__ __forceinline__ float grad_y(float g, float xhat, float gamma, float beta, u32 silu) {
  if (!silu) return g;
  const float y = gamma * xhat + beta;
  const float sg = sigmoid(y);
  return g * sg * (1.0f + y * (1.0f - sg));
}

template <class T>
__device__ void gn_bwd_sums(float* part, const T* x, const T* g, const float* gamma,
                            const float* beta, const float* mean, const float* rstd, GnShape s,
                            u32 silu) {
  const u64 base = s.base();
  const float mu = mean[s.bg()], r = rstd[s.bg()];
  float sdy = 0.0f, sdyx = 0.0f;
  for (u32 i = s.begin() + threadIdx.x; i < s.end(); i += blockDim.x) {
    const u32 ch = s.channel(i);
    const float xhat = (to_f(x[base + i]) - mu) * r;
    const float dy = grad_y(to_f(g[base + i]), xhat, gamma[ch], beta[ch], silu) * gamma[ch];
    sdy += dy;
    sdyx += dy * xhat;
  }
  block_sum2(sdy, sdyx);
  if (threadIdx.x == 0) {
    float* p = part + ((u64)s.bg() * gridDim.x + blockIdx.x) * 2;
    p[0] = sdy;
    p[1] = sdyx;
  }
}

template <class T>
__device__ void gn_bwd_dx(T* dx, const T* x, const T* g, const float* gamma, const float* beta,
                          const float* mean, const float* rstd, const float* part, GnShape s,
                          u32 silu) {
  const u32 chunks = gridDim.x;
  const float* p = part + (u64)s.bg() * chunks * 2;
  float sdy = 0.0f, sdyx = 0.0f;
  for (u32 c = threadIdx.x; c < chunks; c += blockDim.x) {
    sdy += p[2 * c];
    sdyx += p[2 * c + 1];
  }
  block_sum2(sdy, sdyx);
  const float n = (float)s.n();
  const float mdy = sdy / n, mdyx = sdyx / n;
  const float mu = mean[s.bg()], r = rstd[s.bg()];
  const u64 base = s.base();
  for (u32 i = s.begin() + threadIdx.x; i < s.end(); i += blockDim.x) {
    const u32 ch = s.channel(i);
    const float xhat = (to_f(x[base + i]) - mu) * r;
    const float dy = grad_y(to_f(g[base + i]), xhat, gamma[ch], beta[ch], silu) * gamma[ch];
    store(dx, base + i, r * (dy - mdy - xhat * mdyx));
  }
}

// dγ (dparams[0..C]) and dβ (dparams[C..2C]): block c sums channel c over the batch and hw.
template <class T>
__device__ void gn_bwd_params(float* dparams, const T* x, const T* g, const float* gamma,
                              const float* beta, const float* mean, const float* rstd, u32 batch,
                              u32 channels, u32 groups, u32 hw, u32 silu) {
  const u32 ch = blockIdx.x;
  const u32 grp = ch / (channels / groups);
  float sg = 0.0f, sb = 0.0f;
  for (u32 b = 0; b < batch; ++b) {
    const u32 bg = b * groups + grp;
    const float mu = mean[bg], r = rstd[bg];
    const u64 base = ((u64)b * channels + ch) * hw;
    for (u32 j = threadIdx.x; j < hw; j += blockDim.x) {
      const float xhat = (to_f(x[base + j]) - mu) * r;
      const float gy = grad_y(to_f(g[base + j]), xhat, gamma[ch], beta[ch], silu);
      sg += gy * xhat;
      sb += gy;
    }
  }
  block_sum2(sg, sb);
  if (threadIdx.x == 0) {
    dparams[ch] = sg;
    dparams[channels + ch] = sb;
  }
}

// ---------------------------------------------------------------- layer norm

// One warp per row: rows blockIdx.x·warps + warp. A warp past the last row leaves as a whole
// (these kernels hold no block barrier).
__device__ __forceinline__ u32 ln_row() { return blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; }

template <class T>
__device__ void ln_fwd(T* y, float* mean_out, float* rstd_out, const T* x, const float* gamma,
                       const float* beta, u32 rows, u32 d, float eps) {
  const u32 row = ln_row(), lane = threadIdx.x % 32;
  if (row >= rows) return;
  const u64 base = (u64)row * d;
  float sum = 0.0f;
  for (u32 j = lane; j < d; j += 32) sum += to_f(x[base + j]);
  const float mean = warp_sum(sum) / (float)d;
  float m2 = 0.0f;
  for (u32 j = lane; j < d; j += 32) {
    const float c = to_f(x[base + j]) - mean;
    m2 += c * c;
  }
  const float rstd = 1.0f / sqrtf(warp_sum(m2) / (float)d + eps);
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  for (u32 j = lane; j < d; j += 32) {
    store(y, base + j, (to_f(x[base + j]) - mean) * rstd * gamma[j] + beta[j]);
  }
}

template <class T>
__device__ void ln_bwd_dx(T* dx, const T* x, const T* g, const float* gamma, const float* mean,
                          const float* rstd, u32 rows, u32 d) {
  const u32 row = ln_row(), lane = threadIdx.x % 32;
  if (row >= rows) return;
  const u64 base = (u64)row * d;
  const float mu = mean[row], r = rstd[row];
  float sdy = 0.0f, sdyx = 0.0f;
  for (u32 j = lane; j < d; j += 32) {
    const float dy = to_f(g[base + j]) * gamma[j];
    sdy += dy;
    sdyx += dy * (to_f(x[base + j]) - mu) * r;
  }
  const float mdy = warp_sum(sdy) / (float)d, mdyx = warp_sum(sdyx) / (float)d;
  for (u32 j = lane; j < d; j += 32) {
    const float xhat = (to_f(x[base + j]) - mu) * r;
    const float dy = to_f(g[base + j]) * gamma[j];
    store(dx, base + j, r * (dy - mdy - xhat * mdyx));
  }
}

// Block (32, by ≤ 32), grid (⌈d/32⌉, chunks): block (i, c) sums columns 32i.. over rows
// [c·rows_per_chunk, (c+1)·rows_per_chunk) into part[c][0][col] (Σ g·x̂) and part[c][1][col] (Σ g).
template <class T>
__device__ void ln_bwd_params_part(float* part, const T* x, const T* g, const float* mean,
                                   const float* rstd, u32 rows, u32 d, u32 rows_per_chunk) {
  __shared__ float red[2][32][33];
  const u32 tx = threadIdx.x, ty = threadIdx.y;
  const u32 col = blockIdx.x * 32 + tx;
  const u32 r0 = blockIdx.y * rows_per_chunk;
  const u32 r1 = umin(r0 + rows_per_chunk, rows);
  float sg = 0.0f, sb = 0.0f;
  if (col < d) {
    for (u32 r = r0 + ty; r < r1; r += blockDim.y) {
      const u64 i = (u64)r * d + col;
      const float gv = to_f(g[i]);
      sg += gv * (to_f(x[i]) - mean[r]) * rstd[r];
      sb += gv;
    }
  }
  red[0][ty][tx] = sg;
  red[1][ty][tx] = sb;
  __syncthreads();
  if (ty == 0 && col < d) {
    float a = 0.0f, b = 0.0f;
    for (u32 k = 0; k < blockDim.y; ++k) {
      a += red[0][k][tx];
      b += red[1][k][tx];
    }
    part[((u64)blockIdx.y * 2) * d + col] = a;
    part[((u64)blockIdx.y * 2 + 1) * d + col] = b;
  }
}

// dγ (dparams[0..d]) and dβ (dparams[d..2d]): the chunks' partials summed in chunk order.
__device__ void ln_params_finish(float* dparams, const float* part, u32 chunks, u32 d) {
  const u32 col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= d) return;
  float a = 0.0f, b = 0.0f;
  for (u32 c = 0; c < chunks; ++c) {
    a += part[((u64)c * 2) * d + col];
    b += part[((u64)c * 2 + 1) * d + col];
  }
  dparams[col] = a;
  dparams[d + col] = b;
}

// ---------------------------------------------------------------- GEGLU

// Φ(z) and φ(z), the standard normal CDF and density.
__device__ __forceinline__ float normal_cdf(float z) {
  return 0.5f * (1.0f + erff(z * 0.70710678118654752f));
}
__device__ __forceinline__ float normal_pdf(float z) {
  return expf(-0.5f * z * z) * 0.39894228040143268f;
}

// Grid-stride over the n = rows·inner outputs.
template <class T>
__device__ void geglu_fwd(T* out, const T* p, u64 n, u32 inner) {
  for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (u64)gridDim.x * blockDim.x) {
    const u64 row = k / inner, j = k - row * inner;
    const u64 a_at = row * 2 * inner + j;
    const float a = to_f(p[a_at]), z = to_f(p[a_at + inner]);
    store(out, k, a * z * normal_cdf(z));
  }
}

template <class T>
__device__ void geglu_bwd(T* dp, const T* p, const T* g, u64 n, u32 inner) {
  for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (u64)gridDim.x * blockDim.x) {
    const u64 row = k / inner, j = k - row * inner;
    const u64 a_at = row * 2 * inner + j;
    const float a = to_f(p[a_at]), z = to_f(p[a_at + inner]), gv = to_f(g[k]);
    const float cdf = normal_cdf(z);
    store(dp, a_at, gv * z * cdf);
    store(dp, a_at + inner, gv * a * (cdf + z * normal_pdf(z)));
  }
}

// ---------------------------------------------------------------- entry points

#define ENTRY_POINTS(SUFFIX, T)                                                                   \
  extern "C" __global__ void gn_stats_##SUFFIX(float* part, const T* x, u32 groups, u32 cpg,     \
                                               u32 hw, u32 chunk) {                               \
    gn_stats(part, x, GnShape{groups, cpg, hw, chunk});                                          \
  }                                                                                               \
  extern "C" __global__ void gn_fwd_##SUFFIX(T* y, float* mean, float* rstd, const T* x,          \
                                             const float* gamma, const float* beta,               \
                                             const float* part, u32 groups, u32 cpg, u32 hw,      \
                                             u32 chunk, float eps, u32 silu) {                    \
    gn_fwd(y, mean, rstd, x, gamma, beta, part, GnShape{groups, cpg, hw, chunk}, eps, silu);     \
  }                                                                                               \
  extern "C" __global__ void gn_bwd_sums_##SUFFIX(                                                \
      float* part, const T* x, const T* g, const float* gamma, const float* beta,                 \
      const float* mean, const float* rstd, u32 groups, u32 cpg, u32 hw, u32 chunk, u32 silu) {   \
    gn_bwd_sums(part, x, g, gamma, beta, mean, rstd, GnShape{groups, cpg, hw, chunk}, silu);     \
  }                                                                                               \
  extern "C" __global__ void gn_bwd_dx_##SUFFIX(                                                  \
      T* dx, const T* x, const T* g, const float* gamma, const float* beta, const float* mean,    \
      const float* rstd, const float* part, u32 groups, u32 cpg, u32 hw, u32 chunk, u32 silu) {   \
    gn_bwd_dx(dx, x, g, gamma, beta, mean, rstd, part, GnShape{groups, cpg, hw, chunk}, silu);   \
  }                                                                                               \
  extern "C" __global__ void gn_bwd_params_##SUFFIX(                                              \
      float* dparams, const T* x, const T* g, const float* gamma, const float* beta,              \
      const float* mean, const float* rstd, u32 batch, u32 channels, u32 groups, u32 hw,          \
      u32 silu) {                                                                                 \
    gn_bwd_params(dparams, x, g, gamma, beta, mean, rstd, batch, channels, groups, hw, silu);    \
  }                                                                                               \
  extern "C" __global__ void ln_fwd_##SUFFIX(T* y, float* mean, float* rstd, const T* x,          \
                                             const float* gamma, const float* beta, u32 rows,     \
                                             u32 d, float eps) {                                  \
    ln_fwd(y, mean, rstd, x, gamma, beta, rows, d, eps);                                          \
  }                                                                                               \
  extern "C" __global__ void ln_bwd_dx_##SUFFIX(T* dx, const T* x, const T* g,                    \
                                                const float* gamma, const float* mean,            \
                                                const float* rstd, u32 rows, u32 d) {             \
    ln_bwd_dx(dx, x, g, gamma, mean, rstd, rows, d);                                              \
  }                                                                                               \
  extern "C" __global__ void ln_bwd_params_part_##SUFFIX(float* part, const T* x, const T* g,     \
                                                         const float* mean, const float* rstd,    \
                                                         u32 rows, u32 d, u32 rows_per_chunk) {   \
    ln_bwd_params_part(part, x, g, mean, rstd, rows, d, rows_per_chunk);                          \
  }                                                                                               \
  extern "C" __global__ void geglu_fwd_##SUFFIX(T* out, const T* p, u64 n, u32 inner) {           \
    geglu_fwd(out, p, n, inner);                                                                  \
  }                                                                                               \
  extern "C" __global__ void geglu_bwd_##SUFFIX(T* dp, const T* p, const T* g, u64 n, u32 inner) { \
    geglu_bwd(dp, p, g, n, inner);                                                                \
  }

ENTRY_POINTS(f32, float)
ENTRY_POINTS(bf16, __nv_bfloat16)
ENTRY_POINTS(f16, __half)

extern "C" __global__ void ln_bwd_params_finish(float* dparams, const float* part, u32 chunks,
                                                u32 d) {
  ln_params_finish(dparams, part, chunks, d);
}
