// `blocked` forward: a block owns consecutive queries of one (batch, head),
// so the corner rows its warps read are that head's, near each other (the
// L1 serves more of them than when a warp mixes the heads of one query, as
// `baseline` does). The lanes of a group resolve the row's L * P points in
// rounds across levels (gather_row, sampler.cuh): no lane idles where
// P < lanes (fp32: 8 lanes, P = 4). For ms_deform_attn_fused it also forms
// the locations and the softmax from the offsets and logits. Where the rows
// give few warps (the decoders), blocked_lane_rows_kernel takes them
// instead: every lane sets up its own points, no slots.
#include "../device/sampler.cuh"
#include "../launch.h"

namespace msda::cuda {
namespace {

// The smallest block the launcher halves down to (threads); the kernel's
// slots are sized for the largest, kThreads.
constexpr int kMinBlockThreads = 64;

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
                                                int64_t qblocks, int64_t b = -1) {
  const Problem& pb = p.pb;
  if (b < 0) b = blockIdx.x;
  const int64_t qb = b % qblocks, nm = b / qblocks;
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

template <typename T, typename LT, int VEC, bool kFused, int kAhead = 0>
// At most 64 registers (4 blocks of 256 per SM), as baseline_forward_kernel.
__global__ void __launch_bounds__(kThreads, kForwardBlocksPerSm)
    blocked_forward_kernel(const ForwardParams p, const int lanes, const int64_t qblocks) {
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  __shared__ __align__(16) unsigned char slot_mem[CornerSlots<A>::kBytesPerThread * kThreads];
  // A group a row. Groups past the last query stay (loading nothing), so
  // that every warp syncs whole: a partial-mask __syncwarp costs a
  // convergence check each time.
  const int lane = static_cast<int>(threadIdx.x) % lanes;
  const auto site = row_site<LT>(p, static_cast<int>(blockDim.x) / lanes,
                                 static_cast<int>(threadIdx.x) / lanes, qblocks);
  PointAhead<A> first{A(0), A(0), A(0)};
  if constexpr (kAhead == 1 || kAhead == 2) {
    if (site.valid) prefetch_row<kAhead>(RowPoints<LT>{site.points.loc, site.points.attn},
                                         pb.L * pb.P, lane, lanes);
  } else if constexpr (kAhead == 3) {
    if (site.valid && lane < pb.L * pb.P)
      load_point(site.points.loc, site.points.attn, lane, first.x, first.y, first.w);
  }
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  __syncthreads();
  const bool valid = site.valid;
  const auto [loc, attn] = site.points;
  const HeadPixels<T, VEC> value(p, site.n, site.m);
  T* out = static_cast<T*>(p.out) + site.group * pb.D;
  const CornerSlots<A> slots(slot_mem, kThreads);
  const GroupLanes g = group_lanes(lane, lanes);

  auto row = [&](const auto& pts) {
    // 32-bit channel offsets (D < 2^31, the binding), unsigned so that the
    // last step cannot overflow; 64-bit ones cost the fp32 kernel a spill.
    for (unsigned c0 = 0; c0 < pb.D; c0 += lanes * VEC) {
      const unsigned c = c0 + lane * VEC;
      const bool active = c < pb.D;
      A acc[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] = A(0);
      if constexpr (kAhead == 3 && !kFused) {
        gather_row_ahead<T>(g, pb.L, pb.P, levels, pts, valid, active, slots, acc, first,
                            value.at(active ? c : 0));
      } else {
        gather_row<T, !kFused>(g, pb.L, pb.P, levels, pts, valid, active, slots, acc,
                               value.at(active ? c : 0));
      }
      if (valid && active) store_vec<T, VEC>(out + c, acc);
    }
  };
  if constexpr (kFused) {
    float max, inv_sum;
    row_softmax(attn, pb.L * pb.P, g, max, inv_sum);
    const float* ref = p.ref + (site.group / pb.M) * pb.L * p.ref_dim;  // its (n, q)
    row(FusedPoints<LT>{loc, attn, ref, p.ref_dim, 0.5f / float(pb.P), max, inv_sum});
  } else {
    row(RowPoints<LT>{loc, attn});
  }
}

__device__ unsigned g_proto_tiles[2];  // prototype only: not safe across concurrent launches

// PROTOTYPE (MSDA_PROTO_WAVES): blocked_forward_kernel's rows (kAhead 3)
// with each block taking tiles b, b + gridDim.x, ... (`tiles` in all): the
// level table once a block, the next tile's first points loaded during the
// current tile's last round. D within one channel pass.
template <typename T, typename LT, int VEC>
__global__ void __launch_bounds__(kThreads, kForwardBlocksPerSm)
    blocked_forward_loop_kernel(const ForwardParams p, const int lanes, const int64_t qblocks,
                                const int64_t tiles, const int mode, const int64_t persistent,
                                const int64_t per_block) {
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  __shared__ __align__(16) unsigned char slot_mem[CornerSlots<A>::kBytesPerThread * kThreads];
  const int lane = static_cast<int>(threadIdx.x) % lanes;
  const int rows = static_cast<int>(blockDim.x) / lanes, row = static_cast<int>(threadIdx.x) / lanes;
  const int LP = pb.L * pb.P;
  // mode 2: tiles past the first gridDim.x from a counter (the last block
  // out resets it); next_tile[k & 1] holds tile k's index.
  __shared__ int64_t next_tile[2];
  // mode 3: blocks below `persistent` take tiles b + k * persistent, k <
  // per_block; the rest one tile each, past those, in order (the hardware
  // hands them to the SMs that finish first).
  const bool single = mode == 3 && blockIdx.x >= persistent;
  int64_t b = single ? persistent * per_block + (blockIdx.x - persistent) : blockIdx.x;
  const int64_t stride = mode == 3 ? persistent : gridDim.x;
  const int64_t last = mode == 3 ? (single ? b : b + (per_block - 1) * persistent) : tiles - 1;
  int64_t fetched = 0;
  if (mode == 2 && threadIdx.x == 0) next_tile[1] = gridDim.x + atomicAdd(&g_proto_tiles[0], 1u);
  auto site = row_site<LT>(p, rows, row, qblocks, b);
  PointAhead<A> nx{A(0), A(0), A(0)};
  if (site.valid && lane < LP) load_point(site.points.loc, site.points.attn, lane, nx.x, nx.y, nx.w);
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  __syncthreads();
  int k = 0;
  const CornerSlots<A> slots(slot_mem, kThreads);
  const GroupLanes g = group_lanes(lane, lanes);
  const unsigned c = lane * VEC;
  const bool active = c < pb.D;
  for (;; ++k) {
    const int64_t bn = mode == 2 ? next_tile[(k + 1) & 1] : b + stride;
    if (mode == 2 && threadIdx.x == 0) fetched = gridDim.x + atomicAdd(&g_proto_tiles[0], 1u);
    const bool more = bn < tiles && bn <= last;
    const LT *nloc = nullptr, *nattn = nullptr;
    if (more) {
      const int64_t qb = bn % qblocks, nm = bn / qblocks, q = qb * rows + row;
      if (q < pb.Lq) {
        const auto pts = query_row<LT>(p, ((nm / pb.M) * pb.Lq + q) * pb.M + nm % pb.M);
        nloc = pts.loc;
        nattn = pts.attn;
      }
    }
    const HeadPixels<T, VEC> value(p, site.n, site.m);
    A acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = A(0);
    gather_row_ahead<T>(g, pb.L, pb.P, levels, RowPoints<LT>{site.points.loc, site.points.attn},
                        site.valid, active, slots, acc, nx, value.at(active ? c : 0), nloc, nattn);
    if (site.valid && active)
      store_vec<T, VEC>(static_cast<T*>(p.out) + site.group * pb.D + c, acc);
    if (mode == 2 && threadIdx.x == 0) next_tile[k & 1] = fetched;
    if (mode >= 1) __syncthreads();
    if (!more) break;
    b = bn;
    site = row_site<LT>(p, rows, row, qblocks, b);
  }
  if (mode == 2 && threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&g_proto_tiles[1], 1u) == gridDim.x - 1) {
      g_proto_tiles[0] = 0;
      g_proto_tiles[1] = 0;
      __threadfence();
    }
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
                                 static_cast<int>(threadIdx.x) / row_threads, qblocks);
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

template <typename T, typename LT, int VEC>
struct Launch {
  static cudaError_t run(const ForwardParams& p, cudaStream_t stream) {
    DeviceLimits d;
    cudaError_t err = device_limits(d);
    if (err != cudaSuccess) return err;
    const Problem& pb = p.pb;
    const int lanes = lanes_for(pb.D, VEC);
    auto qblocks_for = [&](int threads) {
      const int64_t groups = threads / lanes;
      return (pb.Lq + groups - 1) / groups;
    };
    // Smaller blocks where blocks of kThreads would leave SMs idle (the
    // decoders: a few hundred queries a (batch, head)).
    int threads = kThreads;
    while (threads > kMinBlockThreads && threads / 2 >= lanes &&
           qblocks_for(threads) * pb.N * pb.M < 2 * int64_t(d.sms)) {
      threads /= 2;
    }
    const int64_t qblocks = qblocks_for(threads);
    const auto blocks = static_cast<unsigned>(qblocks * pb.N * pb.M);  // < 2^31: the predicate
    const int resident = kForwardBlocksPerSm * kThreads / threads;  // an SM, by the register cap
    if (p.ref != nullptr) {
      // The fused operator sends no fp64 values here (fused_forward_cuda).
      if constexpr (std::is_same_v<acc_t<T>, float>) {
        err = fit_carveout<blocked_forward_kernel<T, LT, VEC, true>>(resident);
        if (err != cudaSuccess) return err;
        blocked_forward_kernel<T, LT, VEC, true><<<blocks, threads, 0, stream>>>(p, lanes, qblocks);
        return cudaGetLastError();
      }
      return cudaErrorInvalidValue;
    }
    if constexpr (VEC * sizeof(T) == 16 && !std::is_same_v<T, double>) {
      const int split = p.blocked_rows == BlockedRows::shared
                            ? 0
                            : lane_row_split(pb.N * pb.M * pb.Lq, lanes, pb.L * pb.P, d.sms,
                                             p.blocked_rows == BlockedRows::lane);
      if (split > 0) {
        const int64_t rows = threads / (lanes * split);  // threads >= 32 >= lanes * split
        const int64_t row_blocks = (pb.Lq + rows - 1) / rows;
        err = fit_carveout<blocked_lane_rows_kernel<T, LT, VEC>>(kLaneRowBlocksPerSm * kThreads /
                                                                 threads);
        if (err != cudaSuccess) return err;
        blocked_lane_rows_kernel<T, LT, VEC>
            <<<static_cast<unsigned>(row_blocks * pb.N * pb.M), threads, 0, stream>>>(
                p, lanes, split, row_blocks);
        return cudaGetLastError();
      }
    }
    const char* ahead_env = getenv("MSDA_PROTO_AHEAD");
    const int ahead = ahead_env ? atoi(ahead_env) : 0;
    auto go = [&](auto kernel) {
      cudaError_t e = fit_carveout<decltype(kernel)::value>(resident);
      if (e != cudaSuccess) return e;
      decltype(kernel)::value<<<blocks, threads, 0, stream>>>(p, lanes, qblocks);
      return cudaGetLastError();
    };
    if constexpr (!std::is_same_v<T, double>) {
      // Only for round(s) after the first: a channel pass past the first
      // re-resolves from round 0 (kAhead 3 needs D within one pass).
      if (ahead == 1) return go(std::integral_constant<decltype(&blocked_forward_kernel<T, LT, VEC, false, 1>), &blocked_forward_kernel<T, LT, VEC, false, 1>>{});
      if (ahead == 2) return go(std::integral_constant<decltype(&blocked_forward_kernel<T, LT, VEC, false, 2>), &blocked_forward_kernel<T, LT, VEC, false, 2>>{});
      const char* waves_env = getenv("MSDA_PROTO_WAVES");
      const int waves = waves_env ? atoi(waves_env) : 0;
      if (waves > 0 && pb.D <= lanes * VEC && threads == kThreads) {
        const char* grid_env = getenv("MSDA_PROTO_GRID");  // tests: a few blocks, many tiles each
        int64_t grid = std::min<int64_t>(
            blocks, grid_env ? atoi(grid_env) : int64_t(waves) * resident * d.sms);
        const int mode = getenv("MSDA_PROTO_LOOP") ? atoi(getenv("MSDA_PROTO_LOOP")) : 0;
        int64_t persistent = grid, per_block = 0;
        if (mode == 3) {
          const int frac = getenv("MSDA_PROTO_FRAC") ? atoi(getenv("MSDA_PROTO_FRAC")) : 75;
          per_block = int64_t(blocks) * frac / 100 / persistent;
          grid = per_block > 0 ? persistent + (blocks - persistent * per_block) : blocks;
          if (per_block == 0) persistent = 0;
        }
        err = fit_carveout<blocked_forward_loop_kernel<T, LT, VEC>>(resident);
        if (err != cudaSuccess) return err;
        blocked_forward_loop_kernel<T, LT, VEC><<<static_cast<unsigned>(grid), threads, 0, stream>>>(
            p, lanes, qblocks, blocks, mode, persistent, per_block);
        return cudaGetLastError();
      }
      if (ahead == 3 && pb.D <= lanes * VEC) return go(std::integral_constant<decltype(&blocked_forward_kernel<T, LT, VEC, false, 3>), &blocked_forward_kernel<T, LT, VEC, false, 3>>{});
    }
    return go(std::integral_constant<decltype(&blocked_forward_kernel<T, LT, VEC, false>), &blocked_forward_kernel<T, LT, VEC, false>>{});
  }
};

}  // namespace

cudaError_t blocked_forward(const ForwardParams& p, cudaStream_t stream) {
  return launch_for_dtypes<Launch>(p, stream);
}

}  // namespace msda::cuda
