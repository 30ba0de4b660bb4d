import sys, torch
import ms_deform_attn as msda
from ms_deform_attn import testing as T
wl = T.WORKLOADS[sys.argv[1]]
x = T.make_inputs(wl, torch.float32, torch.float32, "cuda", seed=0)
for _ in range(2):
    msda.ms_deform_attn(*x, backend="blocked", spatial_shapes_list=list(wl.levels))
torch.cuda.synchronize()
