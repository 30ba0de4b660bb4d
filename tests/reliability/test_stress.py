"""A short run of the stress loop (tests/reliability/stress.py): random-shape calls,
CUDA-graph replays in between, memory back to its starting level."""
import pytest
import torch

from stress import stress


def test_stress_cpu():
    stats = stress(60, "cpu", seed=1, log=lambda *_: None)
    assert stats["reference_checks"] >= 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_stress_cuda():
    stats = stress(300, "cuda", seed=2, log=lambda *_: None)
    assert stats["graph_replays"] > 0
