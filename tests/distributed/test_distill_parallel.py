"""distillation_loss / linear_distillation_loss under tensor (vocab) parallelism: TP=2, gloo, one spawn.

Student and teacher are sharded the same way over the 30 columns of the vocabulary; the true vocabulary is
smaller (padding on the last shard), and padded columns are made large so that counting them would show.

  even      15 columns per rank, vocab_size=28
  uneven    rank 0 holds [11, 30), rank 1 holds [0, 11) (out of rank order, explicit vocab_start), vocab_size=29

For each: from logits (beta 0, 0.3, 1 at temperature 0.8), from both heads (beta 0.5, with and without
sequence parallelism; the teacher's hidden size differs from the student's), and the sparse teacher (tail
on and off, logits and heads), plus the collectives each call issues over the TP group. One more check in
the same spawn: ``mean_group`` over two ranks holding different tokens, and ranks that disagree on beta.
The references (float64, unsharded, plain PyTorch) are computed in the test process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

import lmloss

WORLD = 2
COLUMNS = 30
N, CHUNK = 10, 4
# `_problem` ignores tokens 0, 3, 6 and 9: no chunk holds them, so the 6 that count make 2 chunks of 4, not 3
N_CHUNKS = 2
H_S, H_T, K = 5, 7, 3
T = 0.8
CONFIGS = {"even": (28, None), "uneven": (29, {0: (11, 19), 1: (0, 11)})}
LOGIT_BETAS = (0.0, 0.3, 1.0)


def _problem(vocab_size: int, seed: int):
    """Global student / teacher heads, their logits [N, 30] (padding columns large), labels, teacher top-k."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H_S, generator=g, dtype=torch.float64)
    weight = torch.randn(COLUMNS, H_S, generator=g, dtype=torch.float64) * 0.8
    t_hidden = torch.randn(N, H_T, generator=g, dtype=torch.float64)
    t_weight = torch.randn(COLUMNS, H_T, generator=g, dtype=torch.float64) * 0.8
    weight[vocab_size:] *= 20.0  # padding would dominate either softmax if it were counted
    t_weight[vocab_size:] *= 20.0
    labels = torch.randint(0, vocab_size, (N,), generator=g)
    labels[::3] = -100
    logprobs, ids = torch.log_softmax((t_hidden @ t_weight.T)[:, :vocab_size], -1).topk(K, dim=-1)
    return dict(hidden=hidden, weight=weight, t_hidden=t_hidden, t_weight=t_weight, labels=labels,
                ids=ids, logprobs=logprobs)  # fmt: skip


