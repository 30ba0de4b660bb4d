"""The attention layer and a whole model, timed as users feel them.

    python -m benchmarks.layer                     # layer: ddetr_enc, ddetr_dec; fp32, bf16
    python -m benchmarks.layer --workloads m2f_enc --dtypes bf16 --impls ours,transformers
    python -m benchmarks.layer --model             # full-size DeformableDetrModel training step
    python -m benchmarks.layer --model --compile   # ... also under torch.compile

Layer: one multi-scale deformable attention layer of d_model 256 (8 heads,
4 points, the workload's levels), forward + backward of the layer's output
against a random gradient, queries and flattened features requiring grad.
Implementations:
  ours          ms_deform_attn.nn.MSDeformAttn(fused=False) (backend "auto";
                locations and softmax as separate PyTorch ops before
                ms_deform_attn, as Deformable DETR does)
  fused         the same module with fused=True: locations and softmax inside
                the operator (ms_deform_attn_fused; the module's default)
  fused-recompute  fused with recompute=True: the operator's inputs (value,
                offsets, logits) formed again at the backward instead of kept
  fused-hm      fused with value_layout="head_major": value_proj writes value
                (N, M, S, D), read in place by the operator
  pytorch       the same module on the grid_sample reference
  transformers  transformers' DeformableDetrMultiscaleDeformableAttention on its own
                path, the same weights
  swapped       that layer after ms_deform_attn.hf.swap_msda
For each: median step time (CUDA events around an eager step on a GPU, so
the host's launch gaps count; wall clock on the CPU; gradients set to None
before each step, as optimizer.zero_grad() does), the bytes the layer
keeps for its backward (saved_bytes: the storages of the saved tensors,
counted with torch.autograd.graph.saved_tensors_hooks, which do not see
those the recomputing layers save under their own hooks; kept_bytes on a
GPU: the memory a forward leaves allocated besides its output), and on a
GPU the peak memory of a step of --encoder-layers stacked layers (residual
connections). On a GPU, ours, fused, fused-recompute, fused-hm and swapped are also
timed as CUDA-graph replays (fwd_graph_us, fwdbwd_graph_us: GPU time alone;
the other two read the level shapes on the host and cannot be captured).

Model: a full-size transformers DeformableDetrModel built from its config
(ResNet-50-shaped backbone, no weights, no network), batch 2 at 800 x 1333
(--image), bf16 autocast on a GPU: training step time (AdamW; --fused-adamw
for its fused CUDA kernel) and peak memory, transformers' own path against
swap_msda, eager and (--compile) compiled, in each of --compile-modes
(torch.compile's modes: "default", "reduce-overhead" replays CUDA graphs,
"max-autotune-no-cudagraphs", ...). Three steps warm up first (compilation,
graph recording; the peak memory counts them). step_ms is the median wall
step between CUDA events, so a host slower than the GPU counts; gpu_ms is
the step's kernels summed (torch.profiler over five steps), what the step
takes where the host keeps the GPU fed.

Writes layer.json / model.json under --out and prints a table. With
--plain-linears the layers' linears run as their nn.Linear modules
(MSDeformAttn's and swap_msda's fast_linears=False) instead of
ms_deform_attn::_linear (an A/B of the bias gradients).
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import os
from contextlib import nullcontext
from typing import Callable, Dict, List

import torch

from ms_deform_attn import testing as W
from ms_deform_attn.nn import MSDeformAttn

from .timing import time_cpu, time_cuda

# The layers' fast_linears option (--plain-linears: False).
FAST_LINEARS = True

IMPLS = ("ours", "fused", "fused-recompute", "fused-hm", "pytorch", "transformers", "swapped")
DTYPES = ("fp32", "bf16")


def _time(device: str, step: Callable[[], object], target_ms: float, graph: bool = False) -> float:
    """Median time of step() in microseconds: benchmarks.timing's eager
    timers (CUDA events on a GPU, wall clock on the CPU), or with `graph`
    replays of a CUDA graph (GPU time, no launch gaps)."""
    if device == "cuda":
        return time_cuda(lambda i: step(), 1, use_graph=graph, target_ms=target_ms)[0]
    return time_cpu(lambda i: step(), 1, target_s=target_ms / 1e3)[0]


# Layers a CUDA graph can capture: no host reads of device tensors (the
# grid_sample reference and transformers' own path read the level shapes).
GRAPHABLE = ("ours", "fused", "fused-recompute", "fused-hm", "swapped")


def _autocast(device: str, dtype: str, cache: bool = True):
    """bf16 autocast for "bf16"; `cache` False under CUDA-graph capture (the
    cast cache would hold tensors of the capture's memory pool)."""
    if dtype == "bf16":
        return torch.autocast(device_type=device, dtype=torch.bfloat16, cache_enabled=cache)
    return nullcontext()


def _hf_layer(d_model: int, n_levels: int, n_heads: int, n_points: int):
    import transformers
    from transformers.models.deformable_detr import modeling_deformable_detr as hf

    cfg = transformers.DeformableDetrConfig(d_model=d_model, num_feature_levels=n_levels,
                                            encoder_attention_heads=n_heads,
                                            encoder_n_points=n_points)
    return hf.DeformableDetrMultiscaleDeformableAttention(cfg, num_heads=n_heads, n_points=n_points)


def make_layer(impl: str, wl: W.Workload, d_model: int, device: str) -> torch.nn.Module:
    """The layer of `impl`, with the weights of MSDeformAttn under seed 0."""
    torch.manual_seed(0)
    n_levels = len(wl.levels)
    base = MSDeformAttn(d_model, n_levels, wl.m, wl.p, backend="auto", fused=False,
                        fast_linears=FAST_LINEARS)
    if impl == "ours":
        return base.to(device)
    if impl in ("fused", "fused-recompute", "fused-hm"):
        base.fused = True
        base.recompute = impl == "fused-recompute"
        base.value_layout = "head_major" if impl == "fused-hm" else "standard"
        return base.to(device)
    if impl == "pytorch":
        mod = MSDeformAttn(d_model, n_levels, wl.m, wl.p, backend="pytorch",
                           fast_linears=FAST_LINEARS)
    else:
        mod = _hf_layer(d_model, n_levels, wl.m, wl.p)
    mod.load_state_dict(base.state_dict(), strict=True)
    if impl == "swapped":
        from ms_deform_attn.hf import swap_msda
        holder = torch.nn.Sequential(mod)
        if swap_msda(holder, fast_linears=FAST_LINEARS) != 1:
            raise RuntimeError("swap_msda found no MSDA in the transformers layer")
        mod = holder[0]
    return mod.to(device)


def call_layer(mod: torch.nn.Module, query, flat, ref, shapes, start, levels):
    """One layer's output, whichever signature it has."""
    if isinstance(mod, MSDeformAttn):
        return mod(query, ref, flat, shapes, start, None, levels)
    return mod(query, encoder_hidden_states=flat, reference_points=ref, spatial_shapes=shapes,
               spatial_shapes_list=levels, level_start_index=start)[0]


def layer_inputs(wl: W.Workload, d_model: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes, start = W.level_tensors(wl.levels, device)
    query = torch.randn(wl.n, wl.queries, d_model, generator=g).to(device).requires_grad_()
    flat = torch.randn(wl.n, wl.s, d_model, generator=g).to(device).requires_grad_()
    if wl.lq is None:  # encoder: every pixel is a query, its own centre the reference
        ref = W.encoder_reference_points(wl.levels, device).float()
        ref = ref[None, :, None, :].expand(wl.n, -1, len(wl.levels), -1).contiguous()
    else:
        ref = torch.rand(wl.n, wl.queries, 1, 2, generator=g).to(device)
        ref = ref.expand(-1, -1, len(wl.levels), -1).contiguous()
    grad = torch.randn(wl.n, wl.queries, d_model, generator=g).to(device)
    return query, flat, ref, shapes, start, grad


def saved_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes of the tensors autograd keeps for the backward of fn() (each
    storage counted once)."""
    seen: Dict[int, int] = {}

    def pack(t):
        try:
            key = t.untyped_storage().data_ptr()
            seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):
            pass
        # Detached: a tensor an op saves of its own outputs (softmax's), kept
        # as itself, would hold its node, which holds it: a cycle that keeps
        # the graph, and the leaves' AccumulateGrad nodes, alive after the
        # forward (and broke the unfused layer's CUDA-graph capture here).
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def kept_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """GPU memory fn() leaves allocated besides its output: what autograd
    keeps for the backward, however it keeps it (inputs allocated before,
    such as the reference points, are not counted)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base - out.untyped_storage().nbytes()
    del out
    return kept


def layer_fns(layer: torch.nn.Module, device: str, dname: str, query, flat, ref, shapes, start,
              grad, levels):
    """forward(cache=True) and step() of one layer on layer_inputs(), and
    the leaves step() differentiates: query, flat and the parameters that
    require grad. step() runs forward() and the backward of its output
    against `grad`, the leaves' gradients set to None first, as
    optimizer.zero_grad() leaves them (no accumulation into last step's)."""
    leaves = [query, flat] + [p for p in layer.parameters() if p.requires_grad]

    def forward(cache=True):
        with _autocast(device, dname, cache):
            return call_layer(layer, query, flat, ref, shapes, start, levels)

    def step():
        for t in leaves:
            t.grad = None
        out = forward()
        torch.autograd.backward(out, grad.to(out.dtype))

    return forward, step, leaves


def bench_layer(args) -> List[Dict]:
    device = args.device
    rows = []
    for name in args.workloads.split(","):
        wl = W.get(name)
        levels = [tuple(x) for x in wl.levels]
        for dname in args.dtypes.split(","):
            query, flat, ref, shapes, start, grad = layer_inputs(wl, args.d_model, device)
            for impl in args.impls.split(","):
                try:
                    layer = make_layer(impl, wl, args.d_model, device)
                except ImportError as e:
                    print(f"skip {impl}: {e}")
                    continue

                # Leaves of this layer's own: autograd nodes that another
                # layer's CUDA-graph capture made (on its stream) and kept
                # alive would break this one's capture.
                q_in, f_in = (t.detach().clone().requires_grad_() for t in (query, flat))
                forward, step, leaves = layer_fns(layer, device, dname, q_in, f_in, ref, shapes,
                                                  start, grad, levels)
                row = {"workload": wl.name, "dtype": dname, "impl": impl,
                       "fwdbwd_us": _time(device, step, args.target_ms),
                       "fwd_us": _time(device, forward, args.target_ms),
                       "saved_bytes": saved_bytes(forward)}
                if device == "cuda":
                    row["kept_bytes"] = kept_bytes(forward)
                if device == "cuda" and impl in GRAPHABLE:
                    # GPU time without the host's launch gaps: the gradients
                    # of the inputs and weights as fresh tensors (no .grad
                    # accumulation inside the graph).
                    for t in leaves:
                        t.grad = None
                    g_forward = functools.partial(forward, cache=False)

                    def g_step(g_forward=g_forward, leaves=leaves):
                        out = g_forward()
                        return torch.autograd.grad(out, leaves, grad.to(out.dtype))

                    try:
                        row["fwd_graph_us"] = _time(device, g_forward, args.target_ms, graph=True)
                        row["fwdbwd_graph_us"] = _time(device, g_step, args.target_ms, graph=True)
                    except RuntimeError as e:  # a capture the layer does not allow
                        row["graph_error"] = f"{type(e).__name__}: {e}"
                if device == "cuda":
                    mods = [copy.deepcopy(layer) for _ in range(args.encoder_layers)]
                    row["stack_peak_bytes"] = _stack_peak(mods, query, flat, ref, shapes, start,
                                                          levels, grad, dname)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def _stack_peak(mods, query, flat, ref, shapes, start, levels, grad, dname) -> int:
    """Peak memory above what is allocated before one forward + backward
    through the layers `mods` stacked with residual connections."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with _autocast("cuda", dname):
        q = query
        for mod in mods:
            q = q + call_layer(mod, q, flat, ref, shapes, start, levels)
    torch.autograd.backward(q, grad.to(q.dtype))
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


# ---- the whole model ----------------------------------------------------------
def full_size_deformable_detr(tiny: bool = False):
    import transformers
    if tiny:  # for the CPU smoke test
        from ms_deform_attn.testing import small_deformable_detr
        return small_deformable_detr().train()
    # Deformable DETR's defaults on a ResNet-50-shaped backbone
    bb = transformers.ResNetConfig(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048],
                                   depths=[3, 4, 6, 3], layer_type="bottleneck",
                                   out_features=["stage2", "stage3", "stage4"])
    cfg = transformers.DeformableDetrConfig(use_timm_backbone=False, backbone_config=bb,
                                            use_pretrained_backbone=False, backbone=None)
    torch.manual_seed(0)
    return transformers.DeformableDetrModel(cfg)


def gpu_ms_per_step(step: Callable[[], object], steps: int = 5) -> float:
    """The GPU time of one step in ms: its kernels, copies and fills summed
    over `steps` steps under torch.profiler (one stream: no overlap to
    discount), divided by `steps`."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0)
    return total_us / steps / 1e3


def bench_model(args) -> List[Dict]:
    from ms_deform_attn.hf import swap_msda

    device = args.device
    h, w = (int(x) for x in args.image.split("x"))
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(args.batch, 3, h, w, generator=g).to(device)
    mask = torch.ones(args.batch, h, w, dtype=torch.long, device=device)
    rows = []
    modes = [None] + (args.compile_modes.split(",") if args.compile else [])
    for path in args.paths.split(","):
        for mode in modes:
            model = full_size_deformable_detr(tiny=args.tiny_model)
            if path.startswith("swapped"):
                swap_msda(model, fused=path != "swapped_unfused",
                          recompute=path == "swapped_recompute", fast_linears=FAST_LINEARS)
            model = model.to(device).train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5,
                                    **({"fused": True} if args.fused_adamw else {}))
            if mode is None:
                fwd = model
            else:
                fwd = torch.compile(model, mode=None if mode == "default" else mode)

            def step(fwd=fwd, opt=opt):
                with _autocast(device, "bf16" if device == "cuda" else "fp32"):
                    out = fwd(pixel_values=pixels, pixel_mask=mask)
                loss = out.last_hidden_state.float().pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            # Compilation, graph recording (whose memory pool the replays
            # reuse: the peak counts from here), the allocator.
            for _ in range(3):
                step()
            t = _time(device, step, args.target_ms)
            row = {"model": "DeformableDetrModel", "path": path, "compiled": mode is not None,
                   "compile_mode": mode, "fused_adamw": args.fused_adamw,
                   "image": args.image, "batch": args.batch, "step_ms": t / 1e3}
            if device == "cuda":
                row["peak_bytes"] = torch.cuda.max_memory_allocated()
                row["gpu_ms"] = gpu_ms_per_step(step)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del model, opt, fwd
            if mode is not None:
                torch._dynamo.reset()  # the next model compiles afresh, not against a limit
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.layer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="ddetr_enc,ddetr_dec")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--encoder-layers", type=int, default=6)
    ap.add_argument("--target-ms", type=float, default=300.0,
                    help="timing budget per measurement (at least 10 steps on a GPU, 3 on the CPU)")
    ap.add_argument("--model", action="store_true", help="the whole-model benchmark instead")
    ap.add_argument("--compile", action="store_true", help="--model: also under torch.compile")
    ap.add_argument("--compile-modes", default="default",
                    help="--model --compile: torch.compile modes, comma-separated "
                         "(default, reduce-overhead, max-autotune-no-cudagraphs, ...)")
    ap.add_argument("--fused-adamw", action="store_true",
                    help="--model: AdamW(fused=True) instead of its foreach default")
    ap.add_argument("--paths", default="transformers,swapped",
                    help="--model: of transformers (its own path), swapped (swap_msda: "
                         "the fused layers), swapped_recompute (swap_msda(recompute=True)), "
                         "swapped_unfused (swap_msda(fused=False))")
    ap.add_argument("--image", default="800x1333", help="--model: H x W")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tiny-model", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plain-linears", action="store_true",
                    help="the layers' linears as their nn.Linear modules (fast_linears=False)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args


def main(argv=None) -> int:
    global FAST_LINEARS
    args = parse_args(argv)
    FAST_LINEARS = not args.plain_linears
    rows = bench_model(args) if args.model else bench_layer(args)
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__}
    path = os.path.join(args.out, "model.json" if args.model else "layer.json")
    with open(path, "w") as f:
        json.dump({"env": meta, "rows": rows}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
