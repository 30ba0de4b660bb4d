"""`tma` backend specifics: it needs the level shapes on the host; staged
boxes of every size (none, a few pixels, the default) give the reference's
result, with sampling footprints that straddle the box edge, the level edge
and lie far outside; host shapes that disagree with the device tensors fall
back to global reads; descriptors cached per tensor stay right when tensors
change."""
import pytest
import torch

import ms_deform_attn as msda
from helpers import TOL, budget_error, make_inputs, reference64, rel_err, run
from ms_deform_attn import testing as workloads

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or "tma" not in msda.available_backends("cuda"),
    reason="needs a CUDA device with the tma backend (sm_90+)")

SHAPES = [(20, 30), (10, 15), (5, 8), (3, 4)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_explicit_request_without_host_shapes_says_how():
    inputs = make_inputs(1, 10, 2, 32, SHAPES, 2, torch.bfloat16, torch.float32, device="cuda")
    with pytest.raises(RuntimeError, match=r"backend 'tma' cannot run these inputs: needs the "
                                           r"level shapes on the host.*spatial_shapes_list="):
        msda.ms_deform_attn(*inputs, backend="tma")
    # "auto" runs without them (another backend).
    assert msda.select_backend(*inputs) != "tma"
    assert rel_err(msda.ms_deform_attn(*inputs), reference64(*inputs)) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype,d,why", [
    (torch.float64, 32, "float64"),
    (torch.bfloat16, 12, r"multiple of 16 bytes.*D = 12 \(24 bytes\)"),
    (torch.float32, 256, r"at most 512, got D = 256 \(1024 bytes\)"),
])
def test_predicate_names_what_it_cannot_run(dtype, d, why):
    inputs = make_inputs(1, 4, 1, d, [(3, 3)], 1, dtype, device="cuda")
    assert msda.backend_reason("tma", *inputs, spatial_shapes_list=[(3, 3)]) != ""
    with pytest.raises(RuntimeError, match="backend 'tma' cannot run these inputs: .*" + why):
        msda.ms_deform_attn(*inputs, backend="tma", spatial_shapes_list=[(3, 3)])


def encoder_inputs(dtype, scale=4, seed=0, wide=1.0):
    """ddetr_enc scaled down: consecutive queries are neighbouring pixels,
    samples a few pixels around them (what the boxes are made for); `wide`
    stretches the offsets so that footprints leave the boxes."""
    wl = workloads.get(f"ddetr_enc/{scale}")
    inputs = workloads.make_inputs(wl, dtype, torch.float32, device="cuda", seed=seed)
    ref = workloads.encoder_reference_points(wl.levels, "cuda")[None, :, None, None, None, :]
    inputs[3] = (ref + (inputs[3].double() - ref) * wide).float()
    return wl, inputs


@pytest.mark.parametrize("budget", ["0", "512", "4096", "30000", "-1"],
                         ids=["none", "two-pixels", "small", "medium", "default"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("wide", [1.0, 6.0], ids=["encoder", "wide"])
def test_box_sizes(monkeypatch, budget, dtype, wide):
    """Every box size, from none to the default: corners inside the box read
    shared memory, the others global memory, with the same result."""
    wl, inputs = encoder_inputs(dtype, wide=wide)
    monkeypatch.setenv("MS_DEFORM_ATTN_SMEM_BUDGET", budget)
    out = msda.ms_deform_attn(*inputs, backend="tma", spatial_shapes_list=wl.levels)
    assert rel_err(out, reference64(*inputs)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16", "float16"])
def test_level_edges_and_far_outside(monkeypatch, dtype):
    """Locations on and just past every level edge, and far outside (some
    queries' footprints miss the map entirely), with small boxes that the
    clamp pins to the level edges."""
    inputs = list(make_inputs(2, 300, 4, 32, SHAPES, 4, dtype, torch.float32, device="cuda",
                              seed=3))
    loc = inputs[3]
    g = torch.Generator(device="cuda").manual_seed(4)
    edges = torch.tensor([0.0, 1.0, -0.02, 1.02, -3.0, 7.0, 0.001, 0.999], device="cuda")
    pick = edges[torch.randint(0, len(edges), loc.shape, device="cuda", generator=g)]
    mask = torch.rand(loc.shape, device="cuda", generator=g) < 0.4
    inputs[3] = torch.where(mask, pick, loc)
    inputs[3][:, :20] = 5.0  # whole queries (and a whole first warp) outside
    for budget in ["1024", "-1"]:
        assert budget_error(monkeypatch, "tma", budget, inputs) <= TOL[dtype]


def test_host_shapes_that_disagree_fall_back_to_global_reads():
    """A list with the right total but another level split: the levels where
    it disagrees with spatial_shapes (on the device, unchecked without a
    sync) are not staged; the result follows spatial_shapes, as for every
    backend."""
    inputs = make_inputs(2, 64, 4, 32, [(4, 6), (2, 3)], 4, torch.float32, device="cuda")
    out = msda.ms_deform_attn(*inputs, backend="tma", spatial_shapes_list=[(6, 4), (2, 3)])
    assert rel_err(out, reference64(*inputs)) <= TOL[torch.float32]


def test_descriptor_cache_follows_the_tensor():
    """Same shapes, other value tensors (other addresses), alternating: each
    call reads its own tensor."""
    a = make_inputs(2, 50, 8, 32, SHAPES, 4, torch.bfloat16, torch.float32, device="cuda", seed=1)
    b = make_inputs(2, 50, 8, 32, SHAPES, 4, torch.bfloat16, torch.float32, device="cuda", seed=2)
    for inputs in (a, b, a, b):
        out = run(*inputs, "tma")
        assert rel_err(out, reference64(*inputs)) <= TOL[torch.bfloat16]
    # A view that starts off a 16-byte boundary is copied, not misread.
    buf = torch.empty(a[0].numel() + 1, device="cuda", dtype=torch.bfloat16)
    value = buf[1:].view_as(a[0])
    value.copy_(a[0])
    out = run(value, *a[1:], "tma")
    assert rel_err(out, reference64(*a)) <= TOL[torch.bfloat16]


def test_many_tiles_and_pairs():
    """Thousands of blocks (the grid is one per query tile and (batch, head))."""
    inputs = make_inputs(3, 20000, 8, 32, SHAPES, 4, torch.bfloat16, torch.float32,
                         device="cuda")
    out = run(*inputs, "tma")
    assert rel_err(out, reference64(*inputs)) <= TOL[torch.bfloat16]
