"""Drop-in layers: Deformable DETR module, compat functions, HF transformers;
AMP, torch.compile, CUDA graphs and torch.export around them."""
import math

import pytest
import torch

import ms_deform_attn as msda
from ms_deform_attn.compat import (MSDeformAttnFunction, MultiScaleDeformableAttnFunction,
                                   multi_scale_deformable_attn_pytorch)
from ms_deform_attn.nn import MSDeformAttn
from ms_deform_attn.reference import ms_deform_attn_pytorch
from ms_deform_attn.testing import level_tensors
from helpers import TOL, device_backends, make_inputs, rel_err, tiny_deformable_detr, tiny_rt_detr

LEVELS = [(12, 15), (6, 8), (3, 4)]


def module_inputs(device, n=2, lq=17, d_model=64, boxes=False, mask=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes, start = level_tensors(LEVELS, device)
    s = sum(h * w for h, w in LEVELS)
    query = torch.randn(n, lq, d_model, generator=g).to(device)
    flat = torch.randn(n, s, d_model, generator=g).to(device)
    ref = torch.rand(n, lq, len(LEVELS), 4 if boxes else 2, generator=g).to(device)
    if boxes:
        ref[..., 2:] = ref[..., 2:] * 0.5 + 0.05
    pad = (torch.rand(n, s, generator=g) < 0.2).to(device) if mask else None
    # The host-side shapes last (the `tma` backend needs them).
    return query, ref, flat, shapes, start, pad, LEVELS


VALUE_LAYOUTS = pytest.mark.parametrize("layout", ["standard", "head_major"])


def make_pair(device, backend, d_model=64, n_heads=8, n_points=3, fused=False, layout="standard"):
    torch.manual_seed(1)
    ours = MSDeformAttn(d_model, len(LEVELS), n_heads, n_points, backend=backend,
                        fused=fused, value_layout=layout).to(device)
    # Random weights so that the comparison exercises every parameter.
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.2)
    ref = MSDeformAttn(d_model, len(LEVELS), n_heads, n_points, backend="pytorch").to(device)
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref


def test_state_dict_of_the_deformable_detr_module_loads_strictly():
    # Names and shapes of Deformable DETR's MSDeformAttn(256, 4, 8, 4).
    sd = {
        "sampling_offsets.weight": torch.randn(256, 256), "sampling_offsets.bias": torch.randn(256),
        "attention_weights.weight": torch.randn(128, 256), "attention_weights.bias": torch.randn(128),
        "value_proj.weight": torch.randn(256, 256), "value_proj.bias": torch.randn(256),
        "output_proj.weight": torch.randn(256, 256), "output_proj.bias": torch.randn(256),
    }
    m = MSDeformAttn()
    m.load_state_dict(sd, strict=True)
    assert torch.equal(m.sampling_offsets.bias, sd["sampling_offsets.bias"])


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.float32, True)],
                         ids=["fp32", "bf16", "bf16-autocast"])
