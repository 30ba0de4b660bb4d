"""`persistent` backend specifics: the shared-memory budget decides which
levels are cached; every split (none, some, all) must give the same result,
and the grid must work through many more tiles than it has blocks."""
import pytest
import torch

import ms_deform_attn as msda
from helpers import TOL, budget_error, make_inputs, reference64, rel_err

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or "persistent" not in msda.available_backends("cuda"),
    reason="needs a CUDA device with the persistent backend")

# bf16, D = 32: 64 bytes a pixel. Levels of 12, 40, 150 and 600 pixels:
# 768 B, 2.5 KB, 9.6 KB, 38 KB.
SHAPES = [(20, 30), (10, 15), (5, 8), (3, 4)]


@pytest.mark.parametrize("budget", ["0", "1000", "4096", "20000", "-1"],
                         ids=["none", "smallest", "two", "three", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["float32", "bfloat16", "float16", "float64"])
def test_cache_budgets(monkeypatch, budget, dtype):
    inputs = make_inputs(2, 777, 8, 32, SHAPES, 4, dtype, torch.float32, device="cuda")
    assert budget_error(monkeypatch, "persistent", budget, inputs) <= TOL[dtype]


@pytest.mark.parametrize("d", [30, 64, 128])
def test_cache_budget_odd_channels(monkeypatch, d):
    inputs = make_inputs(1, 300, 4, d, SHAPES, 3, torch.float32, device="cuda")
    assert budget_error(monkeypatch, "persistent", 20000, inputs) <= TOL[torch.float32]


def test_many_tiles_per_block():
    # 3 * 8 (batch, head) pairs, 30000 queries each: thousands of tiles for a
    # few hundred resident blocks.
    inputs = make_inputs(3, 30000, 8, 32, SHAPES, 4, torch.bfloat16, torch.float32,
                         device="cuda")
    out = msda.ms_deform_attn(*inputs, backend="persistent")
    assert rel_err(out, reference64(*inputs)) <= TOL[torch.bfloat16]


def test_auto_picks_an_available_backend_that_auto_may_pick():
    # persistent is measured slower than baseline and blocked (BENCHMARKS.md): auto leaves it alone.
    enc = make_inputs(1, 5000, 8, 32, SHAPES, 4, torch.bfloat16, torch.float32, device="cuda")
    assert msda.select_backend(*enc) in ("blocked", "baseline")
