"""``invariant=True`` under tensor parallelism: 4 gloo ranks in one spawned run make TP=4 (one group) and TP=2
(two groups, with other chunk sizes), each rank on one intra-op thread; the test process computes TP=1 (its own
thread count). Every token's outputs are the same bits (`torch.equal`) for TP 1, 2 and 4, and sequence
parallelism: from logits (log-probs, entropy, per-token cross-entropy with label smoothing and z-loss, top-p and
its kept mass, a replayed support, both implementations), fused (bias, temperature, bf16), and each rank's
columns of a row's logits gradient. The vocabulary is padded as Megatron pads it (1000 ids in 1024 columns:
shards of 512 and 256, multiples of 128). A shard that does not start on a block raises on every rank.
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

WORLD = 4
N, H, COLS, VOCAB, T = 96, 16, 1024, 1000, 0.8
TRITON = lmloss.kernels.triton_available()
#: The fused heads' GEMM tile here: narrower than one process's 1024 columns and TP=2's 512 (tiles overlapping
#: at the end), wider than TP=4's 256 (zero-padded), as the CPU's 128 x 4096 meets real vocabularies.
GEMM_TILE = (128, 384)


def _data():
    g = torch.Generator().manual_seed(21)
    d = dict(
        hidden=torch.randn(N, H, generator=g),
        weight=torch.randn(COLS, H, generator=g) / 2,
        bias=torch.randn(COLS, generator=g) * 0.1,
        up=torch.randn(N, generator=g),
    )
    d["logits"] = torch.addmm(d["bias"], d["hidden"], d["weight"].T).double().mul(2).float()
    d["labels"] = torch.randint(0, VOCAB, (N,), generator=g)
    d["labels"][::11] = -100
    d["top_labels"] = d["logits"][:, :VOCAB].argmax(-1)
    d["support"] = d["logits"][:, :VOCAB].topk(20, -1).indices
    return d


def _cols(t, rank, tp):
    """Rank `rank`'s shard of the last dimension (even shards of COLS) under a TP degree of `tp`."""
    width = COLS // tp
    return t[..., rank * width : (rank + 1) * width]


