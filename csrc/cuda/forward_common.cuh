// The per-sample gather shared by every CUDA forward backend: resolve a
// location on one level, fetch the four corners' VEC channels through the
// backend's `fetch` (global memory, shared memory, ...), accumulate.
#pragma once

#include "common.cuh"

namespace msda::cuda {

// One sample resolved for the gather: the row-major pixel indices of its four
// corners (clamped into the map, so always loadable) and their weights
// (bilinear weight x attention weight; 0 for a corner outside the map and for
// a sample whose footprint misses it or whose location is not finite).
template <typename A>
struct Corners {
  int pix[4];
  A w[4];
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
  for (int k = 0; k < 4; ++k) c.w[k] = b.inside && b.corner_ok(k, H, W) ? w * b.weight(k) : A(0);
  return c;
}

// acc += sum_k c.w[k] * value(c.pix[k]) over VEC channels. fetch(pixel, v)
// loads the VEC channels of row-major pixel `pixel` of the level. The four
// loads issue back to back, with no branch (the forward is issue-bound).
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

// Location and weight of point i of a (query, head) row.
template <typename A, typename LT>
__device__ __forceinline__ void load_point(const LT* loc, const LT* attn, int i, A& x, A& y, A& w) {
  A xy[2];
  load_xy(loc + 2 * i, xy);
  x = xy[0];
  y = xy[1];
  w = A(to_acc(attn[i]));
}

// Corners resolved by lane `src` of the group (shuffle over `lanes` lanes).
template <typename A>
__device__ __forceinline__ Corners<A> shfl_corners(unsigned mask, const Corners<A>& c, int src,
                                                   int lanes) {
  Corners<A> r;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    r.pix[k] = __shfl_sync(mask, c.pix[k], src, lanes);
    r.w[k] = __shfl_sync(mask, c.w[k], src, lanes);
  }
  return r;
}

// One (query, head) row of the output: the sum over levels and points, over
// this lane's channel slices. The `lanes` threads of a group (aligned inside
// a warp; all of them call this) split the per-sample set-up (location and
// weight loads, bilinear weights, corner indices): lane j resolves point
// p0 + j of the level, and the group then gathers those points one after the
// other with the corners shuffled from their lane. So the set-up runs once a
// sample instead of once per lane. with_fetch(l, c, body) calls body(fetch)
// with the fetch for level l at channel offset c (global memory, shared
// memory...), which is where the backends differ.
template <typename T, typename LT, int VEC, typename WithFetch>
__device__ __forceinline__ void forward_row(const Problem& pb, const Level* levels, const LT* loc,
                                            const LT* attn, T* out, int lane, int lanes,
                                            WithFetch&& with_fetch) {
  using A = acc_t<T>;
  const int lane_in_warp = threadIdx.x & 31;
  const unsigned mask =
      (lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u)) << (lane_in_warp & ~(lanes - 1));
  const int64_t step = int64_t(lanes) * VEC;
  for (int64_t c0 = 0; c0 < pb.D; c0 += step) {
    const int64_t c = c0 + int64_t(lane) * VEC;
    const bool active = c < pb.D;  // lanes past D resolve points but gather nothing
    A acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = A(0);
    for (int l = 0; l < pb.L; ++l) {
      const Level lv = levels[l];
      if (lv.H == 0) continue;  // level rejected by load_levels
      with_fetch(l, active ? c : 0, [&](auto&& fetch) {
        for (int p0 = 0; p0 < pb.P; p0 += lanes) {
          Corners<A> mine{};
          if (p0 + lane < pb.P) {
            A x, y, w;
            load_point(loc, attn, l * pb.P + p0 + lane, x, y, w);
            mine = resolve_sample(x, y, w, lv.H, lv.W);
          }
          const int count = min(lanes, pb.P - p0);
          for (int i = 0; i < count; ++i) {
            const Corners<A> s = shfl_corners(mask, mine, i, lanes);
            if (active) gather_corners(acc, s, fetch);
          }
        }
      });
    }
    if (active) store_vec<T, VEC>(out + c, acc);
  }
}

}  // namespace msda::cuda
