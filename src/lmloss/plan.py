"""Arguments -> one typed `LossPlan`, and the one chunk loop that every op runs.

An op checks its arguments and calls `make_plan` once: the options, the vocabulary shard and its TP group,
the chunking, the kept set of a sampling truncation, the kernels' implementation, and one agreement of all
of it (and of every per-token tensor that changes the result) across the TP ranks, in one all-gather
before any other collective. `forward_pass` then walks the tokens in chunks: a *chunk source*
(`lmloss.chunks`, `lmloss.replay`) yields each chunk's logits, an *objective* (`lmloss.objectives`)
computes the chunk's per-token results with the pass's kernels (`lmloss.kernels`) and the TP combine, and
a *gradient sink* receives the chunk's gradient when it is computed in the forward. `backward_pass`
walks the chunks again for a per-token op's backward. These two loops are the only ones in the package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch

from lmloss import _validate
from lmloss.agreement import describe_arguments, errors_raised_on_every_rank, will_gather
from lmloss.kernels import INVARIANT_BLOCK, ChunkMath, compute_dtype, make_kernels, resolve_impl
from lmloss.objectives import BYPRODUCTS, OUTPUTS
from lmloss.rows import Rows, RowSelection, all_rows
from lmloss.sampling import Sampling, search_bytes
from lmloss.vocab_parallel import INVARIANT_MAX_COLUMNS, ProcessGroup, VocabShard, resolve_shard, world_size

#: ``source(rows, cols) -> x [c, V_local]`` (or ``[c, c1 - c0]`` for local columns ``cols = (c0, c1)``)
ChunkSource = Callable[..., torch.Tensor]


class GradSink(Protocol):
    def buffer(self, rows: Rows, x: torch.Tensor) -> torch.Tensor:
        """Where the kernel writes the gradient of the chunk `rows` (its logits are `x`)."""

    def consume(self, rows: Rows, grad: torch.Tensor) -> None:
        """Take the chunk's gradient from that buffer (before the next chunk reuses it)."""


