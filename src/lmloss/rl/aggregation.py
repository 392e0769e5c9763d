"""Per-token weights of a global loss: ``loss = sum(w * per_token_loss)``, whatever the batch split.

Every aggregation mode of an RL actor is linear in the per-token losses once its denominators are known,
so it is a per-token weight ``w``. The denominators (valid tokens, valid sequences, tokens of each prompt
group) belong to the *global* batch; `token_weights` computes them once, on each data-parallel rank's
whole batch (whole sequences, before any context-parallel split or micro-batch slicing), with the counts
summed over the DP group. The weights are then a per-token tensor like any other: `lmloss.cp.split` /
`lmloss.cp.split_batch` and micro-batch slicing carry them, so a sequence split over CP ranks keeps its
global length, and the per-rank, per-micro-batch losses ``sum(w_local * loss_local)`` add up to the global
loss exactly.

The convention (lmloss's everywhere, as `cross_entropy(..., mean_group=g)`): per-rank losses *sum* to the
global loss. A data-parallel wrapper that *averages* gradients over ``dp_size`` ranks (DDP, FSDP) needs
each rank's loss multiplied by ``dp_size`` (verl's ``* dp_size`` in ``agg_loss``), or the reduced gradient
is the global one divided by ``dp_size``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lmloss.packing import as_cu_seqlens, check_cu_seqlens
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
#: verl adds this to each sequence's token count in ``seq-mean-token-mean`` (kept for parity).
SEQ_LEN_EPS = 1e-8

__all__ = ["LOSS_AGG_MODES", "check_mask", "sequence_index", "token_weights"]


def check_mask(mask: object, shape: torch.Size | None = None, *, name: str = "mask") -> torch.Tensor:
    """`mask` as bool (nonzero = valid), ``[B, T]`` rows or ``[N]`` packed tokens, of `shape` when given."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if shape is not None and mask.shape != shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(shape)} (the log-probs')")
    if mask.dim() not in (1, 2):
        raise ValueError(
            f"{name} must be [B, T] (one sequence per row) or [N] (packed), got {tuple(mask.shape)}"
        )
    return mask if mask.dtype == torch.bool else mask != 0


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
        if not isinstance(sequence_ids, torch.Tensor) or sequence_ids.shape != shape:
            got = (
                tuple(sequence_ids.shape)
                if isinstance(sequence_ids, torch.Tensor)
                else type(sequence_ids).__name__
            )
            raise ValueError(f"sequence_ids must be an int tensor of shape {tuple(shape)}, got {got}")
        ids = sequence_ids.to(device).long()
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
    bounds = check_cu_seqlens(cu_seqlens, name="cu_seqlens")
    if bounds[-1] != n:
        raise ValueError(f"cu_seqlens covers {bounds[-1]} tokens but there are {n}: it must end at {n}")
    cu = as_cu_seqlens(cu_seqlens).to(device).long()
    lengths = cu[1:] - cu[:-1]
    return torch.arange(lengths.numel(), device=device).repeat_interleave(lengths), lengths.numel()


