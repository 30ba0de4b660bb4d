"""Benchmark MSDA implementations on the canonical workloads.

    python -m benchmarks.run                       # default: ddetr_enc + ddetr_dec
    python -m benchmarks.run --full                # every workload, dtype and pass
    python -m benchmarks.run --workloads ddetr_enc,seed --dtypes bf16 \\
        --backends all --passes fwd,fwdbwd --out results/
    python -m benchmarks.run --timer both       # torch.utils.benchmark beside the graph replays

For every (workload, dtype, pass, implementation): median time and its
spread (interquartile range), effective GB/s (fewest bytes / time), the
ratio to the workload's floor (fewest bytes / the device-to-device copy rate
measured in the same run) and the relative error against the float64
reference on the same inputs. Ours, the reference and every installed peer
(benchmarks/peers.py) run in the same process. Prints a table and writes
bench.json and bench.png under --out.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch

import ms_deform_attn as msda
from ms_deform_attn import testing as W
from ms_deform_attn.reference import ms_deform_attn_pytorch

from .peers import PEERS
from .report import auto_verdicts, kind_of
from .timing import (DETERMINISTIC, Timing, copy_bandwidth, implementations, our_backends, time_cpu,
                     time_cuda, time_torch_benchmark)

DTYPES = {  # name -> (value dtype, location / weight dtype)
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.float32),
    "fp16": (torch.float16, torch.float32),
}
PASSES = ("fwd", "fwdbwd")
DEFAULT_WORKLOADS = "ddetr_enc,ddetr_dec"
CPU_SCALE = 4
# A measurement whose interquartile range passes this share of its median
# was taken on a busy machine: the run says so.
BUSY_SPREAD = 0.25


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=None,
                    help=f"comma list or 'all' (known: {', '.join(W.WORKLOADS)}); 'name/k' "
                         f"scales a workload down by k, 'name@smooth' takes the smooth "
                         f"location generator. Default: {DEFAULT_WORKLOADS}")
    ap.add_argument("--dtypes", default=None, help="comma list of fp32,bf16,fp16 (default fp32,bf16)")
    ap.add_argument("--backends", default="all",
                    help="'all' (our backends, the reference, installed peers), 'ours', or a "
                         "comma list of names")
    ap.add_argument("--passes", default="fwd,fwdbwd", help="comma list of fwd,fwdbwd")
    ap.add_argument("--full", action="store_true", help="every workload, dtype and pass")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    ap.add_argument("--scale", type=int, default=None,
                    help=f"shrink every workload by this factor (default 1 on CUDA, {CPU_SCALE} on CPU)")
    ap.add_argument("--out", default="results", help="folder for bench.json and bench.png")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    ap.add_argument("--target-ms", type=float, default=300.0, help="timing budget per measurement")
    ap.add_argument("--timer", choices=("graph", "torch", "both"), default="graph",
                    help="graph: CUDA-graph replays of our backends on the GPU (GPU time), wall "
                         "clock on the CPU; torch: torch.utils.benchmark's "
                         "Timer.blocked_autorange, as users time it (eager, launch overhead "
                         "included); both: the first in time_us, the second beside it "
                         "(torch_us, torch_iqr_us), and a benchmark.Compare table")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no (workload, dtype) pair after this many seconds but the "
                         "first; --resume continues the run (a device call's limit)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run whose bench.json is in --out: the (workload, dtype) "
                         "pairs it holds are kept, not timed again (a --full run with the peers "
                         "outlasts one device call; bench.json is written after every pair)")
    return ap.parse_args(argv)


def git_commit() -> str:
    """HEAD of the checkout, or MSDA_COMMIT where the tree was copied without
    its history (the GPU machine)."""
    if os.environ.get("MSDA_COMMIT"):
        return os.environ["MSDA_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        sha = subprocess.check_output(["git", "rev-parse", "--short=12", "HEAD"], cwd=here,
                                      stderr=subprocess.DEVNULL, text=True).strip()
        dirty = subprocess.call(["git", "diff", "--quiet", "HEAD", "--", ".."], cwd=here,
                                stderr=subprocess.DEVNULL)
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def environment(device: str, copy_bw: float) -> Dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": device,
        "copy_bandwidth_GBps": copy_bw / 1e9,
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(device_name=props.name, sm_count=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}",
                   l2_bytes=getattr(props, "L2_cache_size", None))
    else:
        env.update(device_name=platform.processor() or platform.machine(),
                   threads=torch.get_num_threads())
    return env


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.detach().double()
    if torch.isnan(out).any():
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def n_rotating_sets(inputs_bytes: int, device: str) -> int:
    """Input sets to rotate through so that repeated runs do not hit in L2."""
    if device != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20) or (50 << 20)
    return max(1, min(8, math.ceil(3 * l2 / max(inputs_bytes, 1))))


def measure(args) -> Dict:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    scale = args.scale if args.scale is not None else (1 if device == "cuda" else CPU_SCALE)
    # "all": every workload, and the encoders with the `smooth` generator too.
    every = list(W.WORKLOADS) + [f"{n}@smooth" for n, w in W.WORKLOADS.items()
                                 if w.locations == "encoder"]
    if args.full:
        wl_names, dtypes, passes = every, list(DTYPES), list(PASSES)
    else:
        wl_names = (args.workloads or DEFAULT_WORKLOADS).split(",")
        if wl_names == ["all"]:
            wl_names = every
        dtypes = (args.dtypes or "fp32,bf16").split(",")
        passes = args.passes.split(",")
    for d in dtypes:
        if d not in DTYPES:
            sys.exit(f"unknown dtype {d!r}; expected one of {', '.join(DTYPES)}")
    for p in passes:
        if p not in PASSES:
            sys.exit(f"unknown pass {p!r}; expected one of {', '.join(PASSES)}")
    # An explicit 'name/k' keeps its own factor; the others take --scale.
    workloads = [W.get(n) if "/" in n else W.get(n).scaled(scale) for n in wl_names]

    ours = our_backends(device)
    if args.backends == "all":
        names = ours + [DETERMINISTIC, "reference"] + list(PEERS)
    elif args.backends == "ours":
        names = ours
    else:
        names = args.backends.split(",")
    impls, notes = implementations(device, names)

    previous = _previous_run(args) if args.resume else None
    if previous is not None:
        env, notes, rows = previous["env"], previous["notes"] + notes, previous["rows"]
        copy_bw = env["copy_bandwidth_GBps"] * 1e9
        env["parts"] = env.get("parts", 1) + 1
    else:
        copy_bw = copy_bandwidth(device)
        env = environment(device, copy_bw)
        rows = []
    done = {(r["workload"], r["dtype"]) for r in rows}
    try:
        from tqdm import tqdm
    except ImportError:  # progress bar is optional
        def tqdm(x, **_):
            return x
    combos = [(wl, d) for wl in workloads for d in dtypes]
    began, timed_before = time.perf_counter(), len(rows)
    bar = tqdm(combos, desc="bench", file=sys.stderr, disable=not sys.stderr.isatty())
    for wl, dname in bar:
        if (wl.name, dname) in done:
            continue
        if (args.deadline_s is not None and len(rows) > timed_before
                and time.perf_counter() - began > args.deadline_s):
            # Every call times one pair at least. Not a note of the result:
            # a resumed run times these pairs.
            print(f"warning: stopped at --deadline-s {args.deadline_s:g}: {wl.name} {dname} and "
                  f"the pairs after it not timed; --resume continues", file=sys.stderr)
            break
        dtype, loc_dtype = DTYPES[dname]
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(f"{wl.name} {dname}")
        rows.extend(bench_one(wl, dname, dtype, loc_dtype, device, impls, passes, copy_bw,
                              args, notes))
        _checkpoint(args, {"env": env, "notes": notes, "rows": rows})
    env["timer"] = args.timer
    print(wall_summary(rows[timed_before:], time.perf_counter() - began), file=sys.stderr)
    busy = [r for r in rows if r.get("spread_us", 0) > BUSY_SPREAD * r["time_us"]]
    if busy:
        worst = max(busy, key=lambda r: r["spread_us"] / r["time_us"])
        notes.append(
            f"the machine was busy: {len(busy)} of {len(rows)} measurements spread more than "
            f"{BUSY_SPREAD:.0%} of their median (worst {worst['impl']} {worst['workload']} "
            f"{worst['dtype']} {worst['pass_']}: {worst['time_us']:.1f} us, interquartile range "
            f"{worst['spread_us']:.1f} us); time again on an idle machine before comparing")
        print(f"warning: {notes[-1]}", file=sys.stderr)
    return {"env": env, "notes": notes, "rows": rows}



def wall_summary(rows: List[Dict], total_s: float) -> str:
    """Where this call's wall-clock time went: each implementation's
    measurements (their wall_s), most first, and the rest (inputs, the
    float64 reference, failed measurements): what to cut when a run does not
    fit a device call."""
    by_impl: Dict[str, float] = {}
    for r in rows:
        by_impl[r["impl"]] = by_impl.get(r["impl"], 0.0) + r.get("wall_s", 0.0)
    parts = [f"{k} {v:.1f}" for k, v in sorted(by_impl.items(), key=lambda kv: -kv[1])]
    rest = total_s - sum(by_impl.values())
    return (f"wall time {total_s:.1f} s, {len(rows)} measurements: " + ", ".join(parts)
            + f", the rest {rest:.1f}")


def _previous_run(args) -> Optional[Dict]:
    """The run to continue (--resume): bench.json in --out, which must be of
    this device and commit (a run is one build on one device)."""
    path = os.path.join(args.out, "bench.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        previous = json.load(f)
    env = previous["env"]
    here = torch.cuda.get_device_name() if env.get("device") == "cuda" else env.get("device_name")
    if env.get("device_name") != here or env.get("commit") != git_commit():
        sys.exit(f"--resume: {path} is of {env.get('device_name')} at {env.get('commit')}, this is "
                 f"{here} at {git_commit()}; a run continues only on its own device and commit")
    return previous


def _checkpoint(args, result: Dict) -> None:
    """bench.json as it stands, so that a run cut short can be resumed."""
    os.makedirs(args.out, exist_ok=True)
    tmp = os.path.join(args.out, "bench.json.part")
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, os.path.join(args.out, "bench.json"))


# torch.utils.benchmark Measurements of the run (--timer torch / both), for
# the Compare table main() prints.
MEASUREMENTS: List = []


def bench_one(wl, dname, dtype, loc_dtype, device, impls, passes, copy_bw, args, notes):
    base = W.make_inputs(wl, dtype, loc_dtype, device=device, seed=args.seed)
    in_bytes = sum(t.numel() * t.element_size() for t in base)
    n_sets = n_rotating_sets(in_bytes, device)
    sets = [base] + [W.make_inputs(wl, dtype, loc_dtype, device=device, seed=args.seed + i)
                     for i in range(1, n_sets)]
    for s in sets:
        for i in (0, 3, 4):
            s[i].requires_grad_()
    value, shapes, start, loc, attn = base
    g = torch.Generator(device=device).manual_seed(args.seed)
    grad_out = torch.randn(wl.n, wl.queries, wl.m * wl.d, device=device, dtype=dtype, generator=g)

    # float64 reference on set 0: output and gradients.
    ref_in = [value.detach().double().requires_grad_(), shapes, start,
              loc.detach().double().requires_grad_(), attn.detach().double().requires_grad_()]
    ref_out = ms_deform_attn_pytorch(*ref_in)
    ref_grads = None
    if "fwdbwd" in passes:
        ref_grads = torch.autograd.grad(ref_out, (ref_in[0], ref_in[3], ref_in[4]),
                                        grad_out.double())
    ref_out = ref_out.detach()
    del ref_in

    rows = []
    # Our implementations get the host-side level shapes, as transformers
    # passes them (value_spatial_shapes_list); the tma backend needs them.
    choice = msda.select_backend(*[t.detach() for t in base], spatial_shapes_list=wl.levels)
    for name, fn in impls.items():
        peer = PEERS.get(name)
        if peer is not None and dname not in peer.dtypes:
            continue
        if getattr(fn, "takes_host_shapes", False):
            fn = functools.partial(fn, spatial_shapes_list=wl.levels)
        # A peer's inputs in the dtypes it takes, converted here, not in the
        # timed step.
        isets = [peer.prepare(s) for s in sets] if peer is not None else sets
        for pas in passes:
            row = dict(workload=wl.name, dtype=dname, impl=name, kind=kind_of(name), pass_=pas,
                       auto_choice=choice, sets=n_sets)
            began = time.perf_counter()
            try:
                if pas == "fwd":
                    with torch.no_grad():
                        out = fn(*[t.detach() for t in isets[0]])
                    row["rel_err"] = rel_err(out, ref_out)
                    del out

                    def step(i, fn=fn):
                        with torch.no_grad():
                            return fn(*isets[i])
                else:
                    s0 = isets[0]
                    out = fn(*s0)
                    grads = torch.autograd.grad(out, (s0[0], s0[3], s0[4]), grad_out)
                    row["rel_err"] = max(rel_err(g, r) for g, r in zip(grads, ref_grads))
                    row["rel_err_by_input"] = [rel_err(g, r) for g, r in zip(grads, ref_grads)]
                    del out, grads

                    def step(i, fn=fn):
                        s = isets[i]
                        o = fn(*s)
                        return torch.autograd.grad(o, (s[0], s[3], s[4]), grad_out)

                if args.timer in ("torch", "both"):
                    m = time_torch_benchmark(step, f"ms_deform_attn {pas}", f"{wl.name} {dname}", name,
                                             min_run_time=args.target_ms / 1e3)
                    MEASUREMENTS.append(m)
                    row.update(torch_us=m.median * 1e6, torch_iqr_us=m.iqr * 1e6)
                if args.timer == "torch":
                    timing = Timing(m.median * 1e6, m.iqr * 1e6, "torch.utils.benchmark",
                                    m.number_per_run * len(m.times))
                elif device == "cuda":
                    # Everything but the reference (it reads shapes on the
                    # host) as graph replays; a peer whose calls do not
                    # capture between CUDA events.
                    graph = name != "reference"
                    try:
                        timing = time_cuda(step, n_sets, use_graph=graph, target_ms=args.target_ms)
                    except Exception as exc:
                        if peer is None:
                            raise
                        notes.append(f"{name} {wl.name} {dname} {pas}: its calls do not capture "
                                     f"in a CUDA graph ({type(exc).__name__}: {exc}); timed "
                                     f"between CUDA events")
                        torch.cuda.synchronize()
                        timing = time_cuda(step, n_sets, use_graph=False, target_ms=args.target_ms)
                else:
                    timing = time_cpu(step, n_sets, target_s=args.target_ms / 1e3)
            except Exception as exc:
                notes.append(f"{name} {wl.name} {dname} {pas} failed: {type(exc).__name__}: {exc}")
                continue
            fb = W.floor_bytes(wl, dtype, loc_dtype, backward=(pas == "fwdbwd"))
            floor_us = fb / copy_bw * 1e6
            t = timing.median_us
            row.update(time_us=t, spread_us=timing.iqr_us, method=timing.method, reps=timing.reps,
                       floor_bytes=fb, floor_us=floor_us, GBps=fb / (t * 1e-6) / 1e9,
                       x_floor=t / floor_us,
                       # the measurement's own cost (capture, errors, repetitions)
                       wall_s=time.perf_counter() - began)
            rows.append(row)
    # Backward time derived as (fwd + bwd) - fwd of the same implementation;
    # not derived where the difference is within the two measurements'
    # spreads (a busy machine), said in a note.
    by_key = {(r["impl"], r["pass_"]): r for r in rows}
    for r in rows:
        f = by_key.get((r["impl"], "fwd"))
        if r["pass_"] == "fwdbwd" and f is not None:
            bwd = backward_us(r, f)
            if bwd is None:
                notes.append(f"{r['impl']} {wl.name} {dname}: no backward time derived: forward + "
                             f"backward {r['time_us']:.1f} us (spread {r['spread_us']:.1f}) "
                             f"against the forward's {f['time_us']:.1f} (spread "
                             f"{f['spread_us']:.1f}); time again on an idle machine")
            else:
                r["bwd_us"] = bwd
    return rows


def backward_us(fwdbwd: Dict, fwd: Dict):
    """(forward + backward) - forward, or None where that difference is not
    above the two measurements' spreads (it came out negative on a busy
    machine)."""
    bwd = fwdbwd["time_us"] - fwd["time_us"]
    return bwd if bwd > fwdbwd.get("spread_us", 0) + fwd.get("spread_us", 0) else None


def fmt_table(result: Dict) -> str:
    env = result["env"]
    scaled = sorted({r["workload"] for r in result["rows"] if "/" in r["workload"]})
    lines = [
        f"device: {env.get('device_name')} | torch {env['torch']} | CUDA {env['cuda']} | "
        f"commit {env['commit']} | {env['date']} | copy {env['copy_bandwidth_GBps']:.0f} GB/s",
        *([f"scaled down: {', '.join(scaled)} ('name/k': a k-th of the queries and of every "
           f"level's pixels; --scale sets k, {CPU_SCALE} by default on the CPU)"] if scaled else []),
        "",
        "| workload | dtype | pass | impl | time (us) | spread (us) | bwd (us) | GB/s | x floor "
        "| rel. error (out; or grad value / loc / weights) |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        bwd = f"{r['bwd_us']:.1f}" if "bwd_us" in r else ""
        err = " / ".join(f"{e:.1e}" for e in r.get("rel_err_by_input", [r["rel_err"]]))
        lines.append(
            f"| {r['workload']} | {r['dtype']} | {r['pass_']} | {r['impl']} | {r['time_us']:.1f} | "
            f"{r['spread_us']:.1f} | {bwd} | {r['GBps']:.3g} | {r['x_floor']:.1f} | {err} |")
    lines += auto_check(result["rows"])
    for n in result["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def auto_check(rows: List[Dict]) -> List[str]:
    """Compares what backend="auto" picked with the fastest of our backends in
    this run, per (workload, dtype), forward pass."""
    ours = our_backends("cuda" if torch.cuda.is_available() else "cpu")
    lines = []
    for wl, dt, timed, pick, best in auto_verdicts(rows, ours):
        verdict = "ok" if pick == best else f"auto is {timed.get(pick, float('nan')) / timed[best]:.2f}x slower"
        lines.append(f"auto: {wl} {dt}: picks {pick}, fastest {best} ({verdict})")
    return lines


def plot(result: Dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["rows"]
    dtypes = sorted({r["dtype"] for r in rows}, key=list(DTYPES).index)
    passes = [p for p in PASSES if any(r["pass_"] == p for r in rows)]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(len(passes), len(dtypes), squeeze=False,
                             figsize=(max(6, 1.6 * len(workloads)) * len(dtypes), 4 * len(passes)))
    width = 0.8 / max(1, len(impls))
    for pi, pas in enumerate(passes):
        for di, dn in enumerate(dtypes):
            ax = axes[pi][di]
            for ii, impl in enumerate(impls):
                xs, ys = [], []
                for wi, wl in enumerate(workloads):
                    for r in rows:
                        if (r["workload"], r["dtype"], r["pass_"], r["impl"]) == (wl, dn, pas, impl):
                            xs.append(wi + (ii - (len(impls) - 1) / 2) * width)
                            ys.append(r["time_us"])
                ax.bar(xs, ys, width, label=impl)
            for wi, wl in enumerate(workloads):
                fl = [r["floor_us"] for r in rows if (r["workload"], r["dtype"], r["pass_"]) == (wl, dn, pas)]
                if fl:
                    ax.hlines(fl[0], wi - 0.45, wi + 0.45, colors="black", linestyles="dashed",
                              label="floor" if wi == 0 else None)
            ax.set_yscale("log")
            ax.set_xticks(range(len(workloads)))
            ax.set_xticklabels(workloads, rotation=30, ha="right")
            ax.set_ylabel("time (us, log)")
            ax.set_title(f"{pas} {dn}")
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    env = result["env"]
    fig.suptitle(f"ms_deform_attn on {env.get('device_name')} ({env['commit']}, {env['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    result = measure(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(fmt_table(result))
    if MEASUREMENTS:
        from torch.utils import benchmark
        print()
        benchmark.Compare(MEASUREMENTS).print()
    if not args.no_plot and result["rows"]:
        if plot(result, os.path.join(args.out, "bench.png")):
            print(f"wrote {os.path.join(args.out, 'bench.png')}")
        else:
            print("no chart: matplotlib is not installed (pip install matplotlib, or the "
                  "'bench' extra; --no-plot skips it quietly)")
    print(f"wrote {os.path.join(args.out, 'bench.json')}")
    return 0 if result["rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
