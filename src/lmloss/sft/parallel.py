"""The DP x CP x TP layout of the processes, its process groups, and the few collectives the trainer adds.

Rank layout (TP innermost, like Megatron): ``rank = ranks[(dp_rank * cp + cp_rank) * tp + tp_rank]``.

Groups each rank holds (None where that dimension has size 1, so single-process code has no collectives):

* ``tp_group``: same (dp, cp): the ranks sharing one token slice; the LM head is vocab-sharded over it.
* ``cp_group``: same (dp, tp): the ranks sharing one packed micro-batch; attention gathers K/V over it.
* ``dp_cp_group``: same tp: the ranks holding different tokens of the global batch; gradients and token
  counts are summed over it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from lmloss.distributed import free_port
from lmloss.vocab_parallel import all_reduce_sum_

ProcessGroup = dist.ProcessGroup


@dataclasses.dataclass
class Mesh:
    """This rank's coordinates and groups. `world` is the group of all ranks of the run."""

    dp: int = 1
    cp: int = 1
    tp: int = 1
    dp_rank: int = 0
    cp_rank: int = 0
    tp_rank: int = 0
    rank: int = 0  # index within the run (0 .. dp*cp*tp - 1)
    world: ProcessGroup | None = None
    tp_group: ProcessGroup | None = None
    cp_group: ProcessGroup | None = None
    dp_cp_group: ProcessGroup | None = None
    tp_src: int = 0  # global rank of tp_rank 0 in this rank's TP group (the one that loads batches)

    @property
    def coords(self) -> dict[str, int]:
        return {"pp": 0, "dp": self.dp_rank, "cp": self.cp_rank, "tp": self.tp_rank}

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def build(cls, dp: int, cp: int, tp: int, ranks: Sequence[int] | None = None) -> Mesh | None:
        """Create the groups of a dp x cp x tp layout over `ranks` (default: the whole default group).

        Every process of the default group must call this (torch requires all of them to take part in
        creating every group); those not in `ranks` get None.
        """
        world_size = dist.get_world_size()
        ranks = list(range(world_size)) if ranks is None else list(ranks)
        if dp * cp * tp != len(ranks):
            raise ValueError(
                f"dp*cp*tp = {dp}*{cp}*{tp} = {dp * cp * tp} does not match the {len(ranks)} processes "
                "launched; launch dp*cp*tp processes (torchrun --nproc-per-node, or --nproc)"
            )

        def at(d: int, c: int, t: int) -> int:
            return ranks[(d * cp + c) * tp + t]

        me = dist.get_rank()
        mesh = None
        if me in ranks:
            i = ranks.index(me)
            mesh = cls(
                dp=dp, cp=cp, tp=tp, dp_rank=i // (cp * tp), cp_rank=(i // tp) % cp, tp_rank=i % tp, rank=i
            )
        world = dist.new_group(ranks)
        tp_groups = {(d, c): [at(d, c, t) for t in range(tp)] for d in range(dp) for c in range(cp)}
        cp_groups = {(d, t): [at(d, c, t) for c in range(cp)] for d in range(dp) for t in range(tp)}
        dpcp_groups = {t: [at(d, c, t) for d in range(dp) for c in range(cp)] for t in range(tp)}
        made = {}
        for name, groups in (("tp", tp_groups), ("cp", cp_groups), ("dp_cp", dpcp_groups)):
            for members in groups.values():
                group = dist.new_group(members)  # every process calls new_group, in the same order
                if mesh is not None and me in members:
                    made[name] = (group, members)
        if mesh is None:
            return None
        mesh.world = world
        mesh.tp_group = made["tp"][0] if tp > 1 else None
        mesh.cp_group = made["cp"][0] if cp > 1 else None
        mesh.dp_cp_group = made["dp_cp"][0] if dp * cp > 1 else None
        mesh.tp_src = made["tp"][1][0]
        return mesh


def all_reduce_grads_(params: Iterable[torch.nn.Parameter], group: ProcessGroup | None) -> None:
    """SUM the gradients over `group` in one flat buffer (one collective).

    SUM, not average: each rank's loss is already divided by the global count of target tokens.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def grad_norm(
    replicated: Iterable[torch.nn.Parameter],
    sharded: Iterable[torch.nn.Parameter],
    tp_group: ProcessGroup | None,
) -> float:
    """Global L2 norm of the gradients: replicated parameters counted once, TP shards summed over `tp_group`."""
    rep = [p.grad.detach() for p in replicated if p.grad is not None]
    shard = [p.grad.detach() for p in sharded if p.grad is not None]
    device = (rep + shard)[0].device

    def squares(grads: list[torch.Tensor]) -> torch.Tensor:
        return sum(
            (g.double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64, device=device)
        )

    return float((squares(rep) + all_reduce_sum_(squares(shard), tp_group)).sqrt())


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward SUMs the gradient over the TP group (each rank's covers one vocab shard)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum_(grad.contiguous().clone(), ctx.group), None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Mark `x` as replicated over TP ranks that each use it against their own vocab shard (naive head)."""
    return x if group is None else _CopyToTP.apply(x, group)


