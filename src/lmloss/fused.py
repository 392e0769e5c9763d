"""Log-probs, entropy and cross-entropy straight from hidden states and the LM-head weight.

Per chunk of tokens the logits ``hidden[s:e] @ weight.T + bias`` (temperature folded into the matmul) are
made by one matmul in the inputs' dtype (bf16 / fp16 GEMMs accumulate in fp32 but round their output),
reduced in fp32 by `lmloss.logits`' per-chunk kernels and dropped; no ``[tokens, V_local]`` tensor ever
exists. Two ways through:

* per-token outputs (`linear_token_logprobs`, ``reduction="none"``): the backward recomputes each chunk's
  logits and turns arbitrary per-token upstream gradients (RL advantages) into gradients.
* a summed loss (``reduction="sum"`` / ``"mean"``) when gradients are wanted: the upstream gradient is a
  single scalar, so the forward computes the gradients right after each chunk's statistics, while the
  logits are at hand, and the backward only scales them. That saves the recompute matmul: 3 matmuls in
  all, the floor.

Gradients for hidden, weight and bias accumulate in fp32 and come back in their inputs' dtypes. Under
tensor parallelism (``weight`` vocab-sharded over ``tp_group``) each rank's hidden gradient covers only its
vocabulary shard, so it is all-reduced over ``tp_group`` (or reduce-scattered, with sequence parallelism).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from lmloss import _validate
from lmloss.logits import (
    ChunkScratch,
    SoftmaxSpec,
    build_spec,
    chunk_bounds,
    grad_coefficients,
    reduce_loss,
    softmax_chunk_backward_,
    softmax_chunk_forward,
    softmax_grad_from_exps_,
)
from lmloss.vocab_parallel import ProcessGroup, all_reduce_sum_, gather_rows, reduce_scatter_rows, world_size

#: Working-set budget for ``chunk_size="auto"``: the fp32 chunk temporaries (at most two ``[chunk, V_local]``
#: fp32 tensors at once: the logits chunk, and ``p`` beside it for an entropy gradient) stay under it.
#: Override with ``LMLOSS_CHUNK_BUDGET_MIB``.
DEFAULT_CHUNK_BUDGET_MIB = {"cpu": 64, "cuda": 2048}
_LIVE_CHUNK_TENSORS = 2


def auto_chunk_size(n_tokens: int, local_vocab: int, device: torch.device | str = "cpu") -> int:
    """Tokens per chunk so that the chunk's fp32 temporaries fit the budget.

    Budget: ``LMLOSS_CHUNK_BUDGET_MIB`` if set, else `DEFAULT_CHUNK_BUDGET_MIB` for the device type
    (64 MiB on CPU, 2 GiB on CUDA). Rounded down to a multiple of 64 (matmul-friendly) when >= 64.
    """
    device_type = torch.device(device).type
    budget_mib = float(
        os.environ.get("LMLOSS_CHUNK_BUDGET_MIB", DEFAULT_CHUNK_BUDGET_MIB.get(device_type, 96))
    )
    rows = int(budget_mib * 2**20 // (_LIVE_CHUNK_TENSORS * 4 * max(local_vocab, 1)))
    if rows >= 64:
        rows -= rows % 64
    return max(1, min(rows, max(n_tokens, 1)))


@dataclasses.dataclass(frozen=True)
class _FusedPlan:
    spec: SoftmaxSpec  # scale 1: the temperature is folded into the matmul
    inv_temperature: float
    chunk_size: int | None
    tp_group: ProcessGroup | None
    sequence_parallel: bool


@dataclasses.dataclass
class _Grads:
    """fp32 gradient accumulators; None where that input needs no gradient."""

    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None

    @classmethod
    def zeros(cls, hidden, weight, bias, needs) -> _Grads:
        def make(t, need):
            return torch.zeros(t.shape, dtype=torch.float32, device=t.device) if need else None

        # hidden rows are each written once (by their chunk), so they need no zero fill
        h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if needs[0] else None
        return cls(h, make(weight, needs[1]), None if bias is None else make(bias, needs[2]))


def _scaled_rows(hidden: torch.Tensor, s: int, e: int, inv_t: float) -> torch.Tensor:
    rows = hidden[s:e]
    return rows if inv_t == 1.0 else rows * inv_t


def _scaled_bias(bias: torch.Tensor | None, inv_t: float) -> torch.Tensor | None:
    return bias if bias is None or inv_t == 1.0 else bias * inv_t


def _chunk_logits(
    rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scratch: ChunkScratch
) -> torch.Tensor:
    """fp32 ``[c, V_local]`` logits of one chunk, in the reused buffer ``scratch["logits"]``."""
    c, v_local = rows.shape[0], weight.shape[0]
    z = scratch.get("logits", c, v_local)
    mm_out = z if weight.dtype == torch.float32 else scratch.get("logits_lowp", c, v_local, weight.dtype)
    if bias is None:
        torch.mm(rows, weight.t(), out=mm_out)
    else:
        torch.addmm(bias, rows, weight.t(), out=mm_out)
    return z if mm_out is z else z.copy_(mm_out)


def _accumulate(
    grad_z: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    inv_t: float,
    g: _Grads,
    s: int,
    scratch: ChunkScratch,
):
    """Chain one chunk's fp32 ``d/d logits`` through ``logits = (rows_raw @ W.T + b) / T``.

    `rows` are the already scaled hidden rows, so the weight gradient needs no further factor.
    """
    e = s + grad_z.shape[0]
    if g.hidden is not None:
        if weight.dtype == torch.float32:
            torch.mm(grad_z, weight, out=g.hidden[s:e])
        else:  # the GEMM accumulates in fp32 internally; each hidden row comes from one GEMM
            grad_lowp = scratch.get("logits_lowp", *grad_z.shape, weight.dtype).copy_(grad_z)
            g.hidden[s:e] = torch.mm(grad_lowp, weight)
        if inv_t != 1.0:
            g.hidden[s:e].mul_(inv_t)
    if g.weight is not None:
        g.weight.addmm_(grad_z.t(), rows.float())
    if g.bias is not None:
        g.bias.add_(grad_z.sum(dim=0), alpha=inv_t)


def _forward(hidden, weight, bias, labels, plan: _FusedPlan, grads: _Grads | None):
    """Walk the chunks: per-token outputs, lse, entropy; with `grads`, also the gradients of sum(loss)."""
    spec = plan.spec
    n = hidden.shape[0]
    fp32 = dict(dtype=torch.float32, device=hidden.device)
    results = {k: torch.empty(n, **fp32) for k in spec.outputs}
    lse = torch.empty(n, **fp32)
    bias = _scaled_bias(bias, plan.inv_temperature)
    scratch = ChunkScratch(min(n, plan.chunk_size or n), weight.shape[0], hidden.device)
    for s, e in chunk_bounds(n, plan.chunk_size):
        rows = _scaled_rows(hidden, s, e, plan.inv_temperature)
        z = _chunk_logits(rows, weight, bias, scratch)
        chunk_labels = None if labels is None else labels[s:e]
        out = softmax_chunk_forward(z, chunk_labels, spec, overwrite=True, scratch=scratch)  # z: exps now
        lse[s:e] = out.lse
        for k in spec.outputs:
            results[k][s:e] = getattr(out, k)
        if grads is not None:  # d sum(loss) / d logits, while the exps are at hand
            coef = grad_coefficients(spec, chunk_labels, out.lse, None, None, torch.ones_like(out.lse))
            softmax_grad_from_exps_(z, chunk_labels, out, coef, spec)
            _accumulate(z, rows, weight, plan.inv_temperature, grads, s, scratch)
    return results, lse


def _backward(hidden, weight, bias, labels, lse, entropy, coef, plan: _FusedPlan, grads: _Grads) -> None:
    """Recompute each chunk's logits and accumulate the gradients of the per-token outputs."""
    n = hidden.shape[0]
    bias = _scaled_bias(bias, plan.inv_temperature)
    scratch = ChunkScratch(min(n, plan.chunk_size or n), weight.shape[0], hidden.device)
    for s, e in chunk_bounds(n, plan.chunk_size):
        rows = _scaled_rows(hidden, s, e, plan.inv_temperature)
        z = _chunk_logits(rows, weight, bias, scratch)
        p_scratch = None if coef.d is None else scratch.get("p", e - s, plan.spec.shard.valid)
        softmax_chunk_backward_(
            z, z, None if labels is None else labels[s:e], lse[s:e],
            None if entropy is None else entropy[s:e], coef.rows(s, e), plan.spec, p_scratch,
        )  # fmt: skip
        _accumulate(z, rows, weight, plan.inv_temperature, grads, s, scratch)


