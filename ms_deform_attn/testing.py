"""The canonical MSDA workloads and their sampling-location generators.

The project's own copy of ../shared/WORKLOADS.md (the spec): every workload by
name (plus dino_dec_dn, DINO's decoder with its denoising queries), the
location generators (`uniform`, `encoder`, `decoder` from the spec;
`smooth`, the project's trained-like field for the encoders, see
smooth_offsets), and the bytes floor. Tests and benchmarks draw their inputs
from here. "name@generator" gives a workload with another generator
("ddetr_enc@smooth"). Also the small transformers detector the deployment
tests, example and benchmark share (small_deformable_detr, needs
transformers).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

import torch

from .compat import level_start_index

DDETR_LEVELS = ((100, 167), (50, 84), (25, 42), (13, 21))


@dataclass(frozen=True)
class Workload:
    name: str
    n: int                               # batch
    levels: Tuple[Tuple[int, int], ...]  # (H, W) per level
    lq: Optional[int]                    # queries; None: one per pixel (= S)
    m: int                               # heads
    p: int                               # points per level
    locations: str                       # generator: uniform / encoder / decoder
    d: int = 32                          # channels per head

    @property
    def s(self) -> int:
        return sum(h * w for h, w in self.levels)

    @property
    def queries(self) -> int:
        return self.s if self.lq is None else self.lq

    def scaled(self, factor: int) -> "Workload":
        """A smaller workload of the same structure (for CPU runs): level sides
        divided by `factor`, batch and explicit query counts too."""
        if factor <= 1:
            return self
        levels = tuple((max(1, math.ceil(h / factor)), max(1, math.ceil(w / factor)))
                       for h, w in self.levels)
        lq = None if self.lq is None else max(1, self.lq // factor)
        return replace(self, n=max(1, self.n // factor), levels=levels, lq=lq,
                       name=f"{self.name}/{factor}")


WORKLOADS: Dict[str, Workload] = {
    w.name: w
    for w in [
        Workload("seed", 48, ((92, 160), (46, 80), (23, 40), (12, 20)), 15422, 1, 8, "uniform"),
        Workload("ddetr_enc", 2, DDETR_LEVELS, None, 8, 4, "encoder"),
        Workload("ddetr_dec", 2, DDETR_LEVELS, 300, 8, 4, "decoder"),
        Workload("dino_dec", 4, DDETR_LEVELS, 900, 8, 4, "decoder"),
        # The project's addition: dino_dec in training, its 900 queries
        # joined by ~200 denoising ones (Lq P 4400: above the block-local
        # path's first 4096-sample instantiation).
        Workload("dino_dec_dn", 4, DDETR_LEVELS, 1100, 8, 4, "decoder"),
        Workload("rtdetr_dec", 16, ((80, 80), (40, 40), (20, 20)), 300, 8, 4, "decoder"),
        Workload("dino5_enc", 1, ((200, 334),) + DDETR_LEVELS, None, 8, 4, "encoder"),
        Workload("bevformer_tsa", 2, ((200, 200),), None, 8, 4, "encoder"),
        Workload("m2f_enc", 1, ((128, 128), (64, 64), (32, 32)), None, 8, 4, "encoder"),
    ]
}


GENERATORS = ("uniform", "encoder", "decoder", "smooth")


# Devices the planners' table tests plan for without having them: the CUDA
# runtime's figures (DeviceInfo's fields, csrc/plan/device.h; compute
# capability, SMs, shared memory a block may opt in to, an SM's most, the
# system's reservation a block). The H200 has the H100 SXM's.
DEVICES: Dict[str, Dict[str, int]] = {
    "H100": dict(major=9, minor=0, sms=132, smem_optin=232448, smem_per_sm=233472, smem_reserved=1024),
    "H200": dict(major=9, minor=0, sms=132, smem_optin=232448, smem_per_sm=233472, smem_reserved=1024),
    "A100": dict(major=8, minor=0, sms=108, smem_optin=166912, smem_per_sm=167936, smem_reserved=1024),
    "RTX5090": dict(major=12, minor=0, sms=170, smem_optin=101376, smem_per_sm=102400, smem_reserved=1024),
    "RTX3060": dict(major=8, minor=6, sms=28, smem_optin=101376, smem_per_sm=102400, smem_reserved=1024),
    "T4": dict(major=7, minor=5, sms=40, smem_optin=65536, smem_per_sm=65536, smem_reserved=0),
}


def get(name: str) -> Workload:
    """Workload by name; "name/k" gives it scaled down by k, "name@gen" with
    the location generator `gen` (both: "name@gen/k")."""
    base, _, factor = name.partition("/")
    base, _, gen = base.partition("@")
    if base not in WORKLOADS:
        raise KeyError(f"unknown workload {base!r}; known: {', '.join(WORKLOADS)}")
    wl = WORKLOADS[base]
    if gen:
        if gen not in GENERATORS:
            raise KeyError(f"unknown location generator {gen!r}; known: {', '.join(GENERATORS)}")
        if gen in ("encoder", "smooth") and wl.lq is not None:
            raise KeyError(f"generator {gen!r} needs one query per pixel; {base} has {wl.lq} queries")
        if gen != wl.locations:
            wl = replace(wl, locations=gen, name=f"{base}@{gen}")
    return wl.scaled(int(factor) if factor else 1)


def level_tensors(levels, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """spatial_shapes (L, 2) and level_start_index (L,), int64, on `device`."""
    shapes = torch.tensor(levels, dtype=torch.long, device=device)
    return shapes, level_start_index(shapes)


# ---- location generators ------------------------------------------------------
def _directions(m: int, device) -> torch.Tensor:
    """(M, 2) unit vectors (cos t_m, sin t_m), t_m = 2 pi m / M."""
    t = 2 * math.pi * torch.arange(m, dtype=torch.float64, device=device) / m
    return torch.stack([t.cos(), t.sin()], -1)


def _initial_pixels(wl: Workload, device) -> torch.Tensor:
    """(1, 1, M, 1, P, 2) the Deformable DETR initialisation: (p + 1) * dir_m pixels."""
    dirs = _directions(wl.m, device)[:, None, None, :]                       # (M, 1, 1, 2)
    steps = torch.arange(1, wl.p + 1, dtype=torch.float64, device=device)[None, None, :, None]
    return (steps * dirs)[None, None]


def _level_sizes(wl: Workload, device) -> torch.Tensor:
    """(1, 1, 1, L, 1, 2) each level's (W, H): pixels of a level over it are
    normalised units."""
    wh = torch.tensor([(w, h) for h, w in wl.levels], dtype=torch.float64, device=device)
    return wh[None, None, None, :, None, :]


def _offsets(wl: Workload, nq: int, scale: float, g: torch.Generator, device) -> torch.Tensor:
    """(N, nq, M, L, P, 2) offsets in normalised units: ((p + 1) * dir_m + N(0, 1))
    pixels of each level, times `scale`."""
    noise = torch.randn(wl.n, nq, wl.m, len(wl.levels), wl.p, 2, generator=g,
                        dtype=torch.float64).to(device)
    pix = _initial_pixels(wl, device) + noise                                 # pixels
    return scale * pix / _level_sizes(wl, device)


def encoder_reference_points(levels, device) -> torch.Tensor:
    """(S, 2): every pixel of every level, level-then-raster order, its centre."""
    refs = []
    for h, w in levels:
        ys = (torch.arange(h, dtype=torch.float64, device=device) + 0.5) / h
        xs = (torch.arange(w, dtype=torch.float64, device=device) + 0.5) / w
        yy, xx = torch.meshgrid(ys, xs, indexing="ij")
        refs.append(torch.stack([xx.flatten(), yy.flatten()], -1))
    return torch.cat(refs)


# The `smooth` field: amplitude and jitter in pixels of each level, and the
# spatial frequencies (cycles over the image) of its sinusoids.
SMOOTH_AMPLITUDE = 3.0
SMOOTH_JITTER = 0.25
SMOOTH_WAVES = 3
SMOOTH_MAX_FREQ = 2.0


def smooth_offsets(wl: Workload, ref: torch.Tensor, g: torch.Generator, device) -> torch.Tensor:
    """(N, nq, M, L, P, 2) offsets of the `smooth` generator, in normalised units,
    for reference points `ref` (nq, 2) in [0, 1]^2.

    What a trained model's offsets look like, as opposed to `encoder`'s
    independent N(0, 1) pixels a query: for every (batch, head, level, point,
    coordinate) the offset is the Deformable DETR initialisation (p + 1) *
    (cos t_m, sin t_m) pixels plus a smooth function of the query's position,
    SMOOTH_WAVES sinusoids sum(a_i sin(2 pi k_i . ref + phi_i)) with random
    frequencies |k_i| <= SMOOTH_MAX_FREQ cycles over the image, random phases
    and amplitudes scaled to an RMS of SMOOTH_AMPLITUDE pixels, plus
    N(0, SMOOTH_JITTER^2) pixels of jitter. Neighbouring queries therefore
    sample neighbouring pixels, as they do in a trained model.
    """
    nl, f = len(wl.levels), SMOOTH_WAVES
    shape = (wl.n, wl.m, nl, wl.p, 2, f)
    k = (torch.rand(shape + (2,), generator=g, dtype=torch.float64) * 2 - 1) * SMOOTH_MAX_FREQ
    phase = torch.rand(shape, generator=g, dtype=torch.float64) * 2 * math.pi
    amp = torch.randn(shape, generator=g, dtype=torch.float64)
    amp = amp / amp.pow(2).sum(-1, keepdim=True).div(2).sqrt().clamp_min(1e-12) * SMOOTH_AMPLITUDE
    k, phase, amp = k.to(device), phase.to(device), amp.to(device)
    # (N, M, L, P, 2, F, nq): each wave's value at every query.
    arg = 2 * math.pi * torch.einsum("...fc,qc->...fq", k, ref) + phase[..., None]
    field = (amp[..., None] * torch.sin(arg)).sum(-2)                       # (N, M, L, P, 2, nq)
    field = field.permute(0, 5, 1, 2, 3, 4)                                 # (N, nq, M, L, P, 2)
    jitter = SMOOTH_JITTER * torch.randn(field.shape, generator=g, dtype=torch.float64).to(device)
    pix = _initial_pixels(wl, device) + field + jitter                      # pixels
    return pix / _level_sizes(wl, device)


def sampling_locations(wl: Workload, g: torch.Generator, device="cpu") -> torch.Tensor:
    """(N, Lq, M, L, P, 2) float64 locations from the workload's generator."""
    nq = wl.queries
    if wl.locations == "uniform":
        shape = (wl.n, nq, wl.m, len(wl.levels), wl.p, 2)
        return torch.rand(shape, generator=g, dtype=torch.float64).to(device)
    if wl.locations == "encoder":
        assert nq == wl.s, "encoder workloads have one query per pixel"
        ref = encoder_reference_points(wl.levels, device)[None, :, None, None, None, :]
        return ref + _offsets(wl, nq, 1.0, g, device)
    if wl.locations == "smooth":
        assert nq == wl.s, "smooth workloads have one query per pixel"
        ref = encoder_reference_points(wl.levels, device)
        return (ref[None, :, None, None, None, :] + smooth_offsets(wl, ref, g, device)).contiguous()
    if wl.locations == "decoder":
        ref = 0.05 + 0.9 * torch.rand(wl.n, nq, 2, generator=g, dtype=torch.float64).to(device)
        return ref[:, :, None, None, None, :] + _offsets(wl, nq, 4.0, g, device)
    raise ValueError(f"unknown location generator {wl.locations!r}")


