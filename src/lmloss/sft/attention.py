"""Context-parallel attention over packed sequences, plugged into transformers' `AttentionInterface`.

Each CP rank holds a zigzag slice of the packed buffer (`lmloss.cp`). Per layer the attention function

1. all-gathers keys and values over the CP group (one collective for both), putting every position back
   at its place in the full buffer;
2. masks by sequence (a query sees only keys of its own packed sequence) and by causality, using the
   queries' *global* buffer positions, so the zigzag order of the local queries does not matter;
3. runs `scaled_dot_product_attention` for the local queries against all keys.

Backward: every rank's queries attended to every rank's keys, so the gradient of a rank's K/V slice is the
SUM of all ranks' contributions: the gather's backward is a reduce-scatter. (`lmloss.cp.gather` returns
only the rank's own slice unsummed, which is right for values that feed the same computation on every
rank, not for attention.)

The model receives the per-micro-batch facts through a keyword argument, ``model.model(...,
packed=PackedAttention(...))``, which transformers forwards untouched to the attention function. The mask
is ``[T_local, T]`` booleans: fine for the short packed buffers of this trainer; long contexts want a
varlen flash kernel with ``cu_seqlens`` / ``cu_seqlens_padded`` instead (same gather, different kernel).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lmloss import cp
from lmloss.packing import sequence_ids

ATTENTION_NAME = "lmloss_cp"
ProcessGroup = dist.ProcessGroup


@dataclasses.dataclass
class PackedAttention:
    """What the attention function needs about the current packed micro-batch.

    cu_seqlens_padded: int32 ``[B + 1]``, the full buffer's padded boundaries (its layout), the same on every
        CP rank.
    group: the CP group, or None for one rank.
    mask: bool ``[T_local, T]``, True where a local query may attend to a buffer position.
    layout: the `lmloss.cp` layout of the local tokens.
    """

    cu_seqlens_padded: torch.Tensor
    group: ProcessGroup | None
    mask: torch.Tensor
    layout: str = "zigzag"

    @classmethod
    def build(
        cls,
        cu_seqlens_padded: torch.Tensor,
        group: ProcessGroup | None,
        *,
        layout: str = "zigzag",
        device=None,
    ) -> PackedAttention:
        cp_size = 1 if group is None else dist.get_world_size(group)
        cp_rank = 0 if group is None else dist.get_rank(group)
        mask = packed_causal_mask(cu_seqlens_padded, cp_size, cp_rank, layout=layout)
        return cls(cu_seqlens_padded=cu_seqlens_padded, group=group, mask=mask.to(device), layout=layout)


def packed_causal_mask(
    cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int, *, layout: str = "zigzag"
) -> torch.Tensor:
    """bool ``[T / cp_size, T]``: local query ``i`` (global position ``q[i]``) may see key ``j`` iff both are
    in the same packed sequence and ``j <= q[i]``."""
    cu_seqlens_padded = cu_seqlens_padded.cpu()
    q_pos = cp.partition_index(cu_seqlens_padded, cp_size, cp_rank, layout)
    seq = sequence_ids(cu_seqlens_padded)
    k_pos = torch.arange(seq.numel())
    return (seq[q_pos][:, None] == seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])


def gather_kv(
    local: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    group: ProcessGroup | None,
    *,
    dim: int,
    layout: str = "zigzag",
) -> torch.Tensor:
    """The full buffer of a per-position tensor (e.g. stacked K and V) from every CP rank's slice.

    Differentiable; the backward sums every rank's gradient for this rank's positions.
    """
    return cp.gather(local, cu_seqlens_padded, group, dim=dim, layout=layout, sum_grads=True)


def cp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    packed: PackedAttention | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query ``[1, Hq, T_local, D]``, key/value ``[1, Hkv, T_local, D]``
    -> ``[1, T_local, Hq, D]``. `attention_mask` from transformers is ignored: `packed` carries the mask."""
    if packed is None:
        raise ValueError(
            f"attn_implementation={ATTENTION_NAME!r} needs the packed batch: call the model with "
            "packed=PackedAttention.build(cu_seqlens_padded, cp_group)"
        )
    if sliding_window is not None:
        raise NotImplementedError(
            "sliding-window attention layers are not supported by the lmloss CP attention"
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch size 1 (one packed buffer), got {query.shape[0]}")
    kv = gather_kv(
        torch.stack([key, value]), packed.cu_seqlens_padded, packed.group, dim=3, layout=packed.layout
    )
    key, value = kv[0], kv[1]
    if key.shape[1] != query.shape[1]:  # grouped-query attention: share each K/V head between query heads
        repeats = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=packed.mask,
        dropout_p=dropout,  # transformers passes 0.0 in eval mode
        scale=scaling,
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the function with transformers (idempotent) and return its name for ``attn_implementation``."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, cp_attention_forward)
    return ATTENTION_NAME
