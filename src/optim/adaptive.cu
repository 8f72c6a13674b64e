// nvcc-flags: --fmad=false
//
// The fused CUDA steps of the optimizers whose CPU path is written with tensor ops
// (src/optim/dense.rs): Prodigy, D-Adaptation Adam, Adan, Lion and SGD, coordinate and scalar
// DoWG, and AdaCoor. One launch per parameter tensor and pass, one pass over its values: one
// thread per element, grid-stride, in place in the parameter's own storage.
//
// The step-size estimators take two passes (src/optim/rule.rs). `<rule>_accumulate` updates the
// moments and gathers the group's sums: each thread sums its elements in f32, each block reduces
// in shared memory and writes its partial sums to `sums[block·K + k]`, and the host adds the
// blocks' sums in f64 in block order (src/optim/adaptive_cuda.rs). `<rule>_apply` then updates
// the parameter with the scalars of the new estimate. The one-pass rules have `<rule>_update`.
//
// The math is the CPU path's (src/optim/{prodigy,dadapt_*,dowg,adacoor}.rs) operation for
// operation, including candle's tensor-by-scalar form `x·a + 0` with the f64 coefficient rounded
// to f32. build.rs compiles this file with --fmad=false, so given the same scalars each element's
// result is the CPU path's bit for bit; only the sums differ, by summation order.
// src/optim/adaptive_args.rs builds every kernel's scalars from the rule's hyper-parameters and
// the step's estimate: the two files are read together.
//
// Every entry point is `<name>_<param dtype>(p, g, state…, [sums], scalars…, n)`: `p` the parameter
// (f32, bf16 or f16), `g` its f32 gradient, every state buffer of the rule in its state file's
// order whether the pass uses it or not (f32; AdaCoor's bf16), `sums` only for an accumulate pass, the scalars f32, `n` the element count. Flags are f32 scalars, 0 or 1. With
// SDTRAIN_EMULATE defined, the file compiles as host C++ against tests/kernel_emu/emu.h (bf16
// and f16 as host types that convert as CUDA does), where the unit tests run it thread by thread against the CPU path.

#ifdef SDTRAIN_EMULATE
#include "emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include "param_access.cuh"

// Threads per CUDA block (src/optim/launch.rs THREADS).
#define THREADS 256

#define GRID_STRIDE(i, n)                                                                 \
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                     \
       i += (u64)gridDim.x * blockDim.x)

// The block's sum of x (every thread of the block must call it). `red` is THREADS floats of
// shared memory, free again on return.
__device__ __forceinline__ float block_sum(float x, float* red) {
  const unsigned t = threadIdx.x;
  red[t] = x;
  __syncthreads();
  for (unsigned s = THREADS / 2; s > 0; s >>= 1) {
    if (t < s) red[t] += red[t + s];
    __syncthreads();
  }
  const float r = red[0];
  __syncthreads();
  return r;
}

// Writes the block's sums of each thread's `acc[0..K]` to `sums[blockIdx.x·K + k]`.
template <int K>
__device__ void write_sums(const float* acc, float* sums) {
  __shared__ float red[THREADS];
  for (int k = 0; k < K; ++k) {
    const float s = block_sum(acc[k], red);
    if (threadIdx.x == 0) sums[(u64)blockIdx.x * K + k] = s;
  }
}

// candle's `mix(x, a, y, b)`: `(x·a + 0) + (y·b + 0)`. The `+ 0` only turns −0 into +0.
__device__ __forceinline__ float mix(float x, float a, float y, float b) {
  return (x * a + 0.0f) + (y * b + 0.0f);
}

// ---------------------------------------------------------------- Prodigy

