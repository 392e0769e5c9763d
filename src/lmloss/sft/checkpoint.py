"""Checkpoints: model, optimizer, step and data position, one file per TP shard, each with its checksum.

Layout of ``<out>/checkpoints/step_<N>/``:

* ``tp<t>.pt``, written by the rank with dp = cp = 0 of each TP rank (the body is replicated, the LM head
  and its optimizer state are that rank's vocabulary shard), atomically (a temporary file, then a rename);
* ``manifest.json``, written last by the main rank once every shard is on disk: each shard's size and
  sha256, the run's identity (`RUN_FIELDS` as resolved: the data's and tokenizer's sha256 instead of
  paths), the step, tp, the run's target ``steps`` and the sha256 of ``metrics.jsonl`` up to this step.

``<out>/checkpoints/latest`` names the newest step directory (for people and scripts). Resuming does not
trust it: `find` verifies checkpoints newest first and takes the first intact one. Intact: a manifest
whose step is the directory's ``N``, listing exactly the shards ``tp0.pt`` .. ``tp<tp-1>.pt`` that are on
disk, each of its size and checksum and recording the manifest's step and tp. A save cut short (no manifest
yet), a truncated shard, a flipped byte, a renamed or swapped step directory or a shard missing from the
manifest is skipped, with one line naming it and why; if none is intact the run stops with one line.
Resuming needs the same tp (the shards are not re-split); dp and cp may change.

Shards are read with ``torch.load(weights_only=True)``: they hold only tensors and plain Python values
(dicts, lists, tuples, numbers, strings, None), which its unpickler allows without an allow-list, and it
refuses anything else, so a shard cannot run code when it is read. A shard that holds anything else was
not written by lmloss (its checksum matches a manifest written for it): resuming stops and names it
rather than falling back past it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
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


class UnsafeShardError(CheckpointError):
    """A shard holds objects other than tensors and plain Python values: it was not read."""


def read_shard(file: str | Path, *, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """A shard's contents, unpickled with ``weights_only=True`` (no code can run while it is read).

    `mmap`: map the tensors' storage instead of reading it (to look at the step and tp only).
    Raises UnsafeShardError (one line, naming what the file asked to load) for anything but tensors and
    plain Python values, CheckpointError when the file is not a shard at all.
    """
    file = Path(file)
    try:
        blob = torch.load(file, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        what = f" ({found.group(1)})" if found else ""
        raise UnsafeShardError(
            f"{file} holds objects other than tensors and plain Python values{what}, which lmloss never "
            "saves: it was not loaded (loading it could run code). Nothing was resumed; check where this "
            "checkpoint came from"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{file} cannot be read as a checkpoint shard: {first}") from None
    if not isinstance(blob, dict):
        raise CheckpointError(
            f"{file} is not a checkpoint shard (it holds a {type(blob).__name__}, not a dict)"
        )
    return blob


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


def _shard_index(name: str) -> int:
    return int(name[2:-3]) if re.fullmatch(r"tp\d+\.pt", name) else -1


def _listed(names: list[str]) -> str:
    return ", ".join(sorted(names, key=_shard_index))


def verify(path: str | Path) -> str | None:
    """None if the checkpoint at `path` is intact, else why not (a short phrase).

    Raises UnsafeShardError when a shard that matches its checksum holds anything but tensors and plain
    Python values (someone wrote it and its manifest: not a damaged checkpoint to skip quietly).
    """
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST}: its save did not finish"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"its {MANIFEST} is damaged"
    if (
        not isinstance(manifest, dict)
        or not isinstance(manifest.get("tp"), int)
        or not isinstance(manifest.get("step"), int)
        or manifest["tp"] < 1
    ):
        return f"its {MANIFEST} is damaged"
    tp, step = manifest["tp"], manifest["step"]
    named = re.fullmatch(r"step_(\d+)", path.name)
    if named and int(named.group(1)) != step:
        return f"its {MANIFEST} records step {step}, not {named.group(1)}: a renamed or swapped directory"
    shards = manifest.get("shards")
    if not isinstance(shards, dict) or not all(
        isinstance(w, dict) and isinstance(w.get("bytes"), int) and isinstance(w.get("sha256"), str)
        for w in shards.values()
    ):
        return f"its {MANIFEST} is damaged"
    expected = [f"tp{t}.pt" for t in range(tp)]
    if unlisted := [n for n in expected if n not in shards]:
        return f"its {MANIFEST} (tp={tp}) does not list {_listed(unlisted)}"
    if foreign := [n for n in shards if n not in expected]:
        return f"its {MANIFEST} (tp={tp}) lists {_listed(foreign)}, which tp={tp} does not write"
    if extra := [p.name for p in path.glob("tp*.pt") if p.name not in shards]:
        return f"{_listed(extra)} is on disk but not in its {MANIFEST} (tp={tp})"
    for name in expected:
        want = shards[name]
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != want["bytes"]:
            return f"{name} is truncated ({size} of {want['bytes']} bytes)" if size < want["bytes"] else (
                f"{name} has {size} bytes, not {want['bytes']}")  # fmt: skip
        if file_sha256(file) != want["sha256"]:
            return f"{name} fails its sha256 check"
    for name in expected:  # the checksums match: what each shard says it is (its tensors are not read)
        try:
            blob = read_shard(path / name, mmap=True)
        except UnsafeShardError:
            raise
        except CheckpointError:
            return f"{name} cannot be read"
        if blob.get("step") != step or blob.get("tp") != tp:
            return (f"{name} records step {blob.get('step')} with tp={blob.get('tp')}, its {MANIFEST} step "
                    f"{step} with tp={tp}")  # fmt: skip
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
    blob = read_shard(point.path / f"tp{mesh.tp_rank}.pt", map_location=device)
    if blob.get("step") != point.step or blob.get("tp") != mesh.tp:
        raise CheckpointError(f"checkpoint {point.path}: tp{mesh.tp_rank}.pt records step {blob.get('step')} with "
                              f"tp={blob.get('tp')}, its manifest step {point.step} with tp={mesh.tp}")  # fmt: skip
    try:
        model.load_state_dict(blob.pop("model"))
        optimizer.load_state_dict(blob.pop("optimizer"))
    except (RuntimeError, ValueError) as err:  # another architecture: say so in one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"checkpoint {point.path} does not fit this model: {first}") from None
    return blob
