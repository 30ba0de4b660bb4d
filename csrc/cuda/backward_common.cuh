// Per-sample backward arithmetic shared by the backward kernels (backward.cu,
// backward_windowed.cu): the corners' dot products with grad_output, the
// gradient sums of a sample, and where they are written. The kernels differ
// only in where a corner's grad_value contribution goes.
#pragma once

#include "common.cuh"

namespace msda::cuda {

// A sample's gradient sums over this lane's channels: d out / d attention
// weight, and d out / d (lw, lh) before the attention weight and the level's
// size are applied.
template <typename A>
struct SampleGrads {
  A attn = A(0), lw = A(0), lh = A(0);
};

// The corners of sample b (inside level lv) on the channel slice [c, c + VEC):
// reads the value rows at vbase + off (off = lbase + pixel * row_stride + c),
// adds their dot products with go (grad_output of the slice) to g, and, when
// value_grad, hands corner k's grad_value contribution (scale * go, scale =
// w * weight(k)) to add_value(k, off, scale).
template <typename T, int VEC, typename A, typename AddValue>
__device__ __forceinline__ void corner_grads(const T* vbase, int64_t lbase, int64_t row_stride,
                                             int64_t c, const A (&go)[VEC], const Bilinear<A>& b,
                                             const Level& lv, A w, bool value_grad,
                                             SampleGrads<A>& g, AddValue&& add_value) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (!b.corner_ok(k, lv.H, lv.W)) continue;
    const int64_t off = lbase + b.corner_offset(k, lv.W) * row_stride + c;
    A v[VEC];
    load_vec<T, VEC>(vbase + off, v);
    A dot = A(0);
#pragma unroll
    for (int e = 0; e < VEC; ++e) dot += go[e] * v[e];
    const A wk = b.weight(k);
    g.attn += wk * dot;
    g.lw += b.dweight_dlw(k) * dot;
    g.lh += b.dweight_dlh(k) * dot;
    if (value_grad) add_value(k, off, w * wk);
  }
}

// Sums g over the group's lanes (every thread of the warp calls it) and, on
// lane 0 of a live sample, writes the gradients of sample i of the row:
// grad of the attention weight, and of the location (x, y) (chain rule
// through w = x * W - 0.5 and h = y * H - 0.5, times the attention weight w).
template <typename A, typename LT>
__device__ __forceinline__ void write_sample_grads(SampleGrads<A> g, int lanes, bool write, int i,
                                                   A w, const Level& lv, LT* gloc, LT* gattn) {
  g.attn = group_sum(g.attn, lanes);
  g.lw = group_sum(g.lw, lanes);
  g.lh = group_sum(g.lh, lanes);
  if (write) {
    gattn[i] = from_acc<LT>(acc_t<LT>(g.attn));
    gloc[2 * i] = from_acc<LT>(acc_t<LT>(w * g.lw * A(lv.W)));
    gloc[2 * i + 1] = from_acc<LT>(acc_t<LT>(w * g.lh * A(lv.H)));
  }
}

}  // namespace msda::cuda
