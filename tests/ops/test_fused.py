"""ms_deform_attn_fused: the location arithmetic and the softmax inside the
operator. Checked against the same arithmetic composed in PyTorch around
the float64 reference, and against the unfused operator it calls."""
import pytest
import torch

import ms_deform_attn as msda
from ms_deform_attn.reference import ms_deform_attn_pytorch
from ms_deform_attn.testing import level_tensors
from helpers import TOL, bits, device_backends, head_major, host_shapes, rel_err, skip_unless_runs

LEVELS = [(6, 7), (3, 4)]


def fused_inputs(device, dtype, boxes, n=2, lq=9, m=4, d=16, p=3, logits_5d=False, seed=0,
                 coord_dtype=None, levels=LEVELS):
    """value in `dtype`; offsets and logits in coord_dtype (default: dtype,
    as a linear layer makes them), reference points in float32 (float64 for
    float64 values)."""
    g = torch.Generator().manual_seed(seed)
    coord_dtype = coord_dtype or dtype
    ref_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    shapes, start = level_tensors(levels, device)
    s = sum(h * w for h, w in levels)
    L = len(levels)
    value = torch.randn(n, s, m, d, generator=g, dtype=torch.float64)
    ref = torch.rand(n, lq, L, 4 if boxes else 2, generator=g, dtype=torch.float64)
    if boxes:
        ref[..., 2:] = ref[..., 2:] * 0.5 + 0.05
    off = torch.randn(n, lq, m, L, p, 2, generator=g, dtype=torch.float64) * 2
    logits = torch.randn(n, lq, m, L, p, generator=g, dtype=torch.float64)
    if not logits_5d:
        logits = logits.reshape(n, lq, m, L * p)
    return (value.to(device, dtype), shapes, start, ref.to(device, ref_dtype),
            off.to(device, coord_dtype), logits.to(device, coord_dtype))


def composed(value, shapes, start, ref, off, logits, op=None, **kw):
    """The arithmetic of Deformable DETR's layer in the inputs' own dtypes
    promoted as the fused operator does (float32, float64 for float64
    value), then `op` (default: the float64 grid_sample reference)."""
    coord = torch.float64 if value.dtype == torch.float64 else torch.float32
    n, lq, m, L, p, _ = off.shape
    off = off.to(coord)
    weights = torch.softmax(logits.to(coord).reshape(n, lq, m, L * p), -1).view(n, lq, m, L, p)
    if ref.shape[-1] == 4:
        loc = (ref[:, :, None, :, None, :2].to(coord)
               + off / p * ref[:, :, None, :, None, 2:].to(coord) * 0.5)
    else:
        wh = shapes.flip(-1).to(coord)
        loc = ref[:, :, None, :, None, :].to(coord) + off / wh[None, None, None, :, None, :]
    if op is None:
        return ms_deform_attn_pytorch(value.double(), shapes, start, loc.double(), weights.double())
    return op(value, shapes, start, loc, weights, **kw)


