"""The rank agreement's fingerprints and descriptions, on one process (`lmloss.agreement`).

A fingerprint must move whenever a tensor's values, places, dtype or shape change, including under a
*patterned* change that a position-weighted sum cannot see: +d, -d, -d, +d at four consecutive places leaves
``sum (bits_i + c) (a i + b)`` exactly where it was (the linear fingerprint the agreement had before; written out
below to show the pattern is the one it misses). The multi-rank consequences (every rank raising the same error
instead of a silent mix) are tested in tests/distributed/test_rank_agreement.py.
"""

from __future__ import annotations

import pytest
import torch

from lmloss._validate import label_stats
from lmloss.agreement import describe_arguments, mix64, tensor_fingerprint

PATTERN = torch.tensor([1, -1, -1, 1, 0, 0, 0, 0])
INT_VIEWS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
             torch.float16: torch.int16}  # fmt: skip


def _linear_fingerprint(t: torch.Tensor) -> int:
    """A position-weighted sum of the elements' bits, the kind of fingerprint a patterned change cancels in."""
    flat = t.reshape(-1)
    bits = flat.view(INT_VIEWS[flat.dtype]).long() if flat.is_floating_point() else flat.long()
    position = torch.arange(1, flat.numel() + 1)
    return int(((bits + 7) * (position * 3 + 1)).sum())


def _patterned(t: torch.Tensor, d: int) -> torch.Tensor:
    """`t` with its elements' bits changed by +d, -d, -d, +d at its first four places."""
    if t.dtype == torch.bool:
        flipped = t.clone()
        flipped[:4] = torch.tensor([True, False, False, True])
        return flipped
    if t.is_floating_point():
        return (t.view(INT_VIEWS[t.dtype]) + (PATTERN * d).to(INT_VIEWS[t.dtype])).view(t.dtype)
    return t + (PATTERN * d).to(t.dtype)


