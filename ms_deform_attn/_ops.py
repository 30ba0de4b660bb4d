"""Python side of the operator: public wrappers and the fake kernels
(torch.compile, export). Schemas and kernels are C++ (lib/libms_deform_attn.so,
shared with LibTorch programs); autograd and autocast the C++ layer for this
torch release, or Python registrations where the build has none (_layer.py)."""
from __future__ import annotations

import glob
import os
import sys
from typing import Dict, List, Optional, Sequence, Union

import torch

_here = os.path.dirname(os.path.abspath(__file__))
if not glob.glob(os.path.join(_here, "_C*")):
    # Said before the import is tried: a failed `from . import _C` inside the
    # package's own import reads as a circular import.
    raise ImportError(
        f"ms_deform_attn: the compiled extension is not in {_here}. In a source checkout, "
        "build it in place (`make build`, or `pip install --no-build-isolation -e .`); if the "
        "package was installed with `pip install .`, run Python from another directory (the "
        "checkout's ms_deform_attn/ folder hides the installed package).")


def _check_torch() -> None:
    """The operator library loads into its stable ABI target release and
    every later torch; an older torch (or a torch of another CUDA major
    version) would fail in the dynamic loader with a missing symbol or
    library. Say so first, naming what was found and what is needed."""
    try:
        from . import _build_info as built
    except ImportError:  # a build older than the file
        return
    release = lambda v: tuple(int(x) for x in v.split("+")[0].split(".")[:2])  # noqa: E731
    cuda_major = lambda v: v.split(".")[0] if v else None  # noqa: E731
    ours = f"torch {built.TORCH_VERSION}" + (f" (CUDA {built.CUDA_VERSION})" if built.CUDA_VERSION else "")
    oldest = getattr(built, "STABLE_TARGET", None)
    if oldest is None:  # a version-bound build
        if release(built.TORCH_VERSION) != release(torch.__version__):
            raise ImportError(
                f"ms_deform_attn was built against {ours}, but torch {torch.__version__} is installed: "
                f"install torch=={'.'.join(map(str, release(built.TORCH_VERSION)))}.*, or build "
                "ms_deform_attn for this torch (pip install --no-build-isolation . from source)")
    elif release(torch.__version__) < release(oldest):
        raise ImportError(
            f"ms_deform_attn needs torch {oldest} or newer (its operator library is built for "
            f"LibTorch's stable ABI of torch {oldest}; this build was made with {ours}), but torch "
            f"{torch.__version__} is installed: pip install 'torch>={oldest}'")
    if built.CUDA_VERSION and cuda_major(built.CUDA_VERSION) != cuda_major(torch.version.cuda):
        raise ImportError(
            f"ms_deform_attn was built against {ours}, but this torch has "
            f"{'CUDA ' + torch.version.cuda if torch.version.cuda else 'no CUDA'}: install a torch "
            f"built for CUDA {cuda_major(built.CUDA_VERSION)}.x, or a build of ms_deform_attn for "
            "this torch's CUDA (the wheel for it, or from source)")


_check_torch()
from . import _C  # noqa: F401,E402  (loads lib/libms_deform_attn.so: schemas and kernels)
from . import _layer  # noqa: E402

# The torch release of the C++ autograd layer loaded, or None where autograd
# and autocast are registered from Python (_layer.py).
torch_layer = _layer.load()

_lib = torch.ops.ms_deform_attn

# The operator in plain PyTorch ops (reference.ms_deform_attn_plain), accepted
# as a backend by the Python entry points and the layers (not by the C++
# operator): slow, every device, float64 too.
REFERENCE_BACKEND = "pytorch"


_CUDA_KERNELS = bool(_lib._built_with_cuda())


def _warn_without_cuda_kernels() -> None:
    """A build without the CUDA kernels imported where a GPU is visible:
    said at import, where a pip user sees it (pip hides the build's own
    notice), instead of at the first CUDA call."""
    if _CUDA_KERNELS:
        return
    if torch.version.cuda is None or not torch.cuda.is_available():
        return
    import warnings
    warnings.warn(
        "ms_deform_attn was built without its CUDA kernels (no nvcc was found at build time), "
        f"but this torch sees a GPU ({torch.cuda.get_device_name(0)}): CUDA tensors will raise. "
        f"Rebuild with the CUDA toolkit {torch.version.cuda} on the PATH (or CUDA_HOME set), e.g. "
        "`FORCE_CUDA=1 pip install --no-build-isolation --force-reinstall --no-deps .`.",
        RuntimeWarning, stacklevel=3)