def _span(name: str, rank: int) -> tuple[int, int]:
    spans = CONFIGS[name][1]
    return spans[rank] if spans else (rank * COLUMNS // WORLD, COLUMNS // WORLD)


class _Counter:
    """Records the all_reduce / all_gather calls (op, group) made while installed."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self._orig = (dist.all_reduce, dist.all_gather)
        all_reduce, all_gather = self._orig

        def counted_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            self.calls.append(("all_reduce", "MAX" if op == dist.ReduceOp.MAX else "SUM"))
            return all_reduce(tensor, op=op, group=group, async_op=async_op)

        def counted_all_gather(tensor_list, tensor, group=None, async_op=False):
            self.calls.append(("all_gather", ""))
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)

        dist.all_reduce, dist.all_gather = counted_all_reduce, counted_all_gather

    def restore(self):
        dist.all_reduce, dist.all_gather = self._orig

    def take(self):
        calls, self.calls = self.calls, []
        return calls


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _run_config(name: str, rank: int, group, counter: _Counter) -> dict:
    vocab_size, spans = CONFIGS[name]
    p = _problem(vocab_size, seed=list(CONFIGS).index(name))
    start, size = _span(name, rank)
    cols = slice(start, start + size)
    kw = dict(
        tp_group=group, vocab_size=vocab_size, vocab_start=None if spans is None else start, chunk_size=CHUNK
    )
    student, teacher = p["hidden"] @ p["weight"].T, p["t_hidden"] @ p["t_weight"].T
    out = {}
    for beta in LOGIT_BETAS:
        x = _leaf(student[:, cols])
        counter.take()
        loss = lmloss.distillation_loss(x, teacher[:, cols], p["labels"], beta=beta, temperature=T, **kw)
        fwd = counter.take()
        loss.backward()
        out[("logits", beta)] = dict(loss=loss.detach(), grad=x.grad, fwd=fwd, bwd=counter.take())
    for sp in (False, True):
        rows = slice(rank * N // WORLD, (rank + 1) * N // WORLD) if sp else slice(None)
        h, w = _leaf(p["hidden"][rows]), _leaf(p["weight"][cols])
        loss = lmloss.linear_distillation_loss(
            h, w, p["t_hidden"][rows], p["t_weight"][cols], p["labels"], beta=0.5, temperature=T,
            sequence_parallel=sp, **kw,
        )  # fmt: skip
        fwd = counter.take()
        loss.backward()
        out[("fused", sp)] = dict(loss=loss.detach(), grads=(h.grad, w.grad), fwd=fwd, bwd=counter.take())
    for tail in (True, False):
        x = _leaf(student[:, cols])
        loss = lmloss.distillation_loss(
            x, None, p["labels"], teacher_topk=(p["ids"], p["logprobs"]), tail=tail, **kw
        )
        fwd = counter.take()
        loss.backward()
        out[("sparse", tail)] = dict(loss=loss.detach(), grad=x.grad, fwd=fwd, bwd=counter.take())
    h, w = _leaf(p["hidden"]), _leaf(p["weight"][cols])
    loss = lmloss.linear_distillation_loss(
        h, w, None, None, p["labels"], teacher_topk=(p["ids"], p["logprobs"]), **kw
    )
    loss.backward()
    out["fused_sparse"] = dict(loss=loss.detach(), grads=(h.grad, w.grad))
    counter.take()
    return out


def _rank_fn(rank: int, world: int):
    group = dist.new_group(list(range(world)))
    counter = _Counter()
    results = {}
    try:
        for name in CONFIGS:
            results[name] = _run_config(name, rank, group, counter)
    finally:
        counter.restore()
    # data parallel: each rank has its own tokens; "mean" divides by the count over mean_group
    p = _problem(30, seed=7)
    s, t = p["hidden"] @ p["weight"].T, p["t_hidden"] @ p["t_weight"].T
    rows = slice(rank * N // world, (rank + 1) * N // world)
    results["mean_group"] = lmloss.distillation_loss(
        s[rows], t[rows], p["labels"][rows], beta=0.3, mean_group=group
    )
    try:  # ranks that disagree on beta
        lmloss.distillation_loss(s[:, :15], t[:, :15], beta=0.1 * rank, tp_group=group)
        results["disagree"] = None
    except ValueError as exc:
        results["disagree"] = str(exc)
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_rank_fn, WORLD)


# ------------------------------------------------------------------------------------------------------------
# references (float64, unsharded)


def _kl(log_p, log_q):
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def _reference(student, teacher, beta, temperature):
    ls, lt = torch.log_softmax(student / temperature, -1), torch.log_softmax(teacher / temperature, -1)
    if beta == 0.0:
        return _kl(lt, ls)
    if beta == 1.0:
        return _kl(ls, lt)
    lm = torch.log((1 - beta) * ls.exp() + beta * lt.exp())
    return beta * _kl(lt, lm) + (1 - beta) * _kl(ls, lm)


def _sparse_reference(student, ids, lq, tail):
    ls = torch.log_softmax(student, -1).gather(1, ids)
    if not tail:
        return _kl(torch.log_softmax(lq, -1), torch.log_softmax(ls, -1))
    q_tail, p_tail = 1 - lq.exp().sum(-1), 1 - ls.exp().sum(-1)
    return _kl(lq, ls) + q_tail * (q_tail.log() - p_tail.log())


def _mean(per_token, labels):
    valid = labels != -100
    return per_token[valid].sum() / valid.sum()


def _padded(grad, vocab_size):
    return torch.cat([grad, torch.zeros(grad.shape[0], COLUMNS - vocab_size, dtype=grad.dtype)], 1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp2_distillation_from_logits_matches_unsharded_reference(ranks, name):
    vocab_size, _ = CONFIGS[name]
    p = _problem(vocab_size, seed=list(CONFIGS).index(name))
    for beta in LOGIT_BETAS:
        x = _leaf((p["hidden"] @ p["weight"].T)[:, :vocab_size])
        teacher = (p["t_hidden"] @ p["t_weight"].T)[:, :vocab_size]
        expected = _mean(_reference(x, teacher, beta, T), p["labels"])
        expected.backward()
        full = _padded(x.grad, vocab_size)
        for rank, res in enumerate(ranks):
            got = res[name][("logits", beta)]
            start, size = _span(name, rank)
            torch.testing.assert_close(got["loss"], expected)
            torch.testing.assert_close(got["grad"], full[:, start : start + size])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp2_distillation_issues_three_collectives_per_chunk(ranks, name):
    got = ranks[0][name][("logits", 0.3)]
    per_chunk = [
        ("all_reduce", "MAX"),
        ("all_reduce", "SUM"),
        ("all_reduce", "SUM"),
    ]
    # one all_gather: the ranks' agreement on shapes and options; then MAX + SUM of both distributions'
    # statistics and one SUM of the divergence's partial sums, per chunk; the backward reads the forward's
    # saved log-sum-exps and row sums: no collective
    assert got["fwd"] == [("all_gather", "")] + per_chunk * N_CHUNKS
    assert got["bwd"] == []
    fused = ranks[0][name][("fused", False)]
    assert fused["fwd"] == [("all_gather", "")] + per_chunk * N_CHUNKS
    assert fused["bwd"] == [("all_reduce", "SUM")]  # the student's hidden gradient


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sp"])
def test_tp2_linear_distillation_matches_unsharded_reference(ranks, name, sp):
    vocab_size, _ = CONFIGS[name]
    p = _problem(vocab_size, seed=list(CONFIGS).index(name))
    h, w = _leaf(p["hidden"]), _leaf(p["weight"][:vocab_size])
    teacher = (p["t_hidden"] @ p["t_weight"].T)[:, :vocab_size]
    expected = _mean(_reference(h @ w.T, teacher, 0.5, T), p["labels"])
    expected.backward()
    w_grad = torch.cat([w.grad, torch.zeros(COLUMNS - vocab_size, H_S, dtype=w.grad.dtype)])
    for rank, res in enumerate(ranks):
        got = res[name][("fused", sp)]
        start, size = _span(name, rank)
        rows = slice(rank * N // WORLD, (rank + 1) * N // WORLD) if sp else slice(None)
        torch.testing.assert_close(got["loss"], expected)
        torch.testing.assert_close(got["grads"][0], h.grad[rows])
        torch.testing.assert_close(got["grads"][1], w_grad[start : start + size])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp2_sparse_teacher_matches_unsharded_reference(ranks, name):
    vocab_size, _ = CONFIGS[name]
    p = _problem(vocab_size, seed=list(CONFIGS).index(name))
    valid = p["labels"] != -100
    for tail in (True, False):
        x = _leaf((p["hidden"] @ p["weight"].T)[:, :vocab_size])
        expected = _sparse_reference(x[valid], p["ids"][valid], p["logprobs"][valid], tail).mean()
        expected.backward()
        full = _padded(x.grad, vocab_size)
        for rank, res in enumerate(ranks):
            got = res[name][("sparse", tail)]
            start, size = _span(name, rank)
            torch.testing.assert_close(got["loss"], expected)
            torch.testing.assert_close(got["grad"], full[:, start : start + size])
    h, w = _leaf(p["hidden"]), _leaf(p["weight"][:vocab_size])
    expected = _sparse_reference((h @ w.T)[valid], p["ids"][valid], p["logprobs"][valid], True).mean()
    expected.backward()
    for rank, res in enumerate(ranks):
        start, size = _span(name, rank)
        got = res[name]["fused_sparse"]
        torch.testing.assert_close(got["loss"], expected)
        torch.testing.assert_close(got["grads"][0], h.grad)
        torch.testing.assert_close(got["grads"][1], _padded(w.grad.T, vocab_size).T[start : start + size])


def test_mean_group_divides_each_ranks_sum_by_the_global_count(ranks):
    p = _problem(30, seed=7)
    per_token = _reference(p["hidden"] @ p["weight"].T, p["t_hidden"] @ p["t_weight"].T, 0.3, 1.0)
    torch.testing.assert_close(ranks[0]["mean_group"] + ranks[1]["mean_group"], _mean(per_token, p["labels"]))


def test_ranks_disagreeing_on_beta_raise_on_every_rank(ranks):
    for res in ranks:
        assert res["disagree"] is not None and "disagree on beta" in res["disagree"]
