"""Preference losses as functions of per-sequence sums: DPO (every TRL 1.16 loss type), KTO, ORPO, CPO.

Every preference loss is a function of a few sums over each sequence's tokens (the policy's log-probs, the
reference's, the token count, ...). This module is that function and the sums' definition; whoever makes the
per-token log-probs (the caller, `lmloss.linear_token_logprobs`, a fused op on the chunk loop,
`lmloss.integrations.trl`) forms the sums and calls it.

The interface (stable: the fused op and the TRL patch call it):

* `SequenceStats`: per-sequence tensors ``[S]``. Paired families (DPO, ORPO, CPO) take TRL's layout:
  ``S = 2B``, sequence ``i < B`` is pair i's chosen completion and sequence ``B + i`` its rejected one
  (packed batches number their sequences the same way). KTO's sequences are unpaired, each marked desirable
  or not (`SequenceStats.desirable`).
* `per_token_weights` (mask, spec) -> ``w`` of each token: 0 where the token does not count, 1 where it
  does, LD-DPO's ``ld_alpha`` for the tokens of a completion beyond its pair's shorter length. A caller that
  sums the log-probs itself forms ``logps[s] = Σ_{t in s} w_t · logp_t`` (and the reference's alike).
* `sequence_stats` (per-token tensors, padded ``[S, T]`` + mask or packed ``[N]`` + ``cu_seqlens`` /
  ``sequence_ids``) -> `SequenceStats`: every sum in one ``index_add`` (`lmloss.rl.aggregation.
  sequence_sums`, summed over ``cp_group`` when the sequences are split over context-parallel ranks).
* `preference_loss` (stats, spec, group=None) -> `PreferenceOutput` ``(loss, metrics)``: the scalar loss, differentiable
  by autograd in ``stats.logps`` and ``stats.sft_logps`` (the sums a fused op sends back per token:
  ``d loss / d logp_t = d loss / d logps[s] · w_t + d loss / d sft_logps[s] · [t in sft set]``), and TRL's
  logged metrics, detached.
* `preference_loss_from_logprobs`: the front door from per-token log-probs (the two calls above).

What is summed (token sets are masks of the caller's layout, prompt tokens excluded as everywhere):

=================  ===============================================================================
``logps``          ``Σ w_t · logp_t`` over the completion's counted tokens (w: `per_token_weights`)
``ref_logps``      the same sum of the reference's log-probs (DPO, KTO; None for ORPO / CPO)
``n_tokens``       the number of counted tokens (unweighted)
``sft_logps``      ``Σ logp_t`` over the NLL term's tokens (``sft_mask``; default the counted tokens;
                   ORPO's is the whole chosen sequence, prompt included, as TRL's)
``sft_tokens``     their number
``wpo_logps``      ``Σ (logp_t − log Σ_v p_v²)`` over the counted tokens (WPO; no gradient)
``entropy``, ``mean_logits``, ``top1``: sums over the counted tokens of the per-token entropy, mean
                   logit over the vocabulary and argmax == label (metrics only)
=================  ===============================================================================

The formulas, with TRL's names, are in docs/preference.md, and so are the deliberate differences from TRL
(each tested): the NLL and averaged terms divide by ``max(count, 1)`` (TRL: NaN for an empty completion),
ORPO's odds-ratio term stays in the input's dtype (TRL rounds it to float32), AlphaPO's reward is
``(1 − exp(−α·logp)) / α`` (TRL's ``p^(−α)`` overflows where ``exp(logp)`` underflows), DPO's ``sft`` type
with WPO weighting is ``mean(w) · sft`` (TRL raises), and no loss keeps state (TRL 1.16's ``bco_pair`` has
no running mean, so neither does this one).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lmloss.agreement import agree_over_group
from lmloss.preference.spec import AGREEMENT_FIELDS, PreferenceSpec
from lmloss.rl.aggregation import DTYPE_CODES, group_size, sequence_index, sequence_sums
from lmloss.vocab_parallel import ProcessGroup

__all__ = [
    "PreferenceOutput",
    "SequenceStats",
    "kto_kl",
    "log1mexp",
    "per_token_weights",
    "preference_loss",
    "preference_loss_from_logprobs",
    "sequence_stats",
]

#: The optional per-sequence sums, in `sequence_stats`' column order after logps / ref_logps / n_tokens.
_METRIC_SUMS = ("entropy", "mean_logits", "top1")


@dataclasses.dataclass
class SequenceStats:
    """Per-sequence sums ``[S]`` (one dtype, floating), the only input of `preference_loss`.

    Paired families: ``S = 2B``, chosen ``[:B]``, rejected ``[B:]``. KTO: `desirable` marks each sequence;
    `kl_logps` / `ref_kl_logps` ``[S']`` are the policy's and the reference's log-prob sums of KTO's
    mismatched (prompt, completion) pairs, from which `kto_kl` estimates the batch KL (no gradient).
    See the module docstring for what each field sums.

    Fields that are None are not known: `preference_loss` raises where its spec needs one."""

    logps: torch.Tensor
    n_tokens: torch.Tensor
    ref_logps: torch.Tensor | None = None
    sft_logps: torch.Tensor | None = None
    sft_tokens: torch.Tensor | None = None
    wpo_logps: torch.Tensor | None = None
    desirable: torch.Tensor | None = None
    kl_logps: torch.Tensor | None = None
    ref_kl_logps: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    top1: torch.Tensor | None = None
    #: this rank's share of the loss: 1, or 1 / CP size where `sequence_stats` summed the sums over a
    #: ``cp_group`` (every CP rank then holds the whole loss; the shares sum to it, lmloss's convention, and the
    #: sums' all-reduce sums the gradients back)
    loss_share: float = 1.0

    @property
    def num_sequences(self) -> int:
        return self.logps.shape[0]


@dataclasses.dataclass
class PreferenceOutput:
    """`preference_loss`'s result: the scalar `loss` (0-dim, the stats' dtype, differentiable) and
    `metrics`: TRL's logged names (``rewards/chosen``, ``logps/rejected``, ``kl``, ``nll_loss``, ...) ->
    detached 0-dim tensors, means over the sequences of every rank of the metrics group."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


