"""The vocabulary split across tensor-parallel ranks, and the two collectives that combine softmax statistics.

Each TP rank holds columns ``[start, start + size)`` of the global vocabulary; columns at global index
``>= vocab_size`` are embedding padding and take no part in the softmax. Per chunk of tokens the forward
needs exactly two collectives over the TP group: a MAX of the row maxima and one SUM of a packed
``[tokens, k]`` block of partial sums.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """This rank's columns of the vocabulary.

    start: global id of local column 0.
    size: number of local columns (``V_local``), padding included.
    vocab_size: the true global vocabulary; columns at global index ``>= vocab_size`` are padding.
    group: the TP process group, or None for one process.
    """

    start: int
    size: int
    vocab_size: int
    group: ProcessGroup | None = None

    @property
    def valid(self) -> int:
        """How many leading local columns are real vocabulary (padding is always a suffix)."""
        return max(0, min(self.size, self.vocab_size - self.start))

    def local_targets(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(column index clamped into this shard, whether this shard owns the label) for global labels."""
        local = labels - self.start
        owned = (local >= 0) & (local < self.valid)
        return local.clamp(0, max(self.valid - 1, 0)), owned


def world_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def vocab_shard(
    local_size: int,
    *,
    tp_group: ProcessGroup | None,
    vocab_start: int | None,
    vocab_size: int | None,
    device: torch.device,
) -> VocabShard:
    """Work out and check this rank's vocabulary shard.

    With ``vocab_start=None`` shards are taken to be even (rank r holds ``[r * V_local, (r+1) * V_local)``)
    and no communication happens. With an explicit ``vocab_start`` (uneven shards) one all-gather over
    ``tp_group`` checks that the shards tile ``[0, V_total)`` without gaps or overlap.
    """
    if tp_group is None:
        if vocab_start not in (None, 0):
            raise ValueError(
                f"vocab_start={vocab_start} with tp_group=None: one process must hold the whole vocabulary "
                f"from id 0 (vocab_start + V_local = {vocab_start + local_size} is past it)"
            )
        start, total = 0, local_size
    else:
        rank, world = dist.get_rank(tp_group), dist.get_world_size(tp_group)
        if vocab_start is None:
            start, total = rank * local_size, world * local_size
        else:
            # every rank must reach the all-gather before any raises, or the others would wait forever
            # (so the negative-start check comes after it); ranks must all pass vocab_start or all omit it
            start = vocab_start
            mine = torch.tensor([start, local_size], dtype=torch.int64, device=device)
            everyone = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(everyone, mine, group=tp_group)
            spans = sorted((int(s), int(n)) for s, n in (t.tolist() for t in everyone))
            if spans[0][0] < 0:
                raise ValueError(
                    f"vocab_start must be >= 0 on every rank (vocab_start, V_local per rank: {spans})"
                )
            expected = 0
            for s, n in spans:
                if s != expected:
                    raise ValueError(
                        f"vocab shards over tp_group do not tile the vocabulary: a shard starts at {s} "
                        f"where {expected} was expected (vocab_start, V_local per rank: {spans})"
                    )
                expected = s + n
            total = expected
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
    return VocabShard(start=start, size=local_size, vocab_size=vocab_size, group=tp_group)


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
