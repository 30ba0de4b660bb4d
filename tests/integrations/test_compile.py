"""The operator and the modules inside PyTorch's compilers and graphs:
torch.compile (fullgraph, reduce-overhead), torch.export, CUDA-graph
capture of forward and backward and of whole training steps."""
import pytest
import torch

import ms_deform_attn as msda
from ms_deform_attn.nn import MSDeformAttn
from ms_deform_attn.testing import level_tensors
from helpers import (MODULE_LEVELS, TOL, VALUE_LAYOUTS, cuda_backends, device_backends, host_shapes,
                     make_inputs, make_module_pair, module_inputs, reference64, rel_err)


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


class TinyEncoder(torch.nn.Module):
    """Two Deformable-DETR-style encoder layers."""

    def __init__(self, d_model=64, backend="auto", shapes_list=MODULE_LEVELS):
        super().__init__()
        self.shapes_list = shapes_list  # host-side level shapes, a constant to compile / export
        self.layers = torch.nn.ModuleList(
            [MSDeformAttn(d_model, len(MODULE_LEVELS), 8, 3, backend=backend) for _ in range(2)])
        self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(d_model) for _ in range(2)])

    def forward(self, src, ref, shapes, start):
        for attn, norm in zip(self.layers, self.norms):
            src = norm(src + attn(src, ref, src, shapes, start,
                                  input_spatial_shapes_list=self.shapes_list))
        return src


def encoder_inputs(device):
    shapes, start = level_tensors(MODULE_LEVELS, device)
    s = sum(h * w for h, w in MODULE_LEVELS)
    src = torch.randn(2, s, 64, device=device)
    ref = torch.rand(2, s, len(MODULE_LEVELS), 2, device=device)
    return src, ref, shapes, start


@VALUE_LAYOUTS
@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_compile_module_and_model_fullgraph(device, backend, fused, layout):
    torch._dynamo.reset()
    compiler = "aot_eager" if device == "cpu" else "inductor"
    ours, _ = make_module_pair(device, backend, fused=fused, layout=layout)
    args = module_inputs(device, mask=True)
    compiled = torch.compile(ours, fullgraph=True, backend=compiler)
    torch.testing.assert_close(compiled(*args), ours(*args), rtol=1e-4, atol=1e-5)
    model = TinyEncoder(backend=backend).to(device)
    for layer in model.layers:
        layer.fused = fused
        layer.value_layout = layout
    inputs = encoder_inputs(device)
    compiled_model = torch.compile(model, fullgraph=True, backend=compiler)
    out = compiled_model(*inputs)
    torch.testing.assert_close(out, model(*inputs), rtol=1e-4, atol=1e-4)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@VALUE_LAYOUTS
@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_export_has_one_op_node(device, backend, fused, layout):
    model = TinyEncoder(backend=backend).to(device).eval()
    for layer in model.layers:
        layer.fused = fused
        layer.value_layout = layout
    ep = torch.export.export(model, encoder_inputs(device))
    op = torch.ops.ms_deform_attn.ms_deform_attn_fused if fused else torch.ops.ms_deform_attn.ms_deform_attn
    nodes = [n for n in ep.graph.nodes if n.op == "call_function" and n.target == op.default]
    assert len(nodes) == 2  # one per layer
    inputs = encoder_inputs(device)
    torch.testing.assert_close(ep.module()(*inputs), model(*inputs))


@VALUE_LAYOUTS
@pytest.mark.parametrize("device,backend", [p for p in device_backends() if p.values[0] == "cuda"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_cuda_graph_training_step(device, backend, fused, layout):
    model = TinyEncoder(backend=backend).to(device)
    for layer in model.layers:
        layer.fused = fused
        layer.value_layout = layout
    static = encoder_inputs(device)

    def step():
        model.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(*static).float().square().mean()
        loss.backward()
        return loss

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    fresh = encoder_inputs(device)
    static[0].copy_(fresh[0])
    static[1].copy_(fresh[1])
    graph.replay()
    torch.cuda.synchronize()
    graph_grads = [p.grad.clone() for p in model.parameters()]
    eager_loss = step()
    torch.testing.assert_close(static_loss, eager_loss, rtol=1e-3, atol=1e-4)
    for a, p in zip(graph_grads, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=2e-2, atol=2e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_compile_reduce_overhead_training_step(fused):
    # torch.compile's CUDA-graph mode (cudagraph trees over the forward and the
    # backward), as benchmarks.layer's model step uses it: no graph skipped
    # for the operator, and every step's loss and gradients are eager's,
    # through warm-up, recording and replays on fresh inputs.
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = TinyEncoder().cuda()
    for layer in model.layers:
        layer.fused = fused
    compiled = torch.compile(model, mode="reduce-overhead")

    def step(fn, inputs):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(*inputs).float().square().mean()
        loss.backward()
        return loss.detach().clone(), [p.grad.clone() for p in model.parameters()]

    for _ in range(4):
        inputs = encoder_inputs("cuda")
        torch.compiler.cudagraph_mark_step_begin()
        loss, grads = step(compiled, inputs)
        eager_loss, eager_grads = step(model, inputs)
        torch.testing.assert_close(loss, eager_loss, rtol=1e-3, atol=1e-4)
        for a, b in zip(grads, eager_grads):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
    assert counters["inductor"]["cudagraph_skips"] == 0
