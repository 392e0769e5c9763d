"""The policy objective fused into the LM head: `linear_policy_loss`, three matmuls for token-separable
objectives.

A token-separable objective's loss is ``sum_t w_t * L_t(lp_t, H_t)``: once a chunk's log-probs and
entropies are known (in the forward), so are ``dL/dlp`` and ``dL/dH`` for its tokens. The chunk loop
(`lmloss.plan`, the softmax objective with an upstream: `PolicyUpstream`) asks for them per chunk, turns
them into the gradient form's coefficients and hands the chunk's d-logits to the head's accumulators while
the logits are at hand (`lmloss.functions.SummedLoss`): no second pass, no recomputed logits. The
per-token derivative is taken by autograd of `Objective.per_token` on the chunk's ``[c]`` vectors (the
same code as `policy_loss`; negligible next to the ``[c, V]`` work). ``loss_mode="gspo"`` (one ratio per
sequence, not known until every chunk is done) falls back to `lmloss.linear_token_logprobs` +
`policy_loss` (the backward recomputes the logits).

Under the sampler's distribution (``top_k`` / ``top_p`` / ``min_p``, or a replayed ``support``) the
log-probs and entropies are those of the kept set, renormalised, and the gradient stays on the kept set;
a token whose label lies outside it (log-prob -inf: the trainer's truncation differs from the engine's)
is left out of the objective, with a warning: its term is 0, while the aggregation's denominators, fixed
by the caller's mask once per batch, still count it.
"""

from __future__ import annotations

import math

import torch

from lmloss import replay
from lmloss.functions import Op, PerTokenLoss, SummedLoss
from lmloss.fused import prepare
from lmloss.metrics import StatsTracker
from lmloss.objectives import SoftmaxObjective
from lmloss.rl.objectives import (
    Objective,
    PerToken,
    check_weights_or_mode,
    policy_loss,
    record_metrics,
    token_weights_of,
)
from lmloss.sampling import make_sampling, report_dropped
from lmloss.vocab_parallel import ProcessGroup

__all__ = ["linear_policy_loss"]


