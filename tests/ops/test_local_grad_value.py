"""The sorted backward's block-local grad_value (csrc/cuda/backward/local_grad_value.cu):
the decoders' path, where the Lq P samples of one (n, m, level) fit one
block's sort (at most 8192; up to 4096 the kernel holds 8 a thread, above
16). A block owns a 32 x 64-pixel tile; these cases
walk its edges: levels of several tiles and a pixel over, 1 x 1 levels, every
sample in one cell, the cap exactly and one query over it (the global sort
then), non-finite samples and grad_output, several channel passes, the fused
operator. Each against float64, bitwise against a repeat, and within
tolerance of the global sort's result."""
import pytest
import torch

import ms_deform_attn as msda
from helpers import TOL, bits, host_shapes, make_inputs, reference64_grads, rel_err, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def grads(monkeypatch, path, inputs, grad):
    """Gradients of (value, loc, attn) by the deterministic backward with
    MS_DEFORM_ATTN_GRAD_VALUE = `path` ("local" or "sorted")."""
    monkeypatch.setenv("MS_DEFORM_ATTN_GRAD_VALUE", path)
    value, shapes, start, loc, attn = inputs
    out = run(value, shapes, start, loc, attn, "baseline", deterministic=True)
    return torch.autograd.grad(out, (value, loc, attn), grad)


def nonfinite_leaves(inputs):
    """`inputs` as leaves, the first three queries' first samples made a NaN,
    an inf and a location outside the map."""
    with torch.no_grad():
        inputs[3][0, :3, 0, 0, 0] = torch.tensor([[float("nan"), 0.5], [0.5, float("inf")], [-0.3, 1.2]])
    return tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs)


def same_bits_without(monkeypatch, variable, field, inputs, grad):
    """The block-local path's gradients with its plan's `field` on and with
    `variable`=0 (off) are the same bits; those made with it off."""
    monkeypatch.setenv("MS_DEFORM_ATTN_GRAD_VALUE", "local")
    detached = [t.detach() for t in inputs]
    assert msda.select_backward_plan(*detached, deterministic=True)[field]
    on = grads(monkeypatch, "local", inputs, grad)
    monkeypatch.setenv(variable, "0")
    assert not msda.select_backward_plan(*detached, deterministic=True)[field]
    off = grads(monkeypatch, "local", inputs, grad)
    monkeypatch.delenv(variable)
    for a, b in zip(on, off):
        assert torch.equal(bits(a), bits(b))
    return off


def value_tol(dtype):
    """grad_value's tolerance against float64: 3e-3 in bf16 (its output's
    rounding alone is ~1e-3, as the tiles'), else the dtype's."""
    return 3e-3 if dtype == torch.bfloat16 else TOL[dtype]


def local_checked(monkeypatch, inputs, grad, dtype):
    """The block-local path's gradients of `inputs`, checked against float64
    (grad_value to value_tol) and bitwise against a repeat; with the
    tolerance used."""
    got = grads(monkeypatch, "local", inputs, grad)
    ref = reference64_grads(*inputs, grad)
    tol = value_tol(dtype)
    for name, g, r, t in zip(("value", "locations", "weights"), got, ref, (tol, TOL[dtype], TOL[dtype])):
        assert rel_err(g, r) <= t, name
    again = grads(monkeypatch, "local", inputs, grad)
    for a, b in zip(got, again):
        assert torch.equal(bits(a), bits(b))
    return got, tol


CASES = [
    # n, lq, m, d, level shapes, p
    pytest.param(2, 300, 8, 32, [(80, 80), (40, 40), (20, 20)], 4, id="rtdetr-like"),
    pytest.param(2, 50, 3, 64, [(33, 65), (1, 1), (2, 130), (64, 1)], 3, id="tile-edges"),
    pytest.param(1, 7, 1, 128, [(4, 4)], 2, id="d128"),
    pytest.param(1, 1024, 2, 32, [(5, 7), (3, 3)], 4, id="at-cap-4096"),
    pytest.param(1, 1100, 2, 32, [(40, 70), (5, 7)], 4, id="dino-denoising"),
    pytest.param(1, 2048, 2, 32, [(5, 7)], 4, id="at-cap"),
    pytest.param(1, 2049, 2, 32, [(5, 7)], 4, id="over-cap"),
]


