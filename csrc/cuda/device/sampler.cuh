// The sampler shared by every CUDA kernel, forward and backward: resolve a
// location on one level, fetch the four corners' VEC channels through the
// backend's `fetch` (global memory, shared memory, ...), accumulate.
#pragma once

#include <algorithm>

#include "common.cuh"
#include "fused_samples.cuh"
#include "launch.cuh"

namespace msda::cuda {

// One sample resolved for the gather: the row-major pixel indices of its four
// corners (clamped into the map, so always loadable) and their weights
// (bilinear weight x attention weight; 0 for a corner outside the map; NaN
// for a poisoned sample, sampling.h). pix[0] == kNoSample marks a sample that
// reads nothing (its footprint misses the map).
template <typename A>
struct Corners {
  int pix[4];
  A w[4];
};

// Shared-memory slots through which the lanes of a group hand each other
// resolved samples: kSlotsPerWarp slots a warp, pixel indices and weights
// in separate arrays. Where slot j of group g sits: see GroupLanes::slot (no
// bank conflicts on the writes nor on the reads).
template <typename A>
struct __align__(4 * sizeof(A)) Weights4 {
  A v[4];
};
template <typename A>
struct CornerSlots {
  int4* pix;
  Weights4<A>* w;
  static constexpr int64_t kBytesPerThread =
      kSlotsPerWarp * (sizeof(int4) + sizeof(Weights4<A>)) / 32;
  // The planner's figure (plan/launch_shapes.h), which sizes the caching
  // backends' shared memory.
  static_assert(kBytesPerThread == corner_slot_bytes_per_thread(sizeof(A)));
  // Carves the slots of `threads` threads (a multiple of 32) out of `mem`
  // (16-byte aligned, kBytesPerThread * threads bytes).
  __device__ __forceinline__ CornerSlots(void* mem, int threads)
      : pix(static_cast<int4*>(mem)),
        w(reinterpret_cast<Weights4<A>*>(pix + threads / 32 * kSlotsPerWarp)) {}
  __device__ __forceinline__ void put(int i, const Corners<A>& c) {
    pix[i] = make_int4(c.pix[0], c.pix[1], c.pix[2], c.pix[3]);
    w[i] = Weights4<A>{{c.w[0], c.w[1], c.w[2], c.w[3]}};
  }
  __device__ __forceinline__ Corners<A> get(int i) const {
    const int4 p = pix[i];
    const Weights4<A> q = w[i];
    return Corners<A>{{p.x, p.y, p.z, p.w}, {q.v[0], q.v[1], q.v[2], q.v[3]}};
  }
};

// Marks a sample that reads nothing in Corners::pix[0].
constexpr int kNoSample = -1;

// The corners of footprint b with weight w, b inside the map (see Corners;
// the backward keeps b for its location gradients). Requires H, W >= 1
// (load_levels() guarantees it). index(row, col) gives the number a backend's fetch wants for a
// corner (row, col) inside the map: by default the row-major pixel index; it
// must never be kNoSample.
template <typename A, typename Index>
__device__ __forceinline__ Corners<A> sample_corners(const Bilinear<A>& b, A w, int H, int W,
                                                     Index&& index) {
  Corners<A> c;
  clamped_corners(b, H, W, index, c.pix);
#pragma unroll
  for (int k = 0; k < 4; ++k) c.w[k] = b.corner_ok(k, H, W) ? w * b.weight(k) : A(0);
  return c;
}

// The corners of the sample at location (x, y) with weight w; pix[0] ==
// kNoSample when its footprint misses the map.
template <typename A, typename Index>
__device__ __forceinline__ Corners<A> resolve_sample(A x, A y, A w, int H, int W, Index&& index) {
  const auto b = make_bilinear<A>(x, y, w, H, W);
  Corners<A> c = sample_corners(b, w, H, W, index);
  if (!b.inside) c.pix[0] = kNoSample;
  return c;
}

template <typename A>
__device__ __forceinline__ Corners<A> resolve_sample(A x, A y, A w, int H, int W) {
  return resolve_sample(x, y, w, H, W, RowMajor{W});
}

// acc += sum_k c.w[k] * value(c.pix[k]) over VEC channels. fetch(pixel, v)
// loads the VEC channels of row-major pixel `pixel` of the level. The four
// loads issue back to back, with no branch in between.
template <typename A, int VEC, typename Fetch>
__device__ __forceinline__ void gather_corners(A (&acc)[VEC], const Corners<A>& c, Fetch&& fetch) {
  A v[4][VEC];
#pragma unroll
  for (int k = 0; k < 4; ++k) fetch(c.pix[k], v[k]);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] += c.w[k] * v[k][e];
  }
}

