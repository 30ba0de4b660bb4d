"""PROTO: the warp-specialised `blocked` (MSDA_PROTO_WS=1) against the kernel
as built: outputs (NaN-filled first, MS_DEFORM_ATTN_POISON=1) and times."""
import dataclasses, os, sys, torch
import ms_deform_attn as msda
from ms_deform_attn import testing as T
from ms_deform_attn.reference import ms_deform_attn_pytorch
from benchmarks.timing import time_cuda

def wl_of(name):
    base, _, gen = name.partition("@")
    wl = T.WORKLOADS[base]
    return dataclasses.replace(wl, locations=gen) if gen else wl

def run(x, ws, levels=None):
    os.environ["MSDA_PROTO_WS"] = ws if ws else "0"
    return msda.ms_deform_attn(*x, backend="blocked", spatial_shapes_list=levels)

def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()

if sys.argv[1] == "check":
    for V in ("1,4", "2,8"):
        for name in ("ddetr_enc", "m2f_enc", "bevformer_tsa"):
            wl = wl_of(name)
            x = T.make_inputs(wl, torch.float32, torch.float32, "cuda", seed=1)
            a, b = run(x, False, list(wl.levels)), run(x, V, list(wl.levels))
            print(f"{V} {name}: nan {a.isnan().sum().item()}/{b.isnan().sum().item()}  rel(ws, blocked) {rel(b, a):.2e}")
        g = torch.Generator().manual_seed(3)
        shapes = torch.tensor([[7, 9], [3, 5]], device="cuda")
        start = torch.tensor([0, 63], device="cuda")
        N, Lq, M, L, P = 2, 1001, 3, 2, 4
        value = torch.randn(N, 78, M, 32, generator=g).cuda()
        loc = (torch.rand(N, Lq, M, L, P, 2, generator=g) * 1.4 - 0.2).cuda()
        loc[0, 5, 1, 0, 2, 0] = float("nan")
        attn = torch.rand(N, Lq, M, L, P, generator=g).cuda()
        x = [value, shapes, start, loc, attn]
        a, b = run(x, False), run(x, V)
        fin = ~a.isnan()
        print(f"{V} small: nan masks equal {torch.equal(a.isnan(), b.isnan())} ({a.isnan().sum().item()}), "
              f"rel(ws, blocked) {rel(b[fin], a[fin]):.2e}")
else:
    variants = ["0", "1,4", "2,4", "1,8", "2,8", "1,16"]
    for name in ("ddetr_enc", "ddetr_enc@smooth", "m2f_enc", "bevformer_tsa"):
        wl = wl_of(name)
        sets = [T.make_inputs(wl, torch.float32, torch.float32, "cuda", seed=s) for s in range(2)]
        line = []
        for v in variants + ["0"]:
            os.environ["MSDA_PROTO_WS"] = v
            t, _, _ = time_cuda(lambda i: msda.ms_deform_attn(*sets[i], backend="blocked",
                                spatial_shapes_list=list(wl.levels)), 2, True, target_ms=120)
            line.append(f"[{v}] {t:6.1f}")
        print(f"{name:18s} fp32  " + "  ".join(line), flush=True)
        del sets
