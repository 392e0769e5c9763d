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

The data's path is the plan (`lmloss.plan.make_plan`, rank agreement included: the options, and the sparse
teacher's ids and log-probs by fingerprint) and its one chunk loop, with the student's head as the chunk
source and the two-distribution objective (`lmloss.objectives.DivergenceObjective`) reading the
teacher's chunks from a second source. Per chunk of tokens:

1. the softmax statistics of both distributions (`softmax_partials`, the single-distribution kernels),
   combined over the TP group in ONE MAX and ONE SUM for both (`combine_partials` over the stacked rows);
2. the divergence's per-row partial sums (`divergence_partials`, the two-distribution kernels, see
   `lmloss.kernels`) and ONE SUM over the TP group;
3. with a gradient sink, the student's gradient from the same elementwise terms (no collective).

Three collectives per chunk in all. In one process with no padded columns the PyTorch kernels skip step 1
(each row's own log-softmax). With a sparse teacher (`teacher_topk`, `SparseTeacherObjective`) step 2 is
replaced by a gather of the student's logits at the teacher's ids (each TP rank contributes the ids of its
shard) and one SUM. A per-token op's backward saves both log-sum-exps and the divergence's row sums in
the forward and needs no collective.

Peak memory (PyTorch kernels): per chunk, three chunk-sized buffers in the compute dtype (the two
log-softmaxes and one work term; a fourth for the JSD), whether from logits (scratch buffers) or fused (the
log-softmaxes are written over the two heads' fp32 chunks); ``chunk_size="auto"`` budgets that
(`bytes_per_logit`).
"""

from __future__ import annotations

import math

import torch

from lmloss import _validate
from lmloss.agreement import errors_raised_on_every_rank
from lmloss.chunks import HiddenRows, LogitRows, LogitsHead, auto_chunk_size, chunk_budget_mib
from lmloss.functions import Op, PerTokenLoss, SummedLoss
from lmloss.fused import prepare
from lmloss.kernels import ChunkMath, ChunkScratch, compute_dtype
from lmloss.kernels.torch_ref import transform_into
from lmloss.logits import reduce_loss
from lmloss.objectives import DivergenceObjective, DivergenceSpec, SparseTeacherObjective
from lmloss.plan import make_plan
from lmloss.vocab_parallel import ProcessGroup, gather_rows

#: Teacher top-k probabilities may sum above 1 by this much (an engine's rounding) before it is an error.
TOPK_MASS_TOLERANCE = 1e-3


def bytes_per_logit(dtype: torch.dtype, beta: float, *, fused: bool, softcap: bool = False) -> int:
    """The PyTorch kernels' per-logit working set, for ``chunk_size="auto"``: three chunk-sized buffers in
    the compute dtype (four for the JSD; with a softcap two more, its slopes), and in the fused path with bf16
    / fp16 the two heads' chunks in that dtype as the matmuls write them."""
    buffers = (4 if 0.0 < beta < 1.0 else 3) + (2 if softcap else 0)
    element = compute_dtype(dtype).itemsize
    low_precision = fused and dtype not in (torch.float32, torch.float64)
    return buffers * element + (2 * dtype.itemsize if low_precision else 0)


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


def _options(*, beta, reduction, teacher_topk, tail, teacher_softcap):
    beta = _check_beta(beta)
    _validate.check_reduction(reduction)
    if not isinstance(tail, bool):
        raise TypeError(f"tail must be a bool, got {tail!r}")
    _validate.check_softcap(teacher_softcap, name="teacher_softcap")
    if teacher_softcap and teacher_topk is not None:
        raise ValueError("teacher_softcap applies to teacher logits; teacher_topk gives the teacher's log-probs")
    spec = DivergenceSpec(beta=beta, sparse=teacher_topk is not None, tail=tail)
    agree = dict(
        beta=beta, sparse_teacher=int(spec.sparse), tail=int(tail), reduction=_validate.REDUCTIONS.index(reduction),
        teacher_softcap=float(teacher_softcap or 0.0),
    )  # fmt: skip
    return spec, agree


class TeacherRows:
    """A teacher's chunk source as the kernels read it: its softcap applied (``cap * tanh(x / cap)``, the
    PyTorch kernels' own transform) and, for a teacher wider than the student's compute dtype (float64
    beside float32), rounded to the student's compute dtype; a fresh chunk."""

    owns_chunks = True

    def __init__(self, source, cap: float | None, dtype: torch.dtype) -> None:
        self.source, self.dtype = source, dtype
        self.math = ChunkMath(vocab_start=0, valid=0, scale=1.0, softcap=float(cap or 0.0))

    def __call__(self, rows, cols=None) -> torch.Tensor:
        x = self.source(rows, cols)
        return transform_into(torch.empty(x.shape, dtype=self.dtype, device=x.device), x, self.math)


def second_head(hidden, weight, *, softcap, sequence_parallel: bool, tp_group, student_dtype: torch.dtype):
    """The chunk-source factory ``make_source(rows, cols)`` of a second LM head beside an op's own (a
    distillation teacher, an RL reference policy): its hidden states detached (with sequence parallelism,
    the same blocks of tokens as the first head's, gathered in rank order), each pass's source with scratch
    of its own for chunks of up to `rows` rows and `cols` columns (None: the whole shard), read as
    `teacher_rows` reads it (its softcap, the student's compute dtype where it is wider)."""
    flat = hidden.detach().reshape(-1, hidden.shape[-1])
    if sequence_parallel:
        flat = gather_rows(flat, tp_group)
    weight = weight.detach()

    def make_source(rows: int, cols: int | None = None):
        scratch = ChunkScratch(rows, weight.shape[0] if cols is None else cols, weight.device)
        source = HiddenRows(flat, weight, None, scratch, weight.dtype)
        return teacher_rows(source, softcap, weight.dtype, student_dtype)

    return make_source


def teacher_rows(source, cap: float | None, teacher_dtype: torch.dtype, student_dtype: torch.dtype):
    """`source` as it is, or wrapped in `TeacherRows` when it has a softcap or is wider than the student."""
    acc = compute_dtype(student_dtype)
    if not cap and teacher_dtype.itemsize <= acc.itemsize:
        return source
    return TeacherRows(source, cap, acc)


def _labels_for_count(labels: torch.Tensor | None, shape, ignore_index: int, device) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.int64, device=device) if labels is None else labels


# ----------------------------------------------------------------------------------------------------------
# from logits


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
    memory_budget_mib: float | None = None,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
) -> torch.Tensor:
    """Divergence between the student's and the teacher's next-token distributions (TRL GKD semantics).

    Per token, with ``p_s = softmax(student_logits / temperature)`` and ``p_t`` likewise over the valid
    global vocabulary: ``beta=0`` forward ``KL(p_t || p_s)``; ``beta=1`` reverse ``KL(p_s || p_t)``;
    in between the generalized JSD ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)``,
    ``m = (1 - beta) p_s + beta p_t``. Computed chunk by chunk in fp32 (fp64 for fp64 inputs).

    Args:
        student_logits: ``[..., V_local]`` fp32 / bf16 / fp16 / fp64; this rank's vocabulary shard under TP.
            Receives the gradient.
        teacher_logits: the same shape, sharded the same way (None with `teacher_topk`), any float dtype (a
            float64 teacher beside a narrower student is read in the student's compute dtype, fp32). Detached:
            it never receives a gradient.
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
            ``chunk_size="auto"`` sizes chunks from a memory budget (`lmloss.chunks.auto_chunk_size`).
        softcap, teacher_softcap: Gemma's ``final_logit_softcapping`` of the student and of the teacher
            (``cap * tanh(logits / cap)`` before the temperature; None for none). The student's goes
            through the kernels' transform (and its gradient); the teacher's is applied to each teacher
            chunk as it is read (not with `teacher_topk`: its log-probs are given).

    Returns:
        A scalar (``"mean"`` / ``"sum"``), or per-token losses ``[...]`` (``"none"``); the same on every TP
        rank. The chunk loop makes three collectives per chunk over `tp_group` (a MAX and a SUM of both
        distributions' statistics, a SUM of the divergence's partial sums).
    """
    _validate.check_group("tp_group", tp_group)
    with errors_raised_on_every_rank(tp_group, vocab_start, student_logits):
        _validate.check_floating("student_logits", student_logits)
        if student_logits.dim() < 1:
            raise ValueError("student_logits must have at least one dimension (the vocabulary)")
        spec, agree = _options(
            beta=beta, reduction=reduction, teacher_topk=teacher_topk, tail=tail, teacher_softcap=teacher_softcap
        )
        _validate.check_temperature(temperature)
        _validate.check_softcap(softcap)
        _validate.check_group("mean_group", mean_group)
        agree["chunk_budget"] = budget = chunk_budget_mib(student_logits.device, memory_budget_mib)
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
        _validate.check_ignore_index(ignore_index)  # compared with the int64 labels before the plan checks it
    agree["op"] = 2
    flat_labels = None if labels is None else labels.reshape(-1)
    n, v_local = math.prod(leading), student_logits.shape[-1]
    device, dtype = student_logits.device, student_logits.dtype

    def auto_chunk(n_tokens, max_local, impl_, search):  # (no kept set: `search` is (0, 0))
        per_logit = bytes_per_logit(dtype, spec.beta, fused=False, softcap=bool(softcap))
        return auto_chunk_size(n_tokens, max_local, device, per_logit, budget_mib=budget)

    plan = make_plan(
        n_tokens=n, local_vocab=v_local, device=device, dtype=dtype, labels=None, outputs=("loss",),
        chunk_size=chunk_size, auto_chunk=auto_chunk, temperature=temperature, softcap=softcap,
        ignore_index=ignore_index, vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start,
        impl=impl, agree=agree, tensors=_tensors(topk, flat_labels, ignore_index),
        counting=None if flat_labels is None else flat_labels != ignore_index,
        arguments={"logits": student_logits, "teacher_logits": teacher_logits},
    )  # fmt: skip

    def make_teacher(rows, cols=None):
        return teacher_rows(LogitRows(teacher.reshape(-1, v_local)), teacher_softcap, teacher.dtype, dtype)

    objective = _objective(plan, spec, topk, flat_labels, make_teacher)
    (per_token,) = PerTokenLoss.apply(Op(plan, LogitsHead, objective), student_logits.reshape(-1, v_local))
    return reduce_loss(
        per_token.view(leading), _labels_for_count(labels, leading, ignore_index, device),
        ignore_index=ignore_index, reduction=reduction, mean_group=mean_group,
    )  # fmt: skip


