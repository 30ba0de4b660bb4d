// The block-local grad_value path: grad_value where the samples of one (n, m,
// level) fit one block (Lq P <= kLocalCap, 8192: the decoders, with DINO's
// denoising queries too): no global sort.
// Every sample is resolved once, into a record (BackwardParams::local_cell,
// local_wts): its cell within its level and its four corner weights, a (n,
// m, level)'s records contiguous. The dots kernel writes them as it resolves
// the samples (ffma_dots.cu, mma_dots.cu); for the fused operator's FFMA kernel (fp32
// values) local_footprints does, after it. Then a block owns a
// tile of at most kTileH x kTileW pixels of one (n, m, level): it reads the
// cells of that (n, m, level), keeps the samples whose footprint touches the
// tile, groups them by cell within the tile in sample order, and sums each
// pixel's samples in grad_value_pixels_kernel' order (the four cells that have the
// pixel as a corner, as two runs, in cell and sample order), walking down
// pixel columns so that each run is read once for the two pixels it touches.
// Every pixel of the map is in exactly one tile, so grad_value is written
// completely, once, in its dtype: no fill, no accumulator, no conversion, and
// the same bits on every run. Scratch: the records (20 bytes a sample) and
// the blocks' work counter, from which blocks claim items level by level,
// the smallest level first: its tiles hold the longest walks.
//
// Staged (BackwardPlan::stage, where they fit: the 16-bit decoders): the
// block copies its (n, m)'s Lq grad_output rows into shared memory with the
// records' loads, and, once the tile's samples are grouped, each one's four
// weights in sorted order, with its query in place of its index: the walk
// then reads shared memory only. Unstaged, each run's entries wait on their
// weights' and rows' global loads, one run after another down a column:
// on the dense small levels of a decoder that chain is the item's time.
// The same sums in the same order either way: the same bits.
//
// Grouping: a counting sort (shared-memory counters, a scan, a scatter), then
// each cell's run put in sample order by insertion sort, so the order does
// not depend on the counters' atomics. A tile with a cell of more than
// kShortRun samples (crowded inputs) takes cub's block radix sort of (cell,
// sample) keys instead: the same order.
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include "../device/fused_samples.cuh"
#include "../device/grad_value_records.cuh"
#include "../device/launch.cuh"
#include "../entry_points.h"

