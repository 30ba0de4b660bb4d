// The sorted grad_value path: a gather instead of atomics, so every run adds
// the same numbers in the same order and the result is bitwise reproducible.
//
//   1. the dots kernel (ffma_dots.cu, mma_dots.cu) computes grad of locations and weights as
//      usual (those are deterministic already) and writes, for every sample,
//      the key of the bilinear cell its footprint lies in (cell_key()).
//   2. sort_samples: a stable radix sort of (key, sample index) over only the
//      bits the keys use. Samples of one cell end up together, in sample order.
//   3. cell_starts: start[c] = first sorted position with key >= c (written
//      by the positions where the key changes), so the samples of cell c are
//      ids[start[c] .. start[c + 1]).
//   4. pack_samples: per sorted position, the sample's grad_output row and its
//      four corner weights times its attention weight, stored contiguously so
//      that the gather reads them with independent, sequential loads.
//   5. grad_value_pixels_kernel: every value pixel (n, s, m) walks the samples of
//      the four cells that have it as a corner, with as many slots of a warp
//      as its level's density calls for (their sums added in a fixed tree),
//      and writes its grad once, in the value's dtype. Pixels no sample
//      touches get 0; no zero-fill pass, no accumulator buffer.
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cfloat>
#include <type_traits>

#include "../device/fused_samples.cuh"
#include "../device/grad_value_records.cuh"
#include "../device/launch.cuh"
#include "../device/tensor_core.cuh"
#include "../entry_points.h"

