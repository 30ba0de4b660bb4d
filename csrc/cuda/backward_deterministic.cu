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
//   5. value_grad_pixels: every value pixel (n, s, m) walks the samples of
//      the four cells that have it as a corner, with as many slots of a warp
//      as its level's density calls for (their sums added in a fixed tree),
//      and writes its grad once, in the value's dtype. Pixels no sample
//      touches get 0; no zero-fill pass, no accumulator buffer.
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>

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

constexpr int kBatch = 4;  // walk entries a slot loads at once
constexpr int kWarps = kThreads / 32;

// Slots a pixel of level lv gets (a power of two <= slots): about one per
// kSpread kBatch of the corner entries a pixel of the level has on average
// (4 Lq P over its H W pixels), so that crowded pixels (the small levels)
// are walked by many slots and sparse ones (the large levels, decoders)
// share a warp, and its per-pixel work (bounds, the slots' sum, the store),
// with other pixels. kSpread was chosen by measurement (benchmarks/NOTES.md).
constexpr int kSpread = 8;
__device__ __forceinline__ int pixel_slots(const Problem& pb, const Level& lv, int slots) {
  const float entries = 4.f * float(pb.Lq) * float(pb.P) / (float(lv.H) * float(lv.W));
  int g = 1;
  while (g < slots && float(kSpread * g * kBatch) < entries) g <<= 1;
  return g;
}

// Warp items of one level of one (n, m): its pixels, slots / g a warp (g =
// pixel_slots()).
__device__ __forceinline__ int64_t level_items(const Level& lv, int slots, int g) {
  const int64_t per = slots / g;
  return (int64_t(lv.H) * lv.W + per - 1) / per;
}

