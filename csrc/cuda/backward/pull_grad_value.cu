// The pull grad_value path: grad_value of an encoder (its queries are the
// pixels of its levels, Lq = S) without a global sort. The dots kernel leaves
// every sample's block-local record (grad_value_records.cuh: its cell on its
// level and its four corner weights). A block owns a tile of one (n, m,
// level), at most kPullTilePixels pixels (plan/pull_tiles.h: tile_shape), and
// reads the records of only the queries whose own cell on that level lies
// within kPullRadius cells of the tile: a rectangle of queries a query level,
// enumerated in sample order (its candidates). It keeps the home samples that
// touch the tile (pull::home), groups them by cell in shared memory (counting
// sort, each run put in sample order), and walks pixel columns as the
// block-local path does (local_grad_value.cu). Candidates beyond a block's
// sort (kPullCap: the coarse levels, where every finer query lands) come in
// chunks, one after the other in the same block, the tile's fp32 sums kept in
// shared memory between them; the last chunk writes grad_value once.
//
// A sample that is not home (an escape) is skipped by the windows: two passes
// over the records count and list the escapes by the tile of their cell's
// first pixel (pull::home_tile) and (n, m), a scan sizes the buckets, and a
// segmented sort puts each bucket in sample order. A tile takes its own
// bucket and those of the tiles left of, above and left above it (its
// escapes' cells may touch it) as further chunks, after its windows.
// Each pixel's sums thus run in a fixed order (chunks in order, runs in sample
// order): the same bits on every run, whatever the inputs; escapes only cost
// time. Scratch (grad_value_pull_scratch_bytes): per (n, m) and pixel a
// bucket's count and offset, the escape list twice (4 bytes a sample each,
// at most every sample), cub's temporary storage, a work counter.
#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>
#include <cub/device/device_segmented_sort.cuh>

#include "../../plan/pull_tiles.h"
#include "../device/grad_value_records.cuh"
#include "../device/launch.cuh"
#include "../entry_points.h"

