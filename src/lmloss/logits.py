"""Per-token log-probs, entropy and cross-entropy from logits, chunked over tokens and vocab-parallel.

The math lives in two per-chunk kernels, `softmax_chunk_forward` and `softmax_chunk_backward_`, which the
fused LM-head path (`lmloss.fused`) reuses unchanged. `_SoftmaxOverLogits` walks the tokens in chunks:

* forward, per chunk: row max (one MAX over the TP group), then the partial sums ``sum exp``, the target
  logit and, when asked for, ``sum p*x`` (entropy) and ``sum x`` (label smoothing), packed into one tensor
  and combined by one SUM over the TP group. Only ``lse`` (and the entropy) per token are saved.
* backward, per chunk: recompute ``log p`` from the saved ``lse`` and write the gradient once into a
  preallocated buffer of the logits' dtype. fp32 logits are worked on in place in their slice of that
  buffer; lower precisions go through one fp32 chunk scratch. No collectives, no concatenation, and the
  saved logits are never written to.

Writing ``x = logits / temperature`` and ``p = softmax(x)`` over the valid global vocabulary, every output's
gradient with respect to ``x`` has the form ``a*p + b*onehot(label) + c + d*p*(log p + H)`` per token, so
one backward kernel serves every combination of outputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from lmloss import _validate
from lmloss.vocab_parallel import (
    ProcessGroup,
    VocabShard,
    all_reduce_max_,
    all_reduce_sum_,
    vocab_shard,
)

DEFAULT_CHUNK_SIZE = 1024


@dataclasses.dataclass(frozen=True)
class SoftmaxSpec:
    """What to compute per token. Shared by the logits and the fused ops.

    scale: factor applied to the chunk before the softmax (``1 / temperature``); 1.0 when the caller has
        already folded the temperature in (the fused path does it inside its matmul).
    logprobs / entropy / loss: which per-token outputs to produce; ``loss`` is the cross-entropy with
        ``label_smoothing`` and ``z_loss`` folded in.
    """

    shard: VocabShard
    scale: float = 1.0
    ignore_index: int = -100
    logprobs: bool = False
    entropy: bool = False
    loss: bool = False
    label_smoothing: float = 0.0
    z_loss: float = 0.0

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(k for k in ("logprobs", "entropy", "loss") if getattr(self, k))


@dataclasses.dataclass
class ChunkForward:
    """Per-token results of one chunk, each ``[c]`` fp32.

    `lse` is the log-sum-exp of the scaled logits, `row_max` the global row maximum they were shifted by.
    """

    lse: torch.Tensor
    row_max: torch.Tensor
    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    loss: torch.Tensor | None = None


@dataclasses.dataclass
class GradCoefficients:
    """Per-token coefficients of ``d out / d x = a*p + b*onehot + c + d*p*(log p + H)``; None means zero."""

    a: torch.Tensor
    b: torch.Tensor | None
    c: torch.Tensor | None
    d: torch.Tensor | None

    def rows(self, s: int, e: int) -> GradCoefficients:
        return GradCoefficients(*(None if t is None else t[s:e] for t in (self.a, self.b, self.c, self.d)))


class ChunkScratch:
    """Chunk-sized buffers allocated once per call and reused by every chunk.

    A fresh ``[chunk, V]`` tensor per chunk costs its page faults every time (about 80 ms per 125 MiB on
    a 2-core CPU: more than the math on it), so each op asks for named buffers here instead.
    """

    def __init__(self, rows: int, cols: int, device: torch.device) -> None:
        self.rows, self.cols, self.device = rows, cols, device
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A ``[rows, cols]`` view of the buffer `name` (made on first use at the full chunk size)."""
        buf = self._buffers.get(name)
        if buf is None:
            buf = torch.empty((self.rows, self.cols), dtype=dtype, device=self.device)
            self._buffers[name] = buf
        return buf[:rows, :cols]


def chunk_bounds(n: int, chunk_size: int | None) -> Iterator[tuple[int, int]]:
    """``(start, end)`` row ranges covering ``[0, n)``; one range when `chunk_size` is None."""
    step = n if chunk_size is None else chunk_size
    for s in range(0, n, max(step, 1)):
        yield s, min(s + step, n)