@dataclasses.dataclass(frozen=True)
class LossPlan:
    """Everything an op resolved from its arguments; the same on every TP rank.

    shard: this rank's columns of the global vocabulary (`VocabShard`).
    math: what the per-chunk kernels need (`ChunkMath`: vocab start, valid columns, scale, softcap).
    impl: ``"torch"`` or ``"triton"``, resolved from ``"auto"``.
    chunk_size: tokens per chunk (None: one chunk), agreed across `tp_group`.
    outputs: the per-token outputs to produce, a subset of `OUTPUTS` in that order.
    """

    shard: VocabShard
    math: ChunkMath
    impl: str
    chunk_size: int | None
    outputs: tuple[str, ...]
    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    tp_group: ProcessGroup | None = None
    #: the rollout engine's truncation (`lmloss.sampling`): a per-row kept set; None for the full softmax
    sampling: Sampling | None = None
    #: also return ``log`` of the kept set's probability (with `sampling`, or a replayed support)
    log_kept_mass: bool = False
    #: with a replayed support (`lmloss.replay`) the kernels run over its slots (`shard`, `math`); these are
    #: the vocabulary's shard and math, which the slots are taken from. Otherwise `shard` and `math`.
    vocab: VocabShard | None = None
    vocab_math: ChunkMath | None = None
    #: invariant mode (docs/invariant.md): the width of the blocks the kernels sum over (`INVARIANT_BLOCK`
    #: columns, or 1 over a replayed support's slots, whose ranks hold scattered ids); 0 when off
    invariant_block: int = 0
    #: the rows that count (`lmloss.rows`): None when every row does; the others take no chunk
    rows: RowSelection | None = None
    #: the same as a bool ``[N]`` mask (None: every row), for the objectives' outputs: 0 where a row does not
    #: count (inside ``torch.compile`` the rows are computed, not skipped, and masked alike)
    counting: torch.Tensor | None = None
    #: a fused head's weight gradient without a ``[V_local, H]`` accumulator (`lmloss.chunks.FusedSchedule`):
    #: local columns per block of the weight pass, and tokens per chunk in it; 0 for the accumulator
    weight_block: int = 0
    weight_block_rows: int = 0
    #: the by-products of the same pass (a subset of `BYPRODUCTS`, in that order): not differentiable, returned
    #: after the outputs (`lmloss.objectives.finish`)
    byproducts: tuple[str, ...] = ()
    #: with a weight pass, the local columns ``[0, weight_start)`` whose weight gradient accumulates over the
    #: token pass's chunks (`lmloss.chunks.FusedSchedule.weight_start`); the weight pass makes the others'
    weight_start: int = 0

    @property
    def invariant(self) -> bool:
        return self.invariant_block > 0

    @property
    def returned(self) -> tuple[str, ...]:
        """What the op returns: `outputs`, then ``"log_kept_mass"`` and the `byproducts` (not differentiable)."""
        return (*self.outputs, *(("log_kept_mass",) if self.log_kept_mass else ()), *self.byproducts)

    @property
    def flags(self) -> dict[str, bool]:
        """Which optional partial sums the kernels must produce."""
        wants_target = "logprobs" in self.outputs or "loss" in self.outputs
        smoothing = "loss" in self.outputs and self.label_smoothing > 0
        extra = self.byproducts
        flags = dict(entropy="entropy" in self.outputs, target=wants_target, sum_logits=smoothing or "logit_sum" in extra)
        if "log_sum_sq_probs" in extra:  # only asked when set: an implementation's partials are [c, 5] otherwise
            flags["sum_sq"] = True
        if "argmax" in extra:
            flags["argmax"] = True
        return flags

    def chunks(self, n: int, *, gather: bool = False, chunk_rows: int | None = None) -> list[Rows]:
        """The chunks of ``[0, n)`` the loop walks: every row, or only those that count (`rows`), at most
        `chunk_rows` (default `chunk_size`) each; `gather`: the source gathers rows cheaply (`lmloss.rows`)."""
        chunk_rows = self.chunk_size if chunk_rows is None else chunk_rows
        if self.rows is None:
            return all_rows(n, chunk_rows)
        return self.rows.chunks(n if chunk_rows is None else chunk_rows, gather=gather)

    def one_chunk(self, n: int) -> bool:
        """Whether a pass of a source that gathers rows walks a single chunk."""
        return len(self.chunks(n, gather=True)) == 1

    def kernels(self, n: int, device: torch.device, cols: int | None = None):
        rows = min(n, self.chunk_size or n)
        return make_kernels(self.impl, max(rows, 1), self.shard.size if cols is None else cols, device)

    def column_blocks(self) -> list[tuple[int, int]]:
        """The weight pass's blocks of local columns ``(c0, c1)`` (`weight_block` wide), from `weight_start`."""
        width = self.shard.size
        return [(c, min(c + self.weight_block, width)) for c in range(self.weight_start, width, self.weight_block)]

    def block_math(self, cols: tuple[int, int] | None) -> ChunkMath:
        """The kernels' math for local columns ``cols`` of the shard: a sub-shard (None: the whole shard)."""
        if cols is None:
            return self.math
        c0, c1 = cols
        valid = max(0, min(c1, self.math.valid) - c0)
        return dataclasses.replace(self.math, vocab_start=self.math.vocab_start + c0, valid=valid)


