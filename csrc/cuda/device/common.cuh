// Device helpers shared by every CUDA kernel: dtype conversion, vector loads,
// stores and atomics, clamped corners, per-query rows, level metadata and the
// lanes of a group. Topics of their own: fused_samples.cuh (the fused
// operator's locations and weights), grad_value_records.cuh (cell keys and
// block-local records of the sorted backward paths), launch.cuh (dtype
// dispatch and launch helpers), sampler.cuh (the bilinear gather).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../../core/params.h"
#include "../../core/sampling.h"
#include "../../plan/launch_shapes.h"

namespace msda::cuda {

// ---- conversions -----------------------------------------------------------
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_acc(acc_t<T> v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// ---- vector access ---------------------------------------------------------
// N elements of T moved as one access of sizeof(T) * N bytes (16 at most).
template <int Bytes> struct RawVec;
template <> struct RawVec<16> { using type = uint4; };
template <> struct RawVec<8> { using type = uint2; };
template <> struct RawVec<4> { using type = unsigned int; };
template <> struct RawVec<2> { using type = unsigned short; };

// Converts N raw elements to the accumulation type. bf16 pairs are widened
// with one shift or mask per element (the generic path costs two).
template <typename T, int N, typename R>
__device__ __forceinline__ void unpack(const R& raw, acc_t<T> (&out)[N]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
    const unsigned* words = reinterpret_cast<const unsigned*>(&raw);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      out[2 * i] = __uint_as_float(words[i] << 16);
      out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  } else {
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_acc(e[i]);
  }
}

// More than 16 bytes go as several 16-byte loads.
template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, acc_t<T> (&out)[N]) {
  if constexpr (sizeof(T) * N > 16) {
    constexpr int C = 16 / sizeof(T);
    static_assert(N % C == 0, "vector of more than 16 bytes must split into 16-byte parts");
#pragma unroll
    for (int i = 0; i < N; i += C) {
      acc_t<T> part[C];
      load_vec<T, C>(p + i, part);
#pragma unroll
      for (int e = 0; e < C; ++e) out[i + e] = part[e];
    }
  } else {
    using R = typename RawVec<sizeof(T) * N>::type;
    unpack<T, N>(__ldg(reinterpret_cast<const R*>(p)), out);
  }
}

// Same from shared memory (no read-only-cache path there).
template <typename T, int N>
__device__ __forceinline__ void load_vec_shared(const T* p, acc_t<T> (&out)[N]) {
  using R = typename RawVec<sizeof(T) * N>::type;
  unpack<T, N>(*reinterpret_cast<const R*>(p), out);
}

// Raw copy of N elements (no conversion), e.g. global -> shared.
template <typename T, int N>
__device__ __forceinline__ void copy_vec(T* dst, const T* __restrict__ src) {
  using R = typename RawVec<sizeof(T) * N>::type;
  *reinterpret_cast<R*>(dst) = __ldg(reinterpret_cast<const R*>(src));
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const acc_t<T> (&in)[N]) {
  using R = typename RawVec<sizeof(T) * N>::type;
  R raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < N; ++i) e[i] = from_acc<T>(in[i]);
  *reinterpret_cast<R*>(p) = raw;
}

// Atomically adds VEC consecutive accumulators at p (aligned to VEC elements).
// On sm_90+ fp32 goes through the vector atomics (red.global.v4/v2.f32): one
// instruction per 16 bytes instead of one per element.
template <int VEC>
__device__ __forceinline__ void atomic_add_vec(float* p, const float (&v)[VEC]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int i = 0; i < VEC; i += 4) {
      atomicAdd(reinterpret_cast<float4*>(p + i), make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]));
    }
    return;
  } else if constexpr (VEC % 2 == 0) {
#pragma unroll
    for (int i = 0; i < VEC; i += 2) {
      atomicAdd(reinterpret_cast<float2*>(p + i), make_float2(v[i], v[i + 1]));
    }
    return;
  }
#endif
#pragma unroll
  for (int i = 0; i < VEC; ++i) atomicAdd(p + i, v[i]);
}

template <int VEC>
__device__ __forceinline__ void atomic_add_vec(double* p, const double (&v)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) atomicAdd(p + i, v[i]);
}