namespace msda::cuda {
namespace {

// What the gather launch needs (launch_for_dtypes reads pb and vec).
struct GatherParams {
  Problem pb;
  int vec;
  BackwardParams bw;
  const SortedBuffers* buf;
};

// start[c] = first sorted position whose key is >= c, for c in [0, cells],
// written by the positions: position j (0 <= j <= items) starts the cells
// above the key before it up to its own key (keys past the last cell count
// as `cells`; position items starts the cells above the last key), so every
// cell is written once, from one coalesced read of the keys. A thread takes
// kPer consecutive positions, their keys loaded together: 8 where there are
// enough positions for a full GPU (one a thread, the kernel is a chain of
// waves each waiting for its load), else 1 (fewer threads would not hide the
// loads and the writes of the sparse maps' empty cells). Runs of more than
// 32 cells (sparse maps, or every sample in one cell) are written by the
// whole warp, one run at a time; shorter ones by their position's lane.
// It also clears `big`, the flag pack_samples raises (ahead of it in the stream).
template <int kPer, typename K>
__global__ void cell_starts_kernel(const K* __restrict__ sorted, int64_t items, int64_t cells,
                                   int64_t* __restrict__ start, int64_t* __restrict__ big) {
  const int lane = threadIdx.x % 32;
  const int64_t j0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kPer;
  if (j0 == 0) *big = 0;
  int64_t key[kPer + 1];  // key[k]: of position j0 + k - 1, clamped to cells
#pragma unroll
  for (int k = 0; k <= kPer; ++k) {
    const int64_t j = j0 + k - 1;
    key[k] = j < 0 ? -1 : j < items ? min(int64_t(sorted[j]), cells) : cells;
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int64_t j = j0 + k;
    // This position starts cells [lo, hi).
    const int64_t lo = key[k] + 1, hi = j <= items ? key[k + 1] + 1 : lo;
    for (unsigned runs = __ballot_sync(0xffffffffu, hi - lo > 32); runs != 0; runs &= runs - 1) {
      const int src = __ffs(runs) - 1;
      const int64_t a = __shfl_sync(0xffffffffu, lo, src), b = __shfl_sync(0xffffffffu, hi, src);
      const int64_t v = __shfl_sync(0xffffffffu, j, src);
      for (int64_t c = a + lane; c < b; c += 32) start[c] = v;
    }
    if (hi - lo <= 32) {
      for (int64_t c = lo; c < hi; ++c) start[c] = j;
    }
  }
}

template <typename K>
cudaError_t launch_cell_starts(const SortedBuffers& b, cudaStream_t stream) {
  DeviceInfo d;
  if (const cudaError_t err = current_device_info(d); err != cudaSuccess) return err;
  const auto* keys = static_cast<const K*>(b.sorted_keys);
  auto* start = static_cast<int64_t*>(b.cell_starts);
  if (b.items >= kCellStartsWideFromPerSm * d.sms) {
    cell_starts_kernel<8><<<grid_for((b.items + 8) / 8), kThreads, 0, stream>>>(keys, b.items, b.cells,
                                                                                start, b.big_weights);
  } else {
    cell_starts_kernel<1><<<grid_for(b.items + 1), kThreads, 0, stream>>>(keys, b.items, b.cells, start,
                                                                          b.big_weights);
  }
  return cudaGetLastError();
}

// fp16 weights for grad_value_tiles_kernel are scaled by 2^kHalfWeightExp (in
// pack_samples), so that the low parts of weights down to 2^-15 stay normal
// fp16 numbers in its split (split_16), and the sums scaled back at the end;
// a scaled weight of kHalfWeightLimit or more (|w| >= 8) would leave fp16's
// range: pack_samples raises a flag, and the tiles kernel then scales each
// round that holds one by its own power of two.
constexpr int kHalfWeightExp = 12;
constexpr float kHalfWeightLimit = 32768.f;  // 2^15 (fp16's largest finite number is 65504)

// Sorted position j -> rows[j] (the sample's (n, q, m)) and wts[j][k] =
// attention weight * bilinear weight of corner k; kScaled (fp16 for the
// tiles): times 2^kHalfWeightExp, *big = 1 when one reaches
// kHalfWeightLimit, and one that the scale takes past fp32's range held at
// its largest number. Positions past the last
// sample that touches a cell (start[cells]) hold the samples that touch
// nothing and are skipped. kFused (ms_deform_attn_fused): the location and
// weight are formed from the offset, the logit, the reference point and the
// row's softmax statistics the dots kernel wrote, by the dots kernel's
// arithmetic (fused_location, fused_weight).
template <typename A, typename LT, typename Id, bool kFused, bool kScaled>
__global__ void __launch_bounds__(kThreads)
    pack_samples(const BackwardParams p, const Id* __restrict__ sorted_ids,
                 const int64_t* __restrict__ cell_start, int64_t cells, Id* __restrict__ rows,
                 A* __restrict__ wts, int64_t* __restrict__ big) {
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  __syncthreads();
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= cell_start[cells]) return;
  const int64_t id = static_cast<int64_t>(sorted_ids[j]);
  const int64_t LP = int64_t(pb.L) * pb.P;
  const int64_t row = id / LP;
  const int l = static_cast<int>((id - row * LP) / pb.P);
  const Level lv = levels[l];
  A w;
  const float* ref_row = kFused ? p.ref + (row / pb.M * pb.L + l) * p.ref_dim : nullptr;
  const auto b = resolve_sample_at<A, LT, kFused>(p, id, row, ref_row, lv, w);
  // The arithmetic of the key's: the same cell, hence the same corners.
  rows[j] = Id(row);
  if constexpr (kScaled) {
    bool over = false;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const A wk = w * b.weight(k);
      A scaled = wk * A(1 << kHalfWeightExp);
      if (isinf(scaled) && !isinf(wk)) scaled = copysign(A(FLT_MAX), wk);
      over |= fabs(scaled) >= A(kHalfWeightLimit);  // NaN: no (it stays NaN in fp16)
      wts[4 * j + k] = scaled;
    }
    if (over) *big = 1;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) wts[4 * j + k] = w * b.weight(k);
  }
}

// The gathers' tables in shared memory: the levels and their first cells;
// per level a work split (slots a pixel, warps a tile), the work items of one
// (n, m) and the first item, the smallest levels first (the most entries a
// pixel).
template <typename I>
struct GatherTables {
  Level levels[kMaxLevels];
  int64_t cell_base[kMaxLevels];
  int split[kMaxLevels];
  I items[kMaxLevels];
  I first[kMaxLevels + 1];  // first[L]: the total

