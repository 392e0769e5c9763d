"""Rollout correction: importance weights between the trainer's and the rollout engine's policies.

The rollout engine (vLLM, SGLang) samples with slightly different log-probs than the trainer computes
for the same weights (kernels, precision), so its samples are off-policy. The per-token (or per-sequence)
ratio ``pi_train / pi_rollout = exp(old_logprobs - rollout_logprobs)`` corrects for that:

* truncated IS (TIS): the ratio capped from above (`truncated_is_weights`);
* masked IS (MIS, "icepop"): the ratio where it lies within ``[lower, upper]``, 0 elsewhere
  (`masked_is_weights`): tokens (or sequences) too far off-policy are dropped instead of down-weighted.

``level="sequence"`` uses one ratio per sequence, ``exp(sum of its tokens' log-ratios)`` (a product of
token ratios), for every token of it. All weights are detached (they change the measure, not the
objective) and 0 at masked positions; pass them to `lmloss.rl.policy_loss(..., rollout_is_weights=w)`.
The log-ratio is clamped to +-20 before ``exp`` (verl's safety bound).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lmloss.rl.aggregation import check_mask, sequence_index
from lmloss.rl.objectives import LOG_RATIO_CLAMP, check_per_token
from lmloss.vocab_parallel import ProcessGroup

LEVELS = ("token", "sequence")

__all__ = ["masked_is_weights", "truncated_is_weights"]


def _log_ratio(old_logprobs, rollout_logprobs, mask, level, cu_seqlens, sequence_ids, cp_group):
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    check_per_token(
        "old_logprobs", old_logprobs, old_logprobs.shape if isinstance(old_logprobs, torch.Tensor) else None
    )
    shape = old_logprobs.shape
    check_per_token("rollout_logprobs", rollout_logprobs, shape)
    mask = check_mask(mask, shape)
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    log_ratio = torch.where(mask, old_logprobs.detach() - rollout_logprobs.detach(), zero)
    if level == "sequence":
        seq, n_seq = sequence_index(
            shape, mask.device, cu_seqlens=cu_seqlens, sequence_ids=sequence_ids, need="level='sequence'"
        )
        sums = torch.zeros(n_seq, dtype=log_ratio.dtype, device=log_ratio.device)
        sums.index_add_(0, seq, log_ratio.reshape(-1))
        if cp_group is not None and dist.get_world_size(cp_group) > 1:  # a sequence's pieces on CP ranks
            dist.all_reduce(sums, group=cp_group)
        log_ratio = sums[seq].view(shape)
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), mask


def truncated_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    level: str = "token",
    cu_seqlens: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    cp_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """TIS: ``min(exp(old - rollout), cap)`` per token (or per sequence), 0 where not `mask`; detached.

    Shapes as in `policy_loss` (``[B, T]`` rows, or ``[N]`` with `cu_seqlens` / `sequence_ids`).
    `cp_group`: with ``level="sequence"`` on CP-local tokens, sums each sequence's log-ratio over it.
    """
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise ValueError(f"cap must be a positive number, got {cap!r}")
    log_ratio, mask = _log_ratio(
        old_logprobs, rollout_logprobs, mask, level, cu_seqlens, sequence_ids, cp_group
    )
    return torch.where(mask, log_ratio.exp().clamp(max=float(cap)), 0.0)


def masked_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    lower: float = 0.5,
    upper: float = 2.0,
    level: str = "token",
    cu_seqlens: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    cp_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """MIS / icepop: the ratio ``exp(old - rollout)`` where ``lower <= ratio <= upper``, else 0; detached.

    Arguments as in `truncated_is_weights`. A token (or, at ``level="sequence"``, every token of a
    sequence) outside the bounds gets weight 0: it stays in the denominators but adds no gradient.
    """
    for name, v in (("lower", lower), ("upper", upper)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ValueError(f"{name} must be a number >= 0, got {v!r}")
    if not lower < upper:
        raise ValueError(f"lower ({lower}) must be below upper ({upper})")
    log_ratio, mask = _log_ratio(
        old_logprobs, rollout_logprobs, mask, level, cu_seqlens, sequence_ids, cp_group
    )
    ratio = log_ratio.exp()
    keep = mask & (ratio >= lower) & (ratio <= upper)
    return torch.where(keep, ratio, 0.0)
