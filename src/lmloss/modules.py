"""``nn.Module`` losses: `lmloss.cross_entropy` and `lmloss.linear_cross_entropy` held with their options.

For code built around loss modules (``self.loss_fn = ...`` in a model or a trainer), as Liger-Kernel's and
``torch.nn``'s losses are used. The modules hold no parameters and no state: each call is the functional
op with the options given at construction, validated there once. Name map:

=========================================  ===================================================================
lmloss                                     peers
=========================================  ===================================================================
``CrossEntropyLoss()(logits, labels)``     ``torch.nn.CrossEntropyLoss`` (class dim last here: ``[..., V]``),
                                           Liger's ``LigerCrossEntropyLoss`` (``lse_square_scale`` = ``z_loss``)
``LinearCrossEntropyLoss()(hidden,         Liger's ``LigerFusedLinearCrossEntropyLoss()(weight, hidden,
weight, labels, bias)``                    labels, bias)`` (weight first there); Cut Cross-Entropy's
                                           ``linear_cross_entropy(e, c, targets)``
``shift=True``                             Cut Cross-Entropy's ``shift=True``; transformers'
                                           ``ForCausalLMLoss`` shift (`lmloss.packing.shift_labels`)
=========================================  ===================================================================
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmloss import _validate
from lmloss.chunks import check_memory_budget
from lmloss.fused import linear_cross_entropy
from lmloss.logits import cross_entropy
from lmloss.packing import shift_labels

__all__ = ["CrossEntropyLoss", "LinearCrossEntropyLoss"]


class _Loss(nn.Module):
    """Options checked once, kept as a dict, passed to the functional op on every call."""

    def __init__(self, shift: bool, options: dict[str, Any]) -> None:
        super().__init__()
        if not isinstance(shift, bool):
            raise TypeError(f"shift must be a bool, got {type(shift).__name__}")
        _validate.check_reduction(options["reduction"])
        _validate.check_label_smoothing(options["label_smoothing"])
        _validate.check_z_loss(options["z_loss"])
        _validate.check_ignore_index(options["ignore_index"])
        _validate.check_temperature(options["temperature"])
        _validate.check_softcap(options["softcap"])
        _validate.check_chunk_size(options["chunk_size"])
        check_memory_budget(options["memory_budget_mib"])
        self.shift = shift
        self.options = options

    def _targets(self, labels: torch.Tensor) -> torch.Tensor:
        # shift=True: position i predicts labels[..., i + 1]; the last position of each row predicts nothing
        if not self.shift:
            return labels
        return shift_labels(labels, ignore_index=self.options["ignore_index"])

    def extra_repr(self) -> str:
        shown = {"shift": self.shift, **{k: v for k, v in self.options.items() if v is not None}}
        return ", ".join(f"{k}={v!r}" for k, v in shown.items())


class CrossEntropyLoss(_Loss):
    """`lmloss.cross_entropy` as a module: ``loss_fn(logits, labels)``.

    Shapes: ``logits`` ``[..., V]`` (or this rank's vocabulary shard ``[..., V / TP]`` with `tp_group`), any
    float dtype; ``labels`` int64 ``[...]``. Returns an fp32 scalar (``"mean"`` over non-ignored tokens, 0.0
    when there are none; ``"sum"``) or fp32 ``[...]`` (``"none"``).

    Args:
        shift: labels are the tokens themselves, ``[B, S]`` as in transformers: position ``i`` is scored
            against ``labels[..., i + 1]`` and the last position of each row is ignored (Cut Cross-Entropy's
            ``shift=True``). The logits are not sliced or copied.
        Other arguments as in `lmloss.cross_entropy` (keyword-only).
    """

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        temperature: float = 1.0,
        softcap: float | None = None,
        shift: bool = False,
        chunk_size: int | str | None = "auto",
        vocab_size: int | None = None,
        tp_group: Any = None,
        vocab_start: int | None = None,
        mean_group: Any = None,
        inplace_backward: bool = False,
        impl: str = "auto",
        memory_budget_mib: float | None = None,
    ) -> None:
        options = dict(
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
            temperature=temperature, softcap=softcap, chunk_size=chunk_size, vocab_size=vocab_size,
            tp_group=tp_group, vocab_start=vocab_start, mean_group=mean_group,
            inplace_backward=inplace_backward, impl=impl, memory_budget_mib=memory_budget_mib,
        )  # fmt: skip
        super().__init__(shift, options)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, self._targets(labels), **self.options)


class LinearCrossEntropyLoss(_Loss):
    """`lmloss.linear_cross_entropy` as a module: ``loss_fn(hidden, weight, labels, bias=None)``, the loss of
    ``hidden @ weight.T + bias`` without the logits.

    Shapes: ``hidden`` ``[..., H]``, ``weight`` ``[V, H]`` (or this rank's shard ``[V / TP, H]``), ``bias``
    ``[V]``, one float dtype; ``labels`` int64 ``[...]``. Returns as `CrossEntropyLoss`. The argument order
    is lmloss's and ``F.linear``'s (hidden first); Liger's ``LigerFusedLinearCrossEntropyLoss`` takes the
    weight first.

    Args:
        shift: as in `CrossEntropyLoss`.
        Other arguments as in `lmloss.linear_cross_entropy` (keyword-only).
    """

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        temperature: float = 1.0,
        softcap: float | None = None,
        shift: bool = False,
        chunk_size: int | str | None = "auto",
        vocab_size: int | None = None,
        tp_group: Any = None,
        vocab_start: int | None = None,
        sequence_parallel: bool = False,
        mean_group: Any = None,
        weight_grad_dtype: torch.dtype = torch.float32,
        impl: str = "auto",
        memory_budget_mib: float | None = None,
    ) -> None:
        options = dict(
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
            temperature=temperature, softcap=softcap, chunk_size=chunk_size, vocab_size=vocab_size,
            tp_group=tp_group, vocab_start=vocab_start, sequence_parallel=sequence_parallel,
            mean_group=mean_group, weight_grad_dtype=weight_grad_dtype, impl=impl,
            memory_budget_mib=memory_budget_mib,
        )  # fmt: skip
        super().__init__(shift, options)

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, self._targets(labels), bias=bias, **self.options)