namespace msda::cuda {
namespace {

constexpr int kMaxCells = 512;  // (th + 1) (tw + 1) with th tw <= 256, th, tw <= 64: 325 at most
constexpr int kScanItems = (kMaxCells + 1 + kPullThreads - 1) / kPullThreads;
constexpr int kPer = kPullCap / kPullThreads;  // candidates a thread holds a chunk
constexpr int kPullBatch = 2;                  // a run's entries loaded at once
constexpr int kSources = 5;                    // windows, then the four escape buckets
static_assert(kPullCap <= 65536, "16-bit sorted entries");
static_assert(kPullTilePixels <= 256, "kMaxCells");

// The level table and the tiles (shared memory, filled by load_tiles).
struct Tiles {
  Level levels[kMaxLevels];
  FastDiv by_row[kMaxLevels];  // W + 1 cells a row
  FastDiv by_w[kMaxLevels];    // a query level's pixels a row
  FastDiv by_2h[kMaxLevels], by_2w[kMaxLevels];  // 2 H and 2 W: own cells (own_fast)
  int th[kMaxLevels], tw[kMaxLevels], tiles_x[kMaxLevels];
  uint32_t tiles[kMaxLevels];       // a level's tiles
  uint32_t first_tile[kMaxLevels];  // tiles of the levels before it (index order): buckets
  int order[kMaxLevels];            // the levels, the smallest (densest items) first
  uint32_t first[kMaxLevels + 1];   // first item of the k-th level taken; first[L]: the total
};

// Fills t; false where the level table is poisoned. Every thread calls it.
__device__ bool load_tiles(const BackwardParams& p, Tiles& t) {
  const Problem& pb = p.pb;
  load_levels(t.levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  __syncthreads();
  if (t.levels[0].poison) return false;
  if (threadIdx.x == 0) {
    uint32_t first_tile = 0;
    for (int l = 0; l < pb.L; ++l) {
      const Level& lv = t.levels[l];
      const pull::TileShape s = pull::tile_shape(lv.H, lv.W);
      t.th[l] = s.th;
      t.tw[l] = s.tw;
      t.tiles_x[l] = (lv.W + s.tw - 1) / s.tw;
      t.tiles[l] = uint32_t(t.tiles_x[l]) * uint32_t((lv.H + s.th - 1) / s.th);
      t.first_tile[l] = first_tile;
      first_tile += t.tiles[l];
      t.by_row[l] = FastDiv(uint32_t(lv.W + 1));
      t.by_w[l] = FastDiv(uint32_t(lv.W));
      t.by_2h[l] = FastDiv(uint32_t(2 * lv.H));
      t.by_2w[l] = FastDiv(uint32_t(2 * lv.W));
    }
    for (int l = 0; l < pb.L; ++l) t.order[level_rank(t.levels, pb.L, l)] = l;
    uint32_t first = 0;
    for (int k = 0; k < pb.L; ++k) {
      t.first[k] = first;
      first += uint32_t(pb.N * pb.M) * t.tiles[t.order[k]];
    }
    t.first[pb.L] = first;
  }
  __syncthreads();
  return true;
}

// pull::own_row(y, Hl, Hq) by a multiply-high where the numerator
// (2 y + 1) Hl + Hq (own_row's, plus 2 Hq) stays below 2^31 (`fits`).
__device__ __forceinline__ int own_fast(int y, int Hl, int Hq, const FastDiv& by_2hq, bool fits) {
  return fits ? int(by_2hq(uint32_t(2 * y + 1) * uint32_t(Hl) + uint32_t(Hq))) - 1 : pull::own_row(y, Hl, Hq);
}
__device__ __forceinline__ bool own_fits(int Hl, int Hq) {
  return (2 * int64_t(Hq) + 1) * Hl + Hq < (int64_t(1) << 31);
}

// The level of query (pixel) q: the last level whose start is <= q.
__device__ __forceinline__ int query_level(const Tiles& t, int L, uint32_t q) {
  int k = 0;
  while (k + 1 < L && q >= uint32_t(t.levels[k + 1].start)) ++k;
  return k;
}

// Escapes: every sample whose cell is not home goes to the bucket of its
// home tile and (n, m). kScatter false: counts into `count`; true: lists
// each into list[offset[bucket] + a cursor] (cursors zeroed; the order
// within a bucket is the atomics', which the segmented sort undoes).
template <bool kScatter>
__global__ void __launch_bounds__(kThreads) pull_escapes_kernel(const BackwardParams p, unsigned* count,
                                                               const unsigned* offset, uint32_t* list) {
  __shared__ Tiles t;
  if (!load_tiles(p, t)) return;
  const Problem& pb = p.pb;
  const uint32_t LqP = uint32_t(pb.Lq * pb.P), NM = uint32_t(pb.N * pb.M), L = uint32_t(pb.L);
  const FastDiv by_lqp(LqP), by_p(uint32_t(pb.P)), by_l(L);
  const uint32_t total = NM * L * LqP;  // < 2^31: the plan
  const uint32_t* cells = static_cast<const uint32_t*>(p.local_cell);
  for (uint32_t o = blockIdx.x * blockDim.x + threadIdx.x; o < total; o += gridDim.x * blockDim.x) {
    const uint32_t cell = __ldg(cells + o);
    if (cell == kNoCell) continue;
    const uint32_t nml = by_lqp(o), i = o - nml * LqP, nm = by_l(nml), l = nml - nm * L;
    const uint32_t q = by_p(i);
    const int k = query_level(t, pb.L, q);
    const Level& lq = t.levels[k];
    const Level& lv = t.levels[l];
    const uint32_t rq = q - uint32_t(lq.start), yq = t.by_w[k](rq), xq = rq - yq * uint32_t(lq.W);
    const uint32_t h = t.by_row[l](cell), w = cell - h * uint32_t(lv.W + 1);
    const int cy = own_fast(int(yq), lv.H, lq.H, t.by_2h[k], own_fits(lv.H, lq.H));
    const int cx = own_fast(int(xq), lv.W, lq.W, t.by_2w[k], own_fits(lv.W, lq.W));
    if (pull::home(int(h), int(w), cy, cx)) {
      continue;
    }
    const int64_t tile = pull::home_tile(int(h), int(w), lv.H, lv.W, pull::TileShape{t.th[l], t.tw[l]});
    const uint32_t bucket = (t.first_tile[l] + uint32_t(tile)) * NM + nm;
    if constexpr (kScatter) {
      list[offset[bucket] + atomicAdd(count + bucket, 1u)] = i;
    } else {
      atomicAdd(count + bucket, 1u);
    }
  }
}

// The shared memory of the pull kernel.
struct PullSmem {
  Tiles t;
  union {
    cub::BlockScan<uint32_t, kPullThreads>::TempStorage scan;
    uint16_t ent[kPullCap];  // sorted position -> candidate of the chunk
  } u;
  uint32_t start[kScanItems * kPullThreads];  // a cell's count, then its first position
  float4 w[kPullCap];                          // a candidate's weights (those touching the tile)
  uint32_t idx[kPullCap];                      // a candidate's sample index (the runs' order)
  float acc[kPullTilePixels * kPullD];         // the tile's sums over the chunks before
  // The item's windows: on query level k, rows [ya, ya + rows) and columns
  // [xa, xa + rowlen / P), candidates [pre[k], pre[k + 1]) in sample order.
  int ya[kMaxLevels], xa[kMaxLevels];
  uint32_t rowlen[kMaxLevels], pre[kMaxLevels + 1];
  bool fits_h[kMaxLevels], fits_w[kMaxLevels];  // own_fast's multiply-high serves
  FastDiv by_rowlen[kMaxLevels];
  // The chunks' sources: [src_begin[s], src_end[s]) of the windows' candidates
  // (s = 0) or of the escape list (buckets: own, left, above, left above).
  uint32_t src_begin[kSources], src_end[kSources], src_chunk[kSources + 1];
  uint32_t item;
};
static_assert(sizeof(PullSmem) <= kPullSmem, "the planner's figure for the pull kernel's shared memory");

template <typename T, int VEC>
__global__ void __launch_bounds__(kPullThreads, kPullBlocksPerSm)
    pull_grad_value_kernel(const BackwardParams p, T* __restrict__ grad_value,
                           const unsigned* __restrict__ offset, const uint32_t* __restrict__ list,
                           unsigned* __restrict__ counter) {
  constexpr int kLanes = kPullD / VEC;
  static_assert(kLanes * VEC == kPullD && VEC * sizeof(T) == 16, "16 bytes a lane, one pass over D");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  PullSmem& sm = *reinterpret_cast<PullSmem*>(smem_raw);
  const Problem& pb = p.pb;
  if (!load_tiles(p, sm.t)) {
    zero_grad_value(pb, grad_value);
    return;
  }
  const Tiles& t = sm.t;
  const int tid = threadIdx.x, groups = kPullThreads / kLanes, grp = tid / kLanes, ql = tid % kLanes;
  const uint32_t LqP = uint32_t(pb.Lq * pb.P), NM = uint32_t(pb.N * pb.M);
  const FastDiv by_p(uint32_t(pb.P));
  const uint32_t* cells = static_cast<const uint32_t*>(p.local_cell);
  const float4* wts = static_cast<const float4*>(p.local_wts);
  const T* gout = static_cast<const T*>(p.grad_out);
  using R = typename RawVec<16>::type;
  const unsigned row_bytes = unsigned(pb.M * kPullD * sizeof(T));
  const unsigned pixel_bytes = unsigned(value_pixel_rows(pb) * kPullD * sizeof(T));

  for (;;) {
    if (tid == 0) sm.item = atomicAdd(counter, 1u);
    __syncthreads();
    const uint32_t item = sm.item;
    if (item >= t.first[pb.L]) break;
    int rank = 0;
    while (item >= t.first[rank + 1]) ++rank;
    const int l = t.order[rank];
    const Level lv = t.levels[l];
    const uint32_t r = item - t.first[rank], nm = r / t.tiles[l], tile = r - nm * t.tiles[l];
    const int ty = int(tile / uint32_t(t.tiles_x[l])), tx = int(tile - uint32_t(ty * t.tiles_x[l]));
    const int r0 = ty * t.th[l], c0 = tx * t.tw[l];
    const int th = min(t.th[l], lv.H - r0), tw = min(t.tw[l], lv.W - c0);
    const int cells_n = (th + 1) * (tw + 1);
    const int64_t n = nm / pb.M, m = nm - n * pb.M;
    const int64_t base = (int64_t(nm) * pb.L + l) * LqP;

    // The windows (a thread a query level) and the chunks' sources.
    if (tid < pb.L) {
      const int k = tid;
      const Level& lq = t.levels[k];
      int ya, yb, xa, xb;
      pull::window_rows(int64_t(r0) - 1 - kPullRadius, int64_t(r0) + th - 1 + kPullRadius, lv.H, lq.H, &ya, &yb);
      pull::window_rows(int64_t(c0) - 1 - kPullRadius, int64_t(c0) + tw - 1 + kPullRadius, lv.W, lq.W, &xa, &xb);
      sm.ya[k] = ya;
      sm.xa[k] = xa;
      sm.fits_h[k] = own_fits(lv.H, lq.H);
      sm.fits_w[k] = own_fits(lv.W, lq.W);
      sm.rowlen[k] = uint32_t(xb - xa) * uint32_t(pb.P);
      sm.by_rowlen[k] = FastDiv(max(1u, sm.rowlen[k]));
      sm.pre[k + 1] = uint32_t(yb - ya) * sm.rowlen[k];  // this level's count, summed below
    }
    __syncthreads();
    if (tid == 0) {
      sm.pre[0] = 0;
      for (int k = 0; k < pb.L; ++k) sm.pre[k + 1] += sm.pre[k];
      sm.src_begin[0] = 0;
      sm.src_end[0] = sm.pre[pb.L];
      const uint32_t tile0 = t.first_tile[l];
      for (int s = 1; s < kSources; ++s) {
        const int dy = (s - 1) >> 1, dx = (s - 1) & 1;  // own, left, above, left above
        sm.src_begin[s] = sm.src_end[s] = 0;
        if (ty - dy >= 0 && tx - dx >= 0) {
          const uint32_t b = (tile0 + uint32_t((ty - dy) * t.tiles_x[l] + tx - dx)) * NM + nm;
          sm.src_begin[s] = offset[b];
          sm.src_end[s] = offset[b + 1];
        }
      }
      uint32_t c = 0;
      for (int s = 0; s < kSources; ++s) {
        sm.src_chunk[s] = c;
        c += (sm.src_end[s] - sm.src_begin[s] + kPullCap - 1) / kPullCap;
      }
      sm.src_chunk[kSources] = max(c, 1u);  // at least one chunk: every tile is written
    }
    __syncthreads();
    const uint32_t chunks = sm.src_chunk[kSources];

    for (uint32_t chunk = 0; chunk < chunks; ++chunk) {
      int s = 0;
      while (s + 1 < kSources && chunk >= sm.src_chunk[s + 1]) ++s;
      const uint32_t cb = sm.src_begin[s] + (chunk - sm.src_chunk[s]) * kPullCap;
      const uint32_t ce = min(sm.src_end[s], cb + kPullCap);
      for (int c = tid; c < kScanItems * kPullThreads; c += kPullThreads) sm.start[c] = 0;
      __syncthreads();
      uint32_t kr[kPer];  // key << 16 | rank within the key's cell; key cells_n: none
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        const uint32_t slot = uint32_t(e * kPullThreads + tid), j = cb + slot;
        kr[e] = uint32_t(cells_n) << 16;
        if (j < ce) {
          uint32_t i;
          int cy = 0, cx = 0;
          if (s > 0) {
            i = __ldg(list + j);
          } else {
            int k = 0;
            while (j >= sm.pre[k + 1]) ++k;
            const uint32_t jj = j - sm.pre[k], y = sm.by_rowlen[k](jj);
            const uint32_t rem = jj - y * sm.rowlen[k], x = by_p(rem), pt = rem - x * uint32_t(pb.P);
            const Level& lq = t.levels[k];
            const int yq = sm.ya[k] + int(y), xq = sm.xa[k] + int(x);
            i = (uint32_t(lq.start) + uint32_t(yq) * uint32_t(lq.W) + uint32_t(xq)) * uint32_t(pb.P) + pt;
            cy = own_fast(yq, lv.H, lq.H, t.by_2h[k], sm.fits_h[k]);
            cx = own_fast(xq, lv.W, lq.W, t.by_2w[k], sm.fits_w[k]);
          }
          const uint32_t cell = __ldg(cells + base + i);
          if (cell != kNoCell) {
            const uint32_t h = t.by_row[l](cell), wc = cell - h * uint32_t(lv.W + 1);
            const int a = int(h) - r0, c = int(wc) - c0;
            // A window's sample that is not home is an escape: a bucket has it.
            if (a >= 0 && a <= th && c >= 0 && c <= tw && (s > 0 || pull::home(int(h), int(wc), cy, cx))) {
              const uint32_t key = uint32_t(a * (tw + 1) + c), rk = atomicAdd(&sm.start[key], 1u);
              kr[e] = key << 16 | rk;
              sm.w[slot] = __ldg(wts + base + i);
              sm.idx[slot] = i;
            }
          }
        }
      }
      __syncthreads();
      {
        uint32_t cnt[kScanItems];
#pragma unroll
        for (int k = 0; k < kScanItems; ++k) cnt[k] = sm.start[tid * kScanItems + k];
        cub::BlockScan<uint32_t, kPullThreads>(sm.u.scan).ExclusiveSum(cnt, cnt);
#pragma unroll
        for (int k = 0; k < kScanItems; ++k) sm.start[tid * kScanItems + k] = cnt[k];
      }
      __syncthreads();  // the scan's storage becomes ent
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        const uint32_t key = kr[e] >> 16;
        if (key < uint32_t(cells_n)) sm.u.ent[sm.start[key] + (kr[e] & 0xffffu)] = uint16_t(e * kPullThreads + tid);
      }
      __syncthreads();
      for (int c = tid; c < cells_n; c += kPullThreads) {  // each run in sample order
        const int lo = int(sm.start[c]), hi = int(sm.start[c + 1]);
        for (int j = lo + 1; j < hi; ++j) {
          const uint16_t v = sm.u.ent[j];
          const uint32_t vi = sm.idx[v];
          int q = j - 1;
          for (; q >= lo && sm.idx[sm.u.ent[q]] > vi; --q) sm.u.ent[q + 1] = sm.u.ent[q];
          sm.u.ent[q + 1] = v;
        }
      }
      __syncthreads();

      // Column walk (local_grad_value.cu): the run of cells (a, px), (a, px + 1)
      // gives the pixel above it (w1, w3 / w0, w2 pairs) and the one below.
      // Every chunk the same units, so a pixel's sums stay with one group.
      const int nseg0 = max(1, min(th, groups / tw));
      const int seg_h = (th + nseg0 - 1) / nseg0, units = ((th + seg_h - 1) / seg_h) * tw;
      const char* gbase = reinterpret_cast<const char*>(gout + (n * pb.Lq * pb.M + m) * kPullD + ql * VEC);
      char* obase = reinterpret_cast<char*>(
          grad_value + value_row(pb, n, lv.start + int64_t(r0) * lv.W + c0, m) * kPullD + ql * VEC);
      const bool first = chunk == 0, last = chunk + 1 == chunks;
      for (int unit = grp; unit < units; unit += groups) {
        const int seg = unit / tw, px = unit - seg * tw;
        const int ya = seg * seg_h, yb = min(th, ya + seg_h);
        float cur[VEC], nxt[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) cur[e] = nxt[e] = 0.f;
        auto walk_run = [&](const int a, const bool above) {
          const int k = a * (tw + 1) + px;
          const int lo = int(sm.start[k]), split = int(sm.start[k + 1]), hi = int(sm.start[k + 2]);
          auto load = [&](const int j, float2& w, R& raw) {
            const int e = sm.u.ent[j];
            const float4 w4 = sm.w[e];
            w = j < split ? make_float2(w4.z, w4.w) : make_float2(w4.x, w4.y);
            raw = __ldg(reinterpret_cast<const R*>(gbase + uint64_t(by_p(sm.idx[e])) * row_bytes));
          };
          auto add = [&](const float2& w, const R& raw) {
            float go[VEC];
            unpack<T, VEC>(raw, go);
            if (above) {
#pragma unroll
              for (int e = 0; e < VEC; ++e) cur[e] += w.x * go[e];
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) nxt[e] += w.y * go[e];
          };
          int j0 = lo;
          for (; j0 + kPullBatch <= hi; j0 += kPullBatch) {
            float2 w[kPullBatch];
            R raw[kPullBatch];
#pragma unroll
            for (int u = 0; u < kPullBatch; ++u) load(j0 + u, w[u], raw[u]);
#pragma unroll
            for (int u = 0; u < kPullBatch; ++u) add(w[u], raw[u]);
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
            nxt[e] = 0.f;
          }
          walk_run(py + 1, true);
          float* a = sm.acc + (py * tw + px) * kPullD + ql * VEC;
          if (!first) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) cur[e] = a[e] + cur[e];
          }
          if (last) {
            store_vec<T, VEC>(reinterpret_cast<T*>(obase + uint64_t(unsigned(py * lv.W + px)) * pixel_bytes), cur);
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) a[e] = cur[e];
          }
        }
      }
      __syncthreads();  // start, ent, w and idx are rewritten by the next chunk
    }
  }
}

