"""Run a function on N gloo ranks and collect what each rank returns, with a deadline.

Every run has a deadline for the whole run and a timeout on every collective of its process group, so a
regression that makes ranks wait for each other fails its test in bounded time (gloo's default timeout is 30
minutes; a TP=8 run once hung for 600 s) and says which ranks were still running, or which rank raised what.

The ranks are forked from the test process where that is safe (CPU only, no process group alive here): they
inherit its imports, so a run starts in a tenth of a second where spawned ranks spend seconds each importing
torch and lmloss on a 2-core machine. Where CUDA is available (a backward starts autograd's device threads,
which a forked child cannot use) or a process group is alive here, they are spawned. Each rank uses one
intra-op thread, set first (a forked child must not enter the parent's OpenMP pool). A run's function may still
create sub-groups with `dist.new_group` (every rank must call it) to host several configurations in one run.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lmloss.distributed import free_port

#: The whole run's deadline, start-up included (the heaviest run takes ~10 s on 2 idle cores).
RUN_DEADLINE_S = 180.0
#: Every collective's timeout in the run's default group (a sub-group passes its own to `dist.new_group`).
COLLECTIVE_TIMEOUT_S = 60.0


def start_method() -> str:
    """``"fork"`` where a forked rank is safe and cheap, else ``"spawn"`` (see the module docstring)."""
    return "spawn" if dist.is_available() and dist.is_initialized() or torch.cuda.is_available() else "fork"


def _entry(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple, timeout_s: float) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    code = 0
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:  # noqa: BLE001 - the test process reports it, with the traceback
        code = 1
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        dist.destroy_process_group()
    # The rank's result is on disk and its group destroyed: leave without interpreter finalization (nor, when
    # forked, the test process's exit handlers). A collective issued under a Python TorchDispatchMode
    # (lmloss.profiling's live-tensor tracker, as in test_profiler_ranks) makes PyTorch take references to the
    # process group that are never released, so destroy_process_group cannot free it and gloo's worker threads
    # outlive it; tearing the interpreter down beside those threads ended the process with SIGABRT
    # ("terminate called without an active exception") now and then.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    deadline_s: float = RUN_DEADLINE_S,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on `world_size` gloo ranks; return each rank's result.

    `fn` must be a module-level function; its result is passed back with `torch.save`. Fails (an
    `AssertionError`) when the run passes `deadline_s` (the ranks still running are killed and named) or a rank
    raised (its traceback is shown); `timeout_s` bounds each collective of the default group.
    """
    ctx = mp.get_context(start_method())
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = [
            ctx.Process(target=_entry, args=(r, fn, world_size, port, out_dir, args, timeout_s))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + deadline_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = {}
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.err")
            if os.path.exists(path):
                with open(path) as f:
                    errors[r] = f.read()
        assert not hung, f"ranks {hung} of {world_size} still running after {deadline_s:g} s (a collective hangs)"
        assert not errors, "\n".join(f"rank {r} raised:\n{tb}" for r, tb in errors.items())
        codes = [p.exitcode for p in procs]
        assert codes == [0] * world_size, f"a rank died (exit codes {codes})"
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
