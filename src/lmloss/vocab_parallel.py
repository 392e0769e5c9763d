"""The vocabulary split across tensor-parallel ranks, and the two collectives that combine softmax statistics.

Each TP rank holds columns ``[start, start + size)`` of the global vocabulary; columns at global index
``>= vocab_size`` are embedding padding and take no part in the softmax. Per chunk of tokens the forward
needs exactly two collectives over the TP group: a MAX of the row maxima and one SUM of a packed
``[tokens, k]`` block of partial sums.

Before those, each call resolves its shard (`resolve_shard`) from the rank agreement's one all-gather
(`lmloss.agreement.gather_plan`): the shards' widths and starts are agreed there, with every other argument.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from lmloss.agreement import (
    RankAgreementError,
    check_plan_tensors,
    gather_plan,
    will_gather,
)

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
    """Merge each rank's per-row softmax partials ``[c, 5]`` (or ``[c, 8]``) into the global ones (same layout).

    Columns (see `lmloss.kernels`): local max ``m``, ``s = sum exp(y - m)``, ``t = sum exp(y - m)(y - m)``,
    the target logit, ``sum y``; with the by-products, ``s2 = sum exp(2 (y - m))``, the max ``v`` and the global
    id of its lowest column. Two collectives over `group`: a MAX of ``m`` (and ``v`` beside it), then one SUM
    of the rest, rescaled to the global max ``M`` (``s * exp(m - M)``; ``t`` also shifts by ``(m - M) s``;
    ``s2 * exp(2 (m - M))``). The argmax rides in that SUM as one column per rank, ``id + 1`` where the rank's
    ``v`` is the global max and 0 elsewhere: the lowest nonzero one is the lowest global id (a SUM cannot take
    a min; one column per rank is ``4 * world`` bytes per row). Column 0 of the result is ``M``. For one
    process this is the identity.
    """
    if world_size(group) == 1:
        return partials
    m, s, t = partials[:, 0], partials[:, 1], partials[:, 2]
    extras = partials.shape[1] == 8
    if extras:  # the max of the argmax in the same MAX
        maxes = all_reduce_max_(torch.stack([m, partials[:, 6]], dim=1), group)
        big_m, big_v = maxes[:, 0], maxes[:, 1]
    else:
        big_m = all_reduce_max_(m.clone(), group)
    has_mass = s > 0  # a shard with no valid column (or all -inf) has m = -inf: it contributes nothing
    factor = torch.where(has_mass, torch.exp(m - big_m), 0.0)
    shifted_t = torch.where(has_mass, factor * (t + (m - big_m) * s), 0.0)
    columns = [factor * s, shifted_t, partials[:, 3], partials[:, 4]]
    if extras:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ids = partials[:, 7]
        candidates = torch.zeros((partials.shape[0], world), dtype=partials.dtype, device=partials.device)
        candidates[:, rank] = torch.where((partials[:, 6] == big_v) & (ids >= 0), ids + 1.0, 0.0)
        columns.append(torch.where(has_mass, factor * factor * partials[:, 5], 0.0))
    packed = torch.cat([torch.stack(columns, dim=1), *((candidates,) if extras else ())], dim=1)
    all_reduce_sum_(packed, group)
    if not extras:
        return torch.cat([big_m[:, None], packed], dim=1)
    chosen = packed[:, 5:]
    lowest = torch.where(chosen > 0, chosen, math.inf).amin(dim=1)
    top = torch.where(torch.isinf(lowest), -1.0, lowest - 1.0)
    return torch.cat([big_m[:, None], packed[:, :5], big_v[:, None], top[:, None]], dim=1)


# ----------------------------------------------------------------------------------------------------------
# the invariant mode's combine: sums of blocks in fixed point (docs/invariant.md)

#: Fraction bits of the fixed-point words the invariant mode sums blocks in: a block's rescaled sum ``v`` becomes
#: the integer ``round(v * 2**38)``. Every column's term is at most 1 (``exp(y - M)``) and the vocabulary at most
#: `INVARIANT_MAX_COLUMNS`, so a row's total stays below ``2**62``. Integer sums are exact: their order (the
#: blocks within a shard, the shards over the group, an all-reduce's own order) changes nothing.
INVARIANT_FRACTION_BITS = 38
#: float64 inputs carry a second word per sum: the first word's rounding residual times ``2**44`` (to ~2**-82).
INVARIANT_LOW_BITS = 44
#: The largest vocabulary (columns over all ranks) the invariant mode takes.
INVARIANT_MAX_COLUMNS = 2**24
_FP32_MIN = torch.finfo(torch.float32).min
_NAN_SHIFT, _INF_SHIFT = 32, 26  # bit fields of the flags (counts below 2**25 each)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """``2.0 ** k`` in float64 for integer `k` in [-1022, 1023], exactly (built from its bits)."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def _fixed(v: torch.Tensor, shift: torch.Tensor | int, words: int) -> list[torch.Tensor]:
    """Finite ``[c, n]`` -> `words` int64 ``[c]``: the sums over n of ``round(v * 2**shift)`` (and of the
    residual's next `INVARIANT_LOW_BITS` bits); `shift` an int or ``[c, 1]`` int64 (float64 `v`).

    An fp32 `v` with an int `shift` is truncated instead (one word): ``v * 2**38`` is exact in fp32 and an
    integer already wherever ``v >= 2**-15``, and truncating the rest is as deterministic as rounding (an
    error below ``2**-38`` per block)."""
    if v.dtype == torch.float32 and isinstance(shift, int) and words == 1:
        return [v.mul(2.0**shift).to(torch.int64).sum(1)]
    scaled = v * (2.0**shift if isinstance(shift, int) else _pow2(shift))  # a power of two: exact
    hi = torch.round(scaled)
    out = [hi.to(torch.int64).sum(1)]
    if words == 2:  # the residual is exact (Sterbenz), |residual| <= 1/2
        lo = torch.round((scaled - hi) * 2.0**INVARIANT_LOW_BITS)
        out.append(lo.to(torch.int64).sum(1))
    return out