struct PullParams {
  Problem pb;
  int vec;
  BackwardParams bw;
  void* grad_value;
  const unsigned* offset;
  const uint32_t* list;
  unsigned* counter;
};

template <typename T, typename LT, int VEC>
struct PullLaunch {
  static cudaError_t run(const PullParams& g, cudaStream_t stream) {
    static_assert(VEC * sizeof(T) == 16 && !std::is_same_v<T, double>, "launch_16_byte_vectors only");
    DeviceInfo d;
    if (const cudaError_t err = current_device_info(d); err != cudaSuccess) return err;
    auto kernel = pull_grad_value_kernel<T, VEC>;
    const int bytes = static_cast<int>(sizeof(PullSmem));
    if (const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
        err != cudaSuccess) {
      return err;
    }
    kernel<<<static_cast<unsigned>(d.sms) * kPullBlocksPerSm, kPullThreads, bytes, stream>>>(
        g.bw, static_cast<T*>(g.grad_value), g.offset, g.list, g.counter);
    return cudaGetLastError();
  }
};

// The scratch's parts, 256-byte aligned: counts (buckets + 1; then the
// scatter's cursors), offsets (buckets + 1), the list and the sorted list
// (a sample each at most), the counter, cub's temporary storage.
struct PullScratch {
  int64_t buckets = 0, samples = 0;
  size_t count = 0, offset = 0, list = 0, sorted = 0, counter = 0, temp = 0, temp_bytes = 0, total = 0;
};

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

