"""Replay: log-probs renormalised over the kept set the rollout engine returned (``support=``).

The engine's kept ids per token, ``[N, K]`` padded with -1, select ``K`` *slots* per token. Each TP rank
fills the slots whose ids fall in its vocabulary shard and leaves the others at `ABSENT`; the plan's
kernels then run over the ``[N, K]`` slots, vocab-parallel over K slots per rank (the slots of rank r are
global slots ``[r K, (r + 1) K)``), in the same chunk loop as every other op (`lmloss.plan`).

`SlotsHead` is a head (`lmloss.chunks`) over another head's leaves: its chunk source gathers each chunk's
slot logits (from the logits rows, or, fused, by multiplying the chunk's hidden rows by only the weight
rows its ids name) and maps them through the vocabulary's transform (temperature and softcap, the PyTorch
kernels' own `transform_into`), so the kernels run with the identity; its gradient sink chains each
chunk's slot gradient through that transform and scatters it back (into the ``[N, V]`` gradient, or into
the hidden / weight / bias gradients). Nothing ``[N, V]`` exists in the fused path.

The kept set's mass under the full softmax (``return_log_kept_mass``) is the slots' log-sum-exp minus the
whole vocabulary's, whose statistics the loop takes from a second source over the full rows in the same
collectives (`lmloss.objectives.FullRows`).
"""

from __future__ import annotations

import functools

import torch

from lmloss.chunks import LogitsHead, tiled_linear
from lmloss.functions import Op
from lmloss.kernels import ChunkMath, compute_dtype, scaled_cast
from lmloss.kernels.torch_ref import transform_into
from lmloss.objectives import FullRows, SoftmaxObjective
from lmloss.sampling import SupportSlots, check_support, support_slots
from lmloss.vocab_parallel import all_reduce_sum_

#: The logit of a slot this rank does not fill (another rank's id, or padding): finite, so that a row with
#: no id on this shard gives zero mass through the TP combine (``exp(ABSENT - M) = 0``) instead of NaN.
ABSENT = -1e30


def check_arguments(support, n_tokens: int, device, vocab_size: int | None, top: tuple, want_mass) -> torch.Tensor:
    """The local checks of ``support=`` (before the rank agreement): flat ``[N, K]`` int64 ids."""
    if any(v is not None for v in top):
        raise ValueError(
            "support= replays the engine's kept set: it cannot be combined with top_k / top_p / min_p "
            "(they recompute it)"
        )
    if not isinstance(want_mass, bool):
        raise TypeError(f"return_log_kept_mass must be a bool, got {want_mass!r}")
    return check_support(support, n_tokens, device, vocab_size)


def op_over_slots(plan, base_head, base_leaves, labels, support: torch.Tensor, want_mass: bool, **objective) -> Op:
    """The `Op` of an op over a replayed support: `base_head` (``LogitsHead`` or a ``LinearHead`` factory)
    builds the head the slots are taken from; the plan was made with `support` (agreed); `objective`: more
    `SoftmaxObjective` arguments (an RL objective's upstream)."""
    vocab = plan.vocab
    if support.numel() and int(support.max()) >= vocab.vocab_size:  # agreed ids: every rank raises alike
        raise ValueError(f"support ids must be in [0, {vocab.vocab_size}) or -1 (padding), found {int(support.max())}")
    rank = 0 if plan.tp_group is None else torch.distributed.get_rank(plan.tp_group)
    slots = support_slots(
        support, labels, start=vocab.start, valid=vocab.valid, local_vocab=vocab.size, rank=rank,
        group=plan.tp_group, ignore_index=plan.ignore_index,
    )  # fmt: skip
    full_rows = None
    if want_mass:
        base = base_head(*base_leaves)
        full_rows = FullRows(lambda rows: base.source(rows, vocab.size), plan.vocab_math, base.device)
    objective = SoftmaxObjective(plan, slots.labels, full_rows=full_rows, dropped_labels=slots.dropped, **objective)
    head = functools.partial(SlotsHead, base_head=base_head, slots=slots, math=plan.vocab_math, tp_group=plan.tp_group)
    return Op(plan, head, objective)


class SlotRows:
    """Chunk source of a `SlotsHead`: ``[c, K]`` transformed slot logits in the compute dtype, `ABSENT` where
    this rank holds no id (a fresh tensor: the kernels may overwrite it). Keeps the chunk's raw slot
    logits for the sink's chain rule."""

    owns_chunks = True
    gathers_rows = True  # a slot chunk is a gather anyway

    def __init__(self, head: SlotsHead) -> None:
        self.head = head
        self.raw = None

    def __call__(self, rows, cols=None) -> torch.Tensor:
        head = self.head
        raw = head.values(rows)  # a fresh gather
        if head.math.softcap or raw.dtype != compute_dtype(raw.dtype):
            self.raw = raw if head.math.softcap else None  # only softcap's chain rule reads it again
            y = transform_into(torch.empty(raw.shape, dtype=compute_dtype(raw.dtype), device=raw.device), raw,
                               head.math)  # fmt: skip
        else:  # the temperature alone, in the compute dtype: in place
            self.raw, y = None, transform_into(raw, raw, head.math, aliased=True)
        return y.masked_fill_(~rows.take(head.slots.owned), ABSENT)


