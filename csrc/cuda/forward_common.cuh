// The per-sample gather shared by every CUDA forward backend: resolve a
// location on one level, fetch the four corners' VEC channels through the
// backend's `fetch` (global memory, shared memory, ...), accumulate.
#pragma once

#include "common.cuh"

namespace msda::cuda {

// acc += w * bilinear(level, (x, y)) over VEC channels. fetch(pixel, v) loads
// the VEC channels of row-major pixel `pixel` (int, < H * W) of the level.
//
// Written for few instructions per sample (the forward is issue-bound): the
// four corners are clamped into the map and a corner outside it gets weight
// 0 instead of a branch, so the four loads issue back to back with no
// zeroing; pixel indices are 32-bit. Requires H, W >= 1: callers skip the
// empty levels load_levels() makes of levels that do not fit in value.
template <typename A, int VEC, typename Fetch>
__device__ __forceinline__ void accumulate_sample(A (&acc)[VEC], A x, A y, A w, int H, int W,
                                                  Fetch&& fetch) {
  const auto b = make_bilinear<A>(x, y, H, W);
  if (!b.inside) return;
  const int top = max(b.h0, 0), bottom = min(b.h0 + 1, H - 1);
  const int left = max(b.w0, 0), right = min(b.w0 + 1, W - 1);
  const int pix[4] = {top * W + left, top * W + right, bottom * W + left, bottom * W + right};
  A v[4][VEC];
#pragma unroll
  for (int k = 0; k < 4; ++k) fetch(pix[k], v[k]);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const A wk = b.corner_ok(k, H, W) ? w * b.weight(k) : A(0);
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] += wk * v[k][e];
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

// One (query, head) row of the output, for this lane's channel slices: the
// sum over levels and points. with_fetch(l, c, body) calls body(fetch) with
// the fetch for level l at channel offset c (global memory, shared memory...),
// which is where the backends differ.
template <typename T, typename LT, int VEC, typename WithFetch>
__device__ __forceinline__ void forward_row(const Problem& pb, const Level* levels, const LT* loc,
                                            const LT* attn, T* out, int lane, int lanes,
                                            WithFetch&& with_fetch) {
  using A = acc_t<T>;
  for (int64_t c = int64_t(lane) * VEC; c < pb.D; c += int64_t(lanes) * VEC) {
    A acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = A(0);
    for (int l = 0; l < pb.L; ++l) {
      const Level lv = levels[l];
      if (lv.H == 0) continue;  // level rejected by load_levels
      with_fetch(l, c, [&](auto&& fetch) {
        for (int pt = 0; pt < pb.P; ++pt) {
          A x, y, w;
          load_point(loc, attn, l * pb.P + pt, x, y, w);
          accumulate_sample(acc, x, y, w, lv.H, lv.W, fetch);
        }
      });
    }
    store_vec<T, VEC>(out + c, acc);
  }
}

}  // namespace msda::cuda
