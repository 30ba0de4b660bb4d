"""Multi-Scale Deformable Attention as one PyTorch operator.

    from ms_deform_attn import ms_deform_attn
    out = ms_deform_attn(value, spatial_shapes, level_start_index,
                         sampling_locations, attention_weights)

Shapes: value (N, S, M, D), spatial_shapes (L, 2) int64 (H, W),
level_start_index (L,) int64, sampling_locations (N, Lq, M, L, P, 2) in
[0, 1] (x, y), attention_weights (N, Lq, M, L, P); output (N, Lq, M * D).
"""
from . import _ops  # noqa: F401  (loads the extension, registers fake and autograd)
from ._ops import available_backends, backend_reason, ms_deform_attn, select_backend
from . import compat, nn, reference, workloads

__all__ = ["ms_deform_attn", "available_backends", "select_backend", "backend_reason",
           "reference", "nn", "compat", "workloads"]
__version__ = "0.1.0"
