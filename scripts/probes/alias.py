"""Does a power-of-two level width cost the gather? m2f_enc's shapes against
the same with W +- 1 (encoder locations, `blocked`, CUDA-graph replays)."""
import dataclasses, torch
import ms_deform_attn as msda
from ms_deform_attn import testing as T
from benchmarks.timing import time_cuda

def rows_read(wl, loc):
    n = 0
    for l, (H, W) in enumerate(wl.levels):
        x = loc[..., l, :, 0].double() * W - 0.5; y = loc[..., l, :, 1].double() * H - 0.5
        n += ((x > -1) & (x < W) & (y > -1) & (y < H)).sum().item() * 4
    return n

base = T.WORKLOADS["m2f_enc"]
variants = {
    "pow2 (128,128)(64,64)(32,32)": base.levels,
    "W+1 (128,129)(64,65)(32,33)": ((128, 129), (64, 65), (32, 33)),
    "W-1 (128,127)(64,63)(32,31)": ((128, 127), (64, 63), (32, 31)),
    "HW+1 (129,129)(65,65)(33,33)": ((129, 129), (65, 65), (33, 33)),
    "W+8 (128,136)(64,72)(32,40)": ((128, 136), (64, 72), (32, 40)),
}
for dtype in (torch.float32, torch.bfloat16):
    for name, levels in variants.items():
        wl = dataclasses.replace(base, levels=levels)
        sets = [T.make_inputs(wl, dtype, torch.float32, "cuda", seed=s) for s in range(3)]
        shapes_list = [tuple(h) for h in levels]
        rows = rows_read(wl, sets[0][3])
        step = lambda i: msda.ms_deform_attn(*sets[i], backend="blocked", spatial_shapes_list=shapes_list)
        t, _, _ = time_cuda(step, 3, True, target_ms=200)
        print(f"{str(dtype)[6:]:9s} {name:30s} S={wl.s:6d} rows {rows/1e6:.2f} M  {t:7.1f} us  "
              f"{t / rows * 1e6:.2f} ps/row", flush=True)
