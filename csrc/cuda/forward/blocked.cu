// `blocked` forward: a block owns consecutive queries of one (batch, head),
// so the corner rows its warps read are that head's, near each other (the
// L1 serves more of them than when a warp mixes the heads of one query, as
// `baseline` does). The lanes of a group resolve the row's L * P points in
// rounds across levels (gather_row, sampler.cuh): no lane idles where
// P < lanes (fp32: 8 lanes, P = 4). For ms_deform_attn_fused it also forms
// the locations and the softmax from the offsets and logits. Where the rows
// give few warps (the decoders), blocked_lane_rows_kernel takes them
// instead: every lane sets up its own points, no slots.
#include <cuda/atomic>

#include "../device/sampler.cuh"
#include "../launch.h"

namespace msda::cuda {
namespace {

// Where a (query, head) row of both kernels lives. Block b holds `rows`
// consecutive queries of (n, m) = divmod(b / qblocks, M); its row r is query
// qb * rows + r, qb = b % qblocks. A row past the last query (valid false)
// stands in for the last one, so that its threads still run the kernel's
// warp-wide steps; it must store nothing.
template <typename LT>
struct RowSite {
  bool valid;
  int64_t n, m;
  int64_t group;  // (n, q, m), flattened as in sampling.h
  QueryRow<LT> points;
};

template <typename LT>
__device__ __forceinline__ RowSite<LT> row_site(const ForwardParams& p, int rows, int row,
                                                int64_t qblocks, unsigned tile) {
  const Problem& pb = p.pb;
  const int64_t qb = tile % qblocks, nm = tile / qblocks;
  const int64_t q_at = qb * rows + row;
  RowSite<LT> r;
  r.valid = q_at < pb.Lq;
  r.m = nm % pb.M;
  r.n = nm / pb.M;
  r.group = (r.n * pb.Lq + (r.valid ? q_at : pb.Lq - 1)) * pb.M + r.m;
  r.points = query_row<LT>(p, r.group);
  return r;
}

// Loads of head m's channels of batch n's pixels: at(c) gives the fetch of
// the VEC channels from c, fetch(pix) -> RawCorner (fetch_corners).
template <typename T, int VEC>
struct HeadPixels {
  const T* base;          // (n, pixel 0, m, channel 0)
  unsigned stride_bytes;  // one pixel (< 4 GiB, the binding)
  __device__ __forceinline__ HeadPixels(const ForwardParams& p, int64_t n, int64_t m)
      : base(static_cast<const T*>(p.value) + value_row(p.pb, n, 0, m) * p.pb.D),
        stride_bytes(static_cast<unsigned>(value_pixel_rows(p.pb) * p.pb.D * sizeof(T))) {}
  __device__ __forceinline__ auto at(unsigned c) const {
    return [vc = base + c, s = stride_bytes](int pix) {
      return __ldg(reinterpret_cast<const RawCorner<T, VEC>*>(pixel_ptr(vc, pix, s)));
    };
  }
};

// The tiles a block takes after its first (blockIdx.x) when the grid is
// smaller than the tiles (blocked_grid, launch_shapes.h): claimed from a
// global counter (the binding's zeroed workspace) two tiles ahead, so that
// an SM whose blocks run faster takes more tiles, and handed to the
// block's warps through a ring in shared memory, without a block barrier:
// a warp waits only for its own next tile. Tile k > 0 of the block is the
// ring's entry k; the first warp to start tile k claims entry k + 2, once
// every warp has taken that slot's previous entry.
struct TileQueue {
  static constexpr int kRing = 8;
  // (entry << 32) | tile: the entry number marks the slot's tile as written.
  unsigned long long word[kRing];
  int claimed[kRing];  // the last entry claimed into the slot
  int taken[kRing];    // warps that have taken the slot's entries, all of them

