"""Hand a batch from one rank to the others of a group (the TP ranks of a pipeline stage).

Only one rank per TP group reads data; the others need the same tensors, with shapes they cannot know in
advance (the number of packed sequences changes every step, so ``cu_seqlens`` does too). `broadcast_batch`
sends the metadata first and then every tensor's bytes in one buffer: two collectives per call.

`pipeline_stage_keys` names what each pipeline stage needs. Every stage runs attention over the packed
sequences, so every stage, the middle ones included, needs the sequence boundaries; Megatron's
``get_batch_on_this_tp_rank`` once gave intermediate stages none (NVIDIA/Megatron-LM#4092).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup

_BOUNDARIES = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")
_STAGE_KEYS = {
    "first": ("input_ids", "position_ids", *_BOUNDARIES),
    "middle": _BOUNDARIES,
    "last": ("labels", "loss_mask", *_BOUNDARIES),
    "only": ("input_ids", "position_ids", "labels", "loss_mask", *_BOUNDARIES),
}
_PYTHON_SCALARS = (bool, int, float)

__all__ = ["broadcast_batch", "pipeline_stage_keys"]


def pipeline_stage_keys(stage: str) -> tuple[str, ...]:
    """The batch keys (`lmloss.packing.PackedBatch` field names) a pipeline stage needs.

    * ``"first"``: ``input_ids``, ``position_ids`` and the boundaries;
    * ``"middle"``: the boundaries only (hidden states come from the previous stage);
    * ``"last"``: ``labels``, ``loss_mask`` and the boundaries;
    * ``"only"`` (no pipeline parallelism): all of the above.

    The boundaries are named as in Transformer Engine and Megatron-core: ``cu_seqlens`` (the real,
    unpadded lengths; TE's ``cu_seqlens_q``), ``cu_seqlens_padded`` (the padded lengths, the buffer
    layout; TE's ``cu_seqlens_q_padded``) and ``max_seqlen`` (the longest padded sequence).
    """
    if stage not in _STAGE_KEYS:
        raise ValueError(f"stage must be one of {tuple(_STAGE_KEYS)}, got {stage!r}")
    return _STAGE_KEYS[stage]


def _describe(batch: object, keys: Sequence[str] | None) -> tuple[list, list[torch.Tensor]]:
    """Metadata entries ``(key, "tensor", shape, dtype)`` / ``(key, "python", value)`` and the tensors."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"the source rank must pass a dict of tensors, got {type(batch).__name__}")
    if keys is None:
        keys = list(batch)
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"the batch on the source rank has no {missing} (it has {sorted(batch)})")
    meta, tensors = [], []
    for k in keys:
        v = batch[k]
        if isinstance(v, torch.Tensor):
            meta.append((k, "tensor", tuple(v.shape), v.dtype))
            tensors.append(v)
        elif isinstance(v, _PYTHON_SCALARS):
            meta.append((k, "python", v))
        else:
            raise TypeError(
                f"batch[{k!r}] must be a tensor or a python bool/int/float, got {type(v).__name__}"
            )
    return meta, tensors


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def broadcast_batch(
    batch: Mapping[str, torch.Tensor | int | float | bool] | None,
    *,
    group: ProcessGroup | None,
    src: int,
    keys: Sequence[str] | None = None,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor | int | float | bool]:
    """Send `batch` from global rank `src` to every rank of `group`; every rank returns the same dict.

    Args:
        batch: on `src`, a dict of tensors (any shapes and dtypes) and python bool/int/float values such
            as ``max_seqlen``. On the other ranks, None, or a dict of preallocated tensors to fill: a
            tensor there with the incoming key, shape and dtype is written in place and returned;
            anything else is newly allocated. Python values travel in the metadata and come back as
            the same python type.
        group: the group to broadcast over (e.g. a stage's TP group); None for one process.
        src: the sender's *global* rank, as in `torch.distributed.broadcast`; it must be in `group`.
        keys: on `src`, the keys to send, in this order (e.g. ``pipeline_stage_keys("last")``); None for
            all. A key missing from the batch raises ValueError on *every* rank, never a hang or a
            silently missing tensor. Ignored on the other ranks: they learn the keys from the metadata.
        device: where received tensors are allocated. Default: the current CUDA device when `group`
            uses NCCL, else the CPU.

    Returns:
        ``{key: tensor or python value}`` with exactly the sent keys, in the sent order. On `src` the
        tensors are the caller's own (not copied).

    Collectives over `group`: one object broadcast (metadata) and, if any tensor is sent, one broadcast
    of all tensors' bytes packed into one uint8 buffer.
    """
    if group is None:
        meta, _ = _describe(batch, keys)
        return {m[0]: batch[m[0]] for m in meta}
    members = dist.get_process_group_ranks(group)
    if src not in members:
        raise ValueError(f"src={src} is not a rank of the group (global ranks {members})")
    me = dist.get_rank()
    if device is None:
        nccl = "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    device = torch.device(device)

    if me == src:
        try:
            meta, tensors = _describe(batch, keys)
            header = [("ok", meta)]
        except (TypeError, ValueError) as e:
            # tell the receivers, or they would wait forever on a broadcast that never comes
            header, tensors = [("error", f"{type(e).__name__}: {e}")], []
    else:
        header, tensors = [None], []
    dist.broadcast_object_list(header, src=src, group=group)
    status, payload = header[0]
    if status == "error":
        raise ValueError(f"broadcast_batch: the source rank {src} could not send its batch: {payload}")
    meta = payload

    if me == src:
        out = {}
        for entry in meta:
            out[entry[0]] = batch[entry[0]]
        if tensors:
            buf = torch.cat([_as_bytes(t).to(device) for t in tensors])
            dist.broadcast(buf, src=src, group=group)
        return out

    specs = [m for m in meta if m[1] == "tensor"]
    sizes = [torch.Size(shape).numel() * dtype.itemsize for _, _, shape, dtype in specs]
    received: dict[str, torch.Tensor] = {}
    if specs:
        buf = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(buf, src=src, group=group)
        for (k, _, shape, dtype), part in zip(specs, buf.split(sizes)):
            # a copy first: a slice of the byte buffer may sit at an offset `dtype` cannot be viewed at
            t = part.clone().view(dtype).view(shape)
            given = batch.get(k) if isinstance(batch, Mapping) else None
            if isinstance(given, torch.Tensor) and given.shape == t.shape and given.dtype == t.dtype:
                t = given.copy_(t)
            received[k] = t
    return {m[0]: received[m[0]] if m[1] == "tensor" else m[2] for m in meta}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now, for a local process group's rendezvous."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
