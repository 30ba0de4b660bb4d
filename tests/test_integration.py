"""The operator inside PyTorch's machinery: opcheck, torch.compile, CUDA graphs,
devices, backend selection."""
import pytest
import torch

import ms_deform_attn as msda
from helpers import (LAYOUTS, TOL, cuda_backends, device_backends, host_shapes, in_layout,
                     make_inputs, reference64, reference64_grads, rel_err, skip_unless_runs)


@LAYOUTS
@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_opcheck(device, backend, dtype, layout):
    value, shapes, start, loc, attn = make_inputs(2, 6, 2, 8, [(4, 5), (2, 3)], 2, dtype,
                                                  device=device, requires_grad=True)
    value = in_layout(value, layout)
    skip_unless_runs(backend, value, shapes, start, loc, attn, host_shapes(shapes))
    torch.library.opcheck(torch.ops.ms_deform_attn.ms_deform_attn.default,
                          (value, shapes, start, loc, attn, backend, None,
                           [x for hw in host_shapes(shapes) for x in hw]))


@LAYOUTS
@pytest.mark.parametrize("device,backend", device_backends())
def test_opcheck_backward_op(device, backend, layout):
    value, shapes, start, loc, attn = make_inputs(2, 6, 2, 8, [(4, 5), (2, 3)], 2,
                                                  torch.float32, device=device)
    value = in_layout(value, layout)
    grad = torch.randn(2, 6, 16, device=device)
    torch.library.opcheck(torch.ops.ms_deform_attn._ms_deform_attn_backward.default,
                          (grad, value, shapes, start, loc, attn),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("device,backend", device_backends())
def test_torch_compile_fullgraph(device, backend):
    torch._dynamo.reset()
    value, shapes, start, loc, attn = make_inputs(2, 9, 4, 16, [(6, 7), (3, 4)], 3,
                                                  torch.float32, device=device,
                                                  requires_grad=True)
    hs = host_shapes(shapes)

    def f(v, l, a):
        return msda.ms_deform_attn(v * 2, shapes, start, l.clamp(-1, 2), a.softmax(-1),
                                   backend=backend, spatial_shapes_list=hs).relu()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    out = compiled(value, loc, attn)
    expected = f(value, loc, attn)
    torch.testing.assert_close(out, expected)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (value, loc, attn), g)
    expected_grads = torch.autograd.grad(expected, (value, loc, attn), g)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device,backend", cuda_backends())
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "det"])
def test_cuda_graph_capture_forward_backward(device, backend, deterministic):
    value, shapes, start, loc, attn = make_inputs(2, 33, 8, 32, [(9, 8), (5, 4)], 4,
                                                  torch.bfloat16, torch.float32, device=device,
                                                  requires_grad=True)
    grad = torch.randn(2, 33, 256, device=device, dtype=torch.bfloat16)
    hs = host_shapes(shapes)  # before the capture: a device-to-host copy

    def step():
        out = msda.ms_deform_attn(value, shapes, start, loc, attn, backend=backend,
                                  deterministic=deterministic, spatial_shapes_list=hs)
        return (out,) + torch.autograd.grad(out, (value, loc, attn), grad)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    # New inputs copied in place, then replay.
    fresh = make_inputs(2, 33, 8, 32, [(9, 8), (5, 4)], 4, torch.bfloat16, torch.float32,
                        device=device)
    with torch.no_grad():
        value.copy_(fresh[0]), loc.copy_(fresh[3]), attn.copy_(fresh[4])
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for a, b in zip(static, eager):
        if deterministic:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    assert rel_err(static[0], reference64(value, shapes, start, loc, attn)) <= TOL[torch.bfloat16]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("device,backend", cuda_backends())
def test_runs_on_second_device(device, backend):
    """Current device cuda:0, tensors on cuda:1: the kernels run on cuda:1, on
    its current stream (here a side stream), forward and backward."""
    torch.cuda.set_device(0)
    inputs = make_inputs(2, 20, 8, 32, [(8, 9), (4, 5)], 4, torch.float32, device="cuda:1",
                         requires_grad=True)
    side = torch.cuda.Stream(device="cuda:1")
    side.wait_stream(torch.cuda.current_stream("cuda:1"))
    hs = host_shapes(inputs[1])
    with torch.cuda.stream(side):
        out = msda.ms_deform_attn(*inputs, backend=backend, spatial_shapes_list=hs)
        grads = torch.autograd.grad(out, (inputs[0], inputs[3], inputs[4]), torch.ones_like(out))
    side.synchronize()
    assert torch.cuda.current_device() == 0
    assert out.device == torch.device("cuda:1")
    assert rel_err(out, reference64(*inputs)) <= TOL[torch.float32]
    ref_grads = reference64_grads(*inputs, torch.ones_like(out))
    for g, r in zip(grads, ref_grads):
        assert g.device == torch.device("cuda:1") and rel_err(g, r) <= 1e-5


@pytest.mark.parametrize("device,backend", device_backends())
def test_auto_picks_an_available_backend(device, backend):
    inputs = make_inputs(1, 8, 2, 16, [(4, 4)], 2, torch.bfloat16, device=device)
    choice = msda.select_backend(*inputs)
    assert choice in msda.available_backends(device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_env_override(monkeypatch):
    inputs = make_inputs(1, 8, 2, 16, [(4, 4)], 2, torch.float32, device="cuda")
    monkeypatch.setenv("MS_DEFORM_ATTN_BACKEND", "baseline")
    assert msda.select_backend(*inputs) == "baseline"
    monkeypatch.setenv("MS_DEFORM_ATTN_BACKEND", "nope")
    with pytest.raises(RuntimeError, match="unknown backend 'nope'"):
        msda.ms_deform_attn(*inputs)


def test_a_build_without_cuda_kernels_warns_where_a_gpu_is_visible(monkeypatch):
    """A CPU-only build imported where torch sees a GPU says so at import
    (pip hides the build's notice), naming the GPU and how to rebuild; where
    no GPU is visible, or the kernels are there, it says nothing."""
    import warnings

    from ms_deform_attn import _ops

    monkeypatch.setattr(_ops, "_CUDA_KERNELS", False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    with pytest.warns(RuntimeWarning, match=r"built without its CUDA kernels .* \(NVIDIA H200\).*"
                                            r"FORCE_CUDA=1 pip install"):
        _ops._warn_without_cuda_kernels()
    for kernels, gpu in ((True, True), (False, False)):
        monkeypatch.setattr(_ops, "_CUDA_KERNELS", kernels)
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _ops._warn_without_cuda_kernels()
