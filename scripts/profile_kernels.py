"""Runs each kernel of interest once inside a cudaProfilerStart/Stop range, for
`ncu --profile-from-start off` (see the `profile` stage of gpu_check.sh).

    python scripts/profile_kernels.py [workload] [dtype] [backward | forward] [deterministic]

With "backward" only the backward kernels run; with "forward" only the
forward kernels (of every CUDA backend); "deterministic" takes the
deterministic backward (sort and gather) instead of the default one.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import ms_deform_attn as msda  # noqa: E402
from ms_deform_attn import testing as W  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "ddetr_enc"
dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[
    sys.argv[2] if len(sys.argv) > 2 else "bf16"]
wl = W.get(name)
inputs = W.make_inputs(wl, dtype, torch.float32, device="cuda")
grad = torch.randn(inputs[0].shape[0], inputs[3].shape[1], inputs[0].shape[2] * inputs[0].shape[3],
                   device="cuda", dtype=dtype)
backends = [] if "backward" in sys.argv[3:] else msda.available_backends("cuda")
with_bwd = "forward" not in sys.argv[3:]
det = "deterministic" in sys.argv[3:]
bwd = torch.ops.ms_deform_attn._ms_deform_attn_backward
for _ in range(3):  # warm-up: module load, allocator
    for b in backends:
        msda.ms_deform_attn(*inputs, backend=b, spatial_shapes_list=wl.levels)
    if with_bwd:
        bwd(grad, *inputs, det)
torch.cuda.synchronize()
torch.cuda.profiler.start()
for b in backends:
    msda.ms_deform_attn(*inputs, backend=b, spatial_shapes_list=wl.levels)
if with_bwd:
    bwd(grad, *inputs, det)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print("profiled", name, dtype, backends, "+ backward" if with_bwd else "")
