// Device helpers shared by every CUDA kernel: dtype conversion, vector loads
// and stores, level metadata, and dtype dispatch for the launchers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <type_traits>

#include "../dispatch.h"
#include "../params.h"
#include "../sampling.h"

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
// IMAD.WIDE.U32 (pix * stride + base) where element offsets cost four.
template <typename T>
__device__ __forceinline__ const T* pixel_ptr(const T* base, int pix, unsigned stride_bytes) {
  const uint64_t addr = reinterpret_cast<uint64_t>(base) +
                        static_cast<uint64_t>(static_cast<unsigned>(pix)) * stride_bytes;
  return reinterpret_cast<const T*>(addr);
}

// ---- corners ------------------------------------------------------------------
// The default corner numbering: the row-major pixel of (row, col) in a level
// W pixels wide.
struct RowMajor {
  int W;
  __device__ __forceinline__ int operator()(int row, int col) const { return row * W + col; }
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

// Reads the level table into shared memory (call with every thread of the
// block, then __syncthreads()). spatial_shapes and level_start_index on the
// device cannot be checked by the host without a sync, so each block checks
// the whole table here, as the host does for host tensors: every H, W > 0 and
// H * W < 2^31, level_start_index the exclusive cumulative sum of H * W, and
// the sum equal to S. If anything fails, every level becomes a poisoned 1 x 1
// level at pixel 0 (the host checked S >= 1): the error shows as NaN results,
// never as plausible numbers or an out-of-bounds read. Warp 0 does it, one
// level a lane (kMaxLevels <= 32).
__device__ __forceinline__ void load_levels(Level* lv, const int64_t* shapes,
                                            const int64_t* starts, int L, int64_t S) {
  static_assert(kMaxLevels <= 32, "one level a lane of warp 0");
  if (threadIdx.x >= 32) return;
  const int l = static_cast<int>(threadIdx.x);
  int64_t H = 1, W = 1, st = 0;
  if (l < L) {
    H = shapes[2 * l];
    W = shapes[2 * l + 1];
    st = starts[l];
  }
  const bool dims_ok = H > 0 && W > 0 && H <= INT32_MAX && W <= INT32_MAX && H * W <= INT32_MAX;
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

// ---- ms_deform_attn_fused: locations and weights formed in the kernels ------
// The location of a point from its sampling offset `o` (pixels for points,
// units of half the box over P for boxes) and its query's reference `r` on
// its level lv (ref_dim 2: (x, y); 4: (cx, cy, w, h)): r + o / (W, H), or
// r_xy + o * r_wh * half_p with half_p = 0.5 / P, as multiplications by the
// level's reciprocals (within an ulp or two of the composite's divisions,
// csrc/fused.cpp). Explicitly rounded operations, so that every kernel that
// forms a location gets the same bits (the sorted backward finds a sample's
// cell twice).
__device__ __forceinline__ void fused_location(const float (&o)[2], const float* r, int ref_dim,
                                               float half_p, const Level& lv, float& x, float& y) {
  if (ref_dim == 4) {
    x = __fmaf_rn(o[0], __fmul_rn(r[2], half_p), r[0]);
    y = __fmaf_rn(o[1], __fmul_rn(r[3], half_p), r[1]);
  } else {
    x = __fmaf_rn(o[0], __frcp_rn(float(lv.W)), r[0]);
    y = __fmaf_rn(o[1], __frcp_rn(float(lv.H)), r[1]);
  }
}

// d location / d offset of fused_location, times W (H): what the kernels'
// d out / d (W x) turns into the offset's gradient.
__device__ __forceinline__ void fused_offset_scale(const float* r, int ref_dim, float half_p,
                                                   const Level& lv, float& sx, float& sy) {
  if (ref_dim == 4) {
    sx = float(lv.W) * r[2] * half_p;
    sy = float(lv.H) * r[3] * half_p;
  } else {
    sx = sy = 1.f;  // (1 / W) x W
  }
}

// Softmax weight of a logit given its row's max and the reciprocal of its
// sum of exp(logit - max).
__device__ __forceinline__ float fused_weight(float z, float max, float inv_sum) {
  return __fmul_rn(expf(z - max), inv_sum);
}

// A sample of the sorted backward's grad_value, resolved for its corner
// weights: location and attention weight from the operator's inputs (kFused:
// from the offset, the reference row `ref_row` of its query and level, the
// logit and the row's softmax statistics the dots kernel wrote, by the dots
// kernel's arithmetic), then its footprint on level lv. The weight (w, the
// level's poison applied) goes to `w`. Every kernel that resolves a sample
// for grad_value does it through here, so all find the same cell.
template <typename A, typename LT, bool kFused>
__device__ __forceinline__ Bilinear<A> resolve_sample(const BackwardParams& p, int64_t id, int64_t row,
                                                      const float* ref_row, const Level& lv, A& w) {
  A xy[2];
  if constexpr (kFused) {
    static_assert(std::is_same_v<A, float>, "the fused operator accumulates in float");
    float o[2];
    load_xy(static_cast<const LT*>(p.loc) + 2 * id, o);
    fused_location(o, ref_row, p.ref_dim, 0.5f / float(p.pb.P), lv, xy[0], xy[1]);
    const float2 st = __ldg(reinterpret_cast<const float2*>(p.row_stats) + row);
    w = lv.weight(fused_weight(float(to_acc(__ldg(static_cast<const LT*>(p.attn) + id))), st.x, st.y));
  } else {
    load_xy(static_cast<const LT*>(p.loc) + 2 * id, xy);
    w = lv.weight(A(to_acc(__ldg(static_cast<const LT*>(p.attn) + id))));
  }
  return make_bilinear<A>(xy[0], xy[1], w, lv.H, lv.W);
}

// ---- cells (deterministic backward) ---------------------------------------
// Every bilinear cell (h0, w0), h0 in [-1, H), w0 in [-1, W), of every level of
// every (n, m) gets one key, so that sorting samples by key groups the samples
// that touch a pixel. Level l's cells start at cell_base[l] = the sum over the
// levels before it of (H + 1) * (W + 1); (H + 1) * (W + 1) <= 2 * H * W + 2,
// so 2 * S + 2 * L keys per (n, m) (the host's cell_stride) hold them all.
// Call with every thread, after load_levels() and a __syncthreads().
__device__ __forceinline__ void load_cell_bases(int64_t* base, const Level* lv, int L) {
  if (threadIdx.x == 0) {
    int64_t acc = 0;
    for (int l = 0; l < L; ++l) {
      base[l] = acc;
      acc += (int64_t(lv[l].H) + 1) * (int64_t(lv[l].W) + 1);
    }
  }
}

// The level table and, when `cells` (uniform over the block), the cell
// bases: load_levels() and load_cell_bases() with their barriers. Call with
// every thread of the block.
__device__ __forceinline__ void load_levels_and_cells(Level* lv, int64_t* base,
                                                      const int64_t* shapes, const int64_t* starts,
                                                      int L, int64_t S, bool cells) {
  load_levels(lv, shapes, starts, L, S);
  __syncthreads();
  if (cells) {
    load_cell_bases(base, lv, L);
    __syncthreads();
  }
}

__device__ __forceinline__ uint64_t cell_key(int64_t nm, int64_t cell_stride, int64_t level_base,
                                             int h0, int w0, int W) {
  return uint64_t(nm * cell_stride + level_base + int64_t(h0 + 1) * (W + 1) + (w0 + 1));
}

// grad_value zeroed by the whole grid: what the gathers write when the level
// table on the device is inconsistent (load_levels' poison), since no sample
// adds anything then.
template <typename T>
__device__ __forceinline__ void zero_grad_value(const Problem& pb, T* grad_value) {
  const int64_t total = pb.N * pb.S * pb.M * pb.D;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    grad_value[i] = from_acc<T>(acc_t<T>(0));
  }
}

// ---- block-local records --------------------------------------------------
// The dots kernels (or local_footprints) resolve every sample once and leave
// what the block-local grad_value needs of it (BackwardParams::local_cell,
// local_wts): its cell on its level (local_cell_of) and its four corner
// weights times its attention weight in the order (0, 2, 1, 3), the left
// column's corners 0 and 2, then the right's 1 and 3, which the column walk
// reads as pairs (store_record_weights).
template <typename A>
__device__ __forceinline__ void store_record_weights(A* dst, const Bilinear<A>& b, A w) {
  if constexpr (std::is_same_v<A, float>) {
    *reinterpret_cast<float4*>(dst) =
        make_float4(w * b.weight(0), w * b.weight(2), w * b.weight(1), w * b.weight(3));
  } else {
    reinterpret_cast<double2*>(dst)[0] = make_double2(w * b.weight(0), w * b.weight(2));
    reinterpret_cast<double2*>(dst)[1] = make_double2(w * b.weight(1), w * b.weight(3));
  }
}

// The block-local record's cell: (h0 + 1) (W + 1) + w0 + 1 on the sample's
// level, kNoCell where the sample adds nothing (off the map, poisoned).
constexpr uint32_t kNoCell = 0xffffffffu;
template <typename A>
__device__ __forceinline__ uint32_t local_cell_of(const Bilinear<A>& b, int W) {
  return b.inside && !b.poisoned() ? uint32_t(b.h0 + 1) * uint32_t(W + 1) + uint32_t(b.w0 + 1) : kNoCell;
}

// Record o: the cell of sample b on a level of width W and, where it adds
// something, its corner weights times w.
template <typename A>
__device__ __forceinline__ void write_local_record(const BackwardParams& p, uint32_t o, const Bilinear<A>& b,
                                                   int W, A w) {
  const uint32_t cell = local_cell_of(b, W);
  static_cast<uint32_t*>(p.local_cell)[o] = cell;
  if (cell != kNoCell) store_record_weights<A>(static_cast<A*>(p.local_wts) + 4 * int64_t(o), b, w);
}

// ---- work decomposition ----------------------------------------------------
// A (n, q, m) group is served by `lanes` consecutive threads (a power of two
// <= 32, so a group never straddles a warp); lane j owns channels
// [j * VEC, j * VEC + VEC) + k * lanes * VEC.
inline int lanes_for(int64_t D, int vec) {
  const int64_t vecs = (D + vec - 1) / vec;
  int lanes = 1;
  while (lanes < 32 && lanes < vecs) lanes *= 2;
  return lanes;
}

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

// ---- dtype dispatch --------------------------------------------------------
// Runs Launch<T, LT, VEC>::run(p, stream) for the problem's dtype pair, with
// VEC = kVecBytes bytes (of T, or of the accumulator type when kVecOfAcc)
// when the binding allowed vector access (p.vec), else 1. The kernels are
// instantiated for exactly these two widths.
template <template <typename, typename, int> class Launch, bool kVecOfAcc = false,
          int kVecBytes = 16, typename Params>
cudaError_t launch_for_dtypes(const Params& p, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  dispatch_dtypes<__half, __nv_bfloat16>(p.pb, [&](auto t, auto lt) {
    using T = typename decltype(t)::type;
    using LT = typename decltype(lt)::type;
    constexpr int kVec =
        kVecBytes / static_cast<int>(kVecOfAcc ? sizeof(acc_t<T>) : sizeof(T));
    err = p.vec == kVec ? Launch<T, LT, kVec>::run(p, stream) : Launch<T, LT, 1>::run(p, stream);
  });
  return err;
}

constexpr int kThreads = 256;

// Device figures the caching backends size their launches from.
struct DeviceLimits {
  int sms = 0;
  int smem_optin = 0;  // shared memory a block may opt in to
};

inline cudaError_t query_device_limits(int dev, DeviceLimits& d) {
  cudaError_t err = cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  return err;
}

// The current device's figures, asked of the driver once per device (they
// do not change while the process runs) instead of on every launch.
inline cudaError_t device_limits(DeviceLimits& d) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  constexpr int kMaxDevices = 64;
  if (dev < 0 || dev >= kMaxDevices) return query_device_limits(dev, d);
  static std::once_flag once[kMaxDevices];
  static DeviceLimits cached[kMaxDevices];
  static cudaError_t status[kMaxDevices];
  std::call_once(once[dev], [dev] { status[dev] = query_device_limits(dev, cached[dev]); });
  d = cached[dev];
  return status[dev];
}

// Division of a 31-bit numerator by a divisor fixed at launch: a multiply-
// high, an add and a shift instead of the division routine (Granlund and
// Montgomery's method; the numerator below 2^31 keeps the add in 32 bits).
struct FastDiv {
  uint32_t mul = 1, shift = 0;
  FastDiv() = default;
  __host__ __device__ explicit FastDiv(uint32_t d) {  // d >= 1
    while ((uint64_t(1) << shift) < d) ++shift;
    mul = static_cast<uint32_t>((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d) / d + 1);
  }
  __device__ __forceinline__ uint32_t operator()(uint32_t n) const {
    return (__umulhi(n, mul) + n) >> shift;
  }
};

inline unsigned grid_for(int64_t threads) {
  return static_cast<unsigned>((threads + kThreads - 1) / kThreads);
}

}  // namespace msda::cuda
