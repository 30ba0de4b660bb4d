// The per-sample gather shared by every CUDA forward backend: resolve a
// location on one level, fetch the four corners' VEC channels through the
// backend's `fetch` (global memory, shared memory, ...), accumulate.
#pragma once

#include "common.cuh"

namespace msda::cuda {

// acc += w * bilinear(level, (x, y)) over VEC channels. fetch(pixel, v) loads
// the VEC channels of row-major pixel `pixel` of the level into v.
template <typename A, int VEC, typename Fetch>
__device__ __forceinline__ void accumulate_sample(A (&acc)[VEC], A x, A y, A w, int H, int W,
                                                  Fetch&& fetch) {
  const auto b = make_bilinear<A>(x, y, H, W);
  if (!b.inside) return;
  A v[4][VEC];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (b.corner_ok(k, H, W)) {
      fetch(b.corner_offset(k, W), v[k]);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) v[k][e] = A(0);
    }
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const A wk = w * b.weight(k);
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

}  // namespace msda::cuda