def test_fused_by_default(monkeypatch, dtype, autocast):
    import ms_deform_attn.nn as nn_module
    calls = []
    real = nn_module.ms_deform_attn_fused
    monkeypatch.setattr(nn_module, "ms_deform_attn_fused",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    layer = MSDeformAttn(64, len(LEVELS), 8, 3).to(dtype)
    assert layer.fused
    query, ref, flat, shapes, start, _, levels = module_inputs("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = layer(query.to(dtype), ref, flat.to(dtype), shapes, start, None, levels)
    assert len(calls) == 1
    assert out.dtype == (torch.bfloat16 if autocast else dtype)


def test_initialisation_matches_deformable_detr():
    m = MSDeformAttn(256, 4, 8, 4)
    bias = m.sampling_offsets.bias.view(8, 4, 4, 2)
    # Head 0 looks along +x, head 2 along +y, head 4 along -x; point p is p + 1 steps out.
    torch.testing.assert_close(bias[0, 2, :, 0], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    torch.testing.assert_close(bias[2, 1, 3], torch.tensor([0.0, 4.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(bias[4, 0, 1], torch.tensor([-2.0, 0.0]), atol=1e-6, rtol=0)
    # Head 1 (45 degrees): both components scaled to 1.
    torch.testing.assert_close(bias[1, 3, 0], torch.tensor([1.0, 1.0]))
    assert m.sampling_offsets.weight.abs().sum() == 0
    assert m.attention_weights.weight.abs().sum() == 0 and m.attention_weights.bias.abs().sum() == 0
    assert m.value_proj.bias.abs().sum() == 0 and m.output_proj.bias.abs().sum() == 0
    bound = math.sqrt(6.0 / (256 + 256))  # xavier_uniform
    assert m.value_proj.weight.abs().max() <= bound


@VALUE_LAYOUTS
@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("boxes", [False, True], ids=["points", "boxes"])
@pytest.mark.parametrize("mask", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_module_matches_reference_module(device, backend, boxes, mask, fused, layout):
    ours, ref = make_pair(device, backend, fused=fused, layout=layout)
    args = module_inputs(device, boxes=boxes, mask=mask)
    out = ours(*args)
    expected = ref(*args)
    assert out.shape == expected.shape
    assert rel_err(out, expected.double()) <= 1e-5
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad.double()) <= 1e-4, name


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_head_major_value_reaches_the_operator(device, backend, fused, autocast, monkeypatch):
    """value_layout="head_major": value_proj's output goes to the operator
    head-major (no copy on the way), masked at padding; the layer's output
    and gradients are the standard layout's within the GEMMs' rounding."""
    import ms_deform_attn.nn as msnn
    seen = []
    for name in ("ms_deform_attn", "ms_deform_attn_fused"):
        real = getattr(msnn, name)

        def spy(value, *rest, real=real, **kw):
            seen.append(value.stride())
            return real(value, *rest, **kw)
        monkeypatch.setattr(msnn, name, spy)
    args = module_inputs(device, mask=True)
    results = []
    for layout in ("standard", "head_major"):
        layer, _ = make_pair(device, backend, fused=fused, layout=layout)
        query, flat = (t.clone().requires_grad_() for t in (args[0], args[2]))
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = layer(query, args[1], flat, *args[3:])
        grads = torch.autograd.grad(out.float().square().sum(), [query, flat, *layer.parameters()])
        results.append((out, grads))
    s, m, d = flat.shape[1], 8, 8
    assert seen == [(s * m * d, m * d, d, 1), (m * s * d, d, s * d, 1)]
    tol = 2e-2 if autocast else 1e-5
    for a, b in zip([results[0][0], *results[0][1]], [results[1][0], *results[1][1]]):
        assert a.dtype == b.dtype
        assert rel_err(b, a.double()) <= tol


def test_value_layout_is_checked():
    with pytest.raises(ValueError, match="value_layout"):
        MSDeformAttn(64, 3, 8, 3, value_layout="nhwc")


def test_bad_reference_points():
    m = MSDeformAttn(64, len(LEVELS), 8, 3)
    query, ref, flat, shapes, start, _, _ = module_inputs("cpu", boxes=True)
    with pytest.raises(ValueError, match="must be 2 or 4, got 3"):
        m(query, ref[..., :3], flat, shapes, start)


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("fn", [MSDeformAttnFunction, MultiScaleDeformableAttnFunction],
                         ids=["MSDeformAttnFunction", "MultiScaleDeformableAttnFunction"])
def test_function_compat(device, backend, fn):
    inputs = make_inputs(3, 20, 8, 32, LEVELS, 4, torch.float32, device=device, requires_grad=True)
    out = fn.apply(*inputs, 5)  # an im2col_step that divides nothing: no limit
    expected = msda.ms_deform_attn(*inputs)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (inputs[0], inputs[3], inputs[4]), g)
    expected_grads = torch.autograd.grad(expected, (inputs[0], inputs[3], inputs[4]), g)
    for a, b in zip(grads, expected_grads):
        # grad_value sums with float atomics on CUDA: equal up to summation order.
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("as_list", [False, True], ids=["tensor", "list"])
def test_mmcv_style_function(device, backend, as_list):
    value, shapes, start, loc, attn = make_inputs(2, 11, 4, 16, LEVELS, 2, torch.float64,
                                                  device=device)
    spatial = LEVELS if as_list else shapes
    out = multi_scale_deformable_attn_pytorch(value, spatial, loc, attn)
    expected = ms_deform_attn_pytorch(value, shapes, start, loc, attn)
    assert rel_err(out, expected) <= 1e-12


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_autocast_module(device, backend, fused):
    ours, ref = make_pair(device, backend, fused=fused)
    args = module_inputs(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = ours(*args)
    assert out.dtype == torch.bfloat16
    expected = ref(*args)
    # bf16 projections and bf16 value: within bf16 error of the fp32 module.
    assert rel_err(out.float(), expected.double()) <= 3e-2
    out.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ours.parameters())


@VALUE_LAYOUTS
@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("boxes,mask", [(False, False), (True, True)], ids=["points", "boxes-mask"])
def test_recompute_matches_keeping(device, backend, autocast, boxes, mask, layout):
    # The fused layer forming value, offsets and logits again at the
    # backward: the same output and gradients as keeping them.
    args = module_inputs(device, boxes=boxes, mask=mask)
    results = []
    for recompute in (True, False):
        layer, _ = make_pair(device, backend, fused=True, layout=layout)
        layer.recompute = recompute
        query, flat = (t.clone().requires_grad_() for t in (args[0], args[2]))
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            # Leaves (whose casts autocast caches) in one case, activations
            # (cast here) in the other.
            out = layer(query, args[1], flat * 1.0 if mask else flat, *args[3:])
        grads = torch.autograd.grad(out.float().square().sum(), [query, flat, *layer.parameters()])
        results.append((out, grads))
    for a, b in zip([results[0][0], *results[0][1]], [results[1][0], *results[1][1]]):
        assert a.dtype == b.dtype
        assert torch.isfinite(a).all()
        # The GEMMs run again on the same inputs: bitwise the same where the
        # library is deterministic (the CPU), within rounding elsewhere.
        if device == "cpu":
            assert torch.equal(a, b)
        else:
            assert rel_err(a, b.double()) <= 1e-6


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("recompute", [True, False])
def test_recompute_drops_the_operator_inputs(device, backend, recompute, monkeypatch):
    # With recompute the operator's value, offsets and logits are freed after
    # the forward (autograd keeps a function in their place); without, kept.
    import weakref
    import ms_deform_attn.nn as layers
    made = []
    real = layers._recomputing

    def spy(remakes):
        made.extend(weakref.ref(t) for t, _ in remakes)
        return real(remakes)

    monkeypatch.setattr(layers, "_recomputing", spy)
    layer, _ = make_pair(device, backend, fused=True)
    layer.recompute = recompute
    args = module_inputs(device)
    query = args[0].clone().requires_grad_()
    out = layer(query, *args[1:])
    assert len(made) == (3 if recompute else 0)
    assert all(r() is None for r in made)
    out.sum().backward()
    assert query.grad is not None and torch.isfinite(query.grad).all()


def linears_as_modules(layer, query, flat):
    """What nn._project computes, by calling the layer's linears as modules on
    the inputs as given."""
    n, lq, _ = query.shape
    m, lvl, pts = layer.n_heads, layer.n_levels, layer.n_points
    return (layer.value_proj(flat).view(n, flat.shape[1], m, -1),
            layer.sampling_offsets(query).view(n, lq, m, lvl, pts, 2),
            layer.attention_weights(query).view(n, lq, m, lvl * pts))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")])])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_projections_match_the_linears_as_modules(device, autocast):
    # nn._project casts a (non-leaf) query once under autocast for the two
    # linears that read it: the same results and gradients.
    from ms_deform_attn.nn import _project as project
    layer, _ = make_pair(device, "auto")
    query0, _, flat0, _, _, _, _ = module_inputs(device)
    linears = (layer.value_proj, layer.sampling_offsets, layer.attention_weights)
    leaves = [query0.requires_grad_(), flat0.requires_grad_()] + [
        p for lin in linears for p in lin.parameters()]
    results = []
    for run in (project, linears_as_modules):
        torch.manual_seed(3)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            query, flat = query0 * 1.0, flat0 * 1.0  # not leaves, as in a model
            ys = run(layer, query, flat)[:3]
        loss = sum((y.float() * torch.randn(y.shape, device=device)).sum() for y in ys)
        results.append((ys, torch.autograd.grad(loss, leaves)))
    tol = 1e-2 if autocast else 1e-6
    for a, b in zip(results[0][0], results[1][0]):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel_err(a, b.double()) <= tol
    for a, b in zip(results[0][1], results[1][1]):
        assert a.dtype == b.dtype
        assert rel_err(a, b.double()) <= tol


@pytest.mark.parametrize("device,backend", device_backends())
def test_autocast_accepts_any_input_mix(device, backend):
    value, shapes, start, loc, attn = make_inputs(2, 9, 4, 16, LEVELS, 2, torch.float32,
                                                  device=device)
    # bf16 locations with an fp32 value: refused outside autocast...
    with pytest.raises(RuntimeError, match="sampling_locations must have the value's dtype"):
        msda.ms_deform_attn(value, shapes, start, loc.bfloat16(), attn)
    # ...accepted under it (locations upcast to fp32).
    with torch.autocast(device, dtype=torch.bfloat16):
        out = msda.ms_deform_attn(value, shapes, start, loc.bfloat16(), attn.half())
    assert out.dtype == torch.float32
    expected = ms_deform_attn_pytorch(value.double(), shapes, start, loc.bfloat16().double(),
                                      attn.half().double())
    assert rel_err(out, expected) <= TOL[torch.float32]


class TinyEncoder(torch.nn.Module):
    """Two Deformable-DETR-style encoder layers."""

    def __init__(self, d_model=64, backend="auto", shapes_list=LEVELS):
        super().__init__()
        self.shapes_list = shapes_list  # host-side level shapes, a constant to compile / export
        self.layers = torch.nn.ModuleList(
            [MSDeformAttn(d_model, len(LEVELS), 8, 3, backend=backend) for _ in range(2)])
        self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(d_model) for _ in range(2)])

    def forward(self, src, ref, shapes, start):
        for attn, norm in zip(self.layers, self.norms):
            src = norm(src + attn(src, ref, src, shapes, start,
                                  input_spatial_shapes_list=self.shapes_list))
        return src


def encoder_inputs(device):
    shapes, start = level_tensors(LEVELS, device)
    s = sum(h * w for h, w in LEVELS)
    src = torch.randn(2, s, 64, device=device)
    ref = torch.rand(2, s, len(LEVELS), 2, device=device)
    return src, ref, shapes, start


@VALUE_LAYOUTS
@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_compile_module_and_model_fullgraph(device, backend, fused, layout):
    torch._dynamo.reset()
    compiler = "aot_eager" if device == "cpu" else "inductor"
    ours, _ = make_pair(device, backend, fused=fused, layout=layout)
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


# ---- Hugging Face transformers ---------------------------------------------------
@pytest.mark.parametrize("device,backend", device_backends())
def test_transformers_function_replacement(device, backend):
    pytest.importorskip("transformers")
    from transformers.models.mask2former import modeling_mask2former

    from ms_deform_attn.hf import multi_scale_deformable_attention

    value, shapes, start, loc, attn = make_inputs(2, 13, 4, 16, LEVELS, 3, torch.float32,
                                                  device=device)
    expected = modeling_mask2former.multi_scale_deformable_attention(value, LEVELS, loc, attn)
    out = multi_scale_deformable_attention(value, LEVELS, loc, attn)
    assert rel_err(out, expected.double()) <= 1e-5


def tiny_grounding_dino(device):
    transformers = pytest.importorskip("transformers")
    bb = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 32, 64],
                                   depths=[1, 1, 1, 1], out_features=["stage2", "stage3", "stage4"])
    text = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=4, intermediate_size=32,
                                   max_position_embeddings=64)
    cfg = transformers.GroundingDinoConfig(
        backbone_config=bb, text_config=text, use_timm_backbone=False, backbone=None,
        use_pretrained_backbone=False, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_attention_heads=4,
        decoder_attention_heads=4, num_queries=10, max_text_len=16)
    torch.manual_seed(0)
    return transformers.GroundingDinoModel(cfg).to(device).eval()


