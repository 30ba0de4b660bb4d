"""How fast the layer's bias gradients can be: torch's column sum (what
nn.Linear's backward runs) against a matrix-vector product by cuBLAS and
this package's ms_deform_attn::_column_sum (what its layers' linears run),
on the ddetr_enc layer's shapes (40 k rows of 256 / 128 channels). Kernel
time by CUDA events over many repetitions."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import ms_deform_attn  # noqa: E402,F401  (registers the ops)


def timed(fn, reps=200):
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def main():
    for dtype in (torch.bfloat16, torch.float32):
        for rows, cols in ((40000, 256), (40000, 128), (40000, 384)):
            g = torch.randn(rows, cols, device="cuda", dtype=dtype)
            ones = torch.ones(rows, device="cuda", dtype=dtype)
            ref = g.double().sum(0)
            res = {
                "sum(0)": (lambda: g.sum(0)),
                "ones @ g": (lambda: ones @ g),
                "mv(g.t(), ones)": (lambda: torch.mv(g.t(), ones)),
                "ones[None] @ g": (lambda: torch.mm(ones[None], g)),
                "_column_sum": (lambda: torch.ops.ms_deform_attn._column_sum(g)),
            }
            line = []
            for name, fn in res.items():
                err = ((fn().double().flatten() - ref).norm() / ref.norm()).item()
                line.append(f"{name} {timed(fn):.1f} us (err {err:.1e})")
            mb = g.numel() * g.element_size() / 1e6
            print(f"{str(dtype)[6:]} {rows}x{cols} ({mb:.0f} MB): " + "; ".join(line))


if __name__ == "__main__":
    main()
