"""Run a function on N gloo ranks (spawned processes) and collect what each rank returns.

Each process-group start costs seconds on a small machine, so a test should put several checks into
one spawned run: create sub-groups with `dist.new_group` inside the function (every rank must call it).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lmloss.distributed import free_port


def _entry(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # The rank's result is on disk and its group destroyed: leave without interpreter finalization. A
    # collective issued under a Python TorchDispatchMode (lmloss.profiling's live-tensor tracker, as in
    # test_profiler_ranks) makes PyTorch take references to the process group that are never released, so
    # destroy_process_group cannot free it and gloo's worker threads outlive it; tearing the interpreter down
    # beside those threads ended the process with SIGABRT ("terminate called without an active exception")
    # now and then. A failing rank still exits through torch's spawn wrapper, which reports its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on `world_size` gloo ranks; return each rank's result.

    `fn` must be a module-level function; its result is passed back with `torch.save`.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(fn, world_size, free_port(), out_dir, args), nprocs=world_size, join=True)
        return [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)
        ]