namespace msda::cuda {
namespace {

// Samples of one (n, m, level) at most (Lq P): a block's sort holds kCap, 4096
// (the decoders: 8 a thread) or, for the Lq P up to 8192 that DINO's
// denoising queries give, 8192 (16 a thread; it spills, but the global sort
// it replaces is slower still).
// (kLocalCapSmall, kLocalCap, kLocalThreads and kLocalBlocksPerSm: plan/launch_shapes.h.)
static_assert(kLocalCapSmall % kLocalThreads == 0 && kLocalCap % kLocalThreads == 0,
              "a block's sort holds kCap samples");
constexpr int kTileH = 32, kTileW = 64;
constexpr int kTileCells = (kTileH + 1) * (kTileW + 1);  // cells touching a tile; also "none"
constexpr int kLocalBatch = 2;  // a run's entries loaded at once
constexpr int kShortRun = 32;  // longest cell run the insertion sort takes
constexpr int kScanItems = (kTileCells + 1 + kLocalThreads - 1) / kLocalThreads;  // counters a thread scans

// Keys of the crowded tiles' sort: a sample's cell of the tile (< kTileCells,
// or `cells` for a sample that touches none of it) << 16 | its index within
// its (n, m, level): unique, so the order is the counting sort's (cell, then
// sample order).
template <int kCap>
using LocalSort = cub::BlockRadixSort<uint32_t, kLocalThreads, kCap / kLocalThreads>;
using LocalScan = cub::BlockScan<uint32_t, kLocalThreads>;
static_assert(kTileCells < 65536 && kLocalCap <= 65536, "16-bit keys and values");

template <int kCap>
struct LocalSmem {
  union {
    typename LocalSort<kCap>::TempStorage sort;
    typename LocalScan::TempStorage scan;
    struct {
      uint16_t ent[kCap];   // sorted position -> sample index
      uint16_t keys[kCap];  // sorted position -> key (radix-sorted tiles)
    } s;
  } u;
  // A cell's samples, then (exclusive scan) its first sorted position; entry
  // `cells`: the end of the last.
  uint32_t start[kScanItems * kLocalThreads];
  Level levels[kMaxLevels];
  FastDiv by_row[kMaxLevels];      // a level's cells a row: W + 1
  uint32_t first[kMaxLevels + 1];  // first item of the k-th level taken; first[L]: the total
  int order[kMaxLevels];           // the levels in the order their items are taken
  int tile_h[kMaxLevels], tile_w[kMaxLevels];  // a level's tile (the last ones clipped)
  uint32_t tiles_x[kMaxLevels], tiles[kMaxLevels];
  uint32_t item;                   // the block's current item
  int crowded;                     // a cell holds more than kShortRun samples
};

// The planner's figures for the two kernels' shared memory (launch_shapes.h).
static_assert(sizeof(LocalSmem<kLocalCapSmall>) <= kLocalSmemSmall &&
                  sizeof(LocalSmem<kLocalCap>) <= kLocalSmem,
              "the block-local kernels' shared memory passed the planner's figures");

// Whether the samples of one (n, m, level) fit the first instantiation
// (kLocalCapSmall): its kernel and its shared memory.
bool small_cap(const Problem& pb) { return pb.Lq * pb.P <= kLocalCapSmall; }

constexpr int bits_for_cells(int cells) {  // bits of every key in [0, cells]
  int b = 0;
  while ((1 << b) <= cells) ++b;
  return b;
}

// A record per sample (grad_value_records.cuh: local_cell_of, store_record_weights) at
// ((n M + m) L + l) Lq P + q P + p: the samples of a (n, m, level)
// contiguous, in their order: the fused operator's where its FFMA kernel ran
// (fp32 values, or 16-bit ones without the tensor-core dots), after it
// (whose row statistics it reads). The launch keeps the samples below 2^31
// and S below 2^30 (so cells fit FastDiv's 31 bits).
template <typename LT>
__global__ void __launch_bounds__(kThreads) local_footprints(const BackwardParams p) {
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  __shared__ FastDiv div[4];  // by Lq P, L, M, P: made once a block (FastDiv's set-up divides)
  const uint32_t P = uint32_t(pb.P), L = uint32_t(pb.L), M = uint32_t(pb.M), LqP = uint32_t(pb.Lq * pb.P);
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  if (threadIdx.x >= 32 && threadIdx.x < 36) {
    const uint32_t d[4] = {LqP, L, M, P};
    div[threadIdx.x - 32] = FastDiv(d[threadIdx.x - 32]);
  }
  __syncthreads();
  if (levels[0].poison) return;  // grad_value_local_kernel zero-fills; no record is read
  const FastDiv by_lqp = div[0], by_l = div[1], by_m = div[2], by_p = div[3];
  const uint32_t total = uint32_t(pb.N) * M * L * LqP;
  // Threads in the records' order: their writes coalesce; the reads come in
  // runs of P samples.
  for (uint32_t o = blockIdx.x * blockDim.x + threadIdx.x; o < total; o += gridDim.x * blockDim.x) {
    const uint32_t nml = by_lqp(o), i = o - nml * LqP;
    const uint32_t nm = by_l(nml), l = nml - nm * L;
    const uint32_t n = by_m(nm), m = nm - n * M;
    const uint32_t q = by_p(i), pp = i - q * P;
    const uint32_t nq = n * uint32_t(pb.Lq) + q, row = nq * M + m;
    const Level& lv = levels[l];
    float w;
    const float* ref_row = p.ref + (int64_t(nq) * L + l) * p.ref_dim;
    const auto b = resolve_sample_at<float, LT, true>(p, (int64_t(row) * L + l) * P + pp, row, ref_row, lv, w);
    write_local_record(p, o, b, lv.W, w);
  }
}

// Block items: (level, n m, tile), levels in order, tiles row-major, taken
// from `counter` (zeroed before the launch) as blocks finish, so that tiles
// of different sizes and levels balance over the SMs. A level's tiles are
// its map cut into ceil(H / kTileH) x ceil(W / kTileW) nearly equal parts.
// The launch keeps N M S below 2^31 and Lq P <= kCap.
// kStage: the staged walk (above); its shared memory follows LocalSmem: the
// weights (LqP float4 at most) at stage_offset<kCap>(), then the Lq rows.
template <int kCap>
constexpr size_t stage_offset() { return (sizeof(LocalSmem<kCap>) + 15) / 16 * 16; }

// SelfLT (BackwardPlan::self_records, staged only): the locations' and
// weights' dtype; the block resolves its samples itself (resolve_sample_at,
// the dots kernel's arithmetic: the same cells and weights) instead of
// reading `cell` and `wts`, which are null. void: it reads them.
template <typename T, int VEC, int kCap, bool kStage, typename SelfLT = void>
__global__ void __launch_bounds__(kLocalThreads, kLocalBlocksPerSm)
    grad_value_local_kernel(const BackwardParams p, T* __restrict__ grad_value, const int lanes,
                     const uint32_t* __restrict__ cell, const float4* __restrict__ wts,
                     unsigned* __restrict__ counter) {
  using A = float;
  constexpr bool kSelf = !std::is_void_v<SelfLT>;
  static_assert(!kSelf || kStage, "records made in the block serve the staged walk only");
  const Problem& pb = p.pb;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kLocalItems = kCap / kLocalThreads;  // samples a thread holds for the sort
  LocalSmem<kCap>& sm = *reinterpret_cast<LocalSmem<kCap>*>(smem_raw);
  load_levels(sm.levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  __syncthreads();
  if (sm.levels[0].poison) {
    zero_grad_value(pb, grad_value);
    return;
  }
  if (threadIdx.x == 0) {
    for (int l = 0; l < pb.L; ++l) {
      const Level& lv = sm.levels[l];
      const int ty = (lv.H + kTileH - 1) / kTileH, tx = (lv.W + kTileW - 1) / kTileW;
      sm.tile_h[l] = (lv.H + ty - 1) / ty;
      sm.tile_w[l] = (lv.W + tx - 1) / tx;
      sm.tiles_x[l] = uint32_t(tx);
      sm.tiles[l] = uint32_t(tx) * uint32_t(ty);
      sm.by_row[l] = FastDiv(uint32_t(lv.W + 1));
    }
    // Every level receives Lq P samples of each (n, m): the smallest level's
    // items are the densest (the longest walks); taken first, they do not
    // start last on a GPU already full of the sparse large-level items.
    for (int l = 0; l < pb.L; ++l) sm.order[level_rank(sm.levels, pb.L, l)] = l;
    uint32_t first = 0;
    for (int k = 0; k < pb.L; ++k) {
      sm.first[k] = first;
      first += uint32_t(pb.N * pb.M) * sm.tiles[sm.order[k]];
    }
    sm.first[pb.L] = first;
  }

  const int tid = threadIdx.x;
  const uint32_t LqP = static_cast<uint32_t>(pb.Lq * pb.P);
  const FastDiv by_p(static_cast<uint32_t>(pb.P));
  const int groups = kLocalThreads / lanes, grp = tid / lanes, ql = tid % lanes;
  const T* gout = static_cast<const T*>(p.grad_out);
  float4* staged_w = reinterpret_cast<float4*>(smem_raw + stage_offset<kCap>());
  char* staged_rows = reinterpret_cast<char*>(staged_w + (kStage ? LqP : 0));
  const unsigned staged_row_bytes = static_cast<unsigned>(pb.D * sizeof(T));

  for (;;) {
    for (int c = tid; c < kScanItems * kLocalThreads; c += kLocalThreads) sm.start[c] = 0;
    if (tid == 0) {
      sm.crowded = 0;
      sm.item = atomicAdd(counter, 1u);
    }
    __syncthreads();
    const uint32_t item = sm.item;
    if (item >= sm.first[pb.L]) break;
    int k = 0;
    while (item >= sm.first[k + 1]) ++k;
    const int l = sm.order[k];
    const Level lv = sm.levels[l];
    const uint32_t r = item - sm.first[k], nm = r / sm.tiles[l], tile = r - nm * sm.tiles[l];
    const int64_t n = nm / pb.M, m = nm - n * pb.M;
    const int r0 = static_cast<int>(tile / sm.tiles_x[l]) * sm.tile_h[l];
    const int c0 = static_cast<int>(tile % sm.tiles_x[l]) * sm.tile_w[l];
    const int th = min(sm.tile_h[l], lv.H - r0), tw = min(sm.tile_w[l], lv.W - c0);
    const int cells = (th + 1) * (tw + 1);
    // This thread's samples i = k kLocalThreads + tid (striped: the block's
    // loads in flight together), counted by cell.
    const int64_t base = (int64_t(nm) * pb.L + l) * LqP;
    // Sample i = q P + pt of this (n, m, level) in the operator's inputs.
    auto resolve = [&](const uint32_t i, float& w) {
      const uint32_t q = by_p(i), pt = i - q * uint32_t(pb.P);
      const int64_t row = (n * pb.Lq + q) * pb.M + m;
      return resolve_sample_at<float, std::conditional_t<kSelf, SelfLT, float>, false>(
          p, (row * pb.L + l) * pb.P + pt, row, nullptr, lv, w);
    };
    uint32_t cl[kLocalItems];
#pragma unroll
    for (int k = 0; k < kLocalItems; ++k) {
      const uint32_t i = uint32_t(k) * kLocalThreads + tid;
      cl[k] = kNoCell;
      if (i < LqP) {
        if constexpr (kSelf) {
          float w;
          cl[k] = local_cell_of(resolve(i, w), lv.W);
        } else {
          cl[k] = __ldg(cell + base + i);
        }
      }
    }
    if constexpr (kStage) {
      // The (n, m)'s grad_output rows, 16 bytes a thread at a time (D sizeof(T)
      // is a multiple of 16: the plan), while the cells load. The previous
      // item's walk ended at a barrier.
      const unsigned chunks = staged_row_bytes / 16, total = uint32_t(pb.Lq) * chunks;
      const char* src = reinterpret_cast<const char*>(gout + (n * pb.Lq * pb.M + m) * pb.D);
      const unsigned src_row = static_cast<unsigned>(pb.M * pb.D * sizeof(T));
      for (unsigned k = tid; k < total; k += kLocalThreads) {
        const unsigned q = k / chunks, c = k - q * chunks;
        reinterpret_cast<uint4*>(staged_rows)[k] =
            __ldg(reinterpret_cast<const uint4*>(src + uint64_t(q) * src_row + c * 16u));
      }
    }
    uint32_t kr[kLocalItems];  // key << 16 | rank within the key's cell; key `cells`: none
#pragma unroll
    for (int k = 0; k < kLocalItems; ++k) {
      kr[k] = uint32_t(cells) << 16;
      if (cl[k] != kNoCell) {
        // Footprint rows h0, h0 + 1 and columns w0, w0 + 1 against the tile's.
        const uint32_t h = sm.by_row[l](cl[k]);
        const int a = int(h) - r0, c = int(cl[k] - h * uint32_t(lv.W + 1)) - c0;
        if (a >= 0 && a <= th && c >= 0 && c <= tw) {
          const uint32_t key = uint32_t(a * (tw + 1) + c), rank = atomicAdd(&sm.start[key], 1u);
          kr[k] = key << 16 | rank;  // rank < kCap
          if (rank >= kShortRun) atomicOr(&sm.crowded, 1);
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
        const uint32_t key = kr[k] >> 16;
        if (key < uint32_t(cells)) {
          sm.u.s.ent[sm.start[key] + (kr[k] & 0xffffu)] = static_cast<uint16_t>(k * kLocalThreads + tid);
        }
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
      // Crowded: a radix sort of (cell, sample) keys (the same order), then
      // each cell's start by a binary search of the sorted cells.
#pragma unroll
      for (int k = 0; k < kLocalItems; ++k) kr[k] = (kr[k] & 0xffff0000u) | uint32_t(k * kLocalThreads + tid);
      LocalSort<kCap>(sm.u.sort).Sort(kr, 0, 16 + bits_for_cells(cells));
      __syncthreads();  // the sort's storage becomes ent and keys
#pragma unroll
      for (int k = 0; k < kLocalItems; ++k) {
        sm.u.s.ent[tid * kLocalItems + k] = static_cast<uint16_t>(kr[k]);
        sm.u.s.keys[tid * kLocalItems + k] = static_cast<uint16_t>(kr[k] >> 16);
      }
      __syncthreads();
      for (int c = tid; c <= cells; c += kLocalThreads) {
        int lo = 0, hi = kCap;  // first position whose key is >= c
        while (lo < hi) {
          const int mid = (lo + hi) / 2;
          if (int(sm.u.s.keys[mid]) < c) lo = mid + 1; else hi = mid;
        }
        sm.start[c] = static_cast<uint32_t>(lo);
      }
    }
    __syncthreads();
    if constexpr (kStage) {
      // The tile's samples' weights in sorted order, each entry's index
      // replaced by its query (the row it reads).
      const int total = int(sm.start[cells]);
      for (int j = tid; j < total; j += kLocalThreads) {
        const uint32_t i = sm.u.s.ent[j];
        if constexpr (kSelf) {
          float w;
          const auto b = resolve(i, w);
          store_record_weights<float>(reinterpret_cast<float*>(staged_w + j), b, w);
        } else {
          staged_w[j] = __ldg(wts + base + i);
        }
        sm.u.s.ent[j] = static_cast<uint16_t>(by_p(i));
      }
      __syncthreads();
    }

    // Pixels by columns: `lanes` threads (VEC channels each) a unit of one
    // pixel column and a segment of rows [ya, yb). Cell (a, c) of the tile has
    // corners 0..3 at pixels (a-1, c-1), (a-1, c), (a, c-1), (a, c), so pixel
    // (py, px) sums cells (py, px) (corner 3) and (py, px+1) (corner 2), then
    // cells (py+1, px) (corner 1) and (py+1, px+1) (corner 0), each cell's
    // samples in their sorted order. The two cells of a row are one run of
    // the sorted order (adjacent keys): walking down the column, each run is
    // read once for two pixels, the one above (corners 1 / 0, into `cur`) and
    // the one below (corners 3 / 2, into `nxt`, which becomes the next
    // pixel's start). The sums' order is that of a pixel walking its four
    // cells, so the bits do not depend on the segments. Addresses as a base
    // and 32-bit byte strides (a query's grad_output row, M D elements, and
    // a pixel's grad_value row, M D or D elements: checked < 4 GiB).
    using R = typename RawVec<sizeof(T) * VEC>::type;
    const unsigned row_bytes = static_cast<unsigned>(pb.M * pb.D * sizeof(T));
    const unsigned pixel_bytes = static_cast<unsigned>(value_pixel_rows(pb) * pb.D * sizeof(T));
    const char* gbase = reinterpret_cast<const char*>(gout + (n * pb.Lq * pb.M + m) * pb.D + ql * VEC);
    char* obase = reinterpret_cast<char*>(
        grad_value + value_row(pb, n, lv.start + int64_t(r0) * lv.W + c0, m) * pb.D + ql * VEC);
    // A sample's weights as pairs: (w0, w2) for the cell right of the
    // column, (w1, w3) for the cell at it: (above, below) pixel.
    const float2* wpair = reinterpret_cast<const float2*>(wts + base);
    const int nseg0 = max(1, min(th, groups / tw));  // segments a column, ~ one unit a group
    const int seg_h = (th + nseg0 - 1) / nseg0, units = ((th + seg_h - 1) / seg_h) * tw;
    for (int unit = grp; unit < units; unit += groups) {
      const int seg = unit / tw, px = unit - seg * tw;
      const int ya = seg * seg_h, yb = min(th, ya + seg_h);
      for (int64_t ch = ql * VEC; ch < pb.D; ch += int64_t(lanes) * VEC) {  // VEC divides D
        const int64_t cb = (ch - ql * VEC) * int64_t(sizeof(T));
        // The run of cells (a, px), (a, px + 1): the share of the pixel above
        // it into cur (when `above`), of the pixel below it into nxt.
        A cur[VEC], nxt[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) cur[e] = nxt[e] = A(0);
        auto walk_run = [&](const int a, const bool above) {
          const int k = a * (tw + 1) + px;
          const int lo = int(sm.start[k]), split = int(sm.start[k + 1]), hi = int(sm.start[k + 2]);
          // Entry j's weights for (above, below) and grad_output row.
          auto load = [&](const int j, float2& w, R& raw) {
            const uint32_t i = sm.u.s.ent[j];
            if constexpr (kStage) {
              w = reinterpret_cast<const float2*>(staged_w)[2 * j + (j < split ? 1 : 0)];
              raw = *reinterpret_cast<const R*>(staged_rows + i * staged_row_bytes +
                                                unsigned(ch) * unsigned(sizeof(T)));
            } else {
              w = __ldg(wpair + 2 * i + (j < split ? 1 : 0));
              raw = __ldg(reinterpret_cast<const R*>(gbase + uint64_t(by_p(i)) * row_bytes + cb));
            }
          };
          auto add = [&](const float2& w, const R& raw) {
            A go[VEC];
            unpack<T, VEC>(raw, go);
            if (above) {
#pragma unroll
              for (int e = 0; e < VEC; ++e) cur[e] += w.x * go[e];
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) nxt[e] += w.y * go[e];
          };
          // kLocalBatch entries' loads at once, then the rest one by one (no
          // padding: 0 times a row that holds an infinity would be NaN).
          int j0 = lo;
          for (; j0 + kLocalBatch <= hi; j0 += kLocalBatch) {
            float2 w[kLocalBatch];
            R raw[kLocalBatch];
#pragma unroll
            for (int u = 0; u < kLocalBatch; ++u) load(j0 + u, w[u], raw[u]);
#pragma unroll
            for (int u = 0; u < kLocalBatch; ++u) add(w[u], raw[u]);
          }
          for (; j0 < hi; ++j0) {
            float2 w;
            R raw;
            load(j0, w, raw);
            add(w, raw);
          }
        };
        walk_run(ya, false);
        for (int py = ya; py < yb; ++py) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            cur[e] = nxt[e];
            nxt[e] = A(0);
          }
          walk_run(py + 1, true);
          char* out = obase + uint64_t(static_cast<uint32_t>(py * lv.W + px)) * pixel_bytes;
          store_vec<T, VEC>(reinterpret_cast<T*>(out + cb), cur);
        }
      }
    }
    __syncthreads();  // start and ent are rewritten by the next item
  }
}

// What the launch needs (launch_16_byte_vectors reads pb and vec).
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
    // Instantiated only for what the planner's local_grad_value_ok admits
    // (launch_16_byte_vectors): 16-bit or fp32 values, 16-byte vectors,
    // locations in fp32 or the values' dtype (the fused operator's offsets
    // and logits under autocast; only local_footprints reads them).
    static_assert(VEC * sizeof(T) == 16 && !std::is_same_v<T, double>, "launch_16_byte_vectors only");
    {
      DeviceInfo d;
      if (const cudaError_t err = current_device_info(d); err != cudaSuccess) return err;
      uint32_t* cell = static_cast<uint32_t*>(g.bw.local_cell);
      float4* wts = static_cast<float4*>(g.bw.local_wts);
      // The fused operator's records: written by its tensor-core dots kernel
      // where it ran, else (ffma_dots_kernel) here.
      if (g.bw.ref != nullptr && g.bw.plan.dots == DotsKernel::ffma) {
        const int64_t items = sample_count(g.pb);
        const unsigned grid = static_cast<unsigned>(
            std::min<int64_t>((items + kThreads - 1) / kThreads, int64_t(d.sms) * kFootprintBlocksPerSm));
        local_footprints<LT><<<grid, kThreads, 0, stream>>>(g.bw);
      }
      if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
      // The staged walk only where the plan's local_stage_ok holds, which
      // implies the small cap; its records made in the block where the plan
      // says so (not the fused operator's: its locations are offsets).
      if (g.bw.plan.self_records) return tiles<kLocalCapSmall, true, LT>(g, d, nullptr, nullptr, stream);
      if (g.bw.plan.stage) return tiles<kLocalCapSmall, true>(g, d, cell, wts, stream);
      return small_cap(g.pb) ? tiles<kLocalCapSmall, false>(g, d, cell, wts, stream)
                             : tiles<kLocalCap, false>(g, d, cell, wts, stream);
    }
  }
  template <int kCap, bool kStage, typename SelfLT = void>
  static cudaError_t tiles(const LocalParams& g, const DeviceInfo& d, const uint32_t* cell,
                           const float4* wts, cudaStream_t stream) {
    const size_t bytes =
        kStage ? stage_offset<kCap>() + static_cast<size_t>(local_stage_bytes(
                                            g.pb.Lq, g.pb.P, g.pb.D, int64_t(sizeof(T))))
               : sizeof(LocalSmem<kCap>);
    auto kernel = grad_value_local_kernel<T, VEC, kCap, kStage, SelfLT>;
    if (const cudaError_t err = cudaFuncSetAttribute(
            kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
        err != cudaSuccess) {
      return err;
    }
    kernel<<<static_cast<unsigned>(d.sms) * kLocalBlocksPerSm, kLocalThreads, bytes, stream>>>(
        g.bw, static_cast<T*>(g.grad_value), lanes_for(g.pb.D, VEC), cell, wts, g.counter);
    return cudaGetLastError();
  }
};

int64_t records_offset(int64_t items) { return (4 * items + 15) / 16 * 16; }  // wts after the cells

}  // namespace

int64_t grad_value_local_scratch_bytes(const BackwardParams& p) {
  const int64_t items = sample_count(p.pb);
  return records_offset(items) + 16 * items;
}

void grad_value_local_records(BackwardParams& p, void* scratch) {
  char* rec = static_cast<char*>(scratch);
  p.local_cell = rec;
  p.local_wts = rec + records_offset(sample_count(p.pb));
}

cudaError_t grad_value_local(const BackwardParams& p, void* grad_value, unsigned* counter,
                             cudaStream_t stream) {
  if (p.plan.grad_value != GradValuePath::local || reinterpret_cast<uintptr_t>(grad_value) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p.local_wts) % 16 != 0 || counter == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (p.pb.N * p.pb.S * p.pb.M * p.pb.D == 0) return cudaSuccess;
  if (!p.plan.self_records && (p.local_cell == nullptr || p.local_wts == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const LocalParams g{p.pb, static_cast<int>(16 / dtype_bytes(p.pb.value_dtype)), p, grad_value, counter};
  return launch_16_byte_vectors<LocalLaunch>(g, stream);
}

}  // namespace msda::cuda
