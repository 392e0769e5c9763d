"""What the one chunk loop (`lmloss.plan.forward_pass` / `backward_pass`) computes per chunk.

An objective gets each chunk's logits ``x [c, V_local]`` (from the op's chunk source), the pass's kernels
(`lmloss.kernels`) and, when gradients are computed in the forward, a gradient sink; it returns the chunk's
per-token results (``[c]`` vectors). For a per-token op's backward it turns the upstream gradients into
per-token coefficients and writes each chunk's gradient without collectives.

* `SoftmaxObjective`: one distribution, ``p = softmax(scale * softcap(x))`` over the valid global
  vocabulary, under the plan's kept set (top-k / top-p / min-p, `lmloss.sampling`) when there is one:
  log-probs, entropy, cross-entropy (label smoothing, z-loss). Its gradient is the upstream of those
  outputs: one scalar (a summed loss), or per token (a backward, or an RL objective's `Upstream`,
  `lmloss.rl.fused`). Declared capabilities: the one-kernel cross-entropy (single process, summed loss);
  a second source over the full vocabulary rows whose log-sum-exp gives a replayed set's kept mass
  (`lmloss.replay`).
* `DivergenceObjective`: two distributions, the student's chunk and a teacher's (a second chunk source),
  forward KL, reverse KL or the generalized JSD (`lmloss.distill`); gradient to the student only.
  Declared capability: in one process with no padded columns, the PyTorch kernels normalise each row
  themselves (no statistics pass).
* `SparseTeacherObjective`: a teacher given as top-k ids and log-probs (forward KL over the K ids and the
  tail).

Gradient form of the softmax outputs: writing ``y = scale * softcap(x)`` and ``p = softmax(y)``, every
output's gradient is ``a*p + b*onehot(label) + c + d*p*(log p + H)`` per token (`grad_coefficients`), so
one gradient kernel serves every combination of outputs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from lmloss.kernels import BlockPartials, compute_dtype, make_kernels
from lmloss.kernels.torch_ref import transform_into
from lmloss.rows import Rows
from lmloss.sampling import keep_thresholds, keep_thresholds_by_kernels
from lmloss.vocab_parallel import (
    all_reduce_max_,
    all_reduce_sum_,
    combine_blocks,
    combine_partials,
    world_size,
)

OUTPUTS = ("logprobs", "entropy", "loss")
#: What the same pass also gives, not differentiable (the ops' ``return_*`` options; `finish`): per token the sum
#: of y over the vocabulary, the argmax of y (int64) and ``log sum p**2``
BYPRODUCTS = ("logit_sum", "argmax", "log_sum_sq_probs")
#: ``upstream(rows, chunk_outputs) -> ({output: [c] upstream gradient or None}, [c] terms)`` for a chunk's
#: `lmloss.rows.Rows` (see `SoftmaxObjective`)
Upstream = Callable[[int, int, dict], dict]


# ----------------------------------------------------------------------------------------------------------
# per-token softmax math on the combined partials ([c] vectors: cheap, the same for both implementations)


def finish(plan, combined: torch.Tensor, labels: torch.Tensor | None, counting=None) -> dict[str, torch.Tensor]:
    """Per-token outputs ``[c]`` (and ``"lse"``) from the global partials ``[c, 5]`` of `combine_partials`
    (``[c, 8]`` with the by-products). `counting` ``[c]`` bool or None: rows that do not count give 0 (-1 for
    the argmax; `lmloss.rows`: usually no chunk holds them at all; inside ``torch.compile`` they are computed
    and masked).

    The by-products (`plan.byproducts`), over the valid columns of the distribution's support (the kept set
    under a truncation), of ``y = scale * softcap(x)``, the logits the softmax sees: ``logit_sum`` = sum y
    (the mean logit is that over ``vocab_size``), ``argmax`` = the lowest id of the largest y (int64),
    ``log_sum_sq_probs`` = ``log sum p**2 = logsumexp(2 y) - 2 logsumexp(y)`` (WPO's weight)."""
    big_m, sum_exp, t, target, sum_y = combined[:, :5].unbind(1)
    log_sum_exp = sum_exp.log()
    out = {"lse": big_m + log_sum_exp}
    for key in plan.byproducts:
        if key == "logit_sum":
            value = sum_y
        elif key == "log_sum_sq_probs":
            value = combined[:, 5].log() - 2.0 * log_sum_exp
        else:
            value = combined[:, 7].to(torch.int64)
        out[key] = value if counting is None else torch.where(counting, value, -1 if key == "argmax" else 0.0)
    if "entropy" in plan.outputs:
        entropy = log_sum_exp - t / sum_exp
        out["entropy"] = entropy if counting is None else torch.where(counting, entropy, 0.0)
    if labels is None:
        return out
    valid = labels != plan.ignore_index
    target_logprob = (target - big_m) - log_sum_exp
    if "logprobs" in plan.outputs:
        out["logprobs"] = torch.where(valid, target_logprob, 0.0)
    if "loss" in plan.outputs:
        nll = -target_logprob
        if plan.label_smoothing > 0:
            smooth = log_sum_exp - (sum_y / plan.shard.vocab_size - big_m)
            nll = (1.0 - plan.label_smoothing) * nll + plan.label_smoothing * smooth
        if plan.z_loss > 0:
            nll = nll + plan.z_loss * out["lse"].square()
        out["loss"] = torch.where(valid, nll, 0.0)
    return out


def grad_coefficients(
    plan,
    labels: torch.Tensor | None,
    lse: torch.Tensor,
    upstream: dict[str, torch.Tensor | None],
    dropped: torch.Tensor | None = None,
    counting: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Upstream gradients of the per-token outputs (``[N]`` each, None = unused) -> ``coef [N, 4]``
    (``a, b, c, d``); None when no output has a gradient. `dropped` ``[N]`` bool: labels outside the
    sampling kept set, whose log-prob (-inf) has no gradient. `counting` ``[N]`` bool: the rows that count
    (the others' entropy is 0, without gradient; their labels are already `ignore_index`)."""
    g_lp, g_h, g_loss = (upstream.get(k) for k in OUTPUTS)
    if g_lp is None and g_h is None and g_loss is None:
        return None
    coef = torch.zeros((lse.shape[0], 4), dtype=lse.dtype, device=lse.device)
    a, b, c, d = coef.unbind(1)
    if g_lp is not None or g_loss is not None:
        # where(), not a multiply: an inf or NaN upstream at an ignored position must give no gradient
        valid = labels != plan.ignore_index
        if dropped is not None:
            valid = valid & ~dropped
    if g_lp is not None:  # d logp_t / dy = onehot - p
        g = torch.where(valid, g_lp.to(lse.dtype), 0.0)
        a.sub_(g)
        b.add_(g)
    if g_loss is not None:  # d loss / dy = (1 + 2 z lse) p - (1 - eps) onehot - eps / V
        g = torch.where(valid, g_loss.to(lse.dtype), 0.0)
        # the z-loss term multiplies by lse, NaN / inf in an ignored row: select, so that row stays all 0
        a.add_(torch.where(valid, g * (1.0 + 2.0 * plan.z_loss * lse), 0.0) if plan.z_loss > 0 else g)
        b.sub_((1.0 - plan.label_smoothing) * g)
        if plan.label_smoothing > 0:
            c.sub_((plan.label_smoothing / plan.shard.vocab_size) * g)
    if g_h is not None:  # d H / dy = -p (log p + H); 0 in a row that does not count (its entropy is 0)
        d.sub_(g_h.to(lse.dtype) if counting is None else torch.where(counting, g_h.to(lse.dtype), 0.0))
    return coef


def has_uniform_term(plan, upstream: dict[str, torch.Tensor | None]) -> bool:
    """Whether ``coef[:, 2]`` can be nonzero (label smoothing of a loss with a gradient)."""
    return plan.label_smoothing > 0 and upstream.get("loss") is not None


# ----------------------------------------------------------------------------------------------------------
# one distribution


@dataclasses.dataclass
class FullRows:
    """A second source over the whole vocabulary rows, beside the chunk's own columns (a replayed set's
    slots): its log-sum-exp under `math` gives ``log_kept_mass = lse(kept) - lse(vocabulary)``.
    `make_source(rows)` builds the pass's source (its scratch lives for one pass)."""

    make_source: Callable[[int], Callable[..., torch.Tensor]]
    math: object  # ChunkMath
    device: torch.device


@dataclasses.dataclass
class Reference:
    """A reference policy's head beside the policy's (``kl_loss_type="full"``, `lmloss.rl.fused`):
    ``make_source(rows, cols)`` builds the pass's chunk source of its logits (chunks of up to `rows` rows and
    `cols` columns, None: all), its softcap already applied (`lmloss.distill.teacher_rows`). Each chunk then
    also gives ``kl``, the exact KL(policy || reference) over the vocabulary, whose upstream gradient the
    two-distribution kernels turn into the policy's."""

    make_source: Callable[[int, int | None], Callable[..., torch.Tensor]]
    #: instead of the KL: the reference's log-prob of each label, ``ref_logprobs`` (a sequence objective's
    #: reference policy: `lmloss.preference`), in the forward only (not differentiated; the backward's passes
    #: never read the reference)
    logprobs: bool = False


#: Returned outputs that are not differentiable (`lmloss.functions.PerTokenLoss` marks them so).
CONSTANT_OUTPUTS = ("log_kept_mass", "ref_logprobs")


class SoftmaxObjective:
    """One distribution's per-token outputs (``plan.outputs``) and their gradient (module docstring).

    labels: flat ``[N]`` int64 or None. upstream: an `Upstream` (the gradient of an objective of the
    outputs, per chunk), or None for the gradient of the summed loss times `grad_scale` (a 0-d device
    tensor, ``1 / count`` for a mean; None for 1). full_rows: see `FullRows`. dropped_labels: ``[N]``
    bool, labels already known to lie outside the kept set (a replayed support that misses them).
    reference: see `Reference` (with an upstream; not under a kept set).
    """

    def __init__(self, plan, labels, *, upstream: Upstream | None = None, grad_scale=None, full_rows=None,
                 dropped_labels=None, reference: Reference | None = None):  # fmt: skip
        self.counting = plan.counting  # the rows that count (`lmloss.rows`), or None: every row
        if labels is not None and self.counting is not None:  # a row that does not count has no label
            labels = torch.where(self.counting, labels, plan.ignore_index)
        self.plan, self.labels, self.upstream, self.grad_scale = plan, labels, upstream, grad_scale
        self.full_rows, self.dropped_labels, self.reference = full_rows, dropped_labels, reference

    # -- what the loop stores

    def result_keys(self) -> tuple[str, ...]:
        keys = (*self.plan.returned, "lse")
        if self.plan.sampling is not None:
            keys = (*keys, "keep_min", "dropped")
        if self.upstream is not None:  # each token's term of the upstream's objective (its total is their sum)
            keys = (*keys, "objective")
        if self.reference is not None:
            keys = (*keys, "ref_logprobs" if self.reference.logprobs else "kl")
        if self.plan.weight_block:  # what the weight pass reads (`weight_pass_inputs`)
            keys = (*keys, "coef", *(("ref_lse", "kl_upstream") if self.reference is not None else ()))
        return keys

    def returned_names(self) -> tuple[str, ...]:
        """What a per-token op returns: the plan's outputs, then a reference's log-probs (`Reference`)."""
        with_reference = self.reference is not None and self.reference.logprobs
        return (*self.plan.returned, "ref_logprobs") if with_reference else self.plan.returned

    def returned(self, results: dict) -> tuple[torch.Tensor, ...]:
        names = self.returned_names()
        out = tuple(results[k] for k in names)
        if "argmax" in results and self.plan.rows is not None:  # the rows no chunk held are 0: -1 there
            i = names.index("argmax")
            out = (*out[:i], torch.where(self.counting, out[i], -1), *out[i + 1 :])
        return out

    def saved(self, results: dict) -> dict[str, torch.Tensor | None]:
        return {k: results.get(k) for k in ("lse", "entropy", "keep_min", "dropped")}

    # -- forward

    def can_run_one_kernel(self, kernels, sink) -> bool:
        """The single-process scalar loss in one kernel: statistics, loss and gradient in one read."""
        plan = self.plan
        return (
            sink is not None and self.upstream is None and plan.outputs == ("loss",) and plan.sampling is None
            and world_size(plan.tp_group) == 1 and hasattr(kernels, "loss_and_grad_") and not plan.invariant
        )  # fmt: skip

    def _partials(self, kernels, x, labels, keep: dict, exps: dict, rows: Rows, *, overwrite: bool = False):
        """The chunk's partials for the combine: per row (`lmloss.kernels`), or per block in invariant mode."""
        plan = self.plan
        if plan.invariant:
            return kernels.block_partials(x, labels, plan.math, **plan.flags, **keep, **exps, block=plan.invariant_block,
                                          global_max=self._global_max, overwrite=overwrite)  # fmt: skip
        return kernels.softmax_partials(x, labels, plan.math, **plan.flags, overwrite=overwrite, **keep, **exps,
                                        live=self._live(rows))  # fmt: skip

    def _global_max(self, local_max: torch.Tensor) -> torch.Tensor:
        """The invariant kernels' row max over the TP group (one MAX: exact in any order)."""
        return all_reduce_max_(local_max, self.plan.tp_group)

    def _combine(self, partials):
        """Every rank's partials -> the global ones ``[c, 5]`` over the TP group (`lmloss.vocab_parallel`)."""
        if isinstance(partials, BlockPartials):
            return combine_blocks(partials, self.plan.tp_group)
        return combine_partials(partials, self.plan.tp_group)

    def start(self, n_rows: int, device: torch.device, tile: tuple[int, int] | None = None) -> dict:
        """A pass's own state (its objects live for one pass): the full rows' source and kernels, the
        reference's source. `tile`: a weight pass's ``(rows, columns)`` per chunk (`lmloss.plan.backward_pass`)."""
        rows = max(1, min(n_rows, self.plan.chunk_size or n_rows)) if tile is None else tile[0]
        state = {"n_rows": n_rows, "rows": rows, "search": None}
        if self.reference is not None and not self.reference.logprobs:  # (the log-probs': in the forward)
            state["reference"] = self.reference.make_source(rows, None if tile is None else tile[1])
        if self.full_rows is not None:  # the full rows need kernels of their width
            state["full"] = (self.full_rows.make_source(rows), make_kernels(self.plan.impl, rows, self.plan.vocab.size, device))
        return state

    def forward_chunk(self, state: dict, rows: Rows, x: torch.Tensor, kernels, sink, *, overwrite: bool) -> dict:
        plan = self.plan
        labels = None if self.labels is None else rows.take(self.labels)
        if self.reference is not None and self.reference.logprobs:
            return self._with_reference_logprobs(state, rows, x, kernels, sink, labels, overwrite)
        if self.reference is not None:
            return self._with_reference(state, rows, x, kernels, sink, labels, overwrite)
        kept = self._thresholds(state, rows, x, kernels)
        keep = {} if kept is None else {"keep_min": kept.keep_min}
        if sink is None:
            exps = {} if kept is None else {"kept_exps": (kept.exps, kept.row_max, kept.kept_mass)}
            stats = self._finish(state, self._partials(kernels, x, labels, keep, exps, rows, overwrite=overwrite), labels, rows)
        else:
            out = sink.buffer(rows, x)
            if self.can_run_one_kernel(kernels, sink):
                stats = kernels.loss_and_grad_(
                    x, labels, plan.math, ignore_index=plan.ignore_index, label_smoothing=plan.label_smoothing,
                    z_loss=plan.z_loss, vocab_size=plan.shard.vocab_size, out=out, grad_scale=self.grad_scale,
                )  # fmt: skip
                if plan.weight_block:  # the weight pass's coefficients (the kernel made its own)
                    stats["coef"] = grad_coefficients(
                        plan, labels, stats["lse"], self._upstream_of(rows, stats), counting=self._counting(rows)
                    )
                grad = out
            else:

                def finish_with_grad(partials):
                    stats = self._finish(state, partials, labels, rows)
                    grads = self._upstream_of(rows, stats)
                    coef = grad_coefficients(plan, labels, stats["lse"], grads, stats.get("dropped"), self._counting(rows))
                    if plan.weight_block:  # kept for the weight pass (`weight_pass_inputs`)
                        stats["coef"] = coef
                    if grads.get("entropy") is not None:  # the gradient's d term needs each row's H
                        return stats, coef, stats["lse"], stats["entropy"]
                    return stats, coef, stats["lse"]

                if plan.invariant:  # block sums, then the gradient from the row's lse (elementwise)
                    stats, coef, lse, *rest = finish_with_grad(self._partials(kernels, x, labels, keep, {}, rows))
                    grad = kernels.softmax_grad_(
                        x, labels, lse, rest[0] if rest else None, coef, plan.math, out,
                        uniform_term=plan.label_smoothing > 0, **keep,
                    )  # fmt: skip
                else:
                    stats, grad = kernels.partials_then_grad_(
                        x, labels, plan.math, plan.flags, finish_with_grad, out,
                        uniform_term=plan.label_smoothing > 0, live=self._live(rows), **keep,
                    )  # fmt: skip
            sink.consume(rows, grad)
        if kept is not None:
            stats["keep_min"] = kept.keep_min
            if plan.sampling.log_kept_mass:
                stats["log_kept_mass"] = self._counted(rows, stats["lse"] - kept.full_lse)
        return stats

    def _with_reference_logprobs(self, state, rows, x, kernels, sink, labels, overwrite: bool) -> dict:
        """A chunk beside the reference's (`Reference.logprobs`): both heads' statistics in one combine (MAX +
        SUM), the policy's outputs and the reference's log-prob of each label, ``ref_logprobs`` (0 where a
        label is ignored). Forward only: the per-token op's backward differentiates the policy alone."""
        if sink is not None:
            raise ValueError("a reference head's log-probs are computed in a per-token forward (no gradient sink)")
        plan = self.plan
        if "reference" not in state:  # made in the forward only: the backward's passes never read it
            state["reference"] = self.reference.make_source(state["rows"], None)
        xt = state["reference"](rows)
        ref_math = dataclasses.replace(plan.math, softcap=0.0)  # its source applied the softcap
        ref = kernels.softmax_partials(xt, labels, ref_math, entropy=False, target=True, sum_logits=False)
        partials = kernels.softmax_partials(x, labels, plan.math, **plan.flags, overwrite=overwrite, live=self._live(rows))
        c = rows.count
        both = combine_partials(torch.cat([partials, ref.to(partials.dtype)]), plan.tp_group)
        stats = finish(plan, both[:c], labels, self._counting(rows))
        ref_max, ref_sum, _, ref_target, _ = both[c:].unbind(1)
        valid = labels != plan.ignore_index
        stats["ref_logprobs"] = torch.where(valid, (ref_target - ref_max) - ref_sum.log(), 0.0)
        return stats

    def _with_reference(self, state, rows, x, kernels, sink, labels, overwrite: bool = False) -> dict:
        """A chunk beside the reference's: both heads' statistics in one combine (MAX + SUM), the policy's
        outputs, ``kl`` from the divergence's row sums (one SUM); with a sink the gradient of the upstream's
        objective, its policy terms by the softmax kernels and its KL term by the two-distribution ones
        (into a buffer of its own, added after: the softmax gradient may overwrite the chunk)."""
        plan = self.plan
        xt = state["reference"](rows)
        ref_math = dataclasses.replace(plan.math, softcap=0.0)  # its source applied the softcap
        ref = kernels.softmax_partials(xt, None, ref_math, entropy=False, target=False, sum_logits=False)
        # the policy's last: the PyTorch kernels' folded gradient reuses the exps its partials leave, and where
        # the chunk is ours they take ``x - x_ref`` first and work in x (the contract's `difference_into`)
        folded = sink is not None and self._kl_by_difference(kernels, x, xt, state["reference"])
        in_place = dict(overwrite=True, difference_into=xt) if folded and overwrite else {}
        partials = kernels.softmax_partials(x, labels, plan.math, **plan.flags, **in_place)
        c = rows.count
        both = combine_partials(torch.cat([partials, ref.to(partials.dtype)]), plan.tp_group)
        stats = finish(plan, both[:c], labels, self._counting(rows))
        lse = torch.stack([stats["lse"], _lse(both[c:])], dim=1)
        if plan.weight_block:  # kept for the weight pass
            stats["ref_lse"] = lse[:, 1]
        if sink is None:
            rows = all_reduce_sum_(kernels.divergence_partials(x, xt, lse, plan.math, 1.0), plan.tp_group)
            stats["kl"] = rows[:, 0]
            return stats
        upstream = {}

        def finish_kl(sums):  # the KL's row sums, then the objective's upstream of every output
            stats["kl"] = all_reduce_sum_(sums, plan.tp_group)[:, 0]
            grads, stats["objective"] = self.upstream(rows, stats)
            upstream.update(grads)
            g_kl = grads.get("kl")
            g_kl = torch.zeros_like(stats["kl"]) if g_kl is None else g_kl.to(stats["kl"].dtype)
            if plan.weight_block:
                stats["kl_upstream"] = g_kl
            return None, torch.stack([g_kl, stats["kl"]], dim=1)

        out = sink.buffer(rows, x)
        if folded:
            return self._with_reference_by_difference(rows, x, xt, kernels, sink, labels, stats, both[c:], out)
        if "kl_grad" not in state:
            state["kl_grad"] = torch.empty((state["rows"], out.shape[1]), dtype=out.dtype, device=out.device)
        kl_grad = state["kl_grad"][:c]
        kernels.divergence_partials_then_grad_(x, xt, lse, plan.math, 1.0, finish_kl, kl_grad)
        grads = upstream
        coef = grad_coefficients(plan, labels, stats["lse"], grads, counting=self._counting(rows))
        if plan.weight_block:
            stats["coef"] = torch.zeros((c, 4), dtype=stats["lse"].dtype, device=x.device) if coef is None else coef
        if coef is None:
            out.zero_()
        else:
            entropy = stats.get("entropy") if grads.get("entropy") is not None else None
            kernels.softmax_grad_(x, labels, stats["lse"], entropy, coef, plan.math, out, uniform_term=False)
        out.add_(kl_grad)
        sink.consume(rows, out)
        return stats

    def _kl_by_difference(self, kernels, x, xt, reference_source) -> bool:
        """Whether the KL can ride the policy's gradient pass (no softcap, and chunks the kernels' folded
        gradient takes: `can_fold_difference`)."""
        owned = getattr(reference_source, "owns_chunks", False)
        return not self.plan.math.softcap and kernels.can_fold_difference(x, xt, owned)

    def _with_reference_by_difference(self, rows, x, xt, kernels, sink, labels, stats, ref_combined, out) -> dict:
        """`_with_reference`'s gradient in one pass with the policy's: ``KL = scale * sum p (x - x_ref) - (lse -
        lse_ref)`` (one SUM of this shard's sums), and its gradient ``g p (scale (x - x_ref) - (lse - lse_ref) -
        KL)``: the ``- g (lse - lse_ref + KL) p`` part joins the softmax gradient's ``a`` coefficient, the rest
        is the kernels' difference term (`softmax_grad_with_difference_`). No log-softmax buffers, no
        separate KL gradient."""
        plan = self.plan
        shift = stats["lse"] - _lse(ref_combined)  # lse - lse_ref

        def finish_kl(sums):
            stats["kl"] = plan.math.scale * all_reduce_sum_(sums, plan.tp_group) - shift
            grads, stats["objective"] = self.upstream(rows, stats)
            g_kl = grads.get("kl")
            g_kl = torch.zeros_like(stats["kl"]) if g_kl is None else g_kl.to(stats["kl"].dtype)
            coef = grad_coefficients(plan, labels, stats["lse"], grads, counting=self._counting(rows))
            if coef is None:
                coef = torch.zeros((rows.count, 4), dtype=stats["lse"].dtype, device=stats["lse"].device)
            # where(), not a multiply: a row without gradient (an ignored token) whose reference is NaN stays 0
            coef[:, 0] -= torch.where(g_kl != 0, g_kl * (shift + stats["kl"]), 0.0)
            if plan.weight_block:  # kept for the weight pass
                stats["coef"], stats["kl_upstream"] = coef, g_kl
            entropy = stats.get("entropy") if grads.get("entropy") is not None else None
            return coef, g_kl * plan.math.scale, entropy

        kernels.softmax_grad_with_difference_(x, labels, xt, stats["lse"], plan.math, finish_kl, out, uniform_term=False)
        sink.consume(rows, out)
        return stats

    def _thresholds(self, state, rows, x, kernels):
        """The chunk's kept set (collectives over tp_group), found on the PyTorch kernels' values of y."""
        plan = self.plan
        if plan.sampling is None:
            return None
        k_max = min(plan.sampling.k_max, plan.shard.vocab_size)
        if kernels.name == "triton" and not plan.math.softcap and not plan.invariant:  # its passes by kernels
            return keep_thresholds_by_kernels(x, plan.math, plan.sampling.rows(rows), k_max, group=plan.tp_group,
                                              want_full_lse=plan.sampling.log_kept_mass)  # fmt: skip
        if state["search"] is None:
            chunk = state["rows"]
            state["search"] = kernels if kernels.name == "torch" else make_kernels("torch", chunk, plan.shard.size, x.device)
        search = state["search"]
        return keep_thresholds(
            search.scaled(x, plan.math), x[:, : plan.math.valid], plan.sampling.rows(rows), k_max,
            group=plan.tp_group, scratch=search.scratch, want_full_lse=plan.sampling.log_kept_mass,
            invariant=plan.invariant, scale=None if plan.math.softcap else plan.math.scale,
        )  # fmt: skip

    def total(self, results: dict) -> torch.Tensor:
        """A summed op's loss: the upstream objective's total (the sum of its per-token terms, or, where no
        gradient was made chunk by chunk, `Upstream.evaluate` over all tokens), or the summed losses."""
        if self.upstream is None:
            return results["loss"].sum()
        if "objective" in results:
            return self.upstream.finish_total(results["objective"].double().sum(), results)
        return self.upstream.finish_total(self.upstream.evaluate(results), results)

    def extra_outputs(self, results: dict) -> tuple[torch.Tensor, ...]:
        return () if self.upstream is None else self.upstream.extra_outputs(results)

    def _finish(self, state, partials, labels, rows) -> dict:
        plan = self.plan
        if self.full_rows is None:
            stats = finish(plan, self._combine(partials), labels, self._counting(rows))
        else:  # the full vocabulary's statistics beside the slots', in the same MAX and SUM
            source, full_kernels = state["full"]
            flags = dict(entropy=False, target=False, sum_logits=False)
            if plan.invariant:
                full = full_kernels.block_partials(source(rows), None, self.full_rows.math, **flags,
                                                   global_max=self._global_max)  # fmt: skip
                both = self._combine(BlockPartials.cat([partials, full.cast(partials.s.dtype)]))
            else:
                full = full_kernels.softmax_partials(source(rows), None, self.full_rows.math, **flags)
                both = self._combine(torch.cat([partials, full.to(partials.dtype)]))
            c = rows.count
            stats = finish(plan, both[:c], labels, self._counting(rows))
            full_lse = both[c:, 0] + both[c:, 1].log()
            stats["log_kept_mass"] = self._counted(rows, stats["lse"] - full_lse)
        if labels is not None and "logprobs" in stats:
            valid = labels != plan.ignore_index
            dropped = valid & torch.isneginf(stats["logprobs"])
            if self.dropped_labels is not None:
                known = rows.take(self.dropped_labels)
                dropped = dropped | known
                stats["logprobs"] = torch.where(known, -math.inf, stats["logprobs"])
            if plan.sampling is not None or self.dropped_labels is not None:
                stats["dropped"] = dropped
        elif plan.sampling is not None:
            stats["dropped"] = torch.zeros(rows.count, dtype=torch.bool, device=partials.device)
        return stats

    def _live(self, rows) -> torch.Tensor | None:
        """The kernels' `live` rows of a chunk (those that count), or None when every row of the op counts: a
        slice of logits joins short gaps of rows that do not count (`lmloss.rows`), which the Triton kernels
        then neither read nor compute."""
        return None if self.plan.rows is None else self._counting(rows)

    def _counting(self, rows) -> torch.Tensor | None:
        return None if self.counting is None else rows.take(self.counting)

    def _counted(self, rows, values: torch.Tensor) -> torch.Tensor:
        """`values` with 0 in the rows that do not count."""
        counting = self._counting(rows)
        return values if counting is None else torch.where(counting, values, 0.0)

    def _upstream_of(self, rows, stats) -> dict:
        if self.upstream is not None:
            grads, stats["objective"] = self.upstream(rows, stats)
            return grads
        if self.grad_scale is None:
            return {"loss": torch.ones_like(stats["lse"])}
        return {"loss": self.grad_scale.to(stats["lse"].dtype).expand_as(stats["lse"])}

    # -- backward (per-token ops)

    def coefficients(self, saved: dict, grads: tuple) -> tuple[torch.Tensor | None, dict]:
        """The upstream gradients of the returned outputs -> (``coef [N, 4]`` or None, what the chunks need)."""
        upstream = dict(zip(self.plan.outputs, grads))
        coef = grad_coefficients(self.plan, self.labels, saved["lse"], upstream, saved.get("dropped"), self.counting)
        entropy = saved.get("entropy") if upstream.get("entropy") is not None else None
        return coef, dict(entropy=entropy, uniform_term=has_uniform_term(self.plan, upstream))

    def empty_result(self, key: str, n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A result no chunk made (no row counts): its zeros."""
        if key == "dropped":
            return torch.zeros(n, dtype=torch.bool, device=device)
        if key == "argmax":
            return torch.full((n,), -1, dtype=torch.int64, device=device)
        return torch.zeros((n, 4) if key == "coef" else (n,), dtype=dtype, device=device)

    def weight_pass_inputs(self, results: dict, scale) -> tuple[dict, torch.Tensor, dict]:
        """``(saved, coef, extra)`` of the weight pass after a summed forward (`lmloss.functions.SummedLoss`):
        the coefficients the forward used, times the upstream scalar `scale` (0-d), so that the weight
        gradient is written once, already scaled."""
        saved = {k: results.get(k) for k in ("lse", "keep_min", "ref_lse", "kl")}
        coef = results["coef"] if scale is None else results["coef"] * scale.to(results["coef"].dtype)
        extra = dict(entropy=results.get("entropy"), uniform_term=self.plan.label_smoothing > 0)
        if self.reference is not None:
            g_kl = results["kl_upstream"]
            extra["kl_upstream"] = g_kl if scale is None else g_kl * scale.to(g_kl.dtype)
        return saved, coef, extra

    def backward_chunk(self, state, rows, x, kernels, sink, saved: dict, coef, extra: dict, *, math, cols=None) -> None:
        out = sink.buffer(rows, x)
        keep_min, entropy = saved.get("keep_min"), extra["entropy"]
        labels = None if self.labels is None else rows.take(self.labels)
        lse, coef = rows.take(saved["lse"]), rows.take(coef)
        entropy = None if entropy is None else rows.take(entropy)
        if self.reference is not None and not self.reference.logprobs:  # the weight pass of the full KL
            self._reference_grad(state, rows, x, kernels, saved, coef, extra, labels, lse, entropy, math, cols, out)
        else:
            kernels.softmax_grad_(
                x, labels, lse, entropy, coef, math, out, uniform_term=extra["uniform_term"],
                **({} if keep_min is None else {"keep_min": rows.take(keep_min)}),
            )  # fmt: skip
        sink.consume(rows, out)

    def _reference_grad(self, state, rows, x, kernels, saved, coef, extra, labels, lse, entropy, math, cols, out):
        """The forward's gradient of the policy with the full KL, again for a block of columns: the
        coefficients it found (already with the KL's share of ``a``) and the KL's upstream per row."""
        xt = state["reference"](rows, cols)
        g_kl = rows.take(extra["kl_upstream"])
        if self._kl_by_difference(kernels, x, xt, state["reference"]):
            kernels.softmax_grad_with_difference_(
                x, labels, xt, lse, math, lambda sums: (coef, g_kl * math.scale, entropy), out, uniform_term=False
            )
            return
        both = torch.stack([lse, rows.take(saved["ref_lse"])], dim=1)
        kl_grad = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        kernels.divergence_grad_(x, xt, both, torch.stack([g_kl, rows.take(saved["kl"])], dim=1), math, 1.0, kl_grad)
        kernels.softmax_grad_(x, labels, lse, entropy, coef, math, out, uniform_term=False)
        out.add_(kl_grad)


# ----------------------------------------------------------------------------------------------------------
# two distributions


@dataclasses.dataclass(frozen=True)
class DivergenceSpec:
    """What the divergence is, beside the `LossPlan`: `beta`, and for a sparse teacher `tail`."""

    beta: float
    sparse: bool = False
    tail: bool = True


def divergence_rows(partials: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Global per-row sums ``[c, 2]`` (`lmloss.kernels` contract) -> (loss ``[c]``, ``S`` ``[c]``), where
    the student gradient w.r.t. its scaled logits is ``p_s * (u - S)`` (reverse KL, JSD) or ``p_s - p_t``
    (forward KL: S unused)."""
    if beta == 0.0:
        return partials[:, 0], torch.zeros_like(partials[:, 0])
    if beta == 1.0:
        return partials[:, 0], partials[:, 0]
    b_part = (1.0 - beta) * partials[:, 1]
    return beta * partials[:, 0] + b_part, b_part


def _lse(combined: torch.Tensor) -> torch.Tensor:
    return combined[:, 0] + combined[:, 1].log()


class _UpstreamWeights:
    """The per-token weight of each row's loss in the gradient: the backward's upstream, or 1 / the summed
    loss's scale; 0 at ignored tokens."""

    def __init__(self, labels, ignore_index, upstream=None, grad_scale=None) -> None:
        self.labels, self.ignore_index, self.upstream, self.grad_scale = labels, ignore_index, upstream, grad_scale

    def valid(self, rows):
        return None if self.labels is None else rows.take(self.labels) != self.ignore_index

    def __call__(self, rows, dtype, device) -> torch.Tensor:
        if self.upstream is not None:
            w = rows.take(self.upstream).to(dtype)
        elif self.grad_scale is not None:
            w = self.grad_scale.to(dtype).expand(rows.count)
        else:
            w = torch.ones(rows.count, dtype=dtype, device=device)
        valid = self.valid(rows)
        return w if valid is None else torch.where(valid, w, 0.0)

    def scaled(self, scale) -> _UpstreamWeights:
        """These weights times the upstream scalar `scale` (0-d; None: 1)."""
        if scale is None:
            return self
        if self.upstream is not None:
            return _UpstreamWeights(self.labels, self.ignore_index, upstream=self.upstream * scale)
        grad_scale = scale if self.grad_scale is None else self.grad_scale * scale
        return _UpstreamWeights(self.labels, self.ignore_index, grad_scale=grad_scale)


class DivergenceObjective:
    """Per-token divergence between the student's chunk and the teacher's (`teacher`, a chunk source of the
    same columns). Per chunk: both distributions' statistics in ONE MAX and ONE SUM over the TP group, the
    divergence's row sums (`divergence_partials`) and ONE SUM, and with a sink the student's gradient from
    the same elementwise terms. In one process with no padded columns, kernels that normalise rows
    themselves (``normalises_rows``) skip the statistics pass."""

    def __init__(self, plan, spec: DivergenceSpec, make_teacher, labels, *, grad_scale=None) -> None:
        self.plan, self.spec, self.make_teacher, self.labels = plan, spec, make_teacher, labels
        self.weights = _UpstreamWeights(labels, plan.ignore_index, grad_scale=grad_scale)

    def start(self, n_rows: int, device: torch.device, tile: tuple[int, int] | None = None) -> dict:
        """A pass's own state: the teacher's source (``make_teacher(rows, cols)``, with its own scratch)."""
        if tile is not None:
            return {"teacher": self.make_teacher(*tile)}
        return {"teacher": self.make_teacher(max(1, min(n_rows, self.plan.chunk_size or n_rows)), None)}

    def empty_result(self, key: str, n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=device)

    def weight_pass_inputs(self, results: dict, scale) -> tuple[dict, object, dict]:
        saved = self.saved(results)
        return saved, True, {"weights": self.weights.scaled(scale)}

    def total(self, results: dict) -> torch.Tensor:
        return results["loss"].sum()

    def extra_outputs(self, results: dict) -> tuple:
        return ()

    def result_keys(self):
        return ("loss", "lse_student", "lse_teacher", "S")

    def returned(self, results):
        return (results["loss"],)

    def saved(self, results):
        return {k: results[k] for k in ("lse_student", "lse_teacher", "S")}

    def _local_softmax(self, kernels) -> bool:
        """Whether the kernels normalise each row themselves: one process, no padded column, and whole rows
        in every pass (no weight pass over blocks of columns)."""
        plan = self.plan
        return (
            kernels.normalises_rows and world_size(plan.tp_group) == 1 and plan.math.valid == plan.shard.size
            and not plan.weight_block
        )  # fmt: skip

    def _lse(self, xs, xt, kernels):
        if self._local_softmax(kernels):
            return None
        plan = self.plan
        teacher_math = dataclasses.replace(plan.math, softcap=0.0)  # its source applied its own softcap
        stats = [
            kernels.softmax_partials(x, None, m, entropy=False, target=False, sum_logits=False)
            for x, m in ((xs, plan.math), (xt, teacher_math))
        ]
        combined = combine_partials(torch.cat(stats).to(compute_dtype(xs.dtype)), plan.tp_group)
        return _lse(combined).view(2, xs.shape[0]).t().contiguous()  # [c, 2]: student, teacher

    def forward_chunk(self, state, rows, xs, kernels, sink, *, overwrite: bool) -> dict:
        plan, beta, teacher = self.plan, self.spec.beta, state["teacher"]
        xt = teacher(rows)
        lse = self._lse(xs, xt, kernels)
        overwrite = overwrite and getattr(teacher, "owns_chunks", False)
        saved = {}

        def finish_rows(partials):
            all_reduce_sum_(partials, plan.tp_group)
            loss, subtract = divergence_rows(partials, beta)
            saved["S"] = subtract
            if sink is None:
                return loss, None
            weight = self.weights(rows, partials.dtype, partials.device)
            return loss, torch.stack([weight, subtract], dim=1)

        if sink is None:
            loss = finish_rows(kernels.divergence_partials(xs, xt, lse, plan.math, beta, overwrite=overwrite))[0]
        else:
            out = sink.buffer(rows, xs)
            loss = kernels.divergence_partials_then_grad_(xs, xt, lse, plan.math, beta, finish_rows, out, overwrite=overwrite)
            sink.consume(rows, out)
        valid = self.weights.valid(rows)
        stats = {"loss": loss if valid is None else torch.where(valid, loss, 0.0), "S": saved["S"]}
        nan = torch.full((rows.count,), math.nan, dtype=loss.dtype, device=loss.device)
        stats["lse_student"], stats["lse_teacher"] = (nan, nan) if lse is None else lse.unbind(1)
        return stats

    def coefficients(self, saved, grads):
        (g,) = grads
        if g is None:
            return None, {}
        return True, {"weights": _UpstreamWeights(self.labels, self.plan.ignore_index, upstream=g)}

    def backward_chunk(self, state, rows, xs, kernels, sink, saved, coef, extra, *, math, cols=None) -> None:
        teacher = state["teacher"]
        xt = teacher(rows, cols)
        lse = None
        if not self._local_softmax(kernels):
            lse = torch.stack([rows.take(saved["lse_student"]), rows.take(saved["lse_teacher"])], dim=1)
        weight = extra["weights"](rows, saved["S"].dtype, xs.device)
        out = sink.buffer(rows, xs)
        overwrite = getattr(teacher, "owns_chunks", False) and out is xs
        kernels.divergence_grad_(
            xs, xt, lse, torch.stack([weight, rows.take(saved["S"])], dim=1), math, self.spec.beta, out,
            overwrite=overwrite,
        )  # fmt: skip
        sink.consume(rows, out)


class SparseTeacherObjective:
    """Forward KL against a teacher given as its top-k ids ``[N, K]`` (global) and log-probs ``[N, K]``: over
    the K ids and the tail (the rest of the vocabulary: teacher mass ``1 - sum exp(lp)``, student mass
    outside the ids), or renormalised over the K ids (``tail=False``). Per chunk: with the tail, the
    student's statistics (MAX + SUM), then the student's logits at the ids (each TP rank contributes its
    shard's, one SUM)."""

    def __init__(self, plan, spec: DivergenceSpec, ids, logprobs, labels, *, grad_scale=None) -> None:
        self.plan, self.spec, self.ids, self.logprobs, self.labels = plan, spec, ids, logprobs, labels
        self.weights = _UpstreamWeights(labels, plan.ignore_index, grad_scale=grad_scale)

    def start(self, n_rows: int, device: torch.device, tile: tuple[int, int] | None = None) -> dict:
        return {}

    def empty_result(self, key: str, n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        shape = (n, self.ids.shape[1]) if key == "log_student_at_ids" else (n,)
        return torch.zeros(shape, dtype=dtype, device=device)

    def weight_pass_inputs(self, results: dict, scale) -> tuple[dict, object, dict]:
        return self.saved(results), True, {"weights": self.weights.scaled(scale)}

    def total(self, results: dict) -> torch.Tensor:
        return results["loss"].sum()

    def extra_outputs(self, results: dict) -> tuple:
        return ()

    def result_keys(self):
        return ("loss", "lse_student", "log_student_at_ids")

    def returned(self, results):
        return (results["loss"],)

    def saved(self, results):
        return {k: results[k] for k in ("lse_student", "log_student_at_ids")}

    def _state(self, rows, x, kernels, lse=None, ls=None, chunk_math=None):
        """(loss [c], (lq, ls, lse, q_tail, p_tail, idx, owned)); `lse` / `ls` given: from the forward's;
        `chunk_math`: the chunk's columns (a block of them in a weight pass; default the plan's)."""
        plan = self.plan
        m = plan.math if chunk_math is None else chunk_math
        acc = compute_dtype(x.dtype)
        ids = rows.take(self.ids)
        local = ids - m.vocab_start
        owned = (local >= 0) & (local < m.valid)
        idx = local.clamp(0, max(m.valid - 1, 0))
        if ls is None:
            picked = transform_into(torch.empty(idx.shape, dtype=acc, device=x.device), x.gather(1, idx), m)
            y = torch.where(owned, picked, 0.0)
            if self.spec.tail:
                stats = kernels.softmax_partials(x, None, m, entropy=False, target=False, sum_logits=False)
                lse = _lse(combine_partials(stats, plan.tp_group))
            all_reduce_sum_(y, plan.tp_group)  # every id is owned by exactly one rank: the sum is its logit
            ls = y - lse[:, None] if self.spec.tail else y - torch.logsumexp(y, -1, keepdim=True)
        lq = rows.take(self.logprobs).to(acc)
        if self.spec.tail:
            q_tail = (1.0 - lq.exp().sum(-1)).clamp(min=0.0)
            p_tail = (1.0 - ls.exp().sum(-1)).clamp(min=torch.finfo(acc).tiny)
            tail_term = torch.where(q_tail > 0, q_tail * (q_tail.log() - p_tail.log()), 0.0)
        else:  # renormalised over the K ids
            lq = lq - torch.logsumexp(lq, -1, keepdim=True)
            q_tail = p_tail = tail_term = None
        terms = torch.where(lq > -math.inf, lq.exp() * (lq - ls), 0.0)
        loss = terms.sum(-1) + (tail_term if self.spec.tail else 0.0)
        return loss, (lq, ls, lse, q_tail, p_tail, idx, owned)

    def _grad_(self, x, state, weight, kernels, out, m):
        """The student's gradient into `out`: ``Z p_s - q`` at the teacher's ids, and with the tail
        ``p_s (Z - q_tail / p_tail)`` at every other column (0 there without the tail), where ``Z = sum q +
        q_tail`` is the teacher's mass over the K + 1 buckets: 1, or its top-k mass where that is a little
        above 1 (an engine's rounding, within `lmloss.distill.TOPK_MASS_TOLERANCE`: the tail is then empty)."""
        lq, ls, lse, q_tail, p_tail, idx, owned = state
        slope = m.scale
        if m.softcap:  # dy/dx at the ids, scale * (1 - tanh^2), read before `out` (maybe x) is written
            t = torch.tanh(x.gather(1, idx).to(ls.dtype) / m.softcap)
            slope = (1.0 - t * t) * m.scale
        p_ids = ls.exp()
        if self.spec.tail:
            total = lq.exp().sum(-1) + q_tail
            a = total - q_tail / p_tail
            coef = torch.zeros((x.shape[0], 4), dtype=lse.dtype, device=x.device)
            coef[:, 0] = torch.where(weight != 0, weight * a, 0.0)  # select: an ignored row's a may be NaN
            kernels.softmax_grad_(x, None, lse, None, coef, m, out, uniform_term=False)
            at_ids = p_ids * (total - a)[:, None] - lq.exp()
        else:
            out.zero_()
            at_ids = p_ids - lq.exp()
        active = owned & (weight != 0)[:, None]
        values = torch.where(active, at_ids * slope * weight[:, None], 0.0)
        out.scatter_add_(1, idx, values.to(out.dtype))
        return out

    def forward_chunk(self, state, rows, x, kernels, sink, *, overwrite: bool) -> dict:
        loss, terms = self._state(rows, x, kernels)
        if sink is not None:
            weight = self.weights(rows, loss.dtype, x.device)
            out = sink.buffer(rows, x)
            sink.consume(rows, self._grad_(x, terms, weight, kernels, out, self.plan.math))
        valid = self.weights.valid(rows)
        lse = terms[2] if terms[2] is not None else torch.full_like(loss, math.nan)
        return {"loss": loss if valid is None else torch.where(valid, loss, 0.0), "lse_student": lse,
                "log_student_at_ids": terms[1]}  # fmt: skip

    def coefficients(self, saved, grads):
        (g,) = grads
        if g is None:
            return None, {}
        return True, {"weights": _UpstreamWeights(self.labels, self.plan.ignore_index, upstream=g)}

    def backward_chunk(self, state, rows, x, kernels, sink, saved, coef, extra, *, math, cols=None) -> None:
        lse = rows.take(saved["lse_student"]) if self.spec.tail else None
        _, terms = self._state(rows, x, kernels, lse=lse, ls=rows.take(saved["log_student_at_ids"]), chunk_math=math)
        weight = extra["weights"](rows, terms[1].dtype, x.device)
        out = sink.buffer(rows, x)
        sink.consume(rows, self._grad_(x, terms, weight, kernels, out, math))
