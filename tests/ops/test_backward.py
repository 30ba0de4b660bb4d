"""Gradients: gradcheck in float64, 16-bit and mixed dtypes against the
reference's autograd, double backward."""
import pytest
import torch

from ms_deform_attn.reference import ms_deform_attn_pytorch
from helpers import (LAYOUTS, TOL, bits, device_backends, head_major, in_layout, make_inputs, poisoned,
                     reference64_grads, rel_err, run)


def op(backend, deterministic=None):
    det = True if deterministic == "local" else deterministic
    return lambda v, s, st, l, a: run(v, s, st, l, a, backend, deterministic=det)


# The fast backward (atomics), the deterministic one by the global sort, and
# the deterministic one by the block-local sort (the decoders' default, where
# the samples of one (n, m, level) fit a block; else the global sort). The
# fixture below pins each mode's grad_value path on CUDA.
MODES = pytest.mark.parametrize("deterministic", [False, True, "local"], ids=["fast", "det", "local"])
PATHS = {False: "atomic", True: "sorted", "local": "local"}


@pytest.fixture(autouse=True)
def _grad_value_path(request, monkeypatch):
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and "deterministic" in callspec.params:
        monkeypatch.setenv("MS_DEFORM_ATTN_GRAD_VALUE", PATHS[callspec.params["deterministic"]])


def nondet_tol(deterministic):
    """gradcheck's tolerance between two backward runs on the same inputs: the
    fast path adds grad_value with atomics in whatever order they land, so its
    float64 sums may differ in the last bits between runs; the deterministic
    path must give the same bits."""
    return 0.0 if deterministic else 1e-12


@MODES
@LAYOUTS
@pytest.mark.parametrize("device,backend", device_backends(reference=True))
@pytest.mark.parametrize("shape", [
    (1, 5, 2, 4, [(4, 5)], 2),
    (2, 6, 3, 8, [(5, 3), (2, 4)], 3),
    (1, 4, 1, 33, [(3, 3), (2, 1), (1, 2)], 1),
])
def test_gradcheck(device, backend, shape, deterministic, layout):
    n, lq, m, d, shapes, p = shape
    value, shapes_t, start, loc, attn = make_inputs(n, lq, m, d, shapes, p, torch.float64,
                                                    device=device, outside=0.2,
                                                    requires_grad=True)
    value = in_layout(value, layout)
    f = op(backend, deterministic)
    assert torch.autograd.gradcheck(lambda v, l, a: f(v, shapes_t, start, l, a),
                                    (value, loc, attn), eps=1e-6, atol=1e-7,
                                    nondet_tol=nondet_tol(deterministic))


@MODES
@pytest.mark.parametrize("device,backend", device_backends())
def test_gradients_on_pixel_borders(device, backend, deterministic):
    """Locations exactly on pixel centres and the map border: value and weight
    gradients by gradcheck (smooth there), location gradients against the
    reference's (the same one-sided convention: the cell to the lower right)."""
    shapes = [(6, 8), (3, 4)]
    value, shapes_t, start, _, attn = make_inputs(1, 12, 2, 4, shapes, 2, torch.float64,
                                                  device=device, requires_grad=True)
    ticks = torch.tensor([0.0, 1 / 16, 0.25, 0.5, 1.0, -1 / 16, 1 + 1 / 16], dtype=torch.float64)
    loc = ticks[torch.randint(0, len(ticks), (1, 12, 2, 2, 2, 2))].to(device).requires_grad_()
    f = op(backend, deterministic)
    assert torch.autograd.gradcheck(lambda v, a: f(v, shapes_t, start, loc, a), (value, attn),
                                    nondet_tol=nondet_tol(deterministic))
    grad = torch.randn(1, 12, 8, dtype=torch.float64, device=device)
    (g_ours,) = torch.autograd.grad(f(value, shapes_t, start, loc, attn), loc, grad)
    (g_ref,) = torch.autograd.grad(ms_deform_attn_pytorch(value, shapes_t, start, loc, attn),
                                   loc, grad)
    torch.testing.assert_close(g_ours, g_ref)


