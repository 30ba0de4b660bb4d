"""Render BENCHMARKS.md, and the README's headline table, from a bench.json
written by benchmarks.run: every figure comes from that one run (ours, the
reference and the peers it found installed); nothing is typed in here.

    python -m benchmarks.report benchmarks/results/bench.json > BENCHMARKS.md
    python -m benchmarks.report --readme README.md benchmarks/results/bench.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Sequence

from .peers import PEERS

# The committed results; a run's own (benchmarks.run's default --out,
# what `make bench` writes) is rendered first where there is one.
DEFAULT_RESULTS = "benchmarks/results/bench.json"
RUN_RESULTS = "results/bench.json"
# The README's block, between these lines, is headline()'s.
HEADLINE_BEGIN = "<!-- headline: written by `python -m benchmarks.report --readme README.md` -->"
HEADLINE_END = "<!-- /headline -->"
HEADLINE_DTYPES = ("bf16", "fp32")


def _row(rows: List[Dict], wl: str, dtype: str, impl: str, pas: str):
    for r in rows:
        if (r["workload"], r["dtype"], r["impl"], r["pass_"]) == (wl, dtype, impl, pas):
            return r
    return None


def _fmt(x, spec=".0f"):
    return "" if x is None else format(x, spec)


def _us(x) -> str:
    return "" if x is None else (f"{x:.1f}" if x < 100 else f"{x:.0f}")


def kind_of(name: str) -> str:
    """What an implementation is in the results: ours, a peer or the reference."""
    return "peer" if name in PEERS else "reference" if name == "reference" else "ours"


def _kind(r: Dict) -> str:
    """A row's kind (results written before rows said so: by name)."""
    return r.get("kind") or kind_of(r["impl"])


def peers_in(result: Dict) -> List[str]:
    """The peers the run measured, in peers.PEERS' order."""
    found = {r["impl"] for r in result["rows"] if _kind(r) == "peer"}
    return [p for p in PEERS if p in found] + sorted(found - set(PEERS))


def _cell(rows: List[Dict], wl: str, dtype: str, impl: str) -> Optional[Dict]:
    """An implementation's forward / backward and forward error for one
    (workload, dtype), or None where the run has no forward of it."""
    f = _row(rows, wl, dtype, impl, "fwd")
    if f is None:
        return None
    b = _row(rows, wl, dtype, impl, "fwdbwd")
    return {"fwd": f["time_us"], "bwd": b.get("bwd_us") if b else None, "err": f["rel_err"]}


def _text(c: Optional[Dict]) -> str:
    if c is None:
        return "-"
    times = _us(c["fwd"]) + ("" if c["bwd"] is None else f" / {_us(c['bwd'])}")
    return f"{times} ({c['err']:.1e})"


def peer_table(result: Dict, dtypes: Sequence[str], canonical_only: bool = False) -> List[str]:
    """Ours (the backend auto picks for each row) beside every peer the run
    measured, per (workload, dtype): forward / backward in microseconds,
    the forward's error against float64, and our speed-up over the fastest
    peer of the row (its time / ours, forward and backward)."""
    rows = result["rows"]
    peers = peers_in(result)
    keys = [k for k in dict.fromkeys((r["workload"], r["dtype"]) for r in rows if r["pass_"] == "fwd")
            if k[1] in dtypes and not (canonical_only and ("@" in k[0] or "/" in k[0]))]
    keys.sort(key=lambda k: list(dtypes).index(k[1]))
    head = ["workload", "dtype", "ours"] + peers + (["ours vs the fastest peer"] if peers else [])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for wl, dt in keys:
        pick = next((r.get("auto_choice") for r in rows
                     if (r["workload"], r["dtype"]) == (wl, dt) and r.get("auto_choice")), None)
        ours = _cell(rows, wl, dt, pick) if pick else None
        if ours is None:
            continue
        theirs = {p: _cell(rows, wl, dt, p) for p in peers}

        def speedup(key):
            best = min((c[key] for c in theirs.values() if c and c[key] is not None), default=None)
            return "-" if best is None or ours[key] is None else f"{best / ours[key]:.2f}x"

        cells = [wl, dt, _text(ours)] + [_text(theirs[p]) for p in peers]
        if peers:
            fwd, bwd = speedup("fwd"), speedup("bwd")
            cells.append("-" if fwd == bwd == "-" else f"{fwd} / {bwd}")
        out.append("| " + " | ".join(cells) + " |")
    return out


