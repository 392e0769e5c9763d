"""partition_index / split / gather / split_batch on one process (the multi-rank runs are in tests/distributed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmloss import cp
from lmloss.packing import pack


def transformer_engine_indices(cu_seqlens: list[int], world_size: int, rank: int) -> list[int]:
    """TE's THD partitioning, written out token by token the way its kernel walks them.

    The rank's local buffer holds ``len / world_size`` tokens of every sequence; local token ``i`` of a
    sequence sits in the first half of that share (chunk ``rank``) or the second (chunk
    ``2 * world_size - 1 - rank``), and its global position follows from the chunk it came from.
    """
    local_cu = [c // world_size for c in cu_seqlens]
    out = []
    for token in range(local_cu[-1]):
        seq = max(b for b in range(len(local_cu) - 1) if local_cu[b] <= token)
        half = (local_cu[seq + 1] - local_cu[seq]) // 2
        index = token - local_cu[seq]
        offset = rank if index < half else 2 * world_size - 2 - rank
        out.append(cu_seqlens[seq] + index + offset * half)
    return out


CU = [0, 8, 24, 32, 56]  # lengths 8, 16, 8, 24: divisible by 2 * 4


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_zigzag_partition_is_transformer_engines(cp_size):
    cu = torch.tensor(CU, dtype=torch.int32)
    for rank in range(cp_size):
        assert cp.partition_index(cu, cp_size, rank).tolist() == transformer_engine_indices(CU, cp_size, rank)


def test_zigzag_keeps_chunks_r_and_2cp_minus_1_minus_r_of_every_sequence_in_that_order():
    # one sequence of 8 over cp 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    cu = torch.tensor([0, 8, 12])
    assert cp.partition_index(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert cp.partition_index(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


def test_contiguous_partition_keeps_the_rank_th_piece_of_every_sequence():
    cu = torch.tensor([0, 4, 10])
    assert cp.partition_index(cu, 2, 0, "contiguous").tolist() == [0, 1, 4, 5, 6]
    assert cp.partition_index(cu, 2, 1, "contiguous").tolist() == [2, 3, 7, 8, 9]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 6), min_size=1, max_size=6),
    st.sampled_from([1, 2, 3, 4]),
    st.sampled_from(cp.LAYOUTS),
)
def test_the_ranks_partition_every_position_exactly_once(units, cp_size, layout):
    pieces = 2 * cp_size if layout == "zigzag" else cp_size
    cu = torch.tensor([0, *units]).mul(pieces).cumsum(0)
    parts = [cp.partition_index(cu, cp_size, r, layout) for r in range(cp_size)]
    assert all(p.numel() == int(cu[-1]) // cp_size for p in parts)
    assert sorted(torch.cat(parts).tolist()) == list(range(int(cu[-1])))


@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_reassembling_every_ranks_split_gives_back_the_tensor(layout):
    cu = torch.tensor(CU)
    x = torch.randn(3, CU[-1], 5)
    full = torch.empty_like(x)
    for r in range(4):
        local = cp.split(x, cu, 4, r, dim=1, layout=layout)
        assert local.shape == (3, CU[-1] // 4, 5)
        full[:, cp.partition_index(cu, 4, r, layout)] = local
    assert torch.equal(full, x)


def test_split_is_differentiable():
    cu = torch.tensor([0, 4])
    x = torch.randn(4, 3, requires_grad=True)
    cp.split(x, cu, 2, 1).sum().backward()
    assert x.grad[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("layout, pieces", [("zigzag", 8), ("contiguous", 4)])
def test_a_sequence_the_layout_cannot_divide_raises_and_names_it(layout, pieces):
    cu = torch.tensor([0, 8, 8 + pieces + 2, 8 + 2 * pieces + 2])
    with pytest.raises(ValueError, match=rf"sequence 1 has length {pieces + 2}, not divisible by {pieces}"):
        cp.partition_index(cu, 4, 0, layout)
    with pytest.raises(ValueError, match="sequence 1"):
        cp.split(torch.zeros(int(cu[-1])), cu, 4, 3, layout=layout)


def test_zigzag_refuses_a_length_divisible_by_cp_size_but_not_by_twice_it():
    """12 positions at cp=4: 4 ranks could take 3 each, but the zigzag needs 8 equal chunks (it would
    silently keep 8 of the 12 if it checked ``% cp_size``); the contiguous layout takes it."""
    cu = torch.tensor([0, 8, 20])
    with pytest.raises(ValueError, match="sequence 1 has length 12, not divisible by 8"):
        cp.partition_index(cu, 4, 1, "zigzag")
    parts = [cp.partition_index(cu, 4, r, "contiguous") for r in range(4)]
    assert sorted(torch.cat(parts).tolist()) == list(range(20))


def test_gather_over_a_group_that_is_not_a_process_group_raises_a_type_error_naming_it():
    with pytest.raises(TypeError, match="group must be a torch.distributed.ProcessGroup"):
        cp.gather(torch.zeros(8), torch.tensor([0, 8]), "cp")


def test_cp_size_one_is_the_identity_for_any_length():
    cu = torch.tensor([0, 3, 4, 11])
    x = torch.arange(11)
    assert torch.equal(cp.split(x, cu, 1, 0), x)
    assert cp.gather(x, cu, None) is x


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda cu: cp.partition_index(cu, 2, 0, layout="striped"), ValueError, "layout must be one of"),
        (
            lambda cu: cp.gather(torch.zeros(8), cu, None, layout="striped"),
            ValueError,
            "layout must be one of",
        ),
        (lambda cu: cp.partition_index(cu, 2, 2), ValueError, r"cp_rank must be in \[0, 2\)"),
        (lambda cu: cp.partition_index(cu, 0, 0), ValueError, "cp_size must be >= 1"),
        (lambda cu: cp.partition_index(cu.float(), 2, 0), TypeError, "integer tensor"),
        (lambda cu: cp.split(torch.zeros(6), cu, 2, 0), ValueError, "6 positions along dim 0"),
        (lambda cu: cp.gather(torch.zeros(6), cu, None), ValueError, "6 positions along dim 0"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.tensor([0, 4, 8]))


def test_boundaries_shaped_1_by_n_give_the_same_partition():
    cu = torch.tensor(CU, dtype=torch.int32)
    x = torch.randn(CU[-1], 3)
    for r in range(4):
        assert torch.equal(cp.partition_index(cu[None], 4, r), cp.partition_index(cu, 4, r))
        assert torch.equal(cp.split(x, cu[None], 4, r), x[transformer_engine_indices(CU, 4, r)])
    assert cp.gather(x, cu[None], None) is x


@pytest.mark.parametrize(
    "call",
    [
        lambda cu: cp.partition_index(cu, 2, 0),
        lambda cu: cp.split(torch.zeros(8), cu, 2, 0),
        lambda cu: cp.gather(torch.zeros(8), cu, None),
    ],
)
def test_other_2d_boundaries_are_refused_naming_the_argument(call):
    with pytest.raises(ValueError, match=r"cu_seqlens_padded must be \[B \+ 1\] or \[1, B \+ 1\].*\(2, 3\)"):
        call(torch.tensor([[0, 4, 8], [0, 4, 8]]))


def test_the_old_boundary_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'cu_seqlens'"):
        cp.split(torch.zeros(8), cu_seqlens=torch.tensor([0, 8]), cp_size=2, cp_rank=0)


# pack([[1, 2, 3, 4, 5], [6, 7, 8]], pad_to_multiple_of=4): [1 2 3 4 5 p p p | 6 7 8 p], zigzag over cp 2
REAL, PADDED = [0, 5, 8], [0, 8, 12]
RANK1 = [2, 3, 4, 5, 9, 10]  # chunks 1 and 2 of each sequence


def test_split_batch_gives_local_tokens_with_labels_made_on_the_full_sequence():
    batch = pack([[1, 2, 3, 4, 5], [6, 7, 8]], [[1, 1, 0, 1, 1], [1, 1, 1]], pad_to_multiple_of=4)
    # full buffer: [1 2 3 4 5 p p p | 6 7 8 p]; labels [2 -100 4 5 -100 -100 -100 -100 | 7 8 -100 -100]
    assert batch.cu_seqlens.tolist() == REAL and batch.cu_seqlens_padded.tolist() == PADDED
    local = cp.split_batch(batch, 2, 1)
    assert local["input_ids"].tolist() == [3, 4, 5, 0, 7, 8]
    assert local["labels"].tolist() == [4, 5, -100, -100, 8, -100]  # 4 -> 5 crosses the chunk edge, fine
    assert local["loss_mask"].tolist() == [True, True, False, False, True, False]
    assert local["position_ids"].tolist() == [2, 3, 4, 5, 1, 2]  # positions in the full sequence
    assert local["sequence_ids"].tolist() == [0, 0, 0, 0, 1, 1]
    assert local["token_mask"].tolist() == [True, True, True, False, True, True]
    assert local["cu_seqlens"] is batch.cu_seqlens and local["cu_seqlens_padded"] is batch.cu_seqlens_padded
    assert local["max_seqlen"] == 8
    assert torch.equal(local["labels"], batch.labels[RANK1])


def megatron_batch(flat: bool = False) -> dict:
    """A batch with Megatron's keys and shapes: one row ``[1, T]``, boundaries ``[1, B + 1]``."""
    tokens = torch.arange(100, 112)
    batch = {
        "tokens": tokens,
        "labels": tokens + 1,
        "loss_mask": torch.ones(12),
        "position_ids": torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]),
        "attention_mask": None,
        "cu_seqlens": torch.tensor([REAL], dtype=torch.int32),
        "cu_seqlens_padded": torch.tensor([PADDED], dtype=torch.int32),
        "max_seqlen": torch.tensor([8], dtype=torch.int32),
    }
    if not flat:
        batch.update({k: batch[k][None] for k in ("tokens", "labels", "loss_mask", "position_ids")})
    return batch


