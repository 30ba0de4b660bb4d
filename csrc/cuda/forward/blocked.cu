// `blocked` forward: a block owns consecutive queries of one (batch, head),
// so the corner rows its warps read are that head's, near each other (the
// L1 serves more of them than when a warp mixes the heads of one query, as
// `baseline` does). The lanes of a group resolve the row's L * P points in
// rounds across levels (gather_row, sampler.cuh): no lane idles where
// P < lanes (fp32: 8 lanes, P = 4). For ms_deform_attn_fused it also forms
// the locations and the softmax from the offsets and logits.
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
    blocked_forward_kernel<T, LT, VEC, false><<<blocks, threads, 0, stream>>>(p, lanes, qblocks);
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t blocked_forward(const ForwardParams& p, cudaStream_t stream) {
  return launch_for_dtypes<Launch>(p, stream);
}

}  // namespace msda::cuda
