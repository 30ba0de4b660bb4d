// ms_deform_attn_fused: the location arithmetic and the softmax of the
// attention layer inside the operator (see fused.h). Its composite forward,
// registered for every backend (CompositeExplicitAutograd), forms the fp32
// (fp64) locations and weights as tensors and calls ms_deform_attn; they
// live only for that call. On CUDA the baseline kernel forms them itself
// (cuda/msda_cuda.cpp). The autograd kernel (csrc/layer/autograd.cpp) saves
// the raw inputs.
#include "fused.h"
#include "../binding/kernel_table.h"

namespace msda {
namespace {

const char* kFusedOp = "ms_deform_attn_fused: ";

void check_dims(const Tensor& t, const char* name, std::initializer_list<int64_t> expected,
                const char* layout) {
  MSDA_CHECK(t.dim() >= 1, kFusedOp, name, " must have ", layout, ", got a 0-d tensor");
  const int64_t d = t.dim();
  MSDA_CHECK(d == static_cast<int64_t>(expected.size()), kFusedOp, name, " must have ",
              expected.size(), " dimensions ", layout, ", got ", d, " (shape ", shape_str(t), ")");
  int64_t i = 0;
  for (int64_t want : expected) {
    MSDA_CHECK(want < 0 || t.size(i) == want, kFusedOp, name, " must have shape ", layout,
                ": size(", i, ") expected ", want, ", got ", t.size(i), " (shape ", shape_str(t), ")");
    ++i;
  }
}

void check_float(const Tensor& t, const char* name) {
  MSDA_CHECK(is_floating(dtype_of(t)), kFusedOp, name,
              " must be a floating-point tensor, got ", dtype_name(dtype_of(t)));
}

// (N, Lq, 1, L, 1, k) view of columns [from, from + k) of the reference
// points, in the coordinate dtype t.
Tensor ref_columns(const Tensor& ref, int64_t from, int64_t k, ScalarType t) {
  Tensor r = ref;
  r = to(torch::stable::narrow(r, r.dim() - 1, from, k), t);
  return torch::stable::unsqueeze(torch::stable::unsqueeze(r, 2), 4);
}

// (1, 1, 1, L, 1, 2) (W, H) of each level in dtype t.
Tensor level_wh(const Tensor& spatial_shapes, ScalarType t) {
  return view(to(call_op("aten::flip", "", spatial_shapes, Shape{-1}), t), {1, 1, 1, -1, 1, 2});
}

// The elementwise arithmetic of the composites: ATen's kernels, type
// promotion and broadcasting; a constant is a 0-d CPU tensor of the
// coordinate dtype t (ATen computes with it as with a Python number).
Tensor mul(const Tensor& a, const Tensor& b) { return call_op("aten::mul", "Tensor", a, b); }
Tensor div(const Tensor& a, const Tensor& b) { return call_op("aten::div", "Tensor", a, b); }
Tensor add(const Tensor& a, const Tensor& b) { return torch::stable::subtract(a, b, -1.0); }
Tensor constant(double v, ScalarType t) {
  return full({}, v, t, Device(torch::headeronly::DeviceType::CPU));
}

}  // namespace

FusedSizes check_fused_inputs(const Tensor& value, const Tensor& spatial_shapes,
                              const Tensor& reference_points,
                              const Tensor& sampling_offsets,
                              const Tensor& attention_logits) {
  check_dims(value, "value", {-1, -1, -1, -1}, "(N, S, M, D)");
  check_dims(spatial_shapes, "spatial_shapes", {-1, 2}, "(L, 2)");
  FusedSizes s{};
  s.coord = dtype_of(value) == kDouble ? kDouble : kFloat;
  s.N = value.size(0);
  s.M = value.size(2);
  s.L = spatial_shapes.size(0);
  MSDA_CHECK(reference_points.dim() == 4, kFusedOp,
              "reference_points must have 4 dimensions (N, Lq, L, 2) or (N, Lq, L, 4), got ",
              reference_points.dim(), " (shape ", shape_str(reference_points), ")");
  s.Lq = reference_points.size(1);
  const int64_t k = reference_points.size(3);
  MSDA_CHECK(k == 2 || k == 4, kFusedOp,
              "reference_points.size(3) must be 2 (points) or 4 (boxes cx, cy, w, h), got ", k);
  s.boxes = k == 4;
  check_dims(reference_points, "reference_points", {s.N, s.Lq, s.L, k},
             "(N, Lq, L, 2 or 4) with N = value.size(0), L = spatial_shapes.size(0)");
  MSDA_CHECK(sampling_offsets.dim() == 6, kFusedOp,
              "sampling_offsets must have 6 dimensions (N, Lq, M, L, P, 2), got ",
              sampling_offsets.dim(), " (shape ", shape_str(sampling_offsets), ")");
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
    MSDA_CHECK(t->device() == value.device(), kFusedOp, name,
               " must be on the same device as value (", device_name(value.device()), "), got ",
               device_name(t->device()));
  }
  return s;
}

