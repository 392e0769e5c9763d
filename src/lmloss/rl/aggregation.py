"""Per-token weights of a global loss: ``loss = sum(w * per_token_loss)``, whatever the batch split.

Every aggregation mode of an RL actor is linear in the per-token losses once its denominators are known,
so it is a per-token weight ``w``. The denominators (valid tokens, valid sequences, tokens of each prompt
group) belong to the *global* batch; `token_weights` computes them once, on each data-parallel rank's
whole batch (whole sequences, before any context-parallel split or micro-batch slicing), with the counts
summed over the DP group. The weights are then a per-token tensor like any other: `lmloss.cp.split` /
`lmloss.cp.split_batch` and micro-batch slicing carry them, so a sequence split over CP ranks keeps its
global length, and the per-rank, per-micro-batch losses ``sum(w_local * loss_local)`` add up to the global
loss exactly.

Under a group, the ranks first *agree* (`agree_over_group`): one all-gather of a fixed-size vector carries
each rank's options (the mode, the horizon, the dtype...), its local counts and whether its own checks
failed; a failed check or a disagreement raises the same `lmloss.agreement.RankAgreementError` on
every rank, so no rank is left waiting in a collective the others skipped. Every rank then issues the
same collectives.

The convention (lmloss's everywhere, as `cross_entropy(..., mean_group=g)`): per-rank losses *sum* to the
global loss. A data-parallel wrapper that *averages* gradients over ``dp_size`` ranks (DDP, FSDP) needs
each rank's loss multiplied by ``dp_size`` (verl's ``* dp_size`` in ``agg_loss``), or the reduced gradient
is the global one divided by ``dp_size``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lmloss._validate import check_group
from lmloss.agreement import agree_over_group
from lmloss.packing import as_cu_seqlens, check_cu_seqlens
from lmloss.sequences import sequence_sums
from lmloss.vocab_parallel import ProcessGroup, all_reduce_sum_

#: verl's ``loss_agg_mode`` names, and lmloss's prompt-group mode.
LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "prompt-mean-token-mean",
)
#: verl adds this to a token count before dividing by it (``masked_mean``, ``agg_loss``'s
#: ``seq-mean-token-mean``, GMPO's lengths), in a dtype that depends on the mask's: `count_with_eps`.
SEQ_LEN_EPS = 1e-8
#: The fields of `token_weights`' agreement vector; ``tokens``, ``seqs`` and ``prompts`` are this rank's
#: counts (summed / maxed after the gather), every other field must be equal on every rank.
TOKEN_WEIGHT_FIELDS = ("mode", "horizon", "dtype", "prompt_ids", "tokens", "seqs", "prompts")
#: A floating dtype as an agreement field (the groups' functions compare their inputs' dtypes: the all-reduced
#: sums must be of one dtype on every rank).
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}

__all__ = [
    "DTYPE_CODES",
    "LOSS_AGG_MODES",
    "check_ids",
    "check_mask",
    "count_with_eps",
    "group_size",
    "sequence_index",
    "sequence_sums",
    "token_weights",
    "token_weights_with_mask_dtype",
]


def check_mask(mask: object, shape: torch.Size | None = None, *, name: str = "mask") -> torch.Tensor:
    """`mask` as bool, ``[B, T]`` rows or ``[N]`` packed tokens, of `shape` when given.

    A bool tensor, or a numeric one whose every value is 0 or 1 (checked: 0.5 or -1 is a bug upstream,
    not "valid"; this check costs one host sync for a non-bool mask).
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if shape is not None and mask.shape != shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(shape)} (the log-probs')")
    if mask.dim() not in (1, 2):
        raise ValueError(
            f"{name} must be [B, T] (one sequence per row) or [N] (packed), got {tuple(mask.shape)}"
        )
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"{name} must be bool or 0/1, got {mask.dtype}")
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        value = mask[bad][0].item()
        raise ValueError(
            f"{name} must be bool or hold only 0 and 1; it holds {value!r} (a weight is not a mask: pass "
            f"weights as token_weights or rollout_is_weights)"
        )
    return mask != 0


