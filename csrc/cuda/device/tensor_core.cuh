// Warp-level tensor-core helpers (sm_80+ PTX, used on sm_90): the m16n8k16
// mma of 16-bit inputs with fp32 accumulators, ldmatrix and cp.async.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace msda::cuda {

// d += a (16 x 16, row-major fragment) * b (16 x 8, column fragment), inputs
// of T (__nv_bfloat16 or __half) packed two a register, fp32 accumulators.
// Fragments (PTX ISA, mma.m16n8k16), lane = 4 g + t: a = {(g, 2t..2t+1),
// (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..)}; b = {(2t..2t+1, g),
// (2t + 8.., g)}; d = {(g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)}.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "16-bit inputs");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Four 8 x 8 matrices of 16-bit elements from shared memory: lane i gives
// the address of row i % 8 of matrix i / 8 (16 contiguous bytes); r[j] is
// matrix j in the mma fragment layout (lane 4 g + t: row g, columns 2t,
// 2t + 1), or with `trans` its transpose (rows 2t, 2t + 1, column g).
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
}

// 16 bytes global -> shared through L2 only, without a register round trip;
// `bytes` < 16 of the source are read (0: none) and the rest zero-filled. A
// thread's copies since its last commit form a group; cp_async_wait<N>()
// waits until at most N of its groups are in flight.
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, int bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem_src), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// A weight as a 16-bit (T) high part and the rounding of what is left, so
// that an mma over both (each against the same B) sums it to about fp32
// precision: 16 significant bits for bf16, 22 for fp16 where w's low part
// is a normal fp16 (|w| >= 2^-3; grad_value_tiles_kernel scales fp16 weights into
// that range).
template <typename T>
__device__ __forceinline__ void split_16(float w, uint16_t& hi, uint16_t& lo) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat16 h = __float2bfloat16_rn(w);
    hi = __bfloat16_as_ushort(h);
    lo = __bfloat16_as_ushort(__float2bfloat16_rn(w - __bfloat162float(h)));
  } else {
    static_assert(std::is_same_v<T, __half>, "16-bit inputs");
    const __half h = __float2half_rn(w);
    hi = __half_as_ushort(h);
    lo = __half_as_ushort(__float2half_rn(w - __half2float(h)));
  }
}

// acc += W^T G over one 32-sample round of grad_value_tiles_kernel' layouts: W a
// [k-step][hi, lo][pixel][sample] plane pair (16 pixels x 32 samples, a
// pixel's 16 samples two 16-byte halves swapped on pixels 4-7 and 12-15);
// G's rows (32 channels of 16 bits) wherever they lie in shared memory: for
// k-step h this lane passes grow[h], the row of sample 16 h + 8 ((lane / 8)
// & 1) + lane % 8, whose chunk q (channels 8 q .. 8 q + 7) sits at chunk
// q ^ gswz[h] of it; acc[c] the m16n8 tile of channels 8 c .. 8 c + 7 (lane
// 4 g + t: pixels g and g + 8, channels 8 c + 2 t, + 1). Every lane of the
// warp calls it, after W and G are written and visible.
template <typename T>
__device__ __forceinline__ void wtg_round_rows(float (&acc)[4][4], const uint16_t (&a)[2][2][16][16],
                                               const uint16_t* const (&grow)[2], const int (&gswz)[2],
                                               int lane) {
  const int mi = lane / 8, rr = lane % 8;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t ahi[4], alo[4], b[2][4];
    const int pix = (mi & 1) * 8 + rr, acol = 8 * ((mi >> 1) ^ ((pix >> 2) & 1));
    ldmatrix_x4<false>(ahi, &a[h][0][pix][acol]);
    ldmatrix_x4<false>(alo, &a[h][1][pix][acol]);
#pragma unroll
    for (int cpair = 0; cpair < 2; ++cpair) {
      const int q = 2 * cpair + (mi >> 1);
      ldmatrix_x4<true>(b[cpair], grow[h] + 8 * (q ^ gswz[h]));
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const uint32_t b0 = b[c >> 1][2 * (c & 1)], b1 = b[c >> 1][2 * (c & 1) + 1];
      mma_16816<T>(acc[c], ahi, b0, b1);
      mma_16816<T>(acc[c], alo, b0, b1);
    }
  }
}

// The same with G a [sample][32 channels] array, chunk q of sample s at
// chunk q ^ ((s >> 1) & 3) (conflict-free for ldmatrix).
template <typename T>
__device__ __forceinline__ void wtg_round(float (&acc)[4][4], const uint16_t (&a)[2][2][16][16],
                                          const uint16_t (&g)[32][32], int lane) {
  const int s0 = 8 * ((lane / 8) & 1) + lane % 8, s1 = s0 + 16;
  const uint16_t* const rows[2] = {&g[s0][0], &g[s1][0]};
  const int swz[2] = {(s0 >> 1) & 3, (s1 >> 1) & 3};
  wtg_round_rows<T>(acc, a, rows, swz, lane);
}

}  // namespace msda::cuda
