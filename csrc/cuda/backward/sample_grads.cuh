// What the backward's dots kernels share (ffma_dots.cu, mma_dots.cu): a
// sample resolved for the backward (BackwardSample), its corner dots and
// their gradients, and the writes of a sample's location and weight
// gradients with, on the reproducible plans, its cell key (sorted) or its
// block-local record (local).
#pragma once

#include <algorithm>

#include "../device/fused_samples.cuh"
#include "../device/grad_value_records.cuh"
#include "../device/sampler.cuh"

namespace msda::cuda {

// Key of the cell sample `sample` lies in, or the largest key (past every
// cell) when it adds nothing to grad_value (footprint off the level, or
// poisoned).
template <typename A>
__device__ __forceinline__ void write_key(const BackwardParams& p, int64_t sample, bool inside,
                                          int64_t nm, int64_t level_base, const Bilinear<A>& b,
                                          int W) {
  const uint64_t key = inside ? cell_key(nm, p.cell_stride, level_base, b.h0, b.w0, W)
                              : uint64_t(p.pb.N * p.pb.M * p.cell_stride);
  if (p.wide_keys) {
    static_cast<uint64_t*>(p.cell_keys)[sample] = key;
    static_cast<uint64_t*>(p.sample_ids)[sample] = uint64_t(sample);
  } else {
    static_cast<unsigned*>(p.cell_keys)[sample] = unsigned(key);
    static_cast<unsigned*>(p.sample_ids)[sample] = unsigned(sample);
  }
}

// A round's samples hand their corners through CornerSlots (sampler.cuh):
// sample_corners()'s, with a corner outside the map, or any corner of a
// poisoned sample, flagged by the sign bit (still loadable as
// pix & INT32_MAX): it gets no grad_value. pix[0] == kNoSample
// marks a sample that touches nothing (-1 is no flagged pixel: pixels are
// below INT32_MAX, load_levels).
template <typename A>
__device__ __forceinline__ Corners<A> backward_corners(const Bilinear<A>& b, const Level& lv, A w) {
  Corners<A> c = sample_corners(b, w, lv.H, lv.W, RowMajor{lv.W});
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    c.pix[k] = b.corner_ok(k, lv.H, lv.W) && !b.poisoned() ? c.pix[k] : c.pix[k] | INT32_MIN;
  }
  return c;
}

// Samples a group resolves at once (one a lane), for `lanes` lanes a group.
constexpr int kRound = 8;
__host__ __device__ constexpr int round_width(int lanes) { return lanes < kRound ? lanes : kRound; }

// One channel slice [c, c + VEC) of a resolved sample: its four corners
// loaded back to back, their dot products with go added to dot[k] (the
// resolving lane masks the corners outside the map), and, when `gv` is set,
// each corner inside the map gets c.w[k] * go added to grad_value with vector
// atomics. `vl` / `gv` point at channel c of the level's pixel 0 of this
// (n, m); consecutive pixels are `vstride` / `gstride` bytes apart.
template <typename T, int VEC, typename A>
__device__ __forceinline__ void corner_grads(const T* vl, unsigned vstride, A* gv, uint64_t gstride,
                                             const Corners<A>& c, const A (&go)[VEC], A (&dot)[4]) {
  A v[4][VEC];
#pragma unroll
  for (int k = 0; k < 4; ++k) load_vec<T, VEC>(pixel_ptr(vl, c.pix[k] & INT32_MAX, vstride), v[k]);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) dot[k] += go[e] * v[k][e];
    if (gv != nullptr && c.pix[k] >= 0) {
      A add[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) add[e] = c.w[k] * go[e];
      // Byte arithmetic on the pointer itself (not an integer), so that the
      // compiler still knows it is global memory and emits REDG.
      A* dst = reinterpret_cast<A*>(reinterpret_cast<char*>(gv) +
                                    static_cast<uint64_t>(static_cast<unsigned>(c.pix[k])) * gstride);
      atomic_add_vec<VEC>(dst, add);
    }
  }
}

// A sample of one group resolved: its level, bilinear footprint (b.inside:
// it touches the map) and weight.
template <typename A>
struct BackwardSample {
  Bilinear<A> b{};  // value-initialised: not inside
  Level lv{0, 0, 0, false};
  A w = A(0);
};

template <typename A>
__device__ __forceinline__ BackwardSample<A> make_sample(A x, A y, A w, const Level& lv) {
  BackwardSample<A> s;
  s.lv = lv;
  s.w = lv.weight(w);
  s.b = make_bilinear<A>(x, y, s.w, lv.H, lv.W);
  return s;
}

template <typename A, typename LT>
__device__ __forceinline__ BackwardSample<A> load_sample(const LT* loc, const LT* attn, int i,
                                                         const Level& lv) {
  A xy[2];
  load_xy(loc + 2 * i, xy);
  return make_sample(xy[0], xy[1], A(to_acc(attn[i])), lv);
}

