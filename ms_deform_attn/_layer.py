"""Kernels, autograd and autocast of the operators, for the torch that runs them.

The operator library (lib/libms_deform_attn.so, LibTorch's stable ABI)
loads into every torch from its target release on and registers the
schemas. Autograd and autocast need LibTorch's full C++ API, which changes
between releases; they, and the registration of the library's kernels,
come from one of two places:

- the C++ layer built for this torch release
  (lib/torch<major>_<minor>/libms_deform_attn_torch.so, from
  csrc/layer, shipped in share/ms_deform_attn/src: the same code LibTorch
  programs build), when
  this build carries one: the fast path (kernels registered unboxed);
- else the library's kernels registered through the stable ABI (boxed,
  _C.register_boxed_kernels) and the Python registrations below
  (torch.library): the same results, gradients, saved tensors and autocast
  casts, but each call pays some tens of microseconds of host time more
  (docs/performance.md, "Host cost of a call"). A warning says so once.

MS_DEFORM_ATTN_PYTHON_AUTOGRAD=1 takes the Python registrations even where
a C++ layer exists (the tests run both).
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

_here = os.path.dirname(os.path.abspath(__file__))


def release(version: str) -> str:
    """"2.14" of "2.14.1+cu130"."""
    return ".".join(version.split("+")[0].split(".")[:2])


def layer_path(version: Optional[str] = None) -> str:
    major, minor = release(version or torch.__version__).split(".")
    return os.path.join(_here, "lib", f"torch{major}_{minor}", "libms_deform_attn_torch.so")


def layers_built() -> list:
    """The torch releases this build carries a C++ layer for."""
    lib = os.path.join(_here, "lib")
    found = []
    for name in sorted(os.listdir(lib)) if os.path.isdir(lib) else []:
        if name.startswith("torch") and os.path.exists(os.path.join(lib, name, "libms_deform_attn_torch.so")):
            found.append(name[len("torch"):].replace("_", "."))
    return found


def load() -> Optional[str]:
    """Registers autograd and autocast; returns the release of the C++ layer
    it loaded, or None where it registered the Python ones."""
    path = layer_path()
    forced = os.environ.get("MS_DEFORM_ATTN_PYTHON_AUTOGRAD", "0") == "1"
    if not forced and os.path.exists(path):
        torch.ops.load_library(path)
        return release(torch.__version__)
    from . import _C
    _C.register_boxed_kernels()
    _register_python()
    if not forced:
        built = ", ".join(layers_built()) or "none"
        warnings.warn(
            f"ms_deform_attn: this build has its C++ autograd layer for torch {built}, not for "
            f"torch {torch.__version__}; the operators run with autograd and autocast registered "
            "from Python (the same results, some tens of microseconds more host time per call). "
            "Build from source against this torch (pip install --no-build-isolation .) for the "
            "C++ layer.", RuntimeWarning, stacklevel=3)
    return None


# ---- the Python registrations ---------------------------------------------------------
_lib = torch.ops.ms_deform_attn


def _deterministic(flag: Optional[bool]) -> bool:
    """None is decided when the backward runs, as torch's own ops do."""
    return torch.are_deterministic_algorithms_enabled() if flag is None else bool(flag)


def _forward_setup(ctx, inputs, output):
    value, shapes, start, loc, attn, _backend, deterministic, _shapes_list = inputs
    ctx.save_for_backward(value, shapes, start, loc, attn)
    ctx.deterministic = deterministic


def _forward_backward(ctx, grad):
    value, shapes, start, loc, attn = ctx.saved_tensors
    gv, gl, ga = _lib._ms_deform_attn_backward(grad, value, shapes, start, loc, attn,
                                                _deterministic(ctx.deterministic))
    return gv, None, None, gl, ga, None, None, None


def _fused_setup(ctx, inputs, output):
    value, shapes, start, ref, off, logits, _backend, deterministic, _shapes_list = inputs
    ctx.save_for_backward(value, shapes, start, ref, off, logits)
    ctx.deterministic = deterministic


def _fused_backward(ctx, grad):
    saved = ctx.saved_tensors
    det = _deterministic(ctx.deterministic)
    grad_ref = None
    if ctx.needs_input_grad[3]:
        # The reference points' gradient sums over heads and points: ATen ops.
        gv, goff, glog, grad_ref = _lib._ms_deform_attn_fused_backward_ref(grad, *saved, det)
    else:
        gv, goff, glog = _lib._ms_deform_attn_fused_backward(grad, *saved, det)
    return gv, None, None, grad_ref, goff, glog, None, None, None


def _linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_backward(ctx, grad):
    # torch's linear backward, but the bias gradient is _column_sum (one
    # read of the gradient at the copy rate).
    x, weight = ctx.saved_tensors
    gx = gw = gb = None
    if ctx.needs_input_grad[0]:
        gx = grad.matmul(weight)
    if ctx.needs_input_grad[1]:
        gw = grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
    if ctx.has_bias and ctx.needs_input_grad[2]:
        gb = _lib._column_sum(grad)
    return gx, gw, gb


def _no_double_backward(ctx, *grads):
    raise RuntimeError("ms_deform_attn: double backward (differentiating the gradient) is not "
                       "supported")


def _fp32(t):
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _autocast_kernels(library, key: str, device: str):
    exclude = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def forward(value, shapes, start, loc, attn, backend="auto", deterministic=None,
                spatial_shapes_list=None):
        # The value as it comes (its projection ran in the autocast dtype);
        # locations and weights in float32.
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            return _lib.ms_deform_attn(value, shapes, start, _fp32(loc), _fp32(attn), backend,
                                       deterministic, spatial_shapes_list)

    def linear(x, weight, bias=None):
        # As torch's linear under autocast: floating arguments but fp64 in
        # the autocast dtype.
        dtype = torch.get_autocast_dtype(device)

        def cast(t):
            if t is not None and t.is_floating_point() and t.dtype != torch.float64:
                return t.to(dtype)
            return t

        with torch._C._ExcludeDispatchKeyGuard(exclude):
            return _lib._linear(cast(x), cast(weight), cast(bias))

    library.impl("ms_deform_attn", forward, key)
    library.impl("_linear", linear, key)


_registered = []


def _register_python() -> None:
    if _registered:
        return
    reg = torch.library.register_autograd
    reg("ms_deform_attn::ms_deform_attn", _forward_backward, setup_context=_forward_setup)
    reg("ms_deform_attn::ms_deform_attn_fused", _fused_backward, setup_context=_fused_setup)
    reg("ms_deform_attn::_linear", _linear_backward, setup_context=_linear_setup)
    reg("ms_deform_attn::_ms_deform_attn_backward", _no_double_backward)
    library = torch.library.Library("ms_deform_attn", "IMPL")
    _autocast_kernels(library, "AutocastCUDA", "cuda")
    _autocast_kernels(library, "AutocastCPU", "cpu")
    _registered.append(library)