@pytest.mark.parametrize("device,backend", device_backends(reference=True))
@pytest.mark.parametrize("boxes", [False, True], ids=["points", "boxes"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_fused_matches_composed_reference(device, backend, boxes, dtype):
    inputs = fused_inputs(device, dtype, boxes)
    value, shapes, start, ref, off, logits = inputs
    skip_unless_runs(backend, value, shapes, start,
                     torch.zeros(*off.shape, device=device),
                     torch.zeros(*off.shape[:-1], device=device), host_shapes(shapes))
    out = msda.ms_deform_attn_fused(*inputs, backend=backend, spatial_shapes_list=LEVELS)
    assert out.dtype == dtype and out.shape == (2, 9, 4 * 16)
    expected = composed(*inputs)
    assert rel_err(out, expected) <= TOL[dtype]
    # The same composition around the unfused operator: equal up to the
    # order of the softmax's sum (formed inside the CUDA baseline kernel) and
    # of the backward's sums.
    leaves = [t.detach().requires_grad_() for t in (value, ref, off, logits)]
    fused_out = msda.ms_deform_attn_fused(leaves[0], shapes, start, *leaves[1:], backend=backend,
                                          spatial_shapes_list=LEVELS)
    unfused_out = composed(leaves[0], shapes, start, *leaves[1:], op=msda.ms_deform_attn,
                           backend=backend, spatial_shapes_list=LEVELS)
    # A 16-bit output may round either way where the weights differ in an ulp.
    tol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, 4e-3)
    assert rel_err(fused_out, unfused_out) <= tol
    grad = torch.randn_like(fused_out)
    got = torch.autograd.grad(fused_out, leaves, grad)
    want = torch.autograd.grad(unfused_out, leaves, grad)
    for name, a, b in zip(["value", "reference_points", "sampling_offsets", "attention_logits"],
                          got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        # grad_value: the atomics of a 16-bit value may round a sum either way.
        assert rel_err(a, b) <= max(tol, 1e-5 if dtype == torch.float32 else tol), name


@pytest.mark.parametrize("device,backend", device_backends())
def test_fused_nan_logit_poisons_its_row(device, backend):
    value, shapes, start, ref, off, logits = fused_inputs(device, torch.float32, False)
    skip_unless_runs(backend, value, shapes, start, torch.zeros(*off.shape, device=device),
                     torch.zeros(*off.shape[:-1], device=device), host_shapes(shapes))
    logits[1, 4, 2, 3] = float("nan")
    out = msda.ms_deform_attn_fused(value, shapes, start, ref, off, logits, backend=backend,
                                    spatial_shapes_list=LEVELS).view(2, 9, 4, 16)
    assert torch.isnan(out[1, 4, 2]).all()
    out[1, 4, 2] = 0
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("boxes", [False, True], ids=["points", "boxes"])
def test_fused_gradcheck(device, backend, boxes):
    value, shapes, start, ref, off, logits = fused_inputs(device, torch.float64, boxes, n=1, lq=3,
                                                          m=2, d=4, p=2, logits_5d=True)
    skip_unless_runs(backend, value, shapes, start, torch.zeros(*off.shape, device=device,
                                                                dtype=torch.float64),
                     torch.zeros(*off.shape[:-1], device=device, dtype=torch.float64),
                     host_shapes(shapes))
    leaves = [t.requires_grad_() for t in (value, ref, off, logits)]

    def f(v, r, o, lg):
        return msda.ms_deform_attn_fused(v, shapes, start, r, o, lg, backend=backend,
                                         spatial_shapes_list=LEVELS)

    assert torch.autograd.gradcheck(f, leaves)


@pytest.mark.parametrize("device,backend", device_backends())
def test_fused_opcheck(device, backend):
    value, shapes, start, ref, off, logits = fused_inputs(device, torch.float32, False)
    skip_unless_runs(backend, value, shapes, start, torch.zeros(*off.shape, device=device),
                     torch.zeros(*off.shape[:-1], device=device), host_shapes(shapes))
    for t in (value, ref, off, logits):
        t.requires_grad_()
    torch.library.opcheck(torch.ops.ms_deform_attn.ms_deform_attn_fused.default,
                          (value, shapes, start, ref, off, logits, backend, None,
                           [x for hw in LEVELS for x in hw]))
    # The backward with the reference points' gradient (its autograd calls it).
    grad = torch.randn(2, 9, 4 * 16, device=device)
    torch.library.opcheck(torch.ops.ms_deform_attn._ms_deform_attn_fused_backward_ref.default,
                          tuple(t.detach() for t in (grad, value, shapes, start, ref, off, logits))
                          + (False,), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fused_head_major_value(device, backend, dtype):
    """The fused operator reads a head-major value in place: the contiguous
    value's output and (deterministic) gradients bit for bit, grad_value in
    value's layout."""
    inputs = fused_inputs(device, dtype, False, lq=11, m=3, d=32, p=4)
    value, shapes, start, ref, off, logits = inputs
    skip_unless_runs(backend, value, shapes, start, torch.zeros(*off.shape, device=device),
                     torch.zeros(*off.shape[:-1], device=device), host_shapes(shapes))
    grad = None
    results = []
    for v in (value, head_major(value)):
        leaves = [t.detach().requires_grad_() for t in (v, off, logits)]
        out = msda.ms_deform_attn_fused(leaves[0], shapes, start, ref, leaves[1], leaves[2],
                                        backend=backend, deterministic=True,
                                        spatial_shapes_list=LEVELS)
        grad = torch.randn_like(out) if grad is None else grad
        grads = torch.autograd.grad(out, leaves, grad)
        assert grads[0].stride() == leaves[0].stride()
        results.append((out, *grads))
    for a, b in zip(*results):
        assert torch.equal(bits(a), bits(b))


def test_fused_keeps_the_raw_inputs_for_the_backward():
    """Under autocast the layer's offsets and logits are bf16; the fused
    operator keeps them, not float32 locations (N Lq M L P 2) or weights."""
    value, shapes, start, ref, off, logits = fused_inputs("cpu", torch.bfloat16, False)
    leaves = [t.requires_grad_() for t in (value, off, logits)]
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = msda.ms_deform_attn_fused(value, shapes, start, ref, off, logits)
    assert (tuple(off.shape), torch.bfloat16) in saved
    assert (tuple(logits.shape), torch.bfloat16) in saved
    sizes = (tuple(off.shape), tuple(off.shape[:-1]))  # locations, weights
    assert not any(dt == torch.float32 and shape in sizes for shape, dt in saved), saved
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == t.dtype for t in leaves)


@pytest.mark.parametrize("device,backend", device_backends())
def test_fused_deterministic_is_bitwise_repeatable(device, backend):
    inputs = fused_inputs(device, torch.bfloat16, True, lq=40)
    skip_unless_runs(backend, inputs[0], inputs[1], inputs[2],
                     torch.zeros(*inputs[4].shape, device=device),
                     torch.zeros(*inputs[4].shape[:-1], device=device), host_shapes(inputs[1]))
    grads = []
    for _ in range(2):
        leaves = [t.detach().requires_grad_() for t in (inputs[0], inputs[3], inputs[4], inputs[5])]
        out = msda.ms_deform_attn_fused(leaves[0], inputs[1], inputs[2], *leaves[1:],
                                        backend=backend, deterministic=True,
                                        spatial_shapes_list=LEVELS)
        grads.append(torch.autograd.grad(out, leaves, torch.ones_like(out)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("case,match", [
    ("ref3", r"reference_points.size\(3\) must be 2 \(points\) or 4 \(boxes cx, cy, w, h\), got 3"),
    ("ref_levels", r"reference_points must have shape \(N, Lq, L, 2 or 4\).*size\(2\) expected 2, got 3"),
    ("off_rank", r"sampling_offsets must have 6 dimensions \(N, Lq, M, L, P, 2\), got 5"),
    ("off_heads", r"sampling_offsets must have shape .*size\(2\) expected 4, got 3"),
    ("logits_size", r"attention_logits must have shape \(N, Lq, M, L \* P\).*size\(3\) expected 6, got 5"),
    ("logits_int", r"attention_logits must be a floating-point tensor, got Long"),
])
def test_fused_bad_inputs_name_the_argument(device, case, match):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    value, shapes, start, ref, off, logits = fused_inputs(device, torch.float32, False)
    if case == "ref3":
        ref = torch.rand(*ref.shape[:-1], 3, device=device)
    elif case == "ref_levels":
        ref = torch.rand(ref.shape[0], ref.shape[1], 3, 2, device=device)
    elif case == "off_rank":
        off = off[..., 0]
    elif case == "off_heads":
        off = off[:, :, :3]
    elif case == "logits_size":
        logits = logits[..., :5]
    elif case == "logits_int":
        logits = logits.long()
    with pytest.raises(RuntimeError, match=match):
        msda.ms_deform_attn_fused(value, shapes, start, ref, off, logits)


@pytest.mark.parametrize("device,backend", device_backends())
def test_fused_takes_non_contiguous_inputs(device, backend):
    """Reference points broadcast over levels (expand), offsets and logits
    as strided slices of wider linear outputs: the same result as
    contiguous copies."""
    value, shapes, start, ref, off, logits = fused_inputs(device, torch.float32, True)
    skip_unless_runs(backend, value, shapes, start, torch.zeros(*off.shape, device=device),
                     torch.zeros(*off.shape[:-1], device=device), host_shapes(shapes))
    ref_b = ref[:, :, :1].expand_as(ref)
    off_s = torch.cat([off, off], -1)[..., ::2]
    logits_s = torch.cat([logits, logits], -1)[..., ::2]
    assert not (ref_b.is_contiguous() or off_s.is_contiguous() or logits_s.is_contiguous())
    got = msda.ms_deform_attn_fused(value, shapes, start, ref_b, off_s, logits_s, backend=backend,
                                    spatial_shapes_list=LEVELS)
    want = msda.ms_deform_attn_fused(value, shapes, start, ref_b.contiguous(), off_s.contiguous(),
                                     logits_s.contiguous(), backend=backend,
                                     spatial_shapes_list=LEVELS)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---- the backward inside the CUDA kernels ---------------------------------------
# The fused backward forms the locations and the softmax inside the kernels
# and writes the offsets' and logits' gradients itself: on the sorted path's
# tensor-core dots (16-bit values, D a multiple of 32, the bf16 default on
# dense problems or deterministic=True), else in ffma_dots_kernel (fp32
# values; 16-bit values on the atomic path). Levels x points: 2 x 3 (rows of
# 8 slots once padded, reduced by shuffles in the dots kernel), 3 x 4 (12
# slots) and 5 x 3 (20 once padded: rows that do not divide a warp, so a
# block task of whole rows over its warps, reduced through shared memory),
# 1 x 1 (sparse: bf16 takes the atomics).
KERNEL_SHAPES = {"pow2": ([(6, 7), (3, 4)], 3), "odd": ([(6, 7), (3, 4), (2, 2)], 4),
                 "five": ([(6, 7), (3, 4), (2, 2), (2, 1), (1, 1)], 3), "single": ([(5, 9)], 1)}


def kernel_backward_grads(inputs, levels, deterministic, **kw):
    value, shapes, start, ref, off, logits = inputs
    leaves = [t.detach().requires_grad_() for t in (value, off, logits)]
    out = msda.ms_deform_attn_fused(leaves[0], shapes, start, ref, leaves[1], leaves[2],
                                    deterministic=deterministic, spatial_shapes_list=levels, **kw)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    return out, grad, torch.autograd.grad(out, leaves, grad)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", list(KERNEL_SHAPES))
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("boxes", [False, True], ids=["points", "boxes"])
@pytest.mark.parametrize("dtype,deterministic", [
    (torch.bfloat16, None), (torch.bfloat16, True), (torch.float16, True), (torch.float16, None),
    (torch.float32, None), (torch.float32, True)])
def test_fused_kernel_backward_matches_reference(shape, d, boxes, dtype, deterministic):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    levels, p = KERNEL_SHAPES[shape]
    # 3 heads x 11 queries: the last warp task only partly filled.
    inputs = fused_inputs("cuda", dtype, boxes, lq=11, m=3, d=d, p=p, levels=levels)
    value, shapes, start, ref, off, logits = inputs
    off.mul_(3)  # some samples outside the map
    _, grad, got = kernel_backward_grads(inputs, levels, deterministic)
    leaves = [t.detach().double().requires_grad_() for t in (value, off, logits)]
    want_out = composed(leaves[0], shapes, start, ref.double(), leaves[1], leaves[2])
    want = torch.autograd.grad(want_out, leaves, grad.double())
    for name, a, b, t in zip(["value", "sampling_offsets", "attention_logits"], got, want,
                             (value, off, logits)):
        assert a.dtype == t.dtype and a.shape == t.shape, name
        assert rel_err(a, b) <= TOL[dtype], name


@pytest.mark.cuda
@pytest.mark.parametrize("shape", ["odd", "five"])
def test_fused_kernel_backward_many_block_tasks(shape):
    """More block tasks of whole rows than blocks at once (the grid strides)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    levels, p = KERNEL_SHAPES[shape]
    inputs = fused_inputs("cuda", torch.bfloat16, False, lq=4001, m=8, d=32, p=p, levels=levels)
    _, grad, got = kernel_backward_grads(inputs, levels, True)
    value, shapes, start, ref, off, logits = inputs
    leaves = [t.detach().double().requires_grad_() for t in (value, off, logits)]
    want = torch.autograd.grad(composed(leaves[0], shapes, start, ref.double(), leaves[1], leaves[2]),
                               leaves, grad.double())
    for name, a, b in zip(["value", "sampling_offsets", "attention_logits"], got, want):
        assert rel_err(a, b) <= TOL[torch.bfloat16], name


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "mma_dots_kernel"),
                                          (torch.float32, "ffma_dots_kernel")])
def test_fused_kernel_backward_runs_in_the_kernels(dtype, kernel):
    """No softmax nor its backward among the kernels the backward launches
    (the composite path forms them with ATen's)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    levels, p = KERNEL_SHAPES["pow2"]
    inputs = fused_inputs("cuda", dtype, False, lq=12, d=32, p=p, levels=levels)
    value, shapes, start, ref, off, logits = inputs
    leaves = [t.detach().requires_grad_() for t in (value, off, logits)]
    out = msda.ms_deform_attn_fused(leaves[0], shapes, start, ref, leaves[1], leaves[2])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(out, leaves, torch.ones_like(out))
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    assert any(kernel in k for k in names), names
    assert not any("softmax" in k for k in names), names


@pytest.mark.cuda
@pytest.mark.parametrize("shape", list(KERNEL_SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_kernel_backward_nan_logit_poisons_its_row(shape, dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    levels, p = KERNEL_SHAPES[shape]
    inputs = fused_inputs("cuda", dtype, False, lq=12, d=32, p=p, levels=levels,
                          logits_5d=True)
    inputs[5][1, 4, 2, 0, 0] = float("nan")
    _, _, (g_value, g_off, g_logits) = kernel_backward_grads(inputs, levels, None)
    assert torch.isnan(g_logits[1, 4, 2]).all() and torch.isnan(g_off[1, 4, 2]).all()
    g_logits[1, 4, 2] = 0
    g_off[1, 4, 2] = 0
    assert torch.isfinite(g_logits).all() and torch.isfinite(g_off).all()
    assert torch.isfinite(g_value).all()  # a poisoned sample adds nothing to grad_value


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_kernel_backward_bitwise_repeatable_and_opcheck(dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    levels, p = KERNEL_SHAPES["odd"]
    inputs = fused_inputs("cuda", dtype, True, lq=40, d=32, p=p, levels=levels)
    runs = [kernel_backward_grads(inputs, levels, True)[2] for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    value, shapes, start, ref, off, logits = inputs
    grad = torch.randn(value.shape[0], ref.shape[1], value.shape[2] * value.shape[3],
                       device="cuda", dtype=value.dtype)
    torch.library.opcheck(torch.ops.ms_deform_attn._ms_deform_attn_fused_backward.default,
                          (grad, value, shapes, start, ref, off, logits, False),
                          test_utils=("test_schema", "test_faketensor"))
