"""Checkpoints: model, optimizer, step and data position, one file per TP shard, each with its checksum.

Layout of ``<out>/checkpoints/step_<N>/``:

* ``tp<t>.pt``, written by the rank with dp = cp = 0 of each TP rank (the body is replicated, the LM head
  and its optimizer state are that rank's vocabulary shard), atomically (a temporary file, then a rename);
* ``manifest.json``, written last by the main rank once every shard is on disk: each shard's size and
  sha256, the run's identity (`RUN_FIELDS` as resolved: the data's and tokenizer's sha256 instead of
  paths), the step, tp, the run's target ``steps`` and the sha256 of ``metrics.jsonl`` up to this step.

``<out>/checkpoints/latest`` names the newest step directory (for people and scripts). Resuming does not
trust it: `find` verifies checkpoints newest first (manifest present, every shard present, of its size
and checksum) and takes the first intact one. A save cut short (no manifest yet), a truncated shard or a
flipped byte is skipped, with one line saying so; if none is intact the run stops with one line. Resuming
needs the same tp (the shards are not re-split); dp and cp may change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lmloss.sft.parallel import Mesh

MANIFEST = "manifest.json"
FORMAT = 1


class CheckpointError(ValueError):
    """No checkpoint can be resumed (the message says which and why)."""


def checkpoint_dir(out: str | Path, step: int) -> Path:
    return Path(out) / "checkpoints" / f"step_{step}"


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def save(
    out: str | Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh: Mesh,
    state: dict[str, Any],
    manifest: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint after `step` completed steps; every rank of the run must call it.

    `manifest` (main rank): what to record beside the shards' checksums (run identity, metrics checksum).
    One all-gather of the shards' checksums over the run's ranks, then the main rank writes the manifest
    and moves ``latest``: until then the directory is not a checkpoint.
    """
    path = checkpoint_dir(out, step)
    mine = None
    if mesh.dp_rank == 0 and mesh.cp_rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        blob = {"step": step, "tp": mesh.tp, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                **state}  # fmt: skip
        name = f"tp{mesh.tp_rank}.pt"
        tmp = path / f".{name}.tmp"
        torch.save(blob, tmp)
        mine = (name, {"bytes": tmp.stat().st_size, "sha256": file_sha256(tmp)})
        os.replace(tmp, path / name)
    shards = [mine]
    if mesh.world is not None:  # also the barrier: every shard is on disk before the manifest
        shards = [None] * dist.get_world_size(mesh.world)
        dist.all_gather_object(shards, mine, group=mesh.world)
    if mesh.is_main:
        record = {"format": FORMAT, "step": step, "tp": mesh.tp, **(manifest or {}),
                  "shards": dict(sorted(s for s in shards if s is not None))}  # fmt: skip
        tmp = path / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path / MANIFEST)
        latest = Path(out) / "checkpoints" / "latest"
        latest.with_suffix(".tmp").write_text(path.name)
        os.replace(latest.with_suffix(".tmp"), latest)
    return path


@dataclasses.dataclass
class ResumePoint:
    """A verified checkpoint: its directory, step and manifest; `note` says which newer ones were skipped."""

    path: Path
    step: int
    manifest: dict[str, Any]
    note: str | None = None


def verify(path: str | Path) -> str | None:
    """None if the checkpoint at `path` is intact, else why not (a short phrase)."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST}: its save did not finish"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"its {MANIFEST} is damaged"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("tp"), int):
        return f"its {MANIFEST} is damaged"
    shards = manifest.get("shards")
    expected = sorted(f"tp{t}.pt" for t in range(manifest["tp"]))
    if (
        not isinstance(shards, dict)
        or sorted(shards) != expected
        or not all(
            isinstance(w, dict) and isinstance(w.get("bytes"), int) and isinstance(w.get("sha256"), str)
            for w in shards.values()
        )
    ):
        return f"its {MANIFEST} is damaged"
    for name, want in shards.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != want["bytes"]:
            return f"{name} is truncated ({size} of {want['bytes']} bytes)" if size < want["bytes"] else (
                f"{name} has {size} bytes, not {want['bytes']}")  # fmt: skip
        if file_sha256(file) != want["sha256"]:
            return f"{name} fails its sha256 check"
    return None


def step_dirs(root: Path) -> list[Path]:
    """``step_<N>`` directories under `root`, newest (largest N) first."""
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if (m := re.fullmatch(r"step_(\d+)", p.name))]
    return [p for _, p in sorted(found, key=lambda x: x[0], reverse=True) if p.is_dir()]


def find(out: str | Path, resume: str) -> ResumePoint:
    """The checkpoint to resume: ``"latest"`` -> the newest intact one under `out`, else the directory given.

    Raises FileNotFoundError when there is none, CheckpointError when none is intact (or the one named is
    not), each in one line.
    """
    if resume == "latest":
        root = Path(out) / "checkpoints"
        candidates = step_dirs(root)
        if not candidates:
            raise FileNotFoundError(f"--resume latest: no checkpoint under {root}")
        skipped = []
        for path in candidates:
            reason = verify(path)
            if reason is None:
                note = None
                if skipped:
                    note = (f"checkpoint {'; '.join(skipped)}: not intact; resuming from {path.name}, "
                            "the newest intact one")  # fmt: skip
                return _point(path, note)
            skipped.append(f"{path.name} ({reason})")
        raise CheckpointError(
            f"--resume latest: no intact checkpoint under {root}: {'; '.join(skipped)}. Nothing was resumed"
        )
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint directory")
    reason = verify(path)
    if reason is not None:
        raise CheckpointError(
            f"--resume {resume}: the checkpoint is not intact ({reason}); nothing was resumed"
        )
    return _point(path, None)


def _point(path: Path, note: str | None) -> ResumePoint:
    manifest = json.loads((path / MANIFEST).read_text())
    return ResumePoint(path=path, step=int(manifest["step"]), manifest=manifest, note=note)


def load(
    point: ResumePoint,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh: Mesh,
    device: torch.device,
) -> dict[str, Any]:
    """Restore model and optimizer in place; return the rest of the saved state (step, data position, ...)."""
    if point.manifest["tp"] != mesh.tp:
        raise CheckpointError(f"checkpoint {point.path} was written with tp={point.manifest['tp']}; resume with "
                              f"--tp {point.manifest['tp']} (the LM-head shards are not re-split)")  # fmt: skip
    blob = torch.load(point.path / f"tp{mesh.tp_rank}.pt", map_location=device, weights_only=False)
    try:
        model.load_state_dict(blob.pop("model"))
        optimizer.load_state_dict(blob.pop("optimizer"))
    except (RuntimeError, ValueError) as err:  # another architecture: say so in one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"checkpoint {point.path} does not fit this model: {first}") from None
    return blob