// A sampling location (x, y), converted to the accumulation type A.
template <typename A, typename LT>
__device__ __forceinline__ void load_xy(const LT* p, A (&xy)[2]) {
  acc_t<LT> raw[2];
  load_vec<LT, 2>(p, raw);
  xy[0] = A(raw[0]);
  xy[1] = A(raw[1]);
}

// Address of pixel `pix` of a level whose pixel 0 is at `base`, at
// `stride_bytes` bytes a pixel (< 4 GiB, checked by the binding): one
// IMAD.WIDE.U32 (pix * stride + base) where element offsets cost four. The
// product in PTX (mul.wide.u32): written in C++, the compiler hoists the
// stride's widening out of the gather loops and then multiplies in 64 bits,
// one more add a corner.
template <typename T>
__device__ __forceinline__ const T* pixel_ptr(const T* base, int pix, unsigned stride_bytes) {
  uint64_t off;
  asm("mul.wide.u32 %0, %1, %2;" : "=l"(off) : "r"(static_cast<unsigned>(pix)), "r"(stride_bytes));
  const uint64_t addr = reinterpret_cast<uint64_t>(base) + off;
  return reinterpret_cast<const T*>(addr);
}

// ---- corners ------------------------------------------------------------------
// The default corner numbering: the row-major pixel of (row, col) in a level
// W pixels wide.
struct RowMajor {
  int W;
  __device__ __forceinline__ int operator()(int row, int col) const { return row * W + col; }
};

// Corners numbered by their pixel in the whole map: the level's first pixel
// `start` plus the row-major pixel (S < 2^31, the binding).
struct MapIndex {
  int start, W;
  __device__ __forceinline__ int operator()(int row, int col) const {
    return start + row * W + col;
  }
};

// The four corners of sample b, clamped into its H x W level (H, W >= 1) so
// that all four can be loaded unconditionally, numbered by index(row, col)
// (the row-major pixel by default); b.corner_ok() says which are real. One
// definition for the forward gathers and the backward.
template <typename A, typename Index>
__device__ __forceinline__ void clamped_corners(const Bilinear<A>& b, int H, int W, Index&& index,
                                                int (&pix)[4]) {
  const int top = max(b.h0, 0), bottom = min(b.h0 + 1, H - 1);
  const int left = max(b.w0, 0), right = min(b.w0 + 1, W - 1);
  pix[0] = index(top, left);
  pix[1] = index(top, right);
  pix[2] = index(bottom, left);
  pix[3] = index(bottom, right);
}

template <typename A>
__device__ __forceinline__ void clamped_corners(const Bilinear<A>& b, int H, int W, int (&pix)[4]) {
  clamped_corners(b, H, W, RowMajor{W}, pix);
}

// ---- per-query rows ---------------------------------------------------------
// Locations and weights of one (n, q, m) group (flattened as in sampling.h):
// L * P points each, for forward and backward params alike.
template <typename LT>
struct QueryRow {
  const LT* loc;
  const LT* attn;
};

template <typename LT, typename Params>
__device__ __forceinline__ QueryRow<LT> query_row(const Params& p, int64_t group) {
  const int64_t LP = int64_t(p.pb.L) * p.pb.P;
  return {static_cast<const LT*>(p.loc) + group * LP * 2, static_cast<const LT*>(p.attn) + group * LP};
}

// ---- level metadata --------------------------------------------------------
// poison: the level table on the device is inconsistent (see load_levels);
// every sample then counts as poisoned (sampling.h), on a 1 x 1 level at
// pixel 0, so the whole output and the location and weight gradients are NaN
// and nothing outside value is read.
struct Level {
  int H, W;
  int64_t start;
  bool poison;

  // The attention weight a sample on this level is resolved with.
  template <typename A>
  __device__ __forceinline__ A weight(A w) const { return poison ? A(NAN) : w; }
};

// The levels in size order: level j comes before level l when it has fewer
// pixels, ties in index order. The caching forwards keep the first ones in
// shared memory; the block-local backward takes their (densest) items first.
__device__ __forceinline__ bool level_before(const Level* lv, int j, int l) {
  const int64_t pj = int64_t(lv[j].H) * lv[j].W, pl = int64_t(lv[l].H) * lv[l].W;
  return pj < pl || (pj == pl && j < l);
}