def tiny_mask2former(device):
    transformers = pytest.importorskip("transformers")
    swin = transformers.SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1],
                                   num_heads=[1, 1, 2, 2], window_size=4,
                                   out_features=["stage1", "stage2", "stage3", "stage4"])
    cfg = transformers.Mask2FormerConfig(
        backbone_config=swin, feature_size=32, mask_feature_size=32, hidden_dim=32,
        encoder_feedforward_dim=32, dim_feedforward=32, encoder_layers=1, decoder_layers=2,
        num_attention_heads=4, num_queries=10, use_pretrained_backbone=False)
    torch.manual_seed(0)
    return transformers.Mask2FormerModel(cfg).to(device).eval()


def text_ids(device):
    return {"input_ids": torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)}


# name: (model factory, image height and width, extra inputs, output compared,
# MSDA sites transformers puts in it)
HF_MODELS = {
    # one encoder and one decoder layer
    "deformable_detr": (tiny_deformable_detr, (160, 192), None, "last_hidden_state", 2),
    # the decoder's cross-attention
    "rt_detr": (tiny_rt_detr, (128, 128), None, "last_hidden_state", 1),
    # one encoder and one decoder layer
    "grounding_dino": (tiny_grounding_dino, (96, 96), text_ids, "last_hidden_state", 2),
    # the pixel decoder's module-level function (one site for the family)
    "mask2former": (tiny_mask2former, (64, 64), None, "pixel_decoder_last_hidden_state", 1),
}
# Of those sites, the attention layers swap_msda runs on the fused operator
# (those with Deformable DETR's own forward).
FUSED_SITES = {"deformable_detr": 2, "rt_detr": 1, "grounding_dino": 0, "mask2former": 0}


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("name", list(HF_MODELS))
def test_transformers_model_swap(device, backend, name, monkeypatch):
    from ms_deform_attn.hf import MultiScaleDeformableAttention, swap_msda

    factory, (h, w), extra, output, sites = HF_MODELS[name]
    # fp32 convolutions in IEEE precision: with cuDNN's TF32 the two runs'
    # convolutions may round differently (another algorithm each time), which
    # showed as 1.07e-5 on mask2former for every backend alike.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = factory(device)
    if name == "mask2former":  # swap_msda patches the family's module: undo it afterwards
        from transformers.models.mask2former import modeling_mask2former as m2f
        monkeypatch.setattr(m2f, "multi_scale_deformable_attention",
                            m2f.multi_scale_deformable_attention)
    inputs = {"pixel_values": torch.randn(2, 3, h, w, device=device)}
    inputs.update(extra(device) if extra else {})
    with torch.no_grad():
        expected = getattr(model(**inputs), output)
    assert swap_msda(model, backend=backend) == sites
    layers = sum(isinstance(m, MultiScaleDeformableAttention) for m in model.modules())
    if name == "mask2former":
        from ms_deform_attn.hf import multi_scale_deformable_attention
        assert layers == 0 and m2f.multi_scale_deformable_attention is multi_scale_deformable_attention
    else:
        assert layers == sites
    assert sum(hasattr(m, "_msda_backend") for m in model.modules()) == FUSED_SITES[name]
    with torch.no_grad():
        out = getattr(model(**inputs), output)
    assert rel_err(out, expected.double()) <= 1e-5