def make_inputs(wl: Workload, dtype=torch.float32, loc_dtype=torch.float32, device="cpu",
                seed: int = 0, requires_grad: bool = False) -> List[torch.Tensor]:
    """[value, spatial_shapes, level_start_index, sampling_locations, attention_weights]."""
    g = torch.Generator().manual_seed(seed)
    shapes, start = level_tensors(wl.levels, device)
    value = torch.randn(wl.n, wl.s, wl.m, wl.d, generator=g, dtype=torch.float32).to(device, dtype)
    loc = sampling_locations(wl, g, device).to(loc_dtype)
    logits = torch.randn(wl.n, wl.queries, wl.m, len(wl.levels) * wl.p, generator=g)
    attn = logits.to(device).softmax(-1).view(wl.n, wl.queries, wl.m, len(wl.levels), wl.p)
    attn = attn.to(loc_dtype)
    if requires_grad:
        for t in (value, loc, attn):
            t.requires_grad_()
    return [value, shapes, start, loc, attn]


def outside_fraction(loc: torch.Tensor) -> float:
    """Share of locations outside [0, 1]^2."""
    out = ((loc < 0) | (loc > 1)).any(-1)
    return out.double().mean().item()


def floor_bytes(wl: Workload, dtype: torch.dtype, loc_dtype: torch.dtype,
                backward: bool = False) -> int:
    """Fewest bytes a forward (or forward + backward) must move: every input read
    once, every output written once. The backward reads value, locations,
    weights and grad_output and writes the three gradients."""
    e = torch.tensor([], dtype=dtype).element_size()
    el = torch.tensor([], dtype=loc_dtype).element_size()
    value = wl.n * wl.s * wl.m * wl.d * e
    npts = wl.n * wl.queries * wl.m * len(wl.levels) * wl.p
    loc, attn = npts * 2 * el, npts * el
    out = wl.n * wl.queries * wl.m * wl.d * e
    fwd = value + loc + attn + out
    if not backward:
        return fwd
    return fwd + 2 * (value + loc + attn) + out


