"""Bad input raises a clear error naming the argument, expected and actual value."""
import re

import pytest
import torch

import ms_deform_attn as msda
from helpers import cuda_backends, device_backends, host_shapes, make_inputs, run


def good(device):
    return list(make_inputs(2, 5, 4, 8, [(4, 6), (2, 3)], 3, torch.float32, device=device))


def replace(args, i, new):
    args = list(args)
    args[i] = new
    return args


# (id, mutation of the good argument list, regex the message must match)
CASES = [
    ("value_rank", lambda a: replace(a, 0, a[0][0]), r"value must have 4 dimensions.*got 3"),
    ("shapes_rank", lambda a: replace(a, 1, a[1].flatten()), r"spatial_shapes must have 2 dim"),
    ("start_rank", lambda a: replace(a, 2, a[2][None]), r"level_start_index must have 1 dim"),
    ("loc_rank", lambda a: replace(a, 3, a[3][..., 0]), r"sampling_locations must have 6 dim"),
    ("attn_rank", lambda a: replace(a, 4, a[4][..., None]), r"attention_weights must have 5 dim"),
    ("loc_batch", lambda a: replace(a, 3, a[3][:1]),
     r"sampling_locations.size\(0\) \(batch N\) must equal value.size\(0\) = 2, got 1"),
    ("attn_batch", lambda a: replace(a, 4, a[4][:1]), r"attention_weights.size\(0\) \(batch N\)"),
    ("loc_heads", lambda a: replace(a, 3, a[3][:, :, :3]),
     r"sampling_locations.size\(2\) \(heads M\) must equal value.size\(2\) = 4, got 3"),
    ("attn_heads", lambda a: replace(a, 4, a[4][:, :, :3]), r"attention_weights.size\(2\) \(heads M\)"),
    ("loc_levels", lambda a: replace(a, 3, a[3][:, :, :, :1]),
     r"sampling_locations.size\(3\) \(levels L\) must equal spatial_shapes.size\(0\) = 2, got 1"),
    ("attn_levels", lambda a: replace(a, 4, a[4][:, :, :, :1]), r"attention_weights.size\(3\) \(levels L\)"),
    ("start_levels", lambda a: replace(a, 2, a[2][:1]), r"level_start_index.size\(0\) \(levels L\)"),
    ("attn_points", lambda a: replace(a, 4, a[4][..., :2]),
     r"attention_weights.size\(4\) \(points P\) must equal sampling_locations.size\(4\) = 3, got 2"),
    ("attn_queries", lambda a: replace(a, 4, a[4][:, :4]),
     r"attention_weights.size\(1\) \(queries Lq\) must equal sampling_locations.size\(1\) = 5, got 4"),
    ("loc_xy", lambda a: replace(a, 3, torch.cat([a[3], a[3][..., :1]], -1)),
     r"sampling_locations.size\(5\) must be 2 \(\(x, y\)\), got 3"),
    ("shapes_cols", lambda a: replace(a, 1, torch.cat([a[1], a[1][:, :1]], 1)),
     r"spatial_shapes.size\(1\) must be 2"),
    ("value_int", lambda a: replace(a, 0, a[0].long()), r"value must be float32.*got Long"),
    ("loc_dtype", lambda a: replace(a, 3, a[3].half()),
     r"sampling_locations must have the value's dtype \(Float\) or float32, got Half"),
    ("attn_dtype", lambda a: replace(a, 4, a[4].double()),
     r"attention_weights must have the value's dtype \(Float\) or float32, got Double"),
    ("shapes_float", lambda a: replace(a, 1, a[1].float()), r"spatial_shapes must be int64.*got Float"),
    ("shapes_int32", lambda a: replace(a, 1, a[1].int()), r"spatial_shapes must be int64.*got Int"),
    ("start_int32", lambda a: replace(a, 2, a[2].int()), r"level_start_index must be int64.*got Int"),
    # A pixel row of 4 heads x 2^27 float64 channels (4 GiB), as a broadcast
    # view: rejected before anything is allocated.
    ("pixel_row_4gib", lambda a: replace(a, 0, a[0].double()[..., :1].expand(2, 30, 4, 2**27)),
     r"one pixel of value \(M \* D \* element size\) must be < 4 GiB, got 4294967296 bytes"),
]

