"""Prototype A/B: baseline and blocked variants (MSDA_PROTO_DEPTH) in one process, interleaved."""
import os, sys, torch
import ms_deform_attn as msda
from ms_deform_attn import testing as W
from benchmarks.run import n_rotating_sets
from benchmarks.timing import time_cuda

variants = sys.argv[1].split(",")
wls = sys.argv[2].split(",")
dtypes = sys.argv[3].split(",")
DT = dict(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16)
print("| workload | dtype | " + " | ".join(variants) + " |")
for wname in wls:
    wl = W.get(wname)
    for dn in dtypes:
        dt = DT[dn]
        base = W.make_inputs(wl, dt, torch.float32, device="cuda", seed=0)
        nb = sum(t.numel() * t.element_size() for t in base)
        sets = [base] + [W.make_inputs(wl, dt, torch.float32, device="cuda", seed=i) for i in range(1, n_rotating_sets(nb, "cuda"))]
        best = {v: 1e9 for v in variants}
        for rep in range(3):
            for v in variants:
                be = "baseline" if v == "base" else "blocked"
                os.environ["MSDA_PROTO_DEPTH"] = "0" if v == "base" else v
                def step(i, be=be):
                    with torch.no_grad():
                        return msda.ms_deform_attn(*sets[i], backend=be)
                t, _, _ = time_cuda(step, len(sets), True, target_ms=25)
                best[v] = min(best[v], t)
        print(f"| {wname} | {dn} | " + " | ".join(f"{best[v]:.1f}" for v in variants) + " |", flush=True)
