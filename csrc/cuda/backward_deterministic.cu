// Deterministic grad_value: a gather instead of atomics, so every run adds the
// same numbers in the same order and the result is bitwise reproducible.
//
//   1. backward_kernel (backward.cu) computes grad of locations and weights as
//      usual (those are deterministic already) and writes, for every sample,
//      the key of the bilinear cell its footprint lies in (cell_key()).
//   2. sort_samples: a stable radix sort of (key, sample index) over only the
//      bits the keys use. Samples of one cell end up together, in sample order.
//   3. cell_starts: start[c] = first sorted position with key >= c (binary
//      search), so the samples of cell c are ids[start[c] .. start[c + 1]).
//   4. pack_samples: per sorted position, the sample's grad_output row and its
//      four corner weights times its attention weight, stored contiguously so
//      that the gather reads them with independent, sequential loads.
//   5. value_grad_gather: one lane group per value pixel (n, s, m) walks the
//      samples of the four cells that have the pixel as a corner, in that fixed
//      order, and writes the pixel's grad once, in the value's dtype. Pixels
//      no sample touches get 0; no zero-fill pass, no accumulator buffer.
#include <cub/device/device_radix_sort.cuh>

#include "common.cuh"
#include "launch.h"

namespace msda::cuda {
namespace {

// What the gather launch needs (launch_for_dtypes reads pb and vec).
struct GatherParams {
  Problem pb;
  int vec;
  BackwardParams bw;
  const DeterministicBuffers* buf;
};

template <typename K>
__global__ void cell_starts_kernel(const K* __restrict__ sorted, int64_t items, int64_t cells,
                                   int64_t* __restrict__ start) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c > cells) return;
  int64_t lo = 0, hi = items;  // first position whose key >= c
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (int64_t(sorted[mid]) < c) lo = mid + 1; else hi = mid;
  }
  start[c] = lo;
}

// Sorted position j -> rows[j] (the sample's (n, q, m)) and wts[j][k] =
// attention weight * bilinear weight of corner k. Positions past the last
// sample that touches a cell (start[cells]) hold the samples that touch
// nothing and are skipped.
template <typename A, typename LT, typename Id>
__global__ void __launch_bounds__(kThreads)
    pack_samples(const BackwardParams p, const Id* __restrict__ sorted_ids,
                 const int64_t* __restrict__ cell_start, int64_t cells, Id* __restrict__ rows,
                 A* __restrict__ wts) {
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  __syncthreads();
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= cell_start[cells]) return;
  const int64_t id = static_cast<int64_t>(sorted_ids[j]);
  const int64_t LP = int64_t(pb.L) * pb.P;
  const int64_t row = id / LP;
  const Level lv = levels[(id - row * LP) / pb.P];
  A xy[2];
  load_xy(static_cast<const LT*>(p.loc) + 2 * id, xy);
  const A w = lv.weight(A(to_acc(static_cast<const LT*>(p.attn)[id])));
  // The arithmetic of the key's: the same cell, hence the same corners.
  const auto b = make_bilinear<A>(xy[0], xy[1], w, lv.H, lv.W);
  rows[j] = Id(row);
#pragma unroll
  for (int k = 0; k < 4; ++k) wts[4 * j + k] = w * b.weight(k);
}

constexpr int kBatch = 4;

template <typename T, int VEC, bool kMulti, typename Id>
__global__ void __launch_bounds__(kThreads, 4)
    value_grad_gather(const BackwardParams p, const Id* __restrict__ rows,
                      const acc_t<T>* __restrict__ wts, const int64_t* __restrict__ cell_start,
                      T* __restrict__ grad_value, const int lanes) {
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  __shared__ int64_t cell_base[kMaxLevels];
  load_levels_and_cells(levels, cell_base, p.spatial_shapes, p.level_start, pb.L, pb.S, true);

  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t group = tid / lanes;  // value row (n, s, m)
  if (group >= pb.N * pb.S * pb.M) return;
  const int lane = static_cast<int>(tid % lanes);
  const int64_t m = group % pb.M, s = (group / pb.M) % pb.S, n = group / (pb.M * pb.S);
  T* out = grad_value + group * pb.D;
  const T* gout = static_cast<const T*>(p.grad_out);

  int l = 0;  // the level holding pixel s (if any)
  while (l < pb.L &&
         !(s >= levels[l].start && s - levels[l].start < int64_t(levels[l].H) * levels[l].W)) {
    ++l;
  }
  for (int64_t c = int64_t(lane) * VEC; c < pb.D; c += int64_t(lanes) * VEC) {
    A acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = A(0);
    if (l < pb.L) {
      const Level lv = levels[l];
      const int pix = static_cast<int>(s - lv.start);
      const int y = pix / lv.W, x = pix % lv.W;
      const int64_t nm = n * pb.M + m;
      // This pixel is corner k of cell (y - (k >> 1), x - (k & 1)). Cells
      // (r, x - 1) and (r, x) have consecutive keys, so the bounds of all
      // four cells are six starts, loaded together before any walk: most
      // decoder pixels have no sample at all, and then those loads are all
      // the pixel waits for (one round trip instead of four).
      int64_t bound[2][3];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t first = int64_t(cell_key(nm, p.cell_stride, cell_base[l], y - r, x - 1, lv.W));
#pragma unroll
        for (int i = 0; i < 3; ++i) bound[r][i] = cell_start[first + i];
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int64_t* b = bound[k >> 1];
        const int i = 1 - (k & 1);  // cell (., x - (k & 1)) is bound i of its row
        const int64_t end = b[i + 1];
        // kBatch entries at a time, their loads issued before any is used:
        // the walk is bound by load latency, not by arithmetic.
        for (int64_t j0 = b[i]; j0 < end; j0 += kBatch) {
          A scale[kBatch];
          int64_t row[kBatch];
#pragma unroll
          for (int u = 0; u < kBatch; ++u) {
            const bool ok = j0 + u < end;
            scale[u] = ok ? wts[4 * (j0 + u) + k] : A(0);
            row[u] = ok ? static_cast<int64_t>(rows[j0 + u]) : int64_t(-1);
          }
          A go[kBatch][VEC];
#pragma unroll
          for (int u = 0; u < kBatch; ++u) {
            if (row[u] >= 0) {
              load_vec<T, VEC>(gout + row[u] * pb.D + c, go[u]);
            } else {
#pragma unroll
              for (int e = 0; e < VEC; ++e) go[u][e] = A(0);
            }
          }
#pragma unroll
          for (int u = 0; u < kBatch; ++u) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] += scale[u] * go[u][e];
          }
        }
      }
    }
    store_vec<T, VEC>(out + c, acc);
    if (!kMulti) break;
  }
}