  // Thread 0, before the block's first barrier: entry 1 claimed.
  __device__ void init(unsigned* counter) {
    for (int i = 0; i < kRing; ++i) {
      word[i] = 0;  // entry 0 is no slot's
      claimed[i] = (i == 0 ? kRing : i) - kRing;
      taken[i] = 0;
    }
    claimed[1] = 1;
    word[1] = (1ull << 32) | (gridDim.x + atomicAdd(counter, 1u));
  }
  // Lane 0 of each warp as the warp starts the block's tile k.
  __device__ void claim(int k, unsigned* counter) {
    const int e = k + 2, i = e % kRing;
    if (atomicCAS(&claimed[i], e - kRing, e) != e - kRing) return;  // another warp's
    const int earlier = (e - 1) / kRing;  // entries e - kRing, e - 2 kRing, ... >= 1
    const int warps = static_cast<int>(blockDim.x) / 32;
    ::cuda::atomic_ref<int, ::cuda::thread_scope_block> taken_i(taken[i]);
    while (taken_i.load(::cuda::memory_order_acquire) < warps * earlier) {
    }
    const unsigned tile = gridDim.x + atomicAdd(counter, 1u);
    ::cuda::atomic_ref<unsigned long long, ::cuda::thread_scope_block>(word[i]).store(
        (static_cast<unsigned long long>(e) << 32) | tile, ::cuda::memory_order_release);
  }
  // Every lane of a warp, once it has finished tile k - 1: entry k's tile.
  __device__ unsigned take(int k) {
    const int i = k % kRing;
    ::cuda::atomic_ref<unsigned long long, ::cuda::thread_scope_block> w(word[i]);
    unsigned long long v;
    do {
      v = w.load(::cuda::memory_order_acquire);
    } while (static_cast<int>(v >> 32) != k);
    __syncwarp();
    if (threadIdx.x % 32 == 0) {
      ::cuda::atomic_ref<int, ::cuda::thread_scope_block>(taken[i]).fetch_add(
          1, ::cuda::memory_order_release);
    }
    return static_cast<unsigned>(v);
  }
};

template <typename T, typename LT, int VEC, bool kFused>
// At most 64 registers (4 blocks of 256 per SM), as baseline_forward_kernel.
// tiles: the grid's rows of queries, `qblocks` a (batch, head); with
// `counter` (a zeroed unsigned) the block loops over tiles (TileQueue),
// otherwise it takes tile blockIdx.x alone.
__global__ void __launch_bounds__(kThreads, kForwardBlocksPerSm)
    blocked_forward_kernel(const ForwardParams p, const int lanes, const int64_t qblocks,
                           const unsigned tiles, unsigned* counter) {
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  __shared__ __align__(16) unsigned char slot_mem[CornerSlots<A>::kBytesPerThread * kThreads];
  __shared__ TileQueue queue;
  // A group a row. Groups past the last query stay (loading nothing), so
  // that every warp syncs whole: a partial-mask __syncwarp costs a
  // convergence check each time.
  const int lane = static_cast<int>(threadIdx.x) % lanes;
  const int rows = static_cast<int>(blockDim.x) / lanes;
  const int my_row = static_cast<int>(threadIdx.x) / lanes;
  const int LP = pb.L * pb.P;
  unsigned tile = blockIdx.x;
  // The lane's first point, loaded under the level table's load (gather_row's
  // kAhead form; the fused form's points need the table).
  LanePoint<A> next{A(0), A(0), A(0)};
  if constexpr (!kFused) {
    const auto first = row_site<LT>(p, rows, my_row, qblocks, tile);
    if (first.valid && lane < LP) next.load(RowPoints<LT>{first.points.loc, first.points.attn}, lane);
  }
  if (counter != nullptr && threadIdx.x == 0) queue.init(counter);
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  __syncthreads();
  const CornerSlots<A> slots(slot_mem, kThreads);
  const GroupLanes g = group_lanes(lane, lanes);

  for (int k = 0;; ++k) {
    if (counter != nullptr && threadIdx.x % 32 == 0) queue.claim(k, counter);
    const auto site = row_site<LT>(p, rows, my_row, qblocks, tile);
    const bool valid = site.valid;
    const auto [loc, attn] = site.points;
    const HeadPixels<T, VEC> value(p, site.n, site.m);
    T* out = static_cast<T*>(p.out) + site.group * pb.D;
    unsigned next_tile = tiles;  // none, unless the last pass takes one
    auto row = [&](const auto& pts) {
      // 32-bit channel offsets (D < 2^31, the binding), unsigned so that the
      // last step cannot overflow; 64-bit ones cost the fp32 kernel a spill.
      for (unsigned c0 = 0; c0 < pb.D; c0 += lanes * VEC) {
        const unsigned c = c0 + lane * VEC;
        const bool active = c < pb.D;
        A acc[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = A(0);
        if constexpr (!kFused) {
          // A pass past the first (D > lanes * VEC) loads the first point
          // again: holding it over a pass costs the fp32 kernel a spill.
          if (c0 > 0 && valid && lane < LP) next.load(pts, lane);
        }
        // The last pass takes the block's next tile and loads its first
        // point during its own last round.
        const bool last_pass = c0 + lanes * VEC >= pb.D;
        gather_row<T, !kFused>(g, pb.L, pb.P, levels, pts, valid, active, slots, acc,
                               value.at(active ? c : 0), next, [&](LanePoint<A>& pt) {
                                 if (counter == nullptr || !last_pass) return;
                                 next_tile = queue.take(k + 1);
                                 if (next_tile >= tiles) return;
                                 const auto s = row_site<LT>(p, rows, my_row, qblocks, next_tile);
                                 if (s.valid && lane < LP) pt.load(RowPoints<LT>{s.points.loc, s.points.attn}, lane);
                               });
        if (valid && active) store_vec<T, VEC>(out + c, acc);
      }
    };
    if constexpr (kFused) {
      float max, inv_sum;
      row_softmax(attn, LP, g, max, inv_sum);
      const float* ref = p.ref + (site.group / pb.M) * pb.L * p.ref_dim;  // its (n, q)
      row(FusedPoints<LT>{loc, attn, ref, p.ref_dim, 0.5f / float(pb.P), max, inv_sum});
      return;  // one tile a block (the launcher passes no counter)
    } else {
      row(RowPoints<LT>{loc, attn});
    }
    if (next_tile >= tiles) return;
    tile = next_tile;
  }
}

// The same rows with per-lane set-up (LaneRow, sampler.cuh): a row is
// served by `split` groups of `lanes` lanes, each taking every split-th
// chunk of the row's points, their sums added by shuffles. For problems
// with few warps (lane_row_split(), launch_shapes.h); 16-byte vectors of
// fp32, bf16 or fp16 only (the rest take the slots).
template <typename T, typename LT, int VEC>
__global__ void __launch_bounds__(kThreads, kLaneRowBlocksPerSm)
    blocked_lane_rows_kernel(const ForwardParams p, const int lanes, const int split,
                             const int64_t qblocks) {
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  const int row_threads = lanes * split;  // a power of two <= 32: a row never straddles a warp
  const int t = static_cast<int>(threadIdx.x) % row_threads;
  const int lane = t % lanes, part = t / lanes;
  const auto site = row_site<LT>(p, static_cast<int>(blockDim.x) / row_threads,
                                 static_cast<int>(threadIdx.x) / row_threads, qblocks, blockIdx.x);
  LaneRow<T, kLaneRowPoints, LT, A> row{{site.points.loc, site.points.attn}, pb.L, pb.P,
                                        part * kLaneRowPoints, split * kLaneRowPoints};
  row.prefetch();  // under the level table's load
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  __syncthreads();
  if (!site.valid) return;  // a row's threads leave together: the shuffles below stay whole
  const unsigned mask = (row_threads == 32 ? 0xffffffffu : (1u << row_threads) - 1u)
                        << ((threadIdx.x - t) & 31u);
  const HeadPixels<T, VEC> value(p, site.n, site.m);
  T* out = static_cast<T*>(p.out) + site.group * pb.D;
  const unsigned first_c = lane * VEC;  // 32-bit, as in blocked_forward_kernel
  for (unsigned c = first_c; c < pb.D; c += lanes * VEC) {
    A acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = A(0);
    if (c != first_c) row.prefetch();
    row.run(levels, acc, value.at(c));
    for (int o = lanes; o < row_threads; o <<= 1) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] += __shfl_xor_sync(mask, acc[e], o);
    }
    if (part == 0) store_vec<T, VEC>(out + c, acc);
  }
}

// The launch of `blocked` for p: which kernel, its grid, and whether its
// blocks claim tiles (then it needs the 4-byte counter of
// blocked_workspace_bytes).
struct Plan {
  int lanes = 0;
  int split = 0;  // > 0: blocked_lane_rows_kernel, a row over `split` groups
  BlockedGrid grid;
};

Plan plan_for(const ForwardParams& p, int sms) {
  const Problem& pb = p.pb;
  Plan plan;
  plan.lanes = lanes_for(pb.D, p.vec);
  const int64_t elem = dtype_bytes(pb.value_dtype);
  // 16-byte vectors of fp32, bf16 or fp16 only (the rest take the slots).
  if (p.ref == nullptr && p.vec * elem == 16 && elem != 8 &&
      p.blocked_rows != BlockedRows::shared) {
    plan.split = lane_row_split(pb.N * pb.M * pb.Lq, plan.lanes, pb.L * pb.P, sms,
                                p.blocked_rows == BlockedRows::lane);
  }
  BlockedGrid& g = plan.grid;
  g = blocked_grid(pb.N * pb.M, pb.Lq, plan.lanes, sms, p.ref != nullptr || plan.split > 0,
                   p.blocked_grid);
  if (plan.split > 0) {  // blocked_lane_rows_kernel: the same blocks, fewer rows each
    const int64_t rows = g.threads / (plan.lanes * plan.split);  // threads >= 32 >= lanes * split
    g.qblocks = (pb.Lq + rows - 1) / rows;
    g.tiles = g.blocks = g.qblocks * pb.N * pb.M;
  }
  return plan;
}

template <typename T, typename LT, int VEC>
struct Launch {
  static cudaError_t run(const ForwardParams& p, cudaStream_t stream) {
    DeviceLimits d;
    cudaError_t err = device_limits(d);
    if (err != cudaSuccess) return err;
    const Plan plan = plan_for(p, d.sms);
    const BlockedGrid& g = plan.grid;
    const auto blocks = static_cast<unsigned>(g.blocks);  // tiles < 2^31: the predicate
    if constexpr (VEC * sizeof(T) == 16 && !std::is_same_v<T, double>) {
      if (plan.split > 0) {
        err = fit_carveout<blocked_lane_rows_kernel<T, LT, VEC>>(kLaneRowBlocksPerSm * kThreads /
                                                                 g.threads);
        if (err != cudaSuccess) return err;
        blocked_lane_rows_kernel<T, LT, VEC><<<blocks, g.threads, 0, stream>>>(
            p, plan.lanes, plan.split, g.qblocks);
        return cudaGetLastError();
      }
    }
    const int resident = kForwardBlocksPerSm * kThreads / g.threads;  // an SM, by the register cap
    const auto tiles = static_cast<unsigned>(g.tiles);
    if (p.ref != nullptr) {
      // The fused operator sends no fp64 values here (fused_forward_cuda).
      if constexpr (std::is_same_v<acc_t<T>, float>) {
        err = fit_carveout<blocked_forward_kernel<T, LT, VEC, true>>(resident);
        if (err != cudaSuccess) return err;
        blocked_forward_kernel<T, LT, VEC, true>
            <<<blocks, g.threads, 0, stream>>>(p, plan.lanes, g.qblocks, tiles, nullptr);
        return cudaGetLastError();
      }
      return cudaErrorInvalidValue;
    }
    if (g.claims && p.workspace == nullptr) return cudaErrorInvalidValue;
    err = fit_carveout<blocked_forward_kernel<T, LT, VEC, false>>(resident);
    if (err != cudaSuccess) return err;
    blocked_forward_kernel<T, LT, VEC, false><<<blocks, g.threads, 0, stream>>>(
        p, plan.lanes, g.qblocks, tiles, g.claims ? static_cast<unsigned*>(p.workspace) : nullptr);
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t blocked_forward(const ForwardParams& p, cudaStream_t stream) {
  return launch_for_dtypes<Launch>(p, stream);
}

int64_t blocked_workspace_bytes(const ForwardParams& p) {
  DeviceLimits d;
  if (device_limits(d) != cudaSuccess) return 0;  // the launch reports the error
  return plan_for(p, d.sms).grid.claims ? int64_t(sizeof(unsigned)) : 0;
}

}  // namespace msda::cuda
