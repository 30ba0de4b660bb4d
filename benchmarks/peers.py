"""The peers the benchmark times beside ours, when they are installed.

Each entry: a factory that imports the peer and returns a callable with our
operator's arguments (value, spatial_shapes, level_start_index, locations,
weights), the dtypes it takes its locations and weights in (benchmarks.run
converts the inputs once, before timing, so that no cast is timed), and
which value dtypes it runs. Every peer is timed like ours, as CUDA-graph
replays; one whose calls fail to capture is timed between CUDA events, and
the row says so (its `method`). benchmarks.run asks for every name here; a
peer that fails to import is skipped with a note in the results.
docs/development.md says how to install each on the GPU machine (no network
there: carry them).

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


# What a peer takes its sampling locations and attention weights in: "fp32",
# or "value" (value's dtype).
AS_GIVEN, AS_VALUE = "fp32", "value"


@dataclass(frozen=True)
class Peer:
    make: Callable[[], Callable]
    dtypes: FrozenSet[str] = field(default_factory=lambda: frozenset({"fp32", "bf16", "fp16"}))
    locations: str = AS_GIVEN
    weights: str = AS_GIVEN

    def prepare(self, inputs):
        """The inputs in the dtypes this peer takes (value, shapes, start,
        locations, weights), new leaves where a cast was needed, so that
        gradients are taken with respect to what the peer was given."""
        value, shapes, start, loc, attn = inputs

        def cast(t, how):
            if how == AS_GIVEN or t.dtype == value.dtype:
                return t
            return t.detach().to(value.dtype).requires_grad_(t.requires_grad)
        return [value, shapes, start, cast(loc, self.locations), cast(attn, self.weights)]


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
    from msda_triton import multi_scale_deformable_attention
    return multi_scale_deformable_attention


def _deformops(backend: str):
    def make():
        from deformops.registry import Backend, msda

        chosen = None if backend == "auto" else getattr(Backend, backend)
        if chosen is not None and hasattr(msda, "load"):
            msda.load(chosen)  # compile or load its kernel library now, not in the first call

        def fn(value, shapes, start, loc, attn):
            return msda(value, shapes, start, loc, attn, backend=chosen)
        return fn
    return make


PEERS: Dict[str, Peer] = {
    # Locations and weights in value's dtype (16-bit locations: its errors).
    "triton": Peer(_triton, locations=AS_VALUE, weights=AS_VALUE),
    "original": Peer(_original, dtypes=frozenset({"fp32"})),
    "mmcv": Peer(_mmcv),
    # Weights in value's dtype; locations may stay fp32.
    "deformops": Peer(_deformops("auto"), weights=AS_VALUE),
    "deformops-triton": Peer(_deformops("TRITON"), weights=AS_VALUE),
    "deformops-cuda": Peer(_deformops("CUDA"), weights=AS_VALUE),
}
