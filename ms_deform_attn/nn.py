"""Drop-in modules.

`MSDeformAttn` is the Deformable DETR module (models/ops/modules/ms_deform_attn.py
there): the same parameter names and shapes (so a state_dict loads with
strict=True), the same initialisation and the same forward signature, running
on this package's operator.
"""
from __future__ import annotations

import math
import warnings
from contextlib import nullcontext
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ._ops import ms_deform_attn, ms_deform_attn_fused

__all__ = ["MSDeformAttn", "sampling_locations"]


def _linear(module: nn.Module, x: torch.Tensor, fast: bool = True) -> torch.Tensor:
    """module(x) for the attention layers' linears. With `fast` (the layers'
    `fast_linears` option), a plain nn.Linear (no hooks, not a subclass) on
    CUDA runs as ms_deform_attn::_linear: torch's linear forward and
    backward, but the bias gradient is one read of the output gradient at
    the copy rate (torch's sum over its rows runs far below it:
    docs/performance.md). Anything else, and traced, compiled or exported
    code (where the compiler makes its own reduction), calls the module."""
    if (fast and type(module) is nn.Linear and x.is_cuda and not module._forward_hooks
            and not module._forward_pre_hooks and not _global_module_hooks()
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and not torch.jit.is_scripting() and not torch.onnx.is_in_onnx_export()):
        return torch.ops.ms_deform_attn._linear(x, module.weight, module.bias)
    return module(x)


def _fast_linears(layer: nn.Module) -> bool:
    """A layer's `fast_linears` option: MSDeformAttn's attribute, or the one
    swap_msda sets on transformers' layers; True where unset (a layer
    pickled before the option existed)."""
    return getattr(layer, "fast_linears", getattr(layer, "_msda_fast_linears", True))


def _global_module_hooks() -> bool:
    from torch.nn.modules import module as m
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks)


def _plain(module: nn.Module) -> bool:
    """Whether `module` is an nn.Linear that F.linear on its parameters
    reproduces: not a subclass, no hooks."""
    return (type(module) is nn.Linear and not module._forward_hooks
            and not module._forward_pre_hooks and not _global_module_hooks())


class _Remake:
    """A tensor autograd would keep for the backward, kept instead as the
    function that forms it again."""
    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], torch.Tensor]):
        self.fn = fn


def _cast_linear(module: nn.Linear, x: torch.Tensor, dtype: torch.dtype):
    """x, module's weight and its bias (or None) in `dtype`: autocast's casts
    made by hand (a no-op where a tensor has the dtype already)."""
    bias = None if module.bias is None else module.bias.to(dtype)
    return x.to(dtype), module.weight.to(dtype), bias


def _remake_linear(module: nn.Linear, x: torch.Tensor, dtype: torch.dtype,
                   finish: Callable[[torch.Tensor], torch.Tensor]):
    """module(x) as project() formed it, in `dtype` (autocast's casts of x,
    where it is not cast already, and of the parameters are made again),
    then finish()."""
    def fn():
        return finish(F.linear(*_cast_linear(module, x, dtype)))
    return fn


