"""Argument checks shared by every op: one place for each error message."""

from __future__ import annotations

import torch

REDUCTIONS = ("mean", "sum", "none")


def check_floating(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be floating point (fp32, bf16 or fp16), got {t.dtype}")
    return t


def check_labels(labels: object, expected_shape: torch.Size, *, against: str) -> torch.Tensor:
    """`labels` must be an integer tensor shaped like `against`'s leading dimensions."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor (int64 global vocabulary ids), got {labels.dtype}")
    if labels.shape != expected_shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match {against} leading shape {tuple(expected_shape)}"
        )
    return labels


def check_chunk_size(chunk_size: object, *, allow_auto: bool = False) -> None:
    if chunk_size is None or (allow_auto and chunk_size == "auto"):
        return
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        allowed = "a positive int, None" + (' or "auto"' if allow_auto else "")
        raise TypeError(f"chunk_size must be {allowed}, got {chunk_size!r}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive (or None for unchunked), got {chunk_size}")


def check_temperature(temperature: float) -> None:
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    if not 0 < temperature < float("inf"):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")


def check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_label_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")


def check_z_loss(z_loss: float) -> None:
    if not z_loss >= 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")


def check_label_range(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Every label is `ignore_index` or in ``[0, vocab_size)``.

    On CPU this raises ValueError with an example; on CUDA it is a device-side assert, so the check
    never synchronises the stream.
    """
    bad = ((labels < 0) | (labels >= vocab_size)) & (labels != ignore_index)
    if labels.device.type == "cpu":
        if bool(bad.any()):
            example = int(labels[bad][0])
            raise ValueError(
                f"labels must be in [0, {vocab_size}) or ignore_index={ignore_index}; found {example}"
            )
    else:
        torch._assert_async(~bad.any(), "lmloss: a label is outside [0, vocab_size) and not ignore_index")