// Chooses the levels a caching backend keeps in shared memory: the
// smallest levels first, while their pixels add up to at most `capacity`.
// One thread calls it; off[l] = pixel offset of level l's pixel 0 in the
// cache (levels concatenated), or -1 when level l is read from global memory.
__device__ inline void choose_cached_levels(const Level* lv, int L, int64_t capacity, int64_t* off) {
  for (int l = 0; l < L; ++l) {  // the levels before l in size order, and l, must fit
    int64_t before = 0;
    for (int j = 0; j < L; ++j) before += level_before(lv, j, l) ? int64_t(lv[j].H) * lv[j].W : 0;
    off[l] = before + int64_t(lv[l].H) * lv[l].W <= capacity ? before : -1;
  }
}

// Location and weight of point i of a (query, head) row.
template <typename A, typename LT>
__device__ __forceinline__ void load_point(const LT* loc, const LT* attn, int i, A& x, A& y, A& w) {
  A xy[2];
  load_xy(loc + 2 * i, xy);
  x = xy[0];
  y = xy[1];
  w = A(to_acc(attn[i]));
}

// Where the `lanes` threads of a group (aligned inside a warp) stand: the
// group's lane mask and the CornerSlots they hand samples through.
struct GroupLanes {
  int lane, lanes;
  int first_slot;   // slot(0)
  int slot_stride;  // slot(j + 1) - slot(j)
  unsigned mask;

  // Slot of point j (lane j writes it, the whole group reads it): the warp's
  // first slot + group + j * slot_stride, slot_stride = groups + max(8 /
  // lanes, 1) (1 for 32 lanes). For one j the groups' slots are consecutive
  // 16-byte words (the reads, every group at once, hit distinct banks); the
  // stride's excess over `groups` makes the 8 threads of each quarter-warp
  // write 8 distinct 16-byte bank groups (a stride of `groups` alone gives
  // 2-4-way conflicts from 2 to 16 lanes). Checked for every lane count by
  // enumeration; at most 47 slots a warp (16 lanes). Linear in j, so a
  // gather steps through its slots by one addition a sample.
  __device__ __forceinline__ int slot(int j) const { return first_slot + j * slot_stride; }
};

// lanes: a power of two <= 32 (lanes_for), so divisions by it are shifts.
__device__ __forceinline__ GroupLanes group_lanes(int lane, int lanes) {
  const unsigned first = threadIdx.x - lane;  // the group's first thread
  const int shift = __ffs(lanes) - 1;         // log2(lanes)
  const int groups = 32 >> shift;
  GroupLanes g;
  g.lane = lane;
  g.lanes = lanes;
  g.mask = (lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u)) << (first & 31u);
  g.first_slot = static_cast<int>(threadIdx.x / 32) * kSlotsPerWarp +
                 static_cast<int>((first & 31u) >> shift);
  g.slot_stride = lanes == 32 ? 1 : groups + max(8 >> shift, 1);
  return g;
}

// Where a row's points come from. RowPoints: the (query, head) row's
// locations and weights as the caller passed them.
template <typename LT>
struct RowPoints {
  const LT* loc;
  const LT* attn;
  template <typename A>
  __device__ __forceinline__ void load(const Level&, int, int i, A& x, A& y, A& w) const {
    load_point(loc, attn, i, x, y, w);
  }
};

// FusedPoints (ms_deform_attn_fused): formed from the row's sampling offsets
// and attention logits and its query's reference points `ref` (L x ref_dim
// floats), in the composite's order of operations (csrc/composite/fused.cpp):
// location = ref + offset / (W, H) (ref_dim 2) or ref_xy + offset / P *
// ref_wh * 0.5 (ref_dim 4); weight = exp(logit - max) / sum over the row
// (row_softmax). Float accumulation only (no fp64 values).
template <typename LT>
struct FusedPoints {
  const LT* off;
  const LT* logits;
  const float* ref;
  int ref_dim;
  float half_p;        // 0.5 / P
  float max, inv_sum;  // the row's softmax: row_softmax()
  template <typename A>
  __device__ __forceinline__ void load(const Level& lv, int l, int i, A& x, A& y, A& w) const {
    float o[2];
    load_xy(off + 2 * i, o);
    fused_location(o, ref + l * ref_dim, ref_dim, half_p, lv, x, y);
    w = fused_weight(float(to_acc(logits[i])), max, inv_sum);
  }
};

