"""Whether a layer's forward + backward can be captured as a CUDA graph after
the eager calls benchmarks.layer makes first (the unfused layer could not
until its saved-tensor count stopped keeping the graph alive: NOTES.md,
eighth session): those calls, one step under
torch.cuda.set_sync_debug_mode("warn") (a warning for every host
synchronisation), then the harness's capture with the first error's
traceback.

    python scripts/graph_probe.py [workload] [dtype] [impl]   # ddetr_dec bf16 ours
"""
import contextlib
import functools
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import layer as B  # noqa: E402
from benchmarks.timing import time_cuda  # noqa: E402
from ms_deform_attn import workloads as W  # noqa: E402


def main():
    name, dname, impl = (sys.argv[1:] + ["ddetr_dec", "bf16", "ours"][len(sys.argv) - 1:])[:3]
    wl = W.get(name)
    levels = [tuple(x) for x in wl.levels]
    query, flat, ref, shapes, start, grad = B.layer_inputs(wl, 256, "cuda")
    layer = B.make_layer(impl, wl, 256, "cuda")
    forward, step, leaves = B.layer_fns(layer, "cuda", dname, query, flat, ref, shapes, start,
                                        grad, levels)
    g_forward = functools.partial(forward, cache=False)

    def g_step():
        out = g_forward()
        return torch.autograd.grad(out, leaves, grad.to(out.dtype))

    # What the harness runs before its capture: eager steps (backward into
    # .grad), forwards, and the saved-bytes count; on the default (legacy)
    # stream as there, or on a side stream with MSDA_PROBE_SIDE=1.
    side = torch.cuda.Stream() if os.environ.get("MSDA_PROBE_SIDE") == "1" else None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for _ in range(3):
            step()
            forward()
        B.saved_bytes(forward)
    torch.cuda.synchronize()
    for t in leaves:
        t.grad = None
    g_step()
    torch.cuda.synchronize()
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        g_step()
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    print(f"{name} {dname} {impl}: {len(caught)} synchronising calls in one step")
    for w in caught[:5]:
        print(f"   {w.filename}:{w.lineno}: {w.message}")
    for label, fn in (("forward", g_forward), ("forward + backward", g_step)):
        try:
            us = time_cuda(lambda i: fn(), 1, use_graph=True, target_ms=20)[0]
            print(f"capture of the {label}: ok, {us:.1f} us a replay")
        except Exception:  # what the harness records as graph_error
            print(f"capture of the {label} failed:")
            traceback.print_exc(limit=12)


if __name__ == "__main__":
    main()
