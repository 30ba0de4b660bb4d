// The backward without global atomics: every output is written once, by its
// owner, so the result is bitwise the same on every run.
//
//   1. tile_keys_kernel: per sample, the key of the bilinear cell its
//      footprint lies in (cell_key(), common.cuh) and its index; samples
//      that add nothing (footprint off the map, or poisoned) get the key past
//      every cell and their location / weight gradients (0, or NaN) here.
//   2. A stable radix sort of (key, index) (cub, only the key bits in use):
//      the samples of one cell end up together, in sample order.
//   3. cell_bounds_kernel: start[c] = first sorted position with key >= c.
//   4. tile_grad_kernel: one block a tile of kTile x kTile pixels of one
//      (n, m, level), tiles taken from a counter (the crowded small levels
//      first). A tile needs the samples of the (kTile + 1)^2 cells around it
//      (nine runs of the sorted order). The block stages them in shared
//      memory in chunks (index, weights, their grad_output slice), then
//      every pixel of the window (the tile and the ring above and left of
//      it) is served by kGroup lanes that walk the samples of its four
//      cells: the tile's pixels add weight x grad_output into registers
//      (grad_value, written once in the value's dtype, no accumulator map,
//      no fill, no conversion); for the samples whose cell the tile owns, the
//      pixel also forms the dot product of grad_output with its own value
//      row (the corner's d_k). Each sample's four d_k then give its location
//      and weight gradients, written once.
// Channels: a block serves kGroup * VEC channels (a "slice"); when D needs
// more, blockIdx.y is the slice, partial d_k go to a scratch array and
// tile_dots_kernel adds them up in slice order.
#include <cub/device/device_radix_sort.cuh>

#include "common.cuh"
#include "launch.h"

