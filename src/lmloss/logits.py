"""Per-token log-probs, entropy and cross-entropy from logits, chunked over tokens and vocab-parallel.

Thin: each op checks its arguments, resolves one `LossPlan` and runs a loss Function (`lmloss.functions`)
over the logits (`lmloss.chunks.LogitsHead`, or a replayed support's slots, `lmloss.replay`) with the
softmax objective (`lmloss.objectives.SoftmaxObjective`). The gradient is written once into a buffer of
the logits' dtype (the saved logits are never modified), or, with ``inplace_backward=True``, over the
logits themselves.
"""

from __future__ import annotations

import math

import torch

from lmloss import _validate, replay
from lmloss.agreement import errors_raised_on_every_rank
from lmloss.chunks import LogitsHead, auto_chunk_size, chunk_budget_mib
from lmloss.functions import InPlaceCrossEntropy, Op, PerTokenLoss
from lmloss.kernels import INVARIANT_BLOCK, compute_dtype
from lmloss.objectives import SoftmaxObjective
from lmloss.plan import LossPlan, make_plan
from lmloss.sampling import make_sampling, report_dropped
from lmloss.vocab_parallel import ProcessGroup, all_reduce_sum_

#: Bytes per logit the PyTorch kernels hold for a chunk (two fp32 scratch buffers), for ``chunk_size="auto"``
#: (`lmloss.chunks.auto_chunk_size`); the Triton kernels hold nothing chunk-sized: one chunk.
TORCH_BYTES_PER_LOGIT = 8


def logits_chunk_size(
    n_tokens: int, local_vocab: int, impl: str, device: torch.device, budget_mib: float, search: tuple = (0, 0),
    torch_extra: tuple = (0, 0),
) -> int:  # fmt: skip
    """``chunk_size="auto"`` for the logits ops: the PyTorch kernels' scratch within the budget (and `torch_extra`
    more of it, bytes per logit and per row), and the kept-set search's (`search`, the same units,
    `lmloss.sampling.search_bytes`)."""
    if impl == "triton" and not any(search):
        return auto_chunk_size(n_tokens, local_vocab, device, 0, budget_mib=budget_mib)
    per_logit, per_row = TORCH_BYTES_PER_LOGIT + search[0] + torch_extra[0], search[1] + torch_extra[1]
    return auto_chunk_size(n_tokens, local_vocab, device, per_logit, budget_mib=budget_mib, bytes_per_row=per_row)

def _check_logits(logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor | None:
    """Check the tensors every logits op shares; return the labels as int64 (or None)."""
    _validate.check_floating("logits", logits)
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary)")
    if labels is None:
        return None
    return _validate.check_labels(labels, logits.shape[:-1], logits.device, against="logits")