# Values of the level shapes. (id, mutation, message, whether
# spatial_shapes_list shows the error: it holds H and W, not level_start_index.)
# Where the host knows the shapes (host tensors on the CPU; spatial_shapes_list
# on any device) every backend raises the same error before any kernel runs.
VALUE_CASES = [
    ("start_out_of_range", lambda a: replace(a, 2, torch.tensor([0, 1000])),
     r"level_start_index\[1\] must be the exclusive cumulative sum of H \* W, expected 24, got 1000",
     False),
    ("start_values", lambda a: replace(a, 2, torch.tensor([0, 23])),
     r"level_start_index\[1\] must be the exclusive cumulative sum of H \* W, expected 24, got 23",
     False),
    ("value_row_short", lambda a: replace(a, 0, a[0][:, :-1]),
     r"value.size\(1\) \(S\) must equal the sum of H \* W over the levels of "
     r"spatial_shapes(_list)? = 30, got 29", True),
    ("value_row_long", lambda a: replace(a, 0, torch.cat([a[0], a[0][:, :1]], 1)),
     r"value.size\(1\) \(S\) must equal the sum of H \* W over the levels of "
     r"spatial_shapes(_list)? = 30, got 31", True),
    ("zero_level", lambda a: replace(a, 1, torch.tensor([[4, 6], [0, 3]])),
     r"spatial_shapes(_list)?\[1\] = \(0, 3\) must be positive", True),
    ("negative_level", lambda a: replace(a, 1, torch.tensor([[4, 6], [-2, 3]])),
     r"spatial_shapes(_list)?\[1\] = \(-2, 3\) must be positive", True),
    ("huge_level", lambda a: replace(a, 1, torch.tensor([[1 << 20, 1 << 20], [2, 3]])),
     r"spatial_shapes(_list)?\[0\] = \(1048576, 1048576\): H \* W must be < 2\^31", True),
]
VALUE_IDS = [c[0] for c in VALUE_CASES]


def assert_usable(device):
    """The process still works after an error: a kernel runs and syncs."""
    x = torch.ones(3, device=device)
    assert (x + 1).sum().item() == 6
    if device == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("name,mutate,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input(device, backend, name, mutate, pattern):
    args = mutate(good(device))
    with pytest.raises(RuntimeError, match=pattern):
        run(*args, backend)
    assert_usable(device)


def on_device(args, device):
    return [a.to(device) for a in args]


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("name,mutate,pattern,in_list", VALUE_CASES, ids=VALUE_IDS)
def test_bad_levels_known_on_host(device, backend, name, mutate, pattern, in_list):
    """Host tensors on the CPU; spatial_shapes_list (made from the bad
    tensor, as a caller would) on every device: the same error everywhere."""
    bad = mutate(good("cpu"))
    args = on_device(bad, device)
    if device == "cpu":
        with pytest.raises(RuntimeError, match=pattern):
            msda.ms_deform_attn(*args, backend=backend)
    if in_list:
        with pytest.raises(RuntimeError, match=pattern):
            msda.ms_deform_attn(*args, backend=backend, spatial_shapes_list=host_shapes(bad[1]))
    assert_usable(device)


@pytest.mark.parametrize("device,backend", cuda_backends())
@pytest.mark.parametrize("name,mutate,pattern,in_list", VALUE_CASES, ids=VALUE_IDS)
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "det"])
def test_bad_levels_only_on_device(device, backend, name, mutate, pattern, in_list,
                                   deterministic, monkeypatch):
    """Shapes only in GPU tensors (no sync to read them): every kernel checks
    the level table against S itself, reads nothing outside value, and makes
    the whole output and the location and weight gradients NaN (never
    plausible numbers); grad_value stays finite. MS_DEFORM_ATTN_CHECK_SHAPES=1
    checks on the host instead, with a sync, and raises the CPU's error."""
    bad = on_device(mutate(good("cpu")), device)
    hs = None
    if backend == "tma":
        if in_list:
            pytest.skip("tma needs spatial_shapes_list, which shows this error on the host")
        hs = host_shapes(good("cpu")[1])  # the list cannot show a bad level_start_index
    value, shapes, start, loc, attn = bad
    value, loc, attn = (t.detach().requires_grad_() for t in (value, loc, attn))
    out = msda.ms_deform_attn(value, shapes, start, loc, attn, backend=backend,
                              deterministic=deterministic, spatial_shapes_list=hs)
    grads = torch.autograd.grad(out, (value, loc, attn), torch.randn_like(out))
    torch.cuda.synchronize()
    assert torch.isnan(out).all()
    assert torch.isnan(grads[1]).all() and torch.isnan(grads[2]).all()
    assert torch.isfinite(grads[0]).all()
    monkeypatch.setenv("MS_DEFORM_ATTN_CHECK_SHAPES", "1")
    with pytest.raises(RuntimeError, match=pattern):
        msda.ms_deform_attn(*bad, backend=backend, spatial_shapes_list=hs)
    assert_usable(device)


