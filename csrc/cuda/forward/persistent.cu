// `persistent` forward: a grid of exactly as many blocks as the GPU holds at
// once (SMs x resident blocks per SM, read from the device: one block of 1024
// threads per SM), each block taking work until none is left.
//
// Work items are (batch n, head m, unit of kWarpQueries consecutive queries),
// one warp's. Every (n, m) has its own atomic unit counter in a zeroed
// workspace (reset by the binding with a memset on the stream: no host sync,
// CUDA-graph safe). A block starts on (n, m) = blockIdx.x mod N*M, loads that
// pair's cache, and its warps take the pair's units on their own (no block
// barrier between units) until the counter runs out; then, after one
// barrier, the block moves on to the next (n, m) with work left. So a block
// keeps one (n, m) for many units and loads its cache once per (n, m), and
// its 32 warps work on neighbouring queries at the same time: their samples
// of the levels read from global memory fall close together and share the
// SM's L1.
//
// Cache: when a block starts on an (n, m) it copies into shared memory every
// level of that (n, m) that fits in its budget, smallest levels first (chosen
// on the device from the level table, which stays on the GPU).
// The default budget is kPersistentCache bytes, not all the shared memory: the
// rest of the SM's 256 KB stays L1 for the levels read from global memory.
// A cached level is stored as [pixel][D] (one head's channels contiguous), so
// the VEC channels a lane reads are contiguous and the `lanes` threads of a
// query read one whole pixel row. Samples on cached levels read shared
// memory, the others global memory with 16-byte vector loads. The budget is
// the plan's (tests shrink it to cover the global fallback).
// Measured (docs/performance.md): the smaller the budget, the faster (a
// cached row costs the L1/TEX pipe what an L1 hit does, and the carve-out
// takes L1 from the other levels); even with none this backend is slower
// than `baseline`, so `auto` never picks it.
#include <algorithm>

#include "../device/sampler.cuh"
#include "../entry_points.h"

