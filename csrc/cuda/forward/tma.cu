// `tma` forward (sm_90+): value tiles staged in shared memory by the Tensor
// Memory Accelerator (cp.async.bulk.tensor completing on an mbarrier).
//
// - Work: items of (batch n, head m, tile of queries). A query is served by
//   `lanes` threads as in the baseline (128 queries a 512-thread block for
//   D = 32 in 16 bits, 64 in fp32). When the queries are the pixels of the
//   levels (Lq == S, encoders) a tile is a 2-d patch of one level's pixels
//   (16 x 8 for 128 queries), whose samples fall close together on every
//   level; otherwise it is a run of consecutive queries.
// - Boxes: per level a box of the patch plus a margin (tma_maps.cpp), placed
//   on the mean position of the tile's samples on that level and clamped
//   into the level. Corners inside a box read shared memory, all others
//   global memory, through the shared gather code.
// - Pipeline: a persistent grid (blocks resident at once) walks the items;
//   two stages each hold one item's boxes of every level. While the block
//   gathers item k from one stage, the copies of item k + 1 fill the other:
//   per item, one pass over the next item's locations (its footprint), one
//   barrier, and thread 0 issues the copies.
// - Levels the descriptors cannot serve (host shapes that disagree with the
//   device tensors, no box) read global memory only.
#include "../device/sampler.cuh"
#include "../entry_points.h"
#include "tma_maps.h"

