// ms_deform_attn_fused: the location arithmetic and the softmax of the
// attention layer inside the operator (see fused.h). Its composite forward,
// registered for every backend (CompositeExplicitAutograd), forms the fp32
// (fp64) locations and weights as tensors and calls ms_deform_attn; they
// live only for that call. On CUDA the baseline kernel forms them itself
// (cuda/msda_cuda.cpp). The autograd kernel (share/ms_deform_attn/src/autograd.cpp) saves
// the raw inputs.
#include "fused.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "calls.h"  // share/ms_deform_attn/src: the typed dispatcher calls

namespace msda {
namespace {

const char* kFusedOp = "ms_deform_attn_fused: ";

void check_dims(const at::Tensor& t, const char* name, std::initializer_list<int64_t> expected,
                const char* layout) {
  TORCH_CHECK(t.dim() >= 1, kFusedOp, name, " must have ", layout, ", got a 0-d tensor");
  const int64_t d = t.dim();
  TORCH_CHECK(d == static_cast<int64_t>(expected.size()), kFusedOp, name, " must have ",
              expected.size(), " dimensions ", layout, ", got ", d, " (shape ", t.sizes(), ")");
  int64_t i = 0;
  for (int64_t want : expected) {
    TORCH_CHECK(want < 0 || t.size(i) == want, kFusedOp, name, " must have shape ", layout,
                ": size(", i, ") expected ", want, ", got ", t.size(i), " (shape ", t.sizes(), ")");
    ++i;
  }
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), kFusedOp, name,
              " must be a floating-point tensor, got ", t.scalar_type());
}

// (N, Lq, 1, L, 1, k) view of columns [from, from + k) of the reference
// points, in the coordinate dtype t.
at::Tensor ref_columns(const at::Tensor& ref, int64_t from, int64_t k, at::ScalarType t) {
  return ref.narrow(-1, from, k).to(t).unsqueeze(2).unsqueeze(4);
}

// (1, 1, 1, L, 1, 2) (W, H) of each level in dtype t.
at::Tensor level_wh(const at::Tensor& spatial_shapes, at::ScalarType t) {
  return spatial_shapes.flip(-1).to(t).view({1, 1, 1, -1, 1, 2});
}

}  // namespace

FusedSizes check_fused_inputs(const at::Tensor& value, const at::Tensor& spatial_shapes,
                              const at::Tensor& reference_points,
                              const at::Tensor& sampling_offsets,
                              const at::Tensor& attention_logits) {
  check_dims(value, "value", {-1, -1, -1, -1}, "(N, S, M, D)");
  check_dims(spatial_shapes, "spatial_shapes", {-1, 2}, "(L, 2)");
  FusedSizes s{};
  s.coord = value.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  s.N = value.size(0);
  s.M = value.size(2);
  s.L = spatial_shapes.size(0);
  TORCH_CHECK(reference_points.dim() == 4, kFusedOp,
              "reference_points must have 4 dimensions (N, Lq, L, 2) or (N, Lq, L, 4), got ",
              reference_points.dim(), " (shape ", reference_points.sizes(), ")");
  s.Lq = reference_points.size(1);
  const int64_t k = reference_points.size(3);
  TORCH_CHECK(k == 2 || k == 4, kFusedOp,
              "reference_points.size(3) must be 2 (points) or 4 (boxes cx, cy, w, h), got ", k);
  s.boxes = k == 4;
  check_dims(reference_points, "reference_points", {s.N, s.Lq, s.L, k},
             "(N, Lq, L, 2 or 4) with N = value.size(0), L = spatial_shapes.size(0)");
  TORCH_CHECK(sampling_offsets.dim() == 6, kFusedOp,
              "sampling_offsets must have 6 dimensions (N, Lq, M, L, P, 2), got ",
              sampling_offsets.dim(), " (shape ", sampling_offsets.sizes(), ")");
  s.P = sampling_offsets.size(4);
  check_dims(sampling_offsets, "sampling_offsets", {s.N, s.Lq, s.M, s.L, s.P, 2},
             "(N, Lq, M, L, P, 2) with N, M from value, Lq from reference_points, L from "
             "spatial_shapes");
  if (attention_logits.dim() == 5) {
    check_dims(attention_logits, "attention_logits", {s.N, s.Lq, s.M, s.L, s.P},
               "(N, Lq, M, L, P) or (N, Lq, M, L * P)");
  } else {
    check_dims(attention_logits, "attention_logits", {s.N, s.Lq, s.M, s.L * s.P},
               "(N, Lq, M, L * P) or (N, Lq, M, L, P)");
  }
  check_float(reference_points, "reference_points");
  check_float(sampling_offsets, "sampling_offsets");
  check_float(attention_logits, "attention_logits");
  for (const auto& [t, name] : {std::pair{&reference_points, "reference_points"},
                                {&sampling_offsets, "sampling_offsets"},
                                {&attention_logits, "attention_logits"}}) {
    TORCH_CHECK(t->device() == value.device(), kFusedOp, name, " must be on value's device ",
                value.device(), ", got ", t->device());
  }
  return s;
}

