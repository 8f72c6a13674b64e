// Flash attention, forward and backward: Dao, "FlashAttention-2: Faster Attention with Better
// Parallelism and Work Partitioning", arXiv 2307.08691 (Algorithms 1 and 2).
//
// For one head, q [Lq, D], k, v [Lk, D] (row-major, heads contiguous: [BH, L, D]) and scale s:
//
//   forward, per query tile (BQ rows), K/V tiles of BK rows streamed through shared memory:
//     S = s·Q·Kᵀ (f32);  m' = max(m, rowmax S);  P̃ = exp(S − m');  α = exp(m − m')
//     l = α·l + rowsum P̃;  acc = α·acc + P̃·V;  m = m'
//     O = acc / l (input dtype);  L = m + ln l (f32, saved for backward)
//   backward:
//     Dr = rowsum(dO ∘ O)                                  (flash_dot_*, one warp per row)
//     per K/V tile (one block), looping over query tiles (flash_bwd_*):
//       P = exp(s·Q·Kᵀ − L);  dV += Pᵀ·dO;  dP = dO·Vᵀ;  dS = P ∘ (dP − Dr)·s
//       dK += dSᵀ·Q (registers);  dQ += dS·K (f32 atomicAdd into a zeroed [BH, Lq, D] buffer)
//
// dQ by atomics (FA2's choice) rather than a second pass over query tiles: a dQ pass would
// recompute S and dP (two more tile matmuls of the five), while the atomics cost one f32 add per
// dQ element per K/V tile, spread over L2. The sum order, and so dQ's last bits, vary run to run.
//
// Scores, probabilities and every accumulator are f32 whatever the input dtype; tiles are held in
// shared memory as f32. Entry points exist per dtype (suffix _f32, _bf16, _f16) and head-dim
// bucket (40, 64, 80, 160: SD1.5's 40/80/160 and SD2/SDXL's 64): a bucket takes any head dim up
// to it, the tiles zero-padded. The tile matmuls are plain SIMT loops over shared memory (no
// tensor cores yet). Thread layout, for a tile of rows × columns with NT = 128 threads: a thread
// owns rows warp + 4·i and columns lane + 32·c, so the 32 lanes of a warp share their rows (a
// row reduction is a warp shuffle, a row operand a shared-memory broadcast).
//
// Tiles: the forward has 32 queries per block (a block per query tile and head) and streams K,
// then V, through one 32-row shared tile; the backward has BK keys per block (32; 16 at head dim
// 160) and steps over queries 16 at a time. Static shared memory, forward / backward, at head
// dims 40, 64, 80, 160: 14.7/20.2, 20.9/29.4, 25.0/35.6, 45.4/43.5 KB (ptxas, sm_90; no spills,
// 82–127 registers).
//
// `causal` masks key j > query i (CLIP's text encoder). Rows past Lq and keys past Lk (ragged
// tails) are masked: their scores are −∞, their probabilities 0, and nothing is written for them.
// In the backward the tail masks are defensive: the zero-filled tail rows of K, V, Q and dO
// already make their contributions 0 (dQ gains dS·0, dK and dV gain P·0), so planting their
// removal changes no result; the forward's key-tail mask is what keeps them out of the softmax.
//
// With SDTRAIN_EMULATE the file compiles as host C++ against tests/kernel_emu/emu.h, where the
// unit tests (src/nn/flash_attention.rs) run its entry points (f16's Dr for the tensor-core tests).

#ifdef SDTRAIN_EMULATE
#include "emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#define FA_THREADS 128
#define FA_WARPS (FA_THREADS / 32)
#define FA_NEG_INF (-INFINITY)