@contextlib.contextmanager
def _serial_row_reductions(rows: int, device: torch.device) -> Iterator[None]:
    """Reduce each row on one thread when a chunk has fewer rows than intra-op threads.

    Given enough rows, torch's CPU reductions hand whole rows to threads and sum each row in one fixed
    order; with fewer rows than threads they split a row across threads and round differently. Forcing
    the serial order here keeps fp32 results bit-identical for every chunk size (a tail chunk of one
    row included).
    """
    threads = torch.get_num_threads()
    if device.type != "cpu" or rows >= threads or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _upcast_scale_shift(x: torch.Tensor, scale: float, shift: torch.Tensor, *, out: torch.Tensor) -> None:
    """``out = float32(x) * scale - shift[:, None]``, the same rounding in forward and backward.

    Upcast first: scaling in bf16 / fp16 would round ``x * scale`` to that dtype, and a mixed-dtype
    ``torch.sub(bf16, fp32, out=fp32)`` takes a slow path on CPU (4-5x a copy plus an fp32 subtract).
    """
    if x.dtype == torch.float32 and scale == 1.0:
        torch.sub(x, shift[:, None], out=out)  # one pass when no upcast is needed
        return
    out.copy_(x)
    if scale != 1.0:
        out.mul_(scale)
    out.sub_(shift[:, None])


def softmax_chunk_forward(
    x: torch.Tensor,
    labels: torch.Tensor | None,
    spec: SoftmaxSpec,
    *,
    overwrite: bool = False,
    scratch: ChunkScratch | None = None,
) -> ChunkForward:
    """Softmax statistics of one chunk ``x [c, V_local]`` (any float dtype).

    Two collectives over ``spec.shard.group``: MAX of the row maxima, then one SUM of the packed partial
    sums. Everything is computed in fp32 relative to the global row max.

    `x` is left as it is unless `overwrite` is set and `x` is fp32: then the kernel works in place (the
    fused path owns its logits chunk and so holds one chunk-sized tensor fewer). Without the entropy it
    leaves ``exp(x * scale - row_max)`` in ``x``'s valid columns, which `softmax_grad_from_exps_` turns
    into a gradient without recomputing anything; with the entropy, ``x * scale - row_max``.
    `scratch` provides the fp32 working buffers (else they are allocated for this chunk).
    """
    with _serial_row_reductions(x.shape[0], x.device):
        return _softmax_chunk_forward(x, labels, spec, overwrite, scratch)


def _softmax_chunk_forward(x, labels, spec: SoftmaxSpec, overwrite: bool, scratch) -> ChunkForward:
    shard = spec.shard
    rows, n_valid = x.shape[0], shard.valid
    xv = x[:, :n_valid]  # padded vocabulary columns are a suffix: a view drops them
    if n_valid > 0:
        row_max = xv.amax(dim=-1).float()
        if spec.scale != 1.0:
            row_max.mul_(spec.scale)  # rounding is monotonic, so max(x)*s == max(x*s) exactly
    else:
        row_max = torch.full((rows,), float("-inf"), dtype=torch.float32, device=x.device)
    all_reduce_max_(row_max, shard.group)

    if scratch is None:
        scratch = ChunkScratch(rows, n_valid, x.device)
    if overwrite and x.dtype == torch.float32:
        shifted = xv.mul_(spec.scale) if spec.scale != 1.0 else xv
        shifted.sub_(row_max[:, None])
    else:
        shifted = scratch.get("shifted", rows, n_valid)
        _upcast_scale_shift(xv, spec.scale, row_max, out=shifted)

    partial = []  # order: sum exp, target logit, [sum p*x], [sum x]
    if spec.logprobs or spec.loss:
        idx, owned = shard.local_targets(labels)
        if n_valid > 0:
            target = shifted.gather(1, idx[:, None]).squeeze(1)
        else:
            target = torch.zeros(rows, dtype=torch.float32, device=x.device)
        target = torch.where(owned, target, 0.0)
    sum_shifted = shifted.sum(dim=-1) if spec.loss and spec.label_smoothing > 0 else None
    if spec.entropy:
        # logits of -inf (a sampler's mask) would make exp * shifted = 0 * -inf = NaN; a finite floor
        # gives the same exp (0) and a 0 contribution
        shifted.clamp_(min=torch.finfo(torch.float32).min)
        exps = torch.exp(shifted, out=scratch.get("exps", rows, n_valid))
        sum_exp = exps.sum(dim=-1)
        sum_exp_shifted = exps.mul_(shifted).sum(dim=-1)
        del exps
    else:
        sum_exp = shifted.exp_().sum(dim=-1)
    del shifted
    partial.append(sum_exp)
    if spec.logprobs or spec.loss:
        partial.append(target)
    if spec.entropy:
        partial.append(sum_exp_shifted)
    if sum_shifted is not None:
        partial.append(sum_shifted)
    packed = all_reduce_sum_(torch.stack(partial, dim=1), shard.group)
    cols = iter(packed.unbind(1))

    sum_exp = next(cols)
    log_sum_exp = sum_exp.log()
    out = ChunkForward(lse=row_max + log_sum_exp, row_max=row_max)
    if spec.logprobs or spec.loss:
        target_logprob = next(cols) - log_sum_exp
        valid = labels != spec.ignore_index
    if spec.entropy:
        out.entropy = log_sum_exp - next(cols) / sum_exp
    if spec.logprobs:
        out.logprobs = torch.where(valid, target_logprob, 0.0)
    if spec.loss:
        nll = -target_logprob
        if spec.label_smoothing > 0:
            smooth = log_sum_exp - next(cols) / shard.vocab_size
            nll = (1.0 - spec.label_smoothing) * nll + spec.label_smoothing * smooth
        if spec.z_loss > 0:
            nll = nll + spec.z_loss * out.lse.square()
        out.loss = torch.where(valid, nll, 0.0)
    return out


