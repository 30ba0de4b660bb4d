"""The attention layers' linears as the library's own ops: _linear (torch's
linear, with _column_sum as its bias gradient) and _column_sum, and the
layers calling them."""
import pytest
import torch

from ms_deform_attn.nn import MSDeformAttn
from helpers import MODULE_LEVELS, device_backends, module_inputs, rel_err


def _devices():
    return [p for p in device_backends() if p.values[1] in ("cpu", "baseline", "none")]


@pytest.mark.parametrize("device,backend", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(3, 5, 256), (1000, 128), (7, 40), (2, 0, 16), (4, 1)],
                         ids=["3d-vec", "tall", "odd-cols", "no-rows", "one-col"])
def test_column_sum(device, backend, dtype, shape):
    """_column_sum sums over every dimension but the last, in grad's dtype,
    to within that dtype's rounding of the float64 sum, the same bits on a
    repeat; odd widths (scalar loads) and empty inputs too."""
    g = torch.randn(shape, dtype=torch.float64).to(device=device, dtype=dtype)
    out = torch.ops.ms_deform_attn._column_sum(g)
    ref = g.double().reshape(-1, shape[-1]).sum(0)
    assert out.dtype == dtype and out.shape == (shape[-1],)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert rel_err(out, ref) <= tol if ref.numel() and ref.norm() > 0 else (out == 0).all()
    assert torch.equal(out, torch.ops.ms_deform_attn._column_sum(g))


@pytest.mark.parametrize("device,backend", _devices())
def test_column_sum_errors_and_opcheck(device, backend):
    with pytest.raises(RuntimeError, match="grad must have at least 1 dimension, got 0"):
        torch.ops.ms_deform_attn._column_sum(torch.tensor(1.0, device=device))
    with pytest.raises(RuntimeError, match="grad must be float32, float16, bfloat16 or float64, got Long"):
        torch.ops.ms_deform_attn._column_sum(torch.ones(4, 3, dtype=torch.long, device=device))
    # A non-contiguous gradient is summed as its values say.
    g = torch.randn(64, 48, device=device).t()
    assert rel_err(torch.ops.ms_deform_attn._column_sum(g), g.double().sum(0)) <= 1e-6
    torch.library.opcheck(torch.ops.ms_deform_attn._column_sum.default, (torch.randn(9, 33, device=device),))


@pytest.mark.parametrize("device,backend", _devices())
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_linear_op(device, backend, bias):
    """_linear is torch's linear, forward and backward (gradcheck in
    float64), under autocast too (outputs and gradients in the same dtypes
    as torch's linear gives), and passes opcheck."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 16, generator=g, dtype=torch.float64).to(device).requires_grad_()
    w = torch.randn(24, 16, generator=g, dtype=torch.float64).to(device).requires_grad_()
    b = torch.randn(24, generator=g, dtype=torch.float64).to(device).requires_grad_() if bias else None
    lin = torch.ops.ms_deform_attn._linear
    assert torch.autograd.gradcheck(lambda *a: lin(*a), (x, w, b) if bias else (x, w, None))
    torch.library.opcheck(lin.default, (x, w, b))
    kind = torch.device(device).type
    low = torch.bfloat16
    xs, ws = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    bs = b.detach().float().requires_grad_() if bias else None
    outs = []
    for f in (lin, torch.nn.functional.linear):
        with torch.autocast(kind, dtype=low):
            y = f(xs, ws, bs)
        y.float().square().sum().backward()
        grads = [t.grad.clone() for t in (xs, ws, bs) if t is not None]
        for t in (xs, ws, bs):
            if t is not None:
                t.grad = None
        outs.append((y, grads))
    (y0, g0), (y1, g1) = outs
    assert y0.dtype == y1.dtype == low
    assert rel_err(y0, y1.double()) <= 1e-2
    for a, c in zip(g0, g1):
        assert a.dtype == c.dtype and rel_err(a, c.double()) <= 2e-2


def _from_linear_op(out: torch.Tensor) -> bool:
    """Whether autograd's node for `out` is _linear's: the C++ layer's
    LinearFunction or the one torch.library makes for the Python
    registration (a torch without its C++ layer in this build)."""
    name = out.grad_fn.name()
    return "LinearFunction" in name or "ms_deform_attn__linear" in name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_layer_linears_use_the_op():
    """On CUDA the layer's plain nn.Linear modules run as _linear (their bias
    gradient by _column_sum); a linear with a hook calls the module; the
    layer's parameter gradients match a run on the modules themselves
    (fast_linears=False), which call no _linear."""
    from ms_deform_attn import nn as msnn

    layer = MSDeformAttn(64, len(MODULE_LEVELS), 8, 3).cuda()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(2, 5, 64, device="cuda")
    assert _from_linear_op(msnn._linear(layer.value_proj, x))
    seen = []
    handle = layer.value_proj.register_forward_hook(lambda m, i, o: seen.append(1))
    assert not _from_linear_op(msnn._linear(layer.value_proj, x))
    assert seen == [1]
    handle.remove()
    query, ref, flat, shapes, start, pad, _ = module_inputs("cuda", d_model=64, mask=True)
    assert not _from_linear_op(msnn._linear(layer.value_proj, x, False))
    grads = []
    for fast in (True, False):
        layer.fast_linears = fast
        layer.zero_grad(set_to_none=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            layer(query, ref, flat, shapes, start, pad).square().sum().backward()
        called = any("ms_deform_attn::_linear" in e.name for e in prof.events())
        assert called == fast
        grads.append({n: p.grad.clone() for n, p in layer.named_parameters()})
    for n, g in grads[0].items():
        assert rel_err(g, grads[1][n].double()) <= 1e-5, n