// Max and the reciprocal of the sum of exp(logit - max) over a row's
// `count` logits, by the group's lanes (every lane gets both). A NaN logit
// makes the sum NaN, so every weight of the row is NaN (poisoned), as with
// torch.softmax.
template <typename LT, typename Lanes>
__device__ __forceinline__ void row_softmax(const LT* logits, int count, const Lanes& g, float& max,
                                            float& inv_sum) {
  max = -INFINITY;
  for (int i = g.lane; i < count; i += g.lanes) max = fmaxf(max, float(to_acc(logits[i])));
  for (int o = 1; o < g.lanes; o <<= 1) max = fmaxf(max, __shfl_xor_sync(g.mask, max, o));
  float sum = 0.f;
  for (int i = g.lane; i < count; i += g.lanes) sum += expf(float(to_acc(logits[i])) - max);
  for (int o = 1; o < g.lanes; o <<= 1) sum += __shfl_xor_sync(g.mask, sum, o);
  inv_sum = 1.f / sum;
}

// The group gathers the `count` samples its lanes put in their slots, one
// after the other: each sample's corners read from its slot (a broadcast),
// its values through fetch(pix, v); a sample that reads nothing is skipped.
template <typename A, int VEC, typename Fetch>
__device__ __forceinline__ void gather_slots(const GroupLanes& g, int count,
                                             const CornerSlots<A>& slots, A (&acc)[VEC],
                                             Fetch&& fetch) {
  for (int i = 0; i < count; ++i) {
    const Corners<A> s = slots.get(g.slot(i));
    if (s.pix[0] != kNoSample) gather_corners(acc, s, fetch);
  }
}

// The P points of level l of one (query, head) row, added into acc (this
// lane's channel slice; `active` false for lanes past D, which still resolve
// points). Lane j resolves point p0 + j (taken from `pts`, RowPoints or
// FusedPoints) with resolve(x, y, w) into its slot of `slots` (shared
// memory, see CornerSlots), and the group then gathers those points one
// after the other, reading each point's corners from its slot (a broadcast)
// and its values through fetch(pix, v). So the set-up runs once a sample
// instead of once per lane, and the gather loop has no shuffles (whose
// convergence checks cost more than they save; docs/performance.md).
template <typename Points, typename A, int VEC, typename Resolve, typename Fetch>
__device__ __forceinline__ void gather_level(const GroupLanes& g, int P, int l, const Level& lv,
                                             const Points& pts, bool active, CornerSlots<A> slots,
                                             A (&acc)[VEC], Resolve&& resolve, Fetch&& fetch) {
  for (int p0 = 0; p0 < P; p0 += g.lanes) {
    if (p0 + g.lane < P) {
      A x, y, w;
      pts.load(lv, l, l * P + p0 + g.lane, x, y, w);
      slots.put(g.slot(g.lane), resolve(x, y, w));
    }
    __syncwarp(g.mask);
    const int count = min(g.lanes, P - p0);
    if (active) gather_slots(g, count, slots, acc, fetch);
    __syncwarp(g.mask);  // slots are rewritten by the next points
  }
}

// A sample's four corners as raw vectors of VEC elements of T, loaded
// whether or not the sample reads anything (one that reads nothing loads
// corner 1, clamped into the map like every corner, in place of its
// kNoSample), so that no branch stands between samples; add_corners then
// skips its sum. fetch(pix) returns the raw vector of pixel pix.
template <typename T, int VEC>
using RawCorner = typename RawVec<sizeof(T) * VEC>::type;

template <typename T, int VEC, typename A, typename Fetch>
__device__ __forceinline__ void fetch_corners(const Corners<A>& c, RawCorner<T, VEC> (&v)[4],
                                              Fetch&& fetch) {
  v[0] = fetch(c.pix[0] != kNoSample ? c.pix[0] : c.pix[1]);
#pragma unroll
  for (int k = 1; k < 4; ++k) v[k] = fetch(c.pix[k]);
}