# spatial_shapes_list (host side, so checked without a sync on every device).
HOST_LIST_CASES = [
    ("list_length", [(4, 6)],
     r"spatial_shapes_list must hold one \(H, W\) pair per level, 4 numbers for "
     r"spatial_shapes.size\(0\) = 2 levels, got 2"),
    ("list_zero", [(4, 6), (0, 3)], r"spatial_shapes_list\[1\] = \(0, 3\) must be positive"),
    ("list_sum", [(4, 6), (2, 4)],
     r"value.size\(1\) \(S\) must equal the sum of H \* W over the levels of "
     r"spatial_shapes_list = 32, got 30"),
]


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("name,shapes_list,pattern", HOST_LIST_CASES,
                         ids=[c[0] for c in HOST_LIST_CASES])
def test_bad_host_shapes(device, backend, name, shapes_list, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        msda.ms_deform_attn(*good(device), backend=backend, spatial_shapes_list=shapes_list)
    assert_usable(device)


def test_host_shapes_differing_from_cpu_tensor():
    """On the CPU both are on the host: compared, no sync needed."""
    with pytest.raises(RuntimeError, match=r"spatial_shapes_list\[0\] = \(6, 4\) must equal "
                                           r"spatial_shapes\[0\] = \(4, 6\)"):
        msda.ms_deform_attn(*good("cpu"), spatial_shapes_list=[(6, 4), (2, 3)])


@pytest.mark.parametrize("device,backend", device_backends())
def test_bad_grad_output(device, backend):
    value, shapes, start, loc, attn = good(device)
    bwd = torch.ops.ms_deform_attn._ms_deform_attn_backward
    with pytest.raises(RuntimeError, match=r"grad_output must have shape \(N, Lq, M \* D\)"):
        bwd(torch.zeros(2, 5, 31, device=device), value, shapes, start, loc, attn)
    with pytest.raises(RuntimeError, match=r"grad_output must have the value's dtype"):
        bwd(torch.zeros(2, 5, 32, device=device, dtype=torch.float64), value, shapes, start,
            loc, attn)
    with pytest.raises(RuntimeError, match=r"grad_output must have shape \(N, Lq, M \* D\)"):
        bwd(torch.zeros(2, 5, 32, 1, device=device), value, shapes, start, loc, attn, True)
    assert_usable(device)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_inputs_on_two_gpus():
    args = good("cuda:0")
    for i, name in [(0, "value"), (3, "sampling_locations"), (4, "attention_weights")]:
        bad = replace(args, i, args[i].to("cuda:1"))
        with pytest.raises(RuntimeError, match=r"must be on the same device as value"):
            msda.ms_deform_attn(*bad)
    value, shapes, start, loc, attn = args
    out = msda.ms_deform_attn(value, shapes, start, loc, attn)
    bwd = torch.ops.ms_deform_attn._ms_deform_attn_backward
    with pytest.raises(RuntimeError, match=r"grad_output must be on the same device as value"):
        bwd(torch.zeros_like(out, device="cuda:1"), value, shapes, start, loc, attn)
    assert_usable("cuda")


@pytest.mark.parametrize("device,backend", device_backends())
def test_unknown_backend(device, backend):
    with pytest.raises(RuntimeError, match=r"unknown backend 'nope'; expected 'auto' or one of "
                                           r"\['cpu', 'tma', 'cluster', 'persistent', 'blocked', 'baseline', 'pytorch'\]"):
        msda.ms_deform_attn(*good(device), backend="nope")
    assert_usable(device)


def test_cuda_backend_on_cpu_tensors():
    with pytest.raises(RuntimeError, match=r"backend 'baseline' cannot run on CPU tensors"):
        msda.ms_deform_attn(*good("cpu"), backend="baseline")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cpu_backend_on_cuda_tensors():
    with pytest.raises(RuntimeError, match=r"backend 'cpu' cannot run .*on CUDA tensors"):
        msda.ms_deform_attn(*good("cuda"), backend="cpu")


@pytest.mark.parametrize("device,backend", device_backends())
def test_value_without_a_pixel_per_level(device, backend):
    """S < L: some level would have no pixel (checked on the host, no sync)."""
    value, shapes, start, loc, attn = good(device)
    with pytest.raises(RuntimeError, match=r"value.size\(1\) \(S\) must be at least the number of "
                                           r"levels \(2\).*got 1"):
        msda.ms_deform_attn(value[:, :1], shapes, start, loc, attn, backend=backend)
    assert_usable(device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_mixed_devices():
    args = good("cuda")
    for i, name in [(1, "spatial_shapes"), (2, "level_start_index"), (3, "sampling_locations"),
                    (4, "attention_weights")]:
        bad = replace(args, i, args[i].cpu())
        with pytest.raises(RuntimeError, match=name + r" must be on the same device as value"):
            msda.ms_deform_attn(*bad)
    # The process stays usable after the errors.
    assert torch.cuda.is_available() and (torch.ones(3, device="cuda") + 1).sum().item() == 6


NAMES = ["value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights"]


@pytest.mark.parametrize("i", range(5), ids=NAMES)
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "with_grad"])
def test_a_meta_tensor_among_real_ones(i, grad):
    """One input on the meta device beside CPU ones: the dispatcher then runs
    the fake kernel, which must refuse as the kernels do (it returned
    uninitialised memory)."""
    args = good("cpu")
    if grad:
        args = [t.detach().requires_grad_() if t.is_floating_point() else t for t in args]
    args = replace(args, i, args[i].detach().to("meta"))
    other = "spatial_shapes" if i == 0 else NAMES[i]
    with pytest.raises(RuntimeError, match=other + r" must be on the same device as value"):
        msda.ms_deform_attn(*args)