cudaError_t pull_scratch(const BackwardParams& p, PullScratch& s) {
  const Problem& pb = p.pb;
  // Buckets: a tile and (n, m) each; a level has at most H W tiles, so
  // N M S bounds them without the level shapes on the host.
  s.buckets = pb.N * pb.M * pb.S;
  s.samples = sample_count(pb);
  size_t scan_bytes = 0, sort_bytes = 0;
  cudaError_t err = cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<unsigned*>(nullptr),
                                                  static_cast<unsigned*>(nullptr), int(s.buckets + 1));
  if (err != cudaSuccess) return err;
  err = cub::DeviceSegmentedSort::SortKeys(nullptr, sort_bytes, static_cast<const uint32_t*>(nullptr),
                                           static_cast<uint32_t*>(nullptr), int(s.samples), int(s.buckets),
                                           static_cast<const unsigned*>(nullptr),
                                           static_cast<const unsigned*>(nullptr) + 1);
  if (err != cudaSuccess) return err;
  size_t at = 0;
  s.count = at, at += align256(4 * size_t(s.buckets + 1));
  s.offset = at, at += align256(4 * size_t(s.buckets + 1));
  s.list = at, at += align256(4 * size_t(s.samples));
  s.sorted = at, at += align256(4 * size_t(s.samples));
  s.counter = at, at += 256;
  s.temp = at, s.temp_bytes = std::max(scan_bytes, sort_bytes), at += align256(s.temp_bytes);
  s.total = at;
  return cudaSuccess;
}

}  // namespace

