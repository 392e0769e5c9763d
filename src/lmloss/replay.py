"""Replay: log-probs renormalised over the kept set the rollout engine returned (``support=``).

The engine's kept ids per token, ``[N, K]`` padded with -1, select ``K`` *slots* per token. Each TP rank
fills the slots whose ids fall in its vocabulary shard and leaves the others at `ABSENT`; the op then runs
unchanged over the ``[N, K]`` slot logits, vocab-parallel over ``K`` slots per rank (the slots of rank r
are global slots ``[r K, (r + 1) K)``). From logits the slots are a gather (`_GatherSlots`: its backward
scatters the slots' gradient, chunk by chunk, into the one ``[N, V]`` gradient buffer); fused, `_SupportLinear` multiplies each chunk's hidden rows by the weight
rows its ids name, and nothing ``[N, V]`` exists.
"""

from __future__ import annotations

import torch

from lmloss import _validate
from lmloss._autograd import once_differentiable
from lmloss.sampling import SupportSlots, check_support, report_dropped, support_slots
from lmloss.vocab_parallel import ProcessGroup, all_reduce_max_, all_reduce_sum_, world_size

#: The logit of a slot this rank does not fill (another rank's id, or padding): finite, so that a row with
#: no id on this shard gives zero mass through the TP combine (``exp(ABSENT - M) = 0``) instead of NaN,
#: and stays finite after a temperature of 1e-6.
ABSENT = -1e30


def _slots(support, labels, *, local_vocab, vocab_size, vocab_start, tp_group, ignore_index) -> SupportSlots:
    n = labels.numel()
    rank = 0 if tp_group is None else torch.distributed.get_rank(tp_group)
    world = world_size(tp_group)
    if world == 1:  # one process holds the whole vocabulary: ids and labels must lie in it
        vocab_size = local_vocab if vocab_size is None else vocab_size
        _validate.check_label_range(labels.reshape(-1), vocab_size, ignore_index)
    sup = check_support(support, n, labels.device, vocab_size)
    start = rank * local_vocab if vocab_start is None else vocab_start
    valid = local_vocab if vocab_size is None else max(0, min(local_vocab, vocab_size - start))
    return support_slots(
        sup, labels.reshape(-1), start=start, valid=valid, local_vocab=local_vocab, rank=rank, group=tp_group,
        ignore_index=ignore_index,
    )  # fmt: skip


def _fill(g: torch.Tensor, slots: SupportSlots, softcap: float | None) -> torch.Tensor:
    """Softcap the owned slots (in fp32, as the kernels do) and put `ABSENT` in the others."""
    g = g.float() if g.dtype in (torch.bfloat16, torch.float16) else g
    if softcap:
        g = softcap * torch.tanh(g / softcap)
    return torch.where(slots.owned, g, ABSENT)


def _finish(outs, slots: SupportSlots, labels: torch.Tensor, ignore_index: int, return_entropy: bool):
    lp = outs[0] if isinstance(outs, tuple) else outs
    lp = torch.where(slots.dropped.view(lp.shape), float("-inf"), lp)
    report_dropped(lp, labels, ignore_index)
    return (lp, outs[1]) if return_entropy else lp


class _GatherSlots(torch.autograd.Function):
    """``logits [N, V_local]``, ``local [N, K]`` int64 -> ``logits.gather(1, local)`` ``[N, K]``.

    `torch.gather`'s own backward builds the gradient out of place (``zeros(N, V).scatter_add(...)``), two
    ``[N, V]`` tensors at once; this one allocates the logits' gradient once and scatters each chunk's
    ``[c, K]`` slot gradient into that chunk's rows in place. Slots this rank does not own (clamped
    columns) carry a zero gradient (`_fill` selects `ABSENT` there), and scatter_add adds it harmlessly.
    """

    @staticmethod
    def forward(ctx, logits, local, chunk: int):
        ctx.save_for_backward(local)
        ctx.shape, ctx.dtype, ctx.chunk = logits.shape, logits.dtype, chunk
        return logits.gather(1, local)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (local,) = ctx.saved_tensors
        out = torch.zeros(ctx.shape, dtype=ctx.dtype, device=grad.device)
        n = ctx.shape[0]
        for s in range(0, n, ctx.chunk):
            e = min(s + ctx.chunk, n)
            out[s:e].scatter_add_(1, local[s:e], grad[s:e].to(ctx.dtype))
        return out, None, None