class PolicyUpstream:
    """The upstream of an RL objective for the chunk loop (`lmloss.objectives.Upstream`): per chunk,
    ``d(sum_t w_t L_t)/d lp`` and ``d/dH`` by autograd of `Objective.per_token` on the chunk's ``[c]``
    vectors, and each token's term ``w_t L_t`` (the loop keeps them; the loss is their float64 sum)."""

    def __init__(self, objective: Objective, x: PerToken) -> None:
        self.objective, self.x = objective, x

    def _terms(self, s, e, lp, ent, dropped) -> torch.Tensor:
        x = self.x
        mask = x.mask[s:e] if dropped is None else x.mask[s:e] & ~dropped
        if dropped is not None:  # outside the kept set: -inf, left out of the objective (and finite here)
            lp = torch.where(dropped, 0.0, lp)
        per_tok, _ = self.objective.per_token(
            lp, x.old_logprobs[s:e], x.advantages[s:e], mask,
            ref_logprobs=None if x.ref_logprobs is None else x.ref_logprobs[s:e], entropy=ent,
            rollout_is_weights=None if x.rollout_is_weights is None else x.rollout_is_weights[s:e],
            pg_mask=None if x.pg_mask is None else x.pg_mask[s:e],
        )  # fmt: skip
        return torch.where(mask, x.token_weights[s:e] * per_tok, 0.0)

    def __call__(self, s: int, e: int, stats: dict) -> tuple[dict, torch.Tensor]:
        with torch.enable_grad():
            lp = stats["logprobs"].detach().requires_grad_(True)
            ent = stats.get("entropy")
            ent = None if ent is None else ent.detach().requires_grad_(True)
            terms = self._terms(s, e, lp, ent, stats.get("dropped"))
            inputs = [lp] if ent is None else [lp, ent]
            grads = torch.autograd.grad(terms.sum(), inputs, allow_unused=True)
        g_lp = grads[0] if grads[0] is not None else torch.zeros_like(lp)
        g_h = grads[1] if ent is not None and len(grads) > 1 else None
        return {"logprobs": g_lp.detach(), "entropy": None if g_h is None else g_h.detach()}, terms.detach()

    def evaluate(self, results: dict) -> torch.Tensor:
        """The objective over all tokens at once (no gradient was made chunk by chunk), float64."""
        lp = results["logprobs"]
        return self._terms(0, lp.shape[0], lp, results.get("entropy"), results.get("dropped")).double().sum()

    def finish_total(self, total: torch.Tensor, results: dict) -> torch.Tensor:
        return total.to(torch.promote_types(results["logprobs"].dtype, self.x.token_weights.dtype))

    def extra_outputs(self, results: dict) -> tuple[torch.Tensor, ...]:
        ent = results.get("entropy")
        return (results["logprobs"],) if ent is None else (results["logprobs"], ent)


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
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    support: torch.Tensor | None = None,
    pg_mask: torch.Tensor | None = None,
    cov_selection: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
    dro_beta: float | None = None,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    kl_importance_weighted: bool = False,
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
        pg_mask, cov_selection, generator and the objectives' own options (`tau_pos`, `tau_neg`,
            `clip_cov_*`, `kl_cov_ratio`, `ppo_kl_coef`, `dro_beta`, `vespo_*`, `kl_importance_weighted`): as
            in `policy_loss`.
        top_k, top_p, min_p, support: the sampler's distribution (as in `lmloss.linear_token_logprobs`):
            the objective runs on the kept set's renormalised log-probs and entropies, its gradient stays
            on the kept set; tokens whose label lies outside it are left out of the objective (warned).
        Under `tp_group` every rank must pass the same options and per-token tensors: they are agreed in
        the op's one rank-agreement gather (a rank that differs raises on every rank).

    Returns:
        ``(loss, metrics)`` as `policy_loss`'s, the same on every TP rank. For the token-separable loss modes
        the gradients are computed in the forward (3 matmuls; the backward only scales them); the sequence
        objectives (gspo, geo_mean, vespo) and the covariance selections (clip_cov, kl_cov) need every
        token's log-prob first: `linear_token_logprobs`' two passes, then `policy_loss`.
    """
    with_entropy = entropy_coeff != 0.0
    state: dict = {}
    extra = dict(
        tau_pos=tau_pos, tau_neg=tau_neg, clip_cov_ratio=clip_cov_ratio, clip_cov_lb=clip_cov_lb,
        clip_cov_ub=clip_cov_ub, kl_cov_ratio=kl_cov_ratio, ppo_kl_coef=ppo_kl_coef, dro_beta=dro_beta,
        vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg, kl_importance_weighted=kl_importance_weighted,
    )  # fmt: skip

    def checks(expected):
        objective = Objective.make(
            loss_mode=loss_mode, clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, kl_loss_type=kl_loss_type,
            kl_loss_coef=kl_loss_coef, entropy_coeff=entropy_coeff, **extra,
        )  # fmt: skip
        if kl_loss_coef != 0.0 and ref_logprobs is None:
            raise ValueError("kl_loss_coef != 0 needs ref_logprobs (the reference policy's log-probs)")
        check_weights_or_mode(token_weights, loss_agg_mode)
        mask = labels.reshape(expected) != ignore_index
        x = PerToken(
            expected, mask, old_logprobs, advantages, ref_logprobs, None, rollout_is_weights, token_weights,
            pg_mask=pg_mask, cov_selection=cov_selection,
        )  # fmt: skip
        if x.token_weights is None:
            x.token_weights = token_weights_of(x.mask.view(expected), loss_agg_mode, cu_seqlens, horizon,
                                               x.advantages.dtype).reshape(-1)  # fmt: skip
        state.update(objective=objective, x=x, mask=mask)
        n = math.prod(expected)
        out = {
            "options": dict(
                loss_mode=loss_mode, clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low,
                clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode,
                kl_loss_type=kl_loss_type, kl_loss_coef=kl_loss_coef, entropy_coeff=entropy_coeff, horizon=horizon,
                **extra,
            ),
            "tensors": dict(
                advantages=x.advantages, old_logprobs=x.old_logprobs, ref_logprobs=x.ref_logprobs,
                rollout_is_weights=x.rollout_is_weights, token_weights=x.token_weights, pg_mask=x.pg_mask,
                cov_selection=x.cov_selection,
            ),
        }  # fmt: skip
        if support is not None:
            state["support"] = replay.check_arguments(support, n, hidden.device, vocab_size, (top_k, top_p, min_p), False)
            out["support"] = state["support"]
        else:
            out["sampling"] = make_sampling(top_k, top_p, min_p, n_tokens=n, device=hidden.device)
        return out

    p = prepare(
        hidden, weight, labels, bias, chunk_size=chunk_size, temperature=temperature, softcap=softcap,
        ignore_index=ignore_index, vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start,
        sequence_parallel=sequence_parallel, weight_grad_dtype=weight_grad_dtype, impl=impl,
        outputs=("logprobs", "entropy") if with_entropy else ("logprobs",), checks=checks, agree={"op": 4},
    )  # fmt: skip
    objective, x, mask = state["objective"], state["x"], state["mask"]
    truncated = p.plan.sampling is not None or support is not None

    def op_with(**kw) -> Op:
        if support is None:
            return Op(p.plan, p.head, SoftmaxObjective(p.plan, p.labels, **kw))
        return replay.op_over_slots(p.plan, p.head, (p.flat, weight, bias), p.labels, state["support"], False, **kw)

    if not objective.token_separable:  # sequences, selections: every token's log-prob first; two passes
        outs = PerTokenLoss.apply(op_with(), p.flat, weight, bias)
        lp = outs[0].view(p.shape)
        ent = outs[1].view(p.shape) if with_entropy else None
        if truncated:
            report_dropped(lp, p.labels.view(p.shape), ignore_index)
            mask = mask & ~torch.isneginf(lp)
            lp = torch.where(mask, lp, 0.0)
        return policy_loss(
            lp, old_logprobs, advantages, mask, loss_mode=loss_mode, clip_ratio=clip_ratio,
            clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, loss_agg_mode=loss_agg_mode,
            token_weights=token_weights, cu_seqlens=cu_seqlens, sequence_ids=sequence_ids, cp_group=cp_group,
            horizon=horizon, ref_logprobs=ref_logprobs, kl_loss_type=kl_loss_type, kl_loss_coef=kl_loss_coef,
            entropy=ent, entropy_coeff=entropy_coeff, rollout_is_weights=rollout_is_weights, tracker=tracker,
            pg_mask=pg_mask, cov_selection=cov_selection, generator=generator, **extra,
        )  # fmt: skip
    upstream = PolicyUpstream(objective, x)
    outs = SummedLoss.apply(op_with(upstream=upstream), torch.is_grad_enabled(), None, p.flat, weight, bias)
    loss, lp = outs[0], outs[1]
    ent = outs[2] if with_entropy else None
    metrics_mask = x.mask
    if truncated:
        report_dropped(lp.view(p.shape), p.labels.view(p.shape), ignore_index)
        metrics_mask = x.mask & ~torch.isneginf(lp)
        lp = torch.where(metrics_mask, lp, 0.0)
    metrics_entropy = None if ent is None else torch.where(metrics_mask, ent, 0.0)
    _, parts = objective.per_token(
        lp, x.old_logprobs, x.advantages, metrics_mask, ref_logprobs=x.ref_logprobs, entropy=metrics_entropy,
        rollout_is_weights=x.rollout_is_weights, pg_mask=x.pg_mask,
    )  # fmt: skip
    return loss, record_metrics(parts, metrics_mask, x.token_weights, metrics_entropy, tracker)