def grad_coefficients(
    spec: SoftmaxSpec,
    labels: torch.Tensor | None,
    lse: torch.Tensor,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    grad_loss: torch.Tensor | None,
) -> GradCoefficients | None:
    """Turn upstream gradients of the per-token outputs ``[N]`` into the kernel's coefficients ``[N]``."""
    a = b = c = d = None
    if grad_logprobs is not None or grad_loss is not None:
        # where(), not a multiply: an inf or NaN upstream at an ignored position must give no gradient
        valid = labels != spec.ignore_index
        a = torch.zeros_like(lse)
        b = torch.zeros_like(lse)
    if grad_logprobs is not None:  # d logp_t / dx = onehot - p
        g = torch.where(valid, grad_logprobs.float(), 0.0)
        a -= g
        b += g
    if grad_loss is not None:  # d loss / dx = (1 + 2 z lse) p - (1 - eps) onehot - eps / V
        g = torch.where(valid, grad_loss.float(), 0.0)
        a += g * (1.0 + 2.0 * spec.z_loss * lse) if spec.z_loss > 0 else g
        b -= (1.0 - spec.label_smoothing) * g
        if spec.label_smoothing > 0:
            c = -(spec.label_smoothing / spec.shard.vocab_size) * g
    if grad_entropy is not None:  # d H / dx = -p (log p + H)
        d = -grad_entropy.float()
        if a is None:
            a = torch.zeros_like(lse)
    if a is None:
        return None
    return GradCoefficients(a, b, c, d)


