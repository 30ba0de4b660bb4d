// ms_deform_attn: Multi-Scale Deformable Attention (Deformable DETR, eq. 2)
// for C++ (LibTorch) programs.
//
// Link the target ms_deform_attn::ms_deform_attn of the CMake package
// (find_package(ms_deform_attn); see the README). The functions below call the
// registered operator ms_deform_attn::ms_deform_attn through the dispatcher,
// so CPU and CUDA kernels, autograd (tensor.backward() gives grad_value,
// grad of the sampling locations and of the attention weights) and autocast
// work as from Python; the backward is the same one Python uses.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/OptionalArrayRef.h>

#include <optional>
#include <string>
#include <vector>

#include "ms_deform_attn/version.h"

namespace ms_deform_attn {

// out[n, q, m, :] = sum over levels l and points p of
//   attention_weights[n, q, m, l, p] * bilinear(value level l, sampling_locations[n, q, m, l, p])
// (F.grid_sample's bilinear, zeros padding, align_corners=False).
//
//   value               (N, S, M, D) float32, float16, bfloat16 or float64; read in
//                       place when contiguous or head-major (the transpose(1, 2)
//                       view of a contiguous (N, M, S, D) tensor, whose gradient
//                       comes back in that layout), else copied
//   spatial_shapes      (L, 2) int64, (H, W) of each level, on value's device
//   level_start_index   (L,) int64, the exclusive cumulative sum of H * W
//   sampling_locations  (N, Lq, M, L, P, 2) normalised (x, y), value's dtype or float32
//   attention_weights   (N, Lq, M, L, P), value's dtype or float32
//   backend             "auto" or a name from available_backends()
//   deterministic       bitwise reproducible backward (default: follow
//                       at::globalContext().deterministicAlgorithms())
//   spatial_shapes_list the level shapes on the host, flattened {H0, W0, H1, W1, ...};
//                       optional (checked without a sync; the CUDA `tma` backend needs it)
// Returns (N, Lq, M * D) in value's dtype. Bad input throws c10::Error naming
// the argument, the expected and the actual value.
MS_DEFORM_ATTN_API at::Tensor ms_deform_attn(
    const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights, const std::string& backend = "auto",
    std::optional<bool> deterministic = std::nullopt,
    at::OptionalIntArrayRef spatial_shapes_list = std::nullopt);

// The same, from the attention layer's raw outputs: the sampling locations
// and the softmax are formed inside the operator in fp32, and autograd keeps
// these inputs instead of the N x Lq x M x L x P locations and weights.
//
//   reference_points    (N, Lq, L, 2) normalised points (x, y): location =
//                       point + offset / (W, H) of the level; or (N, Lq, L, 4)
//                       boxes (cx, cy, w, h): location = (cx, cy) + offset / P
//                       * (w, h) * 0.5 (Deformable DETR's two forms)
//   sampling_offsets    (N, Lq, M, L, P, 2)
//   attention_logits    (N, Lq, M, L * P) or (N, Lq, M, L, P): weights =
//                       their softmax over the L * P of each (n, q, m)
// Any floating dtypes (16-bit ones as a linear layer makes them under
// autocast); the other arguments as above. Gradients come back in each
// input's dtype.
MS_DEFORM_ATTN_API at::Tensor ms_deform_attn_fused(
    const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& reference_points,
    const at::Tensor& sampling_offsets, const at::Tensor& attention_logits,
    const std::string& backend = "auto", std::optional<bool> deterministic = std::nullopt,
    at::OptionalIntArrayRef spatial_shapes_list = std::nullopt);

// Backends that can run on `device` (its kind and architecture, this build),
// in the order "auto" prefers them.
MS_DEFORM_ATTN_API std::vector<std::string> available_backends(c10::Device device);

// The backend "auto" picks for these inputs; throws for invalid inputs.
MS_DEFORM_ATTN_API std::string select_backend(
    const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights,
    at::OptionalIntArrayRef spatial_shapes_list = std::nullopt);

// Why `backend` cannot run these inputs, or "" when it can; throws for
// invalid inputs.
MS_DEFORM_ATTN_API std::string backend_reason(
    const std::string& backend, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights,
    at::OptionalIntArrayRef spatial_shapes_list = std::nullopt);

}  // namespace ms_deform_attn