@MODES
@pytest.mark.parametrize("device,backend", device_backends())
def test_location_gradients_at_pixel_centre_ties_are_the_pytorch_backends(device, backend,
                                                                         deterministic):
    """float32 locations on pixel centres ((j + 0.5) / W, rounded), where the
    pixel coordinate lands on an integer or next to it: the location gradient
    jumps there, and every kernel takes the cell the `pytorch` backend takes
    (one rounding after the product, one after the difference)."""
    shapes = [(100, 167), (50, 84), (25, 42), (13, 21)]
    value, shapes_t, start, loc, attn = make_inputs(1, 200, 2, 8, shapes, 2, torch.float32,
                                                    device=device)
    for lvl, (h, w) in enumerate(shapes):
        loc[..., lvl, :, 0] = (torch.randint(0, w, loc.shape[:3] + loc.shape[4:5]) + 0.5) / w
        loc[..., lvl, :, 1] = (torch.randint(0, h, loc.shape[:3] + loc.shape[4:5]) + 0.5) / h
    loc.requires_grad_()
    grad = torch.randn(1, 200, 16, device=device)
    (ours,) = torch.autograd.grad(op(backend, deterministic)(value, shapes_t, start, loc, attn),
                                  loc, grad)
    (plain,) = torch.autograd.grad(run(value, shapes_t, start, loc, attn, "pytorch"), loc, grad)
    assert rel_err(ours, plain) <= 1e-5


@MODES
@pytest.mark.parametrize("device,backend", device_backends(reference=True))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("loc_fp32", [False, True], ids=["loc_same", "loc_fp32"])
@pytest.mark.parametrize("d", [30, 32, 64])
def test_gradients_match_reference(device, backend, dtype, loc_fp32, d, deterministic):
    loc_dtype = torch.float32 if loc_fp32 else dtype
    inputs = make_inputs(2, 37, 4, d, [(9, 11), (5, 6), (3, 3)], 4, dtype, loc_dtype,
                         device=device, requires_grad=True)
    value, shapes, start, loc, attn = inputs
    out = op(backend, deterministic)(*inputs)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (value, loc, attn), grad)
    ref_grads = reference64_grads(value, shapes, start, loc, attn, grad)
    for name, g, r, src in zip(("value", "locations", "weights"), grads, ref_grads,
                               (value, loc, attn)):
        assert g.dtype == src.dtype, name
        assert g.shape == src.shape, name
        err = rel_err(g, r)
        assert err <= TOL[src.dtype], f"grad of {name}: rel. error {err:.2e}"


