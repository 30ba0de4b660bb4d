"""Trains a tiny Deformable-DETR-style encoder for a few steps with AMP.

    python examples/train_encoder.py [--steps 20] [--device cuda|cpu]
                                     [--compile none|default|reduce-overhead]

bf16 autocast on the GPU (the MSDA operator then gets a bf16 value and fp32
locations and weights, no casts needed); on the CPU, bf16 autocast too. Prints
the loss and the step time; the loss goes down.

--compile runs the model's forward (and with it the backward) under
torch.compile. On a GPU, "reduce-overhead" replays both as CUDA graphs: the
operator never syncs with the host, so nothing stops the capture, and the
step no longer waits on the host's kernel launches. CUDA graphs need fixed
input shapes; each new shape records a new graph. Mark each training step's
start with torch.compiler.cudagraph_mark_step_begin(), as below.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

from ms_deform_attn.nn import MSDeformAttn  # noqa: E402
from ms_deform_attn.testing import encoder_reference_points, level_tensors  # noqa: E402


class EncoderLayer(torch.nn.Module):
    def __init__(self, d_model, n_levels):
        super().__init__()
        self.attn = MSDeformAttn(d_model, n_levels, 8, 4)
        self.norm1 = torch.nn.LayerNorm(d_model)
        self.ffn = torch.nn.Sequential(torch.nn.Linear(d_model, 4 * d_model), torch.nn.ReLU(),
                                       torch.nn.Linear(4 * d_model, d_model))
        self.norm2 = torch.nn.LayerNorm(d_model)

    def forward(self, src, ref, shapes, start):
        src = self.norm1(src + self.attn(src, ref, src, shapes, start))
        return self.norm2(src + self.ffn(src))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", default="none", choices=("none", "default", "reduce-overhead"))
    args = ap.parse_args()
    device = args.device
    levels = [(64, 80), (32, 40), (16, 20), (8, 10)] if device == "cuda" else [(16, 20), (8, 10), (4, 5)]
    d_model, batch = 256, 2
    shapes, start = level_tensors(levels, device)
    ref = encoder_reference_points(levels, device).float()[None, :, None].expand(batch, -1, len(levels), -1)
    model = torch.nn.Sequential(*[EncoderLayer(d_model, len(levels)) for _ in range(2)]).to(device)
    head = torch.nn.Linear(d_model, d_model).to(device)
    opt = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=1e-3)
    torch.manual_seed(0)
    src = torch.randn(batch, ref.shape[1], d_model, device=device)
    target = torch.randn(batch, ref.shape[1], d_model, device=device) * 0.1
    def forward(x):
        for layer in model:
            x = layer(x, ref, shapes, start)
        return head(x)

    if args.compile != "none":
        forward = torch.compile(forward, mode=None if args.compile == "default" else args.compile)
    for step in range(args.steps):
        t0 = time.perf_counter()
        if args.compile == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(forward(src).float(), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"step {step:3d}  loss {loss.item():.5f}  {1e3 * (time.perf_counter() - t0):.1f} ms")


if __name__ == "__main__":
    main()
