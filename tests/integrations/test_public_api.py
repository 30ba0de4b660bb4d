"""The Python surface is declared: every public module says what it exports
(__all__), every name it lists exists, and every public function or class it
defines is listed (a new one has to be declared, or named with a leading
underscore)."""
import importlib
import inspect
import pathlib
import re

import pytest
import torch

import ms_deform_attn as msda
from ms_deform_attn import testing as W

MODULES = ["ms_deform_attn", "ms_deform_attn.nn", "ms_deform_attn.hf", "ms_deform_attn.onnx",
           "ms_deform_attn.distributed", "ms_deform_attn.reference", "ms_deform_attn.compat",
           "ms_deform_attn.layers"]


@pytest.mark.parametrize("name", MODULES)
def test_modules_declare_their_surface(name):
    module = importlib.import_module(name)
    declared = getattr(module, "__all__", None)
    assert declared is not None, f"{name} has no __all__"
    assert len(set(declared)) == len(declared), name
    missing = [n for n in declared if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ lists what it lacks: {missing}"
    defined = [n for n, obj in vars(module).items()
               if not n.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
               and getattr(obj, "__module__", None) == name]
    undeclared = sorted(set(defined) - set(declared))
    assert not undeclared, f"{name} defines public names it does not declare: {undeclared}"


def test_the_default_device_of_the_planners_is_testing_h100():
    """testing.DEVICES describes devices to the planners; its H100 (and the
    H200, the same figures) is the planners' own default device (DeviceInfo's
    defaults, csrc/plan/device.h), which the backward's query plans for when
    value is on no CUDA device: the same plans for every problem below."""
    assert W.DEVICES["H200"] == W.DEVICES["H100"]
    for name in ("ddetr_enc", "ddetr_dec", "dino_dec", "bevformer_tsa", "seed"):
        wl = W.get(name)
        for dtype in (torch.float32, torch.bfloat16):
            value, shapes, start, loc, attn = W.make_inputs(wl.scaled(1), dtype, device="meta")
            args = (value, shapes, start, loc, attn)
            for det in (False, True):
                assert (msda.select_backward_plan(*args, deterministic=det)
                        == msda.select_backward_plan(*args, deterministic=det,
                                                     device=W.DEVICES["H100"])), (name, dtype)


def test_the_usage_docs_arguments_example_runs_here():
    """docs/usage.md's first example, as it stands there, on whatever device
    this machine has (it read device="cuda" and failed on a CPU machine)."""
    path = pathlib.Path(__file__).resolve().parents[2] / "docs" / "usage.md"
    if not path.exists():
        pytest.skip("docs/ is the checkout's: run from the checkout")
    block = re.search(r"## Arguments\n```python\n(.*?)```", path.read_text(), re.S)
    assert block, "docs/usage.md lost its Arguments example"
    scope = {"__name__": "__doc_example__"}
    exec(compile(block.group(1), "docs/usage.md", "exec"), scope)
    assert scope["out"].shape == (2, 300, 256) and scope["out"].dtype == torch.bfloat16


def test_one_version_everywhere():
    """The version's four places agree (docs/development.md, Release)."""
    root = pathlib.Path(msda.__file__).resolve().parent
    found = {"ms_deform_attn.__version__": msda.__version__}
    header = root / "include" / "ms_deform_attn" / "version.h"
    found["version.h"] = re.search(r'#define MS_DEFORM_ATTN_VERSION "([^"]+)"',
                                   header.read_text()).group(1)
    cmake = root / "share" / "cmake" / "ms_deform_attn" / "ms_deform_attnConfigVersion.cmake"
    found["cmake"] = re.search(r'set\(PACKAGE_VERSION "([^"]+)"\)', cmake.read_text()).group(1)
    pyproject = root.parent / "pyproject.toml"
    if pyproject.exists():  # the checkout's
        found["pyproject.toml"] = re.search(r'^version = "([^"]+)"', pyproject.read_text(),
                                            re.M).group(1)
    assert len(set(found.values())) == 1, found


def test_docs_stay_in_proportion():
    """README at most 200 lines, docs/development.md 250, performance.md 400."""
    root = pathlib.Path(__file__).resolve().parents[2]
    limits = {"README.md": 200, "docs/development.md": 250, "docs/performance.md": 400}
    if not (root / "docs").exists():
        pytest.skip("docs/ is the checkout's: run from the checkout")
    for name, most in limits.items():
        lines = (root / name).read_text().count("\n")
        assert lines <= most, f"{name}: {lines} lines, at most {most}"


def test_the_cpp_sources_live_under_csrc():
    """The import graph puts the package above the library: no C++ source
    under csrc/ includes anything from the Python package's folder (the
    package carries copies of csrc/include and csrc/layer, made by the
    build), and every quoted include resolves inside csrc/."""
    root = pathlib.Path(__file__).resolve().parents[2]
    csrc = root / "csrc"
    if not csrc.exists():
        pytest.skip("csrc/ is the checkout's: run from the checkout")
    search = [csrc / "include"]
    outside = []
    for f in sorted(csrc.rglob("*")):
        if f.suffix not in (".h", ".cpp", ".cu", ".cuh"):
            continue
        for inc in re.findall(r'^\s*#include "([^"]+)"', f.read_text(), re.M):
            if inc == "ms_deform_attn_build.h":  # written by setup.py into build/generated
                continue
            found = [p.resolve() for p in [f.parent / inc] + [d / inc for d in search]
                     if p.exists()]
            if not found or any(csrc.resolve() not in p.parents for p in found):
                outside.append(f"{f.relative_to(root)}: {inc}")
    assert not outside, outside
