"""Render BENCHMARKS.md from a bench.json written by benchmarks.run.

    python -m benchmarks.report benchmarks/results/bench.json > BENCHMARKS.md

Every figure of ours comes from the JSON (one run); the peers' figures are
quoted from docs/workloads.md, measured on the same kind of device
(picked by the run's device name: H100 or H200).
"""
from __future__ import annotations

import json
import sys
from typing import Dict, List

# Quoted from docs/workloads.md, microseconds, forward / backward.
# H200 (2026-11-22): grid_sample fwd, original fp32 fwd, bwd, DCNv4 flash
# fp16 fwd, bwd, its error against fp64.
PEERS_H200 = {
    "seed": (24199, 2861, 7995, 673, 15907, 5.9e-2),
    "ddetr_enc": (3730, 761, 1961, 167, 2904, 2.1e-2),
    "ddetr_dec": (237, 28, 68, 30, 94, 2.4e-2),
    "dino_dec": (567, 79, 207, 41, 336, 1.3e-1),
    "rtdetr_dec": (588, 90, 222, 41, 354, 2.0e-1),
    "dino5_enc": (12021, 1846, 4907, 426, 7787, 3.6e-2),
    "bevformer_tsa": (1557, 546, 1032, 111, 1068, 4.9e-2),
    "m2f_enc": (1645, 302, 747, 74, 1021, 2.1e-2),
}
# H100 (2026-11-28, the operator at 2246dfc beside them): original fp32 fwd,
# bwd; flash fp16 fwd, bwd, error; triton (roulbac/msda-triton) fp32 fwd,
# bwd; triton bf16 fwd, bwd, error (its 16-bit locations). None: not measured.
PEERS_H100 = {
    "seed": (2899, 8057, 712, 15980, 6e-2, 1021, 5592, None, None, None),
    "ddetr_enc": (767, 1976, 175, 2952, 2e-2, 197, 1210, 214, 892, 0.16),
    "ddetr_dec": (24, 69, 25, 99, 2e-2, 13.7, 44, 8.3, 30, 0.19),
    "dino_dec": (75, 213, 38, 358, 1e-1, 35.3, 158, 29.7, 105, 0.18),
    "rtdetr_dec": (87, 238, 36, 388, 2e-1, 43.6, 183, 33.3, 115, 0.12),
    "dino5_enc": (1865, 4935, 448, 7806, 4e-2, None, None, None, None, None),
    "bevformer_tsa": (554, 1035, 110, 1091, 5e-2, None, None, None, None, None),
    "m2f_enc": (305, 749, 70, 1030, 2e-2, 77, 433, None, None, None),
}


def _row(rows: List[Dict], wl: str, dtype: str, impl: str, pas: str):
    for r in rows:
        if (r["workload"], r["dtype"], r["impl"], r["pass_"]) == (wl, dtype, impl, pas):
            return r
    return None


def _fmt(x, spec=".0f"):
    return "" if x is None else format(x, spec)


def _us(x) -> str:
    return "" if x is None else (f"{x:.1f}" if x < 100 else f"{x:.0f}")