def _tensors(topk, labels, ignore_index: int) -> dict:
    """The per-token tensors the TP ranks agree on: the sparse teacher, and which tokens count (the labels
    are only compared with `ignore_index` here, never read as vocabulary ids)."""
    out = {} if topk is None else {"teacher_ids": topk[0], "teacher_logprobs": topk[1]}
    if labels is not None:
        out["mask"] = labels != ignore_index
    return out


def _objective(plan, spec: DivergenceSpec, topk, labels, make_teacher, grad_scale=None):
    """The two-distribution objective of a plan; a sparse teacher's values are checked here, after the rank
    agreement (its ids and log-probs were agreed by fingerprint: every rank raises alike)."""
    if topk is None:
        return DivergenceObjective(plan, spec, make_teacher, labels, grad_scale=grad_scale)
    valid = None if labels is None else labels != plan.ignore_index
    _check_topk_values(*topk, valid, plan.shard.vocab_size, spec.tail)
    return SparseTeacherObjective(plan, spec, *topk, labels, grad_scale=grad_scale)


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
    memory_budget_mib: float | None = None,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
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
    spec, agree, checked = None, {"op": 3}, {}

    def checks(expected):
        nonlocal spec
        spec, options = _options(
            beta=beta, reduction=reduction, teacher_topk=teacher_topk, tail=tail, teacher_softcap=teacher_softcap
        )
        agree.update(options)
        _validate.check_temperature(temperature)
        if (teacher_hidden is None) != (teacher_weight is None):
            raise ValueError("teacher_hidden and teacher_weight go together (both None with teacher_topk)")
        if (teacher_hidden is None) == (teacher_topk is None):
            raise ValueError("pass exactly one of (teacher_hidden, teacher_weight) and teacher_topk")
        if teacher_hidden is not None:
            _check_teacher_head(teacher_hidden, teacher_weight, student_hidden, student_weight)
            agree["teacher_width"] = teacher_weight.shape[-1]
        if teacher_topk is not None:
            checked["topk"] = _check_topk(teacher_topk, expected, student_weight.device, spec.beta, temperature)
            agree["teacher_topk"] = checked["topk"][0].shape[1]
        return {  # labels: agreed by the plan
            "tensors": _tensors(checked.get("topk"), None, ignore_index),
            "arguments": {"teacher_hidden": teacher_hidden, "teacher_weight": teacher_weight},
        }

    p = prepare(
        student_hidden, student_weight, labels, None, chunk_size=chunk_size, temperature=temperature,
        softcap=softcap, ignore_index=ignore_index, vocab_size=vocab_size, tp_group=tp_group,
        vocab_start=vocab_start, sequence_parallel=sequence_parallel, weight_grad_dtype=weight_grad_dtype,
        impl=impl, outputs=("loss",), agree=agree, reduction=reduction, mean_group=mean_group,
        bytes_per_logit=bytes_per_logit(student_weight.dtype, beta if isinstance(beta, float) else 0.0, fused=True,
                                        softcap=bool(softcap)),
        checks=checks,
        memory_budget_mib=memory_budget_mib,
    )  # fmt: skip
    topk = checked.get("topk")
    make_teacher = None
    if teacher_hidden is not None:
        make_teacher = second_head(
            teacher_hidden, teacher_weight, softcap=teacher_softcap, sequence_parallel=sequence_parallel,
            tp_group=tp_group, student_dtype=student_weight.dtype,
        )  # fmt: skip

    if reduction == "none":
        objective = _objective(p.plan, spec, topk, p.labels, make_teacher)
        (per_token,) = PerTokenLoss.apply(Op(p.plan, p.head, objective), p.flat, student_weight, None)
        return per_token.view(p.shape)
    objective = _objective(p.plan, spec, topk, p.labels, make_teacher)
    total = SummedLoss.apply(Op(p.plan, p.head, objective), torch.is_grad_enabled(), None, p.flat, student_weight, None)
    return reduce_loss(
        total, _labels_for_count(p.labels, (p.flat.shape[0],), ignore_index, student_weight.device),
        ignore_index=ignore_index, reduction=reduction, mean_group=mean_group,
    )  # fmt: skip
