// `baseline` forward: one thread owns VEC channels of one (query, head); the
// `lanes` threads of a (query, head) read each location and weight once per
// (level, point) (one broadcast request per warp) and gather the four corners
// with 16-byte vector loads. fp32 (fp64 for fp64) coordinate math and
// accumulation. For ms_deform_attn_fused it also forms the locations and
// the softmax from the offsets and logits (FusedPoints, sampler.cuh).
#include "../device/sampler.cuh"
#include "../entry_points.h"

namespace msda::cuda {
namespace {

// kFused: ms_deform_attn_fused (p.ref set): loc / attn are the offsets and
// logits, the group forms its row's softmax and each point's location.
template <typename T, typename LT, int VEC, bool kFused>
// At most 64 registers (4 blocks of 256 per SM, 32 warps): the gather is
// latency-bound and no spills result (ptxas: 60-63 registers).
__global__ void __launch_bounds__(kThreads, kForwardBlocksPerSm)
    baseline_forward_kernel(const ForwardParams p, const int lanes) {
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  __shared__ __align__(16) unsigned char slot_mem[CornerSlots<A>::kBytesPerThread * kThreads];
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  __syncthreads();

  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t group = tid / lanes;
  if (group >= pb.N * pb.Lq * pb.M) return;
  const int lane = static_cast<int>(tid % lanes);
  const int64_t m = group % pb.M, n = group / (pb.Lq * pb.M);
  const int64_t row_stride = value_pixel_rows(pb) * pb.D;  // elements between neighbouring pixels
  const unsigned stride_bytes = static_cast<unsigned>(row_stride * sizeof(T));  // < 4 GiB (binding)
  const T* vbase = static_cast<const T*>(p.value) + value_row(pb, n, 0, m) * pb.D;
  const auto [loc, attn] = query_row<LT>(p, group);
  T* out = static_cast<T*>(p.out) + group * pb.D;

  auto with_fetch = [&](int l, int64_t c, auto&& body) {
    const T* vl = vbase + levels[l].start * row_stride + c;
    body([&](int pix, A(&v)[VEC]) { load_vec<T, VEC>(pixel_ptr(vl, pix, stride_bytes), v); });
  };
  const CornerSlots<A> slots(slot_mem, kThreads);
  if constexpr (kFused) {
    float max, inv_sum;
    row_softmax(attn, pb.L * pb.P, group_lanes(lane, lanes), max, inv_sum);
    const float* ref = p.ref + (group / pb.M) * pb.L * p.ref_dim;  // its (n, q)
    const FusedPoints<LT> pts{loc, attn, ref, p.ref_dim, 0.5f / float(pb.P), max, inv_sum};
    forward_row_points<T, VEC>(pb, levels, pts, out, lane, lanes, slots, with_fetch);
  } else {
    forward_row<T, LT, VEC>(pb, levels, loc, attn, out, lane, lanes, slots, with_fetch);
  }
}

template <typename T, typename LT, int VEC>
struct Launch {
  static cudaError_t run(const ForwardParams& p, cudaStream_t stream) {
    const ForwardPlan& plan = p.plan;
    const auto grid = static_cast<unsigned>(plan.blocks);
    if (p.ref != nullptr) {
      // The fused operator's plan sends no fp64 values here.
      if constexpr (std::is_same_v<acc_t<T>, float>) {
        const cudaError_t err =
            fit_carveout<baseline_forward_kernel<T, LT, VEC, true>>(plan.resident);
        if (err != cudaSuccess) return err;
        baseline_forward_kernel<T, LT, VEC, true><<<grid, plan.threads, 0, stream>>>(p, plan.lanes);
        return cudaGetLastError();
      }
      return cudaErrorInvalidValue;
    }
    const cudaError_t err =
        fit_carveout<baseline_forward_kernel<T, LT, VEC, false>>(plan.resident);
    if (err != cudaSuccess) return err;
    baseline_forward_kernel<T, LT, VEC, false><<<grid, plan.threads, 0, stream>>>(p, plan.lanes);
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t baseline_forward(const ForwardParams& p, cudaStream_t stream) {
  return launch_for_dtypes<Launch>(p, stream);
}

}  // namespace msda::cuda
