"""``invariant=True`` under tensor parallelism: what each rank of test_vocab_parallel's run computes
(its tests compare it with one process, `one_process`). TP=4 (one group) and TP=2 (two groups, with other
chunk sizes), each rank on one intra-op thread; one process on the test process's own thread count. The
cases: from logits (log-probs, entropy, per-token cross-entropy with label smoothing and z-loss, top-p and its
kept mass, top-p without the entropy, a replayed support, both implementations), fused (bias, temperature, bf16,
top-p without the entropy, sequence parallelism),
each rank's columns of a row's logits gradient. The vocabulary is padded as Megatron pads it (1000 ids in 1024
columns: shards of 512 and 256, multiples of 128).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import lmloss
from lmloss import sampling

WORLD = 4
N, H, COLS, VOCAB, T = 96, 16, 1024, 1000, 0.8
TRITON = lmloss.kernels.triton_available()
#: The fused heads' GEMM tile here: narrower than one process's 1024 columns and TP=2's 512 (tiles overlapping
#: at the end), wider than TP=4's 256 (zero-padded), as the CPU's 128 x 4096 meets real vocabularies.
GEMM_TILE = (128, 384)


def data():
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


def cols(t, rank, tp):
    """Rank `rank`'s shard of the last dimension (even shards of COLS) under a TP degree of `tp`."""
    width = COLS // tp
    return t[..., rank * width : (rank + 1) * width]


def cases(d, rank, tp, group, chunk):
    """Every case's per-token outputs for this rank (TP degree `tp`, `group`; tp 1: the whole vocabulary)."""
    lmloss.chunks.INVARIANT_GEMM_TILE["cpu"] = GEMM_TILE
    out = {}
    common = dict(vocab_size=VOCAB, tp_group=group, invariant=True, chunk_size=chunk)
    x = cols(d["logits"], rank, tp)
    xg = x.clone().requires_grad_()
    lp, ent = lmloss.token_logprobs(xg, d["labels"], return_entropy=True, temperature=T, **common)
    ((lp * d["up"]).sum() + 0.1 * ent.sum()).backward()
    out["logprobs"], out["entropy"], out["grad"] = lp, ent, xg.grad
    out["ce"] = lmloss.cross_entropy(x, d["labels"], reduction="none", label_smoothing=0.1, z_loss=1e-3, softcap=6.0,
                                     **common)  # fmt: skip
    out["bf16"] = lmloss.token_logprobs(x.bfloat16(), d["labels"], return_entropy=True, **common)
    out["top_p"] = lmloss.token_logprobs(x, d["top_labels"], top_p=0.85, return_entropy=True,
                                         return_log_kept_mass=True, **common)  # fmt: skip
    # without the entropy the exact kept mass of the threshold search is the row's mass: one rank adds it (the
    # group's first), the others add 0; the same bits as with the entropy (and as one process)
    out["top_p_alone"] = lmloss.token_logprobs(x, d["top_labels"], top_p=0.85, **common)
    # vocab_size 700: under TP=4 the last shard (columns 768..1023) is padding only
    small = dict(common, vocab_size=700)
    out["padding_shard"] = (
        *lmloss.token_logprobs(x, d["labels"] % 700, return_entropy=True, top_p=0.9, **small),
        lmloss.cross_entropy(x, d["labels"] % 700, reduction="none", label_smoothing=0.1, **small),
    )
    out["support"] = lmloss.token_logprobs(x, d["top_labels"], support=d["support"], return_entropy=True,
                                           return_log_kept_mass=True, **common)  # fmt: skip
    w, b = d["weight"][rank * (COLS // tp) : (rank + 1) * (COLS // tp)], cols(d["bias"], rank, tp)
    out["fused"] = lmloss.linear_token_logprobs(d["hidden"], w, d["labels"], bias=b, return_entropy=True,
                                                temperature=T, **common)  # fmt: skip
    out["fused_top_p_alone"] = lmloss.linear_token_logprobs(d["hidden"], w, d["top_labels"], bias=b, top_p=0.85,
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
        out["triton_padding_shard"] = lmloss.cross_entropy(x[:6], d["labels"][:6] % 700, reduction="none",
                                                           label_smoothing=0.1, impl="triton", **small)  # fmt: skip
    return out


def rank_results(rank: int, world: int, counter) -> dict:
    """This rank's results (test_vocab_parallel's run, 4 ranks): TP=4 (one group) and TP=2 (two
    groups, other chunk sizes); the collectives per chunk, default and invariant, with their bytes
    (`counter`: that module's collective counter); the misaligned shard's error."""
    assert world == 4
    tp4 = dist.new_group(list(range(world)))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    d = data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sampling.KeptSetWarning)
        out = {4: cases(d, rank, 4, tp4, "auto"), 2: cases(d, rank % 2, 2, pairs[rank // 2], [5, 64][rank // 2])}
    x = cols(d["logits"], rank, 4)
    collectives = {}
    for name, kw in COLLECTIVE_CASES.items():
        for invariant in (False, True):
            counter.take()
            if name == "ce_smoothing":
                lmloss.cross_entropy(x, d["labels"], reduction="none", label_smoothing=0.1, vocab_size=VOCAB,
                                     tp_group=tp4, chunk_size=N // 4, invariant=invariant)  # fmt: skip
            else:
                lmloss.token_logprobs(x, d["labels"], vocab_size=VOCAB, tp_group=tp4, chunk_size=N // 4,
                                      invariant=invariant, **kw)  # fmt: skip
            collectives[(name, invariant)] = counter.take_bytes(tp4)
    out["collectives"] = collectives
    try:  # shards of 100 columns: rank 1's starts at column 100, inside a block
        lmloss.token_logprobs(torch.zeros(2, 100), torch.zeros(2, dtype=torch.long), tp_group=tp4, invariant=True)
        out["misaligned"] = None
    except lmloss.agreement.RankAgreementError as error:
        out["misaligned"] = str(error)
    return out


#: The ops whose collectives per chunk the test compares (default against invariant).
COLLECTIVE_CASES = {"logprobs": {}, "logprobs_entropy": {"return_entropy": True}, "ce_smoothing": None}


def one_process() -> dict:
    """The same cases on one process (the test process's own thread count)."""
    tile = lmloss.chunks.INVARIANT_GEMM_TILE["cpu"]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sampling.KeptSetWarning)
            return cases(data(), 0, 1, None, 7)
    finally:
        lmloss.chunks.INVARIANT_GEMM_TILE["cpu"] = tile
