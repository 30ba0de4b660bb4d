// The fused operator ms_deform_attn_fused: the attention layer's raw outputs
// (reference points, sampling offsets, attention logits) in, the sampling
// locations and the softmax formed inside the operator in fp32 (fp64 for
// fp64 values). Its autograd (autograd/autograd.cpp) keeps those raw
// inputs, not the N x Lq x M x L x P locations and weights, and forms them
// again for the backward.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/OptionalArrayRef.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace msda {

// Sizes of a fused call, checked: value (N, S, M, D), reference_points
// (N, Lq, L, 2) points or (N, Lq, L, 4) boxes (cx, cy, w, h),
// sampling_offsets (N, Lq, M, L, P, 2), attention_logits (N, Lq, M, L P) or
// (N, Lq, M, L, P). Bad input throws c10::Error naming the argument, the
// expected and the actual value.
struct FusedSizes {
  int64_t N, Lq, M, L, P;
  bool boxes;
  at::ScalarType coord;  // of the locations and weights: fp64 for fp64 values, else fp32
};
FusedSizes check_fused_inputs(const at::Tensor& value, const at::Tensor& spatial_shapes,
                              const at::Tensor& reference_points,
                              const at::Tensor& sampling_offsets,
                              const at::Tensor& attention_logits);

// The sampling locations (N, Lq, M, L, P, 2) and attention weights
// (N, Lq, M, L, P), in s.coord, as Deformable DETR's layer forms them: points
// ref + offset / (W, H) of the level; boxes ref_xy + offset / P * ref_wh *
// 0.5; weights the softmax of each (n, q, m)'s L P logits.
std::tuple<at::Tensor, at::Tensor> fused_locations_and_weights(
    const at::Tensor& spatial_shapes, const at::Tensor& reference_points,
    const at::Tensor& sampling_offsets, const at::Tensor& attention_logits, const FusedSizes& s);

// Gradients of the raw inputs from those of the locations and weights (the
// chain rule of fused_locations_and_weights): grad_reference_points (only
// when `ref_grad`; undefined otherwise), grad_sampling_offsets,
// grad_attention_logits, each in its input's dtype and shape.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_input_grads(
    const at::Tensor& spatial_shapes, const at::Tensor& reference_points,
    const at::Tensor& sampling_offsets, const at::Tensor& attention_logits,
    const at::Tensor& attention_weights, const at::Tensor& grad_locations,
    const at::Tensor& grad_weights, const FusedSizes& s, bool ref_grad);

// The forward from ATen ops: the locations and weights formed as tensors,
// then ms_deform_attn (every device; the CUDA kernel's fallback where the
// baseline kernel does not form them itself).
at::Tensor fused_forward_composite(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                   const at::Tensor& level_start_index,
                                   const at::Tensor& reference_points,
                                   const at::Tensor& sampling_offsets,
                                   const at::Tensor& attention_logits, c10::string_view backend,
                                   std::optional<bool> deterministic,
                                   at::OptionalIntArrayRef spatial_shapes_list);

}  // namespace msda
