"""Megatron-core: lmloss's ops in Megatron's layouts and names.

* `vocab_parallel_cross_entropy`: a drop-in for ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``
  (logits ``[S, B, V/TP]``, targets ``[S, B]``, per-token losses ``[S, B]``), chunked, with the tensor-parallel
  group taken from Megatron's ``parallel_state`` unless given.
* `output_layer_loss`: the last pipeline stage's loss straight from the output layer's input and weight
  (no logits), in the layout of ``GPTModel.compute_language_model_loss``: per-token losses ``[B, S]``.
* `packed_seq_params`: Megatron's ``PackedSeqParams`` (``thd`` format) from an `lmloss.packing.PackedBatch`.

Megatron's layouts: activations are sequence-first (``[S, B, ...]``), batches from its data loaders are
batch-first (``labels``, ``loss_mask``: ``[B, S]``, labels already the next token). With sequence parallelism
each TP rank holds ``[S/TP, B, H]`` of the output layer's input, the rank's contiguous block of the sequence.

``megatron-core`` is imported only inside the functions that need it; the loss functions run without it
(pass ``tp_group`` yourself, or None for one process).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

import lmloss
from lmloss.vocab_parallel import ProcessGroup

__all__ = ["output_layer_loss", "packed_seq_params", "tensor_parallel_group", "vocab_parallel_cross_entropy"]


class _FromParallelState:
    """Default of ``tp_group``: Megatron's tensor-parallel group when its parallel state is initialized."""

    def __repr__(self) -> str:
        return "FROM_PARALLEL_STATE"


FROM_PARALLEL_STATE: Any = _FromParallelState()


def tensor_parallel_group(tp_group: ProcessGroup | None | Any = FROM_PARALLEL_STATE) -> ProcessGroup | None:
    """Resolve a ``tp_group`` argument: an explicit group (or None = one process) is returned as given;
    `FROM_PARALLEL_STATE` becomes ``parallel_state.get_tensor_model_parallel_group()`` when megatron-core's
    model-parallel state is initialized in this process, else None (one process)."""
    if tp_group is not FROM_PARALLEL_STATE:
        return tp_group
    # A program whose Megatron state is initialized has imported it: never import it (seconds) just to look.
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    *,
    tp_group: ProcessGroup | None | Any = FROM_PARALLEL_STATE,
    vocab_size: int | None = None,
    chunk_size: int | None = 1024,
) -> torch.Tensor:
    """Per-token cross-entropy of vocab-sharded logits: Megatron-core's op of the same name, chunked.

    Args:
        vocab_parallel_logits: ``[S, B, V/TP]`` (any float dtype), this rank's contiguous vocabulary
            shard (rank ``r`` holds columns ``[r * V/TP, (r + 1) * V/TP)``, as Megatron's
            ``ColumnParallelLinear`` output). Not modified (Megatron's op overwrites fp32 logits).
        target: int64 ``[S, B]`` global vocabulary ids; ``-100`` positions give 0 and no gradient.
        label_smoothing: PyTorch's definition (``F.cross_entropy``): ``(1 - a) * nll + a * mean_j(-log
            p_j)`` with the mean over the whole vocabulary, correct at any TP size. Megatron's op spreads
            ``a`` over the ``V - 1`` non-target classes instead (a factor ``V / (V - 1)``), and at TP > 1
            it averages over each rank's shard only, so its smoothed loss differs between ranks and from
            the true value; this one does not.
        tp_group: the tensor-parallel group; by default Megatron's (``parallel_state``) when initialized,
            else one process. None means one process.
        vocab_size: the real vocabulary size when the shards include padding columns (Megatron pads the
            vocabulary to a multiple of ``make-vocab-size-divisible-by * TP``); None counts every column,
            as Megatron does.
        chunk_size: tokens per chunk (see `lmloss.cross_entropy`).

    Returns:
        fp32 ``[S, B]`` per-token losses, the same on every TP rank; differentiable w.r.t. the logits.
    """
    return lmloss.cross_entropy(
        vocab_parallel_logits, target, reduction="none", label_smoothing=label_smoothing,
        tp_group=tensor_parallel_group(tp_group), vocab_size=vocab_size, chunk_size=chunk_size,
    )  # fmt: skip