@pytest.mark.parametrize("i", range(6), ids=["grad_output"] + NAMES)
def test_backward_with_a_meta_tensor_among_real_ones(i):
    value, shapes, start, loc, attn = good("cpu")
    args = [msda.ms_deform_attn(value, shapes, start, loc, attn), value, shapes, start, loc, attn]
    args = replace(args, i, args[i].to("meta"))
    bwd = torch.ops.ms_deform_attn._ms_deform_attn_backward
    with pytest.raises(RuntimeError, match=r"must be on the same device as value"):
        bwd(*args)


@pytest.mark.parametrize("i", [1, 2, 3, 4, 5], ids=["spatial_shapes", "level_start_index",
                                                     "reference_points", "sampling_offsets",
                                                     "attention_logits"])
def test_fused_with_a_meta_tensor_among_real_ones(i):
    value, shapes, start, _, _ = good("cpu")
    n, lq, m, L, P = 2, 5, 4, 2, 3
    args = [value, shapes, start, torch.rand(n, lq, L, 2), torch.randn(n, lq, m, L, P, 2),
            torch.randn(n, lq, m, L * P)]
    args = replace(args, i, args[i].to("meta"))
    with pytest.raises(RuntimeError, match=r"must be on the same device as value"):
        msda.ms_deform_attn_fused(*args)
    bwd = torch.ops.ms_deform_attn._ms_deform_attn_fused_backward
    grad = torch.zeros(n, lq, m * 8)
    with pytest.raises(RuntimeError, match=r"must be on the same device as value"):
        bwd(grad, *args)


def test_every_input_on_meta_is_traced():
    """All inputs on the meta device (shape inference) still run the fake
    kernels, forward and backward."""
    args = [t.to("meta") for t in good("cpu")]
    args = [t.requires_grad_() if t.is_floating_point() else t for t in args]
    out = msda.ms_deform_attn(*args)
    assert out.device.type == "meta" and out.shape == (2, 5, 32)
    grads = torch.autograd.grad(out, (args[0], args[3], args[4]), torch.zeros_like(out))
    assert [g.shape for g in grads] == [args[0].shape, args[3].shape, args[4].shape]


