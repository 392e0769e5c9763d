"""The logits ops under tensor (vocab) parallelism, on 4 gloo ranks in one run.

One run (world size 4) hosts every check, each in its own sub-group:
  even   - TP=4, even shards (vocab_start=None): values, every rank's gradient slice, collective counts
  uneven - two TP=2 groups with uneven shards and explicit vocab_start (one of them out of rank order)
  pad    - TP=4 with embedding padding: on the last rank only, and a whole shard of padding
  dp     - TP=2 x DP=2: cross_entropy with mean_group over the DP ranks, one DP rank all-ignored
  errors - shards that don't tile, vocab_size past the columns
  invariant - invariant=True under TP=4 and two TP=2 groups (tests/distributed/invariant_support.py): every
           token's outputs the same bits as one process's, the collectives per chunk against the default's
  byproducts - the logit sum, argmax and log sum p^2 (issue #42) on the uneven groups (shards out of rank
           order, ties across shards), on TP=4 with a whole shard of padding, and invariant on TP=4
Each rank returns plain tensors; the references (fp64 log_softmax / F.cross_entropy over the unsharded
logits, or one process's invariant outputs) are computed in the test process.
"""

from __future__ import annotations

import math

import invariant_support as inv
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks

import lmloss

WORLD = 4
TOL = dict(atol=1e-5, rtol=1e-5)
SHAPE = (3, 5)  # 15 tokens; chunk 4 -> 4 chunks
CHUNK = 4
N_CHUNKS = 4
T = 0.8


def _case(seed: int, vocab: int, *, padding_from: int | None = None, shape=SHAPE):
    """Global logits [*shape, vocab] (fp32), labels with some ignored, per-token weights; same on every rank."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=g) * 3
    real = vocab if padding_from is None else padding_from
    if padding_from is not None:
        logits[..., padding_from:] = 40.0  # would dominate the softmax if the padding were counted
    labels = torch.randint(0, real, shape, generator=g)
    labels.view(-1)[::4] = -100
    w1 = torch.randn(shape, generator=g)
    w2 = torch.randn(shape, generator=g)
    return logits, labels, w1, w2


class _Counter:
    """Wraps torch.distributed collectives; records (name, op, group) per call."""

    def __init__(self):
        self.calls: list[tuple[str, str, object, int]] = []
        self._orig = {"all_reduce": dist.all_reduce, "all_gather": dist.all_gather}

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            self.calls.append(("all_reduce", str(op), group, tensor.numel() * tensor.element_size()))
            return self._orig["all_reduce"](tensor, op=op, group=group, async_op=async_op)

        def all_gather(tensor_list, tensor, group=None, async_op=False):
            self.calls.append(("all_gather", "", group, tensor.numel() * tensor.element_size()))
            return self._orig["all_gather"](tensor_list, tensor, group=group, async_op=async_op)

        dist.all_reduce, dist.all_gather = all_reduce, all_gather

    def take(self, group=None):
        """Calls since the last take (only those over `group` when given), as (name, op) pairs."""
        calls, self.calls = self.calls, []
        return [(n, o) for n, o, g, _ in calls if group is None or g is group]

    def take_bytes(self, group):
        """Calls over `group` since the last take, as (name, op, bytes each rank sends in)."""
        calls, self.calls = self.calls, []
        return [(n, o, b) for n, o, g, b in calls if g is group]


def _run_ops(x_local, labels, w1, w2, counter, group, **shard_kw):
    """logprobs+entropy, token_entropy, cross_entropy on this rank's shard; values, grad, collectives."""
    out = {}
    x = x_local.clone().requires_grad_()
    counter.take()
    logp, ent = lmloss.token_logprobs(
        x, labels, chunk_size=CHUNK, temperature=T, return_entropy=True, **shard_kw
    )
    out["fwd_logprobs_collectives"] = counter.take(group)
    ((logp * w1).sum() + (ent * w2).sum()).backward()
    out["bwd_logprobs_collectives"] = counter.take()
    out["logprobs"], out["entropy"], out["grad_logprobs_entropy"] = logp.detach(), ent.detach(), x.grad

    x = x_local.clone().requires_grad_()
    ent = lmloss.token_entropy(x, chunk_size=CHUNK, temperature=1.3, **shard_kw)
    out["fwd_entropy_collectives"] = counter.take(group)
    (ent * w1).sum().backward()
    out["bwd_entropy_collectives"] = counter.take()
    out["token_entropy"], out["grad_token_entropy"] = ent.detach(), x.grad

    x = x_local.clone().requires_grad_()
    ce = lmloss.cross_entropy(
        x, labels, chunk_size=CHUNK, label_smoothing=0.2, z_loss=1e-3, temperature=T, **shard_kw
    )
    out["fwd_ce_collectives"] = counter.take(group)
    ce.backward()
    out["bwd_ce_collectives"] = counter.take()
    out["ce"], out["grad_ce"] = ce.detach(), x.grad
    return out


