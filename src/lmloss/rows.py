"""Which token rows an op computes, and the chunks of the one chunk loop that cover them.

A row *counts* when its label is not ``ignore_index`` (and, for ops that take one, its ``mask`` is set):
prompts, tool outputs and padding do not. The plan (`lmloss.plan.make_plan`) finds the rows that count
once, from labels every TP rank agreed on, so that every rank walks the same chunks and issues the same
collectives. Rows that do not count take no matmul and no softmax pass: no chunk holds them, their
outputs are 0 and their gradient rows are exactly 0 (the sinks write them, `RowSelection.zero_skipped_`).

A chunk is a `Rows`: the op's rows ``[start, end)`` when they are contiguous (a view of the inputs, no
copy), or a gathered set given by an index. Sources that can gather cheaply (hidden rows: ``[c, H]`` next
to a ``[c, V]`` matmul) take the counting rows in order, ``chunk_rows`` at a time; sources that cannot
(logits: a gather is a copy of the whole chunk) take slices: the runs of counting rows, joined across
short gaps, whose rows are then computed and masked (the objectives give a row that does not count 0
outputs and exactly 0 gradient whether or not it was computed).
"""

from __future__ import annotations

import dataclasses

import torch

#: Sources that slice (logits: a gather would copy the whole chunk) skip gaps of at least this many rows that
#: do not count; shorter gaps are computed with the runs around them and masked (a chunk boundary costs a
#: few kernel launches and collectives). On a GPU a chunk costs more: a launch's host time, and a chunk of a
#: few hundred rows leaves most of the SMs idle (one row per program); there, only gaps of at least a chunk
#: (`min_gap`) are skipped.
MIN_GAP = 64
#: ... and of at least this many logits (rows times the widest shard's columns): a chunk boundary costs about
#: 0.18 ms on this project's 2-core CPU, what ~70,000 logits cost forward and backward (2.5 ns each). Measured
#: (``token_logprobs`` of 16384 rows, the first 256 of every 512 ignored, against none, when every such gap was
#: skipped): 3.89x the time at 8 columns, 2.53x at 64, 1.29x at 256, 0.77x at 1024, 0.52x at 32000.
GAP_LOGITS = 2**17