def token_weights(
    mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    cu_seqlens: torch.Tensor | None = None,
    group: ProcessGroup | None = None,
    horizon: int | None = None,
    prompt_ids: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per-token weights ``w`` (`mask`'s shape, `dtype`) such that the loss is ``sum(w * per_token_loss)``.

    Call it once per global batch, on this DP rank's whole sequences (before `lmloss.cp.split` and
    micro-batch slicing, which then carry ``w`` like any per-token tensor). With `group` (the DP group),
    the counts are summed over it (one all-reduce of a few numbers; every rank must call), so each
    rank's weights are its share of the global denominators and the ranks' losses *sum* to the global one.

    Args:
        mask: bool (or 0/1) ``[B, T]`` (one sequence per row) or ``[N]`` packed tokens; True = counts.
        loss_agg_mode: verl's names, with ``n`` = valid tokens, ``S`` = sequences with a valid token,
            ``len_s`` = valid tokens of sequence s (all global):

            * ``"token-mean"``: ``mask / n``;
            * ``"token-sum"``: ``mask``;
            * ``"seq-mean-token-sum"``: ``mask / S``;
            * ``"seq-mean-token-mean"``: ``mask / ((len_s + 1e-8) * S)`` (verl's 1e-8);
            * ``"seq-mean-token-sum-norm"``: ``mask / horizon`` (Dr. GRPO: a constant; default ``T`` for
              ``[B, T]`` rows, required for packed tokens);
            * ``"prompt-mean-token-mean"``: each prompt group (sequences sharing a `prompt_ids` entry) has
              weight ``1 / G`` (G = groups with a valid token), spread evenly over its valid tokens.
        cu_seqlens: int ``[S + 1]`` sequence boundaries of packed ``[N]`` tokens (ending at N); needed by
            the seq-mean and prompt modes on 1-D input.
        group: the data-parallel group the global batch is spread over (None: one process).
        horizon: the constant of ``"seq-mean-token-sum-norm"``.
        prompt_ids: int ``[S]``, each sequence's prompt group, global ids in ``[0, P)`` (the same id on
            every DP rank for the same prompt); for ``"prompt-mean-token-mean"`` only.
        dtype: of the weights (float64 for float64 losses).

    Returns:
        ``w``, 0 where `mask` is False; all 0 when the global batch has no valid token.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    mask = check_mask(mask)
    valid = mask.to(torch.float64)
    if loss_agg_mode == "token-sum":
        return valid.to(dtype)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if horizon is None:
            if mask.dim() == 1:
                raise ValueError(
                    "loss_agg_mode='seq-mean-token-sum-norm' on packed 1-D tokens needs horizon (the constant "
                    "verl takes as the response length)"
                )
            horizon = mask.shape[-1]
        if isinstance(horizon, bool) or not isinstance(horizon, (int, float)) or horizon <= 0:
            raise ValueError(f"horizon must be a positive number, got {horizon!r}")
        return (valid / float(horizon)).to(dtype)
    if loss_agg_mode == "token-mean":
        count = valid.sum().reshape(1)
        all_reduce_sum_(count, group)
        return torch.where(count > 0, valid / count.clamp(min=1.0), 0.0).to(dtype)

    seq, n_seq = sequence_index(
        mask.shape, mask.device, cu_seqlens=cu_seqlens, need=f"loss_agg_mode={loss_agg_mode!r}"
    )
    flat = valid.reshape(-1)
    lengths = torch.zeros(n_seq, dtype=torch.float64, device=mask.device).index_add_(0, seq, flat)
    if loss_agg_mode == "prompt-mean-token-mean":
        return _prompt_weights(flat, seq, lengths, prompt_ids, group).view(mask.shape).to(dtype)
    if prompt_ids is not None:
        raise ValueError(f"prompt_ids is for loss_agg_mode='prompt-mean-token-mean', not {loss_agg_mode!r}")
    n_valid_seqs = (lengths > 0).sum(dtype=torch.float64).reshape(1)
    all_reduce_sum_(n_valid_seqs, group)
    per_seq = 1.0 / n_valid_seqs.clamp(min=1.0)
    if loss_agg_mode == "seq-mean-token-mean":
        per_seq = per_seq / (lengths + SEQ_LEN_EPS)
        return (flat * per_seq[seq]).view(mask.shape).to(dtype)
    return (flat * per_seq).view(mask.shape).to(dtype)


def _prompt_weights(
    flat: torch.Tensor, seq: torch.Tensor, lengths: torch.Tensor, prompt_ids: torch.Tensor | None, group
) -> torch.Tensor:
    """``"prompt-mean-token-mean"``: per-token ``1 / (tokens of its prompt group * groups)``, global counts."""
    if prompt_ids is None:
        raise ValueError(
            "loss_agg_mode='prompt-mean-token-mean' needs prompt_ids (one group id per sequence)"
        )
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.shape != lengths.shape:
        got = tuple(prompt_ids.shape) if isinstance(prompt_ids, torch.Tensor) else type(prompt_ids).__name__
        raise ValueError(
            f"prompt_ids must be an int tensor [{lengths.numel()}] (one per sequence), got {got}"
        )
    ids = prompt_ids.to(lengths.device).long()
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError("prompt_ids must be >= 0")
    # every rank needs the same dense length: agree on the largest id first (a MAX of one number)
    size = torch.tensor([int(ids.max()) + 1 if ids.numel() else 0], dtype=torch.int64, device=lengths.device)
    if group is not None:
        dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group)
    per_prompt = torch.zeros(int(size.item()), dtype=torch.float64, device=lengths.device).index_add_(
        0, ids, lengths
    )
    all_reduce_sum_(per_prompt, group)
    n_groups = (per_prompt > 0).sum(dtype=torch.float64)
    token_prompt = ids[seq]
    return flat / (per_prompt[token_prompt].clamp(min=1.0) * n_groups.clamp(min=1.0))
