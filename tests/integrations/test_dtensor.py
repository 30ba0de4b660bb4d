"""The operators on distributed tensors (ms_deform_attn.distributed's
sharding rules), two CPU processes over gloo: queries, batch or heads
sharded, forward and backward against the same call in one process; the
attention module with its queries sharded; FSDP2 training steps."""
import pytest
import torch
import torch.distributed as dist

from helpers import run_on_two_processes

pytest.importorskip("torch.distributed.tensor")

LEVELS = [(6, 7), (3, 4)]


def inputs(fused=False):
    """The same inputs on every rank (N 2, Lq 8, M 4, D 8, P 3)."""
    from helpers import make_inputs

    value, shapes, start, loc, attn = make_inputs(2, 8, 4, 8, LEVELS, 3, torch.float32, seed=7)
    if not fused:
        return value, shapes, start, loc, attn
    g = torch.Generator().manual_seed(8)
    ref = torch.rand(2, 8, len(LEVELS), 2, generator=g)
    off = torch.randn(2, 8, 4, len(LEVELS), 3, 2, generator=g)
    logits = torch.randn(2, 8, 4, len(LEVELS) * 3, generator=g)
    return value, shapes, start, ref, off, logits


# Per layout, the placements of (value, the per-query inputs) and of the output.
LAYOUTS = {"queries": ("R", "S1", "S1"), "batch": ("S0", "S0", "S0"), "heads": ("S2", "S2", "S2")}


def placement(code):
    from torch.distributed.tensor import Replicate, Shard
    return Replicate() if code == "R" else Shard(int(code[1]))


def check_operator(mesh, layout, fused, deterministic):
    import ms_deform_attn as msda
    from torch.distributed.tensor import Replicate, distribute_tensor

    value_p, per_query_p, out_p = (placement(c) for c in LAYOUTS[layout])
    full = [t.requires_grad_() if t.is_floating_point() else t for t in inputs(fused)]
    op = msda.ms_deform_attn_fused if fused else msda.ms_deform_attn
    expected = op(*full, deterministic=deterministic)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(9))
    want = torch.autograd.grad(expected, [t for t in full if t.requires_grad], grad)

    def dist_(t, i):
        if i in (1, 2):  # the level shapes and starts
            return distribute_tensor(t.detach(), mesh, [Replicate()])
        if i == 0:
            p = value_p
        elif fused and i == 3 and layout == "heads":  # reference points carry no head
            p = Replicate()
        else:
            p = per_query_p
        return distribute_tensor(t.detach(), mesh, [p]).requires_grad_()

    args = [dist_(t, i) for i, t in enumerate(full)]
    out = op(*args, deterministic=deterministic)
    assert out.placements == (out_p,), out.placements
    got_out = out.full_tensor()
    assert ((got_out - expected).norm() / expected.norm()).item() <= 1e-6, layout
    got = torch.autograd.grad(out, [a for a in args if a.requires_grad],
                              distribute_tensor(grad, mesh, [out_p]))
    for name, g, w in zip(["value", "locations / ref", "weights / offsets", "logits"], got, want):
        g = g.full_tensor()
        err = ((g - w).norm() / w.norm()).item()
        assert err <= 1e-6, f"{layout} grad {name}: {err:.1e}"
        if deterministic and layout == "batch":
            assert torch.equal(g, w), f"{layout} grad {name} not bitwise"


def check_module(mesh):
    """MSDeformAttn with its queries (and reference points) sharded and the
    flattened levels and the parameters replicated: the output matches.
    Returns why it could not run: its projections (nn.Linear on (N, Lq, C))
    flatten N and the sharded Lq, which DTensor does without redistribution
    in torch 2.14 but not in 2.11."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

    try:
        distribute_tensor(torch.zeros(2, 4, 3), mesh, [Shard(1)]).view(8, 3)
    except RuntimeError as exc:
        return (f"this torch ({torch.__version__}) cannot flatten a DTensor sharded on its "
                f"second dimension, which nn.Linear on sharded queries needs: {exc}")

    from ms_deform_attn.nn import MSDeformAttn
    from ms_deform_attn.testing import level_tensors

    torch.manual_seed(0)
    layer = MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=3)
    shapes, start = level_tensors(LEVELS, "cpu")
    g = torch.Generator().manual_seed(3)
    s = sum(h * w for h, w in LEVELS)
    query, flat = torch.randn(2, 12, 32, generator=g), torch.randn(2, s, 32, generator=g)
    ref = torch.rand(2, 12, 2, 2, generator=g)
    expected = layer(query, ref, flat, shapes, start)
    sharded = distribute_module(layer, mesh)  # parameters replicated
    rep, qs = [Replicate()], [Shard(1)]
    out = sharded(distribute_tensor(query, mesh, qs), distribute_tensor(ref, mesh, qs),
                  distribute_tensor(flat, mesh, rep), distribute_tensor(shapes, mesh, rep),
                  distribute_tensor(start, mesh, rep))
    got = out.full_tensor()
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-6
    return None


def check_fsdp2(mesh, rank):
    """A small model on MSDeformAttn under FSDP2 (fully_shard), each rank on
    its own batch: a few SGD steps give the weights that one process gets
    from the mean of the ranks' losses."""
    import copy

    from torch.distributed.fsdp import fully_shard

    from helpers import SmallEncoder
    from ms_deform_attn.testing import level_tensors

    shapes, start = level_tensors(LEVELS, "cpu")
    s = sum(h * w for h, w in LEVELS)

    def batch(r, step):
        g = torch.Generator().manual_seed(100 * step + r)
        return torch.randn(2, s, 32, generator=g), torch.rand(2, s, 2, 2, generator=g)

    torch.manual_seed(0)
    single = SmallEncoder(d_model=32, n_levels=2, n_heads=4, n_points=3)
    sharded = copy.deepcopy(single)
    fully_shard(sharded.attn, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    opt_single = torch.optim.SGD(single.parameters(), lr=0.1)
    opt_sharded = torch.optim.SGD(sharded.parameters(), lr=0.1)
    for step in range(3):
        opt_single.zero_grad()
        sum(single(*batch(r, step), shapes, start) for r in range(2)).div(2).backward()
        opt_single.step()
        opt_sharded.zero_grad()
        sharded(*batch(rank, step), shapes, start).backward()
        opt_sharded.step()
    for (name, a), b in zip(sharded.named_parameters(), single.parameters()):
        a = a.full_tensor()
        err = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
        assert err <= 1e-5, f"{name}: {err:.1e}"


def checks(rank):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    for fused in (False, True):
        for layout in LAYOUTS:
            for deterministic in (False, True):
                check_operator(mesh, layout, fused, deterministic)
    check_fsdp2(mesh, rank)


def module_checks(rank):
    from torch.distributed.device_mesh import init_device_mesh

    return check_module(init_device_mesh("cpu", (2,)))


def test_sharded_operators_on_two_processes():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    run_on_two_processes(checks, "gloo")


def test_query_sharded_module_on_two_processes():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    run_on_two_processes(module_checks, "gloo")