_warn_without_cuda_kernels()


def cuda_archs() -> str:
    """The CUDA architectures this build has kernels for, as
    TORCH_CUDA_ARCH_LIST gave them to the compiler ("8.0;8.6;...;12.0+PTX");
    "" without CUDA kernels. A GPU none of them runs on gets an error naming
    both at its first call."""
    return str(_lib._cuda_archs())


def cuda_kernels_built() -> bool:
    """Whether this build has the CUDA kernels (setup.py compiles them when
    torch has CUDA and nvcc is found, or with FORCE_CUDA=1). A CPU-only build
    given CUDA tensors raises an error that says how to rebuild."""
    return _CUDA_KERNELS


def ms_deform_attn(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    *,
    backend: str = "auto",
    deterministic: Optional[bool] = None,
    spatial_shapes_list: Optional[Sequence] = None,
) -> torch.Tensor:
    """Multi-scale deformable attention (Deformable DETR, eq. 2).

    Args:
        value: (N, S, M, D), float32 / float16 / bfloat16 / float64. Read in
            place when contiguous or head-major (``v.transpose(1, 2)`` of a
            contiguous (N, M, S, D) tensor ``v``; its gradient then comes
            back head-major too); any other layout is copied.
        spatial_shapes: (L, 2) int64, (H, W) of each level, on value's device.
        level_start_index: (L,) int64, exclusive cumulative sum of H * W.
        sampling_locations: (N, Lq, M, L, P, 2), normalised (x, y); in value's
            dtype or float32. Locations outside [0, 1] are legal.
        attention_weights: (N, Lq, M, L, P), in value's dtype or float32.
        backend: "auto" or a name from available_backends(value.device);
            "pytorch" runs the operator in plain PyTorch ops (slow; the
            kernels' coordinate arithmetic). The environment
            variable MS_DEFORM_ATTN_BACKEND overrides "auto".
        deterministic: whether the backward must give bitwise identical
            gradients on every run (grad_value by grouping the samples,
            through a global sort or, where one (batch, head, level)'s
            samples fit a block, a block-local one, instead of atomics).
            None (default) follows torch.are_deterministic_algorithms_enabled()
            at backward time. Without it the backward takes whichever path is
            faster: on CUDA with 16-bit values the sorted one on dense
            sampling (encoders) and the block-local one on the decoders, both
            reproducible too; elsewhere atomics (docs/backward.md). The
            forward is deterministic either way.
        spatial_shapes_list: the level shapes on the host, [(H, W), ...] (what
            transformers passes as value_spatial_shapes_list), equal to
            spatial_shapes. Optional; the `tma` backend needs it to build its
            copy descriptors without reading spatial_shapes back from the GPU
            (a sync). `auto` never picks `tma` (an explicit request).

    Returns:
        (N, Lq, M * D) in value's dtype.
    """
    if backend == REFERENCE_BACKEND:
        from .reference import ms_deform_attn_plain
        return ms_deform_attn_plain(value, spatial_shapes, level_start_index, sampling_locations,
                                    attention_weights)
    if type(value) is not torch.Tensor:
        _sharding_rules_if_distributed()
    return _lib.ms_deform_attn(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend,
        deterministic, _flat_shapes(spatial_shapes_list),
    )