namespace msda::cuda {
namespace {

constexpr int kTile = 8;                  // tile side, pixels
constexpr int kWin = kTile + 1;           // window side: the tile and the ring above / left
constexpr int kGroup = 4;                 // lanes a pixel
constexpr int kCells = kWin * kWin;       // cells a window needs
constexpr int kCellsPerLane = (kCells + 1 + 31) / 32;  // the chunk scan: cells and the end
constexpr int kUnroll = 4;                // stage entries a thread loads at once
constexpr int kTileThreads = ((kWin * kWin * kGroup + 31) / 32) * 32;

// Cells of one (n, m): the sum over levels of (H + 1) (W + 1) (cell_key()
// numbers cells (h0, w0), h0 in [-1, H), w0 in [-1, W)). Keys use this tight
// stride, so that the sorted keys leave no gaps between (n, m) and the key of
// the samples that add nothing is N M times it.
__device__ __forceinline__ int64_t cells_per_nm(const Level* levels, int L) {
  int64_t c = 0;
  for (int l = 0; l < L; ++l) c += (int64_t(levels[l].H) + 1) * (levels[l].W + 1);
  return c;
}

// Location and weight gradients of a sample from its four corner dots
// d[k] = grad_output row . value[corner k] (0 for a corner off the map).
template <typename A, typename LT>
__device__ __forceinline__ void write_sample_grads(const BackwardParams& p, int64_t sample,
                                                   const Bilinear<A>& b, A w, const Level& lv,
                                                   const A (&d)[4]) {
  A g0 = A(0), g1 = A(0), g2 = A(0);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    g0 += b.weight(k) * d[k];
    g1 += b.dweight_dlw(k) * d[k];
    g2 += b.dweight_dlh(k) * d[k];
  }
  static_cast<LT*>(p.grad_attn)[sample] = from_acc<LT>(acc_t<LT>(g0));
  LT* gloc = static_cast<LT*>(p.grad_loc) + sample * 2;
  gloc[0] = from_acc<LT>(acc_t<LT>(w * g1 * A(lv.W)));
  gloc[1] = from_acc<LT>(acc_t<LT>(w * g2 * A(lv.H)));
}

// A sample's level, weight and footprint, from its flat index.
template <typename A>
struct Resolved {
  int l;
  A w;
  Bilinear<A> b;
};

// The (n, q, m) group and the level of a sample, in Id arithmetic (32-bit
// divisions unless the problem needs 64-bit indices).
template <typename Id>
__device__ __forceinline__ void split_sample(const Problem& pb, int64_t sample, int64_t& group,
                                             int& level) {
  const Id LP = Id(pb.L) * Id(pb.P);
  const Id g = Id(sample) / LP;
  group = int64_t(g);
  level = static_cast<int>((Id(sample) - g * LP) / Id(pb.P));
}

template <typename A, typename LT>
__device__ __forceinline__ Resolved<A> resolve(const BackwardParams& p, const Level& lv, int l,
                                               int64_t sample) {
  A xy[2];
  load_xy(static_cast<const LT*>(p.loc) + 2 * sample, xy);
  const A w = lv.weight(A(to_acc(static_cast<const LT*>(p.attn)[sample])));
  return {l, w, make_bilinear<A>(xy[0], xy[1], w, lv.H, lv.W)};
}

template <typename A, typename LT, typename Id>
__global__ void __launch_bounds__(kThreads)
    tile_keys_kernel(const BackwardParams p, int64_t items, Id* __restrict__ keys,
                     Id* __restrict__ ids) {
  __shared__ Level levels[kMaxLevels];
  __shared__ int64_t cell_base[kMaxLevels];
  load_levels_and_cells(levels, cell_base, p.spatial_shapes, p.level_start, p.pb.L, p.pb.S, true);
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= items) return;
  int64_t group;
  int l;
  split_sample<Id>(p.pb, i, group, l);
  const Resolved<A> r = resolve<A, LT>(p, levels[l], l, i);
  const bool adds = r.b.inside && !r.b.poisoned();
  const int64_t stride = cells_per_nm(levels, p.pb.L);
  uint64_t key = uint64_t(p.pb.N * p.pb.M * stride);
  if (adds) {
    const int64_t nm = group / (p.pb.Lq * p.pb.M) * p.pb.M + group % p.pb.M;
    key = cell_key(nm, stride, cell_base[r.l], r.b.h0, r.b.w0, levels[r.l].W);
  } else {
    // Off the map: zero gradients; poisoned: NaN (its weights are NaN).
    const A d[4] = {A(0), A(0), A(0), A(0)};
    write_sample_grads<A, LT>(p, i, r.b, r.w, levels[r.l], d);
  }
  keys[i] = Id(key);
  ids[i] = Id(i);
}

// start[c] = first position of `sorted` (items keys) whose key is >= c, for
// c in [0, end], end = N M cells_per_nm (the key of the samples that add
// nothing, the largest): position j sets the cells in (key[j - 1], key[j]],
// so every cell is written once.
template <typename Id>
__global__ void __launch_bounds__(kThreads)
    cell_bounds_kernel(const BackwardParams p, const Id* __restrict__ sorted, int64_t items,
                       Id* __restrict__ start) {
  __shared__ Level levels[kMaxLevels];
  load_levels(levels, p.spatial_shapes, p.level_start, p.pb.L, p.pb.S);
  __syncthreads();
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j > items) return;
  const int64_t end = p.pb.N * p.pb.M * cells_per_nm(levels, p.pb.L);
  const int64_t prev = j == 0 ? -1 : int64_t(sorted[j - 1]);
  const int64_t cur = j == items ? end : int64_t(sorted[j]);
  for (int64_t c = prev + 1; c <= cur; ++c) start[c] = Id(j);
}

// What the tile kernel needs besides the backward's params.
template <typename Id>
struct TileArgs {
  const Id* sorted_ids;
  const Id* cell_start;
  void* grad_value;       // (N, S, M, D), value dtype, written completely
  void* dots;             // (slices, items, 4) accumulators when slices > 1
  unsigned* counter;      // zeroed: next tile to take
  int64_t items;
  int cap;                // samples a chunk
  int slices;             // channel slices of kGroup * VEC
};

