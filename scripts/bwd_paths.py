"""Backward paths side by side (MS_DEFORM_ATTN_BACKWARD = atomic / sorted /
tiled): median GPU time of the backward op per workload and dtype, each
path's gradients against the atomic path's (relative norm), and the tiled
path's kernels on one workload.

    python scripts/bwd_paths.py [workloads] [dtypes] [generator]
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import ms_deform_attn  # noqa: E402,F401
from ms_deform_attn import workloads as W  # noqa: E402

names = (sys.argv[1] if len(sys.argv) > 1 else
         "ddetr_enc,ddetr_dec,dino_dec,rtdetr_dec,dino5_enc,bevformer_tsa,m2f_enc").split(",")
dtypes = (sys.argv[2] if len(sys.argv) > 2 else "bf16,fp32").split(",")
gen = sys.argv[3] if len(sys.argv) > 3 else None
DT = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
bwd = torch.ops.ms_deform_attn._ms_deform_attn_backward
PATHS = os.environ.get("PATHS", "atomic,sorted,tiled").split(",")


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    ts.sort()
    return ts[len(ts) // 2]


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


for name in names:
    wl = W.get(name)
    if gen:
        from dataclasses import replace
        wl = replace(wl, locations=gen)
    for dn in dtypes:
        inputs = W.make_inputs(wl, DT[dn], torch.float32, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(1)
        grad = torch.randn(wl.n, wl.queries, wl.m * wl.d, device="cuda", generator=g).to(DT[dn])
        res, times = {}, {}
        for path in PATHS:
            os.environ["MS_DEFORM_ATTN_BACKWARD"] = path
            det = path != "atomic"
            res[path] = bwd(grad, *inputs, det)
            times[path] = timed(lambda: bwd(grad, *inputs, det))
        base = res[PATHS[0]]
        errs = {p: "/".join(f"{rel(x, y):.1e}" for x, y in zip(res[p], base)) for p in PATHS[1:]}
        line = "  ".join(f"{p} {times[p]:8.1f}" for p in PATHS)
        print(f"{name:14s} {dn:5s} {wl.locations:8s} {line}   err vs {PATHS[0]} (gv/gl/ga): {errs}",
              flush=True)

if os.environ.get("KERNELS"):
    wl = W.get(os.environ["KERNELS"])
    for dn in dtypes:
        inputs = W.make_inputs(wl, DT[dn], torch.float32, device="cuda")
        grad = torch.randn(wl.n, wl.queries, wl.m * wl.d, device="cuda").to(DT[dn])
        os.environ["MS_DEFORM_ATTN_BACKWARD"] = "tiled"
        for _ in range(3):
            bwd(grad, *inputs, True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                bwd(grad, *inputs, True)
            torch.cuda.synchronize()
        print(f"--- tiled kernels, {wl.name} {dn} (us per call)")
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:10]:
            print(f"{e.device_time_total / 10:9.1f}  {e.key[:110]}")
