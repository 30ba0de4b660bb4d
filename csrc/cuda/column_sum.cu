// Column sums of a row-major [rows, cols] matrix: a linear layer's bias
// gradient, its output gradient summed over every row (ms_deform_attn::
// _column_sum, which the layers' linears, ms_deform_attn::_linear, call in
// their backward). torch's reduction over the leading dimension of such a
// tall, narrow matrix runs far below the copy rate (docs/performance.md);
// here each row is read once, 16 bytes a lane, and the sums are added in a
// fixed order: bitwise the same on every run.
#include "device/launch.cuh"
#include "entry_points.h"

namespace msda::cuda {
namespace {

constexpr int kSumWarps = kThreads / 32;

// Block (x, y): columns [32 VEC x, 32 VEC (x + 1)) over the rows of chunk
// y; warp w takes the chunk's rows w, w + kSumWarps, ...; the warps' sums
// are added in warp order into partial[y][column].
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    column_partials(const T* __restrict__ g, int64_t rows, int64_t cols, int64_t chunk_rows,
                    acc_t<T>* __restrict__ partial) {
  using A = acc_t<T>;
  __shared__ A red[kSumWarps][32 * VEC];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t first_col = int64_t(blockIdx.x) * 32 * VEC;
  const int64_t c = first_col + lane * VEC;  // VEC divides cols when VEC > 1
  const int64_t r0 = int64_t(blockIdx.y) * chunk_rows, r1 = min(rows, r0 + chunk_rows);
  A acc[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = A(0);
  if (c < cols) {
#pragma unroll 8
    for (int64_t r = r0 + warp; r < r1; r += kSumWarps) {
      A v[VEC];
      load_vec<T, VEC>(g + r * cols + c, v);
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] += v[e];
    }
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) red[warp][lane * VEC + e] = acc[e];
  __syncthreads();
  for (int i = threadIdx.x; i < 32 * VEC && first_col + i < cols; i += kThreads) {
    A s = red[0][i];
#pragma unroll
    for (int w = 1; w < kSumWarps; ++w) s += red[w][i];
    partial[int64_t(blockIdx.y) * cols + first_col + i] = s;
  }
}

// out[c] = the chunks' partial sums of column c. Block x: columns
// [32 x, 32 x + 32), one a lane; warp w adds chunks w, w + kSumWarps, ...
// (loads in flight together), then the warps' sums are added in warp order.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    column_totals(const acc_t<T>* __restrict__ partial, int64_t chunks, int64_t cols,
                  T* __restrict__ out) {
  using A = acc_t<T>;
  __shared__ A red[kSumWarps][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t c = int64_t(blockIdx.x) * 32 + lane;
  A s = A(0);
  if (c < cols) {
#pragma unroll 4
    for (int64_t y = warp; y < chunks; y += kSumWarps) s += partial[y * cols + c];
  }
  red[warp][lane] = s;
  __syncthreads();
  if (warp == 0 && c < cols) {
#pragma unroll
    for (int w = 1; w < kSumWarps; ++w) s += red[w][lane];
    out[c] = from_acc<T>(s);
  }
}

}  // namespace

ColumnSumShape column_sum_shape(int64_t rows, int64_t cols, int vec, int sms) {
  ColumnSumShape s;
  s.col_blocks = (cols + 32 * vec - 1) / (32 * vec);
  // About a block an SM (eight loads in flight a lane cover the latency),
  // each a chunk of at least kSumWarps rows: few chunks for the totals.
  const int64_t want = std::max<int64_t>(1, (int64_t(sms) + s.col_blocks - 1) / s.col_blocks);
  const int64_t most = std::max<int64_t>(1, (rows + kSumWarps - 1) / kSumWarps);
  const int64_t chunks = std::min(want, most);
  s.chunk_rows = std::max<int64_t>(1, (rows + chunks - 1) / chunks);
  s.chunks = std::max<int64_t>(1, (rows + s.chunk_rows - 1) / s.chunk_rows);
  return s;
}

cudaError_t column_sum(const ColumnSumParams& p, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  dispatch_dtype<__half, __nv_bfloat16>(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    constexpr int kVec = 16 / sizeof(T);
    const dim3 grid(static_cast<unsigned>(p.shape.col_blocks), static_cast<unsigned>(p.shape.chunks));
    const auto* g = static_cast<const T*>(p.grad);
    auto* partial = static_cast<A*>(p.partial);
    if (p.vec == kVec) {
      column_partials<T, kVec><<<grid, kThreads, 0, stream>>>(g, p.rows, p.cols, p.shape.chunk_rows, partial);
    } else {
      column_partials<T, 1><<<grid, kThreads, 0, stream>>>(g, p.rows, p.cols, p.shape.chunk_rows, partial);
    }
    if ((err = cudaGetLastError()) != cudaSuccess) return;
    column_totals<T><<<static_cast<unsigned>((p.cols + 31) / 32), kThreads, 0, stream>>>(
        partial, p.shape.chunks, p.cols, static_cast<T*>(p.out));
    err = cudaGetLastError();
  });
  return err;
}

}  // namespace msda::cuda