namespace msda::cuda {
namespace {

// One block of kPThreads (1024) threads per SM (32 warps, the baseline's
// occupancy; at most 64 registers a thread); its cache's bytes are the
// plan's (ForwardPlan::smem_budget; by default kPersistentCache, the rest of
// the SM's memory is L1).
constexpr int kPThreads = kPersistentThreads;
constexpr int kWarpQueries = 16;                              // queries of a unit (one warp's)
constexpr int kChunkQueries = kWarpQueries * kPThreads / 32;  // a block's round: sizes the grid

// The next unit of a pair's counter for the whole warp: lane 0 takes it,
// every lane gets it.
__device__ __forceinline__ int64_t take_unit(int* counter, int lane_in_warp) {
  int u = 0;
  if (lane_in_warp == 0) u = atomicAdd(counter, 1);
  return __shfl_sync(0xffffffffu, u, 0);
}

template <typename T, typename LT, int VEC>
__global__ void __launch_bounds__(kPThreads, 1)
    persistent_forward_kernel(const ForwardParams p, const int lanes) {
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  // Dynamic shared memory: the CornerSlots, then the cache.
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const CornerSlots<A> slots(smem_raw, kPThreads);
  T* cache = reinterpret_cast<T*>(smem_raw + CornerSlots<A>::kBytesPerThread * kPThreads);
  __shared__ Level levels[kMaxLevels];
  __shared__ int64_t cache_off[kMaxLevels];
  __shared__ int s_unit;
  static_assert(sizeof(levels) + sizeof(cache_off) + sizeof(s_unit) <= kCachingStaticSmem);
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  __syncthreads();
  if (threadIdx.x == 0) {
    choose_cached_levels(levels, pb.L, p.plan.smem_budget / (pb.D * int64_t(sizeof(T))), cache_off);
    for (int l = 0; l < pb.L; ++l) cache_off[l] = cache_off[l] < 0 ? -1 : cache_off[l] * pb.D;
  }
  __syncthreads();

  int* counters = static_cast<int*>(p.workspace);
  const int warp = threadIdx.x / 32;
  const int lane_in_warp = threadIdx.x % 32;
  const int lane = lane_in_warp % lanes;   // channel slice
  const int warp_q = lane_in_warp / lanes;  // query within a warp round
  const int q_per_round = 32 / lanes;
  const int64_t NM = pb.N * pb.M;
  const int64_t units = (pb.Lq + kWarpQueries - 1) / kWarpQueries;
  const int64_t row_stride = value_pixel_rows(pb) * pb.D;
  const unsigned stride_bytes = static_cast<unsigned>(row_stride * sizeof(T));  // < 4 GiB (binding)
  const int d32 = static_cast<int>(pb.D);
  const int vecs_per_px = static_cast<int>(pb.D / VEC);  // cache copy: D % VEC == 0

  for (int64_t k = 0; k < NM; ++k) {
    const int64_t nm = (blockIdx.x + k) % NM;
    const int64_t n = nm / pb.M, m = nm % pb.M;
    // Take a first unit before loading the cache, so that a pair other
    // blocks have finished costs no cache load; warp 0 works on it.
    if (threadIdx.x == 0) s_unit = atomicAdd(counters + nm, 1);
    __syncthreads();
    int64_t unit = s_unit;
    if (unit >= units) {
      __syncthreads();  // s_unit is rewritten next iteration
      continue;
    }
    const T* vbase = static_cast<const T*>(p.value) + value_row(pb, n, 0, m) * pb.D;
    for (int l = 0; l < pb.L; ++l) {
      if (cache_off[l] < 0) continue;
      const T* src = vbase + levels[l].start * row_stride;
      T* dst = cache + cache_off[l];
      const int64_t cells = int64_t(levels[l].H) * levels[l].W * vecs_per_px;
#pragma unroll 4
      for (int64_t u = threadIdx.x; u < cells; u += kPThreads) {
        const int64_t px = u / vecs_per_px, c = (u % vecs_per_px) * VEC;
        copy_vec<T, VEC>(dst + px * pb.D + c, src + px * row_stride + c);
      }
    }
    __syncthreads();

    // Each warp takes its own units (lane 0's atomicAdd, broadcast) until the
    // pair's counter runs out; no block barrier until then.
    if (warp != 0) unit = take_unit(counters + nm, lane_in_warp);
    while (unit < units) {
      const int64_t q0 = unit * kWarpQueries;
      for (int r = 0; r < kWarpQueries; r += q_per_round) {
        const int64_t q = q0 + r + warp_q;
        if (q >= pb.Lq || r + warp_q >= kWarpQueries) continue;
        const int64_t group = (n * pb.Lq + q) * pb.M + m;
        const auto [loc, attn] = query_row<LT>(p, group);
        T* out = static_cast<T*>(p.out) + group * pb.D;
        forward_row<T, LT, VEC>(pb, levels, loc, attn, out, lane, lanes, slots,
                                [&](int l, int64_t c, auto&& body) {
                                  if (cache_off[l] >= 0) {
                                    const T* cl = cache + cache_off[l] + c;
                                    body([&](int pix, A(&v)[VEC]) {
                                      load_vec_shared<T, VEC>(cl + pix * d32, v);
                                    });
                                  } else {
                                    const T* gl = vbase + levels[l].start * row_stride + c;
                                    body([&](int pix, A(&v)[VEC]) {
                                      load_vec<T, VEC>(pixel_ptr(gl, pix, stride_bytes), v);
                                    });
                                  }
                                });
      }
      unit = take_unit(counters + nm, lane_in_warp);
    }
    __syncthreads();  // every warp is done with this pair's cache (and s_unit)
  }
}

template <typename T, typename LT, int VEC>
struct Launch {
  static cudaError_t run(const ForwardParams& p, cudaStream_t stream) {
    auto kernel = persistent_forward_kernel<T, LT, VEC>;
    // Dynamic shared memory: the CornerSlots, then the cache.
    const int64_t dynamic = CornerSlots<acc_t<T>>::kBytesPerThread * kPThreads + p.plan.smem_budget;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(dynamic));
    if (err != cudaSuccess) return err;
    DeviceInfo d;
    err = current_device_info(d);
    if (err != cudaSuccess) return err;
    int per_sm = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kPThreads,
                                                        static_cast<size_t>(dynamic));
    if (err != cudaSuccess) return err;
    const int64_t chunks = (p.pb.Lq + kChunkQueries - 1) / kChunkQueries;
    const int64_t grid =
        std::min<int64_t>(int64_t(std::max(per_sm, 1)) * d.sms, p.pb.N * p.pb.M * chunks);
    kernel<<<static_cast<unsigned>(grid), kPThreads, static_cast<size_t>(dynamic), stream>>>(
        p, p.plan.lanes);
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t persistent_forward(const ForwardParams& p, cudaStream_t stream) {
  return launch_for_dtypes<Launch>(p, stream);
}

}  // namespace msda::cuda