@pytest.mark.parametrize("device,backend", [p for p in device_backends()
                                            if p.values[1] in ("cpu", "baseline", "none")])
@pytest.mark.parametrize("name", ["deformable_detr", "rt_detr"])
@pytest.mark.parametrize("fused,recompute", [(True, False), (True, True), (False, False)],
                         ids=["fused", "fused-recompute", "unfused"])
def test_transformers_swap_gradients(device, backend, name, fused, recompute):
    """Every parameter's gradient after swap_msda (fused or not, recomputing
    or not) is the one transformers' own path gives, and the attention
    weights it returns are its too."""
    import copy

    from ms_deform_attn.hf import swap_msda

    factory, (h, w), extra, output, sites = HF_MODELS[name]
    own = factory(device)
    swapped = copy.deepcopy(own)
    assert swap_msda(swapped, backend=backend, fused=fused, recompute=recompute) == sites
    inputs = {"pixel_values": torch.randn(2, 3, h, w, device=device)}
    outs = []
    for model in (own, swapped):
        res = model(**inputs, output_attentions=True)
        getattr(res, output).square().sum().backward()
        outs.append(res)
    assert rel_err(getattr(outs[1], output), getattr(outs[0], output).detach().double()) <= 1e-5
    for key in ("encoder_attentions", "cross_attentions"):
        theirs, ours = getattr(outs[0], key, None), getattr(outs[1], key, None)
        assert (theirs is None) == (ours is None), key
        assert len(ours or ()) == len(theirs or ()), key
        for a, b in zip(ours or (), theirs or ()):
            assert rel_err(a, b.detach().double()) <= 1e-5, key
    params = list(zip(swapped.named_parameters(), own.named_parameters()))
    # Gradients that cancel to rounding noise (a convolution before a batch
    # norm) are compared against the largest one's scale.
    scale = max(p.grad.abs().max().item() for _, (_, p) in params if p.grad is not None)
    for (na, pa), (nb, pb) in params:
        assert na == nb
        if pb.grad is None:
            assert pa.grad is None, na
        elif pb.grad.norm() > 1e-3 * scale:
            assert rel_err(pa.grad, pb.grad.double()) <= 1e-4, na
        else:
            assert (pa.grad - pb.grad).abs().max() <= 1e-6 * scale, na


