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
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from lmloss import _validate
from lmloss.agreement import describe_arguments, errors_raised_on_every_rank, will_gather
from lmloss.kernels import INVARIANT_BLOCK, ChunkMath, compute_dtype, make_kernels, resolve_impl
from lmloss.objectives import OUTPUTS
from lmloss.sampling import Sampling
from lmloss.vocab_parallel import INVARIANT_MAX_COLUMNS, ProcessGroup, VocabShard, resolve_shard, world_size

#: The input dtype as it travels in the rank-agreement vector (fp32 on one rank and fp64 on another would
#: all-reduce partials of different sizes).
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
ChunkSource = Callable[[int, int], torch.Tensor]


class GradSink(Protocol):
    def buffer(self, s: int, e: int, x: torch.Tensor) -> torch.Tensor:
        """Where the kernel writes the gradient of chunk ``[s, e)`` (its logits are `x`)."""

    def consume(self, s: int, e: int, grad: torch.Tensor) -> None:
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

    @property
    def invariant(self) -> bool:
        return self.invariant_block > 0

    @property
    def returned(self) -> tuple[str, ...]:
        """What the op returns: `outputs`, then ``"log_kept_mass"`` (not differentiable) if asked."""
        return (*self.outputs, "log_kept_mass") if self.log_kept_mass else self.outputs

    @property
    def flags(self) -> dict[str, bool]:
        """Which optional partial sums the kernels must produce."""
        wants_target = "logprobs" in self.outputs or "loss" in self.outputs
        smoothing = "loss" in self.outputs and self.label_smoothing > 0
        return dict(entropy="entropy" in self.outputs, target=wants_target, sum_logits=smoothing)

    def chunks(self, n: int) -> Iterator[tuple[int, int]]:
        """``(start, end)`` row ranges covering ``[0, n)``."""
        step = n if self.chunk_size is None else self.chunk_size
        for s in range(0, n, max(step, 1)):
            yield s, min(s + step, n)

    def kernels(self, n: int, device: torch.device):
        rows = min(n, self.chunk_size or n)
        return make_kernels(self.impl, max(rows, 1), self.shard.size, device)


def make_plan(
    *,
    n_tokens: int,
    local_vocab: int,
    device: torch.device,
    dtype: torch.dtype,
    labels: torch.Tensor | None,
    outputs: tuple[str, ...],
    chunk_size: int | str | None,
    auto_chunk: Callable[[int, int, str], int | None],
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
    arguments: dict[str, torch.Tensor | None] | None = None,
) -> LossPlan:
    """Check the options every op shares and resolve them into a `LossPlan`.

    `labels` are the flat int64 labels (or None). `auto_chunk(n_tokens, max_V_local, impl)` sizes
    ``chunk_size="auto"`` from values that every TP rank agrees on. Under `tp_group` the ranks' metadata
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
        impl = resolve_impl(impl, device, dtype)
    agree = dict(agree or {})
    tensors = dict(tensors or {})
    if sampling is not None:
        agree.update(sampling.agree_fields())
        tensors.update({k: v for k, v in sampling.rows(0, n_tokens).items() if isinstance(v, torch.Tensor)})
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
        outputs=sum(1 << OUTPUTS.index(k) for k in outputs), temperature=float(temperature),
        softcap=float(softcap or 0.0), label_smoothing=float(label_smoothing), z_loss=float(z_loss),
        dtype=_DTYPE_CODES.get(dtype, 99), **(agree or {}),
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
    if labels is not None and not gathered:
        _validate.check_label_range(labels, shard.vocab_size, ignore_index)
    if chunk_size == "auto":
        # the threshold search holds a few chunk-sized buffers whichever kernels run: chunk as torch does;
        # a replayed support's chunk is [c, K] slots (and, fused, the matmul of the rows its ids name)
        width = max_local if support is None else min(max_local, 64 * support.shape[1])
        chunk_size = auto_chunk(n_tokens, width, "torch" if sampling is not None else impl)
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
    )  # fmt: skip


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
    """Walk the chunks once: the objective's per-token results (``[n, ...]`` each, as its chunks give them).

    `objective` (`lmloss.objectives`) computes each chunk's results from its logits ``source(s, e)`` and the
    pass's kernels; with `grad_sink`, also the chunk's gradient (of a summed loss, or of an objective of the
    per-token outputs), handed to the sink while the chunk is at hand.
    """
    state = objective.start(n, device)  # what lives for this pass only (a teacher's scratch, ...)
    kernels = plan.kernels(n, device)
    overwrite = getattr(source, "owns_chunks", False)
    results: dict[str, torch.Tensor] = {}
    for s, e in plan.chunks(n):
        stats = objective.forward_chunk(state, s, e, source(s, e), kernels, grad_sink, overwrite=overwrite)
        for k in objective.result_keys():
            v = stats.get(k)
            if v is None:
                continue
            if k not in results:
                results[k] = torch.empty((n, *v.shape[1:]), dtype=v.dtype, device=device)
            results[k][s:e] = v
    if n == 0:  # no chunk: empty results of the compute dtype
        results = {k: torch.empty(0, dtype=compute_dtype(dtype), device=device) for k in objective.result_keys()}
    return results


def backward_pass(
    plan: LossPlan, n: int, objective, source: ChunkSource, grad_sink: GradSink, saved: dict, coef, extra: dict, *,
    device: torch.device,
) -> None:  # fmt: skip
    """Walk the chunks again: each chunk's gradient from what the forward saved (`saved`, e.g. the
    log-sum-exps) and the per-token coefficients of the upstream gradients. No collectives."""
    state = objective.start(n, device)
    kernels = plan.kernels(n, device)
    for s, e in plan.chunks(n):
        objective.backward_chunk(state, s, e, source(s, e), kernels, grad_sink, saved, coef, extra)
