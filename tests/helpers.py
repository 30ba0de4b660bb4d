"""Shared helpers for the tests: random problems, error metric, device/backend grid."""
from __future__ import annotations


import pytest
import torch

import ms_deform_attn as msda
from ms_deform_attn import testing as W
from ms_deform_attn.nn import MSDeformAttn
from ms_deform_attn.reference import ms_deform_attn_pytorch
from ms_deform_attn.testing import level_tensors

# ||out - ref|| / ||ref|| bounds against the float64 reference.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def kernel_backends(device):
    """The backends with kernels of their own on `device` (available_backends
    without "pytorch", the reference they are compared with)."""
    return [b for b in msda.available_backends(device) if b != "pytorch"]


def device_backends(reference=False):
    """("cpu", "cpu") plus ("cuda", b) for every CUDA backend; CUDA entries
    skip cleanly when there is no GPU. `reference`: also ("cpu", "pytorch")
    and ("cuda", "pytorch"), the grid_sample backend, which meets the same
    accuracy contract as the kernels."""
    params = [pytest.param("cpu", "cpu", id="cpu")]
    if reference:
        params.append(pytest.param("cpu", "pytorch", id="cpu-pytorch"))
    if torch.cuda.is_available():
        for b in kernel_backends("cuda") + (["pytorch"] if reference else []):
            params.append(pytest.param("cuda", b, id=f"cuda-{b}", marks=pytest.mark.cuda))
    else:
        params.append(pytest.param("cuda", "none", id="cuda",
                                   marks=pytest.mark.skip(reason="no CUDA device")))
    return params


def cuda_backends():
    """CUDA backends only (tests that make sense on the GPU alone)."""
    return [p for p in device_backends() if p.values[0] == "cuda"]


