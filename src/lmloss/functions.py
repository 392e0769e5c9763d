"""The three loss autograd Functions every op runs through (one chunk loop, `lmloss.plan`).

* `PerTokenLoss`: per-token outputs (log-probs, entropy, per-token losses, divergences). The forward saves
  what the objective needs (log-sum-exps, ...); the backward turns any per-token upstream gradients into
  the gradient of the head's leaves with a second walk over the chunks (recomputing the logits), without
  collectives. Differentiable any number of times through the graph (`retain_graph`).
* `SummedLoss`: a scalar loss (a sum of per-token losses, or an objective of the per-token outputs such as
  an RL policy loss) whose gradient is computed in the forward while each chunk's logits are at hand; the
  backward only scales it by the upstream scalar (for a fused head: 3 matmuls per chunk in all instead of
  4). **Rule for a second backward** (``retain_graph=True``, ``gradcheck``): the gradients are recomputed
  with the forward's loop (the same collectives on every TP rank), never handed out twice.
* `InPlaceCrossEntropy`: the summed cross-entropy whose gradient is written over the logits in the forward
  (declared to autograd; see its docstring). Its gradient exists once: a second backward raises.

An `Op` says what a Function computes beside its tensors: the plan, how to build the head (`lmloss.chunks`:
what is differentiated) from the leaves, and the objective (`lmloss.objectives`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from lmloss._autograd import once_differentiable
from lmloss.chunks import DiscardSink, InPlaceSink, LogitRows
from lmloss.kernels import scale_
from lmloss.objectives import CONSTANT_OUTPUTS
from lmloss.plan import LossPlan, backward_pass, forward_pass


@dataclasses.dataclass
class Op:
    """plan: the agreed `LossPlan`; head: ``head(*leaves) -> head`` (`LogitsHead`, `LinearHead`,
    `lmloss.replay.SlotsHead`); objective: what each chunk computes (`lmloss.objectives`)."""

    plan: LossPlan
    head: Callable
    objective: object

    def rows(self, n: int) -> int:
        return max(1, min(n, self.plan.chunk_size or n))

    @property
    def weight_pass_needed(self) -> bool:
        """Whether the weight gradient comes from a weight pass (`lmloss.plan.LossPlan.weight_block`)."""
        return self.plan.weight_block > 0

    def token_pass(self, head, needs):
        """The source and sink of a pass over the tokens that makes the gradients of `needs` (the weight's
        is left to the weight pass when the plan has one): ``(source, sink or None)``."""
        rows, cols = self.rows(head.n), self.plan.shard.size
        needs = tuple(bool(x) for x in needs)
        partial = {}
        if self.weight_pass_needed and len(needs) > 1 and needs[1]:
            if self.plan.weight_start:  # the first columns' weight gradient accumulates in this pass
                partial = {"weight_rows": self.plan.weight_start}
            else:
                needs = (needs[0], False, *needs[2:])
                if not any(needs):  # the weight alone: the chunks' coefficients, without hidden gradients
                    return head.source(rows, cols), DiscardSink()
        if not any(needs):
            return head.source(rows, cols), None
        single = self.plan.one_chunk(head.n)
        return head.pass_with_sink(rows, cols, needs, selection=self.plan.rows, single_chunk=single, **partial)

    def run(self, leaves, needs=None):
        """One forward walk: (results, sink or None); with `needs`, gradients of the leaves that need one."""
        head = self.head(*leaves)
        if needs is None or not any(needs):
            source, sink = head.source(self.rows(head.n), self.plan.shard.size), None
        else:
            source, sink = self.token_pass(head, needs)
        results = forward_pass(
            self.plan, head.n, self.objective, source, device=head.device, dtype=head.dtype, grad_sink=sink
        )
        return results, sink

    def weight_gradient(self, head, saved: dict, coef, extra: dict, grads: list) -> torch.Tensor:
        """The weight pass (`lmloss.plan.backward_pass` over blocks of columns): the weight's gradient. `grads`:
        the token pass's gradients, whose weight entry is the fp32 accumulator of the first `weight_start`
        columns (or None): taken out of it and rounded into the gradient before any block is made."""
        plan = self.plan
        source, sink = head.weight_pass(plan.weight_block_rows, plan.weight_block)
        first = [grads[1]] if grads[1] is not None and plan.weight_start else []
        grads[1] = None
        if first:
            sink.take_rows(first)
        backward_pass(plan, head.n, self.objective, source, sink, saved, coef, extra, device=head.device, columns=True)
        return sink.grad


class PerTokenLoss(torch.autograd.Function):
    """``PerTokenLoss.apply(op, *leaves) -> the objective's returned outputs`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, op: Op, *leaves):
        results, _ = op.run(leaves)
        saved = {k: v for k, v in op.objective.saved(results).items() if v is not None}
        ctx.op, ctx.keys, ctx.n_leaves = op, tuple(saved), len(leaves)
        ctx.save_for_backward(*leaves, *saved.values())
        ctx.set_materialize_grads(False)
        outs = op.objective.returned(results)
        # the log kept mass, the by-products (`lmloss.objectives.BYPRODUCTS`) and the reference head's
        # log-probs (`lmloss.objectives.CONSTANT_OUTPUTS`) have no gradient
        returned = getattr(op.plan, "returned", ())
        fixed = [o for k, o in zip(returned, outs) if k == "log_kept_mass" or k in op.plan.byproducts]
        fixed += [results[k] for k in CONSTANT_OUTPUTS if k in results and all(results[k] is not f for f in fixed)]
        if fixed:
            ctx.mark_non_differentiable(*fixed)
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        op: Op = ctx.op
        tensors = ctx.saved_tensors
        leaves, saved = tensors[: ctx.n_leaves], dict(zip(ctx.keys, tensors[ctx.n_leaves :]))
        none = (None,) * (1 + ctx.n_leaves)
        coef, extra = op.objective.coefficients(saved, grads)
        if coef is None:
            return none
        head = op.head(*leaves)
        needs = ctx.needs_input_grad[1:]
        source, sink = op.token_pass(head, needs)
        grads = [None] * ctx.n_leaves
        if sink is not None:
            backward_pass(op.plan, head.n, op.objective, source, sink, saved, coef, extra, device=head.device)
            grads = list(head.gradients(sink, tp_group=op.plan.tp_group))
        del source, sink  # the token pass's scratch, before the weight pass makes its own
        if op.weight_pass_needed and needs[1]:
            grads[1] = op.weight_gradient(head, saved, coef, extra, grads)
        return (None, *grads)