template <typename T, typename LT, int VEC>
struct GatherLaunch {
  template <typename Id>
  static cudaError_t go(const GatherParams& g, cudaStream_t stream) {
    using A = acc_t<T>;
    const DeterministicBuffers& b = *g.buf;
    const BackwardParams& p = g.bw;
    const auto* start = static_cast<const int64_t*>(b.cell_starts);
    const auto* sorted = static_cast<const Id*>(b.sorted_ids);
    auto* rows = static_cast<Id*>(b.rows);
    auto* wts = static_cast<A*>(b.weights);
    pack_samples<A, LT, Id><<<grid_for(b.items), kThreads, 0, stream>>>(p, sorted, start, b.cells,
                                                                      rows, wts);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
    const int lanes = lanes_for(p.pb.D, VEC);
    const int64_t threads = p.pb.N * p.pb.S * p.pb.M * lanes;
    if (threads == 0) return cudaSuccess;
    T* out = static_cast<T*>(b.grad_value);
    if (p.pb.D > int64_t(lanes) * VEC) {
      value_grad_gather<T, VEC, true, Id>
          <<<grid_for(threads), kThreads, 0, stream>>>(p, rows, wts, start, out, lanes);
    } else {
      value_grad_gather<T, VEC, false, Id>
          <<<grid_for(threads), kThreads, 0, stream>>>(p, rows, wts, start, out, lanes);
    }
    return cudaGetLastError();
  }
  static cudaError_t run(const GatherParams& g, cudaStream_t stream) {
    return g.buf->wide ? go<uint64_t>(g, stream) : go<unsigned>(g, stream);
  }
};

template <typename K>
cudaError_t sort_pairs(void* temp, size_t& temp_bytes, const DeterministicBuffers& b,
                       cudaStream_t stream) {
  return cub::DeviceRadixSort::SortPairs(
      temp, temp_bytes, static_cast<const K*>(b.keys), static_cast<K*>(b.sorted_keys),
      static_cast<const K*>(b.ids), static_cast<K*>(b.sorted_ids), b.items, 0, b.end_bit, stream);
}

}  // namespace

cudaError_t deterministic_temp_bytes(const DeterministicBuffers& b, size_t& bytes) {
  bytes = 0;
  return b.wide ? sort_pairs<uint64_t>(nullptr, bytes, b, nullptr)
                : sort_pairs<unsigned>(nullptr, bytes, b, nullptr);
}

cudaError_t deterministic_value_grad(const BackwardParams& p, const DeterministicBuffers& b,
                                     cudaStream_t stream) {
  size_t bytes = b.temp_bytes;
  cudaError_t err = b.wide ? sort_pairs<uint64_t>(b.temp, bytes, b, stream)
                           : sort_pairs<unsigned>(b.temp, bytes, b, stream);
  if (err != cudaSuccess) return err;
  const unsigned blocks = grid_for(b.cells + 1);
  auto* start = static_cast<int64_t*>(b.cell_starts);
  if (b.wide) {
    cell_starts_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const uint64_t*>(b.sorted_keys),
                                                        b.items, b.cells, start);
  } else {
    cell_starts_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const unsigned*>(b.sorted_keys),
                                                        b.items, b.cells, start);
  }
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  const GatherParams g{p.pb, b.vec, p, &b};
  return launch_for_dtypes<GatherLaunch>(g, stream);
}

}  // namespace msda::cuda
