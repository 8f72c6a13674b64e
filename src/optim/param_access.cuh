// The optimizer kernels' parameter loads and stores (src/optim/kernels.cu, src/optim/adaptive.cu):
// a parameter is f32, bf16 or f16 in memory and f32 in the update; stores round to nearest even.
// Included after cuda_bf16.h/cuda_fp16.h (or tests/kernel_emu/emu.h under SDTRAIN_EMULATE, whose
// host bf16/f16 types convert as CUDA's intrinsics do).
#pragma once

typedef unsigned char u8;
typedef unsigned long long u64;

__device__ __forceinline__ float load_p(const float* p, u64 i) { return p[i]; }
__device__ __forceinline__ void store_p(float* p, u64 i, float x) { p[i] = x; }
__device__ __forceinline__ float load_p(const __nv_bfloat16* p, u64 i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store_p(__nv_bfloat16* p, u64 i, float x) {
  p[i] = __float2bfloat16_rn(x);
}
__device__ __forceinline__ float load_p(const __half* p, u64 i) { return __half2float(p[i]); }
__device__ __forceinline__ void store_p(__half* p, u64 i, float x) { p[i] = __float2half_rn(x); }

// torch's sign: 1, −1, or 0 for zero.
__device__ __forceinline__ float sign_of(float x) {
  return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
}