def output_layer_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    tp_group: ProcessGroup | None | Any = FROM_PARALLEL_STATE,
    sequence_parallel: bool = False,
    label_smoothing: float = 0.0,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    chunk_size: int | str | None = "auto",
) -> torch.Tensor:
    """The last pipeline stage's per-token losses from the output layer's input and weight, no logits.

    What ``GPTModel`` computes as ``compute_language_model_loss(labels, output_layer(hidden)[0])``, fused
    (`lmloss.linear_cross_entropy`, ``reduction="none"``): reduce it as Megatron's loss function does,
    e.g. ``(losses * loss_mask).sum() / loss_mask.sum()``.

    Args:
        hidden: ``[S, B, H]`` the output layer's input; with ``sequence_parallel=True``, this rank's block
            ``[S/TP, B, H]`` (gathered inside; its gradient is reduce-scattered back).
        weight: ``[V/TP, H]`` this rank's shard of the output layer's weight (or the shared embedding,
            ``model.shared_embedding_or_output_weight()``), same dtype as `hidden`.
        labels: int64 ``[B, S]`` next-token ids, Megatron's batch layout.
        loss_mask: optional ``[B, S]`` (bool or 0/1 float): positions where it is 0 are not scored
            (loss 0.0, no gradient), as if their label were `ignore_index`.
        bias: optional ``[V/TP]``.
        tp_group, label_smoothing, vocab_size: as in `vocab_parallel_cross_entropy`.
        sequence_parallel: `hidden` is sharded along the sequence over `tp_group`.

    Returns:
        fp32 ``[B, S]`` per-token losses (0.0 where masked), the same on every TP rank.
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [S, B, H] (or [S/TP, B, H]), got shape {tuple(hidden.shape)}")
    if labels.dim() != 2:
        raise ValueError(f"labels must be [B, S], got shape {tuple(labels.shape)}")
    if loss_mask is not None:
        if loss_mask.shape != labels.shape:
            raise ValueError(
                f"loss_mask {tuple(loss_mask.shape)} must have the shape of labels {tuple(labels.shape)}"
            )
        labels = labels.masked_fill(loss_mask == 0, ignore_index)
    per_token = lmloss.linear_cross_entropy(
        hidden, weight, labels.t(), bias=bias, reduction="none", label_smoothing=label_smoothing,
        ignore_index=ignore_index, tp_group=tensor_parallel_group(tp_group), vocab_size=vocab_size,
        sequence_parallel=sequence_parallel, chunk_size=chunk_size,
    )  # fmt: skip
    return per_token.t()  # [S, B] -> [B, S]


def _boundaries(t: torch.Tensor, name: str) -> torch.Tensor:
    """int32 ``[n]`` boundaries; Megatron's loaders hand them as ``[1, n]``."""
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise ValueError(f"{name} must be [n] or [1, n], got shape {tuple(t.shape)}")
    return t.to(torch.int32)


def packed_seq_params(batch: lmloss.packing.PackedBatch, *, qkv_format: str = "thd") -> Any:
    """Megatron's ``PackedSeqParams`` for a packed batch (Transformer Engine's ``thd`` attention).

    ``cu_seqlens_q`` / ``cu_seqlens_kv`` are the real sequence boundaries (``batch.cu_seqlens``), and
    ``cu_seqlens_q_padded`` / ``cu_seqlens_kv_padded`` the padded ones (``batch.cu_seqlens_padded``, the
    buffer layout, which context parallelism splits along); all int32 on the batch's device.
    ``max_seqlen_q`` / ``max_seqlen_kv`` are ``batch.max_seqlen`` (the longest padded sequence).

    Feed the model ``tokens = batch.input_ids[None]`` and ``position_ids = batch.position_ids[None]``
    (``[1, T]``), and its loss ``labels = batch.labels[None]``, ``loss_mask = batch.loss_mask[None]``.

    Needs megatron-core (``ImportError`` otherwise).
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = _boundaries(batch.cu_seqlens, "batch.cu_seqlens")
    cu_padded = _boundaries(batch.cu_seqlens_padded, "batch.cu_seqlens_padded")
    if cu.shape != cu_padded.shape:
        raise ValueError(
            f"batch.cu_seqlens has {cu.numel() - 1} sequences but batch.cu_seqlens_padded has "
            f"{cu_padded.numel() - 1}"
        )
    max_seqlen = int(batch.max_seqlen)
    return PackedSeqParams(
        qkv_format=qkv_format,
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )
