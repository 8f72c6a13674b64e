// A host emulation of the part of CUDA that sdtrain's kernels (src/**/*.cu) use, so that the unit
// tests run those kernels without a GPU (src/kernel_emu.rs compiles a .cu file with this header and
// emu_main.h, using the system C++ compiler).
//
// - Every CUDA thread of a block is an OS thread; the block's threads are started once per launch
//   and run the grid's blocks one after another, so `__shared__` variables (function statics) are
//   the block's own while it runs.
// - Threads of a block interleave freely, as on a GPU, so a missing __syncthreads or a race shows
//   up here as well.
// - __syncthreads is a barrier over the block's live threads: a thread that has returned from the
//   kernel no longer counts (as on sm_70+). A barrier that nobody completes within
//   EMU_BARRIER_TIMEOUT seconds (divergent __syncthreads) aborts the driver with a message
//   instead of hanging the test.
// - Warp shuffles (__shfl_*_sync, full mask) exchange values through a per-warp slot array and a
//   per-warp barrier; warps are 32 consecutive linear thread ids, as on a GPU.
// - ldmatrix and mma.sync (m16n8k16, bf16/f16 into f32) are warp collectives with the fragment
//   layouts of the PTX ISA, through the same per-warp slots and barrier (src/nn/kernels/mma.cuh).
// - atomicAdd on floats and ints is a real atomic (std::atomic_ref).
// - __nv_bfloat16 and __half are host types with CUDA's round-to-nearest-even conversions.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#ifndef EMU_BARRIER_TIMEOUT
#define EMU_BARRIER_TIMEOUT 120
#endif

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using emu_dim3 = dim3;

// A barrier whose party count drops when a thread leaves (returns from the kernel).
class EmuBarrier {
 public:
  void reset(unsigned parties) {
    std::lock_guard<std::mutex> g(mu_);
    parties_ = parties;
    waiting_ = 0;
  }
  void arrive_and_wait(const char* what) {
    std::unique_lock<std::mutex> g(mu_);
    const unsigned long long gen = generation_;
    if (++waiting_ >= parties_) {
      release_locked();
      return;
    }
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::seconds(EMU_BARRIER_TIMEOUT);
    while (generation_ == gen) {
      if (cv_.wait_until(g, deadline) == std::cv_status::timeout && generation_ == gen) {
        std::fprintf(stderr,
                     "emu: %s never completed (%u of %u threads arrived): divergent barrier?\n",
                     what, waiting_, parties_);
        std::fflush(stderr);
        std::_Exit(4);
      }
    }
  }
  // The calling thread leaves for good: barriers from now on wait for one thread fewer.
  void leave() {
    std::lock_guard<std::mutex> g(mu_);
    --parties_;
    if (parties_ > 0 && waiting_ >= parties_) release_locked();
  }

 private:
  void release_locked() {
    waiting_ = 0;
    ++generation_;
    cv_.notify_all();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  unsigned parties_ = 0, waiting_ = 0;
  unsigned long long generation_ = 0;
};

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;
inline thread_local unsigned emu_linear_tid;
inline EmuBarrier* emu_block_barrier;
inline std::vector<EmuBarrier>* emu_warp_barriers;
inline std::vector<unsigned long long>* emu_warp_slots;
inline std::vector<uint32_t>* emu_warp_frags;  // 6 words per thread: an mma's A and B fragments
constexpr int warpSize = 32;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

inline void __syncthreads() { emu_block_barrier->arrive_and_wait("__syncthreads"); }

inline void __syncwarp(unsigned = 0xffffffffu) {
  (*emu_warp_barriers)[emu_linear_tid / 32].arrive_and_wait("__syncwarp");
}

// ---------------------------------------------------------------- warp shuffles

template <class T>
T emu_shfl(T v, unsigned src_lane, unsigned width) {
  static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
  const unsigned t = emu_linear_tid;
  const unsigned lane = t % 32, base = t - lane;
  const unsigned seg = lane - lane % width;
  unsigned src = seg + src_lane % width;
  auto& slots = *emu_warp_slots;
  auto& bar = (*emu_warp_barriers)[t / 32];
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  slots[t] = bits;
  bar.arrive_and_wait("warp shuffle");
  if (base + src >= slots.size()) src = lane;  // a lane past the block reads its own value
  bits = slots[base + src];
  bar.arrive_and_wait("warp shuffle");
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

template <class T>
T __shfl_sync(unsigned, T v, int src, int width = 32) {
  return emu_shfl(v, (unsigned)src, (unsigned)width);
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
  const unsigned lane = emu_linear_tid % 32;
  return emu_shfl(v, (lane % width) ^ (unsigned)mask, (unsigned)width);
}
template <class T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
  const unsigned l = emu_linear_tid % 32 % width;
  return emu_shfl(v, l + delta < (unsigned)width ? l + delta : l, (unsigned)width);
}
template <class T>
T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
  const unsigned l = emu_linear_tid % 32 % width;
  return emu_shfl(v, l >= delta ? l - delta : l, (unsigned)width);
}

