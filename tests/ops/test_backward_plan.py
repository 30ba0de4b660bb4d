"""The backward's policy as a table: problems and the plan the planner
(csrc/plan/backward_plan.cpp, through ms_deform_attn.select_backward_plan) makes
for them on a 132-SM device on which every kernel fits. Runs on the CPU: the
planner is a pure function of the problem's sizes, dtypes and alignments.
docs/backward.md explains each row's reason."""
import pytest
import torch

import ms_deform_attn as msda
from ms_deform_attn import testing as W
from helpers import planner_problem as problem

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}




def plan(grad_value, dots, vec, gather="none", gather_vec=1, stage=False, self_records=False,
         composite=False):
    return dict(grad_value=grad_value, dots=dots, vec=vec, gather=gather, gather_vec=gather_vec,
                stage=stage, self_records=self_records, composite=composite)


def staged(dots, vec, fused=False):
    """The block-local path whose walk reads grad_output and the weights from
    shared memory: Lq P <= 4096 and (16 bytes a sample + a grad_output row a
    query) <= 64 KB; it resolves its samples itself, beside the dots kernel,
    but in the fused operator's backward (whose dots kernel computes the
    locations it samples)."""
    return plan("local", dots, vec, stage=True, self_records=not fused)


COMPOSITE = plan("atomic", "ffma", 1, composite=True)

# (id, problem arguments, planner wishes, expected plan)
TABLE = [
    # Dense 16-bit values (the encoders): the sorted path on tensor cores is the faster one.
    ("ddetr_enc-bf16", ("ddetr_enc", "bf16"), {}, plan("sorted", "mma", 8, "tiles", 8)),
    ("ddetr_enc-fp16", ("ddetr_enc", "fp16"), {}, plan("sorted", "mma", 8, "tiles", 8)),
    # L = 3 (L Pp = 12 does not divide a warp): the flat slot sequence, enough tasks.
    ("m2f_enc-bf16", ("m2f_enc", "bf16"), {}, plan("sorted", "mma_flat", 8, "tiles", 8)),
    ("m2f_enc-bf16-fused", ("m2f_enc", "bf16"), {"fused": True}, plan("sorted", "mma_rows", 8, "tiles", 8)),
    ("ddetr_enc-bf16-fused", ("ddetr_enc", "bf16"), {"fused": True}, plan("sorted", "mma", 8, "tiles", 8)),
    # fp32 encoders: atomics (16 bytes of the fp32 accumulator a lane).
    ("ddetr_enc-fp32", ("ddetr_enc", "fp32"), {}, plan("atomic", "ffma", 4)),
    ("ddetr_enc-fp64", ("ddetr_enc", "fp64"), {}, plan("atomic", "ffma", 2)),
    # Deterministic: the global sort where the block-local path cannot hold a
    # level's samples; 32 bytes of the accumulator a lane.
    ("ddetr_enc-fp32-det", ("ddetr_enc", "fp32"), {"deterministic": True},
     plan("sorted", "ffma", 8, "pixels", 4)),
    ("ddetr_enc-fp16-det", ("ddetr_enc", "fp16"), {"deterministic": True},
     plan("sorted", "mma", 8, "tiles", 8)),
    # More samples than S D, beyond what the block-local path holds: the
    # sorted path's scratch would pass 8x the atomic accumulator's, atomics.
    ("ddetr_enc-fp16-overfull", ("ddetr_enc", "fp16", None, torch.float32, False, 50000), {},
     plan("atomic", "ffma", 4)),
    ("ddetr_enc-fp64-det", ("ddetr_enc", "fp64"), {"deterministic": True},
     plan("sorted", "ffma", 4, "pixels", 2)),
    # 16-bit decoders: the block-local grad_value (no sort) is the faster one.
    ("ddetr_dec-bf16", ("ddetr_dec", "bf16"), {}, staged("mma", 8)),
    ("ddetr_dec-fp16", ("ddetr_dec", "fp16"), {}, staged("mma", 8)),
    ("rtdetr_dec-bf16", ("rtdetr_dec", "bf16"), {}, staged("mma", 8)),
    ("rtdetr_dec-bf16-fused", ("rtdetr_dec", "bf16"), {"fused": True},
     staged("mma_rows", 8, fused=True)),
    # DINO's 900 queries: 57.6 KB of weights and as much of grad_output rows,
    # over the staged walk's 64 KB: the walk loads them from global memory.
    ("dino_dec-bf16", ("dino_dec", "bf16"), {}, plan("local", "mma", 8)),
    # fp32 decoders: atomics, unless asked to be deterministic (block-local, FFMA dots).
    ("ddetr_dec-fp32", ("ddetr_dec", "fp32"), {}, plan("atomic", "ffma", 4)),
    ("ddetr_dec-fp32-det", ("ddetr_dec", "fp32"), {"deterministic": True}, staged("ffma", 8)),
    ("ddetr_dec-fp32-fused-det", ("ddetr_dec", "fp32"), {"fused": True, "deterministic": True},
     staged("ffma", 8, fused=True)),
    # 16-bit locations (the fused layers' offsets under autocast) plan alike.
    ("ddetr_dec-bf16-bf16loc", ("ddetr_dec", "bf16", None, torch.bfloat16), {}, staged("mma", 8)),
    # The caller's request (MS_DEFORM_ATTN_GRAD_VALUE): sorted skips the
    # block-local path; atomic yields to deterministic=True; local where it applies.
    ("ddetr_dec-bf16-ask-sorted", ("ddetr_dec", "bf16"), {"grad_value": "sorted"},
     plan("sorted", "mma", 8, "tiles", 8)),
    ("ddetr_dec-bf16-ask-atomic", ("ddetr_dec", "bf16"), {"grad_value": "atomic"}, plan("atomic", "ffma", 4)),
    ("ddetr_dec-bf16-ask-atomic-det", ("ddetr_dec", "bf16"), {"grad_value": "atomic", "deterministic": True},
     staged("mma", 8)),
    ("ddetr_enc-fp32-ask-local", ("ddetr_enc", "fp32"), {"grad_value": "local"},
     plan("sorted", "ffma", 8, "pixels", 4)),
    # A value not 16-byte aligned: no tensor cores, no vectors.
    ("ddetr_enc-bf16-misaligned", ("ddetr_enc", "bf16", None, torch.float32, True), {},
     plan("atomic", "ffma", 1)),
    # D not a multiple of 32: FFMA dots even where the sorted path serves.
    ("ddetr_enc-bf16-D16-det", ("ddetr_enc", "bf16", 16), {"deterministic": True},
     plan("sorted", "ffma", 8, "pixels", 8)),
    # The fused operator's composite: fp64 values, or rows the FFMA kernel
    # cannot take in one vectorised pass (D > 32 vectors, or no vectors).
    ("ddetr_dec-fp64-fused", ("ddetr_dec", "fp64"), {"fused": True}, COMPOSITE),
    ("ddetr_dec-fp32-D256-fused", ("ddetr_dec", "fp32", 256), {"fused": True}, COMPOSITE),
    ("ddetr_dec-fp32-D6-fused", ("ddetr_dec", "fp32", 6), {"fused": True}, COMPOSITE),
]


