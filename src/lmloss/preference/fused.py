"""The preference losses fused into the LM head: `linear_preference_loss`, token-chunked.

A preference loss (DPO and its family) is a function of per-sequence sums: each sequence's summed
(weighted) policy log-prob of its completion tokens, the reference policy's, and its token count. Here they
come from the one chunk loop without any ``[tokens, V]`` tensor, whatever the sequence length: a sequence
objective (`lmloss.sequences`) over the per-token log-probs, with the reference head as a second chunk
source in the same forward (one more matmul per chunk, not differentiated). The loss function itself (loss
types, f-divergences, label smoothing...) is the caller's: a callable of the per-sequence sums, which autograd
differentiates on ``[S]`` tensors; its gradient goes back to every token as its log-prob's upstream.

Memory: the chunks of both heads within the memory budget, and O(tokens) vectors. Work: per chunk, the
forward's two matmuls (policy and reference), then the backward's three (the policy's logits again, d hidden,
d weight).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from lmloss import _validate
from lmloss.agreement import agree_over_group
from lmloss.distill import second_head
from lmloss.functions import Op
from lmloss.fused import TORCH_BYTES_PER_LOGIT, prepare
from lmloss.objectives import Reference, SoftmaxObjective
from lmloss.preference.losses import SequenceStats, preference_loss
from lmloss.preference.spec import PreferenceSpec
from lmloss.rl.aggregation import DTYPE_CODES, check_ids, check_mask, sequence_index
from lmloss.rl.fused import check_reference_head
from lmloss.sequences import Sequences, sequence_loss
from lmloss.vocab_parallel import ProcessGroup, world_size

__all__ = ["PAIR_LAYOUTS", "linear_preference_loss"]

#: How the 2B sequences of B pairs are ordered: TRL's (every chosen sequence, then every rejected one, in
#: the same pair order) or each pair's chosen sequence followed by its rejected one.
PAIR_LAYOUTS = ("halves", "interleaved")
#: The fields of the agreement over `cp_group` (a sequence's tokens on several ranks).
CP_FIELDS = ("dtype", "sequences", "given")


def describe_loss(loss: object) -> str:
    """A text of the loss that every rank must share (agreed by a hash): a function's qualified name, a
    ``functools.partial``'s function and arguments, a dataclass spec's fields (its repr)."""
    if isinstance(loss, functools.partial):
        args = ", ".join([describe_loss(a) for a in loss.args] + [f"{k}={describe_loss(v)}" for k, v in sorted(loss.keywords.items())])
        return f"{describe_loss(loss.func)}({args})"
    if dataclasses.is_dataclass(loss) and not isinstance(loss, type):
        return repr(loss)
    if isinstance(loss, (int, float, str, bool, type(None))):
        return repr(loss)
    name = getattr(loss, "__qualname__", None) or type(loss).__qualname__
    return f"{getattr(loss, '__module__', '')}.{name}"


def _loss_of(out) -> torch.Tensor:
    """The 0-d loss of what the loss callable returned: a tensor, ``(loss, metrics)``, or an object with a
    ``loss`` field (a ``PreferenceOutput``)."""
    loss = out[0] if isinstance(out, tuple) else getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(
            "the preference loss must return a 0-d tensor, (loss, metrics) or an object with a .loss field; got "
            f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else f' of shape {tuple(loss.shape)}'}"
        )
    return loss


def _with_loss(out, loss: torch.Tensor):
    """`out` with its loss replaced by `loss` (the share of a context-parallel rank)."""
    if isinstance(out, torch.Tensor):
        return loss
    if isinstance(out, tuple):
        return (loss, *out[1:])
    return dataclasses.replace(out, loss=loss)


class PreferenceObjective:
    """The sequence objective (`lmloss.sequences.SequenceObjective`) of a preference loss: the columns
    ``w_t * lp_t``, ``w_t * ref_lp_t`` (a reference head) and the count, summed per sequence, then
    `loss` of their `SequenceStats` in the pairs' halves order."""

    def __init__(self, loss: Callable, weights: torch.Tensor | None, counting: torch.Tensor, order: torch.Tensor | None,
                 ref_logps: torch.Tensor | None, cp: int) -> None:  # fmt: skip
        self.loss, self.weights, self.counting, self.order, self.ref_logps, self.cp = (
            loss, weights, counting, order, ref_logps, cp
        )

    def columns(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        lp = outputs["logprobs"]
        count = self.counting.to(lp.dtype)
        w = count if self.weights is None else self.weights.to(lp.dtype)
        cols = [w * lp, count]
        if "ref_logprobs" in outputs:
            cols.insert(1, w * outputs["ref_logprobs"])
        return torch.stack(cols, dim=1)

    def value(self, outputs: dict[str, torch.Tensor], sums: torch.Tensor):
        """``(this rank's loss, what the loss callable returned)``."""
        if self.order is not None:  # interleaved pairs -> the chosen half, then the rejected half
            sums = sums[self.order]
        if "ref_logprobs" in outputs:
            ref = sums[:, 1]
        elif self.ref_logps is not None:
            ref = (self.ref_logps if self.order is None else self.ref_logps[self.order]).to(sums.dtype)
        else:
            ref = None
        out = self.loss(SequenceStats(logps=sums[:, 0], n_tokens=sums[:, -1], ref_logps=ref))
        # under CP every rank evaluates the loss of the global sums and returns its share (the ranks' losses sum
        # to the loss, as rl's do); the sums' all-reduce sums the shares' gradients back onto every token
        return _loss_of(out) / self.cp, out


def linear_preference_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    loss: Callable | PreferenceSpec,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    pairs: str = "halves",
    cp_group: ProcessGroup | None = None,
    bias: torch.Tensor | None = None,
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
):
    """A preference loss of the policy ``hidden @ weight.T + bias`` (and a reference head), without the logits.

    Args:
        hidden, weight, bias, labels: as in `lmloss.linear_token_logprobs`: ``[..., H]``, ``[V_local, H]``,
            ``[V_local]``; `labels` the completion's next-token ids, `ignore_index` on prompt and padding tokens
            (they take no matmul and count nowhere). Padded: ``[S, T]`` (row s is sequence s). Packed:
            ``[N]`` with `cu_seqlens` (or, on a context-parallel rank, `sequence_ids`).
        loss: a `PreferenceSpec` (its loss by `lmloss.preference.preference_loss`; the specs whose sums are
            ``logps``, ``ref_logps`` and ``n_tokens``: TRL's DPO loss types, MPO weights, f-divergences,
            label smoothing; LD-DPO through `token_weights` (`lmloss.preference.per_token_weights`); a spec
            that needs other sums (the ``sft`` NLL term, WPO, KTO) raises `preference_loss`'s ValueError naming
            the missing field: use `preference_loss_from_logprobs`), or any
            ``loss(stats: SequenceStats) -> loss`` (a 0-d tensor, ``(loss, metrics)``, or an object with a
            ``loss`` field): the preference loss of the per-sequence sums, differentiable in
            ``stats.logps``. Every rank must pass the same (its text, `describe_loss`, is agreed).
        ref_hidden, ref_weight: the reference policy's head (``[..., H_ref]`` over the same tokens, and this
            rank's vocabulary shard ``[V_local, H_ref]``; any float dtype; detached): its log-probs of the
            labels are computed in the same pass as the policy's, at the same temperature and softcap.
        ref_logps: instead, the reference's per-sequence sums ``[S]`` (precomputed; in the sequences' order).
            Neither: ``stats.ref_logps`` is None (reference-free losses).
        mask: bool / 0-1, the labels' shape: which tokens count, with ``labels != ignore_index``.
        token_weights: ``w_t``, the labels' shape, constant (LD-DPO's length weighting...): the sums are of
            ``w_t * log-prob`` for the policy and the reference head alike.
        cu_seqlens: int ``[S + 1]``, the sequences of packed tokens (ending at N; under CP the global ones).
        sequence_ids, cp_group: context parallelism: each local token's sequence (``split_batch(...)
            ["sequence_ids"]``) and the group the sequences are split over; the sums are all-reduced over it,
            every rank evaluates the loss of the global sums and returns its share (the loss / the group's
            size: the ranks' losses sum to the loss), each of its tokens getting its whole gradient.
        pairs: ``"halves"`` (TRL's: chosen 1..B then rejected 1..B) or ``"interleaved"`` (chosen 1, rejected
            1, chosen 2, ...); `SequenceStats` is always in the halves order.
        The LM-head options (`temperature`, `softcap`, `vocab_size`, `tp_group`, `vocab_start`,
        `sequence_parallel`, `chunk_size`, `weight_grad_dtype`, `impl`, `memory_budget_mib`): as in
        `lmloss.linear_cross_entropy`; every option, the loss and every per-token tensor are agreed over
        `tp_group` in the op's one rank agreement.

    Returns:
        What `loss` returned (its loss divided by the CP group's size under `cp_group`). Gradients flow to
        `hidden`, `weight` and `bias` (4 matmuls per chunk; the reference head's 1 in the forward).
    """
    if isinstance(loss, PreferenceSpec):
        loss = functools.partial(preference_loss, spec=loss)
    state: dict = {}

    def checks(expected):
        _validate.check_group("cp_group", cp_group)
        if not callable(loss):
            raise TypeError(f"loss must be a callable of the per-sequence sums (SequenceStats), got {type(loss).__name__}")
        if pairs not in PAIR_LAYOUTS:
            raise ValueError(f"pairs must be one of {PAIR_LAYOUTS}, got {pairs!r}")
        if (ref_hidden is None) != (ref_weight is None):
            raise ValueError("ref_hidden and ref_weight go together (the reference head)")
        if ref_hidden is not None:
            if ref_logps is not None:
                raise ValueError("pass the reference as a head (ref_hidden, ref_weight) or as ref_logps, not both")
            check_reference_head(ref_hidden, ref_weight, hidden, weight)
        if len(expected) != 2 and cu_seqlens is None and sequence_ids is None:
            raise ValueError(
                f"labels {tuple(expected)}: padded sequences are [S, T]; packed tokens [N] need cu_seqlens "
                "(or sequence_ids)"
            )
        if len(expected) == 2 and (cu_seqlens is not None or sequence_ids is not None):
            raise ValueError("cu_seqlens / sequence_ids are for packed [N] tokens; padded [S, T] rows are sequences")
        index, count = sequence_index(expected, hidden.device, cu_seqlens=cu_seqlens, sequence_ids=sequence_ids,
                                      need="linear_preference_loss")  # fmt: skip
        if count == 0 or count % 2:
            raise ValueError(f"a preference batch holds pairs: an even number of sequences > 0, got {count}")
        cu = None if cu_seqlens is None else check_ids("cu_seqlens", cu_seqlens, cu_seqlens.shape)
        ids = None if sequence_ids is None else check_ids("sequence_ids", sequence_ids, expected)
        counting = labels.reshape(expected) != ignore_index
        if mask is not None:
            counting = counting & check_mask(mask, expected).to(counting.device)
        w = None
        if token_weights is not None:
            w = _validate.check_floating("token_weights", token_weights)
            if token_weights.shape != expected:
                raise ValueError(f"token_weights has shape {tuple(token_weights.shape)}, expected {tuple(expected)}")
            if token_weights.requires_grad and torch.is_grad_enabled():
                raise ValueError("token_weights requires grad; it is a constant of the loss: pass token_weights.detach()")
            w = token_weights.reshape(-1)
        ref = None
        if ref_logps is not None:
            ref = _validate.check_floating("ref_logps", ref_logps)
            if ref_logps.shape != (count,):
                raise ValueError(f"ref_logps must be [S] = [{count}] (one sum per sequence), got {tuple(ref_logps.shape)}")
            if ref_logps.requires_grad and torch.is_grad_enabled():
                raise ValueError("ref_logps requires grad; the reference is a constant: pass ref_logps.detach()")
        flat = counting.reshape(-1)
        state.update(index=index, count=count, counting=flat, weights=None if w is None else torch.where(flat, w, 0.0),
                     ref=ref)  # fmt: skip
        text = ", ".join([
            f"loss={describe_loss(loss)}", f"pairs={pairs}", f"sequences={count}",
            f"reference={'head' if ref_hidden is not None else 'ref_logps' if ref is not None else None}",
            f"cp_group={world_size(cp_group) if cp_group is not None else None}",
        ])  # fmt: skip
        state["text"] = text
        return {
            "counting": flat,
            "options": {"preference": text},
            "tensors": dict(token_weights=w, sequence_ids=ids, cu_seqlens=cu, ref_logprobs=ref,
                            mask=None if mask is None else flat),  # fmt: skip
            "arguments": {"ref_hidden": ref_hidden, "ref_weight": ref_weight},
        }

    over_cp = isinstance(cp_group, ProcessGroup) and world_size(cp_group) > 1
    with_head = ref_hidden is not None and ref_weight is not None
    try:
        p = prepare(
            hidden, weight, labels, bias, chunk_size=chunk_size, temperature=temperature, softcap=softcap,
            ignore_index=ignore_index, vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start,
            sequence_parallel=sequence_parallel, weight_grad_dtype=weight_grad_dtype, impl=impl,
            outputs=("logprobs",), checks=checks, agree={"op": 5}, memory_budget_mib=memory_budget_mib,
            # beside the policy's chunk, the reference's (fp32, or its own dtype) in the forward
            **(dict(bytes_per_logit=TORCH_BYTES_PER_LOGIT + 4, chunk_buffers=2) if with_head else {}),
        )  # fmt: skip
    except (TypeError, ValueError) as error:  # raised on every TP rank: the CP ranks hear it too
        if over_cp and "cp_group" not in getattr(error, "fields", ()):
            agree_over_group(cp_group, "lmloss.preference.linear_preference_loss over cp_group", CP_FIELDS, {},
                             error=error, like=hidden)  # fmt: skip
        raise
    if over_cp:  # the sums' all-reduce: every CP rank issues it alike (the same sequences and options)
        given = (ref_hidden, ref_logps, token_weights, mask)
        agree_over_group(
            cp_group, "lmloss.preference.linear_preference_loss over cp_group", CP_FIELDS,
            dict(dtype=DTYPE_CODES.get(hidden.dtype, -1), sequences=state["count"],
                 given=sum(1 << i for i, t in enumerate(given) if t is not None)),
            text=state["text"], like=hidden,
        )  # fmt: skip
    reference = None
    if with_head:  # the policy's head transform: its softcap (and temperature, in the kernels)
        reference = Reference(second_head(
            ref_hidden, ref_weight, softcap=softcap, sequence_parallel=sequence_parallel, tp_group=tp_group,
            student_dtype=weight.dtype,
        ), logprobs=True)  # fmt: skip
    op = Op(p.plan, p.head, SoftmaxObjective(p.plan, p.labels, reference=reference))
    count = state["count"]
    order = None
    if pairs == "interleaved":  # sequence 2i is pair i's chosen one, 2i + 1 its rejected one
        order = torch.cat([torch.arange(0, count, 2), torch.arange(1, count, 2)]).to(hidden.device)
    objective = PreferenceObjective(
        loss, state["weights"], state["counting"], order, state["ref"], world_size(cp_group) if over_cp else 1
    )
    sequences = Sequences(state["index"], count, cp_group if over_cp else None)
    loss_share, out = sequence_loss(op, (p.flat, weight, bias), sequences, objective)
    return out if objective.cp == 1 else _with_loss(out, loss_share)
