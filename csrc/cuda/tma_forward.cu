// `tma` forward (sm_90+): value tiles staged in shared memory by the Tensor
// Memory Accelerator (cp.async.bulk.tensor completing on an mbarrier).
//
// - Grid: one block per (batch n, head m, tile of consecutive queries); a
//   query is served by `lanes` threads as in the baseline (64 queries a block
//   for D = 32 in 16 bits, 32 in fp32).
// - Footprint: the block first reads its tile's locations and, per level,
//   the mean position of the samples that touch the map. The level's box
//   (its size fixed per level by the descriptor, tma_maps.cpp) is centred
//   there and clamped into the level.
// - Pipeline over levels, two buffers: thread 0 issues the copies of levels
//   0 and 1; the block gathers level l from buffer l % 2 once its mbarrier
//   completes, then (after a barrier) the copy of level l + 2 goes into the
//   same buffer, so each copy overlaps the gather of the level before it.
// - Gather: the shared forward code; a corner inside the staged box reads
//   shared memory, any other corner global memory. Levels the descriptors
//   cannot serve (no host shapes match, empty box) read global memory only.
#include "forward_common.cuh"
#include "launch.h"
#include "tma_maps.h"

namespace msda::cuda {
namespace {

constexpr int kTmaThreads = 256;
constexpr int64_t kDefaultBuffers = 16 * 1024;  // both staging buffers together

struct TmaParams {
  ForwardParams p;
  TmaLevels lv;
  int lanes;
  int64_t tiles;      // query tiles per (n, m)
  int64_t buf_bytes;  // one staging buffer (a multiple of 128)
};

// ---- PTX: mbarrier and bulk tensor copy -------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the copy engine.
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival that also expects `bytes` of copies: with 0 bytes the phase
// completes at once.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// Orders this thread's earlier shared-memory accesses (generic proxy) before
// later copies into the same memory (async proxy).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void tma_load_5d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int c0, int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4),
      "r"(smem_u32(bar))
      : "memory");
}

