"""DTensor sharding rules for the operators: how they run when their
inputs are distributed tensors (torch.distributed.tensor), registered with
PyTorch's custom-op sharding API when this package is imported.

A sample's result depends on its own (batch, query, head) row and on the
value map of its batch and head, so three layouts need no communication:

- queries sharded: the locations and weights (and the fused operator's
  reference points, offsets and logits) Shard(1), value and the level
  tensors replicated; the output is Shard(1). Its backward's grad_value is
  a partial sum (each rank's queries add into the whole map), reduced where
  the mesh needs it;
- batch sharded: every batched input Shard(0); every result Shard(0);
- heads sharded: value, locations and weights Shard(2) (heads divisible by
  the mesh size); the output, (N, Lq, M * D), is Shard(2).

Inputs in any other layout are redistributed to one of these (or to
replicated) by DTensor; the level shapes and starts are always replicated.
docs/usage.md shows the query-sharded encoder.
"""
from __future__ import annotations

import torch

__all__ = ["register"]


def _placements():
    from torch.distributed.tensor import Partial, Replicate, Shard
    return Partial, Replicate, Shard

def _forward_rule(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                  backend="auto", deterministic=None, spatial_shapes_list=None):
    """ms_deform_attn's layouts: (output placements, input placements)."""
    _, Replicate, Shard = _placements()
    r, rest = Replicate(), [None, None, None]
    return [
        ([r], [r, r, r, r, r] + rest),
        ([Shard(1)], [r, r, r, Shard(1), Shard(1)] + rest),
        ([Shard(0)], [Shard(0), r, r, Shard(0), Shard(0)] + rest),
        ([Shard(2)], [Shard(2), r, r, Shard(2), Shard(2)] + rest),
    ]

def _backward_rule(grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                   attention_weights, deterministic=False):
    """_ms_deform_attn_backward's: grad_value, grad locations, grad weights."""
    Partial, Replicate, Shard = _placements()
    r = Replicate()
    return [
        ([r, r, r], [r, r, r, r, r, r, None]),
        ([Partial(), Shard(1), Shard(1)], [Shard(1), r, r, r, Shard(1), Shard(1), None]),
        ([Shard(0), Shard(0), Shard(0)], [Shard(0), Shard(0), r, r, Shard(0), Shard(0), None]),
        ([Shard(2), Shard(2), Shard(2)], [Shard(2), Shard(2), r, r, Shard(2), Shard(2), None]),
    ]

def _fused_forward_rule(value, spatial_shapes, level_start_index, reference_points,
                        sampling_offsets, attention_logits, backend="auto", deterministic=None,
                        spatial_shapes_list=None):
    """ms_deform_attn_fused's (reference points (N, Lq, L, 2 | 4) carry no head)."""
    _, Replicate, Shard = _placements()
    r, rest = Replicate(), [None, None, None]
    return [
        ([r], [r, r, r, r, r, r] + rest),
        ([Shard(1)], [r, r, r, Shard(1), Shard(1), Shard(1)] + rest),
        ([Shard(0)], [Shard(0), r, r, Shard(0), Shard(0), Shard(0)] + rest),
        ([Shard(2)], [Shard(2), r, r, r, Shard(2), Shard(2)] + rest),
    ]

def _fused_backward_rule(grad_output, value, spatial_shapes, level_start_index, reference_points,
                         sampling_offsets, attention_logits, deterministic=False, *, with_ref=False):
    Partial, Replicate, Shard = _placements()
    r = Replicate()
    # The reference points' gradient sums over heads: a partial sum where
    # the heads are sharded.
    ref = [[r], [Shard(1)], [Shard(0)], [Partial()]] if with_ref else [[], [], [], []]
    return [
        ([r, r, r] + ref[0], [r, r, r, r, r, r, r, None]),
        ([Partial(), Shard(1), Shard(1)] + ref[1],
         [Shard(1), r, r, r, Shard(1), Shard(1), Shard(1), None]),
        ([Shard(0), Shard(0), Shard(0)] + ref[2],
         [Shard(0), Shard(0), r, r, Shard(0), Shard(0), Shard(0), None]),
        ([Shard(2), Shard(2), Shard(2)] + ref[3],
         [Shard(2), Shard(2), r, r, r, Shard(2), Shard(2), None]),
    ]

def _fused_backward_ref_rule(*args, **kwargs):
    return _fused_backward_rule(*args, with_ref=True, **kwargs)

def register() -> bool:
    """Registers the rules (once); False where this torch has no DTensor."""
    if getattr(register, "done", False):
        return True
    try:
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:
        return False
    lib = torch.ops.ms_deform_attn
    register_sharding(lib.ms_deform_attn.default)(_forward_rule)
    register_sharding(lib._ms_deform_attn_backward.default)(_backward_rule)
    register_sharding(lib.ms_deform_attn_fused.default)(_fused_forward_rule)
    register_sharding(lib._ms_deform_attn_fused_backward.default)(_fused_backward_rule)
    register_sharding(lib._ms_deform_attn_fused_backward_ref.default)(_fused_backward_ref_rule)
    register.done = True
    return True