namespace msda::cuda {
namespace {

// kTmaThreads threads a block; both stages together in the plan's budget
// (ForwardPlan::smem_budget; by default kTmaStages, small enough for two
// blocks an SM with 16 KB of CornerSlots each besides; full-size boxes, one
// block an SM, measured slower: docs/performance.md).

struct TmaParams {
  ForwardParams p;
  TmaLevels lv;
  int lanes;
  int tile_w, tile_h;              // 2-d patches (patches == true) of tile_w * tile_h queries
  bool patches;
  int64_t tile_start[kMaxLevels + 1];  // patches: first tile of each query level
  int tiles_x[kMaxLevels];         // patches: tiles along x on each level
  int64_t tiles;                   // tiles per (n, m)
  int64_t items;                   // N * M * tiles
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

// 16 bytes of T at shared address `a`, one LDS.128. Written out because the
// compiler split the plain C++ read (a runtime offset from a box base) into
// four 4-byte LDS, each a separate pass through the banks (SASS of this
// kernel; ncu: 21 shared wavefronts per request).
template <typename T, int N>
__device__ __forceinline__ void load16_shared(uint32_t a, acc_t<T> (&out)[N]) {
  static_assert(sizeof(T) * N == 16, "one 16-byte vector");
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "r"(a));
  unpack<T, N>(r, out);
}

// ---- kernel ------------------------------------------------------------------
// Where a thread's query of item `item` is: its (n, m, q), or q = -1.
struct QueryOf {
  int64_t n, m, q;
};

__device__ __forceinline__ QueryOf query_of(const TmaParams& tp, int64_t item, int qi) {
  const Problem& pb = tp.p.pb;
  const int64_t nm = item / tp.tiles, t = item % tp.tiles;
  QueryOf r{nm / pb.M, nm % pb.M, -1};
  if (!tp.patches) {
    const int64_t q = t * (kTmaThreads / tp.lanes) + qi;
    r.q = q < pb.Lq ? q : -1;
    return r;
  }
  int l = 0;
  while (l + 1 < pb.L && t >= tp.tile_start[l + 1]) ++l;
  const int64_t k = t - tp.tile_start[l];
  const int64_t y = (k / tp.tiles_x[l]) * tp.tile_h + qi / tp.tile_w;
  const int64_t x = (k % tp.tiles_x[l]) * tp.tile_w + qi % tp.tile_w;
  if (y < tp.lv.H[l] && x < tp.lv.W[l]) r.q = tp.lv.start[l] + y * tp.lv.W[l] + x;
  return r;
}

// Per level: sum of x * W, of y * H, and the count of the item's samples
// whose 2x2 footprint touches the map (all threads call it).
template <typename LT>
__device__ __forceinline__ void footprint(const Problem& pb, const Level* levels, const LT* loc,
                                          bool valid, int lane, int lanes, float (*sums)[kMaxLevels]) {
  for (int l = 0; l < pb.L; ++l) {
    const Level lv = levels[l];
    float sx = 0.f, sy = 0.f, cnt = 0.f;
    if (valid) {
      for (int i = lane; i < pb.P; i += lanes) {
        float xy[2];
        load_xy(loc + 2 * (int64_t(l) * pb.P + i), xy);
        const float x = xy[0] * float(lv.W), y = xy[1] * float(lv.H);
        if (x >= -0.5f && y >= -0.5f && x < float(lv.W) + 0.5f && y < float(lv.H) + 0.5f) {
          sx += x;
          sy += y;
          cnt += 1.f;
        }
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      sx += __shfl_xor_sync(0xffffffffu, sx, o);
      sy += __shfl_xor_sync(0xffffffffu, sy, o);
      cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
    }
    if ((threadIdx.x & 31u) == 0 && cnt > 0.f) {
      atomicAdd(&sums[0][l], sx);
      atomicAdd(&sums[1][l], sy);
      atomicAdd(&sums[2][l], cnt);
    }
  }
}

// Stage bookkeeping in shared memory.
struct StageBoxes {
  float sums[3][kMaxLevels];  // footprint() of the item staged here
  int x[kMaxLevels], y[kMaxLevels];
  bool staged[kMaxLevels];
};

template <typename T, typename LT, int VEC>
__global__ void __launch_bounds__(kTmaThreads, 2)
    tma_forward_kernel(const __grid_constant__ TmaParams tp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // never launched there: the backend's predicate needs sm_90
#else
  using A = acc_t<T>;
  const ForwardParams& p = tp.p;
  const Problem& pb = p.pb;
  const TmaLevels& lvs = tp.lv;
  // Dynamic shared memory: two stages (128-byte aligned, as the copy engine
  // wants), then the CornerSlots.
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* stages = smem_raw + ((128u - (smem_u32(smem_raw) & 127u)) & 127u);
  const CornerSlots<A> slots(stages + 2 * lvs.stage_bytes, kTmaThreads);
  __shared__ Level levels[kMaxLevels];
  __shared__ StageBoxes boxes[2];
  __shared__ __align__(8) uint64_t bars[2];
  static_assert(sizeof(levels) + sizeof(boxes) + sizeof(bars) <= kCachingStaticSmem);
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  for (int i = threadIdx.x; i < 2 * 3 * kMaxLevels; i += kTmaThreads) {
    boxes[i / (3 * kMaxLevels)].sums[(i / kMaxLevels) % 3][i % kMaxLevels] = 0.f;
  }
  if (threadIdx.x == 0) {
    mbar_init(&bars[0], 1);
    mbar_init(&bars[1], 1);
    mbar_fence_init();
  }
  __syncthreads();

  const int lanes = tp.lanes;
  const int qi = threadIdx.x / lanes;
  const int lane = static_cast<int>(threadIdx.x % lanes);
  const int64_t px_bytes = pb.D * static_cast<int64_t>(sizeof(T));
  auto loc_of = [&](const QueryOf& w) {
    return query_row<LT>(p, (w.n * pb.Lq + max(w.q, int64_t(0))) * pb.M + w.m).loc;
  };

  // Thread 0: places item `item`'s boxes from its footprint sums and issues
  // their copies into stage s (an arrival that completes the stage's phase
  // at once when nothing is staged), then clears the sums for reuse.
  auto issue = [&](int64_t item, int s) {
    StageBoxes& b = boxes[s];
    const int64_t nm = item / tp.tiles;
    const int n = static_cast<int>(nm / pb.M), m = static_cast<int>(nm % pb.M);
    unsigned bytes = 0;
    for (int l = 0; l < pb.L; ++l) {
      const Level lv = levels[l];
      const int bw = lvs.box_w[l], bh = lvs.box_h[l];
      // The descriptors were made from the host's shapes: a level where the
      // device tensors say otherwise reads global memory only.
      const bool ok = bw > 0 && b.sums[2][l] > 0.f && lv.H == lvs.H[l] &&
                      lv.W == lvs.W[l] && lv.start == lvs.start[l];
      b.staged[l] = ok;
      if (ok) {
        const float cx = b.sums[0][l] / b.sums[2][l], cy = b.sums[1][l] / b.sums[2][l];
        b.x[l] = min(max(static_cast<int>(floorf(cx - 0.5f * bw)), 0), lv.W - bw);
        b.y[l] = min(max(static_cast<int>(floorf(cy - 0.5f * bh)), 0), lv.H - bh);
        bytes += static_cast<unsigned>(bw * bh * px_bytes);
      }
      b.sums[0][l] = b.sums[1][l] = b.sums[2][l] = 0.f;
    }
    fence_proxy_async();  // the stage's previous item was read through the generic proxy
    mbar_arrive_expect_tx(&bars[s], bytes);
    for (int l = 0; l < pb.L; ++l) {
      if (b.staged[l]) {
        tma_load_5d(stages + s * lvs.stage_bytes + lvs.off[l], &lvs.map[l], &bars[s], 0, m, b.x[l],
                    b.y[l], n);
      }
    }
  };

  const int64_t row_stride = value_pixel_rows(pb) * pb.D;
  const unsigned stride_bytes = static_cast<unsigned>(row_stride * sizeof(T));  // < 4 GiB (binding)

  int64_t item = blockIdx.x;
  // This thread's query of the current item and of the next one, each
  // decoded once (the next becomes the current in the loop's increment).
  QueryOf w{0, 0, -1}, w_next{0, 0, -1};
  if (item < tp.items) {
    w = query_of(tp, item, qi);
    footprint(pb, levels, loc_of(w), w.q >= 0, lane, lanes, boxes[0].sums);
  }
  __syncthreads();
  if (threadIdx.x == 0 && item < tp.items) issue(item, 0);
  for (int k = 0; item < tp.items; ++k, item += gridDim.x, w = w_next) {
    const int s = k & 1;
    const int64_t next = item + gridDim.x;
    if (next < tp.items) {
      w_next = query_of(tp, next, qi);
      footprint(pb, levels, loc_of(w_next), w_next.q >= 0, lane, lanes, boxes[s ^ 1].sums);
    }
    // The next item's sums are complete, and every thread is done with stage
    // s ^ 1 (item k - 1): its copies may start.
    __syncthreads();
    if (threadIdx.x == 0 && next < tp.items) issue(next, s ^ 1);
    mbar_wait(&bars[s], (k >> 1) & 1);

    if (w.q < 0) continue;  // whole groups: the group's lanes agree
    const int64_t group = (w.n * pb.Lq + w.q) * pb.M + w.m;
    const auto [loc, attn] = query_row<LT>(p, group);
    const T* vbase = static_cast<const T*>(p.value) + value_row(pb, w.n, 0, w.m) * pb.D;
    const StageBoxes& b = boxes[s];
    forward_row<T, LT, VEC>(
        pb, levels, loc, attn, static_cast<T*>(p.out) + group * pb.D, lane, lanes, slots,
        [&](int l, int64_t c, auto&& body) {
          const Level lv = levels[l];
          const T* gl = vbase + lv.start * row_stride + c;
          auto global = [&](int pix, A(&v)[VEC]) {
            load_vec<T, VEC>(pixel_ptr(gl, pix, stride_bytes), v);
          };
          if (!b.staged[l]) {
            body(global);
            return;
          }
          // Corners inside the box are numbered -2 - (box-relative pixel).
          const uint32_t sl = smem_u32(stages + s * lvs.stage_bytes + lvs.off[l]) +
                              static_cast<uint32_t>(c * sizeof(T));
          const unsigned row_bytes = static_cast<unsigned>(px_bytes);
          const int bx = b.x[l], by = b.y[l], W = lv.W;
          const unsigned bw = lvs.box_w[l], bh = lvs.box_h[l];
          body(
              [&](int pix, A(&v)[VEC]) {
                if (pix < 0) {
                  load16_shared<T, VEC>(sl + static_cast<unsigned>(-2 - pix) * row_bytes, v);
                } else {
                  global(pix, v);
                }
              },
              [&](int row, int col) {
                const unsigned r = static_cast<unsigned>(row - by), k = static_cast<unsigned>(col - bx);
                return (r < bh && k < bw) ? -2 - static_cast<int>(r * bw + k) : row * W + col;
              });
        });
  }
#endif
}

template <typename T, typename LT, int VEC>
struct Launch {
  static cudaError_t run(const ForwardParams& p, cudaStream_t stream) {
    static_assert(VEC * sizeof(T) == 16 && sizeof(T) <= 4, "launch_16_byte_vectors only");
    {
      const Problem& pb = p.pb;
      if (p.host_shapes == nullptr || pb.D % VEC != 0 || pb.D > 32 * VEC) return cudaErrorInvalidValue;
      auto kernel = tma_forward_kernel<T, LT, VEC>;
      TmaParams tp;
      tp.p = p;
      tp.lanes = p.plan.lanes;
      // Tile: as square a patch as a power-of-two query count allows (16 x 8
      // for 128 queries), when the queries are the levels' pixels.
      const int per_tile = kTmaThreads / tp.lanes;
      int tw = 1;
      while (tw * tw < per_tile) tw *= 2;
      tp.tile_w = tw;
      tp.tile_h = per_tile / tw;
      tp.patches = pb.Lq == pb.S;
      // Dynamic shared memory: kTmaAlignSlack bytes of alignment slack, the
      // CornerSlots, then two stages of boxes within the plan's budget.
      const int64_t fixed = kTmaAlignSlack + CornerSlots<acc_t<T>>::kBytesPerThread * kTmaThreads;
      cudaError_t err = make_tma_levels(p, tp.patches ? tp.tile_w : per_tile,
                                        tp.patches ? tp.tile_h : 1, p.plan.smem_budget / 2, tp.lv);
      if (err != cudaSuccess) return err;
      const int64_t dynamic = fixed + 2 * tp.lv.stage_bytes;
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(dynamic));
      if (err != cudaSuccess) return err;
      if (tp.patches) {
        tp.tile_start[0] = 0;
        for (int l = 0; l < pb.L; ++l) {
          const int64_t tx = (tp.lv.W[l] + tp.tile_w - 1) / tp.tile_w;
          const int64_t ty = (tp.lv.H[l] + tp.tile_h - 1) / tp.tile_h;
          tp.tiles_x[l] = static_cast<int>(tx);
          tp.tile_start[l + 1] = tp.tile_start[l] + tx * ty;
        }
        tp.tiles = tp.tile_start[pb.L];
      } else {
        tp.tiles = (pb.Lq + per_tile - 1) / per_tile;
      }
      tp.items = pb.N * pb.M * tp.tiles;
      int per_sm = 0;
      err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kTmaThreads,
                                                          static_cast<size_t>(dynamic));
      if (err != cudaSuccess) return err;
      if (per_sm < 1) return cudaErrorInvalidConfiguration;
      DeviceInfo d;
      err = current_device_info(d);
      if (err != cudaSuccess) return err;
      const int64_t blocks = std::min<int64_t>(tp.items, int64_t(per_sm) * d.sms);
      kernel<<<static_cast<unsigned>(blocks), kTmaThreads, dynamic, stream>>>(tp);
      return cudaGetLastError();
    }
  }
};

}  // namespace

cudaError_t tma_forward(const ForwardParams& p, cudaStream_t stream) {
  return launch_16_byte_vectors<Launch>(p, stream);
}

}  // namespace msda::cuda
