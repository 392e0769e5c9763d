"""The policy objective fused into the LM head: `linear_policy_loss`, three matmuls for token-separable
objectives.

A token-separable objective's loss is ``sum_t w_t * L_t(lp_t, H_t)``: once a chunk's log-probs and
entropies are known (in the forward), so are ``dL/dlp`` and ``dL/dH`` for its tokens. The chunk loop
(`lmloss.plan`, the softmax objective with an upstream: `PolicyUpstream`) asks for them per chunk, turns
them into the gradient form's coefficients and hands the chunk's d-logits to the head's accumulators while
the logits are at hand (`lmloss.functions.SummedLoss`): no second pass, no recomputed logits. The
per-token derivative is taken by autograd of `Objective.per_token` on the chunk's ``[c]`` vectors (the
same code as `policy_loss`; negligible next to the ``[c, V]`` work). The sequence objectives (gspo, geo_mean,
vespo: one ratio or weight per sequence, not known until every chunk is done) and the covariance selections
(clip_cov, kl_cov: batch statistics) are sequence objectives of the same loop (`lmloss.sequences`,
`PolicySequenceObjective`): the per-token log-probs in one walk, the per-sequence sums (over `cp_group`) and
the loss (`objective_loss`, `policy_loss`'s evaluation) in autograd, then the backward's walk recomputes the
logits (4 matmuls per chunk).

Under the sampler's distribution (``top_k`` / ``top_p`` / ``min_p``, or a replayed ``support``) the
log-probs and entropies are those of the kept set, renormalised, and the gradient stays on the kept set;
a token whose label lies outside it (log-prob -inf: the trainer's truncation differs from the engine's)
is left out of the objective, with a warning: its term is 0, while the aggregation's denominators, fixed
by the caller's mask once per batch, still count it.
"""

from __future__ import annotations

import math

import torch

from lmloss import _validate, replay
from lmloss.agreement import generator_state
from lmloss.distill import second_head
from lmloss.functions import Op, PerTokenLoss, SummedLoss
from lmloss.fused import prepare
from lmloss.metrics import StatsTracker
from lmloss.objectives import DivergenceObjective, DivergenceSpec, Reference, SoftmaxObjective
from lmloss.rl.aggregation import check_mask, group_size, sequence_index
from lmloss.rl.objectives import (
    SELECTION_MODES,
    SEQUENCE_MODES,
    Objective,
    PerToken,
    agree_over_cp,
    check_kl_arguments,
    check_sequences,
    check_weights_or_mode,
    covariance_selection,
    objective_loss,
    policy_agreement_fields,
    record_metrics,
    token_weights_of,
)
from lmloss.rows import Rows
from lmloss.sampling import make_sampling, report_dropped
from lmloss.sequences import Sequences, sequence_loss
from lmloss.vocab_parallel import ProcessGroup

__all__ = ["linear_policy_loss"]


def check_reference_head(ref_hidden, ref_weight, hidden, weight) -> None:
    """The reference head covers the policy's vocabulary shard and its tokens (local checks)."""
    _validate.check_floating("ref_hidden", ref_hidden)
    _validate.check_floating("ref_weight", ref_weight)
    if ref_weight.dim() != 2 or ref_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"ref_weight must be [V_local, H_ref] with the policy's V_local={weight.shape[0]}, got {tuple(ref_weight.shape)}"
        )
    if ref_hidden.shape[:-1] != hidden.shape[:-1] or ref_hidden.shape[-1] != ref_weight.shape[1]:
        raise ValueError(
            f"ref_hidden {tuple(ref_hidden.shape)} must have the policy's tokens {tuple(hidden.shape[:-1])} and "
            f"ref_weight's width {ref_weight.shape[1]}"
        )
    if ref_hidden.dtype != ref_weight.dtype:
        raise TypeError(f"ref_hidden ({ref_hidden.dtype}) and ref_weight ({ref_weight.dtype}) differ in dtype")
    if ref_hidden.device != hidden.device or ref_weight.device != weight.device:
        raise ValueError("ref_hidden / ref_weight must be on the policy's devices")


#: The per-logit working set of a policy loss with a softcap on the PyTorch kernels (measured: the default 8
#: bytes and the slope's and its work buffer's beside them).
SOFTCAP_BYTES_PER_LOGIT = 16


