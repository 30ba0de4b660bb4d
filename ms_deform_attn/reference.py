"""Pure-PyTorch multi-scale deformable attention built on F.grid_sample.

The yardstick the tests and benchmarks compare every kernel with: call it on
float64 inputs for a reference. It runs on any device and is differentiable
through PyTorch's own autograd. It reads spatial_shapes on the host.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ms_deform_attn_pytorch", "ms_deform_attn_gather", "ms_deform_attn_plain",
           "fused_locations_and_weights"]


def ms_deform_attn_pytorch(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
) -> torch.Tensor:
    """Same semantics as ms_deform_attn.ms_deform_attn, with the kernels'
    arithmetic: 16-bit values are sampled and summed in float32 (float64
    stays float64) and the result is returned in value's dtype, so that it
    meets the kernels' accuracy against float64; gradients come back in each
    input's dtype through PyTorch's autograd."""
    n, _, m, d = value.shape
    _, lq, _, n_levels, n_points, _ = sampling_locations.shape
    shapes = spatial_shapes.tolist()
    starts = level_start_index.tolist()
    out_dtype = value.dtype
    dtype = torch.float64 if value.dtype == torch.float64 else torch.float32
    value = value.to(dtype)
    # grid_sample's grid lives in [-1, 1]; (N, Lq, M, L, P, 2) -> per level (N*M, Lq, P, 2).
    grid = (2 * sampling_locations.to(dtype) - 1).transpose(1, 2).flatten(0, 1)
    # Past +-3 (grid units) a sample lies more than a pixel outside any map
    # and adds zero: clamped there, huge finite coordinates stay out of
    # grid_sample's index arithmetic (torch 2.15's CPU kernel reads a pixel
    # for 2e30 in its vectorised loop). NaN and infinities pass unchanged.
    grid = torch.where(torch.isfinite(grid), grid.clamp(-3, 3), grid)
    sampled = []
    for lvl, ((h, w), start) in enumerate(zip(shapes, starts)):
        # (N, H*W, M, D) -> (N*M, D, H, W)
        v = value[:, start:start + h * w].permute(0, 2, 3, 1).reshape(n * m, d, h, w)
        # A contiguous grid: torch 2.14's CPU grid_sample returns NaN for a
        # strided bf16 one.
        sampled.append(
            F.grid_sample(v.contiguous(), grid[:, :, lvl].contiguous(), mode="bilinear",
                          padding_mode="zeros", align_corners=False)
        )  # (N*M, D, Lq, P)
    stacked = torch.cat(sampled, dim=-1)  # (N*M, D, Lq, L*P), level-major like the weights
    weights = attention_weights.to(dtype).transpose(1, 2).reshape(n * m, 1, lq, n_levels * n_points)
    out = (stacked * weights).sum(-1)  # (N*M, D, Lq)
    return out.view(n, m * d, lq).transpose(1, 2).contiguous().to(out_dtype)


def ms_deform_attn_gather(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    corners_outside_read_nothing: bool = False,
    precision_probe: bool = False,
) -> torch.Tensor:
    """The same operator written with one gather, elementwise ops and one
    batched matrix product (no grid_sample, no host reads of the level
    shapes): what the portable ONNX export (ms_deform_attn.onnx) becomes.
    A corner outside the map adds zero (its weight), its index kept inside
    value. Coordinates and sums in float32
    (float64 for float64 values), corners outside the map add zero, a sample
    with a non-finite location or weight makes its (query, head) row NaN, as
    the operator does. Shape-polymorphic: batch, queries and level sizes may
    change from call to call of one exported graph. A corner outside the
    map is read (a clamped row) and weighted by zero, so that a non-finite
    value there still reaches the sum; `corners_outside_read_nothing` zeroes
    those rows first, as the kernels never add them (one more elementwise
    pass). `precision_probe` (the portable export's) makes every output NaN
    where the graph's arithmetic runs in fewer than float32's bits (see
    _precision_probe)."""
    n, s, m, d = value.shape
    _, lq, _, n_levels, n_points, _ = sampling_locations.shape
    acc = torch.float64 if value.dtype == torch.float64 else torch.float32
    hi = spatial_shapes[:, 0].view(1, 1, 1, n_levels, 1)
    wi = spatial_shapes[:, 1].view(1, 1, 1, n_levels, 1)
    h, w = hi.to(acc), wi.to(acc)
    start = level_start_index.view(1, 1, 1, n_levels, 1)
    # Pixel coordinates as grid_sample(align_corners=False) has them.
    x = sampling_locations[..., 0].to(acc) * w - 0.5
    y = sampling_locations[..., 1].to(acc) * h - 0.5
    a = attention_weights.to(acc)
    finite = torch.isfinite(x) & torch.isfinite(y) & torch.isfinite(a)
    x = torch.where(finite, x, torch.zeros_like(x))
    y = torch.where(finite, y, torch.zeros_like(y))
    x0, y0 = torch.floor(x), torch.floor(y)
    fx, fy = x - x0, y - y0
    x1, y1 = x0 + 1, y0 + 1

    def inside(c, size):  # where corner coordinate c lies in [0, size - 1]
        return (c >= 0) & (c <= size - 1)

    # Corner weights, zero outside the map: corners (x0, y0), (x1, y0),
    # (x0, y1), (x1, y1).
    in_x0, in_x1, in_y0, in_y1 = inside(x0, w), inside(x1, w), inside(y0, h), inside(y1, h)
    ax0, ax1 = (1 - fx) * in_x0.to(acc), fx * in_x1.to(acc)
    ay0, ay1 = (1 - fy) * in_y0.to(acc) * a, fy * in_y1.to(acc) * a
    scale = torch.stack([ax0 * ay0, ax1 * ay0, ax0 * ay1, ax1 * ay1], dim=4)  # (N, Lq, M, L, 4, P)
    if precision_probe:
        scale = scale * _precision_probe(x)

    def as_index(c):  # scalar bounds: past any level's side, small enough for int64 sums
        return torch.clamp(c, -1, 2 ** 30).to(torch.int64)

    px0, px1 = as_index(x0), as_index(x1)
    # value rows of (n, m): value as (N, M, S, D) flattened, row (n M + m) S + pixel.
    nm = (torch.arange(n, device=value.device).view(n, 1, 1, 1, 1) * m
          + torch.arange(m, device=value.device).view(1, 1, m, 1, 1)) * s
    row0 = nm + start + as_index(y0) * wi
    row1 = nm + start + as_index(y1) * wi
    # A corner outside the map points at another pixel or none (weight 0):
    # the index is kept inside value, and the weight does the rest.
    index = torch.stack([row0 + px0, row0 + px1, row1 + px0, row1 + px1], dim=4)
    index = index.clamp(min=0).minimum(torch.full_like(index, n * m * s - 1))
    # Every sample's four corner rows in one gather, summed by one batched
    # matrix product: (N Lq M, 1, L 4 P) x (N Lq M, L 4 P, D).
    k = 4 * n_levels * n_points
    rows = value.transpose(1, 2).reshape(n * m * s, d)
    if corners_outside_read_nothing and rows.requires_grad and rows.is_cuda:
        corners = _GatherRows.apply(rows, index.reshape(-1))
    else:
        corners = rows.index_select(0, index.reshape(-1))
    corners = corners.to(acc).view(n * lq * m, k, d)
    if corners_outside_read_nothing:
        read = torch.stack([in_x0 & in_y0, in_x1 & in_y0, in_x0 & in_y1, in_x1 & in_y1], dim=4)
        read = read.reshape(n * lq * m, k, 1)
        corners = torch.where(read, corners, torch.zeros((), dtype=acc, device=value.device))
    out = torch.bmm(scale.reshape(n * lq * m, 1, k), corners).view(n, lq, m, d)
    bad_row = (~finite).flatten(3).any(-1, keepdim=True)  # (N, Lq, M, 1)
    out = torch.where(bad_row, torch.full_like(out, float("nan")), out)
    return out.reshape(n, lq, m * d).to(value.dtype)


class _GatherRows(torch.autograd.Function):
    """rows.index_select(0, index), whose gradient sums each row's shares
    in the same order on every run: index_select's own backward adds them
    with atomics on CUDA (index_add_), so the `pytorch` backend's gradients
    differed in their last bits from run to run there; index_put_ with
    accumulate sorts the indices first on CUDA."""

    @staticmethod
    def forward(ctx, rows, index):
        ctx.save_for_backward(index)
        ctx.rows = rows.shape[0]
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.rows,) + tuple(grad.shape[1:]))
        return out.index_put((index,), grad, accumulate=True), None


# 1 + 2^-12 is a float32 (24-bit significand) but no bfloat16 (8) or float16
# (11): it rounds to 1 in either.
_PROBE_EPS = 2.0 ** -12


def _precision_probe(x: torch.Tensor) -> torch.Tensor:
    """A one-element factor, 1 where the graph computes in float32 and NaN
    where a runtime lowers its activations to bfloat16 or float16 (OpenVINO
    on a CPU with bf16 units by default, on its GPU with f16): there the
    pixel coordinates lose their fraction, and a NaN output says so instead
    of a silently wrong one. 1 + 2^-12 is made at run time from x (a
    constant would be folded at compile time, in float32) and stored once
    by a concatenation, as the coordinates are, before the difference:
    (p - 1) * 2^12 is 1 in float32 and 0 where p was rounded, and d / d
    turns that into 1 or NaN. It multiplies the corner weights, ahead of the
    batched product, where a runtime that keeps only a graph's tail in
    float32 still lowers it."""
    zero = torch.cat([x.reshape(-1)[:1], x.new_zeros(1)])[:1] * 0  # x may hold no sample
    p = torch.cat([zero + (1 + _PROBE_EPS)] * 2)[:1]
    d = (p - 1) * (1 / _PROBE_EPS)
    return d / d


def ms_deform_attn_plain(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
) -> torch.Tensor:
    """The `pytorch` backend: ms_deform_attn_gather on value in float32
    (float64 stays float64), so that its gradient accumulates there, the
    result in value's dtype. It does the kernels' coordinate arithmetic, so
    that a location on a pixel-centre tie takes the cell (and the location
    gradient) the kernels take; grid_sample's differs there."""
    acc = torch.float64 if value.dtype == torch.float64 else torch.float32
    return ms_deform_attn_gather(value.to(acc), spatial_shapes, level_start_index,
                                 sampling_locations, attention_weights,
                                 corners_outside_read_nothing=True).to(value.dtype)


def fused_locations_and_weights(
    spatial_shapes: torch.Tensor,
    reference_points: torch.Tensor,
    sampling_offsets: torch.Tensor,
    attention_logits: torch.Tensor,
):
    """ms_deform_attn_fused's locations and weights (Deformable DETR's layer):
    points ref + offset / (W, H) of the level, boxes (cx, cy) + offset / P *
    (w, h) * 0.5, weights the softmax over each (n, q, m)'s L P logits; in
    float32 (float64 where an input is)."""
    n, lq, m, n_levels, n_points, _ = sampling_offsets.shape
    acc = torch.promote_types(torch.promote_types(sampling_offsets.dtype, reference_points.dtype),
                              torch.float32)
    off = sampling_offsets.to(acc)
    ref = reference_points.to(acc)[:, :, None, :, None, :]
    if reference_points.shape[-1] == 2:
        wh = spatial_shapes.flip(-1).to(acc).view(1, 1, 1, n_levels, 1, 2)
        loc = ref + off / wh
    else:
        loc = ref[..., :2] + off / n_points * ref[..., 2:] * 0.5
    weights = torch.softmax(attention_logits.to(acc).reshape(n, lq, m, n_levels * n_points), -1)
    return loc, weights.view(n, lq, m, n_levels, n_points)