// ---------------------------------------------------------------- loads and stores

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ void from_f(float* p, float x) { *p = x; }
__device__ __forceinline__ void from_f(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void from_f(__half* p, float x) { *p = __float2half_rn(x); }

// Rows [row0, row0 + ROWS) of a [rows, d] matrix into an f32 tile of stride LD = DM + 1 (odd, so
// that lanes reading one column of consecutive rows hit distinct banks); rows past `rows` and
// columns past `d` are zero.
template <int ROWS, int DM, class T>
__device__ void load_tile(float (*tile)[DM + 1], const T* src, int row0, int rows, int d) {
  for (int e = threadIdx.x; e < ROWS * DM; e += FA_THREADS) {
    const int r = e / DM, c = e % DM;
    const int g = row0 + r;
    tile[r][c] = (g < rows && c < d) ? to_f(src[(long long)g * d + c]) : 0.0f;
  }
}

// ---------------------------------------------------------------- warp reductions

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// ---------------------------------------------------------------- tile matmuls (SIMT)

// out[i] = Σ_d a[row_i][d]·b[col][d] for this thread's rows row_i = warp + 4·i (i < R) and column
// `col`: a score tile a·bᵀ, one column per lane.
template <int R, int DM>
__device__ __forceinline__ void tile_abt(float (&out)[R], const float (*a)[DM + 1],
                                         const float (*b)[DM + 1], int warp, int col) {
#pragma unroll
  for (int i = 0; i < R; ++i) out[i] = 0.0f;
  for (int d = 0; d < DM; ++d) {
    const float bv = b[col][d];
#pragma unroll
    for (int i = 0; i < R; ++i) out[i] += a[warp + FA_WARPS * i][d] * bv;
  }
}

// acc[i][c] += Σ_j p[row_i][j]·m[j][lane + 32·c] over j < J: an accumulator tile (rows × DM)
// plus a probability tile times a value tile. `p` has stride PS (J + 1), `m` stride DM + 1.
template <int R, int NC, int J, int PS, int DM>
__device__ __forceinline__ void tile_acc_pm(float (&acc)[R][NC], const float (*p)[PS],
                                            const float (*m)[DM + 1], int warp, int lane) {
  for (int j = 0; j < J; ++j) {
    float mv[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) mv[c] = (lane + 32 * c < DM) ? m[j][lane + 32 * c] : 0.0f;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const float pv = p[warp + FA_WARPS * i][j];
#pragma unroll
      for (int c = 0; c < NC; ++c) acc[i][c] += pv * mv[c];
    }
  }
}

// acc[i][c] = Σ_j pt[j][row_i]·m[j][lane + 32·c] over j < J: as tile_acc_pm with the
// probability tile transposed (pt is [J][rows], stride PS).
template <int R, int NC, int J, int PS, int DM>
__device__ __forceinline__ void tile_ptm(float (&acc)[R][NC], const float (*pt)[PS],
                                         const float (*m)[DM + 1], int warp, int lane) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[i][c] = 0.0f;
  for (int j = 0; j < J; ++j) {
    float mv[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) mv[c] = (lane + 32 * c < DM) ? m[j][lane + 32 * c] : 0.0f;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const float pv = pt[j][warp + FA_WARPS * i];
#pragma unroll
      for (int c = 0; c < NC; ++c) acc[i][c] += pv * mv[c];
    }
  }
}

// ---------------------------------------------------------------- forward

// One block: query tile blockIdx.x of head blockIdx.y. BQ = BK = 32 (a key column per lane).
template <class T, int DM>
__device__ void flash_fwd(const T* q, const T* k, const T* v, T* o, float* lse, float scale,
                          int lq, int lk, int d, int causal) {
  constexpr int BQ = 32, BK = 32, R = BQ / FA_WARPS, NC = (DM + 31) / 32;
  __shared__ float sQ[BQ][DM + 1];
  __shared__ float sKV[BK][DM + 1];
  __shared__ float sP[BQ][BK + 1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long bh = blockIdx.y;
  const int q0 = blockIdx.x * BQ;
  q += bh * lq * d;
  k += bh * lk * d;
  v += bh * lk * d;
  load_tile<BQ, DM>(sQ, q, q0, lq, d);

  float m[R], l[R], acc[R][NC];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    m[i] = FA_NEG_INF;
    l[i] = 0.0f;
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[i][c] = 0.0f;
  }
  // Causal: no key past the tile's last query.
  const int k_end = causal && q0 + BQ < lk ? q0 + BQ : lk;
  for (int k0 = 0; k0 < k_end; k0 += BK) {
    __syncthreads();  // the previous tile's V is no longer read
    load_tile<BK, DM>(sKV, k, k0, lk, d);
    __syncthreads();
    float s[R];
    tile_abt<R, DM>(s, sQ, sKV, warp, lane);
    const int key = k0 + lane;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int qi = q0 + warp + FA_WARPS * i;
      const bool masked = key >= lk || (causal && key > qi);
      s[i] = masked ? FA_NEG_INF : s[i] * scale;
      const float m_new = fmaxf(m[i], warp_max(s[i]));
      // A row with every key so far masked keeps m = −∞; subtract 0 then, not −∞.
      const float m_use = m_new == FA_NEG_INF ? 0.0f : m_new;
      const float alpha = __expf(m[i] - m_use);
      const float p = __expf(s[i] - m_use);
      l[i] = l[i] * alpha + p;  // this lane's share of the row sum; reduced at the end
#pragma unroll
      for (int c = 0; c < NC; ++c) acc[i][c] *= alpha;
      m[i] = m_new;
      sP[warp + FA_WARPS * i][lane] = p;
    }
    __syncthreads();  // S is read from sKV (K) no more
    load_tile<BK, DM>(sKV, v, k0, lk, d);
    __syncthreads();
    tile_acc_pm<R, NC, BK, BK + 1, DM>(acc, sP, sKV, warp, lane);
  }
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const float sum = warp_sum(l[i]);
    const int qi = q0 + warp + FA_WARPS * i;
    if (qi >= lq) continue;
    const float inv = 1.0f / sum;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int col = lane + 32 * c;
      if (col < d) from_f(&o[(bh * lq + qi) * d + col], acc[i][c] * inv);
    }
    if (lane == 0) lse[bh * lq + qi] = m[i] + logf(sum);
  }
}

