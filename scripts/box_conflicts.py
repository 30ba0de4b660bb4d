"""Shared-memory wavefronts of ldmatrix reads from a TMA-staged value box, by
arithmetic (no GPU): the question issue 24's first tensor-core consumer met
(benchmarks/NOTES.md, 2026-11-25: ~2.3 wavefronts an 8-row matrix where 1
was planned) and a matrix layout that avoids it. Also checks, in NumPy, the
mma fragment algebra that layout needs.

    python scripts/box_conflicts.py

Model. A box holds one head's pixels of one level, D = 32 16-bit channels a
pixel: 64 bytes, four 16-byte chunks, pixel p = y * W + x at byte 64 p,
written by the copy engine with its 16-byte-chunk swizzle (the XOR of
address bits [4, 4 + b) with bits [7, 7 + b): b = 1, 2, 3 for the 32-,
64- and 128-byte modes). An ldmatrix 8 x 8 matrix is 8 row addresses of
16 bytes, served in one wavefront when the 8 chunks fall in 8 different
4-bank groups ((address / 16) mod 8), else in as many as the most crowded
group holds.

Two ways to fill a matrix:
- "2 samples x 4 corners, one chunk": the first consumer's layout (lane L
  gave corner L % 8 + 8 (L / 16) at channel 8 ((L / 8) % 2));
- "1 sample x 4 corners x 2 chunks": rows 2 c + h = corner c, chunk 2 j + h
  of matrix j's chunk pair. The four corners of a sample are p, p + 1,
  p + W, p + W + 1; with W = 4 (mod 8) and the 64-byte swizzle their
  chunks land in 8 different groups whatever (x, y).
"""
import random

import numpy as np

SWIZZLE_BITS = {"none": 0, "32B": 1, "64B": 2, "128B": 3}


def swizzle(addr: int, mode: str) -> int:
    b = SWIZZLE_BITS[mode]
    return addr ^ (((addr >> 7) & ((1 << b) - 1)) << 4)


def wavefronts(addrs) -> int:
    groups = {}
    for a in addrs:
        g = (a // 16) % 8
        groups[g] = groups.get(g, 0) + 1
    return max(groups.values())


def corners(x, y, w):
    return [(y + dy) * w + x + dx for dy in (0, 1) for dx in (0, 1)]


def per_sample_matrix(w, h, mode, rng, trials=4000):
    """Mean wavefronts of a matrix holding one sample's 4 corners x 2 chunks."""
    total = 0
    for _ in range(trials):
        x, y = rng.randrange(w - 1), rng.randrange(h - 1)
        for pair in ((0, 1), (2, 3)):
            total += wavefronts([swizzle(64 * p + 16 * c, mode) for p in corners(x, y, w) for c in pair])
    return total / (2 * trials)


def two_sample_matrix(w, h, mode, rng, trials=4000):
    """The first consumer's matrix: two neighbouring samples (points of one
    query, ~1.4 px apart) x 4 corners, one chunk."""
    total = 0
    for _ in range(trials):
        xa, ya = rng.randrange(1, w - 2), rng.randrange(1, h - 2)
        xb = min(max(xa + round(rng.gauss(0, 1.4)), 0), w - 2)
        yb = min(max(ya + round(rng.gauss(0, 1.4)), 0), h - 2)
        for c in range(4):
            total += wavefronts([swizzle(64 * p + 16 * c, mode)
                                 for s in ((xa, ya), (xb, yb)) for p in corners(*s, w)])
    return total / (4 * trials)


def check_fragments(rng_np):
    """ldmatrix.x4.trans + mma.m16n8k16 (bf16 in, fp32 accumulate) with the
    per-sample matrices, simulated lane by lane from the PTX fragment
    layouts: two samples' four corners x 32 channels weighted and summed,
    against the plain sum. Weights split into hi + lo parts (columns 2 h
    and 2 h + 1 of B for chunk bit h)."""
    v = rng_np.standard_normal((2, 4, 32))           # sample, corner, channel
    w = rng_np.standard_normal((2, 4))               # bilinear x attention
    hi = w.astype(np.float32).astype(np.float64)     # stands for the bf16 high part
    lo = w - hi
    # Stored matrices: M_j row r = sample j // 2, corner r // 2, chunk 2 (j % 2) + r % 2.
    mats = np.zeros((4, 8, 8))
    for j in range(4):
        for r in range(8):
            ch = 2 * (j % 2) + r % 2
            mats[j, r] = v[j // 2, r // 2, 8 * ch:8 * ch + 8]
    a = np.zeros((16, 16))
    b = np.zeros((16, 8))
    for t in range(32):
        g, q = t // 4, t % 4
        # .trans: register j of lane t = (M_j[2q][g], M_j[2q + 1][g]) -> a_j.
        regs = [(mats[j, 2 * q, g], mats[j, 2 * q + 1, g]) for j in range(4)]
        a[g, 2 * q:2 * q + 2] = regs[0]
        a[g + 8, 2 * q:2 * q + 2] = regs[1]
        a[g, 2 * q + 8:2 * q + 10] = regs[2]
        a[g + 8, 2 * q + 8:2 * q + 10] = regs[3]
        # b0 = B[2q, 2q + 1][g] (sample 0, corner q, chunk bits 0 and 1), b1 the same for sample 1.
        for s, k0 in ((0, 2 * q), (1, 2 * q + 8)):
            for h in (0, 1):
                if g < 4 and g // 2 == h:
                    b[k0 + h, g] = (hi if g % 2 == 0 else lo)[s, q]
    c = a @ b                                        # C[m][n]
    out = np.zeros(32)
    for t in range(32):                              # lanes q < 2 hold the sums
        g, q = t // 4, t % 4
        if q < 2:
            out[8 * q + g] = c[g, 2 * q] + c[g, 2 * q + 1]            # chunk q
            out[16 + 8 * q + g] = c[g + 8, 2 * q] + c[g + 8, 2 * q + 1]  # chunk 2 + q
    ref = np.einsum("sc,scd->d", w, v)
    return float(np.abs(out - ref).max())


def main():
    rng = random.Random(0)
    print("mean wavefronts an 8-row matrix (1 = conflict-free), box height 20")
    print("| box width | layout | none | 32B | 64B | 128B |")
    print("|---:|---|---:|---:|---:|---:|")
    for w in (16, 18, 20, 22, 24, 28, 32):
        for name, fn in (("2 samples x 4 corners, one chunk", two_sample_matrix),
                         ("1 sample x 4 corners x 2 chunks", per_sample_matrix)):
            cells = " | ".join(f"{fn(w, 20, m, rng, 1500):.2f}" for m in SWIZZLE_BITS)
            print(f"| {w} | {name} | {cells} |")
    err = check_fragments(np.random.default_rng(0))
    print(f"fragment check: max |mma sum - plain sum| = {err:.2e}")
    assert err < 1e-12


if __name__ == "__main__":
    main()