@pytest.mark.skipif(msda.cuda_kernels_built(), reason="this build has the CUDA kernels")
def test_cpu_only_build_names_the_missing_cuda_kernels():
    """A build without the CUDA kernels answers CUDA tensors (here: the CUDA
    kernel called directly) with an error that says so and how to rebuild,
    not the dispatcher's generic one; the queries say "cuda" has no backend."""
    value, shapes, start, loc, attn = make_inputs(1, 3, 2, 8, [(4, 5)], 2, torch.float32)
    op = torch.ops.ms_deform_attn.ms_deform_attn.default
    with pytest.raises(RuntimeError, match="no CUDA kernels.*FORCE_CUDA=1"):
        op.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA), value, shapes, start, loc, attn)
    assert msda.available_backends("cuda") == []


@pytest.mark.parametrize("archs,cc,runs", [
    ("8.0;8.6;8.9;9.0a;10.0;12.0+PTX", (8, 0), True),
    ("8.0;8.6;8.9;9.0a;10.0;12.0+PTX", (8, 7), True),    # sm_86 SASS runs on 8.7
    ("8.0;8.6;8.9;9.0a;10.0;12.0+PTX", (9, 0), True),
    ("8.0;8.6;8.9;9.0a;10.0;12.0+PTX", (10, 3), True),   # sm_100 SASS on 10.3
    ("8.0;8.6;8.9;9.0a;10.0;12.0+PTX", (12, 1), True),
    ("8.0;8.6;8.9;9.0a;10.0;12.0+PTX", (13, 0), True),   # the PTX, compiled by the driver
    ("8.0;8.6;8.9;9.0a;10.0;12.0+PTX", (7, 5), False),
    ("9.0a", (9, 0), True),
    ("9.0a", (10, 0), False),                            # an "a" target runs on 9.0 alone
    ("9.0a", (8, 9), False),
    ("8.0 8.9", (8, 6), True),                           # torch's list takes spaces too
    ("", (9, 0), False),
])
def test_kernel_image_error_names_what_the_build_has_and_the_gpu_needs(archs, cc, runs):
    """The error a GPU gets at its first call when the build has no kernel it
    runs (ms_deform_attn asks the CUDA runtime; this is what it then says)."""
    msg = torch.ops.ms_deform_attn._kernel_image_error(archs, cc[0], cc[1], "cuda:0 (Some GPU)")
    if runs:
        assert msg == ""
    else:
        assert f"no CUDA kernels for cuda:0 (Some GPU) (compute capability {cc[0]}.{cc[1]})" in msg
        assert (f'TORCH_CUDA_ARCH_LIST="{archs}"' if archs else "no CUDA architecture") in msg
        assert f"sm_{cc[0]}{cc[1]}" in msg


def test_build_reports_its_architectures():
    archs = msda.cuda_archs()
    assert (archs != "") == msda.cuda_kernels_built()
    if torch.cuda.is_available() and archs:
        major, minor = torch.cuda.get_device_capability()
        assert torch.ops.ms_deform_attn._kernel_image_error(archs, major, minor, "cuda:0") == ""


def test_import_refuses_a_torch_too_old(monkeypatch):
    """A torch older than the operator library's stable ABI target is
    refused at import, naming both, before the dynamic loader fails on a
    missing symbol; any newer release is accepted."""
    from ms_deform_attn import _build_info, _ops

    assert _build_info.STABLE_TARGET == "2.10"
    monkeypatch.setattr(_build_info, "TORCH_VERSION", "1.13.1+cu117")
    _ops._check_torch()  # the build's own release does not matter
    monkeypatch.setattr(_build_info, "STABLE_TARGET", "99.0")
    with pytest.raises(ImportError, match=r"needs torch 99\.0 or newer.*"
                       + re.escape(f"torch {torch.__version__} is installed")):
        _ops._check_torch()
    monkeypatch.setattr(_build_info, "STABLE_TARGET", "2.10")
    monkeypatch.setattr(_build_info, "TORCH_VERSION", torch.__version__)
    monkeypatch.setattr(_build_info, "CUDA_VERSION", "99.0")
    with pytest.raises(ImportError, match=r"CUDA 99\.0.*install a torch built for CUDA 99\.x"):
        _ops._check_torch()
