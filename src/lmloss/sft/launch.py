"""Starting a run: one process, `--nproc N` local processes, or one rank of a torchrun launch."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lmloss.sft.config import SFTConfig
from lmloss.sft.parallel import (
    Mesh,
    launched_by_torchrun,
    pick_device,
    resolve_device,
    run_distributed,
    spawn,
)
from lmloss.sft.trainer import PreparedData, Trainer, prepare_data


def train(
    device: torch.device, cfg: SFTConfig, prepared: PreparedData | None = None
) -> dict[str, Any] | None:
    """Run the training on this process (the default group, if any, is initialised); the summary on rank 0."""
    if dist.is_initialized():
        mesh = Mesh.build(cfg.dp, cfg.cp, cfg.tp)
    else:
        if cfg.world_size != 1:
            raise ValueError(f"dp*cp*tp = {cfg.world_size} needs that many processes; this is one")
        mesh = Mesh()
    torch.manual_seed(cfg.seed)
    return Trainer(cfg, mesh, device, prepared).fit()


def run(cfg: SFTConfig) -> dict[str, Any]:
    """Train as configured and return the summary (also in ``<out>/summary.json``).

    The data and tokenizer are checked here first, so a bad dataset fails before any process starts.
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
        summary = run_distributed(train, device, cfg, prepare_data(cfg))
        return summary or {}
    nproc = cfg.nproc if cfg.nproc is not None else cfg.world_size
    device = _device_for(cfg, nproc, announce=True)  # before the data: a bad --device fails at once
    prepared = prepare_data(cfg)
    if nproc == 1:
        return train(pick_device(device), cfg, prepared) or {}
    summary_file = Path(cfg.out) / "summary.json"
    summary_file.unlink(missing_ok=True)
    spawn(nproc, device, train, cfg)
    return json.loads(summary_file.read_text())


def _device_for(cfg: SFTConfig, procs_per_node: int, *, announce: bool) -> str:
    """``cfg.device`` resolved for this node's process count; the reason printed when auto falls back to CPU."""
    device, note = resolve_device(cfg.device, procs_per_node)
    if note and announce:
        print(note, flush=True)
    return device
