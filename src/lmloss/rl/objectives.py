"""RL policy objectives on per-token tensors, with verl's names and semantics (and TRL's where verl has none).

`policy_loss` is the actor's whole loss, ``sum_t w_t * (pg_t + kl_loss_coef * kl_t - entropy_coeff * H_t)``
with the weights ``w`` of `lmloss.rl.token_weights` (equal to verl's ``pg - entropy_coeff * agg(entropy) +
kl_loss_coef * agg(kl)``, since every ``agg_loss`` mode is linear in its per-token values). The per-token
math lives in `Objective.per_token`, the one implementation that both `policy_loss` and the fused
`lmloss.rl.linear_policy_loss` run (the latter differentiates it per chunk in the forward).

Every policy loss verl 0.9.1 registers (``POLICY_LOSS_REGISTRY``: ``vanilla``, ``dppo_tv``, ``dppo_kl``,
``gspo``, ``sapo``, ``gpg``, ``clip_cov``, ``kl_cov``, ``geo_mean``, ``dro``, ``cispo``; ``bypass_mode`` is a
composition, docs/rl.md), verl's ``reinforce`` and TRL 1.16's ``vespo`` are a `loss_mode`. Objectives of a
whole sequence (``gspo``, ``geo_mean``, ``vespo``) sum per-sequence columns first (`Objective.
sequence_columns`; all-reduced over `cp_group` when a sequence is split over CP ranks); ``clip_cov`` /
``kl_cov`` read a token selection made from batch statistics (`covariance_selection`, computed once per
step over the DP group, or over the call's tokens when not given).

Masked positions are replaced by 0 *before* any arithmetic (``torch.where``), so NaN / inf there never
reach the loss or the gradient: a masked token gets exactly 0 gradient.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
import torch.distributed as dist

from lmloss._validate import check_group
from lmloss.agreement import agree_over_group
from lmloss.metrics import StatsTracker
from lmloss.packing import as_cu_seqlens
from lmloss.rl.aggregation import (
    DTYPE_CODES,
    check_ids,
    check_mask,
    check_packed_cu_seqlens,
    count_with_eps,
    group_size,
    sequence_index,
    sequence_sums,
    token_weights_with_mask_dtype,
)
from lmloss.vocab_parallel import ProcessGroup

#: verl 0.9.1's registered policy losses (but ``bypass_mode``, a composition), verl's ``reinforce`` and
#: TRL's ``vespo``.
LOSS_MODES = (
    "vanilla", "gspo", "cispo", "reinforce", "gpg", "dppo_tv", "dppo_kl", "sapo", "clip_cov", "kl_cov",
    "geo_mean", "dro", "vespo",
)  # fmt: skip
#: Objectives of a whole sequence: the per-sequence sums come before the per-token loss.
SEQUENCE_MODES = ("gspo", "geo_mean", "vespo")
#: Objectives that read a token selection from batch statistics (`covariance_selection`).
SELECTION_MODES = ("clip_cov", "kl_cov")
#: The KL estimators (``"kl"`` = ``"k1"``, ``"mse"`` = ``"k2"``, ``"low_var_kl"`` = ``"k3"``, verl's aliases)
#: and their straight-through ``"+"`` variants (value of the estimator, gradient of k2).
KL_TYPES = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
KL_LOSS_TYPES = KL_TYPES + tuple(f"{k}+" for k in KL_TYPES)
#: verl's clamps: the log-ratio before exp (PPO, CISPO, SAPO, DPPO, k3), k3's value, GSPO's sequence log-ratio.
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0
GSPO_LOG_RATIO_MAX = 10.0
#: TRL's VESPO bounds the sequence log-weight below by log(1e-8) (and above by 20).
VESPO_LOG_W_MIN = math.log(1e-8)
#: The options of the objectives beyond PPO's clips, verl's (``actor.*``, ``actor.policy_loss.*``) and TRL's
#: (``GRPOConfig.vespo_*``) names and defaults.
OPTION_DEFAULTS = dict(
    tau_pos=1.0, tau_neg=1.05, clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0, kl_cov_ratio=0.0002,
    ppo_kl_coef=0.1, dro_beta=None, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
    kl_importance_weighted=False,
)  # fmt: skip
#: The per-token inputs that are constants of the objective: a differentiable one is refused (its
#: gradient would be silently wrong: ``policy_loss(lp, lp, ...)`` gives exactly zero gradients).
CONSTANT_INPUTS = ("old_logprobs", "advantages", "ref_logprobs", "rollout_is_weights", "token_weights")

__all__ = [
    "KL_LOSS_TYPES",
    "LOSS_MODES",
    "Objective",
    "covariance_selection",
    "high_entropy_mask",
    "kl_estimate",
    "objective_loss",
    "off_policy_sequence_mask",
    "policy_loss",
]


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


def _is_number(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _check_clip(name: str, v: object, *, above: float = 0.0) -> None:
    if not _is_number(v) or v <= above:
        raise ValueError(f"{name} must be a finite number > {above}, got {v!r}")


def _check_fraction(name: str, v: object) -> None:
    if not _is_number(v) or not 0 < v <= 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {v!r}")


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
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    kl_importance_weighted: bool = False

    @classmethod
    def make(
        cls, *, loss_mode, clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c, kl_loss_type, kl_loss_coef,
        entropy_coeff, **options,
    ) -> Objective:  # fmt: skip
        """Check the options; `options` are those of `OPTION_DEFAULTS` (missing ones take the default)."""
        if loss_mode not in LOSS_MODES:
            raise ValueError(f"loss_mode must be one of {LOSS_MODES}, got {loss_mode!r}")
        unknown = set(options) - set(OPTION_DEFAULTS)
        if unknown:
            raise TypeError(f"unknown objective options {sorted(unknown)}; known: {sorted(OPTION_DEFAULTS)}")
        opts = {**OPTION_DEFAULTS, **options}
        _check_clip("clip_ratio", clip_ratio)
        low = clip_ratio if clip_ratio_low is None else clip_ratio_low
        high = clip_ratio if clip_ratio_high is None else clip_ratio_high
        _check_clip("clip_ratio_low", low)
        _check_clip("clip_ratio_high", high)
        if clip_ratio_c is not None:
            if loss_mode == "vanilla":
                _check_clip("clip_ratio_c", clip_ratio_c, above=1.0)
            elif loss_mode in ("dppo_tv", "dppo_kl"):
                _check_clip("clip_ratio_c", clip_ratio_c)
            else:
                raise ValueError(
                    f"clip_ratio_c is the dual clip of loss_mode='vanilla' and the ratio cap of 'dppo_tv' / "
                    f"'dppo_kl', not an option of {loss_mode!r}"
                )
        if kl_loss_type not in KL_LOSS_TYPES + ("full",):
            raise ValueError(f"kl_loss_type must be one of {KL_LOSS_TYPES + ('full',)}, got {kl_loss_type!r}")
        for name, v in (("kl_loss_coef", kl_loss_coef), ("entropy_coeff", entropy_coeff)):
            if not _is_number(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        for name in ("tau_pos", "tau_neg"):
            _check_clip(name, opts[name])
        _check_fraction("clip_cov_ratio", opts["clip_cov_ratio"])
        _check_fraction("kl_cov_ratio", opts["kl_cov_ratio"])
        for name in ("clip_cov_lb", "clip_cov_ub", "ppo_kl_coef", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                     "vespo_lambda_neg"):  # fmt: skip
            if not _is_number(opts[name]):
                raise ValueError(f"{name} must be a finite number, got {opts[name]!r}")
        if not opts["clip_cov_lb"] < opts["clip_cov_ub"]:
            raise ValueError(
                f"clip_cov_lb ({opts['clip_cov_lb']}) must be below clip_cov_ub ({opts['clip_cov_ub']})"
            )
        if opts["dro_beta"] is not None:
            _check_clip("dro_beta", opts["dro_beta"])
        elif loss_mode == "dro":
            raise ValueError(
                "loss_mode='dro' needs dro_beta > 0 (verl's policy_loss.dro_beta has no default)"
            )
        if not isinstance(opts["kl_importance_weighted"], bool):
            raise TypeError(f"kl_importance_weighted must be a bool, got {opts['kl_importance_weighted']!r}")
        if opts["kl_importance_weighted"] and loss_mode in SEQUENCE_MODES:
            raise ValueError(
                f"kl_importance_weighted multiplies the KL by the token ratio; it is not defined for the sequence "
                f"objective {loss_mode!r}"
            )
        if opts["kl_importance_weighted"] and kl_loss_type == "full":
            raise ValueError(
                "kl_importance_weighted multiplies a sampled-token KL estimate by the token ratio; "
                "kl_loss_type='full' is the exact KL over the vocabulary (no estimate to weight): pass one"
            )
        floats = {k: v if v is None or isinstance(v, bool) else float(v) for k, v in opts.items()}
        return cls(loss_mode, float(low), float(high), None if clip_ratio_c is None else float(clip_ratio_c),
                   kl_loss_type, float(kl_loss_coef), float(entropy_coeff), **floats)  # fmt: skip

    def draws_selection(self, cov_selection: object) -> bool:
        """Whether the objective draws tokens at random (``clip_cov`` without a `cov_selection`)."""
        return self.loss_mode == "clip_cov" and cov_selection is None

    @property
    def token_separable(self) -> bool:
        """Whether each token's loss depends on that token's log-prob and entropy alone (and so can be
        differentiated chunk by chunk): not the sequence objectives nor the batch-statistic selections."""
        return self.loss_mode not in SEQUENCE_MODES + SELECTION_MODES

    def sequence_columns(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        rollout_is_weights: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """``[N, k]`` per-token values whose per-sequence sums `per_token` reads (``seq_sums``); None for
        token objectives. Zero where not `mask`; differentiable where the objective differentiates through
        the sequence (``geo_mean``)."""
        m = mask.to(logprobs.dtype)
        zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
        log_ratio = logprobs - old_logprobs
        if self.loss_mode == "gspo":  # mean log-ratio: sg[s] in the ratio
            cols = [torch.where(mask, log_ratio, zero).detach(), m]
        elif self.loss_mode == "geo_mean":  # the clipped log-ratio's mean is differentiated
            cols = [torch.where(mask, self._geo_log_ratio(log_ratio, advantages), zero), advantages, m]
            if rollout_is_weights is not None:  # a sequence's IS weight: the tokens' geometric mean
                cols.append(torch.where(mask, torch.log(rollout_is_weights + 1e-10), zero))
        elif self.loss_mode == "vespo":  # log w = sum log-ratio + sum log IS ratio (TRL's clamps)
            lr = torch.where(mask, log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), zero).detach()
            log_is = torch.zeros_like(lr)
            if rollout_is_weights is not None:
                log_is = torch.where(mask, torch.log(rollout_is_weights).clamp(VESPO_LOG_W_MIN, 20.0), zero)
            cols = [lr, log_is]
        else:
            return None
        return torch.stack([torch.where(mask, c, zero) for c in cols], dim=1)

    def _geo_log_ratio(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        """GMPO's token log-ratio clipped to ``[-low, high]`` on the side the advantage's sign points to."""
        sign = torch.sign(advantages)
        clipped = log_ratio.clamp(-self.clip_ratio_low, self.clip_ratio_high)
        return sign * torch.minimum(sign * log_ratio, sign * clipped)

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
        pg_mask: torch.Tensor | None = None,
        seq_sums: torch.Tensor | None = None,
        selected: torch.Tensor | None = None,
        kl: torch.Tensor | None = None,
        mask_dtype: torch.dtype = torch.bool,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token loss ``pg + kl_loss_coef * kl - entropy_coeff * H`` (0 where not `mask`) and its parts.
        `kl`: with ``kl_loss_type="full"``, each token's exact KL(pi || ref) over the vocabulary
        (differentiable; `full_kl`), in place of the estimate from `ref_logprobs`.

        All tensors share one shape; inputs are already 0 where `mask` is False. `seq_sums`: each token's
        sequence's sums of `sequence_columns` (sequence objectives). `selected`: the `covariance_selection`
        (``clip_cov``, ``kl_cov``). `pg_mask`: tokens whose policy term counts (bool). `mask_dtype`: the
        dtype of the mask the caller gave (`mask` is its bool), for verl's 1e-8 in ``geo_mean``'s sequence
        lengths (`lmloss.rl.aggregation.count_with_eps`). Returns ``(loss,
        parts)`` with parts ``pg``, ``kl`` (if used), ``ratio``, ``clipped``, ``clipped_lower`` (bool),
        ``log_ratio`` (``lp - old``).
        """
        mode, a = self.loss_mode, advantages
        log_ratio = logprobs - old_logprobs
        no = torch.zeros_like(mask)
        clipped, clipped_lower = no, no
        ratio = log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # the ratio metric

        def ppo_clip(r):
            l1, l2 = -a * r, -a * r.clamp(1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high)
            return torch.maximum(l1, l2), l2 > l1

        def const(v):
            return torch.as_tensor(v, dtype=a.dtype, device=a.device)

        if mode in ("reinforce", "gpg"):
            pg = -a * logprobs
        elif mode == "gspo":
            assert seq_sums is not None
            seq_mean = (seq_sums[:, 0] / seq_sums[:, 1].clamp(min=1.0)).detach()
            log_s = (logprobs - logprobs.detach() + seq_mean).clamp(max=GSPO_LOG_RATIO_MAX)
            pg, clipped = ppo_clip(log_s.exp())
            ratio = log_s.detach().exp()
        elif mode == "geo_mean":
            assert seq_sums is not None
            n = count_with_eps(seq_sums[:, 2], mask_dtype)  # verl: response_mask.sum(-1) + 1e-8
            pg = -(seq_sums[:, 1] / n) * torch.exp(seq_sums[:, 0] / n)
            if rollout_is_weights is not None:
                pg = pg * torch.exp(seq_sums[:, 3] / n)
            clipped = log_ratio != log_ratio.clamp(-self.clip_ratio_low, self.clip_ratio_high)
            clipped_lower = clipped & (a < 0)
            clipped = clipped & (a > 0)
        elif mode == "vespo":
            assert seq_sums is not None
            log_w = (seq_sums[:, 0] + seq_sums[:, 1]).clamp(VESPO_LOG_W_MIN, 20.0)
            nonneg = a >= 0
            k = torch.where(nonneg, const(self.vespo_k_pos), const(self.vespo_k_neg))
            lam = torch.where(nonneg, const(self.vespo_lambda_pos), const(self.vespo_lambda_neg)).clamp(
                min=1e-4
            )
            phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
            pg = -phi.detach() * a * logprobs
        elif mode in ("dppo_tv", "dppo_kl"):
            r = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
            capped = (r if self.clip_ratio_c is None else r.clamp(max=self.clip_ratio_c)).detach()
            p, p_old = logprobs.exp(), old_logprobs.exp()
            if mode == "dppo_tv":
                valid = torch.where(
                    a > 0, p - p_old <= self.clip_ratio_high, p - p_old >= -self.clip_ratio_low
                )
            else:  # binary KL between Bernoulli(p_old) and Bernoulli(p)
                bkl = p_old * (old_logprobs - logprobs) + (1 - p_old) * torch.log(
                    (1.0 - p_old + 1e-8) / (1.0 - p + 1e-8)
                )
                valid = torch.where(a > 0, (bkl <= self.clip_ratio_high) | (p <= p_old),
                                    (bkl <= self.clip_ratio_low) | (p >= p_old))  # fmt: skip
            valid = valid.detach()
            pg = torch.where(valid, -a * capped * logprobs, 0.0)
            clipped = ~valid
            if self.clip_ratio_c is not None:
                clipped_lower = (r > self.clip_ratio_c) & valid
        elif mode == "sapo":
            r = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
            tau = torch.where(a > 0, const(self.tau_pos), const(self.tau_neg))
            pg = -(torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau)) * a
        elif mode == "clip_cov":
            assert selected is not None
            pg, clipped = ppo_clip(log_ratio.exp())  # verl: no clamp of the log-ratio here
            pg = torch.where(selected, 0.0, pg)
            clipped = selected
        elif mode == "kl_cov":
            assert selected is not None
            pg = -a * log_ratio.exp()
            pg = torch.where(selected, pg + self.ppo_kl_coef * log_ratio.abs(), pg)
            clipped = selected
        elif mode == "dro":
            pg = -(logprobs * a - 0.5 * self.dro_beta * log_ratio.square())
        else:
            r = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
            clipped_ratio = r.clamp(1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high)
            if mode == "cispo":  # the clipped ratio is a stop-gradient weight on log pi
                pg = -clipped_ratio.detach() * a * logprobs
                clipped = r != clipped_ratio
            else:
                pg, clipped = ppo_clip(r)
                if self.clip_ratio_c is not None:  # dual clip: negative advantages bounded by c * |A|
                    l3 = -a * self.clip_ratio_c
                    clipped_lower = (pg > l3) & (a < 0)
                    pg = torch.where(a < 0, torch.minimum(l3, pg), pg)
        if rollout_is_weights is not None and mode not in ("geo_mean", "vespo"):  # those fold them in above
            pg = pg * rollout_is_weights
        if pg_mask is not None:
            pg = torch.where(pg_mask, pg, 0.0)
        loss = pg
        parts = dict(log_ratio=log_ratio.detach(), pg=pg.detach(), ratio=ratio, clipped=clipped,
                     clipped_lower=clipped_lower)  # fmt: skip
        if self.kl_loss_type == "full" and kl is not None:
            parts["kl"] = kl.detach()
            loss = loss + self.kl_loss_coef * kl
        elif ref_logprobs is not None:
            kl = kl_estimate(logprobs, ref_logprobs, self.kl_loss_type)
            if self.kl_importance_weighted:  # TRL's use_bias_correction_kl: E_old[r kl], r differentiable
                kl = kl * log_ratio.exp()
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