// Per staged sample, in shared memory (struct of arrays, `cap` entries each;
// the 16-byte-aligned arrays first).
template <typename T, int VEC>
struct Stage {
  using A = acc_t<T>;
  static constexpr int kSlice = kGroup * VEC;  // channels a block serves
  T* go;     // grad_output slice
  A* dotp;   // [sample][corner][lane] partial dots
  A* wts;    // 4 corner weights (attention x bilinear)
  int64_t* id;
  A* meta;   // w, lh, lw
  int* owned;
  unsigned char* cell;  // its window cell
  static constexpr int64_t bytes_per_sample() {
    return kSlice * sizeof(T) + 4 * kGroup * sizeof(A) + 4 * sizeof(A) + sizeof(int64_t) +
           3 * sizeof(A) + sizeof(int) + 1;
  }
  __device__ Stage(unsigned char* mem, int cap) {
    go = reinterpret_cast<T*>(mem);
    dotp = reinterpret_cast<A*>(go + kSlice * cap);
    wts = dotp + 4 * kGroup * cap;
    id = reinterpret_cast<int64_t*>(wts + 4 * cap);
    meta = reinterpret_cast<A*>(id + cap);
    owned = reinterpret_cast<int*>(meta + 3 * cap);
    cell = reinterpret_cast<unsigned char*>(owned + cap);
  }
};

// VEC elements of T from shared memory (16-byte pieces).
template <typename T, int VEC>
__device__ __forceinline__ void load_shared(const T* src, acc_t<T> (&out)[VEC]) {
  constexpr int C = (16 / sizeof(T)) < VEC ? (16 / sizeof(T)) : VEC;
#pragma unroll
  for (int i = 0; i < VEC; i += C) {
    acc_t<T> part[C];
    load_vec_shared<T, C>(src + i, part);
#pragma unroll
    for (int e = 0; e < C; ++e) out[i + e] = part[e];
  }
}

// VEC raw elements global -> shared (16-byte pieces).
template <typename T, int VEC>
__device__ __forceinline__ void copy_to_shared(T* dst, const T* __restrict__ src) {
  constexpr int C = (16 / sizeof(T)) < VEC ? (16 / sizeof(T)) : VEC;
#pragma unroll
  for (int i = 0; i < VEC; i += C) copy_vec<T, C>(dst + i, src + i);
}

