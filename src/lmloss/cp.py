"""Context parallelism over packed sequences: which positions each CP rank holds, split and gather.

Every sequence of a packed buffer is spread over the ``cp_size`` ranks of the CP group, so each rank holds
``T / cp_size`` positions. The layout follows the *padded* boundaries ``cu_seqlens_padded`` (the buffer
layout, Transformer Engine's ``cu_seqlens_q_padded``; see `lmloss.packing`), which every function here
takes; for a buffer without padding pass ``cu_seqlens``, they are equal. ``[1, B + 1]`` boundaries (as in
Megatron's batches) are accepted everywhere.

* ``"zigzag"`` (load-balanced for causal attention): each sequence is cut into ``2 * cp_size`` equal chunks
  and rank ``r`` keeps chunks ``r`` and ``2 * cp_size - 1 - r``, in that order, sequence after sequence.
  This is the layout of Transformer Engine's ``thd_get_partitioned_indices`` and of Megatron's
  load-balanced CP, so logits coming out of such a model are already in it.
* ``"contiguous"``: rank ``r`` keeps the ``r``-th of ``cp_size`` equal pieces of every sequence.

A sequence whose length the layout cannot divide raises ValueError naming it: pad with
``pack(..., pad_to_multiple_of=2 * cp_size)``. Nothing is ever dropped. With ``cp_size == 1`` every layout
is the identity and any length is accepted.

The CP-local loss: make labels on the full buffer (`lmloss.packing`), `split` them with the logits'
layout, and call `lmloss.cross_entropy` on the local logits with ``mean_group`` = the DP x CP group.
Full logits are never gathered.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from lmloss import _validate
from lmloss.packing import PackedBatch, as_cu_seqlens, check_cu_seqlens, sequence_ids, token_mask
from lmloss.vocab_parallel import reduce_scatter_rows

ProcessGroup = dist.ProcessGroup

LAYOUTS = ("zigzag", "contiguous")
# keys that hold one value per position (lmloss's names, then Megatron's): such a tensor must have T positions
PER_TOKEN_KEYS = ("input_ids", "labels", "position_ids", "loss_mask", "tokens", "attention_mask")
# keys that describe the full sequences and pass through a split unchanged
METADATA_PREFIXES = ("cu_seqlens", "max_seqlen")

__all__ = ["LAYOUTS", "gather", "partition_index", "split", "split_batch"]


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _check_cp(cp_size: int, cp_rank: int) -> None:
    for name, v in (("cp_size", cp_size), ("cp_rank", cp_rank)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {v!r}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")


def partition_index(
    cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int, layout: str = "zigzag"
) -> torch.Tensor:
    """Positions of the packed buffer that CP rank `cp_rank` holds, in its local order.

    Args:
        cu_seqlens_padded: integer ``[B + 1]`` or ``[1, B + 1]``, the buffer's padded sequence boundaries
            (the buffer layout), starting with 0 and ending at ``T``.
        cp_size, cp_rank: size of the CP group and this rank's index in it.
        layout: ``"zigzag"`` or ``"contiguous"`` (see the module docstring).

    Returns:
        int64 ``[T / cp_size]`` on `cu_seqlens_padded`' device: ``local = full[index]``.

    Raises:
        ValueError: a sequence length not divisible by ``2 * cp_size`` (zigzag) or ``cp_size``
            (contiguous), naming the first such sequence; an unknown layout.
    """
    _check_layout(layout)
    _check_cp(cp_size, cp_rank)
    bounds = check_cu_seqlens(cu_seqlens_padded, name="cu_seqlens_padded")
    cu = as_cu_seqlens(cu_seqlens_padded, name="cu_seqlens_padded")
    device = cu.device
    if cp_size == 1:
        return torch.arange(bounds[-1], device=device)
    pieces = 2 * cp_size if layout == "zigzag" else cp_size
    for b, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        if (e - s) % pieces:
            raise ValueError(
                f"sequence {b} has length {e - s}, not divisible by {pieces} "
                f"({layout} layout over cp_size={cp_size}); pad it, e.g. pack(..., pad_to_multiple_of={pieces})"
            )
    starts = cu[:-1].long()
    chunk = (cu[1:] - cu[:-1]).long() // pieces  # per sequence
    local_len = chunk * (pieces // cp_size)
    seq = torch.repeat_interleave(torch.arange(starts.numel(), device=device), local_len)
    local_start = torch.cumsum(local_len, 0) - local_len
    j = torch.arange(seq.numel(), device=device) - local_start[seq]  # offset within the rank's share
    c = chunk[seq]
    if layout == "contiguous":
        return starts[seq] + cp_rank * c + j
    second = j >= c
    which = torch.where(second, 2 * cp_size - 1 - cp_rank, cp_rank)
    return starts[seq] + which * c + j - second.long() * c


def split(
    tensor: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    *,
    dim: int = 0,
    layout: str = "zigzag",
) -> torch.Tensor:
    """This CP rank's positions of a full packed tensor: ``tensor.index_select(dim, partition_index(...))``.

    `tensor` has ``T = cu_seqlens_padded[-1]`` positions along `dim` (any dtype, any other dims); the
    result has ``T / cp_size`` there. Differentiable (the gradient is scattered back, zero elsewhere).
    """
    dim = dim % max(tensor.dim(), 1)
    total = check_cu_seqlens(cu_seqlens_padded, name="cu_seqlens_padded")[-1]
    if tensor.shape[dim] != total:
        raise ValueError(
            f"tensor has {tensor.shape[dim]} positions along dim {dim} but cu_seqlens_padded covers {total}"
        )
    index = partition_index(cu_seqlens_padded, cp_size, cp_rank, layout).to(tensor.device)
    return tensor.index_select(dim, index)


class _GatherCP(torch.autograd.Function):
    """All-gather the CP slices and put every position back where it belongs in the full buffer.

    Backward, by default: this rank's own slice of the incoming gradient, unscaled — the gathered tensor
    is one value replicated on every rank, used the same way by each. With `sum_grads`: the sum over
    ranks of the gradient at this rank's positions (a reduce-scatter) — for a gathered tensor that each
    rank uses differently, such as attention keys/values read by every rank's own queries.
    """

    @staticmethod
    def forward(ctx, local, cu_seqlens_padded, group, dim, layout, sum_grads):
        cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        moved = local.movedim(dim, 0).contiguous()
        parts = [torch.empty_like(moved) for _ in range(cp_size)]
        dist.all_gather(parts, moved, group=group)
        # rank-major order of positions: rank r's positions form the r-th block of rows
        order = torch.cat([partition_index(cu_seqlens_padded, cp_size, r, layout) for r in range(cp_size)])
        order = order.to(moved.device)
        full = moved.new_empty((moved.shape[0] * cp_size, *moved.shape[1:]))
        full[order] = torch.cat(parts)
        rows = moved.shape[0]
        ctx.index = order if sum_grads else order[cp_rank * rows : (cp_rank + 1) * rows]
        ctx.dim, ctx.group, ctx.sum_grads = dim, group, sum_grads
        return full.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.sum_grads:
            return grad.index_select(ctx.dim, ctx.index), None, None, None, None, None
        rows = grad.movedim(ctx.dim, 0).index_select(0, ctx.index).contiguous()
        mine = reduce_scatter_rows(rows, ctx.group)
        return mine.movedim(0, ctx.dim), None, None, None, None, None


def gather(
    local: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    group: ProcessGroup | None,
    *,
    dim: int = 0,
    layout: str = "zigzag",
    sum_grads: bool = False,
) -> torch.Tensor:
    """Inverse of `split`: the full packed tensor from every CP rank's slice.

    Args:
        local: this rank's ``T / cp_size`` positions along `dim`, as `split` returned them (any dtype).
        cu_seqlens_padded: the full buffer's padded boundaries (the layout; the same on every rank),
            ``[B + 1]`` or ``[1, B + 1]``.
        group: the CP group (one all-gather over it); None means ``cp_size == 1`` and returns `local`.

    Returns:
        ``[..., T, ...]`` on every rank. Differentiable: the backward hands each rank its own positions of
        the gradient, with no ``cp_size`` scaling. Gather only what is small (per-token values); the loss
        itself is computed on local logits.

    `sum_grads`: when each rank uses the gathered tensor differently (attention keys/values, read by each
    rank's own queries), the gradient at a position is the sum of every rank's; set it to reduce-scatter
    the gradient instead of slicing it.
    """
    _check_layout(layout)
    _validate.check_group("group", group)
    dim = dim % max(local.dim(), 1)
    total = check_cu_seqlens(cu_seqlens_padded, name="cu_seqlens_padded")[-1]
    if group is None or dist.get_world_size(group) == 1:
        if local.shape[dim] != total:
            raise ValueError(
                f"local has {local.shape[dim]} positions along dim {dim} but cu_seqlens_padded covers "
                f"{total} (cp_size 1)"
            )
        return local
    cp_size = dist.get_world_size(group)
    if local.shape[dim] * cp_size != total:
        raise ValueError(
            f"local has {local.shape[dim]} positions along dim {dim}; cp_size={cp_size} ranks hold "
            f"{local.shape[dim] * cp_size} but cu_seqlens_padded covers {total}"
        )
    return _GatherCP.apply(local, cu_seqlens_padded, group, dim, layout, sum_grads)


def _token_dim(key: str, value: torch.Tensor, total: int) -> int | None:
    """The dimension of `value` to split, None for a one-element value that is not per token; else raise.

    The token dimension is dim 0 for ``[T, ...]`` (lmloss's packed tensors) and dim 1 for ``[1, T, ...]``
    (Megatron's and Hugging Face's one-row batches), found by its size ``T``. An ``attention_mask`` shaped
    ``[1, ..., 1, T, T]`` (query rows x key columns) is split along its query rows.
    """
    shape = tuple(value.shape)
    at = [d for d, n in enumerate(shape) if n == total]
    square = len(shape) >= 2 and at == [len(shape) - 2, len(shape) - 1]
    if key == "attention_mask" and square and all(n == 1 for n in shape[:-2]):
        return len(shape) - 2  # a rank keeps its queries' rows against every key
    if at == [0]:
        return 0
    if at == [1] and shape[0] == 1:
        return 1
    where = f"batch[{key!r}] has shape {shape}"
    if not at:
        if key in PER_TOKEN_KEYS:
            raise ValueError(
                f"{where}, but the packed buffer has {total} positions (the last entry of its boundaries)"
            )
        if value.numel() == 1:
            return None
        raise ValueError(
            f"{where}: no dimension of {total} positions (the packed buffer's), and {key!r} is not a "
            "metadata key (cu_seqlens*, max_seqlen*) nor a one-element value; split_batch cannot tell what "
            "it is. Split it yourself with cp.split(..., dim=...) or leave it out of the batch"
        )
    if at == [1]:
        raise ValueError(
            f"{where}: {shape[0]} rows of {total} positions, but split_batch takes one packed row ([T, ...] "
            "or [1, T, ...]); pack the rows into one buffer (lmloss.packing.pack) or split it yourself with "
            "cp.split(..., dim=1)"
        )
    raise ValueError(
        f"{where}: {total} (the packed buffer's positions) at dim(s) {at}, but split_batch places the token "
        f"dimension only at dim 0 ([T, ...]) or dim 1 after a leading 1 ([1, T, ...]); move it there "
        "(movedim) or split it yourself with cp.split(..., dim=...)"
    )


def split_batch(
    batch: PackedBatch | Mapping[str, object],
    cp_size: int,
    cp_rank: int,
    *,
    layout: str = "zigzag",
) -> dict[str, object]:
    """This CP rank's share of a packed batch: a `PackedBatch`, or a dict with lmloss's or Megatron's keys.

    The boundaries come from ``cu_seqlens_padded`` (the buffer layout) or, when absent or None, from
    ``cu_seqlens`` (a buffer without padding); either may be ``[B + 1]`` or ``[1, B + 1]``. With ``T`` the
    buffer's positions (their last entry):

    * every tensor with a token dimension of size ``T`` is split along it with `split`: dim 0 for
      ``[T, ...]`` (``input_ids``, ``labels``, ... of a `PackedBatch`), dim 1 for ``[1, T, ...]`` (Megatron's
      ``tokens``, ``labels``, ``loss_mask``, ``position_ids``), the query rows of an ``attention_mask``
      ``[1, 1, T, T]``; the result keeps the input's layout, with ``T / cp_size`` positions;
    * passed through unchanged: the boundaries and lengths (keys starting with ``cu_seqlens`` or
      ``max_seqlen``: THD attention under CP takes the *full* sequences' boundaries), values that are not
      tensors (None, python numbers, process groups) and one-element tensors;
    * anything else raises ValueError naming the key: a tensor with ``T`` at another dimension (e.g.
      ``[H, T]``, ``[B > 1, T]``, ``[T, T]``), a per-token key (``input_ids``, ``tokens``, ``labels``,
      ``position_ids``, ``loss_mask``, ``attention_mask``) without ``T`` positions, or an unknown key whose
      shape has no ``T`` at all. Nothing token-aligned is ever passed through unsplit.

    Added, int64/bool ``[T / cp_size]``: ``sequence_ids`` (which sequence each local position belongs to)
    and, when ``cu_seqlens`` is present, ``token_mask`` (False at padding; all True without
    ``cu_seqlens_padded``). Position ids stay global (position within the full sequence), which is what
    rotary embeddings need.
    """
    fields = batch.to_dict() if isinstance(batch, PackedBatch) else dict(batch)
    real, padded = fields.get("cu_seqlens"), fields.get("cu_seqlens_padded")
    if real is None and padded is None:
        raise ValueError(
            "batch has neither 'cu_seqlens_padded' nor 'cu_seqlens': cannot tell where its sequences are"
        )
    name = "cu_seqlens_padded" if padded is not None else "cu_seqlens"
    cu = as_cu_seqlens(padded if padded is not None else real, name=f"batch[{name!r}]")
    total = check_cu_seqlens(cu, name=f"batch[{name!r}]")[-1]
    index = partition_index(cu, cp_size, cp_rank, layout)
    out: dict[str, object] = {}
    for k, v in fields.items():
        if isinstance(v, torch.Tensor) and not k.startswith(METADATA_PREFIXES):
            dim = _token_dim(k, v, total)
            if dim is not None:
                v = v.index_select(dim, index.to(v.device))
        out[k] = v
    out["sequence_ids"] = sequence_ids(cu).index_select(0, index)
    if real is not None:
        real = as_cu_seqlens(real, name="batch['cu_seqlens']")
        out["token_mask"] = token_mask(real, cu).index_select(0, index)
    return out