def _cases(d, rank, tp, group, chunk):
    """Every case's per-token outputs for this rank (TP degree `tp`, `group`; tp 1: the whole vocabulary)."""
    lmloss.chunks.INVARIANT_GEMM_TILE["cpu"] = GEMM_TILE
    out = {}
    common = dict(vocab_size=VOCAB, tp_group=group, invariant=True, chunk_size=chunk)
    x = _cols(d["logits"], rank, tp)
    xg = x.clone().requires_grad_()
    lp, ent = lmloss.token_logprobs(xg, d["labels"], return_entropy=True, temperature=T, **common)
    ((lp * d["up"]).sum() + 0.1 * ent.sum()).backward()
    out["logprobs"], out["entropy"], out["grad"] = lp, ent, xg.grad
    out["ce"] = lmloss.cross_entropy(x, d["labels"], reduction="none", label_smoothing=0.1, z_loss=1e-3, softcap=6.0,
                                     **common)  # fmt: skip
    out["bf16"] = lmloss.token_logprobs(x.bfloat16(), d["labels"], return_entropy=True, **common)
    out["top_p"] = lmloss.token_logprobs(x, d["top_labels"], top_p=0.85, return_entropy=True,
                                         return_log_kept_mass=True, **common)  # fmt: skip
    out["support"] = lmloss.token_logprobs(x, d["top_labels"], support=d["support"], return_entropy=True,
                                           return_log_kept_mass=True, **common)  # fmt: skip
    w, b = d["weight"][rank * (COLS // tp) : (rank + 1) * (COLS // tp)], _cols(d["bias"], rank, tp)
    out["fused"] = lmloss.linear_token_logprobs(d["hidden"], w, d["labels"], bias=b, return_entropy=True,
                                                temperature=T, **common)  # fmt: skip
    out["fused_bf16"] = lmloss.linear_cross_entropy(d["hidden"].bfloat16(), w.bfloat16(), d["labels"],
                                                    reduction="none", **common)  # fmt: skip
    if tp > 1:  # sequence parallelism: this rank's block of tokens; the op gathers them over the group
        rows = d["hidden"].view(tp, N // tp, H)[rank]
        out["fused_sp"] = lmloss.linear_token_logprobs(rows, w, d["labels"], bias=b, return_entropy=True,
                                                       temperature=T, sequence_parallel=True, **common)  # fmt: skip
    if TRITON:
        out["triton"] = lmloss.token_logprobs(x[:6], d["labels"][:6], return_entropy=True, impl="triton",
                                              temperature=T, **common)  # fmt: skip
    return out


def _ranks(rank, world):
    tp4 = dist.new_group(list(range(world)))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    d = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sampling.KeptSetWarning)
        out = {4: _cases(d, rank, 4, tp4, "auto"), 2: _cases(d, rank % 2, 2, pairs[rank // 2], [5, 64][rank // 2])}
    try:  # shards of 100 columns: rank 1's starts at column 100, inside a block
        lmloss.token_logprobs(torch.zeros(2, 100), torch.zeros(2, dtype=torch.long), tp_group=tp4, invariant=True)
        out["misaligned"] = None
    except lmloss.vocab_parallel.RankAgreementError as error:
        out["misaligned"] = str(error)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_ranks, WORLD)


@pytest.fixture(scope="module")
def one_process():
    tile = lmloss.chunks.INVARIANT_GEMM_TILE["cpu"]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sampling.KeptSetWarning)
            return _cases(_data(), 0, 1, None, 7)
    finally:
        lmloss.chunks.INVARIANT_GEMM_TILE["cpu"] = tile


def _same(got, expected, what):
    got, expected = (got, expected) if isinstance(got, tuple) else ((got,), (expected,))
    for g, e in zip(got, expected):
        assert torch.equal(g, e), what


@pytest.mark.parametrize("tp", [2, 4])
def test_every_tokens_outputs_are_the_same_bits_for_tp_1_2_and_4(ranks, one_process, tp):
    for rank, got in enumerate(ranks):
        mine = got[tp]
        for case, expected in one_process.items():
            if case == "grad":  # this rank's columns of each row's gradient
                _same(mine[case], _cols(expected, rank % tp, tp), (tp, rank, case))
            else:
                _same(mine[case], expected, (tp, rank, case))
        if tp > 1:
            _same(mine["fused_sp"], one_process["fused"], (tp, rank, "sequence parallel"))


def test_the_tp1_outputs_are_the_float64_math(one_process):
    d = _data()
    y = d["logits"].double()[:, :VOCAB] / T
    logp = y.log_softmax(-1)
    valid = d["labels"] != -100
    lp = torch.where(valid, logp.gather(1, d["labels"].clamp(min=0)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(one_process["logprobs"].double(), lp, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(one_process["entropy"].double(), -(logp.exp() * logp).sum(-1), rtol=1e-5, atol=2e-5)
    z = torch.addmm(d["bias"].double(), d["hidden"].double(), d["weight"].double().T)[:, :VOCAB] / T
    fused = z.log_softmax(-1)
    torch.testing.assert_close(one_process["fused"][0].double(),
                               torch.where(valid, fused.gather(1, d["labels"].clamp(min=0)[:, None])[:, 0], 0.0),
                               rtol=1e-5, atol=2e-5)  # fmt: skip
    kept = torch.zeros_like(y, dtype=torch.bool).scatter_(1, d["support"], True)
    replay = d["logits"].double()[:, :VOCAB].masked_fill(~kept, -math.inf).log_softmax(-1)
    torch.testing.assert_close(one_process["support"][0].double(), replay.gather(1, d["top_labels"][:, None])[:, 0],
                               rtol=1e-5, atol=2e-5)  # fmt: skip


def test_a_shard_that_starts_inside_a_block_raises_on_every_rank(ranks):
    for got in ranks:
        assert got["misaligned"] is not None
        assert "start at a multiple of 128 columns" in got["misaligned"]
        assert "[0, 100, 200, 300]" in got["misaligned"]
