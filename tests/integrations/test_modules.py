"""The drop-in modules and functions: Deformable DETR's MSDeformAttn (state
dict, initialisation, every option against the reference module), the
compat functions of Deformable DETR and mmcv, autocast, recomputation."""
import math

import pytest
import torch

import ms_deform_attn as msda
from ms_deform_attn.compat import (MSDeformAttnFunction, MultiScaleDeformableAttnFunction,
                                   multi_scale_deformable_attn_pytorch)
from ms_deform_attn.nn import MSDeformAttn
from ms_deform_attn.reference import ms_deform_attn_pytorch
from helpers import (MODULE_LEVELS, TOL, VALUE_LAYOUTS, device_backends, make_inputs,
                     make_module_pair, module_inputs, rel_err)


def test_state_dict_of_the_deformable_detr_module_loads_strictly():
    # Names and shapes of Deformable DETR's MSDeformAttn(256, 4, 8, 4).
    sd = {
        "sampling_offsets.weight": torch.randn(256, 256), "sampling_offsets.bias": torch.randn(256),
        "attention_weights.weight": torch.randn(128, 256), "attention_weights.bias": torch.randn(128),
        "value_proj.weight": torch.randn(256, 256), "value_proj.bias": torch.randn(256),
        "output_proj.weight": torch.randn(256, 256), "output_proj.bias": torch.randn(256),
    }
    m = MSDeformAttn()
    m.load_state_dict(sd, strict=True)
    assert torch.equal(m.sampling_offsets.bias, sd["sampling_offsets.bias"])


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.float32, True)],
                         ids=["fp32", "bf16", "bf16-autocast"])
