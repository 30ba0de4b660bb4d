// ms_deform_attn_fused inside the kernels: a point's location from its
// offset and its query's reference, its weight from its logit and the row's
// softmax statistics; and resolve_sample_at, through which every kernel that
// forms grad_value resolves a stored sample (plain or fused) the same way.
#pragma once

#include "common.cuh"

namespace msda::cuda {

// ---- ms_deform_attn_fused: locations and weights formed in the kernels ------
// The location of a point from its sampling offset `o` (pixels for points,
// units of half the box over P for boxes) and its query's reference `r` on
// its level lv (ref_dim 2: (x, y); 4: (cx, cy, w, h)): r + o / (W, H), or
// r_xy + o * r_wh * half_p with half_p = 0.5 / P, as multiplications by the
// level's reciprocals (within an ulp or two of the composite's divisions,
// csrc/composite/fused.cpp). Explicitly rounded operations, so that every kernel that
// forms a location gets the same bits (the sorted backward finds a sample's
// cell twice).
__device__ __forceinline__ void fused_location(const float (&o)[2], const float* r, int ref_dim,
                                               float half_p, const Level& lv, float& x, float& y) {
  if (ref_dim == 4) {
    x = __fmaf_rn(o[0], __fmul_rn(r[2], half_p), r[0]);
    y = __fmaf_rn(o[1], __fmul_rn(r[3], half_p), r[1]);
  } else {
    x = __fmaf_rn(o[0], __frcp_rn(float(lv.W)), r[0]);
    y = __fmaf_rn(o[1], __frcp_rn(float(lv.H)), r[1]);
  }
}

// d location / d offset of fused_location, times W (H): what the kernels'
// d out / d (W x) turns into the offset's gradient.
__device__ __forceinline__ void fused_offset_scale(const float* r, int ref_dim, float half_p,
                                                   const Level& lv, float& sx, float& sy) {
  if (ref_dim == 4) {
    sx = float(lv.W) * r[2] * half_p;
    sy = float(lv.H) * r[3] * half_p;
  } else {
    sx = sy = 1.f;  // (1 / W) x W
  }
}

// Softmax weight of a logit given its row's max and the reciprocal of its
// sum of exp(logit - max).
__device__ __forceinline__ float fused_weight(float z, float max, float inv_sum) {
  return __fmul_rn(expf(z - max), inv_sum);
}

// A sample of the sorted backward's grad_value, resolved for its corner
// weights: location and attention weight from the operator's inputs (kFused:
// from the offset, the reference row `ref_row` of its query and level, the
// logit and the row's softmax statistics the dots kernel wrote, by the dots
// kernel's arithmetic), then its footprint on level lv. The weight (w, the
// level's poison applied) goes to `w`. Every kernel that resolves a sample
// for grad_value does it through here (resolve_sample_at), so all find the same cell.
template <typename A, typename LT, bool kFused>
__device__ __forceinline__ Bilinear<A> resolve_sample_at(const BackwardParams& p, int64_t id, int64_t row,
                                                      const float* ref_row, const Level& lv, A& w) {
  A xy[2];
  if constexpr (kFused) {
    static_assert(std::is_same_v<A, float>, "the fused operator accumulates in float");
    float o[2];
    load_xy(static_cast<const LT*>(p.loc) + 2 * id, o);
    fused_location(o, ref_row, p.ref_dim, 0.5f / float(p.pb.P), lv, xy[0], xy[1]);
    const float2 st = __ldg(reinterpret_cast<const float2*>(p.row_stats) + row);
    w = lv.weight(fused_weight(float(to_acc(__ldg(static_cast<const LT*>(p.attn) + id))), st.x, st.y));
  } else {
    load_xy(static_cast<const LT*>(p.loc) + 2 * id, xy);
    w = lv.weight(A(to_acc(__ldg(static_cast<const LT*>(p.attn) + id))));
  }
  return make_bilinear<A>(xy[0], xy[1], w, lv.H, lv.W);
}

}  // namespace msda::cuda
