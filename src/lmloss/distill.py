"""Distillation losses between a student and a teacher: forward KL, reverse KL, generalized JSD.

Semantics are those of TRL's GKD (`GKDTrainer.generalized_jsd_loss`), per token, with ``p_s`` and ``p_t``
the softmaxes of ``student / temperature`` and ``teacher / temperature`` over the valid global vocabulary:

* ``beta = 0``: forward KL, ``KL(p_t || p_s) = sum_j p_t (log p_t - log p_s)``;
* ``beta = 1``: reverse KL, ``KL(p_s || p_t)``;
* ``0 < beta < 1``: generalized JSD with the mixture ``m = (1 - beta) p_s + beta p_t``:
  ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` (so beta -> 0 does *not* tend to forward KL; the two
  ends are defined separately, as in TRL).

The teacher is detached: gradients flow to the student only (its logits, or its hidden states and head
weight). No ``temperature ** 2`` factor is applied (TRL applies none either).

The data's path is the plan (`lmloss.plan.make_plan`, rank agreement included) and its chunking, with two
chunk sources (student, teacher) instead of one, walked by `distill_pass`: a loop of its own beside
`lmloss.plan.forward_pass` (two sources and a second reduction per chunk do not fit that loop's kernel
calls; the sources, gradient sinks, TP combine and reductions are the shared ones). Per chunk of tokens:

1. the softmax statistics of both distributions (`softmax_partials`, the single-distribution kernels),
   combined over the TP group in ONE MAX and ONE SUM for both (`combine_partials` over the stacked rows);
2. the divergence's per-row partial sums (`divergence_partials`, the two-distribution kernels, see
   `lmloss.kernels`) and ONE SUM over the TP group;
3. with a gradient sink, the student's gradient from the same elementwise terms (no collective).

Three collectives per chunk in all. In one process with no padded columns the PyTorch kernels skip step 1
(each row's own log-softmax). With a sparse teacher (`teacher_topk`) step 2 is replaced by a gather
of the student's logits at the teacher's ids (each TP rank contributes the ids of its shard) and one SUM.

Peak memory (PyTorch kernels): per chunk, three chunk-sized buffers in the compute dtype (the two
log-softmaxes and one work term; a fourth for the JSD), whether from logits (scratch buffers) or fused (the
log-softmaxes are written over the two heads' fp32 chunks); ``chunk_size="auto"`` budgets that
(`bytes_per_logit`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from lmloss import _validate
from lmloss._autograd import once_differentiable
from lmloss.fused import _Accumulators, _HiddenRows, _pass_scratch, _prepare, auto_chunk_size
from lmloss.kernels import compute_dtype, make_distill_kernels
from lmloss.kernels.torch_ref import ChunkScratch
from lmloss.logits import _BufferSink, _rows_of, reduce_loss
from lmloss.plan import LossPlan, make_plan
from lmloss.vocab_parallel import ProcessGroup, all_reduce_sum_, combine_partials, gather_rows, world_size

#: Teacher top-k probabilities may sum above 1 by this much (an engine's rounding) before it is an error.
TOPK_MASS_TOLERANCE = 1e-3


def bytes_per_logit(dtype: torch.dtype, beta: float, *, fused: bool) -> int:
    """The PyTorch kernels' per-logit working set, for ``chunk_size="auto"``: three chunk-sized buffers in
    the compute dtype (four for the JSD), and in the fused path with bf16 / fp16 the two heads' chunks in
    that dtype as the matmuls write them."""
    buffers = 4 if 0.0 < beta < 1.0 else 3
    element = compute_dtype(dtype).itemsize
    low_precision = fused and dtype not in (torch.float32, torch.float64)
    return buffers * element + (2 * dtype.itemsize if low_precision else 0)


@dataclasses.dataclass(frozen=True)
class DistillSpec:
    """What the divergence is, beside the `LossPlan`: `beta`, and for a sparse teacher `tail`."""

    beta: float
    sparse: bool = False
    tail: bool = True


# ----------------------------------------------------------------------------------------------------------
# per-row math on [c] vectors (cheap; the same for both implementations)


def divergence_rows(partials: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Global per-row sums ``[c, 2]`` (`lmloss.kernels` contract) -> (loss ``[c]``, ``S`` ``[c]``), where
    the student gradient w.r.t. its scaled logits is ``p_s * (u - S)`` (reverse KL, JSD) or ``p_s - p_t``
    (forward KL: S unused)."""
    if beta == 0.0:
        return partials[:, 0], torch.zeros_like(partials[:, 0])
    if beta == 1.0:
        return partials[:, 0], partials[:, 0]
    b_part = (1.0 - beta) * partials[:, 1]
    return beta * partials[:, 0] + b_part, b_part