@pytest.mark.parametrize("device,backend", [p for p in device_backends() if p.values[1] in ("cpu", "baseline", "tma")])
@pytest.mark.parametrize("name", ["deformable_detr", "rt_detr", "grounding_dino"])
def test_transformers_kernels_mapping(device, backend, name, monkeypatch):
    """transformers' layer name mapped through the `kernels` package
    (kernelize, no Hub): the layers' forward becomes the operator's, with
    transformers' value_spatial_shapes_list as the host-side shapes (so the
    tma backend, chosen by the environment variable, runs too)."""
    kernels = pytest.importorskip("kernels")
    from ms_deform_attn.hf import kernelize, kernelized_layers

    factory, (h, w), extra, output, sites = HF_MODELS[name]
    model = factory(device)
    inputs = {"pixel_values": torch.randn(2, 3, h, w, device=device)}
    inputs.update(extra(device) if extra else {})
    with torch.no_grad():
        expected = getattr(model(**inputs), output)
    # ms_deform_attn.hf.kernelize marks transformers' layer for kernels where
    # this transformers does not (it does only for the kernels versions it
    # supports); undone after the test.
    for cls in {type(m) for m in model.modules() if type(m).__name__ == "MultiScaleDeformableAttention"}:
        for attr in ("kernel_layer_name", "kernel_condition"):
            monkeypatch.setattr(cls, attr, getattr(cls, attr, None), raising=False)
    model, replaced = kernelize(model, device=device)
    assert replaced == sites == kernelized_layers(model)
    if device == "cuda":
        monkeypatch.setenv("MS_DEFORM_ATTN_BACKEND", backend)
    with torch.no_grad():
        out = getattr(model(**inputs), output)
    assert rel_err(out, expected.double()) <= 1e-5