def ms_deform_attn_fused(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    level_start_index: torch.Tensor,
    reference_points: torch.Tensor,
    sampling_offsets: torch.Tensor,
    attention_logits: torch.Tensor,
    *,
    backend: str = "auto",
    deterministic: Optional[bool] = None,
    spatial_shapes_list: Optional[Sequence] = None,
) -> torch.Tensor:
    """ms_deform_attn from the attention layer's raw outputs: the sampling
    locations and the softmax are formed inside the operator in float32, and
    autograd keeps these inputs (16-bit under autocast, as the linear layers
    made them) instead of the float32 locations and weights of size
    N x Lq x M x L x P.

    Args:
        value, spatial_shapes, level_start_index: as for ms_deform_attn.
        reference_points: (N, Lq, L, 2) normalised points (x, y), location =
            point + offset / (W, H) of the level; or (N, Lq, L, 4) boxes
            (cx, cy, w, h), location = (cx, cy) + offset / P * (w, h) * 0.5
            (Deformable DETR's two forms).
        sampling_offsets: (N, Lq, M, L, P, 2).
        attention_logits: (N, Lq, M, L * P) or (N, Lq, M, L, P); the weights
            are their softmax over the L * P of each (n, q, m).
        backend, deterministic, spatial_shapes_list: as for ms_deform_attn.

    Returns:
        (N, Lq, M * D) in value's dtype; gradients come back in each input's
        dtype.
    """
    if backend == REFERENCE_BACKEND:
        from .reference import fused_locations_and_weights, ms_deform_attn_plain
        loc, weights = fused_locations_and_weights(spatial_shapes, reference_points,
                                                   sampling_offsets, attention_logits)
        return ms_deform_attn_plain(value, spatial_shapes, level_start_index, loc, weights)
    if type(value) is not torch.Tensor:
        _sharding_rules_if_distributed()
    return _lib.ms_deform_attn_fused(
        value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
        attention_logits, backend, deterministic, _flat_shapes(spatial_shapes_list),
    )


def _sharding_rules_if_distributed() -> None:
    """The DTensor sharding rules (ms_deform_attn.distributed), registered
    once DTensor is in use: checked by the entry points only for inputs that
    are not plain tensors (a DTensor among them), so that importing this
    package does not import torch.distributed.tensor (0.6 s). Where DTensor
    was imported first, the package registers them at import; call
    ms_deform_attn.distributed.register() to do it explicitly."""
    if "torch.distributed.tensor" in sys.modules:
        from .distributed import register
        register()


def _flat_shapes(shapes: Optional[Sequence]) -> Optional[List[int]]:
    """[(H, W), ...] (or already flat [H, W, ...]) as the flat int list the
    operator's schema takes. None where a size is symbolic (torch.export or
    torch.compile with dynamic image sizes): the list is a host-side copy of
    spatial_shapes, and making it ints would fix the image size in the
    traced program (only the `tma` backend needs it)."""
    if shapes is None:
        return None
    flat: List = []
    for item in shapes:
        flat.extend(item if isinstance(item, (tuple, list, torch.Size)) else (item,))
    if any(isinstance(v, torch.SymInt) for v in flat):
        return None
    return [int(v) for v in flat]


def available_backends(device: Optional[Union[str, torch.device]] = None) -> List[str]:
    """Backends that can run on `device` (default: the current CUDA device if
    there is one, else the CPU), in the order "auto" prefers them, then
    "pytorch" (plain PyTorch ops, never picked by "auto"). A backend
    listed here may still refuse particular inputs (its predicate says why).
    Without a visible CUDA device (or without the CUDA kernels in this build)
    "cuda" has none."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not (torch.cuda.is_available() and cuda_kernels_built()):
        return []
    return list(_lib._available_backends(device)) + [REFERENCE_BACKEND]


def select_backend(value, spatial_shapes, level_start_index, sampling_locations,
                   attention_weights, spatial_shapes_list=None) -> str:
    """The backend that backend="auto" resolves to for these inputs: the
    "backend" of select_forward_plan(), which gives the whole plan."""
    return select_forward_plan(value, spatial_shapes, level_start_index, sampling_locations,
                               attention_weights, spatial_shapes_list=spatial_shapes_list)["backend"]


def _device_list(device) -> Optional[List[int]]:
    """A device description (a mapping with DeviceInfo's fields: major,
    minor, sms, smem_optin, smem_per_sm, smem_reserved; testing.DEVICES has
    some) as the queries' int list, or None."""
    if device is None:
        return None
    keys = ("major", "minor", "sms", "smem_optin", "smem_per_sm", "smem_reserved")
    missing = [k for k in keys if k not in device]
    if missing:
        raise ValueError(f"device must give {', '.join(keys)}; missing {', '.join(missing)}")
    return [int(device[k]) for k in keys]


def _plan(query, *args) -> Dict[str, object]:
    """A planner query's answer as a dict, its fields named as the query's
    schema names its returns (csrc/operator/ops.cpp: one place)."""
    names = [r.name for r in query.default._schema.returns]
    return dict(zip(names, query(*args)))