def _lse(combined: torch.Tensor) -> torch.Tensor:
    return combined[:, 0] + combined[:, 1].log()


def _sparse_rows(plan: LossPlan, spec: DistillSpec, x, ids, logprobs, kernels):
    """Sparse teacher, one chunk: (loss ``[c]``, student log-probs at the ids ``[c, K]``, lse ``[c]`` or None,
    column index ``[c, K]``, owned ``[c, K]``). Collectives: MAX + SUM (with the tail), then one SUM."""
    m = plan.math
    acc = compute_dtype(x.dtype)
    local = ids - m.vocab_start
    owned = (local >= 0) & (local < m.valid)
    idx = local.clamp(0, max(m.valid - 1, 0))
    picked = x.gather(1, idx).to(acc) * m.scale
    y = torch.where(owned, picked, 0.0)
    lse = None
    if spec.tail:
        stats = kernels.softmax_partials(x, None, m, entropy=False, target=False, sum_logits=False)
        lse = _lse(combine_partials(stats, plan.tp_group))
    all_reduce_sum_(y, plan.tp_group)  # every id is owned by exactly one rank: the sum is its logit
    lq = logprobs.to(acc)
    if spec.tail:
        ls = y - lse[:, None]
        q_tail = (1.0 - lq.exp().sum(-1)).clamp(min=0.0)
        p_tail = (1.0 - ls.exp().sum(-1)).clamp(min=torch.finfo(acc).tiny)
        tail_term = torch.where(q_tail > 0, q_tail * (q_tail.log() - p_tail.log()), 0.0)
    else:  # renormalised over the K ids
        lq = lq - torch.logsumexp(lq, -1, keepdim=True)
        ls = y - torch.logsumexp(y, -1, keepdim=True)
        q_tail = p_tail = tail_term = None
    terms = torch.where(lq > -math.inf, lq.exp() * (lq - ls), 0.0)
    loss = terms.sum(-1) + (tail_term if spec.tail else 0.0)
    return loss, (lq, ls, lse, q_tail, p_tail, idx, owned)


def _sparse_grad_(plan: LossPlan, spec: DistillSpec, x, state, weight, kernels, out):
    """The student's gradient for a sparse teacher into `out`: ``p_s - q`` at the teacher's ids, and with
    the tail ``p_s (1 - q_tail / p_tail)`` at every other column (0 there without the tail)."""
    lq, ls, lse, q_tail, p_tail, idx, owned = state
    m = plan.math
    p_ids = ls.exp()
    if spec.tail:
        a = 1.0 - q_tail / p_tail
        coef = torch.zeros((x.shape[0], 4), dtype=lse.dtype, device=x.device)
        coef[:, 0] = torch.where(weight != 0, weight * a, 0.0)  # select: an ignored row's a may be NaN
        kernels.softmax_grad_(x, None, lse, None, coef, m, out, uniform_term=False)
        at_ids = p_ids * (1.0 - a)[:, None] - lq.exp()
    else:
        out.zero_()
        at_ids = p_ids - lq.exp()
    active = owned & (weight != 0)[:, None]
    values = torch.where(active, at_ids * (weight * m.scale)[:, None], 0.0)
    out.scatter_add_(1, idx, values.to(out.dtype))
    return out


def _dense_chunk(dk, xs, xt, lse, plan: LossPlan, spec: DistillSpec, weight, grad_sink, s, e, overwrite):
    """Steps 2 and 3 of one chunk (module docstring): the divergence's partial sums, their SUM over the
    TP group, the per-row loss, and with a sink the student's gradient. `lse` None: one process."""

    def finish(partials):
        all_reduce_sum_(partials, plan.tp_group)
        loss, subtract = divergence_rows(partials, spec.beta)
        return loss, None if weight is None else torch.stack([weight, subtract], dim=1)

    if grad_sink is None:
        return finish(dk.divergence_partials(xs, xt, lse, plan.math, spec.beta, overwrite=overwrite))[0]
    out = grad_sink.buffer(s, e, xs)
    loss = dk.divergence_partials_then_grad_(
        xs, xt, lse, plan.math, spec.beta, finish, out, overwrite=overwrite
    )
    grad_sink.consume(s, e, out)
    return loss


