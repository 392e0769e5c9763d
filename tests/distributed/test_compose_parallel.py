"""The composed options of tests/test_compose.py under tensor parallelism: 2 gloo ranks, one run,
the vocabulary sharded over TP (even halves), checked against the one-process float64 math of the whole
vocabulary written here:

* `linear_policy_loss` under top-p and under a replayed support, with softcap (PyTorch kernels in float64,
  Triton under its interpreter in float32);
* `distillation_loss` / `linear_distillation_loss` with student and teacher softcaps;
* `token_logprobs` under top-k with softcap on the Triton kernels (the kept set found on the PyTorch
  values, handed to the kernels as a threshold on the logits).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

import lmloss
from lmloss import sampling

WORLD = 2
N, H, V, T, CAP = 10, 6, 32, 0.8, 4.0
POLICY = dict(clip_ratio=0.2, kl_loss_type="k3", kl_loss_coef=0.05, entropy_coeff=0.01)
TRITON = lmloss.kernels.triton_available()


def _data():
    g = torch.Generator().manual_seed(7)
    d = dict(
        hidden=torch.randn(N, H, generator=g, dtype=torch.float64),
        weight=torch.randn(V, H, generator=g, dtype=torch.float64),
        adv=torch.randn(N, generator=g, dtype=torch.float64),
        old=torch.randn(N, generator=g, dtype=torch.float64) * 0.3 - 2.5,
        t_hidden=torch.randn(N, 5, generator=g, dtype=torch.float64),
        t_weight=torch.randn(V, 5, generator=g, dtype=torch.float64),
    )
    order = torch.stack([torch.randperm(V, generator=g) for _ in range(N)])
    d["ref"] = d["old"] + 0.1 * torch.randn(N, generator=g, dtype=torch.float64)
    z = _capped(d["hidden"] @ d["weight"].T) / T
    # labels inside every truncation used below: each row's argmax (top-p keeps it), and for the support
    # a supported id
    d["labels"] = z.argmax(-1)
    others = order[order != d["labels"][:, None]].view(N, V - 1)
    d["support"] = torch.cat([d["labels"][:, None], others[:, :6]], dim=1)
    d["labels"][3] = -100
    return d


def _capped(z, cap=CAP):
    return cap * torch.tanh(z / cap)


def _shard(t, rank):
    return t[rank * (V // WORLD) : (rank + 1) * (V // WORLD)]


def _ranks(rank, world):
    tp = dist.new_group(list(range(world)))
    d = _data()
    out = {}
    impls = [("torch", torch.float64)] + ([("triton", torch.float32)] if TRITON else [])
    for impl, dtype in impls:
        for case in ("top_p", "support"):
            h = d["hidden"].to(dtype).clone().requires_grad_()
            w = _shard(d["weight"], rank).to(dtype).clone().requires_grad_()
            kw = {"top_p": 0.85} if case == "top_p" else {"support": d["support"]}
            loss, _ = lmloss.rl.linear_policy_loss(
                h, w, d["labels"], d["old"].to(dtype), d["adv"].to(dtype), ref_logprobs=d["ref"].to(dtype),
                temperature=T, softcap=CAP, tp_group=tp, impl=impl, chunk_size=4, **POLICY, **kw,
            )  # fmt: skip
            loss.backward()
            out[("policy", case, impl)] = (loss.detach(), h.grad, w.grad)
        for path in ("logits", "fused"):
            h = d["hidden"].to(dtype).clone().requires_grad_()
            w = _shard(d["weight"], rank).to(dtype).clone().requires_grad_()
            t_w = _shard(d["t_weight"], rank).to(dtype)
            common = dict(beta=0.5, temperature=T, softcap=3.0, teacher_softcap=2.0, tp_group=tp, impl=impl,
                          chunk_size=4)  # fmt: skip
            if path == "logits":
                x = (h @ w.T).detach().requires_grad_()
                loss = lmloss.distillation_loss(x, d["t_hidden"].to(dtype) @ t_w.T, d["labels"], **common)
                loss.backward()
                out[("distill", path, impl)] = (loss.detach(), x.grad)
            else:
                loss = lmloss.linear_distillation_loss(h, w, d["t_hidden"].to(dtype), t_w, d["labels"], **common)
                loss.backward()
                out[("distill", path, impl)] = (loss.detach(), h.grad, w.grad)
    for sp in (False, True):  # the full KL to a reference head, its vocabulary sharded like the policy's
        rows = slice(rank * (N // WORLD), (rank + 1) * (N // WORLD)) if sp else slice(None)
        h = d["hidden"][rows].clone().requires_grad_()
        w = _shard(d["weight"], rank).clone().requires_grad_()
        loss, _ = lmloss.rl.linear_policy_loss(
            h, w, d["labels"], d["old"], d["adv"], kl_loss_type="full", kl_loss_coef=0.3, ref_hidden=d["t_hidden"][rows],
            ref_weight=_shard(d["t_weight"], rank), temperature=T, softcap=CAP, tp_group=tp, sequence_parallel=sp,
            chunk_size=4,
        )  # fmt: skip
        loss.backward()
        out[("full_kl", sp)] = (loss.detach(), h.grad, w.grad)
    if TRITON:
        x = (d["hidden"] @ _shard(d["weight"], rank).T).float()
        labels = (_capped(d["hidden"] @ d["weight"].T) / T).topk(6, dim=-1).indices[:, -1]  # the boundary
        lp = lmloss.token_logprobs(x, labels, top_k=6, softcap=CAP, temperature=T, tp_group=tp, impl="triton")
        out[("topk_boundary", labels)] = lp
    return out


@pytest.fixture(scope="module")
def ranks():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sampling.KeptSetWarning)
        return run_ranks(_ranks, WORLD)


def _kept_top_p(y, p):
    srt, idx = y.sort(-1)
    cum = srt.softmax(-1).cumsum(-1)
    drop = cum <= 1 - p
    drop[:, -1] = False
    return torch.zeros_like(y, dtype=torch.bool).scatter(1, idx, ~drop)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TRITON, reason="no triton"))])
@pytest.mark.parametrize("case", ["top_p", "support"])
def test_tp2_fused_policy_loss_under_the_kept_set_matches_one_process_float64(ranks, case, impl):
    d = _data()
    h, w = d["hidden"].clone().requires_grad_(), d["weight"].clone().requires_grad_()
    y = _capped(h @ w.T) / T
    kept = _kept_top_p(y.detach(), 0.85) if case == "top_p" else torch.zeros(N, V, dtype=torch.bool).scatter_(
        1, d["support"], True)  # fmt: skip
    logp = y.masked_fill(~kept, -math.inf).log_softmax(-1)
    p = logp.exp()
    ent = -(p * logp.masked_fill(~kept, 0.0)).sum(-1)
    mask = d["labels"] != -100
    lp = torch.where(mask, logp.gather(1, d["labels"].clamp(min=0)[:, None]).squeeze(1), 0.0)
    expected, _ = lmloss.rl.policy_loss(lp, d["old"], d["adv"], mask, ref_logprobs=d["ref"], entropy=ent, **POLICY)
    expected.backward()
    tol = dict(rtol=1e-10, atol=1e-12) if impl == "torch" else dict(rtol=2e-4, atol=2e-5)
    for rank, got in enumerate(ranks):
        loss, gh, gw = got[("policy", case, impl)]
        torch.testing.assert_close(loss.double(), expected.detach(), **tol)
        torch.testing.assert_close(gh.double(), h.grad, **tol)
        torch.testing.assert_close(gw.double(), _shard(w.grad, rank), **tol)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TRITON, reason="no triton"))])
@pytest.mark.parametrize("path", ["logits", "fused"])
def test_tp2_distillation_with_softcaps_matches_one_process_float64(ranks, path, impl):
    d = _data()
    h, w = d["hidden"].clone().requires_grad_(), d["weight"].clone().requires_grad_()
    z = (h @ w.T).detach().requires_grad_() if path == "logits" else h @ w.T
    ls = (_capped(z, 3.0) / T).log_softmax(-1)
    lt = (_capped(d["t_hidden"] @ d["t_weight"].T, 2.0) / T).log_softmax(-1)
    lm = torch.logaddexp(ls + math.log(0.5), lt + math.log(0.5))
    per = 0.5 * (lt.exp() * (lt - lm)).sum(-1) + 0.5 * (ls.exp() * (ls - lm)).sum(-1)
    valid = d["labels"] != -100
    expected = torch.where(valid, per, 0.0).sum() / valid.sum()
    expected.backward()
    tol = dict(rtol=1e-10, atol=1e-12) if impl == "torch" else dict(rtol=2e-4, atol=2e-6)
    for rank, got in enumerate(ranks):
        result = got[("distill", path, impl)]
        torch.testing.assert_close(result[0].double(), expected.detach(), **tol)
        if path == "logits":
            torch.testing.assert_close(result[1].double(), z.grad[:, rank * (V // WORLD) : (rank + 1) * (V // WORLD)], **tol)
        else:
            torch.testing.assert_close(result[1].double(), h.grad, **tol)
            torch.testing.assert_close(result[2].double(), _shard(w.grad, rank), **tol)


@pytest.mark.skipif(not TRITON, reason="no triton")
def test_tp2_top_k_boundary_token_stays_kept_under_softcap_on_triton(ranks):
    d = _data()
    y = _capped(d["hidden"] @ d["weight"].T) / T
    for got in ranks:
        ((_, labels), lp), = [(k, v) for k, v in got.items() if k[0] == "topk_boundary"]
        kept = y >= y.topk(6, dim=-1).values[:, -1:]
        ref = y.masked_fill(~kept, -math.inf).log_softmax(-1).gather(1, labels[:, None]).squeeze(1)
        assert torch.isfinite(lp).all()
        torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sp"])
def test_tp2_full_kl_policy_loss_matches_one_process_float64(ranks, sp):
    """``kl_loss_type="full"`` under TP=2 (and sequence parallelism): the loss, the hidden gradient (all-reduced,
    or each rank's rows) and each rank's weight-shard gradient equal one process's float64 math."""
    d = _data()
    h, w = d["hidden"].clone().requires_grad_(), d["weight"].clone().requires_grad_()
    z = h @ w.T
    lp_all = (_capped(z) / T).log_softmax(-1)
    lq = (_capped(d["t_hidden"] @ d["t_weight"].T) / T).log_softmax(-1)
    kl = (lp_all.exp() * (lp_all - lq)).sum(-1)
    mask = d["labels"] != -100
    lp = torch.where(mask, lp_all.gather(1, d["labels"].clamp(min=0)[:, None]).squeeze(1), 0.0)
    expected, _ = lmloss.rl.policy_loss(lp, d["old"], d["adv"], mask, kl_loss_type="full", kl_loss_coef=0.3, kl=kl)
    expected.backward()
    tol = dict(rtol=1e-10, atol=1e-12)
    for rank, got in enumerate(ranks):
        loss, gh, gw = got[("full_kl", sp)]
        torch.testing.assert_close(loss, expected.detach(), **tol)
        rows = slice(rank * (N // WORLD), (rank + 1) * (N // WORLD)) if sp else slice(None)
        torch.testing.assert_close(gh, h.grad[rows], **tol)
        torch.testing.assert_close(gw, _shard(w.grad, rank), **tol)
