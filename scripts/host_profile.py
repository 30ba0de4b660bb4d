"""Where the host's time goes in one eager forward + backward of the
attention layer (the layer benchmark's): torch.profiler's CPU self time by
op, and the wall clock of the step with a synchronisation after it.

    python scripts/host_profile.py [workload] [dtype] [impl]
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks import layer as B  # noqa: E402
from ms_deform_attn import workloads as W  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "ddetr_dec"
dname = sys.argv[2] if len(sys.argv) > 2 else "bf16"
impl = sys.argv[3] if len(sys.argv) > 3 else "fused"
wl = W.get(name)
levels = [tuple(x) for x in wl.levels]
query, flat, ref, shapes, start, grad = B.layer_inputs(wl, 256, "cuda")
layer = B.make_layer(impl, wl, 256, "cuda")
forward, step, _ = B.layer_fns(layer, "cuda", dname, query, flat, ref, shapes, start, grad, levels)

for fn, what in ((forward, "forward"), (step, "forward + backward")):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        fn()
    t1 = time.perf_counter()  # the host has issued everything
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"{name} {dname} {impl} {what}: host issue {(t1 - t0) / 20 * 1e6:.0f} us a call, "
          f"until done {(t2 - t0) / 20 * 1e6:.0f} us a call")
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(10):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
