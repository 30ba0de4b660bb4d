"""Which backend runs: auto's pick among the available ones, the
environment's override, a second device, and what a build without the CUDA
kernels says where a GPU is visible. The policy itself: test_forward_plan.py."""
import pytest
import torch

import ms_deform_attn as msda
from helpers import (TOL, cuda_backends, device_backends, host_shapes, make_inputs, reference64,
                     reference64_grads, rel_err)


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
