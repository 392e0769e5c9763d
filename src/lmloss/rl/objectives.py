"""RL policy objectives on per-token tensors, with verl's names and semantics.

`policy_loss` is the actor's whole loss, ``sum_t w_t * (pg_t + kl_loss_coef * kl_t - entropy_coeff * H_t)``
with the weights ``w`` of `lmloss.rl.token_weights` (equal to verl's ``pg - entropy_coeff * agg(entropy) +
kl_loss_coef * agg(kl)``, since every ``agg_loss`` mode is linear in its per-token values). The per-token
math lives in `Objective.per_token`, the one implementation that both `policy_loss` and the fused
`lmloss.rl.linear_policy_loss` run (the latter differentiates it per chunk in the forward).

Masked positions are replaced by 0 *before* any arithmetic (``torch.where``), so NaN / inf there never
reach the loss or the gradient: a masked token gets exactly 0 gradient.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from lmloss.metrics import StatsTracker
from lmloss.rl.aggregation import check_mask, sequence_index, token_weights
from lmloss.vocab_parallel import ProcessGroup

LOSS_MODES = ("vanilla", "gspo", "cispo", "reinforce")
#: the KL estimators (``"kl"`` = ``"k1"``, ``"mse"`` = ``"k2"``, ``"low_var_kl"`` = ``"k3"``, verl's aliases)
#: and their straight-through ``"+"`` variants (value of the estimator, gradient of k2).
KL_TYPES = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
KL_LOSS_TYPES = KL_TYPES + tuple(f"{k}+" for k in KL_TYPES)
#: verl's clamps: the log-ratio before exp (PPO, CISPO, k3), k3's value, GSPO's sequence log-ratio.
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0
GSPO_LOG_RATIO_MAX = 10.0

__all__ = ["KL_LOSS_TYPES", "LOSS_MODES", "Objective", "kl_estimate", "policy_loss"]


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_loss_type: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from the sampled tokens' log-probs (Schulman's k1 / k2 / k3).

    ``k1 = lp - ref``; ``abs = |lp - ref|``; ``k2 = (lp - ref)^2 / 2``; ``k3 = exp(ref - lp) - (ref - lp) - 1``
    with ``ref - lp`` clamped to +-20 and the result to +-10 (verl's clamps). ``"<type>+"``: the value of
    ``<type>``, the gradient of k2 (straight-through; unbiased KL gradient).
    """
    if kl_loss_type not in KL_LOSS_TYPES:
        raise ValueError(f"kl_loss_type must be one of {KL_LOSS_TYPES}, got {kl_loss_type!r}")
    base = kl_loss_type.rstrip("+")
    diff = logprobs - ref_logprobs
    if base in ("k1", "kl"):
        value = diff
    elif base == "abs":
        value = diff.abs()
    elif base in ("k2", "mse"):
        value = 0.5 * diff.square()
    else:
        log_r = (-diff).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        value = (log_r.exp() - log_r - 1.0).clamp(-K3_CLAMP, K3_CLAMP)
    if kl_loss_type.endswith("+") and base not in ("k2", "mse"):
        surrogate = 0.5 * diff.square()
        value = surrogate - surrogate.detach() + value.detach()
    return value


