// `baseline` forward: one thread owns VEC channels of one (query, head); the
// `lanes` threads of a (query, head) read each location and weight once per
// (level, point) (one broadcast request per warp) and gather the four corners
// with 16-byte vector loads. fp32 (fp64 for fp64) coordinate math and
// accumulation.
#include "sampler.cuh"
#include "launch.h"

namespace msda::cuda {
namespace {

template <typename T, typename LT, int VEC>
// At most 64 registers (4 blocks of 256 per SM, 32 warps): the gather is
// latency-bound and no spills result (ptxas: 60-63 registers).
__global__ void __launch_bounds__(kThreads, 4)
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
  const int64_t row_stride = pb.M * pb.D;  // elements between neighbouring pixels
  const unsigned stride_bytes = static_cast<unsigned>(row_stride * sizeof(T));  // < 4 GiB (binding)
  const T* vbase = static_cast<const T*>(p.value) + value_row(n, 0, m, pb.S, pb.M) * pb.D;
  const auto [loc, attn] = query_row<LT>(p, group);
  T* out = static_cast<T*>(p.out) + group * pb.D;

  forward_row<T, LT, VEC>(pb, levels, loc, attn, out, lane, lanes,
                          CornerSlots<A>(slot_mem, kThreads),
                          [&](int l, int64_t c, auto&& body) {
                            const T* vl = vbase + levels[l].start * row_stride + c;
                            body([&](int pix, A(&v)[VEC]) {
                              load_vec<T, VEC>(pixel_ptr(vl, pix, stride_bytes), v);
                            });
                          });
}

template <typename T, typename LT, int VEC>
struct Launch {
  static cudaError_t run(const ForwardParams& p, cudaStream_t stream) {
    const int lanes = lanes_for(p.pb.D, VEC);
    const int64_t threads = p.pb.N * p.pb.Lq * p.pb.M * lanes;
    baseline_forward_kernel<T, LT, VEC><<<grid_for(threads), kThreads, 0, stream>>>(p, lanes);
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t baseline_forward(const ForwardParams& p, cudaStream_t stream) {
  return launch_for_dtypes<Launch>(p, stream);
}

}  // namespace msda::cuda
