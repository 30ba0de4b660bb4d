"""The peers the benchmark times beside ours, when they are installed.

Each entry: a factory that imports the peer and returns a callable with our
operator's arguments (value, spatial_shapes, level_start_index, locations,
weights), whether its calls can be captured in a CUDA graph (then it is
timed like ours: graph replays), and which value dtypes it takes.
benchmarks.run asks for every name here; a peer that fails to import is
skipped with a note in the results. docs/development.md says how to install
each on the GPU machine (no network there: carry them).

  triton            roulbac/msda-triton (two Python files; `msda_triton` on the path)
  original          Deformable DETR's models/ops (`MultiScaleDeformableAttention`), fp32 only
  mmcv              mmcv.ops.multi_scale_deform_attn (a CUDA build of mmcv)
  deformops         deformops (PyPI), its own backend choice (backend=None)
  deformops-triton  deformops' Triton kernels
  deformops-cuda    deformops' CUDA kernels (compiled at first use: DEFORMOPS_COMPILE=1)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet


@dataclass(frozen=True)
class Peer:
    make: Callable[[], Callable]
    graph: bool = False  # launches capture in a CUDA graph: timed as replays, like ours
    dtypes: FrozenSet[str] = field(default_factory=lambda: frozenset({"fp32", "bf16", "fp16"}))


def _mmcv():
    from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttnFunction

    def fn(value, shapes, start, loc, attn):
        return MultiScaleDeformableAttnFunction.apply(value, shapes, start, loc, attn, 64)
    return fn


def _original():
    import torch
    import MultiScaleDeformableAttention as MSDA  # the Deformable DETR extension

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, value, shapes, start, loc, attn):
            ctx.save_for_backward(value, shapes, start, loc, attn)
            return MSDA.ms_deform_attn_forward(value, shapes, start, loc, attn, 64)

        @staticmethod
        def backward(ctx, grad):
            value, shapes, start, loc, attn = ctx.saved_tensors
            gv, gl, ga = MSDA.ms_deform_attn_backward(value, shapes, start, loc, attn,
                                                      grad.contiguous(), 64)
            return gv, None, None, gl, ga

    return _Fn.apply


def _triton():
    # It takes locations and weights in value's dtype, so 16-bit runs
    # include their cast (a small kernel).
    from msda_triton import multi_scale_deformable_attention as triton_msda

    def fn(value, shapes, start, loc, attn):
        return triton_msda(value, shapes, start, loc.to(value.dtype), attn.to(value.dtype))
    return fn


def _deformops(backend: str):
    def make():
        from deformops.registry import Backend, msda

        chosen = None if backend == "auto" else getattr(Backend, backend)

        # Its weights must have value's dtype (16-bit runs include the cast);
        # locations may stay fp32.
        def fn(value, shapes, start, loc, attn):
            return msda(value, shapes, start, loc, attn.to(value.dtype), backend=chosen)
        return fn
    return make


PEERS: Dict[str, Peer] = {
    "triton": Peer(_triton, graph=True),
    "original": Peer(_original, dtypes=frozenset({"fp32"})),
    "mmcv": Peer(_mmcv),
    "deformops": Peer(_deformops("auto")),
    "deformops-triton": Peer(_deformops("TRITON")),
    "deformops-cuda": Peer(_deformops("CUDA")),
}