def make_plan(
    *,
    n_tokens: int,
    local_vocab: int,
    device: torch.device,
    dtype: torch.dtype,
    labels: torch.Tensor | None,
    outputs: tuple[str, ...],
    chunk_size: int | str | None,
    auto_chunk: Callable[[int, int, str], int | None] | None,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
    vocab_size: int | None,
    tp_group: ProcessGroup | None,
    vocab_start: int | None,
    impl: str,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    agree: dict[str, int | float] | None = None,
    sampling: Sampling | None = None,
    support: torch.Tensor | None = None,
    log_kept_mass: bool = False,
    options: dict | None = None,
    tensors: dict[str, torch.Tensor | None] | None = None,
    invariant: bool = False,
    counting: torch.Tensor | None = None,
    schedule: Callable | None = None,
    arguments: dict[str, torch.Tensor | None] | None = None,
    byproducts: tuple[str, ...] = (),
) -> LossPlan:
    """Check the options every op shares and resolve them into a `LossPlan`.

    `labels` are the flat int64 labels (or None). `auto_chunk(n_rows, max_V_local, impl)` sizes
    ``chunk_size="auto"`` from values that every TP rank agrees on (`n_rows`: the rows that count; a fourth
    argument, ``(bytes per logit, bytes per row)`` of the kept-set search, `lmloss.sampling.search_bytes`, to
    count beside the op's own); a fused head passes `schedule` instead, ``schedule(n_rows, max_V_local, impl,
    chunk_size, gathered, search=..., vocab_rows=max_V_local) ->
    lmloss.chunks.FusedSchedule`` (its chunks and its weight gradient's schedule within the budget;
    `gathered`: rows are skipped, so its chunks gather theirs). Under `tp_group` the ranks' metadata
    is compared in one all-gather before any other collective (`resolve_shard`): token count, chunk size,
    shard, dtype, the shared options, `agree` (the op's own fields of
    `lmloss.agreement.HOST_FIELDS`), a hash of `options` (an objective's further options: RL policy
    options, ...; on a mismatch every rank's text of them is shown), a hash of the dtypes and shapes of
    `arguments` (the op's tensor arguments, by name: `lmloss.agreement.describe_arguments`; `tensors` are
    added to them) and fingerprints of the labels, of `tensors` (the op's per-token tensors,
    `lmloss.agreement.TENSOR_FIELDS`), of the sampling parameters given per token and of `support`. The
    checks here run before it: a rank whose argument fails one takes the error into that gather and every
    rank raises it (`errors_raised_on_every_rank`); checks made after it on agreed tensors fail on every
    rank alike.

    `support` ``[N, K]`` (a replayed kept set, `lmloss.replay`, already checked locally): the plan's
    kernels run over the K slots per rank (`shard`, `math`; the vocabulary's are `vocab`, `vocab_math`).

    `invariant` (docs/invariant.md): the kernels sum fixed blocks of columns and the combine is exact
    (`lmloss.vocab_parallel.combine_blocks`); agreed across the ranks like every option. Every shard must
    start at a multiple of `INVARIANT_BLOCK` columns and the vocabulary hold at most `INVARIANT_MAX_COLUMNS`.

    `byproducts` (a subset of `lmloss.objectives.BYPRODUCTS`): more outputs of the same pass, agreed with the
    outputs. Not with `support` (the kernels run over its slots, not the vocabulary), nor the sum of squares
    with `invariant` (it has no block form); the argmax's ids travel as floats: at most ``2**24`` columns.

    The rows that count (`lmloss.rows`): `counting` (bool ``[N]``, agreed by the caller: a fingerprinted
    tensor), else ``labels != ignore_index``; without either, every row. Found once, after the agreement,
    so that every rank walks the same chunks. Inside ``torch.compile`` every row is walked (the selection
    is data-dependent); the objectives give the rows that do not count the same zeros either way.
    """
    with errors_raised_on_every_rank(tp_group, vocab_start, device):
        _validate.check_temperature(temperature)
        _validate.check_softcap(softcap)
        _validate.check_ignore_index(ignore_index)
        _validate.check_vocab_size(vocab_size)
        _validate.check_vocab_start(vocab_start)
        _validate.check_chunk_size(chunk_size)
        _validate.check_label_smoothing(label_smoothing)
        _validate.check_z_loss(z_loss)
        _validate.check_invariant(invariant)
        _check_byproducts(byproducts, support=support is not None, invariant=invariant)
        impl = resolve_impl(impl, device, dtype)
    agree = dict(agree or {})
    tensors = dict(tensors or {})
    if sampling is not None:
        agree.update(sampling.agree_fields())
        tensors.update({k: v for k, v in sampling.rows(Rows(0, n_tokens)).items() if isinstance(v, torch.Tensor)})
    if support is not None:
        agree["slots"], tensors["support"] = support.shape[1], support
    agree["log_kept_mass"] = int(log_kept_mass)
    agree["invariant"] = int(invariant)
    gathered = will_gather(tp_group, vocab_start)
    texts = {}
    if gathered:  # only a gather compares them
        texts["objective"] = ", ".join(f"{k}={v!r}" for k, v in sorted((options or {}).items()))
        texts["arguments"] = describe_arguments({**(arguments or {}), **tensors})
    chunk_code = {None: -1, "auto": -2}.get(chunk_size, chunk_size)  # type: ignore[arg-type]
    fields = dict(
        n_tokens=n_tokens, chunk_size=chunk_code, ignore_index=ignore_index, impl=("torch", "triton").index(impl),
        outputs=sum(1 << (OUTPUTS + BYPRODUCTS).index(k) for k in (*outputs, *byproducts)), temperature=float(temperature),
        softcap=float(softcap or 0.0), label_smoothing=float(label_smoothing), z_loss=float(z_loss),
        dtype=_validate.DTYPE_CODES.get(dtype, 99), **(agree or {}),
    )  # fmt: skip
    stats = None if labels is None or not gathered else _validate.label_stats(labels, ignore_index)
    shard, max_local = resolve_shard(
        local_vocab, tp_group=tp_group, vocab_start=vocab_start, vocab_size=vocab_size, device=device,
        agree=fields, label_stats=stats, tensors=tensors if gathered else None, texts=texts,
        block_align=INVARIANT_BLOCK if invariant else 0,
    )  # fmt: skip
    if invariant and shard.vocab_size > INVARIANT_MAX_COLUMNS:  # agreed values: every rank raises alike
        raise ValueError(
            f"invariant=True sums the vocabulary in 64-bit fixed point, up to {INVARIANT_MAX_COLUMNS} columns; "
            f"got vocab_size {shard.vocab_size}"
        )
    if "argmax" in byproducts and shard.vocab_size > ARGMAX_MAX_COLUMNS:  # agreed: every rank raises alike
        raise ValueError(
            f"return_argmax: the ids travel through the partials as floats, exact up to {ARGMAX_MAX_COLUMNS} "
            f"columns; got vocab_size {shard.vocab_size}"
        )
    if labels is not None and not gathered:
        _validate.check_label_range(labels, shard.vocab_size, ignore_index)
    if sampling is not None and sampling.k_max > shard.vocab_size:  # a larger top_k keeps every column alike:
        # the search's candidates (every rank's, padded to k_max under TP) need no more (agreed values)
        sampling = dataclasses.replace(sampling, k_max=shard.vocab_size)
    if counting is None and labels is not None:
        counting = labels != ignore_index
    # the threshold search holds a few chunk-sized buffers whichever kernels run: chunk as torch does;
    # a replayed support's chunk is [c, K] slots (and, fused, the matmul of the rows its ids name)
    width = max_local if support is None else min(max_local, 64 * support.shape[1])
    selection = None
    if counting is not None and not torch.compiler.is_compiling():  # data-dependent: every row under compile
        selection = RowSelection.of(counting.reshape(-1), row_width=width)
    n_count = n_tokens if selection is None else selection.count
    budget_impl = "torch" if sampling is not None else impl
    # the kept-set search's own buffers (PyTorch's, whichever kernels run), per logit and per row of a chunk
    search = search_bytes(sampling, dtype=dtype, vocab=shard.vocab_size, invariant=invariant, world=world_size(tp_group))
    weight_block = weight_block_rows = weight_start = 0
    if schedule is not None:  # a fused head: its chunks and its weight gradient's schedule, within the budget
        fused = schedule(n_count, width, budget_impl, chunk_size, selection is not None, search=search, vocab_rows=max_local)
        chunk_size, weight_block, weight_block_rows = fused.chunk_rows, fused.weight_block, fused.weight_block_rows
        weight_start = fused.weight_start
    elif chunk_size == "auto":
        chunk_size = auto_chunk(n_count, width, budget_impl, search)
    math = ChunkMath(
        vocab_start=shard.start, valid=shard.valid, scale=1.0 / temperature, softcap=float(softcap or 0.0)
    )
    vocab, vocab_math = shard, math
    if support is not None:  # the kernels run over the K slots of each rank, which the source transforms
        k, rank = support.shape[1], 0 if tp_group is None else torch.distributed.get_rank(tp_group)
        shard = VocabShard(start=rank * k, size=k, vocab_size=world_size(tp_group) * k)
        math = ChunkMath(vocab_start=shard.start, valid=k, scale=1.0, softcap=0.0)
    return LossPlan(
        shard=shard, math=math, impl=impl, chunk_size=chunk_size, outputs=outputs, ignore_index=ignore_index,
        label_smoothing=float(label_smoothing), z_loss=float(z_loss), tp_group=tp_group, sampling=sampling,
        log_kept_mass=bool(log_kept_mass), vocab=vocab, vocab_math=vocab_math,
        invariant_block=0 if not invariant else 1 if support is not None else INVARIANT_BLOCK,
        rows=selection, counting=None if counting is None else counting.reshape(-1), weight_block=weight_block,
        weight_block_rows=weight_block_rows, weight_start=weight_start,
        byproducts=tuple(k for k in BYPRODUCTS if k in byproducts),
    )  # fmt: skip