// ms_deform_attn_fused: point i of a row from its offset and logit, its
// query's reference on the level `r` and the row's softmax max and 1 / sum
// (the same arithmetic as the forward's FusedPoints and pack_samples').
template <typename LT>
__device__ __forceinline__ BackwardSample<float> load_fused_sample(const LT* off, const LT* logits,
                                                                   int i, const Level& lv,
                                                                   const float* r, int ref_dim,
                                                                   float half_p, float max,
                                                                   float inv_sum) {
  float o[2], x, y;
  load_xy(off + 2 * i, o);
  fused_location(o, r, ref_dim, half_p, lv, x, y);
  return make_sample(x, y, fused_weight(float(to_acc(logits[i])), max, inv_sum), lv);
}

// d out / d attention weight and d out / d (lw, lh) of sample s from its four
// corner dots with grad_output (corners outside the map count nothing).
// Linear in the dots: partial dots give partial sums.
template <typename A>
__device__ __forceinline__ void sample_grads(const BackwardSample<A>& s, const A (&dot)[4],
                                             A (&g)[3]) {
  g[0] = g[1] = g[2] = A(0);
  if (!s.b.inside) return;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const A d = s.b.corner_ok(k, s.lv.H, s.lv.W) ? dot[k] : A(0);
    g[0] += s.b.weight(k) * d;
    g[1] += s.b.dweight_dlw(k) * d;
    g[2] += s.b.dweight_dlh(k) * d;
  }
}

// The block-local record index of sample (q, level l, point pt) of (n, m)
// (nm = n M + m; see BackwardParams::local_cell): records by (n, m, level),
// then query, then point; 32-bit indices, the launch keeps the samples below
// 2^31 and A float.
__device__ __forceinline__ uint32_t local_record_at(const Problem& pb, uint32_t nm, uint32_t l, uint32_t q,
                                                   uint32_t pt) {
  return (nm * uint32_t(pb.L) + l) * (uint32_t(pb.Lq) * uint32_t(pb.P)) + q * uint32_t(pb.P) + pt;
}

// The same for sample i of group (n, q, m), the group's index decoded.
__device__ __forceinline__ uint32_t local_record_index(const BackwardParams& p, int64_t group, int i,
                                                      int64_t nm) {
  const uint32_t M = uint32_t(p.pb.M), Lq = uint32_t(p.pb.Lq), P = uint32_t(p.pb.P);
  const uint32_t n = uint32_t(nm) / M, q = uint32_t(group) / M - n * Lq, l = uint32_t(i) / P;
  return local_record_at(p.pb, uint32_t(nm), l, q, uint32_t(i) - l * P);
}

// Writes the attention weight and location gradients of sample i of group
// `group` (g summed over the group) and, on the deterministic path, its cell
// key (nm = n M + m of the group (n, q, m), level_base = its level's first
// cell) or its block-local record (unless !kRecord: the fused FFMA kernel
// leaves them to local_footprints), at record() where given (the caller's
// cheaper index arithmetic), else at local_record_index().
// The same with the three values given: the weight's (or logit's) gradient
// ga and the location's (or offset's) (gx, gy).
template <typename A, typename LT, bool kRecord = true, typename Record = std::nullptr_t>
__device__ __forceinline__ void write_sample_grads(const BackwardParams& p, const BackwardSample<A>& s,
                                                   A ga, A gx, A gy, int64_t group, int i, int64_t nm,
                                                   int64_t level_base, const Record& record = nullptr) {
  const int64_t sample = group * p.pb.L * p.pb.P + i;
  if (p.plan.grad_value == GradValuePath::sorted) {
    write_key(p, sample, s.b.inside && !s.b.poisoned(), nm, level_base, s.b, s.lv.W);
  }
  if constexpr (kRecord) {
    if (p.plan.grad_value == GradValuePath::local && p.local_cell != nullptr) {
      if constexpr (std::is_same_v<Record, std::nullptr_t>) {
        write_local_record(p, local_record_index(p, group, i, nm), s.b, s.lv.W, s.w);
      } else {
        write_local_record(p, record(), s.b, s.lv.W, s.w);
      }
    }
  }
  static_cast<LT*>(p.grad_attn)[sample] = from_acc<LT>(acc_t<LT>(ga));
  LT* gloc = static_cast<LT*>(p.grad_loc) + sample * 2;
  gloc[0] = from_acc<LT>(acc_t<LT>(gx));
  gloc[1] = from_acc<LT>(acc_t<LT>(gy));
}

template <typename A, typename LT>
__device__ __forceinline__ void write_grads(const BackwardParams& p, const BackwardSample<A>& s,
                                            const A (&g)[3], int64_t group, int i, int64_t nm,
                                            int64_t level_base) {
  write_sample_grads<A, LT>(p, s, g[0], s.w * g[1] * A(s.lv.W), s.w * g[2] * A(s.lv.H), group, i,
                            nm, level_base);
}

}  // namespace msda::cuda