def test_fused_by_default(monkeypatch, dtype, autocast):
    import ms_deform_attn.nn as nn_module
    calls = []
    real = nn_module.ms_deform_attn_fused
    monkeypatch.setattr(nn_module, "ms_deform_attn_fused",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    layer = MSDeformAttn(64, len(MODULE_LEVELS), 8, 3).to(dtype)
    assert layer.fused
    query, ref, flat, shapes, start, _, levels = module_inputs("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = layer(query.to(dtype), ref, flat.to(dtype), shapes, start, None, levels)
    assert len(calls) == 1
    assert out.dtype == (torch.bfloat16 if autocast else dtype)


def test_initialisation_matches_deformable_detr():
    m = MSDeformAttn(256, 4, 8, 4)
    bias = m.sampling_offsets.bias.view(8, 4, 4, 2)
    # Head 0 looks along +x, head 2 along +y, head 4 along -x; point p is p + 1 steps out.
    torch.testing.assert_close(bias[0, 2, :, 0], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    torch.testing.assert_close(bias[2, 1, 3], torch.tensor([0.0, 4.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(bias[4, 0, 1], torch.tensor([-2.0, 0.0]), atol=1e-6, rtol=0)
    # Head 1 (45 degrees): both components scaled to 1.
    torch.testing.assert_close(bias[1, 3, 0], torch.tensor([1.0, 1.0]))
    assert m.sampling_offsets.weight.abs().sum() == 0
    assert m.attention_weights.weight.abs().sum() == 0 and m.attention_weights.bias.abs().sum() == 0
    assert m.value_proj.bias.abs().sum() == 0 and m.output_proj.bias.abs().sum() == 0
    bound = math.sqrt(6.0 / (256 + 256))  # xavier_uniform
    assert m.value_proj.weight.abs().max() <= bound


@VALUE_LAYOUTS
@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("boxes", [False, True], ids=["points", "boxes"])
@pytest.mark.parametrize("mask", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_module_matches_reference_module(device, backend, boxes, mask, fused, layout):
    ours, ref = make_module_pair(device, backend, fused=fused, layout=layout)
    args = module_inputs(device, boxes=boxes, mask=mask)
    out = ours(*args)
    expected = ref(*args)
    assert out.shape == expected.shape
    assert rel_err(out, expected.double()) <= 1e-5
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad.double()) <= 1e-4, name


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_head_major_value_reaches_the_operator(device, backend, fused, autocast, monkeypatch):
    """value_layout="head_major": value_proj's output goes to the operator
    head-major (no copy on the way), masked at padding; the layer's output
    and gradients are the standard layout's within the GEMMs' rounding."""
    import ms_deform_attn.nn as msnn
    seen = []
    for name in ("ms_deform_attn", "ms_deform_attn_fused"):
        real = getattr(msnn, name)

        def spy(value, *rest, real=real, **kw):
            seen.append(value.stride())
            return real(value, *rest, **kw)
        monkeypatch.setattr(msnn, name, spy)
    args = module_inputs(device, mask=True)
    results = []
    for layout in ("standard", "head_major"):
        layer, _ = make_module_pair(device, backend, fused=fused, layout=layout)
        query, flat = (t.clone().requires_grad_() for t in (args[0], args[2]))
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = layer(query, args[1], flat, *args[3:])
        grads = torch.autograd.grad(out.float().square().sum(), [query, flat, *layer.parameters()])
        results.append((out, grads))
    s, m, d = flat.shape[1], 8, 8
    assert seen == [(s * m * d, m * d, d, 1), (m * s * d, d, s * d, 1)]
    tol = 2e-2 if autocast else 1e-5
    for a, b in zip([results[0][0], *results[0][1]], [results[1][0], *results[1][1]]):
        assert a.dtype == b.dtype
        assert rel_err(b, a.double()) <= tol


def test_value_layout_is_checked():
    with pytest.raises(ValueError, match="value_layout"):
        MSDeformAttn(64, 3, 8, 3, value_layout="nhwc")


def test_bad_reference_points():
    m = MSDeformAttn(64, len(MODULE_LEVELS), 8, 3)
    query, ref, flat, shapes, start, _, _ = module_inputs("cpu", boxes=True)
    with pytest.raises(ValueError, match="must be 2 or 4, got 3"):
        m(query, ref[..., :3], flat, shapes, start)


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("fn", [MSDeformAttnFunction, MultiScaleDeformableAttnFunction],
                         ids=["MSDeformAttnFunction", "MultiScaleDeformableAttnFunction"])
def test_function_compat(device, backend, fn):
    inputs = make_inputs(3, 20, 8, 32, MODULE_LEVELS, 4, torch.float32, device=device, requires_grad=True)
    out = fn.apply(*inputs, 5)  # an im2col_step that divides nothing: no limit
    expected = msda.ms_deform_attn(*inputs)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (inputs[0], inputs[3], inputs[4]), g)
    expected_grads = torch.autograd.grad(expected, (inputs[0], inputs[3], inputs[4]), g)
    for a, b in zip(grads, expected_grads):
        # grad_value sums with float atomics on CUDA: equal up to summation order.
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("as_list", [False, True], ids=["tensor", "list"])
def test_mmcv_style_function(device, backend, as_list):
    value, shapes, start, loc, attn = make_inputs(2, 11, 4, 16, MODULE_LEVELS, 2, torch.float64,
                                                  device=device)
    spatial = MODULE_LEVELS if as_list else shapes
    out = multi_scale_deformable_attn_pytorch(value, spatial, loc, attn)
    expected = ms_deform_attn_pytorch(value, shapes, start, loc, attn)
    assert rel_err(out, expected) <= 1e-12


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_autocast_module(device, backend, fused):
    ours, ref = make_module_pair(device, backend, fused=fused)
    args = module_inputs(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = ours(*args)
    assert out.dtype == torch.bfloat16
    expected = ref(*args)
    # bf16 projections and bf16 value: within bf16 error of the fp32 module.
    assert rel_err(out.float(), expected.double()) <= 3e-2
    out.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ours.parameters())


@VALUE_LAYOUTS
@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("boxes,mask", [(False, False), (True, True)], ids=["points", "boxes-mask"])
def test_recompute_matches_keeping(device, backend, autocast, boxes, mask, layout):
    # The fused layer forming value, offsets and logits again at the
    # backward: the same output and gradients as keeping them.
    args = module_inputs(device, boxes=boxes, mask=mask)
    results = []
    for recompute in (True, False):
        layer, _ = make_module_pair(device, backend, fused=True, layout=layout)
        layer.recompute = recompute
        query, flat = (t.clone().requires_grad_() for t in (args[0], args[2]))
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            # Leaves (whose casts autocast caches) in one case, activations
            # (cast here) in the other.
            out = layer(query, args[1], flat * 1.0 if mask else flat, *args[3:])
        grads = torch.autograd.grad(out.float().square().sum(), [query, flat, *layer.parameters()])
        results.append((out, grads))
    for a, b in zip([results[0][0], *results[0][1]], [results[1][0], *results[1][1]]):
        assert a.dtype == b.dtype
        assert torch.isfinite(a).all()
        # The GEMMs run again on the same inputs: bitwise the same where the
        # library is deterministic (the CPU), within rounding elsewhere.
        if device == "cpu":
            assert torch.equal(a, b)
        else:
            assert rel_err(a, b.double()) <= 1e-6


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("recompute", [True, False])
def test_recompute_drops_the_operator_inputs(device, backend, recompute, monkeypatch):
    # With recompute the operator's value, offsets and logits are freed after
    # the forward (autograd keeps a function in their place); without, kept.
    import weakref
    import ms_deform_attn.nn as layers
    made = []
    real = layers._recomputing

    def spy(remakes):
        made.extend(weakref.ref(t) for t, _ in remakes)
        return real(remakes)

    monkeypatch.setattr(layers, "_recomputing", spy)
    layer, _ = make_module_pair(device, backend, fused=True)
    layer.recompute = recompute
    args = module_inputs(device)
    query = args[0].clone().requires_grad_()
    out = layer(query, *args[1:])
    assert len(made) == (3 if recompute else 0)
    assert all(r() is None for r in made)
    out.sum().backward()
    assert query.grad is not None and torch.isfinite(query.grad).all()


def linears_as_modules(layer, query, flat):
    """What nn._project computes, by calling the layer's linears as modules on
    the inputs as given."""
    n, lq, _ = query.shape
    m, lvl, pts = layer.n_heads, layer.n_levels, layer.n_points
    return (layer.value_proj(flat).view(n, flat.shape[1], m, -1),
            layer.sampling_offsets(query).view(n, lq, m, lvl, pts, 2),
            layer.attention_weights(query).view(n, lq, m, lvl * pts))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")])])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_projections_match_the_linears_as_modules(device, autocast):
    # nn._project casts a (non-leaf) query once under autocast for the two
    # linears that read it: the same results and gradients.
    from ms_deform_attn.nn import _project as project
    layer, _ = make_module_pair(device, "auto")
    query0, _, flat0, _, _, _, _ = module_inputs(device)
    linears = (layer.value_proj, layer.sampling_offsets, layer.attention_weights)
    leaves = [query0.requires_grad_(), flat0.requires_grad_()] + [
        p for lin in linears for p in lin.parameters()]
    results = []
    for run in (project, linears_as_modules):
        torch.manual_seed(3)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            query, flat = query0 * 1.0, flat0 * 1.0  # not leaves, as in a model
            ys = run(layer, query, flat)[:3]
        loss = sum((y.float() * torch.randn(y.shape, device=device)).sum() for y in ys)
        results.append((ys, torch.autograd.grad(loss, leaves)))
    tol = 1e-2 if autocast else 1e-6
    for a, b in zip(results[0][0], results[1][0]):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel_err(a, b.double()) <= tol
    for a, b in zip(results[0][1], results[1][1]):
        assert a.dtype == b.dtype
        assert rel_err(a, b.double()) <= tol


@pytest.mark.parametrize("device,backend", device_backends())
def test_autocast_accepts_any_input_mix(device, backend):
    value, shapes, start, loc, attn = make_inputs(2, 9, 4, 16, MODULE_LEVELS, 2, torch.float32,
                                                  device=device)
    # bf16 locations with an fp32 value: refused outside autocast...
    with pytest.raises(RuntimeError, match="sampling_locations must have the value's dtype"):
        msda.ms_deform_attn(value, shapes, start, loc.bfloat16(), attn)
    # ...accepted under it (locations upcast to fp32).
    with torch.autocast(device, dtype=torch.bfloat16):
        out = msda.ms_deform_attn(value, shapes, start, loc.bfloat16(), attn.half())
    assert out.dtype == torch.float32
    expected = ms_deform_attn_pytorch(value.double(), shapes, start, loc.bfloat16().double(),
                                      attn.half().double())
    assert rel_err(out, expected) <= TOL[torch.float32]