def _full_kl_chunk_bytes(softcap, weight, ref_weight) -> dict:
    """The per-logit working set of ``kl_loss_type="full"`` for ``chunk_size="auto"`` (`lmloss.fused.prepare`):
    folded on the PyTorch kernels, the policy's chunk (worked in place), the reference's (``x - x_ref``, then its
    product with the exps) and the exps: three values (fp32: 12 bytes). Otherwise five fp32 values, and a low-
    precision reference head's own matmul output beside them (the policy's is counted by `prepare`)."""
    folded_torch = not softcap and ref_weight is not None and weight.dtype == ref_weight.dtype in (torch.float32, torch.float64)
    ref_lowp = ref_weight is not None and ref_weight.dtype in (torch.bfloat16, torch.float16)
    unfolded = (40 if softcap else 20) + (ref_weight.element_size() if ref_lowp else 0)  # softcap: both slopes too
    return dict(bytes_per_logit=3 * weight.element_size() if folded_torch else unfolded, chunk_buffers=3 if softcap else 2)


class PolicyUpstream:
    """The upstream of an RL objective for the chunk loop (`lmloss.objectives.Upstream`): per chunk,
    ``d(sum_t w_t L_t)/d lp`` and ``d/dH`` by autograd of `Objective.per_token` on the chunk's ``[c]``
    vectors, and each token's term ``w_t L_t`` (the loop keeps them; the loss is their float64 sum)."""

    def __init__(self, objective: Objective, x: PerToken) -> None:
        self.objective, self.x = objective, x

    def _terms(self, rows: Rows, lp, ent, dropped, kl=None) -> torch.Tensor:
        x = self.x

        def take(t):
            return None if t is None else rows.take(t)

        mask = take(x.mask) if dropped is None else take(x.mask) & ~dropped
        if dropped is not None:  # outside the kept set: -inf, left out of the objective (and finite here)
            lp = torch.where(dropped, 0.0, lp)
        per_tok, _ = self.objective.per_token(
            lp, take(x.old_logprobs), take(x.advantages), mask, ref_logprobs=take(x.ref_logprobs), entropy=ent,
            rollout_is_weights=take(x.rollout_is_weights), pg_mask=take(x.pg_mask), kl=kl,
        )  # fmt: skip
        return torch.where(mask, take(x.token_weights) * per_tok, 0.0)

    def __call__(self, rows: Rows, stats: dict) -> tuple[dict, torch.Tensor]:
        with torch.enable_grad():
            given = {k: stats.get(k) for k in ("logprobs", "entropy", "kl")}
            leaves = {k: v.detach().requires_grad_(True) for k, v in given.items() if v is not None}
            terms = self._terms(
                rows, leaves["logprobs"], leaves.get("entropy"), stats.get("dropped"), leaves.get("kl")
            )  # fmt: skip
            grads = torch.autograd.grad(terms.sum(), list(leaves.values()), allow_unused=True)
        out = {k: (None if g is None else g.detach()) for k, g in zip(leaves, grads)}
        if out["logprobs"] is None:
            out["logprobs"] = torch.zeros_like(leaves["logprobs"]).detach()
        return out, terms.detach()

    def evaluate(self, results: dict) -> torch.Tensor:
        """The objective over all tokens at once (no gradient was made chunk by chunk), float64."""
        lp = results["logprobs"]
        terms = self._terms(Rows(0, lp.shape[0]), lp, results.get("entropy"), results.get("dropped"), results.get("kl"))
        return terms.double().sum()

    def finish_total(self, total: torch.Tensor, results: dict) -> torch.Tensor:
        return total.to(torch.promote_types(results["logprobs"].dtype, self.x.token_weights.dtype))

    def extra_outputs(self, results: dict) -> tuple[torch.Tensor, ...]:
        """The per-token log-probs, entropies and full KL the loop computed, for the metrics."""
        return tuple(results[k] for k in ("logprobs", "entropy", "kl") if k in results)