def test_kernelize_warns_when_nothing_is_replaced(monkeypatch):
    """A kernels.kernelize that replaces nothing (as the README's plain
    snippet did with kernels 0.17.2) is reported, not silent."""
    kernels = pytest.importorskip("kernels")
    from ms_deform_attn.hf import kernelize

    factory, *_ = HF_MODELS["deformable_detr"]
    model = factory("cpu")
    monkeypatch.setattr(kernels, "kernelize", lambda model, **kwargs: model)
    with pytest.warns(RuntimeWarning, match=r"replaced none of the model's \d+ "
                                            r"MultiScaleDeformableAttention layers"):
        _, replaced = kernelize(model)
    assert replaced == 0


# ---- the layers' linears: ms_deform_attn::_linear and _column_sum -----------
def _devices():
    return [p for p in device_backends() if p.values[1] in ("cpu", "baseline", "none")]


@pytest.mark.parametrize("device,backend", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(3, 5, 256), (1000, 128), (7, 40), (2, 0, 16), (4, 1)],
                         ids=["3d-vec", "tall", "odd-cols", "no-rows", "one-col"])
def test_column_sum(device, backend, dtype, shape):
    """_column_sum sums over every dimension but the last, in grad's dtype,
    to within that dtype's rounding of the float64 sum, the same bits on a
    repeat; odd widths (scalar loads) and empty inputs too."""
    g = torch.randn(shape, dtype=torch.float64).to(device=device, dtype=dtype)
    out = torch.ops.ms_deform_attn._column_sum(g)
    ref = g.double().reshape(-1, shape[-1]).sum(0)
    assert out.dtype == dtype and out.shape == (shape[-1],)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert rel_err(out, ref) <= tol if ref.numel() and ref.norm() > 0 else (out == 0).all()
    assert torch.equal(out, torch.ops.ms_deform_attn._column_sum(g))


