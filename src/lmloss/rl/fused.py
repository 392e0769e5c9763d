"""The policy objective fused into the LM head: `linear_policy_loss`, three matmuls for token-separable
objectives.

A token-separable objective's loss is ``sum_t w_t * L_t(lp_t, H_t)``: once a chunk's log-probs and
entropies are known (in the forward), so are ``dL/dlp`` and ``dL/dH`` for its tokens. The chunk loop
(`lmloss.plan.forward_pass` with an ``upstream``) asks this module for them per chunk, turns them into
the gradient form's coefficients and hands the chunk's d-logits to the fused ops' accumulators while the
logits are at hand: no second pass, no recomputed logits. The per-token derivative is taken by autograd
of `Objective.per_token` on the chunk's ``[c]`` vectors (the same code as `policy_loss`; negligible next to
the ``[c, V]`` work). ``loss_mode="gspo"`` (one ratio per sequence, not known until every chunk is done)
falls back to `lmloss.linear_token_logprobs` + `policy_loss` (the backward recomputes the logits).
"""

from __future__ import annotations

import torch

from lmloss._autograd import once_differentiable
from lmloss.fused import _Accumulators, _HiddenRows, _pass_scratch, _prepare, linear_token_logprobs
from lmloss.metrics import StatsTracker
from lmloss.plan import LossPlan, forward_pass
from lmloss.rl.objectives import (
    Objective,
    PerToken,
    check_weights_or_mode,
    policy_loss,
    record_metrics,
    token_weights_of,
)
from lmloss.vocab_parallel import ProcessGroup

__all__ = ["linear_policy_loss"]


