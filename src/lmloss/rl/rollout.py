"""Rollout correction: importance weights and rejection between the trainer's and the rollout engine's policies.

The rollout engine (vLLM, SGLang) samples with slightly different log-probs than the trainer computes
for the same weights (kernels, precision), so its samples are off-policy. The per-token (or per-sequence)
log-ratio ``log(pi_train / pi_rollout) = old_logprobs - rollout_logprobs`` corrects for that:

* truncated IS (TIS): the ratio capped from above (`truncated_is_weights`);
* masked IS (MIS, "icepop"): the ratio where it lies within ``[lower, upper]``, 0 elsewhere
  (`masked_is_weights`): tokens (or sequences) too far off-policy are dropped instead of down-weighted;
* rejection sampling (verl's ``rollout_rs``, `rejection_mask`): tokens or whole sequences whose divergence
  estimate exceeds a threshold leave the *mask*, so they leave the loss's denominators too.

``level="sequence"`` uses one ratio per sequence, ``exp(sum of its tokens' log-ratios)`` (a product of
token ratios), for every token of it. All weights are detached (they change the measure, not the
objective) and 0 at masked positions; pass them to `lmloss.rl.policy_loss(..., rollout_is_weights=w)`.
The log-ratio is clamped to +-20 before ``exp`` (verl's safety bound).

Under context parallelism (``sequence_ids`` of the CP-local tokens, ``cp_group``) a sequence's sums are
all-reduced over ``cp_group``; with ``batch_normalize=True`` the weights' mean is taken over ``group`` (the
ranks that hold the global batch's tokens). Both groups first agree on every argument (one fixed-size
gather, `lmloss.agreement.agree_over_group`): a rank whose arguments differ or fail a check makes every
rank raise the same error instead of leaving one waiting in a collective.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.distributed as dist

from lmloss._validate import check_group
from lmloss.agreement import agree_over_group
from lmloss.rl.aggregation import (
    DTYPE_CODES,
    check_mask,
    count_with_eps,
    group_size,
    sequence_index,
    sequence_sums,
)
from lmloss.rl.objectives import LOG_RATIO_CLAMP, check_per_token
from lmloss.vocab_parallel import ProcessGroup, all_reduce_sum_

LEVELS = ("token", "sequence")
#: verl 0.9.1's rejection-sampling criteria (``rollout_rs``): a divergence estimate of each token (``token_``),
#: or its sum / mean / max over a sequence's valid tokens (``seq_sum_``, ``seq_mean_``, ``seq_max_``). With
#: ``r = old - rollout`` (clamped to +-20): ``k1 = -r``, ``k2 = r^2 / 2``, ``k3 = exp(r) - 1 - r``.
REJECTION_CRITERIA = (
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
)  # fmt: skip
#: The agreement vectors' fields (`lmloss.agreement.agree_over_group`): the IS weights' options, and
#: rejection_mask's (``rollout_rs``: a bit per criterion; ``rollout_rs_threshold``: a CRC of the parsed
#: bounds); ``sequences``: how many sequences this rank's CP sums are indexed by (the largest over `cp_group`
#: is summed over: a CP rank may hold no token of the last sequences; per rank over the normalization
#: `group`); ``dtype``: of the log-probs (the sums' all-reduce).
IS_FIELDS = ("level", "cap", "lower", "upper", "batch_normalize", "sequences", "dtype")
REJECTION_FIELDS = ("rollout_rs", "rollout_rs_threshold", "sequences", "dtype")

__all__ = ["REJECTION_CRITERIA", "masked_is_weights", "rejection_mask", "truncated_is_weights"]


def _agree(group, what: str, fields, local: dict, error: BaseException | None, like, per_rank=()) -> int:
    """One agreement gather over `group` when it has more than one rank: a rank's failed check (`error`) or
    a field that differs make every rank raise the same error here. On one process nothing happens (the
    caller raises its own `error` after its agreements). Returns the largest ``sequences`` over the group
    (this rank's on one process): a CP rank may hold no token of the last sequences, and every rank sums over
    the group's count."""
    if group_size(group) <= 1:
        return local.get("sequences", 0)
    ranks = agree_over_group(group, what, fields, local, per_rank=per_rank, floats=("cap", "lower", "upper"),
                             error=error, like=like)  # fmt: skip
    return max(r["sequences"] for r in ranks)


def _is_weights(
    what, old_logprobs, rollout_logprobs, mask, level, cu_seqlens, sequence_ids, cp_group, batch_normalize, group,
    bounds, weigh,
):  # fmt: skip
    """The body of both IS-weight functions: checks (`bounds()` validates the function's own bounds and returns
    them as agreement fields), agreement, the log-ratio, `weigh` (ratio -> weight) and the normalization."""
    check_group("cp_group", cp_group)
    check_group("group", group)
    error, local, seq = None, {}, None
    try:
        local = dict(bounds())
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
        if not isinstance(batch_normalize, bool):
            raise TypeError(f"batch_normalize must be a bool, got {type(batch_normalize).__name__}")
        old = check_per_token(
            "old_logprobs", old_logprobs, old_logprobs.shape if isinstance(old_logprobs, torch.Tensor) else None
        )
        shape = old.shape
        check_per_token("rollout_logprobs", rollout_logprobs, shape)
        valid = check_mask(mask, shape).reshape(-1)
        n_seq = 0
        if level == "sequence":
            seq, n_seq = sequence_index(
                shape, valid.device, cu_seqlens=cu_seqlens, sequence_ids=sequence_ids, need="level='sequence'"
            )
        if batch_normalize and group is None and group_size(cp_group) > 1:
            raise ValueError("batch_normalize=True under cp_group needs group= (the ranks holding the global batch)")
        local.update(level=LEVELS.index(level), batch_normalize=int(batch_normalize), sequences=n_seq,
                     dtype=DTYPE_CODES.get(old.dtype, -1))  # fmt: skip
    except (TypeError, ValueError) as e:
        error = e
    name = f"lmloss.rl.{what}"
    n_seq = _agree(cp_group, name, IS_FIELDS, local, error, old_logprobs, per_rank=("sequences",))
    _agree(group, name, IS_FIELDS, local, error, old_logprobs, per_rank=("sequences",))
    if error is not None:
        raise error

    log_ratio = torch.where(valid, (old_logprobs.detach() - rollout_logprobs.detach()).reshape(-1), 0.0)
    lengths = None
    if level == "sequence":
        sums = sequence_sums(torch.stack([log_ratio, valid.to(log_ratio.dtype)], dim=1), seq, n_seq, cp_group)
        log_ratio, lengths = sums[:, 0][seq], sums[:, 1]
    w = torch.where(valid, weigh(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()), 0.0)
    if batch_normalize:
        w = (w / _batch_mean(w, valid, seq, lengths, group, mask.dtype)).to(w.dtype)
    return w.view(shape)


def _batch_mean(w, valid, seq, lengths, group, mask_dtype) -> torch.Tensor:
    """The weights' mean over the global batch, as verl's ``rollout_is_batch_normalize`` (1 when it is <= 1e-8):
    over valid tokens (token level), or over sequences with a valid token (sequence level, a sequence's weight
    being its token mean). A sequence cut over CP ranks counts once: each piece contributes its share of the
    sequence's valid tokens. verl's 1e-8, added as verl adds it for a mask of `mask_dtype` (`count_with_eps`),
    is in each sequence's count, and in the token count on one process (`group` None: verl's ``masked_mean``;
    over a group its ``distributed_masked_mean`` adds none)."""
    w = w.double()  # the sums in float64 whatever the log-probs' dtype (bf16 sums of thousands drift)
    if seq is None:
        num_den = torch.stack([torch.where(valid, w, 0.0).sum(), valid.sum().double()])
    else:
        total = lengths[seq].double()  # the sequence's valid tokens over every CP rank
        share = torch.where(valid, 1.0 / total.clamp(min=1.0), 0.0)
        seq_weight = w * total / count_with_eps(total, mask_dtype)  # verl: masked_mean over the sequence
        num_den = torch.stack([(share * seq_weight).sum(), share.sum()])
    all_reduce_sum_(num_den, group)
    if seq is None and group is None:
        num_den[1] = count_with_eps(num_den[1], mask_dtype)
    mean = num_den[0] / num_den[1].clamp(min=1e-300)
    return torch.where(mean > 1e-8, mean, torch.ones_like(mean))


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
    batch_normalize: bool = False,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """TIS: ``min(exp(old - rollout), cap)`` per token (or per sequence), 0 where not `mask`; detached.

    Shapes as in `policy_loss` (``[B, T]`` rows, or ``[N]`` with `cu_seqlens` / `sequence_ids`); returns
    the log-probs' shape and dtype.
    `cp_group`: with ``level="sequence"`` on CP-local tokens, sums each sequence's log-ratio over it.
    `batch_normalize`: divide by the weights' mean over the global batch (verl's
    ``rollout_is_batch_normalize``: over valid tokens, or over sequences at ``level="sequence"``), taken over
    `group` (the DP group, or DP x CP when the tokens are CP-split; None: this call's tokens). Call once per
    step on each rank's whole share of the batch, like `token_weights`. verl's 1e-8 enters the counts as in
    verl, in a dtype that follows `mask`'s (`_batch_mean`).
    """

    def bounds():
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
            raise ValueError(f"cap must be a positive number, got {cap!r}")
        return {"cap": float(cap)}

    return _is_weights(
        "truncated_is_weights", old_logprobs, rollout_logprobs, mask, level, cu_seqlens, sequence_ids, cp_group,
        batch_normalize, group, bounds, lambda ratio: ratio.clamp(max=float(cap)),
    )  # fmt: skip


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
    batch_normalize: bool = False,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """MIS / icepop: the ratio ``exp(old - rollout)`` where ``lower <= ratio <= upper``, else 0; detached.

    Arguments as in `truncated_is_weights`. A token (or, at ``level="sequence"``, every token of a
    sequence) outside the bounds gets weight 0: it stays in the denominators but adds no gradient (to drop
    it from the denominators too, use `rejection_mask`).
    """

    def bounds():
        for name, v in (("lower", lower), ("upper", upper)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        if not lower < upper:
            raise ValueError(f"lower ({lower}) must be below upper ({upper})")
        return {"lower": float(lower), "upper": float(upper)}

    return _is_weights(
        "masked_is_weights", old_logprobs, rollout_logprobs, mask, level, cu_seqlens, sequence_ids, cp_group,
        batch_normalize, group, bounds, lambda ratio: torch.where((ratio >= lower) & (ratio <= upper), ratio, 0.0),
    )  # fmt: skip


def parse_rejection(rollout_rs: object, rollout_rs_threshold: object) -> tuple[tuple[str, float, float], ...]:
    """verl's ``rollout_rs`` / ``rollout_rs_threshold`` as ``((criterion, lower, upper), ...)`` on the
    statistic's own scale, duplicates dropped: k1 criteria keep ``log(lo) <= stat <= log(hi)`` (a threshold
    ``"lo_hi"``, or one number ``hi`` meaning ``lo = 1 / hi``), the others ``stat <= hi`` (``lower = -inf``).

    `rollout_rs`: comma-separated names of `REJECTION_CRITERIA`; `rollout_rs_threshold`: one positive number
    (or string) for every criterion, or a comma-separated string with one entry per criterion."""
    if not isinstance(rollout_rs, str) or not [c for c in rollout_rs.split(",") if c.strip()]:
        raise ValueError(f"rollout_rs must be a non-empty comma-separated string of {REJECTION_CRITERIA}")
    names: list[str] = []
    for c in (c.strip() for c in rollout_rs.split(",") if c.strip()):
        if c not in REJECTION_CRITERIA:
            raise ValueError(f"rollout_rs: unknown criterion {c!r}; the criteria are {REJECTION_CRITERIA}")
        if c not in names:
            names.append(c)
    if isinstance(rollout_rs_threshold, bool) or not isinstance(rollout_rs_threshold, (int, float, str)):
        raise TypeError(f"rollout_rs_threshold must be a number or a string, got {rollout_rs_threshold!r}")
    specs = [s.strip() for s in str(rollout_rs_threshold).split(",") if s.strip()]
    if len(specs) == 1:
        specs *= len(names)
    if len(specs) != len(names):
        raise ValueError(
            f"rollout_rs_threshold has {len(specs)} entries for {len(names)} criteria {names}: give one for all "
            "or one per criterion"
        )
    out = []
    for name, spec in zip(names, specs):
        try:
            parts = [float(p) for p in spec.split("_")]
        except ValueError:
            raise ValueError(f"rollout_rs_threshold: {spec!r} (for {name}) is not a number") from None
        if len(parts) > (2 if name.endswith("k1") else 1):
            raise ValueError(f"rollout_rs_threshold: {spec!r} (for {name}) takes {'lower_upper' if name.endswith('k1') else 'one upper bound'}")  # noqa: E501
        if not all(0 < p < math.inf for p in parts):
            raise ValueError(f"rollout_rs_threshold: {spec!r} (for {name}) must be finite and > 0")
        if name.endswith("k1"):
            lo, hi = (1.0 / parts[0], parts[0]) if len(parts) == 1 else parts
            if lo > hi:
                raise ValueError(f"rollout_rs_threshold: {spec!r} (for {name}) needs lower <= upper")
            out.append((name, math.log(lo), math.log(hi)))
        else:
            out.append((name, -math.inf, parts[0]))
    return tuple(out)


def rejection_mask(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    rollout_rs: str,
    rollout_rs_threshold: float | str,
    cu_seqlens: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    cp_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """verl's rejection sampling (``rollout_rs``, ``compute_rollout_rejection_mask``): `mask` without the
    tokens, or whole sequences, whose divergence estimate between trainer and rollout passes its threshold.

    With ``r = clamp(old - rollout, +-20)`` at each valid token: ``k1 = -r``, ``k2 = r^2 / 2``,
    ``k3 = exp(r) - 1 - r``. ``token_kX`` judges each token; ``seq_sum_kX`` / ``seq_mean_kX`` /
    ``seq_max_kX`` judge a sequence by the sum / mean (verl's 1e-8 in the count, added as verl adds it for
    `mask`'s dtype: `lmloss.rl.aggregation.count_with_eps`) / max of its valid tokens' ``kX`` and keep or
    drop all of it. k1 criteria keep ``lo <= ratio`` bounds on ``exp(k1)``, the others ``kX <= threshold``.
    Every criterion of the comma-separated `rollout_rs` must pass.

    Args:
        old_logprobs, rollout_logprobs: float ``[B, T]`` or packed ``[N]``, the trainer's and the rollout
            engine's log-probs of the sampled tokens (read detached).
        mask: bool (or 0/1), the log-probs' shape.
        rollout_rs: e.g. ``"token_k1"`` or ``"token_k1,seq_max_k3"`` (`REJECTION_CRITERIA`).
        rollout_rs_threshold: as verl's: one value for every criterion or one per criterion, comma-separated;
            a k1 criterion takes ``"lower_upper"`` ratio bounds (``"0.5_2.0"``) or one upper bound ``u`` (then
            ``lower = 1 / u``), the others one positive upper bound.
        cu_seqlens, sequence_ids: where the sequences are, for ``seq_`` criteria on packed tokens (as in
            `policy_loss`).
        cp_group: with ``seq_`` criteria on CP-local tokens, the sequence statistics are reduced over it.

    Returns:
        bool, the log-probs' shape: `mask` and every criterion passed. Pass it as the loss's mask, and to
        `token_weights`, before anything is normalized: rejected tokens leave the denominators (unlike
        `masked_is_weights`, whose dropped tokens keep counting).
    """
    check_group("cp_group", cp_group)
    error, local = None, {}
    try:
        criteria = parse_rejection(rollout_rs, rollout_rs_threshold)
        old = check_per_token(
            "old_logprobs", old_logprobs, old_logprobs.shape if isinstance(old_logprobs, torch.Tensor) else None
        )
        shape = old.shape
        check_per_token("rollout_logprobs", rollout_logprobs, shape)
        valid = check_mask(mask, shape).reshape(-1)
        per_sequence, n_seq = any(name.startswith("seq_") for name, _, _ in criteria), 0
        if per_sequence:
            seq, n_seq = sequence_index(
                shape, valid.device, cu_seqlens=cu_seqlens, sequence_ids=sequence_ids, need="a seq_ rollout_rs"
            )
        local = dict(
            rollout_rs=sum(1 << REJECTION_CRITERIA.index(name) for name, _, _ in criteria),
            rollout_rs_threshold=zlib.crc32(repr([(lo, hi) for _, lo, hi in criteria]).encode()),
            sequences=n_seq, dtype=DTYPE_CODES.get(old.dtype, -1),
        )  # fmt: skip
    except (TypeError, ValueError) as e:
        error = e
    n_seq = _agree(cp_group, "lmloss.rl.rejection_mask", REJECTION_FIELDS, local, error, old_logprobs,
                   per_rank=("sequences",))  # fmt: skip
    if error is not None:
        raise error

    r = torch.where(valid, (old_logprobs.detach() - rollout_logprobs.detach()).reshape(-1), 0.0)
    r = r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    estimates = {"k1": -r, "k2": 0.5 * r * r, "k3": torch.expm1(r) - r}
    if per_sequence:  # every sum and count in one all-reduce, every max in another
        zero = torch.zeros_like(r)
        cols = [valid.to(r.dtype)] + [torch.where(valid, estimates[k], zero) for k in ("k1", "k2", "k3")]
        sums = sequence_sums(torch.stack(cols, dim=1), seq, n_seq, cp_group)
        maxes = torch.full((n_seq, 2), -math.inf, dtype=r.dtype, device=r.device)
        for j, k in enumerate(("k2", "k3")):  # k2, k3 >= 0: an empty sequence's max is 0, as verl's
            maxes[:, j] = maxes[:, j].scatter_reduce(0, seq, torch.where(valid, estimates[k], zero), "amax")
        if group_size(cp_group) > 1:
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=cp_group)
        maxes = maxes.clamp(min=0.0)
    keep = valid.clone()
    for name, lo, hi in criteria:
        kind, k = name.rsplit("_", 1)
        j = int(k[1]) - 1
        if kind == "token":
            stat = estimates[k]
        elif kind == "seq_sum":
            stat = sums[:, 1 + j][seq]
        elif kind == "seq_mean":
            stat = (sums[:, 1 + j] / count_with_eps(sums[:, 0], mask.dtype))[seq]  # verl: masked_mean
        else:
            stat = maxes[:, j - 1][seq]
        keep &= (stat >= lo) & (stat <= hi)
    return keep.view(shape)
