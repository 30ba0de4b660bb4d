"""Gradients: gradcheck in float64, 16-bit and mixed dtypes against the
reference's autograd, double backward."""
import pytest
import torch

import ms_deform_attn as msda
from ms_deform_attn.reference import ms_deform_attn_pytorch
from helpers import TOL, device_backends, make_inputs, rel_err

GRAD_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def op(backend):
    return lambda v, s, st, l, a: msda.ms_deform_attn(v, s, st, l, a, backend=backend)


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("shape", [
    (1, 5, 2, 4, [(4, 5)], 2),
    (2, 6, 3, 8, [(5, 3), (2, 4)], 3),
    (1, 4, 1, 33, [(3, 3), (2, 1), (1, 2)], 1),
])
def test_gradcheck(device, backend, shape):
    n, lq, m, d, shapes, p = shape
    value, shapes_t, start, loc, attn = make_inputs(n, lq, m, d, shapes, p, torch.float64,
                                                    device=device, outside=0.2,
                                                    requires_grad=True)
    f = op(backend)
    assert torch.autograd.gradcheck(lambda v, l, a: f(v, shapes_t, start, l, a),
                                    (value, loc, attn), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("device,backend", device_backends())
def test_gradients_on_pixel_borders(device, backend):
    """Locations exactly on pixel centres and the map border: value and weight
    gradients by gradcheck (smooth there), location gradients against the
    reference's (the same one-sided convention: the cell to the lower right)."""
    shapes = [(6, 8), (3, 4)]
    value, shapes_t, start, _, attn = make_inputs(1, 12, 2, 4, shapes, 2, torch.float64,
                                                  device=device, requires_grad=True)
    ticks = torch.tensor([0.0, 1 / 16, 0.25, 0.5, 1.0, -1 / 16, 1 + 1 / 16], dtype=torch.float64)
    loc = ticks[torch.randint(0, len(ticks), (1, 12, 2, 2, 2, 2))].to(device).requires_grad_()
    f = op(backend)
    assert torch.autograd.gradcheck(lambda v, a: f(v, shapes_t, start, loc, a), (value, attn))
    grad = torch.randn(1, 12, 8, dtype=torch.float64, device=device)
    (g_ours,) = torch.autograd.grad(f(value, shapes_t, start, loc, attn), loc, grad)
    (g_ref,) = torch.autograd.grad(ms_deform_attn_pytorch(value, shapes_t, start, loc, attn),
                                   loc, grad)
    torch.testing.assert_close(g_ours, g_ref)


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("loc_fp32", [False, True], ids=["loc_same", "loc_fp32"])
@pytest.mark.parametrize("d", [30, 32, 64])
def test_gradients_match_reference(device, backend, dtype, loc_fp32, d):
    loc_dtype = torch.float32 if loc_fp32 else dtype
    inputs = make_inputs(2, 37, 4, d, [(9, 11), (5, 6), (3, 3)], 4, dtype, loc_dtype,
                         device=device, requires_grad=True)
    value, shapes, start, loc, attn = inputs
    out = op(backend)(*inputs)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (value, loc, attn), grad)

    ref_in = [t.detach().double().requires_grad_() for t in (value, loc, attn)]
    ref_out = ms_deform_attn_pytorch(ref_in[0], shapes, start, ref_in[1], ref_in[2])
    ref_grads = torch.autograd.grad(ref_out, ref_in, grad.double())
    for name, g, r, src in zip(("value", "locations", "weights"), grads, ref_grads,
                               (value, loc, attn)):
        assert g.dtype == src.dtype, name
        assert g.shape == src.shape, name
        err = rel_err(g, r)
        assert err <= GRAD_TOL[src.dtype], f"grad of {name}: rel. error {err:.2e}"


@pytest.mark.parametrize("device,backend", device_backends())
def test_double_backward_raises(device, backend):
    value, shapes, start, loc, attn = make_inputs(1, 4, 2, 8, [(3, 3)], 2, torch.float64,
                                                  device=device, requires_grad=True)
    out = op(backend)(value, shapes, start, loc, attn)
    (g,) = torch.autograd.grad(out.sum(), loc, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


@pytest.mark.parametrize("device,backend", device_backends())
def test_backward_empty(device, backend):
    value, shapes, start, loc, attn = make_inputs(2, 3, 2, 8, [(3, 3)], 2, torch.float32,
                                                  device=device)
    loc = loc[:, :0].requires_grad_()
    attn = attn[:, :0].requires_grad_()
    value.requires_grad_()
    op(backend)(value, shapes, start, loc, attn).sum().backward()
    assert value.grad.abs().sum() == 0
    assert loc.grad.shape == loc.shape
