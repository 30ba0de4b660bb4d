"""Stress loop: thousands of random-shape calls (every backend, dtype, with
and without backward, fast and deterministic), interleaved with replays of a
captured CUDA graph; checks that the graph's results do not change, that
memory returns to its starting level (no leak), and a sample of calls
against the float64 reference.

    python tests/reliability/stress.py [--iterations 3000] [--device cuda]

tests/test_stress.py runs a short loop; scripts/gpu_check.sh a long one.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]  # helpers.py, and the checkout
import torch  # noqa: E402

import ms_deform_attn as msda  # noqa: E402
from helpers import DTYPES, TOL, kernel_backends, make_inputs, reference64, rel_err  # noqa: E402


def _graph(device):
    """A captured forward + backward on fixed inputs, and its first results.
    The inputs stay referenced by `step` (the graph reads their memory)."""
    inputs = make_inputs(2, 64, 8, 32, [(16, 12), (8, 6), (4, 3)], 4, torch.bfloat16,
                         torch.float32, device=device, seed=7, requires_grad=True)
    value, shapes, start, loc, attn = inputs
    grad = torch.randn(2, 64, 256, device=device, dtype=torch.bfloat16)

    def step():
        out = msda.ms_deform_attn(value, shapes, start, loc, attn, deterministic=True)
        return (out,) + torch.autograd.grad(out, (value, loc, attn), grad)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    graph.replay()
    torch.cuda.synchronize()
    first = [t.clone() for t in static]
    graph.keep_alive = (inputs, grad)
    return graph, static, first


def stress(iterations: int, device: str = "cuda", seed: int = 0, check_every: int = 25,
           log=print) -> dict:
    rng = random.Random(seed)
    backends = kernel_backends(device)
    cuda = device == "cuda"
    graph = static = first = None
    if cuda:
        graph, static, first = _graph(device)
        torch.cuda.synchronize()
    gc.collect()  # what earlier code left to the cycle collector is not ours
    if cuda:
        torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() if cuda else 0
    peak = base
    replays = checked = 0
    t0 = time.time()
    for i in range(iterations):
        levels = [(rng.randint(1, 40), rng.randint(1, 40)) for _ in range(rng.randint(1, 4))]
        dtype = rng.choice(DTYPES)
        loc_dtype = torch.float32 if dtype != torch.float64 and rng.random() < 0.5 else dtype
        backend = rng.choice(backends)
        backward = rng.random() < 0.5
        inputs = make_inputs(rng.randint(1, 3), rng.randint(1, 300), rng.randint(1, 8),
                             rng.choice([8, 16, 30, 32, 64]), levels, rng.randint(1, 4), dtype,
                             loc_dtype, device=device, outside=rng.choice([0.0, 0.15, 0.5]),
                             seed=rng.randrange(2**31), requires_grad=backward)
        if msda.backend_reason(backend, *inputs, spatial_shapes_list=levels):
            backend = "auto"  # e.g. tma with float64 values
        out = msda.ms_deform_attn(*inputs, backend=backend, deterministic=rng.random() < 0.5,
                                  spatial_shapes_list=levels)
        if backward:
            torch.autograd.grad(out, (inputs[0], inputs[3], inputs[4]), torch.ones_like(out))
        if i % check_every == 0:
            err = rel_err(out, reference64(*inputs))
            assert err <= TOL[dtype], f"iteration {i}: rel. error {err:.1e} ({dtype}, {backend})"
            checked += 1
        del inputs, out
        if cuda and i % 7 == 0:
            graph.replay()
            replays += 1
        if cuda and i % 100 == 99:
            gc.collect()  # Python reference cycles are not leaks of ours
            torch.cuda.synchronize()
            for a, b in zip(static, first):
                assert torch.equal(a, b), f"iteration {i}: graph replay changed its result"
            mem = torch.cuda.memory_allocated()
            peak = max(peak, torch.cuda.max_memory_allocated())
            assert mem == base, f"iteration {i}: {mem - base} bytes still allocated"
    if cuda:
        gc.collect()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == base
    stats = dict(iterations=iterations, graph_replays=replays, reference_checks=checked,
                 memory_base_bytes=base, memory_peak_bytes=peak, seconds=round(time.time() - t0, 1))
    log(f"stress: {stats}")
    return stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=3000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    stress(args.iterations, args.device, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
