"""Tensors of more than 2^31 elements (64-bit offsets everywhere): a huge
value map, and huge sampling tensors. Outputs are checked against a float64
gather reference on the queries it can afford; grad_value by the adjoint
identity <grad_value(g), v> = <g, forward(v)> with g = forward(v), which
any wrong or stray element would break. GPU only; skipped where memory is short."""
import gc

import pytest
import torch

import ms_deform_attn as msda
from helpers import away_from_pixel_borders, cuda_backends, reference_gather, rel_err
from ms_deform_attn.testing import level_tensors

pytestmark = pytest.mark.cuda

GIB = 1 << 30


def need_free(nbytes):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gc.collect()  # the earlier tests' tensors, still cached by the allocator
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes:
        pytest.skip(f"needs {nbytes / GIB:.0f} GiB free on the GPU, has {free / GIB:.0f}")


def chunked_dot(a, b, chunk=1 << 27):
    """<a, b> in float64 over flat views, chunk by chunk (no float64 copy)."""
    a, b = a.reshape(-1), b.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=a.device)
    for i in range(0, a.numel(), chunk):
        total += (a[i:i + chunk].double() * b[i:i + chunk].double()).sum()
    return total.item()


def check_backward(value, shapes, start, loc, attn, out, grad, deterministic, queries):
    """Adjoint check of grad_value; loc / weight gradients of `queries`
    against the gather reference's autograd."""
    bwd = torch.ops.ms_deform_attn._ms_deform_attn_backward
    g_value, g_loc, g_attn = bwd(grad, value, shapes, start, loc, attn, deterministic)
    lhs = chunked_dot(g_value, value)
    rhs = chunked_dot(grad, out)
    assert abs(lhs - rhs) <= 2e-2 * abs(rhs), (lhs, rhs)
    del g_value
    sub_loc = loc[:, queries].detach().double().requires_grad_()
    sub_attn = attn[:, queries].detach().double().requires_grad_()
    ref = reference_gather(value, shapes, start, sub_loc, sub_attn)
    r_loc, r_attn = torch.autograd.grad(ref, (sub_loc, sub_attn), grad[:, queries].double())
    assert rel_err(g_loc[:, queries], r_loc) < 1e-3
    assert rel_err(g_attn[:, queries], r_attn) < 1e-3


@pytest.mark.parametrize("backend", [p.values[1] for p in cuda_backends()])
def test_huge_value(backend):
    """value (1, 21 M, 4, 32) bf16: 2.7e9 elements, 5.4 GB."""
    need_free(36 * GIB)
    levels = [(4096, 4096), (2048, 2048)]
    shapes, start = level_tensors(levels, "cuda")
    s = sum(h * w for h, w in levels)
    g = torch.Generator(device="cuda").manual_seed(0)
    value = torch.randn(1, s, 4, 32, device="cuda", dtype=torch.bfloat16, generator=g)
    assert value.numel() > 2**31
    q = 4096
    loc = torch.rand(1, q, 4, 2, 4, 2, device="cuda", generator=g, dtype=torch.float64) * 1.2 - 0.1
    loc = away_from_pixel_borders(loc.cpu(), levels).float().cuda()
    attn = torch.rand(1, q, 4, 2, 4, device="cuda", generator=g)
    out = msda.ms_deform_attn(value, shapes, start, loc, attn, backend=backend,
                              spatial_shapes_list=levels)
    assert rel_err(out, reference_gather(value, shapes, start, loc, attn)) < 1e-2
    grad = out.clone()
    for det in (False, True):
        check_backward(value, shapes, start, loc, attn, out, grad, det, torch.arange(0, q, 7))


@pytest.mark.parametrize("backend", [p.values[1] for p in cuda_backends()])
def test_huge_sampling_tensors(backend):
    """sampling_locations (1, 4.2 M, 8, 1, 33, 2) fp32: 2.2e9 elements, 8.9 GB."""
    need_free(40 * GIB)
    shapes, start = level_tensors([(64, 64)], "cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    q, m, p = 1 << 22, 8, 33
    value = torch.randn(1, 64 * 64, m, 8, device="cuda", dtype=torch.bfloat16, generator=g)
    loc = torch.rand(1, q, m, 1, p, 2, device="cuda", generator=g) * 1.2 - 0.1
    assert loc.numel() > 2**31
    attn = torch.rand(1, q, m, 1, p, device="cuda", generator=g)
    # A sample of queries, including the last ones (the largest offsets),
    # kept off pixel borders for the location-gradient check.
    queries = torch.cat([torch.randint(0, q, (1000,), generator=torch.Generator().manual_seed(2)),
                         torch.arange(q - 24, q)]).cuda()
    loc[:, queries] = away_from_pixel_borders(loc[:, queries].double().cpu(), [(64, 64)]).float().cuda()
    out = msda.ms_deform_attn(value, shapes, start, loc, attn, backend=backend,
                              spatial_shapes_list=[(64, 64)])
    ref = reference_gather(value, shapes, start, loc[:, queries], attn[:, queries])
    assert rel_err(out[:, queries], ref) < 1e-2
    grad = out.clone()
    check_backward(value, shapes, start, loc, attn, out, grad, False, queries)
    # The deterministic path sorts 1.1e9 samples: 4 x 4.4 GB of keys and ids,
    # 17.7 GB of weights and the sort's scratch.
    free, _ = torch.cuda.mem_get_info()
    if free >= 48 * GIB:
        check_backward(value, shapes, start, loc, attn, out, grad, True, queries)
