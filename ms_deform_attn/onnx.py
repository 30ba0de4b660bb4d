"""ONNX export for TensorRT.

`torch.onnx.export(..., dynamo=True)` cannot translate a custom operator by
itself; `custom_translation_table()` maps ours to one node of TensorRT's
`MultiscaleDeformableAttnPlugin_TRT` (the plugin that ships with TensorRT,
found by the ONNX parser by its name), with the conversions the plugin
needs around it:

    spatial_shapes, level_start_index -> int32
    sampling_locations, attention_weights -> the value's dtype (fp32 or fp16)
    plugin output (N, Lq, M, D) -> reshaped to the operator's (N, Lq, M * D)

    from ms_deform_attn.onnx import export_onnx
    export_onnx(model, (inputs...), "model.onnx")

Needs the `onnx` and `onnxscript` packages. The plugin computes in fp32 or
fp16: export a model whose value is fp32 or fp16 (not bf16).
"""
from __future__ import annotations

from typing import Any, Callable, Dict

import torch

TRT_PLUGIN = "MultiscaleDeformableAttnPlugin_TRT"
TRT_DOMAIN = "trt.plugins"


def _register_schema() -> None:
    """The ONNX schema of the plugin node (5 inputs, 1 output), so that
    onnxscript can build it and onnx.checker accept it."""
    import onnx
    from onnx.defs import OpSchema

    if onnx.defs.has(TRT_PLUGIN, TRT_DOMAIN):
        return
    param = OpSchema.FormalParameter
    onnx.defs.register_schema(OpSchema(
        TRT_PLUGIN, TRT_DOMAIN, 1,
        doc="TensorRT's multi-scale deformable attention plugin; output (N, Lq, M, D).",
        inputs=[param("value", "T"), param("spatial_shapes", "tensor(int32)"),
                param("level_start_index", "tensor(int32)"), param("sampling_locations", "T"),
                param("attention_weights", "T")],
        outputs=[param("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "value dtype")],
    ))


def custom_translation_table() -> Dict[Any, Callable]:
    """The `custom_translation_table` argument of
    `torch.onnx.export(..., dynamo=True)` that exports the operator as the
    TensorRT plugin node."""
    import onnx
    import onnxscript
    from onnxscript import opset18 as op

    _register_schema()
    trt = onnxscript.values.Opset(domain=TRT_DOMAIN, version=1)
    int32 = onnx.TensorProto.INT32

    def ms_deform_attn_to_trt(value, spatial_shapes, level_start_index, sampling_locations,
                              attention_weights, backend="auto", deterministic=None,
                              spatial_shapes_list=None):
        out = getattr(trt, TRT_PLUGIN)(
            value, op.Cast(spatial_shapes, to=int32), op.Cast(level_start_index, to=int32),
            op.CastLike(sampling_locations, value), op.CastLike(attention_weights, value))
        lead = op.Shape(out, start=0, end=2)  # (N, Lq)
        return op.Reshape(out, op.Concat(lead, op.Constant(value_ints=[-1]), axis=0))

    return {torch.ops.ms_deform_attn.ms_deform_attn.default: ms_deform_attn_to_trt}


def export_onnx(model: torch.nn.Module, args: tuple, f=None, **kwargs):
    """torch.onnx.export(model, args, f, dynamo=True) with the operator
    mapped to the TensorRT plugin; returns the ONNXProgram."""
    table = dict(custom_translation_table())
    table.update(kwargs.pop("custom_translation_table", None) or {})
    return torch.onnx.export(model, args, f, dynamo=True, custom_translation_table=table, **kwargs)
