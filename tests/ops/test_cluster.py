"""`cluster` backend specifics (sm_90+): the value map of a (batch, head) is
spread over the shared memory of a cluster's blocks, pixel s in block s mod C,
so neighbouring corners of a sample live in different blocks; levels that do
not fit are read from global memory; the grid has one cluster per (batch,
head), many more than the GPU holds at once.

MS_DEFORM_ATTN_SMEM_BUDGET sets the bytes of one block's part; the cluster
size is the smallest power of two whose parts hold the whole map (at most 8,
or 16 where the device allows), so a small budget forces large clusters."""
import pytest
import torch

import ms_deform_attn as msda
from helpers import DTYPES, TOL, budget_error, make_inputs

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or "cluster" not in msda.available_backends("cuda"),
    reason="needs a CUDA device of compute capability 9.0+ (the cluster backend)")

# 1200 + 300 + 80 + 20 = 1600 pixels.
SHAPES = [(30, 40), (15, 20), (8, 10), (4, 5)]


def run(budget, n, lq, m, d, shapes, dtype, monkeypatch, p=4):
    inputs = make_inputs(n, lq, m, d, shapes, p, dtype, torch.float32, device="cuda")
    return budget_error(monkeypatch, "cluster", budget, inputs)


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(t).split(".")[1] for t in DTYPES])
@pytest.mark.parametrize("budget_px", [0, 5, 60, 110, 250, -1],
                         ids=["none", "tiny", "small-levels", "three-levels", "all-split", "default"])
def test_budgets(monkeypatch, dtype, budget_px):
    # Budget in pixels of one block's part (converted to bytes below):
    #   0: nothing cached (one-block clusters, every read global);
    #   5, 60, 110: clusters of the largest size the device allows (8 or 16
    #     blocks), holding only the smallest levels; the others read global;
    #   250: 8 blocks x 250 >= 1600 pixels: the whole map, split over 8 blocks;
    #   -1: the default (the device's shared memory): one block holds it all.
    d = 32
    row = d * torch.tensor([], dtype=dtype).element_size()
    budget = budget_px * row if budget_px >= 0 else -1
    assert run(budget, 2, 500, 4, d, SHAPES, dtype, monkeypatch) <= TOL[dtype]


@pytest.mark.parametrize("d", [8, 30, 64])
def test_odd_channels(monkeypatch, d):
    # D = 30 has no vector path (D % VEC != 0): element-wise copies and reads.
    assert run(64 * d * 2, 1, 300, 2, d, SHAPES, torch.bfloat16, monkeypatch) <= TOL[torch.bfloat16]


def test_many_more_clusters_than_resident(monkeypatch):
    # 8 x 32 = 256 (batch, head) pairs, each a cluster of 16 (or 8) blocks of
    # one SM each: thousands of blocks, queued far beyond what is resident.
    # Must finish (no hang) and be right.
    err = run(100 * 32 * 2, 8, 200, 32, 32, SHAPES, torch.bfloat16, monkeypatch)
    assert err <= TOL[torch.bfloat16]


def test_repeatable_and_graph_capturable(monkeypatch):
    monkeypatch.setenv("MS_DEFORM_ATTN_SMEM_BUDGET", str(100 * 32 * 2))
    inputs = make_inputs(2, 700, 4, 32, SHAPES, 4, torch.bfloat16, torch.float32, device="cuda")
    first = msda.ms_deform_attn(*inputs, backend="cluster")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        msda.ms_deform_attn(*inputs, backend="cluster")  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = msda.ms_deform_attn(*inputs, backend="cluster")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(first, captured)


def test_not_chosen_by_auto():
    # Not measured faster than baseline yet (BENCHMARKS.md): auto leaves it alone.
    inputs = make_inputs(1, 500, 8, 32, SHAPES, 4, torch.bfloat16, torch.float32, device="cuda")
    assert msda.select_backend(*inputs) != "cluster"
