"""What value's layout is worth to the kernels: (N, S, M, D) against head-major
(N, M, S, D), before the operator takes the latter (issue 25).

    python -m benchmarks.layout [--workloads ddetr_enc,...] [--dtypes bf16,fp32]

A head-major problem is run today as N * M batches of one head: value
(N, M, S, D) viewed as (N M, S, 1, D), locations and weights permuted to
(N M, Lq, 1, L, P). The kernels then see every (n, m) map contiguous (a
pixel row D * element size bytes apart instead of M D) and a warp's query
groups are neighbouring queries of one head instead of the heads of one
query. The sums are the same ones in the same order: the forward outputs
must match bitwise (checked). Forward and forward + backward, default and
deterministic backward, CUDA-graph replays (benchmarks.timing.time_cuda).
"""
from __future__ import annotations

import argparse
import json
import os

import torch

import ms_deform_attn as msda
from ms_deform_attn import testing as W

from .timing import time_cuda

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def head_major(inputs):
    """The same problem as N M batches of one head (value head-major)."""
    value, shapes, start, loc, attn = inputs
    N, S, M, D = value.shape
    Lq = loc.shape[1]
    v = value.permute(0, 2, 1, 3).contiguous().view(N * M, S, 1, D)
    lo = loc.permute(0, 2, 1, 3, 4, 5).contiguous().view(N * M, Lq, 1, *loc.shape[3:])
    at = attn.permute(0, 2, 1, 3, 4).contiguous().view(N * M, Lq, 1, *attn.shape[3:])
    return [v, shapes, start, lo, at]


def to_standard(out_hm, N, M):
    """(N M, Lq, D) output of head_major's problem -> (N, Lq, M D)."""
    _, Lq, D = out_hm.shape
    return out_hm.view(N, M, Lq, D).permute(0, 2, 1, 3).reshape(N, Lq, M * D)


def measure(wl, dtype, target_ms):
    inputs = W.make_inputs(wl, dtype, torch.float32, device="cuda")
    N, M = wl.n, wl.m
    rows = []
    for layout, ins in (("standard", inputs), ("head-major", head_major(inputs))):
        with torch.no_grad():
            out = msda.ms_deform_attn(*ins, spatial_shapes_list=wl.levels)
        if layout == "standard":
            ref = out
        else:
            assert torch.equal(to_standard(out, N, M), ref), "head-major forward differs"
        grad = torch.randn_like(out)
        leaves = [t.detach().requires_grad_(i in (0, 3, 4)) for i, t in enumerate(ins)]
        row = dict(workload=wl.name, dtype=str(dtype).replace("torch.", ""), layout=layout)

        def fwd(i):
            with torch.no_grad():
                return msda.ms_deform_attn(*ins, spatial_shapes_list=wl.levels)

        row["fwd_us"] = time_cuda(fwd, 1, use_graph=True, target_ms=target_ms)[0]
        for det in (False, True):
            def step(i, det=det):
                o = msda.ms_deform_attn(*leaves, spatial_shapes_list=wl.levels, deterministic=det)
                return torch.autograd.grad(o, (leaves[0], leaves[3], leaves[4]), grad)

            key = "bwd_det_us" if det else "bwd_us"
            row[key] = time_cuda(step, 1, use_graph=True, target_ms=target_ms)[0] - row["fwd_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="ddetr_enc,ddetr_enc@smooth,ddetr_dec,dino_dec,m2f_enc,bevformer_tsa")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--target-ms", type=float, default=200.0)
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.layout needs a CUDA device")
    rows = []
    for name in args.workloads.split(","):
        for d in args.dtypes.split(","):
            rows += measure(W.get(name), DTYPES[d], args.target_ms)
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "layout.json"), "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)
    print("| workload | dtype | layout | fwd (us) | bwd default (us) | bwd deterministic (us) |")
    print("|---|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['dtype']} | {r['layout']} | {r['fwd_us']:.1f} | "
              f"{r['bwd_us']:.0f} | {r['bwd_det_us']:.0f} |")


if __name__ == "__main__":
    main()
