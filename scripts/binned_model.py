"""The tile-owner backward of scripts/binned_backward.cu, emulated on the CPU
in float64 (NumPy), against a float64 reference: its decomposition (bins of
T_l x T_l cells per level, a bin's (T + 1)^2-pixel window, 4 x 4-pixel
sub-tiles over the 5 runs of cells around each, the cells' owners, the
border ring merged over the 2 or 4 bins that share a pixel, chunks of a
bin) checked on small problems, hostile ones included, so that the CUDA
version's index arithmetic has a reference. Float64 throughout: it checks
the arithmetic of the decomposition, not precision.

    python scripts/binned_model.py
"""
import math, sys
import numpy as np

def reference(value, shapes, starts, loc, attn, gout):
    N, S, M, D = value.shape
    _, Lq, _, L, P, _ = loc.shape
    gv = np.zeros_like(value); gl = np.zeros_like(loc); ga = np.zeros_like(attn)
    for l, (H, W) in enumerate(shapes):
        x = loc[..., l, :, 0] * W - 0.5; y = loc[..., l, :, 1] * H - 0.5   # (N, Lq, M, P)
        inside = (y >= -1) & (x >= -1) & (y < H) & (x < W)
        h0 = np.floor(y).astype(int); w0 = np.floor(x).astype(int)
        lh = y - h0; lw = x - w0
        a = attn[..., l, :]
        g = gout.reshape(N, Lq, M, D)
        for k in range(4):
            dy, dx = k >> 1, k & 1
            hy = h0 + dy; wx = w0 + dx
            ok = inside & (hy >= 0) & (hy < H) & (wx >= 0) & (wx < W)
            wy = lh if dy else 1 - lh; wxw = lw if dx else 1 - lw
            bw = wy * wxw
            pix = starts[l] + np.clip(hy, 0, H - 1) * W + np.clip(wx, 0, W - 1)
            n_i = np.arange(N)[:, None, None, None]; m_i = np.arange(M)[None, None, :, None]
            v = value[n_i, pix, m_i]                                 # (N, Lq, M, P, D)
            dot = np.where(ok, (v * g[:, :, :, None, :]).sum(-1), 0)
            ga[..., l, :] += bw * dot
            dlw = (wy if dx else -wy); dlh = (wxw if dy else -wxw)
            gl[..., l, :, 0] += a * dlw * dot * W
            gl[..., l, :, 1] += a * dlh * dot * H
            contrib = np.where(ok[..., None], (a * bw)[..., None] * g[:, :, :, None, :], 0)
            np.add.at(gv, (np.broadcast_to(n_i, pix.shape), pix, np.broadcast_to(m_i, pix.shape)), contrib)
    return gv, gl, ga

def tile_sides(shapes, Lq, P, target, tmax=20):
    out = []
    for H, W in shapes:
        dens = Lq * P / ((H + 1) * (W + 1))
        out.append(max(2, min(tmax, round(math.sqrt(target / dens)))))
    return out

