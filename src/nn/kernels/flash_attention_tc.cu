// nvcc-flags: -arch=compute_80
// Flash attention on tensor cores (sm_80 and later), bf16 and f16: the algorithm of
// flash_attention.cu (FlashAttention-2, Dao, arXiv 2307.08691, Algorithms 1 and 2) with its tile
// products as mma.sync m16n8k16 (src/nn/kernels/mma.cuh), as FlashAttention-2's own kernels do.
// The entry points take flash_attention.cu's arguments plus the layout (`head_base`): split heads
// `[BH, L, D]`, or the attention layers' merged heads `[B, L, H·D]` read and written in place, so
// no split copy of q, k, v, the output or a gradient is made. flash_attention.cu keeps f32 and
// head dim 160.
//
// Forward: a block per 64 query rows and head, a warp per 16 rows. The warp's Q rows stay in
// registers as A fragments. Each step stages 64 keys and values in shared memory; S = Q·Kᵀ
// (16 × 64 per warp) is a C tile in registers, the online softmax runs on it there (a row's 64
// scores are spread over the 4 lanes of a group: two shuffles take its maximum), and P, rounded
// to the input dtype, is the A operand of P·V without leaving registers. O stays in f32.
//
// Backward: a block per 64 keys and head, a warp per 16 keys, looping over 32 queries at a time.
// The warp keeps its K and V rows as A fragments and accumulates dK and dV in registers:
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ (16 × 32);  Pᵀ = exp(s·Sᵀ − L);  dSᵀ = Pᵀ ∘ (dPᵀ − Dr)·s
//   dV += Pᵀ·dO;  dK += dSᵀ·Q   (Pᵀ and dSᵀ rounded to the input dtype, in registers)
//   dQ += dS·K: dS goes through shared memory (the transpose), each warp takes 16 query rows and
//   every other 8 columns, and adds into the f32 dQ by atomics, as flash_attention.cu does.
//
// Head dims: buckets 40, 64 and 80 (SD1.5's 40 and 80, SD2/SDXL's 64); a bucket takes any head
// dim up to it, zero-padded. The Q·Kᵀ products step over the head dim 16 at a time, so bucket 40
// pads to 48 columns in shared memory; the products over the head dim as columns step 8 at a time.
// Shared rows are padded by 8 elements (16 bytes), so the 8 rows an ldmatrix reads fall in
// distinct banks.
//
// Scores, probabilities, the softmax statistics and every accumulator are f32; the operands of
// each product are in the input dtype (P and dS are rounded to it, as in FlashAttention-2).
// Masking is flash_attention.cu's: keys past Lk and (causal) key j > query i get probability 0,
// rows past Lq are neither read nor written.

#ifdef SDTRAIN_EMULATE
#include "emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif
#include "mma.cuh"

#define TC_THREADS 128
#define TC_NEG_INF (-INFINITY)

__device__ __forceinline__ float tc_to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float tc_to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ void tc_from_f(__nv_bfloat16* p, float x) {
  *p = __float2bfloat16_rn(x);
}
__device__ __forceinline__ void tc_from_f(__half* p, float x) { *p = __float2half_rn(x); }

// Rows [row0, row0 + ROWS) of a matrix of `rows` rows of `d` values, `rs` elements apart, into a
// shared tile of DP columns (stride LD); rows past `rows` and columns past `d` are zero. When d
// and rs are multiples of 8 and `src` is 16-byte aligned (SD's head dims 40, 64 and 80), 8
// elements move per load.
template <int ROWS, int DP, int LD, class T>
__device__ void tc_load_rows(T (*tile)[LD], const T* src, int row0, int rows, int d, int rs) {
  if (d % 8 == 0 && rs % 8 == 0 && ((unsigned long long)src & 15) == 0) {
    constexpr int CH = DP / 8;  // 16-byte chunks per tile row
    for (int e = threadIdx.x; e < ROWS * CH; e += TC_THREADS) {
      const int r = e / CH, c = (e % CH) * 8, g = row0 + r;
      uint4 x = {0u, 0u, 0u, 0u};
      if (g < rows && c < d) x = *reinterpret_cast<const uint4*>(src + (long long)g * rs + c);
      *reinterpret_cast<uint4*>(&tile[r][c]) = x;
    }
    return;
  }
  for (int e = threadIdx.x; e < ROWS * DP; e += TC_THREADS) {
    const int r = e / DP, c = e % DP;
    const int g = row0 + r;
    if (g < rows && c < d) {
      tile[r][c] = src[(long long)g * rs + c];
    } else {
      tc_from_f(&tile[r][c], 0.0f);
    }
  }
}