// ---------------------------------------------------------------- atomics and math

template <class T>
T atomicAdd(T* p, T v) {
  return std::atomic_ref<T>(*p).fetch_add(v);
}
template <class T>
T atomicMax(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}

inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __saturatef(float x) { return std::min(1.0f, std::max(0.0f, x)); }
template <class T>
inline T __ldg(const T* p) {
  return *p;
}

// ---------------------------------------------------------------- half types

struct __nv_bfloat16 {
  uint16_t bits;
};
struct __half {
  uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float((unsigned)h.bits << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  unsigned u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return {(uint16_t)(u >> 16)};
}

inline float __half2float(__half h) {
  const unsigned s = (unsigned)(h.bits >> 15) << 31;
  const unsigned e = (h.bits >> 10) & 0x1f, m = h.bits & 0x3ff;
  if (e == 0x1f) return __uint_as_float(s | 0x7f800000u | (m << 13));
  if (e == 0) {
    const float v = std::ldexp((float)m, -24);
    return s ? -v : v;
  }
  return __uint_as_float(s | ((e + 112) << 23) | (m << 13));
}
inline __half __float2half_rn(float x) {
  const unsigned u = __float_as_uint(x);
  const uint16_t s = (uint16_t)((u >> 16) & 0x8000);
  const float a = std::fabs(x);
  if (std::isnan(x)) return {(uint16_t)(s | 0x7e00)};
  if (a >= 65520.0f) return {(uint16_t)(s | 0x7c00)};  // rounds to infinity
  if (a < 6.103515625e-05f) {                          // subnormal: a multiple of 2^-24
    const float q = std::nearbyint(a * 16777216.0f);   // ties to even (default rounding mode)
    return {(uint16_t)(s | (uint16_t)q)};
  }
  unsigned v = __float_as_uint(a);
  const unsigned e = (v >> 23) - 112, m = v & 0x7fffff;
  unsigned h = (e << 10) | (m >> 13);
  const unsigned rest = m & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;
  return {(uint16_t)(s | h)};
}

// CUDA's 16-byte vector type (loads and stores of 8 half-precision values at once).
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }

// ---------------------------------------------------------------- tensor cores (sm_80)
//
// The PTX ISA's layouts, lane = 4·g + t (g = lane / 4, t = lane % 4), two 16-bit elements per
// 32-bit register, the lower index in the low half:
// - ldmatrix .m8n8 .x1/.x2/.x4: lanes 8j..8j+7 give the row addresses of matrix j (16 bytes
//   each, 16-byte aligned); register j of lane (g, t) gets row g, columns 2t and 2t+1 of matrix j,
//   or with .trans rows 2t and 2t+1 of column g.
// - mma.m16n8k16 .row.col, A 16×16, B 16×8, C/D 16×8 (f32): A register r holds row g + 8·(r % 2),
//   columns 2t, 2t+1 (+8 when r >= 2); B register r holds rows 2t, 2t+1 (+8 when r = 1) of
//   column g; C element i holds row g + 8·(i / 2), column 2t + i % 2.