def small_deformable_detr(device="cpu") -> torch.nn.Module:
    """transformers' DeformableDetrModel at a small size (d_model 32, one
    encoder and one decoder layer, 4 heads, a ResNet-shaped backbone of 8-64
    channels, 3 + 1 levels), random weights (seed 0), in eval mode. Its
    attention is transformers' own: swap it with ms_deform_attn.hf.swap_msda."""
    import transformers

    backbone = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 32, 64],
                                         depths=[1, 1, 1, 1],
                                         out_features=["stage2", "stage3", "stage4"])
    cfg = transformers.DeformableDetrConfig(
        d_model=32, encoder_layers=1, decoder_layers=1, num_queries=10, encoder_ffn_dim=32,
        decoder_ffn_dim=32, encoder_attention_heads=4, decoder_attention_heads=4,
        use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False,
        backbone=None)
    torch.manual_seed(0)
    return transformers.DeformableDetrModel(cfg).to(device).eval()


class DetectorOutputs(torch.nn.Module):
    """pixel_values -> (the decoder's last hidden state, the encoder's):
    plain tensors, as an exported program returns them (RT-DETR's encoder
    gives one a level: they follow in order)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        out = self.model(pixel_values=pixel_values)
        enc = out.encoder_last_hidden_state
        return (out.last_hidden_state, *(enc if isinstance(enc, (list, tuple)) else (enc,)))