def select_forward_plan(value, spatial_shapes, level_start_index, sampling_locations,
                        attention_weights, *, spatial_shapes_list=None, fused: bool = False,
                        backend: str = "auto", device=None) -> Dict[str, object]:
    """The plan the forward makes for these inputs (csrc/plan/forward_plan.h):
    {"backend", "composite" (ms_deform_attn_fused: the ATen composite
    serves it), "copy_value" (value copied for the backend's alignment),
    "vec", "lanes", "threads", "split" (`blocked`: groups a row with per-lane
    set-up, 0 for the shared slots), "one_level" (`blocked`'s slots for one
    level, without the level table), "blocks_per_head", "blocks", "resident"
    (blocks an SM the carve-out is sized for), "smem_budget" (the caching
    backends' bytes), "workspace"}. `backend`: "auto" (the
    MS_DEFORM_ATTN_BACKEND override applies) or a name; raises with the
    reason when it cannot run these inputs. On value's device (CPU tensors:
    the `cpu` kernel), or on the CUDA device `device` describes (a mapping
    of major, minor, sms, smem_optin, smem_per_sm, smem_reserved:
    ms_deform_attn.testing.DEVICES), which need not be there. `fused`: the
    plan of ms_deform_attn_fused for the same sizes."""
    if backend == REFERENCE_BACKEND:
        return {"backend": REFERENCE_BACKEND}
    return _plan(_lib._select_forward_plan, value, spatial_shapes, level_start_index,
                 sampling_locations, attention_weights, _flat_shapes(spatial_shapes_list), fused,
                 backend, _device_list(device))


def backend_reason(backend, value, spatial_shapes, level_start_index, sampling_locations,
                   attention_weights, spatial_shapes_list=None) -> str:
    """Why `backend` cannot run these inputs (its predicate), or "" when it
    can; raises for invalid inputs like the operator does."""
    if backend == REFERENCE_BACKEND:
        return ""
    return _lib._backend_reason(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend,
        _flat_shapes(spatial_shapes_list),
    )


def select_backward_plan(value, spatial_shapes, level_start_index, sampling_locations,
                         attention_weights, *, fused: bool = False, deterministic: bool = False,
                         grad_value: str = "auto", sms: Optional[int] = None,
                         device=None) -> Dict[str, object]:
    """The plan the CUDA backward makes for these inputs
    (csrc/plan/backward_plan.h), through the backward's own path:
    {"grad_value": "atomic" | "sorted" | "local", "dots": "ffma" | "mma" |
    "mma_flat" | "mma_rows", "vec": int, "gather": "none" | "pixels" |
    "tiles", "gather_vec": int, "stage": bool (the block-local walk reads
    grad_output and the weights from shared memory), "self_records": bool
    (it resolves its samples itself, beside the dots kernel), "composite":
    bool}.
    `fused`: the backward of
    ms_deform_attn_fused; `grad_value`: a path asked for ("atomic",
    "sorted", "local"), or "auto", which takes MS_DEFORM_ATTN_GRAD_VALUE as
    the backward does. The device is the one `device` describes (as for
    select_forward_plan), else value's CUDA device, else an H100; `sms`
    replaces its SM count. grad_output is taken as contiguous."""
    return _plan(_lib._select_backward_plan, value, spatial_shapes, level_start_index,
                 sampling_locations, attention_weights, fused, deterministic, grad_value,
                 -1 if sms is None else int(sms), _device_list(device))


# ---- fake (meta) kernels -----------------------------------------------------
def _same_device(op: str, anchor: str, tensors) -> None:
    """Every tensor on the device of the first (`anchor`), as the kernels'
    validation requires. The dispatcher runs these fake kernels whenever one
    input is on the meta device, also beside real tensors: without this a
    CPU value with meta locations would return uninitialised memory."""
    device = tensors[0][1].device
    for name, t in tensors[1:]:
        if t is not None and t.device != device:
            raise RuntimeError(f"{op}: {name} must be on the same device as {anchor} ({device}), "
                               f"got {t.device}")


def _same_device_as_value(op, value, spatial_shapes, level_start_index, *named):
    _same_device(op, "value", [("value", value), ("spatial_shapes", spatial_shapes),
                               ("level_start_index", level_start_index), *named])