def _finish_hidden_grad(grad_hidden: torch.Tensor, plan: _FusedPlan) -> torch.Tensor:
    """Each TP rank saw only its vocabulary shard: sum the hidden gradient over the TP group.

    With sequence parallelism the sum happens in `_GatherRows`' backward, as a reduce-scatter.
    """
    if plan.sequence_parallel:
        return grad_hidden
    return all_reduce_sum_(grad_hidden, plan.tp_group)


def _cast_grads(g: _Grads, hidden, weight, bias, plan: _FusedPlan, scale: torch.Tensor | None):
    gh = gw = gb = None
    if g.hidden is not None:
        gh = _finish_hidden_grad(g.hidden if scale is None else g.hidden * scale, plan).to(hidden.dtype)
    if g.weight is not None:
        gw = (g.weight if scale is None else g.weight.mul_(scale)).to(weight.dtype)
    if g.bias is not None:
        gb = (g.bias if scale is None else g.bias.mul_(scale)).to(bias.dtype)
    return gh, gw, gb


class _LinearSoftmaxPerToken(torch.autograd.Function):
    """hidden ``[N, H]`` (full tokens), weight ``[V_local, H]`` -> per-token outputs; recompute in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, plan: _FusedPlan):
        results, lse = _forward(hidden, weight, bias, labels, plan, grads=None)
        ctx.plan = plan
        ctx.save_for_backward(hidden, weight, bias, labels, lse, results.get("entropy"))
        ctx.set_materialize_grads(False)
        return tuple(results[k] for k in plan.spec.outputs)

    @staticmethod
    def backward(ctx, *grads_out):
        plan: _FusedPlan = ctx.plan
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        upstream = dict(zip(plan.spec.outputs, grads_out))
        coef = grad_coefficients(
            plan.spec, labels, lse, upstream.get("logprobs"), upstream.get("entropy"), upstream.get("loss")
        )
        if coef is None:
            return None, None, None, None, None
        g = _Grads.zeros(hidden, weight, bias, ctx.needs_input_grad[:3])
        _backward(hidden, weight, bias, labels, lse, entropy, coef, plan, g)
        return (*_cast_grads(g, hidden, weight, bias, plan, None), None, None)


class _LinearCrossEntropySum(torch.autograd.Function):
    """Scalar ``sum`` of per-token losses; gradients computed in the forward pass, scaled in backward.

    The backward scales the saved fp32 gradients in place (no second weight-sized buffer), so it can run
    once per forward: a second backward through the same graph (``retain_graph=True``) raises.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, plan: _FusedPlan, grad_enabled: bool):
        # grad mode is always off inside forward(): the caller says whether gradients will be wanted
        needs = tuple(n and grad_enabled for n in ctx.needs_input_grad[:3])
        grads = _Grads.zeros(hidden, weight, bias, needs) if any(needs) else None
        results, _ = _forward(hidden, weight, bias, labels, plan, grads)
        ctx.plan, ctx.grads = plan, grads
        ctx.save_for_backward(hidden, weight, bias)
        return results["loss"].sum()

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, bias = ctx.saved_tensors
        if ctx.grads == "used":
            raise RuntimeError(
                "lmloss.linear_cross_entropy with reduction='sum'/'mean' computes its gradients in the forward "
                "and hands them out once; for a second backward through the same graph use reduction='none' "
                "and reduce the per-token losses yourself"
            )
        grads, ctx.grads = ctx.grads, "used"
        if grads is None:
            return None, None, None, None, None, None
        return (*_cast_grads(grads, hidden, weight, bias, ctx.plan, grad_total), None, None, None)