class PolicySequenceObjective:
    """A sequence or selection objective (gspo, geo_mean, vespo; clip_cov, kl_cov) of the loop's per-token
    log-probs (and entropies): `lmloss.sequences.SequenceObjective`. Its columns are
    `Objective.sequence_columns`, summed per sequence (over `cp_group`); its value `objective_loss` with
    each token's sequence's sums, or the covariance selection. Under a sampler's truncation (`labels` given)
    a token whose label lies outside the kept set leaves the objective (warned), its weight kept in the
    denominators the caller's mask fixed."""

    def __init__(self, objective: Objective, x: PerToken, sequences: Sequences | None, *, kl, labels, ignore_index,
                 counted_by: str, selection: dict, tracker) -> None:  # fmt: skip
        self.objective, self.x, self.sequences, self.kl, self.labels = objective, x, sequences, kl, labels
        self.ignore_index, self.counted_by, self.selection, self.tracker = ignore_index, counted_by, selection, tracker
        self._masked = None

    def _inputs(self, outputs: dict) -> tuple[PerToken, torch.Tensor]:
        """The inputs masked where the objective reads them, and the log-probs (once per forward: the warning)."""
        lp, x = outputs["logprobs"], self.x
        if self._masked is not None and self._masked[0] is lp:
            return self._masked[1]
        mask = x.mask
        if self.labels is not None:  # a truncated distribution: -inf outside the kept set
            report_dropped(lp, self.labels, self.ignore_index, counting=mask, counted_by=self.counted_by)
            mask = mask & ~torch.isneginf(lp)
        self._masked = (lp, (x.masked_to(mask, outputs.get("entropy")), torch.where(mask, lp, 0.0)))
        return self._masked[1]

    def columns(self, outputs: dict) -> torch.Tensor | None:
        x, lp = self._inputs(outputs)
        if self.sequences is None:
            return None
        return self.objective.sequence_columns(lp, x.old_logprobs, x.advantages, x.mask, x.rollout_is_weights)

    def value(self, outputs: dict, sums: torch.Tensor | None):
        x, lp = self._inputs(outputs)
        selected = x.cov_selection
        if self.objective.loss_mode in SELECTION_MODES and selected is None:
            selected = covariance_selection(  # the caller's mask (its dtype: verl's 1e-8 in the means' count)
                lp.detach(), x.old_logprobs, x.advantages, x.mask.to(x.mask_dtype), loss_mode=self.objective.loss_mode,
                **self.selection,
            )  # fmt: skip
        seq_sums = None if sums is None else self.sequences.of_tokens(sums)
        kl = None if self.kl is None else torch.where(x.mask, self.kl, 0.0)
        return objective_loss(self.objective, x, lp, x.token_weights, seq_sums=seq_sums, selected=selected, kl=kl,
                              tracker=self.tracker)  # fmt: skip


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
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
    memory_budget_mib: float | None = None,
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
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    invariant: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`lmloss.rl.policy_loss` of the log-probs of ``hidden @ weight.T + bias``, without the logits.

    Args:
        hidden, weight, bias, labels: as in `lmloss.linear_token_logprobs` (``[..., H]``, ``[V_local, H]``,
            ``[V_local]``, ``[...]``; with `sequence_parallel`, labels and every per-token tensor have the
            gathered shape).
        mask: bool / 0-1, the labels' shape: which tokens count (verl's ``response_mask``), combined with
            ``labels != ignore_index`` (a token counts where both say so). None: the labels alone. Tokens that
            do not count take no matmul and no softmax pass, and get exactly zero gradient. Its dtype (bool
            without it) places verl's 1e-8 in a token count, as in `policy_loss`.
        old_logprobs, advantages, ref_logprobs, rollout_is_weights, token_weights: per-token, labels' shape.
        The policy options (`loss_mode`, clips, `loss_agg_mode`, KL, `entropy_coeff`, `tracker`, ...): as
        in `policy_loss`; the entropy is the LM head's own (at `temperature`), computed when
        ``entropy_coeff != 0``.
        The LM-head options (`temperature`, `softcap`, `tp_group`, `vocab_start`, `vocab_size`,
        `sequence_parallel`, `chunk_size`, `weight_grad_dtype`, `impl`): as in `lmloss.linear_cross_entropy`.
        pg_mask, cov_selection, generator and the objectives' own options (`tau_pos`, `tau_neg`,
            `clip_cov_*`, `kl_cov_ratio`, `ppo_kl_coef`, `dro_beta`, `vespo_*`, `kl_importance_weighted`): as
            in `policy_loss`.
        ref_hidden, ref_weight: with ``kl_loss_type="full"``, the reference policy's head (``[..., H_ref]``,
            ``[V_local, H_ref]``: the same tokens, this rank's vocabulary shard, sequence-parallel like
            `hidden`; any float dtype; detached): the KL term is the exact per-token KL(pi || pi_ref) over the
            vocabulary at the policy's temperature and softcap, computed chunk by chunk beside the policy's
            logits (one more matmul per chunk, forward only; no ``[tokens, V]`` tensor) and aggregated like
            the other terms; its gradient is formed in the forward with the policy term.
        top_k, top_p, min_p, support: the sampler's distribution (as in `lmloss.linear_token_logprobs`):
            the objective runs on the kept set's renormalised log-probs and entropies, its gradient stays
            on the kept set; tokens whose label lies outside it are left out of the objective, their KL term
            with it (warned, counting the tokens of `labels` and `mask`). `ref_logprobs` stay the reference
            model's on its full distribution (score it without truncation): the KL compares the policy under
            the sampler with the reference itself; a -inf there at a counted token (a truncated reference)
            is refused with a ``ValueError``, since every KL estimate to it would be infinite or clamped.
        invariant: the per-token log-probs and entropies the objective sees are `linear_token_logprobs`'
            with ``invariant=True``: the same bits whatever the chunking, the batch and the TP degree, so that
            on the first pass over a batch whose `old_logprobs` came from that op (the same head, the same
            options) every ratio is exactly 1 (docs/invariant.md). Not with ``kl_loss_type="full"`` (the
            divergence's vocabulary sums have no invariant kernels).
        Under `tp_group` every rank must pass the same options and per-token tensors (the sequence
        boundaries, whether `cp_group` is given, clip_cov's generator state and the reference head's dtype and
        shape included): they are agreed in the op's one rank-agreement gather (a rank that differs raises on
        every rank). With `cp_group` the CP ranks agree as in `policy_loss`, whatever the loss mode, and an
        error of the TP agreement is passed on over `cp_group` (docs/reliability.md).

    Returns:
        ``(loss, metrics)`` as `policy_loss`'s, the same on every TP rank. For the token-separable loss modes
        the gradients are computed in the forward (3 matmuls; the backward only scales them); the sequence
        objectives (gspo, geo_mean, vespo) and the covariance selections (clip_cov, kl_cov) need every
        token's log-prob first: a sequence objective of the loop (`lmloss.sequences`: 4 matmuls, the
        backward recomputing the logits; with ``kl_loss_type="full"`` the KL's own per-token walk besides).
    """
    with_entropy = entropy_coeff != 0.0
    state: dict = {}
    counted_by = "labels != ignore_index" + (" and mask" if mask is not None else "")  # the warning says it
    extra = dict(
        tau_pos=tau_pos, tau_neg=tau_neg, clip_cov_ratio=clip_cov_ratio, clip_cov_lb=clip_cov_lb,
        clip_cov_ub=clip_cov_ub, kl_cov_ratio=kl_cov_ratio, ppo_kl_coef=ppo_kl_coef, dro_beta=dro_beta,
        vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg, kl_importance_weighted=kl_importance_weighted,
    )  # fmt: skip

    def checks(expected):
        _validate.check_group("cp_group", cp_group)
        objective = Objective.make(
            loss_mode=loss_mode, clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, kl_loss_type=kl_loss_type,
            kl_loss_coef=kl_loss_coef, entropy_coeff=entropy_coeff, **extra,
        )  # fmt: skip
        full = kl_loss_type == "full"
        check_kl_arguments(kl_loss_type, kl_loss_coef, ref_logprobs, ref_hidden if full else None, fused=True)
        if (ref_hidden is None) != (ref_weight is None):
            raise ValueError("ref_hidden and ref_weight go together (the reference head)")
        if full and invariant is True:
            raise ValueError(
                "invariant=True does not take kl_loss_type='full': the KL's sums over the vocabulary (the "
                "two-distribution kernels) have no invariant form; use kl_loss_type='k3' / 'low_var_kl' with "
                "ref_logprobs from linear_token_logprobs(..., invariant=True)"
            )
        if ref_hidden is not None:
            if not full:
                raise ValueError(f"ref_hidden / ref_weight are the reference head of kl_loss_type='full', not {kl_loss_type!r}")
            if any(v is not None for v in (top_k, top_p, min_p, support)):
                raise ValueError(
                    "kl_loss_type='full' is the KL of the two full distributions: it does not combine with "
                    "top_k / top_p / min_p / support"
                )
            check_reference_head(ref_hidden, ref_weight, hidden, weight)
        check_weights_or_mode(token_weights, loss_agg_mode)
        # the sequences, checked before the rank agreement (policy_loss would check them after the forward's
        # collectives): the boundaries and each token's sequence are agreed with the other per-token tensors
        ids, cu = check_sequences(expected, hidden.device, cu_seqlens, sequence_ids, loss_mode)
        _validate.check_ignore_index(ignore_index)  # compared with the int64 labels before the plan checks it
        if objective.loss_mode in SEQUENCE_MODES:  # each token's sequence (`lmloss.sequences`)
            state["seq"], state["n_seq"] = sequence_index(expected, hidden.device, cu_seqlens=cu_seqlens,
                                                          sequence_ids=sequence_ids, need=f"loss_mode={loss_mode!r}")  # fmt: skip
        counting = labels.reshape(expected) != ignore_index
        if mask is not None:
            counting = counting & check_mask(mask, expected)
        x = PerToken(  # the given mask's dtype, or bool (the labels'): verl's 1e-8 in a count follows it
            expected, counting, old_logprobs, advantages, ref_logprobs, None, rollout_is_weights, token_weights,
            pg_mask=pg_mask, cov_selection=cov_selection, mask_dtype=torch.bool if mask is None else mask.dtype,
        )  # fmt: skip
        if x.token_weights is None:
            x.token_weights = token_weights_of(x.mask.view(expected), loss_agg_mode, cu_seqlens, horizon,
                                               x.advantages.dtype, x.mask_dtype).reshape(-1)  # fmt: skip
        state.update(objective=objective, x=x)
        n = math.prod(expected)
        out = {
            "counting": counting.reshape(-1),
            "options": dict(
                loss_mode=loss_mode, clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low,
                clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode,
                kl_loss_type=kl_loss_type, kl_loss_coef=kl_loss_coef, entropy_coeff=entropy_coeff, horizon=horizon,
                cp_group=None if cp_group is None else group_size(cp_group), **extra,
            ),
            "tensors": dict(
                advantages=x.advantages, old_logprobs=x.old_logprobs, ref_logprobs=x.ref_logprobs,
                rollout_is_weights=x.rollout_is_weights, token_weights=x.token_weights, pg_mask=x.pg_mask,
                cov_selection=x.cov_selection, sequence_ids=ids, cu_seqlens=cu, mask=None if mask is None else counting,
                # clip_cov's random draw (no cov_selection): every TP rank must draw from the same state
                generator=generator_state(generator) if objective.draws_selection(cov_selection) else None,
            ),
            "arguments": {"ref_hidden": ref_hidden, "ref_weight": ref_weight},
        }  # fmt: skip
        if support is not None:
            state["support"] = replay.check_arguments(support, n, hidden.device, vocab_size, (top_k, top_p, min_p), False)
            out["support"] = state["support"]
        else:
            out["sampling"] = make_sampling(top_k, top_p, min_p, n_tokens=n, device=hidden.device)
        return out

    try:
        p = prepare(
            hidden, weight, labels, bias, chunk_size=chunk_size, temperature=temperature, softcap=softcap,
            ignore_index=ignore_index, vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start,
            sequence_parallel=sequence_parallel, weight_grad_dtype=weight_grad_dtype, impl=impl,
            outputs=("logprobs", "entropy") if with_entropy else ("logprobs",), checks=checks, agree={"op": 4},
            # with the reference head a chunk holds more (`lmloss.objectives.SoftmaxObjective._with_reference`):
            # both heads' chunks; folded into the policy's gradient (no softcap, and on PyTorch fp32 / fp64 heads
            # of one dtype) two fp32 buffers more (PyTorch), else the KL's own gradient and its work buffers
            **(_full_kl_chunk_bytes(softcap, weight, ref_weight) if kl_loss_type == "full" else
               {"bytes_per_logit": SOFTCAP_BYTES_PER_LOGIT} if softcap else {}),
            invariant=invariant, memory_budget_mib=memory_budget_mib,
        )  # fmt: skip
    except (TypeError, ValueError) as error:  # raised on every TP rank: the CP ranks of other TP groups hear it too
        # (unless the TP ranks disagree on cp_group itself: a rank without it cannot take part, docs/reliability.md)
        if isinstance(cp_group, ProcessGroup) and group_size(cp_group) > 1 and "cp_group" not in getattr(
            error, "fields", ()
        ):
            agree_over_cp(cp_group, {}, "", error=error, like=hidden)
        raise
    objective, x = state["objective"], state["x"]
    n_seq = state.get("n_seq", 0)
    if group_size(cp_group) > 1:  # before a sequence objective's all-reduce of its sums: every CP rank alike
        given = (ref_logprobs, True if with_entropy else None, rollout_is_weights, token_weights, pg_mask,
                 cov_selection, ref_hidden, cu_seqlens, sequence_ids)  # as policy_loss's (the same text and bits)
        n_seq = agree_over_cp(
            cp_group, *policy_agreement_fields(objective, loss_agg_mode, horizon, hidden.dtype, n_seq, given), like=hidden
        )  # fmt: skip
    truncated = p.plan.sampling is not None or support is not None
    reference = None
    if ref_hidden is not None:  # the policy's head transform: its softcap (and temperature, in the kernels)
        reference = Reference(second_head(
            ref_hidden, ref_weight, softcap=softcap, sequence_parallel=sequence_parallel, tp_group=tp_group,
            student_dtype=weight.dtype,
        ))  # fmt: skip

    def op_with(**kw) -> Op:
        if kw.get("reference") is None:
            kw.pop("reference", None)
        if support is None:
            return Op(p.plan, p.head, SoftmaxObjective(p.plan, p.labels, **kw))
        return replay.op_over_slots(p.plan, p.head, (p.flat, weight, bias), p.labels, state["support"], False, **kw)

    if not objective.token_separable:  # sequences, selections: a sequence objective of the loop's per-token outputs
        kl = None
        if reference is not None:  # the per-token full KL, in the same plan (reverse KL from the policy)
            divergence = DivergenceObjective(p.plan, DivergenceSpec(beta=1.0), reference.make_source, p.labels)
            (kl,) = PerTokenLoss.apply(Op(p.plan, p.head, divergence), p.flat, weight, bias)
        sequences = None
        if objective.loss_mode in SEQUENCE_MODES:
            sequences = Sequences(state["seq"], n_seq, cp_group if group_size(cp_group) > 1 else None)
        policy = PolicySequenceObjective(
            objective, x, sequences, kl=kl, labels=p.labels if truncated else None, ignore_index=ignore_index,
            counted_by=counted_by,
            selection=dict(clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                           clip_cov_ratio=clip_cov_ratio, clip_cov_lb=clip_cov_lb, clip_cov_ub=clip_cov_ub,
                           kl_cov_ratio=kl_cov_ratio, generator=generator),
            tracker=tracker,
        )  # fmt: skip
        return sequence_loss(op_with(), (p.flat, weight, bias), sequences, policy)
    upstream = PolicyUpstream(objective, x)
    outs = SummedLoss.apply(
        op_with(upstream=upstream, reference=reference), torch.is_grad_enabled(), None, p.flat, weight, bias
    )
    loss, lp = outs[0], outs[1]
    ent = outs[2] if with_entropy else None
    kl = outs[-1] if reference is not None else None
    metrics_mask = x.mask
    if truncated:
        report_dropped(
            lp.view(p.shape), p.labels.view(p.shape), ignore_index, counting=x.mask.view(p.shape), counted_by=counted_by
        )
        metrics_mask = x.mask & ~torch.isneginf(lp)
        lp = torch.where(metrics_mask, lp, 0.0)
    metrics_entropy = None if ent is None else torch.where(metrics_mask, ent, 0.0)
    _, parts = objective.per_token(
        lp, x.old_logprobs, x.advantages, metrics_mask, ref_logprobs=x.ref_logprobs, entropy=metrics_entropy,
        rollout_is_weights=x.rollout_is_weights, pg_mask=x.pg_mask,
        kl=None if kl is None else torch.where(metrics_mask, kl, 0.0),
    )  # fmt: skip
    # the loss shares of the tokens in the objective (a token outside the kept set adds none)
    shares = x.token_weights if not truncated else torch.where(metrics_mask, x.token_weights, 0.0)
    return loss, record_metrics(parts, metrics_mask, shares, metrics_entropy, tracker)