CASES = {
    "advantages_fp32": torch.linspace(-1, 1, 8),
    "old_logprobs_fp64": -torch.linspace(0.5, 3, 8, dtype=torch.float64),
    "bf16": torch.linspace(-2, 2, 8).bfloat16(),
    "fp16": torch.linspace(-2, 2, 8).half(),
    "labels_int64": torch.tensor([5, 9, 9, 5, 1, 2, 3, 4]),
    "top_k_int32": torch.tensor([3, 4, 4, 3, 5, 5, 5, 5], dtype=torch.int32),
    "pg_mask_bool": torch.tensor([False, True, True, False, True, False, True, True]),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("d", [1, 3, 1 << 10])
def test_a_patterned_change_that_a_linear_fingerprint_misses_moves_the_fingerprint(name, d):
    t = CASES[name]
    changed = _patterned(t, d)
    assert not torch.equal(changed, t)
    assert _linear_fingerprint(changed) == _linear_fingerprint(t)  # the linear one cannot see it
    assert tensor_fingerprint(changed) != tensor_fingerprint(t)


def _wrap(v: int) -> int:
    """`v` modulo 2**64 as a signed int64."""
    v %= 1 << 64
    return v - (1 << 64) if v >> 63 else v


def test_two_compensating_changes_that_collide_under_any_weighted_sum_move_the_fingerprint():
    """Under a fingerprint that is a weighted sum of the elements' bits (whatever the weights: positions, or
    pseudo-random ones), raising element i by 1 moves it by w_i, and lowering element j by w_i / w_j (mod 2**64,
    w_j odd) moves it back: measured here from the fingerprint itself, the pair must still move it."""
    base = torch.tensor([11, -3, 42, 7, 0, 99, -1000, 5], dtype=torch.int64)

    def fp(t):
        return int(tensor_fingerprint(t))

    def raised(t, i, d):
        t = t.clone()
        t[i] = _wrap(int(t[i]) + d)
        return t

    weights = [_wrap(fp(raised(base, i, 1)) - fp(base)) for i in range(base.numel())]
    i = 0
    j = next(k for k in range(1, base.numel()) if weights[k] % 2)  # invertible modulo 2**64
    d = _wrap(-weights[i] * pow(weights[j], -1, 1 << 64))
    changed = raised(raised(base, i, 1), j, d)
    assert not torch.equal(changed, base)
    assert fp(changed) != fp(base)
    # non-linear in each element: raising it by 2 is not twice raising it by 1 (mod 2**64)
    assert all(_wrap(fp(raised(base, k, 2)) - fp(base)) != _wrap(2 * weights[k]) for k in range(base.numel()))


def test_the_fingerprint_is_a_function_of_the_values_places_dtype_and_shape():
    t = torch.linspace(-1, 1, 12)
    assert tensor_fingerprint(t) == tensor_fingerprint(t.clone())
    assert tensor_fingerprint(t[::2]) == tensor_fingerprint(t[::2].contiguous())  # strides do not matter
    assert tensor_fingerprint(t.view(3, 4)) != tensor_fingerprint(t)  # shape
    assert tensor_fingerprint(t.view(torch.int32)) != tensor_fingerprint(t)  # the same bits, another dtype
    assert tensor_fingerprint(t.double()) != tensor_fingerprint(t)
    assert tensor_fingerprint(t.flip(0)) != tensor_fingerprint(t)  # places
    assert tensor_fingerprint(t[:-1]) != tensor_fingerprint(t)  # size
    swapped = t.clone()
    swapped[[3, 7]] = swapped[[7, 3]]
    assert tensor_fingerprint(swapped) != tensor_fingerprint(t)
    minus_zero = torch.zeros(4)
    minus_zero[1] = -0.0
    assert tensor_fingerprint(minus_zero) != tensor_fingerprint(torch.zeros(4))  # the bits, not the values


def test_every_one_element_change_of_a_large_tensor_moves_the_fingerprint_to_a_distinct_value():
    t = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    prints = {int(tensor_fingerprint(t))}
    bits = t.view(torch.int32)
    for i in range(0, 4096, 7):
        changed = bits.clone()
        changed[i] ^= 1  # the lowest mantissa bit
        prints.add(int(tensor_fingerprint(changed.view(torch.float32))))
    assert len(prints) == 1 + len(range(0, 4096, 7))


def test_mix64_is_the_splitmix64_finalizer():
    """Checked against the finalizer written out with Python's unbounded integers (a logical shift, wrap at
    2**64): the int64 tensor arithmetic (arithmetic shifts masked, wrapping multiplies) computes it."""

    def reference(z: int) -> int:
        m = (1 << 64) - 1
        z &= m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        z ^= z >> 31
        return z - (1 << 64) if z >> 63 else z

    values = [0, 1, -1, 2**62 + 12345, -(2**63), 2**63 - 1, 0x0123456789ABCDEF]
    assert mix64(torch.tensor(values)).tolist() == [reference(v) for v in values]


def test_label_stats_fingerprint_the_labels_and_their_ignore_mask():
    labels = torch.tensor([5, 9, 9, 5, -100, 2, 3, 4])
    base = label_stats(labels, -100)
    assert base[:3].tolist() == [0, 9, 7]  # min, max (ignored labels count as 0), how many count
    patterned = torch.tensor([6, 8, 8, 6, -100, 2, 3, 4])  # +1, -1, -1, +1: the same sum and weighted sum
    assert label_stats(patterned, -100)[3] != base[3]
    moved = torch.tensor([5, 9, 9, 5, 1, -100, 3, 4])  # the ignore mask moved
    assert label_stats(moved, -100)[3] != base[3]
    assert label_stats(labels[:0], -100).tolist() == [0, 0, 0, 0]


def test_describe_arguments_names_dtypes_and_shapes_with_the_vocabulary_shard_apart():
    text = describe_arguments(
        {"weight": torch.zeros(16, 8), "ref_weight": torch.zeros(16, 4, dtype=torch.bfloat16),
         "hidden": torch.zeros(6, 8), "bias": None, "logits": torch.zeros(2, 3, 16)}  # fmt: skip
    )
    assert text == (
        "bias: None; hidden: float32 [6, 8]; logits: float32 [2, 3, V_local]; ref_weight: bfloat16 [V_local, 4]; "
        "weight: float32 [V_local, 8]"
    )
    # shards of another width describe alike (V_local is agreed apart); another reference width does not
    assert describe_arguments({"weight": torch.zeros(12, 8)}) == describe_arguments({"weight": torch.zeros(16, 8)})
    assert describe_arguments({"ref_weight": torch.zeros(16, 6)}) != describe_arguments({"ref_weight": torch.zeros(16, 4)})