def replay_over_logits(
    logits, labels, support, *, top, chunk_size, temperature, softcap, ignore_index, vocab_size, tp_group,
    vocab_start, return_entropy, impl,
):  # fmt: skip
    """`lmloss.token_logprobs` with ``support=``: see the module docstring."""
    from lmloss.logits import DEFAULT_CHUNK_SIZE, token_logprobs

    if any(v is not None for v in top[:3]):
        raise ValueError(
            "support= replays the engine's kept set: it cannot be combined with top_k / top_p / min_p "
            "(they recompute it)"
        )
    want_mass = top[3]
    if not isinstance(want_mass, bool):
        raise TypeError(f"return_log_kept_mass must be a bool, got {want_mass!r}")
    _validate.check_softcap(softcap)
    v_local = logits.shape[-1]
    slots = _slots(
        support, labels, local_vocab=v_local, vocab_size=vocab_size, vocab_start=vocab_start, tp_group=tp_group,
        ignore_index=ignore_index,
    )  # fmt: skip
    _validate.check_chunk_size(chunk_size)
    # the scatter's chunking only bounds its [c, K] temporaries: any row count does
    step = chunk_size if isinstance(chunk_size, int) else DEFAULT_CHUNK_SIZE
    g = _GatherSlots.apply(logits.reshape(-1, v_local), slots.local, step)
    g = _fill(g, slots, softcap)
    outs = token_logprobs(
        g, slots.labels, chunk_size=chunk_size, temperature=temperature, ignore_index=ignore_index,
        tp_group=tp_group, return_entropy=return_entropy, impl=impl,
    )  # fmt: skip
    if return_entropy:
        outs = tuple(o.view(labels.shape) for o in outs)
    else:
        outs = outs.view(labels.shape)
    outs = _finish(outs, slots, labels, ignore_index, return_entropy)
    if not want_mass:
        return outs
    with torch.no_grad():
        mass = _log_kept_mass(
            logits.detach(), g.detach(), temperature=temperature, softcap=softcap, vocab_size=vocab_size,
            tp_group=tp_group, vocab_start=vocab_start, chunk_size=chunk_size, impl=impl,
        ).view(labels.shape)  # fmt: skip
    return (*outs, mass) if return_entropy else (outs, mass)


def _log_kept_mass(
    logits, slot_logits, *, temperature, softcap, vocab_size, tp_group, vocab_start, chunk_size, impl
):
    """``log`` of the replayed set's probability under the full tempered softmax, ``[N]`` fp32:
    ``logsumexp`` of the slots (`slot_logits`, already softcapped, `ABSENT` where not this rank's) minus
    that of the whole vocabulary. The latter is read off the plain op's log-prob of id 0 (``y_0 - lse``;
    one more pass over the logits, without gradient), ``y_0`` from the rank whose shard holds id 0."""
    from lmloss.logits import token_logprobs

    y = slot_logits.float() * (1.0 / temperature)
    m = y.amax(dim=-1)
    big_m = all_reduce_max_(m.clone(), tp_group)
    slot_lse = big_m + all_reduce_sum_(torch.exp(y - big_m[:, None]).sum(-1), tp_group).log()
    flat = logits.reshape(-1, logits.shape[-1])
    zero = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
    lp0 = token_logprobs(
        flat, zero, chunk_size=chunk_size, temperature=temperature, softcap=softcap, vocab_size=vocab_size,
        tp_group=tp_group, vocab_start=vocab_start, impl=impl,
    )  # fmt: skip
    rank = 0 if tp_group is None else torch.distributed.get_rank(tp_group)
    start = rank * flat.shape[-1] if vocab_start is None else vocab_start
    x0 = flat[:, 0].float()
    if softcap:
        x0 = softcap * torch.tanh(x0 / softcap)
    y0 = all_reduce_sum_(
        torch.where(torch.tensor(start == 0, device=flat.device), x0 * (1.0 / temperature), 0.0), tp_group
    )
    return slot_lse - (y0 - lp0)


