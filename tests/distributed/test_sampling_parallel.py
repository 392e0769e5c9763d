"""Sampling truncation (top-k / top-p / min-p) and replay under tensor (vocab) parallelism: TP=2 gloo, one spawn.

The thresholds are global: top-k from every rank's candidates, top-p from histograms and candidates
combined over the group. Configurations, all in the one run, each checked against a float64
reference over the unsharded logits (vLLM's order, written out below):

  even     V=200 as 100 + 100 columns; in 4 rows every kept token sits on rank 0 (rank 1 keeps nothing)
  uneven   V=201 as [81, 201) on rank 0 and [0, 81) on rank 1 (out of rank order, explicit vocab_start),
           vocab_size=195: the last 6 columns are padding
  replay   the reference's kept ids as ``support=`` over the even shards (and their kept mass), and
           fused under sequence parallelism
  fused    hidden [16, H] and a weight sharded 100 + 100, top_k + top_p + min_p
  triton   even and uneven again with impl="triton" (Triton's interpreter on these CPU tensors): the kept set
           found by the Triton search's kernels, each of its steps with at most one collective
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from dist_utils import run_ranks

import lmloss

N, V, H, T = 16, 200, 8, 0.5
INF = math.inf
TOP_K = torch.tensor([5, 15, 400, 30] * 4)
TOP_P = torch.tensor([0.85, 0.5, 0.95, 1.0] * 4)
MIN_P = 0.02


def vllm_kept(y, top_k=None, top_p=None, min_p=None):
    """Kept mask of float64 scaled logits (vLLM's order; ties at the top-p boundary kept, see docs)."""
    y = y.double()
    v = y.shape[1]
    work = y.clone()
    if min_p is not None:
        probs = work.softmax(-1)
        work = work.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), -INF)
    srt, idx = work.sort(-1)
    if top_k is not None:
        srt = srt.masked_fill(srt < srt.gather(1, (v - top_k.clamp(max=v))[:, None]), -INF)
    if top_p is not None:
        drop = srt.softmax(-1).cumsum(-1) <= 1 - top_p.double()[:, None]
        drop[:, -1] = False
        srt = srt.masked_fill(drop, -INF)
    kept = torch.zeros_like(y, dtype=torch.bool).scatter(1, idx, srt > -INF)
    return kept | (y >= torch.where(kept, y, INF).amin(-1, keepdim=True))


def _problem():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, V + 1, generator=g) * 3
    logits[:4, :100] += 12.0  # rows whose whole kept set lies in the first 100 columns
    labels = torch.randint(0, V, (N,), generator=g)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.8
    return logits, labels, hidden, weight


def _labels_in(kept, seed):
    labels = torch.multinomial(kept.double(), 1, generator=torch.Generator().manual_seed(seed)).squeeze(1)
    labels[1] = -100
    return labels


def _support(kept):
    out = torch.full((kept.shape[0], int(kept.sum(1).max())), -1)
    for i in range(kept.shape[0]):
        ids = kept[i].nonzero().squeeze(1).flip(0)
        out[i, : ids.numel()] = ids
    return out