namespace {

// The sampling locations (N, Lq, M, L, P, 2) and attention weights
// (N, Lq, M, L, P), in s.coord, as Deformable DETR's layer forms them: points
// ref + offset / (W, H) of the level; boxes ref_xy + offset / P * ref_wh *
// 0.5; weights the softmax of each (n, q, m)'s L P logits.
std::tuple<at::Tensor, at::Tensor> fused_locations_and_weights(
    const at::Tensor& spatial_shapes, const at::Tensor& reference_points,
    const at::Tensor& sampling_offsets, const at::Tensor& attention_logits, const FusedSizes& s) {
  at::Tensor loc;
  if (s.boxes) {
    // The reference module's order of operations: offset / P * wh * 0.5.
    const at::Tensor off = sampling_offsets.to(s.coord);
    loc = ref_columns(reference_points, 0, 2, s.coord) +
          off / static_cast<double>(s.P) * ref_columns(reference_points, 2, 2, s.coord) * 0.5;
  } else {
    // ref + offset / (W, H) in one kernel, computed in the promoted dtype
    // (16-bit offsets are widened, not rounded, before the division).
    loc = at::addcdiv(ref_columns(reference_points, 0, 2, s.coord), sampling_offsets,
                      level_wh(spatial_shapes, s.coord))
              .to(s.coord);
  }
  const at::Tensor weights =
      at::softmax(attention_logits.to(s.coord).reshape({s.N, s.Lq, s.M, s.L * s.P}), -1)
          .view({s.N, s.Lq, s.M, s.L, s.P});
  return {loc, weights};
}

// Gradients of the raw inputs from those of the locations and weights (the
// chain rule of fused_locations_and_weights): grad_reference_points (only
// when `ref_grad`; undefined otherwise), grad_sampling_offsets,
// grad_attention_logits, each in its input's dtype and shape.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_input_grads(
    const at::Tensor& spatial_shapes, const at::Tensor& reference_points,
    const at::Tensor& sampling_offsets, const at::Tensor& attention_logits,
    const at::Tensor& attention_weights, const at::Tensor& grad_locations,
    const at::Tensor& grad_weights, const FusedSizes& s, bool ref_grad) {
  // Softmax: dz = a * (g - sum(a g)) over each row of L P (one ATen kernel).
  const at::Tensor a = attention_weights.reshape({s.N, s.Lq, s.M, s.L * s.P});
  const at::Tensor g = grad_weights.to(s.coord).reshape({s.N, s.Lq, s.M, s.L * s.P});
  const at::Tensor grad_logits = at::_softmax_backward_data(g, a, -1, s.coord)
                                     .view(attention_logits.sizes())
                                     .to(attention_logits.scalar_type());
  const at::Tensor gl = grad_locations.to(s.coord);
  at::Tensor grad_off, grad_ref;
  if (s.boxes) {
    const at::Tensor wh = ref_columns(reference_points, 2, 2, s.coord);
    grad_off = gl / static_cast<double>(s.P) * wh * 0.5;
    if (ref_grad) {
      // loc = xy + off / P * wh * 0.5: d/dxy sums over heads and points,
      // d/dwh sums gl * off / P * 0.5.
      const at::Tensor off = sampling_offsets.to(s.coord);
      grad_ref = at::cat({gl.sum({2, 4}), (gl * off / static_cast<double>(s.P) * 0.5).sum({2, 4})},
                         -1);
    }
  } else {
    grad_off = gl / level_wh(spatial_shapes, s.coord);
    if (ref_grad) grad_ref = gl.sum({2, 4});
  }
  if (ref_grad) grad_ref = grad_ref.to(reference_points.scalar_type());
  return {grad_ref, grad_off.to(sampling_offsets.scalar_type()), grad_logits};
}

}  // namespace

