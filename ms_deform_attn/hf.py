"""Hugging Face transformers integration.

`MultiScaleDeformableAttention` has exactly the forward signature transformers
calls on its own `MultiScaleDeformableAttention` layer (DeformableDetr,
RT-DETR, Grounding DINO, and the other models with such a layer), so it can
be put in its place; `swap_msda(model)` does that for a whole model without
network access, also runs the attention layers with Deformable DETR's own
forward on the fused operator, and routes Mask2Former / OneFormer, which
call a module-level `multi_scale_deformable_attention` function, to the
operator.

With the `kernels` package, `kernelize(model)` runs transformers' own
mechanism (`kernels.kernelize` with `kernel_mapping()`, the layer served from
here: no Hub, no network) and says how many layers it replaced; it warns
when that is none. transformers marks its layer for `kernels` only with the
`kernels` versions it supports; with another one `kernelize` marks it
itself, as `kernels.replace_kernel_forward_from_hub` would:

    from ms_deform_attn.hf import kernelize
    model, replaced = kernelize(model, device="cuda", training=True)
"""
from __future__ import annotations

import functools
import sys
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

import torch.nn.functional as F

from ._ops import ms_deform_attn, ms_deform_attn_fused
from .compat import multi_scale_deformable_attn_pytorch
from . import nn as layers

__all__ = ["MultiScaleDeformableAttention", "MultiScaleDeformableAttentionKernel",
           "kernel_mapping", "kernelize", "kernelized_layers", "multi_scale_deformable_attention",
           "swap_msda"]


class MultiScaleDeformableAttention(nn.Module):
    """Parameter-free MSDA layer with transformers' forward signature.
    `value_spatial_shapes_list` (host-side (H, W) pairs) goes to the operator
    as `spatial_shapes_list`, which the `tma` backend needs; `im2col_step` is
    accepted and ignored."""

    def __init__(self, backend: str = "auto"):
        super().__init__()
        self.backend = backend

    def forward(self, value: torch.Tensor, value_spatial_shapes: torch.Tensor,
                value_spatial_shapes_list: List[Tuple[int, int]], level_start_index: torch.Tensor,
                sampling_locations: torch.Tensor, attention_weights: torch.Tensor,
                im2col_step: int = 64) -> torch.Tensor:
        return ms_deform_attn(value, value_spatial_shapes, level_start_index, sampling_locations,
                              attention_weights, backend=self.backend,
                              spatial_shapes_list=value_spatial_shapes_list)


class MultiScaleDeformableAttentionKernel(nn.Module):
    """The stateless layer `kernels.kernelize` puts under transformers'
    `MultiScaleDeformableAttention` (its forward replaces that layer's; the
    `kernels` package accepts no constructor or state). Runs the operator
    with backend "auto" (the environment variable MS_DEFORM_ATTN_BACKEND
    overrides it) and `value_spatial_shapes_list` as the host-side shapes."""

    can_torch_compile = True
    has_backward = True

    def forward(self, value: torch.Tensor, value_spatial_shapes: torch.Tensor,
                value_spatial_shapes_list: List[Tuple[int, int]], level_start_index: torch.Tensor,
                sampling_locations: torch.Tensor, attention_weights: torch.Tensor,
                im2col_step: int = 64) -> torch.Tensor:
        return ms_deform_attn(value, value_spatial_shapes, level_start_index, sampling_locations,
                              attention_weights, spatial_shapes_list=value_spatial_shapes_list)


class _PackageLayerRepository:
    """A repository in the sense of the `kernels` package (its
    RepositoryProtocol: load() returns the layer class) that serves
    MultiScaleDeformableAttentionKernel from this package."""

    layer_name = "MultiScaleDeformableAttention"

    def load(self):
        return MultiScaleDeformableAttentionKernel

    def __str__(self) -> str:
        return "ms_deform_attn.hf (layer `MultiScaleDeformableAttentionKernel`)"


_REPOSITORY = _PackageLayerRepository()


def kernel_mapping(devices: Tuple[str, ...] = ("cuda", "cpu")) -> Dict[str, Dict[str, object]]:
    """The `kernels` layer mapping (for `kernels.use_kernel_mapping` or
    `kernels.register_kernel_mapping`) of transformers' layer name
    "MultiScaleDeformableAttention" to this package's operator, on `devices`."""
    return {"MultiScaleDeformableAttention": {d: _REPOSITORY for d in devices}}


