"""One forward of ours (a backend) and of the Triton peer (roulbac/msda-triton,
when importable) on one workload, inside a cudaProfilerStart/Stop range after
warm-up (the peer autotunes then), for `ncu --profile-from-start off` side by
side (the `peer` stage of gpu_check.sh). The peer is called as the benchmark
calls it (benchmarks.peers.PEERS: its inputs converted to the dtypes it takes
once, before the profiled range).

    python scripts/peer_profile.py [workload] [dtype] [backend]
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import ms_deform_attn as msda  # noqa: E402
from benchmarks.run import DTYPES, rel_err  # noqa: E402
from benchmarks.peers import PEERS  # noqa: E402
from ms_deform_attn import testing as W  # noqa: E402
from ms_deform_attn.reference import ms_deform_attn_pytorch  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "ddetr_enc"
dtype, loc_dtype = DTYPES[sys.argv[2] if len(sys.argv) > 2 else "fp32"]
backend = sys.argv[3] if len(sys.argv) > 3 else "auto"
wl = W.get(name)
inputs = W.make_inputs(wl, dtype, loc_dtype, device="cuda")
runs = {backend: lambda: msda.ms_deform_attn(*inputs, backend=backend,
                                              spatial_shapes_list=wl.levels)}
try:
    peer = PEERS["triton"].make()
    peer_inputs = PEERS["triton"].prepare(inputs)
    runs["triton"] = lambda: peer(*peer_inputs)
except ImportError as exc:
    print("peer skipped:", exc)
value, shapes, start, loc, attn = inputs
ref = ms_deform_attn_pytorch(value.double(), shapes, start, loc.double(), attn.double())
for _ in range(3):
    outs = {k: f() for k, f in runs.items()}
torch.cuda.synchronize()
for k, o in outs.items():
    print(k, "rel. error", rel_err(o, ref))
torch.cuda.profiler.start()
for f in runs.values():
    f()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print("profiled", name, dtype, list(runs))