class SummedLoss(torch.autograd.Function):
    """``SummedLoss.apply(op, grad_enabled, denominator, *leaves) -> loss`` (or ``(loss, *extras)``): the
    objective's total, divided by `denominator` (a 0-d device tensor, the mean's count, whose reciprocal
    the objective already folds into the gradient; None for a sum). `extras`: per-token outputs the
    objective also returns, not differentiable (an RL objective's log-probs and entropies, for metrics)."""

    @staticmethod
    def forward(ctx, op: Op, grad_enabled: bool, denominator, *leaves):
        # grad mode is always off inside forward(): the caller says whether gradients will be wanted
        needs = tuple(bool(n and grad_enabled) for n in ctx.needs_input_grad[3:])
        results, sink = op.run(leaves, needs)
        ctx.op, ctx.needs, ctx.sink = op, needs, sink
        # a weight pass runs in the backward, from what the forward found per token (the upstream scalar
        # then joins its coefficients: the weight gradient is written once, already scaled)
        ctx.results = results if op.weight_pass_needed and needs[1] else None
        ctx.save_for_backward(*leaves)
        total = op.objective.total(results)
        loss = total if denominator is None else total / denominator
        extras = op.objective.extra_outputs(results)
        if not extras:
            return loss
        ctx.mark_non_differentiable(*extras)
        return (loss, *extras)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total, *_):
        op: Op = ctx.op
        leaves = ctx.saved_tensors
        none = (None, None, None, *(None,) * len(leaves))
        sink, ctx.sink = ctx.sink, "used"
        results = ctx.results
        if sink == "used":  # a second backward: recompute the gradients with the forward's loop
            rerun, sink = op.run(leaves, ctx.needs)
            results = rerun if results is not None else None
        if grad_total is None or (sink is None and results is None):
            return none
        head = op.head(*leaves)
        grads = list(head.gradients(sink, grad_total, tp_group=op.plan.tp_group))
        if results is not None:
            saved, coef, extra = op.objective.weight_pass_inputs(results, grad_total)
            grads[1] = op.weight_gradient(head, saved, coef, extra, grads)
        return (None, None, None, *grads)


class InPlaceCrossEntropy(torch.autograd.Function):
    """``sum`` of per-token losses; the gradient is computed in the forward and written over the logits.

    The backward only scales the stored gradient (already divided by the mean's count) by the upstream
    scalar, once, and does nothing over it when that upstream is 1.0. The modification is made known to
    autograd, so that another op that saved these logits fails with PyTorch's version-counter error
    instead of computing with a gradient:

    * logits that are not a view are marked dirty (``ctx.mark_dirty``) and returned as a second output;
      reading them after the call and backpropagating through that raises.
    * a view (``lm_head(h).view(-1, V)``, ``.flatten(0, 1)``, a slice) cannot be: PyTorch allows a
      function that modifies a view in place one output only, and would route its gradient through
      copies of the whole base. There the version counter (shared with the base) is bumped instead and
      the loss is the only output; the gradient goes back through the view as it is, without a copy.
    """

    @staticmethod
    def forward(ctx, logits, plan: LossPlan, objective, is_view: bool, denominator):
        # `denominator` (a 0-d device tensor, or None for "sum"): the mean's count, folded into the gradient
        flat = logits.view(-1, logits.shape[-1])
        results = forward_pass(
            plan, flat.shape[0], objective, LogitRows(flat), device=logits.device, dtype=logits.dtype,
            grad_sink=InPlaceSink(flat, plan.rows, chunk_rows=plan.chunk_size or flat.shape[0]),
        )  # fmt: skip
        ctx.set_materialize_grads(False)
        ctx.used = False
        total = results["loss"].sum()
        loss = total if denominator is None else total / denominator
        if is_view:
            # Triton's writes do not bump it; the torch kernels' may have: one more bump, then saved, so that
            # a later in-place change to the logits is caught when the backward unpacks them
            torch.autograd.graph.increment_version(logits)
            ctx.save_for_backward(logits)
            return loss
        ctx.mark_dirty(logits)
        ctx.save_for_backward(logits)
        return loss, logits

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total, grad_overwritten=None):
        if grad_overwritten is not None:
            raise RuntimeError(
                "lmloss.cross_entropy(inplace_backward=True) overwrote the logits with their gradient; the "
                "logits tensor cannot be used after the call (use inplace_backward=False)"
            )
        if ctx.used:
            raise RuntimeError(
                "lmloss.cross_entropy(inplace_backward=True) hands out its gradient once; a second backward "
                "through the same graph needs inplace_backward=False"
            )
        ctx.used = True
        (grad,) = ctx.saved_tensors
        if grad_total is None:
            return None, None, None, None, None
        return scale_(grad, grad_total), None, None, None, None  # no [N, V] work for an upstream of 1.0