// Level l's position in that order.
__device__ inline int level_rank(const Level* lv, int L, int l) {
  int r = 0;
  for (int j = 0; j < L; ++j) r += level_before(lv, j, l);
  return r;
}

// Reads the level table into shared memory (call with every thread of the
// block, then __syncthreads()). spatial_shapes and level_start_index on the
// device cannot be checked by the host without a sync, so each block checks
// the whole table here, as the host does for host tensors: every H, W > 0 and
// H * W < 2^31, level_start_index the exclusive cumulative sum of H * W, and
// the sum equal to S. If anything fails, every level becomes a poisoned 1 x 1
// level at pixel 0 (the host checked S >= 1): the error shows as NaN results,
// never as plausible numbers or an out-of-bounds read. Warp 0 does it, one
// level a lane (kMaxLevels <= 32). In two steps where a kernel has work to do
// under the table's load: fetch_level() issues it, store_levels() checks and
// stores.
struct RawLevel {
  int64_t H = 1, W = 1, start = 0;
};

// A level's H and W as the kernels index them: positive, each and their
// product below 2^31.
__device__ __forceinline__ bool level_dims_ok(int64_t H, int64_t W) {
  return H > 0 && W > 0 && H <= INT32_MAX && W <= INT32_MAX && H * W <= INT32_MAX;
}

__device__ __forceinline__ RawLevel fetch_level(const int64_t* shapes, const int64_t* starts,
                                                int L) {
  RawLevel r;
  const int l = static_cast<int>(threadIdx.x);
  if (l < L) {
    r.H = shapes[2 * l];
    r.W = shapes[2 * l + 1];
    r.start = starts[l];
  }
  return r;
}

__device__ __forceinline__ void store_levels(Level* lv, const RawLevel& r, int L, int64_t S) {
  static_assert(kMaxLevels <= 32, "one level a lane of warp 0");
  if (threadIdx.x >= 32) return;
  const int l = static_cast<int>(threadIdx.x);
  const int64_t H = r.H, W = r.W, st = r.start;
  const bool dims_ok = level_dims_ok(H, W);
  const int64_t area = l < L && dims_ok ? H * W : 0;
  int64_t end = area;  // inclusive scan of the areas over the lanes
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t t = __shfl_up_sync(0xffffffffu, end, o);
    if (l >= o) end += t;
  }
  const bool start_ok = l >= L || st == end - area;
  const int64_t total = __shfl_sync(0xffffffffu, end, L - 1);
  const bool ok = __all_sync(0xffffffffu, dims_ok && start_ok) && total == S;
  if (l < L) lv[l] = ok ? Level{int(H), int(W), st, false} : Level{1, 1, 0, true};
}

__device__ __forceinline__ void load_levels(Level* lv, const int64_t* shapes,
                                            const int64_t* starts, int L, int64_t S) {
  store_levels(lv, fetch_level(shapes, starts, L), L, S);
}

// A table of one level (L == 1), read and checked by the calling thread as
// store_levels checks a table: no shared memory, no barrier.
__device__ __forceinline__ Level single_level(const int64_t* shapes, const int64_t* starts,
                                              int64_t S) {
  const int64_t H = __ldg(shapes), W = __ldg(shapes + 1), st = __ldg(starts);
  const bool ok = level_dims_ok(H, W) && st == 0 && H * W == S;
  return ok ? Level{int(H), int(W), 0, false} : Level{1, 1, 0, true};
}

// ---- work decomposition ----------------------------------------------------
// Sums each v[j] over the `lanes` threads of a group, in place; every thread
// of the warp must call it (inactive ones with v = 0). Unrolled over the five
// possible offsets (a loop over a run-time count costs a convergence check
// and a branch per step).
template <typename A, int K>
__device__ __forceinline__ void group_sum(A (&v)[K], int lanes) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    if (o < lanes) {
#pragma unroll
      for (int j = 0; j < K; ++j) v[j] += __shfl_xor_sync(0xffffffffu, v[j], o);
    }
  }
}

}  // namespace msda::cuda
