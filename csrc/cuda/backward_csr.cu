// Sparse grad_value for the fast backward: the decoders' case, few samples
// for a large value map. There the dense path (atomics into a zeroed fp32
// accumulator of the whole map, then a conversion to 16 bits) spends most of
// its time filling and converting rows no sample touches (benchmarks/NOTES.md).
// Here grad_value is built as a list of additions per value row (n, s, m),
// in compressed-sparse-row form, and written once:
//   1. csr_count: one thread per sample; each corner inside its level takes a
//      rank in its row, rank = atomicAdd(count[row], 1), and keeps (row, rank,
//      coef), coef = attention weight x bilinear weight.
//   2. an exclusive scan of the counts: row_start (cub).
//   3. csr_scatter: one thread per corner; entry[row_start[row] + rank] =
//      (the sample's grad_output row, coef).
//   4. csr_gather: one lane group per value row adds coef x grad_output over
//      the row's entries in fp32 (fp64 for fp64) and writes the row once, in
//      the value's dtype; rows nothing touches get 0. No fill, no
//      accumulator, no conversion pass.
// The entries of a row are added in rank order, which the atomics decide: fast,
// not bitwise reproducible (deterministic=True takes backward_deterministic.cu).
// The rows, ranks and coefficients of the corners are the count pass's own,
// so the scatter and the gather never depend on two kernels rounding a
// location the same way.
#include <cub/device/device_scan.cuh>

#include "common.cuh"
#include "launch.h"

namespace msda::cuda {
namespace {

constexpr unsigned kNoRow = 0xffffffffu;  // a corner outside its level

template <typename A>
struct CsrCorner {
  unsigned row, rank;
  A coef;
};

template <typename A>
struct CsrEntry {
  unsigned src;  // grad_output row (n, q, m)
  A coef;
};

// Where the scratch of CsrBuffers::scratch goes, in this order, each part
// 256-byte aligned: counts (rows + 1), row_start (rows + 1), corners,
// entries, the scan's temp.
struct Carve {
  unsigned* count = nullptr;
  unsigned* row_start = nullptr;
  void* corners = nullptr;
  void* entries = nullptr;
  void* temp = nullptr;
  size_t temp_bytes = 0;
};

size_t round_up(size_t x) { return (x + 255) / 256 * 256; }

// Byte offsets of the parts in the scratch (base null: only the sizes), and
// the scratch's total size.
template <typename A>
cudaError_t carve(const CsrBuffers& b, void* base, Carve& c, size_t& total) {
  const size_t index = round_up(sizeof(unsigned) * size_t(b.rows + 1));
  const size_t corners = round_up(sizeof(CsrCorner<A>) * size_t(b.corners));
  const size_t entries = round_up(sizeof(CsrEntry<A>) * size_t(b.corners));
  c.temp_bytes = 0;
  const cudaError_t err = cub::DeviceScan::ExclusiveSum(
      nullptr, c.temp_bytes, static_cast<const unsigned*>(nullptr), static_cast<unsigned*>(nullptr),
      b.rows + 1, cudaStream_t(nullptr));
  const size_t off[4] = {index, 2 * index, 2 * index + corners, 2 * index + corners + entries};
  total = off[3] + c.temp_bytes;
  auto* p = static_cast<unsigned char*>(base);
  if (p != nullptr) {
    c.count = reinterpret_cast<unsigned*>(p);
    c.row_start = reinterpret_cast<unsigned*>(p + off[0]);
    c.corners = p + off[1];
    c.entries = p + off[2];
    c.temp = p + off[3];
  }
  return err;
}

template <typename A, typename LT>
__global__ void __launch_bounds__(kThreads)
    csr_count(const BackwardParams p, unsigned* __restrict__ count, CsrCorner<A>* __restrict__ corners) {
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  __syncthreads();
  const int64_t LP = int64_t(pb.L) * pb.P;
  const int64_t sample = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (sample >= pb.N * pb.Lq * pb.M * LP) return;
  const int64_t group = sample / LP;
  const Level lv = levels[(sample - group * LP) / pb.P];
  const int64_t m = group % pb.M, n = group / (pb.Lq * pb.M);
  A xy[2];
  load_xy(static_cast<const LT*>(p.loc) + 2 * sample, xy);
  const A w = A(to_acc(static_cast<const LT*>(p.attn)[sample]));
  const auto b = make_bilinear<A>(xy[0], xy[1], lv.H, lv.W);
  const bool inside = b.inside && lv.H > 0;  // an empty level samples nothing
  CsrCorner<A>* out = corners + 4 * sample;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    CsrCorner<A> c{kNoRow, 0u, A(0)};
    if (inside && b.corner_ok(k, lv.H, lv.W)) {
      c.row = static_cast<unsigned>(value_row(n, lv.start + b.corner_offset(k, lv.W), m, pb.S, pb.M));
      c.rank = atomicAdd(count + c.row, 1u);
      c.coef = w * b.weight(k);
    }
    out[k] = c;
  }
}

template <typename A>
__global__ void __launch_bounds__(kThreads)
    csr_scatter(const CsrCorner<A>* __restrict__ corners, const unsigned* __restrict__ row_start,
                int64_t count, int64_t corners_per_group, CsrEntry<A>* __restrict__ entries) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= count) return;
  const CsrCorner<A> c = corners[j];
  if (c.row == kNoRow) return;
  entries[row_start[c.row] + c.rank] = CsrEntry<A>{static_cast<unsigned>(j / corners_per_group), c.coef};
}

