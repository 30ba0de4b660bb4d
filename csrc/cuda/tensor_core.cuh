// Warp-level tensor-core helpers (sm_80+ PTX, used on sm_90): ldmatrix from
// shared memory, the bf16 m16n8k16 mma with fp32 accumulators, and the split
// of fp32 weights into bf16 high and low parts.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace msda::cuda {

// Four 8 x 8 matrices of 16-bit elements, transposed: lane 8 i + r gives the
// shared address of row r of matrix i (16 bytes); r[i] receives matrix i's
// elements (2 (t % 4), t / 4) and (2 (t % 4) + 1, t / 4) of the stored rows,
// lane t. The "memory" clobber keeps it after the stores that filled the rows.
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// d += a (16 x 16, row-major fragment) * b (16 x 8, column fragment), bf16
// inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t bf16x2_bits(__nv_bfloat162 v) {
  return *reinterpret_cast<const uint32_t*>(&v);
}

// (w0, w1) as bf16 pairs hi + lo (w0 in the low half of each): hi = w
// rounded to bf16, lo = the remainder rounded to bf16, so hi + lo carries
// 16 bits of w's mantissa and products with bf16 values summed in fp32 keep
// fp32-grade weights. NaN stays NaN.
__device__ __forceinline__ void split_bf16x2(float w0, float w1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(w0, w1);
  const float2 hf = __bfloat1622float2(h);
  hi = bf16x2_bits(h);
  lo = bf16x2_bits(__floats2bfloat162_rn(w0 - hf.x, w1 - hf.y));
}

}  // namespace msda::cuda