namespace {

// The sampling locations (N, Lq, M, L, P, 2) and attention weights
// (N, Lq, M, L, P), in s.coord, as Deformable DETR's layer forms them: points
// ref + offset / (W, H) of the level; boxes ref_xy + offset / P * ref_wh *
// 0.5; weights the softmax of each (n, q, m)'s L P logits.
std::tuple<Tensor, Tensor> fused_locations_and_weights(
    const Tensor& spatial_shapes, const Tensor& reference_points,
    const Tensor& sampling_offsets, const Tensor& attention_logits, const FusedSizes& s) {
  Tensor loc;
  if (s.boxes) {
    // The reference module's order of operations: offset / P * wh * 0.5.
    const Tensor off = to(sampling_offsets, s.coord);
    loc = add(ref_columns(reference_points, 0, 2, s.coord),
              mul(mul(div(off, constant(static_cast<double>(s.P), s.coord)),
                      ref_columns(reference_points, 2, 2, s.coord)),
                  constant(0.5, s.coord)));
  } else {
    // ref + offset / (W, H), computed in the promoted dtype (16-bit offsets
    // are widened, not rounded, before the division).
    loc = to(add(ref_columns(reference_points, 0, 2, s.coord),
                 div(sampling_offsets, level_wh(spatial_shapes, s.coord))),
             s.coord);
  }
  const Tensor weights =
      view(call_op("aten::_softmax", "",
                   reshape(to(attention_logits, s.coord), {s.N, s.Lq, s.M, s.L * s.P}),
                   int64_t(-1), false),
           {s.N, s.Lq, s.M, s.L, s.P});
  return {loc, weights};
}

// Gradients of the raw inputs from those of the locations and weights (the
// chain rule of fused_locations_and_weights): grad_reference_points (only
// when `ref_grad`; undefined otherwise), grad_sampling_offsets,
// grad_attention_logits, each in its input's dtype and shape.
std::tuple<Tensor, Tensor, Tensor> fused_input_grads(
    const Tensor& spatial_shapes, const Tensor& reference_points,
    const Tensor& sampling_offsets, const Tensor& attention_logits,
    const Tensor& attention_weights, const Tensor& grad_locations,
    const Tensor& grad_weights, const FusedSizes& s, bool ref_grad) {
  // Softmax: dz = a * (g - sum(a g)) over each row of L P (one ATen kernel).
  const Tensor a = reshape(attention_weights, {s.N, s.Lq, s.M, s.L * s.P});
  const Tensor g = reshape(to(grad_weights, s.coord), {s.N, s.Lq, s.M, s.L * s.P});
  const Tensor grad_logits =
      to(view(call_op("aten::_softmax_backward_data", "", g, a, int64_t(-1), s.coord),
              sizes_of(attention_logits)),
         dtype_of(attention_logits));
  const Tensor gl = to(grad_locations, s.coord);
  auto sum_heads_points = [](const Tensor& t) {
    return torch::stable::sum(t, std::vector<int64_t>{2, 4});
  };
  Tensor grad_off, grad_ref;
  if (s.boxes) {
    const Tensor wh = ref_columns(reference_points, 2, 2, s.coord);
    const Tensor points = constant(static_cast<double>(s.P), s.coord);
    const Tensor half = constant(0.5, s.coord);
    grad_off = mul(mul(div(gl, points), wh), half);
    if (ref_grad) {
      // loc = xy + off / P * wh * 0.5: d/dxy sums over heads and points,
      // d/dwh sums gl * off / P * 0.5.
      const Tensor off = to(sampling_offsets, s.coord);
      const Tensor d_wh = mul(div(mul(gl, off), points), half);
      grad_ref = call_op("aten::cat", "",
                         std::vector<Tensor>{sum_heads_points(gl), sum_heads_points(d_wh)},
                         int64_t(-1));
    }
  } else {
    grad_off = div(gl, level_wh(spatial_shapes, s.coord));
    if (ref_grad) grad_ref = sum_heads_points(gl);
  }
  if (ref_grad) grad_ref = to(grad_ref, dtype_of(reference_points));
  return {grad_ref, to(grad_off, dtype_of(sampling_offsets)), grad_logits};
}

}  // namespace

