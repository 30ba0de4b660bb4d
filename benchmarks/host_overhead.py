"""Host time of one small eager call: what a training loop pays per call
before the GPU's work (ddetr_dec by default, the smallest canonical
workload). Per call, the median (and the fastest) of --repeats runs of --calls
back-to-back calls:
`forward` (no autograd), `forward+grad` (inputs requiring grad: the autograd
node too), `fwd+bwd` (and the backward). `--workload tiny`: one query, head, level
and point (the call's fixed cost alone, also on the CPU). On CUDA the GPU's work per call is
smaller than the host's, so the loop's wall clock is host time; the last
sync is inside the timed region (a few microseconds over thousands of
calls).

    python -m benchmarks.host_overhead [--workload ddetr_dec] [--dtype bf16] [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Tuple

import torch

import ms_deform_attn as msda
from ms_deform_attn import testing as W

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def per_call_us(fn, calls: int, repeats: int, sync) -> Tuple[float, float]:
    """Median and fastest of the repeats, us a call (the fastest is the
    steadier figure where other work shares the host)."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times), min(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="ddetr_dec")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=None,
                    help="calls a repeat (default: 2000 on CUDA, 100 on the CPU)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)

    wl = (W.Workload("tiny", 1, ((4, 4),), 1, 1, 1, "decoder", d=8) if args.workload == "tiny"
          else W.get(args.workload))
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    calls = args.calls or (2000 if cuda else 100)
    dtype = DTYPES[args.dtype]
    plain = W.make_inputs(wl, dtype, device=args.device)
    graded = W.make_inputs(wl, dtype, device=args.device, requires_grad=True)
    levels = [x for hw in wl.levels for x in hw]
    grad = torch.randn(wl.n, wl.queries, wl.m * wl.d, device=args.device, dtype=dtype)

    def forward():
        msda.ms_deform_attn(*plain, spatial_shapes_list=levels)

    def forward_grad():
        msda.ms_deform_attn(*graded, spatial_shapes_list=levels)

    def fwd_bwd():
        msda.ms_deform_attn(*graded, spatial_shapes_list=levels).backward(grad)

    with torch.inference_mode():
        rows = {"forward": per_call_us(forward, calls, args.repeats, sync)}
    rows["forward+grad"] = per_call_us(forward_grad, calls, args.repeats, sync)
    rows["fwd+bwd"] = per_call_us(fwd_bwd, max(1, calls // 4), args.repeats, sync)
    where = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{args.workload} {args.dtype} on {where}, torch {torch.__version__}, "
          f"ms_deform_attn from {msda.__file__}")
    for name, (median, fastest) in rows.items():
        print(f"  {name:13s} {median:8.2f} us per call (fastest repeat {fastest:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": args.workload, "dtype": args.dtype, "device": where,
                       "torch": torch.__version__,
                       "us_per_call": {k: {"median": m, "fastest": f_} for k, (m, f_) in rows.items()}},
                      f, indent=1)


if __name__ == "__main__":
    main()
