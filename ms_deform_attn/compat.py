"""Call-compatible entry points for code written against the original
Deformable DETR op (also used by DINO, detrex and DN-DETR) and mmcv.

    from ms_deform_attn.compat import MSDeformAttnFunction
    out = MSDeformAttnFunction.apply(value, shapes, level_start_index,
                                     sampling_locations, attention_weights, im2col_step)

`im2col_step` is accepted and ignored: the operator has no batch
divisibility limit.
"""
from __future__ import annotations

import torch

from ._ops import ms_deform_attn

__all__ = ["MSDeformAttnFunction", "MultiScaleDeformableAttnFunction", "level_start_index",
           "multi_scale_deformable_attn_pytorch"]


class MSDeformAttnFunction:
    """Stand-in for the original `MSDeformAttnFunction` (an autograd.Function):
    `.apply(...)` with the same arguments; gradients come from the operator's
    registered autograd."""

    @staticmethod
    def apply(value, value_spatial_shapes, value_level_start_index, sampling_locations,
              attention_weights, im2col_step=64):
        return ms_deform_attn(value, value_spatial_shapes, value_level_start_index,
                              sampling_locations, attention_weights)


# mmcv's name for the same function (mmcv.ops.multi_scale_deform_attn).
MultiScaleDeformableAttnFunction = MSDeformAttnFunction


def level_start_index(value_spatial_shapes: torch.Tensor) -> torch.Tensor:
    """Exclusive cumulative sum of H * W, computed on the shapes' device (no sync)."""
    areas = value_spatial_shapes[:, 0] * value_spatial_shapes[:, 1]
    return torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])


def multi_scale_deformable_attn_pytorch(value, value_spatial_shapes, sampling_locations,
                                        attention_weights):
    """mmcv's `multi_scale_deformable_attn_pytorch(value, value_spatial_shapes,
    sampling_locations, attention_weights)` signature, on this package's
    operator. `value_spatial_shapes` may be an (L, 2) tensor or a list of (H, W)
    (then also handed to the operator as its host-side `spatial_shapes_list`)."""
    shapes_list = None
    if not torch.is_tensor(value_spatial_shapes):
        shapes_list = [(int(h), int(w)) for h, w in value_spatial_shapes]
        value_spatial_shapes = torch.as_tensor(shapes_list, dtype=torch.long, device=value.device)
    return ms_deform_attn(value, value_spatial_shapes, level_start_index(value_spatial_shapes),
                          sampling_locations, attention_weights, spatial_shapes_list=shapes_list)