def emulate(value, shapes, starts, loc, attn, gout, target=1024, E=1024):
    N, S, M, D = value.shape
    _, Lq, _, L, P, _ = loc.shape
    T = tile_sides(shapes, Lq, P, target)
    ty_n = [(H + 1 + t - 1) // t for (H, W), t in zip(shapes, T)]
    tx_n = [(W + 1 + t - 1) // t for (H, W), t in zip(shapes, T)]
    bin_base = np.cumsum([0] + [a * b for a, b in zip(ty_n, tx_n)])
    bins_nm = int(bin_base[-1]); bins = N * M * bins_nm
    items = N * Lq * M * L * P
    lf = loc.reshape(items, 2); af = attn.reshape(items)
    idx = np.arange(items)
    l_of = (idx // P) % L; grp = idx // (L * P); m_of = grp % M; n_of = grp // (Lq * M)
    Hs = np.array([h for h, w in shapes])[l_of]; Ws = np.array([w for h, w in shapes])[l_of]
    y = lf[:, 1] * Hs - 0.5; x = lf[:, 0] * Ws - 0.5
    inside = (y >= -1) & (x >= -1) & (y < Hs) & (x < Ws)
    h0 = np.floor(y).astype(int); w0 = np.floor(x).astype(int)
    cy = h0 + 1; cx = w0 + 1
    Tl = np.array(T)[l_of]; txl = np.array(tx_n)[l_of]
    key = np.where(inside, (n_of * M + m_of) * bins_nm + bin_base[l_of] + (cy // Tl) * txl + cx // Tl, bins)
    order = np.argsort(key, kind="stable")                    # the global sort (stable)
    skeys = key[order]
    start = np.searchsorted(skeys, np.arange(bins + 1))        # bin starts
    gv = np.full_like(value, np.nan); gl = np.zeros((items, 2)); ga = np.zeros(items)
    ring = {}                                                  # (bin, r, c) -> partial (D,)
    g_rows = gout.reshape(-1, D)
    for b in range(bins):
        nm, rest = divmod(b, bins_nm); n, m = divmod(nm, M)
        l = int(np.searchsorted(bin_base, rest, side="right") - 1)
        H, W = shapes[l]; t = T[l]; tb = rest - bin_base[l]; ty, tx = divmod(tb, tx_n[l])
        wy0, wx0 = ty * t - 1, tx * t - 1
        nwin = t + 1
        # value window staged (zeros outside the map)
        vwin = np.zeros((nwin, nwin, D))
        for r in range(nwin):
            for c in range(nwin):
                py, px = wy0 + r, wx0 + c
                if 0 <= py < H and 0 <= px < W:
                    vwin[r, c] = value[n, starts[l] + py * W + px, m]
        acc = np.zeros((nwin, nwin, D))
        ents = order[start[b]:start[b + 1]]
        for c0 in range(0, max(len(ents), 1), E):
            ch = ents[c0:c0 + E]
            lcy = cy[ch] - ty * t; lcx = cx[ch] - tx * t
            assert ((lcy >= 0) & (lcy < t) & (lcx >= 0) & (lcx < t)).all()
            cell = lcy * t + lcx
            perm = np.argsort(cell, kind="stable")              # in-block stable sort by cell
            scell = cell[perm]
            cstart = np.searchsorted(scell, np.arange(t * t + 1))
            lh = y[ch] - h0[ch]; lw = x[ch] - w0[ch]; a = af[ch]
            wts = np.stack([a * (1 - lh) * (1 - lw), a * (1 - lh) * lw, a * lh * (1 - lw), a * lh * lw], 1)
            # dots pass: every entry once (the bin owns its cells)
            g = g_rows[grp[ch]]
            dots = np.zeros((len(ch), 4))
            for k in range(4):
                rr = lcy + (k >> 1); cc = lcx + (k & 1)
                dots[:, k] = (vwin[rr, cc] * g).sum(-1)
            # corner_ok masks (the real kernels use sample_grads)
            for k in range(4):
                hy = h0[ch] + (k >> 1); wx = w0[ch] + (k & 1)
                ok = (hy >= 0) & (hy < H) & (wx >= 0) & (wx < W)
                dots[:, k] = np.where(ok, dots[:, k], 0)
            bw = wts / np.where(a == 0, 1, a)[:, None]
            ga[ch] = (bw * dots).sum(1)
            dlw = np.stack([-(1 - lh), (1 - lh), -lh, lh], 1); dlh = np.stack([-(1 - lw), -lw, (1 - lw), lw], 1)
            gl[ch, 0] = a * (dlw * dots).sum(1) * W; gl[ch, 1] = a * (dlh * dots).sum(1) * H
            # sub-tiles of 4 x 4 window pixels over 5 runs of cells
            for sy in range((nwin + 3) // 4):
                for sx in range((nwin + 3) // 4):
                    y0, x0 = 4 * sy, 4 * sx
                    sub = np.zeros((4, 4, D))
                    for q in range(5):
                        lr = y0 - 1 + q
                        if not (0 <= lr < t):
                            continue
                        c_lo, c_hi = max(x0 - 1, 0), min(x0 + 3, t - 1)
                        if c_lo > c_hi:
                            continue
                        for j in range(cstart[lr * t + c_lo], cstart[lr * t + c_hi + 1]):
                            e = perm[j]
                            py = lcy[e] - y0; px = lcx[e] - x0     # corner 0 in sub-tile coords
                            for k in range(4):
                                yy, xx = py + (k >> 1), px + (k & 1)
                                if 0 <= yy < 4 and 0 <= xx < 4:
                                    sub[yy, xx] += wts[e, k] * g[e]
                    ys, xs = min(4, nwin - y0), min(4, nwin - x0)
                    acc[y0:y0 + ys, x0:x0 + xs] += sub[:ys, :xs]
        # writes: interior direct, ring to scratch
        for r in range(nwin):
            for c in range(nwin):
                py, px = wy0 + r, wx0 + c
                if not (0 <= py < H and 0 <= px < W):
                    continue
                shared = (r == 0 and ty >= 1) or (r == t and ty < ty_n[l] - 1) or \
                         (c == 0 and tx >= 1) or (c == t and tx < tx_n[l] - 1)
                if shared:
                    ring[(b, r, c)] = acc[r, c]
                else:
                    assert np.isnan(gv[n, starts[l] + py * W + px, m]).all()
                    gv[n, starts[l] + py * W + px, m] = acc[r, c]
    # merge: a pixel on tile lines gets the partials of the 2 or 4 bins whose windows hold it
    for nm in range(N * M):
        n, m = divmod(nm, M)
        for l, (H, W) in enumerate(shapes):
            t = T[l]
            for py in range(H):
                for px in range(W):
                    rows = [((py + 1) // t, py + 1 - ((py + 1) // t) * t)]
                    if (py + 1) % t == 0 and (py + 1) // t >= 1:
                        rows = [((py + 1) // t - 1, t)] + rows
                    cols = [((px + 1) // t, px + 1 - ((px + 1) // t) * t)]
                    if (px + 1) % t == 0 and (px + 1) // t >= 1:
                        cols = [((px + 1) // t - 1, t)] + cols
                    if len(rows) == 1 and len(cols) == 1:
                        continue
                    s = np.zeros(D)
                    for ty, r in rows:
                        for tx, c in cols:
                            if ty >= ty_n[l] or tx >= tx_n[l]:
                                continue
                            bb = nm * bins_nm + bin_base[l] + ty * tx_n[l] + tx
                            s += ring[(bb, r, c)]
                    assert np.isnan(gv[n, starts[l] + py * W + px, m]).all()
                    gv[n, starts[l] + py * W + px, m] = s
    # samples off the map
    off = ~inside
    ga[off] = 0; gl[off] = 0
    return gv, gl.reshape(loc.shape), ga.reshape(attn.shape), T

def case(name, N, shapes, Lq, M, P, D, gen, target=1024, E=1024, seed=0):
    rng = np.random.default_rng(seed)
    S = sum(h * w for h, w in shapes)
    starts = np.cumsum([0] + [h * w for h, w in shapes])[:-1]
    L = len(shapes)
    value = rng.standard_normal((N, S, M, D))
    if gen == "encoder":
        refs = np.concatenate([np.stack(np.meshgrid((np.arange(w) + .5) / w, (np.arange(h) + .5) / h), -1).reshape(-1, 2)
                               for h, w in shapes])
        ref = np.broadcast_to(refs[None, :, None, None, None, :], (N, Lq, M, L, P, 2))
        wh = np.array([(w, h) for h, w in shapes], float)[None, None, None, :, None, :]
        t = 2 * np.pi * np.arange(M) / M
        dirs = np.stack([np.cos(t), np.sin(t)], -1)[None, None, :, None, None, :]
        steps = np.arange(1, P + 1)[None, None, None, None, :, None]
        loc = ref + (steps * dirs + rng.standard_normal((N, Lq, M, L, P, 2))) / wh
    elif gen == "crowd":     # every sample within a pixel or two of one point
        loc = 0.45 + 0.1 * rng.random((N, Lq, M, L, P, 2))
    else:                    # uniform, some outside
        loc = rng.random((N, Lq, M, L, P, 2)) * 1.4 - 0.2
    attn = rng.random((N, Lq, M, L, P))
    gout = rng.standard_normal((N, Lq, M * D))
    ref = reference(value, shapes, starts, loc, attn, gout)
    got = emulate(value, shapes, starts, loc, attn, gout, target, E)
    errs = [np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300) for a, b in zip(got[:3], ref)]
    print(f"{name}: tile sides {got[3]}, rel. errors value {errs[0]:.1e} loc {errs[1]:.1e} attn {errs[2]:.1e}")
    assert all(e < 1e-12 for e in errs) and not np.isnan(got[0]).any(), errs

case("encoder", 1, [(25, 42), (13, 21), (7, 11), (4, 6)], 1424, 2, 4, 8, "encoder", target=256, E=128)
case("uniform", 2, [(9, 11), (5, 6), (1, 1), (3, 2)], 60, 3, 3, 4, "uniform", target=64, E=32)
case("crowd", 1, [(16, 16), (8, 8)], 300, 2, 4, 4, "crowd", target=128, E=64)
case("tiny", 1, [(1, 1), (1, 7), (7, 1), (5, 9)], 50, 2, 4, 4, "uniform", target=32, E=16)