def check_constant(name: str, t: torch.Tensor) -> None:
    """A per-token input that the objective treats as a constant must not carry a gradient."""
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{name} requires grad; it is a constant of the objective (its gradient would be silently dropped "
            f"or wrong, e.g. policy_loss(lp, lp, ...) has exactly zero gradient): pass {name}.detach()"
        )


def check_kl_arguments(kl_loss_type: str, kl_loss_coef: float, ref_logprobs, kl, *, fused: bool = False) -> None:
    """The KL term's inputs: `ref_logprobs` for the estimators, the per-token full KL (`kl`, or in the fused
    op the reference head) for ``"full"``; each only with its type."""
    if kl_loss_type == "full":
        if ref_logprobs is not None:
            raise ValueError("kl_loss_type='full' computes the KL over the vocabulary; ref_logprobs is for the estimators")
        if kl_loss_coef != 0.0 and kl is None:
            need = "ref_hidden and ref_weight (the reference head)" if fused else "kl (per-token full KL: lmloss.rl.full_kl)"
            raise ValueError(f"kl_loss_type='full' with kl_loss_coef != 0 needs {need}")
        return
    if kl is not None:
        raise ValueError(f"a per-token full KL was given but kl_loss_type={kl_loss_type!r}; use kl_loss_type='full'")
    if kl_loss_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_loss_coef != 0 needs ref_logprobs (the reference policy's log-probs)")


def policy_agreement_fields(objective, loss_agg_mode, horizon, dtype, n_seq: int, given) -> tuple[dict, str]:
    """What the CP ranks of a policy loss agree on (`agree_over_cp`): `POLICY_CP_FIELDS` (`given`: the optional
    inputs, None where not given) and the options as a text."""
    local = dict(
        dtype=DTYPE_CODES.get(dtype, -1), sequences=n_seq, given=sum(1 << i for i, t in enumerate(given) if t is not None)
    )
    return local, f"{objective}, loss_agg_mode={loss_agg_mode!r}, horizon={horizon!r}"


def agree_over_cp(cp_group, local: dict, text: str, *, error: BaseException | None = None, like=None) -> int:
    """The policy loss's agreement over `cp_group` (more than one rank), before the per-sequence all-reduce:
    one fixed-size gather of `POLICY_CP_FIELDS` and a hash of the options' `text`; a rank's failed check
    (`error`) or a disagreement raises the same `RankAgreementError` on every CP rank. Returns the sequence
    count every rank sums over: the largest (a CP rank may hold no token of the last sequences)."""
    ranks = agree_over_group(
        cp_group, "lmloss.rl.policy_loss over cp_group", POLICY_CP_FIELDS, local, per_rank=("sequences",),
        error=error, like=like, text=text,
    )  # fmt: skip
    return max(r["sequences"] for r in ranks)


def check_sequences(shape, device, cu_seqlens, sequence_ids, loss_mode: str | None):
    """The sequence arguments' local checks: `cu_seqlens` valid boundaries of packed 1-D tokens (checked
    whether or not a mode reads it: wrong boundaries are a bug upstream), and with a sequence `loss_mode` each
    token's sequence found. Returns ``(sequence_ids, cu_seqlens)`` as int64 (None where not given), the values
    the TP ranks agree on."""
    if cu_seqlens is not None:
        if len(shape) != 1:
            raise ValueError(f"cu_seqlens is for packed 1-D tokens; logprobs have shape {tuple(shape)}")
        if sequence_ids is None:
            check_packed_cu_seqlens(cu_seqlens, shape[0])
        cu_seqlens = as_cu_seqlens(cu_seqlens).long()
    if sequence_ids is not None:
        sequence_ids = check_ids("sequence_ids", sequence_ids, shape)
    if loss_mode in SEQUENCE_MODES:
        sequence_index(shape, device, cu_seqlens=cu_seqlens, sequence_ids=sequence_ids, need=f"loss_mode={loss_mode!r}")
    return sequence_ids, cu_seqlens


def check_weights_or_mode(token_weights: object, loss_agg_mode: str) -> None:
    """`token_weights` are the aggregation: a non-default `loss_agg_mode` beside them would be ignored."""
    if token_weights is not None and loss_agg_mode != "token-mean":
        raise ValueError(
            f"token_weights and loss_agg_mode={loss_agg_mode!r} were both given: the weights already are the "
            f"aggregation (make them with lmloss.rl.token_weights(mask, {loss_agg_mode!r}, ...)); pass one"
        )


def check_reference_logprobs(ref_logprobs: torch.Tensor, mask: torch.Tensor) -> None:
    """The reference's log-probs are those of its full distribution: -inf at a counted token is refused.

    A reference scored under a sampler's truncation (top_k / top_p / min_p / support) gives -inf to a sampled
    token its own kept set leaves out, and the KL to it is then infinite (``k1``, ``k2``, ``abs``) or silently
    clamped with no gradient (``k3``). The KL term compares the policy under the sampler with the reference
    model itself: score the reference without truncation. One host sync (skipped while compiling)."""
    if torch.compiler.is_compiling():
        return
    n = int((torch.isneginf(ref_logprobs) & mask).sum())
    if n:
        raise ValueError(
            f"ref_logprobs is -inf at {n} counted token(s): score the reference on its full distribution (no "
            "top_k / top_p / min_p / support); a KL to a reference that gives a sampled token no mass is infinite"
        )


class PerToken:
    """The checked, masked per-token inputs of one call, flattened to ``[N]``: ``mask`` as bool, and
    ``mask_dtype``, the dtype of the mask the caller gave (verl adds its 1e-8 to a count in a dtype that
    depends on it: `lmloss.rl.aggregation.count_with_eps`)."""

    def __init__(
        self, shape, mask, old_logprobs, advantages, ref_logprobs, entropy, rollout_is_weights, weights, *,
        pg_mask=None, cov_selection=None, mask_dtype=None,
    ):  # fmt: skip
        self.shape = shape
        self.mask = check_mask(mask, shape).reshape(-1)
        # the dtype of the mask the caller gave (None: `mask`'s), for verl's 1e-8 in a count (`count_with_eps`)
        self.mask_dtype = mask.dtype if mask_dtype is None else mask_dtype
        named = dict(old_logprobs=old_logprobs, advantages=advantages, ref_logprobs=ref_logprobs,
                     entropy=entropy, rollout_is_weights=rollout_is_weights, token_weights=weights)  # fmt: skip
        for k, v in named.items():
            if v is not None:
                v = check_per_token(k, v, shape).reshape(-1)
                if k in CONSTANT_INPUTS:
                    check_constant(k, v)
                if k == "ref_logprobs":
                    check_reference_logprobs(v, self.mask)
                setattr(self, k, _masked(self.mask, v))
            else:
                setattr(self, k, None)
        self.pg_mask = None if pg_mask is None else check_mask(pg_mask, shape, name="pg_mask").reshape(-1)
        self.cov_selection = (
            None
            if cov_selection is None
            else check_mask(cov_selection, shape, name="cov_selection").reshape(-1)
        )

    def masked_to(self, mask: torch.Tensor, entropy: torch.Tensor | None = None) -> PerToken:
        """These inputs with the tokens outside `mask` (bool ``[N]``, within `self.mask`) also masked (their
        values 0), and `entropy` (``[N]`` or None) masked alike: a fused objective's tokens whose label lies
        outside the sampler's kept set leave the objective (`lmloss.rl.linear_policy_loss`)."""
        out = copy.copy(self)
        out.mask = mask
        for k in ("old_logprobs", "advantages", "ref_logprobs", "rollout_is_weights", "token_weights"):
            setattr(out, k, _masked(mask, getattr(self, k)))
        out.entropy = _masked(mask, entropy)
        return out


# ----------------------------------------------------------------------------------- batch statistics

#: The fields of `policy_loss`'s agreement over `cp_group` (with a hash of the objective's options): the log-probs'
#: dtype, this rank's sequence count (the group sums over the largest) and which optional inputs are given.
POLICY_CP_FIELDS = ("dtype", "sequences", "given")
#: The fields of `covariance_selection`'s agreement vector (``n``, ``sum_a``, ``sum_lp``: this rank's).
COV_FIELDS = ("mode", "low", "high", "ratio", "lb", "ub", "n", "sum_a", "sum_lp")
ENTROPY_FIELDS = ("quantile", "n")


def covariance_selection(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_mode: str = "clip_cov",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    kl_cov_ratio: float = 0.0002,
    group: ProcessGroup | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The tokens ``clip_cov`` drops / ``kl_cov`` penalises (bool, `mask`'s shape), from the global batch.

    With ``cov_i = (A_i - mean A) (lp_i - mean lp)`` over the valid tokens (Cui et al., "The Entropy
    Mechanism of RL for Reasoning LMs", verl's ``compute_policy_loss_clip_cov`` / ``_kl_cov``):

    * ``"clip_cov"``: ``max(1, int(clip_cov_ratio * n))`` tokens drawn at random (``torch.randperm`` on
      `generator`, torch's global generator by default, as verl) among the valid tokens not already
      clipped by PPO's clip (at `clip_ratio_low` / `clip_ratio_high`) with ``clip_cov_lb < cov <
      clip_cov_ub``; `policy_loss` zeroes their policy term;
    * ``"kl_cov"``: the ``max(1, int(kl_cov_ratio * n))`` valid tokens of largest ``cov``; `policy_loss`
      adds ``ppo_kl_coef * |lp - old|`` to their policy term.

    verl computes these statistics on each micro-batch's local tokens; here, with `group` (the DP group;
    called on each rank's whole sequences, before the CP split and the micro-batch slicing, like
    `lmloss.rl.token_weights`), the means, the count ``n``, the random draw (made on the group's first
    rank and broadcast) and the top-k are the global batch's, so no split changes the selection. Every
    rank of `group` must call it; options and local sums travel in one agreement gather. `logprobs`: the
    current policy's log-probs for the whole batch (at a step's start, the rollout's ``old_logprobs``).
    On one process (`group` None) this is verl's selection on the same tensors.
    """
    check_group("group", group)
    distributed = group_size(group) > 1
    error = None
    values: dict = {}
    try:
        if loss_mode not in SELECTION_MODES:
            raise ValueError(f"loss_mode must be one of {SELECTION_MODES}, got {loss_mode!r}")
        check_per_token("logprobs", logprobs, logprobs.shape if isinstance(logprobs, torch.Tensor) else None)
        shape = logprobs.shape
        for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages)):
            check_per_token(name, t, shape)
        valid = check_mask(mask, shape).reshape(-1)
        obj = Objective.make(
            loss_mode=loss_mode, clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
            clip_ratio_c=None, kl_loss_type="k1", kl_loss_coef=0.0, entropy_coeff=0.0, clip_cov_ratio=clip_cov_ratio,
            clip_cov_lb=clip_cov_lb, clip_cov_ub=clip_cov_ub, kl_cov_ratio=kl_cov_ratio,
        )  # fmt: skip
        lp = torch.where(valid, logprobs.detach().reshape(-1), 0.0)
        a = torch.where(valid, advantages.detach().reshape(-1), 0.0)
        old = torch.where(valid, old_logprobs.detach().reshape(-1), 0.0)
        if distributed:
            values = dict(
                mode=SELECTION_MODES.index(loss_mode), low=obj.clip_ratio_low, high=obj.clip_ratio_high,
                ratio=obj.clip_cov_ratio if loss_mode == "clip_cov" else obj.kl_cov_ratio, lb=obj.clip_cov_lb,
                ub=obj.clip_cov_ub, n=int(valid.sum()), sum_a=float(a.double().sum()), sum_lp=float(lp.double().sum()),
            )  # fmt: skip
    except (TypeError, ValueError) as e:
        if not distributed:
            raise
        error = e
    if distributed:
        ranks = agree_over_group(
            group, "lmloss.rl.covariance_selection", COV_FIELDS, values, per_rank=("n", "sum_a", "sum_lp"),
            floats=("low", "high", "ratio", "lb", "ub", "sum_a", "sum_lp"), error=error, like=logprobs,
        )  # fmt: skip
        counts = [r["n"] for r in ranks]
        n = sum(counts)
        offset = sum(counts[: dist.get_rank(group)])
        mean_a = sum(r["sum_a"] for r in ranks) / max(n, 1)
        mean_lp = sum(r["sum_lp"] for r in ranks) / max(n, 1)
    else:
        n, offset = valid.sum(), 0
        if loss_mode == "kl_cov":  # verl: plain means of the valid entries
            mean_a, mean_lp = (
                advantages.detach().reshape(-1)[valid].mean(),
                logprobs.detach().reshape(-1)[valid].mean(),
            )
        else:  # verl's masked_mean: its 1e-8 added to the count as verl adds it for this mask's dtype
            count = count_with_eps(n, mask.dtype)
            mean_a, mean_lp = a.sum() / count, lp.sum() / count
        n = int(n)
    selected = torch.zeros_like(valid)
    if n == 0:
        return selected.view(shape)
    cov = (a - mean_a) * (lp - mean_lp)
    if loss_mode == "kl_cov":
        k = max(1, int(n * obj.kl_cov_ratio))
        positions = valid.nonzero()[:, 0]
        local = cov[valid]
        top_v, top_i = torch.topk(local, min(k, local.numel()), largest=True)
        if distributed:  # every rank's top k (padded), merged the same way on every rank
            pad = torch.full((k - top_v.numel(),), math.inf, dtype=torch.float64, device=top_v.device)
            # float64 carries the global indices exactly (below 2**53)
            mine = torch.stack(
                [torch.cat([top_v.double(), -pad]), torch.cat([(top_i + offset).double(), pad])]
            )
            everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(everyone, mine, group=group)
            allv, alli = torch.cat([t[0] for t in everyone]), torch.cat([t[1] for t in everyone])
            order = torch.argsort(alli, stable=True)  # ties: the lower global index first
            allv, alli = allv[order], alli[order]
            best = alli[torch.argsort(allv, descending=True, stable=True)[:k]]
            top_i = (best[(best >= offset) & (best < offset + local.numel())] - offset).long()
        selected[positions[top_i]] = True
        return selected.view(shape)
    ratio = (lp - old).exp()  # verl's clip_cov: no clamp of the log-ratio
    l1 = -a * ratio
    l2 = -a * ratio.clamp(1.0 - obj.clip_ratio_low, 1.0 + obj.clip_ratio_high)
    candidates = valid & ~(l2 > l1) & (cov < obj.clip_cov_ub) & (cov > obj.clip_cov_lb)
    idx = candidates.nonzero()[:, 0]
    clip_num = max(int(obj.clip_cov_ratio * n), 1)
    if distributed:
        count = torch.tensor([idx.numel()], dtype=torch.int64, device=idx.device)
        counts = [torch.empty_like(count) for _ in range(dist.get_world_size(group))]
        dist.all_gather(counts, count, group=group)
        counts = [int(c) for c in counts]
        total = sum(counts)
        if total == 0:
            return selected.view(shape)
        take = min(clip_num, total)
        chosen = torch.empty(take, dtype=torch.int64, device=idx.device)
        if dist.get_rank(group) == 0:
            chosen.copy_(torch.randperm(total, generator=generator)[:take].to(idx.device))
        dist.broadcast(chosen, src=dist.get_global_rank(group, 0), group=group)
        start = sum(counts[: dist.get_rank(group)])
        chosen = chosen[(chosen >= start) & (chosen < start + idx.numel())] - start
        selected[idx[chosen]] = True
    elif idx.numel():
        perm = torch.randperm(idx.numel(), generator=generator)
        selected[idx[perm[: min(clip_num, idx.numel())].to(idx.device)]] = True
    return selected.view(shape)


def high_entropy_mask(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    top_entropy_quantile: float,
    *,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """The tokens whose entropy is in the top `top_entropy_quantile` of the batch's valid tokens (bool).

    TRL's ``GRPOConfig.top_entropy_quantile`` ("Beyond the 80/20 rule"): the threshold is the
    ``1 - top_entropy_quantile`` quantile (linear interpolation, as ``torch.quantile``) of the valid
    tokens' entropies, gathered over `group` (every rank must call; TRL gathers over all processes); a
    token is kept when its entropy is at least the threshold. Pass the result as `policy_loss(...,
    pg_mask=...)`: the other tokens keep their place in the denominators but add no policy gradient. The
    quantile is taken in the entropies' dtype (TRL takes it in float32).
    """
    check_group("group", group)
    distributed = group_size(group) > 1
    error, values = None, {}
    try:
        if not _is_number(top_entropy_quantile) or not 0 <= top_entropy_quantile <= 1:
            raise ValueError(f"top_entropy_quantile must be a number in [0, 1], got {top_entropy_quantile!r}")
        ent = check_per_token(
            "entropy", entropy, entropy.shape if isinstance(entropy, torch.Tensor) else None
        )
        valid = check_mask(mask, ent.shape)
        local = ent.detach()[valid]
        values = dict(quantile=float(top_entropy_quantile), n=local.numel())
    except (TypeError, ValueError) as e:
        if not distributed:
            raise
        error = e
    if distributed:
        ranks = agree_over_group(
            group, "lmloss.rl.high_entropy_mask", ENTROPY_FIELDS, values, per_rank=("n",), floats=("quantile",),
            error=error, like=entropy,
        )  # fmt: skip
        sizes = [r["n"] for r in ranks]
        width = max(sizes)
        padded = torch.cat([local, local.new_zeros(width - local.numel())])
        everyone = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(everyone, padded, group=group)
        local = torch.cat([t[:s] for t, s in zip(everyone, sizes)])
    if local.numel() == 0:
        return torch.zeros_like(valid)
    values_sorted = local.sort().values
    pos = (1.0 - top_entropy_quantile) * (values_sorted.numel() - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, values_sorted.numel() - 1)
    threshold = torch.lerp(values_sorted[lo], values_sorted[hi], pos - lo)
    return (ent.detach() >= threshold) & valid


def off_policy_sequence_mask(
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    threshold: float,
    cu_seqlens: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    cp_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's ``off_policy_mask_threshold``), bool per token.

    A token is kept when its advantage is >= 0 or its sequence's mean ``sampling_logprobs - logprobs``
    over valid tokens (NaN counted as 0, as TRL) is at most `threshold`. `sampling_logprobs`: the
    rollout engine's (TRL: vLLM's, else the old policy's). Under CP (`sequence_ids`, `cp_group`) the
    per-sequence sums are summed over `cp_group`. Pass the result as `policy_loss(..., pg_mask=...)`.
    """
    check_group("cp_group", cp_group)
    error, local = None, {}
    try:
        if not _is_number(threshold):
            raise ValueError(f"threshold must be a finite number, got {threshold!r}")
        lp = check_per_token("logprobs", logprobs, logprobs.shape if isinstance(logprobs, torch.Tensor) else None)
        shape = lp.shape
        check_per_token("sampling_logprobs", sampling_logprobs, shape)
        check_per_token("advantages", advantages, shape)
        valid = check_mask(mask, shape).reshape(-1)
        seq, n_seq = sequence_index(
            shape, lp.device, cu_seqlens=cu_seqlens, sequence_ids=sequence_ids, need="off_policy_sequence_mask"
        )
        local = dict(threshold=float(threshold), sequences=n_seq, dtype=DTYPE_CODES.get(lp.dtype, -1))
    except (TypeError, ValueError) as e:
        if group_size(cp_group) <= 1:
            raise
        error = e
    if group_size(cp_group) > 1:  # every CP rank issues the same all-reduce, or every rank raises the same error
        ranks = agree_over_group(cp_group, "lmloss.rl.off_policy_sequence_mask", ("threshold", "sequences", "dtype"),
                                 local, per_rank=("sequences",), floats=("threshold",), error=error, like=logprobs)  # fmt: skip
        n_seq = max(r["sequences"] for r in ranks)  # a CP rank may hold no token of the last sequences
    diff = torch.nan_to_num(sampling_logprobs.detach() - lp.detach(), nan=0.0).reshape(-1)
    cols = torch.stack([torch.where(valid, diff, 0.0), valid.to(diff.dtype)], dim=1)
    sums = sequence_sums(cols, seq, n_seq, cp_group)
    seq_kl = (sums[:, 0] / sums[:, 1].clamp(min=1.0))[seq]
    keep = (advantages.detach().reshape(-1) >= 0) | (seq_kl <= threshold)
    return (keep & valid).view(shape)


# ----------------------------------------------------------------------------------- the loss


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
    horizon: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_loss_type: str = "low_var_kl",
    kl_loss_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coeff: float = 0.0,
    rollout_is_weights: torch.Tensor | None = None,
    pg_mask: torch.Tensor | None = None,
    cov_selection: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    tracker: StatsTracker | None = None,
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
    kl: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's policy loss, verl's ``policy_loss`` + entropy bonus + KL loss, as one scalar.

    Args:
        logprobs: ``[B, T]`` (one sequence per row) or ``[N]`` packed tokens, the current policy's
            log-probs of the sampled tokens (differentiable; e.g. `lmloss.token_logprobs`).
        old_logprobs, advantages: same shape, constants (a tensor that requires grad is refused: pass
            ``.detach()``). old: the behaviour policy's log-probs (for ``"reinforce"`` / ``"gpg"`` only
            the ``ppo_kl`` metric reads them).
        mask: bool / 0-1, same shape: which tokens count (verl's ``response_mask``). Its dtype places verl's
            1e-8 in a token count as verl does (kept for a float64 mask, rounded away for a bool one:
            `lmloss.rl.aggregation.count_with_eps`).
        loss_mode: with ``r = exp(lp - old)`` (docs/rl.md has each formula):
            ``"vanilla"`` (PPO clip, asymmetric ``clip_ratio_low/high``, dual clip with `clip_ratio_c`),
            ``"gspo"`` (sequence ratio), ``"cispo"`` (stop-gradient clipped ratio on log pi), ``"reinforce"``
            / ``"gpg"`` (``-A log pi``), ``"dppo_tv"`` / ``"dppo_kl"`` (DPPO: ``-A sg(r) log pi`` where the
            probability's move is within the clips, TV or binary-KL; `clip_ratio_c` caps ``r``),
            ``"sapo"`` (soft gate ``4 / tau * sigmoid(tau (r - 1))``, `tau_pos` / `tau_neg`), ``"clip_cov"`` /
            ``"kl_cov"`` (PPO with covariance-selected tokens dropped / KL-penalised: `cov_selection`),
            ``"geo_mean"`` (GMPO: the geometric mean of clipped token ratios per sequence), ``"dro"``
            (``-(A log pi - dro_beta / 2 (lp - old)^2)``), ``"vespo"`` (TRL: ``-sg(phi(w)) A log pi`` with
            the sequence weight ``w``, `vespo_k_pos` ...).
        clip_ratio, clip_ratio_low, clip_ratio_high: verl's; low/high default to `clip_ratio` (DPPO's
            divergence thresholds; GMPO's log-ratio bounds).
        clip_ratio_c: dual-clip bound (> 1), ``"vanilla"``; the ratio cap of ``"dppo_*"``. None: off (verl
            applies its ``clip_ratio_c`` = 3.0 always).
        loss_agg_mode: how tokens are weighted (`lmloss.rl.token_weights`), when `token_weights` is None.
            Without `token_weights` the batch is taken as the whole global batch (one process).
        token_weights: precomputed per-token weights (same shape) from `lmloss.rl.token_weights` on the
            global batch, split like the other tensors: the loss is ``sum(w * per_token_loss)``, this
            rank's share of the global loss. Then `loss_agg_mode` must be left at its default.
        cu_seqlens: int ``[S + 1]`` for packed tokens (sequence boundaries, ending at N); checked when given.
        sequence_ids, cp_group: sequence objectives under context parallelism: each local token's
            sequence (e.g. ``split_batch(...)["sequence_ids"]``) and the group that splits sequences; the
            per-sequence sums are all-reduced over it so a split sequence gets one ratio. With `cp_group`
            every CP rank first agrees (one gather, whatever the loss mode) on the options, the dtype, which
            optional inputs are given and its sequence count: a disagreement or one rank's failed check
            raises the same `lmloss.RankAgreementError` on every CP rank, and the sums run over the
            largest count (a CP rank may hold no token of the last sequences).
        horizon: the constant of ``"seq-mean-token-sum-norm"`` (default ``T`` for rows).
        ref_logprobs, kl_loss_type, kl_loss_coef: KL-to-reference term (`kl_estimate`), added with weight
            `kl_loss_coef` (needs `ref_logprobs` when the coefficient is not 0; a constant).
            ``kl_loss_type="full"``: the exact KL(pi || ref) over the whole vocabulary at each token, given as
            `kl` (differentiable, same shape: `full_kl` of the policy's and the reference's logits;
            `linear_policy_loss` computes it from both heads itself) instead of `ref_logprobs`.
        kl_importance_weighted: multiply the KL estimate by the differentiable token ratio ``exp(lp - old)``
            (TRL's ``use_bias_correction_kl``, DeepSeek-V3.2's unbiased KL; token objectives only).
        entropy, entropy_coeff: entropy bonus, ``- entropy_coeff * H`` per token (needs `entropy` when the
            coefficient is not 0; differentiable).
        rollout_is_weights: per-token rollout-correction IS weights (constants; `lmloss.rl.rollout`),
            multiplying the policy-gradient term (``"geo_mean"``: their per-sequence geometric mean;
            ``"vespo"``: summed in log space into the sequence weight, as TRL).
        pg_mask: bool, same shape: tokens whose policy term counts (the others stay in the denominators),
            e.g. `high_entropy_mask`, `off_policy_sequence_mask`.
        cov_selection: ``"clip_cov"`` / ``"kl_cov"``: the selected tokens (`covariance_selection` over the
            global batch, split like the other tensors); None: selected from this call's tokens (verl's
            per-micro-batch selection), ``clip_cov`` drawing from `generator`.
        tracker: a `lmloss.StatsTracker` to record the metrics into (global, CP-invariant after
            ``export()``).
        tau_pos, tau_neg, clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio, ppo_kl_coef, dro_beta,
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: the objectives' options, verl's /
            TRL's names and defaults (``dro_beta`` has none: required for ``"dro"``).

    Returns:
        ``(loss, metrics)``: the 0-d loss in the log-probs' dtype (or the weights' if wider), and the
        metrics of this call (`record_metrics`), detached 0-d tensors (no host sync).

    Masked positions contribute nothing, even NaN / inf there: their gradient is exactly 0.
    """
    check_group("cp_group", cp_group)  # raised here: without a group there is nothing to agree over
    over_cp = group_size(cp_group) > 1
    error, local, text, n_seq = None, {}, "", 0
    try:
        check_per_token("logprobs", logprobs, logprobs.shape if isinstance(logprobs, torch.Tensor) else None)
        shape = logprobs.shape
        objective = Objective.make(
            loss_mode=loss_mode, clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
            clip_ratio_c=clip_ratio_c, kl_loss_type=kl_loss_type, kl_loss_coef=kl_loss_coef,
            entropy_coeff=entropy_coeff, tau_pos=tau_pos, tau_neg=tau_neg, clip_cov_ratio=clip_cov_ratio,
            clip_cov_lb=clip_cov_lb, clip_cov_ub=clip_cov_ub, kl_cov_ratio=kl_cov_ratio, ppo_kl_coef=ppo_kl_coef,
            dro_beta=dro_beta, vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
            vespo_lambda_neg=vespo_lambda_neg, kl_importance_weighted=kl_importance_weighted,
        )  # fmt: skip
        check_kl_arguments(kl_loss_type, kl_loss_coef, ref_logprobs, kl)
        if entropy_coeff != 0.0 and entropy is None:
            raise ValueError("entropy_coeff != 0 needs entropy (per-token entropies, e.g. return_entropy=True)")
        check_weights_or_mode(token_weights, loss_agg_mode)
        if cov_selection is not None and loss_mode not in SELECTION_MODES:
            raise ValueError(f"cov_selection is for loss_mode in {SELECTION_MODES}, not {loss_mode!r}")
        x = PerToken(
            shape, mask, old_logprobs, advantages, ref_logprobs, entropy, rollout_is_weights, token_weights,
            pg_mask=pg_mask, cov_selection=cov_selection,
        )  # fmt: skip
        check_sequences(shape, logprobs.device, cu_seqlens, sequence_ids, None)
        if objective.loss_mode in SEQUENCE_MODES:
            seq, n_seq = sequence_index(
                shape, logprobs.device, cu_seqlens=cu_seqlens, sequence_ids=sequence_ids,
                need=f"loss_mode={loss_mode!r}",
            )  # fmt: skip
        if kl is not None:
            check_per_token("kl", kl, shape)
        if x.token_weights is None:
            w = token_weights_of(x.mask.view(shape), loss_agg_mode, cu_seqlens, horizon, logprobs.dtype, x.mask_dtype)
        else:
            w = x.token_weights
        given = (ref_logprobs, entropy, rollout_is_weights, token_weights, pg_mask, cov_selection, kl, cu_seqlens,
                 sequence_ids)  # fmt: skip
        local, text = policy_agreement_fields(objective, loss_agg_mode, horizon, logprobs.dtype, n_seq, given)
    except (TypeError, ValueError) as e:
        if not over_cp:
            raise
        error = e
    if over_cp:  # before the sequences' all-reduce: every CP rank issues it alike, or every rank raises
        n_seq = agree_over_cp(cp_group, local, text, error=error, like=logprobs)
    lp = _masked(x.mask, logprobs.reshape(-1))
    seq_sums = None
    if objective.loss_mode in SEQUENCE_MODES:
        columns = objective.sequence_columns(lp, x.old_logprobs, x.advantages, x.mask, x.rollout_is_weights)
        seq_sums = sequence_sums(columns, seq, n_seq, cp_group)[seq]
    selected = x.cov_selection
    if objective.loss_mode in SELECTION_MODES and selected is None:
        selected = covariance_selection(  # the caller's mask (its dtype: verl's 1e-8 in the means' count)
            lp.detach(), x.old_logprobs, x.advantages, mask.reshape(-1), loss_mode=loss_mode, clip_ratio=clip_ratio,
            clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_cov_ratio=clip_cov_ratio,
            clip_cov_lb=clip_cov_lb, clip_cov_ub=clip_cov_ub, kl_cov_ratio=kl_cov_ratio, generator=generator,
        )  # fmt: skip
    if kl is not None:
        kl = _masked(x.mask, kl.reshape(-1))
    return objective_loss(objective, x, lp, w, seq_sums=seq_sums, selected=selected, kl=kl, tracker=tracker)


def objective_loss(
    objective: Objective, x: PerToken, logprobs: torch.Tensor, weights: torch.Tensor, *,
    seq_sums: torch.Tensor | None = None, selected: torch.Tensor | None = None, kl: torch.Tensor | None = None,
    tracker: StatsTracker | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """``(sum_t w_t L_t, metrics)`` of checked inputs (`x`, masked; its entropy the one the loss reads) and
    the masked log-probs ``[N]``: the one evaluation of `policy_loss` and of `lmloss.rl.linear_policy_loss`'s
    sequence and selection objectives. `seq_sums`: each token's sequence's sums of `Objective.sequence_columns`
    (a sequence objective); `selected`: the covariance selection; `kl`: the per-token full KL, masked."""
    per_tok, parts = objective.per_token(
        logprobs, x.old_logprobs, x.advantages, x.mask, ref_logprobs=x.ref_logprobs, entropy=x.entropy,
        rollout_is_weights=x.rollout_is_weights, pg_mask=x.pg_mask, seq_sums=seq_sums, selected=selected, kl=kl,
        mask_dtype=x.mask_dtype,
    )  # fmt: skip
    loss = (weights * per_tok).sum()
    return loss, record_metrics(parts, x.mask, weights.detach(), x.entropy, tracker)


def token_weights_of(mask, loss_agg_mode, cu_seqlens, horizon, dtype, mask_dtype) -> torch.Tensor:
    """`token_weights` of one batch (no group), flat, in at least `dtype`'s precision; `mask` (bool) made
    from a mask of `mask_dtype` (verl's 1e-8 in ``seq-mean-token-mean``'s lengths follows it)."""
    wdtype = torch.promote_types(dtype, torch.float32)
    return token_weights_with_mask_dtype(mask, loss_agg_mode, cu_seqlens, None, horizon, None, wdtype, mask_dtype).reshape(-1)