class SlotSink:
    """Gradient sink of a `SlotsHead`: d/dy of the chunk's slots -> d/dx through the transform (``scale``, and
    softcap's ``1 - tanh^2``), then scattered into the base head's gradients."""

    def __init__(self, head: SlotsHead, source: SlotRows, needs) -> None:
        self.head, self.source = head, source
        self.grads = head.new_gradients(needs)

    def buffer(self, rows, x):
        return x

    def consume(self, rows, g):
        head = self.head
        math = head.math
        # g is the chunk the source made for this call alone (`buffer` hands it back): scaled in place
        if math.softcap:
            t = torch.tanh(self.source.raw.to(g.dtype) / math.softcap)
            g.mul_((1.0 - t * t) * math.scale)
        elif math.scale != 1.0:
            g.mul_(math.scale)
        head.scatter(self.grads, rows, g.masked_fill_(~rows.take(head.slots.owned), 0.0))


class SlotsHead:
    """The K slots per token of a replayed support, over a base head (`LogitsHead` or `LinearHead`, built from
    the same leaves) whose columns they name (see the module docstring)."""

    def __init__(self, *leaves, base_head, slots: SupportSlots, math: ChunkMath, tp_group) -> None:
        self.base = base_head(*leaves)
        self.slots, self.math, self.tp_group = slots, math, tp_group
        self.n, self.device, self.dtype = self.base.n, self.base.device, self.base.dtype

    # the base head's slot values and their gradients

    def values(self, rows) -> torch.Tensor:
        local = rows.take(self.slots.local)
        if isinstance(self.base, LogitsHead):
            if rows.contiguous:
                return self.base.logits[rows.start : rows.end].gather(1, local)
            return self.base.logits[rows.index[:, None], local]  # the slots alone, not the rows
        b = self.base
        ids, inverse = torch.unique(local, return_inverse=True)
        w = b.weight[ids]
        bias = None if b.bias is None else b.bias[ids]
        h = rows.take(b.hidden)
        tile = b.opts.get("gemm_tile")
        if tile is not None:  # the invariant mode: GEMMs of one fixed shape, whatever the chunk's ids
            z = tiled_linear(h, w, bias, w.new_empty((rows.count, w.shape[0])), tile)
        else:
            z = h @ w.t() if bias is None else torch.addmm(bias, h, w.t())
        return z.gather(1, inverse)

    def new_gradients(self, needs) -> dict:
        if isinstance(self.base, LogitsHead):
            x = self.base.logits
            return {"logits": torch.zeros(x.shape, dtype=x.dtype, device=x.device)} if needs[0] else {}
        # zero-filled: the rows that do not count (and the weight rows no id names) keep a zero gradient
        b = self.base
        acc = torch.promote_types(b.weight.dtype, torch.float32)
        out = {}
        if needs[0]:
            out["hidden"] = torch.zeros(b.hidden.shape, dtype=acc, device=b.hidden.device)
        if needs[1]:
            out["weight"] = torch.zeros(b.weight.shape, dtype=acc, device=b.weight.device)
        if b.bias is not None and needs[2]:
            out["bias"] = torch.zeros(b.bias.shape, dtype=acc, device=b.bias.device)
        return out

    def scatter(self, grads: dict, rows, g: torch.Tensor) -> None:
        local = rows.take(self.slots.local)
        if "logits" in grads:
            x = grads["logits"]
            if rows.contiguous:
                x[rows.start : rows.end].scatter_add_(1, local, g.to(x.dtype))
            else:  # into the slots of those rows alone
                x.index_put_((rows.index[:, None], local), g.to(x.dtype), accumulate=True)
            return
        b = self.base
        acc = torch.promote_types(b.weight.dtype, torch.float32)
        ids, inverse = torch.unique(local, return_inverse=True)
        dz = torch.zeros((rows.count, ids.numel()), dtype=acc, device=g.device).scatter_add_(1, inverse, g.to(acc))
        if "hidden" in grads:
            rows.put_(grads["hidden"], dz @ b.weight[ids].to(acc))
        if "weight" in grads:
            grads["weight"].index_add_(0, ids, dz.t() @ rows.take(b.hidden).to(acc))
        if "bias" in grads:
            grads["bias"].index_add_(0, ids, dz.sum(0))

    # the head protocol (`lmloss.chunks`)

    @property
    def leaves(self):
        return self.base.leaves

    def source(self, rows: int, cols: int) -> SlotRows:
        return SlotRows(self)

    def pass_with_sink(self, rows: int, cols: int, needs, selection=None, single_chunk=False):
        source = SlotRows(self)
        if not any(needs):
            return source, None
        return source, SlotSink(self, source, needs)

    def gradients(self, sink: SlotSink | None, scale=None, tp_group=None):
        if isinstance(self.base, LogitsHead):
            g = None if sink is None else sink.grads.get("logits")
            return (g if g is None or scale is None else g.mul_(scale),)
        if sink is None:
            return (None, None, None)
        b, grads = self.base, sink.grads
        gh = grads.get("hidden")
        if gh is not None:
            # every rank's slots hold its own shard's ids: the hidden gradient is their sum (with sequence
            # parallelism the rows' gather sums them in its backward)
            if not b.opts["sequence_parallel"]:
                all_reduce_sum_(gh, self.tp_group)
            gh = scaled_cast(gh, scale, b.hidden.dtype)
        gw = None if "weight" not in grads else scaled_cast(grads["weight"], scale, b.weight.dtype)
        gb = None if "bias" not in grads else scaled_cast(grads["bias"], scale, b.bias.dtype)
        return gh, gw, gb
