// CPU kernels (kernels.h): the forward and backward loops over a range of
// work items, one sample at a time through the shared bilinear sampler
// (sampling.h), in the accumulation type of the dtype dispatch.
#include "kernels.h"

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <vector>

#include "../core/dispatch.h"
#include "../core/sampling.h"

namespace msda::cpu {
namespace {

struct Level {
  int H, W;
  int64_t start;
};

// Levels as the kernels use them (the binding checked the values on CPU).
std::vector<Level> read_levels(const int64_t* shapes, const int64_t* starts, int L) {
  std::vector<Level> lv(L);
  for (int l = 0; l < L; ++l) {
    lv[l] = {static_cast<int>(shapes[2 * l]), static_cast<int>(shapes[2 * l + 1]), starts[l]};
  }
  return lv;
}

template <typename T, typename LT>
void forward_impl(const ForwardParams& p, int64_t begin, int64_t end) {
  using A = acc_t<T>;
  const auto& pb = p.pb;
  const int64_t D = pb.D, M = pb.M, LP = int64_t(pb.L) * pb.P;
  const auto lv = read_levels(p.spatial_shapes, p.level_start, pb.L);
  const T* value = static_cast<const T*>(p.value);
  const LT* loc = static_cast<const LT*>(p.loc);
  const LT* attn = static_cast<const LT*>(p.attn);
  T* out = static_cast<T*>(p.out);
  std::vector<A> acc(D);
  for (int64_t g = begin; g < end; ++g) {
    const int64_t m = g % M, n = g / (pb.Lq * M);
    std::fill(acc.begin(), acc.end(), A(0));
    for (int l = 0; l < pb.L; ++l) {
      const T* vl = value + value_row(pb, n, lv[l].start, m) * D;
      for (int pt = 0; pt < pb.P; ++pt) {
        const int64_t i = g * LP + l * pb.P + pt;
        const A w = A(attn[i]);
        const auto b = make_bilinear<A>(A(loc[2 * i]), A(loc[2 * i + 1]), w, lv[l].H, lv[l].W);
        if (!b.inside) continue;
        for (int k = 0; k < 4; ++k) {
          if (!b.corner_ok(k, lv[l].H, lv[l].W)) continue;
          const T* v = vl + b.corner_offset(k, lv[l].W) * value_pixel_rows(pb) * D;
          const A wk = w * b.weight(k);
          for (int64_t c = 0; c < D; ++c) acc[c] += wk * A(v[c]);
        }
      }
    }
    for (int64_t c = 0; c < D; ++c) out[g * D + c] = T(acc[c]);
  }
}

template <typename T, typename LT>
void backward_impl(const BackwardParams& p, int64_t begin, int64_t end) {
  using A = acc_t<T>;
  const auto& pb = p.pb;
  const int64_t D = pb.D, M = pb.M, LP = int64_t(pb.L) * pb.P;
  const auto lv = read_levels(p.spatial_shapes, p.level_start, pb.L);
  const T* value = static_cast<const T*>(p.value);
  const LT* loc = static_cast<const LT*>(p.loc);
  const LT* attn = static_cast<const LT*>(p.attn);
  const T* gout = static_cast<const T*>(p.grad_out);
  A* gval = static_cast<A*>(p.grad_value_acc);
  LT* gloc = static_cast<LT*>(p.grad_loc);
  LT* gattn = static_cast<LT*>(p.grad_attn);
  std::vector<A> go(D);
  for (int64_t nm = begin; nm < end; ++nm) {
    const int64_t n = nm / M, m = nm % M;
    for (int64_t q = 0; q < pb.Lq; ++q) {
      const int64_t g = (n * pb.Lq + q) * M + m;
      for (int64_t c = 0; c < D; ++c) go[c] = A(gout[g * D + c]);
      for (int l = 0; l < pb.L; ++l) {
        const int64_t row0 = value_row(pb, n, lv[l].start, m);
        for (int pt = 0; pt < pb.P; ++pt) {
          const int64_t i = g * LP + l * pb.P + pt;
          const A w = A(attn[i]);
          const auto b = make_bilinear<A>(A(loc[2 * i]), A(loc[2 * i + 1]), w, lv[l].H, lv[l].W);
          const bool to_value = !b.poisoned();  // a poisoned sample adds nothing to grad_value
          A g_attn = 0, g_lw = 0, g_lh = 0;
          if (b.inside) {
            for (int k = 0; k < 4; ++k) {
              if (!b.corner_ok(k, lv[l].H, lv[l].W)) continue;
              const int64_t off = (row0 + b.corner_offset(k, lv[l].W) * value_pixel_rows(pb)) * D;
              const T* v = value + off;
              A* gv = gval + off;
              const A wk = b.weight(k), dlw = b.dweight_dlw(k), dlh = b.dweight_dlh(k);
              A dot = 0;
              for (int64_t c = 0; c < D; ++c) {
                dot += go[c] * A(v[c]);
                if (to_value) gv[c] += w * wk * go[c];
              }
              g_attn += wk * dot;
              g_lw += dlw * dot;
              g_lh += dlh * dot;
            }
          }
          gattn[i] = LT(g_attn);
          gloc[2 * i] = LT(w * g_lw * A(lv[l].W));
          gloc[2 * i + 1] = LT(w * g_lh * A(lv[l].H));
        }
      }
    }
  }
}

}  // namespace

void forward_range(const ForwardParams& p, int64_t begin, int64_t end) {
  dispatch_dtypes<torch::headeronly::Half, torch::headeronly::BFloat16>(p.pb, [&](auto t, auto lt) {
    forward_impl<typename decltype(t)::type, typename decltype(lt)::type>(p, begin, end);
  });
}

void backward_range(const BackwardParams& p, int64_t begin, int64_t end) {
  dispatch_dtypes<torch::headeronly::Half, torch::headeronly::BFloat16>(p.pb, [&](auto t, auto lt) {
    backward_impl<typename decltype(t)::type, typename decltype(lt)::type>(p, begin, end);
  });
}

}  // namespace msda::cpu