#: The largest vocabulary ``return_argmax`` takes: the ids ride in the fp32 partials (`lmloss.kernels`).
ARGMAX_MAX_COLUMNS = 2**24


def _check_byproducts(byproducts: tuple[str, ...], *, support: bool, invariant: bool) -> None:
    """The by-products' local checks (names from the ops' ``return_*`` options, `lmloss.objectives.BYPRODUCTS`)."""
    unknown = [k for k in byproducts if k not in BYPRODUCTS]
    if unknown:
        raise ValueError(f"unknown by-products {unknown}; expected some of {BYPRODUCTS}")
    if byproducts and support:
        raise ValueError(
            f"return_{byproducts[0]}=True with support=: the kernels run over the replayed support's slots (absent "
            "slots hold a stand-in logit), not the vocabulary; use top_k / top_p / min_p to recompute the kept set"
        )
    if "log_sum_sq_probs" in byproducts and invariant:
        raise ValueError(
            "return_log_sum_sq_probs=True with invariant=True: the sum of squared probabilities has no blocked, "
            "fixed-point form in the invariant kernels; drop one of them"
        )


# ----------------------------------------------------------------------------------------------------------
# the chunk loop


def forward_pass(
    plan: LossPlan,
    n: int,
    objective,
    source: ChunkSource,
    *,
    device: torch.device,
    dtype: torch.dtype,
    grad_sink: GradSink | None = None,
) -> dict[str, torch.Tensor]:
    """Walk the chunks once: the objective's per-token results (``[n, ...]`` each, as its chunks give them;
    0 in the rows that do not count, which no chunk holds).

    `objective` (`lmloss.objectives`) computes each chunk's results from its logits ``source(rows)`` and the
    pass's kernels; with `grad_sink`, also the chunk's gradient (of a summed loss, or of an objective of the
    per-token outputs), handed to the sink while the chunk is at hand.
    """
    state = objective.start(n, device)  # what lives for this pass only (a teacher's scratch, ...)
    kernels = plan.kernels(n, device)
    overwrite = getattr(source, "owns_chunks", False)
    new = torch.empty if plan.rows is None else torch.zeros
    results: dict[str, torch.Tensor] = {}
    chunks = plan.chunks(n, gather=getattr(source, "gathers_rows", False))
    for rows in chunks:
        stats = objective.forward_chunk(state, rows, source(rows), kernels, grad_sink, overwrite=overwrite)
        for k in objective.result_keys():
            v = stats.get(k)
            if v is None:
                continue
            if k not in results:
                results[k] = new((n, *v.shape[1:]), dtype=v.dtype, device=device)
            rows.put_(results[k], v)
    if grad_sink is not None and hasattr(grad_sink, "pass_done"):
        grad_sink.pass_done()
    if not chunks:  # no row counts (or n == 0): every result is zeros
        results = {k: objective.empty_result(k, n, device, compute_dtype(dtype)) for k in objective.result_keys()}
    return results


