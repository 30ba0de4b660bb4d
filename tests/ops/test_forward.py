"""Forward against the float64 reference, on every device and backend."""
import pytest
import torch

import ms_deform_attn as msda
from helpers import (DTYPES, TOL, bits, device_backends, head_major, make_inputs, poisoned, reference64,
                     reference_gather, rel_err, run)

# (N, Lq, M, D, level shapes, P): covers L 1..5 with non-square levels, P 1..8,
# D in {8, 16, 30, 32, 64, 128}, M in {1, 8}, N in {1, 3}.
CASES = [
    (1, 7, 1, 8, [(5, 9)], 1),
    (3, 33, 8, 16, [(8, 6), (4, 3)], 2),
    (1, 50, 8, 30, [(11, 7), (6, 4), (3, 2)], 3),
    (3, 41, 1, 32, [(12, 17), (6, 9), (3, 5), (2, 3)], 4),
    (1, 19, 8, 64, [(9, 13), (5, 7), (3, 4), (2, 2), (1, 1)], 5),
    (3, 13, 8, 128, [(7, 5), (4, 3)], 8),
    (1, 64, 8, 32, [(16, 20), (8, 10), (4, 5), (2, 3)], 4),
    (3, 9, 1, 30, [(3, 17), (17, 3)], 7),
]


@pytest.mark.parametrize("device,backend", device_backends(reference=True))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("loc_fp32", [False, True], ids=["loc_same", "loc_fp32"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_forward_matches_reference(device, backend, dtype, loc_fp32, case):
    n, lq, m, d, shapes, p = CASES[case]
    loc_dtype = torch.float32 if loc_fp32 else dtype
    inputs = make_inputs(n, lq, m, d, shapes, p, dtype, loc_dtype, device=device)
    out = run(*inputs, backend)
    assert out.shape == (n, lq, m * d)
    assert out.dtype == dtype
    assert rel_err(out, reference64(*inputs)) <= TOL[dtype]


@pytest.mark.parametrize("device,backend", device_backends(reference=True))
def test_mixed_location_and_weight_dtypes(device, backend):
    value, shapes, start, loc, attn = make_inputs(2, 17, 8, 32, [(6, 5), (3, 3)], 4,
                                                  torch.bfloat16, device=device)
    out = run(value, shapes, start, loc.float(), attn, backend)  # bf16 weights, fp32 locations
    assert rel_err(out, reference64(value, shapes, start, loc, attn)) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_non_contiguous_inputs(device, backend, dtype, monkeypatch):
    value, shapes, start, loc, attn = make_inputs(2, 21, 4, 32, [(7, 9), (4, 5)], 3, dtype,
                                                  torch.float32, device=device)
    expected = run(value, shapes, start, loc, attn, backend)
    # Same data behind permuted / sliced strides.
    value_nc = value.transpose(0, 1).contiguous().transpose(0, 1)
    loc_nc = torch.stack([loc[..., 0], loc[..., 1]], dim=0).movedim(0, -1)
    attn_nc = attn.transpose(1, 2).contiguous().transpose(1, 2)
    shapes_nc = shapes.t().contiguous().t()
    assert not (value_nc.is_contiguous() or loc_nc.is_contiguous() or attn_nc.is_contiguous())
    out = run(value_nc, shapes_nc, start, loc_nc, attn_nc, backend)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # A misaligned storage offset (value starts one element into a buffer):
    # one-element vectors, which blocked gathers with its shared set-up
    # (slots) only; the aligned value is gathered with it too here (its
    # per-lane set-up's split rows add their parts in another order).
    monkeypatch.setenv("MS_DEFORM_ATTN_BLOCKED_ROWS", "shared")
    expected = run(value, shapes, start, loc, attn, backend)
    buf = torch.empty(value.numel() + 1, dtype=dtype, device=device)
    buf[1:] = value.flatten()
    out = run(buf[1:].view_as(value), shapes, start, loc, attn, backend)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_head_major_value(device, backend, dtype, case):
    """value head-major ((N, M, S, D) storage seen as (N, S, M, D)) is read
    in place and gives the contiguous value's output, bit for bit."""
    n, lq, m, d, shapes, p = CASES[case]
    value, shapes_t, start, loc, attn = make_inputs(n, lq, m, d, shapes, p, dtype, torch.float32,
                                                    device=device, seed=case)
    expected = run(value, shapes_t, start, loc, attn, backend)
    out = run(head_major(value), shapes_t, start, loc, attn, backend)
    assert torch.equal(bits(out), bits(expected))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_head_major_value_is_not_copied():
    """No copy of a head-major value: the forward's peak allocation stays
    well under value's size (a contiguous copy would add all of it)."""
    value, shapes, start, loc, attn = make_inputs(1, 16, 8, 256, [(128, 128)], 1, torch.float32,
                                                  device="cuda", seed=0)
    value = head_major(value)  # 128 MiB
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = msda.ms_deform_attn(value, shapes, start, loc, attn)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < value.numel() * value.element_size() // 4
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("device,backend", device_backends(reference=True))
@pytest.mark.parametrize("n,lq", [(0, 5), (2, 0), (0, 0)])
def test_empty(device, backend, n, lq):
    value, shapes, start, loc, attn = make_inputs(max(n, 1), max(lq, 1), 2, 8, [(3, 4)], 2,
                                                  torch.float32, device=device)
    value, loc, attn = value[:n], loc[:n, :lq], attn[:n, :lq]
    out = run(value, shapes, start, loc, attn, backend)
    assert out.shape == (n, lq, 16)


@pytest.mark.parametrize("device,backend", device_backends())
def test_non_finite_samples_make_their_rows_nan(device, backend):
    """A NaN or infinite location or weight makes its (query, head) row NaN,
    as in the grid_sample reference (a diverging model fails loudly); huge
    finite locations sample nothing; every other row is exact."""
    value, shapes, start, loc, attn = make_inputs(2, 30, 8, 32, [(9, 7), (5, 4)], 4,
                                                  torch.float32, device=device)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30],
                            device=device)
    idx = torch.randint(0, specials.numel(), loc.shape, device=device)
    loc = torch.where(torch.rand(loc.shape, device=device) < 0.02, specials[idx], loc)
    idx = torch.randint(0, 3, attn.shape, device=device)
    attn = torch.where(torch.rand(attn.shape, device=device) < 0.01, specials[idx], attn)
    out = run(value, shapes, start, loc, attn, backend)
    rows = poisoned(loc, attn).flatten(3).any(-1)
    assert 0 < rows.sum() < rows.numel()
    assert torch.isnan(out.view(2, 30, 8, 32)[rows]).all()
    assert torch.isfinite(out.view(2, 30, 8, 32)[~rows]).all()
    assert rel_err(out, reference64(value, shapes, start, loc, attn)) <= TOL[torch.float32]