// grad_value, pixel by pixel, written once in the value's dtype. A warp
// item is slots / g pixels of one level of one (n, m), g slots a pixel
// (pixel_slots); items of the smallest levels (the most entries a pixel)
// first. Pixel (y, x) is corner k of the cells (y - (k >> 1), x - (k & 1)):
// its entries are two runs of the sorted order. The pixel's g slots take
// them round-robin (slot s: entries s, s + g, ...), each over its lanes'
// channels, kBatch entries at a time with their loads in flight together,
// and a fixed shuffle tree adds the slots: the same order on every run.
template <typename T, int VEC, typename Id>
__global__ void __launch_bounds__(kThreads, 4)
    value_grad_pixels(const BackwardParams p, const Id* __restrict__ rows,
                      const acc_t<T>* __restrict__ wts, const int64_t* __restrict__ cell_start,
                      T* __restrict__ grad_value, const int lanes) {
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  __shared__ int64_t cell_base[kMaxLevels];
  load_levels_and_cells(levels, cell_base, p.spatial_shapes, p.level_start, pb.L, pb.S, true);
  if (levels[0].poison) {
    // The level table on the device is inconsistent (load_levels): nothing
    // adds to grad_value, which is zero.
    const int64_t total = pb.N * pb.S * pb.M * pb.D;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += int64_t(gridDim.x) * blockDim.x) {
      grad_value[i] = from_acc<T>(A(0));
    }
    return;
  }

  // Per level: slots a pixel, warp items of one (n, m), first item (the
  // smallest levels first).
  __shared__ int lv_slots[kMaxLevels];
  __shared__ Id lv_items[kMaxLevels], lv_first[kMaxLevels + 1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slots = 32 / lanes, slot = lane / lanes, q = lane % lanes;
  const Id NM = Id(pb.N * pb.M);  // N M S < 2^32 unless Id is 64-bit (N M S < cells)
  if (threadIdx.x == 0) {
    Id first = 0;
    for (int l = pb.L - 1; l >= 0; --l) {
      lv_slots[l] = pixel_slots(pb, levels[l], slots);
      lv_items[l] = Id(level_items(levels[l], slots, lv_slots[l]));
      lv_first[l] = first;
      first += NM * lv_items[l];
    }
    lv_first[pb.L] = first;  // the total
  }
  __syncthreads();
  const Id total = lv_first[pb.L];
  const T* gout = static_cast<const T*>(p.grad_out);

  for (Id item = Id(blockIdx.x) * kWarps + warp; item < total; item += Id(gridDim.x) * kWarps) {
    int l = 0;
    while (item < lv_first[l]) ++l;  // lv_first decreases with l
    const Level lv = levels[l];
    const int g = lv_slots[l];
    const Id r = item - lv_first[l];
    const Id nm = r / lv_items[l];
    const Id pix = (r - nm * lv_items[l]) * Id(slots / g) + Id(slot / g);
    const int sub = slot % g;  // this lane's slot of its pixel
    const bool pix_ok = pix < Id(lv.H) * Id(lv.W);
    const int y = static_cast<int>(pix / Id(lv.W)), x = static_cast<int>(pix - Id(y) * Id(lv.W));
    const int64_t n = int64_t(nm) / pb.M, m = int64_t(nm) % pb.M;
    // The pixel's entries are two runs of the sorted order: cells (y - 1,
    // x - 1) and (y - 1, x) have consecutive keys (corners 3 then 2), and so
    // do (y, x - 1) and (y, x) (corners 1 then 0). Their bounds are the
    // starts of cells (y - 1 + rr, x - 1 + i), i in {0, 1, 2} (i = 2: the end
    // of cell x; x + 1 <= W gives the next row's first cell at the right
    // edge). Positions in Id arithmetic (32 bits unless the problem needs 64).
    Id bnd[2][3] = {{0, 0, 0}, {0, 0, 0}};
    if (pix_ok) {
      const int64_t key = int64_t(cell_key(int64_t(nm), p.cell_stride, cell_base[l], y - 1, x - 1, lv.W));
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
#pragma unroll
        for (int i = 0; i < 3; ++i) bnd[rr][i] = Id(cell_start[key + rr * (lv.W + 1) + i]);
      }
    }
    const Id above = bnd[0][2] - bnd[0][0];               // entries of the row of cells above
    const Id count = above + (bnd[1][2] - bnd[1][0]);     // uniform over the pixel's slots
    T* out = grad_value + value_row(n, lv.start + int64_t(pix), m, pb.S, pb.M) * pb.D;
    for (int64_t c0 = 0; c0 < pb.D; c0 += int64_t(lanes) * VEC) {
      const int64_t c = c0 + q * VEC;
      const bool c_ok = c < pb.D;  // VEC > 1 only when VEC divides D
      A acc[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] = A(0);
      for (Id v0 = Id(sub); v0 < count; v0 += Id(kBatch) * Id(g)) {
        A scale[kBatch];
        int64_t row[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const Id v = v0 + Id(u) * Id(g);
          scale[u] = A(0);
          row[u] = -1;
          if (v < count) {
            const bool up = v < above;  // in the row of cells above the pixel
            const Id j = up ? bnd[0][0] + v : bnd[1][0] + (v - above);
            const int k = up ? (j < bnd[0][1] ? 3 : 2) : (j < bnd[1][1] ? 1 : 0);
            scale[u] = wts[4 * int64_t(j) + k];
            row[u] = static_cast<int64_t>(rows[j]);
          }
        }
        // Raw rows, converted one at a time (fewer registers).
        using R = typename RawVec<sizeof(T) * VEC>::type;
        R raw[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          raw[u] = row[u] >= 0 && c_ok ? __ldg(reinterpret_cast<const R*>(gout + row[u] * pb.D + c))
                                       : R{};
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          A go[VEC];
          unpack<T, VEC>(raw[u], go);
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[e] += scale[u] * go[e];
        }
      }
      // The pixel's slots added in a fixed tree (every lane of the warp
      // shuffles: g is uniform over the warp).
      for (int o = lanes; o < lanes * g; o <<= 1) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], o);
      }
      if (sub == 0 && pix_ok && c_ok) store_vec<T, VEC>(out + c, acc);
    }
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
    const int64_t items = p.pb.N * p.pb.M * p.pb.S;  // pixels of the grad_value map
    if (items == 0) return cudaSuccess;
    T* out = static_cast<T*>(b.grad_value);
    // Up to 64 warps an SM (at most one a pixel); the rest of the items are
    // taken in turn (grid stride).
    DeviceLimits d;
    if (const cudaError_t err = device_limits(d); err != cudaSuccess) return err;
    const unsigned blocks = static_cast<unsigned>(
        std::max<int64_t>(1, std::min<int64_t>((items + kWarps - 1) / kWarps, int64_t(d.sms) * 8)));
    value_grad_pixels<T, VEC, Id><<<blocks, kThreads, 0, stream>>>(p, rows, wts, start, out, lanes);
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