def distill_pass(
    plan: LossPlan,
    spec: DistillSpec,
    n: int,
    student,
    teacher,
    labels: torch.Tensor | None,
    topk: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    device: torch.device,
    dtype: torch.dtype,
    grad_sink=None,
    upstream: torch.Tensor | None = None,
) -> torch.Tensor:
    """Walk the chunks once: per-token losses ``[n]`` (compute dtype; 0 at ignored tokens).

    `student` / `teacher` are chunk sources ``(s, e) -> [c, V_local]`` (`teacher` None with `topk`).
    With `grad_sink`, also each chunk's student gradient of ``sum(upstream * loss)`` (`upstream` ``[n]``,
    None for 1 per token), handed to the sink; ignored tokens get exactly 0 whatever their values.
    """
    losses = torch.empty(n, dtype=compute_dtype(dtype), device=device)
    kernels = plan.kernels(n, device)
    rows = max(1, min(n, plan.chunk_size or n))
    dk = make_distill_kernels(
        plan.impl, rows, plan.shard.size, device, scratch=getattr(kernels, "scratch", None)
    )
    overwrite = getattr(student, "owns_chunks", False)
    local_softmax = (
        dk.normalises_rows and world_size(plan.tp_group) == 1 and plan.math.valid == plan.shard.size
    )
    for s, e in plan.chunks(n):
        valid = None if labels is None else labels[s:e] != plan.ignore_index
        xs = student(s, e)
        weight = None
        if grad_sink is not None:
            weight = (
                torch.ones(e - s, dtype=losses.dtype, device=device) if upstream is None else upstream[s:e]
            )
            weight = weight.to(losses.dtype)
            weight = weight if valid is None else torch.where(valid, weight, 0.0)
        if spec.sparse:
            loss, state = _sparse_rows(plan, spec, xs, topk[0][s:e], topk[1][s:e], kernels)
            if grad_sink is not None:
                out = grad_sink.buffer(s, e, xs)
                grad_sink.consume(s, e, _sparse_grad_(plan, spec, xs, state, weight, kernels, out))
        elif local_softmax:  # one process, no padding: the kernels normalise each row themselves
            xt = teacher(s, e)
            loss = _dense_chunk(dk, xs, xt, None, plan, spec, weight, grad_sink, s, e, overwrite)
        else:
            xt = teacher(s, e)
            stats = [
                kernels.softmax_partials(x, None, plan.math, entropy=False, target=False, sum_logits=False)
                for x in (xs, xt)
            ]
            # both distributions' rows in one combine: one MAX and one SUM over the TP group
            combined = combine_partials(torch.cat(stats).to(losses.dtype), plan.tp_group)
            lse = _lse(combined).view(2, e - s).t().contiguous()  # [c, 2]: student, teacher
            loss = _dense_chunk(dk, xs, xt, lse, plan, spec, weight, grad_sink, s, e, overwrite)
        losses[s:e] = loss if valid is None else torch.where(valid, loss, 0.0)
    return losses


# ----------------------------------------------------------------------------------------------------------
# argument checks


def _check_beta(beta: object) -> float:
    if not isinstance(beta, (int, float)) or isinstance(beta, bool):
        raise TypeError(f"beta must be a float in [0, 1], got {type(beta).__name__}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL, between: JSD), got {beta}")
    return float(beta)


def _check_teacher_logits(student: torch.Tensor, teacher: object) -> torch.Tensor:
    _validate.check_floating("teacher_logits", teacher)
    if teacher.shape != student.shape:
        raise ValueError(
            f"teacher_logits shape {tuple(teacher.shape)} does not match student_logits shape "
            f"{tuple(student.shape)}: both must be this rank's shard of the same vocabulary columns"
        )
    if teacher.device != student.device:
        raise ValueError(f"teacher_logits are on {teacher.device} but student_logits on {student.device}")
    return teacher.detach()


