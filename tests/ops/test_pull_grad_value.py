"""The encoders' pull grad_value (csrc/cuda/backward/pull_grad_value.cu): a
block a tile reads the records of the queries within kPullRadius cells of it,
and the samples farther away (escapes) come through buckets. These cases take
encoder-like locations (near the query's own pixel), the `smooth` and
`encoder` generators of the canonical workloads (scaled), and uniform ones
(nearly every sample an escape, buckets over a chunk); odd level shapes, 1 x 1
levels, non-finite samples. Each against float64, bitwise against a repeat,
and within tolerance of the global sort's result."""
import pytest
import torch

import ms_deform_attn as msda
from ms_deform_attn import testing as W
from helpers import TOL, bits, level_tensors, reference64_grads, rel_err, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                                 ids=["float32", "float16", "bfloat16"])


def grads(monkeypatch, path, inputs, grad):
    """Gradients of (value, loc, attn) by the deterministic backward with
    MS_DEFORM_ATTN_GRAD_VALUE = `path`."""
    monkeypatch.setenv("MS_DEFORM_ATTN_GRAD_VALUE", path)
    value, shapes, start, loc, attn = inputs
    out = run(value, shapes, start, loc, attn, "baseline", deterministic=True)
    return torch.autograd.grad(out, (value, loc, attn), grad)


def encoder_inputs(shapes, n, m, p, dtype, spread, seed, uniform=False):
    """Inputs whose queries are the pixels of `shapes` (Lq = S, D = 32):
    each sample at its query's centre plus a normal offset of `spread`
    (in units of the map), or uniform on [-0.1, 1.1] (`uniform`); the
    first three samples NaN, inf and outside."""
    g = torch.Generator().manual_seed(seed)
    shapes_t, start = level_tensors(shapes, "cuda")
    s = sum(h * w for h, w in shapes)
    value = torch.randn(n, s, m, 32, generator=g).to("cuda", dtype)
    ref = W.encoder_reference_points(shapes, "cpu").double()
    if uniform:
        loc = torch.rand(n, s, m, len(shapes), p, 2, generator=g, dtype=torch.float64) * 1.2 - 0.1
    else:
        loc = ref[None, :, None, None, None, :] + spread * torch.randn(
            n, s, m, len(shapes), p, 2, generator=g, dtype=torch.float64)
    loc = loc.float().to("cuda")
    loc[0, :3, 0, 0, 0] = torch.tensor([[float("nan"), 0.5], [0.5, float("inf")], [-0.3, 1.2]])
    attn = torch.randn(n, s, m, len(shapes) * p, generator=g).softmax(-1)
    attn = attn.view(n, s, m, len(shapes), p).to("cuda")
    return (value.requires_grad_(), shapes_t, start, loc.requires_grad_(), attn.requires_grad_())


def value_tol(dtype):
    """grad_value's tolerance against float64: 3e-3 in bf16 (its output's
    rounding alone is ~1e-3), else the dtype's."""
    return 3e-3 if dtype == torch.bfloat16 else TOL[dtype]


def pull_checked(monkeypatch, inputs, dtype):
    """The pull path's gradients: its plan, against float64, bitwise against
    a repeat, and within tolerance of the global sort's."""
    detached = [t.detach() for t in inputs]
    monkeypatch.setenv("MS_DEFORM_ATTN_GRAD_VALUE", "pull")
    assert msda.select_backward_plan(*detached, deterministic=True)["grad_value"] == "pull"
    n, lq = inputs[0].shape[0], inputs[3].shape[1]
    m = inputs[0].shape[2]
    grad = torch.randn(n, lq, m * 32, dtype=dtype, device="cuda")
    got = grads(monkeypatch, "pull", inputs, grad)
    ref = reference64_grads(*inputs, grad)
    assert not torch.isnan(got[0]).any()  # non-finite samples add nothing to grad_value
    for name, g, r, t in zip(("value", "locations", "weights"), got, ref,
                             (value_tol(dtype), TOL[dtype], TOL[dtype])):
        assert rel_err(g, r) <= t, name
    again = grads(monkeypatch, "pull", inputs, grad)
    for a, b in zip(got, again):
        assert torch.equal(bits(a), bits(b))
    sorted_ = grads(monkeypatch, "sorted", inputs, grad)
    assert rel_err(got[0], sorted_[0].double()) <= 2 * value_tol(dtype)
    return got


SHAPES = [
    pytest.param([(40, 67), (20, 34), (10, 17), (5, 9)], id="ddetr-like"),
    pytest.param([(33, 65), (1, 1), (2, 130), (64, 1)], id="odd-levels"),
    pytest.param([(50, 50)], id="one-level"),
]


@pytest.mark.parametrize("shapes", SHAPES)
@DTYPES
@pytest.mark.parametrize("spread", [0.01, 0.08], ids=["near", "far"])
def test_pull_grad_value(monkeypatch, shapes, dtype, spread):
    pull_checked(monkeypatch, encoder_inputs(shapes, 2, 3, 4, dtype, spread, seed=5), dtype)


@DTYPES
def test_pull_with_every_sample_an_escape(monkeypatch, dtype):
    """Uniform locations: nearly every sample escapes its windows; buckets
    hold more than a chunk (2048: one 16 x 16 tile a level, 320 queries x 8
    points an (n, m)) and are cut in sample order."""
    inputs = encoder_inputs([(16, 16), (8, 8)], 1, 2, 8, dtype, 0.0, seed=7, uniform=True)
    pull_checked(monkeypatch, inputs, dtype)


@pytest.mark.parametrize("workload", ["ddetr_enc/4", "ddetr_enc@smooth/4", "m2f_enc@smooth/4",
                                      "bevformer_tsa@smooth/4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_pull_on_the_workloads(monkeypatch, workload, dtype):
    wl = W.get(workload)
    value, shapes, start, loc, attn = W.make_inputs(wl, dtype, device="cuda", seed=2, requires_grad=True)
    pull_checked(monkeypatch, (value, shapes, start, loc, attn), dtype)