@pytest.mark.parametrize("flat", [False, True], ids=["1xT", "T"])
def test_split_batch_splits_every_token_tensor_of_a_megatron_batch(flat):
    batch = megatron_batch(flat)
    local = cp.split_batch(batch, 2, 1)
    row = (lambda v: v) if flat else (lambda v: [v])
    assert local["tokens"].tolist() == row([102, 103, 104, 105, 109, 110])  # never passed through unsplit
    assert local["labels"].tolist() == row([103, 104, 105, 106, 110, 111])
    assert local["position_ids"].tolist() == row([2, 3, 4, 5, 1, 2])
    assert local["loss_mask"].tolist() == row([1.0] * 6) and local["loss_mask"].dtype == torch.float32
    assert local["attention_mask"] is None
    for k in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
        assert local[k] is batch[k]
    assert local["token_mask"].tolist() == [True, True, True, False, True, True]
    assert local["sequence_ids"].tolist() == [0, 0, 0, 0, 1, 1]


def test_split_batch_splits_any_tensor_with_the_token_dimension_first_or_after_a_leading_one():
    x = torch.randn(12, 3)
    mask = torch.rand(1, 1, 12, 12) > 0.5  # [B, 1, queries, keys], as Megatron's attention_mask
    local = cp.split_batch(
        {
            "cu_seqlens_padded": torch.tensor(PADDED),
            "hidden": x,
            "logits": x[None],
            "attention_mask": mask,
            "num_items": torch.tensor(7),
            "scale": torch.tensor([0.5]),
            "cu_seqlens_kv": torch.tensor(REAL),
            "max_seqlen_q": 8,
            "note": "kept",
        },
        2,
        1,
    )
    assert torch.equal(local["hidden"], x[RANK1])
    assert torch.equal(local["logits"], x[None, RANK1])
    assert torch.equal(local["attention_mask"], mask[:, :, RANK1, :])  # the local queries' rows, every key
    assert local["num_items"].item() == 7 and local["scale"].tolist() == [0.5]
    assert local["cu_seqlens_kv"].tolist() == REAL and local["max_seqlen_q"] == 8 and local["note"] == "kept"
    assert "token_mask" not in local  # no real lengths given