def _prepare(
    hidden, weight, labels, bias, *, chunk_size, temperature, ignore_index, vocab_size, tp_group,
    vocab_start, sequence_parallel, **outputs,
):  # fmt: skip
    """Check arguments, gather sequence-parallel hidden states, and build the plan."""
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
    if bias is not None:
        _validate.check_floating("bias", bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be [V_local] = [{weight.shape[0]}], got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias ({bias.dtype}) and weight ({weight.dtype}) must have the same dtype")
    _validate.check_chunk_size(chunk_size, allow_auto=True)
    if sequence_parallel and tp_group is None:
        raise ValueError("sequence_parallel=True needs the tp_group that the tokens are sharded over")
    expected = hidden.shape[:-1]
    if sequence_parallel:
        expected = torch.Size((world_size(tp_group) * hidden.shape[0], *hidden.shape[1:-1]))
    if labels is not None:
        _validate.check_labels(
            labels, expected, against="hidden (gathered over tp_group)" if sequence_parallel else "hidden"
        )
    flat = hidden.reshape(-1, hidden.shape[-1])
    if sequence_parallel:
        flat = _GatherRows.apply(flat, tp_group)
    spec = build_spec(
        weight.shape[0], labels, weight.device, temperature=temperature, ignore_index=ignore_index,
        vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start, fold_temperature=True, **outputs,
    )  # fmt: skip
    if chunk_size == "auto":
        chunk_size = auto_chunk_size(flat.shape[0], weight.shape[0], weight.device)
    plan = _FusedPlan(spec, 1.0 / temperature, chunk_size, tp_group, sequence_parallel)
    return flat, None if labels is None else labels.reshape(-1), plan, expected


class _GatherRows(torch.autograd.Function):
    """Sequence parallelism: gather token rows over TP in rank order; the backward sums each rank's
    partial gradient (it covers one vocabulary shard) and hands every rank its own rows."""

    @staticmethod
    def forward(ctx, rows, group):
        ctx.group = group
        return gather_rows(rows, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_rows(grad.contiguous(), ctx.group), None


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int | str | None = "auto",
    temperature: float = 1.0,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    tp_group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    sequence_parallel: bool = False,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`lmloss.token_logprobs` of ``hidden @ weight.T + bias``, without materializing the logits.

    Args:
        hidden: ``[..., H]`` fp32 / bf16 / fp16. With ``sequence_parallel=True``, this rank's block of
            tokens along dim 0; the op gathers the blocks over `tp_group` in rank order.
        weight: ``[V_local, H]``, same dtype: the LM head, a tied embedding, or this rank's vocab shard.
        labels: ``[...]`` global vocabulary ids, the (gathered) leading shape of `hidden`.
        bias: optional ``[V_local]``.
        chunk_size: tokens per chunk; ``"auto"`` sizes it from a memory budget (`auto_chunk_size`);
            None for one chunk.
        sequence_parallel: `hidden` is sharded along tokens over `tp_group`; its gradient is
            reduce-scattered back. Without it every TP rank holds the same `hidden` and receives the
            full (all-reduced) gradient.
        Other arguments as in `lmloss.token_logprobs`; `temperature` divides the logits inside the matmul.

    Returns:
        fp32 ``[...]`` log-probs (0.0 where ignored), or ``(logprobs, entropy)``; the same on every TP rank.
        Gradients flow to `hidden`, `weight` and `bias` for any per-token upstream gradients.
    """
    flat, flat_labels, plan, shape = _prepare(
        hidden, weight, labels, bias, chunk_size=chunk_size, temperature=temperature,
        ignore_index=ignore_index, vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start,
        sequence_parallel=sequence_parallel, logprobs=True, entropy=return_entropy,
    )  # fmt: skip
    outs = _LinearSoftmaxPerToken.apply(flat, weight, bias, flat_labels, plan)
    outs = tuple(o.view(shape) for o in outs)
    return outs if return_entropy else outs[0]


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
    vocab_size: int | None = None,
    tp_group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    sequence_parallel: bool = False,
    mean_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """`lmloss.cross_entropy` of ``hidden @ weight.T + bias``, without materializing the logits.

    Arguments as in `linear_token_logprobs` and `lmloss.cross_entropy` (``reduction``, ``label_smoothing``,
    ``z_loss``, ``mean_group``). With ``"sum"`` / ``"mean"`` and gradients enabled, the gradients are
    computed during the forward (3 matmuls in all instead of 4) and only scaled by the backward.
    """
    _validate.check_reduction(reduction)
    _validate.check_label_smoothing(label_smoothing)
    _validate.check_z_loss(z_loss)
    flat, flat_labels, plan, shape = _prepare(
        hidden, weight, labels, bias, chunk_size=chunk_size, temperature=temperature,
        ignore_index=ignore_index, vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start,
        sequence_parallel=sequence_parallel, loss=True, label_smoothing=label_smoothing, z_loss=z_loss,
    )  # fmt: skip
    if reduction == "none":
        (per_token,) = _LinearSoftmaxPerToken.apply(flat, weight, bias, flat_labels, plan)
        return per_token.view(shape)
    total = _LinearCrossEntropySum.apply(flat, weight, bias, flat_labels, plan, torch.is_grad_enabled())
    return reduce_loss(total, labels, ignore_index=ignore_index, reduction=reduction, mean_group=mean_group)
