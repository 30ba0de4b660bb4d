// `baseline` forward: one thread owns VEC channels of one (query, head); the
// `lanes` threads of a (query, head) read each location and weight once per
// (level, point) (one broadcast request per warp) and gather the four corners
// with 16-byte vector loads. fp32 (fp64 for fp64) coordinate math and
// accumulation.
#include "forward_common.cuh"
#include "launch.h"

namespace msda::cuda {
namespace {

template <typename T, typename LT, int VEC>
__global__ void __launch_bounds__(kThreads)
    baseline_forward_kernel(const ForwardParams p, const int lanes) {
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  __syncthreads();

  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t group = tid / lanes;
  if (group >= pb.N * pb.Lq * pb.M) return;
  const int lane = static_cast<int>(tid % lanes);
  const int64_t m = group % pb.M, n = group / (pb.Lq * pb.M);
  const int64_t row_stride = pb.M * pb.D;  // elements between neighbouring pixels
  const int stride = static_cast<int>(row_stride);  // M * D < 2^31 (checked by the binding)
  const T* vbase = static_cast<const T*>(p.value) + value_row(n, 0, m, pb.S, pb.M) * pb.D;
  const int64_t LP = int64_t(pb.L) * pb.P;
  const LT* loc = static_cast<const LT*>(p.loc) + group * LP * 2;
  const LT* attn = static_cast<const LT*>(p.attn) + group * LP;
  T* out = static_cast<T*>(p.out) + group * pb.D;

  for (int64_t c = int64_t(lane) * VEC; c < pb.D; c += int64_t(lanes) * VEC) {
    A acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = A(0);
    for (int l = 0; l < pb.L; ++l) {
      const Level lv = levels[l];
      if (lv.H == 0) continue;  // level rejected by load_levels
      const T* vl = vbase + lv.start * row_stride + c;
      auto fetch = [&](int pix, A(&v)[VEC]) { load_vec<T, VEC>(vl + pixel_offset(pix, stride), v); };
      for (int pt = 0; pt < pb.P; ++pt) {
        A x, y, w;
        load_point(loc, attn, l * pb.P + pt, x, y, w);
        accumulate_sample(acc, x, y, w, lv.H, lv.W, fetch);
      }
    }
    store_vec<T, VEC>(out + c, acc);
  }
}

template <typename T, typename LT, int VEC>
cudaError_t launch(const ForwardParams& p, cudaStream_t stream) {
  const int lanes = lanes_for(p.pb.D, VEC);
  const int64_t threads = p.pb.N * p.pb.Lq * p.pb.M * lanes;
  baseline_forward_kernel<T, LT, VEC><<<grid_for(threads), kThreads, 0, stream>>>(p, lanes);
  return cudaGetLastError();
}

}  // namespace

cudaError_t baseline_forward(const ForwardParams& p, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  dispatch_dtypes(p.pb, [&](auto t, auto lt) {
    using T = typename decltype(t)::type;
    using LT = typename decltype(lt)::type;
    constexpr int kVec = 16 / sizeof(T);
    err = p.vec == kVec ? launch<T, LT, kVec>(p, stream) : launch<T, LT, 1>(p, stream);
  });
  return err;
}

}  // namespace msda::cuda
