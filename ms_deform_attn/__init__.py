"""Multi-Scale Deformable Attention as one PyTorch operator.

    from ms_deform_attn import ms_deform_attn
    out = ms_deform_attn(value, spatial_shapes, level_start_index,
                         sampling_locations, attention_weights)

Shapes: value (N, S, M, D), spatial_shapes (L, 2) int64 (H, W),
level_start_index (L,) int64, sampling_locations (N, Lq, M, L, P, 2) in
[0, 1] (x, y), attention_weights (N, Lq, M, L, P); output (N, Lq, M * D).
"""
import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))
# For C++ users: the CMake package, the public header, the operator library.
cmake_prefix_path = _os.path.join(_here, "share", "cmake")
include_path = _os.path.join(_here, "include")
library_path = _os.path.join(_here, "lib", "libms_deform_attn.so")

from . import _ops  # noqa: F401,E402  (loads the extension, registers the fake kernels)
from ._ops import (available_backends, backend_reason, cuda_archs, cuda_kernels_built,  # noqa: E402
                   ms_deform_attn, ms_deform_attn_fused, select_backend, select_backward_plan,
                   select_forward_plan)
from . import compat, nn, reference  # noqa: E402

# Also public, imported on demand: ms_deform_attn.hf (transformers),
# ms_deform_attn.onnx (export), ms_deform_attn.distributed (DTensor rules). ms_deform_attn.testing holds the canonical
# workloads for the tests and benchmarks.
__all__ = ["ms_deform_attn", "ms_deform_attn_fused", "available_backends", "select_backend",
           "backend_reason", "select_forward_plan", "select_backward_plan", "cuda_kernels_built", "cuda_archs", "nn", "compat",
           "reference", "cmake_prefix_path", "include_path", "library_path"]
__version__ = "0.1.0"


def __getattr__(name):
    # `layers`, the kernels layout's module (ms_deform_attn/layers.py), on
    # first use: it imports ms_deform_attn.hf.
    if name == "layers":
        import importlib
        return importlib.import_module(f"{__name__}.layers")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
