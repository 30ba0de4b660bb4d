"""Two-process DistributedDataParallel (NCCL, one GPU per process) training
of a small model built on the MSDeformAttn module: after every step the
gradients are bitwise identical across ranks and equal the average of the
ranks' own gradients. Skips (and says so) without two CUDA devices."""
import pytest
import torch
import torch.distributed as dist

from helpers import SmallEncoder, run_on_two_processes
from ms_deform_attn.testing import level_tensors

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason="needs two CUDA devices (run on a two-GPU machine)"),
]

LEVELS = [(12, 16), (6, 8), (3, 4)]
STEPS = 4


def Encoder():
    return SmallEncoder(d_model=64, n_levels=3, n_heads=4, n_points=4)


def batch(rank, step, device):
    g = torch.Generator().manual_seed(100 * step + rank)
    s = sum(h * w for h, w in LEVELS)
    src = torch.randn(2, s, 64, generator=g)
    ref = torch.rand(2, s, 3, 2, generator=g)
    return src.to(device), ref.to(device)


def flat_grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def train(rank):
    device = torch.device("cuda", rank)
    torch.cuda.set_device(rank)
    shapes, start = level_tensors(LEVELS, device)
    torch.manual_seed(0)
    model = Encoder().to(device)
    local = Encoder().to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(STEPS):
        src, ref = batch(rank, step, device)
        # This rank's own gradient, on a copy of the current weights.
        local.load_state_dict(model.state_dict())
        local.zero_grad()
        local(src, ref, shapes, start).backward()
        mine = flat_grads(local)
        opt.zero_grad()
        ddp(src, ref, shapes, start).backward()
        synced = flat_grads(model)
        both = [torch.empty_like(synced) for _ in range(2)]
        dist.all_gather(both, synced)
        assert torch.equal(both[0], both[1]), f"step {step}: ranks' gradients differ"
        theirs = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(theirs, mine)
        mean = (theirs[0] + theirs[1]) / 2
        err = ((synced - mean).norm() / mean.norm()).item()
        assert err < 1e-5, f"step {step}: DDP gradient off the ranks' mean by {err:.1e}"
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    both = [torch.empty_like(params) for _ in range(2)]
    dist.all_gather(both, params)
    assert torch.equal(both[0], both[1]), "ranks' weights differ after training"


def test_ddp_two_gpus():
    run_on_two_processes(train, "nccl")
