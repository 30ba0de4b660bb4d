"""Writes the built package into the directory layout the Hugging Face
`kernels` package loads (`make kernels-build`): the same binaries as the
wheel, under build/<variant>/ with its metadata.json:

    <out>/build/torch-stable-abi<MAJ><MIN>-<cu130|cpu>-x86_64-linux/
        metadata.json
        ms_deform_attn/            the package: _C, lib/ (the operator library and
                                   the autograd layer of the build's torch), layers.py, ...

The variant names the stable ABI release the operator library targets
(any torch from it on loads it); `kernels` imports the package under the
metadata's id, and `kernels.kernelize` maps transformers'
MultiScaleDeformableAttention to `layers.MultiScaleDeformableAttention`.
Run after an in-place build (make build):

    python scripts/kernels_build.py [--out build/kernels]
"""
import argparse
import hashlib
import json
import os
import platform
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "ms_deform_attn")


def build_info():
    """ms_deform_attn/_build_info.py (written by setup.py), read alone: the
    package itself is not imported."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_build_info", os.path.join(PKG, "_build_info.py"))
    info = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(info)
    return info


def variant(info) -> str:
    major, minor = info.STABLE_TARGET.split(".")
    backend = "cu" + info.CUDA_VERSION.replace(".", "") if info.CUDA_VERSION else "cpu"
    return f"torch-stable-abi{major}{minor}-{backend}-{platform.machine()}-linux"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "kernels"))
    args = ap.parse_args(argv)
    library = os.path.join(PKG, "lib", "libms_deform_attn.so")
    if not os.path.exists(library):
        sys.exit("scripts/kernels_build.py: no in-place build (ms_deform_attn/lib/libms_deform_attn.so); "
                 "run `make build` first")
    info = build_info()
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        version = next(line.split('"')[1] for line in f if line.startswith("version"))
    with open(library, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:10]
    target = os.path.join(args.out, "build", variant(info))
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(PKG, os.path.join(target, "ms_deform_attn"),
                    ignore=shutil.ignore_patterns("__pycache__", "include", "share"))
    archs = [a for a in getattr(info, "CUDA_ARCHS", "").replace(" ", ";").split(";") if a]
    metadata = {
        # Imported under this name: one id per build, so two builds never share a module.
        "id": f"_ms_deform_attn_{version.replace('.', '_')}_{digest}",
        "name": "ms-deform-attn",
        "version": 1,
        "license": "NOASSERTION",  # the project states no license (SPDX: no assertion)
        "backend": ({"type": "cuda", "archs": archs} if info.CUDA_VERSION and archs
                    else {"type": "cuda"} if info.CUDA_VERSION else {"type": "cpu"}),
        "python-depends": [],
    }
    with open(os.path.join(target, "metadata.json"), "w") as f:
        json.dump(metadata, f, indent=1)
    print(f"kernels layout: {target} (id {metadata['id']})")


if __name__ == "__main__":
    main()