def make_inputs(n, lq, m, d, shapes, p, dtype, loc_dtype=None, device="cpu", outside=0.15,
                seed=None, requires_grad=False):
    """Random problem. About `outside` of the locations fall outside [0, 1]."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    loc_dtype = loc_dtype or dtype
    num_levels = len(shapes)
    shapes_t, start = level_tensors(shapes, device)
    s = int(sum(h * w for h, w in shapes))
    value = torch.randn(n, s, m, d, generator=g, dtype=torch.float64)
    # Spread so that the given fraction lands outside: uniform on [-a, 1 + a].
    a = outside / (2 * (1 - outside)) if outside > 0 else 0.0
    loc = torch.rand(n, lq, m, num_levels, p, 2, generator=g, dtype=torch.float64) * (1 + 2 * a) - a
    loc = away_from_pixel_borders(loc, shapes)
    attn = torch.rand(n, lq, m, num_levels, p, generator=g, dtype=torch.float64)
    attn = attn / attn.sum((-1, -2), keepdim=True)
    tensors = [value.to(dtype), loc.to(loc_dtype), attn.to(loc_dtype)]
    tensors = [t.to(device).requires_grad_(requires_grad) for t in tensors]
    value, loc, attn = tensors
    return value, shapes_t, start, loc, attn


def head_major(value):
    """The same values stored head-major: the (N, S, M, D) view of a
    contiguous (N, M, S, D) tensor, which the operator reads in place."""
    out = value.detach().transpose(1, 2).contiguous().transpose(1, 2)
    assert not out.is_contiguous() or out.size(2) == 1
    return out.requires_grad_(value.requires_grad)


LAYOUTS = pytest.mark.parametrize("layout", ["contiguous", "head_major"])


def in_layout(value, layout):
    """value as given (contiguous) or head-major (see head_major)."""
    return head_major(value) if layout == "head_major" else value


def bits(t):
    """The raw bytes of t, for bitwise comparisons that NaN (unequal to
    itself) does not break."""
    return t.detach().contiguous().view(torch.uint8)


def away_from_pixel_borders(loc, shapes, margin=1e-4):
    """Moves float64 locations that fall within `margin` pixels of a pixel
    border off it. The location gradient jumps at borders, and the kernels'
    fp32 coordinate x * W - 0.5 may round to the other side of an integer than
    the float64 reference's: both answers are right there, so random tests keep
    clear of borders (the border tests place locations on them on purpose)."""
    wh = torch.tensor([[w, h] for h, w in shapes], dtype=torch.float64)[None, None, None, :, None, :]
    pix = loc * wh - 0.5
    near = (pix - pix.round()).abs() < margin
    return torch.where(near, loc + 4 * margin / wh, loc)


def poisoned(loc, attn):
    """(N, Lq, M, L, P) mask of the samples whose location or weight is not
    finite: the operator makes their output rows, location and weight
    gradients NaN, and they add nothing to grad_value."""
    return ~(torch.isfinite(loc.detach()).all(-1) & torch.isfinite(attn.detach()))


def _clean64(loc, attn):
    """Float64 locations and weights with the poisoned samples made harmless
    (far outside, weight 0), and the poisoned mask."""
    bad = poisoned(loc, attn)
    loc64 = torch.where(bad[..., None], torch.full_like(loc.detach().double(), -10.0),
                        loc.detach().double())
    attn64 = torch.where(bad, torch.zeros_like(attn.detach().double()), attn.detach().double())
    return loc64, attn64, bad


def _poison_rows(out, bad):
    """NaN in the output rows (n, q, m) that hold a poisoned sample."""
    n, lq, md = out.shape
    rows = bad.flatten(3).any(-1).to(out.device)  # (N, Lq, M)
    m = rows.shape[-1]
    return out.view(n, lq, m, md // m).masked_fill(rows[..., None], float("nan")).view(n, lq, md)


def reference64(value, shapes, start, loc, attn):
    """Float64 reference on the same (rounded) inputs, poisoned rows NaN."""
    loc64, attn64, bad = _clean64(loc, attn)
    out = ms_deform_attn_pytorch(value.detach().double(), shapes, start, loc64, attn64)
    return _poison_rows(out, bad)


def reference64_grads(value, shapes, start, loc, attn, grad):
    """Float64 reference gradients of (value, loc, attn) for grad_output
    `grad`, on the same (rounded) inputs; NaN for the poisoned samples'
    location and weight gradients."""
    loc64, attn64, bad = _clean64(loc, attn)
    ref_in = [value.detach().double().requires_grad_(), loc64.requires_grad_(),
              attn64.requires_grad_()]
    out = ms_deform_attn_pytorch(ref_in[0], shapes, start, ref_in[1], ref_in[2])
    gv, gl, ga = torch.autograd.grad(out, ref_in, grad.double())
    nan = float("nan")
    return gv, gl.masked_fill(bad[..., None], nan), ga.masked_fill(bad, nan)


def rel_err(out, ref):
    """||out - ref|| / ||ref|| over the elements where ref is not NaN; out
    must be NaN exactly where ref is (the poisoned rows and gradients), so an
    unwritten element (poisoned with NaN beforehand) or a NaN from bad
    arithmetic fails."""
    out, ref = out.double(), ref.double().to(out.device)
    nan_ref = torch.isnan(ref)
    nan_out = torch.isnan(out)
    assert torch.equal(nan_out, nan_ref), (
        f"NaN in {int((nan_out & ~nan_ref).sum())} elements where the reference has none "
        f"(unwritten element or bad arithmetic), missing in {int((nan_ref & ~nan_out).sum())} "
        "where it has (a poisoned sample not propagated)")
    out, ref = out.masked_fill(nan_ref, 0.0), ref.masked_fill(nan_ref, 0.0)
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def host_shapes(shapes):
    """spatial_shapes as the host-side [(H, W), ...] list (a device-to-host copy:
    call it outside CUDA-graph capture and compiled regions), or None when
    spatial_shapes is not a valid (L, 2) integer tensor. The tests hand it to
    every call, as transformers does, so that the `tma` backend, which needs
    it, runs the same tests as the others."""
    if shapes.dim() != 2 or shapes.size(1) != 2 or shapes.is_floating_point():
        return None
    return [tuple(hw) for hw in shapes.tolist()]


def skip_unless_runs(backend, value, shapes, start, loc, attn, spatial_shapes_list=None):
    """Skips the test when `backend`'s predicate rejects these (valid) inputs,
    with its reason (e.g. tma: float64 values). Invalid inputs are left to the
    operator call that follows, which must raise."""
    try:
        why = msda.backend_reason(backend, value, shapes, start, loc, attn,
                                  spatial_shapes_list=spatial_shapes_list)
    except RuntimeError:
        return
    if why:
        pytest.skip(f"{backend} cannot run these inputs: {why}")


def run(value, shapes, start, loc, attn, backend, **kwargs):
    """The operator with host-side shapes (see host_shapes), skipping inputs
    the backend's predicate rejects."""
    hs = host_shapes(shapes)
    skip_unless_runs(backend, value, shapes, start, loc, attn, hs)
    return msda.ms_deform_attn(value, shapes, start, loc, attn, backend=backend,
                               spatial_shapes_list=hs, **kwargs)


