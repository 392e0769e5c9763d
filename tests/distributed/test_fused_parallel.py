"""linear_token_logprobs / linear_cross_entropy under tensor (vocab) parallelism, 4 gloo ranks, one spawn.

The LM-head weight [36, H] and bias [36] are vocab-sharded over a TP group; the true vocabulary is smaller
than the 36 columns (padding on the last shard), and padded weight rows are made large so that counting
them would show. Configurations, all in the one run:

  tp2_even      two TP=2 groups {0,1} and {2,3}, 18 columns each, vocab_size=33
  tp4_even      TP=4, 9 columns each, vocab_size=31
  tp4_uneven    TP=4, uneven shards out of rank order with explicit vocab_start, vocab_size=33
  tp4_pad_shard TP=4, 9 columns each, vocab_size=27: rank 3's whole shard is padding

each with ``sequence_parallel=False`` (every rank holds all 16 tokens; hidden [4, 4, H]) and ``True`` (rank r
of the group holds token rows [r*n, (r+1)*n) along dim 0; labels are the full gathered [4, 4]). Each rank
returns plain tensors and the collectives it issued; the references (fp64 log_softmax / logsumexp over
the unsharded logits, autograd for the gradients) are computed in the test process.

Collectives observed per call (chunk_size=4 -> 4 chunks), over the TP group:
  forward:  all_reduce MAX + all_reduce SUM per chunk (2 per chunk); one all_gather of (start, size) when
            vocab_start is explicit; one all_gather of the hidden rows with sequence parallelism.
  backward: one all_reduce SUM of the hidden gradient (with sequence parallelism on gloo this is the
            reduce-scatter, done as all_reduce + slice); nothing else.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

import lmloss

WORLD = 4
H = 8
COLUMNS = 36
SHAPE = (4, 4)  # 16 tokens
CHUNK = 4
N_CHUNKS = 3  # `_problem` ignores every 5th of the 16 tokens: no chunk holds them, the 12 others make 3
T = 0.8
SMOOTHING, Z_LOSS = 0.1, 1e-3
TOL = dict(atol=1e-5, rtol=1e-5)

CONFIGS = {
    # name: (tp size, vocab_size, {tp rank: (start, size)} or None for even shards)
    "tp2_even": (2, 33, None),
    "tp4_even": (4, 31, None),
    "tp4_uneven": (4, 33, {0: (20, 10), 1: (0, 7), 2: (7, 13), 3: (30, 6)}),
    "tp4_pad_shard": (4, 27, None),
}
KEYS = [(name, sp) for name in CONFIGS for sp in (False, True)]
KEY_IDS = [f"{name}-{'sp' if sp else 'replicated'}" for name, sp in KEYS]


def _problem(vocab_size: int, seed: int):
    """Global hidden [4, 4, H], weight [36, H], bias [36], labels [4, 4] (every 5th ignored), adv, ent_w."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*SHAPE, H, generator=g)
    weight = torch.randn(COLUMNS, H, generator=g) * (2.0 / H**0.5)
    weight[vocab_size:] *= 10.0  # padding would dominate the softmax if it were counted
    bias = torch.randn(COLUMNS, generator=g)
    labels = torch.randint(0, vocab_size, SHAPE, generator=g)
    labels.view(-1)[::5] = -100
    adv = torch.randn(SHAPE, generator=g)
    ent_w = torch.randn(SHAPE, generator=g)
    return hidden, weight, bias, labels, adv, ent_w


def _span(name: str, tp_rank: int) -> tuple[int, int]:
    tp, _, spans = CONFIGS[name]
    if spans is not None:
        return spans[tp_rank]
    size = COLUMNS // tp
    return tp_rank * size, size