@pytest.mark.parametrize("device,backend", device_backends())
def test_double_backward_raises(device, backend):
    value, shapes, start, loc, attn = make_inputs(1, 4, 2, 8, [(3, 3)], 2, torch.float64,
                                                  device=device, requires_grad=True)
    out = op(backend)(value, shapes, start, loc, attn)
    (g,) = torch.autograd.grad(out.sum(), loc, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


@MODES
@pytest.mark.parametrize("device,backend", device_backends())
def test_backward_empty(device, backend, deterministic):
    value, shapes, start, loc, attn = make_inputs(2, 3, 2, 8, [(3, 3)], 2, torch.float32,
                                                  device=device)
    loc = loc[:, :0].requires_grad_()
    attn = attn[:, :0].requires_grad_()
    value.requires_grad_()
    op(backend, deterministic)(value, shapes, start, loc, attn).sum().backward()
    assert value.grad.abs().sum() == 0
    assert loc.grad.shape == loc.shape


def _grads(backend, inputs, grad, deterministic):
    value, shapes, start, loc, attn = inputs
    out = op(backend, deterministic)(value, shapes, start, loc, attn)
    return torch.autograd.grad(out, (value, loc, attn), grad)


def _crowded_inputs(device, dtype):
    """Many samples in few cells (heavy contention on grad_value), some
    outside, some exactly on borders and a few NaN."""
    inputs = make_inputs(2, 300, 4, 32, [(6, 7), (3, 4), (1, 1)], 4, dtype, torch.float32,
                         device=device, requires_grad=True)
    value, shapes, start, loc, attn = inputs
    with torch.no_grad():
        loc.mul_(0.3).add_(0.35)  # crowd into the middle of each level
        loc[0, :7] = torch.tensor([0.5, 0.0, 1.0, -0.2, 1.3, float("nan"), 0.25])[:, None, None,
                                                                                 None, None]
    return inputs


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("path", ["sorted", "local"])
def test_deterministic_backward_is_bitwise_reproducible(device, backend, dtype, path, monkeypatch):
    if device == "cpu" and path == "local":
        pytest.skip("one CPU path")
    inputs = _crowded_inputs(device, dtype)
    grad = torch.randn(2, 300, 4 * 32, dtype=dtype, device=device)
    monkeypatch.setenv("MS_DEFORM_ATTN_GRAD_VALUE", path)
    first = _grads(backend, inputs, grad, True)
    for _ in range(3):
        again = _grads(backend, inputs, grad, True)
        for a, b in zip(first, again):
            assert torch.equal(bits(a), bits(b))
    # ... and it is the same gradient as the fast path's, within tolerance.
    monkeypatch.setenv("MS_DEFORM_ATTN_GRAD_VALUE", "atomic")
    fast = _grads(backend, inputs, grad, False)
    for name, a, b in zip(("value", "locations", "weights"), first, fast):
        assert rel_err(a, b.double()) <= TOL[dtype], name


@pytest.mark.parametrize("device,backend", device_backends())
def test_deterministic_follows_torch_flag(device, backend):
    """deterministic=None follows torch.use_deterministic_algorithms()."""
    inputs = _crowded_inputs(device, torch.float32)
    grad = torch.randn(2, 300, 4 * 32, device=device)
    explicit = _grads(backend, inputs, grad, True)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        implicit = _grads(backend, inputs, grad, None)
    finally:
        torch.use_deterministic_algorithms(before)
    for a, b in zip(explicit, implicit):
        assert torch.equal(bits(a), bits(b))


@MODES
@pytest.mark.parametrize("device,backend", device_backends())
def test_non_finite_samples_make_their_gradients_nan(device, backend, deterministic):
    """A NaN or infinite location or weight: NaN location and weight
    gradients for that sample, nothing added to grad_value; every other
    gradient as the reference's with those samples removed."""
    inputs = make_inputs(2, 40, 4, 16, [(6, 7), (3, 4), (1, 1)], 3, torch.float32,
                         device=device)
    value, shapes, start, loc, attn = inputs
    specials = torch.tensor([float("nan"), float("inf"), -float("inf")], device=device)
    with torch.no_grad():
        loc[0, 0, 0, 0, 0, 0] = float("nan")
        loc[0, 1, 1, 1, 2, 1] = float("inf")
        attn[1, 2, 2, 0, 1] = float("nan")
        attn[1, 3, 3, 2, 0] = -float("inf")
        loc[1, 4:8] = torch.where(torch.rand(loc[1, 4:8].shape, device=device) < 0.05,
                                  specials[torch.randint(0, 3, loc[1, 4:8].shape, device=device)],
                                  loc[1, 4:8])
    value, loc, attn = (t.detach().requires_grad_() for t in (value, loc, attn))
    out = op(backend, deterministic)(value, shapes, start, loc, attn)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (value, loc, attn), grad)
    ref = reference64_grads(value, shapes, start, loc, attn, grad)
    bad = poisoned(loc, attn)
    assert torch.isnan(grads[1][bad]).all() and torch.isnan(grads[2][bad]).all()
    assert torch.isfinite(grads[0]).all()
    for name, got, want in zip(("value", "locations", "weights"), grads, ref):
        assert rel_err(got, want) <= TOL[torch.float32], name