template <typename T, int VEC, typename A>
__device__ __forceinline__ void add_corners(A (&acc)[VEC], const Corners<A>& c,
                                            const RawCorner<T, VEC> (&v)[4]) {
  if (c.pix[0] == kNoSample) return;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    A x[VEC];
    unpack<T, VEC>(v[k], x);
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] += c.w[k] * x[e];
  }
}

// A lane's point of a row (location and weight), loaded a round before
// the round that resolves it (gather_row's kAhead form).
template <typename A>
struct LanePoint {
  A x, y, w;
  template <typename LT>
  __device__ __forceinline__ void load(const RowPoints<LT>& pts, int i) {
    load_point(pts.loc, pts.attn, i, x, y, w);
  }
};

// The same for a whole row at once (the `blocked` forward): lane j resolves
// point i0 + j of the row's L * P points, across levels, so that no lane
// idles where P < lanes; corners are numbered by their pixel in the whole
// map (MapIndex). `valid` false for a group that stands in only so that its
// warp syncs whole (no loads, nothing read from its slots). by_p divides by
// P (a point's level, FastDiv from the launcher). fetch(pix) returns pixel
// pix's raw vector (fetch_corners).
// kAhead (RowPoints): `next` holds the lane's point of the first round (a
// kernel can issue its load before its barrier on the level table, which
// the load does not need); each round loads the next round's point before
// its gather, so that the locations' latency waits under the corner loads.
// Without kAhead (the fused form: its points need the level table): each
// round loads its points; `next` unused. The gather is gather_slots either
// way (a software-pipelined one, the next sample's slot read and loads
// issued before the current sample's sums, measured slower on trained-like
// locations: docs/performance.md). kOneLevel: every point is on level 0
// (L == 1), no division by P.
template <typename T, bool kAhead, bool kOneLevel = false, typename Points, typename A, int VEC,
          typename Fetch>
__device__ __forceinline__ void gather_row(const GroupLanes& g, int L, int P,
                                           const FastDiv& by_p, const Level* levels,
                                           const Points& pts, bool valid, bool active,
                                           CornerSlots<A> slots, A (&acc)[VEC], Fetch&& fetch,
                                           LanePoint<A> next) {
  const int LP = L * P;
  // Both tests once, held in registers (the empty asm): otherwise the
  // compiler recomputes them from the 64-bit query index and D every round,
  // and spills the index to have it.
  int resolved = valid ? LP : 0;  // points this lane's group resolves
  int gathers = valid && active;
  asm("" : "+r"(resolved), "+r"(gathers));
  for (int i0 = 0; i0 < LP; i0 += g.lanes) {
    const int i = i0 + g.lane;
    if (i < resolved) {
      const int l = kOneLevel ? 0 : static_cast<int>(by_p(static_cast<uint32_t>(i)));
      const Level lv = levels[l];
      LanePoint<A> pt = next;
      if constexpr (!kAhead) pts.load(lv, l, i, pt.x, pt.y, pt.w);
      slots.put(g.slot(g.lane), resolve_sample(pt.x, pt.y, lv.weight(pt.w), lv.H, lv.W,
                                               MapIndex{static_cast<int>(lv.start), lv.W}));
    }
    if constexpr (kAhead) {
      if (i + g.lanes < resolved) next.load(pts, i + g.lanes);
    }
    __syncwarp();
    const int count = min(g.lanes, LP - i0);
    if (gathers) {
      gather_slots(g, count, slots, acc,
                   [&](int pix, A(&v)[VEC]) { unpack<T, VEC>(fetch(pix), v); });
    }
    __syncwarp();  // slots are rewritten by the next points
  }
}

