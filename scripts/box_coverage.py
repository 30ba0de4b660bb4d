"""How many samples a staged value box serves when boxes are placed from the
query tile's own position, not from a pass over the locations. Issue 24's
first consumer placed them from a footprint pass, which cost instructions;
benchmarks/NOTES.md asks for boxes "placed from the tile's own position
scaled to each level (the encoder's reference points)". By arithmetic on
the workloads' own generators, no GPU.

    python scripts/box_coverage.py [workload ...]     (default: ddetr_enc ddetr_enc@smooth)

Model. Encoder queries are the pixels of every level. The queries of level
q are cut into tiles of T_q x T_q pixels, with T_q chosen so that every tile
spans about E pixels of the finest level: T_q = max(1, round(E W_q / W_0)).
For each (tile, head m, level l) there is one box: the tile's reference
points mapped to level l's pixel coordinates (u = x W_l - 0.5), shifted by
head m's mean initial offset (2.5 (cos t_m, sin t_m) pixels at P = 4),
widened by `margin` pixels on each side, plus one pixel for the bilinear
corner, clipped to the map. A sample is served from the box when all its
in-map corners lie inside; the rest would take the global-memory path.

Printed per workload, tile extent E and margin:
- the share of samples served, overall and per level;
- the mean box bytes per (tile, head): 64-byte pixels of D = 32 bf16, all
  levels together;
- the largest such box, which the stage budget must hold (two stages of it
  for double buffering);
- the corner bytes served per byte staged.
"""
import sys

import torch

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from ms_deform_attn import workloads as W  # noqa: E402


def query_pixels(levels):
    """(S,) level, iy, ix of every encoder query (level-then-raster order)."""
    lv, ys, xs = [], [], []
    for l, (h, w) in enumerate(levels):
        yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        lv.append(torch.full((h * w,), l))
        ys.append(yy.flatten())
        xs.append(xx.flatten())
    return torch.cat(lv), torch.cat(ys), torch.cat(xs)


def coverage(wl, loc, extent, margin):
    levels = wl.levels
    nl = len(levels)
    ql, qy, qx = query_pixels(levels)
    hw = torch.tensor(levels, dtype=torch.float64)                       # (L, 2) = (H, W)
    w0 = levels[0][1]
    tiles = torch.tensor([max(1, round(extent * w / w0)) for _, w in levels])
    t = tiles[ql]
    # The tile's first and last query pixel on its own level.
    hq, wq = hw[ql, 0], hw[ql, 1]
    y_lo = (qy // t) * t
    x_lo = (qx // t) * t
    y_hi = torch.minimum(y_lo + t, hq.long()) - 1
    x_hi = torch.minimum(x_lo + t, wq.long()) - 1
    shift = W._directions(wl.m, "cpu") * (wl.p + 1) / 2                  # (M, 2): mean (p + 1) dir_m
    served = torch.zeros(nl, dtype=torch.float64)
    total = torch.zeros(nl, dtype=torch.float64)
    box_bytes = torch.zeros((), dtype=torch.float64)
    # One box a (tile, head, level): each tile counted once, at its first query.
    first = (qy == y_lo) & (qx == x_lo)
    n_boxes = int(first.sum()) * wl.m                                     # (tile, head) pairs
    largest = 0
    for l in range(nl):
        hl, wl_ = levels[l]
        # Reference pixel coordinates of the tile's corners on level l.
        u_lo = ((x_lo.double() + 0.5) / wq) * wl_ - 0.5
        u_hi = ((x_hi.double() + 0.5) / wq) * wl_ - 0.5
        v_lo = ((y_lo.double() + 0.5) / hq) * hl - 0.5
        v_hi = ((y_hi.double() + 0.5) / hq) * hl - 0.5
        # (S, M) box bounds, inclusive, clipped to the map.
        bx0 = torch.floor(u_lo[:, None] + shift[None, :, 0] - margin).clamp(0, wl_ - 1)
        bx1 = (torch.floor(u_hi[:, None] + shift[None, :, 0] + margin) + 1).clamp(0, wl_ - 1)
        by0 = torch.floor(v_lo[:, None] + shift[None, :, 1] - margin).clamp(0, hl - 1)
        by1 = (torch.floor(v_hi[:, None] + shift[None, :, 1] + margin) + 1).clamp(0, hl - 1)
        # Samples of level l: (N, S, M, P) pixel coordinates.
        u = loc[:, :, :, l, :, 0] * wl_ - 0.5
        v = loc[:, :, :, l, :, 1] * hl - 0.5
        cx0, cy0 = torch.floor(u), torch.floor(v)
        ok = torch.ones_like(u, dtype=torch.bool)
        any_in_map = torch.zeros_like(ok)
        for dx in (0, 1):
            for dy in (0, 1):
                cx, cy = cx0 + dx, cy0 + dy
                in_map = (cx >= 0) & (cx <= wl_ - 1) & (cy >= 0) & (cy <= hl - 1)
                inside = ((cx >= bx0[None, :, :, None]) & (cx <= bx1[None, :, :, None]) &
                          (cy >= by0[None, :, :, None]) & (cy <= by1[None, :, :, None]))
                ok &= ~in_map | inside
                any_in_map |= in_map
        served[l] += (ok & any_in_map).sum()
        total[l] += any_in_map.sum()
        px = ((bx1 - bx0 + 1) * (by1 - by0 + 1))[first]                   # (tiles, M)
        box_bytes += 64 * px.sum()
        largest = max(largest, int(px.max()))
    corner_bytes = 4 * 64 * served.sum()
    return served / total, served.sum() / total.sum(), box_bytes / n_boxes, largest, corner_bytes / (
        box_bytes * wl.n)


def main(argv):
    names = argv or ["ddetr_enc", "ddetr_enc@smooth"]
    for name in names:
        wl = W.get(name)
        g = torch.Generator().manual_seed(0)
        loc = W.sampling_locations(wl, g)                                 # (N, S, M, L, P, 2)
        print(f"\n{name}: {wl.n * wl.queries * wl.m * len(wl.levels) * wl.p / 1e6:.2f} M samples")
        print("| E | margin | served | by level | mean box KB a (tile, head) | largest one-level box, px | corner bytes a staged byte |")
        print("|---:|---:|---:|---|---:|---:|---:|")
        for extent in (8, 16):
            for margin in (2, 3, 4, 6):
                per, allf, mean_b, largest, ratio = coverage(wl, loc, extent, margin)
                by = " / ".join(f"{100 * float(x):.1f}" for x in per)
                print(f"| {extent} | {margin} | {100 * float(allf):.1f} % | {by} | {float(mean_b) / 1024:.1f} | "
                      f"{largest} | {float(ratio):.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