  // The level of item `item` (first[] decreases with l).
  __device__ __forceinline__ int level_of(I item) const {
    int l = 0;
    while (item < first[l]) ++l;
    return l;
  }
};

// Fills t (every thread of the block calls it): split_of(level) gives a
// level's split, items_of(level, split) its items of one (n, m). When the
// level table on the device is inconsistent (load_levels) nothing adds to
// grad_value: it is zeroed here and false returned.
template <typename I, typename T, typename SplitOf, typename ItemsOf>
__device__ bool load_gather_tables(const BackwardParams& p, GatherTables<I>& t, T* grad_value,
                                   SplitOf split_of, ItemsOf items_of) {
  const Problem& pb = p.pb;
  load_levels_and_cells(t.levels, t.cell_base, p.spatial_shapes, p.level_start, pb.L, pb.S, true);
  if (t.levels[0].poison) {
    zero_grad_value(pb, grad_value);
    return false;
  }
  if (threadIdx.x == 0) {
    I first = 0;
    for (int l = pb.L - 1; l >= 0; --l) {
      t.split[l] = split_of(t.levels[l]);
      t.items[l] = I(items_of(t.levels[l], t.split[l]));
      t.first[l] = first;
      first += I(pb.N * pb.M) * t.items[l];
    }
    t.first[pb.L] = first;
  }
  __syncthreads();
  return true;
}

constexpr int kBatch = 4;  // walk entries a slot loads at once

// Slots a pixel of level lv gets (a power of two <= slots): about one per
// kSpread kBatch of the corner entries a pixel of the level has on average
// (4 Lq P over its H W pixels), so that crowded pixels (the small levels)
// are walked by many slots and sparse ones (the large levels, decoders)
// share a warp, and its per-pixel work (bounds, the slots' sum, the store),
// with other pixels. kSpread was chosen by measurement (docs/performance.md).
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
__global__ void __launch_bounds__(kThreads, kPixelsMinBlocksPerSm)
    grad_value_pixels_kernel(const BackwardParams p, const Id* __restrict__ rows,
                      const acc_t<T>* __restrict__ wts, const int64_t* __restrict__ cell_start,
                      T* __restrict__ grad_value, const int lanes) {
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slots = 32 / lanes, slot = lane / lanes, q = lane % lanes;
  // Items: slots / g pixels of a level (g = its slots a pixel); N M S < 2^32
  // unless Id is 64-bit (N M S < cells).
  __shared__ GatherTables<Id> t;
  if (!load_gather_tables(
          p, t, grad_value, [&](const Level& lv) { return pixel_slots(pb, lv, slots); },
          [&](const Level& lv, int g) { return level_items(lv, slots, g); })) {
    return;
  }
  const Id total = t.first[pb.L];
  const T* gout = static_cast<const T*>(p.grad_out);

  for (Id item = Id(blockIdx.x) * kWarps + warp; item < total; item += Id(gridDim.x) * kWarps) {
    const int l = t.level_of(item);
    const Level lv = t.levels[l];
    const int g = t.split[l];
    const Id r = item - t.first[l];
    const Id nm = r / t.items[l];
    const Id pix = (r - nm * t.items[l]) * Id(slots / g) + Id(slot / g);
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
      const int64_t key = int64_t(cell_key(int64_t(nm), p.cell_stride, t.cell_base[l], y - 1, x - 1, lv.W));
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
#pragma unroll
        for (int i = 0; i < 3; ++i) bnd[rr][i] = Id(cell_start[key + rr * (lv.W + 1) + i]);
      }
    }
    const Id above = bnd[0][2] - bnd[0][0];               // entries of the row of cells above
    const Id count = above + (bnd[1][2] - bnd[1][0]);     // uniform over the pixel's slots
    T* out = grad_value + value_row(pb, n, lv.start + int64_t(pix), m) * pb.D;
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

