// `cluster` forward (sm_90+): a thread block cluster of C blocks owns one
// (batch n, head m) pair and holds that pair's value map, or as many of its
// levels as fit, spread over the shared memory of its C blocks; every block
// reads the other blocks' parts through distributed shared memory (DSMEM).
//
// - Grid: one cluster per (n, m) pair (C blocks each, C a power of two: the
//   smallest that holds the pair's whole map, at most 8, or 16 where the
//   device allows non-portable clusters). Clusters never wait for each other,
//   so any number of them may be in flight or queued: no hang whatever the
//   grid size.
// - Partition: the cached levels, smallest first while they fit, are
//   concatenated into one pixel sequence s; pixel s lives in block s mod C at
//   row s / C of its part ([pixel][D], one head's channels contiguous). The
//   four corners of a sample thus usually sit in different blocks; the owner
//   and row come from a mask and a shift.
// - Phases: each block copies its pixels in, cluster.sync(), then the
//   cluster's warps share the pair's queries (warp w of block r takes query
//   rounds r * warps + w, + C * warps, ...), gathering cached corners through
//   `mapa` + `ld.shared::cluster` and the others from global memory; a last
//   cluster.sync() keeps every block's part alive until no block reads it.
#include <cooperative_groups.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "../device/sampler.cuh"
#include "../entry_points.h"

namespace msda::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kCThreads = kClusterThreads;  // one block per SM, 32 warps (64 registers a thread)
constexpr int kMaxPortable = 8;
constexpr int kMaxNonPortable = 16;

// ---- distributed shared memory ---------------------------------------------
// Address of the same shared-memory offset in block `rank` of the cluster.
__device__ __forceinline__ uint32_t map_rank(uint32_t addr, uint32_t rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}

template <int Bytes> struct DsmemLoad;
template <> struct DsmemLoad<16> {
  static __device__ __forceinline__ uint4 run(uint32_t a) {
    uint4 r;
    asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(a) : "memory");
    return r;
  }
};
template <> struct DsmemLoad<8> {
  static __device__ __forceinline__ uint2 run(uint32_t a) {
    uint2 r;
    asm volatile("ld.shared::cluster.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "r"(a) : "memory");
    return r;
  }
};
template <> struct DsmemLoad<4> {
  static __device__ __forceinline__ unsigned run(uint32_t a) {
    unsigned r;
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(r) : "r"(a) : "memory");
    return r;
  }
};
template <> struct DsmemLoad<2> {
  static __device__ __forceinline__ unsigned short run(uint32_t a) {
    unsigned short r;
    asm volatile("ld.shared::cluster.u16 %0, [%1];" : "=h"(r) : "r"(a) : "memory");
    return r;
  }
};

// N elements of T at shared::cluster address `a`, widened to the accumulator.
template <typename T, int N>
__device__ __forceinline__ void load_vec_dsmem(uint32_t a, acc_t<T> (&out)[N]) {
  unpack<T, N>(DsmemLoad<sizeof(T) * N>::run(a), out);
}

template <typename T, typename LT, int VEC>
__global__ void __launch_bounds__(kCThreads, 1)
    cluster_forward_kernel(const ForwardParams p, const int lanes, const int log2c,
                           const int64_t part_pixels) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // never launched there: the backend's predicate needs sm_90
