"""The Hugging Face `kernels` layout (`make kernels-build`,
scripts/kernels_build.py): the in-place build written as a local kernel
repository, loaded by the `kernels` package (no Hub) in a fresh process
(where this package is not imported: the library registers the operator
namespace once per process), and a transformers DeformableDetrModel run
through it by kernels.kernelize."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_SCRIPT = os.path.join(ROOT, "scripts", "kernels_build.py")

# Run in a fresh interpreter: argv[1] the layout, argv[2] the device.
RUN_MODEL = r'''
import sys
from pathlib import Path
import torch
import transformers
from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

repo, device = Path(sys.argv[1]), sys.argv[2]
backbone = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1],
                                     out_features=["stage2", "stage3", "stage4"])
cfg = transformers.DeformableDetrConfig(
    d_model=32, encoder_layers=1, decoder_layers=1, num_queries=10, encoder_ffn_dim=32,
    decoder_ffn_dim=32, encoder_attention_heads=4, decoder_attention_heads=4, use_timm_backbone=False,
    backbone_config=backbone, use_pretrained_backbone=False, backbone=None)
torch.manual_seed(0)
model = transformers.DeformableDetrModel(cfg).to(device).eval()
pixels = torch.randn(2, 3, 160, 192, generator=torch.Generator().manual_seed(1)).to(device)
with torch.no_grad():
    expected = model(pixel_values=pixels).last_hidden_state.double()
layers = [m for m in model.modules() if type(m).__name__ == "MultiScaleDeformableAttention"]
for cls in {type(m) for m in layers}:
    # What transformers' use_kernel_forward_from_hub marks (only for the
    # kernels versions it knows).
    if getattr(cls, "kernel_layer_name", None) is None:
        cls.kernel_layer_name = "MultiScaleDeformableAttention"
mapping = {"MultiScaleDeformableAttention": {device: LocalLayerRepository(
    repo, layer_name="MultiScaleDeformableAttention")}}
with use_kernel_mapping(mapping):
    model = kernelize(model, mode=Mode.INFERENCE, device=device)
loaded = [n for n in sys.modules if n.startswith("_ms_deform_attn_")]
assert "ms_deform_attn" not in sys.modules and len(loaded) >= 1, sorted(sys.modules)
replaced = sum(getattr(m.forward, "__func__", type(m).forward).__module__.startswith("_ms_deform_attn_")
               for m in layers)
with torch.no_grad():
    out = model(pixel_values=pixels).last_hidden_state.double()
err = ((out - expected).norm() / expected.norm()).item()
kernel = sys.modules[loaded[0]]
print(f"kernels layout: {len(layers)} layers, {replaced} replaced, module {loaded[0]}, "
      f"autograd {kernel._ops.torch_layer or 'Python'}, rel. error {err:.1e}")
assert replaced == len(layers) == 2, replaced
assert err <= 1e-5, err
'''


def _devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _devices())
def test_kernels_layout_runs_a_transformers_model(device, tmp_path):
    pytest.importorskip("kernels")
    pytest.importorskip("transformers")
    if not os.path.exists(BUILD_SCRIPT) or not os.path.exists(
            os.path.join(ROOT, "ms_deform_attn", "lib", "libms_deform_attn.so")):
        pytest.skip("needs the source checkout with its in-place build (make build)")
    import ms_deform_attn as msda

    if torch.version.cuda and not msda.cuda_kernels_built():
        # kernels picks the CUDA variant under a CUDA torch, whatever the device.
        pytest.skip("this build is CPU-only and torch has CUDA: kernels would ask for a CUDA variant")
    subprocess.run([sys.executable, BUILD_SCRIPT, "--out", str(tmp_path)], check=True, timeout=300)
    (variant,) = os.listdir(tmp_path / "build")
    with open(tmp_path / "build" / variant / "metadata.json") as f:
        meta = json.load(f)
    assert variant.startswith("torch-stable-abi210-") and meta["name"] == "ms-deform-attn"
    assert meta["backend"]["type"] == ("cuda" if msda.cuda_kernels_built() else "cpu")
    # The fresh process must not find this checkout's package first.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    run = subprocess.run([sys.executable, "-c", RUN_MODEL, str(tmp_path), device], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 replaced" in run.stdout, run.stdout
