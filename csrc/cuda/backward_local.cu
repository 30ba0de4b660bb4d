// The deterministic backward's grad_value where the samples of one (n, m,
// level) fit one block (Lq P <= kLocalCap: the decoders): no global sort and
// no scratch but a work counter. A block owns a tile of at most kTileH x
// kTileW pixels of one (n, m, level). It resolves every sample of that (n, m, level) (location, weight,
// footprint), keeps those whose footprint touches the tile, groups them by
// cell within the tile in sample order, and walks each pixel's samples from
// shared memory as value_grad_pixels walks the global order: the four cells
// that have the pixel as a corner, as two runs, in cell and sample order.
// Every pixel of the map is in exactly one tile, so grad_value is written
// completely, once, in its dtype: no fill, no accumulator, no conversion, and
// the same bits on every run.
//
// Grouping: a counting sort (shared-memory counters, a scan, a scatter), then
// each cell's run put in sample order by insertion sort, so the order does
// not depend on the counters' atomics. A tile with a cell of more than
// kShortRun samples (crowded inputs) takes cub's stable block radix sort
// instead, whose order within a cell is as fixed (the order the threads
// hold the samples in).
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include "common.cuh"
#include "launch.h"

namespace msda::cuda {
namespace {

constexpr int kLocalCap = 4096;  // samples of one (n, m, level) at most: Lq P
constexpr int kLocalThreads = 512;
constexpr int kLocalItems = 8;  // samples a thread holds for the sort
static_assert(kLocalCap == kLocalThreads * kLocalItems, "a block's sort holds kLocalCap samples");
constexpr int kTileH = 32, kTileW = 64;
constexpr int kTileCells = (kTileH + 1) * (kTileW + 1);  // cells touching a tile; also "none"
constexpr int kLocalBatch = 2;  // a pixel's entries loaded at once
constexpr int kShortRun = 32;  // longest cell run the insertion sort takes
constexpr int kScanItems = (kTileCells + 1 + kLocalThreads - 1) / kLocalThreads;  // counters a thread scans

// Keys are cells of a tile (< kTileCells, or kTileCells for a sample that
// touches none of it); values the sample's index within its (n, m, level).
using LocalSort = cub::BlockRadixSort<uint16_t, kLocalThreads, kLocalItems, uint16_t>;
using LocalScan = cub::BlockScan<uint32_t, kLocalThreads>;
static_assert(kTileCells < 65536 && kLocalCap <= 65536, "16-bit keys and values");

struct LocalSmem {
  float4 wts[kLocalCap];  // a sample's four corner weights (times its attention weight)
  union {
    typename LocalSort::TempStorage sort;
    typename LocalScan::TempStorage scan;
    struct {
      uint16_t ent[kLocalCap];   // sorted position -> sample index
      uint16_t keys[kLocalCap];  // sorted position -> key (radix-sorted tiles)
    } s;
  } u;
  // A cell's samples, then (exclusive scan) its first sorted position; entry
  // `cells`: the end of the last.
  uint32_t start[kScanItems * kLocalThreads];
  Level levels[kMaxLevels];
  uint32_t first[kMaxLevels + 1];  // first item of each level; first[L]: the total
  int tile_h[kMaxLevels], tile_w[kMaxLevels];  // a level's tile (the last ones clipped)
  uint32_t tiles_x[kMaxLevels], tiles[kMaxLevels];
  uint32_t item;                   // the block's current item
  int crowded;                     // a cell holds more than kShortRun samples
};

constexpr int bits_for_cells(int cells) {  // bits of every key in [0, cells]
  int b = 0;
  while ((1 << b) <= cells) ++b;
  return b;
}

// Block items: (level, n m, tile), levels in order, tiles row-major, taken
// from `counter` (zeroed before the launch) as blocks finish, so that tiles
// of different sizes and levels balance over the SMs. A level's tiles are
// its map cut into ceil(H / kTileH) x ceil(W / kTileW) nearly equal parts.
// The launch keeps N M S below 2^31 and Lq P <= kLocalCap.
template <typename T, int VEC, typename LT, bool kFused>
__global__ void __launch_bounds__(kLocalThreads, 2)
    value_grad_local(const BackwardParams p, T* __restrict__ grad_value, const int lanes,
                     unsigned* __restrict__ counter) {
  using A = float;
  const Problem& pb = p.pb;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  LocalSmem& sm = *reinterpret_cast<LocalSmem*>(smem_raw);
  load_levels(sm.levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  __syncthreads();
  if (sm.levels[0].poison) {  // an inconsistent level table: every sample poisoned, adding nothing
    const int64_t total = pb.N * pb.S * pb.M * pb.D;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += int64_t(gridDim.x) * blockDim.x) {
      grad_value[i] = from_acc<T>(A(0));
    }
    return;
  }
  if (threadIdx.x == 0) {
    uint32_t first = 0;
    for (int l = 0; l < pb.L; ++l) {
      const Level& lv = sm.levels[l];
      const int ty = (lv.H + kTileH - 1) / kTileH, tx = (lv.W + kTileW - 1) / kTileW;
      sm.tile_h[l] = (lv.H + ty - 1) / ty;
      sm.tile_w[l] = (lv.W + tx - 1) / tx;
      sm.tiles_x[l] = uint32_t(tx);
      sm.tiles[l] = uint32_t(tx) * uint32_t(ty);
      sm.first[l] = first;
      first += uint32_t(pb.N * pb.M) * sm.tiles[l];
    }
    sm.first[pb.L] = first;
  }

  const int tid = threadIdx.x;
  const uint32_t LqP = static_cast<uint32_t>(pb.Lq * pb.P);
  const FastDiv by_p(static_cast<uint32_t>(pb.P));
  const int groups = kLocalThreads / lanes, grp = tid / lanes, ql = tid % lanes;
  const T* gout = static_cast<const T*>(p.grad_out);

  for (;;) {
    for (int c = tid; c < kScanItems * kLocalThreads; c += kLocalThreads) sm.start[c] = 0;
    if (tid == 0) {
      sm.crowded = 0;
      sm.item = atomicAdd(counter, 1u);
    }
    __syncthreads();
    const uint32_t item = sm.item;
    if (item >= sm.first[pb.L]) break;
    int l = 0;
    while (item >= sm.first[l + 1]) ++l;
    const Level lv = sm.levels[l];
    const uint32_t r = item - sm.first[l], nm = r / sm.tiles[l], tile = r - nm * sm.tiles[l];
    const int64_t n = nm / pb.M, m = nm - n * pb.M;
    const int r0 = static_cast<int>(tile / sm.tiles_x[l]) * sm.tile_h[l];
    const int c0 = static_cast<int>(tile % sm.tiles_x[l]) * sm.tile_w[l];
    const int th = min(sm.tile_h[l], lv.H - r0), tw = min(sm.tile_w[l], lv.W - c0);
    const int cells = (th + 1) * (tw + 1);
    // Resolve this thread's samples i = k kLocalThreads + tid (striped: the
    // block's loads in flight together) and count them by cell.
    uint16_t key[kLocalItems], val[kLocalItems], rank[kLocalItems];
#pragma unroll
    for (int k = 0; k < kLocalItems; ++k) {
      const uint32_t i = uint32_t(k) * kLocalThreads + tid;
      key[k] = static_cast<uint16_t>(cells);
      val[k] = static_cast<uint16_t>(i);
      rank[k] = 0;
      if (i < LqP) {
        const uint32_t q = by_p(i);
        const int64_t nq = n * pb.Lq + q, row = nq * pb.M + m;
        const int64_t id = (row * pb.L + l) * pb.P + (i - q * uint32_t(pb.P));
        A w;
        const float* ref_row = kFused ? p.ref + (nq * pb.L + l) * p.ref_dim : nullptr;
        const auto b = resolve_sample<A, LT, kFused>(p, id, row, ref_row, lv, w);
        // Footprint rows h0, h0 + 1 and columns w0, w0 + 1 against the tile's.
        const int a = b.h0 - r0 + 1, c = b.w0 - c0 + 1;
        if (b.inside && !b.poisoned() && a >= 0 && a <= th && c >= 0 && c <= tw) {
          key[k] = static_cast<uint16_t>(a * (tw + 1) + c);
          sm.wts[i] = make_float4(w * b.weight(0), w * b.weight(1), w * b.weight(2), w * b.weight(3));
          rank[k] = static_cast<uint16_t>(atomicAdd(&sm.start[key[k]], 1u));
          if (rank[k] >= kShortRun) atomicOr(&sm.crowded, 1);
        }
      }
    }
    __syncthreads();
    if (!sm.crowded) {
      // Counting sort: starts by an exclusive scan of the counts, each sample
      // to its cell's start + its counter rank, then each run in sample order.
      uint32_t cnt[kScanItems];
#pragma unroll
      for (int k = 0; k < kScanItems; ++k) cnt[k] = sm.start[tid * kScanItems + k];
      LocalScan(sm.u.scan).ExclusiveSum(cnt, cnt);
#pragma unroll
      for (int k = 0; k < kScanItems; ++k) sm.start[tid * kScanItems + k] = cnt[k];
      __syncthreads();  // the scan's storage becomes ent
#pragma unroll
      for (int k = 0; k < kLocalItems; ++k) {
        if (key[k] < cells) sm.u.s.ent[sm.start[key[k]] + rank[k]] = val[k];
      }
      __syncthreads();
      for (int c = tid; c < cells; c += kLocalThreads) {
        const int lo = static_cast<int>(sm.start[c]), hi = static_cast<int>(sm.start[c + 1]);
        for (int j = lo + 1; j < hi; ++j) {  // insertion sort of a short run
          const uint16_t v = sm.u.s.ent[j];
          int t = j - 1;
          for (; t >= lo && sm.u.s.ent[t] > v; --t) sm.u.s.ent[t + 1] = sm.u.s.ent[t];
          sm.u.s.ent[t + 1] = v;
        }
      }
    } else {
      // Crowded: the stable radix sort (a cell's samples in the order the
      // threads hold them: by tid, then k; fixed, though not sample order),
      // then each cell's start by a binary search of the sorted keys.
      LocalSort(sm.u.sort).Sort(key, val, 0, bits_for_cells(cells));
      __syncthreads();  // the sort's storage becomes ent and keys
#pragma unroll
      for (int k = 0; k < kLocalItems; ++k) {
        sm.u.s.ent[tid * kLocalItems + k] = val[k];
        sm.u.s.keys[tid * kLocalItems + k] = key[k];
      }
      __syncthreads();
      for (int c = tid; c <= cells; c += kLocalThreads) {
        int lo = 0, hi = kLocalCap;  // first position whose key is >= c
        while (lo < hi) {
          const int mid = (lo + hi) / 2;
          if (int(sm.u.s.keys[mid]) < c) lo = mid + 1; else hi = mid;
        }
        sm.start[c] = static_cast<uint32_t>(lo);
      }
    }
    __syncthreads();

    // Pixels: `lanes` threads a pixel, VEC channels a lane. Pixel (py, px) is
    // corner 3 of cell (py, px) and 2 of (py, px + 1) in the tile's cell
    // coordinates (the run above), 1 of (py + 1, px) and 0 of (py + 1, px + 1)
    // (the run below). Addresses as a base and 32-bit byte strides (a query's
    // grad_output row, a pixel's value row: M D elements, checked < 4 GiB).
    using R = typename RawVec<sizeof(T) * VEC>::type;
    const unsigned row_bytes = static_cast<unsigned>(pb.M * pb.D * sizeof(T));
    const char* gbase = reinterpret_cast<const char*>(gout + (n * pb.Lq * pb.M + m) * pb.D + ql * VEC);
    char* obase = reinterpret_cast<char*>(
        grad_value + value_row(n, lv.start + int64_t(r0) * lv.W + c0, m, pb.S, pb.M) * pb.D + ql * VEC);
    const float* wflat = reinterpret_cast<const float*>(sm.wts);
    const int dy = groups / tw, dx = groups - dy * tw;  // a group's step through the tile
    int py = grp / tw, px = grp - py * tw;
    for (; py < th; py += dy, px += dx) {
      if (px >= tw) {
        px -= tw;
        if (++py >= th) break;
      }
      const int ka = py * (tw + 1) + px, kb = ka + tw + 1;
      const int a0 = int(sm.start[ka]), a1 = int(sm.start[ka + 1]), a2 = int(sm.start[ka + 2]);
      const int b0 = int(sm.start[kb]), b1 = int(sm.start[kb + 1]), b2 = int(sm.start[kb + 2]);
      const int above = a2 - a0, count = above + (b2 - b0);
      char* out = obase + uint64_t(static_cast<uint32_t>(py * lv.W + px)) * row_bytes;
      for (int64_t ch = ql * VEC; ch < pb.D; ch += int64_t(lanes) * VEC) {  // VEC divides D
        const int64_t cb = (ch - ql * VEC) * int64_t(sizeof(T));
        A acc[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = A(0);
        for (int v0 = 0; v0 < count; v0 += kLocalBatch) {
          A scale[kLocalBatch];
          R raw[kLocalBatch];
#pragma unroll
          for (int u = 0; u < kLocalBatch; ++u) {
            const int v = v0 + u;
            scale[u] = A(0);
            raw[u] = R{};
            if (v < count) {
              const bool up = v < above;
              const int j = up ? a0 + v : b0 + (v - above);
              const int corner = up ? (j < a1 ? 3 : 2) : (j < b1 ? 1 : 0);
              const uint32_t i = sm.u.s.ent[j];
              scale[u] = wflat[4 * i + corner];
              raw[u] = __ldg(reinterpret_cast<const R*>(gbase + uint64_t(by_p(i)) * row_bytes + cb));
            }
          }
#pragma unroll
          for (int u = 0; u < kLocalBatch; ++u) {
            A go[VEC];
            unpack<T, VEC>(raw[u], go);
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] += scale[u] * go[e];
          }
        }
        store_vec<T, VEC>(reinterpret_cast<T*>(out + cb), acc);
      }
    }
    __syncthreads();  // start, ent and wts are rewritten by the next item
  }
}

// What the launch needs (launch_for_dtypes reads pb and vec).
struct LocalParams {
  Problem pb;
  int vec;
  BackwardParams bw;
  void* grad_value;
  unsigned* counter;
};

template <typename T, typename LT, int VEC>
struct LocalLaunch {
  static cudaError_t run(const LocalParams& g, cudaStream_t stream) {
    // Instantiated only for what local_value_grad_ok admits: fp32 locations,
    // 16-bit or fp32 values, 16-byte vectors.
    if constexpr (std::is_same_v<T, double> || !std::is_same_v<LT, float> ||
                  VEC * sizeof(T) != 16) {
      return cudaErrorInvalidValue;
    } else {
      DeviceLimits d;
      if (const cudaError_t err = device_limits(d); err != cudaSuccess) return err;
      const int lanes = lanes_for(g.pb.D, VEC);
      constexpr size_t bytes = sizeof(LocalSmem);
      auto go = [&](auto kernel) {
        cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(bytes));
        if (err != cudaSuccess) return err;
        kernel<<<static_cast<unsigned>(d.sms) * 2, kLocalThreads, bytes, stream>>>(
            g.bw, static_cast<T*>(g.grad_value), lanes, g.counter);
        return cudaGetLastError();
      };
      return g.bw.ref != nullptr ? go(value_grad_local<T, VEC, LT, true>)
                              : go(value_grad_local<T, VEC, LT, false>);
    }
  }
};

}  // namespace