// Accumulate. Scalars: first (p0 ← p), active (0: the p0 snapshot alone, as when dlr ≤ 0), wd the
// coupled decay λ (0 when decoupled), b1, mw = d(1−β1), b2, vw = d²(1−β2), b3, sw.
// Sums: Σ g·(p0 − p) (the host scales it by (d/d0)·dlr), Σ |s|.
template <typename P, bool M>
__device__ void prodigy_accumulate(P* p, const float* g, float* m, float* v, float* s, float* p0,
                                   float* sums, float first, float active, float wd, float b1,
                                   float mw, float b2, float vw, float b3, float sw, u64 n) {
  float acc[2] = {0.0f, 0.0f};
  GRID_STRIDE(i, n) {
    const float pi = load_p(p, i);
    const float start = first != 0.0f ? pi : p0[i];
    p0[i] = start;
    if (active == 0.0f) continue;
    float gi = g[i];
    if (wd != 0.0f) gi = mix(gi, 1.0f, pi, wd);
    acc[0] += gi * (start - pi);
    if (M) m[i] = mix(m[i], b1, gi, mw);
    v[i] = mix(v[i], b2, gi * gi, vw);
    const float si = mix(s[i], b3, gi, sw);
    s[i] = si;
    acc[1] += fabsf(si);
  }
  write_sums<2>(acc, sums);
}

// Apply. Scalars: deps = d·ε, dlr, dd = −λ·dlr for decoupled decay (0: none); without a first
// moment (β1 = 0) wd the coupled λ and dlr_d = dlr·d.
template <typename P, bool M>
__device__ void prodigy_apply(P* p, const float* g, const float* m, const float* v, float deps,
                              float dlr, float dd, float wd, float dlr_d, u64 n) {
  GRID_STRIDE(i, n) {
    float pi = load_p(p, i);
    const float denom = sqrtf(v[i]) * 1.0f + deps;
    float dir;
    if (M) {
      dir = (m[i] / denom) * dlr + 0.0f;
    } else {
      float gi = g[i];
      if (wd != 0.0f) gi = mix(gi, 1.0f, pi, wd);
      dir = (gi / denom) * dlr_d + 0.0f;
    }
    if (dd != 0.0f) pi = mix(pi, 1.0f, pi, dd);
    store_p(p, i, pi - dir);
  }
}

// ---------------------------------------------------------------- D-Adaptation Adam

// Accumulate (the host skips it when dlr ≤ 0). Scalars: wd the coupled λ (0 when decoupled), eps,
// b1, mw = dlr(1−β1), b2, vw = 1−β2, sb2 = √β2, sw = dlr(1−√β2).
// Sums: Σ g·s/(√v + ε) (the host scales it by dlr), Σ |s|.
template <typename P>
__device__ void dadapt_adam_accumulate(P* p, const float* g, float* s, float* m, float* v,
                                       float* sums, float wd, float eps, float b1, float mw,
                                       float b2, float vw, float sb2, float sw, u64 n) {
  float acc[2] = {0.0f, 0.0f};
  GRID_STRIDE(i, n) {
    float gi = g[i];
    if (wd != 0.0f) gi = mix(gi, 1.0f, load_p(p, i), wd);
    const float denom = sqrtf(v[i]) * 1.0f + eps;
    acc[0] += gi * (s[i] / denom);
    m[i] = mix(m[i], b1, gi, mw);
    v[i] = mix(v[i], b2, gi * gi, vw);
    const float si = mix(s[i], sb2, gi, sw);
    s[i] = si;
    acc[1] += fabsf(si);
  }
  write_sums<2>(acc, sums);
}

// Apply. Scalars: eps, dd = −λ·dlr for decoupled decay (0: none).
template <typename P>
__device__ void dadapt_adam_apply(P* p, const float* g, const float* m, const float* v, float eps,
                                  float dd, u64 n) {
  GRID_STRIDE(i, n) {
    float pi = load_p(p, i);
    const float denom = sqrtf(v[i]) * 1.0f + eps;
    if (dd != 0.0f) pi = mix(pi, 1.0f, pi, dd);
    store_p(p, i, pi - m[i] / denom);
  }
}

// ---------------------------------------------------------------- D-Adaptation Adan