// Where head `bh` (= batch · heads + head) starts in a tensor of `len` rows `rs` elements apart:
// split heads `[BH, L, D]` have heads = 1 and rs = D; merged heads `[B, L, H·D]` (what the
// attention layers' projections give, read without a split copy) have rs = H·D, a head's D
// values at column head·D.
__device__ __forceinline__ long long head_base(long long bh, int heads, int len, int rs, int d) {
  return (bh / heads) * len * (long long)rs + (bh % heads) * (long long)d;
}

// The largest of x over the 4 lanes of a group (the lanes holding one row of a C tile).
__device__ __forceinline__ float group_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float group_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---------------------------------------------------------------- forward

template <class T, int DM>
__device__ void fa_tc_fwd(const T* q, const T* k, const T* v, T* o, float* lse, float scale,
                          int lq, int lk, int d, int causal, int heads, int q_rs, int k_rs) {
  constexpr int BQ = 64, BK = 64, DP = (DM + 15) / 16 * 16, LD = DP + 8;
  constexpr int KS = DP / 16, NS = BK / 8, NO = DM / 8;
  static_assert(DM % 8 == 0, "head-dim bucket must be a multiple of 8");
  __shared__ __align__(16) T sK[BK][LD];
  __shared__ __align__(16) T sV[BK][LD];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const long long bh = blockIdx.y;
  const int q0 = blockIdx.x * BQ;
  const long long qb = head_base(bh, heads, lq, q_rs, d), kb = head_base(bh, heads, lk, k_rs, d);
  q += qb;
  o += qb;
  k += kb;
  v += kb;

  // The warp's 16 query rows as A fragments, staged through sK.
  tc_load_rows<BQ, DP, LD>(sK, q, q0, lq, d, q_rs);
  __syncthreads();
  uint32_t qa[KS][4];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) load_a(qa[ks], &sK[0][0], LD, warp * 16, ks * 16, lane);

  // Rows g and g + 8 of the warp's tile: running max, this lane's share of the row sum, O.
  float m[2] = {TC_NEG_INF, TC_NEG_INF}, l[2] = {0.0f, 0.0f}, acc[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[n][i] = 0.0f;
  const int row0 = q0 + warp * 16 + g;
  // Causal: no key past the tile's last query.
  const int k_end = causal && q0 + BQ < lk ? q0 + BQ : lk;
  for (int k0 = 0; k0 < k_end; k0 += BK) {
    __syncthreads();  // Q (first step) or the previous K and V are no longer read
    tc_load_rows<BK, DP, LD>(sK, k, k0, lk, d, k_rs);
    tc_load_rows<BK, DP, LD>(sV, v, k0, lk, d, k_rs);
    __syncthreads();
    float s[NS][4];
#pragma unroll
    for (int n = 0; n < NS; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[n][i] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        uint32_t b[2];
        load_b(b, &sK[0][0], LD, n * 8, ks * 16, lane);
        mma16816(T(), s[n], qa[ks], b);
      }
    }
    float mx[2] = {TC_NEG_INF, TC_NEG_INF};
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = k0 + n * 8 + 2 * t + i % 2, qi = row0 + 8 * (i / 2);
        const bool masked = key >= lk || (causal && key > qi);
        s[n][i] = masked ? TC_NEG_INF : s[n][i] * scale;
        mx[i / 2] = fmaxf(mx[i / 2], s[n][i]);
      }
    float m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m[r], group_max(mx[r]));
      // A row with every key so far masked keeps m = −∞; subtract 0 then, not −∞.
      m_use[r] = m_new == TC_NEG_INF ? 0.0f : m_new;
      const float alpha = __expf(m[r] - m_use[r]);
      l[r] *= alpha;
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        acc[n][2 * r] *= alpha;
        acc[n][2 * r + 1] *= alpha;
      }
      m[r] = m_new;
    }
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float p = __expf(s[n][i] - m_use[i / 2]);
        l[i / 2] += p;
        s[n][i] = p;
      }
    // O += P·V: P's C tiles, two at a time, are the A tiles over 16 keys.
#pragma unroll
    for (int j = 0; j < BK / 16; ++j) {
      uint32_t pa[4];
      c_to_a<T>(pa, s[2 * j], s[2 * j + 1]);
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        uint32_t b[2];
        load_b_trans(b, &sV[0][0], LD, j * 16, n * 8, lane);
        mma16816(T(), acc[n], pa, b);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float sum = group_sum(l[r]);
    const int qi = row0 + 8 * r;
    if (qi >= lq) continue;
    const float inv = 1.0f / sum;
#pragma unroll
    for (int n = 0; n < NO; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = n * 8 + 2 * t + e;
        if (col < d) tc_from_f(&o[(long long)qi * q_rs + col], acc[n][2 * r + e] * inv);
      }
    if (t == 0) lse[bh * lq + qi] = m[r] + logf(sum);
  }
}

