"""lmloss.preference.linear_preference_loss under tensor, sequence and context parallelism: 2 gloo ranks, one run,
float64, against the one-process loss of plain PyTorch on the materialized logits (written here).

  tp2     the policy's and the reference's vocabulary (10 columns) split 5 + 5 over the pair; padded [4, T]
          pairs; without and with sequence parallelism (each rank's block of sequences' hidden states): the same
          loss on both ranks, the gradient of each rank's weight shard, and the hidden gradient (whole, or each
          rank's block);
  cp2     the same pairs packed (cu_seqlens), split over CP=2 in the zigzag layout (`lmloss.cp.split`), the
          reference given as its per-sequence sums: the ranks' loss shares sum to the loss, their hidden
          gradients at their tokens and their weight gradients summed are the one-process ones;
  agree   one rank passes another loss (DPO's beta) or other token weights: both ranks raise the same
          `RankAgreementError`, under TP (the plan's agreement) and CP (the group's).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks

import lmloss
from lmloss.preference import linear_preference_loss

S, T, H, V = 4, 8, 3, 10
LENGTHS = [8, 4, 8, 8]  # the packed sequences (padding dropped; divisible by 2 * CP for the zigzag split)
TOL = dict(rtol=1e-12, atol=1e-13)


def dpo(stats, beta=0.1):
    b = stats.logps.shape[0] // 2
    margin = (stats.logps[:b] - stats.ref_logps[:b]) - (stats.logps[b:] - stats.ref_logps[b:])
    return -F.logsigmoid(beta * margin).mean()


def _batch():
    g = torch.Generator().manual_seed(0)
    d = dict(
        hidden=torch.randn(S, T, H, generator=g, dtype=torch.float64),
        weight=torch.randn(V, H, generator=g, dtype=torch.float64),
        ref_hidden=torch.randn(S, T, 2, generator=g, dtype=torch.float64),
        ref_weight=torch.randn(V, 2, generator=g, dtype=torch.float64),
        labels=torch.randint(0, V, (S, T), generator=g),
        weights=torch.rand(S, T, generator=g, dtype=torch.float64) + 0.5,
    )
    d["labels"][:, :2] = -100  # prompts
    d["labels"][1, 4:] = -100  # padding
    return d


def _sums(d, h, w):
    """Per-sequence sums of the policy's and the reference's weighted label log-probs (plain PyTorch)."""
    counts = d["labels"] != -100
    idx = d["labels"].clamp(min=0)[..., None]
    lp = torch.log_softmax(h @ w.T, -1).gather(-1, idx)[..., 0]
    ref = torch.log_softmax(d["ref_hidden"] @ d["ref_weight"].T, -1).gather(-1, idx)[..., 0]
    return (torch.where(counts, d["weights"] * lp, 0.0).sum(-1), torch.where(counts, d["weights"] * ref, 0.0).sum(-1),
            counts.sum(-1).double())  # fmt: skip


def _one_process(d):
    from lmloss.preference import SequenceStats

    h, w = d["hidden"].clone().requires_grad_(True), d["weight"].clone().requires_grad_(True)
    logps, ref, n = _sums(d, h, w)
    loss = dpo(SequenceStats(logps=logps, ref_logps=ref, n_tokens=n))
    return (loss.detach(), *torch.autograd.grad(loss, [h, w]), ref.detach())


def _tp(d, rank, tp, sp):
    cols = slice(5 * rank, 5 * rank + 5)
    rows = slice(2 * rank, 2 * rank + 2) if sp else slice(None)
    h = d["hidden"][rows].clone().requires_grad_(True)
    w = d["weight"][cols].clone().requires_grad_(True)
    loss = linear_preference_loss(
        h, w, d["labels"], loss=dpo, ref_hidden=d["ref_hidden"][rows], ref_weight=d["ref_weight"][cols],
        token_weights=d["weights"], tp_group=tp, sequence_parallel=sp, chunk_size=5,
    )  # fmt: skip
    return (loss.detach(), *torch.autograd.grad(loss, [h, w]))


def _packed(d, ref_sums):
    """The batch packed (each sequence without its padding) and its boundaries."""
    pick = lambda t: torch.cat([t[s, : LENGTHS[s]] for s in range(S)])  # noqa: E731
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return pick(d["hidden"]), pick(d["labels"]), pick(d["weights"]), cu


def _cp(d, rank, cp, ref_sums):
    hidden, labels, weights, cu = _packed(d, ref_sums)
    split = functools.partial(lmloss.cp.split, cu_seqlens_padded=cu, cp_size=2, cp_rank=rank)
    h = split(hidden).clone().requires_grad_(True)
    w = d["weight"].clone().requires_grad_(True)
    ids = split(lmloss.packing.sequence_ids(cu))
    loss = linear_preference_loss(
        h, w, split(labels), loss=dpo, ref_logps=ref_sums, token_weights=split(weights), cu_seqlens=cu,
        sequence_ids=ids, cp_group=cp, chunk_size=3,
    )  # fmt: skip
    positions = split(torch.arange(hidden.shape[0]))
    return (loss.detach(), *torch.autograd.grad(loss, [h, w]), positions)


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type and message are what the test compares
        return type(e).__name__, str(e)
    return None


def _agreement(d, rank, group, ref_sums):
    cols = slice(5 * rank, 5 * rank + 5)
    beta = 0.1 if rank == 0 else 0.2
    tp_loss = lambda: linear_preference_loss(  # noqa: E731
        d["hidden"], d["weight"][cols], d["labels"], loss=functools.partial(dpo, beta=beta), ref_logps=ref_sums,
        tp_group=group,
    )  # fmt: skip
    weights = d["weights"] + (0.0 if rank == 0 else 1e-9)
    tp_weights = lambda: linear_preference_loss(  # noqa: E731
        d["hidden"], d["weight"][cols], d["labels"], loss=dpo, ref_logps=ref_sums, token_weights=weights,
        tp_group=group,
    )  # fmt: skip
    hidden, labels, _, cu = _packed(d, ref_sums)
    cp_loss = lambda: linear_preference_loss(  # noqa: E731
        hidden, d["weight"], labels, loss=functools.partial(dpo, beta=beta), ref_logps=ref_sums, cu_seqlens=cu,
        sequence_ids=lmloss.packing.sequence_ids(cu), cp_group=group,
    )  # fmt: skip
    return [_raised(f) for f in (tp_loss, tp_weights, cp_loss)]


def worker(rank: int, world_size: int) -> dict:
    pair = dist.new_group([0, 1])
    d = _batch()
    ref_sums = _one_process(d)[3]
    out = {"tp2": {sp: _tp(d, rank, pair, sp) for sp in (False, True)}}
    out["cp2"] = _cp(d, rank, pair, ref_sums)
    out["agree"] = _agreement(d, rank, pair, ref_sums)
    dist.barrier(group=pair)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(worker, 2)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_tensor_and_sequence_parallel_equal_one_process(results, sp):
    d = _batch()
    loss, g_hidden, g_weight, _ = _one_process(d)
    for rank, r in enumerate(results):
        got_loss, got_h, got_w = r["tp2"][sp]
        torch.testing.assert_close(got_loss, loss, **TOL)
        torch.testing.assert_close(got_w, g_weight[5 * rank : 5 * rank + 5], **TOL)
        torch.testing.assert_close(got_h, g_hidden[2 * rank : 2 * rank + 2] if sp else g_hidden, **TOL)


def test_context_parallel_shares_sum_to_the_loss_and_gradients_assemble(results):
    d = _batch()
    loss, g_hidden, g_weight, _ = _one_process(d)
    total = sum(r["cp2"][0] for r in results)
    torch.testing.assert_close(total, loss, **TOL)
    torch.testing.assert_close(sum(r["cp2"][2] for r in results), g_weight, **TOL)
    want = torch.cat([g_hidden[s, : LENGTHS[s]] for s in range(S)])
    got = torch.zeros_like(want)
    for r in results:
        got[r["cp2"][3]] = r["cp2"][1]
    torch.testing.assert_close(got, want, **TOL)


def test_ranks_that_disagree_raise_the_same_error_on_every_rank(results):
    first, second = (r["agree"] for r in results)
    assert first == second
    (tp_loss, tp_weights, cp_loss) = first
    assert tp_loss[0] == "RankAgreementError" and "beta" in tp_loss[1], tp_loss
    assert tp_weights[0] == "RankAgreementError" and "token_weights" in tp_weights[1], tp_weights
    assert cp_loss[0] == "RankAgreementError" and "beta" in cp_loss[1], cp_loss
