"""The benchmark suite and the workload generators cannot rot: run them on tiny inputs."""
import json

import pytest
import torch

from ms_deform_attn import testing as W


def test_floors_match_the_spec():
    # Floors in microseconds at 4.3 TB/s, bf16 value with fp32 locations and
    # weights (../shared/WORKLOADS.md).
    spec = {"seed": 91, "ddetr_enc": 26.5, "ddetr_dec": 5.6, "dino_dec": 12.3,
            "rtdetr_dec": 17.9, "dino5_enc": 60.9, "bevformer_tsa": 26.2, "m2f_enc": 10.9}
    for name, floor_us in spec.items():
        got = W.floor_bytes(W.get(name), torch.bfloat16, torch.float32) / 4.3e12 * 1e6
        assert round(got, 1) == pytest.approx(floor_us, abs=0.11), name  # spec rounds


@pytest.mark.parametrize("name,lo,hi", [("ddetr_enc", 0.05, 0.11), ("m2f_enc", 0.05, 0.11),
                                        ("ddetr_dec", 0.25, 0.36), ("seed/8", 0.0, 0.0)])
def test_generators_outside_fraction(name, lo, hi):
    # The spec: encoders about 6-10 % outside the map, decoders about 30 %.
    wl = W.replace(W.get(name), n=1)
    loc = W.sampling_locations(wl, torch.Generator().manual_seed(0))
    assert loc.shape == (wl.n, wl.queries, wl.m, len(wl.levels), wl.p, 2)
    assert lo <= W.outside_fraction(loc) <= hi


def test_encoder_queries_are_pixels():
    wl = W.get("m2f_enc/8")
    ref = W.encoder_reference_points(wl.levels, "cpu")
    assert ref.shape == (wl.s, 2)
    h, w = wl.levels[0]
    assert ref[0].tolist() == [0.5 / w, 0.5 / h]
    assert ref[1].tolist() == [1.5 / w, 0.5 / h]