at::Tensor fused_forward_formed(const FusedSizes& s, const at::Tensor& value,
                                const at::Tensor& spatial_shapes,
                                const at::Tensor& level_start_index,
                                const at::Tensor& reference_points,
                                const at::Tensor& sampling_offsets,
                                const at::Tensor& attention_logits, c10::string_view backend,
                                std::optional<bool> deterministic,
                                at::OptionalIntArrayRef spatial_shapes_list) {
  auto [loc, weights] = fused_locations_and_weights(spatial_shapes, reference_points,
                                                    sampling_offsets, attention_logits, s);
  return call_forward(value, spatial_shapes, level_start_index, loc, weights, backend,
                      deterministic, spatial_shapes_list);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_backward_formed(
    const FusedSizes& s, const at::Tensor& grad_output, const at::Tensor& value,
    const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
    const at::Tensor& reference_points, const at::Tensor& sampling_offsets,
    const at::Tensor& attention_logits, bool deterministic, bool ref_grad) {
  auto [loc, weights] = fused_locations_and_weights(spatial_shapes, reference_points,
                                                    sampling_offsets, attention_logits, s);
  auto [grad_value, grad_loc, grad_weights] = call_backward(
      grad_output, value, spatial_shapes, level_start_index, loc, weights, deterministic);
  auto [grad_ref, grad_off, grad_logits] =
      fused_input_grads(spatial_shapes, reference_points, sampling_offsets, attention_logits,
                        weights, grad_loc, grad_weights, s, ref_grad);
  return {grad_value, grad_off, grad_logits, grad_ref};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_input_grads_formed(
    const FusedSizes& s, const at::Tensor& grad_output, const at::Tensor& value,
    const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
    const at::Tensor& reference_points, const at::Tensor& sampling_offsets,
    const at::Tensor& attention_logits, bool deterministic) {
  auto [grad_value, grad_off, grad_logits, unused] =
      fused_backward_formed(s, grad_output, value, spatial_shapes, level_start_index,
                            reference_points, sampling_offsets, attention_logits, deterministic,
                            /*ref_grad=*/false);
  return {grad_value, grad_off, grad_logits};
}

namespace {

at::Tensor fused_forward_composite(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                   const at::Tensor& level_start_index,
                                   const at::Tensor& reference_points,
                                   const at::Tensor& sampling_offsets,
                                   const at::Tensor& attention_logits, c10::string_view backend,
                                   std::optional<bool> deterministic,
                                   at::OptionalIntArrayRef spatial_shapes_list) {
  const FusedSizes s = check_fused_inputs(value, spatial_shapes, reference_points,
                                          sampling_offsets, attention_logits);
  return fused_forward_formed(s, value, spatial_shapes, level_start_index, reference_points,
                              sampling_offsets, attention_logits, backend, deterministic,
                              spatial_shapes_list);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_backward_composite(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& reference_points,
    const at::Tensor& sampling_offsets, const at::Tensor& attention_logits, bool deterministic) {
  const FusedSizes s = check_fused_inputs(value, spatial_shapes, reference_points,
                                          sampling_offsets, attention_logits);
  return fused_input_grads_formed(s, grad_output, value, spatial_shapes, level_start_index,
                                  reference_points, sampling_offsets, attention_logits,
                                  deterministic);
}

// The backward with the reference points' gradient (its sums over heads
// and points by ATen ops, on every device).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_backward_ref_composite(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& reference_points,
    const at::Tensor& sampling_offsets, const at::Tensor& attention_logits, bool deterministic) {
  const FusedSizes s = check_fused_inputs(value, spatial_shapes, reference_points,
                                          sampling_offsets, attention_logits);
  return fused_backward_formed(s, grad_output, value, spatial_shapes, level_start_index,
                               reference_points, sampling_offsets, attention_logits,
                               deterministic, /*ref_grad=*/true);
}

}  // namespace

}  // namespace msda

// Every device; CUDA registers its own kernels (cuda/msda_cuda.cpp), which
// form the locations and weights inside the baseline forward and the sorted
// backward.
TORCH_LIBRARY_IMPL(ms_deform_attn, CompositeExplicitAutograd, m) {
  m.impl("ms_deform_attn_fused", &msda::fused_forward_composite);
  m.impl("_ms_deform_attn_fused_backward", &msda::fused_backward_composite);
  m.impl("_ms_deform_attn_fused_backward_ref", &msda::fused_backward_ref_composite);
}
