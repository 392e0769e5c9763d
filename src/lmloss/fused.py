"""Log-probs, entropy and cross-entropy straight from hidden states and the LM-head weight.

Thin: the same plan and chunk loop as the logits ops (`lmloss.plan`), with the head
``hidden @ weight.T + bias`` (`lmloss.chunks.LinearHead`) in place of the logits:

* source: each chunk's logits ``hidden[s:e] @ weight.T + bias`` are made by one matmul in the inputs'
  dtype into a reused chunk buffer (bf16 / fp16 GEMMs accumulate in fp32 and round their output once).
  No ``[tokens, V_local]`` tensor ever exists.
* sink: the kernel turns the chunk's logits into its d-logits in place, and the sink chains them
  through the matmul: ``d hidden[s:e] = dz @ W``, ``d W += dz.T @ hidden[s:e]``, ``d b += sum(dz)``.

Two ways through (`lmloss.functions`):

* per-token outputs (`linear_token_logprobs`, ``reduction="none"``): the backward recomputes each chunk's
  logits and turns arbitrary per-token upstream gradients (RL advantages) into gradients (4 matmuls).
* a summed loss (``reduction="sum"`` / ``"mean"``) with gradients: the upstream gradient is one scalar,
  so the forward computes the gradients while each chunk's logits are at hand and the backward only
  scales them (3 matmuls, the floor).

The weight (and bias) gradient accumulates over chunks in ``weight_grad_dtype`` (fp32 by default; on
CUDA with bf16 / fp16 inputs the d-logits stay in the input dtype and the GEMM accumulates into the fp32
buffer directly, ``addmm(out_dtype=float32)``, so the tensor cores do the work). The hidden gradient is
written once per row, in the hidden dtype (fp32 under TP, where ranks' partial gradients are summed:
all-reduced over ``tp_group``, or reduce-scattered with sequence parallelism).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from lmloss import _validate, replay
from lmloss.agreement import errors_raised_on_every_rank
from lmloss.chunks import (
    MIN_CHUNK_ROWS,
    WEIGHT_TILE_ROWS,
    FusedSchedule,
    GatherRows,
    LinearHead,
    chunk_budget_mib,
    fused_schedule,
    gemm_accumulates_into_fp32,
    invariant_gemm_tile,
    invariant_tile_bytes,
    linear_head_options,
)
from lmloss.functions import Op, PerTokenLoss, SummedLoss
from lmloss.kernels import compute_dtype
from lmloss.logits import loss_denominator
from lmloss.objectives import SoftmaxObjective
from lmloss.plan import make_plan
from lmloss.sampling import make_sampling, report_dropped
from lmloss.vocab_parallel import ProcessGroup, world_size

#: Bytes per logit a fused chunk holds with the PyTorch kernels, for ``chunk_size="auto"``: two fp32
#: ``[chunk, V_local]`` tensors at once (the logits chunk, and ``p`` beside it for an entropy gradient).
#: The Triton ones hold only the chunk's logits in the input dtype (their d-logits overwrite them).
TORCH_BYTES_PER_LOGIT = 8
#: The same for a summed cross-entropy without softcap: the fp32 chunk alone, its exps and then its d-logits
#: written over it (`lmloss.kernels.torch_ref`'s ``partials_then_grad_``; measured: 4 bytes per logit).
SUMMED_BYTES_PER_LOGIT = 4


def _check_tensors(
    hidden, weight, labels, bias, sequence_parallel, weight_grad_dtype, tp_group, reduction, mean_group
):
    """The fused ops' local checks; returns the int64 labels (or None) and the leading shape the labels
    must have."""
    if reduction is not None:
        _validate.check_reduction(reduction)
    _validate.check_group("mean_group", mean_group)
    _validate.check_floating("hidden", hidden)
    _validate.check_floating("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V_local, H], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden width {hidden.shape[-1] if hidden.dim() else None} does not match weight [V_local, H] "
            f"with H={weight.shape[1]}"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype")
    if hidden.device != weight.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}")
    if bias is not None:
        _validate.check_floating("bias", bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be [V_local] = [{weight.shape[0]}], got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias ({bias.dtype}) and weight ({weight.dtype}) must have the same dtype")
    if weight_grad_dtype not in (torch.float32, weight.dtype):
        raise ValueError(
            f"weight_grad_dtype must be torch.float32 or the weight's dtype ({weight.dtype}), got {weight_grad_dtype}"
        )
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
    if sequence_parallel and tp_group is None:
        raise ValueError("sequence_parallel=True needs the tp_group that the tokens are sharded over")
    expected = hidden.shape[:-1]
    if sequence_parallel:
        expected = torch.Size((world_size(tp_group) * hidden.shape[0], *hidden.shape[1:-1]))
    if labels is not None:
        against = "hidden (gathered over tp_group)" if sequence_parallel else "hidden"
        labels = _validate.check_labels(labels, expected, hidden.device, against=against)
    return labels, expected


@dataclasses.dataclass
class Prepared:
    """What `prepare` resolves for a fused op: the (gathered) flat hidden states and labels, the plan, the
    head factory (``head(hidden, weight, bias)``) and the labels' leading shape."""

    flat: torch.Tensor
    labels: torch.Tensor | None
    plan: object
    head: object
    shape: torch.Size