// ---- kernel ------------------------------------------------------------------
template <typename T, typename LT, int VEC>
__global__ void __launch_bounds__(kTmaThreads)
    tma_forward_kernel(const __grid_constant__ TmaParams tp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // never launched there: the backend's predicate needs sm_90
#else
  using A = acc_t<T>;
  const ForwardParams& p = tp.p;
  const Problem& pb = p.pb;
  // Dynamic shared memory: two staging buffers (128-byte aligned, as the copy
  // engine wants), then the CornerSlots.
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* bufs = smem_raw + ((128u - (smem_u32(smem_raw) & 127u)) & 127u);
  const CornerSlots<A> slots(bufs + 2 * tp.buf_bytes, kTmaThreads);
  __shared__ Level levels[kMaxLevels];
  __shared__ int box_x[kMaxLevels], box_y[kMaxLevels];
  __shared__ bool staged[kMaxLevels];
  __shared__ float sums[3][kMaxLevels];  // per level: sum of x * W, of y * H, count
  __shared__ __align__(8) uint64_t bars[2];
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  for (int i = threadIdx.x; i < 3 * kMaxLevels; i += kTmaThreads) sums[i / kMaxLevels][i % kMaxLevels] = 0.f;
  if (threadIdx.x == 0) {
    mbar_init(&bars[0], 1);
    mbar_init(&bars[1], 1);
    mbar_fence_init();
  }
  __syncthreads();

  const int lanes = tp.lanes;
  const int64_t nm = blockIdx.x / tp.tiles;
  const int64_t n = nm / pb.M, m = nm % pb.M;
  const int64_t q = (blockIdx.x % tp.tiles) * (kTmaThreads / lanes) + threadIdx.x / lanes;
  const int lane = static_cast<int>(threadIdx.x % lanes);
  const bool valid = q < pb.Lq;  // whole groups: the group's lanes agree
  const int64_t group = (n * pb.Lq + (valid ? q : 0)) * pb.M + m;
  const int64_t LP = int64_t(pb.L) * pb.P;
  const LT* loc = static_cast<const LT*>(p.loc) + group * LP * 2;
  const LT* attn = static_cast<const LT*>(p.attn) + group * LP;

  // Footprint: per level, the mean position (in pixels) of the tile's
  // samples whose 2x2 footprint touches the map.
  for (int l = 0; l < pb.L; ++l) {
    const Level lv = levels[l];
    A sx = 0, sy = 0, cnt = 0;
    if (valid && lv.H > 0) {
      for (int i = lane; i < pb.P; i += lanes) {
        A xy[2];
        load_xy(loc + 2 * (int64_t(l) * pb.P + i), xy);
        const A x = xy[0] * A(lv.W), y = xy[1] * A(lv.H);
        if (x >= A(-0.5) && y >= A(-0.5) && x < A(lv.W) + A(0.5) && y < A(lv.H) + A(0.5)) {
          sx += x;
          sy += y;
          cnt += A(1);
        }
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      sx += __shfl_xor_sync(0xffffffffu, sx, o);
      sy += __shfl_xor_sync(0xffffffffu, sy, o);
      cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
    }
    if ((threadIdx.x & 31u) == 0 && cnt > A(0)) {
      atomicAdd(&sums[0][l], sx);
      atomicAdd(&sums[1][l], sy);
      atomicAdd(&sums[2][l], cnt);
    }
  }
  __syncthreads();

  const int64_t px_bytes = pb.D * static_cast<int64_t>(sizeof(T));
  // Thread 0: level l's copy into buffer `buf`, or (not staged) an arrival
  // that completes the buffer's phase at once.
  auto issue = [&](int l, int buf) {
    const unsigned bytes =
        staged[l] ? static_cast<unsigned>(tp.lv.box_w[l] * tp.lv.box_h[l] * px_bytes) : 0u;
    mbar_arrive_expect_tx(&bars[buf], bytes);
    if (staged[l]) {
      tma_load_5d(bufs + buf * tp.buf_bytes, &tp.lv.map[l], &bars[buf], 0, static_cast<int>(m),
                  box_x[l], box_y[l], static_cast<int>(n));
    }
  };
  if (threadIdx.x == 0) {
    for (int l = 0; l < pb.L; ++l) {
      const Level lv = levels[l];
      const int bw = tp.lv.box_w[l], bh = tp.lv.box_h[l];
      // The descriptors were made from the host's shapes: a level where the
      // device tensors say otherwise reads global memory only.
      const bool ok = lv.H > 0 && bw > 0 && sums[2][l] > 0.f && lv.H == tp.lv.H[l] &&
                      lv.W == tp.lv.W[l] && lv.start == tp.lv.start[l];
      staged[l] = ok;
      if (ok) {
        const float cx = sums[0][l] / sums[2][l], cy = sums[1][l] / sums[2][l];
        box_x[l] = min(max(static_cast<int>(floorf(cx - 0.5f * bw)), 0), lv.W - bw);
        box_y[l] = min(max(static_cast<int>(floorf(cy - 0.5f * bh)), 0), lv.H - bh);
      }
    }
    for (int l = 0; l < min(pb.L, 2); ++l) issue(l, l);
  }
  __syncthreads();

  const GroupLanes g = group_lanes(lane, lanes);
  const int64_t c = int64_t(lane) * VEC;  // one pass covers D (the predicate's D * size <= 512)
  const bool active = valid && c < pb.D;
  const int64_t cc = active ? c : 0;
  A acc[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = A(0);
  const int64_t row_stride = pb.M * pb.D;
  const unsigned stride_bytes = static_cast<unsigned>(row_stride * sizeof(T));  // < 4 GiB (binding)
  const T* vbase = static_cast<const T*>(p.value) + value_row(n, 0, m, pb.S, pb.M) * pb.D + cc;
  const unsigned D = static_cast<unsigned>(pb.D);
  for (int l = 0; l < pb.L; ++l) {
    const int buf = l & 1;
    mbar_wait(&bars[buf], (l >> 1) & 1);
    const Level lv = levels[l];
    if (valid && lv.H > 0) {
      const T* gl = vbase + lv.start * row_stride;
      auto global = [&](int pix, A(&v)[VEC]) { load_vec<T, VEC>(pixel_ptr(gl, pix, stride_bytes), v); };
      if (staged[l]) {
        // Corners inside the box are numbered -2 - (box-relative pixel).
        const T* sl = reinterpret_cast<const T*>(bufs + buf * tp.buf_bytes) + cc;
        const int bx = box_x[l], by = box_y[l];
        const unsigned bw = tp.lv.box_w[l], bh = tp.lv.box_h[l];
        const int W = lv.W;
        auto index = [&](int row, int col) {
          const unsigned r = static_cast<unsigned>(row - by), k = static_cast<unsigned>(col - bx);
          return (r < bh && k < bw) ? -2 - static_cast<int>(r * bw + k) : row * W + col;
        };
        gather_level(
            g, pb.P, l, loc, attn, active, slots, acc,
            [&](A x, A y, A w) { return resolve_sample(x, y, w, lv.H, lv.W, index); },
            [&](int pix, A(&v)[VEC]) {
              if (pix < 0) {
                load_vec_shared<T, VEC>(sl + static_cast<unsigned>(-2 - pix) * D, v);
              } else {
                global(pix, v);
              }
            });
      } else {
        gather_level(
            g, pb.P, l, loc, attn, active, slots, acc,
            [&](A x, A y, A w) { return resolve_sample(x, y, w, lv.H, lv.W); }, global);
      }
    }
    __syncthreads();  // buffer `buf` is read
    if (threadIdx.x == 0 && l + 2 < pb.L) {
      fence_proxy_async();
      issue(l + 2, buf);
    }
  }
  if (active) store_vec<T, VEC>(static_cast<T*>(p.out) + group * pb.D + c, acc);
#endif
}

template <typename T, typename LT, int VEC>
struct Launch {
  static cudaError_t run(const ForwardParams& p, cudaStream_t stream) {
    if constexpr (VEC * sizeof(T) != 16 || sizeof(T) > 4) {
      return cudaErrorInvalidValue;  // the predicate admits none of these (D * size % 16 == 0)
    } else {
      const Problem& pb = p.pb;
      if (p.host_shapes == nullptr || pb.D % VEC != 0 || pb.D > 32 * VEC) return cudaErrorInvalidValue;
      auto kernel = tma_forward_kernel<T, LT, VEC>;
      // Dynamic shared memory: 128 bytes of alignment slack, the CornerSlots,
      // then the two buffers (8 KB each by default: of the budgets measured,
      // 0-64 KB, none made staging pay, and the small ones cost least,
      // benchmarks/NOTES.md; MS_DEFORM_ATTN_SMEM_BUDGET sets both together).
      SmemPlan plan;
      cudaError_t err = plan_smem(kernel, 128 + CornerSlots<acc_t<T>>::kBytesPerThread * kTmaThreads,
                                  p.smem_budget, kDefaultBuffers, plan);
      if (err != cudaSuccess) return err;
      TmaParams tp;
      tp.p = p;
      tp.buf_bytes = plan.budget / 2 / 128 * 128;
      err = make_tma_levels(p, tp.buf_bytes, tp.lv);
      if (err != cudaSuccess) return err;
      tp.lanes = lanes_for(pb.D, VEC);
      const int64_t per_tile = kTmaThreads / tp.lanes;
      tp.tiles = (pb.Lq + per_tile - 1) / per_tile;
      const int64_t blocks = pb.N * pb.M * tp.tiles;
      if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
      kernel<<<static_cast<unsigned>(blocks), kTmaThreads, plan.dynamic, stream>>>(tp);
      return cudaGetLastError();
    }
  }
};

}  // namespace

cudaError_t tma_forward(const ForwardParams& p, cudaStream_t stream) {
  return launch_for_dtypes<Launch>(p, stream);
}

}  // namespace msda::cuda