def _rank_fn(rank: int, world: int):
    assert world == WORLD
    counter = _Counter()
    results = {}

    # -- even: TP=4, even shards, vocab_start=None ------------------------------------------------
    tp4 = dist.new_group([0, 1, 2, 3])
    logits, labels, w1, w2 = _case(0, 28)
    v_local = 7
    results["even"] = _run_ops(
        logits[..., rank * v_local : (rank + 1) * v_local], labels, w1, w2, counter, tp4, tp_group=tp4
    )
    # bf16 shards: fp32 math on the upcast bf16 values
    xb = logits[..., rank * v_local : (rank + 1) * v_local].bfloat16().requires_grad_()
    lpb = lmloss.token_logprobs(xb, labels, chunk_size=CHUNK, temperature=T, tp_group=tp4)
    (lpb * w1).sum().backward()
    results["even_bf16"] = {"logprobs": lpb.detach(), "grad": xb.grad}

    # -- uneven: two TP=2 groups, explicit vocab_start ------------------------------------------
    # group {0,1}: rank 0 holds [0, 7), rank 1 holds [7, 20); group {2,3}: rank 2 holds [13, 20), rank 3 [0, 13)
    g01, g23 = dist.new_group([0, 1]), dist.new_group([2, 3])
    spans = {0: (0, 7), 1: (7, 20), 2: (13, 20), 3: (0, 13)}
    group = g01 if rank < 2 else g23
    logits, labels, w1, w2 = _case(1, 20)
    s, e = spans[rank]
    counter.take()
    results["uneven"] = _run_ops(
        logits[..., s:e], labels, w1, w2, counter, group, tp_group=group, vocab_start=s
    )

    # -- pad: TP=4, V_local=6 (24 columns) ------------------------------------------------------
    for vocab_size in (21, 17):  # 21: padding on the last rank only; 17: rank 3's whole shard is padding
        logits, labels, w1, w2 = _case(2, 24, padding_from=vocab_size)
        results[f"pad{vocab_size}"] = _run_ops(
            logits[..., rank * 6 : (rank + 1) * 6],
            labels,
            w1,
            w2,
            counter,
            tp4,
            tp_group=tp4,
            vocab_size=vocab_size,
        )

    # -- dp: TP=2 x DP=2, mean over the DP ranks -------------------------------------------------
    dp = {0: dist.new_group([0, 2]), 1: dist.new_group([1, 3])}[rank % 2]
    tp = group  # {0,1} or {2,3}; DP rank = rank // 2, TP rank = rank % 2
    logits, labels, _, _ = _case(3, 16, shape=(2, 9))  # DP rank d owns token row d
    d, t = rank // 2, rank % 2
    if d == 1:
        labels[1] = -100  # this DP rank has no valid token at all
    x = logits[d, :, t * 8 : (t + 1) * 8].clone().requires_grad_()
    counter.take()
    loss = lmloss.cross_entropy(
        x, labels[d], chunk_size=CHUNK, label_smoothing=0.1, tp_group=tp, mean_group=dp
    )
    fwd_mean = counter.take(dp)
    loss.backward()
    results["dp"] = {"loss": loss.detach(), "grad": x.grad, "fwd_mean_group_collectives": fwd_mean}

    # -- errors ----------------------------------------------------------------------------------
    errors = {}
    x = torch.randn(4, 5)
    lab = torch.zeros(4, dtype=torch.long)
    cases = {
        "overlap": dict(vocab_start=0),  # both ranks of the group claim [0, 5)
        "gap": dict(vocab_start=5 * (rank % 2) + (rank % 2)),  # [0, 5) and [6, 11)
        "vocab_size_past_columns": dict(vocab_size=11),  # 10 columns over the two ranks
    }
    for name, kw in cases.items():
        try:
            lmloss.token_logprobs(x, lab, tp_group=group, **kw)
            errors[name] = None
        except Exception as exc:  # noqa: BLE001 - the test inspects type and message
            errors[name] = (type(exc).__name__, str(exc))
    results["errors"] = errors
    results["invariant"] = inv.rank_results(rank, world, counter)
    results["byproducts"] = _byproducts(rank, counter, tp4, group, spans)
    return results