int64_t grad_value_pull_scratch_bytes(const BackwardParams& p) {
  PullScratch s;
  return pull_scratch(p, s) == cudaSuccess ? int64_t(s.total) : -1;
}

cudaError_t grad_value_pull(const BackwardParams& p, void* grad_value, void* scratch, cudaStream_t stream) {
  const Problem& pb = p.pb;
  if (p.plan.grad_value != GradValuePath::pull || pb.D != kPullD || pb.Lq != pb.S ||
      reinterpret_cast<uintptr_t>(grad_value) % 16 != 0 || reinterpret_cast<uintptr_t>(scratch) % 256 != 0 ||
      p.local_cell == nullptr || p.local_wts == nullptr || reinterpret_cast<uintptr_t>(p.local_wts) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  if (pb.N * pb.S * pb.M == 0) return cudaSuccess;
  PullScratch s;
  cudaError_t err = pull_scratch(p, s);
  if (err != cudaSuccess) return err;
  char* base = static_cast<char*>(scratch);
  unsigned* count = reinterpret_cast<unsigned*>(base + s.count);
  unsigned* offset = reinterpret_cast<unsigned*>(base + s.offset);
  uint32_t* list = reinterpret_cast<uint32_t*>(base + s.list);
  uint32_t* sorted = reinterpret_cast<uint32_t*>(base + s.sorted);
  unsigned* counter = reinterpret_cast<unsigned*>(base + s.counter);
  void* temp = base + s.temp;
  DeviceInfo d;
  if ((err = current_device_info(d)) != cudaSuccess) return err;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(
      (s.samples + kThreads - 1) / kThreads, int64_t(d.sms) * (kMaxThreadsPerSm / kThreads)));
  if ((err = cudaMemsetAsync(count, 0, 4 * size_t(s.buckets + 1), stream)) != cudaSuccess) return err;
  if ((err = cudaMemsetAsync(counter, 0, 4, stream)) != cudaSuccess) return err;
  pull_escapes_kernel<false><<<grid, kThreads, 0, stream>>>(p, count, nullptr, nullptr);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  size_t bytes = s.temp_bytes;
  if ((err = cub::DeviceScan::ExclusiveSum(temp, bytes, count, offset, int(s.buckets + 1), stream)) !=
      cudaSuccess) {
    return err;
  }
  if ((err = cudaMemsetAsync(count, 0, 4 * size_t(s.buckets + 1), stream)) != cudaSuccess) return err;
  pull_escapes_kernel<true><<<grid, kThreads, 0, stream>>>(p, count, offset, list);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  bytes = s.temp_bytes;
  if ((err = cub::DeviceSegmentedSort::SortKeys(temp, bytes, list, sorted, int(s.samples), int(s.buckets),
                                                offset, offset + 1, stream)) != cudaSuccess) {
    return err;
  }
  const PullParams g{pb, static_cast<int>(16 / dtype_bytes(pb.value_dtype)), p, grad_value, offset, sorted, counter};
  return launch_16_byte_vectors<PullLaunch>(g, stream);
}

}  // namespace msda::cuda