@pytest.mark.parametrize("n,lq,m,d,shapes,p", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("crowd", [False, True], ids=["spread", "one-cell"])
def test_local_grad_value(monkeypatch, n, lq, m, d, shapes, p, dtype, crowd):
    inputs = make_inputs(n, lq, m, d, shapes, p, dtype, torch.float32, device="cuda", seed=3)
    value, shapes_t, start, loc, attn = inputs
    with torch.no_grad():
        if crowd:  # every sample of a level in one cell (all in one tile, one run)
            loc.fill_(0.513)
        loc[0, :3, 0, 0, 0] = torch.tensor([[float("nan"), 0.5], [0.5, float("inf")], [-0.3, 1.2]])
    inputs = (value, shapes_t, start, *(t.detach().requires_grad_() for t in (loc, attn)))
    inputs = (inputs[0].detach().requires_grad_(),) + inputs[1:]
    grad = torch.randn(n, lq, m * d, dtype=dtype, device="cuda")
    got, tol = local_checked(monkeypatch, inputs, grad, dtype)
    sorted_ = grads(monkeypatch, "sorted", inputs, grad)
    assert rel_err(got[0], sorted_[0].double()) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_local_grad_value_nonfinite_grad_output(monkeypatch, dtype):
    """An infinite and a NaN grad_output element reach only the pixels their
    queries' samples touch: the walk never multiplies a row by a zero weight
    (0 x inf would be NaN), so grad_value is finite exactly where the float64
    reference's is, and NaN exactly where it is NaN."""
    inputs = make_inputs(2, 300, 8, 32, [(40, 40), (20, 20), (10, 10)], 4, dtype, torch.float32,
                         device="cuda", seed=5)
    inputs = tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs)
    grad = torch.randn(2, 300, 8 * 32, dtype=dtype, device="cuda")
    grad[0, 7, 3] = float("inf")
    grad[1, 100, 40] = float("nan")
    got = grads(monkeypatch, "local", inputs, grad)[0].double()
    ref = reference64_grads(*inputs, grad)[0]
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert fin.sum() > 0.9 * fin.numel()
    assert rel_err(got[fin], ref[fin]) <= value_tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_local_grad_value_16_bit_locations(monkeypatch, dtype):
    """Locations and weights in the values' 16-bit dtype (a model run in
    half precision) take the block-local kernel too: against float64, and
    bitwise the same on a repeat."""
    inputs = make_inputs(2, 300, 8, 32, [(40, 40), (20, 20), (10, 10)], 4, dtype, dtype,
                         device="cuda", seed=6)
    inputs = tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs)
    grad = torch.randn(2, 300, 8 * 32, dtype=dtype, device="cuda")
    plan = msda.select_backward_plan(*[t.detach() for t in inputs], deterministic=True)
    assert plan["grad_value"] == "local", plan
    local_checked(monkeypatch, inputs, grad, dtype)


def test_local_is_the_16_bit_decoders_default(monkeypatch):
    """A decoder-sized problem's default backward with 16-bit values is the
    block-local one (measured faster there than the atomics; fp32 keeps the
    atomics): bitwise the deterministic gradients."""
    monkeypatch.delenv("MS_DEFORM_ATTN_GRAD_VALUE", raising=False)
    for dtype in (torch.bfloat16, torch.float16):
        value, shapes, start, loc, attn = make_inputs(2, 300, 8, 32, [(20, 30), (10, 15)], 4, dtype,
                                                      torch.float32, device="cuda", seed=9,
                                                      requires_grad=True)
        grad = torch.randn(2, 300, 8 * 32, device="cuda", dtype=dtype)
        got = [torch.autograd.grad(run(value, shapes, start, loc, attn, "baseline",
                                       deterministic=det), (value, loc, attn), grad)
               for det in (False, True)]
        for a, b in zip(*got):
            assert torch.equal(a, b)


@pytest.mark.parametrize("boxes", [False, True], ids=["points", "boxes"])
@pytest.mark.parametrize("dtype,off_dtype", [(torch.float32, torch.float32),
                                             (torch.bfloat16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16),
                                             (torch.float16, torch.float16)],
                         ids=["float32", "bfloat16", "bfloat16-offsets", "float16-offsets"])
