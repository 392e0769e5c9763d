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

import dataclasses
import functools
import math
import os

import torch

from lmloss.kernels import ChunkScratch, scale_, scaled_cast
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
#: one GEMM each, added in order: with MKL here a longer fp32 reduction rounds differently for other row counts
#: and thread counts (H = 4096: the 128-row tile itself changed between 1 and 2 threads; bf16 / fp16 did not).
_CPU_GEMM_K = 256


def tiled_linear(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, tile: tuple[int, int]
) -> torch.Tensor:
    """``out[:c, :N] = hidden @ weight.T (+ bias)`` for ``hidden [c, H]`` and ``weight [N, H]`` by GEMMs of fixed
    shapes, so that a logit's bits depend on its own row of `hidden` and column of `weight` (and the library's
    kernels for those shapes), not on c, N or its place. `tile` = (R, Nb): tiles of Nb weight rows, the last
    overlapping the one before it (zero-padded where N < Nb); writing overlapping tiles twice writes the same
    values.

    CUDA: each tile is one ``[R, H] @ [H, Nb]`` GEMM, the rows in tiles of R too (zero-padded where c < R).
    CPU: fp32 sums the hidden dimension in chunks of `_CPU_GEMM_K` (one GEMM each, added in order); the whole R-row tiles
    as ``[R, H] @ [H, Nb]``, and the rows after them (c < R included) as one ``weight @ hidden_rows.T`` over the
    whole (padded) weight for any count of at least 2 rows (one row gets a zero row beside it): with this CPU's
    MKL both give a row the same bits as an R-row tile, for fp32, bf16 and fp16, 1 or 2 threads (checked over H
    up to 4096, 2 to 127 rows, tiles of 384 to 4096 weight rows and transposed GEMMs of 11 to 128256 weight rows;
    fp32 GEMMs of 10 weight rows or fewer round differently, which the padding to Nb keeps out), so a row alone
    costs about one pass over the weight instead of an R-row GEMM (one GEMM rather than one per tile: 1.2 against
    1.5 ms at 32000 x 256 fp32, 2 threads). float64 (where the transposed form rounds differently) pads the rows
    to whole tiles."""
    rows, cols = tile
    c, n = hidden.shape[0], weight.shape[0]
    if c == 0 or n == 0:
        return out
    h, w, b = hidden, weight, bias
    cpu = hidden.device.type == "cpu" and hidden.shape[1] > 0
    lone_rows = c % rows if cpu and hidden.dtype != torch.float64 else 0  # rows after the whole tiles
    if c < rows and not lone_rows:
        h = hidden.new_zeros((rows, hidden.shape[1]))
        h[:c] = hidden
    if n < cols:
        w = weight.new_zeros((cols, weight.shape[1]))
        w[:n] = weight
        if bias is not None:
            b = bias.new_zeros(cols)
            b[:n] = bias
    split_k = cpu and hidden.dtype == torch.float32  # (bf16 / fp16 partials would round to the output dtype)
    k_parts = [(k, k + _CPU_GEMM_K) for k in range(0, hidden.shape[1], _CPU_GEMM_K)] if split_k else [(0, None)]

    def gemm(a, bt, bias_, dst, tmp):  # dst = a @ bt (+ bias_) over the hidden chunks, added in order
        for i, (k0, k1) in enumerate(k_parts):
            target = dst if i == 0 else tmp
            if i == 0 and bias_ is not None:
                torch.addmm(bias_, a[:, k0:k1], bt[k0:k1], out=target)
            else:
                torch.mm(a[:, k0:k1], bt[k0:k1], out=target)
            if i:
                dst.add_(tmp)
        return dst

    n_tiled = c - lone_rows if lone_rows else max(c, rows)  # rows made in R-row tiles (padded where c < R)
    direct = c >= rows and n >= cols
    scratch = None if direct else torch.empty((rows, cols), dtype=out.dtype, device=out.device)
    tmp = torch.empty((rows, cols), dtype=out.dtype, device=out.device) if len(k_parts) > 1 else None
    if n_tiled:
        for i in _tile_starts(n_tiled, rows):
            for j in _tile_starts(max(n, cols), cols):
                dst = out[i : i + rows, j : j + cols] if direct else scratch
                gemm(h[i : i + rows], w[j : j + cols].t(), None if b is None else b[j : j + cols], dst, tmp)
                if not direct:
                    r_n, c_n = min(rows, c - i), min(cols, n - j)
                    out[i : i + r_n, j : j + c_n] = dst[:r_n, :c_n]
    if lone_rows:  # transposed, all of the (padded) weight in one GEMM: weight [N, H] @ hidden_rows.T [H, r], r >= 2
        lone = hidden[n_tiled:]
        if lone_rows == 1:
            lone = torch.cat([lone, lone.new_zeros((1, lone.shape[1]))])
        acc = torch.empty((w.shape[0], lone.shape[0]), dtype=out.dtype, device=out.device)
        tmp_t = torch.empty_like(acc) if len(k_parts) > 1 else None
        gemm(w, lone.t(), None if b is None else b[:, None], acc, tmp_t)
        out[n_tiled:c, :n] = acc[:n, :lone_rows].t()
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
