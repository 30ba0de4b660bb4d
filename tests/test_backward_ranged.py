"""The ranged grad_value kernel (csrc/cuda/backward_ranged.cu): problems with
few samples per value pixel (decoders), where a block owns a range of pixels
of one (n, m), sums their gradient in shared memory and writes grad_value
once, with no dense fp32 accumulator. Gradients against the float64
reference and against the plain atomic path
(MS_DEFORM_ATTN_BACKWARD_KERNEL=atomic), for ranges of one pixel up to the
whole map, every dtype, corners crowding onto one pixel, non-finite
locations, a level the device guard rejects, and NaN-filled outputs (every
element must be written). fp64 gradcheck reaches it through
test_backward.py (its shapes have few samples per pixel)."""
import pytest
import torch

import ms_deform_attn as msda
from ms_deform_attn.workloads import Workload, make_inputs as workload_inputs
from helpers import TOL, reference64_grads, rel_err

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

LEVELS = ((19, 37), (10, 19), (5, 10), (3, 5))  # S = 958
# Bytes of a block's sums: one pixel (0 asks for none: one is the least),
# a few pixels, the default, more than the whole map.
BUDGETS = [0, 600, -1, 1 << 20]


def decoder_inputs(dtype, loc_dtype, d, m=2, lq=20, n=2, levels=LEVELS, seed=0):
    wl = Workload("t", n, levels, lq, m, 4, "decoder", d)
    value, shapes, start, loc, attn = workload_inputs(wl, dtype, loc_dtype, "cuda", seed=seed)
    loc = loc.clone()
    loc.view(-1)[3] = float("nan")
    loc.view(-1)[50] = -float("inf")
    return value, shapes, start, loc, attn


def grads(inputs, grad, monkeypatch, kernel="default", budget=-1):
    monkeypatch.setenv("MS_DEFORM_ATTN_POISON", "1")
    monkeypatch.setenv("MS_DEFORM_ATTN_BACKWARD_KERNEL", kernel)
    monkeypatch.setenv("MS_DEFORM_ATTN_SMEM_BUDGET", str(budget))
    leaves = [t.detach().requires_grad_() for t in (inputs[0], inputs[3], inputs[4])]
    out = msda.ms_deform_attn(leaves[0], inputs[1], inputs[2], leaves[1], leaves[2])
    return torch.autograd.grad(out, leaves, grad)


def check(got, inputs, grad):
    value, shapes, start, loc, attn = inputs
    ref = reference64_grads(value, shapes, start, loc, attn, grad)
    for name, g, r, src in zip(("value", "locations", "weights"), got, ref, (value, loc, attn)):
        assert g.dtype == src.dtype and g.shape == src.shape, name
        err = rel_err(g, r)
        assert err <= TOL[src.dtype], f"grad of {name}: rel. error {err:.2e}"


def out_grad(inputs):
    value, loc = inputs[0], inputs[3]
    return torch.randn(loc.shape[0], loc.shape[1], value.shape[2] * value.shape[3],
                       device="cuda", dtype=value.dtype)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=str)
@pytest.mark.parametrize("loc_fp32", [False, True], ids=["loc_same", "loc_fp32"])
def test_ranged_matches_reference(monkeypatch, budget, dtype, loc_fp32):
    inputs = decoder_inputs(dtype, torch.float32 if loc_fp32 else dtype, d=32)
    grad = out_grad(inputs)
    check(grads(inputs, grad, monkeypatch, budget=budget), inputs, grad)


@pytest.mark.parametrize("d,m", [(8, 3), (30, 2), (64, 2), (256, 1), (40, 2)])
def test_ranged_channel_counts(monkeypatch, d, m):
    """D below, at and above a warp's 32 lanes; D = 30 takes the scalar writes."""
    for dtype in (torch.float32, torch.bfloat16):
        inputs = decoder_inputs(dtype, torch.float32, d=d, m=m, n=1)
        grad = out_grad(inputs)
        for budget in (-1, 4096):
            check(grads(inputs, grad, monkeypatch, budget=budget), inputs, grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ranged_crowded_corners(monkeypatch, dtype):
    """Every sample on the same location: all additions land on four pixels."""
    value, shapes, start, loc, attn = decoder_inputs(dtype, torch.float32, d=32, lq=60)
    loc = torch.full_like(loc, 0.41)
    inputs = (value, shapes, start, loc, attn)
    grad = out_grad(inputs)
    check(grads(inputs, grad, monkeypatch), inputs, grad)


def test_ranged_agrees_with_plain_path(monkeypatch):
    inputs = decoder_inputs(torch.float32, torch.float32, d=32, m=4)
    grad = out_grad(inputs)
    for budget in (0, -1):
        a = grads(inputs, grad, monkeypatch, budget=budget)
        b = grads(inputs, grad, monkeypatch, kernel="atomic")
        for x, y in zip(a, b):
            assert rel_err(x, y.double()) < 1e-6


def test_ranged_rejected_level(monkeypatch):
    """A level the kernels' device guard rejects (too large for S) samples
    nothing; grad_value is still written everywhere, as on the plain path."""
    value, shapes, start, loc, attn = decoder_inputs(torch.float32, torch.float32, d=32, n=1)
    bad = shapes.clone()
    bad[0] = torch.tensor([1 << 20, 1 << 20])
    grad = out_grad((value, bad, start, loc, attn))
    got = grads((value, bad, start, loc, attn), grad, monkeypatch)
    plain = grads((value, bad, start, loc, attn), grad, monkeypatch, kernel="atomic")
    for x, y in zip(got, plain):
        assert torch.isfinite(x).all()
        assert rel_err(x, y.double()) < 1e-6


def test_ranged_many_ranges_and_batches(monkeypatch):
    """rtdetr_dec-like: 3 levels, 16 images; ranges of 37 pixels (odd, so
    they straddle level boundaries)."""
    levels = ((20, 20), (10, 10), (5, 5))
    inputs = decoder_inputs(torch.bfloat16, torch.float32, d=32, m=8, lq=30, n=16,
                            levels=levels)
    grad = out_grad(inputs)
    check(grads(inputs, grad, monkeypatch, budget=37 * 32 * 4), inputs, grad)
