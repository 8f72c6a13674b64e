// Tensor-core tiles for sm_80 and later: ldmatrix loads of 16-bit tiles from shared memory and the
// mma.sync m16n8k16 product with f32 accumulation, for bf16 and f16 operands.
//
// Fragments (PTX ISA, "Matrix fragments for mma.m16n8k16 with floating point type"), lane =
// 4·g + t:
// - A (16×16, row-major): four 32-bit registers; register r holds row g + 8·(r % 2), columns
//   2t and 2t+1, plus 8 when r >= 2 (the lower column in the low half).
// - B (16×8, "col"): two registers; register r holds rows 2t and 2t+1 (plus 8 when r = 1) of
//   column g.
// - C/D (16×8, f32): four floats; element i is row g + 8·(i / 2), column 2t + i % 2.
// The C layout of two adjacent 16×8 tiles is the A layout of one 16×16 tile, so a score tile
// becomes the A operand of the next product in registers (FlashAttention-2's P·V).
//
// Loads (every address 16-byte aligned, a row of 8 elements contiguous):
// - load_a: a 16×16 A tile from row-major storage (rows = M, columns = K);
// - load_b: a 16×8 B tile from storage that is [N][K] (B transposed, as K is for Q·Kᵀ);
// - load_b_trans: a 16×8 B tile from [K][N] storage (as V is for P·V), by ldmatrix .trans.
//
// With SDTRAIN_EMULATE these run as warp collectives in tests/kernel_emu/emu.h, which implements
// the same layouts; the PTX path is checked against them on a GPU by tests/cuda (flash attention).
#pragma once

#include <stdint.h>

// Two values as one register of two 16-bit elements, `lo` in the low half.
__device__ __forceinline__ uint32_t pack2(__nv_bfloat16, float lo, float hi) {
  return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
         (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16;
}
__device__ __forceinline__ uint32_t pack2(__half, float lo, float hi) {
  return (uint32_t)__half_as_ushort(__float2half_rn(lo)) |
         (uint32_t)__half_as_ushort(__float2half_rn(hi)) << 16;
}

#ifdef SDTRAIN_EMULATE

template <int N>
__device__ __forceinline__ void ldsm(uint32_t (&r)[N], const void* row) {
  emu_ldmatrix(r, N, false, row);
}
template <int N>
__device__ __forceinline__ void ldsm_trans(uint32_t (&r)[N], const void* row) {
  emu_ldmatrix(r, N, true, row);
}
__device__ __forceinline__ void mma16816(__nv_bfloat16, float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
  emu_mma_m16n8k16(d, a, b, true);
}
__device__ __forceinline__ void mma16816(__half, float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
  emu_mma_m16n8k16(d, a, b, false);
}

#else

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void ldsm(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row)));
}
__device__ __forceinline__ void ldsm(uint32_t (&r)[2], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_u32(row)));
}
__device__ __forceinline__ void ldsm_trans(uint32_t (&r)[2], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_u32(row)));
}
__device__ __forceinline__ void mma16816(__nv_bfloat16, float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma16816(__half, float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

#endif

// The A tile at (row0, col0) of row-major `base` (row stride `ld` elements): lanes 0–15 address
// rows row0 + lane of columns col0.., lanes 16–31 the same rows at col0 + 8.
template <class T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* base, int ld, int row0,
                                       int col0, int lane) {
  ldsm(a, base + (long)(row0 + lane % 16) * ld + col0 + (lane / 16) * 8);
}

// The B tile of columns n0..n0+7 and rows k0..k0+15 from [N][K] storage `base`.
template <class T>
__device__ __forceinline__ void load_b(uint32_t (&b)[2], const T* base, int ld, int n0, int k0,
                                       int lane) {
  ldsm(b, base + (long)(n0 + lane % 8) * ld + k0 + ((lane / 8) % 2) * 8);
}

// The B tile of rows k0..k0+15 and columns n0..n0+7 from [K][N] storage `base`.
template <class T>
__device__ __forceinline__ void load_b_trans(uint32_t (&b)[2], const T* base, int ld, int k0,
                                             int n0, int lane) {
  ldsm_trans(b, base + (long)(k0 + lane % 16) * ld + n0);
}

// The A tile (16×16) made of two C tiles side by side, c0 for columns 0–7 and c1 for 8–15,
// rounded to T.
template <class T>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack2(T(), c0[0], c0[1]);
  a[1] = pack2(T(), c0[2], c0[3]);
  a[2] = pack2(T(), c1[0], c1[1]);
  a[3] = pack2(T(), c1[2], c1[3]);
}