bool local_value_grad_ok(const BackwardParams& p) {
  const Problem& pb = p.pb;
  const int64_t elem = dtype_bytes(pb.value_dtype);
  DeviceLimits d;  // the current device's: its blocks must hold LocalSmem (sm_75: no)
  if (device_limits(d) != cudaSuccess || d.smem_optin < int(sizeof(LocalSmem))) return false;
  return pb.value_dtype != DType::f64 && pb.loc_dtype == DType::f32 && pb.L >= 1 &&
         pb.Lq * pb.P <= kLocalCap && pb.N * pb.M * pb.S < (int64_t(1) << 31) &&
         pb.M * pb.D * elem <= int64_t(UINT32_MAX) &&
         pb.D % (16 / elem) == 0 && reinterpret_cast<uintptr_t>(p.grad_out) % 16 == 0;
}

cudaError_t local_value_grad(const BackwardParams& p, void* grad_value, unsigned* counter,
                             cudaStream_t stream) {
  if (!local_value_grad_ok(p) || reinterpret_cast<uintptr_t>(grad_value) % 16 != 0 || counter == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (p.pb.N * p.pb.S * p.pb.M * p.pb.D == 0) return cudaSuccess;
  const LocalParams g{p.pb, static_cast<int>(16 / dtype_bytes(p.pb.value_dtype)), p, grad_value,
                      counter};
  return launch_for_dtypes<LocalLaunch, /*kVecOfAcc=*/false, /*kVecBytes=*/16>(g, stream);
}

}  // namespace msda::cuda