BYPRODUCTS = dict(return_logit_sum=True, return_argmax=True, return_log_sum_sq_probs=True)


def _byproduct_case(seed, vocab, *, padding_from=None):
    """`_case`'s logits with ties of the row max across shards (columns 3 and 15, 8 and 16: ranks out of vocabulary
    order in the uneven groups; the lower id must win) and inside one (2 and 5)."""
    logits, labels, _, _ = _case(seed, vocab, padding_from=padding_from)
    flat = logits.view(-1, vocab)
    for row, cols in enumerate([(3, 15), (8, 16), (2, 5), (15, 3)]):
        flat[row, list(cols)] = 20.0
    return logits, labels


def _byproducts(rank, counter, tp4, group, spans):
    out = {}
    logits, labels = _byproduct_case(7, 20)
    s, e = spans[rank]
    counter.take()
    out["uneven"] = lmloss.token_logprobs(logits[..., s:e], labels, chunk_size=CHUNK, temperature=T, tp_group=group,
                                          vocab_start=s, **BYPRODUCTS)[1:]  # fmt: skip
    out["collectives"] = counter.take(group)
    out["uneven_top_k"] = lmloss.token_entropy(logits[..., s:e], chunk_size=CHUNK, temperature=T, tp_group=group,
                                               vocab_start=s, top_k=3, **BYPRODUCTS)[1:]  # fmt: skip
    logits, labels = _byproduct_case(8, 24, padding_from=17)  # rank 3's whole shard is padding
    out["pad17"] = lmloss.token_logprobs(logits[..., rank * 6 : (rank + 1) * 6], labels, chunk_size=CHUNK,
                                         temperature=T, tp_group=tp4, vocab_size=17, **BYPRODUCTS)[1:]  # fmt: skip
    g = torch.Generator().manual_seed(9)
    wide = torch.randn(6, 512, generator=g) * 3
    wide[0, [100, 300]] = 20.0  # a tie across ranks 0 and 2
    out["invariant"] = lmloss.token_entropy(wide[:, rank * 128 : (rank + 1) * 128], chunk_size=4, tp_group=tp4,
                                            invariant=True, return_logit_sum=True, return_argmax=True)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_rank_fn, WORLD)


# ------------------------------------------------------------------------------------------------------------
# references (fp64, unsharded, plain PyTorch)


def _refs(logits, labels, w1, w2, *, vocab_size=None):
    x = logits.double().requires_grad_()
    real = x[..., :vocab_size]
    valid = labels != -100
    safe = torch.where(valid, labels, 0)

    logp_all = torch.log_softmax(real / T, -1)
    logp = torch.where(valid, logp_all.gather(-1, safe[..., None]).squeeze(-1), 0.0)
    ent = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)  # an ignored token: 0, no gradient
    ((logp * w1.double()).sum() + (ent * w2.double()).sum()).backward()
    out = {"logprobs": logp.detach(), "entropy": ent.detach(), "grad_logprobs_entropy": x.grad}

    x.grad = None
    lp13 = torch.log_softmax(real / 1.3, -1)
    tent = -(lp13.exp() * lp13).sum(-1)
    (tent * w1.double()).sum().backward()
    out["token_entropy"], out["grad_token_entropy"] = tent.detach(), x.grad

    x.grad = None
    v = real.shape[-1]
    flat = (real / T).reshape(-1, v)
    per_tok = F.cross_entropy(flat, labels.reshape(-1), label_smoothing=0.2, reduction="none")
    per_tok = per_tok + 1e-3 * torch.logsumexp(flat, -1) ** 2
    ce = torch.where(valid.reshape(-1), per_tok, 0.0).sum() / valid.sum()
    ce.backward()
    out["ce"], out["grad_ce"] = ce.detach(), x.grad
    return out


def _check_against_refs(ranks, key, case_args, spans, *, vocab_size=None):
    ref = _refs(*case_args, vocab_size=vocab_size)
    for rank, (s, e) in enumerate(spans):
        got = ranks[rank][key]
        for name in ("logprobs", "entropy", "token_entropy", "ce"):
            torch.testing.assert_close(got[name].double(), ref[name], **TOL, msg=f"{key} rank {rank} {name}")
        for name in ("grad_logprobs_entropy", "grad_token_entropy", "grad_ce"):
            torch.testing.assert_close(
                got[name].double(), ref[name][..., s:e], **TOL, msg=f"{key} rank {rank} {name}"
            )