class _LinearPolicyLoss(torch.autograd.Function):
    """``sum_t w_t L_t`` over all tokens; gradients computed in the forward pass, scaled in backward.

    Outputs: the 0-d loss, and (non-differentiable) per-token log-probs and entropies for the metrics.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, plan: LossPlan, opts: dict, objective: Objective, x: PerToken,
                grad_enabled: bool):  # fmt: skip
        needs = tuple(n and grad_enabled for n in ctx.needs_input_grad[:3])
        scratch = _pass_scratch(plan, hidden)
        acc = _Accumulators(hidden, weight, bias, needs, scratch=scratch, **opts) if any(needs) else None
        total = torch.zeros((), dtype=torch.float64, device=hidden.device)

        def upstream(s, e, stats):
            nonlocal total
            with torch.enable_grad():
                lp = stats["logprobs"].detach().requires_grad_(True)
                ent = stats.get("entropy")
                ent = None if ent is None else ent.detach().requires_grad_(True)
                per_tok, _ = objective.per_token(
                    lp, x.old_logprobs[s:e], x.advantages[s:e], x.mask[s:e],
                    ref_logprobs=None if x.ref_logprobs is None else x.ref_logprobs[s:e], entropy=ent,
                    rollout_is_weights=None if x.rollout_is_weights is None else x.rollout_is_weights[s:e],
                )  # fmt: skip
                chunk_loss = (x.token_weights[s:e] * per_tok).sum()
                inputs = [lp] if ent is None else [lp, ent]
                grads = torch.autograd.grad(chunk_loss, inputs, allow_unused=True) if acc else (None, None)
            total = total + chunk_loss.detach().double()
            g_lp = grads[0] if grads[0] is not None else torch.zeros_like(lp)
            g_h = grads[1] if ent is not None and len(grads) > 1 else None
            return {"logprobs": g_lp.detach(), "entropy": None if g_h is None else g_h.detach()}

        source = _HiddenRows(hidden, weight, bias, scratch, opts["chunk_dtype"])
        results = forward_pass(
            plan, hidden.shape[0], source, labels, device=hidden.device, dtype=hidden.dtype, grad_sink=acc,
            upstream=upstream,
        )  # fmt: skip
        if acc is None:  # no gradients wanted: the loop above ran without a sink, compute the loss here
            upstream(0, hidden.shape[0], results)
        ctx.plan, ctx.acc = plan, acc
        ctx.save_for_backward(hidden, weight, bias)
        lp, ent = results["logprobs"], results.get("entropy")
        ctx.mark_non_differentiable(lp, *(() if ent is None else (ent,)))
        loss = total.to(torch.promote_types(lp.dtype, x.token_weights.dtype))
        return (loss, lp) if ent is None else (loss, lp, ent)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total, *_):
        hidden, weight, bias = ctx.saved_tensors
        if ctx.acc == "used":
            raise RuntimeError(
                "lmloss.rl.linear_policy_loss computes its gradients in the forward and hands them out once; "
                "for a second backward use linear_token_logprobs + policy_loss"
            )
        acc, ctx.acc = ctx.acc, "used"
        if acc is None or grad_total is None:
            return (None,) * 9
        grads = acc.finish(hidden, weight, bias, ctx.plan.tp_group, grad_total)
        return (*grads, None, None, None, None, None, None)


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    loss_mode: str = "vanilla",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    token_weights: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    cp_group: ProcessGroup | None = None,
    horizon: int | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_loss_type: str = "low_var_kl",
    kl_loss_coef: float = 0.0,
    entropy_coeff: float = 0.0,
    rollout_is_weights: torch.Tensor | None = None,
    tracker: StatsTracker | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    tp_group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    sequence_parallel: bool = False,
    chunk_size: int | str | None = "auto",
    weight_grad_dtype: torch.dtype = torch.float32,
    impl: str = "auto",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`lmloss.rl.policy_loss` of the log-probs of ``hidden @ weight.T + bias``, without the logits.

    Args:
        hidden, weight, bias, labels: as in `lmloss.linear_token_logprobs` (``[..., H]``, ``[V_local, H]``,
            ``[V_local]``, ``[...]``; with `sequence_parallel`, labels and every per-token tensor have the
            gathered shape). ``labels == ignore_index`` is the mask.
        old_logprobs, advantages, ref_logprobs, rollout_is_weights, token_weights: per-token, labels' shape.
        The policy options (`loss_mode`, clips, `loss_agg_mode`, KL, `entropy_coeff`, `tracker`, ...): as
        in `policy_loss`; the entropy is the LM head's own (at `temperature`), computed when
        ``entropy_coeff != 0``.
        The LM-head options (`temperature`, `softcap`, `tp_group`, `vocab_start`, `vocab_size`,
        `sequence_parallel`, `chunk_size`, `weight_grad_dtype`, `impl`): as in `lmloss.linear_cross_entropy`.

    Returns:
        ``(loss, metrics)`` as `policy_loss`'s, the same on every TP rank. For every loss mode but
        ``"gspo"`` the gradients are computed in the forward (3 matmuls; the backward only scales them,
        so it runs once per forward).
    """
    objective = Objective.make(
        loss_mode=loss_mode, clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c, kl_loss_type=kl_loss_type, kl_loss_coef=kl_loss_coef, entropy_coeff=entropy_coeff,
    )  # fmt: skip
    if kl_loss_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_loss_coef != 0 needs ref_logprobs (the reference policy's log-probs)")
    check_weights_or_mode(token_weights, loss_agg_mode)
    head = dict(
        bias=bias, chunk_size=chunk_size, temperature=temperature, softcap=softcap, ignore_index=ignore_index,
        vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start, sequence_parallel=sequence_parallel,
        weight_grad_dtype=weight_grad_dtype, impl=impl,
    )  # fmt: skip
    with_entropy = entropy_coeff != 0.0
    if not objective.token_separable:  # gspo: the ratio needs whole sequences first; two passes
        out = linear_token_logprobs(hidden, weight, labels, return_entropy=with_entropy, **head)
        lp, ent = out if with_entropy else (out, None)
        return policy_loss(
            lp, old_logprobs, advantages, labels != ignore_index, loss_mode=loss_mode, clip_ratio=clip_ratio,
            clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, loss_agg_mode=loss_agg_mode,
            token_weights=token_weights, cu_seqlens=cu_seqlens, sequence_ids=sequence_ids, cp_group=cp_group,
            horizon=horizon, ref_logprobs=ref_logprobs, kl_loss_type=kl_loss_type, kl_loss_coef=kl_loss_coef,
            entropy=ent, entropy_coeff=entropy_coeff, rollout_is_weights=rollout_is_weights, tracker=tracker,
        )  # fmt: skip
    head.pop("bias")
    flat, flat_labels, plan, opts, shape = _prepare(
        hidden,
        weight,
        labels,
        bias,
        outputs=("logprobs", "entropy") if with_entropy else ("logprobs",),
        **head,
    )
    mask = flat_labels.view(shape) != ignore_index
    x = PerToken(shape, mask, old_logprobs, advantages, ref_logprobs, None, rollout_is_weights, token_weights)
    if x.token_weights is None:
        x.token_weights = token_weights_of(mask, loss_agg_mode, cu_seqlens, horizon, x.advantages.dtype)
    outs = _LinearPolicyLoss.apply(
        flat, weight, bias, flat_labels, plan, opts, objective, x, torch.is_grad_enabled()
    )
    loss, lp = outs[0], outs[1]
    ent = outs[2] if with_entropy else None
    _, parts = objective.per_token(
        lp, x.old_logprobs, x.advantages, x.mask, ref_logprobs=x.ref_logprobs,
        entropy=None if ent is None else torch.where(x.mask, ent, 0.0), rollout_is_weights=x.rollout_is_weights,
    )  # fmt: skip
    metrics_entropy = None if ent is None else torch.where(x.mask, ent, 0.0)
    return loss, record_metrics(parts, x.mask, x.token_weights, metrics_entropy, tracker)