def _on_gpu(result: Dict) -> bool:
    return result["env"].get("device", "cuda") != "cpu"


def _timing_words(result: Dict) -> str:
    """How the run timed, in words a newcomer can place."""
    rows = result["rows"]
    if not _on_gpu(result):
        return "wall-clock medians on the CPU"
    eager = sorted({r["impl"] for r in rows
                    if r.get("method") == "events" and r["impl"] != "reference"})
    return ("GPU time of each call with nothing else running (the calls recorded once in a CUDA "
            "graph and replayed)" + (f"; {', '.join(eager)} timed between CUDA events "
                                    "(their calls cannot be recorded)" if eager else ""))


def _caption(result: Dict) -> str:
    env = result["env"]
    return (f"{env.get('device_name')}, {env['date'][:10]}, commit `{env['commit']}`: one "
            "`benchmarks.run --full`, ours and every other implementation installed (the "
            "peers) in the same process, " + _timing_words(result))


def headline(result: Dict) -> str:
    """The README's headline block: ours beside every peer of the run, one caption."""
    peers = peers_in(result)
    lines = [HEADLINE_BEGIN, "",
             _caption(result) + ". Forward / backward in microseconds, the forward's relative "
             "error against float64 in brackets; ours is the backend `auto` picks"
             + (", the last column our speed-up over the fastest peer of the row (forward / "
                "backward)." if peers else
                "; no peer was installed on that machine, so ours stands alone (BENCHMARKS.md "
                "says why each was skipped).")
             + " bf16 and fp16 take fp32 locations and weights. fp16, the encoders with "
             "smoothly varying offsets (`@smooth`, [docs/workloads.md](docs/workloads.md)) and "
             "every backend: [BENCHMARKS.md](BENCHMARKS.md).",
             ""]
    lines += peer_table(result, HEADLINE_DTYPES, canonical_only=True)
    lines += ["", HEADLINE_END]
    return "\n".join(lines) + "\n"


def replace_headline(readme: str, block: str) -> str:
    """readme with its headline block (HEADLINE_BEGIN to HEADLINE_END) replaced by `block`."""
    start, end = readme.find(HEADLINE_BEGIN), readme.find(HEADLINE_END)
    if start < 0 or end < start:
        raise ValueError(f"the README has no headline block ({HEADLINE_BEGIN} ... {HEADLINE_END})")
    return readme[:start] + block + readme[end + len(HEADLINE_END) + 1:]