def count_with_eps(count: torch.Tensor, mask_dtype: torch.dtype) -> torch.Tensor:
    """``count + SEQ_LEN_EPS`` as verl makes it from a mask of `mask_dtype`: ``mask.sum(...) + 1e-8``.

    The sum of a floating mask is in the mask's dtype, and the 1e-8 is added there (float64: it stays). The
    sum of a bool or integer mask is an integer tensor, and an integer tensor plus a Python float is in
    torch's default float dtype (float32 unless changed), where ``count + 1e-8`` rounds back to ``count`` for
    any count >= 1. `count`: the mask's count, in any floating dtype that holds it (lmloss counts in
    float64). Returns the sum in the wider of `count`'s dtype and the dtype it was made in, so that a division
    by it runs in that precision as verl's does.
    """
    eps_dtype = mask_dtype if mask_dtype.is_floating_point else torch.get_default_dtype()
    return (count.to(eps_dtype) + SEQ_LEN_EPS).to(torch.promote_types(count.dtype, eps_dtype))


def check_ids(name: str, t: object, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """An integer id tensor of `shape` (float ids would be truncated: 0.9 -> 0), as int64."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (int32 / int64), got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    return t.long()


def sequence_index(
    shape: torch.Size,
    device: torch.device,
    *,
    cu_seqlens: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    need: str,
) -> tuple[torch.Tensor, int]:
    """Each token's sequence, flat int64 ``[N]``, and the number of sequences.

    ``[B, T]``: row b is sequence b. ``[N]``: `sequence_ids` (int ``[N]``, e.g. ``split_batch(...)
    ["sequence_ids"]`` on a CP rank, with `cu_seqlens` giving the count when present) or `cu_seqlens`
    (``[S + 1]``, ending at N). `need` names what requires sequences, for the error message.
    """
    if len(shape) == 2:
        b, t = shape
        return torch.arange(b, device=device).repeat_interleave(t), b
    n = shape[0]
    if sequence_ids is not None:
        ids = check_ids("sequence_ids", sequence_ids, shape).to(device)
        if cu_seqlens is not None:
            count = as_cu_seqlens(cu_seqlens).numel() - 1
        else:
            count = int(ids.max()) + 1 if n else 0
        if n and (int(ids.min()) < 0 or int(ids.max()) >= count):
            raise ValueError(f"sequence_ids must lie in [0, {count}) (the sequences of cu_seqlens)")
        return ids, count
    if cu_seqlens is None:
        raise ValueError(
            f"{need} on packed 1-D tokens needs cu_seqlens (or sequence_ids) to know where sequences are"
        )
    check_packed_cu_seqlens(cu_seqlens, n)
    cu = as_cu_seqlens(cu_seqlens).to(device).long()
    lengths = cu[1:] - cu[:-1]
    return torch.arange(lengths.numel(), device=device).repeat_interleave(lengths), lengths.numel()


def check_packed_cu_seqlens(cu_seqlens: object, n: int) -> None:
    """`cu_seqlens` must be valid boundaries ending at `n` (the packed tokens)."""
    bounds = check_cu_seqlens(cu_seqlens, name="cu_seqlens")
    if bounds[-1] != n:
        raise ValueError(f"cu_seqlens covers {bounds[-1]} tokens but there are {n}: it must end at {n}")


def check_horizon(horizon: object) -> float:
    """verl's ``loss_scale_factor``: a finite number > 0 (inf would zero the loss and nan poison it)."""
    if (
        isinstance(horizon, bool)
        or not isinstance(horizon, (int, float))
        or not math.isfinite(horizon)
        or horizon <= 0
    ):
        raise ValueError(f"horizon must be a finite number > 0, got {horizon!r}")
    return float(horizon)


# ----------------------------------------------------------------------------------- rank agreement


def group_size(group: ProcessGroup | None) -> int:
    """The number of ranks of `group` (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def token_weights(
    mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    cu_seqlens: torch.Tensor | None = None,
    group: ProcessGroup | None = None,
    horizon: float | None = None,
    prompt_ids: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per-token weights ``w`` (`mask`'s shape, `dtype`) such that the loss is ``sum(w * per_token_loss)``.

    Call it once per global batch, on this DP rank's whole sequences (before `lmloss.cp.split` and
    micro-batch slicing, which then carry ``w`` like any per-token tensor). With `group` (the DP group),
    every rank must call it: one all-gather of a fixed-size vector agrees on the mode and options and
    sums the counts (plus one all-reduce of the per-prompt counts in the prompt mode), so each rank's
    weights are its share of the global denominators and the ranks' losses *sum* to the global one. A
    rank whose arguments fail a check, or that disagrees with the others (mode, horizon, dtype, whether
    `prompt_ids` is given), makes every rank raise the same `RankAgreementError`.

    Args:
        mask: bool (or 0/1) ``[B, T]`` (one sequence per row) or ``[N]`` packed tokens; True = counts.
        loss_agg_mode: verl's names (``agg_loss`` in ``verl.trainer.ppo.core_algos``), with ``n`` = valid
            tokens, ``S`` = sequences with a valid token, ``len_s`` = valid tokens of sequence s (all
            global):

            * ``"token-mean"``: ``mask / n``;
            * ``"token-sum"``: ``mask``;
            * ``"seq-mean-token-sum"``: ``mask / S``;
            * ``"seq-mean-token-mean"``: ``mask / ((len_s + 1e-8) * S)``, verl's 1e-8 added as verl adds it
              for a mask of `mask`'s dtype (`count_with_eps`: kept for a float64 mask, rounded away for a
              bool or integer one);
            * ``"seq-mean-token-sum-norm"``: ``mask / (S * horizon)`` (verl: the sequence mean of token sums
              divided by ``loss_scale_factor``; default ``T`` for ``[B, T]`` rows, required for packed
              tokens);
            * ``"prompt-mean-token-mean"``: each prompt group (sequences sharing a `prompt_ids` entry) has
              weight ``1 / G`` (G = groups with a valid token), spread evenly over its valid tokens.
        cu_seqlens: int ``[S + 1]`` sequence boundaries of packed ``[N]`` tokens (ending at N); needed by
            the seq-mean and prompt modes on 1-D input, and checked whenever given.
        group: the data-parallel group the global batch is spread over (None: one process).
        horizon: the constant of ``"seq-mean-token-sum-norm"`` (verl's ``loss_scale_factor``), finite > 0.
            Under `group` the resolved horizon must be equal on every rank (pass it when the ranks' rows
            are padded to different lengths).
        prompt_ids: int ``[S]``, each sequence's prompt group, global ids in ``[0, P)`` (the same id on
            every DP rank for the same prompt); for ``"prompt-mean-token-mean"`` only.
        dtype: of the weights (float64 for float64 losses).

    Returns:
        ``w``, 0 where `mask` is False; all 0 when the global batch has no valid token.
    """
    return token_weights_with_mask_dtype(mask, loss_agg_mode, cu_seqlens, group, horizon, prompt_ids, dtype, None)


def token_weights_with_mask_dtype(mask, loss_agg_mode, cu_seqlens, group, horizon, prompt_ids, dtype, mask_dtype) -> torch.Tensor:
    """`token_weights`; `mask_dtype`: the dtype of the mask the caller was given, where `mask` is already
    its bool (None: `mask`'s own), for verl's 1e-8 in ``seq-mean-token-mean`` (`count_with_eps`)."""
    check_group("group", group)
    distributed = group_size(group) > 1
    error: BaseException | None = None
    local: dict[str, int | float] = {}
    try:
        plan = _local_counts(
            mask, loss_agg_mode, cu_seqlens, horizon, prompt_ids, dtype, need_ints=distributed
        )
        local = plan["agree"]
    except (TypeError, ValueError) as e:
        if not distributed:
            raise
        error, plan = e, None
    if distributed:
        ranks = agree_over_group(
            group, "lmloss.rl.token_weights", TOKEN_WEIGHT_FIELDS, local, per_rank=("tokens", "seqs", "prompts"),
            floats=("horizon",), error=error, like=mask,
        )  # fmt: skip
        n_tokens = float(sum(r["tokens"] for r in ranks))
        n_seqs = float(sum(r["seqs"] for r in ranks))
        n_prompts = max(r["prompts"] for r in ranks)
    else:
        n_tokens, n_seqs, n_prompts = plan["tokens"], plan["seqs"], plan["agree"]["prompts"]
    assert plan is not None
    mode, valid, shape = loss_agg_mode, plan["valid"], plan["shape"]

    def at_least_one(count):  # a count as a tensor >= 1 (0 valid tokens: the weights are 0 anyway)
        return torch.as_tensor(count, dtype=torch.float64, device=valid.device).clamp(min=1.0)

    if mode == "token-sum":
        return valid.view(shape).to(dtype)
    if mode == "token-mean":
        return (valid / at_least_one(n_tokens)).view(shape).to(dtype)
    seq, lengths = plan["seq"], plan["lengths"]
    if mode == "prompt-mean-token-mean":
        return (
            _prompt_weights(valid, seq, lengths, plan["prompt_ids"], int(n_prompts), group)
            .view(shape)
            .to(dtype)
        )
    per_seq = 1.0 / at_least_one(n_seqs)
    if mode == "seq-mean-token-mean":
        counts = count_with_eps(lengths, plan["mask_dtype"] if mask_dtype is None else mask_dtype)
        return (valid * (per_seq / counts)[seq]).view(shape).to(dtype)
    if mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / plan["horizon"]
    return (valid * per_seq).view(shape).to(dtype)


def _local_counts(mask, mode, cu_seqlens, horizon, prompt_ids, dtype, *, need_ints: bool) -> dict:
    """Check `token_weights`' arguments on this rank and count its valid tokens / sequences / prompts.

    Returns the flat float64 validity, sequence index and lengths, the resolved horizon and the fields of
    the agreement vector. Counts are python numbers under a group (they travel in the gather) and 0-d
    tensors otherwise (no host sync on one process).
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")
    if dtype not in DTYPE_CODES:
        raise TypeError(f"dtype must be a floating dtype {tuple(DTYPE_CODES)}, got {dtype!r}")
    given, mask = mask, check_mask(mask)
    shape = mask.shape
    valid = mask.reshape(-1).to(torch.float64)
    if (
        cu_seqlens is not None
    ):  # checked whether or not the mode reads it: wrong boundaries are a bug upstream
        if mask.dim() != 1:
            raise ValueError(f"cu_seqlens is for packed 1-D tokens; the mask has shape {tuple(shape)}")
        check_packed_cu_seqlens(cu_seqlens, shape[0])
    if prompt_ids is not None and mode != "prompt-mean-token-mean":
        raise ValueError(f"prompt_ids is for loss_agg_mode='prompt-mean-token-mean', not {mode!r}")
    resolved = 0.0
    if mode == "seq-mean-token-sum-norm":
        if horizon is None:
            if mask.dim() == 1:
                raise ValueError(
                    "loss_agg_mode='seq-mean-token-sum-norm' on packed 1-D tokens needs horizon (the constant "
                    "verl takes as the response length, loss_scale_factor)"
                )
            horizon = shape[-1]
        resolved = check_horizon(horizon)
    out = dict(valid=valid, shape=shape, horizon=resolved, seq=None, lengths=None, prompt_ids=None,
               mask_dtype=given.dtype)  # fmt: skip
    tokens = valid.sum()
    seqs = torch.zeros((), dtype=torch.float64, device=mask.device)
    n_prompts = 0
    if mode not in ("token-mean", "token-sum"):
        seq, n_seq = sequence_index(shape, mask.device, cu_seqlens=cu_seqlens, need=f"loss_agg_mode={mode!r}")
        lengths = torch.zeros(n_seq, dtype=torch.float64, device=mask.device).index_add_(0, seq, valid)
        seqs = (lengths > 0).sum(dtype=torch.float64)
        out.update(seq=seq, lengths=lengths)
        if mode == "prompt-mean-token-mean":
            if prompt_ids is None:
                raise ValueError(
                    "loss_agg_mode='prompt-mean-token-mean' needs prompt_ids (one group id per sequence)"
                )
            ids = check_ids("prompt_ids", prompt_ids, (n_seq,)).to(mask.device)
            if ids.numel() and int(ids.min()) < 0:
                raise ValueError("prompt_ids must be >= 0")
            n_prompts = int(ids.max()) + 1 if ids.numel() else 0
            out["prompt_ids"] = ids
    if need_ints:
        tokens, seqs = int(tokens.item()), int(seqs.item())
    out.update(tokens=tokens, seqs=seqs)
    out["agree"] = dict(
        mode=LOSS_AGG_MODES.index(mode), horizon=resolved, dtype=DTYPE_CODES[dtype],
        prompt_ids=int(prompt_ids is not None), tokens=tokens if need_ints else 0, seqs=seqs if need_ints else 0,
        prompts=n_prompts,
    )  # fmt: skip
    return out


def _prompt_weights(
    flat: torch.Tensor, seq: torch.Tensor, lengths: torch.Tensor, ids: torch.Tensor, n_prompts: int, group
) -> torch.Tensor:
    """``"prompt-mean-token-mean"``: per-token ``1 / (tokens of its prompt group * groups)``, global counts.

    `n_prompts` is agreed (the largest id + 1 over the group), so every rank all-reduces the same length.
    """
    per_prompt = torch.zeros(n_prompts, dtype=torch.float64, device=lengths.device).index_add_(
        0, ids, lengths
    )
    all_reduce_sum_(per_prompt, group)
    n_groups = (per_prompt > 0).sum(dtype=torch.float64)
    token_prompt = ids[seq]
    return flat / (per_prompt[token_prompt].clamp(min=1.0) * n_groups.clamp(min=1.0))