# ------------------------------------------------------------------------------------------------------------
# tests


def test_even_shards_match_the_unsharded_computation(ranks):
    _check_against_refs(ranks, "even", _case(0, 28), [(r * 7, (r + 1) * 7) for r in range(4)])


def test_every_rank_of_a_tp_group_returns_the_same_per_token_outputs(ranks):
    groups = {"even": [(0, 1, 2, 3)], "uneven": [(0, 1), (2, 3)], "pad17": [(0, 1, 2, 3)]}
    for key, key_groups in groups.items():
        for members in key_groups:
            for name in ("logprobs", "entropy", "token_entropy", "ce"):
                first = ranks[members[0]][key][name]
                assert all(torch.equal(first, ranks[r][key][name]) for r in members[1:]), (key, name)


def test_forward_uses_one_agreement_gather_then_one_max_and_one_sum_per_chunk_and_backward_none(ranks):
    per_chunk = [("all_reduce", str(dist.ReduceOp.MAX)), ("all_reduce", str(dist.ReduceOp.SUM))]
    for key in (
        "even",
        "uneven",
    ):  # the rank-agreement gather also tiles uneven shards: one gather either way
        for rank in range(4):
            got = ranks[rank][key]
            for op in ("logprobs", "entropy", "ce"):
                assert got[f"fwd_{op}_collectives"] == [("all_gather", "")] + per_chunk * N_CHUNKS, (
                    key,
                    rank,
                    op,
                )
                assert got[f"bwd_{op}_collectives"] == [], (key, rank, op)


def test_uneven_shards_with_explicit_vocab_start_match_the_unsharded_computation(ranks):
    case = _case(1, 20)
    ref = _refs(*case)
    spans = {0: (0, 7), 1: (7, 20), 2: (13, 20), 3: (0, 13)}
    for rank, (s, e) in spans.items():
        got = ranks[rank]["uneven"]
        for name in ("logprobs", "entropy", "token_entropy", "ce"):
            torch.testing.assert_close(got[name].double(), ref[name], **TOL, msg=f"rank {rank} {name}")
        for name in ("grad_logprobs_entropy", "grad_token_entropy", "grad_ce"):
            torch.testing.assert_close(
                got[name].double(), ref[name][..., s:e], **TOL, msg=f"rank {rank} {name}"
            )


def test_label_smoothing_under_tp_mixes_in_the_global_vocabulary_mean(ranks):
    # Megatron's shard-local mean would give a different value; F.cross_entropy over all 20 columns is the truth
    logits, labels, _, _ = _case(1, 20)
    x = logits.double() / T
    valid = labels != -100
    per_tok = F.cross_entropy(x.reshape(-1, 20), labels.reshape(-1), label_smoothing=0.2, reduction="none")
    per_tok = per_tok + 1e-3 * torch.logsumexp(x.reshape(-1, 20), -1) ** 2
    ref = torch.where(valid.reshape(-1), per_tok, 0.0).sum() / valid.sum()
    for rank in range(4):
        torch.testing.assert_close(ranks[rank]["uneven"]["ce"].double(), ref, **TOL)


@pytest.mark.parametrize("vocab_size", [21, 17], ids=["padding_on_last_rank", "whole_shard_is_padding"])
def test_padding_columns_are_excluded_under_tp_and_get_zero_gradient(ranks, vocab_size):
    spans = [(r * 6, (r + 1) * 6) for r in range(4)]
    _check_against_refs(
        ranks, f"pad{vocab_size}", _case(2, 24, padding_from=vocab_size), spans, vocab_size=vocab_size
    )
    for rank, (s, e) in enumerate(spans):
        pad_cols = max(0, e - max(s, vocab_size))
        for name in ("grad_logprobs_entropy", "grad_token_entropy", "grad_ce"):
            grad = ranks[rank][f"pad{vocab_size}"][name]
            assert torch.equal(grad[..., 6 - pad_cols :], torch.zeros(*SHAPE, pad_cols)), (rank, name)