def _plan(logits: torch.Tensor, labels: torch.Tensor | None, budget: float, **options) -> LossPlan:
    device = logits.device
    # beyond the kernels' two fp32 buffers: a low-precision chunk's softcap slope (a third), and the invariant
    # mode's per-block sums of each row (`INVARIANT_BLOCK` columns a block)
    lowp = logits.dtype in (torch.bfloat16, torch.float16)
    per_logit = 4 if options.get("softcap") and lowp else 0
    per_row = 32 * (logits.shape[-1] // INVARIANT_BLOCK + 1) if options.get("invariant") else 0

    def auto_chunk(n, v, impl, search):
        return logits_chunk_size(n, v, impl, device, budget, search, (per_logit, per_row))

    return make_plan(
        n_tokens=math.prod(logits.shape[:-1]), local_vocab=logits.shape[-1], device=device, dtype=logits.dtype,
        labels=None if labels is None else labels.reshape(-1), auto_chunk=auto_chunk,
        arguments={"logits": logits},
        **options,
    )  # fmt: skip


def _flat(logits: torch.Tensor, labels: torch.Tensor | None):
    """``[..., V] -> [N, V]`` as a view when the layout allows it (a copy otherwise)."""
    return logits.reshape(-1, logits.shape[-1]), None if labels is None else labels.reshape(-1)


def reduce_loss(
    per_token: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int,
    reduction: str,
    mean_group: ProcessGroup | None,
) -> torch.Tensor:
    """Apply `reduction` to per-token losses (ignored tokens already hold 0), or to their sum (0-d).

    ``"mean"`` divides the local sum by the number of non-ignored tokens, counted over `mean_group`
    when given (one all-reduce of a scalar). With no valid token it returns 0 with zero gradients.
    """
    if reduction == "none":
        return per_token
    total = per_token.sum()
    denominator = loss_denominator(
        labels, ignore_index=ignore_index, reduction=reduction, mean_group=mean_group, dtype=total.dtype
    )
    return total if denominator is None else total / denominator


def loss_denominator(
    labels: torch.Tensor, *, ignore_index: int, reduction: str, mean_group: ProcessGroup | None, dtype: torch.dtype
) -> torch.Tensor | None:
    """What ``reduction`` divides the summed loss by: for ``"mean"`` the number of non-ignored tokens (over
    `mean_group` when given: one all-reduce of a scalar), at least 1, a 0-d `dtype` tensor on the labels'
    device (no host sync); None for ``"sum"``."""
    if reduction != "mean":
        return None
    count = (labels != ignore_index).sum().to(dtype)
    all_reduce_sum_(count, mean_group)
    return count.clamp(min=1.0)


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int | str | None = "auto",
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    tp_group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    return_entropy: bool = False,
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
    """Log-probability of each label: ``log_softmax(softcap(logits) / temperature)[..., label]``.

    Args:
        logits: ``[..., V_local]`` fp32 / bf16 / fp16 (fp64 is computed in fp64); this rank's vocabulary
            shard under TP.
        labels: ``[...]`` integer global vocabulary ids, or `ignore_index`: a token that does not count. It
            takes no softmax pass (a run of at least `lmloss.rows.min_gap` such tokens is skipped: 64 on a
            CPU, more over fewer than 2048 columns, a chunk on a GPU; a shorter one is computed with its
            neighbours and masked), every output there is 0.0 and its gradient row 0.
        chunk_size: tokens per chunk (over the flattened leading dims); ``"auto"``: for the PyTorch
            implementation as many as fit its two fp32 chunk buffers in the memory budget, one chunk for
            Triton (it holds nothing chunk-sized); None for one chunk.
        memory_budget_mib: what the op may hold beyond its inputs and their gradients (MiB); None:
            ``LMLOSS_CHUNK_BUDGET_MIB``, else 64 MiB on CPU and 4 GiB on CUDA
            (`lmloss.chunks.chunk_budget_mib`); the kept-set search's buffers included. With
            ``chunk_size="auto"`` a budget below chunks of 8 tokens raises `lmloss.chunks.MemoryBudgetError`
            (a ValueError naming the smallest budget the call honours). Agreed across `tp_group`.
        temperature: the (capped) logits are divided by it before the softmax.
        softcap: Gemma's ``final_logit_softcapping``: logits become ``softcap * tanh(logits / softcap)``
            first. None for no capping.
        ignore_index: positions with this label give exactly 0.0 and no gradient, whatever their logits.
        vocab_size: the true global vocabulary; columns at global index ``>= vocab_size`` are padding
            and take no part in the softmax. Default: all columns over all ranks.
        tp_group: process group the vocabulary is sharded over; None for one process. Each call makes one
            small all-gather over it to check that the ranks agree; an argument that fails a check on
            one rank raises the same `RankAgreementError` on every rank (see README, "Parallelism").
        vocab_start: global id of this rank's first column; default ``rank * V_local`` (even shards). Pass it
            on every TP rank (uneven shards) or on none.
        return_entropy: also return the entropy of the tempered softmax over the whole vocabulary,
            differentiable; 0.0 where the label is `ignore_index` (as TRL's; `token_entropy` gives it at
            every position).
        impl: ``"auto"`` (Triton on CUDA when triton imports, else PyTorch), ``"torch"`` or ``"triton"``.
        top_k, top_p, min_p: the rollout engine's truncation, a number or one value per token (a tensor
            shaped like `labels`): the log-probs, entropy and gradients are those of the distribution
            vLLM samples from, renormalised over the kept set (`lmloss.sampling`, docs/sampling.md).
            A label outside the kept set gets -inf with no gradient, and a warning counts them.
            Both implementations; with `softcap` the PyTorch kernels only (``impl="auto"`` picks them).
        support: instead of recomputing, the kept ids the engine returned, ``[..., K]`` (-1 padded;
            `lmloss.sampling.support_from_offsets` converts vLLM's ids + offsets): renormalise over them.
        return_log_kept_mass: also return ``log`` of the kept set's probability under the full tempered
            softmax (not differentiable; with top_k / top_p / min_p, or with support); 0.0 where the label
            is `ignore_index`.
        invariant: each token's outputs are a function of its own logits row and the options alone, the
            same bits whatever the chunk size, the other rows of the call and the TP degree (every shard
            starting at a multiple of `lmloss.kernels.INVARIANT_BLOCK` columns): the vocabulary is summed
            in fixed blocks combined exactly (docs/invariant.md). Default False: the fast path.
        return_logit_sum, return_argmax, return_log_sum_sq_probs: by-products of the same pass over the
            vocabulary, of ``z = softcap(logits) / temperature`` (the logits the softmax sees, as TRL's fused
            head takes them), without gradient, over the valid global vocabulary (the kept set under
            top_k / top_p / min_p; not with `support`): ``sum_j z_j`` (TRL's mean logit is that over
            ``vocab_size``); the id of the largest ``z`` (int64, the lowest id on ties: SFT token accuracy
            is ``argmax == labels``); ``log sum_j p_j**2 = logsumexp(2 z) - 2 logsumexp(z)`` (WPO's weight).
            0.0 (the argmax -1) where the label is `ignore_index`. With `invariant`, the sum and the argmax
            are invariant too (the sum from the fixed blocks); the sum of squares is refused there.

    Returns:
        fp32 ``[...]`` log-probs (fp64 for fp64 logits), then entropy, log kept mass, logit sum, argmax and
        log sum of squared probabilities, those asked, in that order (a tuple). Each output is the same on
        every TP rank.
    """
    _validate.check_group("tp_group", tp_group)
    with errors_raised_on_every_rank(tp_group, vocab_start, logits):
        labels = _check_logits(logits, labels)
        budget = chunk_budget_mib(logits.device, memory_budget_mib)
        byproducts = _validate.byproducts(
            logit_sum=return_logit_sum, argmax=return_argmax, log_sum_sq_probs=return_log_sum_sq_probs
        )
        n = math.prod(labels.shape)
        if support is None:
            sampling = make_sampling(
                top_k, top_p, min_p, n_tokens=n, device=logits.device, log_kept_mass=return_log_kept_mass
            )
        else:
            sampling = None
            support = replay.check_arguments(support, n, logits.device, vocab_size, (top_k, top_p, min_p),
                                             return_log_kept_mass)  # fmt: skip
    plan = _plan(
        logits, labels, outputs=("logprobs", "entropy") if return_entropy else ("logprobs",),
        chunk_size=chunk_size, temperature=temperature, softcap=softcap, ignore_index=ignore_index,
        vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start, impl=impl, agree=_agree(logits, budget),
        sampling=sampling, support=support, log_kept_mass=return_log_kept_mass, invariant=invariant, budget=budget,
        byproducts=byproducts,
    )  # fmt: skip
    flat, flat_labels = _flat(logits, labels)
    if support is None:
        op = Op(plan, LogitsHead, SoftmaxObjective(plan, flat_labels))
    else:
        op = replay.op_over_slots(plan, LogitsHead, (flat,), flat_labels, support, return_log_kept_mass)
    outs = tuple(o.view(labels.shape) for o in PerTokenLoss.apply(op, flat))
    if sampling is not None or support is not None:
        report_dropped(outs[0], labels, ignore_index)
    return outs if len(outs) > 1 else outs[0]


def token_entropy(
    logits: torch.Tensor,
    *,
    chunk_size: int | str | None = "auto",
    temperature: float = 1.0,
    softcap: float | None = None,
    vocab_size: int | None = None,
    tp_group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    impl: str = "auto",
    memory_budget_mib: float | None = None,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    support: torch.Tensor | None = None,
    invariant: bool = False,
    return_logit_sum: bool = False,
    return_argmax: bool = False,
    return_log_sum_sq_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Shannon entropy ``-sum p log p`` of ``p = softmax(softcap(logits) / temperature)`` over the global
    vocabulary (over the kept set, renormalised, with top_k / top_p / min_p or a replayed `support`).
    `logits` ``[..., V_local]`` -> fp32 ``[...]``, differentiable; then the by-products asked (a tuple; at every
    position: there are no labels, e.g. a multi-token-prediction draft's acceptance is ``argmax == draft``).
    Arguments as in `token_logprobs`."""
    _validate.check_group("tp_group", tp_group)
    with errors_raised_on_every_rank(tp_group, vocab_start, logits):
        _check_logits(logits, None)
        budget = chunk_budget_mib(logits.device, memory_budget_mib)
        byproducts = _validate.byproducts(
            logit_sum=return_logit_sum, argmax=return_argmax, log_sum_sq_probs=return_log_sum_sq_probs
        )
        n_tokens = math.prod(logits.shape[:-1])
        if support is None:
            sampling = make_sampling(top_k, top_p, min_p, n_tokens=n_tokens, device=logits.device)
        else:
            sampling = None
            support = replay.check_arguments(support, n_tokens, logits.device, vocab_size, (top_k, top_p, min_p), False)
    plan = _plan(
        logits, None, outputs=("entropy",), chunk_size=chunk_size, temperature=temperature, softcap=softcap,
        ignore_index=-100, vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start, impl=impl,
        agree=_agree(logits, budget), sampling=sampling, support=support, invariant=invariant, budget=budget,
        byproducts=byproducts,
    )  # fmt: skip
    flat, _ = _flat(logits, None)
    if support is None:
        op = Op(plan, LogitsHead, SoftmaxObjective(plan, None))
    else:
        op = replay.op_over_slots(plan, LogitsHead, (flat,), None, support, False)
    outs = tuple(o.view(logits.shape[:-1]) for o in PerTokenLoss.apply(op, flat))
    return outs if len(outs) > 1 else outs[0]


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
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
    mean_group: ProcessGroup | None = None,
    inplace_backward: bool = False,
    impl: str = "auto",
    memory_budget_mib: float | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Cross-entropy of `labels` under ``softmax(softcap(logits) / temperature)``, as `F.cross_entropy`
    defines it.

    Per token: ``(1 - label_smoothing) * nll + label_smoothing * mean_j(-log p_j) + z_loss * lse**2``,
    where the smoothing mean runs over the global vocabulary (``vocab_size`` columns, every TP rank's)
    and ``lse`` is the log-sum-exp of the scaled logits. Ignored tokens contribute 0.

    Args:
        reduction: ``"mean"`` over non-ignored tokens (0.0 if there are none), ``"sum"``, or ``"none"``
            (fp32 ``[...]``).
        mean_group: with ``"mean"``, count the non-ignored tokens over this group (e.g. DP x CP) and
            divide this rank's sum by that count, so that summing gradients over the group gives the
            gradient of the global mean. The returned value is then this rank's share: all-reduce it
            (SUM) for the global mean.
        inplace_backward: with ``"sum"`` / ``"mean"``, compute the gradient during the forward and write it
            over `logits` (peak memory: the logits plus one chunk, no gradient buffer). Afterwards
            `logits` holds the gradient, not the logits: turn it on only when nothing else reads the
            logits after this call. Another op that saved them for its backward raises PyTorch's
            "modified by an inplace operation" error instead of computing with the gradient. The
            logits must come from an op (an ``lm_head``; a view of its output such as ``.view(-1, V)``
            or ``[:-1]`` works too), not be a leaf that requires grad nor have ``retain_grad()``, and their
            leading dims must flatten as a view. Without gradients it changes nothing; inside
            ``torch.compile`` the op runs out of place (same values and gradients).
        invariant: each token's loss the same bits whatever the chunking, the batch and the TP degree (as
            in `token_logprobs`); ``"sum"`` / ``"mean"`` then add those per-token losses over the call.
        Other arguments as in `token_logprobs`.
    """
    _validate.check_group("tp_group", tp_group)
    # inside a compiled region the compiler owns the buffers (and dynamo cannot trace a dirty-input
    # autograd.Function): the op runs out of place there, with the same values and gradients
    compiling = torch.compiler.is_compiling()
    with errors_raised_on_every_rank(tp_group, vocab_start, logits):
        _validate.check_reduction(reduction)
        _validate.check_group("mean_group", mean_group)
        if not isinstance(inplace_backward, bool):
            raise TypeError(f"inplace_backward must be a bool, got {inplace_backward!r}")
        labels = _check_logits(logits, labels)
        budget = chunk_budget_mib(logits.device, memory_budget_mib)
        if inplace_backward and reduction == "none":
            raise ValueError('inplace_backward=True needs reduction="sum" or "mean" (a scalar loss)')
        inplace = inplace_backward and torch.is_grad_enabled() and logits.requires_grad and not compiling
        if inplace:
            _check_inplace(logits)
    plan = _plan(
        logits, labels, outputs=("loss",), chunk_size=chunk_size, temperature=temperature, softcap=softcap,
        ignore_index=ignore_index, vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start,
        impl=impl, label_smoothing=label_smoothing, z_loss=z_loss,
        agree=_agree(logits, budget, reduction=reduction, mean_group=mean_group), invariant=invariant, budget=budget,
    )  # fmt: skip
    flat, flat_labels = _flat(logits, labels)
    if inplace:
        denominator = loss_denominator(
            labels, ignore_index=ignore_index, reduction=reduction, mean_group=mean_group,
            dtype=compute_dtype(logits.dtype),
        )  # fmt: skip
        grad_scale = None if denominator is None else denominator.reciprocal()
        objective = SoftmaxObjective(plan, labels.reshape(-1), grad_scale=grad_scale)
        out = InPlaceCrossEntropy.apply(logits, plan, objective, logits._is_view(), denominator)
        return out[0] if isinstance(out, tuple) else out
    (per_token,) = PerTokenLoss.apply(Op(plan, LogitsHead, SoftmaxObjective(plan, flat_labels)), flat)
    return reduce_loss(
        per_token.view(labels.shape), labels, ignore_index=ignore_index, reduction=reduction,
        mean_group=mean_group,
    )  # fmt: skip


def _agree(
    logits: torch.Tensor, budget: float, *, reduction: str | None = None, mean_group: ProcessGroup | None = None
) -> dict[str, int | float]:
    """The logits ops' fields of the TP ranks' agreement vector (`lmloss.agreement.HOST_FIELDS`)."""
    return dict(
        op=0, chunk_budget=budget,
        reduction=-1 if reduction is None else _validate.REDUCTIONS.index(reduction),
        grad=int(torch.is_grad_enabled() and logits.requires_grad),
        mean_group=-1 if mean_group is None else torch.distributed.get_world_size(mean_group),
    )


def _check_inplace(logits: torch.Tensor) -> None:
    base = logits._base if logits._is_view() else logits
    if base.is_leaf:
        raise ValueError(
            "inplace_backward=True writes the gradient over the logits, which PyTorch forbids for a leaf "
            "tensor that requires grad (or a view of one): use it on logits an op produced (an lm_head "
            "output), or inplace_backward=False"
        )
    if logits.retains_grad or base.retains_grad:
        raise ValueError(
            "inplace_backward=True writes the gradient over the logits, and retain_grad() was called on them "
            "(or on the tensor they are a view of): their .grad would be that same memory. Use "
            "inplace_backward=False to keep the logits' gradient"
        )
    try:
        logits.view(-1, logits.shape[-1])
    except RuntimeError:
        raise ValueError(
            "inplace_backward=True needs logits whose leading dims flatten as a view (e.g. contiguous); "
            "call .contiguous() first or use inplace_backward=False"
        ) from None
    if logits.stride(-1) != 1:
        raise ValueError("inplace_backward=True needs logits contiguous along the vocabulary (stride 1)")
