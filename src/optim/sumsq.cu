// The step check's sums of squares on CUDA: Σ x² of one gradient, in f32, added into slot `slot`
// of one shared f32 buffer, so a step's check is one launch per trained tensor and one copy to
// the host (src/optim/sumsq_cuda.rs), not a cast, a square, a sum and a copy into a stacked
// buffer per tensor (3 to 4 launches each: 1,170 per SD1.5 LoRA step, counted by the op census).
//
// Each block sums a grid-stride share of the elements, reduces it by warp shuffles and shared
// memory, and adds it to out[slot] with one atomic. The order of those adds varies from run to
// run, so the last bits of a large tensor's sum do too (the host path's order is fixed).
//
// With SDTRAIN_EMULATE the file compiles as host C++ against tests/kernel_emu/emu.h, where
// src/optim/sumsq_emu_tests.rs runs it.

#ifdef SDTRAIN_EMULATE
#include "emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#define SUMSQ_THREADS 256

__device__ __forceinline__ float sumsq_f(float x) { return x; }
__device__ __forceinline__ float sumsq_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float sumsq_f(__half x) { return __half2float(x); }

template <class T>
__device__ void sumsq_into(const T* x, unsigned long long n, float* out, int slot) {
  __shared__ float warps[SUMSQ_THREADS / 32];
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  float s = 0.0f;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float v = sumsq_f(x[i]);
    s += v * v;
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warps[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < SUMSQ_THREADS / 32 ? warps[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) atomicAdd(&out[slot], s);
  }
}

// SUMSQ_THREADS threads per block; the Rust side launches min(ceil(n / SUMSQ_THREADS), 1024)
// blocks.
extern "C" __global__ void sumsq_into_f32(const float* x, unsigned long long n, float* out,
                                          int slot) {
  sumsq_into<float>(x, n, out, slot);
}
extern "C" __global__ void sumsq_into_bf16(const __nv_bfloat16* x, unsigned long long n,
                                           float* out, int slot) {
  sumsq_into<__nv_bfloat16>(x, n, out, slot);
}
extern "C" __global__ void sumsq_into_f16(const __half* x, unsigned long long n, float* out,
                                          int slot) {
  sumsq_into<__half>(x, n, out, slot);
}