@pytest.mark.parametrize("args,wishes,expected", [t[1:] for t in TABLE], ids=[t[0] for t in TABLE])
def test_plan(args, wishes, expected):
    assert msda.select_backward_plan(*problem(*args), sms=132, **wishes) == expected


def test_plan_depends_on_the_device():
    """The flat slot sequence pays only with enough tasks a resident warp."""
    inputs = problem("m2f_enc", "bf16")
    assert msda.select_backward_plan(*inputs, sms=132)["dots"] == "mma_flat"
    assert msda.select_backward_plan(*inputs, sms=1000)["dots"] == "mma"


def test_plan_rejects_unknown_requests():
    with pytest.raises(RuntimeError, match="unknown grad_value path 'fast'"):
        msda.select_backward_plan(*problem("ddetr_dec", "bf16"), grad_value="fast")


def test_plan_validates_inputs():
    value, shapes, start, loc, attn = problem("ddetr_dec", "bf16")
    with pytest.raises(RuntimeError, match="sampling_locations"):
        msda.select_backward_plan(value, shapes, start, loc[..., :1], attn)


def test_the_query_takes_the_backwards_path(monkeypatch):
    """The query plans through the backward's own path: grad_value "auto"
    takes MS_DEFORM_ATTN_GRAD_VALUE as the backward does (the forward's
    query takes MS_DEFORM_ATTN_BACKEND alike); an explicit path wins."""
    inputs = problem("ddetr_dec", "bf16")
    assert msda.select_backward_plan(*inputs, deterministic=True)["grad_value"] == "local"
    monkeypatch.setenv("MS_DEFORM_ATTN_GRAD_VALUE", "sorted")
    assert msda.select_backward_plan(*inputs, deterministic=True)["grad_value"] == "sorted"
    assert msda.select_backward_plan(*inputs, deterministic=True,
                                     grad_value="local")["grad_value"] == "local"
    monkeypatch.delenv("MS_DEFORM_ATTN_GRAD_VALUE")
    assert msda.select_backward_plan(*inputs)["stage"]
    monkeypatch.setenv("MS_DEFORM_ATTN_LOCAL_STAGE", "0")
    assert not msda.select_backward_plan(*inputs)["stage"]
    monkeypatch.setenv("MS_DEFORM_ATTN_LOCAL_STAGE", "yes")
    with pytest.raises(RuntimeError, match="MS_DEFORM_ATTN_LOCAL_STAGE must be '0' or '1', got 'yes'"):
        msda.select_backward_plan(*inputs)
    monkeypatch.delenv("MS_DEFORM_ATTN_LOCAL_STAGE")
    assert msda.select_backward_plan(*inputs)["self_records"]
    monkeypatch.setenv("MS_DEFORM_ATTN_LOCAL_SELF", "0")
    plan0 = msda.select_backward_plan(*inputs)
    assert plan0["stage"] and not plan0["self_records"]
    monkeypatch.setenv("MS_DEFORM_ATTN_LOCAL_SELF", "no")
    with pytest.raises(RuntimeError, match="MS_DEFORM_ATTN_LOCAL_SELF must be '0' or '1', got 'no'"):
        msda.select_backward_plan(*inputs)
    monkeypatch.delenv("MS_DEFORM_ATTN_LOCAL_SELF")
    monkeypatch.setenv("MS_DEFORM_ATTN_BACKEND", "baseline")
    assert msda.select_forward_plan(*inputs, device=W.DEVICES["H100"])["backend"] == "baseline"


def test_plans_are_structures():
    """Both plans come back as typed fields named by the queries' schemas."""
    inputs = problem("ddetr_enc", "bf16")
    fwd = msda.select_forward_plan(*inputs, device=W.DEVICES["H100"])
    bwd = msda.select_backward_plan(*inputs)
    assert isinstance(fwd["backend"], str) and isinstance(fwd["composite"], bool)
    assert all(isinstance(fwd[k], int) for k in ("vec", "lanes", "threads", "blocks"))
    assert list(bwd) == ["grad_value", "dots", "vec", "gather", "gather_vec", "stage",
                         "self_records", "composite"]
    assert isinstance(bwd["composite"], bool) and isinstance(bwd["vec"], int)
