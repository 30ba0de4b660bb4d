"""CPU kernel at one thread and at all threads: forward and forward +
backward of scaled-down canonical workloads (fp32), median wall-clock time.
Prints a markdown table for BENCHMARKS.md.

    python -m benchmarks.cpu_threads [--workloads ddetr_enc/8 ddetr_dec] [--target-ms 1500]
"""
import argparse
import os
import platform

import torch

import ms_deform_attn as msda
from ms_deform_attn.testing import get, make_inputs

from .timing import time_cpu


def measure(name, threads, target_s):
    wl = get(name)
    value, shapes, start, loc, attn = make_inputs(wl, torch.float32, torch.float32, "cpu")
    torch.set_num_threads(threads)
    fwd = time_cpu(lambda i: msda.ms_deform_attn(value, shapes, start, loc, attn), 1, target_s)[0]
    leaves = [t.detach().requires_grad_() for t in (value, loc, attn)]

    def both(i):
        out = msda.ms_deform_attn(leaves[0], shapes, start, leaves[1], leaves[2])
        torch.autograd.grad(out, leaves, torch.ones_like(out))

    return fwd, time_cpu(both, 1, target_s)[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workloads", nargs="+", default=["ddetr_enc/8", "ddetr_dec"])
    ap.add_argument("--target-ms", type=float, default=1500.0)
    args = ap.parse_args(argv)
    all_threads = torch.get_num_threads()
    backend = [ln.strip() for ln in torch.__config__.parallel_info().splitlines()
               if "parallel backend" in ln]
    print(f"CPU: {platform.machine()}, {os.cpu_count()} logical cores, torch {torch.__version__}, "
          f"{backend[0] if backend else ''}")
    print(f"\n| workload (fp32) | pass | 1 thread (ms) | {all_threads} threads (ms) | speed-up |")
    print("|---|---|---:|---:|---:|")
    for name in args.workloads:
        one = measure(name, 1, args.target_ms / 1e3)
        many = measure(name, all_threads, args.target_ms / 1e3)
        for i, label in enumerate(("forward", "forward + backward")):
            print(f"| {name} | {label} | {one[i] / 1e3:.1f} | {many[i] / 1e3:.1f} | "
                  f"{one[i] / many[i]:.2f}x |")
    torch.set_num_threads(all_threads)


if __name__ == "__main__":
    main()