def backward_pass(
    plan: LossPlan, n: int, objective, source: ChunkSource, grad_sink: GradSink, saved: dict, coef, extra: dict, *,
    device: torch.device, columns: bool = False,
) -> None:  # fmt: skip
    """Walk the chunks again: each chunk's gradient from what the forward saved (`saved`, e.g. the
    log-sum-exps) and the per-token coefficients of the upstream gradients. No collectives.

    `columns`: the weight pass of a fused head without a weight-gradient accumulator (`plan.weight_block`):
    the tiles are blocks of `weight_block` local columns, each over the rows in chunks of
    `weight_block_rows`; the sink is told where each block starts and ends (``start_block`` /
    ``finish_block``), and the objective gets each block's math (a sub-shard, `LossPlan.block_math`)."""
    gather = getattr(source, "gathers_rows", False)
    if not columns:
        state = objective.start(n, device)
        kernels = plan.kernels(n, device)
        for rows in plan.chunks(n, gather=gather):
            objective.backward_chunk(state, rows, source(rows), kernels, grad_sink, saved, coef, extra, math=plan.math)
        if hasattr(grad_sink, "pass_done"):
            grad_sink.pass_done()
        return
    state = objective.start(n, device, tile=(max(1, plan.weight_block_rows), plan.weight_block))
    chunks = plan.chunks(n, gather=gather, chunk_rows=plan.weight_block_rows)
    kernels = make_kernels(plan.impl, max(1, plan.weight_block_rows), plan.weight_block, device)
    for cols in plan.column_blocks():
        grad_sink.start_block(cols, single_chunk=len(chunks) == 1)
        math = plan.block_math(cols)
        for rows in chunks:
            x = source(rows, cols)
            objective.backward_chunk(state, rows, x, kernels, grad_sink, saved, coef, extra, math=math, cols=cols)
        grad_sink.finish_block()
