"""Arguments -> one typed `LossPlan`, and the one chunk loop that every op runs.

An op (from logits, or fused from hidden states) checks its arguments and calls `make_plan` once. The
loop then walks the tokens in chunks: a *chunk source* ``source(s, e) -> x [c, V_local]`` yields each
chunk's logits (a slice of the input, or a matmul of hidden rows); the kernels (`lmloss.kernels`, chosen
by ``impl``) compute per-row softmax partials; `combine_partials` merges them over the TP group (one MAX,
one packed SUM); `finish` turns them into the per-token outputs. A *gradient sink* receives each chunk's
gradient: ``sink.buffer(s, e, x)`` says where the kernel writes it (a gradient buffer, the logits
themselves in the in-place mode, the chunk's own scratch in the fused path) and ``sink.consume(s, e, g)``
takes it from there (nothing, or the matmuls into the hidden / weight / bias accumulators).

Writing ``y = scale * softcap(x)`` and ``p = softmax(y)`` over the valid global vocabulary, every
output's gradient has the form ``a*p + b*onehot(label) + c + d*p*(log p + H)`` per token
(`grad_coefficients`), so one gradient kernel serves every combination of outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from lmloss import _validate
from lmloss.kernels import ChunkMath, compute_dtype, make_kernels, resolve_impl
from lmloss.sampling import Sampling, keep_thresholds
from lmloss.vocab_parallel import (
    ProcessGroup,
    VocabShard,
    combine_partials,
    errors_raised_on_every_rank,
    resolve_shard,
    will_gather,
    world_size,
)

OUTPUTS = ("logprobs", "entropy", "loss")
#: The input dtype as it travels in the rank-agreement vector (fp32 on one rank and fp64 on another would
#: all-reduce partials of different sizes).
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
ChunkSource = Callable[[int, int], torch.Tensor]
#: ``upstream(s, e, chunk_outputs) -> {output: [c] upstream gradient or None}`` (see `forward_pass`)
Upstream = Callable[[int, int, dict], dict]


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

    @property
    def returned(self) -> tuple[str, ...]:
        """What the op returns: `outputs`, then ``"log_kept_mass"`` (not differentiable) if asked."""
        wants_mass = self.sampling is not None and self.sampling.log_kept_mass
        return (*self.outputs, "log_kept_mass") if wants_mass else self.outputs

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
) -> LossPlan:
    """Check the options every op shares and resolve them into a `LossPlan`.

    `labels` are the flat int64 labels (or None). `auto_chunk(n_tokens, max_V_local, impl)` sizes
    ``chunk_size="auto"`` from values that every TP rank agrees on. Under `tp_group` the ranks' metadata
    (token count, chunk size, shard, dtype, options, a fingerprint of the labels, and `agree`: the op's
    own fields of `lmloss.vocab_parallel.HOST_FIELDS`) is compared in one all-gather before any other
    collective (`resolve_shard`). The checks here run before it: a rank whose argument fails one takes
    the error into that gather and every rank raises it (`errors_raised_on_every_rank`).
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
        requested = impl
        impl = resolve_impl(impl, device, dtype)
        if sampling is not None and softcap:
            # the Triton kernels' tanh rounds differently from torch.tanh, on whose values the thresholds are
            # found: a token at the threshold could drop out of its own kept set
            if requested == "triton":
                raise ValueError(
                    'top_k / top_p / min_p with softcap run on impl="torch" (impl="auto" picks it); '
                    'impl="triton" takes them without softcap'
                )
            impl = "torch"
    if sampling is not None:
        agree = {**(agree or {}), **sampling.agree_fields()}
    chunk_code = {None: -1, "auto": -2}.get(chunk_size, chunk_size)  # type: ignore[arg-type]
    fields = dict(
        n_tokens=n_tokens, chunk_size=chunk_code, ignore_index=ignore_index, impl=("torch", "triton").index(impl),
        outputs=sum(1 << OUTPUTS.index(k) for k in outputs), temperature=float(temperature),
        softcap=float(softcap or 0.0), label_smoothing=float(label_smoothing), z_loss=float(z_loss),
        dtype=_DTYPE_CODES.get(dtype, 99), **(agree or {}),
    )  # fmt: skip
    gathered = will_gather(tp_group, vocab_start)
    stats = None if labels is None or not gathered else _validate.label_stats(labels, ignore_index)
    shard, max_local = resolve_shard(
        local_vocab, tp_group=tp_group, vocab_start=vocab_start, vocab_size=vocab_size, device=device,
        agree=fields, label_stats=stats,
    )  # fmt: skip
    if labels is not None and not gathered:
        _validate.check_label_range(labels, shard.vocab_size, ignore_index)
    if chunk_size == "auto":
        # the threshold search holds a few chunk-sized buffers whichever kernels run: chunk as torch does
        chunk_size = auto_chunk(n_tokens, max_local, "torch" if sampling is not None else impl)
    math = ChunkMath(
        vocab_start=shard.start, valid=shard.valid, scale=1.0 / temperature, softcap=float(softcap or 0.0)
    )
    return LossPlan(
        shard=shard, math=math, impl=impl, chunk_size=chunk_size, outputs=outputs, ignore_index=ignore_index,
        label_smoothing=float(label_smoothing), z_loss=float(z_loss), tp_group=tp_group, sampling=sampling,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# per-token math on the combined partials ([c] vectors: cheap, the same for both implementations


def finish(plan: LossPlan, combined: torch.Tensor, labels: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Per-token outputs ``[c]`` (and ``"lse"``) from the global partials ``[c, 5]`` of `combine_partials`."""
    big_m, sum_exp, t, target, sum_y = combined.unbind(1)
    log_sum_exp = sum_exp.log()
    out = {"lse": big_m + log_sum_exp}
    if "entropy" in plan.outputs:
        out["entropy"] = log_sum_exp - t / sum_exp
    if labels is None:
        return out
    valid = labels != plan.ignore_index
    target_logprob = (target - big_m) - log_sum_exp
    if "logprobs" in plan.outputs:
        out["logprobs"] = torch.where(valid, target_logprob, 0.0)
    if "loss" in plan.outputs:
        nll = -target_logprob
        if plan.label_smoothing > 0:
            smooth = log_sum_exp - (sum_y / plan.shard.vocab_size - big_m)
            nll = (1.0 - plan.label_smoothing) * nll + plan.label_smoothing * smooth
        if plan.z_loss > 0:
            nll = nll + plan.z_loss * out["lse"].square()
        out["loss"] = torch.where(valid, nll, 0.0)
    return out


def grad_coefficients(
    plan: LossPlan,
    labels: torch.Tensor | None,
    lse: torch.Tensor,
    upstream: dict[str, torch.Tensor | None],
    dropped: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Upstream gradients of the per-token outputs (``[N]`` each, None = unused) -> ``coef [N, 4]``
    (``a, b, c, d``); None when no output has a gradient. `dropped` ``[N]`` bool: labels outside the
    sampling kept set, whose log-prob (-inf) has no gradient."""
    g_lp, g_h, g_loss = (upstream.get(k) for k in OUTPUTS)
    if g_lp is None and g_h is None and g_loss is None:
        return None
    coef = torch.zeros((lse.shape[0], 4), dtype=lse.dtype, device=lse.device)
    a, b, c, d = coef.unbind(1)
    if g_lp is not None or g_loss is not None:
        # where(), not a multiply: an inf or NaN upstream at an ignored position must give no gradient
        valid = labels != plan.ignore_index
        if dropped is not None:
            valid = valid & ~dropped
    if g_lp is not None:  # d logp_t / dy = onehot - p
        g = torch.where(valid, g_lp.to(lse.dtype), 0.0)
        a.sub_(g)
        b.add_(g)
    if g_loss is not None:  # d loss / dy = (1 + 2 z lse) p - (1 - eps) onehot - eps / V
        g = torch.where(valid, g_loss.to(lse.dtype), 0.0)
        # the z-loss term multiplies by lse, NaN / inf in an ignored row: select, so that row stays all 0
        a.add_(torch.where(valid, g * (1.0 + 2.0 * plan.z_loss * lse), 0.0) if plan.z_loss > 0 else g)
        b.sub_((1.0 - plan.label_smoothing) * g)
        if plan.label_smoothing > 0:
            c.sub_((plan.label_smoothing / plan.shard.vocab_size) * g)
    if g_h is not None:  # d H / dy = -p (log p + H)
        d.sub_(g_h.to(lse.dtype))
    return coef


def has_uniform_term(plan: LossPlan, upstream: dict[str, torch.Tensor | None]) -> bool:
    """Whether ``coef[:, 2]`` can be nonzero (label smoothing of a loss with a gradient)."""
    return plan.label_smoothing > 0 and upstream.get("loss") is not None


# ----------------------------------------------------------------------------------------------------------
# the chunk loop


def forward_pass(
    plan: LossPlan,
    n: int,
    source: ChunkSource,
    labels: torch.Tensor | None,
    *,
    device: torch.device,
    dtype: torch.dtype,
    grad_sink: GradSink | None = None,
    grad_scale: torch.Tensor | None = None,
    upstream: Upstream | None = None,
) -> dict[str, torch.Tensor]:
    """Walk the chunks once: per-token outputs ``[n]`` (and ``"lse"``), fp32 (fp64 for fp64 inputs).

    With `grad_sink`, also the gradient of ``grad_scale * sum(loss)`` (`grad_scale`: a 0-d device tensor,
    ``1 / count`` for a mean; None for 1), computed while each chunk's logits are at hand and handed to the
    sink: the scalar-loss paths need no backward pass, and the gradient comes out already scaled.
    With `upstream` instead of `grad_scale`, the gradient of an objective of the per-token outputs:
    ``upstream(s, e, stats)`` gets the chunk's outputs and returns their upstream gradients (``{"logprobs":
    [c], "entropy": [c]}``, as in `grad_coefficients`), e.g. an RL objective's (`lmloss.rl`).
    """
    if plan.sampling is not None and grad_sink is not None:
        raise ValueError("top_k / top_p / min_p are for per-token outputs, not a summed loss")
    assert grad_scale is None or upstream is None, "an upstream objective carries its own scale"
    keys = (*plan.returned, "lse")
    if plan.sampling is not None:
        keys = (*keys, "keep_min", "dropped")
    results = {k: torch.empty(n, dtype=compute_dtype(dtype), device=device) for k in keys}
    if plan.sampling is not None:
        results["dropped"] = torch.zeros(n, dtype=torch.bool, device=device)
    kernels = plan.kernels(n, device)
    search = None  # the threshold search runs on the PyTorch kernels' scaled values and scratch
    if plan.sampling is not None:
        rows = min(n, plan.chunk_size or n)
        search = kernels if plan.impl == "torch" else make_kernels("torch", rows, plan.shard.size, device)
    uniform = plan.label_smoothing > 0
    overwrite = getattr(source, "owns_chunks", False)
    one_kernel = (
        grad_sink is not None
        and plan.outputs == ("loss",)
        and world_size(plan.tp_group) == 1
        and hasattr(kernels, "loss_and_grad_")
    )
    for s, e in plan.chunks(n):
        x = source(s, e)
        chunk_labels = None if labels is None else labels[s:e]
        keep_min = kept = None
        if plan.sampling is not None:  # the kept set's per-row threshold (collectives over tp_group)
            kept = keep_thresholds(
                search.scaled(x, plan.math), plan.sampling.rows(s, e), min(plan.sampling.k_max, plan.shard.vocab_size),
                group=plan.tp_group, scratch=search.scratch, want_full_lse=plan.sampling.log_kept_mass,
            )  # fmt: skip
            keep_min, full_lse = kept.keep_min, kept.full_lse
        if grad_sink is None:
            partials = kernels.softmax_partials(
                x, chunk_labels, plan.math, **plan.flags, overwrite=overwrite,
                **({} if kept is None else {"keep_min": keep_min, "kept_exps": (kept.exps, kept.row_max, kept.kept_mass)}),
            )  # fmt: skip
            stats = finish(plan, combine_partials(partials, plan.tp_group), chunk_labels)
            if keep_min is not None:
                stats["keep_min"] = keep_min
                if chunk_labels is not None and "logprobs" in stats:
                    stats["dropped"] = (chunk_labels != plan.ignore_index) & torch.isneginf(stats["logprobs"])
                else:
                    stats["dropped"] = False
                if plan.sampling.log_kept_mass:
                    stats["log_kept_mass"] = stats["lse"] - full_lse
        else:

            def finish_with_grad(partials, chunk_labels=chunk_labels, s=s, e=e):
                stats = finish(plan, combine_partials(partials, plan.tp_group), chunk_labels)
                if upstream is not None:
                    grads = upstream(s, e, stats)
                elif grad_scale is None:
                    grads = {"loss": torch.ones_like(stats["lse"])}
                else:
                    grads = {"loss": grad_scale.to(stats["lse"].dtype).expand_as(stats["lse"])}
                coef = grad_coefficients(plan, chunk_labels, stats["lse"], grads)
                if grads.get("entropy") is not None:  # the gradient's d term needs each row's H
                    return stats, coef, stats["lse"], stats["entropy"]
                return stats, coef, stats["lse"]

            out = grad_sink.buffer(s, e, x)
            if one_kernel:  # statistics, loss and gradient in one read of the chunk (one process only)
                stats = kernels.loss_and_grad_(
                    x, chunk_labels, plan.math, ignore_index=plan.ignore_index,
                    label_smoothing=plan.label_smoothing, z_loss=plan.z_loss, vocab_size=plan.shard.vocab_size,
                    out=out, grad_scale=grad_scale,
                )  # fmt: skip
                grad = out
            else:
                stats, grad = kernels.partials_then_grad_(
                    x, chunk_labels, plan.math, plan.flags, finish_with_grad, out, uniform_term=uniform
                )
            grad_sink.consume(s, e, grad)
        for k in keys:
            results[k][s:e] = stats[k]
    return results


def backward_pass(
    plan: LossPlan,
    n: int,
    source: ChunkSource,
    labels: torch.Tensor | None,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    coef: torch.Tensor,
    grad_sink: GradSink,
    *,
    device: torch.device,
    uniform_term: bool,
    keep_min: torch.Tensor | None = None,
) -> None:
    """Walk the chunks again: each chunk's gradient from the saved `lse` (and `entropy`, passed only when
    its upstream gradient is used) and the per-token coefficients ``coef [n, 4]``. No collectives."""
    kernels = plan.kernels(n, device)
    for s, e in plan.chunks(n):
        x = source(s, e)
        out = grad_sink.buffer(s, e, x)
        kernels.softmax_grad_(
            x, None if labels is None else labels[s:e], lse[s:e], None if entropy is None else entropy[s:e],
            coef[s:e], plan.math, out, uniform_term=uniform_term,
            **({} if keep_min is None else {"keep_min": keep_min[s:e]}),
        )  # fmt: skip
        grad_sink.consume(s, e, out)