def prepare(
    hidden, weight, labels, bias, *, chunk_size, sequence_parallel, weight_grad_dtype, tp_group,
    reduction=None, mean_group=None, agree=None, bytes_per_logit=None, chunk_buffers=1, checks=None, invariant=False,
    memory_budget_mib=None, **options,
) -> Prepared:  # fmt: skip
    """Check the tensors, resolve the plan, gather sequence-parallel hidden states (every fused op's door).

    `agree`: more values every TP rank must share (fields of `lmloss.agreement.HOST_FIELDS`);
    `bytes_per_logit`: the PyTorch implementation's per-logit working set (default
    `TORCH_BYTES_PER_LOGIT`), for ops holding more; `chunk_buffers`: how many chunk-sized buffers of the input
    dtype the Triton implementation holds (1: the chunk itself); both size the chunks within the memory
    budget (`memory_budget_mib`, `lmloss.chunks.chunk_budget_mib`), which also picks the weight gradient's
    schedule (`lmloss.chunks.fused_schedule`). `checks`: the op's own local checks, run before the rank
    agreement (``checks(expected_leading_shape)``); `options`: `make_plan`'s.
    `invariant`: the plan's invariant mode, and the head's logits made by `lmloss.chunks.tiled_linear` (chunks
    of a whole number of its tiles' rows: `chunk_size` is rounded down to one, or up to one tile).
    """
    _validate.check_group("tp_group", tp_group)
    with errors_raised_on_every_rank(tp_group, options["vocab_start"], hidden):
        labels, expected = _check_tensors(
            hidden, weight, labels, bias, sequence_parallel, weight_grad_dtype, tp_group, reduction, mean_group
        )  # fmt: skip
        budget = chunk_budget_mib(weight.device, memory_budget_mib)
        if checks is not None:
            options.update(checks(expected))
    grad = torch.is_grad_enabled() and sum(
        1 << i for i, t in enumerate((hidden, weight, bias)) if t is not None and t.requires_grad
    )
    n_tokens = math.prod(expected)
    schedule = functools.partial(
        _schedule, hidden=hidden, weight=weight, n_tokens=n_tokens, grad=grad, budget=budget, chunk_buffers=chunk_buffers,
        bytes_per_logit=bytes_per_logit or TORCH_BYTES_PER_LOGIT, weight_grad_dtype=weight_grad_dtype,
        tp=world_size(tp_group), sequence_parallel=sequence_parallel, weight_pass=options.get("support") is None,
        invariant=invariant,
    )  # fmt: skip
    arguments = {"hidden": hidden, "weight": weight, "bias": bias, **options.pop("arguments", {})}
    agree = {
        "op": 1, **(agree or {}), "hidden_width": weight.shape[1], "sequence_parallel": int(sequence_parallel),
        "grad": int(grad), "reduction": -1 if reduction is None else _validate.REDUCTIONS.index(reduction),
        "mean_group": -1 if mean_group is None else world_size(mean_group), "chunk_budget": budget,
        "weight_grad_dtype": _validate.DTYPE_CODES.get(weight_grad_dtype, 99),
    }  # fmt: skip
    plan = make_plan(
        n_tokens=n_tokens, local_vocab=weight.shape[0], device=weight.device, dtype=weight.dtype,
        labels=None if labels is None else labels.reshape(-1), chunk_size=chunk_size, auto_chunk=None,
        schedule=schedule, tp_group=tp_group, agree=agree, invariant=invariant, arguments=arguments, **options,
    )  # fmt: skip
    if invariant and plan.chunk_size is not None:  # whole tiles per chunk (agreed values: the same on every rank)
        rows = invariant_gemm_tile(weight.device)[0]
        plan = dataclasses.replace(plan, chunk_size=max(rows, plan.chunk_size - plan.chunk_size % rows))
    flat = hidden.reshape(-1, hidden.shape[-1])
    if sequence_parallel:
        flat = GatherRows.apply(flat, tp_group)
    if plan.rows is None and plan.counting is not None and torch.compiler.is_compiling():
        # torch.compile walks every row: a row that does not count is computed and masked, and its hidden row
        # would still reach the weight gradient (0 * inf = NaN). Eager leaves plan.rows None only where every
        # row counts: no copy of the hidden states there (it would sit outside the memory budget)
        flat = torch.where(plan.counting[:, None], flat, 0)
    opts = linear_head_options(
        weight, weight_grad_dtype=weight_grad_dtype, sequence_parallel=sequence_parallel, tp_group=tp_group,
        invariant=invariant,
    )  # fmt: skip
    head = functools.partial(LinearHead, opts=opts)
    return Prepared(flat, None if labels is None else labels.reshape(-1), plan, head, expected)