def test_bf16_shards_match_fp64_reference_of_the_same_values(ranks):
    logits, labels, w1, _ = _case(0, 28)
    x = logits.bfloat16().double().requires_grad_()
    valid = labels != -100
    logp_all = torch.log_softmax(x / T, -1)
    logp = torch.where(valid, logp_all.gather(-1, torch.where(valid, labels, 0)[..., None]).squeeze(-1), 0.0)
    (logp * w1.double()).sum().backward()
    for rank in range(4):
        got = ranks[rank]["even_bf16"]
        torch.testing.assert_close(got["logprobs"].double(), logp.detach(), atol=2e-5, rtol=1e-5)
        assert got["grad"].dtype == torch.bfloat16
        # the gradient is rounded once to bf16 (8 significant bits)
        torch.testing.assert_close(
            got["grad"].double(), x.grad[..., rank * 7 : (rank + 1) * 7], atol=1e-2, rtol=1e-2
        )


def test_mean_group_shares_sum_to_the_global_mean_and_gradients_to_its_gradient(ranks):
    logits, labels, _, _ = _case(3, 16, shape=(2, 9))
    labels[1] = -100
    x = logits.double().requires_grad_()
    ref = F.cross_entropy(x.reshape(-1, 16), labels.reshape(-1), label_smoothing=0.1)
    ref.backward()
    for t in (0, 1):  # per TP rank: the DP ranks' shares add up to the global mean
        shares = [ranks[d * 2 + t]["dp"]["loss"] for d in (0, 1)]
        assert shares[1].item() == 0.0  # DP rank 1 has no valid token
        torch.testing.assert_close(sum(shares).double(), ref.detach(), **TOL)
    for rank in range(4):
        d, t = rank // 2, rank % 2
        got = ranks[rank]["dp"]
        torch.testing.assert_close(got["grad"].double(), x.grad[d, :, t * 8 : (t + 1) * 8], **TOL)
        assert got["fwd_mean_group_collectives"] == [("all_reduce", str(dist.ReduceOp.SUM))]


@pytest.mark.parametrize("case", ["overlap", "gap", "vocab_size_past_columns"])
def test_bad_shards_raise_value_error_on_every_rank(ranks, case):
    word = "vocab_size" if case == "vocab_size_past_columns" else "vocab"
    for rank in range(4):
        err = ranks[rank]["errors"][case]
        assert err is not None, f"rank {rank} accepted {case}"
        assert err[0] == "ValueError" and word in err[1], err


# ------------------------------------------------------------------------------------------------------------
# invariant=True (docs/invariant.md): TP 1, 2 and 4 give every token the same bits


@pytest.fixture(scope="module")
def one_process_invariant():
    return inv.one_process()


def _same(got, expected, what):
    got, expected = (got, expected) if isinstance(got, tuple) else ((got,), (expected,))
    for g, e in zip(got, expected):
        assert torch.equal(g, e), what


@pytest.mark.parametrize("tp", [2, 4])
def test_invariant_outputs_are_the_same_bits_for_tp_1_2_and_4(ranks, one_process_invariant, tp):
    for rank, got in enumerate(ranks):
        mine = got["invariant"][tp]
        for case, expected in one_process_invariant.items():
            if case == "grad":  # this rank's columns of each row's gradient
                _same(mine[case], inv.cols(expected, rank % tp, tp), (tp, rank, case))
            else:
                _same(mine[case], expected, (tp, rank, case))
        _same(mine["fused_sp"], one_process_invariant["fused"], (tp, rank, "sequence parallel"))


