// The per-sample gather shared by every CUDA forward backend: resolve a
// location on one level, fetch the four corners' VEC channels through the
// backend's `fetch` (global memory, shared memory, ...), accumulate.
#pragma once

#include <algorithm>

#include "common.cuh"

namespace msda::cuda {

// One sample resolved for the gather: the row-major pixel indices of its four
// corners (clamped into the map, so always loadable) and their weights
// (bilinear weight x attention weight; 0 for a corner outside the map).
// pix[0] < 0 and pix[1] < 0 mark a sample that reads nothing (its footprint
// misses the map, or its location is not finite).
template <typename A>
struct Corners {
  int pix[4];
  A w[4];
};

// The two corners of one column of a sample (left: corners 0 and 2, right:
// 1 and 3), top then bottom. pix[0] < 0: the sample reads nothing.
template <typename A>
struct __align__(16) ColumnCorners {
  A w[2];
  int pix[2];
};

// Shared-memory slots through which the lanes of a group hand each other
// resolved samples: one slot (both columns) per thread of the block. Slot j of
// group g of a warp sits at warp base + j * (groups per warp) + g, its two
// columns side by side, so when every lane of a warp reads column `col` of its
// group's slot i at once the reads are consecutive 16-byte words: no bank
// conflicts.
template <typename A>
struct CornerSlots {
  ColumnCorners<A>* slot;
  static constexpr int64_t kBytesPerThread = 2 * sizeof(ColumnCorners<A>);
  __device__ __forceinline__ explicit CornerSlots(void* mem)
      : slot(static_cast<ColumnCorners<A>*>(mem)) {}
  __device__ __forceinline__ void put(int i, const Corners<A>& c) const {
    slot[2 * i] = ColumnCorners<A>{{c.w[0], c.w[2]}, {c.pix[0], c.pix[2]}};
    slot[2 * i + 1] = ColumnCorners<A>{{c.w[1], c.w[3]}, {c.pix[1], c.pix[3]}};
  }
  __device__ __forceinline__ ColumnCorners<A> get(int i, int col) const { return slot[2 * i + col]; }
};

// Requires H, W >= 1: callers skip the empty levels load_levels() makes of
// levels that do not fit in value.
template <typename A>
__device__ __forceinline__ Corners<A> resolve_sample(A x, A y, A w, int H, int W) {
  const auto b = make_bilinear<A>(x, y, H, W);
  const int top = max(b.h0, 0), bottom = min(b.h0 + 1, H - 1);
  const int left = max(b.w0, 0), right = min(b.w0 + 1, W - 1);
  Corners<A> c;
  c.pix[0] = top * W + left;
  c.pix[1] = top * W + right;
  c.pix[2] = bottom * W + left;
  c.pix[3] = bottom * W + right;
#pragma unroll
  for (int k = 0; k < 4; ++k) c.w[k] = b.corner_ok(k, H, W) ? w * b.weight(k) : A(0);
  if (!b.inside) c.pix[0] = c.pix[1] = -1;
  return c;
}

// acc += w[0] * value(pix[0]) + w[1] * value(pix[1]) over VEC channels, for
// one column of a sample. fetch(pixel, v) loads the VEC channels of row-major
// pixel `pixel` of the level. Both loads issue back to back, with no branch.
template <typename A, int VEC, typename Fetch>
__device__ __forceinline__ void gather_column(A (&acc)[VEC], const ColumnCorners<A>& s,
                                              Fetch&& fetch) {
  A v[2][VEC];
  fetch(s.pix[0], v[0]);
  fetch(s.pix[1], v[1]);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] += s.w[k] * v[k][e];
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

// Threads per (query, head) group in the forward: two columns (left and
// right corners) of lanes_for(D, vec) channel lanes, at most 32.
inline int forward_lanes(int64_t D, int vec) { return 2 * std::min(lanes_for(D, vec), 16); }

// One (query, head) row of the output: the sum over levels and points. The
// `lanes` threads of a group (aligned inside a warp; all of them call this)
// are two columns of lanes / 2 channel lanes: the left column gathers every
// sample's left corners, the right column its right corners (neighbouring
// pixels: a cached level stored [pixel][D] serves both in one contiguous
// request), and the columns add up at the end. The lanes also split the
// per-sample set-up (location and weight loads, bilinear weights, corner
// indices): lane j resolves point p0 + j of a level into its slot of `slots`
// (shared memory, see CornerSlots), and the group then gathers those points
// one after the other, each lane reading its column of the point's slot. So
// the set-up runs once a sample instead of once per lane.
// with_fetch(l, c, body) calls body(fetch) with the fetch for level l at
// channel offset c (global memory, shared memory...), which is where the
// backends differ.
template <typename T, typename LT, int VEC, typename WithFetch>
__device__ __forceinline__ void forward_row(const Problem& pb, const Level* levels, const LT* loc,
                                            const LT* attn, T* out, int lane, int lanes,
                                            const CornerSlots<acc_t<T>>& slots,
                                            WithFetch&& with_fetch) {
  using A = acc_t<T>;
  const unsigned first = threadIdx.x - lane;  // the group's first thread
  const unsigned mask = (lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u)) << (first & 31u);
  const int groups = 32 / lanes;
  const int slot0 = static_cast<int>(threadIdx.x & ~31u) + static_cast<int>(first & 31u) / lanes;
  const int half = lanes / 2;
  const int col = lane < half ? 0 : 1;
  const int64_t step = int64_t(half) * VEC;
  for (int64_t c0 = 0; c0 < pb.D; c0 += step) {
    const int64_t c = c0 + int64_t(lane - col * half) * VEC;
    const bool active = c < pb.D;  // lanes past D resolve points but gather nothing
    A acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = A(0);
    for (int l = 0; l < pb.L; ++l) {
      const Level lv = levels[l];
      if (lv.H == 0) continue;  // level rejected by load_levels
      with_fetch(l, active ? c : 0, [&](auto&& fetch) {
        for (int p0 = 0; p0 < pb.P; p0 += lanes) {
          if (p0 + lane < pb.P) {
            A x, y, w;
            load_point(loc, attn, l * pb.P + p0 + lane, x, y, w);
            slots.put(slot0 + lane * groups, resolve_sample(x, y, w, lv.H, lv.W));
          }
          __syncwarp(mask);
          const int count = min(lanes, pb.P - p0);
          if (active) {
            for (int i = 0; i < count; ++i) {
              const ColumnCorners<A> s = slots.get(slot0 + i * groups, col);
              if (s.pix[0] >= 0) gather_column(acc, s, fetch);
            }
          }
          __syncwarp(mask);  // slots are rewritten by the next points
        }
      });
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] += __shfl_xor_sync(mask, acc[e], half);
    if (active && col == 0) store_vec<T, VEC>(out + c, acc);
  }
}

}  // namespace msda::cuda