def _unfixed(ints: list[torch.Tensor], shift: torch.Tensor | int) -> torch.Tensor:
    def scale(k):
        return 2.0**-k if isinstance(k, int) else _pow2(-k)

    value = ints[0].double() * scale(shift)
    if len(ints) == 2:
        value = value + ints[1].double() * scale(shift + INVARIANT_LOW_BITS)
    return value


def fixed_point_sum(values: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Row sums of ``[c, n]`` non-negative finite values whose every row sums below ``2**24`` (blocks of
    exps), over `group` too, in fixed point (`INVARIANT_FRACTION_BITS`): float64 ``[c]``, the same bits
    however the values are split over columns, chunks and ranks. One SUM over `group`."""
    words = 2 if values.dtype == torch.float64 else 1
    shift = torch.full((values.shape[0], 1), INVARIANT_FRACTION_BITS, dtype=torch.int64, device=values.device)
    ints = all_reduce_sum_(torch.stack(_fixed(values.double(), shift, words), dim=1), group)
    return _unfixed(list(ints.unbind(1)), shift[:, 0])


def to_fixed_point(values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each of ``[...]`` finite values in [0, 2**24) as the int64 ``round(v * 2**INVARIANT_FRACTION_BITS)``
    (into `out`, int64 of the same shape, if given): masses whose sums are exact in any order."""
    scaled = values.double() * 2.0**INVARIANT_FRACTION_BITS
    return torch.round(scaled).to(torch.int64) if out is None else out.copy_(torch.round_(scaled))


def combine_blocks(blocks, group: ProcessGroup | None) -> torch.Tensor:
    """The invariant mode's `combine_partials`: each rank's per-block sums (`lmloss.kernels.BlockPartials`,
    ``[c, n_blocks]``) -> the global partials ``[c, 5]`` (the layout `combine_partials` returns: ``M``,
    ``sum exp(y - M)``, the entropy numerator, the target, ``sum y``; ``[c, 8]`` with `BlockPartials.top`, the
    argmax's max and lowest id in columns 6 and 7, column 5 0), the same bits whatever the blocks' split
    over chunks, shards and ranks.

    The row max ``M`` is one MAX over `group` (exact in any order; made by the kernels already where they
    shifted every block by it, `BlockPartials.global_max`), and, for ``sum y``, the largest block sum's
    magnitude ``A`` in the same MAX (`BlockPartials.y_scale`). Every block is rescaled to ``M`` (``s_b exp(m_b - M)``: a function of the block's
    own values and ``M``), put in fixed point (`INVARIANT_FRACTION_BITS`; ``sum y`` relative to ``A``'s binary
    exponent) and summed as int64 over the blocks and, in one SUM over `group`, over the ranks: integer sums
    are exact, so no order matters. The target travels as its bits (one rank owns it, the others send 0),
    and counts of non-finite blocks beside it, so that a row with a NaN or an infinite logit comes out NaN /
    infinite as the default combine gives it. Collective bytes per row (fp32): 4 for ``M``, 4 for ``A``
    (with ``sum y``), 8 per sum (``s``, with entropy ``t``, with label smoothing ``sum y``), 8 for the target
    and the NaN count, 8 for the infinities of ``sum y``; float64: two words per sum, target and count
    apart. The small ``[c, n_blocks]`` ops run on one CPU thread.
    """
    from lmloss.kernels.torch_ref import check_invariant_math, one_thread

    check_invariant_math(blocks.s.device, blocks.s.dtype)  # (once per process, dtype and thread count)
    with one_thread(blocks.s.device):
        return _combine_blocks(blocks, group)


def _combine_blocks(blocks, group: ProcessGroup | None) -> torch.Tensor:
    m, s, t, sum_y = blocks.m, blocks.s, blocks.t, blocks.sum_y
    acc = s.dtype
    rows, n = s.shape
    words = 2 if acc == torch.float64 else 1
    dev = s.device
    if m.shape[1] and sum_y is None:  # (a shard of padding only has no block, but a global max has its column)
        maxes = m.amax(1, keepdim=True)
    else:
        maxes = torch.full((rows, 1 if sum_y is None else 2), float("-inf"), dtype=acc, device=dev)
        if m.shape[1]:
            torch.amax(m, 1, out=maxes[:, 0])
        if sum_y is not None:
            maxes[:, 1] = 0.0
            if n:
                torch.amax(torch.where(torch.isfinite(sum_y), sum_y.abs(), 0.0), 1, out=maxes[:, 1])
    top = blocks.top
    if top is not None and not blocks.global_max:  # the argmax's max rides in the same MAX, last
        maxes = torch.cat([maxes, top[:, :1].to(acc)], dim=1)
    if not blocks.global_max:
        all_reduce_max_(maxes, group)
    elif sum_y is not None:  # the row max is the group's already, and A too where the kernels made it
        a = blocks.y_scale if blocks.y_scale is not None else all_reduce_max_(maxes[:, 1].contiguous(), group)
        maxes[:, 1] = a
    big_m = maxes[:, 0]
    candidates = big_v = None
    if top is not None:  # the lowest id of the ranks holding the max, as in `combine_partials` (one int64 column
        # per rank in the SUM); with `global_max` the kernels' MAX did not carry it: one MAX more
        big_v = maxes[:, -1] if not blocks.global_max else all_reduce_max_(top[:, 0].to(acc).clone(), group)
        ids = top[:, 1].to(torch.int64)
        candidates = torch.zeros((rows, world_size(group)), dtype=torch.int64, device=dev)
        rank = 0 if world_size(group) == 1 else dist.get_rank(group)
        candidates[:, rank] = torch.where((top[:, 0].to(acc) == big_v) & (ids >= 0), ids + 1, 0)
    # m_b - M in the blocks' dtype (float64 for float64 inputs); an empty block (m_b = -inf, s_b = 0) or a row
    # without a finite M gets a finite stand-in whose exp is 0 and whose product with s_b = 0 is 0. A block
    # with a NaN or +inf logit has s_b NaN: it is counted and its row made NaN
    delta = (m - big_m.clamp(min=_FP32_MIN)[:, None]).clamp_(min=_FP32_MIN)
    r = torch.exp(delta)
    shift = INVARIANT_FRACTION_BITS
    sums = _fixed(s * r, shift, words)
    if t is not None:
        sums += _fixed(r * (t + delta * s), shift, words)
    nan_count = torch.isnan(s).sum(1)
    flags = None
    if sum_y is not None:
        y64 = sum_y.double()
        nan_count += torch.isnan(y64).sum(1)
        # below 2**exponent; the blocks (at most INVARIANT_MAX_COLUMNS of them) then sum below 2**62
        exponent = torch.frexp(maxes[:, 1].double()).exponent.to(torch.int64)[:, None]
        y_shift = (62 - 24) - exponent
        sums += _fixed(torch.where(torch.isfinite(y64), y64, 0.0), y_shift, words)
        flags = (y64 == float("inf")).sum(1) + ((y64 == float("-inf")).sum(1) << _INF_SHIFT)
    if acc == torch.float32:  # the target's 32 bits and the NaN count share a word (one rank owns the target)
        bits = blocks.target.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        packed = [bits + (nan_count << _NAN_SHIFT)]
    else:
        packed = [blocks.target.double().contiguous().view(torch.int64), nan_count]
    sent = [*sums, *packed, *([] if flags is None else [flags])]
    words_out = all_reduce_sum_(torch.cat([torch.stack(sent, dim=1), *([] if candidates is None else [candidates])], 1), group)
    cols = list(words_out[:, : len(sent)].unbind(1))
    total_s, cols = _unfixed(cols[:words], shift), cols[words:]
    total_t = None
    if t is not None:
        total_t, cols = _unfixed(cols[:words], shift), cols[words:]
    total_y = None
    if sum_y is not None:
        total_y, cols = _unfixed(cols[:words], y_shift[:, 0]), cols[words:]
    if acc == torch.float32:
        word = cols.pop(0)
        low = word & 0xFFFFFFFF
        low = torch.where(low >= 1 << 31, low - (1 << 32), low)  # the int32 the bits were
        target = low.to(torch.int32).view(torch.float32)
        nan_rows = (word >> _NAN_SHIFT) > 0
    else:
        target, nan_rows = cols.pop(0).view(torch.float64), cols.pop(0) > 0
    out = torch.zeros((rows, 5 if top is None else 8), dtype=acc, device=dev)
    out[:, 0], out[:, 1], out[:, 3] = big_m, total_s, target
    if top is not None:  # the partials' columns 6 and 7 (no sum of squares in this mode: column 5 stays 0)
        chosen = words_out[:, len(sent) :]
        lowest = torch.where(chosen > 0, chosen, torch.iinfo(torch.int64).max).amin(dim=1)
        out[:, 6] = big_v
        out[:, 7] = torch.where(lowest == torch.iinfo(torch.int64).max, -1, lowest - 1).to(acc)
    if total_t is not None:
        out[:, 2] = total_t
    if total_y is not None:
        flags_all = cols.pop(0)
        pos, neg = (flags_all & ((1 << _INF_SHIFT) - 1)) > 0, (flags_all >> _INF_SHIFT) > 0
        total_y = torch.where(pos, float("inf"), torch.where(neg, float("-inf"), total_y))
        out[:, 4] = torch.where(nan_rows | (pos & neg), float("nan"), total_y)
    out[:, 1:3].masked_fill_(nan_rows[:, None], float("nan"))
    return out


def resolve_shard(
    local_size: int,
    *,
    tp_group: ProcessGroup | None,
    vocab_start: int | None,
    vocab_size: int | None,
    device: torch.device,
    agree: dict[str, int | float] | None = None,
    label_stats: torch.Tensor | None = None,
    tensors: dict[str, torch.Tensor | None] | None = None,
    texts: dict[str, str] | None = None,
    block_align: int = 0,
) -> tuple[VocabShard, int]:
    """This rank's vocabulary shard, checked against every other rank's; returns ``(shard, max V_local)``.

    Under a TP group of more than one rank this makes the plan's ONE agreement all-gather
    (`lmloss.agreement.gather_plan`): each rank's `local_size`, `vocab_start` (and whether it was given),
    `vocab_size`, the values in `agree` (token count, chunk size, op, dtype, options), `texts` (the
    objective's options and the tensor arguments' dtypes and shapes, as hashes), `label_stats` (``[4]``
    int64 on the device, `lmloss._validate.label_stats`) and the fingerprints of `tensors`. A rank that failed
    a local check (`lmloss.agreement.errors_raised_on_every_rank`), any disagreement, a label outside the
    vocabulary or different labels or tensors on any rank raise the same `RankAgreementError` on every rank,
    naming the argument and each rank's value. With the checks agreed off
    (`lmloss.agreement.rank_checks_enabled`) even shards need no gather: then an uneven shard is caught only
    where its own width cannot cover `vocab_size`. `block_align` (the invariant mode's block,
    `lmloss.kernels.INVARIANT_BLOCK`; 0: none): every rank's shard must start at a multiple of it.
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
    if not will_gather(tp_group, vocab_start):
        if vocab_size is not None and vocab_size > world * local_size:
            raise ValueError(
                f"vocab_size={vocab_size} is more than {world} shards of this rank's V_local={local_size} "
                f"columns: with LMLOSS_CHECK_RANKS=0 and no vocab_start the shards are taken to be even; "
                f"uneven shards need vocab_start on every rank"
            )
        _check_block_starts([r * local_size for r in range(world)], block_align)
        return _shard(rank * local_size, local_size, world * local_size, vocab_size), local_size
    fields = dict(
        agree or {}, V_local=local_size, vocab_start_given=int(vocab_start is not None),
        vocab_start=vocab_start or 0, vocab_size=-1 if vocab_size is None else vocab_size,
    )  # fmt: skip
    ranks = gather_plan(tp_group, fields, device=device, label_stats=label_stats, tensors=tensors, texts=texts)
    sizes = [r["V_local"] for r in ranks]
    if any(n == 0 for n in sizes):
        raise RankAgreementError(
            f"a TP rank has 0 vocabulary columns (V_local per rank: {sizes}); every shard needs one"
        )
    if vocab_start is None:
        if len(set(sizes)) > 1:
            raise RankAgreementError(
                f"the vocabulary shards are uneven (V_local per rank: {sizes}): pass vocab_start on every "
                f"rank, the global id of its first column"
            )
        start, total = rank * local_size, world * local_size
    else:
        start, total = vocab_start, _tile([(r["vocab_start"], r["V_local"]) for r in ranks])
    starts = [r["vocab_start"] for r in ranks] if vocab_start is not None else [i * local_size for i in range(world)]
    try:
        _check_block_starts(starts, block_align)
    except ValueError as error:  # agreed values: every rank raises it
        raise RankAgreementError(str(error)) from None
    shard = _shard(start, local_size, total, vocab_size)  # from agreed values: raises on every rank or none
    bad = {i: (r["label_min"], r["label_max"]) for i, r in enumerate(ranks)}
    bad = {i: b for i, b in bad.items() if b[0] < 0 or b[1] >= shard.vocab_size}
    if bad:
        raise RankAgreementError(
            f"labels must be in [0, {shard.vocab_size}) or ignore_index; (min, max) label on the TP ranks "
            f"that have one outside: {bad}"
        )
    check_plan_tensors(ranks)
    return shard, max(sizes)


def _check_block_starts(starts: list[int], block: int) -> None:
    if block and any(start % block for start in starts):
        raise ValueError(
            f"invariant=True needs every TP shard to start at a multiple of {block} columns (its vocabulary "
            f"blocks must line up with the shards; pad the vocabulary as Megatron does, to a multiple of {block} "
            f"x TP); first column per rank: {starts}"
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
