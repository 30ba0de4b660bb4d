"""torch.library.opcheck of the operator's schemas, fake kernels and
autograd registration, on every device and backend."""
import pytest
import torch

from helpers import LAYOUTS, device_backends, host_shapes, in_layout, make_inputs, skip_unless_runs


@LAYOUTS
@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_opcheck(device, backend, dtype, layout):
    value, shapes, start, loc, attn = make_inputs(2, 6, 2, 8, [(4, 5), (2, 3)], 2, dtype,
                                                  device=device, requires_grad=True)
    value = in_layout(value, layout)
    skip_unless_runs(backend, value, shapes, start, loc, attn, host_shapes(shapes))
    torch.library.opcheck(torch.ops.ms_deform_attn.ms_deform_attn.default,
                          (value, shapes, start, loc, attn, backend, None,
                           [x for hw in host_shapes(shapes) for x in hw]))


@LAYOUTS
@pytest.mark.parametrize("device,backend", device_backends())
def test_opcheck_backward_op(device, backend, layout):
    value, shapes, start, loc, attn = make_inputs(2, 6, 2, 8, [(4, 5), (2, 3)], 2,
                                                  torch.float32, device=device)
    value = in_layout(value, layout)
    grad = torch.randn(2, 6, 16, device=device)
    torch.library.opcheck(torch.ops.ms_deform_attn._ms_deform_attn_backward.default,
                          (grad, value, shapes, start, loc, attn),
                          test_utils=("test_schema", "test_faketensor"))
