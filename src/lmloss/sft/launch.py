"""Starting a run: one process, `--nproc N` local processes, or one rank of a torchrun launch."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lmloss.sft.checkpoint import ResumePoint
from lmloss.sft.config import SFTConfig
from lmloss.sft.parallel import (
    Mesh,
    launched_by_torchrun,
    pick_device,
    resolve_device,
    run_distributed,
    spawn,
)
from lmloss.sft.trainer import PreparedData, Trainer, prepare_data, prepare_resume

#: What a run writes into --out: the only names --overwrite deletes (besides hidden ``.*.tmp`` files).
RUN_OUTPUTS = frozenset(
    {
        "metrics.jsonl",
        "loss.png",
        "summary.json",
        "tokenizer.json",
        "tokenizer.meta.json",
        "checkpoints",
        "memory",
    }
)


def prepare_out(cfg: SFTConfig) -> None:
    """Make sure a run never mixes with an earlier one's files in ``cfg.out``.

    A fresh run needs an absent or empty directory; ``--overwrite`` first deletes an earlier run's outputs
    (and refuses when the directory holds anything else, so a mistyped --out deletes nothing of the
    user's); ``--resume`` continues the run there. ValueError (one line) otherwise.
    """
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory")
    if cfg.resume is not None or not out.is_dir():
        return
    entries = sorted(out.iterdir())
    if not entries:
        return
    names = [e.name for e in entries]
    foreign = [n for n in names if n not in RUN_OUTPUTS and not re.fullmatch(r"\..+\.tmp", n)]
    if not cfg.overwrite:
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        if len(foreign) == len(names):
            raise ValueError(f"--out {out} is not empty ({shown}): pass a new or empty directory")
        raise ValueError(
            f"--out {out} already holds a run ({shown}): pass --resume latest to continue it, --overwrite to "
            "delete it and start afresh, or another --out"
        )
    if foreign:
        raise ValueError(
            f"--overwrite: {out} also holds {', '.join(foreign[:4])}, which lmloss sft does not write; nothing "
            "was deleted (remove them, or pick another --out)"
        )
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    print(f"lmloss sft: --overwrite: deleted the earlier run in {out} ({', '.join(names)})", flush=True)


def train(
    device: torch.device, cfg: SFTConfig, prepared: PreparedData | None = None,
    resume_point: ResumePoint | None = None,
) -> dict[str, Any] | None:  # fmt: skip
    """Run the training on this process (the default group, if any, is initialised); the summary on rank 0.

    `cfg` and `resume_point` as `prepare_resume` resolved them (done here when ``cfg.resume`` is set and
    `resume_point` is not given).
    """
    if dist.is_initialized():
        mesh = Mesh.build(cfg.dp, cfg.cp, cfg.tp)
    else:
        if cfg.world_size != 1:
            raise ValueError(f"dp*cp*tp = {cfg.world_size} needs that many processes; this is one")
        mesh = Mesh()
    torch.manual_seed(cfg.seed)
    return Trainer(cfg, mesh, device, prepared, resume_point).fit()


def run(cfg: SFTConfig) -> dict[str, Any]:
    """Train as configured and return the summary (also in ``<out>/summary.json``).

    The output directory, the data, the tokenizer and the checkpoint to resume are checked here first, so
    a bad dataset or an unusable checkpoint fails before any process starts.
    """
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != cfg.world_size:
            raise ValueError(
                f"dp*cp*tp = {cfg.dp}*{cfg.cp}*{cfg.tp} = {cfg.world_size} does not match the world size {world} "
                "of this torchrun launch"
            )
        device = _device_for(
            cfg, int(os.environ.get("LOCAL_WORLD_SIZE", world)), announce=os.environ["RANK"] == "0"
        )
        return run_distributed(_torchrun_rank, device, cfg) or {}
    nproc = cfg.nproc if cfg.nproc is not None else cfg.world_size
    device = _device_for(cfg, nproc, announce=True)  # before the data: a bad --device fails at once
    prepare_out(cfg)
    prepared = prepare_data(cfg)
    cfg, point = prepare_resume(cfg, prepared)
    if nproc == 1:
        return train(pick_device(device), cfg, prepared, point) or {}
    summary_file = Path(cfg.out) / "summary.json"
    summary_file.unlink(missing_ok=True)
    spawn(nproc, device, train, cfg, None, point)
    return json.loads(summary_file.read_text())


def _torchrun_rank(device: torch.device, cfg: SFTConfig) -> dict[str, Any] | None:
    """One torchrun rank: rank 0 checks --out, prepares the data and resolves the resume, then every rank
    gets its verdict (the same one-line error on all, or the resolved config) before training."""
    verdict: list[Any] = [None, None, None]  # error, cfg, resume point
    prepared = None
    if dist.get_rank() == 0:
        try:
            prepare_out(cfg)
            prepared = prepare_data(cfg)
            verdict[1:] = prepare_resume(cfg, prepared)
        except (ValueError, FileNotFoundError) as err:
            verdict[0] = str(err)
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise ValueError(verdict[0])
    if prepared is None:
        prepared = prepare_data(cfg)  # the tokenizer rank 0 trained is cached in --out by now
    return train(device, verdict[1], prepared, verdict[2])


def _device_for(cfg: SFTConfig, procs_per_node: int, *, announce: bool) -> str:
    """``cfg.device`` resolved for this node's process count; the reason printed when auto falls back to CPU."""
    device, note = resolve_device(cfg.device, procs_per_node)
    if note and announce:
        print(note, flush=True)
    return device
