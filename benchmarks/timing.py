"""Timers and the implementations under test (ours, the reference, the peers of peers.py)."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, NamedTuple, Sequence, Tuple

import torch

import ms_deform_attn as msda
from ms_deform_attn.reference import ms_deform_attn_pytorch

from .peers import PEERS

Inputs = Sequence[torch.Tensor]  # value, spatial_shapes, level_start_index, locations, weights


# ---- implementations --------------------------------------------------------------
def _ours(backend: str, deterministic: bool = False):
    def fn(value, shapes, start, loc, attn, spatial_shapes_list=None):
        return msda.ms_deform_attn(value, shapes, start, loc, attn, backend=backend,
                                   deterministic=deterministic,
                                   spatial_shapes_list=spatial_shapes_list)
    fn.takes_host_shapes = True  # the benchmark hands it the workload's level shapes
    return fn


def our_backends(device: str) -> List[str]:
    """Our backends with kernels on `device` ("pytorch", the reference, is
    benchmarked as "reference")."""
    return [b for b in msda.available_backends(device) if b != "pytorch"]


# Our "auto" forward with the deterministic backward (sort and gather).
DETERMINISTIC = "deterministic"


def _reference(value, shapes, start, loc, attn):
    return ms_deform_attn_pytorch(value, shapes, start, loc, attn)


def implementations(device: str, names: Sequence[str]) -> Tuple[Dict[str, Callable], List[str]]:
    """name -> callable for every requested implementation that can run here,
    plus notes on the ones skipped. Names: our backends, "reference", peers."""
    impls: Dict[str, Callable] = {}
    notes: List[str] = []
    ours = our_backends(device)
    for name in names:
        if name in ours:
            impls[name] = _ours(name)
        elif name == DETERMINISTIC:
            impls[name] = _ours("auto", deterministic=True)
        elif name == "reference":
            impls[name] = _reference
        elif name in PEERS:
            try:
                impls[name] = PEERS[name].make()
            except Exception as exc:  # not installed / not built for this device
                notes.append(f"peer {name!r} skipped: {type(exc).__name__}: {exc}")
        else:
            notes.append(f"{name!r} skipped: not available on {device}")
    return impls, notes


class Timing(NamedTuple):
    """A measurement: the median and the interquartile range of one step, in
    microseconds, how it was timed, and over how many repetitions."""
    median_us: float
    iqr_us: float
    method: str
    reps: int


def _timing(times: List[float], method: str) -> Timing:
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return Timing(statistics.median(times), q[2] - q[0], method, len(times))


# ---- timing -----------------------------------------------------------------------
def repetitions(one_ms: float, target_ms: float, min_reps: int, max_reps: int) -> int:
    """Repetitions of a step that took one_ms once: as many as fit target_ms,
    at least min_reps, at most max_reps; but a step so slow that min_reps of
    it would pass four times the target (the reference, the original op on
    the large workloads) takes three, enough for a median and a spread."""
    fit = min(max_reps, int(target_ms / one_ms))
    floor = min_reps if one_ms * min_reps <= 4 * target_ms else 3
    return max(floor, fit)


def _sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_cuda(step: Callable[[int], object], n_sets: int, use_graph: bool,
              target_ms: float = 300.0, min_reps: int = 10) -> Timing:
    """Time of one step on the GPU (median and spread, microseconds).

    step(i) runs the work on input set i (rotating sets keep small inputs from
    being served by L2). With use_graph, one CUDA graph holds one step per set
    and its replays are timed (no launch gaps: GPU time); otherwise eager steps
    are timed between CUDA events (launch overhead included where the GPU
    outruns the host: the reference reads shapes on the host and cannot be
    captured)."""
    if use_graph:
        # Warm-up on the capture's stream (allocator, module load, and the
        # autograd nodes of leaves, which remember the stream they were made
        # on: made on another stream they break the capture).
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            for i in range(n_sets):
                step(i)
            stream.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for i in range(n_sets):
                    step(i)
        torch.cuda.synchronize()
        run, method = graph.replay, "cuda-graph"
    else:
        for i in range(n_sets):  # warm-up (allocator, module load)
            step(i)
        torch.cuda.synchronize()

        def run():
            for i in range(n_sets):
                step(i)
        method = "events"

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    reps = repetitions(max(start.elapsed_time(end), 1e-3), target_ms, min_reps, 2000)
    times = []
    for _ in range(reps):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n_sets)
    return _timing(times, method)


def time_cpu(step: Callable[[int], object], n_sets: int, target_s: float = 1.0) -> Timing:
    """Wall-clock time of one step on the CPU (median and spread, microseconds)."""
    step(0)
    t0 = time.perf_counter()
    step(0)
    one = time.perf_counter() - t0
    reps = repetitions(max(one, 1e-6) * 1e3, target_s * 1e3, 3, 50)
    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        step(r % n_sets)
        times.append((time.perf_counter() - t0) * 1e6)
    return _timing(times, "wall")


def time_torch_benchmark(step: Callable[[int], object], label: str, sub_label: str,
                         description: str, min_run_time: float):
    """One step timed the way users time this operator: torch.utils.benchmark's
    Timer.blocked_autorange (eager calls, synchronised on CUDA, launch
    overhead included). Returns its Measurement (median and IQR in seconds),
    which benchmark.Compare tabulates."""
    from torch.utils import benchmark

    step(0)  # warm-up (allocator, module load)
    timer = benchmark.Timer(stmt="step(0)", globals={"step": step}, label=label,
                            sub_label=sub_label, description=description,
                            num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time)


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus written."""
    if not device.startswith("cuda"):
        nbytes = 1 << 27
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    if device.startswith("cuda"):
        t = time_cuda(lambda i: dst.copy_(src), 1, use_graph=False, target_ms=200).median_us
    else:
        t = time_cpu(lambda i: dst.copy_(src), 1, target_s=0.5).median_us
    return 2 * nbytes / (t * 1e-6)