template <typename T, int VEC, bool kMulti>
__global__ void __launch_bounds__(kThreads)
    csr_gather(const Problem pb, const T* __restrict__ gout, const unsigned* __restrict__ row_start,
               const CsrEntry<acc_t<T>>* __restrict__ entries, T* __restrict__ grad_value,
               const int lanes) {
  using A = acc_t<T>;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = tid / lanes;  // value row (n, s, m)
  if (row >= pb.N * pb.S * pb.M) return;
  const int lane = static_cast<int>(tid % lanes);
  const int64_t begin = row_start[row], end = row_start[row + 1];
  for (int64_t c = int64_t(lane) * VEC; c < pb.D; c += int64_t(lanes) * VEC) {
    A acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = A(0);
    add_scaled_rows<T, VEC>(acc, begin, end, gout + c, pb.D, [&](int64_t j, A& scale, int64_t& src) {
      const CsrEntry<A> e = entries[j];
      scale = e.coef;
      src = e.src;
    });
    store_vec<T, VEC>(grad_value + row * pb.D + c, acc);
    if (!kMulti) break;
  }
}

template <typename T, typename LT>
cudaError_t run(const BackwardParams& p, const CsrBuffers& b, cudaStream_t stream) {
  using A = acc_t<T>;
  Carve c;
  size_t total = 0;
  cudaError_t err = carve<A>(b, b.scratch, c, total);
  if (err != cudaSuccess) return err;
  if (total > b.scratch_bytes) return cudaErrorInvalidValue;
  err = cudaMemsetAsync(c.count, 0, sizeof(unsigned) * size_t(b.rows + 1), stream);
  if (err != cudaSuccess) return err;
  auto* corners = static_cast<CsrCorner<A>*>(c.corners);
  auto* entries = static_cast<CsrEntry<A>*>(c.entries);
  const int64_t samples = b.corners / 4;
  if (samples > 0) {
    csr_count<A, LT><<<grid_for(samples), kThreads, 0, stream>>>(p, c.count, corners);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  err = cub::DeviceScan::ExclusiveSum(c.temp, c.temp_bytes, c.count, c.row_start, b.rows + 1, stream);
  if (err != cudaSuccess) return err;
  if (samples > 0) {
    const int64_t per_group = 4 * int64_t(p.pb.L) * p.pb.P;
    csr_scatter<A><<<grid_for(b.corners), kThreads, 0, stream>>>(corners, c.row_start, b.corners,
                                                                 per_group, entries);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  constexpr int kVec = 16 / sizeof(T);
  const int vec = b.vec == kVec ? kVec : 1;
  const int lanes = lanes_for(p.pb.D, vec);
  const int64_t threads = b.rows * lanes;
  if (threads == 0) return cudaSuccess;
  const auto* gout = static_cast<const T*>(p.grad_out);
  T* out = static_cast<T*>(b.grad_value);
  const bool multi = p.pb.D > int64_t(lanes) * vec;
  const unsigned grid = grid_for(threads);
  if (vec == kVec) {
    if (multi) {
      csr_gather<T, kVec, true><<<grid, kThreads, 0, stream>>>(p.pb, gout, c.row_start, entries, out, lanes);
    } else {
      csr_gather<T, kVec, false><<<grid, kThreads, 0, stream>>>(p.pb, gout, c.row_start, entries, out, lanes);
    }
  } else {
    csr_gather<T, 1, true><<<grid, kThreads, 0, stream>>>(p.pb, gout, c.row_start, entries, out, lanes);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t csr_scratch_bytes(const Problem& pb, CsrBuffers& b) {
  b.rows = pb.N * pb.S * pb.M;
  b.corners = 4 * pb.N * pb.Lq * pb.M * pb.L * pb.P;
  Carve c;
  return pb.value_dtype == DType::f64 ? carve<double>(b, nullptr, c, b.scratch_bytes)
                                      : carve<float>(b, nullptr, c, b.scratch_bytes);
}

cudaError_t csr_value_grad(const BackwardParams& p, const CsrBuffers& b, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  dispatch_dtypes(p.pb, [&](auto t, auto lt) {
    err = run<typename decltype(t)::type, typename decltype(lt)::type>(p, b, stream);
  });
  return err;
}

}  // namespace msda::cuda