// Accumulate. Scalars: first (the previous gradient ← g), b1, mw = dlr(1−β1), b2, nw = dlr(1−β2),
// b3, vw = 1−β3, sw = dlr(1−β3), eps.
// Sums: Σ g²/(√v + ε), Σ s²/(√v + ε), Σ |s|.
template <typename P>
__device__ void dadapt_adan_accumulate(P* p, const float* g, float* s, float* m, float* nd,
                                       float* v, float* prev, float* sums, float first, float b1,
                                       float mw, float b2, float nw, float b3, float vw, float sw,
                                       float eps, u64 n) {
  float acc[3] = {0.0f, 0.0f, 0.0f};
  GRID_STRIDE(i, n) {
    const float gi = g[i];
    const float before = first != 0.0f ? gi : prev[i];
    prev[i] = before;
    const float diff = gi - before;
    const float u = mix(gi, 1.0f, diff, b2);
    m[i] = mix(m[i], b1, gi, mw);
    nd[i] = mix(nd[i], b2, diff, nw);
    const float vi = mix(v[i], b3, u * u, vw);
    v[i] = vi;
    const float denom = sqrtf(vi) * 1.0f + eps;
    acc[0] += (gi * gi) / denom;
    const float si = mix(s[i], b3, gi, sw);
    s[i] = si;
    acc[1] += (si * si) / denom;
    acc[2] += fabsf(si);
  }
  write_sums<3>(acc, sums);
}

// Apply. Scalars: eps, b2, no_prox, a = 1 − dlr·λ (no_prox) or 1/(1 + dlr·λ).
template <typename P>
__device__ void dadapt_adan_apply(P* p, const float* g, const float* m, const float* nd,
                                  const float* v, float* prev, float eps, float b2, float no_prox,
                                  float a, u64 n) {
  GRID_STRIDE(i, n) {
    const float pi = load_p(p, i);
    const float denom = sqrtf(v[i]) * 1.0f + eps;
    const float x = mix(m[i], 1.0f, nd[i], b2) / denom;
    store_p(p, i, no_prox != 0.0f ? (pi * a + 0.0f) - x : (pi - x) * a + 0.0f);
    prev[i] = g[i];
  }
}

// ---------------------------------------------------------------- D-Adaptation Lion

// The whole update, in the first pass. Scalars: keep = 1 − dlr·λ, b1, c1 = 1−β1, ndlr = −dlr, b2,
// mw = (1−β2)·dlr, sb2 = √β2, sw = (1−√β2)·dlr.
// Sums: Σ u·s (the host scales it by dlr), Σ |s|.
template <typename P>
__device__ void dadapt_lion_accumulate(P* p, const float* g, float* m, float* s, float* sums,
                                       float keep, float b1, float c1, float ndlr, float b2,
                                       float mw, float sb2, float sw, u64 n) {
  float acc[2] = {0.0f, 0.0f};
  GRID_STRIDE(i, n) {
    const float gi = g[i];
    const float pi = load_p(p, i) * keep + 0.0f;
    const float u = sign_of(mix(m[i], b1, gi, c1));
    m[i] = mix(m[i], b2, gi, mw);
    acc[0] += u * s[i];
    const float si = mix(s[i], sb2, u, sw);
    s[i] = si;
    acc[1] += fabsf(si);
    store_p(p, i, mix(pi, 1.0f, u, ndlr));
  }
  write_sums<2>(acc, sums);
}

// ---------------------------------------------------------------- D-Adaptation SGD

// Accumulate. Scalars: first (x0 ← p), active (0: the x0 snapshot alone), wd (λ, coupled), dlr.
// Sums: Σ g·s (the host scales it by dlr), Σ s².
template <typename P>
__device__ void dadapt_sgd_accumulate(P* p, const float* g, float* s, float* x0, float* sums,
                                      float first, float active, float wd, float dlr, u64 n) {
  float acc[2] = {0.0f, 0.0f};
  GRID_STRIDE(i, n) {
    const float pi = load_p(p, i);
    x0[i] = first != 0.0f ? pi : x0[i];
    if (active == 0.0f) continue;
    float gi = g[i];
    if (wd != 0.0f) gi = mix(gi, 1.0f, pi, wd);
    acc[0] += gi * s[i];
    const float si = mix(s[i], 1.0f, gi, dlr);
    s[i] = si;
    acc[1] += si * si;
  }
  write_sums<2>(acc, sums);
}

// Apply: p ← p·(1 − ck) + (x0 − s)·ck. Scalars: keep = 1 − ck, ck = 1 − momentum.
template <typename P>
__device__ void dadapt_sgd_apply(P* p, const float* g, const float* s, const float* x0, float keep,
                                 float ck, u64 n) {
  GRID_STRIDE(i, n) {
    store_p(p, i, mix(load_p(p, i), keep, x0[i] - s[i], ck));
  }
}

