"""Pure-PyTorch multi-scale deformable attention built on F.grid_sample.

The yardstick the tests and benchmarks compare every kernel with: call it on
float64 inputs for a reference. It runs on any device and is differentiable
through PyTorch's own autograd. It reads spatial_shapes on the host.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def ms_deform_attn_pytorch(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
) -> torch.Tensor:
    """Same semantics as ms_deform_attn.ms_deform_attn; computes in value's dtype."""
    n, _, m, d = value.shape
    _, lq, _, n_levels, n_points, _ = sampling_locations.shape
    shapes = spatial_shapes.tolist()
    starts = level_start_index.tolist()
    dtype = value.dtype
    # grid_sample's grid lives in [-1, 1]; (N, Lq, M, L, P, 2) -> per level (N*M, Lq, P, 2).
    grid = (2 * sampling_locations.to(dtype) - 1).transpose(1, 2).flatten(0, 1)
    sampled = []
    for lvl, ((h, w), start) in enumerate(zip(shapes, starts)):
        # (N, H*W, M, D) -> (N*M, D, H, W)
        v = value[:, start:start + h * w].permute(0, 2, 3, 1).reshape(n * m, d, h, w)
        # A contiguous grid: torch 2.14's CPU grid_sample returns NaN for a
        # strided bf16 one.
        sampled.append(
            F.grid_sample(v.contiguous(), grid[:, :, lvl].contiguous(), mode="bilinear",
                          padding_mode="zeros", align_corners=False)
        )  # (N*M, D, Lq, P)
    stacked = torch.cat(sampled, dim=-1)  # (N*M, D, Lq, L*P), level-major like the weights
    weights = attention_weights.to(dtype).transpose(1, 2).reshape(n * m, 1, lq, n_levels * n_points)
    out = (stacked * weights).sum(-1)  # (N*M, D, Lq)
    return out.view(n, m * d, lq).transpose(1, 2).contiguous()
