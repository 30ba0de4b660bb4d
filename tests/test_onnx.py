"""ONNX export: the operator becomes one TensorRT plugin node, with the
int32 / dtype conversions and the output reshape around it."""
import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
import onnx  # noqa: E402

import ms_deform_attn as msda  # noqa: E402
from ms_deform_attn.onnx import TRT_DOMAIN, TRT_PLUGIN, export_onnx  # noqa: E402
from ms_deform_attn.testing import level_tensors  # noqa: E402


class Head(torch.nn.Module):
    def forward(self, value, shapes, start, loc, attn):
        return msda.ms_deform_attn(value, shapes, start, loc, attn) * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_onnx_export_as_tensorrt_plugin(dtype, tmp_path):
    shapes, start = level_tensors([(4, 5), (2, 3)], "cpu")
    value = torch.randn(2, 26, 4, 8).to(dtype)
    loc = torch.rand(2, 7, 4, 2, 3, 2)  # fp32 locations with a 16-bit value: cast in the graph
    attn = torch.rand(2, 7, 4, 2, 3)
    path = tmp_path / "msda.onnx"
    export_onnx(Head().eval(), (value, shapes, start, loc, attn), str(path))
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    plugins = [n for n in model.graph.node if n.op_type == TRT_PLUGIN]
    assert len(plugins) == 1 and plugins[0].domain == TRT_DOMAIN
    assert not [n for n in model.graph.node if "ms_deform_attn" in n.op_type]
    inferred = onnx.shape_inference.infer_shapes(model)
    out_type = inferred.graph.output[0].type.tensor_type
    assert [d.dim_value for d in out_type.shape.dim] == [2, 7, 32]
    elem = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16}[dtype]
    assert out_type.elem_type == elem
    # The plugin's inputs: value as is, int32 shapes and starts, locations and
    # weights in the value's dtype.
    types = {vi.name: vi.type.tensor_type.elem_type for vi in
             list(inferred.graph.value_info) + list(inferred.graph.input)}
    assert [types[i] for i in plugins[0].input] == [elem, onnx.TensorProto.INT32,
                                                     onnx.TensorProto.INT32, elem, elem]