@pytest.mark.parametrize("device,backend", _devices())
def test_column_sum_errors_and_opcheck(device, backend):
    with pytest.raises(RuntimeError, match="grad must have at least 1 dimension, got 0"):
        torch.ops.ms_deform_attn._column_sum(torch.tensor(1.0, device=device))
    with pytest.raises(RuntimeError, match="grad must be float32, float16, bfloat16 or float64, got Long"):
        torch.ops.ms_deform_attn._column_sum(torch.ones(4, 3, dtype=torch.long, device=device))
    # A non-contiguous gradient is summed as its values say.
    g = torch.randn(64, 48, device=device).t()
    assert rel_err(torch.ops.ms_deform_attn._column_sum(g), g.double().sum(0)) <= 1e-6
    torch.library.opcheck(torch.ops.ms_deform_attn._column_sum.default, (torch.randn(9, 33, device=device),))


@pytest.mark.parametrize("device,backend", _devices())
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_linear_op(device, backend, bias):
    """_linear is torch's linear, forward and backward (gradcheck in
    float64), under autocast too (outputs and gradients in the same dtypes
    as torch's linear gives), and passes opcheck."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 16, generator=g, dtype=torch.float64).to(device).requires_grad_()
    w = torch.randn(24, 16, generator=g, dtype=torch.float64).to(device).requires_grad_()
    b = torch.randn(24, generator=g, dtype=torch.float64).to(device).requires_grad_() if bias else None
    lin = torch.ops.ms_deform_attn._linear
    assert torch.autograd.gradcheck(lambda *a: lin(*a), (x, w, b) if bias else (x, w, None))
    torch.library.opcheck(lin.default, (x, w, b))
    kind = torch.device(device).type
    low = torch.bfloat16
    xs, ws = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    bs = b.detach().float().requires_grad_() if bias else None
    outs = []
    for f in (lin, torch.nn.functional.linear):
        with torch.autocast(kind, dtype=low):
            y = f(xs, ws, bs)
        y.float().square().sum().backward()
        grads = [t.grad.clone() for t in (xs, ws, bs) if t is not None]
        for t in (xs, ws, bs):
            if t is not None:
                t.grad = None
        outs.append((y, grads))
    (y0, g0), (y1, g1) = outs
    assert y0.dtype == y1.dtype == low
    assert rel_err(y0, y1.double()) <= 1e-2
    for a, c in zip(g0, g1):
        assert a.dtype == c.dtype and rel_err(a, c.double()) <= 2e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_layer_linears_use_the_op(monkeypatch):
    """On CUDA the layer's plain nn.Linear modules run as _linear (their bias
    gradient by _column_sum); a linear with a hook calls the module; the
    layer's parameter gradients match a run on the modules themselves."""
    from ms_deform_attn import nn as msnn

    layer = MSDeformAttn(64, len(LEVELS), 8, 3).cuda()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(2, 5, 64, device="cuda")
    assert "LinearFunction" in msnn._linear(layer.value_proj, x).grad_fn.name()
    seen = []
    handle = layer.value_proj.register_forward_hook(lambda m, i, o: seen.append(1))
    assert "LinearFunction" not in msnn._linear(layer.value_proj, x).grad_fn.name()
    assert seen == [1]
    handle.remove()
    query, ref, flat, shapes, start, pad, _ = module_inputs("cuda", d_model=64, mask=True)
    grads = []
    for plain in (False, True):
        if plain:
            monkeypatch.setattr(msnn, "_linear", lambda module, t: module(t))
        layer.zero_grad(set_to_none=True)
        layer(query, ref, flat, shapes, start, pad).square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in layer.named_parameters()})
    for n, g in grads[0].items():
        assert rel_err(g, grads[1][n].double()) <= 1e-5, n


def test_fused_layer_attention_weights_only_when_wanted():
    """swap_msda's fused layers make the attention weights they return only
    when the caller will use them: output_attentions (transformers 4.x), an
    active attentions collector (5.x)."""
    pytest.importorskip("transformers")
    from ms_deform_attn.hf import _attention_weights_wanted

    assert _attention_weights_wanted({"output_attentions": True})
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        assert not _attention_weights_wanted({"output_attentions": False})
        assert _attention_weights_wanted({})
        return
    assert not _attention_weights_wanted({})
    for collected, wanted in (({"attentions": []}, True), ({"cross_attentions": []}, True),
                              ({"hidden_states": []}, False)):
        token = _active_collector.set(collected)
        try:
            assert _attention_weights_wanted({}) == wanted, collected
        finally:
            _active_collector.reset(token)