def _check_topk(topk: object, leading: torch.Size, device: torch.device, beta: float, temperature: float):
    """`teacher_topk` -> (ids int64 ``[N, K]``, logprobs ``[N, K]``), flattened, detached."""
    if not isinstance(topk, (tuple, list)) or len(topk) != 2:
        raise TypeError("teacher_topk must be a pair (ids [..., K] int, logprobs [..., K] float)")
    ids, logprobs = topk
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError("teacher_topk ids must be an integer tensor [..., K] of global vocabulary ids")
    _validate.check_floating("teacher_topk logprobs", logprobs)
    if ids.dim() < 1 or ids.shape[:-1] != leading or ids.shape[-1] < 1:
        raise ValueError(
            f"teacher_topk ids shape {tuple(ids.shape)} must be [..., K] with K >= 1 and leading shape "
            f"{tuple(leading)} (the student's tokens)"
        )
    if logprobs.shape != ids.shape:
        raise ValueError(
            f"teacher_topk logprobs shape {tuple(logprobs.shape)} does not match ids shape {tuple(ids.shape)}"
        )
    if ids.device != device or logprobs.device != device:
        raise ValueError(f"teacher_topk tensors must be on the student's device ({device})")
    if beta != 0.0:
        raise ValueError(
            f"teacher_topk supports the forward KL only (beta=0), got beta={beta}: the reverse KL and the "
            "JSD need the teacher's probability of every token the student may put mass on"
        )
    if temperature != 1.0:
        raise ValueError(
            "teacher_topk with temperature != 1: the teacher's top-k log-probs cannot be re-tempered without "
            "its full distribution; ask the engine for log-probs at the wanted temperature and pass "
            "temperature=1.0"
        )
    k = ids.shape[-1]
    return ids.reshape(-1, k).long(), logprobs.detach().reshape(-1, k)


def _check_topk_values(ids, logprobs, valid, vocab_size: int, tail: bool) -> None:
    """Range, uniqueness and mass of the teacher's ids / log-probs at non-ignored tokens (eager, one host
    sync; skipped inside a compiled region)."""
    if torch.compiler.is_compiling():
        return
    rows = valid if valid is not None else torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    ids, logprobs = ids[rows], logprobs[rows]
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        raise ValueError(f"teacher_topk ids must be in [0, {vocab_size}); found {int(ids[bad][0])}")
    ordered = ids.sort(dim=-1).values
    if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        raise ValueError(
            "teacher_topk ids must be distinct within a token (a repeated id counts its mass twice)"
        )
    mass = logprobs.double().exp().sum(-1)
    if not bool((logprobs <= 0).all()) or not bool((mass <= 1.0 + TOPK_MASS_TOLERANCE).all()):
        worst = float(mass.nan_to_num(math.inf).max())
        raise ValueError(
            f"teacher_topk logprobs must be log-probabilities (<= 0) whose probabilities sum to at most 1 "
            f"(+{TOPK_MASS_TOLERANCE}) per token; found a token summing to {worst:.6g}"
        )
    if not tail and not bool((mass > 0).all()):
        raise ValueError(
            "teacher_topk with tail=False needs some probability mass on the K ids of every token"
        )


def _options(*, beta, reduction, teacher_topk, tail):
    beta = _check_beta(beta)
    _validate.check_reduction(reduction)
    if not isinstance(tail, bool):
        raise TypeError(f"tail must be a bool, got {tail!r}")
    spec = DistillSpec(beta=beta, sparse=teacher_topk is not None, tail=tail)
    agree = dict(
        beta=beta, sparse_teacher=int(spec.sparse), tail=int(tail), reduction=_validate.REDUCTIONS.index(reduction)
    )
    return spec, agree


def _labels_for_count(labels: torch.Tensor | None, shape, ignore_index: int, device) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.int64, device=device) if labels is None else labels


# ----------------------------------------------------------------------------------------------------------
# from logits


