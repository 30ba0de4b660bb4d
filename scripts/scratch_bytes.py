"""Scratch memory of the backward: the peak allocated during one
_ms_deform_attn_backward call above what was allocated before it, minus its
outputs, for the atomic (default where it applies) and the sorted path.

    python scripts/scratch_bytes.py [workload ...] [--dtype bf16]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import ms_deform_attn  # noqa: E402,F401
from ms_deform_attn import workloads as W  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("workloads", nargs="*", default=["ddetr_enc", "rtdetr_dec"])
ap.add_argument("--dtype", default="bf16")
args = ap.parse_args()
dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
bwd = torch.ops.ms_deform_attn._ms_deform_attn_backward
for name in args.workloads:
    wl = W.get(name)
    x = W.make_inputs(wl, dtype, torch.float32, device="cuda")
    g = torch.randn(x[0].shape[0], x[3].shape[1], x[0].shape[2] * x[0].shape[3], device="cuda", dtype=dtype)
    samples = x[3].numel() // 2
    for det in (False, True):
        bwd(g, *x, det)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = bwd(g, *x, det)
        torch.cuda.synchronize()
        outputs = sum(t.numel() * t.element_size() for t in out)
        scratch = torch.cuda.max_memory_allocated() - base - outputs
        print(f"{name} {args.dtype} deterministic={det}: scratch {scratch / 1e6:.1f} MB, "
              f"{scratch / samples:.1f} bytes a sample ({samples} samples)")
        del out