// A row gathered with per-lane set-up (the `blocked` forward where warps
// are few: BlockedRows, params.h): no slots and no warp syncs; every lane
// resolves each of its points itself (the set-up repeated on the lanes of a
// group, as the Triton peer does), C points at a time in row order (across
// levels), and issues their 4 C corner loads before any sum. A lane takes
// the chunks of C points at `first`, `first + stride`, ... (a row split
// over several groups: each takes every stride / C-th chunk). The next
// chunk's locations and weights are loaded before this chunk's sums; the
// first chunk's by prefetch(), which needs no level table (a kernel issues
// it before the table's barrier). The row's points as given (RowPoints):
// FusedPoints needs each point's level to load it.
template <typename T, int C, typename LT, typename A>
struct LaneRow {
  RowPoints<LT> pts;
  int L, P;
  int first, stride;  // this lane's chunks: points [first + k stride, + C)
  A x[C], y[C], w[C];

  __device__ __forceinline__ void load_chunk(int i0) {
    const int last = L * P - 1;
#pragma unroll
    for (int j = 0; j < C; ++j) load_point(pts.loc, pts.attn, min(i0 + j, last), x[j], y[j], w[j]);
  }
  __device__ __forceinline__ void prefetch() { load_chunk(first); }

  // acc += the row's samples (after prefetch(); `levels` ready).
  template <int VEC, typename Fetch>
  __device__ __forceinline__ void run(const Level* levels, A (&acc)[VEC], Fetch&& fetch) {
    const int LP = L * P;
    for (int i0 = first; i0 < LP; i0 += stride) {
      Corners<A> c[C];
      int lj = i0 / P, pj = i0 - lj * P;  // level and point of sample i0 + j
#pragma unroll
      for (int j = 0; j < C; ++j) {
        const Level lv = levels[min(lj, L - 1)];
        c[j] = resolve_sample(x[j], y[j], lv.weight(w[j]), lv.H, lv.W,
                              MapIndex{static_cast<int>(lv.start), lv.W});
        if (i0 + j >= LP) c[j].pix[0] = kNoSample;
        if (++pj == P) {
          pj = 0;
          ++lj;
        }
      }
      RawCorner<T, VEC> v[C][4];
#pragma unroll
      for (int j = 0; j < C; ++j) fetch_corners<T, VEC>(c[j], v[j], fetch);
      if (i0 + stride < LP) load_chunk(i0 + stride);
#pragma unroll
      for (int j = 0; j < C; ++j) add_corners<T, VEC>(acc, c[j], v[j]);
    }
  }
};

// One (query, head) row of the output: the sum over levels and points of
// `pts`, over this lane's channel slices (gather_level for each level). All
// `lanes` threads of the group call it. with_fetch(l, c, body) calls
// body(fetch) with the fetch for level l at channel offset c (global memory,
// shared memory...), which is where the backends differ; or body(fetch,
// index) when the fetch wants corners numbered by index(row, col) (see
// resolve_sample).
template <typename T, int VEC, typename Points, typename WithFetch>
__device__ __forceinline__ void forward_row_points(const Problem& pb, const Level* levels,
                                                   const Points& pts, T* out, int lane, int lanes,
                                                   CornerSlots<acc_t<T>> slots,
                                                   WithFetch&& with_fetch) {
  using A = acc_t<T>;
  const GroupLanes g = group_lanes(lane, lanes);
  const int64_t step = int64_t(lanes) * VEC;
  for (int64_t c0 = 0; c0 < pb.D; c0 += step) {
    const int64_t c = c0 + int64_t(lane) * VEC;
    const bool active = c < pb.D;
    A acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = A(0);
    for (int l = 0; l < pb.L; ++l) {
      const Level lv = levels[l];
      with_fetch(l, active ? c : 0, [&](auto&& fetch, auto&&... index) {
        gather_level(g, pb.P, l, lv, pts, active, slots, acc,
                     [&](A x, A y, A w) {
                       return resolve_sample(x, y, lv.weight(w), lv.H, lv.W, index...);
                     },
                     fetch);
      });
    }
    if (active) store_vec<T, VEC>(out + c, acc);
  }
}

// The same from the row's locations and weights as given.
template <typename T, typename LT, int VEC, typename WithFetch>
__device__ __forceinline__ void forward_row(const Problem& pb, const Level* levels, const LT* loc,
                                            const LT* attn, T* out, int lane, int lanes,
                                            CornerSlots<acc_t<T>> slots, WithFetch&& with_fetch) {
  forward_row_points<T, VEC>(pb, levels, RowPoints<LT>{loc, attn}, out, lane, lanes, slots,
                             with_fetch);
}

}  // namespace msda::cuda