class _Counter:
    """Wraps the torch.distributed collectives; records (name, op) per call over the group of interest."""

    def __init__(self):
        self.calls: list[tuple[str, str, object]] = []
        self._orig = (dist.all_reduce, dist.all_gather, dist.reduce_scatter_tensor)
        all_reduce, all_gather, reduce_scatter_tensor = self._orig

        def counted_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            self.calls.append(("all_reduce", str(op), group))
            return all_reduce(tensor, op=op, group=group, async_op=async_op)

        def counted_all_gather(tensor_list, tensor, group=None, async_op=False):
            self.calls.append(("all_gather", "", group))
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)

        def counted_reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            self.calls.append(("reduce_scatter", str(op), group))
            return reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)

        dist.all_reduce, dist.all_gather = counted_all_reduce, counted_all_gather
        dist.reduce_scatter_tensor = counted_reduce_scatter

    def restore(self):
        dist.all_reduce, dist.all_gather, dist.reduce_scatter_tensor = self._orig

    def take(self):
        """Calls since the last take as (name, op, over_the_tp_group) triples."""
        calls, self.calls = self.calls, []
        return calls


def _run_config(name, sp, group, counter):
    tp, vocab_size, spans = CONFIGS[name]
    tp_rank = dist.get_rank(group)
    hidden, weight, bias, labels, adv, ent_w = _problem(vocab_size, seed=list(CONFIGS).index(name))
    start, size = _span(name, tp_rank)
    w_local, b_local = weight[start : start + size], bias[start : start + size]
    if sp:
        rows = SHAPE[0] // tp
        h_local = hidden[tp_rank * rows : (tp_rank + 1) * rows]
    else:
        h_local = hidden
    kw = dict(
        chunk_size=CHUNK,
        temperature=T,
        vocab_size=vocab_size,
        tp_group=group,
        vocab_start=None if spans is None else start,
        sequence_parallel=sp,
    )

    def tagged(calls):
        return [(n, op) for n, op, g in calls if g is group]

    out = {}
    # per-token outputs with RL-style upstream gradients (recompute path)
    h, w, b = (t.clone().requires_grad_() for t in (h_local, w_local, b_local))
    counter.take()
    logp, ent = lmloss.linear_token_logprobs(h, w, labels, bias=b, return_entropy=True, **kw)
    fwd = counter.take()
    ((logp * adv).sum() + (ent * ent_w).sum()).backward()
    bwd = counter.take()
    out["logprobs"] = {
        "logprobs": logp.detach(),
        "entropy": ent.detach(),
        "grads": (h.grad, w.grad, b.grad),
        "fwd": tagged(fwd),
        "bwd": tagged(bwd),
        "other_groups": len(fwd) + len(bwd) - len(tagged(fwd)) - len(tagged(bwd)),
    }

    # mean cross-entropy (gradients computed in the forward)
    h, w, b = (t.clone().requires_grad_() for t in (h_local, w_local, b_local))
    loss = lmloss.linear_cross_entropy(h, w, labels, bias=b, label_smoothing=SMOOTHING, z_loss=Z_LOSS, **kw)
    fwd = counter.take()
    loss.backward()
    bwd = counter.take()
    out["ce"] = {
        "loss": loss.detach(),
        "grads": (h.grad, w.grad, b.grad),
        "fwd": tagged(fwd),
        "bwd": tagged(bwd),
        "other_groups": len(fwd) + len(bwd) - len(tagged(fwd)) - len(tagged(bwd)),
    }

    # bf16, within a budget below even this tiny head's fp32 weight-gradient accumulator (the weight pass;
    # chunks of CHUNK tokens, which the budget then does not size: "auto" refuses a budget below chunks of 8)
    # and within the default one (the accumulator): the same gradients, the same collectives
    for budget in (LEAN_BUDGET_MIB, None):
        h, w, b = (t.bfloat16().requires_grad_() for t in (h_local, w_local, b_local))
        counter.take()
        chunk = CHUNK if budget else "auto"
        logp, ent = lmloss.linear_token_logprobs(h, w, labels, bias=b, return_entropy=True, memory_budget_mib=budget,
                                                 **{**kw, "chunk_size": chunk})  # fmt: skip
        ((logp * adv).sum() + (ent * ent_w).sum()).backward()
        loss = lmloss.linear_cross_entropy(h, w, labels, bias=b, memory_budget_mib=budget, **{**kw, "chunk_size": chunk})
        loss.backward()
        out[("bf16", budget)] = {"grads": (h.grad, w.grad, b.grad), "calls": tagged(counter.take())}
    return out


