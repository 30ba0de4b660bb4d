"""Property-based test: hypothesis draws shapes, dtypes, backends and
location distributions; the operator (forward, and backward both ways) must
match the float64 reference. Budget: MSDA_FUZZ_EXAMPLES examples (25 by
default; the GPU check script runs more)."""
import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ms_deform_attn as msda  # noqa: E402
from helpers import (DTYPES, TOL, away_from_pixel_borders, kernel_backends, reference64,  # noqa: E402
                     reference64_grads, rel_err)
from ms_deform_attn.testing import level_tensors  # noqa: E402

EXAMPLES = int(os.environ.get("MSDA_FUZZ_EXAMPLES", "25"))


def targets():
    out = [("cpu", "cpu")]
    if torch.cuda.is_available():
        out += [("cuda", b) for b in kernel_backends("cuda")]
    return out


@st.composite
def problems(draw):
    device, backend = draw(st.sampled_from(targets()))
    levels = draw(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1,
                           max_size=4))
    dtype = draw(st.sampled_from(DTYPES))
    return dict(
        device=device, backend=backend, levels=levels, dtype=dtype,
        loc_fp32=draw(st.booleans()) and dtype != torch.float64,
        n=draw(st.integers(1, 3)), lq=draw(st.integers(1, 40)), m=draw(st.integers(1, 4)),
        d=draw(st.sampled_from([1, 2, 3, 8, 16, 30, 32, 33, 64])),
        p=draw(st.integers(1, 5)),
        where=draw(st.sampled_from(["inside", "wide", "clustered", "borders", "non_finite"])),
        deterministic=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def locations(where, shape, levels, g):
    if where == "inside":
        loc = torch.rand(shape, generator=g, dtype=torch.float64)
    elif where == "wide":  # many samples outside the map, some far outside
        loc = torch.rand(shape, generator=g, dtype=torch.float64) * 3 - 1
    elif where == "clustered":  # heavy contention on a few pixels
        loc = 0.5 + 0.02 * torch.randn(shape, generator=g, dtype=torch.float64)
    elif where == "borders":  # exactly on pixel centres and map edges
        ticks = torch.tensor([0.0, 0.25, 0.5, 1.0, -0.5, 1.5, 0.125], dtype=torch.float64)
        loc = ticks[torch.randint(0, len(ticks), shape, generator=g)]
    else:  # NaN and infinities among normal locations
        loc = torch.rand(shape, generator=g, dtype=torch.float64)
        bad = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30], dtype=torch.float64)
        pick = torch.rand(shape, generator=g) < 0.2
        loc = torch.where(pick, bad[torch.randint(0, 4, shape, generator=g)], loc)
    if where != "borders":
        loc = away_from_pixel_borders(loc, levels)
    return loc


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.filter_too_much])
@given(problems())
def test_fuzz_against_reference(pb):
    g = torch.Generator().manual_seed(pb["seed"])
    dev, dtype, levels = pb["device"], pb["dtype"], pb["levels"]
    loc_dtype = torch.float32 if pb["loc_fp32"] else dtype
    n, lq, m, d, p, nl = pb["n"], pb["lq"], pb["m"], pb["d"], pb["p"], len(pb["levels"])
    s = sum(h * w for h, w in levels)
    shapes, start = level_tensors(levels, dev)
    value = torch.randn(n, s, m, d, generator=g, dtype=torch.float64).to(dev, dtype)
    loc = locations(pb["where"], (n, lq, m, nl, p, 2), levels, g).to(dev, loc_dtype)
    attn = torch.rand(n, lq, m, nl, p, generator=g, dtype=torch.float64)
    attn = (attn / attn.sum((-1, -2), keepdim=True)).to(dev, loc_dtype)
    for t in (value, loc, attn):
        t.requires_grad_()

    # Inputs the drawn backend's predicate rejects (tma: float64, odd D) are
    # drawn again; the host-side shapes go to every backend (tma needs them).
    assume(msda.backend_reason(pb["backend"], value, shapes, start, loc, attn,
                               spatial_shapes_list=levels) == "")
    out = msda.ms_deform_attn(value, shapes, start, loc, attn, backend=pb["backend"],
                              deterministic=pb["deterministic"], spatial_shapes_list=levels)
    assert out.shape == (n, lq, m * d) and out.dtype == dtype
    ref = reference64(value, shapes, start, loc, attn)
    assert rel_err(out, ref) <= TOL[dtype]

    grad = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dev, dtype)
    grads = torch.autograd.grad(out, (value, loc, attn), grad)
    ref_grads = reference64_grads(value, shapes, start, loc, attn, grad)
    # The weights' gradient is a dot product over channels (sampled value .
    # grad_output): where its terms cancel, any fp32 evaluation is off by
    # ~1e-7 of the terms' magnitude, not of the result (fuzzing found 6e-5
    # relative on a 2-element gradient of 0.0117 from terms of ~4). So its
    # error is measured against the same dot product of absolute values,
    # the textbook bound for a dot product's rounding error.
    abs_weights = reference64_grads(value.abs(), shapes, start, loc, attn, grad.abs())[2]
    names = ["value", "locations", "weights"]
    for name, got, want, src in zip(names, grads, ref_grads, (value, loc, attn)):
        assert got.dtype == src.dtype and got.shape == src.shape, name
        if name == "locations" and pb["where"] == "borders":
            continue  # one-sided derivative at borders: fp32 and fp64 may pick different sides
        if name == "weights":
            nan = torch.isnan(want)  # the poisoned samples'
            assert torch.equal(torch.isnan(got), nan), name
            err = ((got.double() - want).masked_fill(nan, 0).norm().item()
                   / max(abs_weights.masked_fill(nan, 0).norm().item(), 1e-30))
            assert err <= TOL[src.dtype], name
            continue
        assert rel_err(got, want) <= TOL[src.dtype], name
