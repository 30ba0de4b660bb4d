"""Per-kernel GPU times of one attention layer's forward + backward (the
layer benchmark's, benchmarks/layer.py), from torch.profiler: where the
layer's time goes besides the operator.

    python scripts/layer_kernels.py [workload] [dtype] [impl ...] [--plain-linears]

With --plain-linears the layers call their nn.Linear modules instead of
ms_deform_attn::_linear (fast_linears=False).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import layer as B  # noqa: E402
from kernel_times import profile_table  # noqa: E402
from ms_deform_attn import testing as W  # noqa: E402

args = [a for a in sys.argv[1:] if a != "--plain-linears"]
B.FAST_LINEARS = "--plain-linears" not in sys.argv
name = args[0] if len(args) > 0 else "ddetr_enc"
dname = args[1] if len(args) > 1 else "bf16"
impls = args[2:] or ["ours", "fused"]
wl = W.get(name)
levels = [tuple(x) for x in wl.levels]
query, flat, ref, shapes, start, grad = B.layer_inputs(wl, 256, "cuda")
for impl in impls:
    layer = B.make_layer(impl, wl, 256, "cuda")
    _, step, _ = B.layer_fns(layer, "cuda", dname, query, flat, ref, shapes, start, grad, levels)
    profile_table(step, f"{name} {dname} layer {impl}, forward + backward", reps=10, counts=True)
