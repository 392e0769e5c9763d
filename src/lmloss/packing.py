"""Packed batches: several sequences laid end to end in one ``[T]`` buffer, described by their boundaries.

The one rule everything here keeps: a label never crosses a sequence boundary. ``labels[i]`` is the token
after position ``i`` *in the same sequence*, or ``ignore_index``. Labels are made on the full packed
buffer, before any context-parallel split (`lmloss.cp`), so a rank never needs its neighbour's tokens to
know its own targets.

Two boundary tensors describe a packed buffer, named as Transformer Engine and Megatron-core name them
(``PackedSeqParams(qkv_format="thd", cu_seqlens_q, cu_seqlens_q_padded, max_seqlen_q, ...)``):

* ``cu_seqlens`` (int32 ``[B + 1]``): cumulative *real* (unpadded) lengths, starting with 0. TE's
  ``cu_seqlens_q``/``cu_seqlens_kv``, Megatron's batch key ``cu_seqlens``, flash-attn's ``cu_seqlens``
  for a buffer without padding.
* ``cu_seqlens_padded`` (int32 ``[B + 1]``): cumulative *padded* lengths, starting with 0. This is the
  buffer layout: sequence ``b`` occupies ``[cu_seqlens_padded[b], cu_seqlens_padded[b + 1])``, its real
  tokens first, then its padding. `lmloss.cp` partitions along it. TE's ``cu_seqlens_q_padded``, Megatron's
  batch key ``cu_seqlens_padded``. Without padding the two are equal.

Every function here also accepts boundaries shaped ``[1, B + 1]`` (Megatron keeps them so in its batches)
and squeezes the leading 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lmloss import _validate

__all__ = [
    "PackedBatch",
    "pack",
    "sequence_ids",
    "shift_labels",
    "token_mask",
]


@dataclasses.dataclass(kw_only=True)
class PackedBatch:
    """A packed batch of ``B`` sequences in ``T`` positions (padding included). Keyword construction only.

    input_ids: int64 ``[T]``; padding positions hold ``pad_id``.
    labels: int64 ``[T]``; ``labels[i]`` is the next token of the same sequence when that token is a
        target, else ``ignore_index`` (the last real token of every sequence, every padding position,
        and positions whose next token has loss mask 0).
    position_ids: int64 ``[T]``; ``0, 1, 2, ...`` restarting in every sequence and running on through
        that sequence's padding.
    cu_seqlens: int32 ``[B + 1]``; cumulative *real* (unpadded) lengths, starting with 0 (TE's
        ``cu_seqlens_q``). ``cu_seqlens[-1]`` is the number of real tokens, not ``T``.
    cu_seqlens_padded: int32 ``[B + 1]``; cumulative *padded* lengths, starting with 0 and ending at ``T``:
        the buffer layout (TE's ``cu_seqlens_q_padded``), along which `lmloss.cp` partitions.
    max_seqlen: the longest *padded* sequence (python int), the value Transformer Engine derives for
        ``max_seqlen_q`` from ``cu_seqlens_q_padded``.
    loss_mask: bool ``[T]``, aligned with `labels` (not with `input_ids`): True exactly where
        ``labels != ignore_index``, i.e. where position ``i``'s prediction is scored.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    loss_mask: torch.Tensor

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens_padded.numel() - 1

    def sequence_ids(self) -> torch.Tensor:
        """int64 ``[T]``: the index of the sequence each position belongs to (padding included)."""
        return sequence_ids(self.cu_seqlens_padded)

    def token_mask(self) -> torch.Tensor:
        """bool ``[T]``: True at real tokens, False at padding."""
        return token_mask(self.cu_seqlens, self.cu_seqlens_padded)

    def to_dict(self) -> dict[str, torch.Tensor | int]:
        """The fields by name, e.g. for `lmloss.distributed.broadcast_batch` or `lmloss.cp.split_batch`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def as_cu_seqlens(cu_seqlens: object, *, name: str = "cu_seqlens") -> torch.Tensor:
    """A boundary tensor as 1-D ``[B + 1]``: ``[B + 1]`` as given, ``[1, B + 1]`` (Megatron's batches) squeezed.

    Raises TypeError for a non-tensor or a non-integer dtype, ValueError for any other shape; both name
    the argument `name`. Nothing is copied (a squeeze is a view).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (int32 or int64), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() == 2 and cu_seqlens.shape[0] == 1:
        cu_seqlens = cu_seqlens[0]
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"{name} must be [B + 1] or [1, B + 1] with at least one entry (a leading 0), got shape "
            f"{tuple(cu_seqlens.shape)}"
        )
    return cu_seqlens


def check_cu_seqlens(cu_seqlens: object, total: int | None = None, *, name: str = "cu_seqlens") -> list[int]:
    """Check a boundary tensor and return it as a python list (one host sync on an accelerator).

    It must be an integer tensor shaped ``[B + 1]`` or ``[1, B + 1]``, start at 0, be non-decreasing,
    and end at `total` when given. Error messages name the argument `name`.
    """
    bounds = [int(b) for b in as_cu_seqlens(cu_seqlens, name=name).tolist()]
    if bounds[0] != 0:
        raise ValueError(f"{name} must start with 0, got {bounds[0]}")
    for b, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        if e < s:
            raise ValueError(f"{name} must be non-decreasing; sequence {b} has length {e - s} ({s} -> {e})")
    if total is not None and bounds[-1] != total:
        raise ValueError(f"{name} ends at {bounds[-1]} but the packed buffer has {total} positions")
    return bounds


def sequence_ids(cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """int64 ``[T]``: the sequence index of every position of the buffer, padding included.

    `cu_seqlens_padded` is the buffer layout, ``[B + 1]`` or ``[1, B + 1]``, ending at ``T`` (for a buffer
    without padding, pass ``cu_seqlens``: the two are equal).
    """
    check_cu_seqlens(cu_seqlens_padded, name="cu_seqlens_padded")
    cu = as_cu_seqlens(cu_seqlens_padded, name="cu_seqlens_padded")
    lengths = (cu[1:] - cu[:-1]).long()
    seqs = torch.arange(lengths.numel(), device=cu.device)
    return torch.repeat_interleave(seqs, lengths)


def token_mask(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """bool ``[T]`` (``T = cu_seqlens_padded[-1]``): True at real tokens, False at padding.

    Args:
        cu_seqlens: the real (unpadded) boundaries, ``[B + 1]`` or ``[1, B + 1]``.
        cu_seqlens_padded: the padded boundaries (the buffer layout), same shape. Each sequence's padding
            is the suffix of its slot.

    Raises ValueError when a sequence has more real tokens than padded positions (e.g. the two
    arguments swapped) or the sequence counts differ.
    """
    padded = check_cu_seqlens(cu_seqlens_padded, name="cu_seqlens_padded")
    real = check_cu_seqlens(cu_seqlens, name="cu_seqlens")
    if len(real) != len(padded):
        raise ValueError(
            f"cu_seqlens has {len(real) - 1} sequences but cu_seqlens_padded has {len(padded) - 1}"
        )
    for b in range(len(padded) - 1):
        if real[b + 1] - real[b] > padded[b + 1] - padded[b]:
            raise ValueError(
                f"sequence {b} has {real[b + 1] - real[b]} real tokens in cu_seqlens but only "
                f"{padded[b + 1] - padded[b]} positions in cu_seqlens_padded (are the two swapped?)"
            )
    cu_padded = as_cu_seqlens(cu_seqlens_padded, name="cu_seqlens_padded")
    cu_real = as_cu_seqlens(cu_seqlens, name="cu_seqlens").to(cu_padded.device)
    seq = sequence_ids(cu_padded)
    offset = torch.arange(seq.numel(), device=seq.device) - cu_padded.long()[seq]
    real_len = (cu_real[1:] - cu_real[:-1]).long()
    return offset < real_len[seq]


def _check_mask(mask: object, length: int, what: str) -> torch.Tensor:
    mask = torch.as_tensor(mask)
    if mask.is_floating_point() or mask.is_complex():
        raise TypeError(f"{what} must be bool or integer 0/1, got {mask.dtype}")
    if mask.dim() != 1 or mask.numel() != length:
        raise ValueError(f"{what} has shape {tuple(mask.shape)} but its sequence has {length} tokens")
    return mask.bool()


def shift_labels(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    *,
    cu_seqlens_padded: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token labels, never crossing a sequence boundary: for a packed buffer, or for ``[B, S]`` rows.

    Two layouts:

    * a packed buffer: ``input_ids`` ``[T]`` with its boundaries `cu_seqlens` (and `cu_seqlens_padded`);
    * a batch of rows, ``cu_seqlens=None``: ``input_ids`` ``[..., S]`` (e.g. ``[B, S]``), each row one
      sequence. This is the shift of transformers' ``ForCausalLMLoss`` and Cut Cross-Entropy's ``shift=``:
      ``labels[..., i] = input_ids[..., i + 1]``, the last position ``ignore_index``. Passing HF-style
      labels (``ignore_index`` at padding and prompts) as `input_ids` shifts them the same way.

    Args:
        input_ids: integer ``[T]`` (packed) or ``[..., S]`` (rows), the tokens.
        cu_seqlens: integer ``[B + 1]`` or ``[1, B + 1]``, the real (unpadded) sequence boundaries,
            starting with 0. Without `cu_seqlens_padded` they are also the buffer layout and must end at T.
            None: every row of `input_ids` is one sequence.
        loss_mask: bool or 0/1, the shape of `input_ids`: which tokens are *targets* (e.g. the
            response tokens). None: every token is. The first token of a sequence is never a target,
            whatever its mask says, because nothing in its sequence precedes it.
        ignore_index: label of positions that predict nothing.
        cu_seqlens_padded: when the buffer holds padded slots, their boundaries (the buffer layout,
            ending at T); padding positions are then never targets. None: the buffer has no padding
            (``cu_seqlens_padded = cu_seqlens``). Only with `cu_seqlens`.

    Returns:
        int64, the shape of `input_ids`: ``labels[i] = input_ids[i + 1]`` when ``i + 1`` is in the same
        sequence (row), is a real token and is a target; ``ignore_index`` otherwise.
    """
    _validate.check_ignore_index(ignore_index)
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    if cu_seqlens is None:
        if cu_seqlens_padded is not None:
            raise ValueError("cu_seqlens_padded needs cu_seqlens (the real boundaries)")
        if input_ids.dim() == 0:
            raise ValueError("input_ids must have a sequence dimension, got a 0-d tensor")
        labels = torch.full(input_ids.shape, ignore_index, dtype=torch.long, device=input_ids.device)
        labels[..., :-1] = input_ids[..., 1:]
        if loss_mask is not None:
            mask = torch.as_tensor(loss_mask)
            if mask.is_floating_point() or mask.is_complex():
                raise TypeError(f"loss_mask must be bool or integer 0/1, got {mask.dtype}")
            if mask.shape != input_ids.shape:
                raise ValueError(
                    f"loss_mask has shape {tuple(mask.shape)}, input_ids {tuple(input_ids.shape)}"
                )
            target = F.pad(mask.bool().to(input_ids.device)[..., 1:], (0, 1), value=False)
            labels.masked_fill_(~target, ignore_index)
        return labels
    if input_ids.dim() != 1:
        raise ValueError(
            f"input_ids must be 1-D (a packed buffer) with cu_seqlens, got shape {tuple(input_ids.shape)}; "
            "for [B, S] rows pass cu_seqlens=None"
        )
    n = input_ids.numel()
    if cu_seqlens_padded is None:
        check_cu_seqlens(cu_seqlens, n, name="cu_seqlens")
        layout = cu_seqlens
    else:
        check_cu_seqlens(cu_seqlens_padded, n, name="cu_seqlens_padded")
        layout = cu_seqlens_padded
    target = torch.ones(n, dtype=torch.bool, device=input_ids.device)
    if loss_mask is not None:
        target &= _check_mask(loss_mask, n, "loss_mask").to(input_ids.device)
    if cu_seqlens_padded is not None:
        target &= token_mask(cu_seqlens, cu_seqlens_padded).to(input_ids.device)
    seq = sequence_ids(layout).to(input_ids.device)
    labels = torch.full((n,), ignore_index, dtype=torch.long, device=input_ids.device)
    if n > 1:
        scored = target[1:] & (seq[1:] == seq[:-1])
        labels[:-1] = torch.where(scored, input_ids[1:].long(), ignore_index)
    return labels


def pack(
    sequences: Sequence[torch.Tensor | Sequence[int]],
    loss_masks: Sequence[torch.Tensor | Sequence[int] | Sequence[bool] | None] | None = None,
    *,
    pad_to_multiple_of: int = 1,
    pad_id: int = 0,
    ignore_index: int = -100,
) -> PackedBatch:
    """Pack sequences end to end, each padded to a multiple of `pad_to_multiple_of`, with shifted labels.

    Args:
        sequences: ``B >= 1`` non-empty 1-D integer tensors or lists of token ids.
        loss_masks: one mask per sequence (bool or 0/1, same length as its sequence; None for all ones),
            aligned with the tokens: ``mask[j]`` says whether token ``j`` is a target, i.e. whether
            predicting it from tokens ``< j`` is scored. None: every token is a target.
        pad_to_multiple_of: pad every sequence on its own to a multiple of this; use ``2 * cp_size`` for
            the zigzag context-parallel layout (``cp_size`` for the contiguous one).
        pad_id: token id written into padding positions.
        ignore_index: label of positions that predict nothing.

    Returns:
        A `PackedBatch` on the device of the first tensor sequence (CPU for lists). See `PackedBatch` for
        the fields; ``loss_mask`` there is aligned with the labels: ``labels != ignore_index``.
    """
    if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int):
        raise TypeError(f"pad_to_multiple_of must be an int, got {pad_to_multiple_of!r}")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    _validate.check_int64("pad_to_multiple_of", pad_to_multiple_of)
    if isinstance(pad_id, bool) or not isinstance(pad_id, int):
        raise TypeError(f"pad_id must be an int, got {pad_id!r}")
    _validate.check_int64("pad_id", pad_id)  # written into the int64 input_ids
    _validate.check_ignore_index(ignore_index)
    if isinstance(sequences, torch.Tensor) or not isinstance(sequences, Sequence):
        raise TypeError(
            f"sequences must be a list of 1-D token tensors or lists, got {type(sequences).__name__}"
        )
    if len(sequences) == 0:
        raise ValueError("sequences is empty: nothing to pack")
    if loss_masks is not None and len(loss_masks) != len(sequences):
        raise ValueError(f"got {len(loss_masks)} loss masks for {len(sequences)} sequences")
    device = next((s.device for s in sequences if isinstance(s, torch.Tensor)), torch.device("cpu"))

    seqs, masks = [], []
    for b, s in enumerate(sequences):
        t = torch.as_tensor(s, device=device)
        if t.dim() != 1:
            raise ValueError(f"sequence {b} must be 1-D, got shape {tuple(t.shape)}")
        if t.numel() == 0:
            raise ValueError(f"sequence {b} is empty")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"sequence {b} must hold integer token ids, got {t.dtype}")
        seqs.append(t.long())
        m = None if loss_masks is None else loss_masks[b]
        if m is None:
            masks.append(torch.ones(t.numel(), dtype=torch.bool, device=device))
        else:
            masks.append(_check_mask(m, t.numel(), f"loss mask of sequence {b}").to(device))

    real = [t.numel() for t in seqs]
    padded = [-(-n // pad_to_multiple_of) * pad_to_multiple_of for n in real]
    input_ids = torch.full((sum(padded),), pad_id, dtype=torch.long, device=device)
    target = torch.zeros(sum(padded), dtype=torch.bool, device=device)
    position_ids = torch.cat([torch.arange(p, device=device) for p in padded])
    start = 0
    for t, m, p in zip(seqs, masks, padded):
        input_ids[start : start + t.numel()] = t
        target[start : start + t.numel()] = m
        start += p

    def cumulative(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0, *lengths], dtype=torch.int64, device=device).cumsum(0).to(torch.int32)

    cu_seqlens, cu_seqlens_padded = cumulative(real), cumulative(padded)
    labels = shift_labels(input_ids, cu_seqlens, target, ignore_index, cu_seqlens_padded=cu_seqlens_padded)
    return PackedBatch(
        input_ids=input_ids,
        labels=labels,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens,
        cu_seqlens_padded=cu_seqlens_padded,
        max_seqlen=max(padded),
        loss_mask=labels != ignore_index,
    )
