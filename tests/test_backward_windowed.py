"""The windowed backward (csrc/cuda/backward_windowed.cu): encoder-shaped
problems (one query per pixel of every level, Lq == S) on sm_90+, where
grad_value's additions are gathered in shared-memory windows before they go
to global memory. Gradients against the float64 reference and against the
plain kernel (MS_DEFORM_ATTN_BACKWARD_KERNEL=atomic), for window sizes from
none (every corner to global memory) to larger than any footprint, corners
crowding onto one pixel (retried compare-and-swaps), locations far outside
and not finite, and levels that do not tile the queries (consecutive-query
tiles instead of patches). On other GPUs the same tests check the plain
kernel."""
import pytest
import torch

import ms_deform_attn as msda
from ms_deform_attn.workloads import Workload, make_inputs as workload_inputs
from helpers import TOL, reference64_grads, rel_err

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Levels whose sides are not multiples of the 16 x 8 patch; one level; a 1 x 1 level.
LEVELS = {
    "four": ((19, 37), (10, 19), (5, 10), (3, 5)),
    "one": ((33, 40),),
    "tiny": ((7, 3), (1, 1)),
}
# Window bytes: none, a few pixels, the default, larger than any footprint here.
BUDGETS = [0, 512, -1, 150_000]


def encoder_inputs(levels, dtype, loc_dtype, d, m=2, p=4, n=2, seed=0, far=0.05):
    wl = Workload("t", n, levels, None, m, p, "encoder", d)
    value, shapes, start, loc, attn = workload_inputs(wl, dtype, loc_dtype, "cuda", seed=seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    # Some locations far outside, some not finite (sample nothing).
    pick = torch.rand(loc.shape[:-1], generator=g) < far
    loc = loc.clone()
    loc[pick.to(loc.device)] = torch.tensor([3.0, -2.0], dtype=loc.dtype, device=loc.device)
    loc.view(-1)[7] = float("nan")
    loc.view(-1)[100] = float("inf")
    return value, shapes, start, loc, attn


def grads(inputs, grad, monkeypatch, kernel="windowed", budget=-1):
    monkeypatch.setenv("MS_DEFORM_ATTN_BACKWARD_KERNEL", kernel)
    monkeypatch.setenv("MS_DEFORM_ATTN_SMEM_BUDGET", str(budget))
    leaves = [inputs[0], inputs[3], inputs[4]]
    leaves = [t.detach().requires_grad_() for t in leaves]
    out = msda.ms_deform_attn(leaves[0], inputs[1], inputs[2], leaves[1], leaves[2])
    return torch.autograd.grad(out, leaves, grad)


def check(got, inputs, grad, dtype):
    value, shapes, start, loc, attn = inputs
    ref = reference64_grads(value, shapes, start, loc, attn, grad)
    for name, g, r, src in zip(("value", "locations", "weights"), got, ref, (value, loc, attn)):
        assert g.dtype == src.dtype and g.shape == src.shape, name
        err = rel_err(g, r)
        assert err <= TOL[src.dtype], f"grad of {name}: rel. error {err:.2e}"


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("levels", list(LEVELS), ids=list(LEVELS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("loc_fp32", [False, True], ids=["loc_same", "loc_fp32"])
def test_windowed_matches_reference(monkeypatch, budget, levels, dtype, loc_fp32):
    loc_dtype = torch.float32 if loc_fp32 else dtype
    inputs = encoder_inputs(LEVELS[levels], dtype, loc_dtype, d=32)
    grad = torch.randn(inputs[3].shape[0], inputs[3].shape[1], 2 * 32, device="cuda", dtype=dtype)
    check(grads(inputs, grad, monkeypatch, budget=budget), inputs, grad, dtype)


@pytest.mark.parametrize("d,m", [(8, 3), (16, 2), (64, 2), (256, 1), (40, 2)])
def test_windowed_channel_counts(monkeypatch, d, m):
    """Lanes per group from 1 to 32 (D = 8 .. 256), and D = 40 (5 lanes' worth
    in groups of 8: idle lanes)."""
    inputs = encoder_inputs(LEVELS["four"], torch.float32, torch.float32, d=d, m=m, n=1)
    grad = torch.randn(1, inputs[3].shape[1], m * d, device="cuda")
    for budget in (-1, 1024):
        check(grads(inputs, grad, monkeypatch, budget=budget), inputs, grad, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_windowed_crowded_corners(monkeypatch, dtype):
    """Every sample of every query on the same location: all additions of a
    block land on the same four pixels at once (compare-and-swap retries)."""
    value, shapes, start, loc, attn = encoder_inputs(LEVELS["four"], dtype, torch.float32, d=32,
                                                     far=0.0)
    loc = torch.full_like(loc, 0.37)
    inputs = (value, shapes, start, loc, attn)
    grad = torch.randn(loc.shape[0], loc.shape[1], 64, device="cuda", dtype=dtype)
    check(grads(inputs, grad, monkeypatch), inputs, grad, dtype)


def test_windowed_agrees_with_plain_kernel(monkeypatch):
    """fp32: the windowed and the plain kernel add the same terms in other
    orders, so they agree to fp32 rounding."""
    inputs = encoder_inputs(LEVELS["four"], torch.float32, torch.float32, d=32, m=4)
    grad = torch.randn(inputs[3].shape[0], inputs[3].shape[1], 4 * 32, device="cuda")
    a = grads(inputs, grad, monkeypatch, kernel="windowed")
    b = grads(inputs, grad, monkeypatch, kernel="atomic")
    for x, y in zip(a, b):
        assert rel_err(x, y.double()) < 1e-6


def test_windowed_without_patches(monkeypatch):
    """Lq == S, but the levels on the device do not tile the queries (a level
    too large for S is made empty by the kernels' guard): the kernel takes
    consecutive queries instead of patches, and every query's gradients are
    still written (NaN-filled outputs would show)."""
    monkeypatch.setenv("MS_DEFORM_ATTN_POISON", "1")
    value, shapes, start, loc, attn = encoder_inputs(LEVELS["four"], torch.float32,
                                                     torch.float32, d=32, n=1)
    bad = shapes.clone()
    bad[0] = torch.tensor([1 << 20, 1 << 20])
    grad = torch.randn(1, loc.shape[1], 64, device="cuda")
    got = grads((value, bad, start, loc, attn), grad, monkeypatch)
    plain = grads((value, bad, start, loc, attn), grad, monkeypatch, kernel="atomic")
    for x, y in zip(got, plain):
        assert torch.isfinite(x).all()
        assert rel_err(x, y.double()) < 1e-6