template <typename T, typename LT, int VEC, typename Id>
__global__ void __launch_bounds__(kTileThreads)
    tile_grad_kernel(const BackwardParams p, const TileArgs<Id> t) {
  using A = acc_t<T>;
  using St = Stage<T, VEC>;
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  __shared__ int64_t cell_base[kMaxLevels];
  __shared__ int64_t gpos[kWin][kWin + 1];  // sorted position of each window cell's first sample
  __shared__ int64_t cfirst[kCells];         // the chunk's first sample of each cell
  __shared__ int coff[kCells + 1];           // where each cell's samples sit in the stage
  __shared__ int64_t total_s;
  __shared__ unsigned tile_id;
  extern __shared__ __align__(16) unsigned char stage_mem[];
  load_levels_and_cells(levels, cell_base, p.spatial_shapes, p.level_start, pb.L, pb.S, true);
  St st(stage_mem, t.cap);

  const int tid = threadIdx.x;
  const int grp = tid / kGroup, lane = tid % kGroup;
  const int py = grp / kWin, px = grp % kWin;  // this group's pixel in the window
  const int64_t NM = pb.N * pb.M;
  const int64_t LP = int64_t(pb.L) * pb.P;
  const int c_base = blockIdx.y * St::kSlice;
  const int c = c_base + lane * VEC;  // this lane's channels [c, c + VEC)
  const bool c_ok = c < pb.D;         // VEC > 1 only when VEC divides D

  const int64_t stride = cells_per_nm(levels, pb.L);
  if (levels[0].poison) {
    // The level table on the device is inconsistent (load_levels): nothing
    // adds to grad_value, which is zero.
    if (blockIdx.y == 0) {
      T* gv = static_cast<T*>(t.grad_value);
      const int64_t total = pb.N * pb.S * pb.M * pb.D;
      for (int64_t i = int64_t(blockIdx.x) * blockDim.x + tid; i < total;
           i += int64_t(gridDim.x) * blockDim.x) {
        gv[i] = from_acc<T>(A(0));
      }
    }
    return;
  }
  int64_t total_tiles = 0;
  for (int l = 0; l < pb.L; ++l) {
    total_tiles += NM * (levels[l].H / kTile + 1) * (levels[l].W / kTile + 1);
  }
  for (;;) {
    if (tid == 0) tile_id = atomicAdd(t.counter + blockIdx.y, 1u);
    __syncthreads();
    int64_t b = tile_id;
    __syncthreads();  // tile_id is rewritten by the next round
    if (b >= total_tiles) return;
    // Smallest level first: its tiles hold the most samples.
    int l = pb.L - 1;
    for (;; --l) {
      const int64_t cnt = NM * (levels[l].H / kTile + 1) * (levels[l].W / kTile + 1);
      if (b < cnt || l == 0) break;
      b -= cnt;
    }
    const Level lv = levels[l];
    const int TX = lv.W / kTile + 1, TY = lv.H / kTile + 1;
    const int64_t nm = b / (int64_t(TY) * TX);
    const int ty = static_cast<int>(b / TX % TY), tx = static_cast<int>(b % TX);
    const int64_t n = nm / pb.M, m = nm % pb.M;
    const int y0 = ty * kTile - 1, x0 = tx * kTile - 1;  // window origin (pixels and cells)

    // Where each window cell's samples start in the sorted order. Cells past
    // the level's right edge are clamped to the edge (empty); rows below it
    // are empty.
    for (int i = tid; i < kWin * (kWin + 1); i += blockDim.x) {
      const int cy = i / (kWin + 1), cx = i % (kWin + 1);
      const int h0 = y0 + cy, w0 = min(x0 + cx, lv.W);
      gpos[cy][cx] = h0 <= lv.H - 1
                         ? int64_t(t.cell_start[cell_key(nm, stride, cell_base[l], h0, w0, lv.W)])
                         : 0;
    }
    __syncthreads();
    // Chunks: chunk i of K takes, from every cell's run of n samples,
    // [n i / K, n (i + 1) / K), so that every pixel has work in every chunk
    // (crowded cells are split, not walked by their four pixels alone). A
    // chunk then holds at most total / K + kCells samples.
    if (tid == 0) {
      int64_t tot = 0;
      for (int cy = 0; cy < kWin; ++cy) tot += gpos[cy][kWin] - gpos[cy][0];
      total_s = tot;
    }
    __syncthreads();
    const int64_t total = total_s;
    const int64_t chunks = total == 0 ? 0 : total <= t.cap ? 1 : (total + t.cap - kCells - 1) / (t.cap - kCells);

    const int yy = y0 + py, xx = x0 + px;
    const bool pix_ok = grp < kWin * kWin && yy >= 0 && xx >= 0 && yy < lv.H && xx < lv.W;
    const bool in_tile = pix_ok && py >= 1 && px >= 1;
    const int64_t vrow = pix_ok ? value_row(n, lv.start + int64_t(yy) * lv.W + xx, m, pb.S, pb.M) : 0;
    A val[VEC], acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) val[e] = acc[e] = A(0);
    if (pix_ok && c_ok) load_vec<T, VEC>(static_cast<const T*>(p.value) + vrow * pb.D + c, val);

    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      // Each cell's part of the chunk: its first sorted position and where it
      // goes in the stage (coff, an exclusive scan over the cells by warp 0,
      // kCellsPerLane cells a lane).
      if (tid < 32) {
        int len[kCellsPerLane];
        int sum = 0;
#pragma unroll
        for (int u = 0; u < kCellsPerLane; ++u) {
          const int cell = tid * kCellsPerLane + u;
          len[u] = 0;
          if (cell < kCells) {
            const int cy = cell / kWin, cx = cell % kWin;
            const int64_t n_c = gpos[cy][cx + 1] - gpos[cy][cx];
            const int64_t lo = n_c * chunk / chunks, hi = n_c * (chunk + 1) / chunks;
            cfirst[cell] = gpos[cy][cx] + lo;
            len[u] = static_cast<int>(hi - lo);
          }
          sum += len[u];
        }
        int incl = sum;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, incl, o);
          if (tid >= o) incl += v;
        }
        int off = incl - sum;