def _worker(rank, world):
    group = dist.new_group([0, 1])
    logits, _, hidden, weight = _problem()
    out = {}
    kw = dict(top_k=TOP_K, top_p=TOP_P, min_p=MIN_P, temperature=T, tp_group=group, chunk_size=6)
    warnings.simplefilter("ignore")

    full = logits[:, :V]
    kept = vllm_kept(full.double() / T, TOP_K, TOP_P, MIN_P)
    labels = _labels_in(kept, 1)
    x = full[:, rank * 100 : (rank + 1) * 100].clone().requires_grad_()
    lp, ent, mass = lmloss.token_logprobs(x, labels, return_entropy=True, return_log_kept_mass=True, **kw)
    (lp + ent).sum().backward()
    out["even"] = (lp, ent, mass, x.grad)

    vocab_size = 195
    kept_u = vllm_kept(logits[:, :vocab_size].double() / T, TOP_K, TOP_P, MIN_P)
    labels_u = _labels_in(kept_u, 2)
    start, stop = (81, 201) if rank == 0 else (0, 81)
    xu = logits[:, start:stop].clone().requires_grad_()
    lp, ent = lmloss.token_logprobs(
        xu, labels_u, return_entropy=True, vocab_start=start, vocab_size=vocab_size, **kw
    )
    (lp + ent).sum().backward()
    out["uneven"] = (lp, ent, xu.grad)

    xr = full[:, rank * 100 : (rank + 1) * 100].clone().requires_grad_()
    lp, ent, mass = lmloss.token_logprobs(
        xr, labels, support=_support(kept), temperature=T, tp_group=group, return_entropy=True,
        return_log_kept_mass=True,
    )  # fmt: skip
    (lp + ent).sum().backward()
    out["replay"] = (lp, ent, mass, xr.grad)

    kept_f = vllm_kept((hidden.double() @ weight.double().T) / T, TOP_K, TOP_P, MIN_P)
    labels_f = _labels_in(kept_f, 3)
    hh = hidden.clone().requires_grad_()
    ww = weight[rank * 100 : (rank + 1) * 100].clone().requires_grad_()
    lp = lmloss.linear_token_logprobs(hh, ww, labels_f, **kw)
    lp.sum().backward()
    out["fused"] = (lp, hh.grad, ww.grad)

    # the same set replayed, fused, sequence parallel: this rank holds half of the tokens' hidden rows
    hs = hidden[rank * (N // 2) : (rank + 1) * (N // 2)].clone().requires_grad_()
    ws = weight[rank * 100 : (rank + 1) * 100].clone().requires_grad_()
    lp = lmloss.linear_token_logprobs(
        hs, ws, labels_f, support=_support(kept_f), temperature=T, tp_group=group, sequence_parallel=True,
        chunk_size=5,
    )  # fmt: skip
    lp.sum().backward()
    out["fused_replay_sp"] = (lp, hs.grad, ws.grad)
    out.update(_triton_cases(rank, group, full, labels, logits, labels_u, kw))
    return out


def _triton_cases(rank, group, full, labels, logits, labels_u, kw):
    """The even and uneven cases with the Triton kernels, and the search's steps: the order in which its
    kernels and collectives ran (a step is a kernel and the collectives before the next one)."""
    from lmloss import sampling
    from lmloss.kernels import triton_kernels, triton_sampling

    events = []

    def recorded(module, name, kind):
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            events.append(kind)
            return fn(*args, **kwargs)

        return wrapper

    patches = [(sampling, "all_reduce_sum_", "collective"), (sampling, "all_reduce_max_", "collective"),
               (sampling.dist, "all_gather", "collective"), (triton_sampling, "histogram", "kernel"),
               (triton_sampling, "candidates", "kernel"), (triton_kernels, "softmax_partials", "kernel")]  # fmt: skip
    saved = [(m, n, getattr(m, n)) for m, n, _ in patches]
    for m, n, kind in patches:
        setattr(m, n, recorded(m, n, kind))
    try:
        x = full[:, rank * 100 : (rank + 1) * 100].clone().requires_grad_()
        lp, ent, mass = lmloss.token_logprobs(x, labels, return_entropy=True, return_log_kept_mass=True,
                                              impl="triton", **kw)  # fmt: skip
    finally:
        for m, n, fn in saved:
            setattr(m, n, fn)
    (lp + ent).sum().backward()
    out = {"triton_even": (lp, ent, mass, x.grad), "triton_events": events}
    start, stop = (81, 201) if rank == 0 else (0, 81)
    xu = logits[:, start:stop].clone().requires_grad_()
    lp, ent = lmloss.token_logprobs(
        xu, labels_u, return_entropy=True, vocab_start=start, vocab_size=195, impl="triton", **kw
    )
    (lp + ent).sum().backward()
    out["triton_uneven"] = (lp, ent, xu.grad)
    return out


def _reference(x, labels, kept):
    """float64 log-probs, entropy, log kept mass and the gradient of sum(logprob + entropy)."""
    x = x.double().requires_grad_()
    y = x / T
    logp = y.masked_fill(~kept, -INF).log_softmax(-1)
    valid = labels != -100
    lp = torch.where(valid, logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1), 0.0)
    # an ignored token counts for nothing: its entropy and kept mass are 0 too
    ent = torch.where(valid, -(logp.exp() * logp.masked_fill(~kept, 0.0)).sum(-1), 0.0)
    mass = torch.logsumexp(y.masked_fill(~kept, -INF), -1) - torch.logsumexp(y, -1)
    mass = torch.where(valid, mass, 0.0)
    (lp + ent).sum().backward()
    return lp.detach(), ent.detach(), mass.detach(), x.grad


def test_sampling_under_tp2_matches_the_unsharded_float64_reference():
    results = run_ranks(_worker, 2)
    logits, _, hidden, weight = _problem()
    tol = dict(rtol=1e-5, atol=1e-5)

    full = logits[:, :V]
    kept = vllm_kept(full.double() / T, TOP_K, TOP_P, MIN_P)
    assert not kept[:4, 100:].any()  # rank 1 keeps nothing in those rows
    labels = _labels_in(kept, 1)
    lp, ent, mass, grad = _reference(full, labels, kept)
    for name in ("even", "replay", "triton_even"):
        for rank, res in enumerate(results):
            got = res[name]
            torch.testing.assert_close(got[0].double(), lp, **tol, msg=f"{name} logprobs rank {rank}")
            torch.testing.assert_close(got[1].double(), ent, **tol, msg=f"{name} entropy rank {rank}")
            shard = grad[:, rank * 100 : (rank + 1) * 100]
            torch.testing.assert_close(got[-1].double(), shard, **tol, msg=f"{name} grad rank {rank}")
            torch.testing.assert_close(got[2].double(), mass, **tol, msg=f"{name} kept mass rank {rank}")

    kept_u = vllm_kept(logits[:, :195].double() / T, TOP_K, TOP_P, MIN_P)
    labels_u = _labels_in(kept_u, 2)
    lp, ent, _, grad = _reference(logits[:, :195], labels_u, kept_u)
    grad = torch.cat([grad, torch.zeros(N, 6, dtype=grad.dtype)], dim=1)  # padding columns: no gradient
    for rank, (start, stop) in enumerate([(81, 201), (0, 81)]):
        for name in ("uneven", "triton_uneven"):
            got = results[rank][name]
            torch.testing.assert_close(got[0].double(), lp, **tol)
            torch.testing.assert_close(got[1].double(), ent, **tol)
            torch.testing.assert_close(got[2].double(), grad[:, start:stop], **tol)

    # the Triton search: every kernel of it is followed by at most one collective before the next kernel
    # (the forward's own partials kernel and its combine after it: the last step has the op's MAX and SUM)
    for res in results:
        events = res["triton_events"]
        assert events.count("kernel") >= 3 * 3 and events.count("collective") >= 3 * 3  # 3 chunks, 3+ steps each
        steps = "".join("k" if e == "kernel" else "c" for e in events).split("k")[1:]
        assert all(len(step) <= 1 for step in steps[:-1]), events

    kept_f = vllm_kept((hidden.double() @ weight.double().T) / T, TOP_K, TOP_P, MIN_P)
    labels_f = _labels_in(kept_f, 3)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp = ((h64 @ w64.T) / T).masked_fill(~kept_f, -INF).log_softmax(-1)
    lp_f = torch.where(labels_f != -100, logp.gather(1, labels_f.clamp(min=0)[:, None]).squeeze(1), 0.0)
    lp_f.sum().backward()
    for rank, res in enumerate(results):
        got_lp, got_h, got_w = res["fused"]
        torch.testing.assert_close(got_lp.double(), lp_f.detach(), **tol)
        torch.testing.assert_close(got_h.double(), h64.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(
            got_w.double(), w64.grad[rank * 100 : (rank + 1) * 100], rtol=1e-4, atol=1e-4
        )
        got_lp, got_h, got_w = res["fused_replay_sp"]
        torch.testing.assert_close(got_lp.double(), lp_f.detach(), **tol)
        rows = slice(rank * (N // 2), (rank + 1) * (N // 2))
        torch.testing.assert_close(got_h.double(), h64.grad[rows], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(
            got_w.double(), w64.grad[rank * 100 : (rank + 1) * 100], rtol=1e-4, atol=1e-4
        )