Tensor fused_forward_formed(const FusedSizes& s, const Tensor& value,
                                const Tensor& spatial_shapes,
                                const Tensor& level_start_index,
                                const Tensor& reference_points,
                                const Tensor& sampling_offsets,
                                const Tensor& attention_logits, std::string_view backend,
                                std::optional<bool> deterministic,
                                const IntListOpt& spatial_shapes_list) {
  auto [loc, weights] = fused_locations_and_weights(spatial_shapes, reference_points,
                                                    sampling_offsets, attention_logits, s);
  return call_op("ms_deform_attn::ms_deform_attn", "", value, spatial_shapes, level_start_index,
                 loc, weights, std::string(backend), deterministic, spatial_shapes_list);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> fused_backward_formed(
    const FusedSizes& s, const Tensor& grad_output, const Tensor& value,
    const Tensor& spatial_shapes, const Tensor& level_start_index,
    const Tensor& reference_points, const Tensor& sampling_offsets,
    const Tensor& attention_logits, bool deterministic, bool ref_grad) {
  auto [loc, weights] = fused_locations_and_weights(spatial_shapes, reference_points,
                                                    sampling_offsets, attention_logits, s);
  auto [grad_value, grad_loc, grad_weights] = call_op<std::tuple<Tensor, Tensor, Tensor>>(
      "ms_deform_attn::_ms_deform_attn_backward", "", grad_output, value, spatial_shapes,
      level_start_index, loc, weights, deterministic);
  auto [grad_ref, grad_off, grad_logits] =
      fused_input_grads(spatial_shapes, reference_points, sampling_offsets, attention_logits,
                        weights, grad_loc, grad_weights, s, ref_grad);
  return {grad_value, grad_off, grad_logits, grad_ref};
}

std::tuple<Tensor, Tensor, Tensor> fused_input_grads_formed(
    const FusedSizes& s, const Tensor& grad_output, const Tensor& value,
    const Tensor& spatial_shapes, const Tensor& level_start_index,
    const Tensor& reference_points, const Tensor& sampling_offsets,
    const Tensor& attention_logits, bool deterministic) {
  auto [grad_value, grad_off, grad_logits, unused] =
      fused_backward_formed(s, grad_output, value, spatial_shapes, level_start_index,
                            reference_points, sampling_offsets, attention_logits, deterministic,
                            /*ref_grad=*/false);
  return {grad_value, grad_off, grad_logits};
}

namespace {

Tensor fused_forward_composite(const Tensor& value, const Tensor& spatial_shapes,
                                   const Tensor& level_start_index,
                                   const Tensor& reference_points,
                                   const Tensor& sampling_offsets,
                                   const Tensor& attention_logits, std::string_view backend,
                                   std::optional<bool> deterministic,
                                   const IntListOpt& spatial_shapes_list) {
  const FusedSizes s = check_fused_inputs(value, spatial_shapes, reference_points,
                                          sampling_offsets, attention_logits);
  return fused_forward_formed(s, value, spatial_shapes, level_start_index, reference_points,
                              sampling_offsets, attention_logits, backend, deterministic,
                              spatial_shapes_list);
}

std::tuple<Tensor, Tensor, Tensor> fused_backward_composite(
    const Tensor& grad_output, const Tensor& value, const Tensor& spatial_shapes,
    const Tensor& level_start_index, const Tensor& reference_points,
    const Tensor& sampling_offsets, const Tensor& attention_logits, bool deterministic) {
  const FusedSizes s = check_fused_inputs(value, spatial_shapes, reference_points,
                                          sampling_offsets, attention_logits);
  return fused_input_grads_formed(s, grad_output, value, spatial_shapes, level_start_index,
                                  reference_points, sampling_offsets, attention_logits,
                                  deterministic);
}

// The backward with the reference points' gradient (its sums over heads
// and points by ATen ops, on every device).
std::tuple<Tensor, Tensor, Tensor, Tensor> fused_backward_ref_composite(
    const Tensor& grad_output, const Tensor& value, const Tensor& spatial_shapes,
    const Tensor& level_start_index, const Tensor& reference_points,
    const Tensor& sampling_offsets, const Tensor& attention_logits, bool deterministic) {
  const FusedSizes s = check_fused_inputs(value, spatial_shapes, reference_points,
                                          sampling_offsets, attention_logits);
  return fused_backward_formed(s, grad_output, value, spatial_shapes, level_start_index,
                               reference_points, sampling_offsets, attention_logits,
                               deterministic, /*ref_grad=*/true);
}

// Every device; CUDA has its own kernels (cuda/msda_cuda.cpp), which form
// the locations and weights inside the `baseline` and `blocked` forwards
// and the backward's dots kernels, whichever grad_value path follows.
constexpr KernelEntry kKernels[] = {
    MSDA_KERNEL(fused_forward_composite, "CompositeExplicitAutograd", "ms_deform_attn_fused",
                &fused_forward_composite),
    MSDA_KERNEL(fused_backward_composite, "CompositeExplicitAutograd",
                "_ms_deform_attn_fused_backward", &fused_backward_composite),
    MSDA_KERNEL(fused_backward_ref_composite, "CompositeExplicitAutograd",
                "_ms_deform_attn_fused_backward_ref", &fused_backward_ref_composite),
};

}  // namespace

KernelTable composite_kernels() { return kKernels; }

}  // namespace msda