// ---------------------------------------------------------------- backward

// dr[row] = Σ_c dO[row][c]·O[row][c] for rows [0, rows): one warp per row.
template <class T>
__device__ void flash_dot(const T* o, const T* g, float* dr, int rows, int d) {
  const int row = blockIdx.x * FA_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps leave together: the shuffles below stay full
  float s = 0.0f;
  for (int c = lane; c < d; c += 32)
    s += to_f(o[(long long)row * d + c]) * to_f(g[(long long)row * d + c]);
  s = warp_sum(s);
  if (lane == 0) dr[row] = s;
}

// The per-query-tile state of the backward in shared memory, for BK keys and BQ queries.
template <int BK, int BQ, int DM>
struct BwdTiles {
  float k[BK][DM + 1], v[BK][DM + 1];   // this block's keys and values
  float q[BQ][DM + 1], g[BQ][DM + 1];   // the query tile and its output gradient dO
  float p[BK][BQ + 1], ds[BK][BQ + 1];  // Pᵀ and dSᵀ (keys × queries)
  float lse[BQ], dr[BQ];
};

// Pᵀ and dSᵀ of one (key tile, query tile) pair into t.p and t.ds; masked pairs get 0.
template <int BK, int BQ, int DM>
__device__ void bwd_scores(BwdTiles<BK, BQ, DM>& t, float scale, int k0, int q0, int lq, int lk,
                           int causal) {
  constexpr int PER = BK * BQ / FA_THREADS, STEP = FA_THREADS / BQ;
  const int col = threadIdx.x % BQ, row0 = threadIdx.x / BQ;
  const int qi = q0 + col;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int r = row0 + STEP * i, key = k0 + r;
    float s = 0.0f, dp = 0.0f;
    for (int c = 0; c < DM; ++c) {
      s += t.k[r][c] * t.q[col][c];
      dp += t.v[r][c] * t.g[col][c];
    }
    const bool masked = key >= lk || qi >= lq || (causal && key > qi);
    const float p = masked ? 0.0f : __expf(s * scale - t.lse[col]);
    t.p[r][col] = p;
    t.ds[r][col] = p * (dp - t.dr[col]) * scale;
  }
}

// dQ[q0 + row][col] += Σ_k dSᵀ[k][row]·K[k][col] for this block's keys, by f32 atomics.
template <int BK, int BQ, int DM>
__device__ void bwd_dq(const BwdTiles<BK, BQ, DM>& t, float* dq, int q0, int lq, int d, int warp,
                       int lane) {
  constexpr int RQ = BQ / FA_WARPS, NC = (DM + 31) / 32;
  float acc[RQ][NC];
  tile_ptm<RQ, NC, BK, BQ + 1, DM>(acc, t.ds, t.k, warp, lane);
#pragma unroll
  for (int i = 0; i < RQ; ++i) {
    const int qi = q0 + warp + FA_WARPS * i;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int col = lane + 32 * c;
      if (qi < lq && col < d) atomicAdd(&dq[(long long)qi * d + col], acc[i][c]);
    }
  }
}