# ----------------------------------------------------------------------------------- per-token -> per-sequence


def _positions(mask: torch.Tensor, seq: torch.Tensor, n_seq: int) -> torch.Tensor:
    """Flat int64 ``[N]``: each counted token's rank among its sequence's counted tokens (1, 2, ...), 0 for
    uncounted ones. A sequence's tokens must be contiguous and in order (padded rows, packed sequences)."""
    counted = mask.reshape(-1).long()
    running = counted.cumsum(0)
    before = running - counted  # counted tokens strictly before each token
    start = torch.zeros(n_seq, dtype=torch.long, device=mask.device)
    start = start.scatter_reduce(0, seq, before, reduce="amin", include_self=False)
    return (running - start[seq]) * counted


def per_token_weights(
    mask: torch.Tensor,
    spec: PreferenceSpec,
    *,
    cu_seqlens: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Each token's weight in its sequence's log-prob sum ``logps[s] = Σ w_t · logp_t``, the shape of `mask`.

    Args:
        mask: bool ``[S, T]`` (padded; row s is sequence s) or ``[N]`` (packed, with `cu_seqlens` ``[S + 1]``
            or `sequence_ids` ``[N]``): the tokens that count (the completions' tokens).
        spec: the loss's options; only ``ld_alpha`` changes the weights.
        dtype: the weights' floating dtype.

    Returns ``w``: 0.0 where `mask` is False, 1.0 where it is True, except with ``spec.ld_alpha`` (LD-DPO,
    paired layout ``S = 2B``): a completion's counted tokens beyond the shorter length of its pair (chosen
    ``i``, rejected ``B + i``) weigh ``ld_alpha``. The lengths are those of the tokens given: compute the
    weights on whole sequences, before a context-parallel split.
    """
    mask = _check_mask(mask)
    seq, n_seq = sequence_index(mask.shape, mask.device, cu_seqlens=cu_seqlens, sequence_ids=sequence_ids, need="per_token_weights")
    w = mask.to(dtype)
    if spec.ld_alpha is None:
        return w
    _check_pairs(n_seq, "ld_alpha")
    flat = mask.reshape(-1)
    lengths = torch.zeros(n_seq, dtype=torch.long, device=mask.device).index_add_(0, seq, flat.long())
    b = n_seq // 2
    shared = torch.minimum(lengths[:b], lengths[b:]).repeat(2)
    tail = _positions(mask, seq, n_seq) > shared[seq]
    return torch.where(tail.view(mask.shape), torch.full_like(w, spec.ld_alpha), w)


def _check_mask(mask: object, name: str = "mask") -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dim() not in (1, 2):
        raise ValueError(f"{name} must be [S, T] (padded) or [N] (packed), got shape {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask
    if bool(((mask != 0) & (mask != 1)).any()):  # labels passed as a mask would count their -100s
        raise ValueError(f"{name} must be bool or 0 / 1 (for labels pass labels != ignore_index)")
    return mask != 0


def _check_pairs(n_seq: int, what: str) -> None:
    if n_seq % 2:
        raise ValueError(f"{what} needs pairs: 2B sequences (chosen [:B], rejected [B:]), got {n_seq} sequences")


def _check_like(name: str, t: object, shape: torch.Size) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != shape:
        raise ValueError(f"{name} must have the shape of token_logps {tuple(shape)}, got {tuple(t.shape)}")
    return t


def _check_sequence_args(token_logps, mask, spec, *, ref_token_logps, ref_logps, cu_seqlens, sequence_ids,
                         token_weights, sft_mask, log_sum_sq_probs, entropy, mean_logits, is_top1, desirable,
                         cp_group):
    """`sequence_stats`' local checks; returns (mask as bool, each token's sequence, the number of sequences,
    the token weights)."""
    if not isinstance(token_logps, torch.Tensor) or not token_logps.is_floating_point():
        raise TypeError("token_logps must be a floating torch.Tensor")
    mask = _check_mask(mask)
    shape = token_logps.shape
    if mask.shape != shape:
        raise ValueError(f"mask must have the shape of token_logps {tuple(shape)}, got {tuple(mask.shape)}")
    for name, t in (("ref_token_logps", ref_token_logps), ("token_weights", token_weights),
                    ("sft_mask", sft_mask), ("log_sum_sq_probs", log_sum_sq_probs), ("entropy", entropy),
                    ("mean_logits", mean_logits), ("is_top1", is_top1)):  # fmt: skip
        _check_like(name, t, shape)
    if ref_token_logps is not None and ref_logps is not None:
        raise ValueError("pass ref_token_logps (per token) or ref_logps (per sequence), not both")
    if spec.needs_log_sum_sq_probs and log_sum_sq_probs is None:
        raise ValueError("spec.use_weighting (WPO) needs log_sum_sq_probs (log Σ p² of each token's distribution)")
    seq, n_seq = sequence_index(shape, token_logps.device, cu_seqlens=cu_seqlens, sequence_ids=sequence_ids, need="sequence_stats")
    for name, t in (("ref_logps", ref_logps), ("desirable", desirable)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != (n_seq,)):
            raise ValueError(f"{name} must be a tensor [S] = [{n_seq}] (one value per sequence)")
    if token_weights is None:
        if spec.ld_alpha is not None and group_size(cp_group) > 1:
            raise ValueError(
                "ld_alpha under cp_group: compute per_token_weights on the whole sequences before the CP split "
                "and pass them as token_weights"
            )
        token_weights = per_token_weights(mask, spec, cu_seqlens=cu_seqlens, sequence_ids=sequence_ids, dtype=token_logps.dtype)
    return mask, seq, n_seq, token_weights


def sequence_stats(
    token_logps: torch.Tensor,
    mask: torch.Tensor,
    spec: PreferenceSpec,
    *,
    ref_token_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    sft_mask: torch.Tensor | None = None,
    log_sum_sq_probs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    mean_logits: torch.Tensor | None = None,
    is_top1: torch.Tensor | None = None,
    desirable: torch.Tensor | None = None,
    cp_group: ProcessGroup | None = None,
) -> SequenceStats:
    """`SequenceStats` from per-token tensors (one ``index_add`` for every sum).

    Args:
        token_logps: the policy's log-prob of each token, floating ``[S, T]`` (padded) or ``[N]`` (packed);
            differentiable. Values where `mask` and `sft_mask` are False are not read.
        mask: bool, same shape: the tokens that count (the completions, prompt and padding excluded).
        spec: the loss's options (``ld_alpha`` weights, what is needed).
        ref_token_logps: the reference's per-token log-probs, same shape; or `ref_logps` ``[S]``: its
            per-sequence sums, precomputed (TRL's ``precompute_ref_log_probs``; weighted as `per_token_weights`).
        cu_seqlens / sequence_ids: the packed layout (``[S + 1]`` boundaries / each token's sequence).
        token_weights: `per_token_weights` computed beforehand (required for ``ld_alpha`` under `cp_group`,
            where a rank holds part of each sequence); default: computed here.
        sft_mask: the tokens of the NLL term (ORPO: the chosen sequences' prompt and completion; default
            `mask`).
        log_sum_sq_probs: ``log Σ_v p_v²`` of each token's distribution (WPO; TRL's ``log_sum_sq_probs``),
            same shape: ``logsumexp(2z) − 2·logsumexp(z)`` of the token's logits ``z``.
        entropy, mean_logits, is_top1: per-token by-products for the metrics (entropy, the mean logit over
            the vocabulary, whether the label is the argmax), same shape.
        desirable: bool ``[S]``, KTO's label of each sequence.
        cp_group: the context-parallel group the sequences are split over: the sums are summed over it (and
            ``loss_share`` is 1 / its size).

    Returns the sums in the per-token log-probs' dtype, float32 at least.
    """
    error, seq, n_seq = None, None, -1
    try:  # this rank's checks; under cp_group a failure travels in the agreement and raises on every rank
        mask, seq, n_seq, token_weights = _check_sequence_args(
            token_logps, mask, spec, ref_token_logps=ref_token_logps, ref_logps=ref_logps, cu_seqlens=cu_seqlens,
            sequence_ids=sequence_ids, token_weights=token_weights, sft_mask=sft_mask,
            log_sum_sq_probs=log_sum_sq_probs, entropy=entropy, mean_logits=mean_logits, is_top1=is_top1,
            desirable=desirable, cp_group=cp_group,
        )  # fmt: skip
    except (TypeError, ValueError) as e:
        error = e
    if group_size(cp_group) > 1:  # the all-reduce below needs one shape on every CP rank: agree first
        named = {"ref_logps": ref_token_logps, "sft_logps": spec.needs_sft or None, "wpo_logps": spec.use_weighting or None,
                 "entropy": entropy, "mean_logits": mean_logits, "top1": is_top1}  # fmt: skip
        like = token_logps if isinstance(token_logps, torch.Tensor) else None
        dtype_of = token_logps.dtype if isinstance(token_logps, torch.Tensor) else None
        _agree(cp_group, "lmloss.preference.sequence_stats", spec, dtype_of, like=like, error=error,
               shape=dict(n_seq=n_seq, columns=_bits({k for k, v in named.items() if v is not None})))  # fmt: skip
    if error is not None:
        raise error
    # the sums in float32 at least (a bf16 sum of a long completion's log-probs would lose the margin)
    dtype = torch.promote_types(token_logps.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=token_logps.device)

    def counted(t, where=mask):  # uncounted positions may hold anything (-inf, nan): never multiplied
        return torch.where(where, t.to(dtype), zero).reshape(-1)

    w = token_weights.to(dtype).reshape(-1)
    columns = {"logps": w * counted(token_logps), "n_tokens": mask.reshape(-1).to(dtype)}
    if ref_token_logps is not None:
        columns["ref_logps"] = w * counted(ref_token_logps)
    if spec.needs_sft:
        sft = mask if sft_mask is None else _check_mask(sft_mask, "sft_mask")
        columns["sft_logps"] = counted(token_logps, sft)
        columns["sft_tokens"] = sft.reshape(-1).to(dtype)
    if spec.use_weighting:
        with torch.no_grad():  # WPO's weight is a constant of the step (TRL's no_grad)
            columns["wpo_logps"] = counted(token_logps.detach() - log_sum_sq_probs)
    for name, t in zip(_METRIC_SUMS, (entropy, mean_logits, is_top1)):
        if t is not None:
            columns[name] = counted(t.detach())
    sums = sequence_sums(torch.stack(list(columns.values()), 1), seq, n_seq, cp_group)
    out = dict(zip(columns, sums.unbind(1)))
    out["loss_share"] = 1.0 / group_size(cp_group)
    for name in ("n_tokens", "sft_tokens", "wpo_logps", *_METRIC_SUMS):  # counts and metrics: constants
        if name in out:
            out[name] = out[name].detach()
    if ref_logps is not None:
        out["ref_logps"] = ref_logps.to(dtype)
    if desirable is not None:
        out["desirable"] = desirable.bool()
    return SequenceStats(**out)


# ----------------------------------------------------------------------------------- the rank agreement

#: `SequenceStats`' optional fields, in the order of their bit in the agreement.
_OPTIONAL = ("ref_logps", "sft_logps", "sft_tokens", "wpo_logps", "desirable", "kl_logps", "ref_kl_logps",
             "entropy", "mean_logits", "top1", "logps", "n_tokens")  # fmt: skip


def _bits(present) -> int:
    return sum(1 << i for i, name in enumerate(_OPTIONAL) if name in present)


def _agree(group, what: str, spec: PreferenceSpec, dtype, *, like, shape: dict, error: BaseException | None = None):
    """One all-gather over `group`: the spec (`PreferenceSpec.agreement_values`), the dtype and `shape`'s
    fields must be equal on every rank, and a rank's failed check (`error`) raises on every rank
    (`lmloss.agreement.agree_over_group`)."""
    values = {**spec.agreement_values(), "dtype": DTYPE_CODES.get(dtype, 99), **shape}
    text = ", ".join(f"{k}={v!r}" for k, v in sorted(spec.options().items()))
    agree_over_group(group, what, (*AGREEMENT_FIELDS, "dtype", *shape), values, floats=AGREEMENT_FIELDS,
                     error=error, like=like, text=text)  # fmt: skip


# ----------------------------------------------------------------------------------- the losses


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 − exp(x))`` for ``x < 0``, without cancellation: ``log1p(−exp(x))`` below ``−log 2`` and
    ``log(−expm1(x))`` above (Mächler's split)."""
    return torch.where(x < -math.log(2.0), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _f_scores(logratios: torch.Tensor, spec: PreferenceSpec) -> torch.Tensor:
    """``f'(π/π_ref)`` of the spec's f-divergence at ``log(π/π_ref) = logratios`` (reverse KL: the log-ratio)."""
    kind = spec.f_divergence
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2.0) + F.logsigmoid(logratios)
    if kind == "alpha_divergence" and abs(spec.f_alpha - 1.0) >= 1e-6:  # α -> 1 is reverse KL, as TRL's
        a = spec.f_alpha - 1.0
        # exp clamped at 80 as TRL's (finite in float32); TRL also rounds t to float32 (a deliberate difference)
        return (torch.exp(torch.clamp(a * logratios, max=80.0)) - 1.0) / a
    return logratios


def _smoothed_sigmoid(x: torch.Tensor, eps: float) -> torch.Tensor:
    return -F.logsigmoid(x) * (1 - eps) - F.logsigmoid(-x) * eps


def _clamped(n: torch.Tensor) -> torch.Tensor:
    return n.clamp(min=1.0)


def _dpo_terms(stats: SequenceStats, spec: PreferenceSpec, b: int) -> tuple[torch.Tensor, dict]:
    beta, eps = spec.beta, spec.label_smoothing
    chosen, rejected = stats.logps[:b], stats.logps[b:]
    ref_chosen, ref_rejected = stats.ref_logps[:b], stats.ref_logps[b:]
    chosen_lr, rejected_lr = chosen - ref_chosen, rejected - ref_rejected
    chosen_s, rejected_s = _f_scores(chosen_lr, spec), _f_scores(rejected_lr, spec)
    delta = chosen_s - rejected_s
    n_chosen, n_rejected = _clamped(stats.n_tokens[:b]), _clamped(stats.n_tokens[b:])
    pair_weights = None
    if spec.use_weighting:  # WPO: exp(mean over the completion of logp - log Σ p²), a constant
        w = torch.exp(stats.wpo_logps.detach() / _clamped(stats.n_tokens))
        pair_weights = w[:b] * w[b:]
    loss = stats.logps.new_zeros(())
    for loss_type, weight in zip(spec.loss_type, spec.weights):
        if loss_type == "sigmoid":
            per_pair = -F.logsigmoid(beta * delta)
        elif loss_type == "hinge":
            per_pair = torch.relu(1 - beta * delta)
        elif loss_type == "ipo":  # per-token averages (TRL's choice, confirmed with the IPO authors)
            per_pair = (chosen_s / n_chosen - rejected_s / n_rejected - 1 / (2 * beta)) ** 2
        elif loss_type == "exo_pair":
            x = beta * delta
            per_pair = torch.sigmoid(x) * (F.logsigmoid(x) - math.log1p(-eps)) + torch.sigmoid(-x) * (
                F.logsigmoid(-x) - math.log(eps)
            )
        elif loss_type == "nca_pair":
            rc, rr = beta * chosen_lr, beta * rejected_lr
            per_pair = -F.logsigmoid(rc) - 0.5 * F.logsigmoid(-rc) - 0.5 * F.logsigmoid(-rr)
        elif loss_type == "robust":
            x = beta * delta
            per_pair = (-(1 - eps) * F.logsigmoid(x) + eps * F.logsigmoid(-x)) / (1 - 2 * eps)
        elif loss_type == "bco_pair":
            per_pair = -F.logsigmoid(beta * chosen_lr) - F.logsigmoid(-beta * rejected_lr)
        elif loss_type == "sppo_hard":
            per_pair = (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2
        elif loss_type == "aot":  # sorted over the batch: the pairs' log-ratio margins, policy vs reference
            d = torch.sort(chosen - rejected).values - torch.sort(ref_chosen - ref_rejected).values
            per_pair = _smoothed_sigmoid(beta * d, eps)
        elif loss_type == "aot_unpaired":
            d = torch.sort(chosen_lr).values - torch.sort(rejected_lr).values
            per_pair = _smoothed_sigmoid(beta * d, eps)
        elif loss_type == "apo_zero":
            per_pair = 1 - torch.sigmoid(beta * chosen_lr) + torch.sigmoid(beta * rejected_lr)
        elif loss_type == "apo_down":
            per_pair = torch.sigmoid(beta * chosen_lr) + 1 - torch.sigmoid(beta * (chosen_lr - rejected_lr))
        elif loss_type == "discopop":
            x = beta * delta
            mix = torch.sigmoid(x / spec.discopop_tau)
            per_pair = -F.logsigmoid(x) * (1 - mix) + torch.exp(-x) * mix
        elif loss_type == "sft":  # the chosen completions' token-mean NLL, one value for the batch
            nll = -stats.sft_logps[:b].sum() / _clamped(stats.sft_tokens[:b].sum())
            per_pair = nll.expand(b)
        elif loss_type == "sigmoid_norm":
            per_pair = -F.logsigmoid(beta * (chosen_s / n_chosen - rejected_s / n_rejected))
        else:  # unreachable: the spec checked the names
            raise AssertionError(loss_type)
        if pair_weights is not None:
            per_pair = per_pair * pair_weights
        loss = loss + per_pair.mean() * weight
    chosen_r, rejected_r = beta * chosen_lr.detach(), beta * rejected_lr.detach()
    sums = {
        "rewards/chosen": (chosen_r.sum(), b), "rewards/rejected": (rejected_r.sum(), b),
        "rewards/accuracies": ((chosen_r > rejected_r).sum(), b), "rewards/margins": ((chosen_r - rejected_r).sum(), b),
        "logps/chosen": (chosen.detach().sum(), b), "logps/rejected": (rejected.detach().sum(), b),
    }  # fmt: skip
    return loss, sums


def kto_kl(stats: SequenceStats, group: ProcessGroup | None = None) -> torch.Tensor:
    """KTO's batch KL estimate, detached 0-dim: ``max(0, mean over ranks of mean(kl_logps − ref_kl_logps))``
    (TRL's: each rank's mean over its mismatched pairs, gathered, averaged, clamped at 0); 0 without
    `stats.kl_logps`."""
    if stats.kl_logps is None:
        return stats.logps.new_zeros(()).detach()
    if stats.ref_kl_logps is None or stats.ref_kl_logps.shape != stats.kl_logps.shape:
        raise ValueError("SequenceStats.ref_kl_logps must be given with kl_logps, of its shape")
    kl = (stats.kl_logps - stats.ref_kl_logps).detach().to(stats.logps.dtype).mean()
    if group_size(group) > 1:
        kl = kl.clone()
        dist.all_reduce(kl, group=group)
        kl = kl / group_size(group)
    return kl.clamp(min=0)


def _kto_terms(stats: SequenceStats, spec: PreferenceSpec, group) -> tuple[torch.Tensor, dict]:
    beta = spec.beta
    kl = kto_kl(stats, group) if spec.loss_type == ("kto",) else stats.logps.new_zeros(())
    d = stats.desirable
    logratios = stats.logps - stats.ref_logps
    chosen_lr, rejected_lr = logratios[d], logratios[~d]
    if spec.loss_type == ("kto",):
        chosen_l = 1 - torch.sigmoid(beta * (chosen_lr - kl))
        rejected_l = 1 - torch.sigmoid(beta * (kl - rejected_lr))
    else:  # apo_zero_unpaired
        chosen_l = 1 - torch.sigmoid(beta * chosen_lr)
        rejected_l = torch.sigmoid(beta * rejected_lr)
    losses = torch.cat((spec.desirable_weight * chosen_l, spec.undesirable_weight * rejected_l))
    loss = losses.nanmean()
    nc, nr = chosen_lr.numel(), rejected_lr.numel()
    sums = {
        "rewards/chosen": ((beta * chosen_lr.detach()).nansum(), nc),
        "rewards/rejected": ((beta * rejected_lr.detach()).nansum(), nr),
        "logps/chosen": (stats.logps[d].detach().nansum(), nc),
        "logps/rejected": (stats.logps[~d].detach().nansum(), nr),
        "kl": (kl.detach(), None),
    }
    return loss, sums


def _nll(stats: SequenceStats, b: int) -> torch.Tensor:
    """The chosen sequences' token-mean NLL over the SFT tokens (TRL's ``CrossEntropyLoss()`` on them)."""
    return -stats.sft_logps[:b].sum() / _clamped(stats.sft_tokens[:b].sum())


def _orpo_terms(stats: SequenceStats, spec: PreferenceSpec, b: int) -> tuple[torch.Tensor, dict]:
    avg = stats.logps / _clamped(stats.n_tokens)  # ORPO's odds use per-token mean log-probs
    chosen, rejected = avg[:b], avg[b:]
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    nll = _nll(stats, b)
    loss = nll - (spec.beta * ratio).mean()
    chosen_r, rejected_r = spec.beta * chosen.detach(), spec.beta * rejected.detach()
    sums = _reward_sums(chosen_r, rejected_r, chosen.detach(), rejected.detach(), b)
    sums.update({"nll_loss": (nll.detach(), None), "log_odds_ratio": (ratio.detach().sum(), b),
                 "log_odds_chosen": (log_odds.detach().sum(), b)})  # fmt: skip
    return loss, sums


def _reward_sums(chosen_r, rejected_r, chosen, rejected, b: int) -> dict:
    return {
        "rewards/chosen": (chosen_r.sum(), b), "rewards/rejected": (rejected_r.sum(), b),
        "rewards/accuracies": ((chosen_r > rejected_r).sum(), b), "rewards/margins": ((chosen_r - rejected_r).sum(), b),
        "logps/chosen": (chosen.sum(), b), "logps/rejected": (rejected.sum(), b),
    }  # fmt: skip


def _cpo_terms(stats: SequenceStats, spec: PreferenceSpec, b: int) -> tuple[torch.Tensor, dict]:
    (loss_type,) = spec.loss_type
    beta, eps = spec.beta, spec.label_smoothing
    lp = stats.logps / _clamped(stats.n_tokens) if loss_type in ("ipo", "simpo") else stats.logps
    chosen, rejected = lp[:b], lp[b:]
    if spec.alpha != 0.0:  # AlphaPO: r = (1 − p^(−α)) / α, written with exp so that p = 0 does not overflow
        chosen_r, rejected_r = ((1 - torch.exp(-spec.alpha * x)) / spec.alpha for x in (chosen, rejected))
    else:
        chosen_r, rejected_r = chosen, rejected
    margin = chosen_r - rejected_r
    if loss_type == "simpo":
        losses = _smoothed_sigmoid(beta * (margin - spec.simpo_gamma / beta), eps)
    elif loss_type == "sigmoid":
        losses = _smoothed_sigmoid(beta * margin, eps)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * margin)
    else:  # ipo
        losses = (margin - 1 / (2 * beta)) ** 2
    loss = losses.mean()
    nll = _nll(stats, b) if spec.cpo_alpha != 0.0 else loss.new_zeros(())
    loss = loss + spec.cpo_alpha * nll
    sums = _reward_sums(beta * chosen_r.detach(), beta * rejected_r.detach(), chosen.detach(), rejected.detach(), b)
    sums["nll_loss"] = (nll.detach(), None)
    return loss, sums


def _by_product_sums(stats: SequenceStats, spec: PreferenceSpec, b: int) -> dict:
    """TRL's per-token metrics (DPO / KTO): the token-mean entropy over every counted token, the mean logit
    over the chosen / rejected tokens, the chosen tokens' argmax accuracy."""
    sums: dict = {}
    n = stats.n_tokens
    chosen = stats.desirable if spec.family == "kto" else torch.arange(n.numel(), device=n.device) < b
    if stats.entropy is not None:
        sums["entropy"] = (stats.entropy.sum(), n.sum())
    if stats.mean_logits is not None:
        sums["logits/chosen"] = (stats.mean_logits[chosen].sum(), n[chosen].sum())
        sums["logits/rejected"] = (stats.mean_logits[~chosen].sum(), n[~chosen].sum())
    if stats.top1 is not None and spec.family == "dpo":
        sums["mean_token_accuracy"] = (stats.top1[chosen].sum(), n[chosen].sum())
    return sums


def _reduce_metrics(sums: dict, dtype, device, group: ProcessGroup | None) -> dict[str, torch.Tensor]:
    """``{name: (sum, count)}`` -> ``{name: sum / count}`` with sums and counts summed over `group` (one
    all-reduce); a count of None: the value is already a mean, averaged over the ranks; a count of 0: left out
    (TRL logs nothing then)."""
    names = list(sums)
    values = torch.stack([torch.as_tensor(sums[k][0], dtype=dtype, device=device).detach() for k in names]) if names else None
    counts = torch.stack(
        [torch.as_tensor(1.0 if sums[k][1] is None else sums[k][1], dtype=dtype, device=device).detach() for k in names]
    ) if names else None
    if names and group_size(group) > 1:
        both = torch.cat([values, counts])
        dist.all_reduce(both, group=group)
        values, counts = both[: len(names)], both[len(names) :]
    return {k: values[i] / counts[i] for i, k in enumerate(names) if counts[i] > 0}


def _check_stats(stats: SequenceStats, spec: PreferenceSpec) -> None:
    """The sums `spec` needs are there, in a layout it can read (ValueError naming the field)."""
    if spec.needs_reference and stats.ref_logps is None:
        raise ValueError(f"family {spec.family!r} needs the reference's sums (SequenceStats.ref_logps)")
    if spec.use_weighting and stats.wpo_logps is None:
        raise ValueError("use_weighting (WPO) needs SequenceStats.wpo_logps")
    if spec.needs_sft and (stats.sft_logps is None or stats.sft_tokens is None):
        raise ValueError("this loss has an NLL term: SequenceStats.sft_logps / sft_tokens are needed")
    if spec.family == "kto":
        if stats.desirable is None:
            raise ValueError("family 'kto' needs SequenceStats.desirable (bool [S]: each sequence's label)")
        if spec.loss_type == ("kto",) and stats.kl_logps is None:
            raise ValueError("loss_type 'kto' needs SequenceStats.kl_logps / ref_kl_logps (the mismatched pairs' sums)")
    else:
        _check_pairs(stats.num_sequences, f"family {spec.family!r}")


def preference_loss(
    stats: SequenceStats, spec: PreferenceSpec, *, group: ProcessGroup | None = None
) -> PreferenceOutput:
    """The preference loss of `spec` from per-sequence sums (`SequenceStats`), with TRL's metrics.

    Differentiable by autograd in ``stats.logps`` and ``stats.sft_logps`` (and the reference's sums, if they
    require grad). The loss is this rank's: TRL's mean over this rank's pairs (DPO, ORPO, CPO) or sequences
    (KTO), as each DDP rank computes it. `group` (the data-parallel group; None: one process) is where KTO's
    batch KL is averaged and the metrics are reduced (sums and counts over every rank's sequences, as TRL's
    ``gather_for_metrics``); the loss's value does not depend on it except through KTO's KL. Under `group`
    the ranks first agree on the spec and on which sums they hold (one all-gather): a disagreement, or a
    check failed on one rank, raises `lmloss.agreement.RankAgreementError` on every rank. ``stats.loss_share``
    scales the loss (1 / CP size after a `sequence_stats` over ``cp_group``: the ranks' losses sum to it).

    Raises ValueError where `stats` lacks a sum the spec needs (the reference's for DPO / KTO, the NLL's for
    ORPO, CPO with ``cpo_alpha`` and DPO's ``sft``, ``wpo_logps`` with ``use_weighting``, ``desirable`` for
    KTO) or the paired families get an odd number of sequences.
    """
    error = None
    try:  # this rank's checks; under `group` a failure travels in the agreement and raises on every rank
        if not isinstance(spec, PreferenceSpec):
            raise TypeError(f"spec must be a PreferenceSpec, got {type(spec).__name__}")
        if not isinstance(stats, SequenceStats):
            raise TypeError(f"stats must be a SequenceStats, got {type(stats).__name__}")
        _check_stats(stats, spec)
    except (TypeError, ValueError) as e:
        error = e
    if group_size(group) > 1:  # the metrics' all-reduce (and KTO's KL) need one shape: agree, raise alike
        valid = error is None or isinstance(stats, SequenceStats) and isinstance(spec, PreferenceSpec)
        present = {f.name for f in dataclasses.fields(stats) if getattr(stats, f.name) is not None} if valid else set()
        like = stats.logps if valid else None
        _agree(group, "lmloss.preference.preference_loss", spec if valid else PreferenceSpec(),
               None if like is None else like.dtype, like=like, shape=dict(fields=_bits(present)), error=error)  # fmt: skip
    if error is not None:
        raise error
    n_seq = stats.num_sequences
    if spec.family == "kto":
        loss, sums = _kto_terms(stats, spec, group)
        b = 0
    else:
        _check_pairs(n_seq, f"family {spec.family!r}")
        b = n_seq // 2
        terms = {"dpo": _dpo_terms, "orpo": _orpo_terms, "cpo": _cpo_terms}[spec.family]
        loss, sums = terms(stats, spec, b)
    loss = loss * stats.loss_share
    sums.update(_by_product_sums(stats, spec, b))
    metrics = _reduce_metrics(sums, stats.logps.dtype, stats.logps.device, group)
    if spec.family == "kto" and "rewards/chosen" in metrics and "rewards/rejected" in metrics:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return PreferenceOutput(loss=loss, metrics=metrics)


def preference_loss_from_logprobs(
    token_logps: torch.Tensor,
    mask: torch.Tensor,
    spec: PreferenceSpec,
    *,
    ref_token_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    sft_mask: torch.Tensor | None = None,
    log_sum_sq_probs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    mean_logits: torch.Tensor | None = None,
    is_top1: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    desirable: torch.Tensor | None = None,
    kl_stats: SequenceStats | None = None,
    cp_group: ProcessGroup | None = None,
    group: ProcessGroup | None = None,
) -> PreferenceOutput:
    """`preference_loss` of per-token log-probs: `sequence_stats`, then `preference_loss`.

    `token_logps`, `mask` and the other per-token arguments as in `sequence_stats` (padded ``[2B, T]``
    with chosen rows first, or packed ``[N]`` with `cu_seqlens` / `sequence_ids`). KTO's mismatched pairs:
    `kl_stats`, the `SequenceStats` of their log-probs (``sequence_stats(kl_logps, kl_mask, spec,
    ref_token_logps=ref_kl_logps)``; only its ``logps`` and ``ref_logps`` are read). `cp_group`: as in
    `sequence_stats`; `group`: as in `preference_loss`.

    Example (DPO, sigmoid; reference log-probs per token)::

        spec = PreferenceSpec(beta=0.1)
        out = preference_loss_from_logprobs(logps, completion_mask, spec, ref_token_logps=ref_logps)
        out.loss.backward()
    """
    stats = sequence_stats(
        token_logps, mask, spec, ref_token_logps=ref_token_logps, ref_logps=ref_logps, cu_seqlens=cu_seqlens,
        sequence_ids=sequence_ids, sft_mask=sft_mask, log_sum_sq_probs=log_sum_sq_probs, entropy=entropy,
        mean_logits=mean_logits, is_top1=is_top1, token_weights=token_weights, desirable=desirable,
        cp_group=cp_group,
    )  # fmt: skip
    if kl_stats is not None:
        stats.kl_logps, stats.ref_kl_logps = kl_stats.logps.detach(), kl_stats.ref_logps
    return preference_loss(stats, spec, group=group)