def full_table(result: Dict) -> List[str]:
    torch_timer = any("torch_us" in r for r in result["rows"])
    extra_h = " torch.utils.benchmark (us, IQR) |" if torch_timer else ""
    spread = any("spread_us" in r for r in result["rows"])
    out = [
        "| workload | dtype | pass | impl | time (us) |" + (" spread (us) |" if spread else "")
        + " bwd (us) | GB/s | x floor | floor (us) "
        "| rel. error (out; or grad value / loc / weights) |" + extra_h,
        "|---|---|---|---|---:|" + ("---:|" if spread else "") + "---:|---:|---:|---:|---|"
        + ("---|" if torch_timer else ""),
    ]
    for r in result["rows"]:
        err = " / ".join(f"{e:.1e}" for e in r.get("rel_err_by_input", [r["rel_err"]]))
        extra = ""
        if torch_timer:
            extra = f" {r['torch_us']:.1f} ({r['torch_iqr_us']:.1f}) |" if "torch_us" in r else " |"
        out.append(
            f"| {r['workload']} | {r['dtype']} | {r['pass_']} | {r['impl']} | {r['time_us']:.1f} | "
            + (f"{_fmt(r.get('spread_us'), '.1f')} | " if spread else "")
            + f"{_fmt(r.get('bwd_us'), '.1f')} | {r['GBps']:{'.0f' if r['GBps'] >= 10 else '.2g'}} | {r['x_floor']:.1f} | "
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


def render(result: Dict, chart: str = "benchmarks/results/bench.png",
           source: str = DEFAULT_RESULTS) -> str:
    env = result["env"]
    ours = sorted({r["impl"] for r in result["rows"] if _kind(r) == "ours"})
    timer = env.get("timer", "graph")
    peers = peers_in(result)
    gpu = _on_gpu(result)
    scaled = sorted({r["workload"] for r in result["rows"] if "/" in r["workload"]})
    if gpu:
        device = (f"- device: **{env.get('device_name')}** ({env.get('sm_count', '?')} SMs), "
                  f"torch {env['torch']}, CUDA {env['cuda']}")
        times = ("- times: medians of the " + _timing_words(result)
                 + "; the grid_sample reference (it reads level shapes on the host) between "
                 "CUDA events; inputs rotated so that they do not sit in L2")
    else:
        device = (f"- device: **{env.get('device_name')}**, the CPU ({env.get('threads', '?')} "
                  f"threads), torch {env['torch']}")
        times = ("- times: " + _timing_words(result)
                 + ("; workloads scaled down (`name/k`: a k-th of the queries and of every "
                    "level's pixels, as --scale sets)" if scaled else ""))
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `python -m benchmarks.report {source}` from one run of "
        "`python -m benchmarks.run` (the workloads of [docs/workloads.md](docs/workloads.md), "
        "every backend and every other implementation installed, the peers, side by side). "
        "Nothing here is written by hand.",
        "",
        device,
        f"- date: {env['date']}, commit: `{env['commit']}`"
        + (f", in {env['parts']} parts on that machine (`--resume`)" if env.get("parts", 1) > 1
           else ""),
        f"- memory copy rate measured in the same run: "
        f"{env['copy_bandwidth_GBps']:.0f} GB/s (floors below use it)",
        times
        + ("" if timer == "graph" else "; the torch.utils.benchmark column: "
           "Timer.blocked_autorange of eager calls (launch overhead included), median and IQR"),
        "- bf16 / fp16 rows: 16-bit value and output, fp32 locations and weights (the autocast "
        "case); errors are ||out - ref|| / ||ref|| against float64 on the same inputs",
        "- `bwd` = (forward + backward) - forward of the same implementation; `deterministic` is "
        "`auto` with `deterministic=True`",
        "",
        f"![time per backend per workload]({chart})",
        "",
        "## Against the peers (ours: the backend auto picks for each row)",
        "",
        (f"Measured in this run, side by side: {', '.join(peers)} (benchmarks/peers.py says how "
         "each is called). " if peers else
         "No peer was installed on the machine of this run (the notes at the end say why each "
         "was skipped): ours alone. ")
        + "Times in microseconds, forward / backward; errors of the forward against float64.",
        "",
    ]
    lines += peer_table(result, ("fp32", "bf16", "fp16"))
    # Forward backends only ("deterministic" changes the backward alone).
    forward_backends = [b for b in ours if b != "deterministic"]
    lines += [
        "",
        "## Auto-selection (forward, every backend side by side)",
        "",
        "`backend=\"auto\"` takes the first backend of the forward planner's table "
        "(`csrc/plan/forward_plan.cpp`) that can run and that it may pick; this checks its choice "
        "against the fastest backend of the same run.",
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
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.report",
        description="Render BENCHMARKS.md (to standard output) or the README's headline table (in "
                    "place, --readme) from the results of one benchmarks.run.")
    ap.add_argument("results", nargs="?", default=None,
                    help=f"a bench.json written by benchmarks.run (default: {RUN_RESULTS}, the "
                         f"last run's, where there is one, else the committed {DEFAULT_RESULTS})")
    ap.add_argument("--readme", metavar="PATH",
                    help="rewrite the headline block of this README in place instead")
    args = ap.parse_args(argv)
    if args.results is None:
        args.results = RUN_RESULTS if os.path.exists(RUN_RESULTS) else DEFAULT_RESULTS
        print(f"benchmarks.report: rendering {args.results}", file=sys.stderr)
    with open(args.results) as f:
        result = json.load(f)
    if args.readme:
        with open(args.readme) as f:
            text = f.read()
        with open(args.readme, "w") as f:
            f.write(replace_headline(text, headline(result)))
        return 0
    chart = os.path.join(os.path.dirname(args.results) or ".", "bench.png")
    sys.stdout.write(render(result, chart=os.path.relpath(chart) if os.path.isabs(chart) else chart,
                            source=args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
