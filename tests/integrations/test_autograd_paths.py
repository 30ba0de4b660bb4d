"""The two homes of autograd and autocast (ms_deform_attn/_layer.py): the C++
layer built for this torch release, and the Python registrations a torch
release without one gets. The same calls through both give the same bits:
forward, every gradient (the plain and the fused operator, reference points
included, the layers' _linear), autocast's casts, the double-backward error."""
import os
import subprocess
import sys

import pytest
import torch

from helpers import make_inputs

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def run_calls(device: str) -> dict:
    """Every call whose autograd or autocast the two paths implement; the
    results by name. Deterministic backward throughout (bitwise)."""
    import ms_deform_attn as msda

    out = {}
    value, shapes, start, loc, attn = make_inputs(2, 7, 4, 8, [(5, 6), (3, 2)], 3, torch.float32,
                                                  device=device, seed=3)
    args = [t.requires_grad_() if t.is_floating_point() else t for t in (value, shapes, start, loc, attn)]
    y = msda.ms_deform_attn(*args, deterministic=True)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(4)).to(device)
    out["forward"] = y.detach()
    out.update({f"grad_{i}": t for i, t in
                enumerate(torch.autograd.grad(y, [args[0], args[3], args[4]], g))})

    gen = torch.Generator().manual_seed(5)
    for k in (2, 4):
        ref = torch.rand(2, 7, 2, k, generator=gen).to(device).requires_grad_()
        off = torch.randn(2, 7, 4, 2, 3, 2, generator=gen).to(device).requires_grad_()
        logits = torch.randn(2, 7, 4, 6, generator=gen).to(device).requires_grad_()
        v = value.detach().requires_grad_()
        y = msda.ms_deform_attn_fused(v, shapes, start, ref, off, logits, deterministic=True)
        out[f"fused{k}"] = y.detach()
        for i, t in enumerate(torch.autograd.grad(y, [v, ref, off, logits], torch.ones_like(y))):
            out[f"fused{k}_grad_{i}"] = t

    x = torch.randn(3, 5, 16, generator=gen).to(device).requires_grad_()
    w = torch.randn(8, 16, generator=gen).to(device).requires_grad_()
    b = torch.randn(8, generator=gen).to(device).requires_grad_()
    y = torch.ops.ms_deform_attn._linear(x, w, b)
    out["linear"] = y.detach()
    for i, t in enumerate(torch.autograd.grad(y, [x, w, b], torch.ones_like(y))):
        out[f"linear_grad_{i}"] = t

    # Autocast: the value as it comes, locations and weights in float32;
    # _linear in the autocast dtype.
    with torch.autocast(device, dtype=torch.bfloat16):
        y = msda.ms_deform_attn(value.detach().bfloat16(), shapes, start,
                                loc.detach().bfloat16(), attn.detach().bfloat16())
        out["autocast"] = y
        out["autocast_linear"] = torch.ops.ms_deform_attn._linear(x.detach(), w.detach(), b.detach())

    ins = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
    gv = torch.ops.ms_deform_attn._ms_deform_attn_backward(g, *ins, True)[0]
    try:
        torch.autograd.grad(gv.sum(), [ins[0]])
        out["double_backward"] = "no error"
    except RuntimeError as exc:
        out["double_backward"] = str(exc).splitlines()[0]
    return out


def _python_path_results(device: str, tmp_path) -> dict:
    """run_calls in a fresh process where the Python registrations serve."""
    path = tmp_path / f"python-{device}.pt"
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import sys; sys.path.insert(0, {here!r}); sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
            "import torch, ms_deform_attn\n"
            "assert ms_deform_attn._ops.torch_layer is None, ms_deform_attn._ops.torch_layer\n"
            "from test_autograd_paths import run_calls\n"
            f"torch.save(run_calls({device!r}), {str(path)!r})\n")
    env = dict(os.environ, MS_DEFORM_ATTN_PYTHON_AUTOGRAD="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=600)
    return torch.load(path)


@pytest.mark.parametrize("device", DEVICES)
def test_python_registrations_match_the_cpp_layer(device, tmp_path):
    import ms_deform_attn as msda

    if msda._ops.torch_layer is None:
        pytest.skip("this process runs the Python registrations already (no C++ layer for this torch)")
    cpp = run_calls(device)
    py = _python_path_results(device, tmp_path)
    assert cpp.keys() == py.keys()
    assert "double backward" in cpp["double_backward"], cpp["double_backward"]
    for name in cpp:
        a, b = cpp[name], py[name]
        if isinstance(a, str):
            assert a == b, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.cpu(), b.cpu()), name
    assert cpp["autocast"].dtype == torch.bfloat16 and cpp["autocast_linear"].dtype == torch.bfloat16


def test_layer_loading_names_the_release():
    """The package says which autograd serves: the C++ layer of this torch
    release when the build has it (an in-place build always does)."""
    import ms_deform_attn as msda
    from ms_deform_attn import _layer

    if os.environ.get("MS_DEFORM_ATTN_PYTHON_AUTOGRAD") == "1":
        assert msda._ops.torch_layer is None
    elif os.path.exists(_layer.layer_path()):
        assert msda._ops.torch_layer == _layer.release(torch.__version__)
        assert torch._C._dispatch_has_kernel_for_dispatch_key("ms_deform_attn::ms_deform_attn",
                                                                "Autograd")
    else:
        assert msda._ops.torch_layer is None
    assert _layer.release("2.14.1+cu130") == "2.14"
    assert _layer.layer_path("2.13.0").endswith(os.path.join("lib", "torch2_13",
                                                             "libms_deform_attn_torch.so"))


# The kernels of the library's tables (csrc/binding/kernel_table.h), by dispatch key.
TABLE_KERNELS = {
    "CPU": ["ms_deform_attn", "_ms_deform_attn_backward", "_column_sum"],
    "CompositeExplicitAutograd": ["ms_deform_attn_fused", "_ms_deform_attn_fused_backward",
                                  "_ms_deform_attn_fused_backward_ref", "_linear"],
    "CUDA": ["ms_deform_attn", "_ms_deform_attn_backward", "_column_sum", "ms_deform_attn_fused",
             "_ms_deform_attn_fused_backward"],
}


def registered_at(op: str, key: str) -> str:
    """The source file that registered op's kernel for key ("" if none)."""
    for line in torch._C._dispatch_dump(f"ms_deform_attn::{op}").splitlines():
        name, _, rest = line.partition(": registered at ")
        if rest and name.split("[")[0] == key:
            return os.path.basename(rest.split(":")[0])
    return ""


def test_kernels_are_registered_by_one_home():
    """The layer registers the library's kernels unboxed (kernels.cpp); a
    process without it registers them boxed through the stable ABI
    (registration.cpp); a CPU-only build answers CUDA tensors from
    cpu_only.cpp either way."""
    import ms_deform_attn as msda

    home = "kernels.cpp" if msda._ops.torch_layer else "registration.cpp"
    for key, ops in TABLE_KERNELS.items():
        for op in ops:
            expected = home
            if key == "CUDA" and not msda._ops._CUDA_KERNELS:
                expected = "cpu_only.cpp"
            assert registered_at(op, key) == expected, (op, key)