// ---- grad_value on tensor cores (16-bit values) ----------------------------
// The gather's sums as matrix products. A warp owns a 4 x 4 tile of pixels of
// one (n, m, level); the samples of the 5 x 5 cells around it (cell rows
// y0 - 1 .. y0 + 3 and columns x0 - 1 .. x0 + 3: five runs of the sorted
// order) are taken 32 at a time (a round), and grad_value[tile] += W^T G,
// with W (32 samples x 16 pixels) their corner weights, split in a 16-bit
// high and low part so that the weights keep fp32 precision, and G (32 samples x
// 32 channels) their grad_output rows: 2 k-steps x 4 n-tiles x 2 parts of
// m16n8k16 mma, fp32 sums. Each sample's lane scatters its in-tile corner
// weights into a zeroed W in shared memory; G's rows are copied with
// cp.async; both reach the mma through ldmatrix (.trans for G, whose rows
// are samples). Tiles of the crowded (small) levels are split over 2-8 warps
// of a block, which take the rounds in turn and add their sums in a fixed
// order, so the result is the same on every run.
// fp16 weights come scaled by 2^kHalfWeightExp (pack_samples); where pack
// raised its flag, a round holding a weight past kHalfWeightLimit is scaled
// by its own power of two, the tile's sums taken to that scale for the round
// and back.
constexpr int kTileRounds = 8;  // rounds a warp aims at before its tile is split

struct __align__(16) TileSmem {
  union {
    // [k-step][hi, lo][pixel][sample]; a pixel's 16 samples are two 16-byte
    // halves, swapped on pixels 4-7 and 12-15 (conflict-free ldmatrix).
    uint16_t a[2][2][16][16];
    float red[16][32];  // the warp's sums, for the reduction of split tiles
  };
  // [sample][channel] of a 32-channel pass; 16-byte chunk q of sample s at
  // chunk q ^ ((s >> 1) & 3) (conflict-free ldmatrix.trans).
  uint16_t b[32][32];
  // The tile's runs: exclusive prefix of their lengths, and first sorted
  // position minus that prefix (modular when unsigned).
  uint64_t pre[5], off[5];
};

// Warps a tile of level lv gets (a power of two <= kWarps): about one per
// kTileRounds rounds of the samples its 5 x 5 cells hold on average.
__device__ __forceinline__ int tile_warps(const Problem& pb, const Level& lv) {
  const float per_cell = float(pb.Lq) * float(pb.P) / (float(lv.H + 1) * float(lv.W + 1));
  const float cells = float(min(lv.H + 1, 5)) * float(min(lv.W + 1, 5));
  const float rounds = per_cell * cells / 32.f;
  int g = 1;
  while (g < kWarps && rounds > float(kTileRounds * g)) g <<= 1;
  return g;
}

// One sample of a tile's runs, as its lane holds it for a round: loaded a
// round ahead and not used before (the loads stay in flight).
template <typename Id>
struct TileEntry {
  Id row = ~Id(0);                  // grad_output row; none: ~0
  Id key = 0;                       // its cell's key
  float4 w = {0.f, 0.f, 0.f, 0.f};  // corner weights
  int run = -1;                     // its run (cell row y0 - 1 + run); none: -1
};