@torch.library.register_fake("ms_deform_attn::ms_deform_attn")
def _forward_fake(value, spatial_shapes, level_start_index, sampling_locations,
                  attention_weights, backend="auto", deterministic=None,
                  spatial_shapes_list=None):
    _same_device_as_value("ms_deform_attn", value, spatial_shapes, level_start_index,
                          ("sampling_locations", sampling_locations),
                          ("attention_weights", attention_weights))
    torch._check(value.dim() == 4, lambda: "ms_deform_attn: value must have 4 dimensions")
    torch._check(sampling_locations.dim() == 6,
                 lambda: "ms_deform_attn: sampling_locations must have 6 dimensions")
    n, _, m, d = value.shape
    return value.new_empty((n, sampling_locations.shape[1], m * d))


def _grad_value_fake(value):
    """grad_value's fake: value's own layout when value is head-major (the
    transpose(1, 2) view of a contiguous (N, M, S, D) tensor, read in place),
    else contiguous, as csrc/operator/output.h's value_shaped allocates it."""
    if value.dim() == 4 and not value.is_contiguous() and value.transpose(1, 2).is_contiguous():
        return torch.empty_like(value.transpose(1, 2), memory_format=torch.contiguous_format).transpose(1, 2)
    return torch.empty_like(value, memory_format=torch.contiguous_format)


@torch.library.register_fake("ms_deform_attn::_ms_deform_attn_backward")
def _backward_fake(grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                   attention_weights, deterministic=False):
    _same_device_as_value("ms_deform_attn", value, spatial_shapes, level_start_index,
                          ("sampling_locations", sampling_locations),
                          ("attention_weights", attention_weights), ("grad_output", grad_output))
    return (
        _grad_value_fake(value),
        torch.empty_like(sampling_locations, memory_format=torch.contiguous_format),
        torch.empty_like(attention_weights, memory_format=torch.contiguous_format),
    )


@torch.library.register_fake("ms_deform_attn::_ms_deform_attn_fused_backward")
def _fused_backward_fake(grad_output, value, spatial_shapes, level_start_index, reference_points,
                         sampling_offsets, attention_logits, deterministic=False):
    _same_device_as_value("ms_deform_attn_fused", value, spatial_shapes, level_start_index,
                          ("reference_points", reference_points),
                          ("sampling_offsets", sampling_offsets),
                          ("attention_logits", attention_logits), ("grad_output", grad_output))
    return (
        _grad_value_fake(value),
        torch.empty_like(sampling_offsets, memory_format=torch.contiguous_format),
        torch.empty_like(attention_logits, memory_format=torch.contiguous_format),
    )


@torch.library.register_fake("ms_deform_attn::_ms_deform_attn_fused_backward_ref")
def _fused_backward_ref_fake(grad_output, value, spatial_shapes, level_start_index,
                             reference_points, sampling_offsets, attention_logits,
                             deterministic=False):
    return _fused_backward_fake(grad_output, value, spatial_shapes, level_start_index,
                                reference_points, sampling_offsets, attention_logits,
                                deterministic) + (
        torch.empty_like(reference_points, memory_format=torch.contiguous_format),)


@torch.library.register_fake("ms_deform_attn::ms_deform_attn_fused")
def _fused_fake(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                attention_logits, backend="auto", deterministic=None, spatial_shapes_list=None):
    _same_device_as_value("ms_deform_attn_fused", value, spatial_shapes, level_start_index,
                          ("reference_points", reference_points),
                          ("sampling_offsets", sampling_offsets),
                          ("attention_logits", attention_logits))
    torch._check(value.dim() == 4, lambda: "ms_deform_attn_fused: value must have 4 dimensions")
    torch._check(reference_points.dim() == 4,
                 lambda: "ms_deform_attn_fused: reference_points must have 4 dimensions")
    n, _, m, d = value.shape
    return value.new_empty((n, reference_points.shape[1], m * d))


@torch.library.register_fake("ms_deform_attn::_linear")
def _linear_fake(input, weight, bias=None):
    _same_device("ms_deform_attn._linear", "input",
                 [("input", input), ("weight", weight), ("bias", bias)])
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


@torch.library.register_fake("ms_deform_attn::_column_sum")
def _column_sum_fake(grad):
    torch._check(grad.dim() >= 1, lambda: "ms_deform_attn._column_sum: grad must have at least 1 dimension")
    return grad.new_empty((grad.shape[-1],))


_sharding_rules_if_distributed()
