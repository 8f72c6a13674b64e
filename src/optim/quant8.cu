// nvcc-flags: --fmad=false
//
// Blockwise 8-bit optimizer state on the device, outside a fused optimizer kernel: a moment held
// as codes and absmax in device memory is dequantized to f32 values, updated by tensor ops
// (CAME, src/optim/came.rs), and requantized, with no copy to the host.
//
// Both kernels compute exactly what src/optim/quant8.rs computes on the host, bit for bit:
// - q8_dequant: `value[i] = map[code[i]] * absmax[i / 256]` (`Moment::values`);
// - q8_requant_{signed,unsigned}: per block of 256, absmax = max |x| over the block (a NaN is
//   passed over, as Rust's f32::max does), then each code is the host's nearest code to
//   x / absmax (`quant8::requantize`: ties to the lower code, the sign fix of the signed map),
//   or the map's code of 0 when absmax is 0.
// One CUDA block of QBLOCK threads per quantization block, one thread per element; the last
// block may be partial. `map` is the 256-entry map (the signed or unsigned half of the buffer the
// 8-bit kernels take). Values are always f32: the entry points carry only the `_f32` suffix of
// the launcher's parameter dtype.

#ifdef SDTRAIN_EMULATE
#include "emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include "param_access.cuh"
#include "quant8.cuh"

extern "C" __global__ void q8_dequant_f32(float* out, const u8* codes, const float* absmax,
                                          const float* map, u64 n) {
  __shared__ float code[256];
  load_map(map, code);
  __syncthreads();
  const u64 b = blockIdx.x;
  const u64 i = b * QBLOCK + threadIdx.x;
  if (i < n) out[i] = code[codes[i]] * absmax[b];
}

template <bool SIGNED>
__device__ void q8_requant(const float* x, u8* codes, float* absmax, const float* map, u64 n) {
  __shared__ float code[256];
  __shared__ float mid[256];
  __shared__ float red[QBLOCK];
  load_map(map, code);
  __syncthreads();
  load_mids(code, mid);
  __syncthreads();
  const u64 b = blockIdx.x;
  const u64 i = b * QBLOCK + threadIdx.x;
  const bool live = i < n;
  const float xi = live ? x[i] : 0.0f;
  // fmaxf with 0 drops a NaN, as the host's fold from 0 with f32::max does.
  const float a = block_max(fmaxf(0.0f, fabsf(xi)), red);
  if (live) {
    codes[i] = a == 0.0f ? (SIGNED ? 127 : 0) : quantize_nearest(code, mid, SIGNED, xi / a);
  }
  if (threadIdx.x == 0) absmax[b] = a;
}

extern "C" __global__ void q8_requant_signed_f32(const float* x, u8* codes, float* absmax,
                                                 const float* map, u64 n) {
  q8_requant<true>(x, codes, absmax, map, n);
}

extern "C" __global__ void q8_requant_unsigned_f32(const float* x, u8* codes, float* absmax,
                                                   const float* map, u64 n) {
  q8_requant<false>(x, codes, absmax, map, n);
}