class _DistillOverLogits(torch.autograd.Function):
    """student ``[N, V_local]``, teacher ``[N, V_local]`` (or top-k) -> per-token losses ``[N]``.

    The backward walks the chunks again (the same statistics and collectives) and writes the gradient of
    ``sum(upstream * loss)`` into one ``[N, V_local]`` buffer of the student's dtype.
    """

    @staticmethod
    def forward(ctx, student, teacher, labels, ids, logprobs, plan: LossPlan, spec: DistillSpec):
        topk = None if ids is None else (ids, logprobs)
        losses = distill_pass(
            plan, spec, student.shape[0], _rows_of(student), None if teacher is None else _rows_of(teacher),
            labels, topk, device=student.device, dtype=student.dtype,
        )  # fmt: skip
        ctx.plan, ctx.spec = plan, spec
        ctx.save_for_backward(student, teacher, labels, ids, logprobs)
        ctx.set_materialize_grads(False)
        return losses

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        student, teacher, labels, ids, logprobs = ctx.saved_tensors
        if grad is None:
            return (None,) * 7
        out = torch.empty(student.shape, dtype=student.dtype, device=student.device)
        distill_pass(
            ctx.plan, ctx.spec, student.shape[0], _rows_of(student),
            None if teacher is None else _rows_of(teacher), labels, None if ids is None else (ids, logprobs),
            device=student.device, dtype=student.dtype, grad_sink=_BufferSink(out), upstream=grad,
        )  # fmt: skip
        return (out,) + (None,) * 6


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    labels: torch.Tensor | None = None,
    *,
    beta: float = 0.0,
    temperature: float = 1.0,
    reduction: str = "mean",
    ignore_index: int = -100,
    teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    tail: bool = True,
    tp_group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    chunk_size: int | str | None = "auto",
    mean_group: ProcessGroup | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Divergence between the student's and the teacher's next-token distributions (TRL GKD semantics).

    Per token, with ``p_s = softmax(student_logits / temperature)`` and ``p_t`` likewise over the valid
    global vocabulary: ``beta=0`` forward ``KL(p_t || p_s)``; ``beta=1`` reverse ``KL(p_s || p_t)``;
    in between the generalized JSD ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)``,
    ``m = (1 - beta) p_s + beta p_t``. Computed chunk by chunk in fp32 (fp64 for fp64 inputs).

    Args:
        student_logits: ``[..., V_local]`` fp32 / bf16 / fp16 / fp64; this rank's vocabulary shard under TP.
            Receives the gradient.
        teacher_logits: the same shape, sharded the same way (None with `teacher_topk`). Detached: it never
            receives a gradient.
        labels: ``[...]`` integers, or None (every token counts). Only compared with `ignore_index`:
            those tokens give exactly 0.0 and exactly zero gradient, whatever their logits (NaN, inf).
        beta: in ``[0, 1]`` (see above).
        temperature: divides both logits before the softmaxes.
        reduction: ``"mean"`` over non-ignored tokens (0.0 if none; counted over `mean_group` when given,
            as in `lmloss.cross_entropy`), ``"sum"``, or ``"none"`` (fp32 ``[...]``).
        teacher_topk: a sparse teacher, ``(ids [..., K] int64 global ids, logprobs [..., K])`` as an
            inference engine returns them, instead of `teacher_logits`. Forward KL only (``beta=0``) and
            ``temperature=1`` (the teacher's log-probs cannot be re-tempered). With ``tail=True`` the KL is
            over K + 1 buckets: the K ids and the rest of the vocabulary (teacher mass ``1 - sum exp(lp)``,
            student mass outside the ids); with ``tail=False`` both distributions are renormalised over
            the K ids. Under TP every rank passes all K ids; each handles those in its shard.
        tp_group, vocab_start, vocab_size, chunk_size, impl: as in `lmloss.cross_entropy`;
            ``chunk_size="auto"`` sizes chunks from a memory budget (`lmloss.fused.auto_chunk_size`).

    Returns:
        A scalar (``"mean"`` / ``"sum"``), or per-token losses ``[...]`` (``"none"``); the same on every TP
        rank. The chunk loop makes three collectives per chunk over `tp_group` (a MAX and a SUM of both
        distributions' statistics, a SUM of the divergence's partial sums).
    """
    _validate.check_floating("student_logits", student_logits)
    if student_logits.dim() < 1:
        raise ValueError("student_logits must have at least one dimension (the vocabulary)")
    spec, agree = _options(beta=beta, reduction=reduction, teacher_topk=teacher_topk, tail=tail)
    agree["op"] = 2
    _validate.check_temperature(temperature)
    leading = student_logits.shape[:-1]
    if (teacher_logits is None) == (teacher_topk is None):
        raise ValueError("pass exactly one of teacher_logits and teacher_topk")
    teacher = None if teacher_logits is None else _check_teacher_logits(student_logits, teacher_logits)
    topk = None
    if teacher_topk is not None:
        topk = _check_topk(teacher_topk, leading, student_logits.device, spec.beta, temperature)
        agree["teacher_topk"] = topk[0].shape[1]
    if labels is not None:
        labels = _validate.check_labels(labels, leading, student_logits.device, against="student_logits")
    flat_labels = None if labels is None else labels.reshape(-1)
    n, v_local = math.prod(leading), student_logits.shape[-1]
    device, dtype = student_logits.device, student_logits.dtype

    def auto_chunk(n_tokens, max_local, impl_):
        return auto_chunk_size(n_tokens, max_local, device, bytes_per_logit(dtype, spec.beta, fused=False))

    plan = make_plan(
        n_tokens=n, local_vocab=v_local, device=device, dtype=dtype, labels=None, outputs=("loss",),
        chunk_size=chunk_size, auto_chunk=auto_chunk, temperature=temperature, softcap=None,
        ignore_index=ignore_index, vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start,
        impl=impl, agree=agree,
    )  # fmt: skip
    if topk is not None:
        valid = None if flat_labels is None else flat_labels != ignore_index
        _check_topk_values(*topk, valid, plan.shard.vocab_size, tail)
    per_token = _DistillOverLogits.apply(
        student_logits.reshape(-1, v_local), None if teacher is None else teacher.reshape(-1, v_local),
        flat_labels, *(topk or (None, None)), plan, spec,
    )  # fmt: skip
    return reduce_loss(
        per_token.view(leading), _labels_for_count(labels, leading, ignore_index, device),
        ignore_index=ignore_index, reduction=reduction, mean_group=mean_group,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# fused from both heads


def _sources(hidden, weight, t_hidden, t_weight, plan: LossPlan, opts: dict):
    """The student's chunk source (scratch chunks the kernels may overwrite) and the teacher's (its own
    scratch buffers, in the teacher's dtype: the kernels read either dtype and compute in fp32, and the
    matmul has already rounded the teacher's logits to that dtype, so an fp32 copy would only add a pass)."""
    student = _HiddenRows(hidden, weight, None, _pass_scratch(plan, hidden), opts["chunk_dtype"])
    if t_hidden is None:
        return student, None
    t_scratch = ChunkScratch(student.scratch.rows, plan.shard.size, t_hidden.device)
    teacher = _HiddenRows(t_hidden, t_weight, None, t_scratch, t_weight.dtype)
    return student, teacher


class _LinearDistillPerToken(torch.autograd.Function):
    """Per-token losses from both heads; the backward recomputes each chunk (4 matmuls + 2 in the forward)."""

    @staticmethod
    def forward(ctx, hidden, weight, t_hidden, t_weight, labels, ids, logprobs, plan, spec, opts):
        student, teacher = _sources(hidden, weight, t_hidden, t_weight, plan, opts)
        topk = None if ids is None else (ids, logprobs)
        losses = distill_pass(
            plan,
            spec,
            hidden.shape[0],
            student,
            teacher,
            labels,
            topk,
            device=hidden.device,
            dtype=hidden.dtype,
        )
        ctx.plan, ctx.spec, ctx.opts = plan, spec, opts
        ctx.save_for_backward(hidden, weight, t_hidden, t_weight, labels, ids, logprobs)
        ctx.set_materialize_grads(False)
        return losses

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        hidden, weight, t_hidden, t_weight, labels, ids, logprobs = ctx.saved_tensors
        if grad is None:
            return (None,) * 10
        plan = ctx.plan
        student, teacher = _sources(hidden, weight, t_hidden, t_weight, plan, ctx.opts)
        needs = (*ctx.needs_input_grad[:2], False)
        acc = _Accumulators(hidden, weight, None, needs, scratch=student.scratch, **ctx.opts)
        distill_pass(
            plan, ctx.spec, hidden.shape[0], student, teacher, labels, None if ids is None else (ids, logprobs),
            device=hidden.device, dtype=hidden.dtype, grad_sink=acc, upstream=grad,
        )  # fmt: skip
        gh, gw, _ = acc.finish(hidden, weight, None, plan.tp_group)
        return (gh, gw) + (None,) * 8


class _LinearDistillSum(torch.autograd.Function):
    """Summed loss from both heads, its gradients computed in the forward (4 matmuls: the two heads' logits,
    the student's d-hidden and d-weight); the backward only scales them, once."""

    @staticmethod
    def forward(
        ctx, hidden, weight, t_hidden, t_weight, labels, ids, logprobs, plan, spec, opts, grad_enabled
    ):
        student, teacher = _sources(hidden, weight, t_hidden, t_weight, plan, opts)
        needs = tuple(n and grad_enabled for n in ctx.needs_input_grad[:2]) + (False,)
        acc = (
            _Accumulators(hidden, weight, None, needs, scratch=student.scratch, **opts)
            if any(needs)
            else None
        )
        losses = distill_pass(
            plan, spec, hidden.shape[0], student, teacher, labels, None if ids is None else (ids, logprobs),
            device=hidden.device, dtype=hidden.dtype, grad_sink=acc,
        )  # fmt: skip
        ctx.plan, ctx.acc = plan, acc
        ctx.save_for_backward(hidden, weight)
        return losses.sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):
        hidden, weight = ctx.saved_tensors
        if ctx.acc == "used":
            raise RuntimeError(
                "lmloss.linear_distillation_loss with reduction='sum'/'mean' computes its gradients in the "
                "forward and hands them out once; for a second backward use reduction='none'"
            )
        acc, ctx.acc = ctx.acc, "used"
        if acc is None:
            return (None,) * 11
        gh, gw, _ = acc.finish(hidden, weight, None, ctx.plan.tp_group, grad_total)
        return (gh, gw) + (None,) * 9


def _check_teacher_head(t_hidden, t_weight, student_hidden, student_weight) -> None:
    """Local checks (before any collective): the teacher's head covers the student's vocabulary shard and
    its hidden states the student's tokens (this rank's block of them with sequence parallelism)."""
    _validate.check_floating("teacher_hidden", t_hidden)
    _validate.check_floating("teacher_weight", t_weight)
    v_local = student_weight.shape[0]
    if t_weight.dim() != 2 or t_weight.shape[0] != v_local:
        raise ValueError(
            f"teacher_weight must be [V_local, H_teacher] with the student's V_local={v_local} (the same "
            f"vocabulary shard), got {tuple(t_weight.shape)}"
        )
    if t_hidden.dim() < 1 or t_hidden.shape[-1] != t_weight.shape[1]:
        raise ValueError(
            f"teacher_hidden width {t_hidden.shape[-1] if t_hidden.dim() else None} does not match "
            f"teacher_weight [V_local, H_teacher] with H_teacher={t_weight.shape[1]}"
        )
    if t_hidden.dtype != t_weight.dtype:
        raise TypeError(
            f"teacher_hidden ({t_hidden.dtype}) and teacher_weight ({t_weight.dtype}) differ in dtype"
        )
    if t_hidden.shape[:-1] != student_hidden.shape[:-1]:
        raise ValueError(
            f"teacher_hidden leading shape {tuple(t_hidden.shape[:-1])} does not match student_hidden's "
            f"{tuple(student_hidden.shape[:-1])}: they must be the same token positions"
        )
    if t_hidden.device != student_hidden.device or t_weight.device != student_weight.device:
        raise ValueError("teacher_hidden / teacher_weight must be on the student's devices")


def linear_distillation_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
    teacher_weight: torch.Tensor | None,
    labels: torch.Tensor | None = None,
    *,
    beta: float = 0.0,
    temperature: float = 1.0,
    reduction: str = "mean",
    ignore_index: int = -100,
    teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    tail: bool = True,
    tp_group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    sequence_parallel: bool = False,
    chunk_size: int | str | None = "auto",
    mean_group: ProcessGroup | None = None,
    weight_grad_dtype: torch.dtype = torch.float32,
    impl: str = "auto",
) -> torch.Tensor:
    """`distillation_loss` of ``student_hidden @ student_weight.T`` against ``teacher_hidden @
    teacher_weight.T``, without materializing either ``[tokens, V]`` logits.

    Args:
        student_hidden: ``[..., H_s]``; student_weight ``[V_local, H_s]`` (same dtype). Receive gradients.
        teacher_hidden: ``[..., H_t]`` (same tokens; ``H_t`` may differ from ``H_s``), teacher_weight
            ``[V_local, H_t]`` (the same vocabulary shard as the student's). Detached. Both None with
            `teacher_topk` (then the sparse teacher of `distillation_loss`, against the student's head).
        sequence_parallel: both hidden tensors are sharded along tokens over `tp_group` (dim 0) and are
            gathered; the student's hidden gradient is reduce-scattered back.
        weight_grad_dtype: the student weight gradient's accumulator, fp32 by default (as in
            `lmloss.linear_cross_entropy`).
        Other arguments as in `distillation_loss`.

    With ``"sum"`` / ``"mean"`` and gradients enabled, the gradients are computed in the forward (four
    matmuls per chunk: both heads' logits, the student's d-hidden and d-weight) and the backward only
    scales them; ``"none"`` recomputes in the backward.
    """
    spec, agree = _options(beta=beta, reduction=reduction, teacher_topk=teacher_topk, tail=tail)
    agree["op"] = 3
    _validate.check_temperature(temperature)
    if (teacher_hidden is None) != (teacher_weight is None):
        raise ValueError("teacher_hidden and teacher_weight go together (both None with teacher_topk)")
    if (teacher_hidden is None) == (teacher_topk is None):
        raise ValueError("pass exactly one of (teacher_hidden, teacher_weight) and teacher_topk")
    _validate.check_floating("student_hidden", student_hidden)
    _validate.check_floating("student_weight", student_weight)
    device = student_weight.device
    if teacher_hidden is not None:
        _check_teacher_head(teacher_hidden, teacher_weight, student_hidden, student_weight)
        agree["teacher_width"] = teacher_weight.shape[-1]
    topk = None
    if teacher_topk is not None:
        lead = student_hidden.shape[:-1]
        if sequence_parallel:
            lead = torch.Size((world_size(tp_group) * student_hidden.shape[0], *student_hidden.shape[1:-1]))
        topk = _check_topk(teacher_topk, lead, device, spec.beta, temperature)
        agree["teacher_topk"] = topk[0].shape[1]
    flat, flat_labels, plan, opts, shape = _prepare(
        student_hidden, student_weight, labels, None, chunk_size=chunk_size, temperature=temperature,
        softcap=None, ignore_index=ignore_index, vocab_size=vocab_size, tp_group=tp_group,
        vocab_start=vocab_start, sequence_parallel=sequence_parallel, weight_grad_dtype=weight_grad_dtype,
        impl=impl, outputs=("loss",), agree=agree, reduction=reduction,
        bytes_per_logit=bytes_per_logit(student_weight.dtype, spec.beta, fused=True),
    )  # fmt: skip
    t_flat = t_weight = None
    if teacher_hidden is not None:
        t_flat = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
        if sequence_parallel:  # the same blocks of tokens as the student's, gathered in rank order
            t_flat = gather_rows(t_flat, tp_group)
        t_weight = teacher_weight.detach()
    if topk is not None:
        valid = None if flat_labels is None else flat_labels != ignore_index
        _check_topk_values(*topk, valid, plan.shard.vocab_size, tail)
    ids, logprobs = topk or (None, None)
    if reduction == "none":
        per_token = _LinearDistillPerToken.apply(
            flat, student_weight, t_flat, t_weight, flat_labels, ids, logprobs, plan, spec, opts
        )
        return per_token.view(shape)
    total = _LinearDistillSum.apply(
        flat, student_weight, t_flat, t_weight, flat_labels, ids, logprobs, plan, spec, opts,
        torch.is_grad_enabled(),
    )  # fmt: skip
    return reduce_loss(
        total, _labels_for_count(flat_labels, (flat.shape[0],), ignore_index, device),
        ignore_index=ignore_index, reduction=reduction, mean_group=mean_group,
    )  # fmt: skip