def test_benchmark_runs_on_a_tiny_workload(tmp_path):
    pytest.importorskip("benchmarks", reason="benchmarks/ is the checkout's, not the package's: run from the checkout")
    from benchmarks.run import main

    rc = main(["--workloads", "ddetr_dec/8,m2f_enc/8", "--dtypes", "fp32", "--device", "cpu",
               "--scale", "1", "--target-ms", "5", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    impls = {r["impl"] for r in result["rows"]}
    assert {"cpu", "reference"} <= impls
    for r in result["rows"]:
        assert r["time_us"] > 0 and r["floor_us"] > 0 and r["wall_s"] > 0
        assert r["rel_err"] <= 1e-5, r
    assert any("bwd_us" in r for r in result["rows"])
    try:
        import matplotlib  # noqa: F401  (the chart is optional, written when it is there)
    except ImportError:
        return
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_benchmark_times_with_torch_utils_benchmark(tmp_path, capsys):
    """--timer both: torch.utils.benchmark's blocked_autorange beside the
    default timer for every row, and its Compare table across backends."""
    pytest.importorskip("benchmarks", reason="benchmarks/ is the checkout's, not the package's: run from the checkout")
    from benchmarks.run import main

    rc = main(["--workloads", "ddetr_dec/16", "--dtypes", "fp32,bf16", "--device", "cpu", "--scale", "1",
               "--backends", "cpu,reference", "--timer", "both", "--target-ms", "20", "--no-plot",
               "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["env"]["timer"] == "both"
    for r in result["rows"]:
        assert r["torch_us"] > 0 and r["torch_iqr_us"] >= 0 and r["time_us"] > 0, r
        assert r["rel_err"] == r["rel_err"], r  # no NaN: the bf16 reference rows included
    out = capsys.readouterr().out
    assert "ms_deform_attn fwd" in out and "ddetr_dec/16 bf16" in out  # the Compare table


def test_smooth_generator():
    """`smooth`: one query per pixel, deterministic for a seed, neighbouring
    queries' samples close together (closer than `encoder`'s jitter puts
    them), a share outside the map; only for one-query-a-pixel workloads."""
    def neighbour_step(name):
        wl = W.get(name)
        loc = W.sampling_locations(wl, torch.Generator().manual_seed(0))
        h, w = wl.levels[0]
        pix = loc[0, :h * w, :, 0, :, :].reshape(h, w, -1, 2) * torch.tensor([w, h],
                                                                             dtype=torch.float64)
        return (pix[:, 1:] - pix[:, :-1]).norm(dim=-1).median().item(), loc

    smooth, loc = neighbour_step("ddetr_enc@smooth/4")
    jitter, _ = neighbour_step("ddetr_enc/4")
    assert W.get("ddetr_enc@smooth").locations == "smooth"
    assert W.get("ddetr_enc@smooth/4").name == "ddetr_enc@smooth/4"
    assert smooth < 1.5 < jitter
    again = W.sampling_locations(W.get("ddetr_enc@smooth/4"), torch.Generator().manual_seed(0))
    assert torch.equal(loc, again)
    assert 0.01 < W.outside_fraction(loc) < 0.6
    with pytest.raises(KeyError, match="one query per pixel"):
        W.get("ddetr_dec@smooth")
    with pytest.raises(KeyError, match="unknown location generator"):
        W.get("ddetr_enc@bogus")


def test_layer_and_model_benchmarks_run(tmp_path):
    """benchmarks.layer on tiny inputs: every implementation's layer gives the
    same output from the same weights, and the model benchmark runs."""
    pytest.importorskip("benchmarks", reason="benchmarks/ is the checkout's, not the package's: run from the checkout")
    from benchmarks import layer as LB

    wl = W.get("m2f_enc/16")
    query, flat, ref, shapes, start, grad = LB.layer_inputs(wl, 32, "cpu")
    levels = [tuple(x) for x in wl.levels]
    impls = ["ours", "pytorch"]
    try:
        import transformers  # noqa: F401
        impls += ["transformers", "swapped"]
    except ImportError:
        pass
    outs = [LB.call_layer(LB.make_layer(i, wl, 32, "cpu"), query, flat, ref, shapes, start, levels)
            for i in impls]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-4, atol=1e-5)
    rows = LB.bench_layer(LB.parse_args(["--workloads", "m2f_enc/16", "--dtypes", "fp32",
                                         "--impls", ",".join(impls), "--d-model", "32",
                                         "--target-ms", "1", "--device", "cpu"]))
    assert [r["impl"] for r in rows] == impls
    assert all(r["fwdbwd_us"] > 0 and r["saved_bytes"] > 0 for r in rows)
    if "transformers" in impls:
        assert LB.main(["--model", "--tiny-model", "--image", "96x128", "--batch", "2", "--target-ms",
                        "1", "--device", "cpu", "--out", str(tmp_path)]) == 0
        rows = json.loads((tmp_path / "model.json").read_text())["rows"]
        assert [r["path"] for r in rows] == ["transformers", "swapped"]


@pytest.mark.parametrize("impl", ["ours", "fused", "fused-recompute"])
def test_saved_bytes_leaves_no_graph_alive(impl):
    # The count of saved tensors must not keep the forward's graph (and the
    # leaves' AccumulateGrad nodes) alive: a graph kept from an eager step on
    # one stream broke a CUDA-graph capture on another. A hook on each
    # leaf's AccumulateGrad node fires in the next step only if the node
    # lived on.
    pytest.importorskip("benchmarks", reason="benchmarks/ is the checkout's, not the package's: run from the checkout")
    from benchmarks import layer as LB
    wl = W.get("m2f_enc/16")
    query, flat, ref, shapes, start, grad = LB.layer_inputs(wl, 32, "cpu")
    levels = [tuple(x) for x in wl.levels]
    layer = LB.make_layer(impl, wl, 32, "cpu")
    q_in, f_in = (t.detach().clone().requires_grad_() for t in (query, flat))
    forward, step, leaves = LB.layer_fns(layer, "cpu", "fp32", q_in, f_in, ref, shapes, start,
                                         grad, levels)
    assert LB.saved_bytes(forward) > 0
    fired = []
    for i, t in enumerate(leaves):
        node = t.view_as(t).grad_fn.next_functions[0][0]
        node.register_hook(lambda gi, go, i=i: fired.append(i))
        del node
    step()
    assert fired == []


def test_peer_table_follows_auto_and_shows_every_measured_peer():
    pytest.importorskip("benchmarks", reason="benchmarks/ is the checkout's, not the package's: run from the checkout")
    from benchmarks.report import peer_table

    def row(impl, dtype, t, auto, err=1e-6, kind=None, pas="fwd", bwd=None):
        r = {"workload": "ddetr_enc", "dtype": dtype, "impl": impl, "pass_": pas,
             "time_us": t, "rel_err": err, "auto_choice": auto}
        if kind:
            r["kind"] = kind
        if bwd is not None:
            r["bwd_us"] = bwd
        return r

    rows = [row("baseline", "fp32", 251.0, "blocked"), row("blocked", "fp32", 210.0, "blocked"),
            row("blocked", "fp32", 1000.0, "blocked", pas="fwdbwd", bwd=790.0),
            row("triton", "fp32", 196.0, "blocked"),
            row("triton", "fp32", 1200.0, "blocked", pas="fwdbwd", bwd=1004.0),
            row("deformops-cuda", "fp32", 420.0, "blocked", kind="peer"),
            row("baseline", "bf16", 157.0, "baseline"), row("blocked", "bf16", 161.0, "baseline"),
            row("triton", "bf16", 248.0, "baseline", 0.16)]
    out = peer_table({"rows": rows, "env": {}}, ("fp32", "bf16"))
    assert out[0] == "| workload | dtype | ours | triton | deformops-cuda | ours vs the fastest peer |"
    cells = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[1:-1]]
             for line in out[2:]}
    assert cells["fp32"][2] == "210 / 790 (1.0e-06)"       # auto's choice, blocked
    assert cells["fp32"][3] == "196 / 1004 (1.0e-06)"      # the Triton peer measured in the run
    assert cells["fp32"][4] == "420 (1.0e-06)"             # forward only
    assert cells["fp32"][5] == "0.93x / 1.27x"             # against the fastest peer of each pass
    assert cells["bf16"][2] == "157 (1.0e-06)"             # auto's choice, baseline
    assert cells["bf16"][3] == "248 (1.6e-01)" and cells["bf16"][4] == "-"
    assert cells["bf16"][5] == "1.58x / -"


def test_committed_reports_regenerate_from_the_committed_results():
    """BENCHMARKS.md and the README's headline block are what
    benchmarks.report writes from benchmarks/results/bench.json, byte for
    byte: no figure in them is typed by hand."""
    pytest.importorskip("benchmarks", reason="benchmarks/ is the checkout's, not the package's: run from the checkout")
    import pathlib

    from benchmarks.report import HEADLINE_BEGIN, headline, render, replace_headline

    root = pathlib.Path(__file__).resolve().parents[2]
    result = json.loads((root / "benchmarks/results/bench.json").read_text())
    assert render(result) == (root / "BENCHMARKS.md").read_text()
    readme = (root / "README.md").read_text()
    assert HEADLINE_BEGIN in readme
    assert replace_headline(readme, headline(result)) == readme


def test_report_help(capsys):
    pytest.importorskip("benchmarks", reason="benchmarks/ is the checkout's, not the package's: run from the checkout")
    from benchmarks.report import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "--readme" in capsys.readouterr().out


def test_busy_machine_is_reported(tmp_path, monkeypatch):
    """CPU rows carry their spread; a run whose measurements spread widely
    says the machine was busy instead of passing for a result."""
    pytest.importorskip("benchmarks", reason="benchmarks/ is the checkout's, not the package's: run from the checkout")
    from benchmarks import run

    monkeypatch.setattr(run, "BUSY_SPREAD", -1.0)  # every measurement counts as spread
    assert run.main(["--workloads", "ddetr_dec/16", "--dtypes", "fp32", "--device", "cpu",
                     "--scale", "1", "--backends", "cpu", "--passes", "fwd", "--target-ms", "5",
                     "--no-plot", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert all(r["spread_us"] >= 0 for r in result["rows"])
    assert any(n.startswith("the machine was busy") for n in result["notes"])


def test_peers_get_their_dtypes_before_timing(tmp_path, monkeypatch):
    # A peer that takes locations and weights in value's dtype is handed
    # them converted (new leaves, outside the timed step), never casts itself.
    pytest.importorskip("benchmarks", reason="benchmarks/ is the checkout's, not the package's: run from the checkout")
    from benchmarks import peers, run, timing
    from ms_deform_attn.reference import ms_deform_attn_pytorch

    seen = []

    def make():
        def fn(value, shapes, start, loc, attn):
            seen.append((loc.dtype, attn.dtype, value.dtype))
            return ms_deform_attn_pytorch(value, shapes, start, loc, attn)
        return fn

    fake = {"fake": peers.Peer(make, locations=peers.AS_VALUE, weights=peers.AS_VALUE)}
    for mod in (peers, run, timing):
        monkeypatch.setattr(mod, "PEERS", fake)
    rc = run.main(["--workloads", "ddetr_dec/8", "--dtypes", "bf16", "--device", "cpu",
                   "--scale", "1", "--target-ms", "1", "--backends", "fake", "--no-plot",
                   "--out", str(tmp_path)])
    assert rc == 0 and seen
    assert set(seen) == {(torch.bfloat16, torch.bfloat16, torch.bfloat16)}
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert {r["pass_"] for r in rows} == {"fwd", "fwdbwd"}


def test_a_backward_is_derived_only_above_the_spreads():
    pytest.importorskip("benchmarks", reason="benchmarks/ is the checkout's, not the package's: run from the checkout")
    from benchmarks.run import backward_us

    fwd = {"time_us": 100.0, "spread_us": 2.0}
    assert backward_us({"time_us": 300.0, "spread_us": 3.0}, fwd) == 200.0
    # A busy machine: the forward + backward read faster than the forward.
    assert backward_us({"time_us": 90.0, "spread_us": 3.0}, fwd) is None
    assert backward_us({"time_us": 104.0, "spread_us": 3.0}, fwd) is None


def test_repetitions_fit_the_target_and_stay_few_for_slow_steps():
    pytest.importorskip("benchmarks", reason="benchmarks/ is the checkout's, not the package's: run from the checkout")
    from benchmarks.timing import repetitions

    assert repetitions(0.01, 100, 10, 2000) == 2000  # capped
    assert repetitions(1.0, 100, 10, 2000) == 100  # as many as fit the target
    assert repetitions(20.0, 100, 10, 2000) == 10  # at least min_reps ...
    assert repetitions(40.0, 100, 10, 2000) == 10
    assert repetitions(41.0, 100, 10, 2000) == 3  # ... unless they pass 4x the target
    assert repetitions(500.0, 100, 10, 2000) == 3


def test_the_wall_summary_names_where_the_time_went():
    pytest.importorskip("benchmarks", reason="benchmarks/ is the checkout's, not the package's: run from the checkout")
    from benchmarks.run import wall_summary

    rows = [{"impl": "a", "wall_s": 1.0}, {"impl": "b", "wall_s": 3.0}, {"impl": "a", "wall_s": 1.5}]
    assert wall_summary(rows, 7.0) == "wall time 7.0 s, 3 measurements: b 3.0, a 2.5, the rest 1.5"


def test_the_report_of_a_cpu_run_says_what_it_measured(tmp_path, monkeypatch):
    """`benchmarks.report` with no argument renders the run `make bench` just
    wrote (results/bench.json), and a CPU run's report speaks of the CPU, of
    scaled-down workloads and of the run's own chart."""
    pytest.importorskip("benchmarks", reason="benchmarks/ is the checkout's, not the package's: run from the checkout")
    from benchmarks import report, run

    monkeypatch.chdir(tmp_path)
    assert run.main(["--workloads", "ddetr_dec", "--dtypes", "fp32", "--device", "cpu",
                     "--scale", "8", "--target-ms", "1", "--backends", "cpu", "--no-plot"]) == 0
    out = tmp_path / "report.md"
    import contextlib
    with open(out, "w") as f, contextlib.redirect_stdout(f):
        assert report.main([]) == 0
    text = out.read_text()
    assert "python -m benchmarks.report results/bench.json" in text
    assert "the CPU" in text and "scaled down" in text and "(results/bench.png)" in text
    assert "SMs" not in text and "CUDA graph" not in text


def test_a_run_resumes_where_it_stopped(tmp_path):
    """--resume keeps the (workload, dtype) pairs bench.json already holds
    (written after every pair) and times only the rest, into one result."""
    pytest.importorskip("benchmarks", reason="benchmarks/ is the checkout's, not the package's: run from the checkout")
    from benchmarks.run import main

    common = ["--device", "cpu", "--scale", "8", "--target-ms", "1", "--backends", "cpu",
              "--no-plot", "--out", str(tmp_path)]
    assert main(["--workloads", "ddetr_dec", "--dtypes", "fp32"] + common) == 0
    first = json.loads((tmp_path / "bench.json").read_text())
    assert main(["--workloads", "ddetr_dec,m2f_enc", "--dtypes", "fp32", "--resume"] + common) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["env"]["parts"] == 2 and result["env"]["date"] == first["env"]["date"]
    pairs = [(r["workload"], r["pass_"]) for r in result["rows"]]
    assert pairs.count(("ddetr_dec/8", "fwd")) == 1 and ("m2f_enc/8", "fwd") in pairs
    assert result["rows"][:len(first["rows"])] == first["rows"]


def test_a_run_stops_at_its_deadline_and_resumes(tmp_path, capsys):
    """--deadline-s starts no pair after it (a device call's limit); --resume
    times the rest into the same result."""
    pytest.importorskip("benchmarks", reason="benchmarks/ is the checkout's, not the package's: run from the checkout")
    from benchmarks.run import main

    common = ["--workloads", "ddetr_dec,m2f_enc", "--dtypes", "fp32", "--device", "cpu",
              "--scale", "8", "--target-ms", "1", "--backends", "cpu", "--no-plot",
              "--out", str(tmp_path)]
    assert main(common + ["--deadline-s", "0"]) == 0
    assert "stopped at --deadline-s 0: m2f_enc/8 fp32" in capsys.readouterr().err
    first = json.loads((tmp_path / "bench.json").read_text())
    assert {r["workload"] for r in first["rows"]} == {"ddetr_dec/8"}
    assert main(common + ["--resume"]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert {r["workload"] for r in result["rows"]} == {"ddetr_dec/8", "m2f_enc/8"}