def budget_error(monkeypatch, backend, budget, inputs):
    """Relative error against float64 of a caching backend (persistent,
    cluster) run with MS_DEFORM_ATTN_SMEM_BUDGET = `budget` bytes of shared
    memory for its cache (-1: the backend's default)."""
    monkeypatch.setenv("MS_DEFORM_ATTN_SMEM_BUDGET", str(budget))
    return rel_err(run(*inputs, backend), reference64(*inputs))


def reference_gather(value, shapes, start, loc, attn):
    """Float64 MSDA by direct corner gathers (no grid_sample, no float64 copy
    of value): for a few queries against a value tensor too large to copy.
    spatial_shapes on the host or the device; rows with a poisoned sample
    (non-finite location or weight) are NaN. Differentiable in loc and attn."""
    n, _, m, d = value.shape
    levels = [(int(h), int(w)) for h, w in shapes.tolist()]
    starts = [int(s) for s in start.tolist()]
    out = torch.zeros(loc.shape[:3] + (d,), dtype=torch.float64, device=value.device)
    n_idx = torch.arange(n, device=value.device)[:, None, None, None]
    m_idx = torch.arange(m, device=value.device)[None, None, :, None]
    for lvl, (h, w) in enumerate(levels):
        x = loc[..., lvl, :, 0].double() * w - 0.5  # (N, Q, M, P)
        y = loc[..., lvl, :, 1].double() * h - 0.5
        a = attn[..., lvl, :].double()
        finite = torch.isfinite(x) & torch.isfinite(y) & torch.isfinite(a)
        x = torch.where(finite, x, torch.full_like(x, -10.0))
        y = torch.where(finite, y, torch.full_like(y, -10.0))
        a = torch.where(finite, a, torch.zeros_like(a))
        x0, y0 = x.detach().floor(), y.detach().floor()
        for dy in (0, 1):
            for dx in (0, 1):
                xi, yi = x0 + dx, y0 + dy
                wgt = (1 - (x - xi).abs()) * (1 - (y - yi).abs())
                ok = (xi >= 0) & (xi < w) & (yi >= 0) & (yi < h)
                pix = starts[lvl] + (yi.clamp(0, h - 1) * w + xi.clamp(0, w - 1)).long()
                v = value[n_idx, pix, m_idx].double()  # (N, Q, M, P, D)
                out = out + ((wgt * ok * a)[..., None] * v).sum(3)
    return _poison_rows(out.reshape(out.shape[0], out.shape[1], m * d), poisoned(loc, attn))


# ---- small transformers detectors (random weights) -------------------------
def tiny_deformable_detr(device):
    pytest.importorskip("transformers")
    from ms_deform_attn.testing import small_deformable_detr
    return small_deformable_detr(device)


def tiny_rt_detr(device):
    transformers = pytest.importorskip("transformers")
    bb = transformers.RTDetrResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
        out_features=["stage2", "stage3", "stage4"], layer_type="basic",
        downsample_in_first_stage=False)
    cfg = transformers.RTDetrConfig(
        backbone_config=bb, encoder_in_channels=[32, 64, 128], decoder_in_channels=[32, 32, 32],
        d_model=32, encoder_hidden_dim=32, encoder_ffn_dim=32, decoder_ffn_dim=32,
        encoder_attention_heads=4, decoder_attention_heads=4, decoder_layers=1, num_queries=10,
        use_pretrained_backbone=False)
    torch.manual_seed(0)
    model = transformers.RTDetrModel(cfg)
    # transformers' initialisation leaves this small model's encoder scores
    # all equal, so its top-k query selection is a tie everywhere (ONNX
    # Runtime and PyTorch then pick different queries): perturb every weight.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.to(device).eval()


# ---- the attention modules (MSDeformAttn) -------------------------------------
MODULE_LEVELS = [(12, 15), (6, 8), (3, 4)]