@MODES
@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("workload", ["ddetr_enc/8", "ddetr_enc@smooth/8", "m2f_enc@smooth/8",
                                      "ddetr_dec/4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_gradients_on_workloads(device, backend, workload, dtype, deterministic):
    """The canonical workloads (scaled down) with their own location
    generators, `encoder`'s jitter and `smooth`'s trained-like field (designs
    that rely on locality must hold on both), against the float64 reference."""
    from ms_deform_attn import testing as W
    wl = W.get(workload)
    value, shapes, start, loc, attn = W.make_inputs(wl, dtype, torch.float32, device=device,
                                                    seed=3, requires_grad=True)
    grad = torch.randn(wl.n, wl.queries, wl.m * wl.d, device=device, dtype=dtype)
    out = op(backend, deterministic)(value, shapes, start, loc, attn)
    got = torch.autograd.grad(out, (value, loc, attn), grad)
    want = reference64_grads(value, shapes, start, loc, attn, grad)
    for name, g, r in zip(("value", "locations", "weights"), got, want):
        assert rel_err(g, r) <= TOL[dtype], name


@MODES
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("workload", ["ddetr_enc/8", "ddetr_enc@smooth/8", "ddetr_dec/4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_head_major_gradients(device, workload, dtype, deterministic):
    """value head-major: every backward path reads it in place and returns
    grad_value in the same layout; the deterministic ones give the contiguous
    value's gradients bit for bit."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from ms_deform_attn import testing as W
    wl = W.get(workload)
    value, shapes, start, loc, attn = W.make_inputs(wl, dtype, torch.float32, device=device,
                                                    seed=5, requires_grad=True)
    value_hm = head_major(value)
    grad = torch.randn(wl.n, wl.queries, wl.m * wl.d, device=device, dtype=dtype)
    backend = "cpu" if device == "cpu" else "baseline"
    got = torch.autograd.grad(op(backend, deterministic)(value_hm, shapes, start, loc, attn),
                              (value_hm, loc, attn), grad)
    assert got[0].stride() == value_hm.stride()
    want = reference64_grads(value, shapes, start, loc, attn, grad)
    for name, g, r in zip(("value", "locations", "weights"), got, want):
        assert rel_err(g, r) <= TOL[dtype], name
    if deterministic or device == "cpu":
        plain = torch.autograd.grad(op(backend, deterministic)(value, shapes, start, loc, attn),
                                    (value, loc, attn), grad)
        for name, a, b in zip(("value", "locations", "weights"), got, plain):
            assert torch.equal(bits(a), bits(b)), name


# The deterministic path's corner dots run on tensor cores for 16-bit values
# with D a multiple of 32, at most 32 samples a (query, head) once the points
# of a level are padded to 4, and 16-byte aligned value and grad_output
# (backward/mma_dots.cu, mma_dots_kernel); everything else takes the FFMA kernel.
# These shapes walk the edges of that kernel and its fall-backs.
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("d,shapes,p,lq,misaligned", [
    (96, [(9, 11), (5, 6)], 3, 37, False),           # three 32-channel passes, P padded to 4
    (128, [(7, 5)], 1, 21, False),                   # four passes, 3 padding slots of every 4
    (32, [(9, 11), (5, 6), (3, 3)], 5, 19, False),   # 8 slots a level: one group a warp task
    (32, [(4, 4)] * 4, 8, 13, False),                # L P = 32 exactly (the seed workload's)
    (64, [(1, 1), (2, 3)], 2, 7, False),             # 1 x 1 level, footprints mostly off the map
    (32, [(4, 4)] * 5, 8, 9, False),                 # 40 padded samples: the FFMA kernel
    (32, [(9, 11), (5, 6)], 4, 23, True),            # value not 16-byte aligned: the FFMA kernel
    # L Pp not dividing 32 with enough queries (8 warp tasks a resident warp
    # on 132 SMs and more): the flat slot sequence, groups straddling tasks
    (32, [(9, 11), (5, 6), (3, 3)], 4, 16001, False),  # L Pp = 12
    (64, [(9, 11), (5, 6), (3, 3), (2, 2), (1, 1)], 4, 9001, False),  # 20, two channel passes
    (32, [(6, 7), (5, 5), (4, 3), (3, 3), (2, 3), (2, 2), (1, 2)], 4, 7001, False),  # 28
    (32, [(9, 11), (5, 6), (3, 3)], 3, 16003, False),  # 12 with a padding slot a level
], ids=["d96-p3", "d128-p1", "p5", "lp32", "tiny-levels", "lp40-ffma", "misaligned-ffma",
        "flat-lp12", "flat-lp20-d64", "flat-lp28", "flat-lp12-p3"])
def test_deterministic_dots_on_tensor_cores(dtype, d, shapes, p, lq, misaligned):
    inputs = make_inputs(3, lq, 3, d, shapes, p, dtype, torch.float32, device="cuda")
    value, shapes_t, start, loc, attn = inputs
    if misaligned:  # the same values one element into a larger buffer
        buf = torch.empty(value.numel() + 1, dtype=dtype, device="cuda")
        buf[1:].copy_(value.flatten())
        value = buf[1:].view(value.shape)
        assert value.data_ptr() % 16 != 0
    value, loc, attn = (t.detach().requires_grad_() for t in (value, loc, attn))
    out = run(value, shapes_t, start, loc, attn, "baseline", deterministic=True)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (value, loc, attn), grad)
    ref = reference64_grads(value, shapes_t, start, loc, attn, grad)
    for name, g, r in zip(("value", "locations", "weights"), grads, ref):
        err = rel_err(g, r)
        assert err <= TOL[dtype], f"grad of {name}: rel. error {err:.2e}"
    again = torch.autograd.grad(run(value, shapes_t, start, loc, attn, "baseline",
                                    deterministic=True), (value, loc, attn), grad)
    for a, b in zip(grads, again):
        assert torch.equal(a, b)


# The deterministic path's grad_value runs on tensor cores for 16-bit values
# with D a multiple of 32 (backward/sorted_grad_value.cu, grad_value_tiles_kernel): 4 x 4
# pixel tiles, the samples of the 5 x 5 cells around each, crowded tiles
# split over several warps. These shapes walk its edges: levels narrower than
# a tile or not a multiple of 4, several 32-channel passes, every sample in
# one tile, locations outside the map; and, for fp16's scaled weights,
# weights of every size (rounds that hold weights of 8 and more take their
# own scale).
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,shapes,p,lq,case", [
    (32, [(1, 1), (1, 7), (7, 1), (5, 9)], 4, 50, None),
    (64, [(13, 21), (4, 4), (2, 3)], 3, 300, None),   # two passes; split tiles on (2, 3)
    (96, [(6, 10)], 2, 40, None),                     # three passes
    (32, [(16, 16), (8, 8)], 4, 2000, "crowd"),       # every sample within 2 pixels of one point
    (32, [(13, 21), (4, 4)], 4, 300, "wide-weights"),  # weights from 1e-6 to 3e3
], ids=["narrow-levels", "d64", "d96", "one-tile", "wide-weights"])
def test_deterministic_grad_value_on_tensor_cores(dtype, d, shapes, p, lq, case, monkeypatch):
    monkeypatch.setenv("MS_DEFORM_ATTN_GRAD_VALUE", "sorted")  # not the block-local path
    value, shapes_t, start, loc, attn = make_inputs(2, lq, 3, d, shapes, p, dtype, torch.float32,
                                                    device="cuda", seed=11)
    if case == "crowd":
        loc = 0.4 + 0.1 * torch.rand_like(loc)
    if case == "wide-weights":
        g = torch.Generator(device="cuda").manual_seed(3)
        attn = attn * torch.exp2(torch.empty_like(attn).uniform_(-20, 12, generator=g))
    value, loc, attn = (t.detach().requires_grad_() for t in (value, loc, attn))
    out = run(value, shapes_t, start, loc, attn, "baseline", deterministic=True)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (value, loc, attn), grad)
    ref = reference64_grads(value, shapes_t, start, loc, attn, grad)
    # bf16 rounding of the output alone is ~1e-3; weights cut to bf16 would add
    # about as much again.
    assert rel_err(grads[0], ref[0]) <= (3e-3 if dtype == torch.bfloat16 else TOL[dtype])
    for name, g, r in zip(("locations", "weights"), grads[1:], ref[1:]):
        assert rel_err(g, r) <= TOL[dtype], name
    again = torch.autograd.grad(run(value, shapes_t, start, loc, attn, "baseline",
                                    deterministic=True), (value, loc, attn), grad)
    for a, b in zip(grads, again):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dense_16bit_default_backward_is_the_sorted_one(dtype):
    """Dense 16-bit problems (S / 3 <= Lq L P <= S D, D a multiple of 32) take
    the sorted backward without being asked (it is the faster one there,
    docs/performance.md): the default gradients are bitwise those of
    deterministic=True."""
    value, shapes, start, loc, attn = make_inputs(2, 129, 4, 32, [(9, 11), (5, 6)], 4,
                                                  dtype, torch.float32, device="cuda", seed=5)
    value, loc, attn = (t.detach().requires_grad_() for t in (value, loc, attn))
    grad = torch.randn(2, 129, 4 * 32, device="cuda", dtype=dtype)
    got = [torch.autograd.grad(run(value, shapes, start, loc, attn, "baseline", deterministic=det),
                               (value, loc, attn), grad) for det in (False, True)]
    for a, b in zip(*got):
        assert torch.equal(a, b)