def _peak_within_budget(group, sp: bool) -> tuple[float, float, int]:
    """(peak MiB above this rank's inputs and gradients within `BUDGET_MIB`, the same within the default
    budget, the tokens) for the mean cross-entropy and its backward of a 256 x 256 x 4000 bf16 head over TP=2 (a
    hidden width at which the gathered rows of sequence parallelism, 128 KiB, pass the per-token slack)."""
    from lmloss.profiling import peak_memory

    n, h, v = 256, PEAK_HIDDEN, 4000
    g = torch.Generator().manual_seed(21)
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) * h**-0.5).bfloat16()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[: n // 4] = -100
    tp_rank, half = dist.get_rank(group), v // 2
    rows = slice(tp_rank * n // 2, (tp_rank + 1) * n // 2) if sp else slice(None)
    peaks = []
    for budget in (BUDGET_MIB, None):
        x = hidden[rows].clone().requires_grad_()
        w = weight[tp_rank * half : (tp_rank + 1) * half].clone().requires_grad_()
        with peak_memory() as mem:
            lmloss.linear_cross_entropy(x, w, labels, tp_group=group, sequence_parallel=sp,
                                        memory_budget_mib=budget).backward()  # fmt: skip
        grads = x.grad.numel() * 2 + w.grad.numel() * 2
        peaks.append((mem.peak_bytes - grads) / 2**20)
    return peaks[0], peaks[1], n


PEAK_HIDDEN = 256
BUDGET_MIB = 0.6  # 30% of this rank's fp32 weight-gradient accumulator (2000 x 256 x 4 bytes)
LEAN_BUDGET_MIB = 2e-4  # 210 bytes: less than any rank's fp32 [V_local, 8] accumulator (at least 192 + 36 rows)


def _rank_fn(rank: int, world: int):
    assert world == WORLD
    tp2 = {0: dist.new_group([0, 1]), 1: dist.new_group([2, 3])}[rank // 2]
    tp4 = dist.new_group([0, 1, 2, 3])
    counter = _Counter()
    results = {}
    try:
        for name, sp in KEYS:
            group = tp2 if CONFIGS[name][0] == 2 else tp4
            results[(name, sp)] = _run_config(name, sp, group, counter)
        for sp in (False, True):
            results[("peak", sp)] = _peak_within_budget(tp2, sp)

        # sequence parallelism: labels must be the gathered tokens, not this rank's block
        h_local = torch.randn(2, 4, H)
        w_local = torch.randn(COLUMNS // 2, H)
        try:
            lmloss.linear_token_logprobs(
                h_local, w_local, torch.zeros(2, 4, dtype=torch.long), tp_group=tp2, sequence_parallel=True
            )
            results["sp_local_labels"] = None
        except Exception as exc:  # noqa: BLE001 - the test inspects type and message
            results["sp_local_labels"] = (isinstance(exc, ValueError), str(exc))
    finally:
        counter.restore()
    return results


@pytest.fixture(scope="module")
def ranks():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the references below are tiny; the ranks set their own
    yield run_ranks(_rank_fn, WORLD)
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------------------
# references (fp64, unsharded, plain PyTorch)


def _reference(name: str):
    _, vocab_size, _ = CONFIGS[name]
    hidden, weight, bias, labels, adv, ent_w = _problem(vocab_size, seed=list(CONFIGS).index(name))
    valid = labels != -100
    safe = torch.where(valid, labels, 0)

    def leaves():
        return [t.double().requires_grad_() for t in (hidden, weight, bias)]

    def scaled_logits(h, w, b):
        return ((h @ w.T + b) / T)[..., :vocab_size]

    ref = {}
    h, w, b = leaves()
    logp_all = torch.log_softmax(scaled_logits(h, w, b), -1)
    logp = torch.where(valid, logp_all.gather(-1, safe[..., None]).squeeze(-1), 0.0)
    ent = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)  # an ignored token: 0, no gradient
    ((logp * adv.double()).sum() + (ent * ent_w.double()).sum()).backward()
    ref["logprobs"] = {"logprobs": logp.detach(), "entropy": ent.detach(), "grads": (h.grad, w.grad, b.grad)}

    h, w, b = leaves()
    x = scaled_logits(h, w, b)
    logp_all = torch.log_softmax(x, -1)
    nll = -logp_all.gather(-1, safe[..., None]).squeeze(-1)
    per_token = (1 - SMOOTHING) * nll + SMOOTHING * -logp_all.mean(-1) + Z_LOSS * torch.logsumexp(x, -1) ** 2
    loss = torch.where(valid, per_token, 0.0).sum() / valid.sum()
    loss.backward()
    ref["ce"] = {"loss": loss.detach(), "grads": (h.grad, w.grad, b.grad)}
    return ref


def _members(name: str, rank: int) -> tuple[int, int]:
    """(tp rank, tp size) of a global rank in the configuration's group."""
    tp = CONFIGS[name][0]
    return rank % tp, tp


# ------------------------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize(("name", "sp"), KEYS, ids=KEY_IDS)
def test_values_on_every_rank_equal_the_single_process_reference(ranks, name, sp):
    ref = _reference(name)
    ignored = _problem(CONFIGS[name][1], seed=list(CONFIGS).index(name))[3] == -100
    for rank in range(WORLD):
        got = ranks[rank][(name, sp)]
        assert torch.all(got["logprobs"]["logprobs"][ignored] == 0.0), rank
        for op, outputs in (("logprobs", ("logprobs", "entropy")), ("ce", ("loss",))):
            for out in outputs:
                torch.testing.assert_close(
                    got[op][out].double(), ref[op][out], **TOL, msg=f"rank {rank} {op}/{out}"
                )


@pytest.mark.parametrize(("name", "sp"), KEYS, ids=KEY_IDS)
def test_hidden_grad_is_the_full_reference_replicated_or_own_rows_with_sequence_parallel(ranks, name, sp):
    ref = _reference(name)
    for rank in range(WORLD):
        tp_rank, tp = _members(name, rank)
        for op in ("logprobs", "ce"):
            expected = ref[op]["grads"][0]
            if sp:
                rows = SHAPE[0] // tp
                expected = expected[tp_rank * rows : (tp_rank + 1) * rows]
            got = ranks[rank][(name, sp)][op]["grads"][0]
            assert got.shape == expected.shape, (rank, op)
            torch.testing.assert_close(got.double(), expected, **TOL, msg=f"rank {rank} {op} hidden.grad")


@pytest.mark.parametrize(("name", "sp"), KEYS, ids=KEY_IDS)
def test_weight_and_bias_grads_are_each_ranks_slice_with_zero_padding_rows(ranks, name, sp):
    ref = _reference(name)
    vocab_size = CONFIGS[name][1]
    for rank in range(WORLD):
        tp_rank, _ = _members(name, rank)
        start, size = _span(name, tp_rank)
        for op in ("logprobs", "ce"):
            _, gw, gb = ranks[rank][(name, sp)][op]["grads"]
            _, rw, rb = ref[op]["grads"]
            torch.testing.assert_close(
                gw.double(), rw[start : start + size], **TOL, msg=f"rank {rank} {op} w"
            )
            torch.testing.assert_close(
                gb.double(), rb[start : start + size], **TOL, msg=f"rank {rank} {op} b"
            )
            pad = max(0, start + size - max(start, vocab_size))  # padded local rows are a suffix
            assert torch.all(gw[size - pad :] == 0) and torch.all(gb[size - pad :] == 0), (rank, op)


@pytest.mark.parametrize(("name", "sp"), KEYS, ids=KEY_IDS)
def test_forward_uses_two_all_reduce_per_chunk_and_backward_one_hidden_grad_reduction(ranks, name, sp):
    per_chunk = [("all_reduce", str(dist.ReduceOp.MAX)), ("all_reduce", str(dist.ReduceOp.SUM))]
    for rank in range(WORLD):
        for op in ("logprobs", "ce"):
            got = ranks[rank][(name, sp)][op]
            fwd_reduces = [c for c in got["fwd"] if c[0] == "all_reduce"]
            fwd_gathers = [c for c in got["fwd"] if c[0] == "all_gather"]
            assert fwd_reduces == per_chunk * N_CHUNKS, (rank, op, got["fwd"])  # <= 2 per chunk
            # one rank-agreement gather per call (it also tiles uneven shards), one more for SP's rows
            assert len(fwd_gathers) == 1 + int(sp), (rank, op, got["fwd"])
            assert len(got["fwd"]) == len(fwd_reduces) + len(fwd_gathers), (rank, op, got["fwd"])
            # the hidden gradient's sum over the TP group (a reduce-scatter with sequence parallelism,
            # emulated on gloo by an all_reduce and a slice)
            assert got["bwd"] == [("all_reduce", str(dist.ReduceOp.SUM))], (rank, op, got["bwd"])
            assert got["other_groups"] == 0, (rank, op)


def test_every_rank_of_a_group_returns_identical_outputs(ranks):
    for name, sp in KEYS:
        tp = CONFIGS[name][0]
        for first in range(0, WORLD, tp):
            for rank in range(first + 1, first + tp):
                a, b = ranks[first][(name, sp)], ranks[rank][(name, sp)]
                assert torch.equal(a["logprobs"]["logprobs"], b["logprobs"]["logprobs"]), (name, sp, rank)
                assert torch.equal(a["logprobs"]["entropy"], b["logprobs"]["entropy"]), (name, sp, rank)
                assert torch.equal(a["ce"]["loss"], b["ce"]["loss"]), (name, sp, rank)


@pytest.mark.parametrize(("name", "sp"), KEYS, ids=KEY_IDS)
def test_the_weight_pass_under_tp_gives_every_rank_the_gradients_of_the_accumulator(ranks, name, sp):
    """Within a budget that no weight-gradient accumulator fits, each rank's weight pass over its shard
    gives the gradients the accumulator gives (both summed in fp32, rounded once to bf16), and issues the
    same collectives: the weight pass has none."""
    for rank in range(WORLD):
        got = ranks[rank][(name, sp)]
        lean, roomy = got[("bf16", LEAN_BUDGET_MIB)], got[("bf16", None)]
        for a, b in zip(lean["grads"], roomy["grads"]):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2, msg=f"{name} {sp} rank {rank}")
        assert len(lean["calls"]) >= len(roomy["calls"])  # more, smaller chunks: more of the same per chunk
        assert {c for c in lean["calls"]} == {c for c in roomy["calls"]}, (rank, lean["calls"], roomy["calls"])


@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sp"])
def test_every_tp_rank_stays_within_a_budget_below_its_weight_gradient_accumulator(ranks, sp):
    """What a rank holds beyond its inputs and gradients, with and without sequence parallelism: within
    the budget (the fp32 sum of the hidden gradient over TP, or the gathered hidden rows, included), plus
    O(N) vectors; the default budget keeps the 1.95 MiB accumulator."""
    for rank in range(WORLD):
        lean, roomy, n = ranks[rank][("peak", sp)]
        assert lean <= BUDGET_MIB + 64 * n / 2**20, (rank, lean)
        assert roomy >= 2000 * PEAK_HIDDEN * 4 / 2**20, (rank, roomy)


def test_sequence_parallel_labels_must_cover_the_gathered_tokens(ranks):
    for rank in range(WORLD):
        err = ranks[rank]["sp_local_labels"]
        assert err is not None and err[0], (rank, err)  # a ValueError, the same on every rank
        assert "(4, 4)" in err[1], err[1]  # the gathered leading shape it expected
    assert ranks[0]["sp_local_labels"] == ranks[1]["sp_local_labels"]