// ---------------------------------------------------------------- DoWG

// Coordinate DoWG's update. Scalars: first (x0 ← p), clip, eps.
template <typename P>
__device__ void coordinate_dowg_update(P* p, const float* g, float* x0, float* r2, float* v,
                                       float first, float clip, float eps, u64 n) {
  GRID_STRIDE(i, n) {
    const float pi = load_p(p, i);
    const float start = first != 0.0f ? pi : x0[i];
    x0[i] = start;
    const float dist = pi - start;
    const float ri = fmaxf(r2[i], dist * dist);
    r2[i] = ri;
    const float gi = g[i];
    const float vi = v[i] + ri * (gi * gi);
    v[i] = vi;
    const float clamped = fminf(fmaxf(gi, -clip), clip);
    store_p(p, i, pi - (ri * clamped) / (sqrtf(vi) * 1.0f + eps));
  }
}

// Scalar DoWG's first pass. Scalars: first (x0 ← p). Sums: Σ g², Σ (p − x0)².
template <typename P>
__device__ void scalar_dowg_accumulate(P* p, const float* g, float* x0, float* sums, float first,
                                       u64 n) {
  float acc[2] = {0.0f, 0.0f};
  GRID_STRIDE(i, n) {
    const float pi = load_p(p, i);
    const float start = first != 0.0f ? pi : x0[i];
    x0[i] = start;
    acc[0] += g[i] * g[i];
    const float dist = pi - start;
    acc[1] += dist * dist;
  }
  write_sums<2>(acc, sums);
}

// Scalar DoWG's update. Scalars: clip, r2, denom = √v + 1 − ε.
template <typename P>
__device__ void scalar_dowg_apply(P* p, const float* g, const float* x0, float clip, float r2,
                                  float denom, u64 n) {
  GRID_STRIDE(i, n) {
    const float clamped = fminf(fmaxf(g[i], -clip), clip);
    store_p(p, i, load_p(p, i) - (clamped * r2) / denom);
  }
}

// ---------------------------------------------------------------- AdaCoor

// The update, with the accumulator in bf16. Scalars: eps_b (ε rounded to bf16), eps.
template <typename P>
__device__ void adacoor_update(P* p, const float* g, __nv_bfloat16* v, float eps_b, float eps,
                               u64 n) {
  GRID_STRIDE(i, n) {
    const float gi = g[i];
    const __nv_bfloat16 added = __float2bfloat16_rn((gi * gi) * eps_b + 0.0f);
    const __nv_bfloat16 vi = __float2bfloat16_rn(__bfloat162float(v[i]) + __bfloat162float(added));
    v[i] = vi;
    const float root = __bfloat162float(__float2bfloat16_rn(sqrtf(__bfloat162float(vi))));
    const float denom = __bfloat162float(__float2bfloat16_rn(root * 1.0f + eps));
    store_p(p, i, load_p(p, i) - (gi * eps_b + 0.0f) / denom);
  }
}

// ---------------------------------------------------------------- Schedule-free AdamW

// First pass of a parameter's first step: z takes the starting point.
template <typename P>
__device__ void sf_adamw_start(P* p, const float* g, float* z, float* v, u64 n) {
  GRID_STRIDE(i, n) { z[i] = load_p(p, i); }
}

// torch's lerp(a, b, ·): a + w·(b − a) when `first`, else b + w·(b − a) with w = −(1 − c).
__device__ __forceinline__ float sf_lerp(float a, float b, float first, float w) {
  const float d = b - a;
  return first != 0.0f ? mix(a, 1.0f, d, w) : mix(b, 1.0f, d, w);
}

