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

template <typename T, typename LT, int VEC, bool kFused>
// At most 64 registers (4 blocks of 256 per SM), as baseline_forward_kernel.
__global__ void __launch_bounds__(kThreads, kForwardBlocksPerSm)
    blocked_forward_kernel(const ForwardParams p, const int lanes, const int64_t qblocks) {
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  __shared__ __align__(16) unsigned char slot_mem[CornerSlots<A>::kBytesPerThread * kThreads];
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  __syncthreads();

  // Block b: queries [qb G, qb G + G) of (n, m) = divmod(b / qblocks, M).
  const int lane = static_cast<int>(threadIdx.x) % lanes;
  const int groups = static_cast<int>(blockDim.x) / lanes;
  const int64_t qb = blockIdx.x % qblocks, nm = blockIdx.x / qblocks;
  const int64_t q_at = qb * groups + threadIdx.x / lanes;
  // Groups past the last query stay (reading the last query's row, loading
  // nothing), so that every warp syncs whole: a partial-mask __syncwarp
  // costs a convergence check each time.
  const bool valid = q_at < pb.Lq;
  const int64_t q = valid ? q_at : pb.Lq - 1;
  const int64_t m = nm % pb.M, n = nm / pb.M;
  const int64_t group = (n * pb.Lq + q) * pb.M + m;
  const int64_t row_stride = value_pixel_rows(pb) * pb.D;
  const unsigned stride_bytes = static_cast<unsigned>(row_stride * sizeof(T));  // < 4 GiB (binding)
  const T* vbase = static_cast<const T*>(p.value) + value_row(pb, n, 0, m) * pb.D;
  const auto [loc, attn] = query_row<LT>(p, group);
  T* out = static_cast<T*>(p.out) + group * pb.D;
  const CornerSlots<A> slots(slot_mem, kThreads);
  const GroupLanes g = group_lanes(lane, lanes);

  auto row = [&](const auto& pts) {
    const int64_t step = int64_t(lanes) * VEC;
    for (int64_t c0 = 0; c0 < pb.D; c0 += step) {
      const int64_t c = c0 + int64_t(lane) * VEC;
      const bool active = c < pb.D;
      const T* vc = vbase + (active ? c : 0);
      A acc[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] = A(0);
      gather_row<T, !kFused>(g, pb.L, pb.P, levels, pts, valid, active, slots, acc, [&](int pix) {
        return __ldg(reinterpret_cast<const RawCorner<T, VEC>*>(pixel_ptr(vc, pix, stride_bytes)));
      });
      if (valid && active) store_vec<T, VEC>(out + c, acc);
    }
  };
  if constexpr (kFused) {
    float max, inv_sum;
    row_softmax(attn, pb.L * pb.P, g, max, inv_sum);
    const float* ref = p.ref + (group / pb.M) * pb.L * p.ref_dim;  // its (n, q)
    row(FusedPoints<LT>{loc, attn, ref, p.ref_dim, 0.5f / float(pb.P), max, inv_sum});
  } else {
    row(RowPoints<LT>{loc, attn});
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
  const int rows = static_cast<int>(blockDim.x) / row_threads;
  const int64_t qb = blockIdx.x % qblocks, nm = blockIdx.x / qblocks;
  const int64_t q_at = qb * rows + threadIdx.x / row_threads;
  const int64_t q = q_at < pb.Lq ? q_at : pb.Lq - 1;
  const int64_t m = nm % pb.M, n = nm / pb.M;
  const int64_t group = (n * pb.Lq + q) * pb.M + m;
  const auto [loc, attn] = query_row<LT>(p, group);
  LaneRow<T, kLaneRowPoints, LT, A> row{{loc, attn}, pb.L, pb.P, part * kLaneRowPoints,
                                        split * kLaneRowPoints};
  row.prefetch();  // under the level table's load
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  __syncthreads();
  if (q_at >= pb.Lq) return;  // a row's threads leave together: the shuffles below stay whole
  const unsigned mask = (row_threads == 32 ? 0xffffffffu : (1u << row_threads) - 1u)
                        << ((threadIdx.x - t) & 31u);
  const int64_t row_stride = value_pixel_rows(pb) * pb.D;
  const unsigned stride_bytes = static_cast<unsigned>(row_stride * sizeof(T));  // < 4 GiB (binding)
  const T* vbase = static_cast<const T*>(p.value) + value_row(pb, n, 0, m) * pb.D;
  T* out = static_cast<T*>(p.out) + group * pb.D;
  const int64_t first_c = int64_t(lane) * VEC;
  for (int64_t c = first_c; c < pb.D; c += int64_t(lanes) * VEC) {
    const T* vc = vbase + c;
    A acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = A(0);
    if (c != first_c) row.prefetch();
    row.run(levels, acc, [&](int pix) {
      return __ldg(reinterpret_cast<const RawCorner<T, VEC>*>(pixel_ptr(vc, pix, stride_bytes)));
    });
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
    if (p.ref != nullptr) {
      // The fused operator sends no fp64 values here (fused_forward_cuda).
      if constexpr (std::is_same_v<acc_t<T>, float>) {
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
        blocked_lane_rows_kernel<T, LT, VEC>
            <<<static_cast<unsigned>(row_blocks * pb.N * pb.M), threads, 0, stream>>>(
                p, lanes, split, row_blocks);
        return cudaGetLastError();
      }
    }
    blocked_forward_kernel<T, LT, VEC, false><<<blocks, threads, 0, stream>>>(p, lanes, qblocks);
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t blocked_forward(const ForwardParams& p, cudaStream_t stream) {
  return launch_for_dtypes<Launch>(p, stream);
}

}  // namespace msda::cuda