def module_inputs(device, n=2, lq=17, d_model=64, boxes=False, mask=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes, start = level_tensors(MODULE_LEVELS, device)
    s = sum(h * w for h, w in MODULE_LEVELS)
    query = torch.randn(n, lq, d_model, generator=g).to(device)
    flat = torch.randn(n, s, d_model, generator=g).to(device)
    ref = torch.rand(n, lq, len(MODULE_LEVELS), 4 if boxes else 2, generator=g).to(device)
    if boxes:
        ref[..., 2:] = ref[..., 2:] * 0.5 + 0.05
    pad = (torch.rand(n, s, generator=g) < 0.2).to(device) if mask else None
    # The host-side shapes last (the `tma` backend needs them).
    return query, ref, flat, shapes, start, pad, MODULE_LEVELS


VALUE_LAYOUTS = pytest.mark.parametrize("layout", ["standard", "head_major"])


def make_module_pair(device, backend, d_model=64, n_heads=8, n_points=3, fused=False, layout="standard"):
    torch.manual_seed(1)
    ours = MSDeformAttn(d_model, len(MODULE_LEVELS), n_heads, n_points, backend=backend,
                        fused=fused, value_layout=layout).to(device)
    # Random weights so that the comparison exercises every parameter.
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.2)
    ref = MSDeformAttn(d_model, len(MODULE_LEVELS), n_heads, n_points, backend="pytorch").to(device)
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref


# ---- the planners' table tests ---------------------------------------------------
PLANNER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                  "fp64": torch.float64}

def planner_problem(workload, dtype, d=None, loc_dtype=torch.float32, misaligned=False, queries=None):
    """Uninitialised CPU inputs of a canonical workload's sizes (the planner
    reads sizes, dtypes and the value's alignment only); `queries` replaces
    the workload's query count."""
    wl = W.get(workload)
    d = d or wl.d
    shapes, start = W.level_tensors(wl.levels, "cpu")
    n, s, lq, m, levels = wl.n, wl.s, queries or wl.queries, wl.m, len(wl.levels)
    if misaligned:  # value's data one element past an aligned address
        value = torch.empty(n * s * m * d + 1, dtype=PLANNER_DTYPES[dtype])[1:].view(n, s, m, d)
    else:
        value = torch.empty(n, s, m, d, dtype=PLANNER_DTYPES[dtype])
    loc = torch.empty(n, lq, m, levels, wl.p, 2, dtype=loc_dtype)
    attn = torch.empty(n, lq, m, levels, wl.p, dtype=loc_dtype)
    return value, shapes, start, loc, attn


# ---- two processes (torch.distributed) -----------------------------------------
def _two_process_entry(rank, body, backend, port, results):
    import os
    import traceback

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":  # one GPU a process, chosen before the group forms
        import torch

        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=2)
    try:
        skipped = body(rank)
        results[rank] = f"skip: {skipped}" if skipped else "ok"
    except Exception as exc:  # reported by the parent
        results[rank] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        dist.destroy_process_group()


def run_on_two_processes(body, backend):
    """body(rank) in two spawned processes of one process group (`backend`:
    gloo, nccl); fails with each rank's error where one raised, skips with
    the reason a body returned (a string: what this torch cannot do). body
    must be a module-level function (the processes import it)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_two_process_entry, args=(body, backend, port, results), nprocs=2, join=True)
        results = dict(results)
    skips = [r for r in results.values() if r.startswith("skip: ")]
    if skips and all(r.startswith(("ok", "skip: ")) for r in results.values()):
        pytest.skip(skips[0][len("skip: "):])
    assert results == {0: "ok", 1: "ok"}, results


class SmallEncoder(torch.nn.Module):
    """MSDeformAttn (self-attention on src) and a linear head to a scalar
    loss: the model the distributed tests train (DDP, FSDP2)."""

    def __init__(self, d_model, n_levels, n_heads, n_points):
        super().__init__()
        self.attn = MSDeformAttn(d_model=d_model, n_levels=n_levels, n_heads=n_heads,
                                 n_points=n_points)
        self.head = torch.nn.Linear(d_model, 1)

    def forward(self, src, ref, shapes, start):
        return self.head(self.attn(src, ref, src, shapes, start)).pow(2).mean()