#pragma unroll
        for (int u = 0; u < kCellsPerLane; ++u) {
          const int cell = tid * kCellsPerLane + u;
          if (cell <= kCells) coff[cell] = off;
          for (int i = 0; i < len[u]; ++i) st.cell[off + i] = static_cast<unsigned char>(cell);
          off += len[u];
        }
      }
      __syncthreads();
      const int cnt = coff[kCells];
      // Stage the chunk's samples, kGroup threads a sample (thread q copies
      // channel part q of its grad_output slice and zeroes its partial dots;
      // thread 0 of the sample resolves it), kUnroll samples a thread at once
      // so that their global loads are in flight together.
      for (int base = 0; base < cnt * kGroup; base += kUnroll * blockDim.x) {
        int64_t sample[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int i = base + u * blockDim.x + tid;
          sample[u] = -1;
          if (i < cnt * kGroup) {
            const int j = i / kGroup, cell = st.cell[j];
            sample[u] = int64_t(t.sorted_ids[cfirst[cell] + (j - coff[cell])]);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (sample[u] < 0) continue;
          const int i = base + u * blockDim.x + tid;
          const int j = i / kGroup, q = i % kGroup;
          const int ch = c_base + q * VEC;
          T* dst = st.go + int64_t(j) * St::kSlice + q * VEC;
          if (ch < pb.D) {
            const T* src = static_cast<const T*>(p.grad_out) + int64_t(Id(sample[u]) / Id(LP)) * pb.D + ch;
            if constexpr (VEC > 1) {
              copy_to_shared<T, VEC>(dst, src);
            } else {
              dst[0] = src[0];
            }
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) dst[e] = from_acc<T>(A(0));
          }
#pragma unroll
          for (int k = 0; k < 4; ++k) st.dotp[(4 * j + k) * kGroup + q] = A(0);
          if (q == 0) {
            const Resolved<A> r = resolve<A, LT>(p, lv, l, sample[u]);
            st.id[j] = sample[u];
            st.meta[3 * j] = r.w;
            st.meta[3 * j + 1] = r.b.lh;
            st.meta[3 * j + 2] = r.b.lw;
#pragma unroll
            for (int k = 0; k < 4; ++k) st.wts[4 * j + k] = r.w * r.b.weight(k);
            const int cell = st.cell[j];
            st.owned[j] = cell / kWin < kTile && cell % kWin < kTile;
          }
        }
      }
      __syncthreads();

      // Walk: this pixel is corner k of window cell (py - (k >> 1), px - (k & 1)).
      if (pix_ok) {
#pragma unroll 1
        for (int k = 0; k < 4; ++k) {
          const int cy = py - (k >> 1), cx = px - (k & 1);
          if (cy < 0 || cx < 0) continue;
          const bool owned = cy < kTile && cx < kTile;
          if (!owned && !in_tile) continue;
          const int cell = cy * kWin + cx;
          const int hi = coff[cell + 1];
#pragma unroll 2
          for (int j = coff[cell]; j < hi; ++j) {
            A go[VEC];
            load_shared<T, VEC>(st.go + j * St::kSlice + lane * VEC, go);
            if (in_tile) {
              const A w = st.wts[4 * j + k];
#pragma unroll
              for (int e = 0; e < VEC; ++e) acc[e] += w * go[e];
            }
            if (owned) {
              A d = A(0);
#pragma unroll
              for (int e = 0; e < VEC; ++e) d += go[e] * val[e];
              st.dotp[(4 * j + k) * kGroup + lane] = d;
            }
          }
        }
      }
      __syncthreads();

      // The owned samples' gradients (or partial dots, when D is sliced).
      for (int j = tid; j < cnt; j += blockDim.x) {
        if (!st.owned[j]) continue;
        A d[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          d[k] = A(0);
#pragma unroll
          for (int q = 0; q < kGroup; ++q) d[k] += st.dotp[(4 * j + k) * kGroup + q];
        }
        const int64_t sample = st.id[j];
        if (t.slices == 1) {
          Bilinear<A> bl;
          bl.lh = st.meta[3 * j + 1];
          bl.lw = st.meta[3 * j + 2];
          write_sample_grads<A, LT>(p, sample, bl, st.meta[3 * j], lv, d);
        } else {
          A* out = static_cast<A*>(t.dots) + (int64_t(blockIdx.y) * t.items + sample) * 4;
#pragma unroll
          for (int k = 0; k < 4; ++k) out[k] = d[k];
        }
      }
      __syncthreads();  // the stage is refilled by the next chunk
    }
    if (in_tile && c_ok) {
      T* out = static_cast<T*>(t.grad_value) + vrow * pb.D + c;
      if constexpr (VEC > 1) {
        if constexpr (sizeof(T) * VEC > 16) {
          constexpr int C = 16 / sizeof(T);
#pragma unroll
          for (int i = 0; i < VEC; i += C) {
            acc_t<T> part[C];
#pragma unroll
            for (int e = 0; e < C; ++e) part[e] = acc[i + e];
            store_vec<T, C>(out + i, part);
          }
        } else {
          store_vec<T, VEC>(out, acc);
        }
      } else {
        out[0] = from_acc<T>(acc[0]);
      }
    }
  }
}