class _HeadMajorProjection(torch.autograd.Function):
    """value = x W^T + b with x (N, S, C), written head-major: (N, M, S, D)
    storage, returned as its (N, S, M, D) view, which the operator reads in
    place. One batched GEMM a batch entry (the heads the batch, x shared at
    batch stride 0), the bias added in place. Its backward copies the
    head-major gradient to (N S, M D) once and forms linear's three
    gradients from it."""

    @staticmethod
    def forward(ctx, x, weight, bias, heads):
        n, s, c = x.shape
        d = weight.shape[0] // heads
        wt = weight.view(heads, d, c).transpose(1, 2)
        b = None if bias is None else bias.view(1, heads, 1, d)
        if torch.compiler.is_compiling():
            # Traced (compile, export): no out= (export refuses it with grad
            # on) and no in-place add; the compiler places the products.
            out = torch.stack([torch.bmm(x[i].expand(heads, s, c), wt) for i in range(n)])
            out = out if b is None else out + b
        else:
            out = x.new_empty(n, heads, s, d)
            for i in range(n):
                torch.bmm(x[i].expand(heads, s, c), wt, out=out[i])
            if b is not None:
                out.add_(b)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        n, s, heads, d = grad.shape
        g = grad.reshape(n * s, heads * d)
        gx = (g @ weight).view(n, s, -1) if ctx.needs_input_grad[0] else None
        gw = g.t() @ x.reshape(n * s, -1) if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def _head_major_linear(module: nn.Linear, x: torch.Tensor, heads: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """module(x) (x (N, S, C), module an nn.Linear) in `dtype` (autocast's
    dtype where it casts), written head-major: the (N, S, M, D) view of a
    contiguous (N, M, S, D) tensor (_HeadMajorProjection)."""
    with torch.autocast(x.device.type, enabled=False):
        return _HeadMajorProjection.apply(*_cast_linear(module, x, dtype), heads)


def _recomputing(remakes: Sequence[Tuple[torch.Tensor, Callable[[], torch.Tensor]]]):
    """A context under which autograd, saving a tensor of `remakes` ((tensor,
    fn) pairs) for the backward, keeps fn instead and calls it at the
    backward: the operator's value, offsets and logits are formed again from
    the projections' inputs (which their linears keep anyway) by three GEMMs
    instead of being held from the forward to the backward."""
    if not remakes:
        return nullcontext()
    # By id, so that the hooks (which autograd may keep beyond the context)
    # hold no reference to the tensors; they are alive while being packed,
    # so no other object has their id then.
    by_id = {id(t): fn for t, fn in remakes}

    def pack(t):
        fn = by_id.get(id(t))
        # Others detached: an output saved by its own node, kept as itself,
        # would hold that node, which holds it (a cycle keeping the graph).
        return t.detach() if fn is None else _Remake(fn)

    def unpack(x):
        return x.fn() if isinstance(x, _Remake) else x

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _project(layer: nn.Module, query: torch.Tensor, input_flatten: torch.Tensor,
            padding_mask: Optional[torch.Tensor] = None, recompute: bool = False):
    """The three projections of an attention layer with Deformable DETR's
    linears and sizes (MSDeformAttn, transformers' layer): value (N, S, M, D),
    zero at padding (padding_mask (N, S) True), head-major when the layer's
    `value_layout` is "head_major" (_head_major_linear), sampling offsets
    (N, Lq, M, L, P, 2) and attention logits (N, Lq, M, L * P). Under
    autocast the query is cast once for the offsets' and the logits' linears
    (autocast would cast a non-leaf query once for each, and keep both
    casts for the backward).

    Returns (value, offsets, logits, remakes): with `recompute`, where
    autograd records and the three linears are plain nn.Linear, remakes pairs
    each of the three with the function that forms it again (_recomputing());
    else it is empty."""
    n, lq, _ = query.shape
    s = input_flatten.shape[1]
    kind = query.device.type
    # The dtypes the linears run in: autocast casts every floating input but
    # float64.
    autocast = torch.is_autocast_enabled(kind)
    low = torch.get_autocast_dtype(kind) if autocast else None
    q_dtype, v_dtype = (low if autocast and x.dtype != torch.float64 else x.dtype
                        for x in (query, input_flatten))
    if autocast and query.dtype == torch.float32:
        query = query.to(low)
    if (recompute and autocast and input_flatten.dtype == torch.float32
            and not (input_flatten.is_leaf and input_flatten.requires_grad)):
        # The cast value_proj's remake reads (its linear keeps it anyway). A
        # leaf's cast autocast makes once and caches for every layer that
        # reads it; the remake casts it again.
        input_flatten = input_flatten.to(low)
    heads, d_head = layer.n_heads, layer.d_model // layer.n_heads
    head_major = (getattr(layer, "value_layout", "standard") == "head_major"
                  and type(layer.value_proj) is nn.Linear)

    def value_of(v):
        if head_major:  # masked in its (N, M, S, D) storage order, which the result keeps
            if padding_mask is not None:
                v = v.transpose(1, 2).masked_fill(padding_mask[:, None, :, None], 0.0).transpose(1, 2)
            return v
        if padding_mask is not None:
            v = v.masked_fill(padding_mask[..., None], 0.0)
        return v.view(n, s, heads, d_head)

    def offsets_of(o):
        return o.view(n, lq, heads, layer.n_levels, layer.n_points, 2)

    def logits_of(a):
        return a.view(n, lq, heads, layer.n_levels * layer.n_points)

    def head_major_value():
        return value_of(_head_major_linear(layer.value_proj, input_flatten, heads, v_dtype))

    fast = _fast_linears(layer)
    value = (head_major_value() if head_major
             else value_of(_linear(layer.value_proj, input_flatten, fast)))
    offsets = offsets_of(_linear(layer.sampling_offsets, query, fast))
    logits = logits_of(_linear(layer.attention_weights, query, fast))
    remakes = []
    mods = (layer.value_proj, layer.sampling_offsets, layer.attention_weights)
    if (recompute and torch.is_grad_enabled() and all(_plain(m) for m in mods)
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and not torch.jit.is_scripting() and not torch.onnx.is_in_onnx_export()):
        # Under a compiler its partitioner chooses what to keep.
        value_remake = (head_major_value if head_major
                        else _remake_linear(layer.value_proj, input_flatten, v_dtype, value_of))
        remakes = [(value, value_remake),
                   (offsets, _remake_linear(layer.sampling_offsets, query, q_dtype, offsets_of)),
                   (logits, _remake_linear(layer.attention_weights, query, q_dtype, logits_of))]
    return value, offsets, logits, remakes


class MSDeformAttn(nn.Module):
    """Multi-scale deformable attention module of Deformable DETR.

    Args:
        d_model: hidden size.
        n_levels: feature levels.
        n_heads: attention heads (d_model must be divisible by it).
        n_points: sampling points per head and level.
        backend: operator backend ("auto", a name from available_backends(),
            or "pytorch" for the operator in plain PyTorch ops).
        fused: True (default) forms the sampling locations and the softmax
            inside the operator (ms_deform_attn_fused), which then keeps the
            offsets and logits for the backward instead of float32 locations
            and weights (a fifth less saved memory per layer under bf16
            autocast); on CUDA its kernels form them, forward and backward
            (BENCHMARKS.md "Layer: the fused operator"). False runs them as
            separate PyTorch ops before ms_deform_attn, as Deformable DETR
            does.
        recompute: with `fused`, the operator's inputs (value, offsets,
            logits) are not kept from the forward to the backward but formed
            again there from the projections' inputs, which their linears
            keep anyway (three GEMMs at the backward): the layer then keeps
            less than half the memory for its backward, for a few percent
            more time under bf16 autocast and more in float32 (BENCHMARKS.md
            "Seventh run: recomputed projections"). Not under torch.compile,
            whose partitioner makes this choice itself.
        value_layout: "standard" (default): value_proj's output viewed as
            (N, S, M, D). "head_major": value_proj writes value as
            (N, M, S, D), one batched GEMM a batch entry, which the operator
            reads in place (two horizontally adjacent corners of a head are
            then contiguous), and grad_value comes back in that layout,
            copied once for value_proj's backward.
        fast_linears: True (default): on CUDA the layer's four nn.Linear
            run as ms_deform_attn::_linear, whose bias gradient is one
            column sum at the copy rate (torch's runs far below it); the
            same values and gradients otherwise. False calls the modules.
            Hooks, subclasses and traced or compiled code call them anyway.
    """

    def __init__(self, d_model: int = 256, n_levels: int = 4, n_heads: int = 8, n_points: int = 4,
                 backend: str = "auto", fused: bool = True, recompute: bool = False,
                 value_layout: str = "standard", fast_linears: bool = True):
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"d_model must be divisible by n_heads, got {d_model} and {n_heads}")
        d_head = d_model // n_heads
        if d_head & (d_head - 1):
            warnings.warn("d_model / n_heads is not a power of 2; the kernels run fastest when "
                          "the channels per head are a multiple of 8", stacklevel=2)
        self.im2col_step = 64  # kept for code that reads it; the operator has no such limit
        self.d_model = d_model
        self.n_levels = n_levels
        self.n_heads = n_heads
        self.n_points = n_points
        self.backend = backend
        self.fused = fused
        self.recompute = recompute
        if value_layout not in ("standard", "head_major"):
            raise ValueError(f'value_layout must be "standard" or "head_major", got {value_layout!r}')
        self.value_layout = value_layout
        self.fast_linears = fast_linears
        self.sampling_offsets = nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)
        self._reset_parameters()

    def _reset_parameters(self):
        nn.init.constant_(self.sampling_offsets.weight, 0.0)
        # Head h starts looking along angle 2 pi h / n_heads, scaled onto the
        # unit square; point p of every level sits (p + 1) steps out.
        angles = torch.arange(self.n_heads, dtype=torch.float32) * (2.0 * math.pi / self.n_heads)
        directions = torch.stack([angles.cos(), angles.sin()], -1)
        directions = directions / directions.abs().max(-1, keepdim=True)[0]
        steps = torch.arange(1, self.n_points + 1, dtype=torch.float32).view(1, 1, -1, 1)
        grid = directions.view(self.n_heads, 1, 1, 2) * steps
        grid = grid.expand(self.n_heads, self.n_levels, self.n_points, 2)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(grid.reshape(-1))
        nn.init.constant_(self.attention_weights.weight, 0.0)
        nn.init.constant_(self.attention_weights.bias, 0.0)
        nn.init.xavier_uniform_(self.value_proj.weight)
        nn.init.constant_(self.value_proj.bias, 0.0)
        nn.init.xavier_uniform_(self.output_proj.weight)
        nn.init.constant_(self.output_proj.bias, 0.0)

    def forward(self, query: torch.Tensor, reference_points: torch.Tensor,
                input_flatten: torch.Tensor, input_spatial_shapes: torch.Tensor,
                input_level_start_index: torch.Tensor,
                input_padding_mask: Optional[torch.Tensor] = None,
                input_spatial_shapes_list=None) -> torch.Tensor:
        """
        Args:
            query: (N, Lq, d_model).
            reference_points: (N, Lq, n_levels, 2) normalised points in [0, 1],
                or (N, Lq, n_levels, 4) boxes (cx, cy, w, h).
            input_flatten: (N, S, d_model), the flattened levels.
            input_spatial_shapes: (n_levels, 2) int64 (H, W).
            input_level_start_index: (n_levels,) int64.
            input_padding_mask: (N, S) bool, True at padding.
            input_spatial_shapes_list: optional [(H, W), ...] on the host, equal
                to input_spatial_shapes; the `tma` backend needs it.
        Returns:
            (N, Lq, d_model).
        """
        n, lq, _ = query.shape
        fused = self.fused and self.backend != "pytorch"
        # getattr: a module pickled before the option existed has no attribute.
        recompute = fused and getattr(self, "recompute", False)
        value, offsets, logits, remakes = _project(self, query, input_flatten, input_padding_mask,
                                                  recompute=recompute)
        if reference_points.shape[-1] not in (2, 4):
            raise ValueError("reference_points.shape[-1] must be 2 or 4, got "
                             f"{reference_points.shape[-1]}")
        if fused:
            with _recomputing(remakes):
                output = ms_deform_attn_fused(value, input_spatial_shapes, input_level_start_index,
                                              reference_points, offsets, logits,
                                              backend=self.backend,
                                              spatial_shapes_list=input_spatial_shapes_list)
            return _linear(self.output_proj, output, _fast_linears(self))
        weights = F.softmax(logits, -1).view(n, lq, self.n_heads, self.n_levels, self.n_points)
        locations = sampling_locations(reference_points, offsets, input_spatial_shapes)
        output = ms_deform_attn(value, input_spatial_shapes, input_level_start_index,
                                locations, weights, backend=self.backend,
                                spatial_shapes_list=input_spatial_shapes_list)
        return _linear(self.output_proj, output, _fast_linears(self))


def sampling_locations(reference_points: torch.Tensor, offsets: torch.Tensor,
                       spatial_shapes: torch.Tensor) -> torch.Tensor:
    """Deformable DETR's sampling locations (N, Lq, M, L, P, 2) from
    reference points (N, Lq, L, 2), offsets in pixels of each level: ref +
    offset / (W, H); or from boxes (N, Lq, L, 4), offsets in units of half
    the box over P: (cx, cy) + offset / P * (w, h) * 0.5. In PyTorch ops,
    as the layer of transformers forms them."""
    if reference_points.shape[-1] == 2:
        normalizer = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1)
        return (reference_points[:, :, None, :, None, :]
                + offsets / normalizer[None, None, None, :, None, :])
    n_points = offsets.shape[4]
    return (reference_points[:, :, None, :, None, :2]
            + offsets / n_points * reference_points[:, :, None, :, None, 2:] * 0.5)