def _check_clip(name: str, v: object, *, above: float = 0.0) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= above:
        raise ValueError(f"{name} must be a finite number > {above}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Objective:
    """The options of one policy objective, checked (`Objective.make`)."""

    loss_mode: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = None
    kl_loss_type: str = "low_var_kl"
    kl_loss_coef: float = 0.0
    entropy_coeff: float = 0.0

    @classmethod
    def make(
        cls, *, loss_mode, clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c, kl_loss_type, kl_loss_coef,
        entropy_coeff,
    ) -> Objective:  # fmt: skip
        if loss_mode not in LOSS_MODES:
            raise ValueError(f"loss_mode must be one of {LOSS_MODES}, got {loss_mode!r}")
        _check_clip("clip_ratio", clip_ratio)
        low = clip_ratio if clip_ratio_low is None else clip_ratio_low
        high = clip_ratio if clip_ratio_high is None else clip_ratio_high
        _check_clip("clip_ratio_low", low)
        _check_clip("clip_ratio_high", high)
        if clip_ratio_c is not None:
            _check_clip("clip_ratio_c", clip_ratio_c, above=1.0)
            if loss_mode != "vanilla":
                raise ValueError(f"clip_ratio_c (dual clip) is for loss_mode='vanilla', not {loss_mode!r}")
        if kl_loss_type not in KL_LOSS_TYPES:
            raise ValueError(f"kl_loss_type must be one of {KL_LOSS_TYPES}, got {kl_loss_type!r}")
        for name, v in (("kl_loss_coef", kl_loss_coef), ("entropy_coeff", entropy_coeff)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        return cls(loss_mode, float(low), float(high), None if clip_ratio_c is None else float(clip_ratio_c),
                   kl_loss_type, float(kl_loss_coef), float(entropy_coeff))  # fmt: skip

    @property
    def token_separable(self) -> bool:
        """Whether each token's loss depends on that token's log-prob and entropy alone (not gspo)."""
        return self.loss_mode != "gspo"

    def per_token(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        ref_logprobs: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        rollout_is_weights: torch.Tensor | None = None,
        seq_log_ratio: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token loss ``pg + kl_loss_coef * kl - entropy_coeff * H`` (0 where not `mask`) and its parts.

        All tensors share one shape; inputs are already 0 where `mask` is False. `seq_log_ratio` (gspo):
        each token's sequence's mean log-ratio (detached). Returns ``(loss, parts)`` with parts ``pg``,
        ``kl`` (if used), ``ratio``, ``clipped``, ``clipped_lower`` (bool), ``log_ratio`` (``lp - old``).
        """
        log_ratio = logprobs - old_logprobs
        a = advantages
        parts: dict[str, torch.Tensor] = {"log_ratio": log_ratio.detach()}
        if self.loss_mode == "reinforce":
            pg = -a * logprobs
            ratio = log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
            clipped = torch.zeros_like(mask)
            clipped_lower = clipped
        elif self.loss_mode == "gspo":
            assert seq_log_ratio is not None
            log_r = (logprobs - logprobs.detach() + seq_log_ratio).clamp(max=GSPO_LOG_RATIO_MAX)
            ratio = log_r.exp()
            l1 = -a * ratio
            l2 = -a * ratio.clamp(1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high)
            pg = torch.maximum(l1, l2)
            clipped, clipped_lower = l2 > l1, torch.zeros_like(mask)
        else:
            ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
            clipped_ratio = ratio.clamp(1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high)
            if self.loss_mode == "cispo":  # the clipped ratio is a stop-gradient weight on log pi
                pg = -clipped_ratio.detach() * a * logprobs
                clipped, clipped_lower = ratio != clipped_ratio, torch.zeros_like(mask)
            else:
                l1, l2 = -a * ratio, -a * clipped_ratio
                pg = torch.maximum(l1, l2)
                clipped, clipped_lower = l2 > l1, torch.zeros_like(mask)
                if self.clip_ratio_c is not None:  # dual clip: negative advantages bounded by c * |A|
                    l3 = -a * self.clip_ratio_c
                    clipped_lower = (pg > l3) & (a < 0)
                    pg = torch.where(a < 0, torch.minimum(l3, pg), pg)
        if rollout_is_weights is not None:
            pg = pg * rollout_is_weights
        loss = pg
        parts.update(pg=pg.detach(), ratio=ratio.detach(), clipped=clipped, clipped_lower=clipped_lower)
        if ref_logprobs is not None:
            kl = kl_estimate(logprobs, ref_logprobs, self.kl_loss_type)
            parts["kl"] = kl.detach()
            loss = loss + self.kl_loss_coef * kl
        if entropy is not None and self.entropy_coeff != 0.0:
            loss = loss - self.entropy_coeff * entropy
        return torch.where(mask, loss, 0.0), parts


def _masked(mask: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` with masked positions replaced by 0 before any arithmetic (NaN / inf there must not leak)."""
    return None if t is None else torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device))


def check_per_token(name: str, t: object, shape: torch.Size) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} (the log-probs')")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {t.dtype}")
    return t


class PerToken:
    """The checked, masked per-token inputs of one call, flattened to ``[N]``."""

    def __init__(
        self, shape, mask, old_logprobs, advantages, ref_logprobs, entropy, rollout_is_weights, weights
    ):
        self.shape = shape
        self.mask = check_mask(mask, shape).reshape(-1)
        named = dict(old_logprobs=old_logprobs, advantages=advantages, ref_logprobs=ref_logprobs,
                     entropy=entropy, rollout_is_weights=rollout_is_weights, token_weights=weights)  # fmt: skip
        for k, v in named.items():
            if v is not None:
                v = check_per_token(k, v, shape).reshape(-1)
                if k == "rollout_is_weights":
                    v = v.detach()  # IS weights change the measure, not the objective
                setattr(self, k, _masked(self.mask, v))
            else:
                setattr(self, k, None)


class _AllReduceSum(torch.autograd.Function):
    """SUM over `group`; the backward sums the gradients over it too (each rank's input feeds every
    rank's output)."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _seq_log_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor, n_seq: int, cp_group: ProcessGroup | None
) -> torch.Tensor:
    """gspo: each token's sequence mean of ``lp - old`` over valid tokens ``[N]``, detached.

    Under CP each rank holds part of every sequence: the per-sequence (sum, count) are summed over
    `cp_group` (a differentiable all-reduce, so the sum's gradient reaches every rank's tokens) before
    dividing.
    """
    sums = torch.zeros((n_seq, 2), dtype=log_ratio.dtype, device=log_ratio.device)
    sums = sums.index_add(
        0, seq, torch.stack([torch.where(mask, log_ratio, 0.0), mask.to(log_ratio.dtype)], 1)
    )
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        sums = _AllReduceSum.apply(sums, cp_group)
    per_seq = sums[:, 0] / sums[:, 1].clamp(min=1.0)
    return per_seq[seq].detach()


def record_metrics(
    parts: dict[str, torch.Tensor],
    mask: torch.Tensor,
    w: torch.Tensor,
    entropy: torch.Tensor | None,
    tracker: StatsTracker | None,
) -> dict[str, torch.Tensor]:
    """Masked statistics of one call as detached 0-d tensors, and into `tracker` as sums and counts.

    ``pg_loss`` / ``kl_loss`` / ``entropy_loss``: this call's share of each loss term (``sum w * x``:
    shares add up over ranks and micro-batches; the tracker records them with ``reduce="sum"``). Means over
    valid tokens: ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl`` (``mean(old - lp)``), ``ratio_mean``,
    ``entropy``; extremes ``ratio_max`` / ``ratio_min``. The tracker's ``export()`` divides after its
    all-reduce, so the means do not depend on the DP / CP / micro-batch split. The tracker's denominator
    is ``"policy_tokens"`` (the valid tokens, also exported), apart from a caller's own ``"n_valid_tokens"``.
    """
    n = mask.sum(dtype=torch.float64)
    f64 = {k: v.double() for k, v in parts.items()}

    def mean(x):
        return torch.where(mask, x.double(), 0.0).sum() / n.clamp(min=1.0)

    means = {
        "pg_clipfrac": f64["clipped"], "pg_clipfrac_lower": f64["clipped_lower"], "ppo_kl": -f64["log_ratio"],
        "ratio_mean": f64["ratio"],
    }  # fmt: skip
    if entropy is not None:
        means["entropy"] = entropy.detach()
    shares = {"pg_loss": (w * parts["pg"]).sum().detach()}
    if "kl" in parts:
        shares["kl_loss"] = (w * parts["kl"]).sum().detach()
    if entropy is not None:
        shares["entropy_loss"] = (w * entropy.detach()).sum()
    ratio = f64["ratio"]
    extremes = {
        "ratio_max": torch.where(mask, ratio, -math.inf).amax() if mask.numel() else torch.tensor(-math.inf),
        "ratio_min": torch.where(mask, ratio, math.inf).amin() if mask.numel() else torch.tensor(math.inf),
    }
    out = {**shares, **{k: mean(v) for k, v in means.items()}, **extremes}
    if tracker is not None:
        tracker.denominator("policy_tokens", mask)
        for k, v in means.items():
            tracker.stat(k, v, denominator="policy_tokens")
        for k, v in shares.items():
            tracker.scalar(k, v, reduce="sum")
        tracker.scalar("ratio_max", extremes["ratio_max"], reduce="max")
        tracker.scalar("ratio_min", extremes["ratio_min"], reduce="min")
    return out


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
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
    entropy: torch.Tensor | None = None,
    entropy_coeff: float = 0.0,
    rollout_is_weights: torch.Tensor | None = None,
    tracker: StatsTracker | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's policy loss, verl's ``policy_loss`` + entropy bonus + KL loss, as one scalar.

    Args:
        logprobs: ``[B, T]`` (one sequence per row) or ``[N]`` packed tokens, the current policy's
            log-probs of the sampled tokens (differentiable; e.g. `lmloss.token_logprobs`).
        old_logprobs, advantages: same shape (old: the behaviour policy's log-probs; for
            ``"reinforce"`` only the ``ppo_kl`` metric reads them).
        mask: bool / 0-1, same shape: which tokens count (verl's ``response_mask``).
        loss_mode: ``"vanilla"`` (PPO clip, asymmetric ``clip_ratio_low/high``, dual clip with
            `clip_ratio_c`), ``"gspo"`` (sequence-level ratio, GSPO paper), ``"cispo"`` (stop-gradient
            clipped IS weight on log pi), ``"reinforce"`` (``-A * log pi``).
        clip_ratio, clip_ratio_low, clip_ratio_high: verl's; low/high default to `clip_ratio`.
        clip_ratio_c: dual-clip bound (> 1), vanilla only; None: no dual clip (verl applies 3.0 always).
        loss_agg_mode: how tokens are weighted (`lmloss.rl.token_weights`), when `token_weights` is None.
            Without `token_weights` the batch is taken as the whole global batch (one process).
        token_weights: precomputed per-token weights (same shape) from `lmloss.rl.token_weights` on the
            global batch, split like the other tensors: the loss is ``sum(w * per_token_loss)``, this
            rank's share of the global loss. Then `loss_agg_mode` is not used.
        cu_seqlens: int ``[S + 1]`` for packed tokens (sequence boundaries, ending at N).
        sequence_ids, cp_group: gspo under context parallelism: each local token's sequence (e.g.
            ``split_batch(...)["sequence_ids"]``) and the group that splits sequences; the per-sequence
            log-ratio sums are all-reduced over it so a split sequence gets one ratio.
        horizon: the constant of ``"seq-mean-token-sum-norm"`` (default ``T`` for rows).
        ref_logprobs, kl_loss_type, kl_loss_coef: KL-to-reference term (`kl_estimate`), added with weight
            `kl_loss_coef` (needs `ref_logprobs` when the coefficient is not 0).
        entropy, entropy_coeff: entropy bonus, ``- entropy_coeff * H`` per token (needs `entropy` when the
            coefficient is not 0; differentiable).
        rollout_is_weights: per-token rollout-correction IS weights (detached; `lmloss.rl.rollout`),
            multiplying the policy-gradient term.
        tracker: a `lmloss.StatsTracker` to record the metrics into (global, CP-invariant after
            ``export()``).

    Returns:
        ``(loss, metrics)``: the 0-d loss in the log-probs' dtype (or the weights' if wider), and the
        metrics of this call (`record_metrics`), detached 0-d tensors (no host sync).

    Masked positions contribute nothing, even NaN / inf there: their gradient is exactly 0.
    """
    check_per_token("logprobs", logprobs, logprobs.shape if isinstance(logprobs, torch.Tensor) else None)
    shape = logprobs.shape
    objective = Objective.make(
        loss_mode=loss_mode, clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c, kl_loss_type=kl_loss_type, kl_loss_coef=kl_loss_coef, entropy_coeff=entropy_coeff,
    )  # fmt: skip
    if kl_loss_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_loss_coef != 0 needs ref_logprobs (the reference policy's log-probs)")
    if entropy_coeff != 0.0 and entropy is None:
        raise ValueError("entropy_coeff != 0 needs entropy (per-token entropies, e.g. return_entropy=True)")
    x = PerToken(
        shape, mask, old_logprobs, advantages, ref_logprobs, entropy, rollout_is_weights, token_weights
    )
    if cu_seqlens is not None:  # checked whether or not a mode reads it: wrong boundaries are a bug upstream
        if len(shape) != 1:
            raise ValueError(f"cu_seqlens is for packed 1-D tokens; logprobs have shape {tuple(shape)}")
        if sequence_ids is None:
            sequence_index(shape, logprobs.device, cu_seqlens=cu_seqlens, need="cu_seqlens")
    if x.token_weights is None:
        w = token_weights_of(x.mask.view(shape), loss_agg_mode, cu_seqlens, horizon, logprobs.dtype)
    else:
        w = x.token_weights
    lp = _masked(x.mask, logprobs.reshape(-1))
    seq_ratio = None
    if objective.loss_mode == "gspo":
        seq, n_seq = sequence_index(
            shape, lp.device, cu_seqlens=cu_seqlens, sequence_ids=sequence_ids, need="loss_mode='gspo'"
        )
        seq_ratio = _seq_log_ratio(lp - x.old_logprobs, x.mask, seq, n_seq, cp_group)
    per_tok, parts = objective.per_token(
        lp, x.old_logprobs, x.advantages, x.mask, ref_logprobs=x.ref_logprobs, entropy=x.entropy,
        rollout_is_weights=x.rollout_is_weights, seq_log_ratio=seq_ratio,
    )  # fmt: skip
    loss = (w * per_tok).sum()
    return loss, record_metrics(parts, x.mask, w.detach(), x.entropy, tracker)


def token_weights_of(mask, loss_agg_mode, cu_seqlens, horizon, dtype) -> torch.Tensor:
    """`token_weights` of one batch (no group), flat, in at least `dtype`'s precision."""
    wdtype = torch.promote_types(dtype, torch.float32)
    return token_weights(mask, loss_agg_mode, cu_seqlens=cu_seqlens, horizon=horizon, dtype=wdtype).reshape(
        -1
    )
