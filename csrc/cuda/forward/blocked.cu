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
#include "../entry_points.h"

namespace msda::cuda {
namespace {

// The launch's run-time divisions (FastDiv, built on the host): by the
// blocks a (batch, head) takes, by the heads, by the points a level. Every
// block index and point number is below 2^31 (the predicate bounds the grid).
struct RowDivisors {
  uint32_t qblocks, heads;
  FastDiv by_qblocks, by_heads, by_points;
  RowDivisors(int64_t per_head, int64_t M, int64_t P)
      : qblocks(static_cast<uint32_t>(per_head)), heads(static_cast<uint32_t>(M)),
        by_qblocks(qblocks), by_heads(heads), by_points(static_cast<uint32_t>(P)) {}
};

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
                                                const RowDivisors& div) {
  const Problem& pb = p.pb;
  const uint32_t nm = div.by_qblocks(blockIdx.x), n = div.by_heads(nm);
  const uint32_t qb = blockIdx.x - nm * div.qblocks;
  const int64_t q_at = int64_t(qb) * rows + row;
  RowSite<LT> r;
  r.valid = q_at < pb.Lq;
  r.m = nm - n * div.heads;
  r.n = n;
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

// kOneLevel (ForwardPlan::one_level: L == 1, BEVFormer's temporal
// self-attention): every thread reads and checks the level itself
// (single_level), so the block has no barrier before its rows.
template <typename T, typename LT, int VEC, bool kFused, bool kOneLevel = false>
// At most 64 registers (4 blocks of 256 per SM), as baseline_forward_kernel.
__global__ void __launch_bounds__(kThreads, kForwardBlocksPerSm)
    blocked_forward_kernel(const ForwardParams p, const int lanes, const RowDivisors div) {
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  __shared__ __align__(16) unsigned char slot_mem[CornerSlots<A>::kBytesPerThread * kThreads];
  // The level table's load first: the set-up below runs under it.
  RawLevel raw_level;
  if constexpr (!kOneLevel) raw_level = fetch_level(p.spatial_shapes, p.level_start, pb.L);
  // A group a row. Groups past the last query stay (loading nothing), so
  // that every warp syncs whole: a partial-mask __syncwarp costs a
  // convergence check each time. lanes is a power of two (lanes_for).
  const int shift = __ffs(lanes) - 1;
  const int lane = static_cast<int>(threadIdx.x) & (lanes - 1);
  const auto site = row_site<LT>(p, static_cast<int>(blockDim.x) >> shift,
                                 static_cast<int>(threadIdx.x) >> shift, div);
  const bool valid = site.valid;
  const auto [loc, attn] = site.points;
  // The lane's first point, loaded under the level table's load (gather_row's
  // kAhead form; the fused form's points need the table).
  LanePoint<A> next{A(0), A(0), A(0)};
  if constexpr (!kFused) {
    if (valid && lane < pb.L * pb.P) next.load(RowPoints<LT>{loc, attn}, lane);
  }
  Level one{1, 1, 0, true};
  if constexpr (kOneLevel) {
    one = single_level(p.spatial_shapes, p.level_start, pb.S);
  } else {
    store_levels(levels, raw_level, pb.L, pb.S);
    __syncthreads();
  }
  const Level* lvls = kOneLevel ? &one : levels;
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
      if constexpr (!kFused) {
        // A pass past the first (D > lanes * VEC) loads the first point
        // again: holding it over a pass costs the fp32 kernel a spill.
        if (c0 > 0 && valid && lane < pb.L * pb.P) next.load(pts, lane);
      }
      gather_row<T, !kFused, kOneLevel>(g, pb.L, pb.P, div.by_points, lvls, pts, valid, active,
                                        slots, acc, value.at(active ? c : 0), next);
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

// The same rows with per-lane set-up (LaneRow, sampler.cuh): a row is
// served by `split` groups of `lanes` lanes, each taking every split-th
// chunk of the row's points, their sums added by shuffles. For problems
// with few warps (lane_row_split(), plan/launch_shapes.h); 16-byte vectors of
// fp32, bf16 or fp16 only (the rest take the slots).
template <typename T, typename LT, int VEC>
__global__ void __launch_bounds__(kThreads, kLaneRowBlocksPerSm)
    blocked_lane_rows_kernel(const ForwardParams p, const int lanes, const int split,
                             const RowDivisors div) {
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  const int row_threads = lanes * split;  // a power of two <= 32: a row never straddles a warp
  const int t = static_cast<int>(threadIdx.x) % row_threads;
  const int lane = t % lanes, part = t / lanes;
  const auto site = row_site<LT>(p, static_cast<int>(blockDim.x) / row_threads,
                                 static_cast<int>(threadIdx.x) / row_threads, div);
  LaneRow<T, kLaneRowPoints, LT, A> row{{site.points.loc, site.points.attn}, pb.L, pb.P,
                                        part * kLaneRowPoints, split * kLaneRowPoints};
  row.prefetch();  // under the level table's load (loaded here: earlier, its registers spill)
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

// The plan's launch (plan/forward_plan.cpp, plan_blocked): the block size,
// the kernel (per-lane set-up where plan.split > 0) and the blocks a
// (batch, head).
template <typename T, typename LT, int VEC>
struct Launch {
  // One launch of the row kernel in the form the plan asked for.
  template <bool kFused, bool kOneLevel>
  static cudaError_t rows(const ForwardParams& p, unsigned blocks, const RowDivisors& div,
                          cudaStream_t stream) {
    const ForwardPlan& plan = p.plan;
    const cudaError_t err =
        fit_carveout<blocked_forward_kernel<T, LT, VEC, kFused, kOneLevel>>(plan.resident);
    if (err != cudaSuccess) return err;
    blocked_forward_kernel<T, LT, VEC, kFused, kOneLevel><<<blocks, plan.threads, 0, stream>>>(
        p, plan.lanes, div);
    return cudaGetLastError();
  }

  static cudaError_t run(const ForwardParams& p, cudaStream_t stream) {
    const ForwardPlan& plan = p.plan;
    const auto blocks = static_cast<unsigned>(plan.blocks);  // < 2^31: the predicate
    const RowDivisors div(plan.blocks_per_head, p.pb.M, p.pb.P);
    // The forms below other than the default are instantiated only for what
    // the plan gives them: the fused operator sends no fp64 values, and the
    // lane rows and the one-level form take 16-byte vectors of fp32, bf16 or
    // fp16.
    constexpr bool kVec16 = VEC * sizeof(T) == 16 && !std::is_same_v<T, double>;
    if (p.ref != nullptr) {
      if constexpr (std::is_same_v<acc_t<T>, float>) return rows<true, false>(p, blocks, div, stream);
      return cudaErrorInvalidValue;
    }
    if (plan.split > 0) {
      if constexpr (kVec16) {
        const cudaError_t err = fit_carveout<blocked_lane_rows_kernel<T, LT, VEC>>(plan.resident);
        if (err != cudaSuccess) return err;
        blocked_lane_rows_kernel<T, LT, VEC><<<blocks, plan.threads, 0, stream>>>(
            p, plan.lanes, plan.split, div);
        return cudaGetLastError();
      }
      return cudaErrorInvalidValue;
    }
    if (plan.one_level) {
      if constexpr (kVec16) return rows<false, true>(p, blocks, div, stream);
      return cudaErrorInvalidValue;
    }
    return rows<false, false>(p, blocks, div, stream);
  }
};

}  // namespace

cudaError_t blocked_forward(const ForwardParams& p, cudaStream_t stream) {
  return launch_for_dtypes<Launch>(p, stream);
}

}  // namespace msda::cuda
