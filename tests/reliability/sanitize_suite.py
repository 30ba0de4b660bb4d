"""Small cases for compute-sanitizer (scripts/gpu_check.sh, stage
`sanitize`): every CUDA backend, forward and backward (atomics, global sort,
block-local sort), every dtype, locations inside, outside, on pixel centres and
level borders, NaN and infinite; D that takes the vector and the scalar
paths; the persistent backend with no shared-memory cache; blocked's
one-level kernel; the block-local path above 4096 samples a (n, m, level);
value head-major on every backend and path. Prints the cases run; any
sanitizer report fails the stage (--error-exitcode).

    compute-sanitizer --tool memcheck python tests/reliability/sanitize_suite.py [--backends a,b]

--backends limits the per-backend cases to those forward backends (the
sections that run "auto" run as always).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]  # helpers.py, and the checkout
import torch  # noqa: E402

import ms_deform_attn as msda  # noqa: E402
from helpers import head_major, kernel_backends, make_inputs  # noqa: E402

# The backward's grad_value paths (MS_DEFORM_ATTN_GRAD_VALUE): atomics, the
# global sort, the block-local sort (where it applies; else the global one).
PATHS = [(False, "atomic"), (True, "sorted"), (True, "local")]

SPECIAL = [0.0, 1.0, 0.5, 1 / 16, -1 / 16, 1 + 1 / 16, -3.0, 4.0, float("nan"), float("inf"),
           -float("inf")]


def cases():
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for loc_dtype in {dtype, torch.float32}:
            for d in (32, 6):  # vector path, scalar path
                yield dtype, loc_dtype, d


def every_path(value, shapes, start, loc, attn, backend, levels) -> int:
    """Forward and backward on each grad_value path; the cases run."""
    for det, path in PATHS:
        os.environ["MS_DEFORM_ATTN_GRAD_VALUE"] = path
        out = msda.ms_deform_attn(value, shapes, start, loc, attn, backend=backend,
                                  deterministic=det, spatial_shapes_list=levels)
        torch.autograd.grad(out, (value, loc, attn), torch.randn_like(out))
    return len(PATHS)


def set_env(name, value):
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def special_cases(backend, count, levels=((5, 7), (3, 2), (1, 1))) -> int:
    """`backend` on every dtype and D, some locations outside and a third of
    them special; returns `count` (the cases run so far, the seed) plus its
    cases."""
    levels = list(levels)
    for dtype, loc_dtype, d in cases():
        value, shapes, start, loc, attn = make_inputs(
            2, 13, 3, d, levels, 3, dtype, loc_dtype, outside=0.3, seed=count)
        # Special locations on a third of the samples (made on the host).
        special = torch.tensor(SPECIAL, dtype=torch.float64)
        pick = torch.randint(0, len(SPECIAL), loc.shape)
        mask = torch.rand(loc.shape) < 0.33
        loc = torch.where(mask, special[pick], loc.double()).to(loc_dtype)
        shapes, start = shapes.cuda(), start.cuda()
        value, loc, attn = [t.cuda().requires_grad_() for t in (value, loc, attn)]
        if msda.backend_reason(backend, value, shapes, start, loc, attn,
                               spatial_shapes_list=levels):
            continue  # e.g. tma with float64 values
        count += every_path(value, shapes, start, loc, attn, backend, levels)
    return count


def main() -> int:
    only = None
    if "--backends" in sys.argv:
        only = set(sys.argv[sys.argv.index("--backends") + 1].split(","))
    backends = [b for b in kernel_backends("cuda") if only is None or b in only]
    count = 0
    # Default cache or staging buffers, none (global reads only), and a tiny
    # one (tma: boxes of a few pixels, most corners outside them).
    for budget in (None, "0", "1024"):
        set_env("MS_DEFORM_ATTN_SMEM_BUDGET", budget)
        for backend in backends:
            count = special_cases(backend, count)
    set_env("MS_DEFORM_ATTN_SMEM_BUDGET", None)
    # blocked's two set-ups of a row, each forced (the cases above, small,
    # take the per-lane one by default).
    if "blocked" in backends:
        for rows in ("shared", "lane"):
            set_env("MS_DEFORM_ATTN_BLOCKED_ROWS", rows)
            count = special_cases("blocked", count)
        # One level (BEVFormer): the shared slots without the level table.
        set_env("MS_DEFORM_ATTN_BLOCKED_ROWS", "shared")
        for levels in (((5, 7),), ((1, 1),)):
            count = special_cases("blocked", count, levels)
        set_env("MS_DEFORM_ATTN_BLOCKED_ROWS", None)
    # Wide rows: groups of 16 and 32 lanes (and several 16-byte chunks a
    # lane), whose slots a warp shares differently, on each set-up of a row.
    levels = [(5, 7), (3, 2), (1, 1)]
    for backend in [b for b in ("baseline", "blocked") if b in backends]:
        for rows in (("shared", "lane") if backend == "blocked" else (None,)):
            set_env("MS_DEFORM_ATTN_BLOCKED_ROWS", rows)
            for dtype in (torch.float32, torch.bfloat16):
                for d in (64, 128, 256):
                    inputs = make_inputs(2, 13, 3, d, levels, 3, dtype, torch.float32,
                                         device="cuda", outside=0.3, seed=count,
                                         requires_grad=True)
                    count += every_path(*inputs, backend, levels)
        set_env("MS_DEFORM_ATTN_BLOCKED_ROWS", None)
    # value head-major ((N, M, S, D) storage, read in place): every backend
    # (tma with its default boxes and with boxes of a few pixels) and path.
    levels = [(5, 7), (3, 2), (1, 1)]
    for budget in (None, "1024"):
        set_env("MS_DEFORM_ATTN_SMEM_BUDGET", budget)
        for backend in backends:
            for dtype in (torch.bfloat16, torch.float32):
                value, shapes, start, loc, attn = make_inputs(2, 13, 3, 32, levels, 3, dtype,
                                                              torch.float32, outside=0.3, seed=count)
                shapes, start = shapes.cuda(), start.cuda()
                value = head_major(value.cuda()).requires_grad_()
                loc, attn = [t.cuda().requires_grad_() for t in (loc, attn)]
                count += every_path(value, shapes, start, loc, attn, backend, levels)
    set_env("MS_DEFORM_ATTN_SMEM_BUDGET", None)
    # Crowded levels: the global sort's grad_value tiles split over several
    # warps, and the block-local path's crowded cells (its radix sort; bf16,
    # one and two 32-channel passes).
    for d in (32, 64):
        for path in ("sorted", "local"):
            os.environ["MS_DEFORM_ATTN_GRAD_VALUE"] = path
            levels = [(5, 7), (3, 2), (1, 1)]
            value, shapes, start, loc, attn = make_inputs(2, 400, 3, d, levels, 3, torch.bfloat16,
                                                          torch.float32, outside=0.3, seed=count)
            shapes, start = shapes.cuda(), start.cuda()
            value, loc, attn = [t.cuda().requires_grad_() for t in (value, loc, attn)]
            out = msda.ms_deform_attn(value, shapes, start, loc, attn, deterministic=True)
            torch.autograd.grad(out, (value, loc, attn), torch.randn_like(out))
            count += 1
    # More than 4096 samples a (n, m, level) (DINO's denoising queries): the
    # block-local path's second instantiation (16 samples a thread), spread
    # and in one cell, 16-bit and fp32 values.
    os.environ["MS_DEFORM_ATTN_GRAD_VALUE"] = "local"
    for dtype in (torch.bfloat16, torch.float32):
        for crowd in (False, True):
            levels = [(40, 70), (5, 7)]
            value, shapes, start, loc, attn = make_inputs(1, 1100, 2, 32, levels, 4, dtype,
                                                          torch.float32, outside=0.3, seed=count)
            if crowd:
                loc.fill_(0.513)
            shapes, start = shapes.cuda(), start.cuda()
            value, loc, attn = [t.cuda().requires_grad_() for t in (value, loc, attn)]
            out = msda.ms_deform_attn(value, shapes, start, loc, attn, deterministic=True)
            torch.autograd.grad(out, (value, loc, attn), torch.randn_like(out))
            count += 1
    set_env("MS_DEFORM_ATTN_GRAD_VALUE", None)
    torch.cuda.synchronize()
    print(f"sanitize suite: {count} forward+backward cases, backends {backends}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
