"""Per-kernel GPU times of the backward (fast and deterministic) on one
workload, from torch.profiler: where the backward's time goes. With a
backend name as third argument, of that backend's forward instead.

    python scripts/kernel_times.py [workload] [dtype] [forward backend]
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import ms_deform_attn as msda  # noqa: E402
from ms_deform_attn import testing as W  # noqa: E402

def profile_table(call, title, reps=10, counts=False):
    """Runs call() 3 times to warm up, then `reps` times under torch.profiler,
    and prints the GPU time per call of each kernel (with counts: how many
    launches a call), largest first, and the total."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    print(f"== {title}: GPU time per call by kernel (us)")
    total = 0.0
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total <= 0:
            continue
        t = e.device_time_total / reps
        total += t
        n = f"{e.count // reps:3d}x  " if counts else ""
        print(f"{t:9.1f}  {n}{e.key[:110]}")
    print(f"{total:9.1f}  total")


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "ddetr_enc"
    dname = sys.argv[2] if len(sys.argv) > 2 else "bf16"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dname]
    wl = W.get(name)
    inputs = W.make_inputs(wl, dtype, torch.float32, device="cuda")
    grad = torch.randn(inputs[0].shape[0], inputs[3].shape[1],
                       inputs[0].shape[2] * inputs[0].shape[3], device="cuda", dtype=dtype)
    bwd = torch.ops.ms_deform_attn._ms_deform_attn_backward
    fwd_backend = sys.argv[3] if len(sys.argv) > 3 else None
    for det in (False,) if fwd_backend else (False, True):
        if fwd_backend:
            def call():
                msda.ms_deform_attn(*inputs, backend=fwd_backend, spatial_shapes_list=wl.levels)
        else:
            def call(det=det):
                bwd(grad, *inputs, det)
        what = f"forward ({fwd_backend})" if fwd_backend else f"backward, deterministic={det}"
        profile_table(call, f"{name} {dname} {what}")


if __name__ == "__main__":
    main()