// 80 registers, 3 blocks an SM (at 64 it spills). A G copied a round ahead
// into a second buffer measured slower (docs/performance.md).
template <typename T, typename Id>
__global__ void __launch_bounds__(kThreads, kTilesBlocksPerSm)
    grad_value_tiles_kernel(const BackwardParams p, const Id* __restrict__ rows,
                     const float* __restrict__ wts, const Id* __restrict__ keys,
                     const int64_t* __restrict__ cell_start, const int64_t* __restrict__ big,
                     T* __restrict__ grad_value) {
  constexpr bool kHalf = std::is_same_v<T, __half>;
  constexpr int kScaleExp = kHalf ? kHalfWeightExp : 0;
  const Problem& pb = p.pb;
  // Block items: kWarps / g tiles of a level (g = its warps a tile). The
  // launch keeps N M S below 2^31, so items, tiles and (n, m) indices fit
  // FastDiv's 31-bit numerators: no 64-bit division routine an item.
  __shared__ GatherTables<uint32_t> t;
  __shared__ FastDiv by_items[kMaxLevels], by_tiles_x[kMaxLevels], by_m;
  if (!load_gather_tables(
          p, t, grad_value, [&](const Level& lv) { return tile_warps(pb, lv); },
          [&](const Level& lv, int g) {
            const int64_t tiles = int64_t((lv.H + 3) / 4) * ((lv.W + 3) / 4);
            return (tiles + kWarps / g - 1) / (kWarps / g);
          })) {
    return;
  }
  if (threadIdx.x < pb.L) {
    by_items[threadIdx.x] = FastDiv(t.items[threadIdx.x]);
    by_tiles_x[threadIdx.x] = FastDiv(static_cast<uint32_t>((t.levels[threadIdx.x].W + 3) / 4));
  }
  if (threadIdx.x == 0) by_m = FastDiv(static_cast<uint32_t>(pb.M));
  __syncthreads();
  const bool big_rounds = kHalf && *big != 0;  // pack_samples' flag
  __shared__ TileSmem smem[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  TileSmem& sm = smem[warp];
  const unsigned row_bytes = static_cast<unsigned>(pb.D * sizeof(T));

  for (uint32_t item = blockIdx.x; item < t.first[pb.L]; item += gridDim.x) {
    const int l = t.level_of(item);
    const Level lv = t.levels[l];
    const int g = t.split[l], lg = __ffs(g) - 1, sub = warp & (g - 1);  // g: a power of two
    const uint32_t r = item - t.first[l];
    const uint32_t nm = by_items[l](r);
    const uint32_t tiles_x = static_cast<uint32_t>((lv.W + 3) / 4);
    const uint32_t tile = (r - nm * t.items[l]) * uint32_t(kWarps >> lg) + uint32_t(warp >> lg);
    const bool tile_ok = tile < static_cast<uint32_t>((lv.H + 3) / 4) * tiles_x;
    const uint32_t ty = by_tiles_x[l](tile);
    const int y0 = tile_ok ? 4 * static_cast<int>(ty) : 0;
    const int x0 = tile_ok ? 4 * static_cast<int>(tile - ty * tiles_x) : 0;
    // Run q (lane q < 5): the cells (y0 - 1 + q, x0 - 1 .. min(x0 + 3, W - 1)),
    // consecutive keys.
    const Id kbase = Id(cell_key(nm, p.cell_stride, t.cell_base[l], y0 - 1, x0 - 1, lv.W));
    Id first = 0, len = 0;
    if (tile_ok && lane < 5 && y0 - 1 + lane <= lv.H - 1) {
      const int64_t k = int64_t(kbase) + int64_t(lane) * (lv.W + 1);
      first = Id(cell_start[k]);
      len = Id(cell_start[k + min(5, lv.W - x0 + 1)]) - first;
    }
    Id pre = len;  // inclusive scan over lanes 0-4
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {
      const Id below = __shfl_up_sync(0xffffffffu, pre, o);
      if (lane >= o) pre += below;
    }
    const Id count = __shfl_sync(0xffffffffu, pre, 4);
    pre -= len;
    if (lane < 5) {
      sm.pre[lane] = pre;
      sm.off[lane] = first - pre;
    }
    __syncwarp();
    // Entry v of the tile's runs, as lane v % 32 holds it for its round.
    auto fetch = [&](Id v) {
      TileEntry<Id> e;
      if (v < count) {
        int q = 0;
#pragma unroll
        for (int u = 1; u < 5; ++u) q += v >= Id(sm.pre[u]) ? 1 : 0;
        const Id j = v + Id(sm.off[q]);
        e.run = q;
        e.key = keys[j];
        e.w = reinterpret_cast<const float4*>(wts)[j];
        e.row = rows[j];
      }
      return e;
    };
    const uint32_t n = by_m(nm), m = nm - n * static_cast<uint32_t>(pb.M);

    for (int64_t cp = 0; cp < pb.D; cp += 32) {  // 32-channel passes
      // This lane's 16 bytes (chunk lane % 4) of a grad_output row.
      const char* glane = static_cast<const char*>(p.grad_out) + cp * int64_t(sizeof(T)) + 16 * (lane % 4);
      // G of a round's entries: lane copies chunk lane % 4 of samples
      // lane / 4 + 8 i (zeros for samples past the runs' end, so that 0 * G
      // stays 0).
      auto stage_g = [&](const TileEntry<Id>& e) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int s = lane / 4 + 8 * i, q = lane % 4;
          const Id row = __shfl_sync(0xffffffffu, e.row, s);
          const bool ok = row != ~Id(0);
          cp_async16(&sm.b[s][8 * (q ^ ((s >> 1) & 3))], glane + uint64_t(ok ? row : Id(0)) * row_bytes,
                     ok ? 16 : 0);
        }
        cp_async_commit();
      };
      // W of a round's entries: zeroed, then each sample's corners inside the
      // tile.
      auto build_w = [&](const TileEntry<Id>& e, float scale) {
        uint4* a4 = reinterpret_cast<uint4*>(&sm.a[0][0][0][0]);
#pragma unroll
        for (int i = 0; i < 4; ++i) a4[lane + 32 * i] = make_uint4(0, 0, 0, 0);
        __syncwarp();
        if (e.run >= 0) {
          // Corner 0 at tile pixel (py, px); element (y, x) of this lane's
          // sample column s in a plane of W: y * 64 + x * 16 + (s ^ 8 (y & 1)).
          const int s = lane % 16;
          const int py = e.run - 1;
          const int px = static_cast<int>(e.key - kbase) - e.run * (lv.W + 1) - 1;
          const int top = py * 64 + px * 16 + (s ^ ((py & 1) << 3));
          const int bottom = (py + 1) * 64 + px * 16 + (s ^ (((py + 1) & 1) << 3));
          const bool up = unsigned(py) < 4u, down = unsigned(py + 1) < 4u;
          const bool left = unsigned(px) < 4u, right = unsigned(px + 1) < 4u;
          const int off[4] = {top, top + 16, bottom, bottom + 16};
          const bool in[4] = {up && left, up && right, down && left, down && right};
          const float w[4] = {e.w.x * scale, e.w.y * scale, e.w.z * scale, e.w.w * scale};
          uint16_t* plane = &sm.a[lane / 16][0][0][0];  // hi; lo 256 elements on
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            if (in[k]) split_16<T>(w[k], plane[off[k]], plane[off[k] + 256]);
          }
        }
      };
      float acc[4][4] = {};  // times 2^kScaleExp
      auto scale_sums = [](float (&sums)[4][4], int k) {  // sums *= 2^k, -126 <= k <= 127
        const float f = __int_as_float((127 + k) << 23);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
#pragma unroll
          for (int i = 0; i < 4; ++i) sums[c][i] *= f;
        }
      };
      // sums += W^T G (after the copies are waited for).
      auto multiply = [&](float (&sums)[4][4]) {
        __syncwarp();
        wtg_round<T>(sums, sm.a, sm.b, lane);
        __syncwarp();  // W and G are rewritten by the next round
      };
      constexpr float kScale = float(1 << kScaleExp);
      const Id step = Id(32 * g);
      // The tile's rounds; kBig: each checked for weights past
      // kHalfWeightLimit (two loops, so that the usual one has no check).
      auto rounds = [&](auto big_rounds) {
        constexpr bool kBig = decltype(big_rounds)::value;
        TileEntry<Id> cur = fetch(Id(sub) * 32 + lane);
        for (Id v0 = Id(sub) * 32; v0 < count; v0 += step) {
          const TileEntry<Id> nxt = fetch(v0 + step + lane);  // in flight meanwhile
          stage_g(cur);
          // fmaxf drops NaN: a NaN weight goes through as a NaN fp16.
          const float wmax = kBig && cur.run >= 0 ? fmaxf(fmaxf(fabsf(cur.w.x), fabsf(cur.w.y)),
                                                          fmaxf(fabsf(cur.w.z), fabsf(cur.w.w)))
                                                  : 0.f;
          if (kBig && __any_sync(0xffffffffu, wmax >= kHalfWeightLimit)) {
            // 2^k with the round's largest weight times 2^k in [2^14, 2^15)
            // (k >= -114 for inf: its parts are inf and NaN, as with bf16).
            const int e = int((__reduce_max_sync(0xffffffffu, __float_as_uint(wmax)) >> 23) & 0xff) - 127;
            const int k = 14 - e;
            build_w(cur, __int_as_float((127 + k) << 23));
            cp_async_wait<0>();
            // The sums taken to this round's scale and back: powers of two,
            // exact (fp32's range holds both), and no second set of sums.
            scale_sums(acc, k);
            multiply(acc);
            scale_sums(acc, -k);
          } else {
            build_w(cur, 1.f);
            cp_async_wait<0>();
            multiply(acc);
          }
          cur = nxt;
        }
      };
      if (big_rounds) {
        if constexpr (kHalf) rounds(std::true_type{});
      } else {
        rounds(std::false_type{});
      }
      if (g > 1) {  // the tile's warps' sums, added in warp order
        __syncwarp();
#pragma unroll
        for (int c = 0; c < 4; ++c) {
#pragma unroll
          for (int e = 0; e < 4; ++e) sm.red[4 * c + e][lane] = acc[c][e];
        }
        __syncthreads();
        if (sub == 0) {
          for (int o = 1; o < g; ++o) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
#pragma unroll
              for (int e = 0; e < 4; ++e) acc[c][e] += smem[warp + o].red[4 * c + e][lane];
            }
          }
        }
        __syncthreads();
      }
      // acc[c] = (pixel lane / 4, channels 8 c + 2 t, + 1) and the same of
      // pixel lane / 4 + 8 (two rows further down), t = lane % 4.
      if (sub == 0 && tile_ok) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int y = y0 + (lane / 4) / 4 + 2 * half, x = x0 + (lane / 4) % 4;
          if (y < lv.H && x < lv.W) {
            T* out = grad_value +
                     value_row(pb, n, lv.start + int64_t(y) * lv.W + x, m) * pb.D + cp +
                     2 * (lane % 4);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              const float pair[2] = {acc[c][2 * half] * (1.f / kScale), acc[c][2 * half + 1] * (1.f / kScale)};
              store_vec<T, 2>(out + 8 * c, pair);
            }
          }
        }
      }
    }
  }
}

