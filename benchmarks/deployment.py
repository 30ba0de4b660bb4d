"""Latency of one image through the small DeformableDetrModel of
examples/aoti (its attention on this operator) in eager PyTorch and in ONNX
Runtime (the portable export); the AOTInductor rows come from the C++
program examples/aoti/main.cpp (scripts/gpu_check.sh, stage deploy).

    python -m benchmarks.deployment [--size 512x512] [--onnx model.onnx]

Prints one Markdown row per path that runs here: eager on the CPU and, with
a GPU, on CUDA; OpenVINO on the CPU (f32, compile_openvino) where it is
installed; ONNX Runtime on the CPU, and with the CUDA provider where this
onnxruntime has it. Median of --runs calls after warm-up, inputs
already on the device, synchronised. Without --onnx the model is exported
here (needs the onnx extra).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "aoti"))
from export_detector import swapped_detector  # noqa: E402


def median_ms(call, runs: int, sync=lambda: None) -> float:
    for _ in range(3):
        call()
    sync()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="512x512", help="image height x width")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--onnx", help="a portable export of the detector at this size (else exported here)")
    args = ap.parse_args()
    h, w = (int(v) for v in args.size.split("x"))
    torch.backends.cudnn.allow_tf32 = False  # fp32 convolutions, as examples/aoti checks them
    detector = swapped_detector("cpu")
    pixels = torch.randn(1, 3, h, w, generator=torch.Generator().manual_seed(1))
    rows = []
    with torch.no_grad():
        expected = detector(pixels)[0].double()
        rows.append(("eager PyTorch", "CPU", median_ms(lambda: detector(pixels), args.runs)))
        if torch.cuda.is_available():
            on_gpu, gpu_pixels = swapped_detector("cuda"), pixels.cuda()
            rows.append(("eager PyTorch", "CUDA", median_ms(lambda: on_gpu(gpu_pixels), args.runs,
                                                            torch.cuda.synchronize)))
    try:
        import onnxruntime as ort
    except ImportError:
        ort = None
        print("onnxruntime is not installed: no ONNX Runtime rows", file=sys.stderr)
    try:
        import openvino
    except ImportError:
        openvino = None
        print("openvino is not installed: no OpenVINO row", file=sys.stderr)
    with tempfile.TemporaryDirectory() as scratch:  # the export, removed after its rows
        path = args.onnx
        if path is None and (ort is not None or openvino is not None):
            from ms_deform_attn.onnx import export_onnx
            path = os.path.join(scratch, "detector.onnx")
            export_onnx(detector, (pixels,), path)
        if openvino is not None:
            from ms_deform_attn.onnx import compile_openvino
            compiled = compile_openvino(path)  # f32 inference precision, as documented
            got = torch.from_numpy(compiled([pixels.numpy()])[compiled.outputs[0]]).double()
            err = float((got - expected).norm() / expected.norm())
            rows.append((f"OpenVINO {openvino.__version__.split('-')[0]} (error {err:.1e})", "CPU",
                         median_ms(lambda: compiled([pixels.numpy()]), args.runs)))
        if ort is not None:
            for provider in ("CPUExecutionProvider", "CUDAExecutionProvider"):
                if provider not in ort.get_available_providers():
                    print(f"onnxruntime has no {provider}", file=sys.stderr)
                    continue
                session = ort.InferenceSession(path, providers=[provider])
                feeds = {session.get_inputs()[0].name: pixels.numpy()}
                got = torch.from_numpy(session.run(None, feeds)[0]).double()
                err = float((got - expected).norm() / expected.norm())
                rows.append((f"ONNX Runtime {ort.__version__} (error {err:.1e})", provider[:-len("ExecutionProvider")],
                             median_ms(lambda: session.run(None, feeds), args.runs)))
    print(f"| path | device | ms, 1 x 3 x {h} x {w} |\n|---|---|---:|")
    for name, device, ms in rows:
        print(f"| {name} | {device} | {ms:.2f} |")


if __name__ == "__main__":
    main()
