"""Sequence objectives: per-sequence sums of per-token terms, a function of them, its gradient per token.

GSPO's sequence ratio, GMPO's geometric mean, VESPO's sequence weight (`lmloss.rl`) and DPO's pair margin
(`lmloss.preference`) share one shape: each token contributes terms (its log-prob, a reference's, a weight,
a count), the terms are summed per sequence (``[S, k]``), and the loss is a function of those sums (and of
the per-token values themselves, for rl's per-token surrogates). None of it is known for a token until
every chunk of its sequence is done, so the gradient cannot be formed chunk by chunk in the forward as a
token-separable objective's is (`lmloss.functions.SummedLoss`). Instead (`sequence_loss`):

1. the one chunk loop walks the tokens once for the per-token outputs (`lmloss.functions.PerTokenLoss`:
   log-probs, entropies, and beside them a second head's log-probs, not differentiated);
2. `Sequences.sums` sums the objective's per-token columns per sequence (all-reduced over a context-parallel
   group, differentiably);
3. the objective's value is computed from the sums and the per-token outputs in autograd (``[S]`` and
   ``[N]`` tensors: cheap);
4. its backward gives each token's upstream gradient of the log-probs (and entropies), which
   `PerTokenLoss`'s backward turns into the head's gradients in the loop's second walk.

A fused head therefore runs four matmuls per chunk (the forward's logits; the backward's logits again,
d hidden and d weight), plus one per chunk for a second head in the forward. The memory stays that of a
per-token op: chunk-sized buffers within the budget and O(tokens) vectors, whatever the sequence length.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
import torch.distributed as dist

from lmloss.functions import Op, PerTokenLoss
from lmloss.vocab_parallel import ProcessGroup, world_size

__all__ = ["AllReduceSum", "SequenceObjective", "Sequences", "sequence_loss", "sequence_sums"]


class AllReduceSum(torch.autograd.Function):
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


def sequence_sums(
    columns: torch.Tensor, seq: torch.Tensor, n_seq: int, cp_group: ProcessGroup | None
) -> torch.Tensor:
    """Per-sequence sums ``[n_seq, k]`` of the token columns ``[N, k]`` (`seq`: each token's sequence, int64
    ``[N]``), in the columns' dtype. Under CP each rank holds part of every sequence: the sums are summed over
    `cp_group` (a differentiable all-reduce, so a sum's gradient reaches every rank's tokens).

    Accumulated in float64 and rounded once: ``index_add`` adds a sequence's terms one after the other, and in
    fp32 a sum of 1024 log-probs near -11 (about -11,000, where fp32's spacing is 0.001) drifts by ~0.01, which
    DPO's margin of two such differences turns into a 4e-4 relative error of its loss (8 sequences of 1024 tokens,
    32000 columns), twenty times a plain fp32 ``sum``'s."""
    sums = torch.zeros((n_seq, columns.shape[1]), dtype=torch.float64, device=columns.device)
    sums = sums.index_add(0, seq, columns.to(torch.float64))
    if world_size(cp_group) > 1:
        sums = AllReduceSum.apply(sums, cp_group)
    return sums.to(columns.dtype)


@dataclasses.dataclass(frozen=True)
class Sequences:
    """Which sequence each token belongs to: `index` int64 ``[N]`` in ``[0, count)`` (the op's flat tokens, a
    context-parallel rank's share of them under `group`), `count` sequences in all. Agreed by the op that
    makes it (the index is a per-token tensor of its rank agreement)."""

    index: torch.Tensor
    count: int
    group: ProcessGroup | None = None

    def sums(self, columns: torch.Tensor) -> torch.Tensor:
        """``[count, k]`` sums of the per-token ``[N, k]`` `columns`, over the group's ranks (differentiable)."""
        return sequence_sums(columns, self.index, self.count, self.group)

    def of_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence ``[count, ...]`` values -> each token's sequence's ``[N, ...]``."""
        return values[self.index]


class SequenceObjective(Protocol):
    """What `sequence_loss` evaluates, given the loop's per-token outputs by name (``"logprobs"``,
    ``"entropy"``, ``"ref_logprobs"``...; flat ``[N]``, the differentiable ones as autograd leaves' results)."""

    def columns(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """``[N, k]`` per-token terms to sum per sequence (None: no sums), 0 where a token does not count."""

    def value(self, outputs: dict[str, torch.Tensor], sums: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """``(loss, metrics)`` from the outputs and the global sums ``[S, k]``: a 0-d loss differentiable in
        both, and detached metrics."""


def sequence_loss(
    op: Op, leaves: tuple, sequences: Sequences | None, objective: SequenceObjective
) -> tuple[torch.Tensor, object]:
    """Run `op` (a `PerTokenLoss` op: its objective names its returned outputs, `returned_names`) over
    `leaves`, sum `objective`'s columns per sequence and return its value (``(loss, metrics)``); the backward of
    the loss reaches the leaves through the per-token outputs (module docstring)."""
    outs = PerTokenLoss.apply(op, *leaves)
    outputs = dict(zip(op.objective.returned_names(), outs))
    columns = objective.columns(outputs)
    sums = None
    if columns is not None:
        if sequences is None:
            raise ValueError("a sequence objective with per-sequence columns needs the sequences")
        sums = sequences.sums(columns)
    return objective.value(outputs, sums)