// D in several slices: each inside sample's dots summed over the slices in
// order, then its gradients.
template <typename A, typename LT>
__global__ void __launch_bounds__(kThreads)
    tile_dots_kernel(const BackwardParams p, int64_t items, int slices, const A* __restrict__ dots) {
  __shared__ Level levels[kMaxLevels];
  load_levels(levels, p.spatial_shapes, p.level_start, p.pb.L, p.pb.S);
  __syncthreads();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= items) return;
  int64_t group;
  int l;
  split_sample<uint64_t>(p.pb, i, group, l);
  const Resolved<A> r = resolve<A, LT>(p, levels[l], l, i);
  if (!r.b.inside || r.b.poisoned()) return;  // tile_keys_kernel wrote those
  A d[4] = {A(0), A(0), A(0), A(0)};
  for (int s = 0; s < slices; ++s) {
#pragma unroll
    for (int k = 0; k < 4; ++k) d[k] += dots[(int64_t(s) * items + i) * 4 + k];
  }
  write_sample_grads<A, LT>(p, i, r.b, r.w, levels[r.l], d);
}

// Every (value dtype, location dtype) pair, VEC = 32 bytes of the accumulator
// (8 channels; 4 for fp64) or 1.
template <typename T, typename LT, int VEC>
struct TileLaunch {
  template <typename Id>
  static cudaError_t go(const TiledBackward& tb, cudaStream_t stream) {
    using A = acc_t<T>;
    const BackwardParams& p = tb.p;
    const int64_t items = tb.items;
    auto* keys = static_cast<Id*>(tb.keys);
    auto* ids = static_cast<Id*>(tb.ids);
    auto* skeys = static_cast<Id*>(tb.sorted_keys);
    auto* sids = static_cast<Id*>(tb.sorted_ids);
    auto* start = static_cast<Id*>(tb.cell_start);
    tile_keys_kernel<A, LT, Id><<<grid_for(items), kThreads, 0, stream>>>(p, items, keys, ids);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    size_t bytes = tb.temp_bytes;
    err = cub::DeviceRadixSort::SortPairs(tb.temp, bytes, keys, skeys, ids, sids, items, 0,
                                          tb.end_bit, stream);
    if (err != cudaSuccess) return err;
    cell_bounds_kernel<Id><<<grid_for(items + 1), kThreads, 0, stream>>>(p, skeys, items, start);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    TileArgs<Id> t{sids, start, tb.grad_value, tb.dots, tb.counter, items, tb.cap, tb.slices};
    const size_t smem = size_t(tb.cap) * Stage<T, VEC>::bytes_per_sample();
    auto kernel = tile_grad_kernel<T, LT, VEC, Id>;
    cudaFuncAttributes attr;
    if ((err = cudaFuncGetAttributes(&attr, kernel)) != cudaSuccess) return err;
    if (smem + attr.sharedSizeBytes > 48 * 1024) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
      if (err != cudaSuccess) return err;
    }
    kernel<<<dim3(tb.blocks, tb.slices), kTileThreads, smem, stream>>>(p, t);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    if (tb.slices > 1) {
      tile_dots_kernel<A, LT><<<grid_for(items), kThreads, 0, stream>>>(
          p, items, tb.slices, static_cast<const A*>(tb.dots));
      err = cudaGetLastError();
    }
    return err;
  }
  static cudaError_t run(const TiledBackward& tb, cudaStream_t stream) {
    return tb.wide ? go<uint64_t>(tb, stream) : go<unsigned>(tb, stream);
  }
};

}  // namespace

