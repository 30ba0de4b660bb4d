"""The forward's policy as a table: problems, devices and the plan the
forward planner (csrc/plan/forward_plan.cpp, through
ms_deform_attn.select_forward_plan) makes for them. Runs on the CPU: the
planner is a pure function of the problem's sizes, dtypes and alignment, the
device's figures (testing.DEVICES) and the caller's wishes. docs/backends.md
explains why auto picks what it picks."""
import pytest
import torch

import ms_deform_attn as msda
from ms_deform_attn import testing as W
from helpers import planner_problem as problem

DEV = W.DEVICES


def plan_of(args, device="H200", **wishes):
    kwargs = dict(wishes)
    if kwargs.pop("host_shapes", False):
        kwargs["spatial_shapes_list"] = W.get(args[0].split("@")[0]).levels
    return msda.select_forward_plan(*problem(*args), device=DEV[device], **kwargs)


def blocked(vec, lanes, threads, split):
    return dict(backend="blocked", vec=vec, lanes=lanes, threads=threads, split=split)


# (id, problem arguments, device, wishes, expected part of the plan)
TABLE = [
    # Encoders: `blocked` with full blocks and the shared slots, 16 bytes a lane.
    ("ddetr_enc-fp32-H200", ("ddetr_enc", "fp32"), "H200", {}, blocked(4, 8, 256, 0)),
    ("ddetr_enc-bf16-H200", ("ddetr_enc", "bf16"), "H200", {}, blocked(8, 4, 256, 0)),
    ("ddetr_enc-fp16-A100", ("ddetr_enc", "fp16"), "A100", {}, blocked(8, 4, 256, 0)),
    ("m2f_enc-fp32-RTX5090", ("m2f_enc", "fp32"), "RTX5090", {}, blocked(4, 8, 256, 0)),
    # One level (BEVFormer): the slots without the level table.
    ("bevformer_tsa-bf16-H100", ("bevformer_tsa", "bf16"), "H100", {},
     dict(blocked(8, 4, 256, 0), one_level=True)),
    ("bevformer_tsa-fp32-H200", ("bevformer_tsa", "fp32"), "H200", {},
     dict(blocked(4, 8, 256, 0), one_level=True)),
    ("ddetr_enc-bf16-one-level-no", ("ddetr_enc", "bf16"), "H100", {},
     dict(blocked(8, 4, 256, 0), one_level=False)),
    # Its kernel serves 16-byte vectors, not the fused operator.
    ("bevformer_tsa-fp32-D30", ("bevformer_tsa", "fp32", 30), "H200", {},
     dict(blocked(1, 32, 256, 0), one_level=False)),
    ("bevformer_tsa-bf16-fused", ("bevformer_tsa", "bf16"), "H200", {"fused": True},
     dict(blocked(8, 4, 256, 0), one_level=False)),
    # One head (seed): blocked too (its prologue alone puts it ahead).
    ("seed-bf16-H200", ("seed", "bf16"), "H200", {}, blocked(8, 4, 256, 0)),
    # fp64 is not measured: baseline.
    ("ddetr_enc-fp64-H200", ("ddetr_enc", "fp64"), "H200", {},
     dict(backend="baseline", vec=2, lanes=16, threads=256)),
    # Decoders: few rows, so smaller blocks (at least 2 an SM) and rows with
    # per-lane set-up split over groups while the SMs stay light; the split
    # and the block size follow the SM count.
    ("ddetr_dec-fp32-H200", ("ddetr_dec", "fp32"), "H200", {}, blocked(4, 8, 128, 2)),
    ("ddetr_dec-bf16-H200", ("ddetr_dec", "bf16"), "H200", {}, blocked(8, 4, 64, 4)),
    ("ddetr_dec-fp32-A100", ("ddetr_dec", "fp32"), "A100", {}, blocked(4, 8, 128, 1)),
    ("ddetr_dec-bf16-A100", ("ddetr_dec", "bf16"), "A100", {}, blocked(8, 4, 64, 2)),
    ("ddetr_dec-fp32-RTX5090", ("ddetr_dec", "fp32"), "RTX5090", {}, blocked(4, 8, 64, 2)),
    # 28 SMs: enough rows an SM for the shared slots and full blocks.
    ("ddetr_dec-fp32-RTX3060", ("ddetr_dec", "fp32"), "RTX3060", {}, blocked(4, 8, 256, 0)),
    ("ddetr_dec-bf16-T4", ("ddetr_dec", "bf16"), "T4", {}, blocked(8, 4, 256, 1)),
    ("dino_dec-bf16-H200", ("dino_dec", "bf16"), "H200", {}, blocked(8, 4, 256, 0)),
    ("rtdetr_dec-fp32-H200", ("rtdetr_dec", "fp32"), "H200", {}, blocked(4, 8, 256, 0)),
    # A value not 16-byte aligned: no vectors (then no per-lane set-up).
    ("ddetr_dec-bf16-misaligned", ("ddetr_dec", "bf16", None, torch.float32, True), "H200", {},
     dict(backend="blocked", vec=1, lanes=32, split=0, copy_value=False)),
    # D = 30: no 16-byte vectors either.
    ("ddetr_enc-fp32-D30", ("ddetr_enc", "fp32", 30), "H200", {}, blocked(1, 32, 256, 0)),
    # The fused operator: blocked and baseline form its points; fp64 values
    # and the other backends take the composite.
    ("ddetr_dec-bf16-fused", ("ddetr_dec", "bf16"), "H200", {"fused": True},
     dict(blocked(8, 4, 64, 0), composite=False)),
    ("ddetr_dec-fp64-fused", ("ddetr_dec", "fp64"), "H200", {"fused": True},
     dict(backend="baseline", composite=True)),
    ("ddetr_dec-bf16-fused-persistent", ("ddetr_dec", "bf16"), "H200",
     {"fused": True, "backend": "persistent"}, dict(backend="persistent", composite=True)),
    # Explicit requests: the caching backends' shared-memory budgets within
    # what a block may opt in to (beside 48 bytes of slots a thread).
    ("ddetr_enc-fp32-persistent-H200", ("ddetr_enc", "fp32"), "H200", {"backend": "persistent"},
     dict(backend="persistent", smem_budget=96 * 1024, workspace=2 * 8 * 4)),
    ("ddetr_enc-fp32-persistent-T4", ("ddetr_enc", "fp32"), "T4", {"backend": "persistent"},
     dict(backend="persistent", smem_budget=65536 - 2048 - 48 * 1024)),
    ("ddetr_enc-bf16-cluster-H200", ("ddetr_enc", "bf16"), "H200", {"backend": "cluster"},
     dict(backend="cluster", smem_budget=232448 - 2048 - 48 * 1024)),
    ("ddetr_enc-bf16-tma-H200", ("ddetr_enc", "bf16"), "H200",
     {"backend": "tma", "host_shapes": True}, dict(backend="tma", smem_budget=64 * 1024, vec=8)),
    # tma copies a value that is not 16-byte aligned.
    ("ddetr_enc-bf16-tma-misaligned", ("ddetr_enc", "bf16", None, torch.float32, True), "H200",
     {"backend": "tma", "host_shapes": True}, dict(backend="tma", copy_value=True, vec=8)),
    ("ddetr_dec-fp32-baseline", ("ddetr_dec", "fp32"), "A100", {"backend": "baseline"},
     dict(backend="baseline", vec=4, lanes=8, threads=256, blocks=2 * 300 * 8 * 8 // 256)),
]


@pytest.mark.parametrize("args,device,wishes,expected", [t[1:] for t in TABLE],
                         ids=[t[0] for t in TABLE])
def test_plan(args, device, wishes, expected):
    plan = plan_of(args, device, **wishes)
    assert {k: plan[k] for k in expected} == expected, plan


# (id, problem arguments, device, wishes, the error's text)
REFUSED = [
    ("tma-A100", ("ddetr_enc", "bf16"), "A100", {"backend": "tma", "host_shapes": True},
     r"backend 'tma' cannot run these inputs: needs the Tensor Memory Accelerator \(compute "
     r"capability 9.0 or later\), device has 8.0"),
    ("cluster-RTX3060", ("ddetr_enc", "bf16"), "RTX3060", {"backend": "cluster"},
     r"backend 'cluster' cannot run these inputs: needs thread block clusters .* device has 8.6"),
    ("tma-no-host-shapes", ("ddetr_enc", "bf16"), "H200", {"backend": "tma"},
     r"needs the level shapes on the host"),
    ("tma-fp64", ("ddetr_enc", "fp64"), "H200", {"backend": "tma", "host_shapes": True},
     r"supports float32, float16 and bfloat16 values, got float64"),
    ("tma-D6", ("ddetr_enc", "fp32", 6), "H200", {"backend": "tma", "host_shapes": True},
     r"needs D \* element size to be a multiple of 16 bytes and at most 512, got D = 6"),
    ("cpu-on-cuda", ("ddetr_enc", "fp32"), "H200", {"backend": "cpu"},
     r"backend 'cpu' cannot run these inputs: cannot run on CUDA tensors"),
    ("unknown", ("ddetr_enc", "fp32"), "H200", {"backend": "nope"},
     r"unknown backend 'nope'; expected 'auto' or one of \['cpu', 'tma', 'cluster', "
     r"'persistent', 'blocked', 'baseline', 'pytorch'\]"),
]


def test_the_cpp_planner_refuses_the_pytorch_backend():
    """`pytorch` runs in Python (the entry points and the layers); the C++
    planner, asked for it directly, says so."""
    value, shapes, start, loc, attn = problem("ddetr_enc", "fp32")
    with pytest.raises(RuntimeError, match=r"backend 'pytorch' is the operator in plain "
                                           r"PyTorch ops, which the Python entry points run"):
        torch.ops.ms_deform_attn._select_forward_plan(value, shapes, start, loc, attn, None,
                                                      False, "pytorch", None)
    assert msda.backend_reason("pytorch", value, shapes, start, loc, attn) == ""


@pytest.mark.parametrize("args,device,wishes,match", [t[1:] for t in REFUSED],
                         ids=[t[0] for t in REFUSED])
def test_plan_refuses_with_the_reason(args, device, wishes, match):
    with pytest.raises(RuntimeError, match=match):
        plan_of(args, device, **wishes)


def test_every_device_plans_every_workload():
    """auto picks `blocked` for every dtype but fp64, on every device, and a
    launch the device holds."""
    for name, dev in DEV.items():
        for wl in W.WORKLOADS:
            for dtype in ("fp32", "bf16", "fp16", "fp64"):
                plan = plan_of((wl, dtype), name)
                assert plan["backend"] == ("baseline" if dtype == "fp64" else "blocked"), (name, wl)
                assert plan["blocks"] >= 1 and plan["threads"] in (64, 128, 256), (name, wl)
                assert 0 < plan["lanes"] * max(plan["split"], 1) <= 32, (name, wl)


def test_environment_overrides(monkeypatch):
    """MS_DEFORM_ATTN_BACKEND replaces auto's choice; the test hooks reach the plan."""
    monkeypatch.setenv("MS_DEFORM_ATTN_BACKEND", "baseline")
    assert plan_of(("ddetr_enc", "bf16"))["backend"] == "baseline"
    assert plan_of(("ddetr_enc", "bf16"), backend="blocked")["backend"] == "blocked"
    monkeypatch.delenv("MS_DEFORM_ATTN_BACKEND")
    monkeypatch.setenv("MS_DEFORM_ATTN_BLOCKED_ROWS", "shared")
    assert plan_of(("ddetr_dec", "bf16"))["split"] == 0
    monkeypatch.setenv("MS_DEFORM_ATTN_BLOCKED_ROWS", "lane")
    assert plan_of(("ddetr_enc", "bf16"))["split"] == 1
    monkeypatch.delenv("MS_DEFORM_ATTN_BLOCKED_ROWS")
    monkeypatch.setenv("MS_DEFORM_ATTN_SMEM_BUDGET", "4100")
    assert plan_of(("ddetr_enc", "fp32"), backend="persistent")["smem_budget"] == 4096


def test_cpu_tensors_plan_the_cpu_kernel():
    plan = msda.select_forward_plan(*problem("ddetr_dec", "fp32"))
    assert plan["backend"] == "cpu"
    assert msda.select_forward_plan(*problem("ddetr_dec", "fp32"), backend="pytorch") == {
        "backend": "pytorch"}
    with pytest.raises(RuntimeError, match=r"backend 'baseline' cannot run on CPU tensors"):
        msda.select_forward_plan(*problem("ddetr_dec", "fp32"), backend="baseline")


def test_the_backward_planner_takes_the_same_device():
    """One device description for both planners: the flat slot sequence
    pays only with enough tasks a resident warp (an SM count of 1000)."""
    inputs = problem("m2f_enc", "bf16")
    assert msda.select_backward_plan(*inputs, device=DEV["H200"])["dots"] == "mma_flat"
    assert msda.select_backward_plan(*inputs, device=dict(DEV["H200"], sms=1000))["dots"] == "mma"
    # The block-local grad_value needs 32 KB a block (Lq P <= 4096), 48 KB
    # beyond: every listed device has both. Without them a 16-bit decoder
    # takes the global sort where it is dense enough to pay (S / 3 <= Lq L P:
    # DINO's with its denoising queries), else atomics.
    def path(workload, smem_optin=None):
        dev = DEV["T4"] if smem_optin is None else dict(DEV["T4"], smem_optin=smem_optin)
        return msda.select_backward_plan(*problem(workload, "bf16"), device=dev)["grad_value"]

    for dev in DEV.values():
        for workload in ("ddetr_dec", "dino_dec_dn"):
            assert msda.select_backward_plan(*problem(workload, "bf16"), device=dev)["grad_value"] == "local"
    assert path("ddetr_dec", 40 * 1024) == "local" and path("dino_dec_dn", 40 * 1024) == "sorted"
    assert path("ddetr_dec", 24 * 1024) == "atomic"