# --------------------------------------------------------------------------------------------- launching


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str, procs_per_node: int) -> tuple[str, str | None]:
    """``"auto" | "cpu" | "cuda"`` -> ``("cpu" | "cuda", note)`` for `procs_per_node` local processes.

    CUDA (NCCL) needs one GPU per local process: ``auto`` takes CUDA only when there are at least as many
    GPUs as local processes, and otherwise CPU (gloo), with a one-line `note` saying why. An explicit
    ``cuda`` without enough GPUs is a ValueError naming ``--device`` and ``--nproc``.
    """
    if name not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "cpu":
        return "cpu", None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= procs_per_node:
        return "cuda", None
    if name == "cuda":
        if gpus == 0:
            raise ValueError("--device cuda: CUDA is not available here; use --device cpu (or auto)")
        raise ValueError(
            f"--device cuda needs one GPU per process: {procs_per_node} processes on this node "
            f"(--nproc, or dp*cp*tp) but {gpus} CUDA device(s); use --device cpu (gloo), or "
            f"--nproc {gpus} or fewer with a smaller dp*cp*tp"
        )
    if gpus == 0:
        return "cpu", None
    return "cpu", (
        f"lmloss sft: device auto: {procs_per_node} processes on this node but {gpus} CUDA device(s), "
        "so the run is on CPU with gloo (--device cuda needs one GPU per process)"
    )


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """This process's device for a resolved name (`resolve_device`); ``cuda`` takes GPU `local_rank`."""
    if name == "auto":
        name, _ = resolve_device(name, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if name == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(name)


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


class RankError(ValueError):
    """A spawned rank stopped on a user error (bad config, data, checkpoint); the message is that error's."""


#: How `spawn` starts the ranks: a fresh interpreter each, which is safe with CUDA (a forked child cannot use
#: CUDA once the parent has initialised it). Tests on CPU set "fork" to skip the imports.
START_METHOD = "spawn"

#: Exit status of a spawned rank that stopped on Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130


def _leave(status: int) -> None:
    """End a spawned rank now: flush what it printed, then exit without interpreter finalization.

    Finalization is skipped because it can abort the process: a collective issued under a Python
    TorchDispatchMode (the CPU memory profiler's live-tensor tracker, `memory_profile`) makes PyTorch keep
    references to the process group, so destroy_process_group cannot free it and gloo's worker threads
    outlive it; tearing the interpreter down beside them ended a rank with SIGABRT now and then.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, RuntimeError, ValueError):  # interrupted mid-write: lost
            stream.flush()
    os._exit(status)


def _leave_quietly(*_) -> None:
    """SIGINT in a spawned rank: flush what it printed (its last step lines) and exit, no traceback."""
    _leave(INTERRUPTED)


def _spawned_worker(
    local_rank: int, nproc: int, port: int, device_name: str, errors, fn: Callable, args: tuple
) -> None:
    # Ctrl-C on a terminal reaches every process of its group: the ranks leave quietly and the parent
    # reports it once. (Also the signal the rank gets when the parent dies, see torch's spawn.)
    signal.signal(signal.SIGINT, _leave_quietly)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      WORLD_SIZE=str(nproc), LOCAL_RANK=str(local_rank))  # fmt: skip
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    try:
        run_distributed(fn, device_name, *args)
    except (ValueError, FileNotFoundError) as err:  # the user's to fix: one line in the parent, no traceback
        errors.put((local_rank, str(err)))
        sys.exit(2)
    _leave(0)  # done, group destroyed (see `_leave` for why not a normal exit)


def run_distributed(fn: Callable, device_name: str, *args):
    """In a torchrun-style process (RANK, WORLD_SIZE, MASTER_* set): init, call ``fn(device, *args)``, clean up."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(device_name, local_rank)
    dist.init_process_group(backend_for(device), rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))  # fmt: skip
    try:
        return fn(device, *args)
    finally:
        dist.destroy_process_group()


def spawn(nproc: int, device_name: str, fn: Callable, *args) -> None:
    """Start `nproc` local processes, each running ``fn(device, *args)`` under an initialised default group.

    A ValueError or FileNotFoundError in a rank (the user's to fix) is raised here as one `RankError` with
    that rank's message (the lowest rank's, if several), instead of torch's traceback of every rank. Ctrl-C
    stops every rank and raises KeyboardInterrupt here. Anything else keeps torch's report.
    """
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

    errors = mp.get_context(START_METHOD).SimpleQueue()
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")  # "Terminating process ..." per rank
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)
    try:
        context = mp.start_processes(_spawned_worker, args=(nproc, free_port(), device_name, errors, fn, args),
                                     nprocs=nproc, start_method=START_METHOD, join=False)  # fmt: skip
        try:
            while not context.join():
                pass
        except KeyboardInterrupt:
            _stop(context)
            raise
        except ProcessException as err:
            _stop(context)
            reported = []
            while not errors.empty():
                reported.append(errors.get())
            if reported:
                raise RankError(min(reported)[1]) from None
            if isinstance(err, ProcessExitedException) and err.exit_code in (INTERRUPTED, -signal.SIGINT):
                raise KeyboardInterrupt from None
            raise
    finally:
        spawn_log.setLevel(level)


def _stop(context) -> None:
    """Terminate the ranks still running and reap them (after Ctrl-C or one rank's failure)."""
    for process in context.processes:
        if process.is_alive():
            process.terminate()
    for process in context.processes:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
            process.join()
