"""`blocked` backend specifics: blocks of consecutive queries of one (batch,
head), sized down for small problems, with groups past the last query that
only stand in; rounds of points across levels; both set-ups of a row's
samples (shared through slots, or per lane with the row split over several
groups; MS_DEFORM_ATTN_BLOCKED_ROWS forces one); one level without the
level table; the fused operator's points formed in it; where auto takes it."""
import pytest
import torch

import ms_deform_attn as msda
from helpers import TOL, make_inputs, reference64, rel_err

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or "blocked" not in msda.available_backends("cuda"),
    reason="needs a CUDA device with the blocked backend")

SHAPES = [(20, 30), (10, 15), (5, 8), (1, 1)]
ROWS = ["auto", "shared", "lane"]


@pytest.fixture(params=ROWS)
def rows(request, monkeypatch):
    monkeypatch.setenv("MS_DEFORM_ATTN_BLOCKED_ROWS", request.param)
    return request.param


# Lq from a single query to several blocks with a partial last one; D from 16
# (2 or 4 lanes) to 512 (32 lanes; two channel passes in 16 bits, four in
# fp32, each starting its row's points again): every block size the
# launcher picks (64 to 256 threads).
@pytest.mark.parametrize("lq", [1, 3, 63, 65, 300, 2049])
@pytest.mark.parametrize("d", [16, 32, 64, 128, 256, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
def test_query_runs_and_channels(lq, d, dtype, rows):
    inputs = make_inputs(2, lq, 3, d, SHAPES, 4, dtype, torch.float32, device="cuda")
    out = msda.ms_deform_attn(*inputs, backend="blocked")
    assert rel_err(out, reference64(*inputs)) <= TOL[dtype]


@pytest.mark.parametrize("p", [1, 3, 8, 13])
def test_rounds_across_levels(p, rows):
    # L P not a multiple of the group's lanes (8 in fp32) nor of a lane's
    # chunk: rounds and chunks that span levels, partial last ones, and
    # parts of a split row with no points.
    inputs = make_inputs(1, 77, 8, 32, SHAPES, p, torch.float32, device="cuda")
    out = msda.ms_deform_attn(*inputs, backend="blocked")
    assert rel_err(out, reference64(*inputs)) <= TOL[torch.float32]


@pytest.mark.parametrize("shapes", [SHAPES, SHAPES[:1]], ids=["levels", "one_level"])
def test_matches_baseline_bitwise_in_fp32(shapes, monkeypatch):
    # The same per-sample arithmetic in the same order: only the work's
    # placement differs. (The per-lane set-up adds a split row's parts in
    # another order.)
    monkeypatch.setenv("MS_DEFORM_ATTN_BLOCKED_ROWS", "shared")
    inputs = make_inputs(2, 500, 8, 32, shapes, 4, torch.float32, device="cuda")
    a = msda.ms_deform_attn(*inputs, backend="blocked")
    b = msda.ms_deform_attn(*inputs, backend="baseline")
    assert torch.equal(a, b)


@pytest.mark.parametrize("lq", [1, 65, 2049])
@pytest.mark.parametrize("shape", [(20, 30), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
def test_one_level(lq, shape, dtype, monkeypatch):
    # One level (BEVFormer): the shared slots without the level table.
    monkeypatch.setenv("MS_DEFORM_ATTN_BLOCKED_ROWS", "shared")
    inputs = make_inputs(2, lq, 3, 32, [shape], 4, dtype, torch.float32, device="cuda")
    assert msda.select_forward_plan(*inputs)["one_level"]
    out = msda.ms_deform_attn(*inputs, backend="blocked")
    assert rel_err(out, reference64(*inputs)) <= TOL[dtype]


@pytest.mark.parametrize("shape,start", [((4, 5), 0), ((4, 6), 1), ((0, 6), 0), ((-4, -6), 0),
                                         ((1 << 20, 1 << 20), 0)],
                         ids=["rows", "start", "zero", "negative", "huge"])
def test_one_level_checks_its_level_on_device(shape, start, monkeypatch):
    # The one-level kernel reads and checks its level itself: shapes only on
    # the GPU that do not match value's 24 rows make the whole output NaN.
    monkeypatch.setenv("MS_DEFORM_ATTN_BLOCKED_ROWS", "shared")
    value, _, _, loc, attn = make_inputs(2, 70, 3, 32, [(4, 6)], 4, torch.float32, device="cuda")
    shapes = torch.tensor([shape], device="cuda")
    starts = torch.tensor([start], device="cuda")
    assert msda.select_forward_plan(value, shapes, starts, loc, attn)["one_level"]
    out = msda.ms_deform_attn(value, shapes, starts, loc, attn, backend="blocked")
    assert torch.isnan(out).all()


def test_rows_override_is_checked(monkeypatch):
    monkeypatch.setenv("MS_DEFORM_ATTN_BLOCKED_ROWS", "slots")
    inputs = make_inputs(1, 10, 2, 32, SHAPES, 4, torch.float32, torch.float32, device="cuda")
    with pytest.raises(RuntimeError, match="MS_DEFORM_ATTN_BLOCKED_ROWS must be 'auto', 'shared' "
                       "or 'lane', got 'slots'"):
        msda.ms_deform_attn(*inputs, backend="blocked")


@pytest.mark.parametrize("dtype,m,lq,expected", [
    (torch.float32, 8, 500, "blocked"), (torch.float32, 8, 100, "blocked"),
    (torch.bfloat16, 8, 500, "blocked"), (torch.bfloat16, 8, 100, "blocked"),
    (torch.float16, 8, 500, "blocked"), (torch.float16, 2, 100, "blocked"),
    (torch.float64, 8, 100, "baseline"), (torch.float32, 1, 500, "blocked"),
    (torch.bfloat16, 1, 100, "blocked"), (torch.float16, 1, 100, "blocked")])
def test_auto_choice(dtype, m, lq, expected):
    # BENCHMARKS.md's auto table: blocked wins in fp32, bf16 and fp16, with
    # one head too; fp64 (not measured) keeps baseline.
    inputs = make_inputs(1, lq, m, 32, SHAPES, 4, dtype, torch.float32, device="cuda")
    assert msda.select_backend(*inputs) == expected


def test_fused_forms_points_in_the_kernel():
    n, lq, m, d, p = 2, 90, 8, 32, 4
    L = len(SHAPES)
    shapes = torch.tensor(SHAPES, device="cuda")
    start = torch.cat([shapes.new_zeros(1), shapes.prod(1).cumsum(0)[:-1]])
    value = torch.randn(n, int(shapes.prod(1).sum()), m, d, device="cuda")
    ref = torch.rand(n, lq, L, 2, device="cuda")
    off = torch.randn(n, lq, m, L, p, 2, device="cuda")
    logits = torch.randn(n, lq, m, L * p, device="cuda")
    got = msda.ms_deform_attn_fused(value, shapes, start, ref, off, logits, backend="blocked",
                                    spatial_shapes_list=SHAPES)
    want = msda.ms_deform_attn_fused(value, shapes, start, ref, off, logits, backend="baseline",
                                     spatial_shapes_list=SHAPES)
    assert torch.equal(got, want)
