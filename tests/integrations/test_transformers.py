"""Hugging Face transformers: the function replacement, swap_msda on every
model family (outputs, gradients, returned attentions, pickling) and the
`kernels` mapping."""
import pytest
import torch

from helpers import MODULE_LEVELS, device_backends, make_inputs, rel_err, tiny_deformable_detr, tiny_rt_detr


@pytest.mark.parametrize("device,backend", device_backends())
def test_transformers_function_replacement(device, backend):
    pytest.importorskip("transformers")
    from transformers.models.mask2former import modeling_mask2former

    from ms_deform_attn.hf import multi_scale_deformable_attention

    value, shapes, start, loc, attn = make_inputs(2, 13, 4, 16, MODULE_LEVELS, 3, torch.float32,
                                                  device=device)
    expected = modeling_mask2former.multi_scale_deformable_attention(value, MODULE_LEVELS, loc, attn)
    out = multi_scale_deformable_attention(value, MODULE_LEVELS, loc, attn)
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


def test_fused_layer_attention_weights_only_when_wanted():
    """swap_msda's fused layers make the attention weights they return only
    when the caller will use them: output_attentions (transformers 4.x), an
    active attentions collector (5.x); None where that is not known."""
    pytest.importorskip("transformers")
    from ms_deform_attn.hf import _attention_weights_wanted

    assert _attention_weights_wanted({"output_attentions": True}) is True
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        assert _attention_weights_wanted({"output_attentions": False}) is False
        assert _attention_weights_wanted({}) is None  # not known: made beside the fused output
        return
    assert _attention_weights_wanted({}) is False
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


def _own_and_swapped(name, monkeypatch):
    """transformers' own small model of `name`, a swapped copy, inputs and the
    output's name (Mask2Former's module-level function restored after)."""
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
    return own, swapped, inputs, output


@pytest.mark.parametrize("name", list(HF_MODELS))
def test_transformers_swap_attentions_carry_gradients(name, monkeypatch):
    """The attention weights a swapped model returns (output_attentions)
    are in the graph exactly where transformers' own are: retain_grad works
    on them and a loss on them gives transformers' own parameter gradients."""
    own, swapped, inputs, output = _own_and_swapped(name, monkeypatch)
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
def test_transformers_swap_retains_grad_of_attentions_from_the_output(name, monkeypatch):
    """What transformers' own test_retain_grad_hidden_states_attentions does,
    on the swapped model: the attention weights returned under
    output_attentions are the ones the output was computed from, so a
    backward from one output element reaches every one of them that
    transformers' own model reaches."""
    own, swapped, inputs, output = _own_and_swapped(name, monkeypatch)
    reached = []
    for model in (own, swapped):
        res = model(**inputs, output_attentions=True, output_hidden_states=True)
        attentions = _attention_outputs(res)
        for a in attentions.values():
            if a.requires_grad:
                a.retain_grad()
        res[output].flatten()[0].backward()
        reached.append({k for k, a in attentions.items() if a.grad is not None})
    # (Mask2Former's pixel-decoder output is computed from none of them.)
    assert reached[0] or name == "mask2former", name
    assert reached[1] == reached[0], name


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