int tiled_slice_channels(int vec) { return kGroup * vec; }

int64_t tiled_stage_bytes_per_sample(DType t, int vec) {
  int64_t bytes = 0;
  auto size = [&](auto tag) {
    using T = typename decltype(tag)::type;
    bytes = vec > 1 ? Stage<T, (sizeof(T) == 8 ? 4 : 8)>::bytes_per_sample()
                    : Stage<T, 1>::bytes_per_sample();
  };
  switch (t) {
    case DType::f32: size(Tag<float>{}); break;
    case DType::f64: size(Tag<double>{}); break;
    case DType::f16: size(Tag<__half>{}); break;
    case DType::bf16: size(Tag<__nv_bfloat16>{}); break;
  }
  return bytes;
}

int tiled_window_cells() { return kCells; }

cudaError_t tiled_sort_temp_bytes(const TiledBackward& tb, size_t& bytes) {
  bytes = 0;
  if (tb.wide) {
    return cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint64_t*>(nullptr),
                                           static_cast<uint64_t*>(nullptr),
                                           static_cast<const uint64_t*>(nullptr),
                                           static_cast<uint64_t*>(nullptr), tb.items, 0, tb.end_bit);
  }
  return cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const unsigned*>(nullptr),
                                         static_cast<unsigned*>(nullptr),
                                         static_cast<const unsigned*>(nullptr),
                                         static_cast<unsigned*>(nullptr), tb.items, 0, tb.end_bit);
}

cudaError_t tiled_backward(const TiledBackward& tb, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  dispatch_dtypes<__half, __nv_bfloat16>(tb.p.pb, [&](auto t, auto lt) {
    using T = typename decltype(t)::type;
    using LT = typename decltype(lt)::type;
    constexpr int kVec = sizeof(T) == 8 ? 4 : 8;
    err = tb.p.vec == kVec ? TileLaunch<T, LT, kVec>::run(tb, stream)
                           : TileLaunch<T, LT, 1>::run(tb, stream);
  });
  return err;
}

}  // namespace msda::cuda