// ---------------------------------------------------------------- backward

template <class T, int DM>
__device__ void fa_tc_bwd(const T* q, const T* k, const T* v, const T* go, const float* lse,
                          const float* dr, float* dq, T* dk, T* dv, float scale, int lq, int lk,
                          int d, int causal, int heads, int q_rs, int k_rs) {
  constexpr int BK = 64, BQ = 32, DP = (DM + 15) / 16 * 16, LD = DP + 8, LDS = BK + 8;
  constexpr int KS = DP / 16, NQ = BQ / 8, QS = BQ / 16, NO = DM / 8;
  static_assert(DM % 8 == 0, "head-dim bucket must be a multiple of 8");
  __shared__ __align__(16) T sK[BK][LD];
  __shared__ __align__(16) T sV[BK][LD];
  __shared__ __align__(16) T sQ[BQ][LD];
  __shared__ __align__(16) T sG[BQ][LD];
  __shared__ __align__(16) T sdS[BQ][LDS];  // dS, queries × keys
  __shared__ float sL[BQ], sDr[BQ];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const long long bh = blockIdx.y;
  const int k0 = blockIdx.x * BK;
  const long long qb = head_base(bh, heads, lq, q_rs, d), kb = head_base(bh, heads, lk, k_rs, d);
  q += qb;
  go += qb;
  dq += qb;
  k += kb;
  v += kb;
  dk += kb;
  dv += kb;
  lse += bh * lq;
  dr += bh * lq;
  tc_load_rows<BK, DP, LD>(sK, k, k0, lk, d, k_rs);
  tc_load_rows<BK, DP, LD>(sV, v, k0, lk, d, k_rs);
  __syncthreads();
  // The warp's 16 keys and values as A fragments.
  uint32_t ka[KS][4], va[KS][4];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    load_a(ka[ks], &sK[0][0], LD, warp * 16, ks * 16, lane);
    load_a(va[ks], &sV[0][0], LD, warp * 16, ks * 16, lane);
  }
  float dk_acc[NO][4], dv_acc[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) dk_acc[n][i] = dv_acc[n][i] = 0.0f;
  const int key0 = k0 + warp * 16 + g;  // this lane's keys: key0 and key0 + 8
  // Causal: queries before the first key see none of this tile.
  const int q_begin = causal ? k0 / BQ * BQ : 0;
  for (int q0 = q_begin; q0 < lq; q0 += BQ) {
    __syncthreads();  // the previous query tile and dS are no longer read
    tc_load_rows<BQ, DP, LD>(sQ, q, q0, lq, d, q_rs);
    tc_load_rows<BQ, DP, LD>(sG, go, q0, lq, d, q_rs);
    for (int e = threadIdx.x; e < BQ; e += TC_THREADS) {
      const bool in = q0 + e < lq;
      sL[e] = in ? lse[q0 + e] : 0.0f;
      sDr[e] = in ? dr[q0 + e] : 0.0f;
    }
    __syncthreads();
    // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, 16 keys × BQ queries.
    float st[NQ][4], dpt[NQ][4];
#pragma unroll
    for (int n = 0; n < NQ; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) st[n][i] = dpt[n][i] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        uint32_t b[2];
        load_b(b, &sQ[0][0], LD, n * 8, ks * 16, lane);
        mma16816(T(), st[n], ka[ks], b);
        load_b(b, &sG[0][0], LD, n * 8, ks * 16, lane);
        mma16816(T(), dpt[n], va[ks], b);
      }
    }
    // Pᵀ into st, dSᵀ into dpt.
#pragma unroll
    for (int n = 0; n < NQ; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int col = n * 8 + 2 * t + i % 2, qi = q0 + col, key = key0 + 8 * (i / 2);
        const bool masked = key >= lk || qi >= lq || (causal && key > qi);
        const float p = masked ? 0.0f : __expf(st[n][i] * scale - sL[col]);
        st[n][i] = p;
        dpt[n][i] = p * (dpt[n][i] - sDr[col]) * scale;
      }
    // dV += Pᵀ·dO and dK += dSᵀ·Q, over BQ queries 16 at a time.
#pragma unroll
    for (int j = 0; j < QS; ++j) {
      uint32_t pa[4], dsa[4];
      c_to_a<T>(pa, st[2 * j], st[2 * j + 1]);
      c_to_a<T>(dsa, dpt[2 * j], dpt[2 * j + 1]);
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        uint32_t b[2];
        load_b_trans(b, &sG[0][0], LD, j * 16, n * 8, lane);
        mma16816(T(), dv_acc[n], pa, b);
        load_b_trans(b, &sQ[0][0], LD, j * 16, n * 8, lane);
        mma16816(T(), dk_acc[n], dsa, b);
      }
    }
    // dS, transposed through shared memory: sdS[query][key].