def _msda_layers(model: nn.Module) -> List[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "MultiScaleDeformableAttention"
            and type(m).__module__.startswith("transformers.")]


def kernelized_layers(model: nn.Module) -> int:
    """How many transformers MSDA layers of `model` run this package's
    operator through `kernels` (their forward is the kernel layer's)."""
    return sum(getattr(m.forward, "__func__", None) is MultiScaleDeformableAttentionKernel.forward
               for m in _msda_layers(model))


def kernelize(model: nn.Module, device: Optional[str] = None, training: bool = False):
    """`kernels.kernelize(model)` with `kernel_mapping()`, for any installed
    `kernels` version: marks transformers' MultiScaleDeformableAttention
    classes for kernelize where this transformers did not (it does so only
    for the `kernels` versions it supports), then kernelizes. Returns
    (model, number of layers replaced) and warns when the model has MSDA
    layers and none was replaced."""
    import kernels

    for cls in {type(m) for m in _msda_layers(model)}:
        if getattr(cls, "kernel_layer_name", None) is None:
            cls.kernel_layer_name = "MultiScaleDeformableAttention"
            if getattr(cls, "kernel_condition", None) is None:
                cls.kernel_condition = staticmethod(lambda module: True)
    mode = kernels.Mode.TRAINING if training else kernels.Mode.INFERENCE
    with kernels.use_kernel_mapping(kernel_mapping()):
        model = kernels.kernelize(model, mode=mode, device=device)
    replaced = kernelized_layers(model)
    if replaced == 0 and _msda_layers(model):
        warnings.warn(
            "ms_deform_attn.hf.kernelize: kernels.kernelize replaced none of the model's "
            f"{len(_msda_layers(model))} MultiScaleDeformableAttention layers (kernels "
            f"{getattr(kernels, '__version__', '?')}); the model still runs transformers' own "
            "code. Use ms_deform_attn.hf.swap_msda(model) instead.", RuntimeWarning, stacklevel=2)
    return model, replaced


def multi_scale_deformable_attention(value, value_spatial_shapes, sampling_locations,
                                     attention_weights):
    """Replacement for transformers' module-level function of that name
    (Mask2Former, OneFormer)."""
    return multi_scale_deformable_attn_pytorch(value, value_spatial_shapes, sampling_locations,
                                               attention_weights)


# Models whose modelling file calls a module-level function instead of a layer.
_FUNCTION_MODULES = (
    "transformers.models.mask2former.modeling_mask2former",
    "transformers.models.oneformer.modeling_oneformer",
)


def _attention_weights_wanted(kwargs) -> Optional[bool]:
    """Whether the caller will use the attention weights the layer returns:
    transformers 4.x asks with `output_attentions`; 5.x records them with
    forward hooks while a collector of attentions is active
    (transformers.utils.output_capturing). None where that cannot be known (a
    traced or compiled forward, where an unused result is dropped anyway, or
    a transformers without either)."""
    if kwargs.get("output_attentions"):
        return True
    if torch.compiler.is_compiling():
        return None
    collector = _output_collector()
    if collector is None:
        return None if "output_attentions" not in kwargs else False
    collected = collector.get()
    return collected is not None and any("attentions" in key for key in collected)


