"""Triggers one bad-input error from the extension (CPU path); prints the message."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402
import ms_deform_attn  # noqa: E402,F401

v = torch.randn(5, 2, 8)  # rank 3: value must be 4-d
shapes = torch.tensor([[1, 5]])
start = torch.tensor([0])
loc = torch.rand(1, 3, 2, 1, 2, 2)
attn = torch.rand(1, 3, 2, 1, 2)
for call in (lambda: torch.ops.ms_deform_attn._select_backend(v, shapes, start, loc, attn),
             lambda: torch.ops.ms_deform_attn.ms_deform_attn(v, shapes, start, loc, attn, "auto")):
    try:
        call()
    except RuntimeError as e:
        print("caught:", str(e).splitlines()[0])
print("diag done")
