// The blockwise 8-bit quantization of optimizer state on the device, shared by the fused 8-bit
// optimizer kernels (src/optim/kernels.cu) and the stand-alone dequantize/requantize kernels
// (src/optim/quant8.cu): the layout and maps of src/optim/quant8.rs, blocks of QBLOCK elements,
// one thread per element. Included after param_access.cuh.
#pragma once

// Elements per quantization block, and threads per CUDA block.
#define QBLOCK 256

// ---------------------------------------------------------------- quantization

__device__ __forceinline__ bool sign_bit(float x) { return (__float_as_uint(x) >> 31) != 0; }

// bitsandbytes' sign fix for the signed map: a code q whose sign differs from x's moves one step
// toward x, so a small moment never flips sign or becomes 0 (-0 counts as negative, as on the host;
// the step wraps as the host's u8 does).
__device__ __forceinline__ u8 sign_fix(const float* code, bool is_signed, int q, float x) {
  if (is_signed && sign_bit(code[q]) != sign_bit(x)) {
    q += x > 0.0f ? 1 : -1;
  }
  return (u8)q;
}

// The nearest code to x (|x| <= 1) in the sorted 256-entry map `code`: bitsandbytes' binary
// search with a midpoint comparison, then its sign fix for the signed map (a code whose sign
// differs from x's moves one step toward x, so a small moment never flips sign or becomes 0).
__device__ __forceinline__ u8 quantize_search(const float* code, bool is_signed, float x) {
  int pivot = 127, upper_pivot = 255, lower_pivot = 0;
  float lower = is_signed ? -1.0f : 0.0f, upper = 1.0f;
  float val = code[127];
  for (int step = 64; step > 0; step >>= 1) {
    if (x > val) {
      lower_pivot = pivot;
      lower = val;
      pivot += step;
    } else {
      upper_pivot = pivot;
      upper = val;
      pivot -= step;
    }
    val = code[pivot];
  }
  int q;
  if (x > val) {
    q = x > (upper + val) * 0.5f ? upper_pivot : pivot;
  } else {
    q = x < (lower + val) * 0.5f ? lower_pivot : pivot;
  }
  return sign_fix(code, is_signed, q, x);
}

// The host's nearest code (quant8.rs `DynamicMap::quantize`): the first k whose upper midpoint
// `mid[k] = (code[k] + code[k+1]) / 2` x does not pass, so an exact midpoint goes to the lower
// code (bitsandbytes' search above may take the upper one there), and NaN to code 0; then the sign
// fix. `mid` is 255 midpoints in ascending order (load_mids); a binary search over them finds the
// same k as the host's walk up from its lookup table, since "x > mid[k]" only turns false once.
__device__ __forceinline__ u8 quantize_nearest(const float* code, const float* mid,
                                               bool is_signed, float x) {
  int lo = 0, hi = 255;
  while (lo < hi) {
    const int k = (lo + hi) >> 1;
    if (x > mid[k]) {
      lo = k + 1;
    } else {
      hi = k;
    }
  }
  return sign_fix(code, is_signed, lo, x);
}

// The midpoints of a map already in shared memory `code` into shared memory `mid` (255 of them,
// as the host computes them in f32; the caller synchronizes before and after).
__device__ __forceinline__ void load_mids(const float* code, float* mid) {
  const unsigned t = threadIdx.x;
  if (t < 255) mid[t] = (code[t] + code[t + 1]) * 0.5f;
}

// The block's maximum of x (every thread of the block must call it). `red` is QBLOCK floats of
// shared memory, free again on return.
__device__ __forceinline__ float block_max(float x, float* red) {
  const unsigned t = threadIdx.x;
  red[t] = x;
  __syncthreads();
  for (unsigned s = QBLOCK / 2; s > 0; s >>= 1) {
    if (t < s) red[t] = fmaxf(red[t], red[t + s]);
    __syncthreads();
  }
  const float r = red[0];
  __syncthreads();
  return r;
}

// The code of x in a block whose absmax is `absmax` (the zero code when the block is all zero).
__device__ __forceinline__ u8 requantize(const float* code, bool is_signed, float x,
                                         float absmax) {
  if (absmax == 0.0f) return is_signed ? 127 : 0;
  return quantize_search(code, is_signed, x / absmax);
}

// Copies a 256-entry map into shared memory (one entry per thread; the caller synchronizes).
__device__ __forceinline__ void load_map(const float* map, float* code) {
  code[threadIdx.x] = map[threadIdx.x];
}
