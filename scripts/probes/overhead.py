"""`blocked` forward times of the canonical encoders (CUDA-graph replays), one line each."""
import sys, torch
import ms_deform_attn as msda
from ms_deform_attn import testing as T
from benchmarks.timing import time_cuda
tag = sys.argv[1]
for name in ("ddetr_enc", "m2f_enc", "bevformer_tsa", "dino5_enc"):
    wl = T.WORKLOADS[name]
    for dtype in (torch.float32, torch.bfloat16):
        sets = [T.make_inputs(wl, dtype, torch.float32, "cuda", seed=s) for s in range(2)]
        step = lambda i: msda.ms_deform_attn(*sets[i], backend="blocked",
                                             spatial_shapes_list=list(wl.levels))
        t, _, _ = time_cuda(step, 2, True, target_ms=150)
        print(f"{tag:8s} {name:14s} {str(dtype)[6:]:9s} {t:7.1f} us", flush=True)
        del sets