// Apply. Scalars: b2, vw = 1−β2, inv_bc2 = 1/(1−β2^(k+1)), eps, wd (decay at y, 0: none), the
// lerp's form and weight (sf_lerp), y_coef = lr·(β1(1−c)−1), z_coef = −lr.
template <typename P>
__device__ void sf_adamw_apply(P* p, const float* g, float* z, float* v, float b2, float vw,
                               float inv_bc2, float eps, float wd, float lerp_first, float lerp_w,
                               float y_coef, float z_coef, u64 n) {
  GRID_STRIDE(i, n) {
    const float gi = g[i];
    float yi = load_p(p, i);
    const float zi = z[i];
    const float vi = mix(v[i], b2, gi * gi, vw);
    const float denom = sqrtf(vi * inv_bc2 + 0.0f) * 1.0f + eps;
    float gn = gi / denom;
    if (wd != 0.0f) gn = mix(gn, 1.0f, yi, wd);
    yi = sf_lerp(yi, zi, lerp_first, lerp_w);
    yi = mix(yi, 1.0f, gn, y_coef);
    z[i] = mix(zi, 1.0f, gn, z_coef);
    v[i] = vi;
    store_p(p, i, yi);
  }
}

// The evaluation weights x = lerp(y, z, 1 − 1/β1) written over y (g unused).
template <typename P>
__device__ void sf_adamw_eval(P* p, const float* g, float* z, float* v, float lerp_first,
                              float lerp_w, u64 n) {
  GRID_STRIDE(i, n) { store_p(p, i, sf_lerp(load_p(p, i), z[i], lerp_first, lerp_w)); }
}

// ---------------------------------------------------------------- entry points

