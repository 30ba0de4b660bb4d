// The fused operator ms_deform_attn_fused: the attention layer's raw outputs
// (reference points, sampling offsets, attention logits) in, the sampling
// locations and the softmax formed inside the operator in fp32 (fp64 for
// fp64 values). Its autograd (csrc/layer/autograd.cpp) keeps those raw
// inputs, not the N x Lq x M x L x P locations and weights; its backward
// (_ms_deform_attn_fused_backward) forms them again.
#pragma once

#include <optional>
#include <string_view>
#include <tuple>

#include "../binding/tensor.h"

namespace msda {

// Sizes of a fused call, checked: value (N, S, M, D), reference_points
// (N, Lq, L, 2) points or (N, Lq, L, 4) boxes (cx, cy, w, h),
// sampling_offsets (N, Lq, M, L, P, 2), attention_logits (N, Lq, M, L P) or
// (N, Lq, M, L, P). Bad input throws an error naming the argument, the
// expected and the actual value.
struct FusedSizes {
  int64_t N, Lq, M, L, P;
  bool boxes;
  ScalarType coord;  // of the locations and weights: fp64 for fp64 values, else fp32
};
FusedSizes check_fused_inputs(const Tensor& value, const Tensor& spatial_shapes,
                              const Tensor& reference_points,
                              const Tensor& sampling_offsets,
                              const Tensor& attention_logits);

// The forward from ATen ops (through the dispatcher), on inputs check_fused_inputs() passed as s: the
// locations and weights formed as tensors, then ms_deform_attn (every
// device; the CUDA kernels' fallback where the `baseline` and `blocked`
// forwards and the backward's dots kernels do not form them themselves).
Tensor fused_forward_formed(const FusedSizes& s, const Tensor& value,
                                const Tensor& spatial_shapes,
                                const Tensor& level_start_index,
                                const Tensor& reference_points,
                                const Tensor& sampling_offsets,
                                const Tensor& attention_logits, std::string_view backend,
                                std::optional<bool> deterministic,
                                const IntListOpt& spatial_shapes_list);

// The backward likewise: locations and weights formed again, then
// _ms_deform_attn_backward and the chain rule (fused_input_grads). Returns
// grad_value, grad_sampling_offsets, grad_attention_logits and (only when
// `ref_grad`; undefined otherwise) grad_reference_points.
std::tuple<Tensor, Tensor, Tensor, Tensor> fused_backward_formed(
    const FusedSizes& s, const Tensor& grad_output, const Tensor& value,
    const Tensor& spatial_shapes, const Tensor& level_start_index,
    const Tensor& reference_points, const Tensor& sampling_offsets,
    const Tensor& attention_logits, bool deterministic, bool ref_grad);

// fused_backward_formed without the reference points' gradient: the three
// gradients _ms_deform_attn_fused_backward returns.
std::tuple<Tensor, Tensor, Tensor> fused_input_grads_formed(
    const FusedSizes& s, const Tensor& grad_output, const Tensor& value,
    const Tensor& spatial_shapes, const Tensor& level_start_index,
    const Tensor& reference_points, const Tensor& sampling_offsets,
    const Tensor& attention_logits, bool deterministic);

}  // namespace msda