// ldmatrix of `nmat` 8×8 matrices of 16-bit elements, `row` this lane's row address.
inline void emu_ldmatrix(uint32_t* r, int nmat, bool trans, const void* row) {
  const unsigned tid = emu_linear_tid, lane = tid % 32, base = tid - lane;
  auto& slots = *emu_warp_slots;
  auto& bar = (*emu_warp_barriers)[tid / 32];
  if (lane < 8u * nmat && (uintptr_t)row % 16 != 0) {
    std::fprintf(stderr, "emu: ldmatrix row address %p of lane %u is not 16-byte aligned\n", row,
                 lane);
    std::fflush(stderr);
    std::_Exit(5);
  }
  slots[tid] = (unsigned long long)(uintptr_t)row;
  bar.arrive_and_wait("ldmatrix");
  const unsigned g = lane / 4, t = lane % 4;
  auto at = [&](int j, unsigned rr, unsigned cc) {
    return ((const uint16_t*)(uintptr_t)slots[base + 8 * j + rr])[cc];
  };
  for (int j = 0; j < nmat; ++j) {
    const uint16_t lo = trans ? at(j, 2 * t, g) : at(j, g, 2 * t);
    const uint16_t hi = trans ? at(j, 2 * t + 1, g) : at(j, g, 2 * t + 1);
    r[j] = (uint32_t)lo | (uint32_t)hi << 16;
  }
  bar.arrive_and_wait("ldmatrix");
}

// d += A·B for one m16n8k16 tile of bf16 (or f16) operands, f32 accumulation.
inline void emu_mma_m16n8k16(float* d, const uint32_t* a, const uint32_t* b, bool bf16) {
  const unsigned tid = emu_linear_tid, lane = tid % 32, base = tid - lane;
  auto& fr = *emu_warp_frags;
  auto& bar = (*emu_warp_barriers)[tid / 32];
  for (int i = 0; i < 4; ++i) fr[6 * tid + i] = a[i];
  fr[6 * tid + 4] = b[0];
  fr[6 * tid + 5] = b[1];
  bar.arrive_and_wait("mma.sync");
  auto elem = [&](unsigned holder, int reg, int half) {
    const uint32_t w = fr[6 * (base + holder) + reg];
    const uint16_t h = half ? (uint16_t)(w >> 16) : (uint16_t)(w & 0xffffu);
    return bf16 ? __bfloat162float({h}) : __half2float({h});
  };
  auto A = [&](int r, int k) { return elem((r % 8) * 4 + (k % 8) / 2, r / 8 + 2 * (k / 8), k % 2); };
  auto B = [&](int k, int n) { return elem(n * 4 + (k % 8) / 2, 4 + k / 8, k % 2); };
  const unsigned g = lane / 4, t = lane % 4;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i / 2), n = 2 * t + i % 2;
    float s = d[i];
    for (int k = 0; k < 16; ++k) s = std::fma(A(r, k), B(k, n), s);
    out[i] = s;
  }
  bar.arrive_and_wait("mma.sync");
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// ---------------------------------------------------------------- launch

// Runs `body` as a grid of `grid` blocks of `block` threads: one OS thread per CUDA thread of a
// block, the blocks in turn.
template <class F>
void emu_launch(dim3 grid, dim3 block, F body) {
  gridDim = grid;
  blockDim = block;
  const unsigned nthreads = block.x * block.y * block.z;
  const unsigned long long nblocks = (unsigned long long)grid.x * grid.y * grid.z;
  EmuBarrier block_barrier, grid_barrier;
  std::vector<EmuBarrier> warp_barriers((nthreads + 31) / 32);
  std::vector<unsigned long long> slots(nthreads);
  std::vector<uint32_t> frags(6 * (size_t)nthreads);
  emu_block_barrier = &block_barrier;
  emu_warp_barriers = &warp_barriers;
  emu_warp_slots = &slots;
  emu_warp_frags = &frags;
  grid_barrier.reset(nthreads);
  auto reset_block = [&] {
    block_barrier.reset(nthreads);
    for (unsigned w = 0; w < warp_barriers.size(); ++w)
      warp_barriers[w].reset(std::min(32u, nthreads - 32 * w));
  };
  reset_block();
  std::vector<std::thread> threads;
  threads.reserve(nthreads);
  for (unsigned t = 0; t < nthreads; ++t) {
    threads.emplace_back([&, t] {
      emu_linear_tid = t;
      threadIdx = dim3(t % block.x, t / block.x % block.y, t / (block.x * block.y));
      for (unsigned long long b = 0; b < nblocks; ++b) {
        blockIdx = dim3((unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y),
                        (unsigned)(b / ((unsigned long long)grid.x * grid.y)));
        body();
        block_barrier.leave();
        (*emu_warp_barriers)[t / 32].leave();
        // Every thread has finished this block: start the next with full barriers.
        grid_barrier.arrive_and_wait("end of block");
        if (t == 0) reset_block();
        grid_barrier.arrive_and_wait("start of block");
      }
    });
  }
  for (auto& th : threads) th.join();
}
