"""``invariant=True`` under TP=8 (docs/invariant.md): 8 gloo ranks, one run, every case of
tests/distributed/invariant_support.py (logits and fused, entropy, label smoothing, bf16, top-p and its kept
mass, a replayed support, a padding-only shard, sequence parallelism) gives every token the same bits as one
process. Shards of 128 columns, the invariant block: the narrowest TP degree the mode takes at this width
(Megatron pads the vocabulary so that every shard is a whole number of blocks). TP 1 / 2 / 4 are checked in
test_vocab_parallel's run.
"""

from __future__ import annotations

import warnings

import invariant_support as inv
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

from lmloss import sampling

WORLD = 8


def worker(rank: int, world: int) -> dict:
    group = dist.new_group(list(range(world)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sampling.KeptSetWarning)
        return inv.cases(inv.data(), rank, world, group, 48)  # two chunks: the collectives of 8 ranks on 2 cores are the cost


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(worker, WORLD)


def test_invariant_outputs_under_tp8_are_the_one_process_bits(ranks):
    expected = inv.one_process()
    for rank, got in enumerate(ranks):
        for case, want in expected.items():
            if case == "grad":  # this rank's 128 columns of each row's gradient
                want = inv.cols(want, rank, WORLD)
            for g, e in zip(*((got[case], want) if isinstance(want, tuple) else ((got[case],), (want,)))):
                assert torch.equal(g, e), (rank, case)
        for g, e in zip(got["fused_sp"], expected["fused"]):
            assert torch.equal(g, e), (rank, "sequence parallel")