@pytest.mark.parametrize("device,backend", device_backends(reference=True))
def test_samples_outside_the_map_read_nothing(device, backend):
    """A sample whose footprint misses the map adds nothing, whatever the
    values: with every value NaN and every location outside, the output is
    exactly zero, as in the reference (kernels may load a clamped pixel for
    such a sample, but must not add it)."""
    value, shapes, start, loc, attn = make_inputs(2, 37, 8, 32, [(9, 7), (5, 4), (1, 1)], 4,
                                                  torch.float32, device=device)
    value = torch.full_like(value, float("nan"))
    far = torch.tensor([-3.0, 4.0], device=device)
    loc = far[torch.randint(0, 2, loc.shape, device=device)]
    out = run(value, shapes, start, loc, attn, backend)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(reference64(value, shapes, start, loc, attn), torch.zeros_like(out, dtype=torch.float64))


@pytest.mark.parametrize("device,backend", device_backends())
def test_locations_on_pixel_borders_and_corners(device, backend):
    shapes = [(6, 8), (3, 4)]
    value, shapes_t, start, _, attn = make_inputs(1, 40, 2, 16, shapes, 2, torch.float64,
                                                  device=device)
    # Normalised coordinates of pixel centres, pixel edges and the map border.
    ticks = torch.tensor([0.0, 1 / 16, 1 / 8, 0.25, 0.5, 1 - 1 / 16, 1.0, -1 / 16, 1 + 1 / 16],
                         dtype=torch.float64)
    loc = ticks[torch.randint(0, len(ticks), (1, 40, 2, 2, 2, 2))].to(device)
    out = run(value, shapes_t, start, loc, attn, backend)
    assert rel_err(out, reference64(value, shapes_t, start, loc, attn)) <= TOL[torch.float64]


def test_available_backends():
    assert msda.available_backends("cpu") == ["cpu", "pytorch"]
    if not torch.cuda.is_available():
        assert msda.available_backends("cuda") == []
    else:
        assert "baseline" in msda.available_backends("cuda")
        assert msda.available_backends("cuda")[-1] == "pytorch"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_pytorch_backend_is_the_reference(dtype):
    """backend="pytorch", listed by available_backends, runs the grid_sample
    reference; backend_reason accepts it on every device."""
    value, shapes_t, start, loc, attn = make_inputs(2, 7, 2, 8, [(5, 6), (3, 2)], 3, dtype)
    out = msda.ms_deform_attn(value, shapes_t, start, loc, attn, backend="pytorch")
    torch.testing.assert_close(out, reference64(value, shapes_t, start, loc, attn).to(dtype))
    assert msda.backend_reason("pytorch", value, shapes_t, start, loc, attn) == ""


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_gather_reference_matches_grid_sample_reference(dtype):
    """The second reference (corner gathers, used for huge tensors) agrees
    with the grid_sample one."""
    value, shapes, start, loc, attn = make_inputs(2, 9, 3, 5, [(4, 6), (3, 2)], 3, dtype,
                                                  outside=0.3)
    ref = reference64(value, shapes, start, loc, attn)
    assert rel_err(reference_gather(value, shapes, start, loc, attn), ref) < 1e-12