def test_local_grad_value_fused(monkeypatch, boxes, dtype, off_dtype):
    """The fused operator's backward on the block-local path (locations and
    weights formed from offsets, logits and the row statistics) against the
    global sort's, and repeatable bit for bit; with offsets and logits in
    fp32 or, as the layers give them under autocast, in the values' 16-bit
    dtype (the block-local kernel then runs too)."""
    torch.manual_seed(4)
    n, lq, m, d, p = 2, 200, 4, 32, 4
    shapes = [(40, 70), (20, 35), (10, 18)]
    levels = torch.tensor(shapes, device="cuda")
    start = torch.tensor([0, 2800, 3500], device="cuda")
    s = sum(h * w for h, w in shapes)
    value = torch.randn(n, s, m, d, device="cuda", dtype=dtype, requires_grad=True)
    ref = torch.rand(n, lq, len(shapes), 4 if boxes else 2, device="cuda")
    off = (4 * torch.randn(n, lq, m, len(shapes), p, 2, device="cuda")).to(off_dtype).requires_grad_()
    logits = torch.randn(n, lq, m, len(shapes) * p, device="cuda").to(off_dtype).requires_grad_()
    grad = torch.randn(n, lq, m * d, device="cuda", dtype=dtype)

    def fused_grads(path):
        monkeypatch.setenv("MS_DEFORM_ATTN_GRAD_VALUE", path)
        out = msda.ms_deform_attn_fused(value, levels, start, ref, off, logits, deterministic=True,
                                        spatial_shapes_list=shapes)
        return torch.autograd.grad(out, (value, off, logits), grad)

    plan = msda.select_backward_plan(value.detach(), levels, start, off.detach(), logits.detach().view(
        n, lq, m, len(shapes), p), fused=True, deterministic=True)
    assert plan["grad_value"] == "local", plan
    local, sorted_ = fused_grads("local"), fused_grads("sorted")
    again = fused_grads("local")
    for a, b in zip(local, again):
        assert torch.equal(a, b)
    tol = 3e-3 if torch.bfloat16 in (dtype, off_dtype) else TOL[dtype]
    for name, a, b in zip(("value", "offsets", "logits"), local, sorted_):
        assert rel_err(a, b.double()) <= tol, name


@pytest.mark.parametrize("n,lq,m,d,shapes,p", [CASES[0], CASES[1], CASES[2]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_staged_walk_gives_the_same_bits(monkeypatch, n, lq, m, d, shapes, p, dtype):
    """The staged walk (grad_output rows and weights in shared memory; the
    plan's `stage`) sums the same terms in the same order as the walk that
    loads them from global memory (MS_DEFORM_ATTN_LOCAL_STAGE=0): the same
    bits, non-finite samples included."""
    inputs = make_inputs(n, lq, m, d, shapes, p, dtype, torch.float32, device="cuda", seed=4)
    inputs = nonfinite_leaves(inputs)
    grad = torch.randn(n, lq, m * d, dtype=dtype, device="cuda")
    same_bits_without(monkeypatch, "MS_DEFORM_ATTN_LOCAL_STAGE", "stage", inputs, grad)


@pytest.mark.parametrize("loc_dtype", ["float32", "value"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
def test_records_made_in_the_block_give_the_same_bits(monkeypatch, dtype, loc_dtype):
    """The staged walk making its records itself beside the dots kernel (a
    forked stream; MS_DEFORM_ATTN_LOCAL_SELF=0 reads the dots kernel's): the
    same cells and weights by the same arithmetic, the same bits; and the
    same again replayed from a CUDA graph (the fork and join captured)."""
    ldt = torch.float32 if loc_dtype == "float32" else dtype
    n, lq, m, d, shapes, p = 2, 300, 8, 32, [(80, 80), (40, 40), (20, 20), (1, 1)], 4
    inputs = make_inputs(n, lq, m, d, shapes, p, dtype, ldt, device="cuda", seed=5, outside=0.3)
    inputs = nonfinite_leaves(inputs)
    grad = torch.randn(n, lq, m * d, dtype=dtype, device="cuda")
    read = same_bits_without(monkeypatch, "MS_DEFORM_ATTN_LOCAL_SELF", "self_records", inputs, grad)
    hs = host_shapes(inputs[1])  # read before the capture (a device-to-host copy)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # Fresh leaves, first used on the capture's stream: a leaf's autograd
        # node keeps the stream of its first use, and under compute-sanitizer
        # a capture whose leaves were first used on the legacy default
        # stream fails (cudaErrorStreamCaptureImplicit).
        value, shapes, start, loc, attn = (t.detach().requires_grad_() if t.is_floating_point()
                                           else t for t in inputs)

        def step():
            out = msda.ms_deform_attn(value, shapes, start, loc, attn, backend="baseline",
                                      deterministic=True, spatial_shapes_list=hs)
            return torch.autograd.grad(out, (value, loc, attn), grad)

        step()  # warm-up on the capture's stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = step()
    for g in captured:
        g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, read):
        assert torch.equal(bits(a), bits(b))