@functools.lru_cache(maxsize=None)
def _output_collector():
    """transformers 5.x's collector of recorded outputs, None where there is
    none; looked up once, not on every layer call."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


def _fused_layer_forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                         encoder_attention_mask=None, position_embeddings=None,
                         reference_points=None, spatial_shapes=None, spatial_shapes_list=None,
                         level_start_index=None, **kwargs):
    """The forward of transformers' DeformableDetrMultiscaleDeformableAttention
    (and of the layers that share it) on ms_deform_attn_fused: the sampling
    locations and the softmax formed inside the operator. The attention
    weights it returns are computed only when the caller will use them
    (output_attentions): then the output is computed from them, through the
    unfused operator, as transformers' layer computes it (gradients reach
    them from the output: its retain_grad tests); where that is not known
    (a compiled forward) the output stays fused and the weights are made
    beside it (dropped when unused); None otherwise."""
    if position_embeddings is not None:
        hidden_states = hidden_states + position_embeddings
    n, lq, _ = hidden_states.shape
    # transformers' attention_mask is True where the pixel is valid.
    value, offsets, logits, remakes = layers._project(
        self, hidden_states, encoder_hidden_states,
        None if attention_mask is None else ~attention_mask,
        recompute=getattr(self, "_msda_recompute", False))
    if reference_points.shape[-1] not in (2, 4):
        raise ValueError("Last dim of reference_points must be 2 or 4, but got "
                         f"{reference_points.shape[-1]}")
    if reference_points.shape[2] == 1:  # one for every level (RT-DETR's decoder)
        reference_points = reference_points.expand(-1, -1, self.n_levels, -1)
    wanted = _attention_weights_wanted(kwargs)
    weights = None
    if wanted is not False:
        weights = F.softmax(logits, -1).view(n, lq, self.n_heads, self.n_levels, self.n_points)
    if wanted:
        locations = layers.sampling_locations(reference_points, offsets, spatial_shapes)
        output = ms_deform_attn(value, spatial_shapes, level_start_index, locations, weights,
                                backend=self._msda_backend,
                                spatial_shapes_list=spatial_shapes_list)
    else:
        with layers._recomputing(remakes):
            output = ms_deform_attn_fused(value, spatial_shapes, level_start_index,
                                          reference_points, offsets, logits,
                                          backend=self._msda_backend,
                                          spatial_shapes_list=spatial_shapes_list)
    return layers._linear(self.output_proj, output, layers._fast_linears(self)), weights


def _runs_deformable_detr_forward(layer: nn.Module) -> bool:
    """Whether `layer`'s class has transformers' Deformable DETR attention
    forward, code for code (DeformableDetr, RT-DETR, LW-DETR, RF-DETR,
    PP-DocLayout; not Grounding DINO, RT-DETRv2, D-FINE, OmDet: theirs
    differ), so that _fused_layer_forward computes what it computes."""
    try:
        from transformers.models.deformable_detr import modeling_deformable_detr as ddetr
    except ImportError:
        return False
    code = getattr(type(layer).forward, "__code__", None)
    return code is not None and _same_code(
        code, ddetr.DeformableDetrMultiscaleDeformableAttention.forward.__code__)


def _same_code(a, b) -> bool:
    """Equal bytecode, names and constants (nested code objects alike, their
    file names and line numbers aside)."""
    if a.co_code != b.co_code or a.co_names != b.co_names or a.co_varnames != b.co_varnames:
        return False
    if len(a.co_consts) != len(b.co_consts):
        return False
    for x, y in zip(a.co_consts, b.co_consts):
        if hasattr(x, "co_code") and hasattr(y, "co_code"):
            if not _same_code(x, y):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def swap_msda(model: nn.Module, backend: str = "auto", fused: bool = True,
              recompute: bool = False, fast_linears: bool = True) -> int:
    """Puts this package's operator under every MSDA of a transformers model.

    Replaces each `MultiScaleDeformableAttention` submodule defined by
    transformers with `MultiScaleDeformableAttention(backend)` and, for models
    defined in a modelling file that calls a module-level
    `multi_scale_deformable_attention` (Mask2Former, OneFormer), points that
    name at the operator (this affects every model of that family in the
    process). With `fused` (default), the attention layers that hold such a
    submodule and run Deformable DETR's own forward (DeformableDetr, RT-DETR,
    LW-DETR, RF-DETR, PP-DocLayout) run on ms_deform_attn_fused instead:
    locations and softmax inside the operator, which keeps the offsets and
    logits for the backward (their parameters and state_dict unchanged), or
    with `recompute` forms them again at the backward from the projections'
    inputs (MSDeformAttn's `recompute`: less memory, a little more time).
    `fast_linears`: MSDeformAttn's option of that name for those fused layers
    (on CUDA their linears' bias gradients by one column sum at the copy
    rate; False calls the nn.Linear modules).
    Returns the number of places swapped.
    """
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            cls = type(child)
            if cls.__name__ == "MultiScaleDeformableAttention" and cls.__module__.startswith("transformers."):
                setattr(parent, name, MultiScaleDeformableAttention(backend))
                swapped += 1
                if fused and _runs_deformable_detr_forward(parent):
                    parent._msda_backend = backend
                    parent._msda_recompute = recompute
                    parent._msda_fast_linears = fast_linears
                    # A partial of the module-level function, not a bound
                    # method: it pickles (torch.save of the whole model,
                    # copy.deepcopy, multiprocessing) and unpickles.
                    parent.forward = functools.partial(_fused_layer_forward, parent)
    families = {type(m).__module__ for m in model.modules()}
    for modname in _FUNCTION_MODULES:
        module = sys.modules.get(modname)
        if module is not None and modname in families:
            module.multi_scale_deformable_attention = multi_scale_deformable_attention
            swapped += 1
    return swapped