#pragma unroll
    for (int n = 0; n < NQ; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        tc_from_f(&sdS[n * 8 + 2 * t + i % 2][warp * 16 + g + 8 * (i / 2)], dpt[n][i]);
    __syncthreads();
    // dQ += dS·K: warp w takes query rows 16·(w % 2).. and the column tiles w / 2, w / 2 + 2, ...
    const int mt = warp % 2;
    uint32_t dsq[BK / 16][4];
#pragma unroll
    for (int j = 0; j < BK / 16; ++j) load_a(dsq[j], &sdS[0][0], LDS, mt * 16, j * 16, lane);
    const int qrow = q0 + mt * 16 + g;
#pragma unroll
    for (int n = warp / 2; n < NO; n += 2) {
      float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int j = 0; j < BK / 16; ++j) {
        uint32_t b[2];
        load_b_trans(b, &sK[0][0], LD, j * 16, n * 8, lane);
        mma16816(T(), a, dsq[j], b);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int qi = qrow + 8 * (i / 2), col = n * 8 + 2 * t + i % 2;
        if (qi < lq && col < d) atomicAdd(&dq[(long long)qi * q_rs + col], a[i]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int key = key0 + 8 * (i / 2);
    if (key >= lk) continue;
#pragma unroll
    for (int n = 0; n < NO; ++n) {
      const int col = n * 8 + 2 * t + i % 2;
      if (col < d) {
        tc_from_f(&dk[(long long)key * k_rs + col], dk_acc[n][i]);
        tc_from_f(&dv[(long long)key * k_rs + col], dv_acc[n][i]);
      }
    }
  }
}

// ---------------------------------------------------------------- Dr

// dr[bh·Lq + i] = Σ_c dO[i][c]·O[i][c] over head bh's rows (laid out as the forward's q): one
// warp per row.
template <class T>
__device__ void fa_tc_dot(const T* o, const T* g, float* dr, int bhs, int lq, int d, int heads,
                          int q_rs) {
  const long long row = (long long)blockIdx.x * (TC_THREADS / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= (long long)bhs * lq) return;  // whole warps leave together
  const long long bh = row / lq;
  const long long at = head_base(bh, heads, lq, q_rs, d) + (row % lq) * q_rs;
  float s = 0.0f;
  for (int c = lane; c < d; c += 32) s += tc_to_f(o[at + c]) * tc_to_f(g[at + c]);
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) dr[row] = s;
}

// ---------------------------------------------------------------- entry points

// SUFFIX: head-dim bucket and dtype (d40_bf16). The Rust side (src/nn/flash_attention.rs)
// launches TC_THREADS threads per block with grids: forward (ceil(Lq/64), BH), Dr
// (ceil(BH·Lq/4)), backward (ceil(Lk/64), BH). `heads`, `q_rs`, `k_rs`: the layout (head_base).
#define TC_ENTRY_POINTS(SUFFIX, T, DM)                                                           \
  extern "C" __global__ void flash_fwd_tc_##SUFFIX(                                              \
      const T* q, const T* k, const T* v, T* o, float* lse, float scale, int lq, int lk, int d,  \
      int causal, int heads, int q_rs, int k_rs) {                                               \
    fa_tc_fwd<T, DM>(q, k, v, o, lse, scale, lq, lk, d, causal, heads, q_rs, k_rs);             \
  }                                                                                              \
  extern "C" __global__ void flash_dot_tc_##SUFFIX(const T* o, const T* g, float* dr, int bhs,   \
                                                   int lq, int d, int heads, int q_rs) {         \
    fa_tc_dot<T>(o, g, dr, bhs, lq, d, heads, q_rs);                                             \
  }                                                                                              \
  extern "C" __global__ void flash_bwd_tc_##SUFFIX(                                              \
      const T* q, const T* k, const T* v, const T* g, const float* lse, const float* dr,         \
      float* dq, T* dk, T* dv, float scale, int lq, int lk, int d, int causal, int heads,        \
      int q_rs, int k_rs) {                                                                      \
    fa_tc_bwd<T, DM>(q, k, v, g, lse, dr, dq, dk, dv, scale, lq, lk, d, causal, heads, q_rs,     \
                     k_rs);                                                                      \
  }

TC_ENTRY_POINTS(d40_bf16, __nv_bfloat16, 40)
TC_ENTRY_POINTS(d64_bf16, __nv_bfloat16, 64)
TC_ENTRY_POINTS(d80_bf16, __nv_bfloat16, 80)
TC_ENTRY_POINTS(d40_f16, __half, 40)
TC_ENTRY_POINTS(d64_f16, __half, 64)
TC_ENTRY_POINTS(d80_f16, __half, 80)