#define ADAPTIVE_ENTRY_POINTS(SUFFIX, P)                                                          \
  extern "C" __global__ void prodigy_accumulate_##SUFFIX(                                       \
      P* p, const float* g, float* m, float* v, float* s, float* p0, float* sums, float first,   \
      float active, float wd, float b1, float mw, float b2, float vw, float b3, float sw,        \
      u64 n) {                                                                                   \
    prodigy_accumulate<P, true>(p, g, m, v, s, p0, sums, first, active, wd, b1, mw, b2, vw, b3, \
                                sw, n);                                                          \
  }                                                                                              \
  extern "C" __global__ void prodigy_apply_##SUFFIX(                                            \
      P* p, const float* g, const float* m, const float* v, const float* s, const float* p0,     \
      float deps, float dlr, float dd, float wd, float dlr_d, u64 n) {                           \
    prodigy_apply<P, true>(p, g, m, v, deps, dlr, dd, wd, dlr_d, n);                             \
  }                                                                                              \
  extern "C" __global__ void prodigy_nom_accumulate_##SUFFIX(                                   \
      P* p, const float* g, float* v, float* s, float* p0, float* sums, float first,             \
      float active, float wd, float b1, float mw, float b2, float vw, float b3, float sw,        \
      u64 n) {                                                                                   \
    prodigy_accumulate<P, false>(p, g, nullptr, v, s, p0, sums, first, active, wd, b1, mw, b2,  \
                                 vw, b3, sw, n);                                                 \
  }                                                                                              \
  extern "C" __global__ void prodigy_nom_apply_##SUFFIX(                                        \
      P* p, const float* g, const float* v, const float* s, const float* p0, float deps,         \
      float dlr, float dd, float wd, float dlr_d, u64 n) {                                       \
    prodigy_apply<P, false>(p, g, nullptr, v, deps, dlr, dd, wd, dlr_d, n);                      \
  }                                                                                              \
  extern "C" __global__ void dadapt_adam_accumulate_##SUFFIX(                                   \
      P* p, const float* g, float* s, float* m, float* v, float* sums, float wd, float eps,      \
      float b1, float mw, float b2, float vw, float sb2, float sw, u64 n) {                       \
    dadapt_adam_accumulate(p, g, s, m, v, sums, wd, eps, b1, mw, b2, vw, sb2, sw, n);            \
  }                                                                                              \
  extern "C" __global__ void dadapt_adam_apply_##SUFFIX(P* p, const float* g, const float* s,   \
                                                        const float* m, const float* v,         \
                                                        float eps, float dd, u64 n) {           \
    dadapt_adam_apply(p, g, m, v, eps, dd, n);                                                   \
  }                                                                                              \
  extern "C" __global__ void dadapt_adan_accumulate_##SUFFIX(                                   \
      P* p, const float* g, float* s, float* m, float* nd, float* v, float* prev, float* sums,   \
      float first, float b1, float mw, float b2, float nw, float b3, float vw, float sw,         \
      float eps, u64 n) {                                                                        \
    dadapt_adan_accumulate(p, g, s, m, nd, v, prev, sums, first, b1, mw, b2, nw, b3, vw, sw,    \
                           eps, n);                                                              \
  }                                                                                              \
  extern "C" __global__ void dadapt_adan_apply_##SUFFIX(                                        \
      P* p, const float* g, const float* s, const float* m, const float* nd, const float* v,     \
      float* prev, float eps, float b2, float no_prox, float a, u64 n) {                         \
    dadapt_adan_apply(p, g, m, nd, v, prev, eps, b2, no_prox, a, n);                             \
  }                                                                                              \
  extern "C" __global__ void dadapt_lion_accumulate_##SUFFIX(                                   \
      P* p, const float* g, float* m, float* s, float* sums, float keep, float b1, float c1,      \
      float ndlr, float b2, float mw, float sb2, float sw, u64 n) {                               \
    dadapt_lion_accumulate(p, g, m, s, sums, keep, b1, c1, ndlr, b2, mw, sb2, sw, n);            \
  }                                                                                              \
  extern "C" __global__ void dadapt_sgd_accumulate_##SUFFIX(P* p, const float* g, float* s,     \
                                                            float* x0, float* sums, float first, \
                                                            float active, float wd, float dlr,  \
                                                            u64 n) {                            \
    dadapt_sgd_accumulate(p, g, s, x0, sums, first, active, wd, dlr, n);                         \
  }                                                                                              \
  extern "C" __global__ void dadapt_sgd_apply_##SUFFIX(P* p, const float* g, const float* s,    \
                                                       const float* x0, float keep, float ck,   \
                                                       u64 n) {                                 \
    dadapt_sgd_apply(p, g, s, x0, keep, ck, n);                                                  \
  }                                                                                              \
  extern "C" __global__ void coordinate_dowg_update_##SUFFIX(P* p, const float* g, float* x0,   \
                                                             float* r2, float* v, float first,  \
                                                             float clip, float eps, u64 n) {    \
    coordinate_dowg_update(p, g, x0, r2, v, first, clip, eps, n);                                \
  }                                                                                              \
  extern "C" __global__ void scalar_dowg_accumulate_##SUFFIX(P* p, const float* g, float* x0,   \
                                                             float* sums, float first, u64 n) { \
    scalar_dowg_accumulate(p, g, x0, sums, first, n);                                            \
  }                                                                                              \
  extern "C" __global__ void scalar_dowg_apply_##SUFFIX(P* p, const float* g, const float* x0,  \
                                                        float clip, float r2, float denom,      \
                                                        u64 n) {                                \
    scalar_dowg_apply(p, g, x0, clip, r2, denom, n);                                             \
  }                                                                                              \
  extern "C" __global__ void adacoor_update_##SUFFIX(P* p, const float* g, __nv_bfloat16* v,    \
                                                     float eps_b, float eps, u64 n) {           \
    adacoor_update(p, g, v, eps_b, eps, n);                                                      \
  }                                                                                              \
  extern "C" __global__ void sf_adamw_start_##SUFFIX(P* p, const float* g, float* z, float* v,  \
                                                     u64 n) {                                   \
    sf_adamw_start(p, g, z, v, n);                                                               \
  }                                                                                              \
  extern "C" __global__ void sf_adamw_apply_##SUFFIX(                                           \
      P* p, const float* g, float* z, float* v, float b2, float vw, float inv_bc2, float eps,    \
      float wd, float lerp_first, float lerp_w, float y_coef, float z_coef, u64 n) {             \
    sf_adamw_apply(p, g, z, v, b2, vw, inv_bc2, eps, wd, lerp_first, lerp_w, y_coef, z_coef, n); \
  }                                                                                              \
  extern "C" __global__ void sf_adamw_eval_##SUFFIX(P* p, const float* g, float* z, float* v,   \
                                                    float lerp_first, float lerp_w, u64 n) {    \
    sf_adamw_eval(p, g, z, v, lerp_first, lerp_w, n);                                            \
  }

ADAPTIVE_ENTRY_POINTS(f32, float)
ADAPTIVE_ENTRY_POINTS(bf16, __nv_bfloat16)
ADAPTIVE_ENTRY_POINTS(f16, __half)