def _schedule(
    n_rows, local_vocab, impl, chunk_size, gathered, *, search=(0, 0), vocab_rows=None, hidden, weight, n_tokens, grad, budget,
    chunk_buffers, bytes_per_logit, weight_grad_dtype, tp, sequence_parallel, weight_pass, invariant,
) -> FusedSchedule:  # fmt: skip
    """`fused_schedule` from a fused op's arguments: what each buffer costs (agreed values only). `search`: the
    kept-set search's bytes per logit and per row (`lmloss.sampling.search_bytes`); `vocab_rows`: the weight's
    rows (the largest shard's; `local_vocab` is a chunk's width, a replayed support's slots for one)."""
    h_width, item = weight.shape[1], weight.element_size()
    low_precision = weight.dtype in (torch.bfloat16, torch.float16)
    if impl == "triton":
        per_logit = chunk_buffers * item
    else:  # beside the fp32 chunk, the low-precision one the matmul writes (`HiddenRows`)
        per_logit = bytes_per_logit + (item if low_precision else 0)
    fp32_acc = low_precision and weight_grad_dtype == torch.float32
    wants_weight, wants_hidden, wants_bias = bool(grad & 2), bool(grad & 1), bool(grad & 4)
    # a replayed support's weight gradient is a scatter into an fp32 [V_local, H] accumulator (no weight pass)
    rows = local_vocab if vocab_rows is None else vocab_rows
    accumulator = rows * h_width * 4 if wants_weight and (fp32_acc or not weight_pass) else 0
    fixed = local_vocab * 4 if wants_bias else 0  # the bias gradient's fp32 sum
    if wants_hidden and (tp > 1 and not sequence_parallel and low_precision or not weight_pass):
        fixed += n_tokens * h_width * 4  # the hidden gradient's fp32 sum over TP ranks (or the slots')
    if sequence_parallel:  # every rank's tokens, gathered
        fixed += n_tokens * h_width * item
    if invariant:  # the fixed-shape GEMM's tile, and the transposed output of the rows after whole tiles
        tile_rows, tile_cols = invariant_gemm_tile(weight.device)
        fixed += invariant_tile_bytes(weight.device, h_width, item) + tile_rows * tile_cols * item
    # fp32 d-logits of a low-precision weight (CPU) are written into its gradient in fp32 tiles
    tile = WEIGHT_TILE_ROWS * h_width * 4 if fp32_acc and not gemm_accumulates_into_fp32(weight.device, weight.dtype) else 0
    return fused_schedule(
        n_rows=n_rows, local_vocab=local_vocab, hidden_width=h_width, device=weight.device, budget_mib=budget,
        bytes_per_logit=per_logit + search[0], gather_bytes_per_row=h_width * item if gathered else 0,
        accumulator_bytes=accumulator, fixed_bytes=fixed, chunk_size=chunk_size, weight_tile_bytes=tile,
        bytes_per_row=search[1], weight_pass=weight_pass,
        # a weight-pass tile recomputes its d-logits as a per-token backward does (at least the default's buffers,
        # a kept set's mask), and upcasts the low-precision hidden rows of each chunk for the fp32 GEMM
        block_bytes_per_logit=max(per_logit, TORCH_BYTES_PER_LOGIT + (item if low_precision else 0))
        + (4 if search[0] else 0), block_bytes_per_row=h_width * 4 if fp32_acc else 0,
        min_rows=invariant_gemm_tile(weight.device)[0] if invariant else MIN_CHUNK_ROWS,
    )  # fmt: skip


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int | str | None = "auto",
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    tp_group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    sequence_parallel: bool = False,
    return_entropy: bool = False,
    weight_grad_dtype: torch.dtype = torch.float32,
    impl: str = "auto",
    memory_budget_mib: float | None = None,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    support: torch.Tensor | None = None,
    return_log_kept_mass: bool = False,
    invariant: bool = False,
    return_logit_sum: bool = False,
    return_argmax: bool = False,
    return_log_sum_sq_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """`lmloss.token_logprobs` of ``hidden @ weight.T + bias``, without materializing the logits.

    Args:
        hidden: ``[..., H]`` fp32 / bf16 / fp16. With ``sequence_parallel=True``, this rank's block of
            tokens along dim 0; the op gathers the blocks over `tp_group` in rank order.
        weight: ``[V_local, H]``, same dtype: the LM head, a tied embedding, or this rank's vocab shard.
        labels: ``[...]`` global vocabulary ids, the (gathered) leading shape of `hidden`; `ignore_index` where
            a token does not count: its hidden row is never multiplied, its outputs are 0.0 and its
            gradient row 0.
        bias: optional ``[V_local]``.
        chunk_size: tokens per chunk; ``"auto"`` sizes it from the memory budget, agreed across
            `tp_group`; None for one chunk.
        memory_budget_mib: what the op may hold beyond its inputs, their gradients and O(tokens) vectors
            (MiB), the weight-gradient accumulator included; None: ``LMLOSS_CHUNK_BUDGET_MIB``, else 64 MiB
            on CPU and 4 GiB on CUDA (`lmloss.chunks.chunk_budget_mib`). Where an fp32 ``[V_local, H]``
            accumulator does not fit beside chunks of a useful size, it is kept for the columns it fits for
            and the others' weight gradient is made by a weight pass over blocks of columns (one more matmul
            for those; `lmloss.chunks.fused_schedule`). With ``chunk_size="auto"`` a budget below the
            smallest the call can honour (chunks of 8 tokens) raises `lmloss.chunks.MemoryBudgetError` (a
            ValueError naming that smallest budget). Agreed across `tp_group`.
        sequence_parallel: `hidden` is sharded along tokens over `tp_group`; its gradient is
            reduce-scattered back. Without it every TP rank holds the same `hidden` and receives the
            full (all-reduced) gradient.
        weight_grad_dtype: dtype of the weight-gradient accumulator, ``torch.float32`` (default) or the
            weight's own dtype (saves ``4 - 2`` bytes per weight element for bf16, at the precision cost
            stated in the README). Within a budget that the fp32 accumulator does not fit, the fp32 sums
            are made per block of the weight pass instead: the same precision, no accumulator.
        top_k, top_p, min_p, return_log_kept_mass: the rollout engine's truncation, recomputed per chunk
            (as in `lmloss.token_logprobs`).
        support: the engine's kept ids ``[..., K]`` (-1 padded): each chunk multiplies its hidden rows by
            only the weight rows its ids name (`lmloss.replay`). With ``sequence_parallel``, `labels` and
            `support` cover every rank's tokens (as `labels` always does).
        invariant: each token's outputs are a function of its hidden row, the whole weight and bias and the
            options alone, the same bits whatever the chunking, the other rows, the TP degree and sequence
            parallelism (docs/invariant.md): the logits come from GEMMs of one fixed shape
            (`lmloss.chunks.tiled_linear`) and the vocabulary is summed in fixed blocks combined exactly.
        Other arguments as in `lmloss.token_logprobs` (`temperature`, `softcap`, `impl`, ...).

        return_logit_sum, return_argmax, return_log_sum_sq_probs: by-products of the same pass, without
            gradient, as in `lmloss.token_logprobs`.

    Returns:
        fp32 ``[...]`` log-probs (0.0 where ignored), then entropy, log kept mass and the by-products if asked
        (a tuple, in `lmloss.token_logprobs`' order); the same on every TP rank. Gradients flow to `hidden`, `weight` and `bias` for any per-token
        upstream gradients.
    """
    n_tokens = math.prod(hidden.shape[:-1]) * (world_size(tp_group) if sequence_parallel else 1)
    checked = {}

    def checks(expected):
        byproducts = _validate.byproducts(
            logit_sum=return_logit_sum, argmax=return_argmax, log_sum_sq_probs=return_log_sum_sq_probs
        )
        if support is not None:
            checked["support"] = replay.check_arguments(
                support, math.prod(expected), hidden.device, vocab_size, (top_k, top_p, min_p), return_log_kept_mass
            )
            return {"support": checked["support"], "byproducts": byproducts}
        return {"byproducts": byproducts, "sampling": make_sampling(
            top_k, top_p, min_p, n_tokens=n_tokens, device=hidden.device, log_kept_mass=return_log_kept_mass
        )}  # fmt: skip

    p = prepare(
        hidden, weight, labels, bias, chunk_size=chunk_size, temperature=temperature, softcap=softcap,
        ignore_index=ignore_index, vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start,
        sequence_parallel=sequence_parallel, weight_grad_dtype=weight_grad_dtype, impl=impl,
        outputs=("logprobs", "entropy") if return_entropy else ("logprobs",), checks=checks,
        log_kept_mass=return_log_kept_mass, invariant=invariant,
        memory_budget_mib=memory_budget_mib,
    )  # fmt: skip
    if support is None:
        op = Op(p.plan, p.head, SoftmaxObjective(p.plan, p.labels))
    else:
        op = replay.op_over_slots(
            p.plan, p.head, (p.flat, weight, bias), p.labels, checked["support"], return_log_kept_mass
        )
    outs = tuple(o.view(p.shape) for o in PerTokenLoss.apply(op, p.flat, weight, bias))
    if p.plan.sampling is not None or support is not None:
        report_dropped(outs[0], p.labels.view(p.shape), ignore_index)
    return outs if len(outs) > 1 else outs[0]


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int | str | None = "auto",
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    temperature: float = 1.0,
    softcap: float | None = None,
    vocab_size: int | None = None,
    tp_group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    sequence_parallel: bool = False,
    mean_group: ProcessGroup | None = None,
    weight_grad_dtype: torch.dtype = torch.float32,
    impl: str = "auto",
    memory_budget_mib: float | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """`lmloss.cross_entropy` of ``hidden @ weight.T + bias``, without materializing the logits.

    Arguments as in `linear_token_logprobs` and `lmloss.cross_entropy` (``reduction``, ``label_smoothing``,
    ``z_loss``, ``mean_group``, ``invariant``). With ``"sum"`` / ``"mean"`` and gradients enabled, the gradients are
    computed during the forward (3 matmuls in all instead of 4) and only scaled by the backward.
    """
    p = prepare(
        hidden, weight, labels, bias, chunk_size=chunk_size, temperature=temperature, softcap=softcap,
        ignore_index=ignore_index, vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start,
        sequence_parallel=sequence_parallel, weight_grad_dtype=weight_grad_dtype, impl=impl,
        outputs=("loss",), label_smoothing=label_smoothing, z_loss=z_loss, reduction=reduction,
        mean_group=mean_group, invariant=invariant, memory_budget_mib=memory_budget_mib,
        bytes_per_logit=SUMMED_BYTES_PER_LOGIT if reduction != "none" and softcap is None else None,
    )  # fmt: skip
    if reduction == "none":
        op = Op(p.plan, p.head, SoftmaxObjective(p.plan, p.labels))
        (per_token,) = PerTokenLoss.apply(op, p.flat, weight, bias)
        return per_token.view(p.shape)
    denominator = loss_denominator(
        p.labels, ignore_index=ignore_index, reduction=reduction, mean_group=mean_group,
        dtype=compute_dtype(hidden.dtype),
    )  # fmt: skip
    grad_scale = None if denominator is None else denominator.reciprocal()
    op = Op(p.plan, p.head, SoftmaxObjective(p.plan, p.labels, grad_scale=grad_scale))
    return SummedLoss.apply(op, torch.is_grad_enabled(), denominator, p.flat, weight, bias)