class _SupportLinear(torch.autograd.Function):
    """``[N, K]`` slot logits ``hidden[i] . weight[local[i, q]] (+ bias)``, chunk by chunk: each chunk
    multiplies its hidden rows by the distinct weight rows its ids name (``unique``), never ``[N, V]``.
    The backward scatters the slots' gradient back into those rows (and the hidden rows)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, local, chunk: int, tp_group):
        n = hidden.shape[0]
        out = torch.empty(local.shape, dtype=weight.dtype, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            rows, inverse = torch.unique(local[s:e], return_inverse=True)
            w = weight[rows]
            z = hidden[s:e] @ w.t() if bias is None else torch.addmm(bias[rows], hidden[s:e], w.t())
            out[s:e] = z.gather(1, inverse)
        ctx.save_for_backward(hidden, weight, bias, local)
        ctx.chunk, ctx.tp_group = chunk, tp_group
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        hidden, weight, bias, local = ctx.saved_tensors
        needs = ctx.needs_input_grad
        acc = torch.promote_types(weight.dtype, torch.float32)
        gh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if needs[0] else None
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs[1] else None
        gb = (
            torch.zeros(weight.shape[0], dtype=acc, device=weight.device)
            if bias is not None and needs[2]
            else None
        )
        n = hidden.shape[0]
        for s in range(0, n, ctx.chunk):
            e = min(s + ctx.chunk, n)
            rows, inverse = torch.unique(local[s:e], return_inverse=True)
            dz = torch.zeros((e - s, rows.numel()), dtype=acc, device=hidden.device)
            dz.scatter_add_(1, inverse, grad[s:e].to(acc))
            if gh is not None:
                gh[s:e] = dz @ weight[rows].to(acc)
            if gw is not None:
                gw.index_add_(0, rows, dz.t() @ hidden[s:e].to(acc))
            if gb is not None:
                gb.index_add_(0, rows, dz.sum(0))
        if gh is not None:  # every rank's slots hold its own shard's ids: the hidden gradient is their sum
            # (tp_group None under sequence parallelism: the rows' gather sums them in its backward)
            gh = all_reduce_sum_(gh, ctx.tp_group).to(hidden.dtype)
        gw = None if gw is None else gw.to(weight.dtype)
        gb = None if gb is None else gb.to(bias.dtype)
        return gh, gw, gb, None, None, None


def replay_over_hidden(
    hidden, weight, labels, support, *, bias, top, chunk_size, temperature, softcap, ignore_index, vocab_size,
    tp_group: ProcessGroup | None, vocab_start, sequence_parallel, return_entropy, impl,
):  # fmt: skip
    """`lmloss.linear_token_logprobs` with ``support=``: see the module docstring."""
    from lmloss.fused import auto_chunk_size
    from lmloss.logits import token_logprobs

    if any(v is not None for v in top[:3]) or top[3]:
        raise ValueError(
            "support= replays the engine's kept set: it cannot be combined with top_k / top_p / min_p / "
            "return_log_kept_mass (they recompute it; the kept mass of a replayed set is computed from "
            "logits only, for now)"
        )
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
    if sequence_parallel and tp_group is None:
        raise ValueError("sequence_parallel=True needs the tp_group that the tokens are sharded over")
    _validate.check_softcap(softcap)
    _validate.check_floating("hidden", hidden)
    _validate.check_floating("weight", weight)
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1] or hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden [..., H] and weight [V_local, H] must match in H and dtype, got {tuple(hidden.shape)} "
            f"{hidden.dtype} and {tuple(weight.shape)} {weight.dtype}"
        )
    expected, against = hidden.shape[:-1], "hidden"
    if sequence_parallel:  # labels and support cover every rank's tokens, in rank order
        expected = torch.Size((world_size(tp_group) * hidden.shape[0], *hidden.shape[1:-1]))
        against = "hidden (gathered over tp_group)"
    labels = _validate.check_labels(labels, expected, hidden.device, against=against)
    v_local = weight.shape[0]
    slots = _slots(
        support, labels, local_vocab=v_local, vocab_size=vocab_size, vocab_start=vocab_start, tp_group=tp_group,
        ignore_index=ignore_index,
    )  # fmt: skip
    flat = hidden.reshape(-1, hidden.shape[-1])
    if sequence_parallel:  # its backward sums the ranks' partial hidden gradients and scatters the rows
        from lmloss.fused import _GatherRows

        flat = _GatherRows.apply(flat, tp_group)
    n = flat.shape[0]
    if chunk_size == "auto":
        chunk = auto_chunk_size(n, min(v_local, slots.local.shape[1] * 64), hidden.device)
    else:
        _validate.check_chunk_size(chunk_size)
        chunk = n if chunk_size is None else chunk_size
    g = _SupportLinear.apply(
        flat, weight, bias, slots.local, max(chunk, 1), None if sequence_parallel else tp_group
    )
    g = _fill(g, slots, softcap)
    outs = token_logprobs(
        g, slots.labels, chunk_size=None, temperature=temperature, ignore_index=ignore_index, tp_group=tp_group,
        return_entropy=return_entropy, impl=impl,
    )  # fmt: skip
    if return_entropy:
        outs = tuple(o.view(labels.shape) for o in outs)
    else:
        outs = outs.view(labels.shape)
    return _finish(outs, slots, labels, ignore_index, return_entropy)
