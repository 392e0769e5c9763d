"""Training statistics reduced over the right process group, the same whatever the CP size.

Under context parallelism each rank holds a slice of every sequence, so any statistic computed from a
rank's local tokens alone is wrong: counts come out ``cp_size`` times too small, per-token means are
means of means, and a per-sequence quantity (perplexity) mixes partial sequences. `StatsTracker` records
local *sums and counts* only and divides after the all-reduce, so a statistic depends on the global batch
alone, not on how it was split.

Typical use on a CP rank (``local`` from `lmloss.cp.split_batch`, ``dp_cp`` = the DP x CP group)::

    tracker = StatsTracker(group=dp_cp)
    tracker.denominator("n_tokens", local["token_mask"])
    tracker.denominator("n_valid_tokens", local["loss_mask"])
    tracker.stat("loss", per_token_loss, denominator="n_valid_tokens")
    tracker.perplexity("ppl", logprobs, mask=local["loss_mask"], sequence_ids=local["sequence_ids"],
                       num_sequences=batch.num_sequences, cp_group=cp)
    stats = tracker.export()   # same dict of floats on every rank

Every rank of a group must record the same keys (with empty tensors if it has no tokens): `export` issues
collectives per group.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from lmloss import _validate

ProcessGroup = dist.ProcessGroup

REDUCES = ("sum", "mean", "max", "min")

__all__ = ["StatsTracker"]


class _Default:
    def __repr__(self) -> str:
        return "<tracker default group>"


_DEFAULT = _Default()


@dataclasses.dataclass
class _Denominator:
    mask: torch.Tensor
    count: torch.Tensor  # accumulated over calls, local
    group: ProcessGroup | None


@dataclasses.dataclass
class _Stat:
    total: torch.Tensor
    count: torch.Tensor
    group: ProcessGroup | None


@dataclasses.dataclass
class _Scalar:
    value: torch.Tensor  # sum (sum / mean) or running extreme (max / min)
    n: int
    reduce: str
    group: ProcessGroup | None


@dataclasses.dataclass
class _Sequences:
    per_seq: list[torch.Tensor]  # each float64 [B, 2]: (sum of logprobs, valid tokens), local to this CP rank
    cp_group: ProcessGroup | None
    group: ProcessGroup | None
    count_key: str | None


def _ranks(group: ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of `group`; for None, this process alone."""
    if group is None:
        return (dist.get_rank(),) if dist.is_initialized() else (0,)
    return tuple(dist.get_process_group_ranks(group))


def _device(group: ProcessGroup | None) -> torch.device:
    if group is not None and "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _ordered(groups: Iterable[ProcessGroup | None]) -> list[ProcessGroup | None]:
    """Distinct groups in one order every rank agrees on (by member ranks), so collectives over
    overlapping groups cannot wait on each other in a cycle."""
    seen: dict[tuple[int, ...], ProcessGroup | None] = {}
    for g in groups:
        seen.setdefault(_ranks(g) if g is not None else (), g)
    return [seen[k] for k in sorted(seen)]