#else
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  const cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank();
  const int C = 1 << log2c;
  // Dynamic shared memory: the CornerSlots, then this block's part.
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const CornerSlots<A> slots(smem_raw, kCThreads);
  T* part = reinterpret_cast<T*>(smem_raw + CornerSlots<A>::kBytesPerThread * kCThreads);
  const uint32_t part_addr = static_cast<uint32_t>(__cvta_generic_to_shared(part));
  __shared__ Level levels[kMaxLevels];
  __shared__ int64_t cache_off[kMaxLevels];  // first pixel of level l in the sequence, or -1
  static_assert(sizeof(levels) + sizeof(cache_off) <= kCachingStaticSmem);
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  __syncthreads();
  if (threadIdx.x == 0) choose_cached_levels(levels, pb.L, part_pixels * C, cache_off);
  __syncthreads();

  const int64_t nm = blockIdx.x >> log2c;  // one cluster per (n, m)
  const int64_t n = nm / pb.M, m = nm % pb.M;
  const int64_t row_stride = value_pixel_rows(pb) * pb.D;
  const unsigned stride_bytes = static_cast<unsigned>(row_stride * sizeof(T));  // < 4 GiB (binding)
  const T* vbase = static_cast<const T*>(p.value) + value_row(pb, n, 0, m) * pb.D;
  const int vecs_per_px = static_cast<int>(pb.D / VEC);  // D % VEC == 0 (binding)

  // Load phase: this block's pixels s = rank, rank + C, ... of every cached level.
  for (int l = 0; l < pb.L; ++l) {
    if (cache_off[l] < 0) continue;
    const int64_t first = (rank - cache_off[l] % C + C) % C;  // first pixel of level l with s % C == rank
    const int64_t pixels = int64_t(levels[l].H) * levels[l].W;
    const int64_t mine = pixels > first ? (pixels - first + C - 1) / C : 0;
    const T* src = vbase + levels[l].start * row_stride;
    const int64_t units = mine * vecs_per_px;
    for (int64_t u = threadIdx.x; u < units; u += kCThreads) {
      const int64_t px = first + (u / vecs_per_px) * C, c = (u % vecs_per_px) * VEC;
      const int64_t row = (cache_off[l] + px) >> log2c;
      copy_vec<T, VEC>(part + row * pb.D + c, src + px * row_stride + c);
    }
  }
  cluster.sync();  // every part is written and visible to the whole cluster

  const int warp = threadIdx.x / 32;
  const int lane_in_warp = threadIdx.x % 32;
  const int lane = lane_in_warp % lanes;
  const int warp_q = lane_in_warp / lanes;
  const int q_per_round = 32 / lanes;
  const int64_t warps = int64_t(C) * (kCThreads / 32);
  const unsigned row_bytes = static_cast<unsigned>(pb.D * sizeof(T));
  for (int64_t q0 = (int64_t(rank) * (kCThreads / 32) + warp) * q_per_round; q0 < pb.Lq;
       q0 += warps * q_per_round) {
    const int64_t q = q0 + warp_q;
    if (q >= pb.Lq) continue;  // whole groups: the group's lanes agree
    const int64_t group = (n * pb.Lq + q) * pb.M + m;
    const auto [loc, attn] = query_row<LT>(p, group);
    T* out = static_cast<T*>(p.out) + group * pb.D;
    forward_row<T, LT, VEC>(
        pb, levels, loc, attn, out, lane, lanes, slots, [&](int l, int64_t c, auto&& body) {
          if (cache_off[l] >= 0) {
            const unsigned base = static_cast<unsigned>(cache_off[l]);
            const uint32_t lane_addr = part_addr + static_cast<uint32_t>(c * sizeof(T));
            body([&](int pix, A(&v)[VEC]) {
              const unsigned s = base + static_cast<unsigned>(pix);
              load_vec_dsmem<T, VEC>(
                  map_rank(lane_addr + (s >> log2c) * row_bytes, s & unsigned(C - 1)), v);
            });
          } else {
            const T* gl = vbase + levels[l].start * row_stride + c;
            body([&](int pix, A(&v)[VEC]) { load_vec<T, VEC>(pixel_ptr(gl, pix, stride_bytes), v); });
          }
        });
  }
  cluster.sync();  // no block leaves while another may still read its part
#endif
}

template <typename T, typename LT, int VEC>
struct Launch {
  static cudaError_t run(const ForwardParams& p, cudaStream_t stream) {
    auto kernel = cluster_forward_kernel<T, LT, VEC>;
    // Dynamic shared memory: the CornerSlots, then this block's part (the
    // plan's budget: by default all the shared memory the device allows).
    const int64_t part_pixels = p.plan.smem_budget / (p.pb.D * static_cast<int64_t>(sizeof(T)));
    const int64_t dynamic = CornerSlots<acc_t<T>>::kBytesPerThread * kCThreads + p.plan.smem_budget;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(dynamic));
    if (err != cudaSuccess) return err;

    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute cluster_dim[1] = {};
    cfg.blockDim = dim3(kCThreads);
    cfg.dynamicSmemBytes = static_cast<size_t>(dynamic);
    cfg.stream = stream;
    cfg.attrs = cluster_dim;
    cfg.numAttrs = 1;
    cluster_dim[0].id = cudaLaunchAttributeClusterDimension;
    cluster_dim[0].val.clusterDim.y = cluster_dim[0].val.clusterDim.z = 1;
    // Whether a cluster of c blocks with this much shared memory a block can
    // be resident (cudaOccupancyMaxActiveClusters, asked once per device,
    // size and shared memory: it costs host time on every call otherwise).
    int device = 0;
    err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    auto resident = [&](int c) {
      static std::mutex mu;
      static std::map<std::tuple<int, int, int64_t>, bool> known;
      const std::lock_guard<std::mutex> lock(mu);
      const auto key = std::make_tuple(device, c, dynamic);
      if (auto it = known.find(key); it != known.end()) return it->second;
      cluster_dim[0].val.clusterDim.x = static_cast<unsigned>(c);
      cfg.gridDim = dim3(static_cast<unsigned>(c));
      int clusters = 0;
      const bool ok = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess && clusters > 0;
      (void)cudaGetLastError();  // a refused size is an answer, not an error of this launch
      known.emplace(key, ok);
      return ok;
    };
    int max_c = kMaxPortable;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess &&
        resident(kMaxNonPortable)) {
      max_c = kMaxNonPortable;
    }
    // Smallest cluster that holds the pair's whole map, else the largest one.
    int c = 1;
    while (part_pixels > 0 && c < max_c && int64_t(c) * part_pixels < p.pb.S) c *= 2;
    while (c > 1 && !resident(c)) c /= 2;
    if (!resident(c)) return cudaErrorInvalidConfiguration;  // cannot be resident at all
    int log2c = 0;
    while ((1 << log2c) < c) ++log2c;
    if (p.pb.N * p.pb.M * c > INT32_MAX) return cudaErrorInvalidConfiguration;
    cluster_dim[0].val.clusterDim.x = static_cast<unsigned>(c);
    cfg.gridDim = dim3(static_cast<unsigned>(p.pb.N * p.pb.M * c));
    return cudaLaunchKernelEx(&cfg, kernel, p, p.plan.lanes, log2c, part_pixels);
  }
};

}  // namespace

cudaError_t cluster_forward(const ForwardParams& p, cudaStream_t stream) {
  return launch_for_dtypes<Launch>(p, stream);
}

}  // namespace msda::cuda
