"""The vocabulary split across tensor-parallel ranks, and the two collectives that combine softmax statistics.

Each TP rank holds columns ``[start, start + size)`` of the global vocabulary; columns at global index
``>= vocab_size`` are embedding padding and take no part in the softmax. Per chunk of tokens the forward
needs exactly two collectives over the TP group: a MAX of the row maxima and one SUM of a packed
``[tokens, k]`` block of partial sums.
"""

from __future__ import annotations

import dataclasses
import os
import struct

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """This rank's columns of the vocabulary.

    start: global id of local column 0.
    size: number of local columns (``V_local``), padding included.
    vocab_size: the true global vocabulary; columns at global index ``>= vocab_size`` are padding.
    """

    start: int
    size: int
    vocab_size: int

    @property
    def valid(self) -> int:
        """How many leading local columns are real vocabulary (padding is always a suffix)."""
        return max(0, min(self.size, self.vocab_size - self.start))


def world_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def combine_partials(partials: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Merge each rank's per-row softmax partials ``[c, 5]`` into the global ones (same layout).

    Columns (see `lmloss.kernels`): local max ``m``, ``s = sum exp(y - m)``, ``t = sum exp(y - m)(y - m)``,
    the target logit, ``sum y``. Two collectives over `group`: a MAX of ``m``, then one SUM of the other
    four, rescaled to the global max ``M`` (``s * exp(m - M)``; ``t`` also shifts by ``(m - M) s``).
    Column 0 of the result is ``M``. For one process this is the identity.
    """
    if world_size(group) == 1:
        return partials
    m, s, t = partials[:, 0], partials[:, 1], partials[:, 2]
    big_m = all_reduce_max_(m.clone(), group)
    has_mass = s > 0  # a shard with no valid column (or all -inf) has m = -inf: it contributes nothing
    factor = torch.where(has_mass, torch.exp(m - big_m), 0.0)
    shifted_t = torch.where(has_mass, factor * (t + (m - big_m) * s), 0.0)
    packed = torch.stack([factor * s, shifted_t, partials[:, 3], partials[:, 4]], dim=1)
    all_reduce_sum_(packed, group)
    return torch.cat([big_m[:, None], packed], dim=1)


def rank_checks_enabled() -> bool:
    """The per-call agreement check under a TP group; off only with ``LMLOSS_CHECK_RANKS=0``."""
    return os.environ.get("LMLOSS_CHECK_RANKS", "1") != "0"


def resolve_shard(
    local_size: int,
    *,
    tp_group: ProcessGroup | None,
    vocab_start: int | None,
    vocab_size: int | None,
    device: torch.device,
    agree: dict[str, int | float] | None = None,
    label_bounds: torch.Tensor | None = None,
) -> tuple[VocabShard, int]:
    """This rank's vocabulary shard, checked against every other rank's; returns ``(shard, max V_local)``.

    Under a TP group of more than one rank this makes ONE all-gather of a small int64 vector per call:
    each rank's `local_size`, `vocab_start` (and whether it was given), `vocab_size`, the values in
    `agree` (token count, chunk size, options: they must be equal on every rank, or the ranks would
    issue different collectives and hang) and `label_bounds` (``[2]`` int64 on the device: the min and
    max non-ignored label, gathered without a host sync before the collective). Any disagreement, or a
    label outside the vocabulary on any rank, raises the same ValueError on every rank, naming the
    argument and each rank's value.
    Turning the check off (``LMLOSS_CHECK_RANKS=0``) skips the gather for even shards; with
    `vocab_start` the gather still runs, as it is how the shards are tiled.
    """
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        if vocab_start not in (None, 0):
            raise ValueError(
                f"vocab_start={vocab_start} with tp_group=None: one process must hold the whole vocabulary "
                f"from id 0 (vocab_start + V_local = {vocab_start + local_size} is past it)"
            )
        if local_size == 0:
            raise ValueError("the vocabulary dimension is empty (0 columns): nothing to take a softmax over")
        return _shard(0, local_size, local_size, vocab_size), local_size
    rank, world = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    if vocab_start is None and not rank_checks_enabled():
        return _shard(rank * local_size, local_size, world * local_size, vocab_size), local_size
    ranks = _gather_metadata(tp_group, local_size, vocab_start, vocab_size, agree or {}, label_bounds, device)
    _check_agreement(ranks)
    sizes = [r["V_local"] for r in ranks]
    if any(n == 0 for n in sizes):
        raise ValueError(
            f"a TP rank has 0 vocabulary columns (V_local per rank: {sizes}); every shard needs one"
        )
    if vocab_start is None:
        if len(set(sizes)) > 1:
            raise ValueError(
                f"the vocabulary shards are uneven (V_local per rank: {sizes}): pass vocab_start on every "
                f"rank, the global id of its first column"
            )
        start, total = rank * local_size, world * local_size
    else:
        start, total = vocab_start, _tile([(r["vocab_start"], r["V_local"]) for r in ranks])
    shard = _shard(start, local_size, total, vocab_size)
    bad = {i: (r["label_min"], r["label_max"]) for i, r in enumerate(ranks)}
    bad = {i: b for i, b in bad.items() if b[0] < 0 or b[1] >= shard.vocab_size}
    if bad:
        raise ValueError(
            f"labels must be in [0, {shard.vocab_size}) or ignore_index; (min, max) label on the TP ranks "
            f"that have one outside: {bad}"
        )
    return shard, max(sizes)


_FIXED_FIELDS = ("V_local", "vocab_start_given", "vocab_start", "vocab_size", "label_min", "label_max")
_PER_RANK_FIELDS = ("V_local", "vocab_start", "label_min", "label_max")
#: `agree` fields that `lmloss.plan.make_plan` packs as the bits of a float64


def _gather_metadata(group, local_size, vocab_start, vocab_size, agree, label_bounds, device) -> list[dict]:
    """Every rank's metadata, one dict per rank. Floats in `agree` travel as their float64 bits (int64)
    and come back as floats."""
    floats = {name for name, v in agree.items() if isinstance(v, float)}
    encoded = [_float_bits(v) if name in floats else int(v) for name, v in agree.items()]
    fixed = [local_size, vocab_start is not None, vocab_start or 0, -1 if vocab_size is None else vocab_size]
    mine = torch.tensor([*fixed, *encoded], dtype=torch.int64, device=device)
    if label_bounds is None:
        label_bounds = torch.zeros(2, dtype=torch.int64, device=device)
    mine = torch.cat([mine[:4], label_bounds.to(device=device, dtype=torch.int64), mine[4:]])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    names = (*_FIXED_FIELDS, *agree)
    ranks = [dict(zip(names, t.tolist())) for t in everyone]
    for r in ranks:
        r.update({name: struct.unpack("<d", struct.pack("<q", r[name]))[0] for name in floats})
    return ranks


def _float_bits(v: float) -> int:
    return struct.unpack("<q", struct.pack("<d", v))[0]


def _check_agreement(ranks: list[dict]) -> None:
    """Every field but the shard's own extent must be equal on every rank."""
    for name in ranks[0]:
        if name in _PER_RANK_FIELDS:
            continue
        values = [r[name] for r in ranks]
        if len(set(values)) > 1:
            shown = {
                "vocab_start_given": "vocab_start passed (1) or not (0)",
                "vocab_size": "vocab_size (-1: None)",
                "chunk_size": "chunk_size (-1: None, -2: 'auto')",
                "softcap": "softcap (0.0: None)",
                "impl": "impl (0: torch, 1: triton)",
                "outputs": "outputs (bits: 1 logprobs, 2 entropy, 4 loss)",
            }
            raise ValueError(
                f"TP ranks disagree on {shown.get(name, name)}: per rank {values}. Every rank of tp_group must "
                f"call the op with the same value, or they would issue different collectives"
            )


def _tile(spans: list[tuple[int, int]]) -> int:
    """Check that ``(vocab_start, V_local)`` spans tile ``[0, total)``; return total."""
    spans = sorted(spans)
    if spans[0][0] < 0:
        raise ValueError(f"vocab_start must be >= 0 on every rank (vocab_start, V_local per rank: {spans})")
    expected = 0
    for s, n in spans:
        if s != expected:
            raise ValueError(
                f"vocab shards over tp_group do not tile the vocabulary: a shard starts at {s} "
                f"where {expected} was expected (vocab_start, V_local per rank: {spans})"
            )
        expected = s + n
    return expected


def _shard(start: int, local_size: int, total: int, vocab_size: int | None) -> VocabShard:
    if vocab_size is None:
        vocab_size = total
    elif not 0 < vocab_size <= total:
        raise ValueError(
            f"vocab_size={vocab_size} must be in (0, {total}], the number of vocabulary columns over all ranks"
        )
    if start + local_size > total:
        raise ValueError(
            f"vocab_start + V_local = {start + local_size} is past the vocabulary ({total} columns)"
        )
    return VocabShard(start=start, size=local_size, vocab_size=vocab_size)


def all_reduce_max_(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """In-place MAX over `group` (the global row maxima); no-op for one process."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def all_reduce_sum_(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """In-place SUM over `group`; no-op for one process."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def gather_rows(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``[n, ...]`` along dim 0, in rank order (sequence-parallel hidden states)."""
    if group is None or dist.get_world_size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def reduce_scatter_rows(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum ``[world * n, ...]`` over `group` and return this rank's ``[n, ...]`` block of rows.

    gloo has no reduce-scatter, so there it is an all-reduce followed by taking the slice.
    """
    if group is None or dist.get_world_size(group) == 1:
        return t
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = t.shape[0] // world
    if dist.get_backend(group) == "gloo":
        dist.all_reduce(t, group=group)
        return t[rank * rows : (rank + 1) * rows].clone()
    out = torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.reduce_scatter_tensor(out, t.contiguous(), group=group)
    return out