class StatsTracker:
    """Accumulates per-token statistics, per-sequence perplexity and scalars; `export` reduces them.

    Every key names its reduce group (default: the tracker's `group`). A group should hold each piece of
    data once: DP x CP for per-token values, never TP ranks that duplicate them. ``None`` means no
    communication. Recording never synchronises with the device; `export` does (one host copy).

    Repeated calls with the same key accumulate (micro-batches): token statistics weight every token
    equally, scalars average or extreme over every call on every rank.
    """

    def __init__(self, group: ProcessGroup | None = None) -> None:
        _validate.check_group("group", group)
        self.group = group
        self._denominators: dict[str, _Denominator] = {}
        self._stats: dict[str, _Stat] = {}
        self._scalars: dict[str, _Scalar] = {}
        self._sequences: dict[str, _Sequences] = {}

    # -- recording -----------------------------------------------------------------------------------
    def _group(self, group: object) -> ProcessGroup | None:
        if group is _DEFAULT:
            return self.group
        _validate.check_group("group", group)
        return group

    def _check_new_key(self, key: str, kind: dict) -> None:
        for other in (self._denominators, self._stats, self._scalars, self._sequences):
            if other is not kind and key in other:
                raise ValueError(f"key {key!r} is already recorded as another kind of statistic")
        if key in {s.count_key for s in self._sequences.values()}:
            raise ValueError(f"key {key!r} is already used as a perplexity count_key")

    def denominator(
        self, name: str, mask: torch.Tensor, *, group: ProcessGroup | None | _Default = _DEFAULT
    ) -> None:
        """Register the token mask `name` (bool ``[...]``) that `stat` divides by.

        Its count of True entries is also exported under `name`, summed over `group` and over calls
        (e.g. ``"n_tokens"`` with the real-token mask, ``"n_valid_tokens"`` with the loss mask).
        """
        self._check_new_key(name, self._denominators)
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask of {name!r} must be a torch.Tensor, got {type(mask).__name__}")
        mask = mask.bool()
        count = mask.sum(dtype=torch.float64)
        group = self._group(group)
        if name in self._denominators:
            prev = self._denominators[name]
            if _ranks(prev.group) != _ranks(group):
                raise ValueError(f"denominator {name!r} was recorded before with another group")
            count = prev.count + count.to(prev.count.device)
        self._denominators[name] = _Denominator(mask, count, group)

    def stat(
        self,
        key: str,
        values: torch.Tensor,
        *,
        denominator: str,
        group: ProcessGroup | None | _Default = _DEFAULT,
    ) -> None:
        """Record the mean of `values` over the tokens of the latest `denominator` mask.

        `values` has the mask's shape (any float dtype; summed in fp64; masked-out entries are ignored
        even if NaN). Exported: ``sum(values[mask]) / count(mask)``, both summed over `group` (default:
        the denominator's group) and over calls; NaN when the count is 0.
        """
        self._check_new_key(key, self._stats)
        if denominator not in self._denominators:
            raise KeyError(f"denominator {denominator!r} is not registered; call tracker.denominator() first")
        den = self._denominators[denominator]
        if not isinstance(values, torch.Tensor) or values.shape != den.mask.shape:
            shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(
                f"values of {key!r} have shape {shape}, denominator {denominator!r} has "
                f"{tuple(den.mask.shape)}"
            )
        mask = den.mask.to(values.device)
        total = torch.where(mask, values.detach().double(), 0.0).sum()
        count = mask.sum(dtype=torch.float64)
        group = den.group if group is _DEFAULT else group
        if key in self._stats:
            prev = self._stats[key]
            if _ranks(prev.group) != _ranks(group):
                raise ValueError(f"stat {key!r} was recorded before with another group")
            total, count = prev.total + total.to(prev.total.device), prev.count + count.to(prev.count.device)
        self._stats[key] = _Stat(total, count, group)

    def scalar(
        self,
        key: str,
        value: float | torch.Tensor,
        *,
        reduce: str = "mean",
        group: ProcessGroup | None | _Default = _DEFAULT,
    ) -> None:
        """Record one number per call: exported as the sum, mean, max or min over calls and `group` ranks.

        For a loss from ``cross_entropy(..., reduction="mean", mean_group=g)`` (each rank's *share* of the
        global mean) use ``reduce="sum", group=g``.
        """
        self._check_new_key(key, self._scalars)
        if reduce not in REDUCES:
            raise ValueError(f"reduce must be one of {REDUCES}, got {reduce!r}")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"scalar {key!r} must have one element, got shape {tuple(value.shape)}")
            v = value.detach().reshape(()).double()
        else:
            v = torch.tensor(float(value), dtype=torch.float64)
        group = self._group(group)
        if key in self._scalars:
            prev = self._scalars[key]
            if prev.reduce != reduce or _ranks(prev.group) != _ranks(group):
                raise ValueError(f"scalar {key!r} was recorded before with another reduce or group")
            v = v.to(prev.value.device)
            combine = {"max": torch.maximum, "min": torch.minimum}.get(reduce, torch.add)
            self._scalars[key] = _Scalar(combine(prev.value, v), prev.n + 1, reduce, group)
        else:
            self._scalars[key] = _Scalar(v, 1, reduce, group)

    def perplexity(
        self,
        key: str,
        logprobs: torch.Tensor,
        *,
        mask: torch.Tensor,
        sequence_ids: torch.Tensor,
        num_sequences: int,
        cp_group: ProcessGroup | None = None,
        group: ProcessGroup | None | _Default = _DEFAULT,
        count_key: str | None = None,
    ) -> None:
        """Record per-sequence perplexity: the mean over sequences of ``exp(-mean logprob of its tokens)``.

        Args:
            logprobs: float ``[T_local]``, log-prob of each local position's label.
            mask: bool ``[T_local]``, which positions count (the loss mask).
            sequence_ids: int ``[T_local]``, each position's sequence index in the packed batch
                (``split_batch(...)["sequence_ids"]``), in ``[0, num_sequences)``.
            num_sequences: ``B``, the number of sequences in this rank's packed batch.
            cp_group: the group that splits each sequence. A sequence's tokens are spread over it, so
                its (sum of logprobs, token count) is summed over `cp_group` *before* the exponential;
                averaging per-rank perplexities instead would be wrong (exp is not linear).
            group: the group over which sequences are averaged (DP, or DP x CP; default: the tracker's).
            count_key: also export the number of sequences averaged (those with a valid token) under
                this key.

        Export: per sequence, the ``[B, 2]`` sums are all-reduced over `cp_group`; sequences without a
        valid token are skipped; then (sum of perplexities, number of sequences) is summed over `group`.
        After the CP reduction every CP rank holds the same sequences, so to count each sequence once
        only the lowest global rank of ``cp_group ∩ group`` contributes: this is exact both when `group`
        is the DP group (the intersection is the rank itself) and when it is DP x CP. Repeated calls add
        more sequences (micro-batches). NaN when no sequence has a valid token.
        """
        _validate.check_group("cp_group", cp_group)
        self._check_new_key(key, self._sequences)
        if count_key is not None and key not in self._sequences:
            if count_key == key:
                raise ValueError(f"count_key {count_key!r} must differ from the perplexity key")
            self._check_new_key(count_key, {})
        if logprobs.shape != mask.shape or logprobs.shape != sequence_ids.shape or logprobs.dim() != 1:
            raise ValueError(
                f"logprobs {tuple(logprobs.shape)}, mask {tuple(mask.shape)} and sequence_ids "
                f"{tuple(sequence_ids.shape)} must be the same 1-D shape"
            )
        mask = mask.to(logprobs.device).bool()
        per_seq = torch.zeros((num_sequences, 2), dtype=torch.float64, device=logprobs.device)
        ids = sequence_ids.to(logprobs.device).long()
        per_seq[:, 0].index_add_(0, ids, torch.where(mask, logprobs.detach().double(), 0.0))
        per_seq[:, 1].index_add_(0, ids, mask.double())
        group = self._group(group)
        if key in self._sequences:
            prev = self._sequences[key]
            if (
                _ranks(prev.group) != _ranks(group)
                or _ranks(prev.cp_group) != _ranks(cp_group)
                or prev.count_key != count_key
            ):
                raise ValueError(f"perplexity {key!r} was recorded before with other groups or count_key")
            prev.per_seq.append(per_seq)
        else:
            self._sequences[key] = _Sequences([per_seq], cp_group, group, count_key)

    # -- reduction -----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything recorded."""
        self._denominators.clear()
        self._stats.clear()
        self._scalars.clear()
        self._sequences.clear()

    def export(self, *, reset: bool = True) -> dict[str, float]:
        """All-reduce everything recorded and return ``{key: float}``, the same on every rank of a group.

        Collectives: one SUM over each distinct `cp_group` of the perplexity keys, then per distinct
        reduce group one SUM (and one MAX if a max/min scalar uses it). Groups are visited in an order
        every rank agrees on (by their member ranks).
        """
        me = _ranks(None)[0]
        # 1) per-sequence sums over each CP group, so every CP rank sees whole sequences
        seq_keys = sorted(self._sequences)
        ppl_parts: dict[str, tuple[torch.Tensor, ProcessGroup | None]] = {}
        for cp in _ordered(self._sequences[k].cp_group for k in seq_keys):
            keys = [k for k in seq_keys if _ranks(self._sequences[k].cp_group) == _ranks(cp)]
            flat = [torch.cat(self._sequences[k].per_seq).to(_device(cp)) for k in keys]
            buf = torch.cat(flat)
            if cp is not None:
                dist.all_reduce(buf, group=cp)
            for k, part in zip(keys, buf.split([f.shape[0] for f in flat])):
                ppl_parts[k] = (part, self._sequences[k].cp_group)

        # 2) per reduce group: a SUM of (numerator, denominator) pairs and a MAX of extremes
        sums: dict[tuple[int, ...], list[tuple[str, torch.Tensor]]] = {}
        maxes: dict[tuple[int, ...], list[tuple[str, torch.Tensor]]] = {}
        groups: dict[tuple[int, ...], ProcessGroup | None] = {}

        def add(target: dict, key: str, group: ProcessGroup | None, *values: torch.Tensor) -> None:
            gk = _ranks(group) if group is not None else ()
            groups.setdefault(gk, group)
            dev = _device(group)
            target.setdefault(gk, []).append((key, torch.stack([v.double().to(dev) for v in values])))

        for k in sorted(self._denominators):
            d = self._denominators[k]
            add(sums, k, d.group, d.count)
        for k in sorted(self._stats):
            s = self._stats[k]
            add(sums, k, s.group, s.total, s.count)
        for k in sorted(self._scalars):
            s = self._scalars[k]
            if s.reduce == "max":
                add(maxes, k, s.group, s.value)
            elif s.reduce == "min":
                add(maxes, k, s.group, -s.value)
            else:
                add(sums, k, s.group, s.value, torch.tensor(float(s.n), dtype=torch.float64))
        for k in sorted(ppl_parts):
            part, cp = ppl_parts[k]
            group = self._sequences[k].group
            present = part[:, 1] > 0
            ppl = torch.exp(-part[present, 0] / part[present, 1])
            shared = set(_ranks(cp)) & set(_ranks(group))
            if me == min(shared):
                add(sums, k, group, ppl.sum(), torch.tensor(float(ppl.numel()), dtype=torch.float64))
            else:
                add(
                    sums, k, group, torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
                )

        out: dict[str, float] = {}
        for gk in sorted(groups):
            group = groups[gk]
            for target, op in ((sums, dist.ReduceOp.SUM), (maxes, dist.ReduceOp.MAX)):
                entries = target.get(gk)
                if not entries:
                    continue
                sizes = [v.numel() for _, v in entries]
                buf = torch.cat([v for _, v in entries])
                if group is not None:
                    dist.all_reduce(buf, op=op, group=group)
                for (k, _), v in zip(entries, buf.cpu().split(sizes)):
                    out[k] = self._finish(k, v.tolist())
                    if k in self._sequences and self._sequences[k].count_key is not None:
                        out[self._sequences[k].count_key] = v[1].item()
        if reset:
            self.reset()
        return dict(sorted(out.items()))

    def _finish(self, key: str, v: list[float]) -> float:
        if key in self._denominators:
            return v[0]
        if key in self._scalars:
            s = self._scalars[key]
            if s.reduce == "max":
                return v[0]
            if s.reduce == "min":
                return -v[0]
            return v[0] if s.reduce == "sum" else v[0] / v[1]
        return v[0] / v[1] if v[1] > 0 else math.nan