template <typename T, typename LT, int VEC>
struct GatherLaunch {
  template <typename Id>
  static cudaError_t go(const GatherParams& g, cudaStream_t stream) {
    using A = acc_t<T>;
    const SortedBuffers& b = *g.buf;
    const BackwardParams& p = g.bw;
    const auto* start = static_cast<const int64_t*>(b.cell_starts);
    const auto* sorted = static_cast<const Id*>(b.sorted_ids);
    auto* rows = static_cast<Id*>(b.rows);
    auto* wts = static_cast<A*>(b.weights);
    // The planner's tiles: 16-bit values, VEC == 8 (grad_output and grad_value
    // 16-byte aligned), D a multiple of 32, fewer than 2^31 pixels for the
    // tiles' 32-bit item arithmetic. fp16 weights go to them scaled.
    constexpr bool kTileable = (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>) && VEC == 8;
    const bool tiles = kTileable && p.plan.gather == GatherKernel::tiles;
    auto pack = [&](auto scaled) {
      constexpr bool kScaled = decltype(scaled)::value;
      if (p.ref == nullptr) {
        pack_samples<A, LT, Id, false, kScaled><<<grid_for(b.items), kThreads, 0, stream>>>(
            p, sorted, start, b.cells, rows, wts, b.big_weights);
      } else if constexpr (std::is_same_v<A, float>) {  // the fused operator: no fp64 values
        pack_samples<A, LT, Id, true, kScaled><<<grid_for(b.items), kThreads, 0, stream>>>(
            p, sorted, start, b.cells, rows, wts, b.big_weights);
      } else {
        return cudaErrorInvalidValue;
      }
      return cudaGetLastError();
    };
    cudaError_t err = cudaSuccess;
    if constexpr (kTileable && std::is_same_v<T, __half>) {
      err = tiles ? pack(std::true_type{}) : pack(std::false_type{});
    } else {
      err = pack(std::false_type{});
    }
    if (err != cudaSuccess) return err;
    const int64_t items = p.pb.N * p.pb.M * p.pb.S;  // pixels of the grad_value map
    if (items == 0) return cudaSuccess;
    T* out = static_cast<T*>(b.grad_value);
    DeviceInfo d;
    if (const cudaError_t err = current_device_info(d); err != cudaSuccess) return err;
    if constexpr (kTileable) {
      if (tiles) {
        // As many blocks as fit (__launch_bounds__), the rest of the items in turn.
        grad_value_tiles_kernel<T, Id><<<static_cast<unsigned>(d.sms) * kTilesBlocksPerSm, kThreads, 0, stream>>>(
            p, rows, wts, static_cast<const Id*>(b.sorted_keys), start, b.big_weights, out);
        return cudaGetLastError();
      }
    }
    // Up to 64 warps an SM (at most one a pixel); the rest of the items are
    // taken in turn (grid stride).
    const int lanes = lanes_for(p.pb.D, VEC);
    const unsigned blocks = static_cast<unsigned>(
        std::max<int64_t>(1, std::min<int64_t>((items + kWarps - 1) / kWarps, int64_t(d.sms) * kPixelsBlocksPerSm)));
    grad_value_pixels_kernel<T, VEC, Id><<<blocks, kThreads, 0, stream>>>(p, rows, wts, start, out, lanes);
    return cudaGetLastError();
  }
  static cudaError_t run(const GatherParams& g, cudaStream_t stream) {
    return g.buf->wide ? go<uint64_t>(g, stream) : go<unsigned>(g, stream);
  }
};

