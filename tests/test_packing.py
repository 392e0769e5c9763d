"""pack / shift_labels: labels are the next token of the same sequence, never across a boundary.

Boundary names follow Transformer Engine / Megatron-core: ``cu_seqlens`` real lengths, ``cu_seqlens_padded``
the padded buffer layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmloss.packing import PackedBatch, pack, sequence_ids, shift_labels, token_mask

IGNORE = -100


def reference_labels(sequences, masks, pad_to):
    """Labels written out sequence by sequence, the slow obvious way."""
    out = []
    for seq, mask in zip(sequences, masks):
        n = len(seq)
        padded = -(-n // pad_to) * pad_to
        for j in range(padded):
            if j + 1 < n and mask[j + 1]:
                out.append(int(seq[j + 1]))
            else:
                out.append(IGNORE)
    return out


def test_labels_are_next_tokens_within_each_sequence_under_the_target_mask():
    batch = pack([[1, 2, 3], [4], [5, 6, 7, 8, 9]], [[0, 1, 1], [1], [1, 0, 1, 1, 1]])
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    #          seq 0: 2, 3 then end | seq 1: length 1 | seq 2: 6 is masked, 7 8 9 then end
    assert batch.labels.tolist() == [2, 3, IGNORE, IGNORE, IGNORE, 7, 8, 9, IGNORE]
    assert batch.loss_mask.tolist() == [lb != IGNORE for lb in batch.labels.tolist()]
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]
    assert batch.cu_seqlens.tolist() == batch.cu_seqlens_padded.tolist() == [0, 3, 4, 9]  # no padding
    assert batch.cu_seqlens.dtype == batch.cu_seqlens_padded.dtype == torch.int32
    assert batch.max_seqlen == 5 and batch.num_sequences == 3


def test_a_first_token_marked_as_target_does_not_pull_a_label_across_the_boundary():
    # every token is a target, position 0 of the second sequence included: the previous sequence's last
    # token must still predict nothing
    batch = pack([[10, 11], [12, 13]], [[1, 1], [1, 1]])
    assert batch.labels.tolist() == [11, IGNORE, 13, IGNORE]


def test_a_sequence_of_length_one_predicts_nothing_and_is_kept():
    batch = pack([[7], [8, 9], [3]])
    assert batch.labels.tolist() == [IGNORE, 9, IGNORE, IGNORE]
    assert batch.cu_seqlens.tolist() == [0, 1, 3, 4]


def test_padding_makes_every_sequence_a_multiple_and_is_never_a_target():
    batch = pack([[1, 2, 3], [4, 5, 6, 7, 8]], pad_to_multiple_of=4, pad_id=99)
    assert batch.input_ids.tolist() == [1, 2, 3, 99, 4, 5, 6, 7, 8, 99, 99, 99]
    assert batch.labels.tolist() == [2, 3, IGNORE, IGNORE, 5, 6, 7, 8, IGNORE, IGNORE, IGNORE, IGNORE]
    assert batch.cu_seqlens.tolist() == [0, 3, 8]  # real lengths 3 and 5 (TE's cu_seqlens_q)
    assert batch.cu_seqlens_padded.tolist() == [0, 4, 12]  # the buffer layout (TE's cu_seqlens_q_padded)
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    assert batch.max_seqlen == 8  # the longest padded slot
    assert batch.num_sequences == 2
    assert batch.token_mask().tolist() == [True] * 3 + [False] + [True] * 5 + [False] * 3
    assert batch.sequence_ids().tolist() == [0] * 4 + [1] * 8


def test_pack_keeps_the_device_and_accepts_tensors_and_bool_masks():
    batch = pack([torch.tensor([3, 4, 5], dtype=torch.int32)], [torch.tensor([True, False, True])])
    assert batch.input_ids.dtype == torch.long and batch.labels.tolist() == [IGNORE, 5, IGNORE]


def test_shift_labels_on_a_packed_buffer_matches_pack():
    seqs, masks = [[1, 2, 3, 4], [5, 6], [7, 8, 9]], [[1, 1, 0, 1], [1, 1], [0, 0, 1]]
    batch = pack(seqs, masks)
    flat_mask = torch.tensor(sum(masks, []))
    labels = shift_labels(batch.input_ids, batch.cu_seqlens, flat_mask)
    assert labels.tolist() == batch.labels.tolist() == reference_labels(seqs, masks, 1)


def test_shift_labels_with_padded_boundaries_ignores_padding_targets():
    ids = torch.tensor([1, 2, 0, 0, 3, 4, 5, 0])
    cu_padded, cu_real = torch.tensor([0, 4, 8]), torch.tensor([0, 2, 5])
    # the padded boundaries alone: a buffer without padding, so the padding looks real
    assert shift_labels(ids, cu_padded).tolist() == [2, 0, 0, IGNORE, 4, 5, 0, IGNORE]
    expected = [2, IGNORE, IGNORE, IGNORE, 4, 5] + [IGNORE] * 2
    assert shift_labels(ids, cu_real, cu_seqlens_padded=cu_padded).tolist() == expected
    # Megatron keeps its boundaries as [1, B + 1]
    assert shift_labels(ids, cu_real[None], cu_seqlens_padded=cu_padded[None]).tolist() == expected
    with pytest.raises(ValueError, match="cu_seqlens ends at 5 but the packed buffer has 8"):
        shift_labels(ids, cu_real)  # the real boundaries of a padded buffer, without the layout


def test_shift_labels_uses_the_given_ignore_index():
    assert shift_labels(torch.tensor([1, 2]), torch.tensor([0, 2]), ignore_index=-1).tolist() == [2, -1]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 50), st.booleans()), min_size=1, max_size=9),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 8),
)
def test_pack_matches_the_sequence_by_sequence_reference(data, pad_to):
    seqs = [[tok for tok, _ in s] for s in data]
    masks = [[m for _, m in s] for s in data]
    batch = pack(seqs, masks, pad_to_multiple_of=pad_to, pad_id=51)
    assert batch.labels.tolist() == reference_labels(seqs, masks, pad_to)
    assert batch.loss_mask.tolist() == [lb != IGNORE for lb in batch.labels.tolist()]
    lengths = [-(-len(s) // pad_to) * pad_to for s in seqs]
    assert (batch.cu_seqlens_padded[1:] - batch.cu_seqlens_padded[:-1]).tolist() == lengths
    assert (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist() == [len(s) for s in seqs]
    assert batch.max_seqlen == max(lengths)
    assert batch.position_ids.tolist() == [j for n in lengths for j in range(n)]
    # no label crosses a boundary: a label at position i is the token at i + 1 in the same sequence
    seq = batch.sequence_ids()
    for i in torch.nonzero(batch.loss_mask).flatten().tolist():
        assert seq[i] == seq[i + 1] and batch.labels[i] == batch.input_ids[i + 1]


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        (([],), {}, ValueError, "empty"),
        (([[1, 2], []],), {}, ValueError, "sequence 1 is empty"),
        (([[[1, 2]]],), {}, ValueError, "sequence 0 must be 1-D"),
        (([[1.0, 2.0]],), {}, TypeError, "integer token ids"),
        (([[1, 2]], [[1, 1, 1]]), {}, ValueError, "loss mask of sequence 0"),
        (([[1, 2]], [[1, 1], [1]]), {}, ValueError, "2 loss masks for 1 sequences"),
        (([[1, 2]],), {"pad_to_multiple_of": 0}, ValueError, "pad_to_multiple_of must be >= 1"),
        ((torch.tensor([1, 2]),), {}, TypeError, "list of 1-D"),
    ],
)
def test_pack_rejects_bad_input_with_a_clear_message(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        pack(*args, **kwargs)


@pytest.mark.parametrize(
    "ids, cu, mask, match",
    [
        (torch.tensor([1, 2, 3]), torch.tensor([0, 2]), None, "ends at 2 but the packed buffer has 3"),
        (torch.tensor([1, 2, 3]), torch.tensor([1, 3]), None, "must start with 0"),
        (torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1, 3]), None, "non-decreasing; sequence 1"),
        (torch.tensor([[1, 2]]), torch.tensor([0, 2]), None, "must be 1-D"),
        (
            torch.tensor([1, 2]),
            torch.tensor([[0, 2], [0, 2]]),
            None,
            r"cu_seqlens must be \[B \+ 1\] or \[1, B \+ 1\]",
        ),
        (
            torch.tensor([1, 2]),
            torch.tensor([[[0, 2]]]),
            None,
            r"cu_seqlens must be .* got shape \(1, 1, 2\)",
        ),
        (torch.tensor([1, 2, 3]), torch.tensor([0, 3]), torch.tensor([1, 1]), "loss_mask has shape"),
    ],
)
def test_shift_labels_rejects_inconsistent_buffers(ids, cu, mask, match):
    with pytest.raises(ValueError, match=match):
        shift_labels(ids, cu, mask)


def test_token_mask_is_true_at_each_slots_real_prefix():
    real, padded = torch.tensor([0, 3, 3, 5]), torch.tensor([0, 4, 4, 8])  # an empty slot in the middle
    expected = [True, True, True, False] + [True, True, False, False]
    assert token_mask(real, padded).tolist() == expected
    assert token_mask(real[None], padded[None]).tolist() == expected


def test_token_mask_rejects_swapped_boundaries():
    # the old argument order (padded first) has more "real" tokens than positions
    with pytest.raises(ValueError, match="sequence 0 has 5 real tokens in cu_seqlens but only 4 positions"):
        token_mask(torch.tensor([0, 5]), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="cu_seqlens has 2 sequences but cu_seqlens_padded has 1"):
        token_mask(torch.tensor([0, 1, 2]), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"cu_seqlens_padded must be \[B \+ 1\] or \[1, B \+ 1\]"):
        token_mask(torch.tensor([0, 1]), torch.tensor([[0, 4], [0, 4]]))


def test_sequence_ids_cover_zero_length_slots_without_positions():
    assert sequence_ids(torch.tensor([0, 2, 2, 3], dtype=torch.int32)).tolist() == [0, 0, 2]
    assert sequence_ids(torch.tensor([[0, 2, 2, 3]], dtype=torch.int32)).tolist() == [0, 0, 2]


def test_the_old_boundary_keyword_is_a_type_error():
    batch = pack([[1, 2, 3]], pad_to_multiple_of=4)
    fields = batch.to_dict()
    fields["cu_seqlens_unpadded"] = fields.pop("cu_seqlens")
    with pytest.raises(TypeError, match="unexpected keyword argument 'cu_seqlens_unpadded'"):
        PackedBatch(**fields)
    with pytest.raises(TypeError, match="unexpected keyword argument 'cu_seqlens_unpadded'"):
        shift_labels(batch.input_ids, batch.cu_seqlens_padded, cu_seqlens_unpadded=batch.cu_seqlens)
    # keyword-only: a positional construction in the old field order cannot silently swap the boundaries
    with pytest.raises(TypeError, match="positional"):
        PackedBatch(*batch.to_dict().values())


def test_to_dict_names_every_field():
    batch = pack([[1, 2]])
    d = batch.to_dict()
    assert set(d) == {
        "input_ids",
        "labels",
        "position_ids",
        "cu_seqlens",
        "cu_seqlens_padded",
        "max_seqlen",
        "loss_mask",
    }
    assert all(d[k] is getattr(batch, k) for k in d)


def test_shift_labels_without_cu_seqlens_shifts_each_row_of_a_batch():
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, -100, -100]])  # HF-style labels: padding already ignored
    assert shift_labels(ids).tolist() == [[6, 7, 8, -100], [10, -100, -100, -100]]
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])  # targets: the response tokens only
    assert shift_labels(ids, loss_mask=mask, ignore_index=-1).tolist() == [[-1, 7, 8, -1], [10, -100, -100, -1]]
    assert shift_labels(torch.tensor([1, 2, 3])).tolist() == [2, 3, -100]  # one unpacked sequence
    with pytest.raises(ValueError, match="cu_seqlens_padded needs cu_seqlens"):
        shift_labels(ids, cu_seqlens_padded=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="loss_mask has shape"):
        shift_labels(ids, loss_mask=mask[0])
    with pytest.raises(ValueError, match="cu_seqlens=None"):
        shift_labels(ids, torch.tensor([0, 4]))