def comparison(result: Dict, backend: str) -> List[str]:
    """Our figures (`backend`, or "auto": the backend auto picked for each
    workload and dtype) beside the peers' on the same kind of device; the
    Triton peer's measured figures where the run has them, else quoted."""
    rows = result["rows"]

    def impl(wl, dtype):
        if backend != "auto":
            return backend
        r = next((r for r in rows if (r["workload"], r["dtype"]) == (wl, dtype)
                  and r.get("auto_choice")), None)
        return r["auto_choice"] if r else backend

    def ours(wl, dtype, pas, key="time_us"):
        r = _row(rows, wl, dtype, impl(wl, dtype), pas)
        return r and r.get(key)

    def err(wl, dtype):
        r = _row(rows, wl, dtype, impl(wl, dtype), "fwd")
        return "" if r is None else f"{r['rel_err']:.1e}"

    def measured_triton(wl, dtype):
        f, b = _row(rows, wl, dtype, "triton", "fwd"), _row(rows, wl, dtype, "triton", "fwdbwd")
        if f is None:
            return None
        bwd = b.get("bwd_us") if b else None
        text = f"**{_us(f['time_us'])}** / {_us(bwd)}" if bwd is not None else f"**{_us(f['time_us'])}**"
        return text + (f" ({f['rel_err']:.2f})" if dtype != "fp32" else "")

    if "H100" in str(result["env"].get("device_name")):
        out = [
            "| workload | ours fp32 fwd / bwd | triton fp32 | original fp32 | ours bf16 fwd / bwd "
            "(error) | triton bf16 (error) | ours fp16 fwd / bwd (error) | flash fp16 (error) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for wl, (of, ob, ff, fb, fe, tf, tb, t16f, t16b, t16e) in PEERS_H100.items():
            if ours(wl, "fp32", "fwd") is None and ours(wl, "bf16", "fwd") is None:
                continue
            tri16 = measured_triton(wl, "bf16") or (
                f"{_us(t16f)} / {_us(t16b)} ({t16e})" if t16f is not None else "-")
            tri32 = measured_triton(wl, "fp32") or (f"{_us(tf)} / {_us(tb)}" if tf is not None else "-")
            out.append(
                f"| {wl} | {_us(ours(wl, 'fp32', 'fwd'))} / {_us(ours(wl, 'fp32', 'fwdbwd', 'bwd_us'))} | "
                f"{tri32} | {_us(of)} / {_us(ob)} | "
                f"{_us(ours(wl, 'bf16', 'fwd'))} / {_us(ours(wl, 'bf16', 'fwdbwd', 'bwd_us'))} ({err(wl, 'bf16')}) | "
                f"{tri16} | "
                f"{_us(ours(wl, 'fp16', 'fwd'))} / {_us(ours(wl, 'fp16', 'fwdbwd', 'bwd_us'))} ({err(wl, 'fp16')}) | "
                f"{_us(ff)} / {_us(fb)} ({fe:.0e}) |")
        return out
    # Other devices: the peers quoted for the H200, and the Triton peer's
    # figures where this run measured them.
    triton = any(r["impl"] == "triton" for r in rows)
    out = [
        "| workload | ours fp32 fwd | original fwd | ours fp32 bwd | original bwd | "
        "ours bf16 fwd | ours bf16 bwd | ours bf16 error | flash fp16 fwd | flash fp16 bwd | "
        "flash fp16 error |" + (" triton fp32 fwd / bwd | triton bf16 fwd / bwd (error) |"
                                if triton else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if triton else ""),
    ]
    for wl, (gs, of, ob, ff, fb, fe) in PEERS_H200.items():
        if ours(wl, "fp32", "fwd") is None and ours(wl, "bf16", "fwd") is None:
            continue
        out.append(
            f"| {wl} | {_us(ours(wl, 'fp32', 'fwd'))} | {of} | {_us(ours(wl, 'fp32', 'fwdbwd', 'bwd_us'))} | "
            f"{ob} | {_us(ours(wl, 'bf16', 'fwd'))} | {_us(ours(wl, 'bf16', 'fwdbwd', 'bwd_us'))} | "
            f"{err(wl, 'bf16')} | {ff} | {fb} | {fe:.1e} |"
            + (f" {measured_triton(wl, 'fp32') or '-'} | {measured_triton(wl, 'bf16') or '-'} |"
               if triton else ""))
    return out


def full_table(result: Dict) -> List[str]:
    torch_timer = any("torch_us" in r for r in result["rows"])
    extra_h = " torch.utils.benchmark (us, IQR) |" if torch_timer else ""
    out = [
        "| workload | dtype | pass | impl | time (us) | bwd (us) | GB/s | x floor | floor (us) "
        "| rel. error (out; or grad value / loc / weights) |" + extra_h,
        "|---|---|---|---|---:|---:|---:|---:|---:|---|" + ("---|" if torch_timer else ""),
    ]
    for r in result["rows"]:
        err = " / ".join(f"{e:.1e}" for e in r.get("rel_err_by_input", [r["rel_err"]]))
        extra = ""
        if torch_timer:
            extra = f" {r['torch_us']:.1f} ({r['torch_iqr_us']:.1f}) |" if "torch_us" in r else " |"
        out.append(
            f"| {r['workload']} | {r['dtype']} | {r['pass_']} | {r['impl']} | {r['time_us']:.1f} | "
            f"{_fmt(r.get('bwd_us'), '.1f')} | {r['GBps']:.0f} | {r['x_floor']:.1f} | "
            f"{r['floor_us']:.1f} | {err} |{extra}")
    return out


def auto_verdicts(rows: List[Dict], backends: List[str]):
    """Per (workload, dtype) of the forward pass, in run order: the forward
    time of each of `backends` that ran (dict), what backend="auto" chose and
    the fastest of them."""
    keys = list(dict.fromkeys((r["workload"], r["dtype"]) for r in rows if r["pass_"] == "fwd"))
    for wl, dt in keys:
        found = {b: _row(rows, wl, dt, b, "fwd") for b in backends}
        timed = {b: r["time_us"] for b, r in found.items() if r}
        if not timed:
            continue
        pick = next(r.get("auto_choice") for r in found.values() if r)
        yield wl, dt, timed, pick, min(timed, key=timed.get)


def auto_table(result: Dict, forward_backends: List[str]) -> List[str]:
    """Forward time of every forward backend side by side per (workload,
    dtype), what backend="auto" chose and whether it was the fastest."""
    out = [
        "| workload | dtype | " + " | ".join(f"{b} (us)" for b in forward_backends)
        + " | auto picks | fastest |",
        "|---|---|" + "---:|" * len(forward_backends) + "---|---|",
    ]
    for wl, dt, timed, pick, best in auto_verdicts(result["rows"], forward_backends):
        verdict = best if pick == best else f"{best} (auto {timed.get(pick, float('nan')) / timed[best]:.2f}x slower)"
        cells = " | ".join(_fmt(timed.get(b), ".1f") for b in forward_backends)
        out.append(f"| {wl} | {dt} | {cells} | {pick} | {verdict} |")
    return out


def render(result: Dict, chart: str = "benchmarks/results/bench.png") -> str:
    env = result["env"]
    ours = sorted({r["impl"] for r in result["rows"]} - {"reference", "mmcv", "original", "triton"})
    main_backend = "auto" if any(r.get("auto_choice") for r in result["rows"]) else (
        "baseline" if "baseline" in ours else (ours[0] if ours else "cpu"))
    timer = env.get("timer", "graph")
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m benchmarks.report benchmarks/results/bench.json` from one run of "
        "`python -m benchmarks.run --full` (every workload of [docs/workloads.md](docs/workloads.md), "
        "every backend side by side). Nothing here is written by hand.",
        "",
        f"- device: **{env.get('device_name')}** ({env.get('sm_count', '?')} SMs), "
        f"torch {env['torch']}, CUDA {env['cuda']}",
        f"- date: {env['date']}, commit: `{env['commit']}`",
        f"- device-to-device copy rate measured in the same run: "
        f"{env['copy_bandwidth_GBps']:.0f} GB/s (floors below use it)",
        "- times: medians; our backends timed as CUDA-graph replays (GPU time, no launch gaps), "
        "the reference between CUDA events; inputs rotated so that they do not sit in L2"
        + ("" if timer == "graph" else "; the torch.utils.benchmark column: "
           "Timer.blocked_autorange of eager calls (launch overhead included), median and IQR"),
        "- bf16 / fp16 rows: 16-bit value and output, fp32 locations and weights (the autocast "
        "case); errors are ||out - ref|| / ||ref|| against float64 on the same inputs",
        "- `bwd` = (forward + backward) - forward of the same implementation; `deterministic` is "
        "`auto` with `deterministic=True`",
        "",
        f"![time per backend per workload]({chart})",
        "",
        f"## Against the peers (`{main_backend}`" + (": the backend auto picks for each row)"
                                                      if main_backend == "auto" else " backend)"),
        "",
        ("Triton figures in **bold** were measured in this run, side by side (roulbac/msda-triton, "
         "CUDA-graph replays; its 16-bit runs include the cast of locations and weights to "
         "value's dtype, which it requires); other peer figures are quoted from "
         "[docs/workloads.md](docs/workloads.md), measured on the same kind of device in one "
         "process there. " if any(r["impl"] == "triton" for r in result["rows"]) else
         "Peer figures quoted from [docs/workloads.md](docs/workloads.md), measured on the same "
         "kind of device in one process there (not re-run here: no peer is installed on the GPU "
         "machine). ") + "Times in microseconds, forward / backward; errors against float64.",
        "",
    ]
    lines += comparison(result, main_backend)
    # Forward backends only ("deterministic" changes the backward alone).
    forward_backends = [b for b in ours if b != "deterministic"]
    lines += [
        "",
        "## Auto-selection (forward, every backend side by side)",
        "",
        "`backend=\"auto\"` walks the preference table in `csrc/cuda/forward/backends.cpp`; "
        "this checks its choice against the fastest backend of the same run.",
        "",
    ]
    lines += auto_table(result, forward_backends)
    lines += [
        "",
        "## Full table",
        "",
    ]
    lines += full_table(result)
    if result.get("notes"):
        lines += ["", "Notes from the run:", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__)
        return 2
    with open(argv[0]) as f:
        result = json.load(f)
    sys.stdout.write(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