// The sort in place: keys / sorted_keys and ids / sorted_ids are its double
// buffers (no copies of them in its temp); where the result lands is known
// on the host once the call returns, and b then points at it (sorted_*), and
// rows at the dead keys buffer.
template <typename K>
cudaError_t sort_pairs(void* temp, size_t& temp_bytes, SortedBuffers& b, cudaStream_t stream) {
  cub::DoubleBuffer<K> keys(static_cast<K*>(b.keys), static_cast<K*>(b.sorted_keys));
  cub::DoubleBuffer<K> ids(static_cast<K*>(b.ids), static_cast<K*>(b.sorted_ids));
  // 32-bit offsets on the large sorts: cub then takes more items a thread
  // (faster on ddetr_enc, slower on rtdetr_dec's 0.46 M; docs/performance.md).
  // The size query goes through here too, so the temp
  // storage matches the call.
  const bool offsets32 = b.items >= kSortOffsets32From && b.items <= int64_t(INT32_MAX);
  const cudaError_t err =
      offsets32 ? cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, ids, static_cast<uint32_t>(b.items),
                                                  0, b.end_bit, stream)
                : cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, ids, b.items, 0, b.end_bit, stream);
  if (temp != nullptr) {
    b.sorted_keys = keys.Current();
    b.sorted_ids = ids.Current();
    b.rows = keys.Alternate();
  }
  return err;
}

}  // namespace

cudaError_t sorted_temp_bytes(const SortedBuffers& b, size_t& bytes) {
  bytes = 0;
  SortedBuffers sizes = b;
  return b.wide ? sort_pairs<uint64_t>(nullptr, bytes, sizes, nullptr)
                : sort_pairs<unsigned>(nullptr, bytes, sizes, nullptr);
}

cudaError_t grad_value_sorted(const BackwardParams& p, const SortedBuffers& buffers,
                                     cudaStream_t stream) {
  SortedBuffers b = buffers;
  size_t bytes = b.temp_bytes;
  cudaError_t err = b.wide ? sort_pairs<uint64_t>(b.temp, bytes, b, stream)
                           : sort_pairs<unsigned>(b.temp, bytes, b, stream);
  if (err != cudaSuccess) return err;
  err = b.wide ? launch_cell_starts<uint64_t>(b, stream) : launch_cell_starts<unsigned>(b, stream);
  if (err != cudaSuccess) return err;
  const GatherParams g{p.pb, b.vec, p, &b};
  return launch_for_dtypes<GatherLaunch>(g, stream);
}

}  // namespace msda::cuda