def min_gap(device: torch.device, chunk_rows: int, row_width: int = 0) -> int:
    """The shortest gap of rows that do not count which a slicing source skips: `MIN_GAP` rows and, for rows of
    `row_width` logits (0: unknown), `GAP_LOGITS` logits; on a GPU at least `chunk_rows` too (measured on an
    H200, ``token_logprobs`` over ``[32768, 128256]`` bf16 logits with the first 256 of every 512 rows ignored
    took 2.75x the time with none ignored when every such gap was skipped, in chunks of 256 rows)."""
    rows = max(MIN_GAP, -(-GAP_LOGITS // row_width) if row_width > 0 else 0)
    return rows if device.type == "cpu" else max(rows, chunk_rows)


@dataclasses.dataclass(frozen=True, eq=False)
class Rows:
    """One chunk's rows of an op's ``[N, ...]`` tensors: ``[start, end)`` when `index` is None, else the rows
    `index` names (int64 ``[c]`` on the op's device, increasing, within ``[start, end)``)."""

    start: int
    end: int
    index: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return self.end - self.start if self.index is None else self.index.shape[0]

    @property
    def contiguous(self) -> bool:
        return self.index is None

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """These rows of `t` (``[N, ...]``): a view when contiguous, else a gathered copy."""
        return t[self.start : self.end] if self.index is None else t.index_select(0, self.index)

    def put_(self, dst: torch.Tensor, values: torch.Tensor) -> None:
        """``dst[these rows] = values``."""
        if self.index is None:
            dst[self.start : self.end] = values
        else:
            dst.index_copy_(0, self.index, values.to(dst.dtype))


@dataclasses.dataclass(frozen=True, eq=False)
class RowSelection:
    """The rows of an ``N``-row op that count: `index` int64 ``[n_count]`` on the op's device and
    `index_host` the same on the host (increasing); `starts` / `ends` the host runs of consecutive rows;
    `row_width` the logits of a row on the widest shard (agreed; 0: unknown), which sets the gaps a slicing
    source skips (`min_gap`)."""

    n: int
    index: torch.Tensor
    index_host: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    row_width: int = 0

    @property
    def count(self) -> int:
        return self.index.shape[0]

    @staticmethod
    def of(counting: torch.Tensor, row_width: int = 0) -> RowSelection | None:
        """The selection of a bool ``[N]`` mask, or None when every row counts (one host sync)."""
        flags = counting.detach().to("cpu", torch.bool)
        if bool(flags.all()):
            return None
        index_host = flags.nonzero().squeeze(1)
        if index_host.numel() == 0:
            starts = ends = index_host
        else:
            breaks = (index_host[1:] - index_host[:-1] != 1).nonzero().squeeze(1) + 1
            starts = torch.cat([index_host[:1], index_host[breaks]])
            ends = torch.cat([index_host[breaks - 1], index_host[-1:]]) + 1
        return RowSelection(flags.shape[0], index_host.to(counting.device), index_host, starts, ends, row_width)

    def chunks(self, chunk_rows: int, *, gather: bool) -> list[Rows]:
        """The chunks covering the counting rows, at most `chunk_rows` each. With `gather` (sources for
        which a gather is cheap), the counting rows in order, ``chunk_rows`` at a time (slices where they
        happen to be contiguous). Without, only slices: the runs, joined across gaps shorter than
        `min_gap` rows (whose rows are then computed and masked: 0 outputs, 0 gradient), cut every
        `chunk_rows` rows."""
        step = max(chunk_rows, 1)
        if gather:
            positions = torch.arange(self.count)
            return [self._gathered(positions[s : s + step]) for s in range(0, self.count, step)]
        if self.starts.numel() == 0:
            return []
        joined = self._skipped_inner_gaps(self.index.device, step)
        first = torch.cat([torch.ones(1, dtype=torch.bool), joined])
        last = torch.cat([joined, torch.ones(1, dtype=torch.bool)])
        out: list[Rows] = []
        for start, end in zip(self.starts[first].tolist(), self.ends[last].tolist()):
            out.extend(Rows(s, min(s + step, end)) for s in range(start, end, step))
        return out

    def _gathered(self, positions: torch.Tensor) -> Rows:
        """The chunk of the counting rows at these positions of `index` (host, increasing)."""
        first, last = int(positions[0]), int(positions[-1])
        start, end = int(self.index_host[first]), int(self.index_host[last]) + 1
        if end - start == positions.numel():  # consecutive rows: a slice
            return Rows(start, end)
        if last - first + 1 == positions.numel():  # consecutive positions: a view of the index
            return Rows(start, end, self.index[first : last + 1])
        return Rows(start, end, self.index_host[positions].to(self.index.device))

    def _skipped_inner_gaps(self, device: torch.device, chunk_rows: int) -> torch.Tensor:
        """bool ``[runs - 1]``: which gaps between consecutive runs a slicing source's chunks of `chunk_rows`
        skip (`min_gap`); the others are computed with the runs around them. The chunks and the sink's zeroing
        read this one rule."""
        return (self.starts[1:] - self.ends[:-1]) >= min_gap(device, max(chunk_rows, 1), self.row_width)

    def zero_skipped_(self, t: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
        """Write 0 into the rows of `t` (``[N, ...]``) that no chunk holds: every row that does not count, or,
        for a slicing source's chunks of `chunk_rows` (`chunks` without `gather`), the gaps it skips (the
        rows of a shorter gap are computed and given 0 by the kernels: writing them twice would cost a pass
        over them)."""
        gaps_start = torch.cat([torch.zeros(1, dtype=torch.int64), self.ends])
        gaps_end = torch.cat([self.starts, torch.full((1,), self.n, dtype=torch.int64)])
        skipped = gaps_end > gaps_start
        if chunk_rows is not None:  # a slice computes the inner gaps it does not skip
            skipped[1:-1] &= self._skipped_inner_gaps(t.device, chunk_rows)
        starts, ends = gaps_start[skipped], gaps_end[skipped]
        if starts.numel() > (MIN_GAP if t.device.type == "cpu" else 2):  # many gaps (a GPU: launches): one fill
            edges = torch.zeros(self.n + 1, dtype=torch.int64)  # +1 where a gap starts, -1 where it ends
            edges.index_add_(0, starts, torch.ones_like(starts))
            edges.index_add_(0, ends, -torch.ones_like(ends))
            rows = edges[:-1].cumsum(0).nonzero().squeeze(1)
            return t.index_fill_(0, rows.to(t.device), 0)
        for a, b in zip(starts.tolist(), ends.tolist()):
            t[a:b].zero_()
        return t


def all_rows(n: int, chunk_rows: int | None) -> list[Rows]:
    """Contiguous chunks of `chunk_rows` (None: one chunk) covering ``[0, n)``."""
    step = max(n if chunk_rows is None else chunk_rows, 1)
    return [Rows(s, min(s + step, n)) for s in range(0, n, step)]
