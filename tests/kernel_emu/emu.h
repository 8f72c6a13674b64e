// A host emulation of the part of CUDA that src/optim/kernels.cu uses, so that the unit tests can
// run those kernels without a GPU (src/optim/kernel_emu.rs compiles this with the system C++
// compiler).
//
// Every CUDA thread of a block runs as an OS thread; __syncthreads is a barrier over the block's
// threads; __shared__ variables are function statics, shared by the block's threads because
// blocks run one after another. Threads within a block interleave freely, as on a GPU, so a
// missing __syncthreads or a race shows up here as well.
#pragma once

#include <barrier>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

struct emu_dim3 {
  unsigned x, y, z;
};

inline thread_local emu_dim3 threadIdx;
inline thread_local emu_dim3 blockIdx;
inline emu_dim3 blockDim;
inline emu_dim3 gridDim;
inline thread_local std::barrier<>* emu_block_barrier;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }

inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// Runs `body` as a grid of `grid` blocks of `block` threads.
template <class F>
void emu_launch(unsigned grid, unsigned block, F body) {
  gridDim = {grid, 1, 1};
  blockDim = {block, 1, 1};
  for (unsigned b = 0; b < grid; ++b) {
    std::barrier<> barrier(block);
    std::vector<std::thread> threads;
    threads.reserve(block);
    for (unsigned t = 0; t < block; ++t) {
      threads.emplace_back([&, t] {
        threadIdx = {t, 0, 0};
        blockIdx = {b, 0, 0};
        emu_block_barrier = &barrier;
        body();
      });
    }
    for (auto& th : threads) th.join();
  }
}