// One block: key/value tile blockIdx.x of head blockIdx.y, looping over the query tiles.
template <class T, int DM, int BK, int BQ>
__device__ void flash_bwd(const T* q, const T* k, const T* v, const T* g, const float* lse,
                          const float* dr, float* dq, T* dk, T* dv, float scale, int lq, int lk,
                          int d, int causal) {
  constexpr int R = BK / FA_WARPS, NC = (DM + 31) / 32;
  __shared__ BwdTiles<BK, BQ, DM> t;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long bh = blockIdx.y;
  const int k0 = blockIdx.x * BK;
  q += bh * lq * d;
  g += bh * lq * d;
  lse += bh * lq;
  dr += bh * lq;
  dq += bh * lq * d;
  load_tile<BK, DM>(t.k, k + bh * lk * d, k0, lk, d);
  load_tile<BK, DM>(t.v, v + bh * lk * d, k0, lk, d);
  float dk_acc[R][NC], dv_acc[R][NC];
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int c = 0; c < NC; ++c) dk_acc[i][c] = dv_acc[i][c] = 0.0f;
  // Causal: queries before the first key see none of this tile.
  const int q_begin = causal ? k0 / BQ * BQ : 0;
  for (int q0 = q_begin; q0 < lq; q0 += BQ) {
    __syncthreads();  // the previous query tile is no longer read
    load_tile<BQ, DM>(t.q, q, q0, lq, d);
    load_tile<BQ, DM>(t.g, g, q0, lq, d);
    for (int e = threadIdx.x; e < BQ; e += FA_THREADS) {
      const bool in = q0 + e < lq;
      t.lse[e] = in ? lse[q0 + e] : 0.0f;
      t.dr[e] = in ? dr[q0 + e] : 0.0f;
    }
    __syncthreads();
    bwd_scores<BK, BQ, DM>(t, scale, k0, q0, lq, lk, causal);
    __syncthreads();
    tile_acc_pm<R, NC, BQ, BQ + 1, DM>(dv_acc, t.p, t.g, warp, lane);
    tile_acc_pm<R, NC, BQ, BQ + 1, DM>(dk_acc, t.ds, t.q, warp, lane);
    bwd_dq<BK, BQ, DM>(t, dq, q0, lq, d, warp, lane);
  }
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int key = k0 + warp + FA_WARPS * i;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int col = lane + 32 * c;
      if (key < lk && col < d) {
        from_f(&dk[(bh * lk + key) * d + col], dk_acc[i][c]);
        from_f(&dv[(bh * lk + key) * d + col], dv_acc[i][c]);
      }
    }
  }
}

// ---------------------------------------------------------------- entry points

// SUFFIX: head-dim bucket and dtype (d40_f32); T: the element type; DM: the bucket's head dim;
// BK, BQ: the backward's key and query tile rows (48 KB of static shared memory at DM = 160).
// The Rust side (src/nn/flash_attention.rs) launches FA_THREADS threads per block with grids:
// forward (ceil(Lq/32), BH), dot (ceil(BH·Lq/4)), backward (ceil(Lk/BK), BH).
#define ENTRY_POINTS(SUFFIX, T, DM, BK, BQ)                                                      \
  extern "C" __global__ void flash_fwd_##SUFFIX(                                                    \
      const T* q, const T* k, const T* v, T* o, float* lse, float scale, int lq, int lk, int d,  \
      int causal) {                                                                              \
    flash_fwd<T, DM>(q, k, v, o, lse, scale, lq, lk, d, causal);                                 \
  }                                                                                              \
  extern "C" __global__ void flash_dot_##SUFFIX(                                                    \
      const T* o, const T* g, float* dr, int rows, int d) {                   \
    flash_dot<T>(o, g, dr, rows, d);                                                             \
  }                                                                                              \
  extern "C" __global__ void flash_bwd_##SUFFIX(                                                    \
      const T* q, const T* k, const T* v, const T* g, const float* lse, const float* dr,         \
      float* dq, T* dk, T* dv, float scale, int lq, int lk, int d, int causal) {                 \
    flash_bwd<T, DM, BK, BQ>(q, k, v, g, lse, dr, dq, dk, dv, scale, lq, lk, d, causal);         \
  }

ENTRY_POINTS(d40_f32, float, 40, 32, 16)
ENTRY_POINTS(d64_f32, float, 64, 32, 16)
ENTRY_POINTS(d80_f32, float, 80, 32, 16)
ENTRY_POINTS(d160_f32, float, 160, 16, 16)
ENTRY_POINTS(d40_bf16, __nv_bfloat16, 40, 32, 16)
ENTRY_POINTS(d64_bf16, __nv_bfloat16, 64, 32, 16)
ENTRY_POINTS(d80_bf16, __nv_bfloat16, 80, 32, 16)
ENTRY_POINTS(d160_bf16, __nv_bfloat16, 160, 16, 16)
ENTRY_POINTS(d40_f16, __half, 40, 32, 16)
ENTRY_POINTS(d64_f16, __half, 64, 32, 16)
ENTRY_POINTS(d80_f16, __half, 80, 32, 16)
ENTRY_POINTS(d160_f16, __half, 160, 16, 16)
