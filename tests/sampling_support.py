"""The rollout engine's kept set written out in float64 (vLLM's sampler), for the sampling tests."""

from __future__ import annotations

import math

import torch

INF = math.inf


def vllm_kept(y: torch.Tensor, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """Kept mask ``[N, V]`` of float64 scaled logits `y`; parameters are ``[N]`` tensors or None."""
    y = y.double()
    n, v = y.shape
    work = y.clone()
    if min_p is not None:
        probs = work.softmax(-1)
        work = work.masked_fill(probs < min_p.double()[:, None] * probs.amax(-1, keepdim=True), -INF)
    srt, idx = work.sort(-1)
    if top_k is not None:
        k = top_k.clamp(max=v)
        kth = srt.gather(1, (v - k)[:, None])
        srt = srt.masked_fill(srt < kth, -INF)
    if top_p is not None:
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p.double()[:, None]
        drop[:, -1] = False
        srt = srt.masked_fill(drop, -INF)
    kept = torch.zeros_like(y, dtype=torch.bool).scatter(1, idx, srt > -INF)
    smallest = torch.where(kept, y, INF).amin(-1, keepdim=True)
    return kept | (y >= smallest)


def per_row(v, n):
    return None if v is None else (v if isinstance(v, torch.Tensor) else torch.full((n,), v))