def _attention_outputs(res):
    """Every attention tensor a transformers model output holds, by field."""
    found = {}

    def walk(name, item):
        if isinstance(item, torch.Tensor):
            found[name] = item
        elif isinstance(item, (tuple, list)):
            for i, x in enumerate(item):
                walk(f"{name}[{i}]", x)

    for key in res.keys():
        if "attentions" in key:
            walk(key, res[key])
    return found


@pytest.mark.parametrize("name", list(HF_MODELS))
def test_transformers_swap_attentions_carry_gradients(name, monkeypatch):
    """The attention weights a swapped model returns (output_attentions)
    are in the graph exactly where transformers' own are: retain_grad works
    on them and a loss on them gives transformers' own parameter gradients."""
    import copy

    from ms_deform_attn.hf import swap_msda

    factory, (h, w), extra, output, sites = HF_MODELS[name]
    own = factory("cpu")
    if name == "mask2former":
        from transformers.models.mask2former import modeling_mask2former as m2f
        monkeypatch.setattr(m2f, "multi_scale_deformable_attention",
                            m2f.multi_scale_deformable_attention)
    swapped = copy.deepcopy(own)
    assert swap_msda(swapped) == sites
    inputs = {"pixel_values": torch.randn(2, 3, h, w)}
    inputs.update(extra("cpu") if extra else {})
    found = []
    for model in (own, swapped):
        attentions = _attention_outputs(model(**inputs, output_attentions=True))
        for a in attentions.values():
            if a.requires_grad:
                a.retain_grad()
        loss = sum((a.double() * torch.linspace(0, 1, a.numel()).view(a.shape)).sum()
                   for a in attentions.values() if a.requires_grad)
        if torch.is_tensor(loss):
            loss.backward()
        found.append(attentions)
    assert found[0].keys() == found[1].keys() and found[0], name
    for key, theirs in found[0].items():
        ours = found[1][key]
        assert ours.requires_grad == theirs.requires_grad, key
        assert rel_err(ours, theirs.detach().double()) <= 1e-5, key
        if theirs.requires_grad:
            assert ours.grad is not None, key
    for (na, pa), (nb, pb) in zip(swapped.named_parameters(), own.named_parameters()):
        assert na == nb and (pa.grad is None) == (pb.grad is None), na
        if pb.grad is not None and pb.grad.norm() > 0:
            assert rel_err(pa.grad, pb.grad.double()) <= 1e-4, na


@pytest.mark.parametrize("name", list(HF_MODELS))
def test_transformers_swapped_model_pickles(name, monkeypatch, tmp_path):
    """A swapped model survives whole-model torch.save / torch.load,
    copy.deepcopy and the pickling multiprocessing does, and the copies
    compute what it computes."""
    import copy
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from ms_deform_attn.hf import swap_msda

    factory, (h, w), extra, output, sites = HF_MODELS[name]
    model = factory("cpu")
    try:
        pickle.dumps(model)
    except (AttributeError, pickle.PicklingError) as e:
        pytest.skip(f"transformers' own {name} model does not pickle: {e}")
    if name == "mask2former":
        from transformers.models.mask2former import modeling_mask2former as m2f
        monkeypatch.setattr(m2f, "multi_scale_deformable_attention",
                            m2f.multi_scale_deformable_attention)
    assert swap_msda(model) == sites
    # Copied before the first forward: transformers' own models do not pickle
    # after one (its output-capturing hooks are local functions).
    torch.save(model, tmp_path / "model.pt")
    copies = [torch.load(tmp_path / "model.pt", weights_only=False), copy.deepcopy(model),
              pickle.loads(bytes(ForkingPickler.dumps(model)))]
    inputs = {"pixel_values": torch.randn(2, 3, h, w)}
    inputs.update(extra("cpu") if extra else {})
    with torch.no_grad():
        expected = getattr(model(**inputs), output)
    for other in copies:
        fused = [m for m in other.modules() if hasattr(m, "_msda_backend")]
        # The copies' fused layers run their own parameters, not the original's.
        assert all(m.forward.args[0] is m for m in fused)
        with torch.no_grad():
            assert torch.equal(getattr(other(**inputs), output), expected)
