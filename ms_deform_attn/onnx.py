"""ONNX export of models that use this operator, two targets:

- "portable" (the default): the operator written with standard ONNX
  operators only (gathers and elementwise ops, no GridSample, no plugin),
  as `reference.ms_deform_attn_gather` computes it: fp32 coordinate math,
  zero padding, corners outside the map adding nothing, non-finite samples
  poisoning their row. ONNX Runtime, TensorRT and OpenVINO run it as it is
  (OpenVINO with f32 inference precision: compile_openvino);
  batch, queries and image size may change between runs of one file when
  the export marks them dynamic (`dynamic_shapes`, as torch.export takes;
  `symbolic_sizes` keeps transformers' detectors' level sizes symbolic).
- "tensorrt": the operator as one node of TensorRT's
  `MultiscaleDeformableAttnPlugin_TRT` (domain `trt.plugins`), with int32
  spatial shapes and level starts, locations and weights cast to the
  value's dtype (fp32 or fp16, which the plugin takes), and its (N, Lq, M,
  D) output reshaped to (N, Lq, M * D). Only TensorRT with that plugin runs
  the file; nothing here runs it.

    from ms_deform_attn.onnx import export_onnx
    export_onnx(model, (inputs...), "model.onnx")                    # portable
    export_onnx(model, (inputs...), "model.onnx", target="tensorrt")

Export runs on the CPU with or without the CUDA kernels built. Needs the
`onnx` and `onnxscript` packages (the `onnx` extra, which adds onnxruntime
to run the result).
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Dict

import torch

from .reference import fused_locations_and_weights, ms_deform_attn_gather

__all__ = ["TARGETS", "TRT_PLUGIN", "TRT_DOMAIN", "OPENVINO_CONFIG", "PRECISION_NOTE",
           "export_onnx", "compile_openvino", "export_example", "symbolic_sizes", "output_names",
           "portable_decompositions", "custom_translation_table"]

TARGETS = ("portable", "tensorrt")
TRT_PLUGIN = "MultiscaleDeformableAttnPlugin_TRT"
TRT_DOMAIN = "trt.plugins"


def _ops():
    lib = torch.ops.ms_deform_attn
    return lib.ms_deform_attn.default, lib.ms_deform_attn_fused.default


def _gather(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
            backend="auto", deterministic=None, spatial_shapes_list=None):
    return ms_deform_attn_gather(value, spatial_shapes, level_start_index, sampling_locations,
                                 attention_weights, precision_probe=True)


def _fused_gather(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                  attention_logits, backend="auto", deterministic=None, spatial_shapes_list=None):
    n, lq, m, n_levels, n_points, _ = sampling_offsets.shape
    logits = attention_logits.reshape(n, lq, m, n_levels, n_points)
    loc, weights = fused_locations_and_weights(spatial_shapes, reference_points, sampling_offsets, logits)
    return ms_deform_attn_gather(value, spatial_shapes, level_start_index, loc, weights,
                                 precision_probe=True)


def portable_decompositions() -> Dict[Any, Callable]:
    """torch.export decompositions (`ExportedProgram.run_decompositions`)
    that write both operators with standard ops; the default ones beside
    them."""
    table = torch.export.default_decompositions()
    forward, fused = _ops()
    table[forward] = _gather
    table[fused] = _fused_gather
    return table


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

    return {_ops()[0]: ms_deform_attn_to_trt}


def _has_symbolic(data) -> bool:
    if isinstance(data, (list, tuple)):
        return any(_has_symbolic(v) for v in data)
    return isinstance(data, (torch.SymInt, torch.SymFloat))


def _transformers_torch_int_users():
    """The loaded transformers modules holding transformers' `torch_int`
    (each modeling module imports it by name), with that function."""
    generic = sys.modules.get("transformers.utils.generic")
    original = getattr(generic, "torch_int", None)
    if original is None:
        return [], None
    users = [m for name, m in list(sys.modules.items())
             if name.startswith("transformers.") and getattr(m, "torch_int", None) is original]
    return users, original


@contextlib.contextmanager
def symbolic_sizes():
    """While active, the calls that detection models make on feature-map
    sizes keep those sizes symbolic under torch.export instead of making them
    constants (which would fix the image size of the exported program):
    `torch.as_tensor` of a nested list holding symbolic ints (how
    transformers builds `spatial_shapes` from `spatial_shapes_list`),
    `torch.linspace` with a symbolic step count (its reference-point grids),
    and transformers' `torch_int`, which makes a size a Python int outside
    torch.jit tracing (RT-DETR's position embeddings and anchors). Each gives
    the same values as the function it stands in for; other calls go to the
    functions themselves. export_onnx applies it when given `dynamic_shapes`;
    wrap torch.export.export in it for AOTInductor."""
    as_tensor, linspace = torch.as_tensor, torch.linspace

    def symbolic_as_tensor(data, dtype=None, device=None):
        if not (isinstance(data, (list, tuple)) and _has_symbolic(data)):
            return as_tensor(data, dtype=dtype, device=device)

        def build(x):
            if isinstance(x, (list, tuple)):
                return torch.stack([build(v) for v in x])
            return torch.scalar_tensor(x, dtype=dtype or torch.long, device=device)
        return build(data)

    def symbolic_linspace(start, end, steps, *, dtype=None, device=None, **kwargs):
        if not _has_symbolic((start, end, steps)) or kwargs:
            return linspace(start, end, steps, dtype=dtype, device=device, **kwargs)
        dtype = dtype or torch.get_default_dtype()
        index = torch.arange(steps, dtype=dtype, device=device)
        return start + index * ((end - start) / torch.sym_max(steps - 1, 1))

    users, torch_int = _transformers_torch_int_users()

    def symbolic_torch_int(x):
        return x if isinstance(x, torch.SymInt) else torch_int(x)

    torch.as_tensor, torch.linspace = symbolic_as_tensor, symbolic_linspace
    for module in users:
        module.torch_int = symbolic_torch_int
    try:
        yield
    finally:
        torch.as_tensor, torch.linspace = as_tensor, linspace
        for module in users:
            module.torch_int = torch_int


def _is_dynamic(marker) -> bool:
    """Whether a dimension's entry of `dynamic_shapes` asks for a dynamic
    size: a named Dim, Dim.AUTO or Dim.DYNAMIC (not None, an int or
    Dim.STATIC)."""
    return not (marker is None or isinstance(marker, int) or marker is torch.export.Dim.STATIC)


def _enlarged(value, spec):
    """`value` (a tensor or a container of them) with every dimension that
    `spec` marks dynamic and that has size 1 doubled (the data repeated), so
    that torch.export does not make it the constant 1."""
    if isinstance(value, torch.Tensor):
        if isinstance(spec, dict):
            dims = spec.items()
        elif isinstance(spec, (list, tuple)):
            dims = enumerate(spec)
        else:
            return value
        for dim, marker in dims:
            if _is_dynamic(marker) and value.size(dim) == 1:
                value = torch.cat([value, value], dim)
        return value
    if isinstance(value, (list, tuple)) and isinstance(spec, (list, tuple)) and len(spec) == len(value):
        return type(value)(_enlarged(v, s) for v, s in zip(value, spec))
    if isinstance(value, dict) and isinstance(spec, dict):
        return {k: _enlarged(v, spec.get(k)) for k, v in value.items()}
    return value


def export_example(model: torch.nn.Module, args: tuple, kwargs: Dict[str, Any] | None,
                   dynamic_shapes):
    """The example export_onnx traces: (args, kwargs) with every dimension
    that `dynamic_shapes` marks dynamic and that has size 1 doubled.
    torch.export makes a dimension of size 1 a constant (a batch-1 example
    would fix the graph's batch at 1, or fail with a named Dim); the doubled
    example leaves it symbolic, and the model's result for it is the same
    computation."""
    kwargs = dict(kwargs or {})
    if dynamic_shapes is None:
        return tuple(args), kwargs
    if isinstance(dynamic_shapes, dict):
        import inspect

        names = list(inspect.signature(model.forward).parameters)
        args = tuple(_enlarged(a, dynamic_shapes.get(names[i]) if i < len(names) else None)
                     for i, a in enumerate(args))
        kwargs = {k: _enlarged(v, dynamic_shapes.get(k)) for k, v in kwargs.items()}
    else:
        specs = list(dynamic_shapes)
        args = tuple(_enlarged(a, specs[i] if i < len(specs) else None) for i, a in enumerate(args))
        rest = specs[len(args):]
        kwargs = {k: _enlarged(v, rest[i] if i < len(rest) else None)
                  for i, (k, v) in enumerate(kwargs.items())}
    return args, kwargs


def output_names(program) -> list:
    """Names for the exported program's outputs, from the model's output
    structure: a dict's keys (or the fields of any output type registered
    with torch's pytree), `output` for a lone tensor, `output_<i>` in a
    tuple; nested items joined by `_`."""
    from torch.utils import _pytree as pytree

    spec = program.call_spec.out_spec
    structure = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    names, seen = [], set()
    for path, _ in pytree.tree_flatten_with_path(structure)[0]:
        parts = []
        for key in path:
            part = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
            parts.append(str(part))
        name = "_".join(parts) or "output"
        if not (name[0].isalpha() or name[0] == "_"):
            name = "output_" + name
        while name in seen:
            name += "_"
        seen.add(name)
        names.append(name)
    return names


# OpenVINO compiles a graph in the precision its device prefers unless told
# otherwise: bf16 on CPUs with bf16 units (AMX, AVX512-BF16), f16 on its GPU
# plugin. In the portable graph that would round the pixel coordinates (the
# location times the level's width) to an 8- or 11-bit mantissa and lose
# their fraction, so the graph's precision probe makes the output NaN there
# (reference._precision_probe). This setting keeps every operation in f32.
OPENVINO_CONFIG = {"INFERENCE_PRECISION_HINT": "f32"}


def compile_openvino(model, device: str = "CPU", config: Dict[str, Any] | None = None):
    """A portable export (a path or an openvino.Model) compiled by OpenVINO
    with OPENVINO_CONFIG (f32 inference precision; `config` adds to it or
    overrides it): what gives the operator's results on every OpenVINO
    device. Needs the `openvino` package (the onnx extra)."""
    import openvino as ov

    settings = dict(OPENVINO_CONFIG)
    settings.update(config or {})
    return ov.Core().compile_model(str(model) if not isinstance(model, ov.Model) else model,
                                   device, settings)


PRECISION_NOTE = ("The sampling's coordinates need float32: compile with float32 inference "
                  "precision (OpenVINO: INFERENCE_PRECISION_HINT=f32, "
                  "ms_deform_attn.onnx.compile_openvino; its CPU defaults to bf16 where the CPU "
                  "has bf16 units, its GPU to f16). Under a lower precision every output of the "
                  "operator is NaN on purpose, never silently wrong.")


def _note_precision(path) -> None:
    """Writes PRECISION_NOTE into a written portable file's metadata
    (`ms_deform_attn.precision`), where a deployment tool or person reading
    the model finds it; the weights beside it are left as they are."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    entry = model.metadata_props.add()
    entry.key, entry.value = "ms_deform_attn.precision", PRECISION_NOTE
    onnx.save(model, str(path))


def _our_nodes(program):
    ours = set(_ops())
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target in ours]


def export_onnx(model: torch.nn.Module, args: tuple, f=None, *, target: str = "portable",
                kwargs: Dict[str, Any] | None = None, dynamic_shapes=None, **export_kwargs):
    """Exports `model` called on `args` (and `kwargs`) to ONNX for `target`
    ("portable" or "tensorrt", see the module's docstring) through
    torch.export (`dynamic_shapes` as torch.export.export takes it) and
    torch.onnx.export(..., dynamo=True); writes `f` when given and returns
    the ONNXProgram. A dimension marked dynamic keeps dynamic whatever its
    size in the example (one of size 1 is traced doubled: export_example);
    a request torch.export cannot meet raises its error naming the
    dimension. The graph's outputs are named from the model's output
    structure (output_names; `output_names=[...]` overrides). Raises
    ValueError for an unknown target, a model that calls neither operator,
    and, for "tensorrt", a value dtype the plugin does not take."""
    if target not in TARGETS:
        raise ValueError(f"export_onnx: target must be one of {TARGETS}, got {target!r}")
    args, kwargs = export_example(model, args, kwargs, dynamic_shapes)
    with symbolic_sizes() if dynamic_shapes is not None else contextlib.nullcontext():
        program = torch.export.export(model, tuple(args), kwargs=kwargs, dynamic_shapes=dynamic_shapes)
    export_kwargs.setdefault("output_names", output_names(program))
    nodes = _our_nodes(program)
    if not nodes:
        raise ValueError(
            "export_onnx: the exported model calls neither ms_deform_attn nor ms_deform_attn_fused "
            f"(its graph has {sum(1 for n in program.graph.nodes if n.op == 'call_function')} "
            "operators); export it with torch.onnx.export directly")
    if target == "portable":
        program = program.run_decompositions(portable_decompositions())
        exported = torch.onnx.export(program, tuple(args), f, dynamo=True, **export_kwargs)
        if isinstance(f, (str, os.PathLike)):
            _note_precision(f)
        return exported
    forward, fused = _ops()
    for node in nodes:
        if node.target == fused:
            raise ValueError(
                "export_onnx: the TensorRT plugin takes sampling locations and weights, not "
                "ms_deform_attn_fused's offsets and logits: build the layers with fused=False "
                "(MSDeformAttn(..., fused=False), swap_msda(model, fused=False)) for this target")
        dtype = node.args[0].meta["val"].dtype
        if dtype not in (torch.float32, torch.float16):
            raise ValueError(
                f"export_onnx: the TensorRT plugin computes in float32 or float16, but the "
                f"operator's value is {dtype}: export the model in float32 (model.float()) or "
                "float16 (model.half()), or use target='portable'")
    table = dict(custom_translation_table())
    table.update(export_kwargs.pop("custom_translation_table", None) or {})
    return torch.onnx.export(program, tuple(args), f, dynamo=True, custom_translation_table=table,
                             **export_kwargs)
