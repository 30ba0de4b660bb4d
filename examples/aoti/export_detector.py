"""Export a whole detector that uses ms_deform_attn for the C++ program
beside this file: a small transformers DeformableDetrModel (random weights)
with its attention layers swapped for this operator, through torch.export
and AOTInductor, into one package (model.pt2), plus its inputs and eager
outputs (io.pt) for the C++ program to check against.

    python examples/aoti/export_detector.py --device cpu --out build-aoti
    ./build-aoti-cpp/aoti_detector build-aoti/model.pt2 build-aoti/io.pt

Needs transformers (the `hf` extra) and a C++ compiler (AOTInductor
compiles the model); the CUDA package needs the CUDA kernels and nvcc.
"""
import argparse
import os
import time

import torch


def swapped_detector(device):
    """The small DeformableDetrModel of ms_deform_attn.testing (Deformable
    DETR's architecture at d_model 32, random weights) with its attention
    layers on this operator, returning plain tensors."""
    from ms_deform_attn.hf import swap_msda
    from ms_deform_attn.testing import DetectorOutputs, small_deformable_detr

    model = small_deformable_detr(device)
    assert swap_msda(model) == 2  # one encoder and one decoder layer
    return DetectorOutputs(model).eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default="build-aoti", help="folder for model.pt2 and io.pt")
    ap.add_argument("--size", default="160x192", help="image height x width")
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    h, w = (int(v) for v in args.size.split("x"))
    os.makedirs(args.out, exist_ok=True)

    import ms_deform_attn  # noqa: F401  (registers the operator)
    # fp32 convolutions in IEEE precision (cuDNN defaults to TF32), as the C++
    # program runs them: the outputs are compared within 1e-5.
    torch.backends.cudnn.allow_tf32 = False

    detector = swapped_detector(args.device)
    pixels = torch.randn(args.batch, 3, h, w, generator=torch.Generator().manual_seed(1)).to(args.device)
    with torch.no_grad():
        expected = detector(pixels)
        start = time.time()
        program = torch.export.export(detector, (pixels,))
        ops = {str(n.target) for n in program.graph.nodes if "ms_deform_attn" in str(n.target)}
        assert ops, "the exported program does not call ms_deform_attn"
        package = torch._inductor.aoti_compile_and_package(
            program, package_path=os.path.join(args.out, "model.pt2"))
        print(f"exported ({', '.join(sorted(ops))}) and compiled in {time.time() - start:.0f} s: {package}")
    torch.save({"pixel_values": pixels.cpu(), "last_hidden_state": expected[0].cpu(),
                "encoder_last_hidden_state": expected[1].cpu()}, os.path.join(args.out, "io.pt"))


if __name__ == "__main__":
    main()