def test_invariant_one_process_outputs_are_the_float64_math(one_process_invariant):
    got, d = one_process_invariant, inv.data()
    y = d["logits"].double()[:, : inv.VOCAB] / inv.T
    logp = y.log_softmax(-1)
    valid = d["labels"] != -100
    lp = torch.where(valid, logp.gather(1, d["labels"].clamp(min=0)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(got["logprobs"].double(), lp, rtol=1e-5, atol=2e-5)
    entropy = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    torch.testing.assert_close(got["entropy"].double(), entropy, rtol=1e-5, atol=2e-5)
    z = torch.addmm(d["bias"].double(), d["hidden"].double(), d["weight"].double().T)[:, : inv.VOCAB] / inv.T
    fused = z.log_softmax(-1)
    torch.testing.assert_close(got["fused"][0].double(),
                               torch.where(valid, fused.gather(1, d["labels"].clamp(min=0)[:, None])[:, 0], 0.0),
                               rtol=1e-5, atol=2e-5)  # fmt: skip
    kept = torch.zeros_like(y, dtype=torch.bool).scatter_(1, d["support"], True)
    replay = d["logits"].double()[:, : inv.VOCAB].masked_fill(~kept, -math.inf).log_softmax(-1)
    torch.testing.assert_close(got["support"][0].double(), replay.gather(1, d["top_labels"][:, None])[:, 0],
                               rtol=1e-5, atol=2e-5)  # fmt: skip


def test_invariant_collectives_per_chunk_are_a_max_and_a_sum_of_at_most_twice_the_defaults_bytes(ranks):
    """Per chunk, after the agreement gather, the default sends a MAX of the row maxima and a SUM of four fp32
    partials; the invariant mode a MAX and a SUM of int64 words (entropy and label smoothing add a word each,
    label smoothing a second MAX value)."""
    n_chunks = 4
    for got in ranks:
        per = got["invariant"]["collectives"]
        for name in inv.COLLECTIVE_CASES:
            default, invariant = per[(name, False)], per[(name, True)]
            assert default[0][0] == invariant[0][0] == "all_gather"  # the rank agreement, once per call
            default, invariant = default[1:], invariant[1:]
            assert [c[:2] for c in invariant] == [c[:2] for c in default], name
            assert len(default) == 2 * n_chunks
            ratio = sum(c[2] for c in invariant) / sum(c[2] for c in default)
            assert ratio <= {"logprobs": 1.0, "logprobs_entropy": 1.4, "ce_smoothing": 2.0}[name], (name, ratio)


def test_invariant_refuses_a_shard_that_starts_inside_a_block_on_every_rank(ranks):
    for got in ranks:
        message = got["invariant"]["misaligned"]
        assert message is not None and "start at a multiple of 128 columns" in message
        assert "[0, 100, 200, 300]" in message


# ------------------------------------------------------------------------------------------------------------
# the by-products (issue #42): float64 references of the whole logits


def _byproduct_refs(logits, labels, *, vocab_size=None, top_k=None):
    z = logits.double()[..., :vocab_size] / T
    if top_k is not None:
        z = torch.where(z >= z.topk(top_k, dim=-1).values[..., -1:], z, -math.inf)
    ids = torch.arange(z.shape[-1])
    top = torch.where(z == z.amax(-1, keepdim=True), ids, z.shape[-1]).amin(-1)  # the lowest id of the max
    total = torch.where(torch.isfinite(z), z, 0.0).sum(-1)
    lsq = torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1)
    valid = labels != -100
    return torch.where(valid, total, 0.0), torch.where(valid, top, -1), torch.where(valid, lsq, 0.0)


def _check_byproducts(got, want):
    total, top, lsq = got
    assert torch.equal(top, want[1])
    torch.testing.assert_close(total.double(), want[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(lsq.double(), want[2], rtol=1e-5, atol=1e-5)


def test_byproducts_under_tp_match_float64_with_the_lowest_id_on_ties_across_shards(ranks):
    """Uneven shards (one group out of rank order), a whole shard of padding, top_k: every rank the float64
    values; the argmax's tie across two ranks goes to the lower id whichever rank holds it. Per chunk the forward
    still makes one MAX and one SUM (the argmax rides in both)."""
    logits, labels = _byproduct_case(7, 20)
    want = _byproduct_refs(logits, labels)
    assert want[1].view(-1)[[0, 1, 2, 3]].tolist() == [-1 if labels.view(-1)[0] == -100 else 3, 8, 2, 3]
    pad_logits, pad_labels = _byproduct_case(8, 24, padding_from=17)
    pad = _byproduct_refs(pad_logits, pad_labels, vocab_size=17)
    kept = _byproduct_refs(logits, torch.zeros_like(labels), top_k=3)
    for got in ranks:
        mine = got["byproducts"]
        _check_byproducts(mine["uneven"], want)
        _check_byproducts(mine["pad17"], pad)
        _check_byproducts(mine["uneven_top_k"], kept)
        ops = [(name, op.split(".")[-1]) for name, op in mine["collectives"]]
        assert ops == [("all_gather", "")] + [("all_reduce", "MAX"), ("all_reduce", "SUM")] * N_CHUNKS


def test_invariant_byproducts_under_tp4_are_one_process_bits(ranks):
    g = torch.Generator().manual_seed(9)
    wide = torch.randn(6, 512, generator=g) * 3
    wide[0, [100, 300]] = 20.0
    one = lmloss.token_entropy(wide, chunk_size=None, invariant=True, return_logit_sum=True, return_argmax=True)
    assert one[2][0] == 100 and torch.equal(one[2], wide.argmax(-1))
    for got in ranks:
        assert all(torch.equal(a, b) for a, b in zip(got["byproducts"]["invariant"], one))
