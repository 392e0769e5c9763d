"""Checkpoints: model, optimizer, step and data position, one file per TP shard.

Layout: ``<out>/checkpoints/step_<N>/tp<t>.pt`` written by the rank with dp = cp = 0 of each TP rank (the
body is replicated, the LM head and its optimizer state are that rank's vocabulary shard), and
``<out>/checkpoints/latest`` holding the newest step directory's name, written last so a crash mid-save
never points at a half-written checkpoint. Resuming needs the same tp (the shards are not re-split);
dp and cp may change.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lmloss.sft.parallel import Mesh


def checkpoint_dir(out: str | Path, step: int) -> Path:
    return Path(out) / "checkpoints" / f"step_{step}"


def save(
    out: str | Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh: Mesh,
    state: dict[str, Any],
) -> Path:
    """Write the checkpoint after `step` completed steps; every rank of the run must call it (one barrier)."""
    path = checkpoint_dir(out, step)
    if mesh.dp_rank == 0 and mesh.cp_rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        blob = {
            "step": step,
            "tp": mesh.tp,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            **state,
        }
        tmp = path / f".tp{mesh.tp_rank}.pt.tmp"
        torch.save(blob, tmp)
        os.replace(tmp, path / f"tp{mesh.tp_rank}.pt")
    if mesh.world is not None:
        dist.barrier(group=mesh.world)  # every shard is on disk before `latest` moves
    if mesh.is_main:
        latest = Path(out) / "checkpoints" / "latest"
        latest.with_suffix(".tmp").write_text(path.name)
        os.replace(latest.with_suffix(".tmp"), latest)
    return path


def resolve(out: str | Path, resume: str) -> Path:
    """``"latest"`` -> the newest checkpoint under `out`; anything else is a checkpoint directory."""
    if resume == "latest":
        latest = Path(out) / "checkpoints" / "latest"
        if not latest.is_file():
            raise FileNotFoundError(f"--resume latest: no checkpoint under {Path(out) / 'checkpoints'}")
        return latest.parent / latest.read_text().strip()
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint directory")
    return path


def load(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh: Mesh,
    device: torch.device,
) -> dict[str, Any]:
    """Restore model and optimizer in place; return the rest of the saved state (step, data position, ...)."""
    file = Path(path) / f"tp{mesh.tp_rank}.pt"
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint {path} has no {file.name} (was it written with tp={mesh.tp}?)")
    blob = torch.load(file, map_location=device, weights_only=False)
    if blob["tp"] != mesh.tp:
        raise ValueError(f"checkpoint {path} was written with tp={blob['tp']}; resume with the same --tp")
    model.load_state_dict(blob.pop("model"))
    optimizer.load_state_dict(blob.pop("optimizer"))
    return blob
