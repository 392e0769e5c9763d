"""Chunk sources, gradient sinks and heads: what the one chunk loop (`lmloss.plan`) reads and writes.

A *chunk source* ``source(s, e) -> x [c, V_local]`` yields the logits of tokens ``[s, e)``: a slice of the
logits (`LogitRows`) or the LM head's matmul of hidden rows (`HiddenRows`); `lmloss.replay` adds the
replayed support's slots. ``source.owns_chunks`` says whether the chunk is the caller's scratch (the
kernels may overwrite it).

A *gradient sink* receives each chunk's gradient: ``sink.buffer(s, e, x)`` says where the kernel writes it
and ``sink.consume(s, e, g)`` takes it from there: a ``[N, V_local]`` buffer (`BufferSink`), the logits
themselves (`InPlaceSink`), or the fp32 accumulators of the hidden / weight / bias gradients
(`Accumulators`, which chain the chunk's d-logits through the matmuls).

A *head* is what an op differentiates: `LogitsHead` (the logits) or `LinearHead` (hidden states, weight,
bias). It gives a pass its source and sink (sharing one scratch) and turns the sink into the leaves'
gradients. The loss Functions (`lmloss.functions`) run any head through the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os

import torch

from lmloss.kernels import ChunkScratch, scale_, scaled_cast
from lmloss.kernels.torch_ref import one_thread
from lmloss.rows import Rows, RowSelection
from lmloss.vocab_parallel import ProcessGroup, all_reduce_sum_, gather_rows, reduce_scatter_rows, world_size

#: The memory budget (MiB) of an op: what it may allocate beyond its inputs and their gradients (chunks,
#: scratch, accumulators). Override with ``LMLOSS_CHUNK_BUDGET_MIB`` or an op's ``memory_budget_mib=``.
#: CUDA's covers a 128k x 4k bf16 head's fp32 weight-gradient accumulator (2 GiB) beside one chunk of 8192
#: tokens: at that shape the fastest schedule; a smaller budget, or a larger head, takes the weight pass.
DEFAULT_CHUNK_BUDGET_MIB = {"cpu": 64, "cuda": 4096}
#: A larger budget is taken as this one (1 EiB: more than any device holds), so that its bytes stay finite
#: (``1e308`` MiB is ``inf`` bytes, whose rows per chunk are NaN).
MAX_CHUNK_BUDGET_MIB = float(2**40)


def check_memory_budget(memory_budget_mib: object) -> None:
    """``memory_budget_mib``: None (the default budget) or a positive, finite number of MiB."""
    if memory_budget_mib is None:
        return
    ok = isinstance(memory_budget_mib, (int, float)) and not isinstance(memory_budget_mib, bool)
    if not ok or not 0 < memory_budget_mib < math.inf:
        raise ValueError(f"memory_budget_mib must be None or a positive number of MiB, got {memory_budget_mib!r}")


def chunk_budget_mib(device: torch.device | str = "cpu", memory_budget_mib: float | None = None) -> float:
    """The op's memory budget in MiB: `memory_budget_mib` if given, else ``LMLOSS_CHUNK_BUDGET_MIB`` if set (a
    positive number), else `DEFAULT_CHUNK_BUDGET_MIB` for the device type; at most `MAX_CHUNK_BUDGET_MIB`. Read before the TP ranks'
    agreement gather, which carries it: ranks with different budgets would cut different chunks and issue
    different collectives."""
    if memory_budget_mib is not None:
        check_memory_budget(memory_budget_mib)
        return float(min(memory_budget_mib, MAX_CHUNK_BUDGET_MIB))
    text = os.environ.get("LMLOSS_CHUNK_BUDGET_MIB")
    if text is None:
        return float(DEFAULT_CHUNK_BUDGET_MIB.get(torch.device(device).type, 96))
    try:
        budget = float(text)
    except ValueError:
        budget = math.nan
    if not 0 < budget < math.inf:
        raise ValueError(f"LMLOSS_CHUNK_BUDGET_MIB must be a positive number of MiB, got {text!r}")
    return min(budget, MAX_CHUNK_BUDGET_MIB)


#: The fewest tokens per chunk a budget must hold (or every token that counts, when fewer do): below that
#: the op is refused (`MemoryBudgetError`) rather than run in chunks of a few rows, each of which re-reads the
#: whole head (a 1-row chunk per token took minutes where a budget of a few hundred KiB took a second).
MIN_CHUNK_ROWS = 8
#: The narrowest block of columns a weight pass takes (or the whole shard): a smaller budget is refused.
MIN_FLOOR_COLUMNS = 128


class MemoryBudgetError(ValueError):
    """A memory budget below the smallest one the call can honour. ``floor_mib``: that smallest budget (MiB,
    rounded up to 0.001 MiB: the call runs within it)."""

    def __init__(self, budget_mib: float, floor_bytes: float, what: str) -> None:
        self.budget_mib = budget_mib
        self.floor_mib = math.ceil(floor_bytes / 2**20 * 1000) / 1000
        floor = f"{self.floor_mib:.3f}".rstrip("0").rstrip(".")  # rounded up: the call runs within it
        super().__init__(
            f"memory_budget_mib: a budget of {budget_mib:.4g} MiB is below the smallest this call can honour, "
            f"{floor} MiB ({what}); pass memory_budget_mib={floor} or more (the budget is memory_budget_mib=, "
            "else LMLOSS_CHUNK_BUDGET_MIB, else the device's default)"
        )


def auto_chunk_size(
    n_tokens: int,
    local_vocab: int,
    device: torch.device | str = "cpu",
    bytes_per_logit: float = 8,
    *,
    budget_mib: float | None = None,
    bytes_per_row: float = 0,
) -> int:
    """Tokens per chunk for ``chunk_size="auto"``: as many as fit the op's per-chunk working set
    (``bytes_per_logit`` per logit, plus ``bytes_per_row`` per token; no bytes at all: one chunk) in the
    budget (`chunk_budget_mib` by default: 64 MiB on CPU, 4 GiB on CUDA). Rounded down to a multiple of 64
    (matmul-friendly) when >= 64; at most `n_tokens`. A budget that holds fewer than `MIN_CHUNK_ROWS` rows (or
    all of them) raises `MemoryBudgetError`, naming the smallest budget that does."""
    if bytes_per_logit <= 0 and bytes_per_row <= 0:
        return max(n_tokens, 1)
    budget_mib = chunk_budget_mib(device) if budget_mib is None else budget_mib
    row_bytes = bytes_per_logit * max(local_vocab, 1) + bytes_per_row
    floor_rows = min(max(n_tokens, 1), MIN_CHUNK_ROWS)
    if budget_mib * 2**20 < floor_rows * row_bytes:
        raise MemoryBudgetError(
            budget_mib, floor_rows * row_bytes, f"chunks of {floor_rows} tokens over {local_vocab} columns"
        )
    return _rows_in(budget_mib * 2**20, row_bytes, n_tokens)


def _rows_in(budget_bytes: float, row_bytes: float, n_rows: int) -> int:
    """Rows of `row_bytes` that fit `budget_bytes`: a multiple of 64 when >= 64 (rounded down), at least 1, at
    most `n_rows`."""
    rows = int(max(budget_bytes, 0) // max(row_bytes, 1))
    if rows >= 64:
        rows -= rows % 64
    return max(1, min(rows, max(n_rows, 1)))


# ----------------------------------------------------------------------------------------------------------
# the fused head's schedule under the budget

#: The token pass keeps the fp32 weight-gradient accumulator (of the whole shard, or of its first columns) only
#: beside chunks of at least this many tokens (or all of them): smaller chunks re-read the weight (and the
#: accumulator) too often, and the weight pass (4 matmuls of full size instead of 3) is faster.
MIN_ACCUMULATE_ROWS = {"cpu": 64, "cuda": 512}
#: The weight pass's blocks of columns are at least this wide (or the whole shard) where the budget allows,
#: a multiple of 128; a tight budget takes narrower ones, down to `MIN_FLOOR_COLUMNS`.
MIN_BLOCK_COLUMNS = 512
#: The fewest local columns worth an accumulator of their own beside a weight pass (`FusedSchedule.weight_start`).
MIN_ACCUMULATED_COLUMNS = 128
#: The most logits per chunk of a fused token pass on a CPU, whatever the budget (32 MiB of fp32): the budget's
#: 4-byte summed cross-entropy chunks (`lmloss.fused.SUMMED_BYTES_PER_LOGIT`) keep the footprint the 8-byte
#: ones had at the default 64 MiB (256 tokens of 32000 columns: 31.3 MiB), not measured slower
MAX_CHUNK_LOGITS = {"cpu": 2**23}


@dataclasses.dataclass(frozen=True)
class FusedSchedule:
    """How a fused head computes within its budget (`fused_schedule`).

    chunk_rows: tokens per chunk of the token pass (the forward, a per-token op's backward).
    weight_block: 0: the weight gradient accumulates over the token pass's chunks (in an fp32 ``[V_local, H]``
        accumulator for a bf16 / fp16 weight, unless one chunk holds every token: then it is written by one
        GEMM). Else the local columns per block of a *weight pass* that writes the weight gradient block by
        block, each from every token at once (`WeightBlocks`): no ``[V_local, H]`` buffer beyond the gradient.
    weight_block_rows: tokens per chunk of the weight pass.
    weight_start: with a weight pass, the local columns ``[0, weight_start)`` whose weight gradient still
        accumulates over the token pass's chunks (an fp32 ``[weight_start, H]`` accumulator, as much of the
        shard as the budget holds beside the chunks); the weight pass makes the others' only.
    """

    chunk_rows: int | None
    weight_block: int = 0
    weight_block_rows: int = 0
    weight_start: int = 0


def fused_schedule(
    *, n_rows: int, local_vocab: int, hidden_width: int, device: torch.device | str, budget_mib: float,
    bytes_per_logit: float, gather_bytes_per_row: float, accumulator_bytes: float, fixed_bytes: float,
    chunk_size: int | None | str, weight_tile_bytes: float = 0, bytes_per_row: float = 0, weight_pass: bool = True,
    min_rows: int = MIN_CHUNK_ROWS, block_bytes_per_logit: float | None = None, block_bytes_per_row: float = 0,
) -> FusedSchedule:  # fmt: skip
    """The fused head's schedule (`FusedSchedule`) for `n_rows` counting tokens and a `local_vocab` x
    `hidden_width` head within `budget_mib`, from agreed values only (every TP rank finds the same).

    Costs in bytes: `bytes_per_logit` of a chunk's working set per logit; `gather_bytes_per_row` per token
    of a chunk whose rows are gathered (``H`` of the hidden dtype); `bytes_per_row` more per token of the token
    pass (a kept-set search's bins, `lmloss.sampling.search_bytes`); `accumulator_bytes` the fp32 weight-
    gradient accumulator (0 when the weight's gradient needs none: an fp32 weight, a low-precision
    accumulator by request, no weight gradient); `fixed_bytes` what the op holds whatever its chunks (an fp32
    hidden-gradient sum under TP, a bias accumulator, gathered rows); `weight_tile_bytes` the fp32 tile of a
    weight gradient written from fp32 d-logits (`write_weight_gradient_`). `chunk_size`: an int fixes the token
    pass's chunk (the budget then decides only the weight gradient's schedule); None: one chunk; ``"auto"``:
    the budget. `weight_pass` False: the accumulator is the only way (a replayed support's scatter).
    `min_rows`: the fewest tokens per chunk (`MIN_CHUNK_ROWS`, an invariant GEMM tile's rows).
    `block_bytes_per_logit` (default `bytes_per_logit`) and `block_bytes_per_row` (more per token): a weight-pass
    tile's, whose d-logits are recomputed as a per-token backward's are (a summed loss's forward holds less).

    Where the accumulator does not fit beside chunks of `MIN_ACCUMULATE_ROWS`, the columns it does fit for
    keep it (`FusedSchedule.weight_start`) and only the others take the weight pass: the cost grows with
    the share of the vocabulary the budget cannot hold, not all at once. With ``"auto"`` a budget below the
    smallest schedule (chunks of `min_rows` tokens, weight-pass blocks of `MIN_FLOOR_COLUMNS` columns) raises
    `MemoryBudgetError` naming it.
    """
    budget = budget_mib * 2**20 - fixed_bytes
    width, n = max(local_vocab, 1), max(n_rows, 1)
    row_bytes = bytes_per_logit * width + gather_bytes_per_row + bytes_per_row
    useful = min(n, MIN_ACCUMULATE_ROWS.get(torch.device(device).type, 64))
    floor_rows = min(n, min_rows)
    cap = MAX_CHUNK_LOGITS.get(torch.device(device).type, 0) // width or n  # rows (0 logits: no cap)
    cap = max(floor_rows, cap - cap % 64 if cap >= 64 else cap)

    def rows_in(space):  # `_rows_in` of the token pass, at most `cap`
        return min(_rows_in(space, row_bytes, n_rows), cap)
    block_acc = 4 * hidden_width  # the fp32 block accumulator's bytes per column, when a block takes chunks
    block_logit = bytes_per_logit if block_bytes_per_logit is None else block_bytes_per_logit
    block_row = gather_bytes_per_row + block_bytes_per_row

    def tile_bytes(rows, cols):  # a weight-pass tile: its logits, gathered rows and block accumulator
        acc = cols * block_acc if rows < n else min(weight_tile_bytes, cols * block_acc)
        return rows * (cols * block_logit + block_row) + acc

    def fit(rows):  # chunks of whole `min_rows` (an invariant GEMM tile's rows) where it is more than the floor
        return rows if min_rows <= MIN_CHUNK_ROWS or rows >= n else max(floor_rows, rows - rows % min_rows)

    if chunk_size == "auto":
        floor, what = floor_rows * row_bytes, f"chunks of {floor_rows} tokens over {local_vocab} columns"
        narrow = min(width, MIN_FLOOR_COLUMNS)
        lean = max(floor, tile_bytes(floor_rows, narrow)) if weight_pass else math.inf  # the weight pass's floor
        if accumulator_bytes:
            with_acc = floor + accumulator_bytes
            if with_acc <= lean:
                floor, what = with_acc, what + f" beside the fp32 [{local_vocab}, {hidden_width}] weight-gradient accumulator"
            else:
                floor, what = lean, what + f", weight-pass blocks of {narrow} columns"
        one_chunk = (n if n < 64 else -(-n // 64) * 64) * row_bytes + weight_tile_bytes  # `_rows_in` rounds
        if one_chunk < floor:
            floor, what = one_chunk, f"one chunk of {n} tokens over {local_vocab} columns"
        if budget < floor:
            raise MemoryBudgetError(budget_mib, floor + fixed_bytes, what + (
                f" and {fixed_bytes / 2**20:.3g} MiB whatever the chunks" if fixed_bytes else ""))  # fmt: skip
        if rows_in(budget - weight_tile_bytes) >= n_rows:
            return FusedSchedule(max(n_rows, 1))  # one chunk holds every token: its weight gradient is one GEMM
        if not accumulator_bytes:
            return FusedSchedule(fit(rows_in(budget)))
        rows = fit(rows_in(budget - accumulator_bytes))
        if budget < lean or rows >= useful and rows * row_bytes + accumulator_bytes <= budget:
            return FusedSchedule(rows)  # the accumulator whole (no weight pass fits, or it is not needed)
        chunk = fit(useful if useful * row_bytes <= budget else rows_in(budget))
    elif chunk_size is None:
        return FusedSchedule(None)
    else:
        chunk = int(chunk_size)
        if not accumulator_bytes or not weight_pass or chunk >= n_rows or chunk * row_bytes + accumulator_bytes <= budget:
            return FusedSchedule(chunk)
    # an accumulator for the first columns the budget holds beside the chunks (rounded down to 128 columns)
    start = int(max(budget - chunk * row_bytes, 0) // block_acc)
    start -= start % 128
    start = start if start >= MIN_ACCUMULATED_COLUMNS else 0
    if start >= width:  # (an explicit chunk beside which the accumulator fits after all)
        return FusedSchedule(chunk)
    # the weight pass over the others: blocks of columns over as many tokens at once as fit (all if possible)
    rest = width - start
    narrow = min(rest, MIN_BLOCK_COLUMNS)
    floor_cols = min(rest, MIN_FLOOR_COLUMNS)
    if tile_bytes(n, narrow) <= budget:
        rows = n
        cols = (budget - rows * block_row - weight_tile_bytes) // max(rows * block_logit, 1)
        cols = int(min(rest, max(narrow, cols - cols % 128)))
    else:  # a block accumulator and some tokens: half the budget for each (a tiny budget: narrower blocks)
        cols = max(floor_cols, min(narrow, int(budget / 2 // block_acc)))
        rows = _rows_in(budget - cols * block_acc, cols * block_logit + block_row, n_rows)
        if rows < floor_rows:  # the half left too few tokens: fewer columns beside `floor_rows` of them
            rows = floor_rows
            cols = int(max(budget - rows * block_row, 0) // (rows * block_logit + block_acc))
            cols = max(floor_cols, min(narrow, cols - cols % 128 if cols >= 128 else cols))
    return FusedSchedule(chunk, max(cols, 1), rows, start)


#: The invariant mode's GEMM tile per device type, ``(rows, weight rows)``: every logit of a fused op is made by
#: a GEMM of exactly ``[rows, H] @ [H, weight rows]`` (`tiled_linear`), whatever the chunk, the batch or the
#: shard, so that the matmul library picks the same kernel for it every time. On this CPU library (oneDNN /
#: MKL) a GEMM of fewer than 64 rows takes another kernel and rounds differently; tiles of 128 rows cost
#: what one GEMM over the chunk costs (measured at 256 x 256 x 32000 fp32), 4096 columns keep the calls few.
#: The CUDA tile is a first guess, not measured (docs/invariant.md).
INVARIANT_GEMM_TILE = {"cpu": (128, 4096), "cuda": (256, 8192)}


def invariant_gemm_tile(device: torch.device | str) -> tuple[int, int]:
    """`INVARIANT_GEMM_TILE` for the device's type (the CPU's for any other)."""
    return INVARIANT_GEMM_TILE.get(torch.device(device).type, INVARIANT_GEMM_TILE["cpu"])


def invariant_tile_bytes(device: torch.device | str, hidden_width: int, itemsize: int) -> int:
    """What `tiled_linear` may hold beside a chunk: one output tile and zero-padded copies of a tile's hidden
    rows and weight rows (the floor of invariant mode's working set, whatever the budget)."""
    rows, cols = invariant_gemm_tile(device)
    return (rows * cols + (rows + cols) * (hidden_width + 1)) * itemsize


def _tile_starts(n: int, size: int) -> list[int]:
    """Starts of `size`-wide tiles covering ``[0, n)`` (``n >= size``), the last one ending at n (overlapping
    the one before it when size does not divide n)."""
    starts = list(range(0, n - size + 1, size))
    return starts if n % size == 0 else [*starts, n - size]


#: The CPU's invariant fp32 GEMMs sum the hidden dimension in chunks of this many columns (the last one shorter),
#: one GEMM each, added in order, so that no GEMM reduces more than 256 terms (with MKL a longer fp32 reduction
#: rounded differently under another thread count: H = 4096, the 128-row tile between 1 and 2 threads). bf16 /
#: fp16 partials would round to the output dtype, and float64 ones are not split.
_CPU_GEMM_K = 256

#: The small GEMM forms `tiled_linear` may give the rows after the last whole R-row tile (a row alone, a chunk's
#: last few), cheapest first, each of a fixed shape against one Nb-row weight tile: ``("rows", S)`` is
#: ``[S, H] @ [H, Nb]``, ``("cols", S)`` is ``weight_tile [Nb, H] @ [H, S]``, the rows zero-padded to S. A form
#: is used only where `probe_invariant_gemm` found that it gives rows the bits of the R-row tile on this machine.
SMALL_GEMM_FORMS: tuple[tuple[str, int], ...] = (
    ("rows", 1), ("cols", 1), ("cols", 2), ("rows", 2), ("cols", 4), ("rows", 4), ("cols", 8), ("rows", 8),
    ("cols", 16), ("rows", 16),
)  # fmt: skip
#: At most this many small GEMMs (each a pass over the weight) for the rows after the whole tiles; more rows take
#: one zero-padded R-row tile (one pass over the weight at a GEMM's full rate).
MAX_SMALL_GEMMS = 4


@dataclasses.dataclass(frozen=True)
class InvariantGemm:
    """How `tiled_linear` makes its GEMMs for one (device, dtype, H, bias or not, tile, thread count): what
    `probe_invariant_gemm` verified on this machine.

    one_thread: the R-row tile rounds differently under the current thread count than on one thread, so every
        GEMM runs on one thread (a tile's bits are then one thread's whatever the caller's count).
    copy_weight: the tile rounds differently with the weight at another alignment, so each weight tile is
        copied into a fresh buffer first (the hidden rows always are).
    small: the `SMALL_GEMM_FORMS` entry that gives rows the tile's bits, or None: every row in R-row tiles,
        zero-padded where fewer.
    direct_out: the tile gives the same bits written straight into the output (another row stride and
        alignment), so whole tiles are; else each tile is made in a fresh buffer and copied out.
    """

    one_thread: bool
    copy_weight: bool
    small: tuple[str, int] | None
    direct_out: bool = False


def _gemm_k_parts(width: int, dtype: torch.dtype, device: torch.device) -> list[tuple[int, int | None]]:
    """The hidden dimension's parts, one GEMM each, added in order (`_CPU_GEMM_K` on CPU fp32, else one part)."""
    if device.type == "cpu" and dtype == torch.float32 and width > 0:
        return [(k, min(k + _CPU_GEMM_K, width)) for k in range(0, width, _CPU_GEMM_K)]
    return [(0, None)]


def _gemm(a, bt, bias, dst, k_parts) -> torch.Tensor:
    """``dst = a @ bt (+ bias)``, one GEMM per hidden part of `k_parts`, the parts added in order."""
    tmp = torch.empty_like(dst) if len(k_parts) > 1 else None
    for i, (k0, k1) in enumerate(k_parts):
        target = dst if i == 0 else tmp
        if i == 0 and bias is not None:
            torch.addmm(bias, a[:, k0:k1], bt[k0:k1], out=target)
        else:
            torch.mm(a[:, k0:k1], bt[k0:k1], out=target)
        if i:
            dst.add_(tmp)
    return dst


def _small_gemm(form: tuple[str, int], a, w_tile, bias, k_parts) -> torch.Tensor:
    """The `SMALL_GEMM_FORMS` GEMM of S rows ``a [S, H]`` against ``w_tile [Nb, H]`` (and ``bias [Nb]``) into a
    fresh buffer -> ``[S, Nb]`` (for ``"cols"`` a view of the ``[Nb, S]`` result)."""
    kind, s = form
    n = w_tile.shape[0]
    if kind == "rows":
        return _gemm(a, w_tile.t(), bias, a.new_empty((s, n)), k_parts)
    return _gemm(w_tile, a.t(), None if bias is None else bias[:, None], a.new_empty((n, s)), k_parts).t()


def _at_offset(t: torch.Tensor, k: int, buf: torch.Tensor) -> torch.Tensor:
    """A copy of `t` `k` elements into `buf` (a fresh buffer of at least ``t.numel() + k`` elements, whose
    alignment is the allocator's; reused by the probe's copies one after another)."""
    return buf[k : k + t.numel()].view(t.shape).copy_(t)


def probe_invariant_gemm(
    device: torch.device, dtype: torch.dtype, width: int, with_bias: bool, tile: tuple[int, int],
    forms: tuple[tuple[str, int], ...] | None = None,
) -> InvariantGemm:  # fmt: skip
    """Verify on this machine, under the current thread count, what `tiled_linear` relies on, with random
    ``[R, width]`` rows and ``[Nb, width]`` weight rows of `dtype` (`tile` = (R, Nb)), fresh buffers for the rows
    and the output (as `tiled_linear` gives them), and as the reference their R-row tile GEMM on one thread:

    1. the R-row tile gives a row the reference's bits at another place in the tile, beside other rows, under
       the current thread count; else on one thread, and then `InvariantGemm.one_thread`; if not even there,
       RuntimeError: invariant mode cannot hold on this machine;
    2. with the weight at other alignments (1 element and 16 bytes off the allocator's) as well; else
       `InvariantGemm.copy_weight`;
    3. the tile written into a strided view at another alignment (as into the chunk's logits): if the same
       bits, `InvariantGemm.direct_out`;
    4. the first of `forms` (default `SMALL_GEMM_FORMS`, read at the call: empty, none is tried) whose GEMMs give rows (each of its S positions, a group only partly filled, the
       weight at another alignment unless copied) the reference's bits is `InvariantGemm.small`; if none, None.

    What is verified is a property of the library's code path for these shapes, not of the values: a path that
    adds in another order rounds some of the R x Nb random sums differently. Cached by `invariant_gemm_form`;
    costs a few R-row tile GEMMs once per key and process (here about 0.1 s at H = 256 fp32, 1 s at H = 4096)."""
    rows, cols = tile
    forms = SMALL_GEMM_FORMS if forms is None else forms
    g = torch.Generator().manual_seed(0)
    a = torch.randn(rows, width, generator=g).to(device, dtype)
    w = (torch.randn(cols, width, generator=g) / max(width, 1) ** 0.5).to(device, dtype)
    b = (torch.randn(cols, generator=g) * 0.1).to(device, dtype) if with_bias else None
    k_parts = _gemm_k_parts(width, dtype, device)
    item = torch.empty((), dtype=dtype).element_size()
    offsets = sorted({1, max(16 // item, 1)})  # the weight 1 element and 16 bytes off the allocator's alignment

    def tile_gemm(a_, w_):
        return _gemm(a_, w_.t(), b, torch.empty((rows, cols), dtype=dtype, device=device), k_parts)

    with one_thread(device):
        ref = tile_gemm(a, w)

    moved_w = torch.empty(w.numel() + max(offsets), dtype=dtype, device=device)  # the weight at other offsets

    def moved_holds(k: int) -> bool:  # rows moved by 37 + k places (other neighbours), the weight k elements in
        return torch.equal(tile_gemm(a.roll(37 + k, 0).clone(), _at_offset(w, k, moved_w)).roll(-37 - k, 0), ref)

    serial = copy_weight = False
    if not all(moved_holds(k) for k in offsets):  # (two tile GEMMs where all holds) which property fails:
        serial = not moved_holds(0)  # the place alone, under these threads
        with one_thread(device) if serial else contextlib.nullcontext():
            if serial and not moved_holds(0):
                raise RuntimeError(
                    f"invariant=True cannot hold on this machine: its matrix library gives a row of a {dtype} "
                    f"[{rows}, {width}] x [{width}, {cols}] GEMM other bits at another place in the tile, even on "
                    "one thread"
                )
            copy_weight = not all(moved_holds(k) for k in offsets)
    with one_thread(device) if serial else contextlib.nullcontext():
        wide = torch.empty(rows * (cols + 3) + 1, dtype=dtype, device=device)[1:].view(rows, cols + 3)
        direct = torch.equal(_gemm(a, w.t(), b, wide[:, :cols], k_parts), ref)
        w_other = w if copy_weight else _at_offset(w, 1, moved_w)
        for form in forms:
            s = form[1]
            if s >= rows:  # no smaller than the tile
                continue
            holds = True
            for start, count, w_ in ((0, s, w), (s, max(s - 1, 1), w_other)):  # a full group, one a row short
                if start + count > rows:
                    break
                group = a.new_zeros((s, width))
                group[:count] = a[start : start + count]
                holds = torch.equal(_small_gemm(form, group, w_, b, k_parts)[:count], ref[start : start + count])
                if not holds:
                    break
            if holds:
                return InvariantGemm(serial, copy_weight, form, direct)
    return InvariantGemm(serial, copy_weight, None, direct)


@functools.lru_cache(maxsize=64)
def _probed_gemm(device, dtype, width, with_bias, tile, threads) -> InvariantGemm:
    return probe_invariant_gemm(device, dtype, width, with_bias, tile)


def invariant_gemm_form(
    device: torch.device, dtype: torch.dtype, width: int, with_bias: bool, tile: tuple[int, int]
) -> InvariantGemm:
    """`probe_invariant_gemm`'s verdict for these GEMMs under the current intra-op thread count, probed at first
    use in the process and cached. CUDA (and any device but the CPU): R-row tiles only, not probed (a GEMM of one
    shape on cuBLAS; docs/invariant.md, "What a GPU must confirm")."""
    if torch.device(device).type != "cpu":
        return InvariantGemm(False, False, None, True)
    return _probed_gemm(torch.device(device), dtype, width, with_bias, tuple(tile), torch.get_num_threads())


def tiled_linear(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, tile: tuple[int, int]
) -> torch.Tensor:
    """``out[:c, :N] = hidden @ weight.T (+ bias)`` for ``hidden [c, H]`` and ``weight [N, H]`` by GEMMs of fixed
    shapes, so that a logit's bits depend on its own row of `hidden` and column of `weight`, not on c, N, its
    place, the inputs' alignment or the thread count. `tile` = (R, Nb): tiles of Nb weight rows, the last
    overlapping the one before it (zero-padded where N < Nb); writing overlapping tiles twice writes the same
    values.

    Every logit comes from an R-row tile ``[R, H] @ [H, Nb]`` (its rows copied into a fresh zero-padded buffer:
    one alignment for every call; its output written into `out` where the probe verified that this gives the
    same bits, else into a fresh buffer copied out), except where `invariant_gemm_form`
    verified on this machine that a `SMALL_GEMM_FORMS` shape gives rows the tile's bits: then the rows after the
    last whole tile (a row alone, a chunk's last few) take at most `MAX_SMALL_GEMMS` of those per weight tile
    (about a pass over the weight each, instead of an R-row GEMM). On CPU fp32 each GEMM is split over the hidden
    dimension in parts of `_CPU_GEMM_K` columns added in order. Where the probe found the tile's bits change with
    the thread count, the GEMMs run on one thread; with the weight's alignment, each weight tile is copied."""
    rows, cols = tile
    c, n = hidden.shape[0], weight.shape[0]
    if c == 0 or n == 0:
        return out
    form = invariant_gemm_form(hidden.device, hidden.dtype, hidden.shape[1], bias is not None, tile)
    k_parts = _gemm_k_parts(hidden.shape[1], hidden.dtype, hidden.device)
    w, b = weight, bias
    if n < cols:
        w = weight.new_zeros((cols, weight.shape[1]))
        w[:n] = weight
        if bias is not None:
            b = bias.new_zeros(cols)
            b[:n] = bias
    small, lone = form.small, c % rows  # lone: the rows after the last whole tile
    if small is None or not lone or -(-lone // small[1]) > MAX_SMALL_GEMMS:
        small, lone = None, 0
    tiled = c - lone  # rows made in R-row tiles
    row_starts = _tile_starts(max(tiled, rows), rows) if tiled else []
    h = hidden.new_zeros((rows if small is None else max(rows * bool(tiled), small[1]), hidden.shape[1]))
    direct = form.direct_out and tiled >= rows and n >= cols  # whole tiles straight into `out`
    dst = torch.empty((rows, cols), dtype=out.dtype, device=out.device) if tiled and not direct else None
    with one_thread(hidden.device) if form.one_thread else contextlib.nullcontext():
        for j in _tile_starts(max(n, cols), cols):
            w_j, b_j = w[j : j + cols], None if b is None else b[j : j + cols]
            if form.copy_weight:
                w_j = w_j.clone()
            c_n = min(cols, n - j)
            for i in row_starts:
                r_n = min(rows, tiled - i)
                h[:r_n] = hidden[i : i + r_n]  # (rows past r_n: zeros, only where tiled < R)
                if direct:
                    _gemm(h[:rows], w_j.t(), b_j, out[i : i + rows, j : j + cols], k_parts)
                else:
                    _gemm(h[:rows], w_j.t(), b_j, dst, k_parts)
                    out[i : i + r_n, j : j + c_n] = dst[:r_n, :c_n]
            if small is not None:
                s = small[1]
                for g0 in range(tiled, c, s):
                    k = min(s, c - g0)
                    h[:k] = hidden[g0 : g0 + k]
                    h[k:s] = 0
                    out[g0 : g0 + k, j : j + c_n] = _small_gemm(small, h[:s], w_j, b_j, k_parts)[:k, :c_n]
    return out


@functools.lru_cache(maxsize=8)
def gemm_accumulates_into_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(fp32, lowp, lowp, out_dtype=float32)`` runs here (CUDA, PyTorch >= 2.11)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        a = torch.ones((2, 2), dtype=dtype, device=device)
        acc = torch.ones((2, 2), dtype=torch.float32, device=device)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return bool((acc == 3.0).all())  # accumulated into the buffer it read (1 + 1*1 + 1*1)


def chunk_dtype_for(weight: torch.Tensor, weight_grad_dtype: torch.dtype) -> torch.dtype:
    """The dtype each fused chunk's logits (then d-logits, in place) live in.

    The input dtype when the weight-gradient GEMM can take low-precision d-logits as they are: fp32
    inputs, a low-precision accumulator by request, or a GEMM that accumulates into the fp32 buffer
    itself (CUDA). Otherwise (bf16 / fp16 on CPU) fp32, so that the fp32 accumulator gets unrounded
    d-logits.
    """
    if weight.dtype in (torch.float32, torch.float64) or weight_grad_dtype == weight.dtype:
        return weight.dtype
    return weight.dtype if gemm_accumulates_into_fp32(weight.device, weight.dtype) else torch.float32


# ----------------------------------------------------------------------------------------------------------
# sources


def _columns(t: torch.Tensor | None, cols: tuple[int, int] | None) -> torch.Tensor | None:
    """Rows ``[c0, c1)`` of a weight ``[V_local, ...]`` or bias (the local columns of the logits), or all."""
    return t if t is None or cols is None else t[cols[0] : cols[1]]


class LogitRows:
    """Chunk source over ``[N, V_local]`` logits: the chunk's rows (a slice, or a gathered copy of rows that
    do not follow each other), made contiguous along the vocabulary if needed. It slices rather than
    gathers (`lmloss.rows`): a gather copies the whole chunk."""

    owns_chunks = False
    gathers_rows = False

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def __call__(self, rows: Rows, cols: tuple[int, int] | None = None) -> torch.Tensor:
        x = rows.take(self.logits)
        if cols is not None:
            x = x[:, cols[0] : cols[1]]
        return x if x.stride(-1) == 1 else x.contiguous()


class HiddenRows:
    """Chunk source: ``hidden[rows] @ weight.T (+ bias)`` into one reused ``[chunk, V_local]`` buffer (or, in
    a fused head's weight pass, ``[chunk, c1 - c0]`` for the local columns ``cols``).

    The chunk is made in the weight's dtype (a bf16 / fp16 GEMM accumulates in fp32 and rounds its output
    once) and, when `chunk_dtype` is fp32 (low-precision inputs whose d-logits must be fp32, see
    `chunk_dtype_for`), upcast into an fp32 buffer. The chunk is scratch the kernels may overwrite.
    Rows that do not follow each other are gathered first (``[c, H]``: cheap beside the matmul).
    `name` keeps two heads' buffers apart in one scratch (a teacher beside the student).
    """

    owns_chunks = True
    gathers_rows = True

    def __init__(
        self, hidden, weight, bias, scratch: ChunkScratch, chunk_dtype: torch.dtype, name: str = "",
        gemm_tile: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        self.hidden, self.weight, self.bias, self.scratch = hidden, weight, bias, scratch
        self.chunk_dtype, self.name, self.gemm_tile = chunk_dtype, name, gemm_tile
        self._gathered: tuple[Rows, torch.Tensor] | None = None

    def hidden_rows(self, rows: Rows) -> torch.Tensor:
        """The chunk's hidden rows (the last chunk's gather is kept for its sink: one gather per chunk)."""
        if rows.contiguous:
            return rows.take(self.hidden)
        if self._gathered is None or self._gathered[0] is not rows:
            self._gathered = (rows, rows.take(self.hidden))
        return self._gathered[1]

    def __call__(self, rows: Rows, cols: tuple[int, int] | None = None) -> torch.Tensor:
        weight, bias = _columns(self.weight, cols), _columns(self.bias, cols)
        width, h = weight.shape[0], self.hidden_rows(rows)
        z = self.scratch.contiguous(self.name + "logits_lowp", rows.count, width, self.weight.dtype)
        if self.gemm_tile is not None:  # the invariant mode: GEMMs of one fixed shape
            tiled_linear(h, weight, bias, z, self.gemm_tile)
        elif bias is None:
            torch.mm(h, weight.t(), out=z)
        else:
            torch.addmm(bias, h, weight.t(), out=z)
        if self.chunk_dtype == z.dtype:
            return z
        return self.scratch.contiguous(self.name + "logits", rows.count, width, self.chunk_dtype).copy_(z)


# ----------------------------------------------------------------------------------------------------------
# sinks


class BufferSink:
    """Gradient sink that is a preallocated ``[N, V]`` buffer: the kernel writes each chunk's rows (a gathered
    chunk's gradient is written over its own copy, then copied into its rows); rows that do not count are
    zeroed once."""

    def __init__(
        self, grad: torch.Tensor, selection: RowSelection | None = None, chunk_rows: int | None = None
    ) -> None:  # fmt: skip
        self.grad = grad
        if selection is not None:  # `chunk_rows`: a slicing source's chunks (`RowSelection.zero_skipped_`)
            selection.zero_skipped_(grad, chunk_rows)

    def buffer(self, rows, x):
        return self.grad[rows.start : rows.end] if rows.contiguous else x  # a gathered x is a fresh copy

    def consume(self, rows, grad):
        if not rows.contiguous:
            rows.put_(self.grad, grad)


class InPlaceSink:
    """Gradient sink that is the logits themselves: each chunk's gradient overwrites its logits (a gathered
    chunk's is copied back into its rows); the rows that do not count are zeroed once."""

    def __init__(
        self, logits: torch.Tensor, selection: RowSelection | None = None, chunk_rows: int | None = None
    ) -> None:  # fmt: skip
        self.logits = logits
        if selection is not None:  # `chunk_rows`: a slicing source's chunks (`RowSelection.zero_skipped_`)
            selection.zero_skipped_(logits, chunk_rows)

    def buffer(self, rows, x):
        return x

    def consume(self, rows, grad):
        if not rows.contiguous:
            rows.put_(self.logits, grad)


class DiscardSink:
    """Gradient sink of a fused head's token pass when only the weight needs a gradient and a weight pass makes
    it: the forward still forms each chunk's gradient coefficients (the weight pass reads them), the
    d-logits are dropped."""

    def buffer(self, rows, x):
        return x

    def consume(self, rows, grad):
        pass

    def finish(self, hidden, weight, bias, tp_group, scale=None):
        return None, None, None


class Accumulators:
    """Gradient sink of a fused head's token pass: chains each chunk's d-logits into hidden / weight / bias
    gradients.

    hidden: ``[N, H]``, each row written once (hidden dtype; fp32 when TP ranks' partials are summed over
    ``tp_group`` here, without sequence parallelism); rows that do not count are zeroed.
    weight, bias: accumulated over chunks in `weight_grad_dtype`, or, with `single_chunk` (the pass has one
    chunk), the weight gradient written by one GEMM in the weight's dtype (the GEMM accumulates in fp32
    and rounds once: no accumulator). None where that input needs no gradient, or where a weight pass
    makes it (`WeightBlocks`). `weight_rows`: the weight pass makes all but the first `weight_rows` rows of
    the weight gradient; those accumulate here (``[weight_rows, H]``, at least fp32) and `finish` hands the
    accumulator itself to the weight pass (`WeightBlocks.take_rows`).
    """

    def __init__(
        self, hidden, weight, bias, needs, *, weight_grad_dtype, tp_summed, sequence_parallel, scratch,
        selection: RowSelection | None = None, single_chunk: bool = False, hidden_rows=None, weight_rows: int = 0,
    ):  # fmt: skip
        self.hidden_in, self.weight_in, self.scratch = hidden, weight, scratch
        # the chunk's hidden rows as the source gathered them (`HiddenRows.hidden_rows`)
        self.hidden_rows = hidden_rows or (lambda rows: rows.take(hidden))
        self.sequence_parallel = sequence_parallel
        h_dtype = torch.promote_types(hidden.dtype, torch.float32) if tp_summed and not sequence_parallel else hidden.dtype
        self.hidden = None
        if needs[0]:
            self.hidden = torch.empty(hidden.shape, dtype=h_dtype, device=hidden.device)
            if selection is not None:
                selection.zero_skipped_(self.hidden)
        # one chunk: the weight's own dtype, one GEMM; else the accumulator's (fp32 by default)
        self.weight_rows = weight_rows
        self.single_chunk = single_chunk and weight_grad_dtype != torch.float64 and not weight_rows
        w_dtype = weight.dtype if self.single_chunk else weight_grad_dtype
        if weight_rows:  # the first rows only, rounded once by the weight pass: at least fp32
            w_dtype = torch.promote_types(w_dtype, torch.float32)
        shape = (weight_rows, weight.shape[1]) if weight_rows else weight.shape
        # not zero-filled: the first chunk's GEMM writes it with beta=0
        self.weight = torch.empty(shape, dtype=w_dtype, device=weight.device) if needs[1] else None
        self.weight_written = False
        self.bias = None
        if bias is not None and needs[2]:
            bias_dtype = torch.promote_types(bias.dtype, torch.float32)
            self.bias = torch.zeros(bias.shape, dtype=bias_dtype, device=bias.device)

    def buffer(self, rows, x):
        return x  # the chunk is scratch (`chunk_dtype_for`): its d-logits overwrite it

    def pass_done(self) -> None:
        """The pass is over: let its chunk-sized scratch go (the gradients may wait for the backward)."""
        self.scratch, self.hidden_rows = None, None

    def _lowp(self, dz: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`dz` in `dtype` (the source's low-precision chunk buffer is free again once the chunk was upcast)."""
        return dz if dz.dtype == dtype else self.scratch.contiguous("logits_lowp", *dz.shape, dtype).copy_(dz)

    def consume(self, rows, dz):
        w = self.weight_in
        h_rows = self.hidden_rows(rows) if self.weight is not None else None
        dz_w = self._lowp(dz, w.dtype) if self.hidden is not None else None
        if self.hidden is not None:
            if self.hidden.dtype == w.dtype and rows.contiguous:
                torch.mm(dz_w, w, out=self.hidden[rows.start : rows.end])
            else:  # the GEMM accumulates in fp32 internally; each hidden row comes from one GEMM
                rows.put_(self.hidden, torch.mm(dz_w, w))
        if self.weight is not None:
            if self.single_chunk:  # the whole gradient at once, in the weight's dtype
                write_weight_gradient_(self.weight, dz, h_rows)
            else:
                beta = 1.0 if self.weight_written else 0.0  # beta=0: the buffer's unset contents are not read
                accumulate_(self.weight, dz[:, : self.weight_rows] if self.weight_rows else dz, h_rows, beta)
            self.weight_written = True
        if self.bias is not None:
            self.bias.add_(dz.sum(dim=0, dtype=self.bias.dtype))

    def finish(self, hidden, weight, bias, tp_group, scale=None):
        """The gradients in their inputs' dtypes; scaled by the upstream scalar `scale` if given, in the same
        pass as the cast (`scaled_cast`: no pass at all over a same-dtype buffer when `scale` is 1.0)."""
        gh = gw = gb = None
        if self.hidden is not None:
            if not self.sequence_parallel:  # with it, the sum is `GatherRows`' backward (a reduce-scatter)
                all_reduce_sum_(self.hidden, tp_group)
            gh = scaled_cast(self.hidden, scale, hidden.dtype)
        if self.weight is not None:
            if not self.weight_written:  # no chunk (no tokens): a zero gradient
                self.weight.zero_()
            if self.weight_rows:  # the accumulator itself, scaled: the weight pass rounds it into its rows
                gw, self.weight = (self.weight if scale is None else self.weight.mul_(scale)), None
            else:
                gw = scaled_cast(self.weight, scale, weight.dtype)
        if self.bias is not None:
            gb = scaled_cast(self.bias, scale, bias.dtype)
        return gh, gw, gb


#: Weight rows per GEMM when fp32 d-logits of a low-precision weight are written straight into its gradient
#: (`write_weight_gradient_`): the fp32 product of a tile is ``[tile, H]``, never ``[V_local, H]``.
WEIGHT_TILE_ROWS = 1024


def write_weight_gradient_(grad: torch.Tensor, dz: torch.Tensor, h_rows: torch.Tensor) -> None:
    """``grad = dz.T @ h_rows`` over every row that counts at once, rounded once into `grad`'s dtype: one GEMM
    when `dz` has that dtype (it accumulates in fp32 inside), else (fp32 d-logits of a low-precision weight)
    one fp32 GEMM per tile of `WEIGHT_TILE_ROWS` weight rows, each rounded into its rows of `grad`."""
    if dz.dtype == grad.dtype:
        torch.mm(dz.t(), h_rows if h_rows.dtype == dz.dtype else h_rows.to(dz.dtype), out=grad)
        return
    h = h_rows.to(dz.dtype)
    for r in range(0, grad.shape[0], WEIGHT_TILE_ROWS):  # tiles of one GEMM's output, not chunks of tokens
        grad[r : r + WEIGHT_TILE_ROWS].copy_(dz[:, r : r + WEIGHT_TILE_ROWS].t() @ h)


def accumulate_(acc: torch.Tensor, dz: torch.Tensor, h_rows: torch.Tensor, beta: float) -> None:
    """``acc = beta * acc + dz.T @ h_rows``: in `acc`'s dtype, or, for low-precision d-logits into an fp32
    `acc`, by a GEMM that accumulates into the fp32 buffer itself (CUDA, `gemm_accumulates_into_fp32`)."""
    if dz.dtype == acc.dtype:
        acc.addmm_(dz.t(), h_rows if h_rows.dtype == dz.dtype else h_rows.to(dz.dtype), beta=beta)
    else:  # low-precision d-logits into the fp32 accumulator, on the tensor cores
        torch.addmm(acc, dz.t(), h_rows, out_dtype=torch.float32, beta=beta, out=acc)


class WeightBlocks:
    """Gradient sink of a fused head's weight pass (`lmloss.plan.backward_pass` with ``columns``): the weight
    gradient ``[V_local, H]`` in the weight's dtype, one block of rows ``[c0, c1)`` at a time, each from
    the d-logits of that block of columns over every row that counts. A block whose rows come in one chunk
    is one GEMM written once in the weight's dtype (accumulated in fp32 inside the GEMM); otherwise the
    chunks accumulate into an fp32 ``[c1 - c0, H]`` block buffer, rounded once into the gradient. No
    ``[V_local, H]`` accumulator; the upstream scalar is already in the coefficients (scale None)."""

    def __init__(self, hidden, weight, *, block: int, weight_grad_dtype: torch.dtype, hidden_rows=None) -> None:
        self.hidden_in, self.weight_in = hidden, weight
        self.hidden_rows = hidden_rows or (lambda rows: rows.take(hidden))
        self.grad = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        self.acc_dtype = torch.promote_types(weight.dtype, weight_grad_dtype)
        self.block, self.acc = block, None
        self.cols, self.single_chunk, self.written = (0, 0), False, False

    def take_rows(self, first: list) -> None:
        """Round the token pass's accumulator of the first rows (`Accumulators` with ``weight_rows``), handed over
        in the list `first`, into those rows of the gradient, and let it go before any block is made."""
        acc = first.pop()
        self.grad[: acc.shape[0]].copy_(acc)

    def start_block(self, cols: tuple[int, int], *, single_chunk: bool) -> None:
        self.cols, self.single_chunk, self.written = cols, single_chunk, False
        if not single_chunk and self.acc is None and self.acc_dtype != self.grad.dtype:
            self.acc = torch.empty((self.block, self.grad.shape[1]), dtype=self.acc_dtype, device=self.grad.device)

    def buffer(self, rows, x):
        return x

    def consume(self, rows, dz):
        c0, c1 = self.cols
        h_rows, dst = self.hidden_rows(rows), self.grad[c0:c1]
        if self.single_chunk:  # fp32 inside the GEMM, one rounding into the gradient
            write_weight_gradient_(dst, dz, h_rows)
        else:
            accumulate_(dst if self.acc is None else self.acc[: c1 - c0], dz, h_rows, 1.0 if self.written else 0.0)
        self.written = True

    def finish_block(self) -> None:
        c0, c1 = self.cols
        if not self.written:  # no row counts: a zero gradient
            self.grad[c0:c1].zero_()
        elif self.acc is not None and not self.single_chunk:
            self.grad[c0:c1].copy_(self.acc[: c1 - c0])


class GatherRows(torch.autograd.Function):
    """Sequence parallelism: gather token rows over TP in rank order; the backward sums each rank's
    partial gradient (it covers one vocabulary shard) and hands every rank its own rows."""

    @staticmethod
    def forward(ctx, rows, group):
        ctx.group = group
        return gather_rows(rows, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_rows(grad.contiguous(), ctx.group), None


# ----------------------------------------------------------------------------------------------------------
# heads


class LogitsHead:
    """The logits ``[N, V_local]`` as what is differentiated: chunks are row slices; a per-token backward
    writes the gradient into one ``[N, V_local]`` buffer of the logits' dtype."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits
        self.n, self.device, self.dtype = logits.shape[0], logits.device, logits.dtype

    @property
    def leaves(self) -> tuple[torch.Tensor, ...]:
        return (self.logits,)

    def source(self, rows: int, cols: int) -> LogitRows:
        return LogitRows(self.logits)

    def pass_with_sink(
        self, rows: int, cols: int, needs, selection: RowSelection | None = None, single_chunk: bool = False
    ) -> tuple[LogitRows, BufferSink | None]:  # fmt: skip
        if not needs[0]:
            return LogitRows(self.logits), None
        grad = torch.empty(self.logits.shape, dtype=self.logits.dtype, device=self.logits.device)
        return LogitRows(self.logits), BufferSink(grad, selection, chunk_rows=rows)

    def gradients(self, sink: BufferSink | None, scale: torch.Tensor | None = None, tp_group=None):
        if sink is None:
            return (None,)
        return (sink.grad if scale is None else scale_(sink.grad, scale),)


class LinearHead:
    """``hidden [N, H] @ weight.T [H, V_local] + bias``: chunks are matmuls of hidden rows; gradients go
    through `Accumulators` (hidden all-reduced over `tp_group` unless sequence-parallel, where
    `GatherRows`' backward sums them), and in a weight pass through `WeightBlocks`. `opts`:
    ``weight_grad_dtype``, ``tp_summed``, ``sequence_parallel``, ``chunk_dtype`` (see `chunk_dtype_for`),
    ``gemm_tile`` (the invariant mode's `tiled_linear` tile, or None)."""

    def __init__(self, hidden, weight, bias, opts: dict) -> None:
        self.hidden, self.weight, self.bias, self.opts = hidden, weight, bias, opts
        self.n, self.device, self.dtype = hidden.shape[0], hidden.device, hidden.dtype

    @property
    def leaves(self) -> tuple[torch.Tensor | None, ...]:
        return (self.hidden, self.weight, self.bias)

    def source(self, rows: int, cols: int, scratch: ChunkScratch | None = None) -> HiddenRows:
        scratch = ChunkScratch(rows, cols, self.device) if scratch is None else scratch
        return HiddenRows(self.hidden, self.weight, self.bias, scratch, self.opts["chunk_dtype"],
                          gemm_tile=self.opts.get("gemm_tile"))  # fmt: skip

    def pass_with_sink(
        self, rows: int, cols: int, needs, selection: RowSelection | None = None, single_chunk: bool = False,
        weight_rows: int = 0,
    ) -> tuple[HiddenRows, Accumulators | None]:  # fmt: skip
        """`weight_rows`: a weight pass makes the others' gradient (`Accumulators`)."""
        scratch = ChunkScratch(rows, cols, self.device)
        source = self.source(rows, cols, scratch)
        needs = (needs[0], needs[1], bool(needs[2]) and self.bias is not None)
        if not any(needs):
            return source, None
        sink = Accumulators(
            self.hidden, self.weight, self.bias, needs, scratch=scratch, weight_grad_dtype=self.opts["weight_grad_dtype"],
            tp_summed=self.opts["tp_summed"], sequence_parallel=self.opts["sequence_parallel"], selection=selection,
            single_chunk=single_chunk, hidden_rows=source.hidden_rows, weight_rows=weight_rows,
        )  # fmt: skip
        return source, sink

    def weight_pass(self, rows: int, block: int) -> tuple[HiddenRows, WeightBlocks]:
        """The source and sink of the weight pass (`WeightBlocks`): chunks of `rows` by `block` columns. Its
        logits are plain GEMMs even in invariant mode: they make a gradient, never an output."""
        source = HiddenRows(self.hidden, self.weight, self.bias, ChunkScratch(rows, block, self.device),
                            self.opts["chunk_dtype"])  # fmt: skip
        sink = WeightBlocks(self.hidden, self.weight, block=block, weight_grad_dtype=self.opts["weight_grad_dtype"],
                            hidden_rows=source.hidden_rows)  # fmt: skip
        return source, sink

    def gradients(self, sink: Accumulators | None, scale: torch.Tensor | None = None, tp_group=None):
        if sink is None:
            return (None, None, None)
        return sink.finish(self.hidden, self.weight, self.bias, tp_group, scale)


def linear_head_options(
    weight: torch.Tensor, *, weight_grad_dtype: torch.dtype, sequence_parallel: bool, tp_group: ProcessGroup | None,
    invariant: bool = False,
) -> dict:  # fmt: skip
    """`LinearHead`'s options from the fused ops' arguments."""
    return dict(
        # float64 weights accumulate in float64 (the fp32 default is "at least fp32")
        weight_grad_dtype=torch.float64 if weight.dtype == torch.float64 else weight_grad_dtype,
        tp_summed=world_size(tp_group) > 1,
        sequence_parallel=sequence_parallel,
        chunk_dtype=chunk_dtype_for(weight, weight_grad_dtype),
        gemm_tile=invariant_gemm_tile(weight.device) if invariant else None,
    )