def softmax_chunk_backward_(
    out: torch.Tensor,
    x: torch.Tensor,
    labels: torch.Tensor | None,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    coef: GradCoefficients,
    spec: SoftmaxSpec,
    p_scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write ``d outputs / d x_raw`` of one chunk into the fp32 tensor `out` ``[c, V_local]``.

    `x` is the chunk as the forward saw it (before ``spec.scale``); `out` may be `x` itself when the
    caller owns that memory (the fused path), never a tensor saved by autograd. `p_scratch` (fp32, at
    least ``[c, V_valid]``) is needed only when ``coef.d`` is set, to hold ``p`` beside ``log p``.
    """
    n_valid = spec.shard.valid
    ov, xv = out[:, :n_valid], x[:, :n_valid]
    _upcast_scale_shift(xv, spec.scale, lse, out=ov)
    # ov = log p
    if coef.d is not None:
        p = torch.exp(ov, out=p_scratch[: ov.shape[0], :n_valid])
        ov.clamp_(min=torch.finfo(torch.float32).min)  # -inf logits: p = 0, and 0 * (log p + H) must be 0
        ov.add_(entropy[:, None]).mul_(p).mul_(coef.d[:, None])
        ov.addcmul_(p, coef.a[:, None])
    else:
        ov.exp_().mul_(coef.a[:, None])
    return _finish_grad_(out, labels, coef, spec)


def softmax_grad_from_exps_(
    exps: torch.Tensor,
    labels: torch.Tensor | None,
    fwd: ChunkForward,
    coef: GradCoefficients,
    spec: SoftmaxSpec,
) -> torch.Tensor:
    """Like `softmax_chunk_backward_`, in place on what ``softmax_chunk_forward(..., overwrite=True)`` left.

    ``exps`` holds ``exp(x * scale - row_max)``, so ``p = exps * exp(row_max - lse)`` and ``a * p`` is one
    pass. Only for coefficients without the entropy term (``coef.d is None``).
    """
    if coef.d is not None:
        raise ValueError(
            "softmax_grad_from_exps_ cannot produce the entropy gradient; use softmax_chunk_backward_"
        )
    ev = exps[:, : spec.shard.valid]
    ev.mul_((coef.a * torch.exp(fwd.row_max - fwd.lse))[:, None])
    return _finish_grad_(exps, labels, coef, spec)


def _finish_grad_(out: torch.Tensor, labels: torch.Tensor | None, coef: GradCoefficients, spec: SoftmaxSpec):
    """Add the terms that do not involve ``p`` (``c``, ``b * onehot``), apply the chain rule through the
    scale, and zero the padded vocabulary columns."""
    n_valid = spec.shard.valid
    ov = out[:, :n_valid]
    if coef.c is not None:
        ov.add_(coef.c[:, None])
    if coef.b is not None and n_valid > 0:
        idx, owned = spec.shard.local_targets(labels)
        ov.scatter_add_(1, idx[:, None], torch.where(owned, coef.b, 0.0)[:, None])
    if spec.scale != 1.0:
        ov.mul_(spec.scale)  # chain rule through x = logits * scale
    out[:, n_valid:].zero_()
    return out


class _SoftmaxOverLogits(torch.autograd.Function):
    """logits ``[N, V_local]``, labels ``[N]`` -> the per-token outputs named by ``spec.outputs``."""

    @staticmethod
    def forward(ctx, logits, labels, spec: SoftmaxSpec, chunk_size):
        n = logits.shape[0]
        fp32 = dict(dtype=torch.float32, device=logits.device)
        results = {k: torch.empty(n, **fp32) for k in spec.outputs}
        lse = torch.empty(n, **fp32)
        scratch = ChunkScratch(min(n, chunk_size or n), spec.shard.valid, logits.device)
        for s, e in chunk_bounds(n, chunk_size):
            chunk = softmax_chunk_forward(
                logits[s:e], None if labels is None else labels[s:e], spec, scratch=scratch
            )
            lse[s:e] = chunk.lse
            for k in spec.outputs:
                results[k][s:e] = getattr(chunk, k)
        ctx.spec, ctx.chunk_size = spec, chunk_size
        ctx.save_for_backward(logits, labels, lse, results.get("entropy"))
        ctx.set_materialize_grads(False)
        return tuple(results[k] for k in spec.outputs)

    @staticmethod
    def backward(ctx, *grads):
        spec: SoftmaxSpec = ctx.spec
        logits, labels, lse, entropy = ctx.saved_tensors
        upstream = dict(zip(spec.outputs, grads))
        coef = grad_coefficients(
            spec, labels, lse, upstream.get("logprobs"), upstream.get("entropy"), upstream.get("loss")
        )
        if coef is None:
            return None, None, None, None
        n, v_local = logits.shape
        grad = torch.empty((n, v_local), dtype=logits.dtype, device=logits.device)
        in_place = logits.dtype == torch.float32
        scratch = ChunkScratch(min(n, ctx.chunk_size or n), v_local, logits.device)
        for s, e in chunk_bounds(n, ctx.chunk_size):
            out = grad[s:e] if in_place else scratch.get("grad", e - s, v_local)
            p_scratch = None if coef.d is None else scratch.get("p", e - s, spec.shard.valid)
            softmax_chunk_backward_(
                out,
                logits[s:e],
                None if labels is None else labels[s:e],
                lse[s:e],
                None if entropy is None else entropy[s:e],
                coef.rows(s, e),
                spec,
                p_scratch,
            )
            if not in_place:
                grad[s:e].copy_(out)
        return grad, None, None, None


def _flatten(logits: torch.Tensor, labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[..., V] -> [N, V]`` as a view when the layout allows it (a copy otherwise)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return flat, None if labels is None else labels.reshape(-1)


def build_spec(
    local_vocab: int,
    labels: torch.Tensor | None,
    device: torch.device,
    *,
    temperature: float,
    ignore_index: int,
    vocab_size: int | None,
    tp_group: ProcessGroup | None,
    vocab_start: int | None,
    fold_temperature: bool = False,
    **outputs,
) -> SoftmaxSpec:
    """Resolve the vocabulary shard, check the labels against it and build the `SoftmaxSpec`.

    Shared by the logits and fused ops. With `fold_temperature` the caller applies ``1 / temperature``
    itself (inside its matmul) and the spec's scale is 1.
    """
    _validate.check_temperature(temperature)
    shard = vocab_shard(
        local_vocab, tp_group=tp_group, vocab_start=vocab_start, vocab_size=vocab_size, device=device
    )
    if labels is not None:
        _validate.check_label_range(labels, shard.vocab_size, ignore_index)
    scale = 1.0 if fold_temperature else 1.0 / temperature
    return SoftmaxSpec(shard=shard, scale=scale, ignore_index=ignore_index, **outputs)


def prepare(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    chunk_size: int | None,
    **spec_args,
) -> SoftmaxSpec:
    """Check the arguments every logits op shares and build its `SoftmaxSpec`."""
    _validate.check_floating("logits", logits)
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary)")
    if labels is not None:
        _validate.check_labels(labels, logits.shape[:-1], against="logits")
    _validate.check_chunk_size(chunk_size)
    return build_spec(logits.shape[-1], labels, logits.device, **spec_args)


def reduce_loss(
    per_token: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int,
    reduction: str,
    mean_group: ProcessGroup | None,
) -> torch.Tensor:
    """Apply `reduction` to per-token losses (ignored tokens already hold 0).

    ``"mean"`` divides the local sum by the number of non-ignored tokens, counted over `mean_group`
    when given (one all-reduce of a scalar). With no valid token it returns 0 with zero gradients.
    """
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if reduction == "sum":
        return total
    count = (labels != ignore_index).sum().to(torch.float32)
    all_reduce_sum_(count, mean_group)
    return total / count.clamp(min=1.0)


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    tp_group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each label: ``log_softmax(logits / temperature)[..., label]``.

    Args:
        logits: ``[..., V_local]`` fp32 / bf16 / fp16; this rank's vocabulary shard under TP.
        labels: ``[...]`` integer global vocabulary ids, or `ignore_index`.
        chunk_size: tokens per chunk (over the flattened leading dims); None for one chunk.
        temperature: the logits are divided by it before the softmax.
        ignore_index: positions with this label give exactly 0.0 and no gradient.
        vocab_size: the true global vocabulary; columns at global index ``>= vocab_size`` are padding
            and take no part in the softmax. Default: all columns over all ranks.
        tp_group: process group the vocabulary is sharded over; None for one process.
        vocab_start: global id of this rank's first column; default ``rank * V_local`` (even shards). Pass it
            on every TP rank or on none: with it, one all-gather per call checks that the shards tile.
        return_entropy: also return the entropy of ``softmax(logits / temperature)`` over the whole
            vocabulary, differentiable, at every position (ignore_index does not mask it).

    Returns:
        fp32 ``[...]`` log-probs, or ``(logprobs, entropy)``. Each output is the same on every TP rank.
    """
    spec = prepare(
        logits, labels, chunk_size=chunk_size, temperature=temperature, ignore_index=ignore_index,
        vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start,
        logprobs=True, entropy=return_entropy,
    )  # fmt: skip
    flat, flat_labels = _flatten(logits, labels)
    outs = _SoftmaxOverLogits.apply(flat, flat_labels, spec, chunk_size)
    outs = tuple(o.view(labels.shape) for o in outs)
    return outs if return_entropy else outs[0]


def token_entropy(
    logits: torch.Tensor,
    *,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    tp_group: ProcessGroup | None = None,
    vocab_start: int | None = None,
) -> torch.Tensor:
    """Shannon entropy ``-sum p log p`` of ``p = softmax(logits / temperature)`` over the global vocabulary.

    `logits` ``[..., V_local]`` -> fp32 ``[...]``, differentiable. Arguments as in `token_logprobs`.
    """
    spec = prepare(
        logits, None, chunk_size=chunk_size, temperature=temperature, ignore_index=-100,
        vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start, entropy=True,
    )  # fmt: skip
    flat, _ = _flatten(logits, None)
    (entropy,) = _SoftmaxOverLogits.apply(flat, None, spec, chunk_size)
    return entropy.view(logits.shape[:-1])


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    tp_group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    mean_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Cross-entropy of `labels` under ``softmax(logits / temperature)``, as `F.cross_entropy` defines it.

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
        Other arguments as in `token_logprobs`.
    """
    _validate.check_reduction(reduction)
    _validate.check_label_smoothing(label_smoothing)
    _validate.check_z_loss(z_loss)
    spec = prepare(
        logits, labels, chunk_size=chunk_size, temperature=temperature, ignore_index=ignore_index,
        vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start,
        loss=True, label_smoothing=label_smoothing, z_loss=z_loss,
    )  # fmt: skip
    flat, flat_labels = _flatten(logits, labels)
    (per_token,) = _SoftmaxOverLogits.apply(flat, flat_labels, spec, chunk_size)
    return reduce_loss(
        per_token.view(labels.shape),
        labels,
        ignore_index=ignore_index,
        reduction=reduction,
        mean_group=mean_group,
    )