@pytest.mark.parametrize(
    "key, value, match",
    [
        (
            "mrope_position_ids",
            torch.zeros(3, 12),
            r"batch\['mrope_position_ids'\] has shape \(3, 12\): 3 rows",
        ),
        ("tokens", torch.zeros(2, 12), r"batch\['tokens'\] has shape \(2, 12\): 2 rows"),
        (
            "scores",
            torch.zeros(4, 1, 12),
            r"batch\['scores'\] has shape \(4, 1, 12\): 12 .* at dim\(s\) \[2\]",
        ),
        ("pair", torch.zeros(12, 12), r"batch\['pair'\] has shape \(12, 12\): 12 .* at dim\(s\) \[0, 1\]"),
        (
            "attention_mask",
            torch.zeros(2, 1, 12, 12),
            r"batch\['attention_mask'\] has shape \(2, 1, 12, 12\)",
        ),
        ("labels", torch.zeros(6), r"batch\['labels'\] has shape \(6,\), but the packed buffer has 12"),
        ("tokens", torch.zeros(1, 6), r"batch\['tokens'\] has shape \(1, 6\), but the packed buffer has 12"),
        ("weights", torch.zeros(6), r"batch\['weights'\] has shape \(6,\): no dimension of 12 positions"),
    ],
)
def test_split_batch_refuses_a_tensor_it_cannot_place(key, value, match):
    batch = megatron_batch()
    batch[key] = value
    with pytest.raises(ValueError, match=match):
        cp.split_batch(batch, 2, 1)


def test_split_batch_takes_the_layout_from_cu_seqlens_without_padding():
    # Megatron sets cu_seqlens_padded to None when nothing is padded: cu_seqlens is then the layout
    local = cp.split_batch(
        {"tokens": torch.arange(8)[None], "cu_seqlens": torch.tensor([[0, 8]]), "cu_seqlens_padded": None},
        2,
        0,
    )
    assert local["tokens"].tolist() == [[0, 1, 6, 7]] and local["cu_seqlens_padded"] is None
    assert local["token_mask"].tolist() == [True] * 4


def test_split_batch_accepts_the_partial_dict_a_middle_stage_receives():
    batch = pack([[1, 2, 3, 4]], pad_to_multiple_of=4).to_dict()
    local = cp.split_batch({k: batch[k] for k in ("cu_seqlens_padded", "max_seqlen")}, 2, 0)
    assert set(local) == {"cu_seqlens_padded", "max_seqlen", "sequence_ids"}
    with pytest.raises(ValueError, match="neither 'cu_seqlens_padded' nor 'cu_seqlens'"):
        cp.split_batch({"input_ids": batch["input_ids"]}, 2, 0)
    with pytest.raises(ValueError, match=r"batch\['labels'\] has shape \(3,\)"):
        cp.split_batch({"cu_seqlens_padded": batch["cu_seqlens_padded"], "labels": torch.zeros(3)}, 2, 0)
    with pytest.raises(ValueError, match=r"batch\['cu_seqlens_padded'\] must be \[B \+ 1\] or \[1, B \+ 1\]"):
        cp.split_batch({"cu_seqlens_padded": torch.tensor([[0, 4], [0, 4]])}, 2, 0)
