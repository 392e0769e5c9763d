"""Argument checks shared by every op: one place for each error message.

Every check here is local (no collective): they all run before the plan's one rank-agreement gather.
Under a TP group a failure there is not raised at once: it travels in that gather as an error code and
every rank raises it (`lmloss.agreement.errors_raised_on_every_rank`), so no rank waits in a
collective that another one skipped.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lmloss.agreement import tensor_fingerprint

REDUCTIONS = ("mean", "sum", "none")
#: 1 / temperature must stay far from fp32 overflow (scaled logits of 1e4 at T = 1e-6 are 1e10).
MIN_TEMPERATURE = 1e-6
#: The range of every integer option (top_k, chunk_size, vocab_size, vocab_start, ignore_index): each travels
#: in the TP ranks' int64 agreement vector, and ids, counts and sizes are int64 in the tensors. A value past
#: it (``top_k=10**23``) is refused here, naming the argument, rather than overflowing inside the op.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


#: Float dtypes as they travel in the TP ranks' agreement vector (fp32 on one rank and fp64 on another would
#: all-reduce partials of different sizes).
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_floating(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be floating point (fp32, bf16, fp16 or fp64), got {t.dtype}")
    return t


def check_labels(
    labels: object, expected_shape: torch.Size, device: torch.device, *, against: str
) -> torch.Tensor:
    """`labels` must be an integer tensor shaped like `against`'s leading dimensions, on its device.

    Returns them as int64 (int8 / uint8 / int16 / int32 labels are widened once).
    """
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor (global vocabulary ids), got {labels.dtype}")
    if labels.shape != expected_shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match {against} leading shape {tuple(expected_shape)}"
        )
    if labels.device != device:
        raise ValueError(
            f"labels are on {labels.device} but {against} is on {device}: put them on one device"
        )
    return labels if labels.dtype == torch.int64 else labels.long()


def check_int64(name: str, value: int) -> None:
    """An int option must lie in ``[INT64_MIN, INT64_MAX]`` (`INT64_MAX`: why)."""
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} must fit in int64 (at most 2**63 - 1 in magnitude), got {value}")


def check_chunk_size(chunk_size: object) -> None:
    if chunk_size is None or chunk_size == "auto":
        return
    if not _is_int(chunk_size):
        raise TypeError(f'chunk_size must be a positive int, "auto" or None, got {chunk_size!r}')
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive (or None for unchunked), got {chunk_size}")
    check_int64("chunk_size", chunk_size)  # any value >= the token count is one chunk


def check_temperature(temperature: object) -> None:
    if not _is_real(temperature):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    if not MIN_TEMPERATURE <= temperature < math.inf:
        raise ValueError(f"temperature must be finite and >= {MIN_TEMPERATURE:g}, got {temperature}")


def check_softcap(softcap: object, name: str = "softcap") -> None:
    if softcap is None:
        return
    if not _is_real(softcap):
        raise TypeError(f"{name} must be a float or None, got {type(softcap).__name__}")
    if not 0 < softcap < math.inf:
        raise ValueError(f"{name} must be finite and > 0 (or None for no capping), got {softcap}")


def check_ignore_index(ignore_index: object) -> None:
    if not _is_int(ignore_index):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if not INT64_MIN <= ignore_index <= INT64_MAX:
        raise ValueError(f"ignore_index must fit in int64 (labels are int64), got {ignore_index}")


def check_group(name: str, group: object) -> None:
    """`group` must be a `torch.distributed.ProcessGroup` this rank belongs to, or None (one process).

    Raised on this rank alone: without a group there is nothing to agree over.
    """
    if group is None:
        return
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"this process is not a member of {name} (dist.new_group returned NON_GROUP_MEMBER here)"
        )
    if not isinstance(group, dist.ProcessGroup):
        hint = " (for a DeviceMesh, pass mesh.get_group(dim))" if type(group).__name__ == "DeviceMesh" else ""
        raise TypeError(f"{name} must be a torch.distributed.ProcessGroup or None, got {group!r}{hint}")


def check_vocab_size(vocab_size: object) -> None:
    if vocab_size is None:
        return
    if not _is_int(vocab_size):
        raise TypeError(f"vocab_size must be an int or None, got {vocab_size!r}")
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    check_int64("vocab_size", vocab_size)


def check_vocab_start(vocab_start: object) -> None:
    if vocab_start is not None and not _is_int(vocab_start):
        raise TypeError(f"vocab_start must be an int or None, got {vocab_start!r}")
    if vocab_start is not None and vocab_start < 0:
        raise ValueError(f"vocab_start must be >= 0, got {vocab_start}")
    if vocab_start is not None:
        check_int64("vocab_start", vocab_start)


def check_reduction(reduction: object) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_label_smoothing(label_smoothing: object) -> None:
    if not _is_real(label_smoothing):
        raise TypeError(f"label_smoothing must be a float, got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")


def check_z_loss(z_loss: object) -> None:
    if not _is_real(z_loss):
        raise TypeError(f"z_loss must be a float, got {type(z_loss).__name__}")
    if not 0.0 <= z_loss < math.inf:
        raise ValueError(f"z_loss must be finite and >= 0, got {z_loss}")


def check_invariant(invariant: object) -> None:
    if not isinstance(invariant, bool):
        raise TypeError(f"invariant must be a bool, got {invariant!r}")


def label_stats(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``[4]`` int64 on the labels' device (`lmloss.agreement.LABEL_FIELDS`): min and max of the labels
    (ignored ones count as 0), how many are not ignored, and a fingerprint of the labels and their places
    (`lmloss.agreement.tensor_fingerprint`: non-linear, so a patterned change cannot cancel in it).

    Gathered with the TP ranks' metadata without a host sync before the collective: the range check and
    the check that every rank holds the same labels need nothing else.
    """
    if labels.numel() == 0:
        return torch.zeros(4, dtype=torch.int64, device=labels.device)
    valid = labels != ignore_index
    kept = torch.where(valid, labels, 0)
    return torch.stack([kept.min(), kept.max(), valid.sum(), tensor_fingerprint(labels)])


def check_label_range(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Every label is `ignore_index` or in ``[0, vocab_size)`` (one process).

    Eager on CPU: ValueError with an example. On CUDA, and inside a compiled region on any device, a
    device-side assert, so the check never synchronises the stream or breaks the graph.
    """
    bad = ((labels < 0) | (labels >= vocab_size)) & (labels != ignore_index)
    if labels.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(bad.any()):
            example = int(labels[bad][0])
            raise ValueError(
                f"labels must be in [0, {vocab_size}) or ignore_index={ignore_index}; found {example}"
            )
    else:
        torch._assert_async(~bad.any(), "lmloss: a label is outside [0, vocab_size) and not ignore_index")


def byproducts(**flags: object) -> tuple[str, ...]:
    """The by-products asked by the ops' ``return_<name>`` options (`lmloss.objectives.BYPRODUCTS`), each a bool."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"return_{name} must be a bool, got {value!r}")
    return tuple(name for name, value in flags.items() if value)
